"""The dense forward pass: one whole sequence, no cache, explicit masks; the oracle of the paged engine.

`dense_forward(model, tokens)` must give what the paged engine (`dsv41_jax.model.engine`) gives for the
same tokens. It shares the modules' projections, the compressor's pooling and the indexer's selection
rules (`dsv41_jax.model.indexer`) with the engine, and writes its own attention: every key of a token is
explicit (the window's SWA latents plus the selected compressed entries) and one softmax with the
layer's sink covers them. Every rounding that a cache would apply is applied here too (`kv_format`: the
SWA latent and the compressed latent go through the cache format's quantise / dequantise; q and the
attention output are rounded to bf16, as the public ops take and return bf16).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv41_jax import kv_cache as kvc
from dsv41_jax.kv_cache import LATENT_DIM
from dsv41_jax.model.indexer import Selections, index_keys, select_for_layer
from dsv41_jax.model.nn import DecoderLayer, DeepseekV41Model
from dsv41_jax.model.rope_tables import RopeTables, make_rope_tables
from dsv41_jax.rope import apply_rope

__all__ = ["cache_roundtrip", "dense_forward", "decoder_tail"]

_F32 = jnp.float32
_HI = jax.lax.Precision.HIGHEST


def cache_roundtrip(x: jax.Array, kv_format: str) -> jax.Array:
    """What a cache in `kv_format` gives back for latents `x [..., 512]` (float32 out)."""
    xb = x.astype(jnp.bfloat16)
    if kv_format == "bf16":
        return xb.astype(_F32)
    return kvc.dequantize(kvc.quantize(xb.reshape(-1, LATENT_DIM), kv_format), kv_format).reshape(x.shape).astype(_F32)


def decoder_tail(layer: DecoderLayer, x: jax.Array, attn_out_hidden: jax.Array) -> jax.Array:
    """Residual + MLP after the attention of one decoder layer (`DecoderLayer.feed_forward`)."""
    return layer.feed_forward(x, attn_out_hidden)


def _window_mask(pos: jax.Array, window: int) -> jax.Array:
    """bool `[L, L]`: key position j is in query position i's window `[i - W + 1, i]`."""
    return (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)


def _selection_mask(topk: jax.Array, num_groups: int) -> jax.Array:
    """bool `[L, num_groups]` of the compressed entries in each token's selection (-1 entries select none)."""
    num_tokens = topk.shape[0]
    mask = jnp.zeros((num_tokens, num_groups + 1), bool)
    mask = mask.at[jnp.arange(num_tokens)[:, None], jnp.where(topk >= 0, topk, num_groups)].set(True)
    return mask[:, :num_groups]


def _masked_attention(q: jax.Array, keys: jax.Array, mask: jax.Array, attn_sink: jax.Array,
                      softmax_scale: float) -> jax.Array:
    """Softmax attention with a per-head sink of q `[L, H, 512]` over keys = values `[N, 512]` where
    `mask [L, N]`; the output float32 `[L, H, 512]` is rounded to bf16, as the ops return it."""
    s = jnp.einsum("lhd,nd->lhn", q, keys, precision=_HI) * softmax_scale
    s = jnp.where(mask[:, None, :], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - m)
    denom = jnp.sum(p, axis=-1)
    o = jnp.einsum("lhn,nd->lhd", p, keys, precision=_HI) / denom[..., None]
    lse = m[..., 0] + jnp.log(denom)
    o = o / (1.0 + jnp.exp(attn_sink[None, :] - lse))[..., None]
    return o.astype(jnp.bfloat16)


def dense_forward(model: DeepseekV41Model, tokens: jax.Array, *, kv_format: str = "bf16",
                  comp_kv_format: str | None = None, tables: RopeTables | None = None) -> jax.Array:
    """Logits float32 `[L, vocab]` of one sequence `tokens int [L]`, no cache, explicit masks.

    Attention per layer: keys = the window `[pos - W + 1, pos]` of SWA latents plus the compressed
    entries selected by the layer's index source, one softmax with the layer's sink.
    """
    cfg = model.cfg
    comp_format = kv_format if comp_kv_format is None else comp_kv_format
    length = tokens.shape[0]
    tables = tables or make_rope_tables(cfg, max(length, 1))
    pos = jnp.arange(length)
    x = model.embed(tokens)
    compressed: dict[int, tuple[jax.Array, jax.Array]] = {}  # kv source -> (latents [Ng, 512], index keys)
    selections = Selections()
    for layer, role in zip(model.layers, model.roles()):
        attn = layer.self_attn
        cos_sin = tables.for_role(role)
        h = layer.input_layernorm(x)
        q, qr, kv = attn.project(h, pos, cos_sin)
        q = q.astype(_F32)
        keys = [cache_roundtrip(kv, kv_format)]  # [L, 512]
        masks = [_window_mask(pos, cfg.sliding_window)]
        if role.compress_ratio:
            ratio = role.compress_ratio
            if role.owns_compressed_cache:
                num_groups = length // ratio
                rows = attn.compressor.rows(h[: num_groups * ratio]).reshape(num_groups, ratio, 2, LATENT_DIM)
                latent = attn.compressor.pool(rows)
                group_pos = jnp.arange(num_groups) * ratio
                compressed[role.layer_id] = (cache_roundtrip(apply_rope(latent, group_pos, cos_sin), comp_format),
                                             index_keys(attn, latent, group_pos, cos_sin))
            latents, ikeys = compressed[role.kv_source_layer]
            if role.owns_indexer:
                selections = select_for_layer(attn, role, cfg, h, qr, pos, cos_sin, ikeys, (pos + 1) // ratio,
                                              selections)
            keys.append(latents)
            masks.append(_selection_mask(selections.topk[role.index_source_layer], latents.shape[0]))
        o = _masked_attention(q, jnp.concatenate(keys, axis=0), jnp.concatenate(masks, axis=1), attn.attn_sink[...],
                              cfg.softmax_scale)
        x = layer.feed_forward(x, attn.output_projection(o, pos, cos_sin))
    return model.logits(x)
