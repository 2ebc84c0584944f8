"""The RoPE cos/sin tables of a model: plain RoPE on sliding-window-only layers, YaRN on compressed layers."""

from __future__ import annotations

import dataclasses

import jax

from dsv41_jax.model.config import DeepseekV4AttentionConfig, LayerRole
from dsv41_jax.rope import cos_sin_cache

__all__ = ["RopeTables", "make_rope_tables"]


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
