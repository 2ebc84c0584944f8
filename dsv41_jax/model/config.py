"""Frozen configuration of DeepSeek-V4 / V4.1 attention, built from a Hugging Face config.

`DeepseekV4AttentionConfig.from_hf_config(source)` takes a flat dict, the composite form (fields under
`text_config`), a path to a `config.json` or a `transformers` config object (`dsv41_jax.model.hf_config`); it
validates every field it reads and raises `ValueError` / `TypeError` naming the key, the expected and the
actual value, and logs the keys it used and ignored on the `dsv41_jax.config` logger (INFO);
`from_hf_config_with_keys` returns them. `layer_role(i)`
resolves a layer's part in the cache-sharing topology (which kv-source layer's compressed
cache it reads, which index-source layer's top-k it uses, whether it owns either).

Presets: `V41_FLASH` (DeepSeek-V4.1-Flash), `V4_FLASH` (DeepSeek-V4-Flash), `TINY` (tests and
examples). V4.1-Flash's RoPE settings are not in its published sources; the preset
assumes V4-Flash's (rope_theta 10000, compress_rope_theta 160000, YaRN factor 16 over 65536).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

from dsv41_jax.kv_cache import LATENT_DIM, NOPE_DIM, ROPE_DIM
from dsv41_jax.model.hf_config import TEXT_CONFIG, HFConfigKeys, KeyRecorder, resolve_hf_config
from dsv41_jax.model.layer_types import deepseek_v40_layer_type, deepseek_v41_layer_type

__all__ = [
    "DeepseekV4AttentionConfig",
    "HFConfigKeys",
    "LayerRole",
    "RopeScaling",
    "V41_FLASH",
    "V4_FLASH",
    "TINY",
    "PRESETS",
    "get_preset",
]

_log = logging.getLogger("dsv41_jax.config")  # the name users configure, whatever the module path

HEAD_DIM = LATENT_DIM  # q and k heads are the MLA latent: NoPE + RoPE dims


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """YaRN rope scaling as DeepSeek configures it (`type: yarn`, mscale off)."""

    factor: float = 1.0
    original_max_position_embeddings: int = 65536
    beta_fast: float = 32.0
    beta_slow: float = 1.0

    @property
    def enabled(self) -> bool:
        return self.factor != 1.0


@dataclasses.dataclass(frozen=True)
class LayerRole:
    """A layer's place in the V4 / V4.1 attention topology.

    compress_ratio: 0 (SWA only), 1 or 2 (V4.1); 0/1, 4, 128 (V4.0).
    kv_source_layer: the layer whose compressed cache this layer reads (itself when it owns
      one), or None for SWA-only layers.
    index_source_layer: the layer whose indexer top-k this layer uses, or None when the layer
      attends every compressed entry (V4.0 C128A) or has no compressed cache.
    candidate_source_layer: the layer publishing candidate blocks that this layer's indexer is
      restricted to (V4.1), or None.
    rope_theta / use_yarn: RoPE base and whether YaRN applies (compressed layers only).
    """

    layer_id: int
    compress_ratio: int
    layer_type: str
    is_mtp: bool
    kv_source_layer: int | None
    index_source_layer: int | None
    candidate_source_layer: int | None
    rope_theta: float
    use_yarn: bool

    @property
    def has_compressed_cache(self) -> bool:
        return self.kv_source_layer is not None

    @property
    def owns_compressed_cache(self) -> bool:
        return self.kv_source_layer == self.layer_id

    @property
    def owns_indexer(self) -> bool:
        return self.index_source_layer == self.layer_id

    @property
    def is_candidate_source(self) -> bool:
        return self.candidate_source_layer == self.layer_id and self.owns_indexer


def _req(d: Mapping[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    if key not in d:
        raise ValueError(f"config is missing required key {key!r}")
    return _typed(key, d[key], kind)


def _typed(key: str, value: Any, kind: type | tuple[type, ...]) -> Any:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if float in kinds and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if isinstance(value, bool) or not isinstance(value, kinds):
        names = " or ".join(k.__name__ for k in kinds)
        raise TypeError(f"config key {key!r} must be {names}, got {type(value).__name__} {value!r}")
    return value


def _int_list(d: Mapping[str, Any], key: str, default: Sequence[int] | None) -> tuple[int, ...]:
    value = d.get(key, default)
    if value is None:
        value = ()
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"config key {key!r} must be a list of int, got {type(value).__name__} {value!r}")
    for v in value:
        _typed(f"{key}[]", v, int)
    return tuple(int(v) for v in value)


def _positive(key: str, value: int | float) -> None:
    if not value > 0:
        raise ValueError(f"config key {key!r} must be > 0, got {value!r}")


@dataclasses.dataclass(frozen=True)
class DeepseekV4AttentionConfig:
    """Attention-relevant hyperparameters of a DeepSeek-V4 (`version="v4.0"`) or V4.1 model.

    Layers are numbered 0 .. num_hidden_layers + num_nextn_predict_layers - 1; the last
    `num_nextn_predict_layers` are MTP layers. `compress_ratios[i]` is layer i's ratio;
    layers beyond the list are ratio 0 (SWA only).
    """

    version: str
    hidden_size: int
    num_hidden_layers: int
    num_nextn_predict_layers: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    sliding_window: int
    compress_ratios: tuple[int, ...]
    kv_source_layer_ids: tuple[int, ...]
    index_source_layer_ids: tuple[int, ...]
    candidate_source_layer_id: int | None
    candidate_topk_blocks: int
    candidate_block_size: int
    index_topk: int
    index_n_heads: int
    index_head_dim: int
    rope_theta: float
    compress_rope_theta: float
    rope_scaling: RopeScaling
    rms_norm_eps: float
    vocab_size: int
    intermediate_size: int
    max_position_embeddings: int

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_hf_config(cls, source: Any) -> "DeepseekV4AttentionConfig":
        """Build and validate from a Hugging Face config (V4.0 or V4.1).

        `source`: a flat dict, a composite dict with the fields under `text_config`, a path to a
        `config.json` (or its directory), or an object with `to_dict()` such as a `transformers` config.
        The version is `dsv4_version` if given, else "v4.1" when the fields carry
        `kv_source_layer_ids` or only ratios in {0, 1, 2}, else "v4.0". The keys used and ignored are
        logged at INFO on the `dsv41_jax.config` logger; `from_hf_config_with_keys` returns them.
        """
        cfg, keys = cls.from_hf_config_with_keys(source)
        if _log.isEnabledFor(logging.INFO):
            _log.info("config from %s: used %d keys %s; ignored %d keys %s", keys.source, len(keys.used),
                      list(keys.used), len(keys.ignored), list(keys.ignored))
        return cfg

    @classmethod
    def from_hf_config_with_keys(cls, source: Any) -> tuple["DeepseekV4AttentionConfig", HFConfigKeys]:
        """`from_hf_config`, also returning which keys of `source` it used and which it ignored."""
        fields, top_ignored, composite, name = resolve_hf_config(source)
        rec = KeyRecorder(fields)
        nested_ignored: list[str] = []
        try:
            cfg = cls._from_fields(rec, nested_ignored)
        except (TypeError, ValueError) as e:
            if not composite:
                raise
            raise type(e)(f"in {TEXT_CONFIG} of the composite config: {e}") from None  # where the key is
        prefix = f"{TEXT_CONFIG}." if composite else ""
        used = tuple(prefix + k for k in rec.used)
        ignored = top_ignored + tuple(prefix + k for k in sorted(rec.ignored + tuple(nested_ignored)))
        return cfg, HFConfigKeys(used=used, ignored=ignored, composite=composite, source=name)

    @classmethod
    def _from_fields(cls, d: Mapping[str, Any], nested_ignored: list[str]) -> "DeepseekV4AttentionConfig":
        ratios = _int_list(d, "compress_ratios", ())
        version = d.get("dsv4_version")
        if version is None:
            has_v41_keys = "kv_source_layer_ids" in d or "index_source_layer_ids" in d
            version = "v4.1" if has_v41_keys or set(ratios) <= {0, 1, 2} else "v4.0"
        if version not in ("v4.0", "v4.1"):
            raise ValueError(f"config key 'dsv4_version' must be 'v4.0' or 'v4.1', got {version!r}")

        head_dim = _typed("head_dim", d.get("head_dim", HEAD_DIM), int)
        rope_dim = _typed("qk_rope_head_dim", d.get("qk_rope_head_dim", ROPE_DIM), int)
        n_layers = _req(d, "num_hidden_layers", int)
        n_mtp = _typed("num_nextn_predict_layers", d.get("num_nextn_predict_layers", 0), int)
        total = n_layers + n_mtp
        if len(ratios) > total:
            raise ValueError(
                f"config key 'compress_ratios' has {len(ratios)} entries, more than "
                f"num_hidden_layers + num_nextn_predict_layers = {total}"
            )
        ratios = ratios + (0,) * (total - len(ratios))

        cand = d.get("candidate_source_layer_id")
        cand = None if cand is None else _typed("candidate_source_layer_id", cand, int)
        cfg = cls(
            version=version,
            hidden_size=_req(d, "hidden_size", int),
            num_hidden_layers=n_layers,
            num_nextn_predict_layers=n_mtp,
            num_attention_heads=_req(d, "num_attention_heads", int),
            head_dim=head_dim,
            qk_rope_head_dim=rope_dim,
            q_lora_rank=_req(d, "q_lora_rank", int),
            o_lora_rank=_req(d, "o_lora_rank", int),
            o_groups=_req(d, "o_groups", int),
            sliding_window=_req(d, "sliding_window", int),
            compress_ratios=ratios,
            kv_source_layer_ids=_int_list(d, "kv_source_layer_ids", ()),
            index_source_layer_ids=_int_list(d, "index_source_layer_ids", ()),
            candidate_source_layer_id=cand,
            candidate_topk_blocks=_typed("candidate_topk_blocks", d.get("candidate_topk_blocks", 0), int),
            candidate_block_size=_typed("candidate_block_size", d.get("candidate_block_size", 1), int),
            index_topk=_req(d, "index_topk", int),
            index_n_heads=_req(d, "index_n_heads", int),
            index_head_dim=_req(d, "index_head_dim", int),
            rope_theta=_typed("rope_theta", d.get("rope_theta", 10000.0), float),
            compress_rope_theta=_typed("compress_rope_theta", d.get("compress_rope_theta", 160000.0), float),
            rope_scaling=_parse_rope_scaling(d.get("rope_scaling"), nested_ignored),
            rms_norm_eps=_typed("rms_norm_eps", d.get("rms_norm_eps", 1e-6), float),
            vocab_size=_typed("vocab_size", d.get("vocab_size", 129280), int),
            intermediate_size=_typed("intermediate_size", d.get("intermediate_size", 4 * d.get("hidden_size", 1)), int),
            max_position_embeddings=_typed("max_position_embeddings", d.get("max_position_embeddings", 1 << 20), int),
        )
        cfg.validate()
        return cfg

    def to_hf_config(self, *, composite: bool = False) -> dict[str, Any]:
        """The inverse of `from_hf_config` (round-trips exactly): the flat form, or with `composite`
        the fields under `text_config`."""
        if composite:
            return {TEXT_CONFIG: self.to_hf_config()}
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["dsv4_version"] = out.pop("version")
        rs = self.rope_scaling
        out["rope_scaling"] = None if not rs.enabled else {
            "type": "yarn",
            "factor": rs.factor,
            "original_max_position_embeddings": rs.original_max_position_embeddings,
            "beta_fast": rs.beta_fast,
            "beta_slow": rs.beta_slow,
        }
        for k in ("compress_ratios", "kv_source_layer_ids", "index_source_layer_ids"):
            out[k] = list(out[k])
        return out

    def replace(self, **changes: Any) -> "DeepseekV4AttentionConfig":
        cfg = dataclasses.replace(self, **changes)
        cfg.validate()
        return cfg

    # ---------------------------------------------------------------- validation
    def validate(self) -> None:
        """Raise ValueError naming the first inconsistent field."""
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "q_lora_rank",
                    "o_lora_rank", "o_groups", "sliding_window", "index_topk", "index_n_heads",
                    "index_head_dim", "candidate_block_size", "vocab_size", "intermediate_size",
                    "rope_theta", "compress_rope_theta", "rms_norm_eps", "max_position_embeddings"):
            _positive(key, getattr(self, key))
        if self.num_nextn_predict_layers < 0:
            raise ValueError(f"config key 'num_nextn_predict_layers' must be >= 0, got {self.num_nextn_predict_layers}")
        if self.head_dim != HEAD_DIM:
            raise ValueError(f"config key 'head_dim' must be {HEAD_DIM} (448 NoPE + 64 RoPE), got {self.head_dim}")
        if self.qk_rope_head_dim != ROPE_DIM:
            raise ValueError(f"config key 'qk_rope_head_dim' must be {ROPE_DIM}, got {self.qk_rope_head_dim}")
        if self.num_attention_heads % self.o_groups:
            raise ValueError(
                f"config key 'o_groups' must divide num_attention_heads={self.num_attention_heads}, got {self.o_groups}"
            )
        if self.index_head_dim < ROPE_DIM or self.index_head_dim % 2:
            raise ValueError(f"config key 'index_head_dim' must be even and >= {ROPE_DIM}, got {self.index_head_dim}")
        if self.candidate_topk_blocks < 0:
            raise ValueError(f"config key 'candidate_topk_blocks' must be >= 0, got {self.candidate_topk_blocks}")
        n = self.num_layers
        if len(self.compress_ratios) != n:
            raise ValueError(f"config key 'compress_ratios' must have {n} entries after padding, got {len(self.compress_ratios)}")
        layer_type = deepseek_v41_layer_type if self.version == "v4.1" else deepseek_v40_layer_type
        for i, r in enumerate(self.compress_ratios):
            try:
                layer_type(r)
            except ValueError as e:
                raise ValueError(f"config key 'compress_ratios'[{i}]: {e}") from None
        if self.version == "v4.0":
            if self.kv_source_layer_ids or self.index_source_layer_ids:
                raise ValueError("config keys 'kv_source_layer_ids' / 'index_source_layer_ids' are V4.1 only; "
                                 "a V4.0 config must leave them empty")
            return
        self._validate_sources("kv_source_layer_ids", self.kv_source_layer_ids)
        self._validate_sources("index_source_layer_ids", self.index_source_layer_ids)
        for i, r in enumerate(self.compress_ratios):
            if r == 0:
                continue
            src = _latest_at_or_before(self.kv_source_layer_ids, i)
            if src is None:
                raise ValueError(
                    f"layer {i} has compress_ratio {r} but no kv source layer <= {i} in "
                    f"kv_source_layer_ids={list(self.kv_source_layer_ids)}"
                )
            if self.compress_ratios[src] != r:
                raise ValueError(
                    f"config key 'kv_source_layer_ids': layer {i} (compress_ratio {r}) would read the "
                    f"compressed cache of kv source layer {src}, "
                    f"whose compress_ratio is {self.compress_ratios[src]}; they must match"
                )
            if _latest_at_or_before(self.index_source_layer_ids, i) is None:
                raise ValueError(
                    f"layer {i} has compress_ratio {r} but no index source layer <= {i} in "
                    f"index_source_layer_ids={list(self.index_source_layer_ids)}"
                )
        if self.candidate_source_layer_id is not None:
            c = self.candidate_source_layer_id
            if c not in self.index_source_layer_ids:
                raise ValueError(
                    f"config key 'candidate_source_layer_id' must be one of index_source_layer_ids="
                    f"{list(self.index_source_layer_ids)}, got {c}"
                )
            if self.candidate_topk_blocks <= 0:
                raise ValueError("config key 'candidate_topk_blocks' must be > 0 when candidate_source_layer_id is set")

    def _validate_sources(self, key: str, ids: tuple[int, ...]) -> None:
        if list(ids) != sorted(set(ids)):
            raise ValueError(f"config key {key!r} must be strictly increasing, got {list(ids)}")
        for s in ids:
            if not 0 <= s < self.num_layers:
                raise ValueError(f"config key {key!r} has layer {s}, outside 0..{self.num_layers - 1}")
            if self.compress_ratios[s] == 0:
                raise ValueError(f"config key {key!r} names layer {s}, whose compress_ratio is 0 (SWA only)")

    # ---------------------------------------------------------------- derived
    @property
    def num_layers(self) -> int:
        """Decoder layers plus MTP layers."""
        return self.num_hidden_layers + self.num_nextn_predict_layers

    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        return self.head_dim ** -0.5

    @property
    def layer_types(self) -> tuple[str, ...]:
        fn = deepseek_v41_layer_type if self.version == "v4.1" else deepseek_v40_layer_type
        return tuple(fn(r) for r in self.compress_ratios)

    def layer_role(self, layer_id: int) -> LayerRole:
        """The role of layer `layer_id` (MTP layers included)."""
        if not isinstance(layer_id, int) or isinstance(layer_id, bool):
            raise TypeError(f"layer_id must be int, got {type(layer_id).__name__}")
        if not 0 <= layer_id < self.num_layers:
            raise ValueError(f"layer_id must be in 0..{self.num_layers - 1}, got {layer_id}")
        r = self.compress_ratios[layer_id]
        is_mtp = layer_id >= self.num_hidden_layers
        if self.version == "v4.1":
            layer_type = deepseek_v41_layer_type(r)
            compressed = r != 0
            kv_src = _latest_at_or_before(self.kv_source_layer_ids, layer_id) if compressed else None
            idx_src = _latest_at_or_before(self.index_source_layer_ids, layer_id) if compressed else None
            cand = self.candidate_source_layer_id
            cand = cand if (compressed and cand is not None and idx_src is not None and idx_src >= cand) else None
        else:
            layer_type = deepseek_v40_layer_type(r)
            compressed = r > 1
            kv_src = layer_id if compressed else None
            idx_src = layer_id if r == 4 else None  # C128A attends every compressed entry
            cand = None
        return LayerRole(
            layer_id=layer_id,
            compress_ratio=r,
            layer_type=layer_type,
            is_mtp=is_mtp,
            kv_source_layer=kv_src,
            index_source_layer=idx_src,
            candidate_source_layer=cand,
            rope_theta=self.compress_rope_theta if compressed else self.rope_theta,
            use_yarn=compressed and self.rope_scaling.enabled,
        )

    def layer_roles(self) -> tuple[LayerRole, ...]:
        return tuple(self.layer_role(i) for i in range(self.num_layers))


def _latest_at_or_before(ids: Sequence[int], layer: int) -> int | None:
    best = None
    for s in ids:
        if s <= layer:
            best = s
    return best


def _parse_rope_scaling(rs: Any, ignored: list[str]) -> RopeScaling:
    """The YaRN settings of `rs`; appends the keys inside `rs` it does not use to `ignored`."""
    if rs is None:
        return RopeScaling()
    if not isinstance(rs, Mapping):
        raise TypeError(f"config key 'rope_scaling' must be a dict or None, got {type(rs).__name__}")
    prefix = "rope_scaling."
    if "compress" in rs or "main" in rs:  # V4.1 nested form: only compressed layers use YaRN
        ignored += [prefix + k for k in sorted(rs) if k != "compress"]
        prefix += "compress."
        rs = rs.get("compress") or {}
        if not isinstance(rs, Mapping):
            raise TypeError(f"config key 'rope_scaling.compress' must be a dict, got {type(rs).__name__}")
    rec = KeyRecorder(rs)
    try:
        return _yarn(rec)
    finally:
        ignored += [prefix + k for k in rec.ignored]


def _yarn(rs: Mapping[str, Any]) -> RopeScaling:
    if not rs:
        return RopeScaling()
    kind = rs.get("type", rs.get("rope_type", "yarn"))
    if kind not in ("yarn", "default"):
        raise ValueError(f"config key 'rope_scaling.type' must be 'yarn' or 'default', got {kind!r}")
    if kind == "default":
        return RopeScaling()
    out = RopeScaling(
        factor=_typed("rope_scaling.factor", rs.get("factor", 1.0), float),
        original_max_position_embeddings=_typed(
            "rope_scaling.original_max_position_embeddings", rs.get("original_max_position_embeddings", 65536), int
        ),
        beta_fast=_typed("rope_scaling.beta_fast", rs.get("beta_fast", 32.0), float),
        beta_slow=_typed("rope_scaling.beta_slow", rs.get("beta_slow", 1.0), float),
    )
    if out.factor < 1.0 or not math.isfinite(out.factor):
        raise ValueError(f"config key 'rope_scaling.factor' must be a finite value >= 1, got {out.factor}")
    return out


_YARN = {"type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536, "beta_fast": 32.0, "beta_slow": 1.0}

V4_FLASH = DeepseekV4AttentionConfig.from_hf_config({
    "dsv4_version": "v4.0",
    "hidden_size": 4096,
    "num_hidden_layers": 43,
    "num_nextn_predict_layers": 1,
    "num_attention_heads": 64,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 1024,
    "o_lora_rank": 1024,
    "o_groups": 8,
    "sliding_window": 128,
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
    "index_topk": 512,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_scaling": _YARN,
    "rms_norm_eps": 1e-6,
    "vocab_size": 129280,
    "intermediate_size": 2048,
    "max_position_embeddings": 1048576,
})

V41_FLASH = DeepseekV4AttentionConfig.from_hf_config({
    "dsv4_version": "v4.1",
    "hidden_size": 5120,
    "num_hidden_layers": 40,
    "num_nextn_predict_layers": 3,
    "num_attention_heads": 64,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 1280,
    "o_lora_rank": 1024,
    "o_groups": 8,
    "sliding_window": 128,
    "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0],
    "kv_source_layer_ids": [2, 8, 14, 20],
    "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
    "candidate_source_layer_id": 20,
    "candidate_topk_blocks": 2048,
    "candidate_block_size": 8,
    "index_topk": 512,
    "index_n_heads": 32,
    "index_head_dim": 128,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_scaling": _YARN,
    "rms_norm_eps": 1e-20,
    "vocab_size": 129280,
    "intermediate_size": 2048,
    "max_position_embeddings": 1048576,
})

# Small enough to run a whole model on a CPU in seconds, yet exercising every role: SWA-only
# layers, ratio-2 and ratio-1 kv sources with sharing layers, a non-owning index source, a
# candidate source, an MTP layer.
TINY = DeepseekV4AttentionConfig.from_hf_config({
    "dsv4_version": "v4.1",
    "hidden_size": 128,
    "num_hidden_layers": 7,
    "num_nextn_predict_layers": 1,
    "num_attention_heads": 4,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 64,
    "o_lora_rank": 64,
    "o_groups": 2,
    "sliding_window": 8,
    "compress_ratios": [0, 2, 2, 1, 1, 1, 0],
    "kv_source_layer_ids": [1, 3],
    "index_source_layer_ids": [1, 3, 5],
    "candidate_source_layer_id": 3,
    "candidate_topk_blocks": 3,
    "candidate_block_size": 2,
    "index_topk": 6,
    "index_n_heads": 2,
    "index_head_dim": 64,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_scaling": {**_YARN, "factor": 4.0, "original_max_position_embeddings": 64},
    "rms_norm_eps": 1e-6,
    "vocab_size": 256,
    "intermediate_size": 256,
    "max_position_embeddings": 4096,
})

PRESETS: dict[str, DeepseekV4AttentionConfig] = {
    "v4.1-flash": V41_FLASH,
    "v4-flash": V4_FLASH,
    "tiny": TINY,
}


def get_preset(name: str) -> DeepseekV4AttentionConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; expected one of {sorted(PRESETS)}") from None
