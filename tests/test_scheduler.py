"""plan_decode_splits against a plain-Python FlashMLA planner (conftest.py) and structural invariants;
num_sm_parts_for values; argument validation."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv41_jax import num_sm_parts_for, plan_decode_splits
from dsv41_jax.scheduler import SCHED_META_FIELDS


@functools.cache
def _jit_plan(**static):
    return jax.jit(functools.partial(plan_decode_splits, **static))


def jit_plan(lengths, extra_lengths=None, **static):
    fn = _jit_plan(**static)
    if extra_lengths is None:
        return fn(jnp.asarray(lengths, jnp.int32))
    return fn(jnp.asarray(lengths, jnp.int32), extra_topk_length=jnp.asarray(extra_lengths, jnp.int32))


def _cdiv(a, b):
    return -(-a // b)


def _blocks(lengths, extra=None, extra_scalar=None):
    out = []
    for i, n in enumerate(lengths):
        n = max(n, 1)
        if extra is not None or extra_scalar is not None:
            n = _cdiv(n, 64) * 64 + (extra[i] if extra is not None else extra_scalar)
        out.append(max(_cdiv(n, 64), 1))
    return out


def check_invariants(meta, splits, nblk, num_sm_parts):
    """Every block of every request is covered exactly once, in order; num_splits and the split
    flags agree with the parts."""
    b = len(nblk)
    assert len(meta) == num_sm_parts and all(len(r) == 8 for r in meta)
    assert len(splits) == b + 1 and splits[0] == 0
    pieces = [[] for _ in range(b)]  # (part, begin, end)
    for p, (br, er, bb, eb, bsplit, f, l, pad) in enumerate(meta):
        assert pad == 0
        if br > er:
            continue  # empty part
        for req in range(br, er + 1):
            lo = bb if req == br else 0
            hi = eb if req == er else nblk[req]
            assert 0 <= lo < hi <= nblk[req], (p, req, lo, hi)
            pieces[req].append((p, lo, hi))
    for req in range(b):
        covered = []
        for _, lo, hi in pieces[req]:
            covered.extend(range(lo, hi))
        assert covered == list(range(nblk[req])), f"request {req} blocks {covered} of {nblk[req]}"
        assert splits[req + 1] - splits[req] == len(pieces[req])
    for p, (br, er, bb, eb, bsplit, f, l, pad) in enumerate(meta):
        if br > er:
            continue
        first_pieces = [q for q, _, _ in pieces[br]]
        assert bsplit == first_pieces.index(p)
        assert f == int(len(pieces[br]) > 1)
        assert l == int(len(pieces[er]) > 1)
    # parts are consecutive: empty parts only at the end
    nonempty = [r[0] <= r[1] for r in meta]
    assert nonempty == sorted(nonempty, reverse=True)


lengths_el = st.one_of(
    st.integers(0, 20000),
    st.sampled_from([0, 1, 63, 64, 65, 127, 128, 129, 2048, 20000]),
)


@settings(max_examples=30, deadline=None)
@given(data=st.data(), b=st.integers(1, 300), P=st.integers(1, 160),
       topk=st.sampled_from([64, 128, 512, 2048, 20000]), ov=st.sampled_from([5, 3, 0, 1]))
def test_plan_matches_flashmla_oracle(plan_oracle, data, b, P, topk, ov):
    lengths = data.draw(st.lists(lengths_el, min_size=b, max_size=b))
    meta, splits = jit_plan(lengths, topk=topk, num_sm_parts=P, fixed_overhead=ov)
    assert meta.shape == (P, 8) and meta.dtype == jnp.int32
    assert splits.shape == (b + 1,) and splits.dtype == jnp.int32
    want_meta, want_splits = plan_oracle(lengths, topk=topk, num_sm_parts=P, fixed_overhead=ov)
    assert np.asarray(meta).tolist() == want_meta
    assert np.asarray(splits).tolist() == want_splits
    check_invariants(want_meta, want_splits, _blocks(lengths), P)


@settings(max_examples=30, deadline=None)
@given(data=st.data(), b=st.integers(1, 300), P=st.integers(1, 160),
       extra_topk=st.sampled_from([64, 512, 1024, 2048]), per_request=st.booleans())
def test_plan_with_extra_cache_matches_oracle(plan_oracle, data, b, P, extra_topk, per_request):
    lengths = data.draw(st.lists(lengths_el, min_size=b, max_size=b))
    if per_request:
        extra = data.draw(st.lists(st.integers(0, extra_topk), min_size=b, max_size=b))
        meta, splits = jit_plan(lengths, extra, topk=128, num_sm_parts=P, extra_topk=extra_topk)
        want_meta, want_splits = plan_oracle(lengths, topk=128, num_sm_parts=P, extra_topk_length=extra)
        nblk = _blocks(lengths, extra=extra)
    else:
        extra = None
        meta, splits = jit_plan(lengths, topk=128, num_sm_parts=P, extra_topk=extra_topk)
        want_meta, want_splits = plan_oracle(lengths, topk=128, num_sm_parts=P, extra_topk=extra_topk)
        nblk = _blocks(lengths, extra_scalar=extra_topk)
    assert np.asarray(meta).tolist() == want_meta
    assert np.asarray(splits).tolist() == want_splits
    check_invariants(want_meta, want_splits, nblk, P)


def test_oracle_small_hand_example(plan_oracle):
    # lengths 100, 0, 300 -> blocks 2, 1, 5; overhead 5 -> total 23; 2 parts -> payload 12 + 5 = 17.
    # part 0: req0 (2+5=7, remain 10), req1 (1+5=6, remain 4), req2 needs 10 > 4 and 4-5 <= 0: stop.
    # part 1: req2 (5+5=10 <= 17).
    meta, splits = plan_oracle([100, 0, 300], topk=512, num_sm_parts=2)
    assert meta == [[0, 1, 0, 1, 0, 0, 0, 0], [2, 2, 0, 5, 0, 0, 0, 0]]
    assert splits == [0, 1, 2, 3]
    got_meta, got_splits = plan_decode_splits(jnp.array([100, 0, 300], jnp.int32), topk=512, num_sm_parts=2)
    assert np.asarray(got_meta).tolist() == meta
    assert np.asarray(got_splits).tolist() == splits


def test_single_long_request_is_split_across_parts(plan_oracle):
    # one request of 64 blocks over 4 parts: total 69, payload ceil(69/4) + 5 = 23 -> 18 blocks a part.
    lengths = [64 * 64]
    meta, splits = plan_decode_splits(jnp.array(lengths, jnp.int32), topk=4096, num_sm_parts=4)
    meta = np.asarray(meta).tolist()
    assert meta == [
        [0, 0, 0, 18, 0, 1, 1, 0],
        [0, 0, 18, 36, 1, 1, 1, 0],
        [0, 0, 36, 54, 2, 1, 1, 0],
        [0, 0, 54, 64, 3, 1, 1, 0],
    ]
    assert np.asarray(splits).tolist() == [0, 4]
    assert meta == plan_oracle(lengths, topk=4096, num_sm_parts=4)[0]


def test_full_topk_and_empty_parts(plan_oracle):
    # Many parts, few blocks: trailing parts are empty (begin_req > end_req).
    lengths = [2048, 2048, 2048]
    meta, splits = plan_decode_splits(jnp.full((3,), 2048, jnp.int32), topk=2048, num_sm_parts=132)
    want_meta, want_splits = plan_oracle(lengths, topk=2048, num_sm_parts=132)
    assert np.asarray(meta).tolist() == want_meta
    assert np.asarray(splits).tolist() == want_splits
    assert any(r[0] > r[1] for r in want_meta)
    check_invariants(want_meta, want_splits, _blocks(lengths), 132)


def test_plan_accepts_host_lists_and_numpy():
    a = plan_decode_splits([5, 700, 0], topk=1024, num_sm_parts=3)
    b = plan_decode_splits(np.array([5, 700, 0], np.int64), topk=1024, num_sm_parts=3)
    for x, y in zip(a, b):
        assert np.array_equal(np.asarray(x), np.asarray(y))


def test_sched_meta_fields():
    assert SCHED_META_FIELDS == ("begin_req", "end_req", "begin_block", "end_block", "begin_split_idx",
                                 "is_first_req_splitted", "is_last_req_splitted", "pad")


# ------------------------------------------------------------------------ num_sm_parts_for
@pytest.mark.parametrize("impl,num_sms,s_q,h_q,want", [
    ("sm90", 132, 2, 128, 33),
    ("sm90", 132, 2, 64, 66),
    ("sm90", 132, 1, 64, 132),
    ("sm90", 132, 1, 128, 66),
    ("sm90", 132, 4, 128, 16),
    ("sm90", 132, 200, 128, 1),  # at least one part
    ("cuda", 132, 2, 128, 33),
    ("pallas", 132, 2, 64, 66),
    ("sm100_head64", 148, 1, 64, 148),
    ("sm100_head64", 148, 2, 64, 74),
    ("sm100_head128", 148, 1, 128, 74),
    ("sm100_head128", 148, 2, 128, 37),
    ("sm100_head128", 1, 2, 128, 1),
    ("xla", 132, 2, 128, 1),
])
def test_num_sm_parts_for(impl, num_sms, s_q, h_q, want):
    assert num_sm_parts_for(impl, num_sms=num_sms, s_q=s_q, h_q=h_q) == want


def test_num_sm_parts_for_errors():
    with pytest.raises(ValueError, match="impl"):
        num_sm_parts_for("sm80", num_sms=132, s_q=1, h_q=64)
    with pytest.raises(ValueError, match="num_sms"):
        num_sm_parts_for("sm90", num_sms=0, s_q=1, h_q=64)
    with pytest.raises(ValueError, match="h_q"):
        num_sm_parts_for("sm90", num_sms=132, s_q=1, h_q=0)
    with pytest.raises(TypeError, match="s_q"):
        num_sm_parts_for("sm90", num_sms=132, s_q=1.0, h_q=64)


# ------------------------------------------------------------------------------ bad inputs
def test_plan_bad_inputs():
    good = jnp.array([10, 20], jnp.int32)
    with pytest.raises(ValueError, match="topk_length"):
        plan_decode_splits(jnp.ones((2, 2), jnp.int32), topk=64, num_sm_parts=2)
    with pytest.raises(TypeError, match="topk_length"):
        plan_decode_splits(jnp.array([1.0, 2.0]), topk=64, num_sm_parts=2)
    with pytest.raises(ValueError, match="num_sm_parts"):
        plan_decode_splits(good, topk=64, num_sm_parts=0)
    with pytest.raises(TypeError, match="num_sm_parts"):
        plan_decode_splits(good, topk=64, num_sm_parts=jnp.int32(4))
    with pytest.raises(TypeError, match="topk"):
        plan_decode_splits(good, topk=64.0, num_sm_parts=2)
    with pytest.raises(TypeError, match="fixed_overhead"):
        plan_decode_splits(good, topk=64, num_sm_parts=2, fixed_overhead=True)
    with pytest.raises(ValueError, match="extra_topk_length"):
        plan_decode_splits(good, topk=64, num_sm_parts=2, extra_topk_length=jnp.ones((3,), jnp.int32))
    with pytest.raises(TypeError, match="extra_topk_length"):
        plan_decode_splits(good, topk=64, num_sm_parts=2, extra_topk_length=jnp.ones((2,), jnp.float32))


def test_plan_under_jit_with_traced_lengths(plan_oracle):
    rng = np.random.default_rng(7)
    lengths = rng.integers(0, 3000, size=17).tolist()
    extra = rng.integers(0, 512, size=17).tolist()
    f = jax.jit(lambda t, e: plan_decode_splits(t, topk=128, num_sm_parts=9, extra_topk_length=e, extra_topk=512))
    meta, splits = f(jnp.asarray(lengths, jnp.int32), jnp.asarray(extra, jnp.int32))
    want_meta, want_splits = plan_oracle(lengths, topk=128, num_sm_parts=9, extra_topk_length=extra)
    assert np.asarray(meta).tolist() == want_meta
    assert np.asarray(splits).tolist() == want_splits
