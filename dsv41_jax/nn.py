"""Flax NNX modules of a DeepSeek-V4.1 decoder: the attention layer and a minimal model around it.

Parameters only; the math that depends on how tokens arrive lives in `dsv41_jax.model`
(`dense_forward`: a whole sequence, no cache) and `dsv41_jax.engine` (paged caches, one step at a
time). Both call the same projection methods defined here, so they share every weight and every
rounding step but the attention itself.

Attention layer (V4.1, as vLLM runs it: no per-head q norm):
- q: `qr = q_norm(wq_a x)`, `q = wq_b qr` -> `[H, 512]`, GPT-J RoPE on the last 64 dims;
- SWA latent: `kv = kv_norm(wkv x)`, RoPE'd; K = V = this 512-d vector;
- compressor (kv-source layers only): ratio 1 `latent = norm(wkv_c x)`; ratio 2 pools each pair
  of tokens with a per-dim softmax gate, `norm(sum_t softmax_t(wgate x_t) * wkv x_t)`; the latent
  is RoPE'd at the group's first position `g * r`;
- indexer (index-source layers): `q_I = wq_b_I(qr)` RoPE'd, `w = weights_proj(x) / sqrt(d_I * H_I)`,
  `score[t] = sum_h relu(q_I[h] . k_I[t]) w[h]` with `k_I = rope(k_norm(wk(latent)), g * r)` owned
  by the kv-source layer;
- output: inverse RoPE, `wo_a` per group of heads, `wo_b`.
RoPE: `compress_rope_theta` + YaRN on compressed layers (ratio 1, 2), plain `rope_theta` on ratio 0.
The MLP is a dense SwiGLU standing in for DeepSeek's MoE. MTP layers are not part of this model.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsv41_jax.config import DeepseekV4AttentionConfig, LayerRole

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
    """Parameters of one V4.1 attention layer (its role decides which sub-modules exist)."""

    def __init__(self, cfg: DeepseekV4AttentionConfig, layer_id: int, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
        role = cfg.layer_role(layer_id)
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
        return q.reshape(q.shape[:-1] + (-1, 512)), qr

    def swa_latent(self, x: jax.Array) -> jax.Array:
        """Unroped SWA latent float32 `[..., 512]`."""
        return self.kv_norm(self.wkv(x))

    def output(self, o: jax.Array) -> jax.Array:
        """Inverse-RoPE'd attention output `[..., H, 512]` -> hidden `[..., hidden]`."""
        G, R, F = self.wo_a.shape
        grouped = o.astype(_F32).reshape(o.shape[:-2] + (G, F))
        z = jnp.einsum("...gf,grf->...gr", grouped, self.wo_a[...].astype(_F32), precision=jax.lax.Precision.HIGHEST)
        return self.wo_b(z.reshape(z.shape[:-2] + (G * R,)))


class MLP(nnx.Module):
    """Dense SwiGLU (stands in for the MoE)."""

    def __init__(self, hidden: int, inter: int, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
        self.gate_proj = Dense(hidden, inter, rngs=rngs, param_dtype=param_dtype)
        self.up_proj = Dense(hidden, inter, rngs=rngs, param_dtype=param_dtype)
        self.down_proj = Dense(inter, hidden, rngs=rngs, param_dtype=param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: DeepseekV4AttentionConfig, layer_id: int, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=param_dtype)
        self.self_attn = DeepseekV41Attention(cfg, layer_id, rngs=rngs, param_dtype=param_dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=param_dtype)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, rngs=rngs, param_dtype=param_dtype)


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
