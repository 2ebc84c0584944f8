"""FlashMLA's split-KV decode scheduler as a jittable function, and each implementation's part count.

`plan_decode_splits` assigns every request's 64-token blocks (main cache first, then the extra
cache) to `num_sm_parts` workers with a greedy fill of equal budgets, exactly as FlashMLA's
one-warp planner does, so plans (and therefore the split-KV accumulation order) match it.

Record layout, one row of 8 int32 per part:
`[begin_req, end_req (inclusive), begin_block, end_block (exclusive), begin_split_idx,
is_first_req_splitted, is_last_req_splitted, 0]`. `num_splits[i] .. num_splits[i + 1] - 1` are
request i's accumulator slots; a part with `begin_req > end_req` is empty.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dsv41_jax.device import DEFAULT_NUM_SMS, default_num_sms

__all__ = ["plan_decode_splits", "num_sm_parts_for", "default_num_sms", "SCHED_META_FIELDS", "DEFAULT_NUM_SMS"]

SCHED_META_FIELDS = (
    "begin_req", "end_req", "begin_block", "end_block", "begin_split_idx",
    "is_first_req_splitted", "is_last_req_splitted", "pad",
)
_I32 = jnp.int32


def _static_int(name, v, lo):
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{name} must be a static int, got {type(v).__name__} {v!r}")
    if v < lo:
        raise ValueError(f"{name} must be >= {lo}, got {v}")
    return int(v)


def plan_decode_splits(
    topk_length: jax.Array,
    *,
    topk: int,
    num_sm_parts: int,
    extra_topk_length: jax.Array | None = None,
    extra_topk: int | None = None,
    fixed_overhead: int = 5,
    block_tokens: int = 64,
) -> tuple[jax.Array, jax.Array]:
    """FlashMLA's decode split plan.

    topk_length: int32[b], tokens each request attends in the main cache (pass `full(b, topk)`
    when every request uses `topk`; negative values count as 0). extra_topk_length: int32[b]
    for the extra cache, or None to use `extra_topk` for every request (no extra cache when
    both are None). Returns `(tile_scheduler_metadata int32[num_sm_parts, 8], num_splits
    int32[b + 1])`.

    Per request: `len = max(topk_length, 1)`; with an extra cache `len = roundup(len,
    block_tokens) + extra_len`; `blocks = max(ceil(len / block_tokens), 1)`. Each part gets a
    budget `ceil(sum(blocks + overhead) / num_sm_parts) + overhead` and takes whole requests
    (blocks + overhead) while they fit, then splits the next one if more than `overhead` is left.
    """
    if not hasattr(topk_length, "shape"):
        topk_length = np.asarray(topk_length)
    if topk_length.ndim != 1:
        raise ValueError(f"topk_length must be 1-D [b], got shape {tuple(topk_length.shape)}")
    if not jnp.issubdtype(topk_length.dtype, jnp.integer):
        raise TypeError(f"topk_length must be int32, got {topk_length.dtype}")
    _static_int("topk", topk, 0)
    P = _static_int("num_sm_parts", num_sm_parts, 1)
    ov = _static_int("fixed_overhead", fixed_overhead, 0)
    bt = _static_int("block_tokens", block_tokens, 1)
    b = topk_length.shape[0]
    lens = jnp.maximum(jnp.asarray(topk_length, _I32), 0)
    lens = jnp.where(lens == 0, 1, lens)
    has_extra = extra_topk_length is not None or (extra_topk is not None and extra_topk > 0)
    if has_extra:
        if extra_topk_length is not None:
            el = jnp.asarray(extra_topk_length)
            if el.shape != (b,):
                raise ValueError(f"extra_topk_length must have shape ({b},), got {tuple(el.shape)}")
            if not jnp.issubdtype(el.dtype, jnp.integer):
                raise TypeError(f"extra_topk_length must be int32, got {el.dtype}")
            el = jnp.maximum(el.astype(_I32), 0)
        else:
            el = jnp.full((b,), _static_int("extra_topk", extra_topk, 0), _I32)
        lens = -(-lens // bt) * bt + el
    nblk = jnp.maximum(lens - 1, 0) // bt + 1
    if b == 0:
        meta = jnp.zeros((P, 8), _I32).at[:, 1].set(-1)
        return meta, jnp.zeros((1,), _I32)
    total = jnp.sum(nblk + ov)
    payload = (total + P - 1) // P + ov

    def part(i, carry):
        req, blk, nsplit, cum, splits, meta = carry
        begin_req, begin_blk, begin_split = req, blk, nsplit
        first_split = (blk != 0).astype(_I32)

        def cond(c):
            req, blk, nsplit, cum, splits, remain, done = c
            return (req < b) & ~done

        def body(c):
            req, blk, nsplit, cum, splits, remain, done = c
            rem_blocks = nblk[jnp.minimum(req, b - 1)] - blk
            fits = remain >= rem_blocks + ov
            cum2 = cum + nsplit + 1
            can_split = remain - ov > 0
            return (
                jnp.where(fits, req + 1, req),
                jnp.where(fits, 0, jnp.where(can_split, blk + remain - ov, blk)),
                jnp.where(fits, 0, jnp.where(can_split, nsplit + 1, nsplit)),
                jnp.where(fits, cum2, cum),
                jnp.where(fits, splits.at[req + 1].set(cum2), splits),
                jnp.where(fits, remain - rem_blocks - ov, jnp.where(can_split, 0, remain)),
                ~fits,
            )

        req, blk, nsplit, cum, splits, _, _ = lax.while_loop(
            cond, body, (req, blk, nsplit, cum, splits, payload, jnp.array(False))
        )
        prev = jnp.clip(req - 1, 0, b - 1)
        end_req = jnp.where(blk > 0, req, req - 1)
        end_blk = jnp.where(blk > 0, blk, jnp.where(lens[prev] == 0, 0, nblk[prev]))
        er = jnp.clip(end_req, 0, b - 1)
        last_split = ((end_blk != nblk[er]) & (lens[er] != 0)).astype(_I32)
        same = begin_req == end_req
        either = jnp.maximum(first_split, last_split)
        first_split = jnp.where(same, either, first_split)
        last_split = jnp.where(same, either, last_split)
        row = jnp.stack([begin_req, end_req, begin_blk, end_blk, begin_split, first_split, last_split, jnp.int32(0)])
        return req, blk, nsplit, cum, splits, meta.at[i].set(row.astype(_I32))

    init = (jnp.int32(0), jnp.int32(0), jnp.int32(0), jnp.int32(0), jnp.zeros((b + 1,), _I32), jnp.zeros((P, 8), _I32))
    *_, splits, meta = lax.fori_loop(0, P, part, init)
    return meta, splits


def num_sm_parts_for(impl: str, *, num_sms: int, s_q: int, h_q: int) -> int:
    """Split-plan parts for an implementation on a device with `num_sms` SMs.

    "sm90" (FlashMLA SM90 and our CUDA SM90 kernel): `max(num_sms // s_q // ceil(h_q / 64), 1)`
    (one CTA per 64 heads); "sm100_head64": `max(num_sms // s_q, 1)`; "sm100_head128":
    `max(num_sms // s_q // 2, 1)`; "pallas" (one program per 64-head group and query token, like
    SM90); "xla": 1 (the reference does not split).
    """
    n = _static_int("num_sms", num_sms, 1)
    s = _static_int("s_q", s_q, 1)
    h = _static_int("h_q", h_q, 1)
    groups = -(-h // 64)
    if impl in ("sm90", "cuda", "pallas"):
        return max(n // s // groups, 1)
    if impl == "sm100_head64":
        return max(n // s, 1)
    if impl == "sm100_head128":
        return max(n // s // 2, 1)
    if impl == "xla":
        return 1
    raise ValueError(f"impl must be one of 'sm90', 'cuda', 'pallas', 'sm100_head64', 'sm100_head128', 'xla', got {impl!r}")
