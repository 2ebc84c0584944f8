"""One V4.1-Flash decode step's attention: metadata and plans once, then every layer's call.

Every layer of the `V41_FLASH` preset (40: 2 swaonly, 18 c2a, 20 c1a) with its layer type: `b` requests
decoding 2 tokens each (one speculative token, s_q = 1 rows as vLLM packs them), sequences around 16384
tokens (spread 8192), fp8_ds_mla caches with pages of 64: a window cache per layer (only the window's
pages are mapped), one compressed cache per ratio (64 states per page for c1a, 32 for c2a) and per
layer its own top-512 selection over the visible states. One jitted step builds the sparse-SWA metadata
with one plan per layer type (`build_sparse_swa_metadata(num_heads=64)`) and runs the 40 decodes with
their type's plan. Reported (CUPTI kernel time): the step, the metadata alone, and the 40 calls timed
alone over the same plans; the step's attention (step minus metadata) should equal the calls' sum.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import dsv41_jax as d
from benchmarks.flashmla_cases import SOFTMAX_SCALE, random_fp8_cache

__all__ = ["StepInputs", "step_inputs", "run_step"]

PAGE = 64
STATES_PER_PAGE = {1: 64, 2: 32}


@dataclasses.dataclass
class StepInputs:
    common: d.CommonAttentionMetadata
    layer_types: tuple[str, ...]
    ratios: tuple[int, ...]
    swa: list            # per layer fp8 cache
    comp: dict           # ratio -> fp8 cache
    q: list              # per layer bf16 [T, 1, 64, 512]
    comp_indices: list   # per layer int32 [T, 1, 512] (None for swaonly)
    sink: jax.Array


def step_inputs(b: int, *, seed: int = 0, cfg=d.V41_FLASH) -> StepInputs:
    rng = np.random.default_rng(seed)
    key = jax.random.PRNGKey(seed)
    L = cfg.num_hidden_layers
    ratios = tuple(int(r) for r in cfg.compress_ratios[:L])
    types = tuple(d.deepseek_v41_layer_type(r) for r in ratios)
    W, K, H = cfg.sliding_window, cfg.index_topk, cfg.num_attention_heads
    seq = np.maximum(rng.normal(16384, 8192, b), 2 * W).astype(np.int64)
    # the window cache maps only the pages of each request's last W + 2 positions: 4 pages per request
    width = -(-int(seq.max()) // PAGE)
    bt = np.zeros((b, width), np.int32)
    for i, s in enumerate(seq):
        first = (s - W - 2) // PAGE
        for j in range(first, -(-s // PAGE)):
            bt[i, j] = 4 * i + (j - first)
    qlens = [2] * b
    pos = np.concatenate([[s - 2, s - 1] for s in seq])
    req = np.repeat(np.arange(b), 2)
    slots = bt[req, pos // PAGE].astype(np.int64) * PAGE + pos % PAGE
    common = d.make_common_attention_metadata(qlens, seq.tolist(), bt, slots.tolist())
    T = common.padded_num_tokens
    keys = jax.random.split(key, 3 * L + 4)
    swa = [random_fp8_cache(keys[i], 4 * b, PAGE) for i in range(L)]
    comp = {}
    comp_rows = {}
    for r in sorted(set(ratios) - {0}):
        spp = STATES_PER_PAGE[r]
        per = -(-int(seq.max()) // r // spp) * spp
        comp[r] = random_fp8_cache(keys[L + r], b * per // spp, spp)
        comp_rows[r] = per
    q, cidx = [], []
    tok = jnp.asarray(np.pad(req, (0, T - 2 * b)))
    vis = jnp.asarray(np.pad(pos + 1, (0, T - 2 * b)))
    for i, r in enumerate(ratios):
        q.append(jax.random.normal(keys[2 * L + i], (T, 1, H, 512), jnp.float32).astype(jnp.bfloat16))
        if r == 0:
            cidx.append(None)
            continue
        n_vis = vis // r
        loc = (jax.random.uniform(keys[L + 4 + i], (T, K)) * jnp.maximum(n_vis, 1)[:, None]).astype(jnp.int32)
        cidx.append((tok[:, None] * comp_rows[r] + loc)[:, None, :].astype(jnp.int32))
    sink = jax.random.normal(keys[-1], (H,), jnp.float32)
    return StepInputs(common, types, ratios, swa, comp, q, cidx, sink)


def _metadata(common, ratios, cfg=d.V41_FLASH, **kw):
    return d.build_sparse_swa_metadata(common, window=cfg.sliding_window, block_size=PAGE, num_speculative_tokens=1,
                                       compress_ratios=list(ratios), index_topk=cfg.index_topk,
                                       num_heads=cfg.num_attention_heads, **kw)


def _layer(sm, arrays: dict, i: int, ratio: int, plan, impl: str):
    kw = dict(kv_format="fp8_ds_mla", block_size=PAGE, softmax_scale=SOFTMAX_SCALE, attn_sink=arrays["sink"],
              impl=impl, plan=plan)
    if ratio:
        eidx = arrays["comp_indices"][i]
        kw.update(extra_kv_cache=arrays["comp"][ratio], extra_indices=eidx,
                  extra_topk_length=sm.decode_extra_topk_lens(ratio, eidx.shape[2]), extra_kv_format="fp8_ds_mla",
                  extra_block_size=STATES_PER_PAGE[ratio])
    return d.sparse_mla_decode(arrays["q"][i], arrays["swa"][i], sm.decode_swa_indices, sm.decode_swa_lens, **kw)


def run_step(b: int, impl: str, *, iterations: int = 5) -> dict:
    """Device times (us, CUPTI kernel sums) of the step, its metadata and its calls alone."""
    from benchmarks.cupti import kernel_times

    x = step_inputs(b)
    L = len(x.ratios)
    arrays = dict(swa=x.swa, comp={str(r): c for r, c in x.comp.items()}, q=x.q,
                  comp_indices=[c if c is not None else jnp.zeros((1, 1, 1), jnp.int32) for c in x.comp_indices],
                  sink=x.sink)

    def fix(a):  # the compressed caches keyed by ratio
        return {**a, "comp": {int(k): v for k, v in a["comp"].items()}}

    def step(common, a):
        a, sm = fix(a), _metadata(common, x.ratios)
        return [_layer(sm, a, i, x.ratios[i], sm.tile_sched[x.layer_types[i]], impl)[0] for i in range(L)]

    step_fn = jax.jit(step)
    meta_fn = jax.jit(lambda c: _metadata(c, x.ratios))
    layer_fn = jax.jit(lambda sm, plan, a, i: _layer(sm, fix(a), i, x.ratios[i], plan, impl)[0], static_argnums=3)
    holder = {}

    def timed(fn, *args):
        def run():
            holder["v"] = fn(*args)

        return kernel_times(run, sync=lambda: jax.block_until_ready(holder["v"]), iterations=iterations)

    t_step, k_step = timed(step_fn, x.common, arrays)
    t_meta, k_meta = timed(meta_fn, x.common)
    sm = jax.block_until_ready(meta_fn(x.common))
    calls = sum(timed(layer_fn, sm, sm.tile_sched[x.layer_types[i]], arrays, i)[0] for i in range(L))
    return dict(b=b, impl=impl, layers=L, step_us=t_step, metadata_us=t_meta, calls_us=calls,
                attention_us=t_step - t_meta, ratio=(t_step - t_meta) / calls if calls else float("nan"),
                metadata_kernels=k_meta, step_kernels=len(k_step))
