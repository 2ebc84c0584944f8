"""GPT-J (interleaved-pair) rotary embeddings on the last 64 dims of a 512-d head, with YaRN.

`cos_sin_cache(max_pos, rope_dim=64, theta=..., scaling=...)` returns float32
`[max_pos, rope_dim]` rows `[cos(rope_dim/2) | sin(rope_dim/2)]`, vLLM's layout. Pair i of the
rotated slice is `(x[2i], x[2i+1])`, turned by `pos * inv_freq[i]`. YaRN (DeepSeek's form, no
attention mscale) blends interpolated and original frequencies across a linear ramp between
the correction dims of `beta_fast` and `beta_slow` rotations over the original context.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from dsv41_jax.model.config import RopeScaling

__all__ = ["inv_frequencies", "cos_sin_cache", "apply_rope", "apply_inverse_rope"]


def inv_frequencies(rope_dim: int, theta: float, scaling: RopeScaling | None = None) -> np.ndarray:
    """float64 `[rope_dim // 2]` inverse frequencies, YaRN-blended when `scaling.enabled`."""
    if rope_dim <= 0 or rope_dim % 2:
        raise ValueError(f"rope_dim must be a positive even int, got {rope_dim}")
    if theta <= 0:
        raise ValueError(f"theta must be > 0, got {theta}")
    half = rope_dim // 2
    freqs = 1.0 / (theta ** (np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim))
    if scaling is None or not scaling.enabled:
        return freqs

    def correction_dim(rotations: float) -> float:
        # the dim whose wavelength fits `rotations` times into the original context
        return rope_dim * math.log(scaling.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
            2 * math.log(theta)
        )

    low = max(math.floor(correction_dim(scaling.beta_fast)), 0)
    high = min(math.ceil(correction_dim(scaling.beta_slow)), rope_dim - 1)
    if high == low:
        high += 0.001
    ramp = np.clip((np.arange(half, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    keep = 1.0 - ramp  # 1: high-frequency dims keep their frequency; 0: interpolated by `factor`
    return freqs / scaling.factor * (1.0 - keep) + freqs * keep


def cos_sin_cache(max_pos: int, rope_dim: int = 64, *, theta: float, scaling: RopeScaling | None = None) -> jax.Array:
    """float32 `[max_pos, rope_dim]`: `[cos | sin]` of `pos * inv_freq` for pos in [0, max_pos)."""
    if max_pos <= 0:
        raise ValueError(f"max_pos must be > 0, got {max_pos}")
    ang = np.arange(max_pos, dtype=np.float64)[:, None] * inv_frequencies(rope_dim, theta, scaling)[None, :]
    return jnp.asarray(np.concatenate([np.cos(ang), np.sin(ang)], axis=-1), jnp.float32)


def _rotate(x: jax.Array, positions: jax.Array, cache: jax.Array, sign: float) -> jax.Array:
    rope_dim = cache.shape[-1]
    if x.shape[-1] < rope_dim:
        raise ValueError(f"x's last dim ({x.shape[-1]}) must be >= the rope dim {rope_dim}")
    pos = jnp.clip(jnp.asarray(positions, jnp.int32), 0, cache.shape[0] - 1)
    cs = cache[pos]  # [..., rope_dim]
    half = rope_dim // 2
    cos, sin = cs[..., :half], sign * cs[..., half:]
    # broadcast over any axes between the positions' and the feature axis (e.g. heads)
    extra = x.ndim - 1 - pos.ndim
    cos = cos.reshape(cos.shape[:-1] + (1,) * extra + (half,))
    sin = sin.reshape(sin.shape[:-1] + (1,) * extra + (half,))
    nope, rope = x[..., :-rope_dim], x[..., -rope_dim:].astype(jnp.float32)
    a, b = rope[..., 0::2], rope[..., 1::2]
    ra, rb = a * cos - b * sin, a * sin + b * cos
    out = jnp.stack([ra, rb], axis=-1).reshape(rope.shape).astype(x.dtype)
    return jnp.concatenate([nope, out], axis=-1)


def apply_rope(x: jax.Array, positions: jax.Array, cache: jax.Array) -> jax.Array:
    """Rotate the last `rope_dim` dims of `x [*pos_shape, ..., D]` by each token's position.

    `positions` int `[*pos_shape]` indexes `cache` (clamped into range); math in float32, the
    result keeps x's dtype.
    """
    return _rotate(x, positions, cache, 1.0)


def apply_inverse_rope(x: jax.Array, positions: jax.Array, cache: jax.Array) -> jax.Array:
    """Undo `apply_rope` (rotate by `-pos`)."""
    return _rotate(x, positions, cache, -1.0)
