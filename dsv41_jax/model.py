"""Pieces of the V4.1 forward pass shared by the dense (no-cache) path and the paged engine.

`dense_forward(model, tokens)` runs one whole sequence with explicit masks and no cache: it is
the oracle that the paged engine (`dsv41_jax.engine`) must reproduce. Every rounding that a cache
would apply is applied here too (`kv_format`: the SWA latent and the compressed latent go through
the cache format's quantise / dequantise; q and the attention output are rounded to bf16, as the
public ops take and return bf16).

Indexer selection (both paths): a token at position `pos` of a layer with ratio r sees compressed
entries `g < (pos + 1) // r`. When it sees at most `index_topk` of them it selects them all (vLLM's
short-context shortcut); otherwise the `index_topk` highest scores. The candidate-source layer
publishes, per token, the `candidate_topk_blocks` blocks of `candidate_block_size` entries with the
highest block score (the max over the block's visible entries; the exact block score of DeepSeek's
V4.1 is not public, this is our choice); index sources after it score only candidate entries.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dsv41_jax import kv_cache as kvc
from dsv41_jax.config import DeepseekV4AttentionConfig, LayerRole
from dsv41_jax.nn import DeepseekV41Attention, DeepseekV41Model
from dsv41_jax.rope import apply_inverse_rope, apply_rope, cos_sin_cache

__all__ = ["RopeTables", "make_rope_tables", "cache_roundtrip", "index_scores", "candidate_mask", "select_topk",
           "run_indexer", "dense_forward", "decoder_tail"]

_F32 = jnp.float32
_HI = jax.lax.Precision.HIGHEST


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RopeTables:
    """cos/sin caches `[max_pos, 64]`: `plain` for ratio-0 layers, `compressed` (YaRN) for the rest."""

    plain: jax.Array
    compressed: jax.Array

    def for_role(self, role: LayerRole) -> jax.Array:
        return self.compressed if role.compress_ratio else self.plain


def make_rope_tables(cfg: DeepseekV4AttentionConfig, max_pos: int) -> RopeTables:
    return RopeTables(
        plain=cos_sin_cache(max_pos, cfg.qk_rope_head_dim, theta=cfg.rope_theta),
        compressed=cos_sin_cache(max_pos, cfg.qk_rope_head_dim, theta=cfg.compress_rope_theta,
                                 scaling=cfg.rope_scaling),
    )


def cache_roundtrip(x: jax.Array, fmt: str) -> jax.Array:
    """What a cache in `fmt` gives back for latents `x [..., 512]` (float32 out)."""
    xb = x.astype(jnp.bfloat16)
    if fmt == "bf16":
        return xb.astype(_F32)
    return kvc.dequantize(kvc.quantize(xb.reshape(-1, 512), fmt), fmt).reshape(x.shape).astype(_F32)


def index_query(attn: DeepseekV41Attention, h: jax.Array, qr: jax.Array, pos: jax.Array, cs: jax.Array):
    """Indexer query `[..., H_I, d_I]` (RoPE'd) and head weights `[..., H_I]`."""
    ix = attn.indexer
    iq = ix.wq_b(qr).reshape(qr.shape[:-1] + (ix.n_heads, ix.head_dim))
    iq = apply_rope(iq, pos, cs)
    w = ix.weights_proj(h) * (ix.head_dim ** -0.5 * ix.n_heads ** -0.5)
    return iq, w


def index_keys(attn: DeepseekV41Attention, latent: jax.Array, group_pos: jax.Array, cs: jax.Array) -> jax.Array:
    """Index keys `[..., d_I]` float32 from the kv-source compressor's latent, RoPE'd at `g * r`."""
    return apply_rope(attn.indexer.k_norm(attn.indexer.wk(latent)), group_pos, cs)


def index_scores(iq: jax.Array, w: jax.Array, keys: jax.Array) -> jax.Array:
    """`score[t, g] = sum_h relu(iq[t, h] . keys[t?, g]) * w[t, h]`; keys `[T, N, d]` or `[N, d]`."""
    if keys.ndim == 2:
        dots = jnp.einsum("thd,nd->thn", iq, keys, precision=_HI)
    else:
        dots = jnp.einsum("thd,tnd->thn", iq, keys, precision=_HI)
    return jnp.einsum("thn,th->tn", jax.nn.relu(dots), w, precision=_HI)


def candidate_mask(scores: jax.Array, visible: jax.Array, *, num_blocks: int, block: int) -> jax.Array:
    """bool `[T, N]`: entries inside each token's `num_blocks` best blocks (block score = max)."""
    T, N = scores.shape
    nb = -(-N // block)
    s = jnp.where(visible, scores, -jnp.inf)
    s = jnp.pad(s, ((0, 0), (0, nb * block - N)), constant_values=-jnp.inf).reshape(T, nb, block)
    bscore = jnp.max(s, axis=-1)
    k = min(num_blocks, nb)
    top, idx = jax.lax.top_k(bscore, k)
    chosen = jnp.zeros((T, nb), bool).at[jnp.arange(T)[:, None], idx].set(jnp.isfinite(top))
    return jnp.repeat(chosen, block, axis=1)[:, :N] & visible


def select_topk(scores: jax.Array, n_visible: jax.Array, topk: int, allowed: jax.Array | None = None) -> jax.Array:
    """Local positions int32 `[T, topk]` (valid first, -1 pad): all visible entries when there are at most
    `topk`, else the `topk` best scores among `allowed` visible entries."""
    T, N = scores.shape
    g = jnp.arange(N)[None, :]
    vis = g < n_visible[:, None]
    ok = vis if allowed is None else vis & allowed
    s = jnp.where(ok, scores, -jnp.inf)
    if N < topk:
        s = jnp.pad(s, ((0, 0), (0, topk - N)), constant_values=-jnp.inf)
    top, idx = jax.lax.top_k(s, topk)
    picked = jnp.where(jnp.isfinite(top), idx, -1)
    k = jnp.arange(topk)[None, :]
    everything = jnp.where(k < n_visible[:, None], k, -1)
    return jnp.where((n_visible <= topk)[:, None], everything, picked).astype(jnp.int32)


def run_indexer(attn: DeepseekV41Attention, role: LayerRole, cfg: DeepseekV4AttentionConfig, h: jax.Array,
                qr: jax.Array, pos: jax.Array, cs: jax.Array, keys: jax.Array, n_visible: jax.Array,
                candidates: dict[int, jax.Array]) -> jax.Array:
    """An index-source layer's selection int32 `[T, index_topk]` over `keys [T, N, d]` or `[N, d]`.

    The candidate source records its candidate mask in `candidates`; later index sources read it.
    """
    iq, w = index_query(attn, h, qr, pos, cs)
    sc = index_scores(iq, w, keys)
    vis = jnp.arange(sc.shape[1])[None, :] < n_visible[:, None]
    allowed = None
    if role.is_candidate_source:
        candidates[role.layer_id] = candidate_mask(sc, vis, num_blocks=cfg.candidate_topk_blocks,
                                                   block=cfg.candidate_block_size)
    elif role.candidate_source_layer is not None:
        allowed = candidates[role.candidate_source_layer]
    return select_topk(sc, n_visible, cfg.index_topk, allowed)


def decoder_tail(layer, x: jax.Array, attn_out_hidden: jax.Array) -> jax.Array:
    """Residual + MLP after the attention of one decoder layer."""
    x = x + attn_out_hidden
    return x + layer.mlp(layer.post_attention_layernorm(x))


def dense_forward(model: DeepseekV41Model, tokens: jax.Array, *, kv_format: str = "bf16",
                  comp_kv_format: str | None = None, tables: RopeTables | None = None) -> jax.Array:
    """Logits float32 `[L, vocab]` of one sequence `tokens int [L]`, no cache, explicit masks.

    Attention per layer: keys = the window `[pos - W + 1, pos]` of SWA latents plus the compressed
    entries selected by the layer's index source, one softmax with the layer's sink.
    """
    cfg = model.cfg
    cfmt = kv_format if comp_kv_format is None else comp_kv_format
    L = tokens.shape[0]
    tables = tables or make_rope_tables(cfg, max(L, 1))
    pos = jnp.arange(L)
    x = model.embed_tokens[...].astype(_F32)[tokens]
    W = cfg.sliding_window
    comp: dict[int, tuple[jax.Array, jax.Array]] = {}  # kv source -> (main latents [Ng, 512], index keys)
    selected: dict[int, jax.Array] = {}  # index source -> int32 [L, K] local positions
    cands: dict[int, jax.Array] = {}
    for layer, role in zip(model.layers, model.roles()):
        attn = layer.self_attn
        cs = tables.for_role(role)
        h = layer.input_layernorm(x)
        q, qr = attn.q_and_qr(h)
        q = apply_rope(q, pos, cs).astype(jnp.bfloat16).astype(_F32)
        kv = cache_roundtrip(apply_rope(attn.swa_latent(h), pos, cs), kv_format)  # [L, 512]
        keys = [kv]
        win = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - W)
        masks = [win]
        if role.compress_ratio:
            r = role.compress_ratio
            if role.owns_compressed_cache:
                ng = L // r
                rows = attn.compressor.rows(h[: ng * r]).reshape(ng, r, 2, 512)
                latent = attn.compressor.pool(rows)
                gpos = jnp.arange(ng) * r
                main = cache_roundtrip(apply_rope(latent, gpos, cs), cfmt)
                comp[role.layer_id] = (main, index_keys(attn, latent, gpos, cs))
            main, ikeys = comp[role.kv_source_layer]
            n_vis = (pos + 1) // r
            if role.owns_indexer:
                selected[role.layer_id] = run_indexer(attn, role, cfg, h, qr, pos, cs, ikeys, n_vis, cands)
            sel = selected[role.index_source_layer]
            ng = main.shape[0]
            m = jnp.zeros((L, ng + 1), bool).at[jnp.arange(L)[:, None], jnp.where(sel >= 0, sel, ng)].set(True)
            keys.append(main)
            masks.append(m[:, :ng])
        kall = jnp.concatenate(keys, axis=0)
        mall = jnp.concatenate(masks, axis=1)
        s = jnp.einsum("lhd,nd->lhn", q, kall, precision=_HI) * cfg.softmax_scale
        s = jnp.where(mall[:, None, :], s, -jnp.inf)
        m = jnp.max(s, axis=-1, keepdims=True)
        p = jnp.exp(s - m)
        l = jnp.sum(p, axis=-1)
        o = jnp.einsum("lhn,nd->lhd", p, kall, precision=_HI) / l[..., None]
        lse = m[..., 0] + jnp.log(l)
        o = o / (1.0 + jnp.exp(attn.attn_sink[...][None, :] - lse))[..., None]
        o = o.astype(jnp.bfloat16).astype(_F32)
        o = apply_inverse_rope(o, pos, cs)
        x = decoder_tail(layer, x, attn.output(o))
    return model.lm_head(model.norm(x))
