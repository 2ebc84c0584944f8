"""Split plans as values (dsv41_jax.plans): made once, passed to every call, checked against it.

- `make_decode_plan` (JAX planner) equals `plan_decode_splits` of the clamped lengths bit for bit; it is a
  pytree that flows through jit without recompiling for other lengths, and unpacks as FlashMLA's pair;
- every mismatch between a plan and a call (batch, s_q, topk, extra cache, extra_topk, batch_invariant, the
  SM parts impl="cuda" needs) raises ValueError naming `plan` at trace time;
- the batch-invariant plan (one part per request, no split) and `plan_is_stale`;
- the xla reference and the mega op accept plans (bitwise the same results), the reference is batch
  invariant; the metadata builder makes the plans `make_decode_plan` makes; the sharded op runs each shard
  over its plan (8 simulated CPU devices).
The kernels' use of plans (in-call, passed, stale, batch-invariant) is tested through the CUDA emulator
(tests/test_cuda_ffi.py), in Pallas interpret mode (tests/test_pallas_kernels.py) and on the GPU (tests/gpu/).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsv41_jax as d
from dsv41_jax import DecodePlan, make_decode_plan, plan_decode_splits, plan_is_stale, sparse_mla_decode
from tests.attention_cases import make_decode_case

PK = dict(s_q=2, num_heads=64, topk=512, num_sms=132, planner="jax")


def _lens(seed, b, hi):
    return jnp.asarray(np.random.default_rng(seed).integers(-5, hi + 40, b), jnp.int32)


@pytest.mark.parametrize("b,extra", [(1, None), (7, 256), (40, None), (130, 1024)])
def test_plan_equals_plan_decode_splits(b, extra):
    tl = _lens(b, b, 512)
    el = _lens(b + 1, b, extra) if extra else None
    plan = make_decode_plan(tl, **PK, extra_topk_length=el, extra_topk=extra)
    parts = d.num_sm_parts_for("cuda", num_sms=132, s_q=2, h_q=64)
    want = plan_decode_splits(jnp.clip(tl, 0, 512), topk=512, num_sm_parts=parts,
                              extra_topk_length=None if el is None else jnp.clip(el, 0, extra))
    meta, splits = plan  # FlashMLA's pair
    np.testing.assert_array_equal(np.asarray(meta), np.asarray(want[0]))
    np.testing.assert_array_equal(np.asarray(splits), np.asarray(want[1]))
    assert (plan.batch, plan.s_q, plan.topk, plan.extra_topk, plan.num_sm_parts) == (b, 2, 512, extra, parts)
    if extra:  # extra_topk_length None: every request at extra_topk
        full = make_decode_plan(tl, **PK, extra_topk=extra)
        want = plan_decode_splits(jnp.clip(tl, 0, 512), topk=512, num_sm_parts=parts,
                                  extra_topk_length=jnp.full((b,), extra, jnp.int32))
        np.testing.assert_array_equal(np.asarray(full.tile_scheduler_metadata), np.asarray(want[0]))


def test_plan_is_a_jit_value_without_recompiles():
    f = jax.jit(lambda tl: make_decode_plan(tl, **PK))
    plans = [f(_lens(i, 9, 512)) for i in range(3)]
    assert f._cache_size() == 1
    g = jax.jit(lambda p: p.tile_scheduler_metadata.sum() + p.num_splits[-1])
    for p in plans:
        g(p)
    assert g._cache_size() == 1
    leaves, treedef = jax.tree.flatten(plans[0])
    assert len(leaves) == 2  # the two arrays; the facts are static
    assert jax.tree.unflatten(treedef, leaves).num_sm_parts == plans[0].num_sm_parts


def _case(**kw):
    return make_decode_case(41, b=4, s_q=2, h_q=8, topk=128, block_size=64, fmt="bf16",
                            extra=dict(topk=64, block_size=2, fmt="bf16"), **kw)


def _plan_for(case, **kw):
    p = dict(s_q=case.q.shape[1], num_heads=case.q.shape[2], topk=case.indices.shape[2],
             extra_topk=None if case.extra_indices is None else case.extra_indices.shape[2], planner="jax")
    p.update(kw)
    return make_decode_plan(case.topk_length, extra_topk_length=case.extra_topk_length, **p)


@pytest.mark.parametrize("what,change,msg", [
    ("batch", dict(b=5), r"plan does not fit this call: batch: plan 4, call 5"),
    ("s_q", dict(s_q=1), r"s_q: plan 2, call 1"),
    ("topk", dict(topk=192), r"topk: plan 128, call 192"),
    ("no extra", dict(extra=None), r"extra_topk: plan 64, call None"),
    ("extra_topk", dict(extra=dict(topk=128, block_size=2, fmt="bf16")), r"extra_topk: plan 64, call 128"),
])
def test_plan_mismatch_raises_at_trace_time(what, change, msg):
    plan = _plan_for(_case())
    kw = dict(b=4, s_q=2, h_q=8, topk=128, block_size=64, fmt="bf16", extra=dict(topk=64, block_size=2, fmt="bf16"))
    kw.update(change)
    other = make_decode_case(42, **kw)
    with pytest.raises(ValueError, match=msg):
        jax.jit(lambda *a: sparse_mla_decode(*a, plan=plan, impl="xla", **other.kwargs())).trace(*other.args())


def test_plan_type_and_batch_invariant_conflicts():
    case = _case()
    with pytest.raises(TypeError, match="plan must be a dsv41_jax.DecodePlan"):
        sparse_mla_decode(*case.args(), plan=tuple(_plan_for(case)), impl="xla", **case.kwargs())
    with pytest.raises(ValueError, match="batch_invariant=True but the plan was made with batch_invariant=False"):
        sparse_mla_decode(*case.args(), plan=_plan_for(case), batch_invariant=True, impl="xla", **case.kwargs())
    with pytest.raises(TypeError, match="batch_invariant must be a bool"):
        sparse_mla_decode(*case.args(), batch_invariant="yes", impl="xla", **case.kwargs())
    with pytest.raises(ValueError, match="extra_topk_length needs extra_topk"):
        make_decode_plan(case.topk_length, s_q=2, num_heads=8, topk=128, extra_topk_length=case.extra_topk_length)
    with pytest.raises(ValueError, match="planner must be one of"):
        make_decode_plan(case.topk_length, s_q=2, num_heads=8, topk=128, planner="host")


def test_cuda_refuses_a_plan_for_other_sm_parts():
    # impl="cuda" needs num_sm_parts_for("cuda", device SMs, s_q, h_q) parts: a plan for another SM count or head
    # count is refused at trace time (checked in the cuda wrapper, no GPU needed)
    from cuda_ffi import ops as _ops

    case = _case()
    call = d.sparse_mla.make_decode_call(*case.args(), case.kv_format, case.block_size, case.softmax_scale,
                                         case.attn_sink, case.extra_kv_cache, case.extra_indices,
                                         case.extra_topk_length, case.extra_kv_format, case.extra_block_size,
                                         _plan_for(case, num_sms=114))
    with pytest.raises(ValueError, match=r"plan has 57 SM parts \(made for num_sms=114, s_q=2, num_heads=8\); "
                                         r"impl='cuda' on this device \(132 SMs\) with h_q=8 needs 66"):
        _ops.call_plan(call, num_sms=132)
    ok = dataclasses.replace(call, plan=_plan_for(case, num_sms=132))
    assert _ops.call_plan(ok, num_sms=132) is ok.plan
    heads = dataclasses.replace(call, plan=_plan_for(case, num_sms=132, num_heads=128))
    with pytest.raises(ValueError, match="needs 66"):
        _ops.call_plan(heads, num_sms=132)


def test_batch_invariant_plan_is_a_constant_of_the_shapes():
    tl = _lens(3, 5, 300)
    p = make_decode_plan(tl, s_q=2, num_heads=64, topk=300, extra_topk=128, batch_invariant=True)
    q = make_decode_plan(tl * 0, s_q=2, num_heads=64, topk=300, extra_topk=128, batch_invariant=True)
    assert p.num_sm_parts == 5 and p.batch_invariant
    meta = np.asarray(p.tile_scheduler_metadata)
    np.testing.assert_array_equal(meta, np.asarray(q.tile_scheduler_metadata))
    np.testing.assert_array_equal(meta[:, 0], np.arange(5))
    np.testing.assert_array_equal(meta[:, 1], np.arange(5))
    assert (meta[:, 3] == (320 + 128) // 64).all() and (meta[:, [2, 4, 5, 6, 7]] == 0).all()
    np.testing.assert_array_equal(np.asarray(p.num_splits), np.arange(6))
    assert not bool(plan_is_stale(p, tl * 3))


def test_plan_is_stale():
    tl = _lens(4, 12, 512)
    plan = make_decode_plan(tl, **PK)
    assert not bool(jax.jit(plan_is_stale)(plan, tl))
    assert bool(plan_is_stale(plan, jnp.clip(tl, 0, 512) // 3))


def test_reference_with_plan_and_batch_invariance():
    case = _case()
    f = jax.jit(lambda p, *a: sparse_mla_decode(*a, plan=p, impl="xla", **case.kwargs()))
    a = f(None, *case.args())
    b = f(_plan_for(case), *case.args())
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))
    case.check(*a, "xla decode with a plan")
    # a request's rows do not depend on the rest of its batch
    kw = case.kwargs()
    q, cache, idx, tl = case.args()
    g = jax.jit(lambda q, i, t, ei, et: sparse_mla_decode(q, cache, i, t, impl="xla", batch_invariant=True,
                                                          **{**kw, "extra_indices": ei, "extra_topk_length": et}))
    full = g(q, idx, tl, kw["extra_indices"], kw["extra_topk_length"])
    perm = np.array([2, 0])
    part = g(q[perm], idx[perm], tl[perm], kw["extra_indices"][perm], kw["extra_topk_length"][perm])
    for x, y in zip(full, part):
        np.testing.assert_array_equal(np.asarray(x, np.float32)[perm], np.asarray(y, np.float32))


def test_mega_decode_checks_its_plan():
    from dsv41_jax.rope import cos_sin_cache

    case = make_decode_case(43, b=5, s_q=1, h_q=8, topk=64, block_size=64, fmt="fp8_ds_mla")
    cs = cos_sin_cache(64, theta=10000.0)
    pos = jnp.arange(5, dtype=jnp.int32)
    args = (case.q[:, 0], pos, cs, case.kv_cache, case.indices[:, 0], case.topk_length)
    kw = dict(kv_format="fp8_ds_mla", block_size=64, softmax_scale=case.softmax_scale, attn_sink=case.attn_sink)
    plan = make_decode_plan(case.topk_length, s_q=1, num_heads=8, topk=64, planner="jax")
    a = d.sparse_mla_mega_decode(*args, **kw)
    b = d.sparse_mla_mega_decode(*args, **kw, plan=plan)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))
    bad = make_decode_plan(case.topk_length, s_q=1, num_heads=8, topk=128, planner="jax")
    with pytest.raises(ValueError, match="topk: plan 128, call 64"):
        d.sparse_mla_mega_decode(*args, **kw, plan=bad)


def _decode_step(n, seed=0):
    rng = np.random.default_rng(seed)
    seq = rng.integers(1, 700, n)
    bt = np.arange(n * 16).reshape(n, 16)
    slots = [int(bt[i, (t - 1) // 64]) * 64 + (t - 1) % 64 for i, t in enumerate(seq)]
    return d.make_common_attention_metadata([1] * n, seq.tolist(), bt, slots)


def test_builder_plans_equal_make_decode_plan():
    common = _decode_step(11)
    sm = jax.jit(lambda c: d.build_sparse_swa_metadata(c, window=128, block_size=64, compress_ratios=[0, 1, 2],
                                                       index_topk=256, num_heads=16, num_sms=132))(common)
    assert set(sm.tile_sched) == {"swaonly", "c1a", "c2a"}
    for lt, r in (("swaonly", 0), ("c1a", 1), ("c2a", 2)):
        got = sm.tile_sched[lt]
        assert isinstance(got, DecodePlan) and got.batch == sm.decode_swa_lens.shape[0] and got.s_q == 1
        want = make_decode_plan(sm.decode_swa_lens, s_q=1, num_heads=16, topk=128, num_sms=132, planner="jax",
                                extra_topk_length=None if r == 0 else sm.decode_extra_topk_lens(r, 256),
                                extra_topk=None if r == 0 else 256)
        assert (got.topk, got.extra_topk, got.num_sm_parts) == (want.topk, want.extra_topk, want.num_sm_parts)
        np.testing.assert_array_equal(np.asarray(got.tile_scheduler_metadata), np.asarray(want.tile_scheduler_metadata))
        np.testing.assert_array_equal(np.asarray(got.num_splits), np.asarray(want.num_splits))
    legacy = d.build_sparse_swa_metadata(common, window=128, block_size=64, num_sm_parts=4)
    meta, splits = legacy.tile_sched["swaonly"]  # unpacks as before
    assert meta.shape == (4, 8) and legacy.tile_sched["swaonly"].num_sms is None


def test_sharded_decode_runs_each_shard_over_its_plan():
    from jax.sharding import Mesh

    from dsv41_jax.sharding import make_decode_plan_sharded, sparse_mla_decode_sharded

    devs = np.array(jax.devices()[:4])
    if devs.size < 4:
        pytest.skip(f"needs 4 devices, got {devs.size}")
    case = make_decode_case(44, b=4, s_q=2, h_q=8, topk=128, block_size=64, fmt="bf16")
    ref = sparse_mla_decode(*case.args(), impl="xla", **case.kwargs())
    heads = Mesh(devs, ("tp",))
    plan = make_decode_plan_sharded(case.topk_length, mesh=heads, head_axis="tp", s_q=2, num_heads=8, topk=128,
                                    planner="jax")
    assert plan.num_heads == 2
    out = sparse_mla_decode_sharded(*case.args(), mesh=heads, head_axis="tp", plan=plan, impl="xla",
                                    **case.kwargs())
    for x, y in zip(out, ref):  # (XLA's per-shard fusions round the last bit of a few lse values differently)
        np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), rtol=1e-6, atol=1e-6)
    reqs = Mesh(devs.reshape(2, 2), ("dp", "tp"))
    plan = make_decode_plan_sharded(case.topk_length, mesh=reqs, head_axis="tp", batch_axis="dp", s_q=2, num_heads=8,
                                    topk=128, planner="jax")
    assert plan.batch == 2 and plan.tile_scheduler_metadata.shape[0] == 2
    for i in range(2):  # shard i's plan is the plan of its requests
        own = make_decode_plan(case.topk_length[2 * i: 2 * i + 2], s_q=2, num_heads=4, topk=128, planner="jax")
        np.testing.assert_array_equal(np.asarray(plan.tile_scheduler_metadata[i]),
                                      np.asarray(own.tile_scheduler_metadata))
    with pytest.raises(ValueError, match="plan: with batch_axis=None the plan needs a leading axis"):
        sparse_mla_decode_sharded(*case.args(), mesh=heads, head_axis="tp", plan=plan, impl="xla", **case.kwargs())
