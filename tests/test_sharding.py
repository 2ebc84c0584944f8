"""Sparse MLA and the model on 8 simulated CPU devices: sharded results equal single-device results.

tests/conftest.py sets `--xla_force_host_platform_device_count=8` before JAX starts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import dsv41_jax as d
from dsv41_jax import kv_cache as kvc
from dsv41_jax.sharding import (
    local_block_tables,
    sparse_mla_decode_sharded,
    sparse_mla_prefill_sharded,
)
from tests.attention_cases import make_decode_case, make_prefill_case


@pytest.fixture(scope="module")
def cpus():
    devs = jax.devices("cpu")
    assert len(devs) >= 8, ("the sharding tests need 8 simulated CPU devices; run pytest from the repository so "
                            f"tests/conftest.py sets XLA_FLAGS before JAX starts (got {len(devs)})")
    return devs[:8]


def _eq(a, b):
    """Equal up to float reassociation: a shard's smaller head count can change how XLA blocks the fp32
    dots, which may flip the last bf16 bit of an output (seen: 1 element in 49152)."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    np.testing.assert_array_equal(np.isfinite(a), np.isfinite(b))
    np.testing.assert_allclose(a, b, rtol=2.0**-7, atol=1e-6)


@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "bf16"])
def test_decode_head_parallel_equals_single_device(cpus, fmt):
    mesh = Mesh(np.array(cpus), ("tp",))
    c = make_decode_case(21, b=3, s_q=2, h_q=16, topk=64, fmt=fmt, sink="inf",
                         extra=dict(topk=64, block_size=16, fmt="fp8_ds_mla"))
    ref = d.sparse_mla_decode(*c.args(), **c.kwargs(), impl="xla")
    kw = c.kwargs()
    got = jax.jit(lambda *a: sparse_mla_decode_sharded(*a, mesh=mesh, head_axis="tp", **kw, impl="xla"))(*c.args())
    for g, r in zip(got, ref):
        _eq(g, r)
    assert got[0].sharding.spec[2] == "tp" and got[1].sharding.spec[2] == "tp"


def test_decode_request_parallel_with_local_pages(cpus):
    """2 x 4 mesh: requests over dp (each shard owns half the pages), heads over tp."""
    mesh = Mesh(np.array(cpus).reshape(2, 4), ("dp", "tp"))
    rng = np.random.default_rng(3)
    bs, nb, b, h = 16, 8, 4, 8  # 8 pages: shard 0 owns 0..3, shard 1 owns 4..7
    cache = kvc.insert(kvc.allocate(nb, bs, "fp8_ds_mla"), jnp.asarray(rng.standard_normal((nb * bs, 512)), jnp.bfloat16),
                       jnp.arange(nb * bs, dtype=jnp.int32), fmt="fp8_ds_mla", block_size=bs)
    shard = np.array([0, 0, 1, 1])  # request -> shard (requests split evenly along dp)
    # each request's global slots stay inside its shard's pages
    g_idx = np.stack([rng.integers(s * 4 * bs, (s + 1) * 4 * bs, size=(2, 40)) for s in shard]).astype(np.int32)
    g_idx[1, 0, :5] = -1
    lens = jnp.asarray([40, 33, 0, 17], jnp.int32)
    q = jnp.asarray(rng.standard_normal((b, 2, h, 512)), jnp.bfloat16)
    sink = jnp.asarray(rng.standard_normal(h), jnp.float32)
    kw = dict(kv_format="fp8_ds_mla", block_size=bs, softmax_scale=0.06, attn_sink=sink, impl="xla")
    ref = d.sparse_mla_decode(q, cache, jnp.asarray(g_idx), lens, **kw)
    l_idx = np.where(g_idx >= 0, g_idx - shard[:, None, None] * 4 * bs, -1).astype(np.int32)
    got = sparse_mla_decode_sharded(q, cache, jnp.asarray(l_idx), lens, mesh=mesh, head_axis="tp", batch_axis="dp", **kw)
    for g, r in zip(got, ref):
        _eq(g, r)


def test_local_block_tables():
    bt = np.array([[0, 3, -1], [5, 6, 7]])
    np.testing.assert_array_equal(local_block_tables(bt, [0, 1], 4), [[0, 3, -1], [1, 2, 3]])
    with pytest.raises(ValueError, match=r"block_table\[1, 0\] = 3 is not in shard 1's pages \[4, 8\)"):
        local_block_tables(np.array([[0], [3]]), [0, 1], 4)


def test_prefill_heads_and_tokens_sharded(cpus):
    mesh = Mesh(np.array(cpus).reshape(2, 4), ("dp", "tp"))
    c = make_prefill_case(22, s_q=6, h_q=8, topk=64, s_kv=100, sink="inf")
    ref = d.sparse_mla_prefill(*c.args(), **c.kwargs(), impl="xla")
    got = sparse_mla_prefill_sharded(*c.args(), mesh=mesh, head_axis="tp", token_axis="dp", **c.kwargs(), impl="xla")
    for g, r in zip(got, ref):
        _eq(g, r)


def test_plain_op_under_jit_with_named_sharding_inputs(cpus):
    mesh = Mesh(np.array(cpus), ("tp",))
    c = make_decode_case(23, b=2, s_q=1, h_q=8, topk=64)
    ref = d.sparse_mla_decode(*c.args(), **c.kwargs(), impl="xla")
    q = jax.device_put(c.q, NamedSharding(mesh, P(None, None, "tp", None)))
    cache = jax.device_put(c.kv_cache, NamedSharding(mesh, P()))
    kw = {**c.kwargs(), "attn_sink": jax.device_put(c.attn_sink, NamedSharding(mesh, P("tp")))}
    got = jax.jit(lambda q, cache, i, t: d.sparse_mla_decode(q, cache, i, t, **kw, impl="xla"))(q, cache, c.indices, c.topk_length)
    np.testing.assert_allclose(np.asarray(got[0], np.float32), np.asarray(ref[0], np.float32), atol=8e-3, rtol=1e-2)
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(ref[1]), rtol=1e-5)


def test_metadata_builders_inside_shard_map(cpus):
    """Each dp shard builds its own window indices and compressed slot mapping from its own batch."""
    mesh = Mesh(np.array(cpus[:2]), ("dp",))
    shards = [d.make_common_attention_metadata([1, 3], [9, 20], [[1, 2], [3, 0]], [9, 30, 31, 32], num_tokens=16,
                                               num_reqs=8, num_blocks=4),
              d.make_common_attention_metadata([5], [5], [[2]], [16, 17, 18, 19, 20], num_tokens=16, num_reqs=8,
                                               num_blocks=4)]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *shards)

    def per_shard(cm):
        cm = jax.tree.map(lambda x: x[0], cm)
        idx, lens = d.swa_window_indices(cm.query_start_loc, cm.seq_lens, cm.block_table, cm.slot_mapping, window=4,
                                         block_size=8)
        cs = d.compressed_slot_mapping(cm.slot_mapping, cm.query_start_loc, cm.seq_lens, cm.block_table,
                                       states_per_page=4, compress_ratio=2)
        return idx[None], lens[None], cs[None]

    f = jax.jit(jax.shard_map(per_shard, mesh=mesh, in_specs=(P("dp"),), out_specs=(P("dp"), P("dp"), P("dp"))))
    idx, lens, cs = f(stacked)
    for k, cm in enumerate(shards):
        e_idx, e_lens = d.swa_window_indices(cm.query_start_loc, cm.seq_lens, cm.block_table, cm.slot_mapping,
                                             window=4, block_size=8)
        e_cs = d.compressed_slot_mapping(cm.slot_mapping, cm.query_start_loc, cm.seq_lens, cm.block_table,
                                         states_per_page=4, compress_ratio=2)
        np.testing.assert_array_equal(idx[k], e_idx)
        np.testing.assert_array_equal(lens[k], e_lens)
        np.testing.assert_array_equal(cs[k], e_cs)


def test_engine_with_head_mesh_equals_single_device(cpus):
    cfg = d.TINY.replace(num_hidden_layers=4, num_nextn_predict_layers=0, compress_ratios=(0, 2, 1, 1),
                         kv_source_layer_ids=(1, 2), index_source_layer_ids=(1, 2, 3), candidate_source_layer_id=2)
    model = d.DeepseekV41Model(cfg, rngs=nnx.Rngs(0))
    mesh = Mesh(np.array(cpus[:2]), ("tp",))  # 4 heads, 2 output groups: 2 shards
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, 11).tolist(), rng.integers(0, cfg.vocab_size, 6).tolist()]
    base = dict(max_model_len=32, max_reqs=2, block_size=8, comp_block_size=4, impl="xla")
    single = d.InferenceEngine(model, d.EngineConfig(**base))
    sharded = d.InferenceEngine(model, d.EngineConfig(**base, mesh=mesh, head_axis="tp"))
    wq_b = sharded.params["layers"][1]["self_attn"]["wq_b"]["kernel"]
    assert wq_b[...].sharding.spec == P(None, "tp")
    logits = []
    for eng in (single, sharded):
        rids = [eng.add_request(p) for p in prompts]
        out = [eng.step([(rids[0], 7), (rids[1], 6)]), eng.step([(rids[0], 4)])]
        logits.append(np.concatenate([out[0][rids[0]], out[1][rids[0]]]))
    np.testing.assert_allclose(logits[1], logits[0], atol=2e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="divisible by the head axis size 8"):
        d.InferenceEngine(model, d.EngineConfig(**base, mesh=Mesh(np.array(cpus), ("tp",))))
