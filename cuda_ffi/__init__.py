"""`impl="cuda"`: our FlashMLA-style sparse MLA kernels behind XLA FFI custom calls.

The kernels live in a plain C-ABI shared library, `cuda_ffi/lib/libdsv41_cuda.so`, built by an
explicit step, `python -m cuda_ffi.build` (nvcc + cmake; sm_90a and sm_100a). Set
`DSV41_CUDA_LIB=/path/to/libdsv41_cuda.so` to use another build. Without the library this
package imports fine and registers nothing but an availability probe that says why.

Importing never touches a GPU. When the library file exists, the "cuda" decode and prefill
implementations are registered with `dsv41_jax.attention` (so CPU tests can trace and lower
them for the CUDA platform); the library itself is loaded with ctypes, and its FFI targets
registered with `jax.ffi.register_ffi_target(..., platform="CUDA")`, on first use.
`impl="auto"` picks "cuda" only when `backend_unavailable_reason()` is None: the library loads,
`jax.default_backend() == "gpu"` and the first device has compute capability 9.x or 10.x.

Kernel design, numerics, padding and limits: `cuda_ffi/kernels.cuh`, `cuda_ffi/_ops.py` and
`benchmarks/cuda_notes.md`. Cache formats read: "bf16" and "fp8_ds_mla" (`supports` turns the
others away, so `impl="auto"` falls back to another implementation for them).
"""

from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path

from cuda_ffi import _ops
from cuda_ffi._ops import DECODE_TARGET, PLAN_TARGET, PREFILL_TARGET, decode_supports, prefill_supports

__all__ = [
    "library_path",
    "library_present",
    "load_library",
    "ensure_registered",
    "backend_unavailable_reason",
    "decode",
    "prefill",
    "decode_supports",
    "prefill_supports",
    "DECODE_TARGET",
    "PLAN_TARGET",
    "PREFILL_TARGET",
    "EXPORTED_SYMBOLS",
    "refresh",
]

ABI_VERSION = 3
EXPORTED_SYMBOLS = {DECODE_TARGET: "Dsv41SparseMlaDecode", PLAN_TARGET: "Dsv41PlanDecodeSplits",
                    PREFILL_TARGET: "Dsv41SparseMlaPrefill"}
_DEFAULT_LIB = Path(__file__).resolve().parent / "lib" / "libdsv41_cuda.so"

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_load_error: str | None = None
_registered = False


def library_path() -> Path:
    """`$DSV41_CUDA_LIB` if set, else cuda_ffi/lib/libdsv41_cuda.so."""
    env = os.environ.get("DSV41_CUDA_LIB")
    return Path(env) if env else _DEFAULT_LIB


def library_present() -> bool:
    return library_path().is_file()


def load_library() -> ctypes.CDLL:
    """Load the library once (ctypes; no GPU work: the CUDA runtime inside is static and lazy)."""
    global _lib, _load_error
    with _lock:
        if _lib is not None:
            return _lib
        path = library_path()
        if not path.is_file():
            _load_error = f"cuda_ffi: {path} not found; build it with `python -m cuda_ffi.build` or set DSV41_CUDA_LIB"
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


def backend_unavailable_reason() -> str | None:
    """None when the cuda kernels can run on the default device, else the reason."""
    if not library_present():
        return f"cuda_ffi: {library_path()} not built (run `python -m cuda_ffi.build`)"
    try:
        load_library()
    except RuntimeError as e:
        return str(e)
    import jax

    backend = jax.default_backend()
    if backend != "gpu":
        return f"cuda_ffi: the default JAX backend is {backend!r}, not 'gpu'"
    dev = jax.devices()[0]
    cc = str(getattr(dev, "compute_capability", "") or "")
    try:
        major = int(cc.split(".")[0])
    except ValueError:
        return f"cuda_ffi: cannot read the compute capability of {dev} ({cc!r})"
    if major not in (9, 10):
        return f"cuda_ffi: kernels are built for sm_90a / sm_100a; the device has compute capability {cc}"
    return None


def decode(call):
    """The registered decode implementation (see `cuda_ffi._ops.decode`)."""
    return _ops.decode(call)


def prefill(call):
    """The registered prefill implementation (see `cuda_ffi._ops.prefill`)."""
    return _ops.prefill(call)


def refresh() -> bool:
    """(Re-)register the "cuda" implementations if the library file exists now (e.g. right after
    `cuda_ffi.build.build_library()` in the same process). Returns whether it exists."""
    from dsv41_jax.attention import register_decode_impl, register_prefill_impl
    from dsv41_jax.backends import register_impl_availability

    register_impl_availability("cuda", backend_unavailable_reason)
    if library_present():
        register_decode_impl("cuda", decode, supports=decode_supports)
        register_prefill_impl("cuda", prefill, supports=prefill_supports)
        return True
    return False


refresh()
