"""Run the CUDA kernels on the CPU through the host emulator (tests only).

`libdsv41_emu.so` (built by `python -m tests.cuda_emulator.build`) compiles cuda_ffi/csrc/ for the
host with sm_90a's wgmma consumers, `libdsv41_emu_mma_sync.so` with sm_100a's mma.sync ones (pick
with `consumer=`): every CUDA thread is a fiber, warp-collective instructions exchange their operands with
the PTX fragment semantics, named barriers count arrivals. `decode_emulated(call)` /
`prefill_emulated(call)` (and the mega ops') run the same JAX-side preparation as the GPU path (`_ops.prepare_*`:
head/topk padding, empty operands for absent lengths and sinks), the same argument checks as the
FFI handlers (csrc/host_params.h), then the kernels (the split planner when the call brings no plan,
decode, combine), and slice the results like the GPU path. `plan_emulated` runs the planner kernel
alone. Outputs start poisoned (NaN), so an element the kernels never write fails any comparison.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from cuda_ffi import ops as _ops
from dsv41_jax.plans import DecodePlan
from dsv41_jax.scheduler import num_sm_parts_for
from tests.cuda_emulator.build import CONSUMERS, LIB_DIR, emulator_name

__all__ = ["EMU_LIB", "EMU_LIBS", "load", "run_decode_ffi", "run_mega_decode_ffi", "run_prefill_ffi",
           "run_mega_prefill_ffi", "plan_batch_emulated", "plan_emulated", "emulated_plan", "decode_emulated",
           "mega_decode_emulated", "prefill_emulated", "mega_prefill_emulated"]

EMU_LIBS = {c: LIB_DIR / emulator_name(c) for c in CONSUMERS}
EMU_LIB = EMU_LIBS["wgmma"]

_DTYPES = {np.dtype(ml_dtypes.bfloat16): 1, np.dtype(np.uint8): 2, np.dtype(np.int32): 3, np.dtype(np.float32): 4,
           np.dtype(np.float16): 5}


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


_libs: dict[str, ctypes.CDLL] = {}


def load(path: Path | None = None, consumer: str = "wgmma") -> ctypes.CDLL:
    """The emulator library of `consumer` ("wgmma" or "mma_sync"), loaded once."""
    if consumer not in EMU_LIBS:
        raise ValueError(f"consumer must be one of {sorted(EMU_LIBS)}, got {consumer!r}")
    if consumer not in _libs:
        lib = ctypes.CDLL(str(path or EMU_LIBS[consumer]))
        lib.dsv41_emu_decode.restype = ctypes.c_int
        lib.dsv41_emu_decode.argtypes = [
            ctypes.POINTER(TensorView), ctypes.POINTER(TensorView), ctypes.c_float, ctypes.c_int64, ctypes.c_int64,
            ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.POINTER(TensorView), ctypes.c_int64,
            ctypes.c_uint64, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
        lib.dsv41_emu_plan.restype = ctypes.c_int
        i64p = ctypes.POINTER(ctypes.c_int64)
        lib.dsv41_emu_plan.argtypes = [
            ctypes.POINTER(TensorView), ctypes.POINTER(TensorView), ctypes.POINTER(TensorView),
            ctypes.POINTER(TensorView), ctypes.c_int64, i64p, i64p, ctypes.c_int64, ctypes.c_int64,
            ctypes.c_uint64, ctypes.c_char_p, ctypes.c_int]
        lib.dsv41_emu_plan_smem_bytes.restype = ctypes.c_int
        lib.dsv41_emu_plan_smem_bytes.argtypes = lib.dsv41_emu_plan.argtypes[:-3] + [ctypes.c_char_p, ctypes.c_int]
        lib.dsv41_emu_prefill.restype = ctypes.c_int
        lib.dsv41_emu_prefill.argtypes = [
            ctypes.POINTER(TensorView), ctypes.POINTER(TensorView), ctypes.c_float, ctypes.POINTER(TensorView),
            ctypes.c_uint64, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
        _libs[consumer] = lib
    return _libs[consumer]


def _np(x) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(x))


def _poisoned(sds) -> np.ndarray:
    a = np.empty(sds.shape, np.dtype(sds.dtype))
    if np.issubdtype(a.dtype, np.floating) or a.dtype == ml_dtypes.bfloat16:
        a.fill(np.nan)
    elif a.dtype == np.uint8:
        a.fill(0x7F)  # an e4m3 NaN (the mega output), an exponent of 2^0
    else:
        a.fill(-0x55555556)
    return a


def _views(arrays):
    return (TensorView * len(arrays))(*[_view(a) for a in arrays])


def run_decode_ffi(args, attrs, results, *, seed: int = 1, workers: int = 0, consumer: str = "wgmma"):
    """The decode FFI call's contract on host arrays: returns the 4 result arrays (out, lse, o_accum,
    lse_accum)."""
    lib = load(consumer=consumer)
    ins = [_np(a) for a in args]
    outs = [_poisoned(r) for r in results]
    err = ctypes.create_string_buffer(4096)
    rc = lib.dsv41_emu_decode(_views(ins), _views(outs), float(attrs["softmax_scale"]), int(attrs["kv_format"]),
                              int(attrs["block_size"]), int(attrs["has_extra"]), int(attrs["extra_kv_format"]),
                              int(attrs["extra_block_size"]), None, 0, seed, workers, err, len(err))
    if rc:
        raise ValueError(err.value.decode())
    return outs


def run_mega_decode_ffi(args, attrs, results, *, seed: int = 1, workers: int = 0, consumer: str = "wgmma"):
    """The mega decode FFI call's contract on host arrays (`_ops.prepare_mega_decode`'s): returns the 5 result
    arrays (out bytes, out_scale, lse, o_accum, lse_accum)."""
    lib = load(consumer=consumer)
    ins = [_np(a) for a in args]
    outs = [_poisoned(r) for r in results]
    err = ctypes.create_string_buffer(4096)
    # the kernels' order: (out, lse, o_accum, lse_accum) and the mega views (positions, cos_sin, out_scale)
    dec_outs = [outs[0], outs[2], outs[3], outs[4]]
    mega = [ins[10], ins[11], outs[1]]
    rc = lib.dsv41_emu_decode(_views(ins[:10]), _views(dec_outs), float(attrs["softmax_scale"]),
                              int(attrs["kv_format"]), int(attrs["block_size"]), int(attrs["has_extra"]),
                              int(attrs["extra_kv_format"]), int(attrs["extra_block_size"]), _views(mega),
                              int(attrs["batch_invariant"]), seed, workers, err, len(err))
    if rc:
        raise ValueError(err.value.decode())
    return outs


def plan_batch_emulated(topk_length, extra_topk_length, *, batch: int, topk: int, extra_topk, has_extra,
                        num_sm_parts: int, fixed_overhead: int = 5, seed: int = 1, return_smem_bytes: bool = False):
    """The planner FFI call's contract on host arrays (`_ops.plan_on_device`'s operands): topk_length int32
    [batch] or [1], extra_topk_length int32 [n, batch] or [n, 1], per plan extra_topk / has_extra; returns
    `(metadata int32 [n, parts, 8], num_splits int32 [n, batch + 1])`, and with return_smem_bytes the shared
    memory its launch gets (> 0: the CTA planner, 0: the warp planner; host_params.h plan_smem_bytes)."""
    lib = load()
    tl = np.ascontiguousarray(np.asarray(topk_length, np.int32))
    etl = np.ascontiguousarray(np.asarray(extra_topk_length, np.int32))
    n, b = etl.shape[0], batch
    meta = np.full((n, num_sm_parts, 8), -0x55555556, np.int32)
    splits = np.full((n, b + 1), -0x55555556, np.int32)
    et = np.ascontiguousarray(np.asarray(extra_topk, np.int64))
    he = np.ascontiguousarray(np.asarray(has_extra, np.int64))
    i64p = ctypes.POINTER(ctypes.c_int64)
    err = ctypes.create_string_buffer(4096)
    views = [_view(a) for a in (tl, etl, meta, splits)]
    operands = ([ctypes.byref(v) for v in views]
                + [int(topk), et.ctypes.data_as(i64p), he.ctypes.data_as(i64p), len(et), int(fixed_overhead)])
    if return_smem_bytes:
        smem = lib.dsv41_emu_plan_smem_bytes(*operands, err, len(err))
        if smem < 0:
            raise ValueError(err.value.decode())
    rc = lib.dsv41_emu_plan(*operands, seed, err, len(err))
    if rc:
        raise ValueError(err.value.decode())
    return (meta, splits, smem) if return_smem_bytes else (meta, splits)


def plan_emulated(topk_length, *, topk: int, num_sm_parts: int, extra_topk_length=None, extra_topk: int = 0,
                  fixed_overhead: int = 5, seed: int = 1, return_smem_bytes: bool = False):
    """One plan of the device split planner (kernels.cuh plan_cta, or plan_warp where its table does not fit)
    run by the emulator: `(metadata int32[parts, 8], num_splits int32[b + 1])` (+ the launch's shared memory,
    as plan_batch_emulated). Lengths are clamped to [0, topk] / [0, extra_topk] like the kernel does; an
    extra cache iff extra_topk_length is given."""
    tl = np.asarray(topk_length, np.int32)
    has_extra = extra_topk_length is not None
    etl = np.asarray(extra_topk_length, np.int32)[None] if has_extra else np.zeros((1, 1), np.int32)
    res = plan_batch_emulated(tl, etl, batch=tl.shape[0], topk=topk, extra_topk=[extra_topk],
                              has_extra=[int(has_extra)], num_sm_parts=num_sm_parts, fixed_overhead=fixed_overhead,
                              seed=seed, return_smem_bytes=return_smem_bytes)
    return (res[0][0], res[1][0]) + tuple(res[2:])


def run_prefill_ffi(args, attrs, results, *, seed: int = 1, workers: int = 0, consumer: str = "wgmma"):
    lib = load(consumer=consumer)
    ins = [_np(a) for a in args]
    outs = [_poisoned(r) for r in results]
    err = ctypes.create_string_buffer(4096)
    rc = lib.dsv41_emu_prefill(_views(ins), _views(outs), float(attrs["softmax_scale"]), None, seed, workers, err,
                               len(err))
    if rc:
        raise ValueError(err.value.decode())
    return outs


def run_mega_prefill_ffi(args, attrs, results, *, seed: int = 1, workers: int = 0, consumer: str = "wgmma"):
    """The mega prefill FFI call's contract on host arrays (`_ops.prepare_mega_prefill`'s): returns the 3 result
    arrays (out bytes, out_scale, lse)."""
    lib = load(consumer=consumer)
    ins = [_np(a) for a in args]
    outs = [_poisoned(r) for r in results]
    err = ctypes.create_string_buffer(4096)
    # the kernels' order: (out, max_logits: not read, lse) and the mega views (cos_sin_rows, out_scale)
    pre_outs = [outs[0], np.zeros((0,), np.float32), outs[2]]
    mega = [ins[5], outs[1]]
    rc = lib.dsv41_emu_prefill(_views(ins[:5]), _views(pre_outs), float(attrs["softmax_scale"]), _views(mega), seed,
                               workers, err, len(err))
    if rc:
        raise ValueError(err.value.decode())
    return outs


def emulated_plan(call, *, num_sms: int = 132, planner: str = "device", seed: int = 1) -> DecodePlan:
    """The plan the cuda decode of `call` runs over (`_ops.call_plan`), with the planner kernel emulated
    where the GPU path would launch it."""
    if call.plan is not None or call.batch_invariant or planner == "jax":
        return _ops.call_plan(call, num_sms=num_sms, planner="jax")
    b, s_q, h_q, _ = call.q.shape
    parts = num_sm_parts_for("cuda", num_sms=num_sms, s_q=s_q, h_q=h_q)
    topk = call.indices.shape[2]
    tl, etl = call.lengths()
    et = call.extra_indices.shape[2] if call.has_extra else None
    meta, splits = plan_emulated(tl, topk=topk, num_sm_parts=parts, extra_topk_length=etl, extra_topk=et or 0,
                                 seed=seed)
    return DecodePlan(jnp.asarray(meta), jnp.asarray(splits), batch=b, s_q=s_q, topk=topk, extra_topk=et,
                      num_sm_parts=parts, num_sms=num_sms, num_heads=h_q)


def decode_emulated(call, *, num_sms: int = 132, seed: int = 1, workers: int = 0, planner: str = "device",
                    return_plan: bool = False, consumer: str = "wgmma"):
    """(out, lse) of the CUDA decode path, computed by the emulator (+ the `DecodePlan` it ran over, with
    return_plan)."""
    plan = emulated_plan(call, num_sms=num_sms, planner=planner, seed=seed + 2)
    args, attrs, results, _ = _ops.prepare_decode(call, plan)
    out, lse, _, _ = run_decode_ffi(args, attrs, results, seed=seed, workers=workers, consumer=consumer)
    res = (jnp.asarray(out), jnp.asarray(lse))
    return res + (plan,) if return_plan else res


def mega_decode_emulated(call, *, num_sms: int = 132, seed: int = 1, workers: int = 0, planner: str = "device",
                         consumer: str = "wgmma"):
    """(out e4m3 [T, h_q, 512], out_scale, lse) of the CUDA mega decode of a `MegaDecodeCall`, computed by the
    emulator."""
    plan = emulated_plan(call.decode, num_sms=num_sms, planner=planner, seed=seed + 2)
    args, attrs, results, _ = _ops.prepare_mega_decode(call, plan)
    out, scale, lse, _, _ = run_mega_decode_ffi(args, attrs, results, seed=seed, workers=workers, consumer=consumer)
    return _ops.finish_mega(jnp.asarray(out), jnp.asarray(scale), jnp.asarray(lse))


def prefill_emulated(call, *, seed: int = 1, workers: int = 0, consumer: str = "wgmma", kv_f16: bool | None = None):
    """(out, max_logits, lse) of the CUDA prefill path, computed by the emulator (`kv_f16`: see
    `_ops.prepare_prefill`; f16 rows run the seesaw CTA in the wgmma build)."""
    args, attrs, results, _ = _ops.prepare_prefill(call, kv_f16=kv_f16)
    out, ml, lse = run_prefill_ffi(args, attrs, results, seed=seed, workers=workers, consumer=consumer)
    return jnp.asarray(out), jnp.asarray(ml), jnp.asarray(lse)


def mega_prefill_emulated(call, *, seed: int = 1, workers: int = 0, consumer: str = "wgmma", kv_f16: bool | None = None):
    """(out e4m3 [s_q, h_q, 512], out_scale, lse) of the CUDA mega prefill of a `MegaPrefillCall`, computed by the
    emulator (`kv_f16` as `prefill_emulated`)."""
    args, attrs, results, _ = _ops.prepare_mega_prefill(call, kv_f16=kv_f16)
    out, scale, lse = run_mega_prefill_ffi(args, attrs, results, seed=seed, workers=workers, consumer=consumer)
    return jax.lax.bitcast_convert_type(jnp.asarray(out), jnp.float8_e4m3fn), jnp.asarray(scale), jnp.asarray(lse)
