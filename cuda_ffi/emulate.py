"""Run the CUDA kernels on the CPU through the host emulator (tests only).

`libdsv41_emu.so` (built by `python -m cuda_ffi.build --emu-only`) compiles kernels.cuh for the
host: every CUDA thread is a fiber, warp-collective instructions exchange their operands with
the PTX fragment semantics, named barriers count arrivals. `decode_emulated(call)` /
`prefill_emulated(call)` run the same JAX-side preparation as the GPU path (`_ops.prepare_*`:
head/topk padding, length clamping, split plan), the same argument checks as the FFI handlers
(host_params.h), then the kernels, and slice the results like the GPU path. Outputs start
poisoned (NaN), so an element the kernels never write fails any comparison.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from cuda_ffi import _ops

EMU_LIB = Path(__file__).resolve().parent / "lib" / "libdsv41_emu.so"

_DTYPES = {np.dtype(ml_dtypes.bfloat16): 1, np.dtype(np.uint8): 2, np.dtype(np.int32): 3, np.dtype(np.float32): 4}


class TensorView(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("dims", ctypes.c_int64 * 8), ("rank", ctypes.c_int32),
                ("dtype", ctypes.c_int32)]


def _view(a: np.ndarray) -> TensorView:
    assert a.flags.c_contiguous
    t = TensorView()
    t.data = a.ctypes.data if a.size else None
    t.rank = a.ndim
    for i, n in enumerate(a.shape):
        t.dims[i] = n
    t.dtype = _DTYPES.get(a.dtype, 0)
    return t


_lib = None


def load(path: Path | None = None) -> ctypes.CDLL:
    global _lib
    if _lib is None:
        lib = ctypes.CDLL(str(path or EMU_LIB))
        lib.dsv41_emu_decode.restype = ctypes.c_int
        lib.dsv41_emu_decode.argtypes = [
            ctypes.POINTER(TensorView), ctypes.POINTER(TensorView), ctypes.c_float, ctypes.c_int64, ctypes.c_int64,
            ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint64, ctypes.c_int, ctypes.c_char_p,
            ctypes.c_int]
        lib.dsv41_emu_prefill.restype = ctypes.c_int
        lib.dsv41_emu_prefill.argtypes = [
            ctypes.POINTER(TensorView), ctypes.POINTER(TensorView), ctypes.c_float, ctypes.c_uint64, ctypes.c_int,
            ctypes.c_char_p, ctypes.c_int]
        _lib = lib
    return _lib


def _np(x) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(x))


def _poisoned(sds) -> np.ndarray:
    a = np.empty(sds.shape, np.dtype(sds.dtype))
    a.fill(np.nan)
    return a


def _views(arrays):
    return (TensorView * len(arrays))(*[_view(a) for a in arrays])


def run_decode_ffi(args, attrs, results, *, seed: int = 1, workers: int = 0):
    """The FFI call's contract on host arrays: returns the 4 result arrays (out, lse, o_accum, lse_accum)."""
    lib = load()
    ins = [_np(a) for a in args]
    outs = [_poisoned(r) for r in results]
    err = ctypes.create_string_buffer(4096)
    rc = lib.dsv41_emu_decode(_views(ins), _views(outs), float(attrs["softmax_scale"]), int(attrs["kv_format"]),
                              int(attrs["block_size"]), int(attrs["has_extra"]), int(attrs["extra_kv_format"]),
                              int(attrs["extra_block_size"]), seed, workers, err, len(err))
    if rc:
        raise ValueError(err.value.decode())
    return outs


def run_prefill_ffi(args, attrs, results, *, seed: int = 1, workers: int = 0):
    lib = load()
    ins = [_np(a) for a in args]
    outs = [_poisoned(r) for r in results]
    err = ctypes.create_string_buffer(4096)
    rc = lib.dsv41_emu_prefill(_views(ins), _views(outs), float(attrs["softmax_scale"]), seed, workers, err, len(err))
    if rc:
        raise ValueError(err.value.decode())
    return outs


def decode_emulated(call, *, num_sms: int = 132, seed: int = 1, workers: int = 0):
    """(out, lse) of the CUDA decode path, computed by the emulator."""
    args, attrs, results, info = _ops.prepare_decode(call, num_sms=num_sms)
    out, lse, _, _ = run_decode_ffi(args, attrs, results, seed=seed, workers=workers)
    h = info["h_q"]
    return jnp.asarray(out[:, :, :h]), jnp.asarray(lse[:, :, :h])


def prefill_emulated(call, *, seed: int = 1, workers: int = 0):
    """(out, max_logits, lse) of the CUDA prefill path, computed by the emulator."""
    args, attrs, results, info = _ops.prepare_prefill(call)
    out, ml, lse = run_prefill_ffi(args, attrs, results, seed=seed, workers=workers)
    h = info["h_q"]
    return jnp.asarray(out[:, :h]), jnp.asarray(ml[:, :h]), jnp.asarray(lse[:, :h])
