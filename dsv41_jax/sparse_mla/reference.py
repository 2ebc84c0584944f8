"""The `impl="xla"` reference of sparse MLA: pure jnp, float32 math, FlashMLA's numerics.

`decode` / `prefill` run a checked `DecodeCall` / `PrefillCall` (`dsv41_jax.sparse_mla.base`); both,
and the mega ops, reduce to `sparse_attention_rows` over one or two token pools.

For each query row, the attended set is the union of a main and an optional extra token pool,
each given as global slots with a per-row valid length. Scores are `softmax_scale * q . k`
over the 512-d latent (K = V = the latent). One online softmax runs over the union:

    m = max_j s_j,  l = sum_j exp(s_j - m),  lse = m + log(l),
    out = (sum_j exp(s_j - m) v_j / l) / (1 + exp(sink - lse))

so the sink sits in the denominator only; `lse` and `max_logits` exclude it. A row with no
valid token gives out = 0, lse = +inf, max_logits = -inf. An index is valid iff it is inside
its pool (`0 <= idx < capacity`) and its position is below the row's length; invalid rows of a
pool are never read (their slots are masked to -1 before the gather, which yields zeros), so
NaN in unused cache slots never reaches the output.

Memory: rows are processed in blocks and the top-k in chunks (`lax.map` over row blocks,
`lax.scan` over chunks), so the largest intermediate is one chunk of gathered rows, about
`_TARGET_ROWS` x LATENT_DIM float32, never `[rows, h, topk, LATENT_DIM]`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from dsv41_jax import kv_cache as kvc
from dsv41_jax.sparse_mla.base import DecodeCall, MegaDecodeCall, MegaPrefillCall, PrefillCall

__all__ = ["Pool", "sparse_attention_rows", "decode", "prefill", "decode_f32", "prefill_f32", "mega_decode",
           "mega_prefill", "mega_finish", "quantize_output_fp8"]

_F32 = jnp.float32
_HI = lax.Precision.HIGHEST
_TARGET_ROWS = 1 << 16  # gathered latent rows per step: 64 Ki x LATENT_DIM x 4 B = 128 MiB


class Pool(NamedTuple):
    """One token pool of a sparse attention call.

    gather: maps int32 slots `[..., K]` (-1 for masked) to bf16/f32 rows `[..., K, 512]`, zero for -1.
    indices: int32 `[R, K]` global slots per query row. lengths: int32 `[R]` valid prefix per row.
    capacity: number of slots in the pool (indices outside [0, capacity) are invalid).
    """

    gather: Callable[[jax.Array], jax.Array]
    indices: jax.Array
    lengths: jax.Array
    capacity: int


def _chunk_size(rows: int, k: int, heads: int) -> tuple[int, int]:
    """(row block, topk chunk) so that one step gathers about _TARGET_ROWS latent rows."""
    chunk = max(1, min(k, 512))
    rb = max(1, min(rows, _TARGET_ROWS // chunk, (1 << 22) // max(heads * chunk, 1)))
    return rb, chunk


def sparse_attention_rows(
    q: jax.Array,
    pools: Sequence[Pool],
    *,
    softmax_scale: float,
    attn_sink: jax.Array | None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Attention of each query row over the union of its pools' valid tokens.

    q: `[R, h, 512]` (any float dtype; used in float32). Returns `(out float32 [R, h, 512],
    max_logits float32 [R, h], lse float32 [R, h])` with the conventions of the module docstring.
    """
    R, H, D = q.shape
    total_k = sum(int(p.indices.shape[1]) for p in pools)
    rb, chunk = _chunk_size(R, max(total_k, 1), H)
    n_blocks = -(-R // rb)
    pad_r = n_blocks * rb - R

    def pad_rows(x, value):
        return jnp.pad(x, [(0, pad_r)] + [(0, 0)] * (x.ndim - 1), constant_values=value) if pad_r else x

    qb = pad_rows(q, 0).reshape(n_blocks, rb, H, D)
    # Validity is decided here, once: slots of masked entries become -1 so the gather never reads them.
    masked = []
    for p in pools:
        K = p.indices.shape[1]
        pos = jnp.arange(K, dtype=jnp.int32)[None, :]
        ok = (pos < p.lengths[:, None]) & (p.indices >= 0) & (p.indices < p.capacity)
        idx = jnp.where(ok, p.indices, -1)
        kc = -(-K // chunk) * chunk if K else 0
        idx = jnp.pad(idx, ((0, 0), (0, kc - K)), constant_values=-1) if kc > K else idx
        masked.append(pad_rows(idx, -1).reshape(n_blocks, rb, kc))

    def one_block(args):
        qblk, idx_blks = args
        qf = qblk.astype(_F32)
        m = jnp.full((rb, H), -jnp.inf, _F32)
        l = jnp.zeros((rb, H), _F32)
        acc = jnp.zeros((rb, H, D), _F32)
        for p, idx in zip(pools, idx_blks):
            if idx.shape[1] == 0:
                continue
            chunks = idx.reshape(rb, -1, chunk).transpose(1, 0, 2)  # [n_chunks, rb, chunk]

            def step(carry, ic, gather=p.gather):
                m, l, acc = carry
                rows = gather(ic).astype(_F32)  # [rb, chunk, D]; zeros where ic == -1
                s = jnp.einsum("rhd,rcd->rhc", qf, rows, precision=_HI) * softmax_scale
                s = jnp.where((ic >= 0)[:, None, :], s, -jnp.inf)
                m_new = jnp.maximum(m, jnp.max(s, axis=-1))
                base = jnp.where(jnp.isneginf(m_new), 0.0, m_new)  # keeps (-inf) - (-inf) out
                pexp = jnp.exp(s - base[..., None])
                alpha = jnp.exp(m - base)
                l = l * alpha + jnp.sum(pexp, axis=-1)
                acc = acc * alpha[..., None] + jnp.einsum("rhc,rcd->rhd", pexp, rows, precision=_HI)
                return (m_new, l, acc), None

            (m, l, acc), _ = lax.scan(step, (m, l, acc), chunks)
        empty = l == 0
        lse = jnp.where(empty, jnp.inf, m + jnp.log(jnp.where(empty, 1.0, l)))
        out = acc / jnp.where(empty, 1.0, l)[..., None]
        if attn_sink is not None:
            # exp(sink - lse) may overflow to inf (sink = +inf): the factor then becomes 0, as it should.
            out = out / (1.0 + jnp.exp(attn_sink.astype(_F32)[None, :] - lse))[..., None]
        out = jnp.where(empty[..., None], 0.0, out)
        return out, m, lse

    out, max_logits, lse = lax.map(one_block, (qb, tuple(masked)))
    out = out.reshape(n_blocks * rb, H, D)[:R]
    return out, max_logits.reshape(-1, H)[:R], lse.reshape(-1, H)[:R]


# ------------------------------------------------------------------- the ops' xla implementation
def _gather_fn(cache, kv_format: str, block_size: int):
    return lambda slots: kvc.gather(cache, slots, kv_format=kv_format, block_size=block_size)


def decode(c: DecodeCall) -> tuple[jax.Array, jax.Array]:
    """`sparse_mla_decode` of a checked call: (out bf16 [b, s_q, h_q, 512], lse f32 [b, s_q, h_q])."""
    out, lse = decode_f32(c)
    return out.astype(jnp.bfloat16), lse


def decode_f32(c: DecodeCall) -> tuple[jax.Array, jax.Array]:
    """As `decode`, with the output still float32 (the mega op's inverse RoPE reads it so)."""
    b, s_q, h_q, d = c.q.shape
    rows = b * s_q

    def pool(cache, kv_format, bs, idx, lens):
        k = idx.shape[2]
        return Pool(_gather_fn(cache, kv_format, bs), idx.reshape(rows, k), jnp.repeat(lens, s_q),
                    kvc.cache_capacity(cache, kv_format, bs))

    tl, etl = c.lengths()
    pools = [pool(c.kv_cache, c.kv_format, c.block_size, c.indices, tl)]
    if c.has_extra:
        pools.append(pool(c.extra_kv_cache, c.extra_kv_format, c.extra_block_size, c.extra_indices, etl))
    out, _, lse = sparse_attention_rows(c.q.reshape(rows, h_q, d), pools, softmax_scale=c.softmax_scale,
                                        attn_sink=c.attn_sink)
    return out.reshape(b, s_q, h_q, d), lse.reshape(b, s_q, h_q)


def prefill(c: PrefillCall) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`sparse_mla_prefill` of a checked call: (out bf16 [s_q, h_q, 512], max_logits, lse f32 [s_q, h_q])."""
    out, max_logits, lse = prefill_f32(c)
    return out.astype(jnp.bfloat16), max_logits, lse


def prefill_f32(c: PrefillCall) -> tuple[jax.Array, jax.Array, jax.Array]:
    """As `prefill`, with the output still float32."""
    kv = c.kv

    def gather(slots):
        return jnp.where((slots >= 0)[..., None], kv[jnp.clip(slots, 0, kv.shape[0] - 1)], 0)

    pool = Pool(gather, c.indices, c.lengths(), kv.shape[0])
    return sparse_attention_rows(c.q, [pool], softmax_scale=c.softmax_scale, attn_sink=c.attn_sink)


# ------------------------------------------------------------------------------ the mega ops
def quantize_output_fp8(x: jax.Array, *, group: int = 32) -> tuple[jax.Array, jax.Array]:
    """Per-`group` e4m3 quantisation of the last dim with UE8M0 scales.

    Returns `(values float8_e4m3fn [..., D], exponents uint8 [..., D // group])`; dequantise as
    `values * 2^(exponent - 127)`. Scale rule as the fp8 cache formats: `2^ceil(log2(max(amax,
    1e-4) / 448))`.
    """
    D = x.shape[-1]
    if D % group:
        raise ValueError(f"last dim {D} must be a multiple of group={group}")
    xf = x.astype(_F32).reshape(x.shape[:-1] + (D // group, group))
    amax = jnp.max(jnp.abs(xf), axis=-1)
    e = jnp.ceil(jnp.log2(jnp.maximum(amax, 1e-4) / 448.0))
    vals = jnp.clip(xf * jnp.exp2(-e)[..., None], -448.0, 448.0).astype(jnp.float8_e4m3fn)
    return vals.reshape(x.shape), jnp.clip(e + 127, 0, 255).astype(jnp.uint8)


def mega_finish(out: jax.Array, positions: jax.Array, cos_sin_cache: jax.Array, lse: jax.Array):
    """The mega ops' output stage: inverse RoPE of the float32 `out`'s last 64 dims, then e4m3 with UE8M0
    exponents per 32 dims. Returns `(out e4m3, out_scale uint8, lse)`."""
    from dsv41_jax.rope import apply_inverse_rope

    out = apply_inverse_rope(out.astype(_F32), positions, cos_sin_cache)
    vals, exps = quantize_output_fp8(out)
    return vals, exps, lse


def mega_decode(c: MegaDecodeCall) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`sparse_mla_mega_decode` of a checked call: RoPE of q (kept bf16), the decode with its output kept float32,
    `mega_finish`. Returns `(out e4m3 [T, h_q, 512], out_scale uint8 [T, h_q, 16], lse f32 [T, h_q])`."""
    from dsv41_jax.rope import apply_rope

    q = apply_rope(c.decode.q[:, 0], c.positions, c.cos_sin_cache)
    out, lse = decode_f32(dataclasses.replace(c.decode, q=q[:, None]))
    return mega_finish(out[:, 0], c.positions, c.cos_sin_cache, lse[:, 0])


def mega_prefill(c: MegaPrefillCall) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`sparse_mla_mega_prefill` of a checked call: RoPE of q (kept bf16), the prefill with its output kept float32,
    `mega_finish`. Returns `(out e4m3 [s_q, h_q, 512], out_scale uint8 [s_q, h_q, 16], lse f32 [s_q, h_q])`."""
    from dsv41_jax.rope import apply_rope

    q = apply_rope(c.prefill.q, c.positions, c.cos_sin_cache)
    out, _, lse = prefill_f32(dataclasses.replace(c.prefill, q=q))
    return mega_finish(out, c.positions, c.cos_sin_cache, lse)
