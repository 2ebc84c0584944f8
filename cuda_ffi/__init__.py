"""`impl="cuda"`: our FlashMLA-style sparse MLA kernels behind XLA FFI custom calls.

The kernels live in a plain C-ABI shared library, `libdsv41_cuda.so` (nvcc + cmake; sm_90a and
sm_100a), found at, in order: `$DSV41_CUDA_LIB`; `cuda_ffi/lib/`, where the explicit step
`python -m cuda_ffi.build` puts it; the first-use build's cache (`cuda_ffi.build.build_cached`,
`$DSV41_CUDA_CACHE`). The first-use build runs when the availability probe finds no library while a
GPU of compute capability 9.x / 10.x is the default device and nvcc and cmake are here (minutes, once
per source version, logged on the `dsv41_jax` logger; `DSV41_CUDA_AUTOBUILD=0` turns it off); on such a
GPU a library that cannot be had (nvcc or cmake missing, the build off or failed) is logged once at
WARNING, whichever implementation then runs. Without the library this package imports fine and
`unavailable_reason` says what is missing and what to do (`python -m dsv41_jax.info` prints it).

Importing never touches a GPU. This package is the "cuda" row of the core's implementation table
(`dsv41_jax.sparse_mla.implementations`, which imports it on first use): `decode`, `prefill`, their
`*_supports` predicates, `installed` and `unavailable_reason`. When the library file exists, "cuda"
is installed (so CPU tests can trace and lower it for the CUDA platform); the library itself is loaded
with ctypes, and its FFI targets registered with `jax.ffi.register_ffi_target(..., platform="CUDA")`,
on first use. `impl="auto"` picks "cuda" only when `backend_unavailable_reason()` is None: the library loads,
`jax.default_backend() == "gpu"`, the first device has compute capability 9.x or 10.x and the
library holds its architecture (build_info.json's archs, when the build wrote one).

Kernel design, numerics, padding and limits: `cuda_ffi/csrc/kernels.cuh` (the sources, one header
per role), `cuda_ffi/ops.py` and `docs/cuda_kernels.md`. Cache formats read: "bf16" and "fp8_ds_mla"
(`supports` turns the others away, so `impl="auto"` falls back to another implementation for them).
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import threading
from pathlib import Path

from cuda_ffi import build
from cuda_ffi import ops as _ops
from cuda_ffi.ops import (DECODE_TARGET, MEGA_DECODE_TARGET, MEGA_PREFILL_TARGET, PLAN_TARGET, PREFILL_TARGET,
                          decode_supports, mega_decode_supports, mega_prefill_supports, prefill_supports)

__all__ = [
    "library_path",
    "library_present",
    "build_info",
    "load_library",
    "ensure_registered",
    "backend_unavailable_reason",
    "decode",
    "mega_decode",
    "prefill",
    "mega_prefill",
    "decode_supports",
    "mega_decode_supports",
    "prefill_supports",
    "mega_prefill_supports",
    "DECODE_TARGET",
    "MEGA_DECODE_TARGET",
    "MEGA_PREFILL_TARGET",
    "PLAN_TARGET",
    "PREFILL_TARGET",
    "EXPORTED_SYMBOLS",
    "installed",
    "unavailable_reason",
    "refresh",
]

ABI_VERSION = 5
EXPORTED_SYMBOLS = {DECODE_TARGET: "Dsv41SparseMlaDecode", MEGA_DECODE_TARGET: "Dsv41SparseMlaMegaDecode",
                    PLAN_TARGET: "Dsv41PlanDecodeSplits", PREFILL_TARGET: "Dsv41SparseMlaPrefill",
                    MEGA_PREFILL_TARGET: "Dsv41SparseMlaMegaPrefill"}
_DEFAULT_LIB = Path(__file__).resolve().parent / "lib" / build.LIB_NAME
AUTOBUILD_ENV = "DSV41_CUDA_AUTOBUILD"
_log = logging.getLogger("dsv41_jax.cuda_ffi")

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_load_error: str | None = None
_registered = False
_build_error: str | None = None  # a failed first-use build is reported, not retried, in this process
# Reasons already logged: on a GPU the kernels' absence is said once per process and cause, whichever
# implementation then runs.
_WARNED: set[str] = set()


def library_path() -> Path:
    """`$DSV41_CUDA_LIB` if set; else cuda_ffi/lib/libdsv41_cuda.so when `python -m cuda_ffi.build` made
    it; else the first-use build's library in the cache (`cuda_ffi.build.cached_library_path()`), built
    or not."""
    env = os.environ.get(build.LIB_ENV)
    if env:
        return Path(env)
    if _DEFAULT_LIB.is_file():
        return _DEFAULT_LIB
    return build.cached_library_path()


def library_present() -> bool:
    return library_path().is_file()


def build_info() -> dict | None:
    """The library's build_info.json (archs, nvcc release, git commit, build time, source key; written by
    `cuda_ffi.build`), or None when it is absent or unreadable (a library built without one)."""
    try:
        return json.loads((library_path().parent / build.INFO_NAME).read_text())
    except (OSError, ValueError):
        return None


def load_library() -> ctypes.CDLL:
    """Load the library once (ctypes; no GPU work: the CUDA runtime inside is static and lazy)."""
    global _lib, _load_error
    with _lock:
        if _lib is not None:
            return _lib
        path = library_path()
        if not path.is_file():
            _load_error = f"cuda_ffi: {path} not found; build it with `python -m cuda_ffi.build` or set {build.LIB_ENV}"
            raise RuntimeError(_load_error)
        try:
            lib = ctypes.CDLL(str(path))
            lib.dsv41_cuda_abi_version.restype = ctypes.c_int
            abi = lib.dsv41_cuda_abi_version()
            for sym in EXPORTED_SYMBOLS.values():
                getattr(lib, sym)
        except (OSError, AttributeError) as e:
            _load_error = f"cuda_ffi: cannot load {path}: {e}"
            raise RuntimeError(_load_error) from None
        if abi != ABI_VERSION:
            _load_error = f"cuda_ffi: {path} has ABI version {abi}, this package needs {ABI_VERSION}; rebuild it"
            raise RuntimeError(_load_error)
        _lib = lib
        _load_error = None
        return lib


def ensure_registered() -> None:
    """Load the library and register its FFI targets for the CUDA platform (once)."""
    global _registered
    lib = load_library()
    with _lock:
        if _registered:
            return
        import jax

        for target, sym in EXPORTED_SYMBOLS.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, sym)), platform="CUDA")
        _registered = True


def _autobuild_off() -> bool:
    return os.environ.get(AUTOBUILD_ENV, "1") == "0"


def _missing_reason() -> str:
    """Why there is no library, and what to do."""
    env = os.environ.get(build.LIB_ENV)
    if env:
        return f"cuda_ffi: {build.LIB_ENV}={env} does not exist"
    where = f"{_DEFAULT_LIB} and {build.cached_library_path()} do not exist"
    if build.missing_tools():
        return f"cuda_ffi: the CUDA library is not built ({where}) and cannot be built here: {build.build_hint()}"
    first = f"off: {AUTOBUILD_ENV}=0" if _autobuild_off() else "on: the first call on a GPU builds it"
    return f"cuda_ffi: the CUDA library is not built ({where}); {build.build_hint()} (first-use build {first})"


def _device_reason() -> str | None:
    """None when the default device is a GPU the kernels are written for (compute capability 9.x / 10.x)."""
    from dsv41_jax.device import gpu_unsupported_reason
    from dsv41_jax.sparse_mla.capabilities import CUDA_SPARSE_DSV41

    why = gpu_unsupported_reason(CUDA_SPARSE_DSV41.compute_capability_majors)
    return None if why is None else f"cuda_ffi: the kernels are written for sm_90a / sm_100a: {why}"


def _arch_reason() -> str | None:
    """None when the library holds the default device's architecture (or does not say which it holds)."""
    archs = (build_info() or {}).get("archs") or []
    try:
        majors = {int(a.rstrip("af")) // 10 for a in archs}
    except ValueError:
        return None
    from dsv41_jax.device import DeviceInfo

    cc = DeviceInfo.default().compute_capability
    if majors and cc is not None and cc[0] not in majors:
        return (f"cuda_ffi: {library_path()} holds sm_{', sm_'.join(archs)}, not this device's compute capability "
                f"{cc[0]}.{cc[1]}; rebuild it with `python -m cuda_ffi.build`")
    return None


def _build_on_first_use() -> str | None:
    """Build the library into the cache now; None on success, else why not."""
    global _build_error
    if os.environ.get(build.LIB_ENV) or _autobuild_off() or build.missing_tools():
        why = _missing_reason()
        if why not in _WARNED:
            _WARNED.add(why)
            _log.warning("%s", why)
        return why
    if _build_error is None:
        try:
            build.build_cached()
        except (build.BuildError, OSError) as e:
            _build_error = (f"cuda_ffi: the first-use build into {build.cached_library_path().parent} failed "
                            f"(`python -m cuda_ffi.build -v` shows the whole log): {e}")
            _log.warning("%s", _build_error)
        else:
            refresh()
            return None
    return _build_error


def backend_unavailable_reason(*, build_missing: bool = True) -> str | None:
    """None when the cuda kernels can run on the default device, else the reason, with what to do.

    On a GPU of compute capability 9.x / 10.x without a library, `build_missing` builds one now (the
    first-use build, see the module docstring); the reason says when nvcc or cmake are missing, the
    build is off or failed. `python -m dsv41_jax.info` asks with build_missing=False."""
    device = _device_reason()
    if not library_present():
        if device is not None:
            return f"{_missing_reason()}; {device}"
        why = _build_on_first_use() if build_missing else _missing_reason()
        if why is not None:
            return why
    try:
        load_library()
    except RuntimeError as e:
        return str(e)
    return device or _arch_reason()


def decode(call):
    """The decode implementation (see `cuda_ffi.ops.decode`)."""
    return _ops.decode(call)


def mega_decode(call):
    """The mega decode implementation (see `cuda_ffi.ops.mega_decode`)."""
    return _ops.mega_decode(call)


def prefill(call):
    """The prefill implementation (see `cuda_ffi.ops.prefill`)."""
    return _ops.prefill(call)


def mega_prefill(call):
    """The mega prefill implementation (see `cuda_ffi.ops.mega_prefill`)."""
    return _ops.mega_prefill(call)


def installed() -> bool:
    """Whether impl="cuda" can be traced here: the library file exists (`library_present`); whether it can
    run on the default device is `unavailable_reason`. Read by the core's implementation table
    (`dsv41_jax.sparse_mla.implementations`) on every dispatch."""
    return library_present()


def unavailable_reason() -> str | None:
    """The implementation table's availability probe: `backend_unavailable_reason()` (which may run the
    first-use build)."""
    return backend_unavailable_reason()


def refresh() -> bool:
    """Whether the library file exists now (e.g. right after `cuda_ffi.build.build_library()` in the same
    process). The core asks `installed()` on every dispatch, so a library built in this process is used
    without anything to re-register."""
    return library_present()
