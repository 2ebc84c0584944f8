"""The indexer's selection rules, shared by the dense forward and the paged engine.

A token at position `pos` of a layer with ratio r sees compressed entries `g < (pos + 1) // r`. When it
sees at most `index_topk` of them it selects them all (vLLM's short-context shortcut); otherwise the
`index_topk` highest scores. The candidate-source layer publishes, per token, the `candidate_topk_blocks`
blocks of `candidate_block_size` entries with the highest block score (the max over the block's visible
entries; DeepSeek's exact V4.1 block score is not public, the max is this library's choice); index sources
after it score only candidate entries.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from dsv41_jax.model.config import DeepseekV4AttentionConfig, LayerRole
from dsv41_jax.rope import apply_rope

if TYPE_CHECKING:
    from dsv41_jax.model.nn import DeepseekV41Attention

__all__ = ["Selections", "index_query", "index_keys", "index_scores", "candidate_mask", "select_topk",
           "select_for_layer", "run_indexer"]

_HI = jax.lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class Selections:
    """What the index sources of one forward pass have chosen so far, for the layers after them.

    `topk`: index-source layer id -> its selection int32 `[T, index_topk]` (local positions, -1 pad);
    `candidates`: candidate-source layer id -> its candidate mask bool `[T, N]`.
    """

    topk: Mapping[int, jax.Array] = dataclasses.field(default_factory=dict)
    candidates: Mapping[int, jax.Array] = dataclasses.field(default_factory=dict)

    def with_layer(self, layer_id: int, topk: jax.Array, candidates: jax.Array | None) -> "Selections":
        cands = dict(self.candidates) if candidates is None else {**self.candidates, layer_id: candidates}
        return Selections({**self.topk, layer_id: topk}, cands)


def index_query(attn: "DeepseekV41Attention", h: jax.Array, qr: jax.Array, pos: jax.Array, cs: jax.Array):
    """Indexer query `[..., H_I, d_I]` (RoPE'd) and head weights `[..., H_I]`."""
    ix = attn.indexer
    iq = ix.wq_b(qr).reshape(qr.shape[:-1] + (ix.n_heads, ix.head_dim))
    iq = apply_rope(iq, pos, cs)
    w = ix.weights_proj(h) * (ix.head_dim ** -0.5 * ix.n_heads ** -0.5)
    return iq, w


def index_keys(attn: "DeepseekV41Attention", latent: jax.Array, group_pos: jax.Array, cs: jax.Array) -> jax.Array:
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


def select_for_layer(attn: "DeepseekV41Attention", role: LayerRole, cfg: DeepseekV4AttentionConfig, h: jax.Array,
                     qr: jax.Array, pos: jax.Array, cs: jax.Array, keys: jax.Array, n_visible: jax.Array,
                     selections: Selections) -> Selections:
    """`selections` with an index-source layer's top-k over `keys [T, N, d]` or `[N, d]` added (and, on the
    candidate source, its candidate mask); a layer after the candidate source scores only its candidates."""
    iq, w = index_query(attn, h, qr, pos, cs)
    scores = index_scores(iq, w, keys)
    visible = jnp.arange(scores.shape[1])[None, :] < n_visible[:, None]
    allowed = candidates = None
    if role.is_candidate_source:
        candidates = candidate_mask(scores, visible, num_blocks=cfg.candidate_topk_blocks,
                                    block=cfg.candidate_block_size)
    elif role.candidate_source_layer is not None:
        allowed = selections.candidates[role.candidate_source_layer]
    return selections.with_layer(role.layer_id, select_topk(scores, n_visible, cfg.index_topk, allowed), candidates)


def run_indexer(attn: "DeepseekV41Attention", role: LayerRole, cfg: DeepseekV4AttentionConfig, h: jax.Array,
                qr: jax.Array, pos: jax.Array, cs: jax.Array, keys: jax.Array, n_visible: jax.Array,
                candidates: dict[int, jax.Array]) -> jax.Array:
    """An index-source layer's selection int32 `[T, index_topk]` (`select_for_layer` on a plain dict).

    The candidate source records its candidate mask in `candidates`; later index sources read it.
    """
    out = select_for_layer(attn, role, cfg, h, qr, pos, cs, keys, n_visible, Selections({}, dict(candidates)))
    candidates.update(out.candidates)
    return out.topk[role.layer_id]
