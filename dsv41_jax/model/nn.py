"""Flax NNX modules of a DeepSeek-V4.1 decoder: the attention layer and a minimal model around it.

Each module's `__call__` is its forward pass over one paged engine step (`dsv41_jax.model.step`): the
model embeds the step's tokens and runs its decoder layers; a layer runs its attention, then residual
and MLP; the attention projects q and the latents, writes the caches, selects the compressed entries
and calls the sparse attention op. The dense oracle (`dsv41_jax.model.dense`: a whole sequence, no
cache) calls the same projection methods, so both paths share every weight and every rounding but the
attention itself.

Attention layer (V4.1, as vLLM runs it: no per-head q norm):
- q: `qr = q_norm(wq_a x)`, `q = wq_b qr` -> `[H, 512]`, GPT-J RoPE on the last 64 dims;
- SWA latent: `kv = kv_norm(wkv x)`, RoPE'd; K = V = this 512-d vector;
- compressor (kv-source layers only): ratio 1 `latent = norm(wkv_c x)`; ratio 2 pools each pair
  of tokens with a per-dim softmax gate, `norm(sum_t softmax_t(wgate x_t) * wkv x_t)`; the latent
  is RoPE'd at the group's first position `g * r`;
- indexer (index-source layers): `q_I = wq_b_I(qr)` RoPE'd, `w = weights_proj(x) / sqrt(d_I * H_I)`,
  `score[t] = sum_h relu(q_I[h] . k_I[t]) w[h]` with `k_I = rope(k_norm(wk(latent)), g * r)` owned
  by the kv-source layer (`dsv41_jax.model.indexer`);
- output: inverse RoPE, `wo_a` per group of heads, `wo_b`.
RoPE: `compress_rope_theta` + YaRN on compressed layers (ratio 1, 2), plain `rope_theta` on ratio 0.
The MLP is a dense SwiGLU standing in for DeepSeek's MoE. MTP layers are not part of this model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import nnx

from dsv41_jax.kv_cache import LATENT_DIM
from dsv41_jax.model.config import DeepseekV4AttentionConfig, LayerRole
from dsv41_jax.model.indexer import Selections, select_for_layer
from dsv41_jax.rope import apply_inverse_rope, apply_rope

if TYPE_CHECKING:
    from dsv41_jax.model.step import StepContext

__all__ = ["RMSNorm", "Dense", "Compressor", "Indexer", "DeepseekV41Attention", "MLP", "DecoderLayer",
           "DeepseekV41Model"]

_F32 = jnp.float32


class RMSNorm(nnx.Module):
    """`x * rsqrt(mean(x^2) + eps) * weight`, in float32."""

    def __init__(self, dim: int, eps: float, *, param_dtype=jnp.float32):
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(_F32)
        return xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps) * self.weight[...].astype(_F32)


class Dense(nnx.Module):
    """`y = x @ kernel`, kernel `[in, out]` (the transpose of a torch Linear weight); float32 math."""

    def __init__(self, in_dim: int, out_dim: int, *, rngs: nnx.Rngs, param_dtype=jnp.float32, scale: float = 1.0):
        std = scale / (in_dim ** 0.5)
        self.kernel = nnx.Param((jax.random.normal(rngs.params(), (in_dim, out_dim), _F32) * std).astype(param_dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        return jnp.dot(x.astype(_F32), self.kernel[...].astype(_F32), precision=jax.lax.Precision.HIGHEST)


class Compressor(nnx.Module):
    """The kv-source layer's compressor: one 512-d latent per group of `ratio` tokens."""

    def __init__(self, cfg: DeepseekV4AttentionConfig, ratio: int, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
        self.ratio = ratio
        self.wkv = Dense(cfg.hidden_size, cfg.head_dim, rngs=rngs, param_dtype=param_dtype)
        self.wgate = Dense(cfg.hidden_size, cfg.head_dim, rngs=rngs, param_dtype=param_dtype) if ratio > 1 else None
        self.norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, param_dtype=param_dtype)

    def rows(self, x: jax.Array) -> jax.Array:
        """Per-token pooling inputs float32 `[..., 2, 512]`: (value, gate score); gate 0 for ratio 1."""
        v = self.wkv(x)
        g = self.wgate(x) if self.wgate is not None else jnp.zeros_like(v)
        return jnp.stack([v, g], axis=-2)

    def pool(self, rows: jax.Array) -> jax.Array:
        """`rows [..., ratio, 2, 512]` of one group -> normed latent float32 `[..., 512]`."""
        v, g = rows[..., 0, :], rows[..., 1, :]
        w = jax.nn.softmax(g, axis=-2)  # per dim, over the group's tokens
        return self.norm(jnp.sum(w * v, axis=-2))


class Indexer(nnx.Module):
    """Index-source layer's top-k scorer; `wk` / `k_norm` exist only on kv-source layers."""

    def __init__(self, cfg: DeepseekV4AttentionConfig, owns_k: bool, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
        self.n_heads, self.head_dim = cfg.index_n_heads, cfg.index_head_dim
        self.wq_b = Dense(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim, rngs=rngs, param_dtype=param_dtype)
        self.weights_proj = Dense(cfg.hidden_size, cfg.index_n_heads, rngs=rngs, param_dtype=param_dtype)
        self.wk = Dense(cfg.head_dim, cfg.index_head_dim, rngs=rngs, param_dtype=param_dtype) if owns_k else None
        self.k_norm = RMSNorm(cfg.index_head_dim, cfg.rms_norm_eps, param_dtype=param_dtype) if owns_k else None


class DeepseekV41Attention(nnx.Module):
    """One V4.1 attention layer; its role (`cfg.layer_role(layer_id)`) decides which sub-modules exist."""

    def __init__(self, cfg: DeepseekV4AttentionConfig, layer_id: int, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
        role = cfg.layer_role(layer_id)
        self.cfg = cfg
        self.role = role
        self.layer_id = layer_id
        H, D, G = cfg.num_attention_heads, cfg.head_dim, cfg.o_groups
        self.wq_a = Dense(cfg.hidden_size, cfg.q_lora_rank, rngs=rngs, param_dtype=param_dtype)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, param_dtype=param_dtype)
        self.wq_b = Dense(cfg.q_lora_rank, H * D, rngs=rngs, param_dtype=param_dtype)
        self.wkv = Dense(cfg.hidden_size, D, rngs=rngs, param_dtype=param_dtype)
        self.kv_norm = RMSNorm(D, cfg.rms_norm_eps, param_dtype=param_dtype)
        self.attn_sink = nnx.Param((jax.random.normal(rngs.params(), (H,), _F32) * 0.5).astype(_F32))
        wo_a = jax.random.normal(rngs.params(), (G, cfg.o_lora_rank, H * D // G), _F32) / (H * D // G) ** 0.5
        self.wo_a = nnx.Param(wo_a.astype(param_dtype))
        self.wo_b = Dense(G * cfg.o_lora_rank, cfg.hidden_size, rngs=rngs, param_dtype=param_dtype)
        self.compressor = Compressor(cfg, role.compress_ratio, rngs=rngs, param_dtype=param_dtype) \
            if role.owns_compressed_cache else None
        self.indexer = Indexer(cfg, role.owns_compressed_cache, rngs=rngs, param_dtype=param_dtype) \
            if role.owns_indexer else None

    def q_and_qr(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Unroped q float32 `[..., H, 512]` and the normed q-LoRA activation `qr`."""
        qr = self.q_norm(self.wq_a(x))
        q = self.wq_b(qr)
        return q.reshape(q.shape[:-1] + (-1, LATENT_DIM)), qr

    def swa_latent(self, x: jax.Array) -> jax.Array:
        """Unroped SWA latent float32 `[..., 512]`."""
        return self.kv_norm(self.wkv(x))

    def project(self, h: jax.Array, pos: jax.Array, cos_sin: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """RoPE'd q bf16 `[T, H, 512]` (the attention ops take bf16), the q-LoRA activation `qr` and the RoPE'd
        SWA latent float32 `[T, 512]` of normed hidden states `h [T, hidden]` at positions `pos`."""
        q, qr = self.q_and_qr(h)
        q = apply_rope(q, pos, cos_sin).astype(jnp.bfloat16)
        kv = apply_rope(self.swa_latent(h), pos, cos_sin)
        return q, qr, kv

    def output(self, o: jax.Array) -> jax.Array:
        """Inverse-RoPE'd attention output `[..., H, 512]` -> hidden `[..., hidden]`."""
        G, R, F = self.wo_a.shape
        grouped = o.astype(_F32).reshape(o.shape[:-2] + (G, F))
        z = jnp.einsum("...gf,grf->...gr", grouped, self.wo_a[...].astype(_F32), precision=jax.lax.Precision.HIGHEST)
        return self.wo_b(z.reshape(z.shape[:-2] + (G * R,)))

    def output_projection(self, o: jax.Array, pos: jax.Array, cos_sin: jax.Array) -> jax.Array:
        """Attention output `[T, H, 512]` (RoPE'd, as the op returns it) -> hidden float32 `[T, hidden]`."""
        return self.output(apply_inverse_rope(o.astype(_F32), pos, cos_sin))

    def __call__(self, h: jax.Array, step: "StepContext", caches: dict,
                 selections: Selections) -> tuple[jax.Array, dict, Selections]:
        """The layer's attention in one paged engine step.

        `h`: normed hidden states float32 `[T, hidden]` of the step's packed tokens; `step`: the step's
        metadata, RoPE tables, attention ops and cache operations; `caches`: the engine's cache pytree
        (this layer writes its own entries and reads its kv source's); `selections`: the top-k of the index
        sources before it. Returns the attention's hidden output float32 `[T, hidden]`, the updated caches
        and the selections with this layer's added when it is an index source.
        """
        role, pos = self.role, step.positions
        cos_sin = step.tables.for_role(role)
        with jax.named_scope("qkv_proj"):
            q, qr, kv = self.project(h, pos, cos_sin)
            caches = step.write_swa(caches, role, kv.astype(jnp.bfloat16))
        topk = None
        if role.compress_ratio:
            if role.owns_compressed_cache:
                with jax.named_scope("compressor"):
                    caches = step.write_compressed(caches, self, h, cos_sin)
            if role.owns_indexer:
                num_visible = step.num_visible_compressed(role.compress_ratio)
                with jax.named_scope("indexer"):
                    keys = step.index_keys(caches, role)
                    selections = select_for_layer(self, role, self.cfg, h, qr, pos, cos_sin, keys, num_visible,
                                                  selections)
            topk = selections.topk[role.index_source_layer]
        with jax.named_scope("sparse_attention"):
            out = step.attend(q, caches, role, topk, self.attn_sink[...])
        # the residual and MLP after it run under this scope too (`DecoderLayer`), as profiles group them
        with jax.named_scope("o_proj"):
            return self.output_projection(out, pos, cos_sin), caches, selections


class MLP(nnx.Module):
    """Dense SwiGLU (stands in for the MoE)."""

    def __init__(self, hidden: int, inter: int, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
        self.gate_proj = Dense(hidden, inter, rngs=rngs, param_dtype=param_dtype)
        self.up_proj = Dense(hidden, inter, rngs=rngs, param_dtype=param_dtype)
        self.down_proj = Dense(inter, hidden, rngs=rngs, param_dtype=param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    """Pre-norm attention and MLP, each with a residual."""

    def __init__(self, cfg: DeepseekV4AttentionConfig, layer_id: int, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=param_dtype)
        self.self_attn = DeepseekV41Attention(cfg, layer_id, rngs=rngs, param_dtype=param_dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=param_dtype)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, rngs=rngs, param_dtype=param_dtype)

    def feed_forward(self, x: jax.Array, attn_hidden: jax.Array) -> jax.Array:
        """Residual + MLP after the layer's attention output `attn_hidden`."""
        x = x + attn_hidden
        return x + self.mlp(self.post_attention_layernorm(x))

    def __call__(self, x: jax.Array, step: "StepContext", caches: dict,
                 selections: Selections) -> tuple[jax.Array, dict, Selections]:
        """The layer over one paged engine step (see `DeepseekV41Attention.__call__`): hidden states
        float32 `[T, hidden]` in and out, with the updated caches and selections."""
        role = self.self_attn.role
        with jax.named_scope(f"layer{role.layer_id}_{role.layer_type}"):
            attn_hidden, caches, selections = self.self_attn(self.input_layernorm(x), step, caches, selections)
            with jax.named_scope("o_proj"):
                return self.feed_forward(x, attn_hidden), caches, selections


class DeepseekV41Model(nnx.Module):
    """Embedding, `num_hidden_layers` decoder layers, final norm, LM head."""

    def __init__(self, cfg: DeepseekV4AttentionConfig, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
        if cfg.version != "v4.1":
            raise ValueError(f"DeepseekV41Model needs a V4.1 config, got version {cfg.version!r}")
        self.cfg = cfg
        self.embed_tokens = nnx.Param(jax.random.normal(rngs.params(), (cfg.vocab_size, cfg.hidden_size), _F32).astype(param_dtype))
        self.layers = nnx.List([DecoderLayer(cfg, i, rngs=rngs, param_dtype=param_dtype) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=param_dtype)
        self.lm_head = Dense(cfg.hidden_size, cfg.vocab_size, rngs=rngs, param_dtype=param_dtype)

    def roles(self) -> tuple[LayerRole, ...]:
        return tuple(self.cfg.layer_role(i) for i in range(self.cfg.num_hidden_layers))

    def embed(self, tokens: jax.Array) -> jax.Array:
        """Hidden states float32 `[T, hidden]` of token ids `[T]`."""
        return self.embed_tokens[...].astype(_F32)[tokens]

    def logits(self, x: jax.Array) -> jax.Array:
        """Logits float32 `[T, vocab]` of the last layer's hidden states."""
        return self.lm_head(self.norm(x))

    def __call__(self, tokens: jax.Array, step: "StepContext", caches: dict) -> tuple[jax.Array, dict]:
        """One paged engine step: logits float32 `[T, vocab]` of the step's packed tokens `int32 [T]`, and
        the caches with the step's entries written (`dsv41_jax.model.step` builds `step`)."""
        x = self.embed(tokens)
        selections = Selections()
        for layer in self.layers:
            x, caches, selections = layer(x, step, caches, selections)
        return self.logits(x), caches
