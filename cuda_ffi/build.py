"""Build the dsv41 CUDA FFI library (and, for CPU tests, the host emulator of its kernels).

    python -m cuda_ffi.build            # cuda_ffi/lib/libdsv41_cuda.so (sm_90a + sm_100a)
    python -m cuda_ffi.build --emu      # also cuda_ffi/lib/libdsv41_emu.so (g++, no CUDA needed)
    python -m cuda_ffi.build --emu-only # only the emulator
    python -m cuda_ffi.build --archs 90a
    python -m cuda_ffi.build --force-mma-sync    # sm_90a with the mma.sync consumers (timing comparisons)

The CUDA build needs nvcc (PATH, $CUDACXX, $CUDA_HOME/bin or /usr/local/cuda/bin) and cmake
(PATH or the `cmake` pip package); it passes `jax.ffi.include_dir()` to CMake and links the CUDA
runtime statically, so the library loads on machines without a GPU. ptxas's resource report
(registers, shared memory, spills per kernel) is written to cuda_ffi/lib/ptxas_report.txt.
The built library is picked up by `import cuda_ffi`; set DSV41_CUDA_LIB=/path/to/lib.so to use
another one.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
LIB_DIR = HERE / "lib"
BUILD_DIR = HERE / "build"
LIB_NAME = "libdsv41_cuda.so"
EMU_NAME = "libdsv41_emu.so"
DEFAULT_ARCHS = "90a;100a"

__all__ = ["find_nvcc", "find_cmake", "find_cxx", "build_library", "build_emulator", "BuildError"]


class BuildError(RuntimeError):
    """A tool is missing or a build step failed (the message says which and why)."""


def find_nvcc() -> str | None:
    for env in ("CUDACXX", "NVCC"):
        p = os.environ.get(env)
        if p and Path(p).is_file():
            return p
    p = shutil.which("nvcc")
    if p:
        return p
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and (Path(root) / "bin" / "nvcc").is_file():
            return str(Path(root) / "bin" / "nvcc")
    return None


def find_cmake() -> str | None:
    p = shutil.which("cmake")
    if p:
        return p
    try:  # the `cmake` pip package
        import cmake  # type: ignore

        cand = Path(cmake.CMAKE_BIN_DIR) / "cmake"
        if cand.is_file():
            return str(cand)
    except Exception:
        pass
    return None


def find_cxx() -> str | None:
    p = os.environ.get("CXX")
    if p and shutil.which(p):
        return shutil.which(p)
    for name in ("g++", "c++", "clang++"):
        p = shutil.which(name)
        if p:
            return p
    return None


def _ffi_include_dir() -> str:
    import jax

    return str(jax.ffi.include_dir())


def _run(cmd: list[str], log: list[str], cwd: Path | None = None, env: dict | None = None) -> None:
    proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log.append("$ " + " ".join(cmd) + "\n" + proc.stdout)
    if proc.returncode != 0:
        raise BuildError(f"command failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout[-6000:]}")


def _ptxas_report(text: str) -> str:
    """The ptxas -v lines, one block per kernel and architecture, and ptxas's wgmma pipeline messages
    (C75xx: a compiler-inserted warpgroup wait or serialised wgmmas, i.e. tensor-core overlap lost)."""
    keep = []
    for line in text.splitlines():
        if "ptxas info" in line and ("Compiling entry" in line or "Used" in line or "Function properties" in line
                                     or "(C75" in line):
            keep.append(line.split("ptxas info    : ")[-1].strip())
        elif re.search(r"bytes stack frame", line):
            keep.append("    " + line.strip())
    return "\n".join(keep) + "\n"


CONSUMERS = ("wgmma", "mma_sync")


def build_library(*, archs: str = DEFAULT_ARCHS, jobs: int | None = None, out_dir: Path = LIB_DIR,
                  build_dir: Path = BUILD_DIR, verbose: bool = False, force_mma_sync: bool = False,
                  defines: tuple[str, ...] = ()) -> Path:
    """Configure and build libdsv41_cuda.so with CMake; returns its path. sm_90a gets the wgmma
    consumers unless `force_mma_sync` (timing comparisons); sm_100a always the mma.sync ones.
    `defines`: extra preprocessor definitions (NAME or NAME=VALUE) for experiments, e.g. the
    DSV41_EXP_* switches of kernels.cuh that leave one stage out to time the others."""
    nvcc = find_nvcc()
    if nvcc is None:
        raise BuildError("nvcc not found (looked at $CUDACXX, $NVCC, PATH, $CUDA_HOME/bin, /usr/local/cuda/bin)")
    cmake = find_cmake()
    if cmake is None:
        raise BuildError("cmake not found (PATH or `pip install cmake`)")
    out_dir.mkdir(parents=True, exist_ok=True)
    build_dir.mkdir(parents=True, exist_ok=True)
    log: list[str] = []
    t0 = time.time()
    _run([cmake, "-S", str(HERE), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release",
          f"-DCMAKE_CUDA_COMPILER={nvcc}", f"-DXLA_FFI_INCLUDE_DIR={_ffi_include_dir()}",
          f"-DDSV41_CUDA_ARCHS={archs}", f"-DDSV41_OUTPUT_DIR={out_dir}",
          f"-DDSV41_FORCE_MMA_SYNC={'ON' if force_mma_sync else 'OFF'}",
          f"-DDSV41_EXTRA_DEFINES={';'.join(defines)}"], log)
    _run([cmake, "--build", str(build_dir), "--parallel", str(jobs or max(os.cpu_count() or 1, 1))], log)
    lib = out_dir / LIB_NAME
    if not lib.is_file():
        raise BuildError(f"build finished but {lib} is missing")
    text = "\n".join(log)
    (out_dir / "build.log").write_text(text)
    report = _ptxas_report(text)
    if report.strip():  # an up-to-date (no-op) build compiles nothing: keep the last report
        (out_dir / "ptxas_report.txt").write_text(report)
    if verbose:
        print(text)
    print(f"built {lib} in {time.time() - t0:.1f} s (archs {archs}{', mma.sync forced' if force_mma_sync else ''})")
    return lib


EMU_SOURCES = ("emu_main.cc", "emu_runtime.h", "kernels.cuh", "seesaw.cuh", "prims.cuh", "params.h", "host_params.h")


def build_emulator(*, out_dir: Path = LIB_DIR, opt: str = "-O2", force: bool = False,
                   consumer: str = "wgmma", defines: tuple[str, ...] = ()) -> Path:
    """Compile the host emulator of the kernels (emu_main.cc) with the C++ compiler; returns its path.
    `consumer` picks the consumer warps emulated: "wgmma" (sm_90a's, libdsv41_emu.so) or
    "mma_sync" (sm_100a's, libdsv41_emu_mma_sync.so). Skipped when the library is newer than all
    its sources (unless `force`). `defines`: extra preprocessor definitions (the emulator tests'
    planted bugs); such builds must go to an `out_dir` other than cuda_ffi/lib."""
    if consumer not in CONSUMERS:
        raise ValueError(f"consumer must be one of {CONSUMERS}, got {consumer!r}")
    if defines and Path(out_dir).resolve() == LIB_DIR.resolve():
        raise ValueError("build_emulator: builds with `defines` need an out_dir other than cuda_ffi/lib")
    name = EMU_NAME if consumer == "wgmma" else EMU_NAME.replace(".so", f"_{consumer}.so")
    out = out_dir / name
    if not force and out.is_file():
        newest = max((HERE / f).stat().st_mtime for f in EMU_SOURCES)
        if out.stat().st_mtime > newest:
            return out
    cxx = find_cxx()
    if cxx is None:
        raise BuildError("no C++ compiler found (g++, c++, clang++ or $CXX)")
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / (name + ".tmp")
    log: list[str] = []
    t0 = time.time()
    _run([cxx, "-std=c++17", opt, "-fPIC", "-shared", "-DDSV41_EMULATE", f"-DDSV41_WGMMA={int(consumer == 'wgmma')}",
          *[f"-D{d}" for d in defines], "-I", str(HERE), str(HERE / "emu_main.cc"),
          "-o", str(tmp), "-lpthread"], log)
    os.replace(tmp, out)
    print(f"built {out} in {time.time() - t0:.1f} s")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cuda_ffi.build", description=__doc__.split("\n\n")[0])
    ap.add_argument("--archs", default=DEFAULT_ARCHS, help="semicolon-separated CUDA archs (default 90a;100a)")
    ap.add_argument("--jobs", type=int, default=None)
    ap.add_argument("--force-mma-sync", action="store_true",
                    help="sm_90a: build the mma.sync consumers instead of wgmma (timing comparisons)")
    ap.add_argument("--define", action="append", default=[], metavar="NAME[=VALUE]",
                    help="extra preprocessor definition (experiments, e.g. DSV41_EXP_NO_GATHER); repeatable")
    ap.add_argument("--out-dir", type=Path, default=LIB_DIR, help="where the library goes (default cuda_ffi/lib)")
    ap.add_argument("--build-dir", type=Path, default=BUILD_DIR, help="CMake build directory (default cuda_ffi/build)")
    ap.add_argument("--emu", action="store_true", help="also build the host emulator (CPU tests)")
    ap.add_argument("--emu-only", action="store_true", help="build only the host emulator")
    ap.add_argument("--clean", action="store_true", help="remove the CMake build directory first")
    ap.add_argument("-v", "--verbose", action="store_true")
    a = ap.parse_args(argv)
    if a.define and a.out_dir.resolve() == LIB_DIR.resolve():
        # experiment builds (DSV41_EXP_* leave stages out) must never replace the library the package loads
        ap.error("--define needs --out-dir other than cuda_ffi/lib (experiment builds are not the package's library)")
    try:
        if a.clean and a.build_dir.exists():
            shutil.rmtree(a.build_dir)
        if not a.emu_only:
            build_library(archs=a.archs, jobs=a.jobs, verbose=a.verbose, force_mma_sync=a.force_mma_sync,
                          defines=tuple(a.define), out_dir=a.out_dir, build_dir=a.build_dir)
            print((a.out_dir / "ptxas_report.txt").read_text())
        if a.emu or a.emu_only:
            for consumer in CONSUMERS:
                build_emulator(consumer=consumer)
    except BuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
