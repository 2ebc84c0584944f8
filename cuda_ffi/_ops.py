"""JAX side of the `impl="cuda"` kernels: argument preparation and the XLA FFI calls.

Both kernels work on 64-head groups and 64-token tiles, so the wrapper
- pads q's heads with zeros to a multiple of 64 (their sink is -inf) and slices the results back;
- pads indices with -1 to a multiple of 64 (at least 64);
- clamps topk_length / extra_topk_length to [0, topk] (the kernel clamps again);
- decode: FlashMLA's split plan (`dsv41_jax.scheduler.plan_decode_splits`'s algorithm, from the
  clamped lengths, `num_sm_parts_for("sm90", num_sms, s_q, h_q)` parts) is computed by a
  one-warp planner kernel that the FFI handler enqueues before the decode kernel
  (`plan="device"`, the default: no XLA loops, no host round trip); `plan="jax"` computes it
  with `plan_decode_splits` in XLA and passes it in (the handler copies it). Either way the plan
  the kernels used comes back as two extra FFI results, `tile_scheduler_metadata int32[parts, 8]`
  and `num_splits int32[b + 1]`;
- passes the split accumulators `o_accum f32[b + parts, s_q, h_pad, 512]` and `lse_accum` as
  extra FFI results (no allocation inside the handler; command-buffer compatible);
- prefill: converts kv to f16 (saturating) when `prefill_kv_f16` says the rows are re-read often enough; the
  handler then runs the f16-row kernel (`seesaw.cuh` on sm_90a).
Results are exactly what the xla reference returns: decode `(out bf16 [b, s_q, h_q, 512], lse f32
[b, s_q, h_q])`, prefill `(out bf16 [s_q, h_q, 512], max_logits f32 [s_q, h_q], lse f32 [s_q, h_q])`.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dsv41_jax.kv_cache import f16_rows_pay, to_f16_saturating
from dsv41_jax.scheduler import num_sm_parts_for, plan_decode_splits

DECODE_TARGET = "dsv41_sparse_mla_decode"
PREFILL_TARGET = "dsv41_sparse_mla_prefill"
HEAD_DIM = 512
GROUP = 64
FORMAT_CODES = {"bf16": 0, "fp8_ds_mla": 1}
DEFAULT_NUM_SMS = 132


# ------------------------------------------------------------------------------ checks
def _require(name: str, x: Any, *, dtype, ndim: int) -> None:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"cuda: {name} must be an array, got {type(x).__name__}")
    if x.dtype != jnp.dtype(dtype):
        raise TypeError(f"cuda: {name} must have dtype {jnp.dtype(dtype).name}, got {x.dtype} (shape {tuple(x.shape)})")
    if x.ndim != ndim:
        raise ValueError(f"cuda: {name} must be {ndim}-D, got shape {tuple(x.shape)}")


def _check_cache(name: str, cache: Any, fmt: str, bs: int) -> None:
    if fmt not in FORMAT_CODES:
        raise ValueError(f"cuda: {name} format must be one of {sorted(FORMAT_CODES)}, got {fmt!r}")
    if fmt == "bf16":
        _require(name, cache, dtype=jnp.bfloat16, ndim=3)
        if tuple(cache.shape[1:]) != (bs, HEAD_DIM):
            raise ValueError(f"cuda: {name} (bf16) must be [num_blocks, {bs}, {HEAD_DIM}], got {tuple(cache.shape)}")
    else:
        _require(name, cache, dtype=jnp.uint8, ndim=2)
        pb = -(-bs * 584 // 576) * 576
        if cache.shape[1] != pb:
            raise ValueError(f"cuda: {name} (fp8_ds_mla, block_size {bs}) must be uint8[num_blocks, {pb}], "
                             f"got {tuple(cache.shape)}")


def decode_supports(call) -> str | None:
    """None if the CUDA decode kernel reads this call's cache formats, else why not."""
    if call.kv_format not in FORMAT_CODES:
        return f"the cuda kernels read kv_format 'bf16' or 'fp8_ds_mla', not {call.kv_format!r}"
    if call.has_extra and call.extra_kv_format not in FORMAT_CODES:
        return f"the cuda kernels read extra_kv_format 'bf16' or 'fp8_ds_mla', not {call.extra_kv_format!r}"
    return None


def prefill_supports(call) -> str | None:
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


def _sink(sink: jax.Array | None, h_q: int, h_pad: int) -> jax.Array:
    s = jnp.full((h_q,), -jnp.inf, jnp.float32) if sink is None else jnp.asarray(sink, jnp.float32)
    return _pad_axis(s, 0, h_pad, -jnp.inf)


def _pad_for_kernel(call, *, head_axis: int):
    """q padded to 64-head groups (sink -inf for the padding), indices to 64-token tiles (-1), lengths
    clamped to [0, topk]: `(q, sink, indices, lengths, h_pad, topk)`. The last axis of indices is top-k."""
    if call.attn_sink is not None:
        _require("attn_sink", call.attn_sink, dtype=jnp.float32, ndim=1)
    h_q = call.q.shape[head_axis]
    h_pad = _round_up(h_q, GROUP)
    qp = _pad_axis(call.q, head_axis, h_pad, 0)
    topk = call.indices.shape[-1]
    idx = _pad_axis(call.indices, call.indices.ndim - 1, _round_up(topk, GROUP), -1)
    tl = jnp.clip(call.topk_length, 0, topk).astype(jnp.int32)
    return qp, _sink(call.attn_sink, h_q, h_pad), idx, tl, h_pad, topk


@functools.cache
def default_num_sms() -> int:
    """SM count of the first GPU (`core_count`), or 132 (H100/H200) when there is none."""
    try:
        dev = jax.devices()[0]
        if dev.platform == "gpu":
            n = getattr(dev, "core_count", None)
            if isinstance(n, (int, np.integer)) and n > 0:
                return int(n)
    except Exception:
        pass
    return DEFAULT_NUM_SMS


# ------------------------------------------------------------------------------ decode
PLANS = ("device", "jax")


def prepare_decode(call, *, num_sms: int | None = None, plan: str = "device") -> tuple[tuple, dict, tuple, dict]:
    """(ffi args, ffi attrs, result ShapeDtypeStructs, info) for a checked `DecodeCall`.

    plan="device": the handler's planner kernel computes the split plan; "jax": `plan_decode_splits`."""
    if plan not in PLANS:
        raise ValueError(f"cuda: plan must be one of {PLANS}, got {plan!r}")
    q = call.q
    _require("q", q, dtype=jnp.bfloat16, ndim=4)
    b, s_q, h_q, d = q.shape
    if d != HEAD_DIM:
        raise ValueError(f"cuda: q's head dim must be {HEAD_DIM}, got shape {tuple(q.shape)}")
    _check_cache("kv_cache", call.kv_cache, call.kv_format, call.block_size)
    _require("indices", call.indices, dtype=jnp.int32, ndim=3)
    _require("topk_length", call.topk_length, dtype=jnp.int32, ndim=1)
    qp, sink, idx, tl, h_pad, topk = _pad_for_kernel(call, head_axis=2)
    parts = num_sm_parts_for("sm90", num_sms=num_sms or default_num_sms(), s_q=s_q, h_q=h_q)
    if call.has_extra:
        _check_cache("extra_kv_cache", call.extra_kv_cache, call.extra_kv_format, call.extra_block_size)
        _require("extra_indices", call.extra_indices, dtype=jnp.int32, ndim=3)
        _require("extra_topk_length", call.extra_topk_length, dtype=jnp.int32, ndim=1)
        etopk = call.extra_indices.shape[2]
        eidx = _pad_axis(call.extra_indices, 2, _round_up(etopk, GROUP), -1)
        etl = jnp.clip(call.extra_topk_length, 0, etopk).astype(jnp.int32)
        ekv = call.extra_kv_cache
        efmt, ebs = FORMAT_CODES[call.extra_kv_format], int(call.extra_block_size)
    else:
        ekv = jnp.zeros((1, 1), jnp.uint8)
        eidx = jnp.full((1, 1, 1), -1, jnp.int32)
        etl = jnp.zeros((1,), jnp.int32)
        efmt, ebs = 0, 1
    if plan == "jax":
        meta, splits = plan_decode_splits(tl, topk=topk, num_sm_parts=parts,
                                          extra_topk_length=etl if call.has_extra else None)
    else:  # placeholders: the handler plans on the device and ignores these inputs
        meta, splits = jnp.zeros((1, 8), jnp.int32), jnp.zeros((1,), jnp.int32)
    args = (qp, call.kv_cache, idx, tl, sink, meta, splits, ekv, eidx, etl)
    attrs = dict(softmax_scale=np.float32(call.softmax_scale), kv_format=np.int64(FORMAT_CODES[call.kv_format]),
                 block_size=np.int64(call.block_size), has_extra=np.int64(1 if call.has_extra else 0),
                 extra_kv_format=np.int64(efmt), extra_block_size=np.int64(ebs),
                 device_plan=np.int64(1 if plan == "device" else 0))
    results = (
        jax.ShapeDtypeStruct((b, s_q, h_pad, HEAD_DIM), jnp.bfloat16),
        jax.ShapeDtypeStruct((b, s_q, h_pad), jnp.float32),
        jax.ShapeDtypeStruct((b + parts, s_q, h_pad, HEAD_DIM), jnp.float32),
        jax.ShapeDtypeStruct((b + parts, s_q, h_pad), jnp.float32),
        jax.ShapeDtypeStruct((parts, 8), jnp.int32),
        jax.ShapeDtypeStruct((b + 1,), jnp.int32),
    )
    return args, attrs, results, dict(h_q=h_q, h_pad=h_pad, num_parts=parts)


def _empty_decode(call):
    b, s_q, h_q, d = call.q.shape
    return jnp.zeros((b, s_q, h_q, d), jnp.bfloat16), jnp.full((b, s_q, h_q), jnp.inf, jnp.float32)


def decode_with_plan(call, *, plan: str = "device", num_sms: int | None = None):
    """`(out, lse, tile_scheduler_metadata, num_splits)`: the decode and the split plan it used
    (b >= 1 and s_q >= 1)."""
    from cuda_ffi import ensure_registered

    args, attrs, results, info = prepare_decode(call, num_sms=num_sms, plan=plan)
    ensure_registered()
    out, lse, _, _, meta, splits = jax.ffi.ffi_call(DECODE_TARGET, results)(*args, **attrs)
    h_q = info["h_q"]
    if info["h_pad"] != h_q:
        out, lse = out[:, :, :h_q], lse[:, :, :h_q]
    return out, lse, meta, splits


def decode(call, *, plan: str = "device") -> tuple[jax.Array, jax.Array]:
    """`impl="cuda"` sparse decode of a checked `DecodeCall`: `(out, lse)` like the xla reference."""
    b, s_q = call.q.shape[:2]
    if b == 0 or s_q == 0:
        return _empty_decode(call)
    out, lse, _, _ = decode_with_plan(call, plan=plan)
    return out, lse


# ------------------------------------------------------------------------------ prefill
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
    _require("topk_length", call.topk_length, dtype=jnp.int32, ndim=1)
    qp, sink, idx, tl, h_pad, topk = _pad_for_kernel(call, head_axis=1)
    if kv_f16 is None:
        kv_f16 = prefill_kv_f16(call.kv.shape[0], s_q, idx.shape[1], h_pad // GROUP)
    args = (qp, to_f16_saturating(call.kv) if kv_f16 else call.kv, idx, tl, sink)
    attrs = dict(softmax_scale=np.float32(call.softmax_scale))
    results = (
        jax.ShapeDtypeStruct((s_q, h_pad, HEAD_DIM), jnp.bfloat16),
        jax.ShapeDtypeStruct((s_q, h_pad), jnp.float32),
        jax.ShapeDtypeStruct((s_q, h_pad), jnp.float32),
    )
    return args, attrs, results, dict(h_q=h_q, h_pad=h_pad, kv_f16=bool(kv_f16))


def prefill(call, *, kv_f16: bool | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`impl="cuda"` sparse prefill of a checked `PrefillCall`: `(out, max_logits, lse)`. `kv_f16`: see
    `prepare_prefill`."""
    from cuda_ffi import ensure_registered

    s_q, h_q, d = call.q.shape
    if s_q == 0:
        return (jnp.zeros((0, h_q, d), jnp.bfloat16), jnp.zeros((0, h_q), jnp.float32),
                jnp.zeros((0, h_q), jnp.float32))
    args, attrs, results, info = prepare_prefill(call, kv_f16=kv_f16)
    ensure_registered()
    out, max_logits, lse = jax.ffi.ffi_call(PREFILL_TARGET, results)(*args, **attrs)
    if info["h_pad"] != h_q:
        out, max_logits, lse = out[:, :h_q], max_logits[:, :h_q], lse[:, :h_q]
    return out, max_logits, lse
