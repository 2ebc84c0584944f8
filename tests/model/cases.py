"""The model of the engine and weights tests: tiny, with a layer of every V4.1 role."""

from __future__ import annotations

from flax import nnx

import dsv41_jax as d
from dsv41_jax.model.nn import DeepseekV41Model

# Five layers cover every role: SWA only; a ratio-2 kv + index source; a ratio-2 layer sharing both;
# a ratio-1 kv + index + candidate source; a ratio-1 index source restricted to the candidates.
CFG = d.TINY.replace(
    num_hidden_layers=5, num_nextn_predict_layers=0, compress_ratios=(0, 2, 2, 1, 1),
    kv_source_layer_ids=(1, 3), index_source_layer_ids=(1, 3, 4), candidate_source_layer_id=3,
)


def tiny_model(seed: int = 0) -> DeepseekV41Model:
    return DeepseekV41Model(CFG, rngs=nnx.Rngs(seed))
