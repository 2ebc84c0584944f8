"""Build the host emulator of the CUDA kernels: emu_main.cc with the product's sources (cuda_ffi/csrc/, or a
patched copy of them from `cuda_ffi.build.copy_sources`) on the include path, compiled by the host C++
compiler; no CUDA needed.

    python -m tests.cuda_emulator.build     # tests/cuda_emulator/lib/libdsv41_emu{,_mma_sync}.so
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from cuda_ffi.build import CSRC, SOURCE_GLOBS, BuildError, _run, find_cxx

HERE = Path(__file__).resolve().parent
LIB_DIR = HERE / "lib"
EMU_NAME = "libdsv41_emu.so"
# The consumer warps each emulator build runs: sm_90a's wgmma (default) or sm_100a's mma.sync.
CONSUMERS = ("wgmma", "mma_sync")
_OWN_SOURCES = ("emu_main.cc", "emu_runtime.h")

__all__ = ["build_emulator", "emulator_name", "CONSUMERS", "LIB_DIR"]


def emulator_name(consumer: str) -> str:
    return EMU_NAME if consumer == "wgmma" else EMU_NAME.replace(".so", f"_{consumer}.so")


def _newest_source(src_dir: Path) -> float:
    paths = [HERE / f for f in _OWN_SOURCES] + [p for g in SOURCE_GLOBS for p in Path(src_dir).glob(g)]
    return max(p.stat().st_mtime for p in paths)


def build_emulator(*, out_dir: Path = LIB_DIR, opt: str = "-O2", force: bool = False, consumer: str = "wgmma",
                   src_dir: Path = CSRC) -> Path:
    """Compile the emulator of the kernels in `src_dir` with the C++ compiler; returns its path. `consumer`
    picks the consumer warps emulated: "wgmma" (sm_90a's, libdsv41_emu.so) or "mma_sync" (sm_100a's,
    libdsv41_emu_mma_sync.so). Skipped when the library is newer than all its sources (unless `force`).
    Builds of other sources (planted bugs) must go to an `out_dir` other than the default one."""
    if consumer not in CONSUMERS:
        raise ValueError(f"consumer must be one of {CONSUMERS}, got {consumer!r}")
    src_dir = Path(src_dir).resolve()
    if src_dir != CSRC and Path(out_dir).resolve() == LIB_DIR.resolve():
        raise ValueError("build_emulator: builds of other sources need an out_dir other than the default one")
    name = emulator_name(consumer)
    out = Path(out_dir) / name
    if not force and out.is_file() and out.stat().st_mtime > _newest_source(src_dir):
        return out
    cxx = find_cxx()
    if cxx is None:
        raise BuildError("no C++ compiler found (g++, c++, clang++ or $CXX)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(name + ".tmp")
    log: list[str] = []
    t0 = time.time()
    _run([cxx, "-std=c++17", opt, "-fPIC", "-shared", "-DDSV41_EMULATE", f"-DDSV41_WGMMA={int(consumer == 'wgmma')}",
          "-I", str(HERE), "-I", str(src_dir), str(HERE / "emu_main.cc"), "-o", str(tmp), "-lpthread"], log)
    os.replace(tmp, out)
    print(f"built {out} in {time.time() - t0:.1f} s")
    return out


def main() -> int:
    try:
        for consumer in CONSUMERS:
            build_emulator(consumer=consumer)
    except BuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
