"""dsv41-jax: DeepSeek-V4.1 sparse MLA attention for JAX.

Sliding-window + compressed-KV + top-k sparse attention (FlashMLA semantics) with a pure-jnp
reference (`impl="xla"`), Pallas Mosaic GPU kernels (`impl="pallas"`) and CUDA kernels behind
XLA FFI (`impl="cuda"`). Everything public is importable from this module.
"""

from dsv41_jax import _moved

_moved.install()

from dsv41_jax import buckets, device, kv_cache, metadata, plans, rope, scheduler, sparse_mla
from dsv41_jax import checkpoint, config, engine_stats, envelope, hf_config, layer_types
from dsv41_jax import attention, backends, reference  # old paths of sparse_mla.api / .capabilities / .reference
from dsv41_jax.device import DeviceInfo
from dsv41_jax.kv_cache import KV_FORMATS, LATENT_DIM, canonical_kv_cache_dtype, canonical_kv_format
from dsv41_jax.sparse_mla.api import (
    AUTO_ORDER,
    DecodeCall,
    ImplCandidate,
    ImplChoice,
    PrefillCall,
    explain_impl,
    sparse_mla_decode,
    sparse_mla_mega_decode,
    sparse_mla_mega_prefill,
    sparse_mla_prefill,
)
from dsv41_jax.sparse_mla.capabilities import (
    CUDA_SPARSE_DSV41,
    FLASHMLA_MEGA_ATTN_DSV41,
    FLASHMLA_SPARSE_DSV41,
    PALLAS_SPARSE_DSV41,
    XLA_SPARSE_DSV41,
    BackendSelectionError,
    BackendSpec,
    register_backend,
    registered_backends,
    select_backend,
)
from dsv41_jax.buckets import DEFAULT_BUCKETS, BucketPolicy
from dsv41_jax.model.checkpoint import Checkpoint, TensorInfo, open_checkpoint, write_checkpoint
from dsv41_jax.model.config import (
    PRESETS,
    TINY,
    V4_FLASH,
    V41_FLASH,
    DeepseekV4AttentionConfig,
    HFConfigKeys,
    LayerRole,
    RopeScaling,
    get_preset,
)
from dsv41_jax.model.engine_stats import GenerateStats, StepTiming, WarmupStats
from dsv41_jax.model.envelope import ServingLimits, StepShape, envelope_shapes
from dsv41_jax.model.layer_types import (
    DecodePlanSpec,
    decode_plan_spec,
    deepseek_v40_layer_type,
    deepseek_v41_layer_type,
    required_layer_types,
)
from dsv41_jax.metadata import (
    CommonAttentionMetadata,
    DecodePrefillSplit,
    DeepseekSparseSWAMetadata,
    DeepseekV4FlashMLAMetadata,
    PrefillChunk,
    build_flashmla_metadata,
    build_sparse_swa_metadata,
    combine_topk_swa_indices,
    compressed_slot_mapping,
    decode_threshold,
    global_topk_indices,
    make_common_attention_metadata,
    prefill_chunk_plan,
    prefill_gather_lens,
    prefill_workspace_slots,
    reorder_decodes_first,
    split_decodes_and_prefills,
    swa_window_indices,
    token_positions,
    token_to_req_indices,
)
from dsv41_jax.plans import DecodePlan, make_decode_plan, plan_is_stale
from dsv41_jax.scheduler import num_sm_parts_for, plan_decode_splits

from dsv41_jax import sharding

# The Flax model side is imported on first use, so the ops and kernels need no Flax import; `info` too, so
# `python -m dsv41_jax.info` runs a module not imported yet.
_LAZY = {
    "engine": ("dsv41_jax.model.engine", None), "model": ("dsv41_jax.model", None),
    "nn": ("dsv41_jax.model.nn", None), "weights": ("dsv41_jax.model.weights", None), "info": ("dsv41_jax.info", None),
    "EngineConfig": ("dsv41_jax.model.engine", "EngineConfig"),
    "InferenceEngine": ("dsv41_jax.model.engine", "InferenceEngine"),
    "dense_forward": ("dsv41_jax.model.dense", "dense_forward"),
    "DeepseekV41Attention": ("dsv41_jax.model.nn", "DeepseekV41Attention"),
    "DeepseekV41Model": ("dsv41_jax.model.nn", "DeepseekV41Model"),
    "hf_state_dict": ("dsv41_jax.model.weights", "hf_state_dict"),
    "load_safetensors": ("dsv41_jax.model.weights", "load_safetensors"),
    "save_safetensors": ("dsv41_jax.model.weights", "save_safetensors"),
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        mod, attr = _LAZY[name]
        m = importlib.import_module(mod)
        value = m if attr is None else getattr(m, attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'dsv41_jax' has no attribute {name!r}")


__version__ = "0.1.0"

__all__ = [
    # modules
    "buckets", "checkpoint", "config", "device", "engine_stats", "envelope", "hf_config", "kv_cache", "layer_types",
    "metadata", "plans", "rope", "scheduler", "sharding", "sparse_mla", "attention", "backends", "reference",
    # the ops and their dispatch
    "sparse_mla_decode", "sparse_mla_prefill", "sparse_mla_mega_decode", "sparse_mla_mega_prefill",
    "explain_impl", "ImplChoice", "ImplCandidate", "AUTO_ORDER", "DecodeCall", "PrefillCall",
    # backend capabilities
    "BackendSpec", "BackendSelectionError", "DeviceInfo", "select_backend", "register_backend",
    "registered_backends", "FLASHMLA_SPARSE_DSV41", "FLASHMLA_MEGA_ATTN_DSV41", "CUDA_SPARSE_DSV41",
    "PALLAS_SPARSE_DSV41", "XLA_SPARSE_DSV41",
    # cache formats
    "LATENT_DIM", "KV_FORMATS", "canonical_kv_format", "canonical_kv_cache_dtype",
    # padding, plans, scheduling
    "DEFAULT_BUCKETS", "BucketPolicy", "DecodePlan", "make_decode_plan", "plan_is_stale", "num_sm_parts_for",
    "plan_decode_splits",
    # metadata
    "CommonAttentionMetadata", "DecodePrefillSplit", "DeepseekSparseSWAMetadata", "DeepseekV4FlashMLAMetadata",
    "PrefillChunk", "build_flashmla_metadata", "build_sparse_swa_metadata", "combine_topk_swa_indices",
    "compressed_slot_mapping", "decode_threshold", "global_topk_indices", "make_common_attention_metadata",
    "prefill_chunk_plan", "prefill_gather_lens", "prefill_workspace_slots", "reorder_decodes_first",
    "split_decodes_and_prefills", "swa_window_indices", "token_positions", "token_to_req_indices",
    # the model side
    "Checkpoint", "TensorInfo", "open_checkpoint", "write_checkpoint", "PRESETS", "TINY", "V4_FLASH", "V41_FLASH",
    "DeepseekV4AttentionConfig", "HFConfigKeys", "LayerRole", "RopeScaling", "get_preset", "GenerateStats",
    "StepTiming", "WarmupStats", "ServingLimits", "StepShape", "envelope_shapes", "DecodePlanSpec",
    "decode_plan_spec", "deepseek_v40_layer_type", "deepseek_v41_layer_type", "required_layer_types",
    *_LAZY,
]
