"""Build the dsv41 CUDA FFI library from the sources in cuda_ffi/csrc/.

    python -m cuda_ffi.build            # cuda_ffi/lib/libdsv41_cuda.so (sm_90a + sm_100a)
    python -m cuda_ffi.build --archs 90a
    python -m cuda_ffi.build --force-mma-sync    # sm_90a with the mma.sync consumers (timing comparisons)

The CUDA build needs nvcc (PATH, $CUDACXX, $CUDA_HOME/bin or /usr/local/cuda/bin) and cmake
(PATH or the `cmake` pip package); it passes `jax.ffi.include_dir()` to CMake and links the CUDA
runtime statically, so the library loads on machines without a GPU. ptxas's resource report
(registers, shared memory, spills per kernel) is written to cuda_ffi/lib/ptxas_report.txt.
The built library is picked up by `import cuda_ffi`; set DSV41_CUDA_LIB=/path/to/lib.so to use
another one. Every build writes build_info.json beside the library (archs, nvcc release, git commit,
time, source key), read by `cuda_ffi.build_info()` and `python -m dsv41_jax.info`. `copy_sources`
and `build_library(src_dir=...)` build a patched copy of the sources (the benchmarks' ablations);
the host emulator of the CPU tests lives in tests/cuda_emulator/.

Without an explicit build, `build_cached` is the first-use build: `cuda_ffi` calls it when a GPU of
compute capability 9.x / 10.x is the default device and no library exists, and builds into
`$DSV41_CUDA_CACHE` (default `~/.cache/dsv41_jax/cuda`) under a key of the sources, the archs and
the jax version, so an edited source or another jax gets its own build and a built one is reused.
"""

from __future__ import annotations

import argparse
import datetime
import fcntl
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CSRC = HERE / "csrc"
LIB_DIR = HERE / "lib"
BUILD_DIR = HERE / "build"
LIB_NAME = "libdsv41_cuda.so"
INFO_NAME = "build_info.json"
DEFAULT_ARCHS = "90a;100a"
CACHE_ENV = "DSV41_CUDA_CACHE"
LIB_ENV = "DSV41_CUDA_LIB"  # a library to load instead of the built ones (cuda_ffi.library_path)
# the files in csrc/ the library is built from (package data, so an installed package can build itself)
SOURCE_GLOBS = ("CMakeLists.txt", "*.cu", "*.cuh", "*.h")
NVCC_LOOKED_AT = "$CUDACXX, $NVCC, PATH, $CUDA_HOME/bin, /usr/local/cuda/bin"

__all__ = ["find_nvcc", "find_cmake", "find_cxx", "build_library", "BuildError", "cache_root", "copy_sources",
           "source_key", "cached_library_path", "build_cached", "missing_tools", "build_hint", "INFO_NAME",
           "LIB_NAME", "LIB_ENV", "CACHE_ENV", "CSRC", "DEFAULT_ARCHS"]

_log = logging.getLogger("dsv41_jax.cuda_ffi")


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


def missing_tools() -> list[str]:
    """What the CUDA build lacks here, each with where it was looked for ([] when nvcc and cmake are found)."""
    out = []
    if find_nvcc() is None:
        out.append(f"nvcc not found (looked at {NVCC_LOOKED_AT})")
    if find_cmake() is None:
        out.append("cmake not found (PATH or the `cmake` pip package)")
    return out


def build_hint() -> str:
    """What to do to get the CUDA library on this machine."""
    missing = missing_tools()
    if not missing:
        return "nvcc and cmake are here: `python -m cuda_ffi.build` builds it"
    fixes = []
    if find_nvcc() is None:
        fixes.append("install the CUDA toolkit (nvcc; tested with CUDA 13.0) or set $CUDA_HOME")
    if find_cmake() is None:
        fixes.append("`pip install cmake` (part of `pip install \"dsv41-jax[cuda]\"`)")
    return "; ".join(missing) + ": " + " and ".join(fixes) + ", then `python -m cuda_ffi.build`"


def _ffi_include_dir() -> str:
    import jax

    return str(jax.ffi.include_dir())


def _run(cmd: list[str], log: list[str], cwd: Path | None = None, env: dict | None = None) -> None:
    proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log.append("$ " + " ".join(cmd) + "\n" + proc.stdout)
    if proc.returncode != 0:
        raise BuildError(f"command failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout[-6000:]}")


def _drop_foreign_cache(build_dir: Path, src_dir: Path) -> None:
    """Empty a build folder that cmake configured from another source folder (cmake refuses to reuse it)."""
    cache = build_dir / "CMakeCache.txt"
    if not cache.exists():
        return
    for line in cache.read_text(errors="replace").splitlines():
        if line.startswith("CMAKE_HOME_DIRECTORY:"):
            home = line.split("=", 1)[-1].strip()
            if Path(home).resolve() != Path(src_dir).resolve():
                shutil.rmtree(build_dir)
            return


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


def _tool_output(cmd: list[str]) -> str | None:
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def _build_info(*, archs: str, nvcc: str, force_mma_sync: bool, defines: tuple[str, ...], src_dir: Path) -> dict:
    """What build_info.json records: enough to say which kernels a library holds and where they came from."""
    import jax

    version = _tool_output([nvcc, "--version"]) or ""
    release = next((line for line in version.splitlines() if "release" in line), None)  # "..., release 13.0, V13.0.88"
    commit = _tool_output(["git", "-C", str(CSRC), "rev-parse", "HEAD"])
    dirty = _tool_output(["git", "-C", str(CSRC), "status", "--porcelain", "--untracked-files=no", "--", *SOURCE_GLOBS])
    return {
        "archs": archs.split(";"),
        "nvcc": release,
        "commit": commit,
        "sources_modified": (bool(dirty) or src_dir != CSRC) if commit else None,
        "source_key": source_key(archs, src_dir),
        "jax": jax.__version__,
        "force_mma_sync": force_mma_sync,
        "defines": list(defines),
        "built_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def build_library(*, archs: str = DEFAULT_ARCHS, jobs: int | None = None, out_dir: Path = LIB_DIR,
                  build_dir: Path = BUILD_DIR, verbose: bool = False, force_mma_sync: bool = False,
                  defines: tuple[str, ...] = (), quiet: bool = False, src_dir: Path = CSRC) -> Path:
    """Configure and build libdsv41_cuda.so with CMake; returns its path. sm_90a gets the wgmma
    consumers unless `force_mma_sync` (timing comparisons); sm_100a always the mma.sync ones.
    `defines`: extra preprocessor definitions (NAME or NAME=VALUE). `src_dir`: the sources (csrc/, or
    a patched copy from `copy_sources`). `quiet`: no "built ..." line on stdout (the first-use build
    logs instead)."""
    src_dir = Path(src_dir).resolve()
    nvcc = find_nvcc()
    if nvcc is None:
        raise BuildError(f"nvcc not found (looked at {NVCC_LOOKED_AT})")
    cmake = find_cmake()
    if cmake is None:
        raise BuildError("cmake not found (PATH or `pip install cmake`)")
    out_dir.mkdir(parents=True, exist_ok=True)
    _drop_foreign_cache(build_dir, src_dir)
    build_dir.mkdir(parents=True, exist_ok=True)
    log: list[str] = []
    t0 = time.time()
    _run([cmake, "-S", str(src_dir), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release",
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
    info = _build_info(archs=archs, nvcc=nvcc, force_mma_sync=force_mma_sync, defines=defines, src_dir=src_dir)
    (out_dir / INFO_NAME).write_text(json.dumps(info, indent=1) + "\n")
    report = _ptxas_report(text)
    if report.strip():  # an up-to-date (no-op) build compiles nothing: keep the last report
        (out_dir / "ptxas_report.txt").write_text(report)
    if verbose:
        print(text)
    if not quiet:
        print(f"built {lib} in {time.time() - t0:.1f} s (archs {archs}{', mma.sync forced' if force_mma_sync else ''})")
    return lib


def cache_root() -> Path:
    """Where first-use builds go: $DSV41_CUDA_CACHE, else $XDG_CACHE_HOME/dsv41_jax/cuda (~/.cache/...)."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dsv41_jax" / "cuda"


def source_key(archs: str = DEFAULT_ARCHS, src_dir: Path = CSRC) -> str:
    """16 hex digits of the library's sources (csrc/, or a patched copy), the archs and the jax version
    (whose FFI headers it compiles against). A patched copy is hashed again on every call: its folder
    may be rewritten between builds."""
    if Path(src_dir) == CSRC:
        return _package_source_key(archs)
    return _hash_sources(archs, Path(src_dir))


@functools.lru_cache(maxsize=None)
def _package_source_key(archs: str) -> str:
    return _hash_sources(archs, CSRC)


def _hash_sources(archs: str, src_dir: Path) -> str:
    import jax

    h = hashlib.sha256(f"{archs}\0{jax.__version__}\0".encode())
    for path in sorted({p for g in SOURCE_GLOBS for p in Path(src_dir).glob(g)}):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def cached_library_path(archs: str | None = None) -> Path:
    """The first-use build's library (built or not) for these sources; archs default to DEFAULT_ARCHS."""
    return cache_root() / source_key(archs or DEFAULT_ARCHS) / LIB_NAME


def build_cached(*, archs: str | None = None, jobs: int | None = None) -> Path:
    """Build the library into `cached_library_path(archs)` unless it is there; returns its path.

    A lock file serialises processes that start together (one builds, the others then find it), and
    the library is moved into place last, so a process that reads the cache without the lock never
    sees a half-written one. Progress goes to the `dsv41_jax` logger (WARNING: a build takes minutes)."""
    archs = archs or DEFAULT_ARCHS
    lib = cached_library_path(archs)
    if lib.is_file():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    with open(lib.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if lib.is_file():
            return lib
        stage, build_dir = lib.parent / "stage", lib.parent / "build"
        _log.warning("cuda_ffi: building the CUDA kernels (archs %s) into %s: once per source version, "
                     "a few minutes", archs, lib.parent)
        t0 = time.time()
        build_library(archs=archs, jobs=jobs, out_dir=stage, build_dir=build_dir, quiet=True)
        for name in ("build.log", "ptxas_report.txt", INFO_NAME, LIB_NAME):  # the library last
            if (stage / name).is_file():
                os.replace(stage / name, lib.parent / name)
        shutil.rmtree(stage, ignore_errors=True)
        shutil.rmtree(build_dir, ignore_errors=True)
        _log.warning("cuda_ffi: built %s in %.0f s", lib, time.time() - t0)
    return lib


def copy_sources(dst: Path, patches: tuple[tuple[str, str, str], ...] = ()) -> Path:
    """Copy the library's sources (csrc/) to `dst` and apply `patches`, each (file name, exact snippet,
    replacement); a snippet must occur exactly once in its file, so a patch that no longer matches the
    sources fails here instead of building something else. Returns `dst`."""
    dst = Path(dst)
    if dst.resolve() == CSRC:
        raise ValueError("copy_sources: dst must not be csrc/ itself")
    shutil.copytree(CSRC, dst, dirs_exist_ok=True)
    for name, old, new in patches:
        path = dst / name
        text = path.read_text()
        count = text.count(old)
        if count != 1:
            raise BuildError(f"copy_sources: {name} holds the patched snippet {count} times, not once:\n{old}")
        path.write_text(text.replace(old, new))
    return dst


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cuda_ffi.build", description=__doc__.split("\n\n")[0])
    ap.add_argument("--archs", default=DEFAULT_ARCHS, help="semicolon-separated CUDA archs (default 90a;100a)")
    ap.add_argument("--jobs", type=int, default=None)
    ap.add_argument("--force-mma-sync", action="store_true",
                    help="sm_90a: build the mma.sync consumers instead of wgmma (timing comparisons)")
    ap.add_argument("--define", action="append", default=[], metavar="NAME[=VALUE]",
                    help="extra preprocessor definition; repeatable")
    ap.add_argument("--out-dir", type=Path, default=LIB_DIR, help="where the library goes (default cuda_ffi/lib)")
    ap.add_argument("--build-dir", type=Path, default=BUILD_DIR, help="CMake build directory (default cuda_ffi/build)")
    ap.add_argument("--clean", action="store_true", help="remove the CMake build directory first")
    ap.add_argument("-v", "--verbose", action="store_true")
    a = ap.parse_args(argv)
    if a.define and a.out_dir.resolve() == LIB_DIR.resolve():
        # a build with other definitions must never replace the library the package loads
        ap.error("--define needs --out-dir other than cuda_ffi/lib (such builds are not the package's library)")
    try:
        if a.clean and a.build_dir.exists():
            shutil.rmtree(a.build_dir)
        build_library(archs=a.archs, jobs=a.jobs, verbose=a.verbose, force_mma_sync=a.force_mma_sync,
                      defines=tuple(a.define), out_dir=a.out_dir, build_dir=a.build_dir)
        print((a.out_dir / "ptxas_report.txt").read_text())
    except BuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
