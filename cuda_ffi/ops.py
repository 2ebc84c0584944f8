"""JAX side of the `impl="cuda"` kernels: argument preparation and the XLA FFI calls.

Both kernels work on 64-head groups and 64-token tiles, so the wrapper
- passes q and takes the results at the call's own head count: a last group of fewer than 64 heads is
  completed with zero Q rows inside the kernels and its missing heads are never written; a decode of at
  most 32 heads runs the narrow CTA (16 or 32 rows; params.h `kNarrowMaxHeads`);
- pads indices with -1 to a multiple of 64 (at least 64);
- passes lengths and sinks as they are (the kernels clamp lengths to [0, topk]); absent lengths are a
  constant `[topk]` (one length for every row), an absent sink an empty operand, so a call adds no
  XLA work around the kernels;
- decode: runs over a split plan (`dsv41_jax.plans.DecodePlan`): the call's own, or, when none is
  given, one made in the call: the batch-invariant constant, or FlashMLA's plan from the one-warp
  planner kernel (`PLAN_TARGET`, `plan_on_device`; `planner="jax"`: `plan_decode_splits` in XLA);
- passes the split accumulators `o_accum f32[b + parts, s_q, h_q, 512]` and `lse_accum` as extra FFI
  results (no allocation inside the handler; command-buffer compatible); a plan without split-KV
  (batch-invariant) gets one slot and no combine kernel;
- prefill: converts kv to f16 (saturating) when `prefill_kv_f16` says the rows are re-read often enough; the
  handler then runs the f16-row kernel (`seesaw.cuh` on sm_90a).
- the mega ops (`MEGA_DECODE_TARGET`, `MEGA_PREFILL_TARGET`): the decode's operands plus positions and the cos / sin
  table, or the prefill's plus each query's cos / sin row (one small gather in XLA); the e4m3 output comes back as
  uint8 bytes, bitcast here.
Results are exactly what the xla reference returns: decode `(out bf16 [b, s_q, h_q, 512], lse f32
[b, s_q, h_q])`, prefill `(out bf16 [s_q, h_q, 512], max_logits f32 [s_q, h_q], lse f32 [s_q, h_q])`.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dsv41_jax import kv_cache as kvc
from dsv41_jax.device import default_num_sms
from dsv41_jax.kv_cache import LATENT_DIM, f16_rows_pay, to_f16_saturating
from dsv41_jax.plans import FIXED_OVERHEAD, DecodePlan, make_plans, resolve_planner
from dsv41_jax.scheduler import num_sm_parts_for

__all__ = ["DECODE_TARGET", "MEGA_DECODE_TARGET", "MEGA_PREFILL_TARGET", "PLAN_TARGET", "PREFILL_TARGET", "HEAD_DIM",
           "GROUP", "FORMAT_CODES", "MAX_PLANS", "decode_supports", "mega_decode_supports", "prefill_supports",
           "mega_prefill_supports", "plan_on_device", "call_plan", "prepare_decode", "prepare_mega_decode", "decode",
           "mega_decode", "prefill_kv_f16", "prepare_prefill", "prepare_mega_prefill", "prefill", "mega_prefill"]

DECODE_TARGET = "dsv41_sparse_mla_decode"
MEGA_DECODE_TARGET = "dsv41_sparse_mla_mega_decode"
MEGA_PREFILL_TARGET = "dsv41_sparse_mla_mega_prefill"
PLAN_TARGET = "dsv41_plan_decode_splits"
PREFILL_TARGET = "dsv41_sparse_mla_prefill"
HEAD_DIM = LATENT_DIM  # the latent width the kernels are built for
GROUP = 64
# kv_format -> the kernels' KvFormat code (csrc/params.h; 2 is prefill's f16 rows, not a cache format)
FORMAT_CODES = {"bf16": 0, "fp8_ds_mla": 1, "mxfp8_ds_mla": 3, "nvfp4_ds_mla": 4}
MAX_PLANS = 8  # plans per planner launch (params.h kMaxPlans)
# The decode kernels' format families (params.h kFamV4 / kFamV41): one call reads pools of one family.
V41_FORMATS = kvc.V41_FORMATS


# ------------------------------------------------------------------------------ checks
def _require(name: str, x: Any, *, dtype, ndim: int) -> None:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"cuda: {name} must be an array, got {type(x).__name__}")
    if x.dtype != jnp.dtype(dtype):
        raise TypeError(f"cuda: {name} must have dtype {jnp.dtype(dtype).name}, got {x.dtype} (shape {tuple(x.shape)})")
    if x.ndim != ndim:
        raise ValueError(f"cuda: {name} must be {ndim}-D, got shape {tuple(x.shape)}")


def _check_cache(name: str, cache: Any, kv_format: str, bs: int) -> None:
    if kv_format not in FORMAT_CODES:
        raise ValueError(f"cuda: {name} format must be one of {sorted(FORMAT_CODES)}, got {kv_format!r}")
    if kv_format == "bf16":
        _require(name, cache, dtype=jnp.bfloat16, ndim=3)
        if tuple(cache.shape[1:]) != (bs, HEAD_DIM):
            raise ValueError(f"cuda: {name} (bf16) must be [num_blocks, {bs}, {HEAD_DIM}], got {tuple(cache.shape)}")
    else:
        _require(name, cache, dtype=jnp.uint8, ndim=2)
        pb = kvc.page_bytes(kv_format, bs)
        if cache.shape[1] != pb:
            raise ValueError(f"cuda: {name} ({kv_format}, block_size {bs}) must be uint8[num_blocks, {pb}], "
                             f"got {tuple(cache.shape)}")


def decode_supports(call) -> str | None:
    """None if the CUDA decode kernel reads this call's cache formats, else why not."""
    if call.kv_format not in FORMAT_CODES:
        return f"the cuda kernels read kv_format {' / '.join(FORMAT_CODES)}, not {call.kv_format!r}"
    if call.has_extra and call.extra_kv_format not in FORMAT_CODES:
        return f"the cuda kernels read extra_kv_format {' / '.join(FORMAT_CODES)}, not {call.extra_kv_format!r}"
    if call.has_extra and (call.kv_format in V41_FORMATS) != (call.extra_kv_format in V41_FORMATS):
        return (f"the cuda kernels read bf16 / fp8_ds_mla pools or mxfp8_ds_mla / nvfp4_ds_mla pools, not both in one "
                f"call (kv_format {call.kv_format!r}, extra_kv_format {call.extra_kv_format!r})")
    return None


def mega_decode_supports(call) -> str | None:
    """None if the CUDA mega decode runs this `MegaDecodeCall` (the decode kernels with the mega prologue and
    epilogue: whatever `decode_supports` accepts)."""
    return decode_supports(call.decode)


def prefill_supports(call) -> str | None:
    return None


def mega_prefill_supports(call) -> str | None:
    """None: the CUDA mega prefill (the prefill kernels with the mega prologue and epilogue) runs every
    `MegaPrefillCall`."""
    return None


# ------------------------------------------------------------------------------ helpers
def _pad_axis(x: jax.Array, axis: int, size: int, value) -> jax.Array:
    n = x.shape[axis]
    if n == size:
        return x
    pads = [(0, 0)] * x.ndim
    pads[axis] = (0, size - n)
    return jnp.pad(x, pads, constant_values=value)


def _round_up(n: int, m: int) -> int:
    return max(m, -(-n // m) * m)


def _sink(sink: jax.Array | None) -> jax.Array:
    """The sink operand: f32 [h_q], or [0] for no sink."""
    if sink is None:
        return jnp.zeros((0,), jnp.float32)
    _require("attn_sink", sink, dtype=jnp.float32, ndim=1)
    return sink


def _rows(name: str, x: jax.Array | None, topk: int) -> jax.Array:
    """A lengths operand: int32 [rows], or the constant [topk] (one length for every row)."""
    if x is None:
        return jnp.asarray(np.array([topk], np.int32))
    _require(name, x, dtype=jnp.int32, ndim=1)
    return x


def _pad_indices(indices: jax.Array) -> jax.Array:
    """indices padded with -1 to whole 64-token tiles along their last axis (top-k)."""
    return _pad_axis(indices, indices.ndim - 1, _round_up(indices.shape[-1], GROUP), -1)


# ------------------------------------------------------------------------------ decode
def plan_on_device(topk_length: jax.Array, extras: list, *, topk: int, num_sm_parts: int,
                   fixed_overhead: int = FIXED_OVERHEAD) -> tuple[jax.Array, jax.Array]:
    """The planner kernel (one warp per plan, one launch): FlashMLA's plans of `len(extras)` layer types
    over the same requests. topk_length int32 [b]; extras[j] = (extra_topk_length int32 [b] or None,
    extra_topk) or (None, None) for no extra cache. Returns `(tile_scheduler_metadata int32 [n, parts, 8],
    num_splits int32 [n, b + 1])`, bit-identical to `plan_decode_splits` of the clamped lengths."""
    from cuda_ffi import ensure_registered

    n = len(extras)
    if not 1 <= n <= MAX_PLANS:
        raise ValueError(f"cuda: plan_on_device takes 1..{MAX_PLANS} plans, got {n}")
    _require("topk_length", topk_length, dtype=jnp.int32, ndim=1)
    b = topk_length.shape[0]
    has = [et is not None for _, et in extras]
    if any(el is not None for el, _ in extras):  # one row per plan: the lengths, or extra_topk for all
        etl = jnp.stack([el if el is not None else jnp.full((b,), et or 0, jnp.int32) for el, et in extras])
    else:  # one length per plan
        etl = jnp.asarray(np.array([[et or 0] for _, et in extras], np.int32))
    results = (jax.ShapeDtypeStruct((n, num_sm_parts, 8), jnp.int32), jax.ShapeDtypeStruct((n, b + 1), jnp.int32))
    ensure_registered()
    return jax.ffi.ffi_call(PLAN_TARGET, results)(
        topk_length, etl, topk=np.int64(topk), extra_topk=np.array([et or 0 for _, et in extras], np.int64),
        has_extra=np.array(has, np.int64), fixed_overhead=np.int64(fixed_overhead))


def call_plan(call, *, num_sms: int | None = None, planner: str = "device") -> DecodePlan:
    """The plan the cuda decode of `call` runs over: the call's own (checked against this device), the
    batch-invariant constant, or FlashMLA's plan made now by `planner` ("device": the planner kernel;
    "jax": `plan_decode_splits` in XLA)."""
    planner = resolve_planner(planner)  # (checks the name)
    _, s_q, h_q, _ = call.q.shape
    num_sms = num_sms or default_num_sms()
    parts = num_sm_parts_for("cuda", num_sms=num_sms, s_q=s_q, h_q=h_q)
    if call.plan is not None:
        call.plan.check_parts(parts, impl="cuda", num_sms=num_sms, num_heads=h_q)
        return call.plan
    topk = call.indices.shape[2]
    tl, _ = call.lengths()
    extra = None
    if call.has_extra:
        extra = (call.extra_topk_length, call.extra_indices.shape[2])
    return make_plans(tl, {"p": extra}, s_q=s_q, num_heads=h_q, topk=topk, num_sms=num_sms,
                      batch_invariant=call.batch_invariant, planner=planner)["p"]


def _check_decode(call) -> None:
    _require("q", call.q, dtype=jnp.bfloat16, ndim=4)
    if call.q.shape[3] != HEAD_DIM:
        raise ValueError(f"cuda: q's head dim must be {HEAD_DIM}, got shape {tuple(call.q.shape)}")
    _check_cache("kv_cache", call.kv_cache, call.kv_format, call.block_size)
    _require("indices", call.indices, dtype=jnp.int32, ndim=3)
    if call.has_extra:
        _check_cache("extra_kv_cache", call.extra_kv_cache, call.extra_kv_format, call.extra_block_size)
        _require("extra_indices", call.extra_indices, dtype=jnp.int32, ndim=3)


def prepare_decode(call, plan: DecodePlan) -> tuple[tuple, dict, tuple, dict]:
    """(ffi args, ffi attrs, result ShapeDtypeStructs, info) of a checked `DecodeCall` over `plan`."""
    _check_decode(call)
    b, s_q, h_q, _ = call.q.shape
    idx = _pad_indices(call.indices)
    tl = _rows("topk_length", call.topk_length, call.indices.shape[2])
    if call.has_extra:
        etopk = call.extra_indices.shape[2]
        eidx = _pad_indices(call.extra_indices)
        etl = _rows("extra_topk_length", call.extra_topk_length, etopk)
        ekv = call.extra_kv_cache
        ekv_format, ebs = FORMAT_CODES[call.extra_kv_format], int(call.extra_block_size)
    else:
        ekv = jnp.zeros((1, 1), jnp.uint8)
        eidx = jnp.full((1, 1, 1), -1, jnp.int32)
        etl = jnp.asarray(np.zeros((1,), np.int32))
        ekv_format, ebs = 0, 1
    meta, splits = plan
    parts = meta.shape[0]
    slots = 1 if plan.batch_invariant else b + parts
    args = (call.q, call.kv_cache, idx, tl, _sink(call.attn_sink), meta, splits, ekv, eidx, etl)
    attrs = dict(softmax_scale=np.float32(call.softmax_scale), kv_format=np.int64(FORMAT_CODES[call.kv_format]),
                 block_size=np.int64(call.block_size), has_extra=np.int64(1 if call.has_extra else 0),
                 extra_kv_format=np.int64(ekv_format), extra_block_size=np.int64(ebs))
    results = (
        jax.ShapeDtypeStruct((b, s_q, h_q, HEAD_DIM), jnp.bfloat16),
        jax.ShapeDtypeStruct((b, s_q, h_q), jnp.float32),
        jax.ShapeDtypeStruct((slots, s_q, h_q, HEAD_DIM), jnp.float32),
        jax.ShapeDtypeStruct((slots, s_q, h_q), jnp.float32),
    )
    return args, attrs, results, dict(h_q=h_q, num_parts=parts)


def prepare_mega_decode(call, plan: DecodePlan) -> tuple[tuple, dict, tuple, dict]:
    """(ffi args, ffi attrs, result ShapeDtypeStructs, info) of a checked `MegaDecodeCall` over `plan`: the decode's,
    plus positions [T, 1] and the cos / sin table as arguments, the e4m3 output as uint8 bytes, its exponents, and
    accumulators of b + num_parts slots whatever the plan (the combine finishes some kernels' requests of one piece
    too: csrc/mega.cuh)."""
    dcall = call.decode
    args, attrs, results, info = prepare_decode(dcall, plan)
    b, s_q, h_q, _ = dcall.q.shape
    slots = b + plan.tile_scheduler_metadata.shape[0]
    args = args + (call.positions.reshape(b, s_q), call.cos_sin_cache)
    attrs = dict(attrs, batch_invariant=np.int64(1 if plan.batch_invariant else 0))
    results = (
        jax.ShapeDtypeStruct((b, s_q, h_q, HEAD_DIM), jnp.uint8),
        jax.ShapeDtypeStruct((b, s_q, h_q, HEAD_DIM // 32), jnp.uint8),
        results[1],
        jax.ShapeDtypeStruct((slots, s_q, h_q, HEAD_DIM), jnp.float32),
        jax.ShapeDtypeStruct((slots, s_q, h_q), jnp.float32),
    )
    return args, attrs, results, info


def finish_mega(out_bytes: jax.Array, out_scale: jax.Array, lse: jax.Array):
    """The mega decode's results from the FFI's: `(out e4m3 [T, h_q, 512], out_scale uint8 [T, h_q, 16],
    lse [T, h_q])`."""
    out = jax.lax.bitcast_convert_type(out_bytes[:, 0], jnp.float8_e4m3fn)
    return out, out_scale[:, 0], lse[:, 0]


def _empty_decode(call):
    b, s_q, h_q, d = call.q.shape
    return jnp.zeros((b, s_q, h_q, d), jnp.bfloat16), jnp.full((b, s_q, h_q), jnp.inf, jnp.float32)


def decode(call, *, planner: str = "device", num_sms: int | None = None) -> tuple[jax.Array, jax.Array]:
    """`impl="cuda"` sparse decode of a checked `DecodeCall`: `(out, lse)` like the xla reference, over
    `call_plan(call, ...)`."""
    from cuda_ffi import ensure_registered

    _check_decode(call)
    b, s_q = call.q.shape[:2]
    if b == 0 or s_q == 0:
        return _empty_decode(call)
    plan = call_plan(call, num_sms=num_sms, planner=planner)
    args, attrs, results, _ = prepare_decode(call, plan)
    ensure_registered()
    out, lse, _, _ = jax.ffi.ffi_call(DECODE_TARGET, results)(*args, **attrs)
    return out, lse


# ------------------------------------------------------------------------------ prefill
def mega_decode(call, *, planner: str = "device", num_sms: int | None = None):
    """`impl="cuda"` mega decode of a checked `MegaDecodeCall`: `(out e4m3, out_scale, lse)` like the xla
    reference (`dsv41_jax.sparse_mla.reference.mega_decode`), over `call_plan(call.decode, ...)`."""
    from cuda_ffi import ensure_registered

    dcall = call.decode
    _check_decode(dcall)
    T, _, h_q, d = dcall.q.shape
    if T == 0:
        return (jnp.zeros((0, h_q, d), jnp.float8_e4m3fn), jnp.zeros((0, h_q, d // 32), jnp.uint8),
                jnp.zeros((0, h_q), jnp.float32))
    plan = call_plan(dcall, num_sms=num_sms, planner=planner)
    args, attrs, results, _ = prepare_mega_decode(call, plan)
    ensure_registered()
    out, scale, lse, _, _ = jax.ffi.ffi_call(MEGA_DECODE_TARGET, results)(*args, **attrs)
    return finish_mega(out, scale, lse)


def prefill_kv_f16(s_kv: int, s_q: int, topk_pad: int, num_groups: int) -> bool:
    """Whether the wrapper converts prefill's bf16 kv to f16 before the kernel (the f16-row kernel,
    seesaw.cuh, copies rows with cp.async and splits the tensor work evenly between its consumers):
    `dsv41_jax.kv_cache.f16_rows_pay` over the padded shapes, i.e. s_kv * 8 <= s_q * topk * groups (the
    kernel reads s_q * topk rows per 64-head group; ~0.1 ns saved per gathered row and group against
    ~0.6 ns per converted row). $DSV41_CUDA_PREFILL_ROWS=bf16|f16 overrides the rule (benchmark comparisons)."""
    forced = os.environ.get("DSV41_CUDA_PREFILL_ROWS", "")
    if forced:
        if forced not in ("bf16", "f16"):
            raise ValueError(f"DSV41_CUDA_PREFILL_ROWS must be 'bf16' or 'f16', got {forced!r}")
        return forced == "f16"
    return f16_rows_pay(s_kv, s_q, topk_pad, num_groups * GROUP)


def prepare_prefill(call, *, kv_f16: bool | None = None) -> tuple[tuple, dict, tuple, dict]:
    """(ffi args, ffi attrs, result ShapeDtypeStructs, info) for a checked `PrefillCall`. `kv_f16`: pass
    kv as f16 rows (None: when `prefill_kv_f16` says the conversion pays)."""
    q = call.q
    _require("q", q, dtype=jnp.bfloat16, ndim=3)
    s_q, h_q, d = q.shape
    if d != HEAD_DIM:
        raise ValueError(f"cuda: q's head dim must be {HEAD_DIM}, got shape {tuple(q.shape)}")
    _require("kv", call.kv, dtype=jnp.bfloat16, ndim=2)
    if call.kv.shape[1] != HEAD_DIM:
        raise ValueError(f"cuda: kv must be [s_kv, {HEAD_DIM}], got {tuple(call.kv.shape)}")
    _require("indices", call.indices, dtype=jnp.int32, ndim=2)
    idx = _pad_indices(call.indices)
    num_groups = -(-h_q // GROUP)  # a last group of fewer heads is completed inside the kernel
    if kv_f16 is None:
        kv_f16 = prefill_kv_f16(call.kv.shape[0], s_q, idx.shape[1], num_groups)
    args = (q, to_f16_saturating(call.kv) if kv_f16 else call.kv, idx,
            _rows("topk_length", call.topk_length, call.indices.shape[1]), _sink(call.attn_sink))
    attrs = dict(softmax_scale=np.float32(call.softmax_scale))
    results = (
        jax.ShapeDtypeStruct((s_q, h_q, HEAD_DIM), jnp.bfloat16),
        jax.ShapeDtypeStruct((s_q, h_q), jnp.float32),
        jax.ShapeDtypeStruct((s_q, h_q), jnp.float32),
    )
    return args, attrs, results, dict(h_q=h_q, kv_f16=bool(kv_f16))


def prepare_mega_prefill(call, *, kv_f16: bool | None = None) -> tuple[tuple, dict, tuple, dict]:
    """(ffi args, ffi attrs, result ShapeDtypeStructs, info) of a checked `MegaPrefillCall`: the prefill's, plus each
    query's cos / sin row (the table gathered at its clamped position: a prefill CTA is one query token, and a
    position-then-row load at its start would be a latency it cannot hide) as arguments, the e4m3 output as uint8
    bytes and its exponents in place of out and max_logits."""
    args, attrs, results, info = prepare_prefill(call.prefill, kv_f16=kv_f16)
    s_q, h_q, _ = call.prefill.q.shape
    cs = call.cos_sin_cache
    args = args + (jnp.take(cs, jnp.clip(call.positions, 0, cs.shape[0] - 1), axis=0),)
    results = (
        jax.ShapeDtypeStruct((s_q, h_q, HEAD_DIM), jnp.uint8),
        jax.ShapeDtypeStruct((s_q, h_q, HEAD_DIM // 32), jnp.uint8),
        results[2],
    )
    return args, attrs, results, info


def prefill(call, *, kv_f16: bool | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`impl="cuda"` sparse prefill of a checked `PrefillCall`: `(out, max_logits, lse)`. `kv_f16`: see
    `prepare_prefill`."""
    from cuda_ffi import ensure_registered

    s_q, h_q, d = call.q.shape
    if s_q == 0:
        return (jnp.zeros((0, h_q, d), jnp.bfloat16), jnp.zeros((0, h_q), jnp.float32),
                jnp.zeros((0, h_q), jnp.float32))
    args, attrs, results, _ = prepare_prefill(call, kv_f16=kv_f16)
    ensure_registered()
    return tuple(jax.ffi.ffi_call(PREFILL_TARGET, results)(*args, **attrs))


def mega_prefill(call, *, kv_f16: bool | None = None):
    """`impl="cuda"` mega prefill of a checked `MegaPrefillCall`: `(out e4m3 [s_q, h_q, 512], out_scale uint8
    [s_q, h_q, 16], lse f32 [s_q, h_q])` like the xla reference (`dsv41_jax.sparse_mla.reference.mega_prefill`).
    `kv_f16`: see `prepare_prefill`."""
    from cuda_ffi import ensure_registered

    s_q, h_q, d = call.prefill.q.shape
    if s_q == 0:
        return (jnp.zeros((0, h_q, d), jnp.float8_e4m3fn), jnp.zeros((0, h_q, d // 32), jnp.uint8),
                jnp.zeros((0, h_q), jnp.float32))
    args, attrs, results, _ = prepare_mega_prefill(call, kv_f16=kv_f16)
    ensure_registered()
    out, scale, lse = jax.ffi.ffi_call(MEGA_PREFILL_TARGET, results)(*args, **attrs)
    return jax.lax.bitcast_convert_type(out, jnp.float8_e4m3fn), scale, lse
