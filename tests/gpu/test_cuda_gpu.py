"""GPU tests of `impl="cuda"` (our CUDA kernels behind XLA FFI) on an SM90 / SM100 device.

Run on the GPU machine from the repository root:
    python3 -m cuda_ffi.build --archs 90a && PYTHONPATH=. python3 -m pytest -q -m gpu tests/gpu/test_cuda_gpu.py

- the shared decode / prefill grids against the float64 oracle (FlashMLA's tolerances);
- split-heavy shapes (b=4 with topk 2048 + extra 1024, h=128; b=128, s_q=2, h=128, topk=2048)
  against the xla reference;
- poison: every unused cache slot is NaN / 0xFF and indices past topk_length point at them;
- determinism: two runs are bitwise equal;
- the f16 range: kv beyond 65504 saturates (finite outputs equal the oracle on clamped values), and fp8
  tiles with UE8M0 exponents inside and outside the f16x2 dequant fast path's [-14, 7];
- the split plan of the planner kernel (`make_decode_plan(planner="device")`, the metadata builder's
  plans of three layer types in one launch) equals `plan_decode_splits` bit for bit; the op with no
  plan, the device plan and the JAX plan give bitwise equal outputs; stale plans stay finite (exact
  when made for longer lengths); batch_invariant=True is bitwise invariant to the batch;
- the mega decode (`sparse_mla_mega_decode(impl="cuda")`: q RoPE, attention, inverse RoPE and e4m3 output in the
  kernels) over its grid and at batches where requests run unsplit (the staged epilogue), against the oracle, and
  bitwise batch-invariant; the mega prefill (`sparse_mla_mega_prefill(impl="cuda")`) over its grid and at s_q 700,
  both prefill kernels, against the oracle and the xla reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

if jax.default_backend() != "gpu":
    pytest.skip(f"needs a CUDA GPU: jax.default_backend() is {jax.default_backend()!r}", allow_module_level=True)

import cuda_ffi  # noqa: E402
from cuda_ffi import ops as _ops  # noqa: E402
from dsv41_jax import make_decode_plan, num_sm_parts_for, plan_decode_splits, sparse_mla_decode, sparse_mla_prefill  # noqa: E402
from dsv41_jax.scheduler import default_num_sms  # noqa: E402
from dsv41_jax.sparse_mla.base import make_decode_call as _make_decode_call  # noqa: E402
from tests.attention_cases import (  # noqa: E402
    DECODE_GRID,
    MEGA_DECODE_GRID,
    MEGA_PREFILL_GRID,
    PREFILL_GRID,
    V41_DECODE_GRID,
    MegaCase,
    assert_close,
    assert_mega_close,
    assert_mega_like_reference,
    make_mega_case,
    make_mega_prefill_case,
    make_decode_case,
    make_prefill_case,
    make_growing_scores_prefill_case,
    make_saturating_prefill_case,
    make_two_scale_decode_case,
)

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def cuda_library():
    if not cuda_ffi.library_present():
        from cuda_ffi import build

        if build.find_nvcc() is None or build.find_cmake() is None:
            pytest.skip(f"{cuda_ffi.library_path()} is not built and nvcc/cmake are missing")
        build.build_library(archs="90a;100a")
        cuda_ffi.refresh()
    why = cuda_ffi.backend_unavailable_reason()
    if why is not None:
        pytest.skip(why)


def _readable(kw) -> str | None:
    fmts = [kw["fmt"]] + ([kw["extra"]["fmt"]] if kw.get("extra") else [])
    bad = [f for f in fmts if f not in _ops.FORMAT_CODES]
    return f"the cuda kernels do not read {bad} (impl='auto' falls back to another implementation)" if bad else None


def _decode(case, impl="cuda"):
    f = jax.jit(lambda *a: sparse_mla_decode(*a, impl=impl, **case.kwargs()))
    return f(*case.args())


DECODE_IDS = [n for n, _ in DECODE_GRID]


@pytest.mark.parametrize("name", DECODE_IDS)
def test_decode_grid(name):
    i = DECODE_IDS.index(name)
    kw = DECODE_GRID[i][1]
    if (why := _readable(kw)) is not None:
        pytest.skip(why)
    case = make_decode_case(100 + i, **kw)
    case.check(*_decode(case), name)


PREFILL_IDS = [n for n, _ in PREFILL_GRID]


@pytest.fixture(params=[False, True], ids=["bf16_rows", "f16_rows"])
def kv_rows(request, monkeypatch):
    """Both prefill kernels: bf16 rows converted by the producers, or kv converted to f16 by the
    wrapper (the seesaw CTA, seesaw.cuh), whatever `prefill_kv_f16` would pick for the shape."""
    import cuda_ffi.ops as ops

    monkeypatch.setattr(ops, "prefill_kv_f16", lambda *a: request.param)
    return request.param


@pytest.mark.parametrize("name", PREFILL_IDS)
def test_prefill_grid(name, kv_rows):
    i = PREFILL_IDS.index(name)
    case = make_prefill_case(200 + i, **PREFILL_GRID[i][1])
    case.check(jax.jit(lambda *a: sparse_mla_prefill(*a, impl="cuda", **case.kwargs()))(*case.args()), name)


def test_prefill_large_sq_two_groups(kv_rows):
    case = make_prefill_case(31, s_q=700, h_q=128, s_kv=1521, topk=512, sink="inf")
    f = jax.jit(lambda *a: sparse_mla_prefill(*a, impl="cuda", **case.kwargs()))
    out, ml, lse = f(*case.args())
    e_out, e_ml, e_lse = case.expected()
    assert_close(out, e_out, "prefill_out", "out")
    assert_close(ml, e_ml, "prefill_max_logits", "max_logits")
    assert_close(lse, e_lse, "prefill_lse", "lse")


@pytest.mark.parametrize("kw", [
    dict(b=4, s_q=2, h_q=128, topk=2048, block_size=64, fmt="fp8_ds_mla", s_kv=4096, lengths="var",
         extra=dict(topk=1024, block_size=2, fmt="fp8_ds_mla", s_kv=3000, lengths="var")),
    dict(b=128, s_q=2, h_q=128, topk=2048, block_size=64, fmt="fp8_ds_mla", s_kv=8192, lengths="full",
         invalid_frac=0.02),
    dict(b=5, s_q=3, h_q=20, topk=1000, block_size=61, fmt="bf16", s_kv=2000,
         extra=dict(topk=200, block_size=64, fmt="bf16")),
], ids=["b4_topk2048_extra1024_h128", "b128_sq2_h128_topk2048", "h20_bf16_extra"])
def test_decode_multi_split_vs_xla(kw):
    case = make_decode_case(41, **kw)
    out, lse = _decode(case)
    r_out, r_lse = _decode(case, impl="xla")
    assert_close(out, np.asarray(r_out, np.float32), "decode_out", "out vs xla")
    assert_close(lse, np.asarray(r_lse), "decode_lse", "lse vs xla")


# The narrow CTA (csrc/narrow.cuh: h_q <= 32, no padding to 64 heads) on FlashMLA-style edge cases, and on the
# V4.1-Flash shape of a tensor-parallel shard (SWA top-k 128 on pages of 256 + compressed top-k 512 on pages of 64).
NARROW_GRID_IDS = ["fp8_p61", "fp8_extra_p2", "bf16_p64", "fp8_all_invalid_row", "fp8_zero_len", "fp8_p2_var"]


@pytest.mark.parametrize("h_q", [1, 3, 8, 16, 24, 32])
@pytest.mark.parametrize("name", NARROW_GRID_IDS)
def test_decode_narrow_heads(name, h_q):
    kw = dict(dict(DECODE_GRID)[name], h_q=h_q)
    case = make_decode_case(600 + NARROW_GRID_IDS.index(name) + 7 * h_q, **kw)
    case.check(*_decode(case), f"{name} h_q={h_q}")


@pytest.mark.parametrize("h_q", [8, 16, 32])
def test_decode_narrow_v41_flash_shard_vs_xla(h_q):
    case = make_decode_case(640 + h_q, b=64, s_q=2, h_q=h_q, topk=128, block_size=256, fmt="fp8_ds_mla", s_kv=4096,
                            lengths="full", extra=dict(topk=512, block_size=64, fmt="fp8_ds_mla", s_kv=4096,
                                                       lengths="var"))
    out, lse = _decode(case)
    r_out, r_lse = _decode(case, impl="xla")
    assert_close(out, np.asarray(r_out, np.float32), "decode_out", "out vs xla")
    assert_close(lse, np.asarray(r_lse), "decode_lse", "lse vs xla")


def test_decode_poison_never_reaches_output():
    # Unused slots are NaN (bf16) / 0xFF (fp8: NaN e4m3 and a 2^128 scale), 40% of the indices are
    # invalid (-1, INT_MIN, INT_MAX, capacity, ...), and positions past topk_length point at unused slots.
    for fmt in ("fp8_ds_mla", "bf16"):
        case = make_decode_case(51, b=16, s_q=2, h_q=64, topk=512, block_size=64, fmt=fmt, invalid_frac=0.4,
                                extra=dict(topk=256, block_size=2, fmt="fp8_ds_mla"))
        out, lse = _decode(case)
        assert not np.isnan(np.asarray(out, np.float32)).any()
        e_out, e_lse = case.expected()
        assert_close(out, e_out, "decode_out", f"{fmt} out")
        assert_close(lse, e_lse, "decode_lse", f"{fmt} lse")


def test_deterministic():
    case = make_decode_case(61, b=32, s_q=2, h_q=128, topk=2048, block_size=64, fmt="fp8_ds_mla", s_kv=4096,
                            extra=dict(topk=512, block_size=64, fmt="fp8_ds_mla"))
    a = _decode(case)
    b = _decode(case)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))
    pcase = make_prefill_case(62, s_q=64, h_q=128, s_kv=4000, topk=1024)
    f = jax.jit(lambda *a: sparse_mla_prefill(*a, impl="cuda", **pcase.kwargs()))
    a, b = f(*pcase.args()), f(*pcase.args())
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


def _call(case):
    kw = case.kwargs()
    return _make_decode_call(case.q, case.kv_cache, case.indices, case.topk_length, kw["kv_format"],
                             kw["block_size"], kw["softmax_scale"], kw["attn_sink"], kw.get("extra_kv_cache"),
                             kw.get("extra_indices"), kw.get("extra_topk_length"), kw.get("extra_kv_format"),
                             kw.get("extra_block_size"))


@pytest.mark.parametrize("kw,lengths", [
    (dict(b=128, s_q=2, h_q=128, topk=2048, block_size=64, fmt="fp8_ds_mla", s_kv=8192, lengths="full"), None),
    (dict(b=300, s_q=1, h_q=16, topk=2048, block_size=64, fmt="fp8_ds_mla", s_kv=4096), "random"),
    (dict(b=77, s_q=3, h_q=64, topk=512, block_size=2, fmt="bf16", s_kv=1000,
          extra=dict(topk=256, block_size=64, fmt="fp8_ds_mla")), "random"),
    (dict(b=5, s_q=1, h_q=8, topk=1024, block_size=64, fmt="fp8_ds_mla", s_kv=2000), "zeros"),
], ids=["b128_h128_full", "b300_random", "b77_extra_random", "b5_zeros"])
def test_device_plan_matches_plan_decode_splits(kw, lengths):
    # the planner kernel's plan is plan_decode_splits' bit for bit; the op without a plan, with the device plan and
    # with the JAX plan give bitwise equal outputs
    rng = np.random.default_rng(5)
    if lengths == "random":  # out of range on purpose: the kernels clamp to [0, topk]
        kw = {**kw, "lengths": rng.integers(-3, kw["topk"] + 50, kw["b"])}
    elif lengths == "zeros":
        kw = {**kw, "lengths": "zero"}
    case = make_decode_case(71, **kw)
    call = _call(case)
    topk = call.indices.shape[2]
    etopk = call.extra_indices.shape[2] if call.has_extra else None
    pk = dict(s_q=kw["s_q"], num_heads=kw["h_q"], topk=topk, extra_topk_length=call.extra_topk_length, extra_topk=etopk)
    dev = jax.jit(lambda tl: make_decode_plan(tl, **pk, planner="device"))(call.topk_length)
    jx = jax.jit(lambda tl: make_decode_plan(tl, **pk, planner="jax"))(call.topk_length)
    parts = num_sm_parts_for("cuda", num_sms=default_num_sms(), s_q=kw["s_q"], h_q=kw["h_q"])
    etl = None if etopk is None else jnp.clip(call.extra_topk_length, 0, etopk)
    w_meta, w_splits = plan_decode_splits(jnp.clip(call.topk_length, 0, topk), topk=topk, num_sm_parts=parts,
                                          extra_topk_length=etl)
    for p in (dev, jx):
        np.testing.assert_array_equal(np.asarray(p.tile_scheduler_metadata), np.asarray(w_meta))
        np.testing.assert_array_equal(np.asarray(p.num_splits), np.asarray(w_splits))
    f = jax.jit(lambda plan, *a: sparse_mla_decode(*a, impl="cuda", plan=plan, **case.kwargs()))
    out, lse = f(None, *case.args())
    for p in (dev, jx):
        out_p, lse_p = f(p, *case.args())
        np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(out_p, np.float32))
        np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse_p))
    e_out, e_lse = case.expected() if kw["b"] <= 128 and kw["h_q"] <= 64 else (None, None)
    if e_out is not None:
        assert_close(out, e_out, "decode_out", "out")
        assert_close(lse, e_lse, "decode_lse", "lse")


def test_builder_plans_all_layer_types_in_one_launch():
    # the metadata builder's plans (swaonly, c1a, c2a) from one planner launch equal plan_decode_splits'
    from dsv41_jax import build_sparse_swa_metadata, make_common_attention_metadata

    rng = np.random.default_rng(9)
    n = 40
    seq = rng.integers(1, 3000, n)
    bt = np.arange(n * 64).reshape(n, 64)
    slots = [int(bt[i, (t - 1) // 64]) * 64 + (t - 1) % 64 for i, t in enumerate(seq)]
    common = make_common_attention_metadata([1] * n, seq.tolist(), bt, slots)
    f = jax.jit(lambda c: build_sparse_swa_metadata(c, window=128, block_size=64, compress_ratios=[0, 1, 2],
                                                    index_topk=512, num_heads=64, planner="device"))
    sm = f(common)
    hlo = jax.jit(lambda c: build_sparse_swa_metadata(c, window=128, block_size=64, compress_ratios=[0, 1, 2],
                                                      index_topk=512, num_heads=64, planner="device")
                  ).lower(common).compile().as_text()
    assert hlo.count("dsv41_plan_decode_splits") == 1 and " while(" not in hlo
    parts = num_sm_parts_for("cuda", num_sms=default_num_sms(), s_q=1, h_q=64)
    for lt, r in (("swaonly", 0), ("c1a", 1), ("c2a", 2)):
        extra = None if r == 0 else sm.decode_extra_topk_lens(r, 512)
        w_meta, w_splits = plan_decode_splits(sm.decode_swa_lens, topk=128, num_sm_parts=parts,
                                              extra_topk_length=extra, extra_topk=None if r == 0 else 512)
        np.testing.assert_array_equal(np.asarray(sm.tile_sched[lt].tile_scheduler_metadata), np.asarray(w_meta), lt)
        np.testing.assert_array_equal(np.asarray(sm.tile_sched[lt].num_splits), np.asarray(w_splits), lt)


def test_stale_plan_on_device():
    # plans from other lengths: in bounds and finite (compute-sanitizer runs one too); from the longest lengths exact
    case = make_decode_case(73, b=40, s_q=2, h_q=128, topk=512, block_size=64, fmt="fp8_ds_mla", lengths="var",
                            s_kv=3000, extra=dict(topk=256, block_size=2, fmt="fp8_ds_mla", lengths="var"))
    call = _call(case)
    rng = np.random.default_rng(2)
    f = jax.jit(lambda plan, *a: sparse_mla_decode(*a, impl="cuda", plan=plan, **case.kwargs()))
    pk = dict(s_q=2, num_heads=128, topk=512, extra_topk=256)
    longest = make_decode_plan(jnp.full((40,), 512, jnp.int32), extra_topk_length=jnp.full((40,), 256, jnp.int32), **pk)
    out, lse = f(longest, *case.args())
    e_out, e_lse = case.expected()
    assert_close(out, e_out, "decode_out", "out")
    assert_close(lse, e_lse, "decode_lse", "lse")
    for i in range(3):
        stale = make_decode_plan(jnp.asarray(rng.integers(0, 513, 40), jnp.int32),
                                 extra_topk_length=jnp.asarray(rng.integers(0, 257, 40), jnp.int32), **pk)
        out, lse = f(stale, *case.args())
        assert np.isfinite(np.asarray(out, np.float32)).all() and not np.isnan(np.asarray(lse)).any(), i


@pytest.mark.parametrize("h_q", [8, 64, 128])
def test_batch_invariant_on_device(h_q):
    # batch_invariant=True: a request's out and lse are bitwise the same alone, in a permuted sub-batch and in the
    # whole batch
    case = make_decode_case(74, b=24, s_q=2, h_q=h_q, topk=640, block_size=64, fmt="fp8_ds_mla", lengths="var",
                            s_kv=4000, extra=dict(topk=512, block_size=64, fmt="fp8_ds_mla", lengths="var"))
    kw = case.kwargs()
    q, cache, idx, tl = case.args()
    f = jax.jit(lambda q, i, t, ei, et: sparse_mla_decode(q, cache, i, t, impl="cuda", batch_invariant=True,
                                                          **{**kw, "extra_indices": ei, "extra_topk_length": et}))
    full = f(q, idx, tl, kw["extra_indices"], kw["extra_topk_length"])
    e_out, e_lse = case.expected()
    assert_close(full[0], e_out, "decode_out", "out")
    assert_close(full[1], e_lse, "decode_lse", "lse")
    for perm in (np.array([7]), np.array([5, 3, 11, 0])):
        part = f(q[perm], idx[perm], tl[perm], kw["extra_indices"][perm], kw["extra_topk_length"][perm])
        for x, y in zip(full, part):
            np.testing.assert_array_equal(np.asarray(x, np.float32)[perm], np.asarray(y, np.float32))


def test_public_op_has_no_xla_loops():
    # the plan is computed inside the FFI call: no while loops in the compiled public op
    case = make_decode_case(72, b=8, s_q=2, h_q=64, topk=256, fmt="fp8_ds_mla")
    f = jax.jit(lambda *a: sparse_mla_decode(*a, impl="cuda", **case.kwargs()))
    hlo = f.lower(*case.args()).compile().as_text()
    assert " while(" not in hlo and "dsv41_sparse_mla_decode" in hlo


def test_f16_saturation_on_device(kv_rows):
    big, sat = make_saturating_prefill_case(33)
    out, ml, lse = jax.jit(lambda: sparse_mla_prefill(*big.args(), impl="cuda", **big.kwargs()))()
    assert np.isfinite(np.asarray(out, np.float32)).all() and np.isfinite(np.asarray(lse)).all()
    e_out, _, e_lse = sat.expected()
    assert np.abs(e_out).max() > 6e4
    assert_close(out, e_out, "prefill_out", "out")
    assert_close(lse, e_lse, "prefill_lse", "lse")


@pytest.mark.parametrize("h_q,tiny", [(8, False), (128, False), (128, True)])
def test_both_dequant_paths_on_device(h_q, tiny):
    case = make_two_scale_decode_case(34, h_q=h_q, tiny=tiny)
    case.check(*sparse_mla_decode(*case.args(), impl="cuda", **case.kwargs()), "cuda decode, two scale ranges")


V41_IDS = [n for n, _ in V41_DECODE_GRID]


@pytest.mark.parametrize("name", V41_IDS)
def test_decode_v41_formats(name):
    # the V4.1 decode kernels (mxfp8_ds_mla / nvfp4_ds_mla producers; params.h kFamV41) in every kernel shape
    i = V41_IDS.index(name)
    case = make_decode_case(300 + i, **V41_DECODE_GRID[i][1])
    case.check(*_decode(case), name)


@pytest.mark.parametrize("h_q,tiny", [(64, False), (128, False), (16, True)])
def test_mxfp8_both_dequant_paths_on_device(h_q, tiny):
    case = make_two_scale_decode_case(36, h_q=h_q, tiny=tiny, fmt="mxfp8_ds_mla",
                                      extra=dict(topk=64, block_size=2, fmt="nvfp4_ds_mla", lengths="full"))
    case.check(*_decode(case), "cuda decode, mxfp8 two scale ranges")


def test_decode_v41_flash_shape_vs_xla():
    # V4.1-Flash: SWA top-k 128 on pages of 256 (528 B) + compressed top-k 512 on pages of 64 (288 B), h_q 64
    case = make_decode_case(39, b=16, s_q=2, h_q=64, topk=128, block_size=256, fmt="mxfp8_ds_mla", s_kv=4096,
                            lengths="var", extra=dict(topk=512, block_size=64, fmt="nvfp4_ds_mla", s_kv=2048))
    got = _decode(case)
    case.check(*got, "cuda V4.1-Flash decode")
    ref = _decode(case, impl="xla")
    assert_close(got[0], np.asarray(ref[0], np.float64), "decode_out", "cuda vs xla out")


MEGA_IDS = [n for n, _ in MEGA_DECODE_GRID]


def _mega(case: MegaCase, impl="cuda", **kw):
    from dsv41_jax import sparse_mla_mega_decode

    return sparse_mla_mega_decode(*case.args(), **case.kwargs(), impl=impl, **kw)


@pytest.mark.parametrize("name", MEGA_IDS)
def test_mega_decode_grid_on_device(name):
    i = MEGA_IDS.index(name)
    case = make_mega_case(400 + i, **MEGA_DECODE_GRID[i][1])
    assert_mega_close(*_mega(case), case.expected(), f"cuda mega decode {name}")


@pytest.mark.parametrize("h_q,fmt,extra_fmt", [(64, "mxfp8_ds_mla", "nvfp4_ds_mla"), (128, "mxfp8_ds_mla", "nvfp4_ds_mla"),
                                               (100, "fp8_ds_mla", "fp8_ds_mla"), (16, "mxfp8_ds_mla", "mxfp8_ds_mla")])
def test_mega_decode_unsplit_requests_on_device(h_q, fmt, extra_fmt):
    # more requests than the plan has parts: most requests are one piece, finished by the staged epilogue (h 64 / 128 /
    # 100) or by the combine (the narrow CTA)
    case = make_mega_case(430, b=300, h_q=h_q, topk=128, block_size=64, fmt=fmt, s_kv=1024,
                          extra=dict(topk=128, block_size=2, fmt=extra_fmt, s_kv=512))
    assert_mega_like_reference(_mega(case), _mega(case, impl="xla"), case.expected(),
                               f"cuda mega decode h{h_q}, 300 requests")


def test_mega_decode_batch_invariant_on_device():
    case = make_mega_case(431, b=40, h_q=64, topk=128, block_size=64, fmt="mxfp8_ds_mla", s_kv=1024,
                          extra=dict(topk=512, block_size=64, fmt="nvfp4_ds_mla", s_kv=2048))
    whole = _mega(case, batch_invariant=True)
    c = case.base
    import dataclasses

    one = MegaCase(dataclasses.replace(c, q=c.q[:2], indices=c.indices[:2], topk_length=c.topk_length[:2],
                                       extra_indices=c.extra_indices[:2], extra_topk_length=c.extra_topk_length[:2]),
                   case.positions[:2], case.cos_sin_cache)
    part = _mega(one, batch_invariant=True)
    for x, y in zip(whole, part):
        np.testing.assert_array_equal(np.asarray(x)[:2].view(np.uint8), np.asarray(y).view(np.uint8))
    assert_mega_close(*whole, case.expected(), "cuda batch-invariant mega decode")


MEGA_PREFILL_IDS = [n for n, _ in MEGA_PREFILL_GRID]


def _mega_prefill(case, impl="cuda"):
    from dsv41_jax import sparse_mla_mega_prefill

    return jax.jit(lambda *a: sparse_mla_mega_prefill(*a, impl=impl, **case.kwargs()))(*case.args())


@pytest.mark.parametrize("name", MEGA_PREFILL_IDS)
def test_mega_prefill_grid_on_device(name, kv_rows):
    i = MEGA_PREFILL_IDS.index(name)
    case = make_mega_prefill_case(500 + i, **MEGA_PREFILL_GRID[i][1])
    assert_mega_close(*_mega_prefill(case), case.expected(), f"cuda mega prefill {name}", kind="prefill")


def test_mega_prefill_large_sq_on_device(kv_rows):
    case = make_mega_prefill_case(532, s_q=700, h_q=128, s_kv=1521, topk=512, sink="inf", max_pos=4096)
    assert_mega_like_reference(_mega_prefill(case), _mega_prefill(case, impl="xla"), case.expected(),
                               "cuda mega prefill s_q 700 h 128", kind="prefill")


def test_lazy_rescaling_on_device(kv_rows):
    case = make_growing_scores_prefill_case(35)
    case.check(sparse_mla_prefill(*case.args(), impl="cuda", **case.kwargs()), "cuda prefill, growing scores")

