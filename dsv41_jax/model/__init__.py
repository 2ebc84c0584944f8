"""The DeepSeek-V4.1 model around the sparse MLA ops: configuration, Flax NNX modules, the paged engine.

- `config` (+ `hf_config`, `layer_types`): the frozen model configuration read from a Hugging Face
  config, layer roles and layer types; pure Python, no Flax;
- `nn`: the NNX modules, each with its forward pass over one engine step (`__call__`);
- `indexer`: the indexer's selection rules; `rope_tables`: the RoPE tables of a model;
- `dense`: `dense_forward`, one sequence with no cache, the oracle the engine must reproduce;
- `engine` (+ `step`, `envelope`, `engine_stats`): the paged inference engine, its compiled step, the
  step shapes its limits can meet and what its steps cost;
- `weights` (+ `checkpoint`): weights in Hugging Face names, to and from safetensors.

The names below load their module on first use, so `import dsv41_jax.model.config` (which the core's
metadata builders need) imports no Flax.
"""

from __future__ import annotations

import importlib

__all__ = ["RopeTables", "make_rope_tables", "cache_roundtrip", "index_scores", "candidate_mask", "select_topk",
           "run_indexer", "dense_forward", "decoder_tail"]

_SUBMODULES = frozenset({"checkpoint", "config", "dense", "engine", "engine_stats", "envelope", "hf_config",
                         "indexer", "layer_types", "nn", "rope_tables", "step", "weights"})

# name -> the module holding it (the names `dsv41_jax.model` had as one module keep working)
_LAZY = {
    "RopeTables": "rope_tables", "make_rope_tables": "rope_tables",
    "cache_roundtrip": "dense", "dense_forward": "dense", "decoder_tail": "dense",
    "index_query": "indexer", "index_keys": "indexer", "index_scores": "indexer", "candidate_mask": "indexer",
    "select_topk": "indexer", "run_indexer": "indexer",
    "DeepseekV4AttentionConfig": "config", "LayerRole": "config",
    "DeepseekV41Attention": "nn", "DeepseekV41Model": "nn",
}


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    if name in _LAZY:
        value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _SUBMODULES | set(_LAZY))
