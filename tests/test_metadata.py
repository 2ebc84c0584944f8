"""Metadata builders against plain-Python loop oracles (per request, per token), written from
vllm_deepseek_v4.md sections 2, 3, 6 and the module's documented decisions.

Batches: decodes first (query_len <= 1 + num_spec, zero included), then prefills, then requests of
query_len 0; tokens with slot -1; odd page sizes; multi-page, ragged and negative block tables.
Every batch is padded to pinned buckets (T=64 tokens, R=8 requests, a fixed table width per page
size) so each jitted builder compiles once per static geometry, not once per example.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv41_jax import (
    DEFAULT_BUCKETS,
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

T_PIN, R_PIN, MAX_SEQ = 64, 8, 200


def cdiv(a, b):
    return -(-a // b)


def table_width(unit):
    """Pinned block-table width for pages of `unit` tokens: a little short of MAX_SEQ, so the longest
    sequences also exercise 'page past the table'."""
    return max(1, cdiv(9 * MAX_SEQ // 10, unit))


_JIT: dict = {}


def jitted(fn, **static):
    """One jax.jit per (function, static arguments): compiles once per geometry per shape."""
    key = (fn, tuple(sorted(static.items())))
    if key not in _JIT:
        _JIT[key] = jax.jit(functools.partial(fn, **static))
    return _JIT[key]


def L(x):
    return np.asarray(x).tolist()


def trace_only(fn, *args, **static):
    """Run fn abstractly (for argument-error tests: no eager op compiles)."""
    return jax.eval_shape(functools.partial(fn, **static), *args)


# --------------------------------------------------------------------------------- batches
@dataclasses.dataclass
class Batch:
    query_lens: list
    seq_lens: list
    rows: list  # ragged block-table rows
    slots: list  # one per packed token (-1 = invalid)
    num_spec: int
    T: int
    R: int
    B: int

    def common(self):
        return make_common_attention_metadata(self.query_lens, self.seq_lens, self.rows, self.slots,
                                              num_tokens=self.T, num_reqs=self.R, num_blocks=self.B)

    # Padded host views, as the module docstring specifies padding (q_len 0, seq 0, rows of -1, slot -1).
    @property
    def qsl(self):
        out = [0]
        for q in self.query_lens:
            out.append(out[-1] + q)
        return out + [out[-1]] * (self.R - len(self.query_lens))

    @property
    def seq(self):
        return list(self.seq_lens) + [0] * (self.R - len(self.seq_lens))

    @property
    def table(self):
        t = [list(r) + [-1] * (self.B - len(r)) for r in self.rows]
        return t + [[-1] * self.B for _ in range(self.R - len(self.rows))]

    @property
    def slot_map(self):
        return list(self.slots) + [-1] * (self.T - len(self.slots))

    @property
    def num_tokens(self):
        return sum(self.query_lens)


def make_batch(rng, unit, *, num_spec, n_dec, n_pre, n_pad, prefix_max, p_neg, p_inv, short_rows,
               T=T_PIN, R=R_PIN, B=None):
    B = table_width(unit) if B is None else B
    thr = 1 + num_spec
    ql = [int(rng.integers(0, thr + 1)) for _ in range(n_dec)]
    room = T - sum(ql)
    for _ in range(n_pre):
        if room < thr + 1:
            break
        q = int(rng.integers(thr + 1, min(thr + 24, room) + 1))
        ql.append(q)
        room -= q
    ql += [0] * n_pad
    seqs = []
    for i, q in enumerate(ql):
        if i >= len(ql) - n_pad and rng.integers(0, 2):
            seqs.append(0)
            continue
        seqs.append(q + int(rng.integers(0, min(prefix_max, MAX_SEQ - q) + 1)))
    rows = []
    for s in seqs:
        need = cdiv(s, unit)
        n = need + int(rng.integers(-1, 2)) if short_rows else need + int(rng.integers(0, 2))
        n = max(0, min(B, n))
        row = rng.integers(0, 400, size=n)
        neg = rng.random(n) < p_neg
        row[neg] = rng.integers(-5, 0, size=int(neg.sum()))
        rows.append(row.tolist())
    n_tok = sum(ql)
    slots = rng.integers(0, 1 << 20, size=n_tok)
    slots[rng.random(n_tok) < p_inv] = -1
    return Batch(ql, seqs, rows, slots.tolist(), num_spec, T, R, B)


@st.composite
def batches(draw, unit, num_spec=None, **fixed):
    kw = dict(
        num_spec=draw(st.integers(0, 3)) if num_spec is None else num_spec,
        n_dec=draw(st.integers(0, 6)),
        prefix_max=draw(st.sampled_from([0, 3, 40, MAX_SEQ])),
        p_neg=draw(st.sampled_from([0.0, 0.05, 0.3])),
        p_inv=draw(st.sampled_from([0.0, 0.2, 0.6])),
        short_rows=draw(st.booleans()),
    )
    kw["n_pre"] = draw(st.integers(0, 6 - kw["n_dec"]))
    kw["n_pad"] = draw(st.integers(0, 6 - kw["n_dec"] - kw["n_pre"]))
    kw.update(fixed)
    seed = draw(st.integers(0, 2**32 - 1))
    return make_batch(np.random.default_rng(seed), unit, **kw)


def with_geometry(geos, unit_of, **kw):
    return st.sampled_from(geos).flatmap(lambda g: st.tuples(st.just(g), batches(unit_of(g), **kw)))


# ---------------------------------------------------------------------------------- oracles
def tokens_of(b: Batch):
    """(request, packed token, position) of every token, request by request."""
    qsl, seq = b.qsl, b.seq
    for r in range(b.R):
        q = qsl[r + 1] - qsl[r]
        for k in range(q):
            yield r, qsl[r] + k, seq[r] - q + k


def paged_slot(row, p, size):
    """Slot of position p in a page table row; -1 for a negative page or a page past the row."""
    if p < 0:
        return -1
    col = p // size
    if col >= len(row) or row[col] < 0:
        return -1
    return row[col] * size + p % size


def o_token_to_req(b):
    out = [0] * b.T
    for r, t, _ in tokens_of(b):
        out[t] = r
    return out


def o_positions(b):
    pos, inb = [0] * b.T, [False] * b.T
    for _, t, p in tokens_of(b):
        pos[t], inb[t] = p, True
    return pos, inb


def o_split(b, thr):
    ql = b.query_lens
    n = len(ql)
    total = sum(ql)
    if max(ql, default=0) <= thr:
        return dict(num_decodes=n, num_prefills=0, num_decode_tokens=total, num_prefill_tokens=0)
    first = next(i for i in range(n) if ql[i] > thr)
    ndt = sum(ql[:first])
    return dict(num_decodes=first, num_prefills=n - first, num_decode_tokens=ndt, num_prefill_tokens=total - ndt)


def o_compressed_slots(b, r, spp):
    """vllm_deepseek_v4.md section 3 (newest form), table clamped to >= 0 first."""
    out = [-1] * b.T
    slots, table = b.slot_map, b.table
    for req, t, pos in tokens_of(b):
        if (pos + 1) % r != 0 or slots[t] == -1:
            continue
        state = pos // r
        col = state // spp
        if col >= len(table[req]):
            continue  # module decision: a state past the table gets -1
        out[t] = max(table[req][col], 0) * spp + state % spp
    return out


def o_swa(b, W, bs):
    """vllm_deepseek_v4.md 2.3 step 4; tokens with slot -1 get len 0 and a row of -1."""
    idx = [[-1] * W for _ in range(b.T)]
    lens = [0] * b.T
    slots, table = b.slot_map, b.table
    for req, t, pos in tokens_of(b):
        if slots[t] == -1:
            continue
        start = max(pos - W + 1, 0)
        lens[t] = pos + 1 - start
        for k in range(lens[t]):
            idx[t][k] = paged_slot(table[req], start + k, bs)
    return idx, lens


def o_gather_lens(b, W):
    out = []
    for r in range(b.R):
        q = b.qsl[r + 1] - b.qsl[r]
        out.append(q + min(max(b.seq[r] - q, 0), W - 1))
    return out


def o_chunk_plan(seq_lens, query_lens, W, r, max_model_len, mnbt, chunk_size=4, has_compressed=None):
    hc = (r != 0) if has_compressed is None else has_compressed
    area = chunk_size * ((cdiv(max_model_len, r) if hc else 0) + W + mnbt)
    n_i = [(s // r if hc else 0) for s in seq_lens]
    g_i = [q + min(max(s - q, 0), W - 1) for s, q in zip(seq_lens, query_lens)]
    plan, i = [], 0
    while i < len(seq_lens):
        j, mn, mg = i + 1, n_i[i], g_i[i]
        while j < len(seq_lens):
            cn, cg = max(mn, n_i[j]), max(mg, g_i[j])
            if (j - i + 1) * (cn + cg) > area:
                break
            mn, mg, j = cn, cg, j + 1
        plan.append((i, j, mn, mn + mg))
        i = j
    return plan


# ---------------------------------------------------------------------- common metadata
@settings(max_examples=30, deadline=None)
@given(batches(unit=5))
def test_make_common_attention_metadata_pads(b):
    c = b.common()
    assert L(c.query_start_loc) == b.qsl
    assert L(c.seq_lens) == b.seq
    assert L(c.block_table) == b.table
    assert L(c.slot_mapping) == b.slot_map
    assert int(c.num_reqs) == len(b.query_lens)
    assert int(c.num_actual_tokens) == b.num_tokens
    assert int(c.max_query_len) == max(b.query_lens, default=0)
    assert int(c.max_seq_len) == max(b.seq_lens, default=0)
    assert L(c.query_lens) == [b.qsl[i + 1] - b.qsl[i] for i in range(b.R)]
    assert c.padded_num_reqs == b.R and c.padded_num_tokens == b.T
    for a in (c.query_start_loc, c.seq_lens, c.block_table, c.slot_mapping, c.num_reqs):
        assert a.dtype == jnp.int32


def test_make_common_default_buckets():
    c = make_common_attention_metadata([1, 30], [9, 100], [[3], [4, 5, 6, 7, 8]], list(range(31)))
    assert c.padded_num_tokens == DEFAULT_BUCKETS.tokens(31) == 32
    assert c.padded_num_reqs == DEFAULT_BUCKETS.reqs(2) == 8
    assert c.block_table.shape == (8, DEFAULT_BUCKETS.blocks(5)) == (8, 8)


@pytest.mark.parametrize("args,kw,word", [
    (([1, 2], [3], [[0], [0]], [0, 0, 0]), {}, "same length"),
    (([-1], [3], [[0]], []), {}, "query_lens"),
    (([4], [3], [[0]], [0] * 4), {}, "seq_lens"),
    (([1], [3], [[0], [1]], [0]), {}, "block_table"),
    (([2], [3], [[0]], [0]), {}, "slot_mapping"),
    (([2], [3], [[0]], [0, 1 << 33]), {}, "int32"),
    (([20], [30], [[0]], [0] * 20), dict(num_tokens=16), "num_tokens"),
    (([1] * 3, [3] * 3, [[0]] * 3, [0] * 3), dict(num_reqs=2), "num_reqs"),
    (([1], [3], [[0, 1, 2]], [0]), dict(num_blocks=2), "num_blocks"),
])
def test_make_common_errors(args, kw, word):
    with pytest.raises(ValueError, match=word):
        make_common_attention_metadata(*args, **kw)


# ------------------------------------------------------------------ token -> request, positions
@settings(max_examples=40, deadline=None)
@given(batches(unit=3))
def test_token_to_req_indices_oracle(b):
    c = b.common()
    got = jitted(token_to_req_indices, num_tokens=b.T)(c.query_start_loc)
    assert got.dtype == jnp.int32 and got.shape == (b.T,)
    assert L(got) == o_token_to_req(b)
    assert L(c.token_to_req_indices()) == o_token_to_req(b)


@settings(max_examples=40, deadline=None)
@given(batches(unit=3))
def test_token_positions_oracle(b):
    c = b.common()
    tp = jitted(token_positions, num_tokens=b.T)(c.query_start_loc, c.seq_lens)
    pos, inb = o_positions(b)
    assert L(tp.req) == o_token_to_req(b)
    assert L(tp.pos) == pos
    assert L(tp.in_batch) == inb


def test_token_to_req_zero_length_requests_own_nothing():
    # requests 0 and 2 have query_len 0; padding tokens at or past qsl[-1] get 0
    qsl = jnp.array([0, 0, 3, 3, 5, 5], jnp.int32)
    assert L(token_to_req_indices(qsl, 8)) == [1, 1, 1, 3, 3, 0, 0, 0]
    assert L(token_to_req_indices(qsl, 0)) == []


# -------------------------------------------------------------------- decode / prefill split
@settings(max_examples=50, deadline=None)
@given(b=batches(unit=64), thr_override=st.sampled_from([None, 1]))
def test_split_decodes_and_prefills_oracle(b, thr_override):
    thr = decode_threshold(b.num_spec) if thr_override is None else thr_override
    got = jitted(split_decodes_and_prefills, decode_threshold=thr)(b.common())
    want = o_split(b, thr)
    for k, v in want.items():
        assert int(getattr(got, k)) == v, k


def test_decode_threshold():
    assert decode_threshold() == 1
    assert decode_threshold(0) == 1
    assert decode_threshold(2) == 3  # MTP 2 -> 3
    assert decode_threshold(2, parallel_drafting=True) == 5
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        decode_threshold(-1)
    with pytest.raises(TypeError, match="num_speculative_tokens"):
        decode_threshold(1.0)


@settings(max_examples=40, deadline=None)
@given(ql=st.lists(st.integers(0, 9), max_size=20), thr=st.integers(1, 4))
def test_reorder_decodes_first_oracle(ql, thr):
    want = [i for i, q in enumerate(ql) if q <= thr] + [i for i, q in enumerate(ql) if q > thr]
    assert L(reorder_decodes_first(ql, decode_threshold=thr)) == want


def _counts(s):
    return int(s.num_decodes), int(s.num_prefills), int(s.num_decode_tokens), int(s.num_prefill_tokens)


def test_spec_decode_counts_as_decode():
    # num_spec 2: query_len 3 is a decode, 4 is a prefill
    c = make_common_attention_metadata([1, 3, 3, 4, 1], [10, 20, 30, 40, 50], [[0]] * 5, list(range(12)),
                                       num_tokens=16, num_reqs=8, num_blocks=4)
    assert _counts(jitted(split_decodes_and_prefills, decode_threshold=decode_threshold(2))(c)) == (3, 2, 7, 5)
    assert _counts(jitted(split_decodes_and_prefills, decode_threshold=1)(c)) == (1, 4, 1, 11)
    # everything at or under the threshold: all decodes (a query_len 0 request included)
    c = make_common_attention_metadata([1, 3, 0], [10, 20, 5], [[0]] * 3, list(range(4)),
                                       num_tokens=16, num_reqs=8, num_blocks=4)
    assert _counts(jitted(split_decodes_and_prefills, decode_threshold=3)(c)) == (3, 0, 4, 0)


# --------------------------------------------------------------------- compressed slot mapping
CSM_GEOS = [(4, 64), (2, 3), (2, 32), (1, 5), (2, 1), (4, 61)]  # (compress_ratio, states/page)


@settings(max_examples=60, deadline=None)
@given(with_geometry(CSM_GEOS, lambda g: g[0] * g[1]))
def test_compressed_slot_mapping_oracle(gb):
    (r, spp), b = gb
    c = b.common()
    got = jitted(compressed_slot_mapping, states_per_page=spp, compress_ratio=r)(
        c.slot_mapping, c.query_start_loc, c.seq_lens, c.block_table)
    assert got.dtype == jnp.int32 and got.shape == (b.T,)
    assert L(got) == o_compressed_slots(b, r, spp)


def test_compressed_slot_mapping_worked_example():
    # vllm_deepseek_v4.md section 3: r=4, 64 states per page, prefix 240, q_len 40, block table [5, 7].
    rng = np.random.default_rng(3)
    slots = rng.integers(0, 1 << 20, size=40).tolist()
    c = make_common_attention_metadata([40], [280], [[5, 7]], slots, num_tokens=64, num_reqs=8, num_blocks=4)
    got = L(jitted(compressed_slot_mapping, states_per_page=64, compress_ratio=4)(
        c.slot_mapping, c.query_start_loc, c.seq_lens, c.block_table))
    assert len(got) == 64
    valid = [(k, s) for k, s in enumerate(got[:40]) if s != -1]
    assert [s for _, s in valid] == [5 * 64 + i for i in range(60, 64)] + [7 * 64 + i for i in range(0, 6)]
    assert [k for k, _ in valid] == list(range(3, 40, 4))  # the last token of each group of 4
    assert sum(1 for s in got[:40] if s == -1) == 30
    assert all(s == -1 for s in got[40:])


def test_compressed_slot_mapping_own_slot_and_negative_table():
    # a token whose own slot is -1 writes nothing; negative table entries are clamped to 0
    c = make_common_attention_metadata([4], [8], [[-1, -3]], [11, 12, 13, -1], num_tokens=16, num_reqs=8,
                                       num_blocks=4)
    got = L(jitted(compressed_slot_mapping, states_per_page=2, compress_ratio=2)(
        c.slot_mapping, c.query_start_loc, c.seq_lens, c.block_table))
    # positions 4..7: pos 5 closes state 2 (page 1 -> clamped 0, offset 0); pos 7 has slot -1
    assert got[:4] == [-1, 0, -1, -1]


# ------------------------------------------------------------------------- SWA window indices
SWA_GEOS = [(1, 7), (3, 16), (5, 64), (61, 1), (64, 128), (2, 5)]  # (block_size, window)


@settings(max_examples=60, deadline=None)
@given(with_geometry(SWA_GEOS, lambda g: g[0]))
def test_swa_window_indices_oracle(gb):
    (bs, W), b = gb
    c = b.common()
    idx, lens = jitted(swa_window_indices, window=W, block_size=bs)(
        c.query_start_loc, c.seq_lens, c.block_table, c.slot_mapping)
    want_idx, want_lens = o_swa(b, W, bs)
    assert idx.shape == (b.T, W) and idx.dtype == jnp.int32 and lens.dtype == jnp.int32
    assert L(lens) == want_lens
    assert L(idx) == want_idx


def test_swa_window_small_example():
    # one request, prefix 3, q 2, block size 2, table [9, 4, 6], window 4
    c = make_common_attention_metadata([2], [5], [[9, 4, 6]], [100, 101], num_tokens=16, num_reqs=8, num_blocks=4)
    idx, lens = jitted(swa_window_indices, window=4, block_size=2)(
        c.query_start_loc, c.seq_lens, c.block_table, c.slot_mapping)
    # pos 3: positions 0..3 -> 18, 19, 8, 9; pos 4: positions 1..4 -> 19, 8, 9, 12
    assert L(lens)[:3] == [4, 4, 0]
    assert L(idx)[:2] == [[18, 19, 8, 9], [19, 8, 9, 12]]
    assert L(idx)[2] == [-1] * 4


# ------------------------------------------------------------------------ global top-k indices
# (kernel block tokens, compress ratio, pass is_valid_token)
GTK_GEOS = [(64, 2, True), (64, 1, False), (128, 2, False), (6, 2, True), (5, 1, True), (3, 1, False)]


@settings(max_examples=40, deadline=None)
@given(gb=with_geometry(GTK_GEOS, lambda g: g[0]), seed=st.integers(0, 2**32 - 1))
def test_global_topk_indices_oracle(gb, seed):
    (blk, r, use_valid), b = gb
    spp = blk // r
    K = 8
    rng = np.random.default_rng(seed)
    topk = rng.integers(-1, MAX_SEQ // r + 8, size=(b.T, K))
    topk[rng.random((b.T, K)) < 0.3] = -1
    c = b.common()
    req = o_token_to_req(b)
    valid = [s >= 0 for s in b.slot_map] if use_valid else [True] * b.T
    fn = jitted(global_topk_indices, states_per_page=spp)
    if use_valid:
        idx, lens = fn(jnp.asarray(topk, jnp.int32), jnp.asarray(req, jnp.int32), c.block_table,
                       is_valid_token=c.slot_mapping >= 0)
    else:
        idx, lens = fn(jnp.asarray(topk, jnp.int32), jnp.asarray(req, jnp.int32), c.block_table)
    want_idx = [[-1] * K for _ in range(b.T)]
    want_lens = [0] * b.T
    table = b.table
    for t in range(b.T):
        if not valid[t]:
            continue
        for k in range(K):
            l = int(topk[t, k])
            if l < 0:
                continue
            want_lens[t] += 1
            want_idx[t][k] = paged_slot(table[req[t]], l, spp)
    assert L(idx) == want_idx
    assert L(lens) == want_lens


# ----------------------------------------------------------------------------- prefill side
@settings(max_examples=40, deadline=None)
@given(b=batches(unit=64), W=st.sampled_from([1, 5, 128]))
def test_prefill_gather_lens_oracle(b, W):
    c = b.common()
    got = jitted(prefill_gather_lens, window=W)(c.query_start_loc, c.seq_lens)
    assert L(got) == o_gather_lens(b, W)


def test_chunk_plan_worked_example():
    # vllm_deepseek_v4.md 2.3 step 6
    plan = prefill_chunk_plan([80, 96, 112, 128, 144], [4] * 5, window=64, compress_ratio=4, max_model_len=1024,
                              max_num_batched_tokens=128, has_compressed=True)
    assert plan == [(0, 5, 36, 103)]
    assert isinstance(plan[0], PrefillChunk) and plan[0].N == 36 and plan[0].M == 103
    # default has_compressed = (r != 0) gives the same for r = 4
    assert prefill_chunk_plan([80, 96, 112, 128, 144], [4] * 5, window=64, compress_ratio=4, max_model_len=1024,
                              max_num_batched_tokens=128) == [(0, 5, 36, 103)]


def test_chunk_plan_several_chunks():
    # area = 4 * (1024/4 + 64 + 128) = 1792; seq 1024, q 100: N 256, G 163 -> 419 a request: 4 per chunk
    plan = prefill_chunk_plan([1024] * 10, [100] * 10, window=64, compress_ratio=4, max_model_len=1024,
                              max_num_batched_tokens=128)
    assert plan == [(0, 4, 256, 419), (4, 8, 256, 419), (8, 10, 256, 419)]
    # growing requests: the chunk closes when the running maxima no longer fit
    seq, q = [100, 200, 1024, 1024, 1024, 1024, 50], [10, 20, 100, 100, 100, 100, 50]
    plan = prefill_chunk_plan(seq, q, window=64, compress_ratio=4, max_model_len=1024, max_num_batched_tokens=128)
    assert plan == o_chunk_plan(seq, q, 64, 4, 1024, 128)
    assert len(plan) >= 2
    # a request larger than the whole area still gets a chunk of its own
    plan = prefill_chunk_plan([4096, 10], [4096, 10], window=8, compress_ratio=0, max_model_len=4096,
                              max_num_batched_tokens=16)
    assert plan == [(0, 1, 0, 4096), (1, 2, 0, 10)]
    # V4.1 ratio 1: full-length compressed cache, N = seq_len
    plan = prefill_chunk_plan([300, 400], [5, 6], window=128, compress_ratio=1, max_model_len=512,
                              max_num_batched_tokens=64)
    assert plan == o_chunk_plan([300, 400], [5, 6], 128, 1, 512, 64)
    assert plan[0].N == 400 and plan[0].M == 400 + 6 + 127
    # V4.0 semantics for r = 1 (no compressed cache)
    plan = prefill_chunk_plan([300, 400], [5, 6], window=128, compress_ratio=1, max_model_len=512,
                              max_num_batched_tokens=64, has_compressed=False)
    assert plan == [(0, 2, 0, 133)]
    assert prefill_chunk_plan([], [], window=8, compress_ratio=2, max_model_len=64, max_num_batched_tokens=8) == []


@settings(max_examples=60, deadline=None)
@given(data=st.data(), n=st.integers(1, 30), W=st.sampled_from([1, 8, 64, 128]), r=st.sampled_from([0, 1, 2, 4]),
       max_model_len=st.sampled_from([64, 1024, 8192]), mnbt=st.sampled_from([16, 128, 2048]),
       chunk_size=st.sampled_from([1, 4]), has_compressed=st.sampled_from([None, True, False]))
def test_chunk_plan_oracle(data, n, W, r, max_model_len, mnbt, chunk_size, has_compressed):
    if r == 0 and has_compressed:
        has_compressed = None
    q = data.draw(st.lists(st.integers(1, 600), min_size=n, max_size=n))
    seq = [qq + data.draw(st.integers(0, max_model_len)) for qq in q]
    got = prefill_chunk_plan(seq, q, window=W, compress_ratio=r, max_model_len=max_model_len,
                             max_num_batched_tokens=mnbt, chunk_size=chunk_size, has_compressed=has_compressed)
    assert [tuple(c) for c in got] == o_chunk_plan(seq, q, W, r, max_model_len, mnbt, chunk_size, has_compressed)
    # chunks tile the requests in order
    assert got[0].start == 0 and got[-1].end == n
    assert all(a.end == b.start for a, b in zip(got, got[1:]))


# (swa block size, compress ratio, states/page, N, M): M - N < max gather in the last one (truncation)
PWS_GEOS = [(5, 2, 3, 40, 100), (64, 1, 64, 120, 200), (3, 0, None, 0, 50), (61, 2, 32, 16, 36), (1, 2, 1, 8, 8)]
C_PIN = 4


@settings(max_examples=40, deadline=None)
@given(gb=with_geometry(PWS_GEOS, lambda g: g[0]), seed=st.integers(0, 2**32 - 1), W=st.sampled_from([1, 20]),
       req_start=st.integers(0, R_PIN), nlive=st.integers(0, C_PIN))
def test_prefill_workspace_slots_oracle(gb, seed, W, req_start, nlive):
    (bs, r, spp, N, M), b = gb
    rng = np.random.default_rng(seed)
    c = b.common()
    gl = o_gather_lens(b, W)
    cbt = None
    if r:
        Bc = table_width(r * spp)
        cbt = rng.integers(0, 300, size=(b.R, Bc))
        cbt[rng.random((b.R, Bc)) < 0.1] = -2
    fn = jitted(prefill_workspace_slots, num_chunk_reqs=C_PIN, N=N, M=M, swa_block_size=bs, compress_ratio=r,
                states_per_page=spp)
    comp, swa = fn(c.seq_lens, jnp.asarray(gl, jnp.int32), c.block_table,
                   None if cbt is None else jnp.asarray(cbt, jnp.int32),
                   req_start=jnp.int32(req_start), num_reqs_in_chunk=jnp.int32(nlive))
    want_comp = [[-1] * N for _ in range(C_PIN)]
    want_swa = [[-1] * (M - N) for _ in range(C_PIN)]
    seq, table = b.seq, b.table
    for row in range(C_PIN):
        req = req_start + row
        if row >= nlive or req >= b.R:
            continue
        S, G = seq[req], gl[req]
        for j in range(M - N):
            if j < G:
                want_swa[row][j] = paged_slot(table[req], S - G + j, bs)
        if r:
            for i in range(N):
                if i < S // r:
                    want_comp[row][i] = paged_slot(cbt[req].tolist(), i, spp)
    assert comp.shape == (C_PIN, N) and swa.shape == (C_PIN, M - N)
    assert L(comp) == want_comp
    assert L(swa) == want_swa


# (window, compress ratio, index_topk, N, M)
CMB_GEOS = [(16, 2, 8, 100, 180), (5, 1, 12, 130, 200), (64, 0, 4, 0, 90), (1, 2, 3, 7, 9)]


@settings(max_examples=40, deadline=None)
@given(gb=with_geometry(CMB_GEOS, lambda g: 1), seed=st.integers(0, 2**32 - 1),
       req_start=st.integers(0, R_PIN), span=st.integers(0, R_PIN))
def test_combine_topk_swa_indices_oracle(gb, seed, req_start, span):
    (W, r, K, N, M), b = gb
    req_end = min(req_start + span, R_PIN)
    rng = np.random.default_rng(seed)
    topk = rng.integers(-1, 100, size=(b.T, K))
    gl = o_gather_lens(b, W)
    c = b.common()
    fn = jitted(combine_topk_swa_indices, window=W, compress_ratio=r, N=N, M=M)
    idx, lens = fn(jnp.asarray(topk, jnp.int32), c.query_start_loc, c.seq_lens, jnp.asarray(gl, jnp.int32),
                   req_start=jnp.int32(req_start), req_end=jnp.int32(req_end))
    Kc = K if r else 0
    width = cdiv(Kc + W, 128) * 128
    want_idx = [[-1] * width for _ in range(b.T)]
    want_lens = [0] * b.T
    seq = b.seq
    for req, t, pos in tokens_of(b):
        if not req_start <= req < req_end:
            continue
        row = req - req_start
        tk = min((pos + 1) // r, Kc) if r else 0
        sw = min(pos + 1, W)
        # a top-k entry outside [0, N) must stay -1, never land in a neighbouring request's rows
        entries = [int(topk[t, k]) + M * row if 0 <= topk[t, k] < N else -1 for k in range(tk)]
        entries += [M * row + N + (pos - sw + 1 - (seq[req] - gl[req])) + j for j in range(sw)]
        want_idx[t][: len(entries)] = entries
        want_lens[t] = tk + sw
    assert idx.shape == (b.T, width)
    assert L(lens) == want_lens
    assert L(idx) == want_idx


def test_combine_explicit_width_and_errors():
    c = make_common_attention_metadata([3], [10], [[0]], [1, 2, 3], num_tokens=16, num_reqs=8, num_blocks=4)
    topk = jnp.asarray(np.random.default_rng(0).integers(0, 5, size=(16, 4)), jnp.int32)
    gl = jitted(prefill_gather_lens, window=4)(c.query_start_loc, c.seq_lens)
    idx, lens = jitted(combine_topk_swa_indices, window=4, compress_ratio=2, N=5, M=16, width=256)(
        topk, c.query_start_loc, c.seq_lens, gl, req_start=0, req_end=1)
    assert idx.shape == (16, 256)
    assert L(lens)[:3] == [min(8 // 2, 4) + 4, min(9 // 2, 4) + 4, min(10 // 2, 4) + 4]
    with pytest.raises(ValueError, match="width"):
        jax.eval_shape(lambda *a: combine_topk_swa_indices(*a, req_start=0, req_end=1, window=4, compress_ratio=2,
                                                           N=5, M=16, width=7), topk, c.query_start_loc, c.seq_lens, gl)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_chunk_workspace_and_combined_indices_reproduce_cache_slots(seed):
    """End to end on the prefill side: reading the chunk workspace at the combined indices gives the same
    cache slots as the sliding window (the last `sw` positions) and the indexer's global top-k slots.
    Workspace sizes are pinned at upper bounds (N >= every N_i, M - N >= every G_i) so one compile serves
    every chunk; the chunk boundaries come from prefill_chunk_plan."""
    rng = np.random.default_rng(seed)
    W, bs, r, K, spp = 8, 5, 2, 6, 3
    C, N, M = 6, MAX_SEQ // r, MAX_SEQ // r + T_PIN + W
    b = make_batch(rng, bs, num_spec=1, n_dec=2, n_pre=int(rng.integers(2, 5)), n_pad=0, prefix_max=MAX_SEQ,
                   p_neg=0.1, p_inv=0.2, short_rows=False, B=cdiv(MAX_SEQ, bs))
    c = b.common()
    nd = o_split(b, 2)["num_decodes"]
    n_req = len(b.query_lens)
    cbt = rng.integers(0, 300, size=(b.R, cdiv(MAX_SEQ, r * spp)))
    cbt[rng.random(cbt.shape) < 0.1] = -1
    gl = o_gather_lens(b, W)
    # the indexer's packed local top-k: the first min(visible, K) of a permutation of the visible entries
    topk = np.full((b.T, K), -1, np.int64)
    for _, t, p in tokens_of(b):
        sel = rng.permutation((p + 1) // r)[:K]
        topk[t, : len(sel)] = sel
    chunks = prefill_chunk_plan(b.seq_lens[nd:n_req], b.query_lens[nd:n_req], window=W, compress_ratio=r,
                                max_model_len=MAX_SEQ, max_num_batched_tokens=b.T, chunk_size=1)
    assert chunks and all(ch.end - ch.start <= C and ch.N <= N and ch.M - ch.N <= M - N for ch in chunks)
    ws = jitted(prefill_workspace_slots, num_chunk_reqs=C, N=N, M=M, swa_block_size=bs, compress_ratio=r,
                states_per_page=spp)
    comb = jitted(combine_topk_swa_indices, window=W, compress_ratio=r, N=N, M=M)
    seen = 0
    for ch in chunks:
        lo, hi = nd + ch.start, nd + ch.end
        comp, swa = ws(c.seq_lens, jnp.asarray(gl, jnp.int32), c.block_table, jnp.asarray(cbt, jnp.int32),
                       req_start=jnp.int32(lo), num_reqs_in_chunk=jnp.int32(hi - lo))
        flat = np.concatenate([np.asarray(comp), np.asarray(swa)], axis=1).reshape(-1).tolist()
        idx, lens = comb(jnp.asarray(topk, jnp.int32), c.query_start_loc, c.seq_lens, jnp.asarray(gl, jnp.int32),
                         req_start=jnp.int32(lo), req_end=jnp.int32(hi))
        idx, lens = L(idx), L(lens)
        for req, t, pos in tokens_of(b):
            if not lo <= req < hi:
                assert lens[t] == 0 and all(v == -1 for v in idx[t])
                continue
            seen += 1
            tk, sw = min((pos + 1) // r, K), min(pos + 1, W)
            assert lens[t] == tk + sw
            for k in range(tk):
                assert flat[idx[t][k]] == paged_slot(cbt[req].tolist(), int(topk[t, k]), spp)
            for j in range(sw):
                assert flat[idx[t][tk + j]] == paged_slot(b.table[req], pos - sw + 1 + j, bs)
            assert all(v == -1 for v in idx[t][tk + sw:])
    assert seen == sum(b.query_lens[nd:n_req])


# ---------------------------------------------------------------------------- FlashMLA metadata
FM_GEOS = [(1, 64, None), (2, 64, None), (2, 5, None), (1, 3, None), (2, 64, 16)]  # r, block, num_states


def _fm_unit(g):
    r, bs, ns = g
    if r == 1:
        return bs
    return (bs // r if ns is None else ns) * r


@settings(max_examples=50, deadline=None)
@given(with_geometry(FM_GEOS, _fm_unit))
def test_build_flashmla_metadata_oracle(gb):
    (r, bs, ns), b = gb
    c = b.common()
    m = jitted(build_flashmla_metadata, compress_ratio=r, block_size=bs, topk_tokens=512, num_states=ns)(c)
    assert L(m.req_id_per_token) == o_token_to_req(b)
    assert L(m.query_start_loc) == b.qsl
    assert int(m.num_reqs) == len(b.query_lens) and int(m.num_actual_tokens) == b.num_tokens
    assert int(m.max_query_len) == max(b.query_lens, default=0)
    assert int(m.max_seq_len) == max(b.seq_lens, default=0)
    assert m.block_size == bs and m.topk_tokens == 512
    if r == 1:
        # ratio 1: the per-token slot mapping and the table as they are
        assert L(m.slot_mapping) == b.slot_map
        assert L(m.block_table) == b.table
    else:
        spp = bs // r if ns is None else ns
        assert L(m.slot_mapping) == o_compressed_slots(b, r, spp)
        assert L(m.block_table) == [[max(v, 0) for v in row] for row in b.table]


@pytest.mark.parametrize("r", [3, 0, 4, 128, -1])
def test_build_flashmla_metadata_bad_ratio(r):
    c = make_common_attention_metadata([1], [5], [[0]], [3], num_tokens=16, num_reqs=8, num_blocks=4)
    msg = f"DeepSeek V4.1 compressed-KV caches use compress_ratio 1 or 2; got {r}."
    with pytest.raises(ValueError, match="^" + re.escape(msg) + "$"):
        build_flashmla_metadata(c, compress_ratio=r, block_size=64, topk_tokens=512)


def test_build_flashmla_metadata_other_errors():
    c = make_common_attention_metadata([1], [5], [[0]], [3], num_tokens=16, num_reqs=8, num_blocks=4)
    with pytest.raises(TypeError, match="compress_ratio"):
        trace_only(build_flashmla_metadata, c, compress_ratio=2.0, block_size=64, topk_tokens=512)
    with pytest.raises(TypeError, match="block_size"):
        trace_only(build_flashmla_metadata, c, compress_ratio=2, block_size=jnp.int32(64), topk_tokens=512)
    with pytest.raises(ValueError, match="num_states"):
        trace_only(build_flashmla_metadata, c, compress_ratio=2, block_size=1, topk_tokens=512)
    with pytest.raises(ValueError, match="topk_tokens"):
        trace_only(build_flashmla_metadata, c, compress_ratio=1, block_size=64, topk_tokens=0)


# ------------------------------------------------------------------------ sparse SWA metadata
# (window, block size, num_spec, compress_ratios, index_topk, num_sm_parts)
SWA_META_GEOS = [
    (16, 5, 1, (0, 1, 2), 8, 4),
    (7, 64, 0, None, None, 3),
    (64, 3, 2, (2, 2), 16, 1),
    (128, 61, 3, (0, 1), 32, None),
    (4, 1, 0, (0, 2, 1, 0), 3, 16),
]


def o_sparse_swa(b, W, bs, num_spec, ratios, K, P, plan_oracle):
    thr = 1 + num_spec
    split = o_split(b, thr)
    ndt, n_tok = split["num_decode_tokens"], b.num_tokens
    idx, lens = o_swa(b, W, bs)
    pos, inb = o_positions(b)
    out = dict(split)
    out["d_lens"] = [lens[t] if t < ndt else 0 for t in range(b.T)]
    out["p_lens"] = [lens[t] if ndt <= t < n_tok else 0 for t in range(b.T)]
    out["d_idx"] = [[idx[t] if t < ndt else [-1] * W] for t in range(b.T)]
    out["p_idx"] = [[idx[t] if ndt <= t < n_tok else [-1] * W] for t in range(b.T)]
    gl = o_gather_lens(b, W)
    nd, nr = split["num_decodes"], len(b.query_lens)
    out["prefill_seq_lens"] = [b.seq[r] if nd <= r < nr else 0 for r in range(b.R)]
    out["prefill_query_lens"] = [b.qsl[r + 1] - b.qsl[r] if nd <= r < nr else 0 for r in range(b.R)]
    out["prefill_gather_lens"] = [gl[r] if nd <= r < nr else 0 for r in range(b.R)]
    out["pos"], out["req"] = pos, o_token_to_req(b)
    out["valid"] = [s >= 0 for s in b.slot_map]
    types = sorted({{0: "swaonly", 1: "c1a", 2: "c2a"}[r] for r in (ratios or [0])},
                   key=["swaonly", "c1a", "c2a"].index)
    out["types"] = tuple(types)
    # extra cache entries a decode token attends: what the indexer passes to the kernel (0 for a token with
    # no valid slot, as the global top-k lengths are)
    out["extra"] = {}
    for r in (1, 2):
        out["extra"][r] = [min((pos[t] + 1) // r, K) if (K and t < ndt and out["valid"][t]) else 0
                           for t in range(b.T)]
    out["sched"] = {}
    if P is not None:
        for lt in types:
            if lt == "swaonly":
                out["sched"][lt] = plan_oracle(out["d_lens"], topk=W, num_sm_parts=P)
            else:
                r = {"c1a": 1, "c2a": 2}[lt]
                out["sched"][lt] = plan_oracle(out["d_lens"], topk=W, num_sm_parts=P,
                                               extra_topk_length=out["extra"][r])
    return out


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(SWA_META_GEOS).flatmap(lambda g: st.tuples(st.just(g), batches(g[1], num_spec=g[2]))))
def test_build_sparse_swa_metadata_oracle(plan_oracle, gb):
    (W, bs, num_spec, ratios, K, P), b = gb
    c = b.common()
    m = jitted(build_sparse_swa_metadata, window=W, block_size=bs, num_speculative_tokens=num_spec,
               compress_ratios=ratios, index_topk=K, num_sm_parts=P)(c)
    want = o_sparse_swa(b, W, bs, num_spec, ratios, K, P, plan_oracle)
    for k in ("num_decodes", "num_prefills", "num_decode_tokens", "num_prefill_tokens"):
        assert int(getattr(m, k)) == want[k], k
    assert m.decode_swa_indices.shape == (b.T, 1, W) and m.prefill_swa_indices.shape == (b.T, 1, W)
    assert L(m.decode_swa_lens) == want["d_lens"]
    assert L(m.prefill_swa_lens) == want["p_lens"]
    assert L(m.decode_swa_indices) == want["d_idx"]
    assert L(m.prefill_swa_indices) == want["p_idx"]
    assert L(m.prefill_seq_lens) == want["prefill_seq_lens"]
    assert L(m.prefill_query_lens) == want["prefill_query_lens"]
    assert L(m.prefill_gather_lens) == want["prefill_gather_lens"]
    assert L(m.token_to_req_indices) == want["req"]
    assert L(m.token_positions) == want["pos"]
    assert L(m.is_valid_token) == want["valid"]
    assert L(m.block_table) == b.table and L(m.slot_mapping) == b.slot_map
    assert L(m.seq_lens) == b.seq and L(m.query_start_loc) == b.qsl
    assert (m.window, m.block_size, m.decode_threshold) == (W, bs, 1 + num_spec)
    assert tuple(m.layer_types) == want["types"]
    if K:
        for r in (1, 2):
            assert L(m.decode_extra_topk_lens(r, K)) == want["extra"][r]
    assert set(m.tile_sched) == set(want["sched"])
    for lt, (meta, splits) in want["sched"].items():
        got_meta, got_splits = m.tile_sched[lt]
        assert L(got_meta) == meta, lt
        assert L(got_splits) == splits, lt


def test_build_sparse_swa_metadata_errors():
    c = make_common_attention_metadata([1], [5], [[0]], [3], num_tokens=16, num_reqs=8, num_blocks=4)
    with pytest.raises(ValueError, match="0, 1, or 2"):
        trace_only(build_sparse_swa_metadata, c, window=8, block_size=4, compress_ratios=[0, 4])
    with pytest.raises(ValueError, match="index_topk"):
        trace_only(build_sparse_swa_metadata, c, window=8, block_size=4, compress_ratios=[0, 1], num_sm_parts=2)
    with pytest.raises(ValueError, match="window"):
        trace_only(build_sparse_swa_metadata, c, window=0, block_size=4)
    with pytest.raises(TypeError, match="block_size"):
        trace_only(build_sparse_swa_metadata, c, window=8, block_size=4.0)
    with pytest.raises(TypeError, match="num_sm_parts"):
        trace_only(build_sparse_swa_metadata, c, window=8, block_size=4, num_sm_parts=jnp.int32(2))
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        trace_only(build_sparse_swa_metadata, c, window=8, block_size=4, num_speculative_tokens=-1)


# ----------------------------------------------------------------------------------- retracing
def _batch_list(rng, n, unit, **kw):
    out = []
    for i in range(n):
        out.append(make_batch(rng, unit, num_spec=1, n_dec=int(rng.integers(0, 5)), n_pre=int(rng.integers(0, 3)),
                              n_pad=1, prefix_max=MAX_SEQ, p_neg=0.1, p_inv=0.2, short_rows=bool(i % 2), **kw))
    return out


def test_no_retrace_within_a_bucket_sparse_swa(plan_oracle):
    traces = []

    @jax.jit
    def build(common):
        traces.append(1)
        return build_sparse_swa_metadata(common, window=16, block_size=5, num_speculative_tokens=1,
                                         compress_ratios=(0, 2), index_topk=8, num_sm_parts=4)

    rng = np.random.default_rng(11)
    small = _batch_list(rng, 5, 5)
    assert len({(tuple(b.query_lens), tuple(b.seq_lens)) for b in small}) == 5  # really different batches
    for b in small:
        m = build(b.common())
        want = o_sparse_swa(b, 16, 5, 1, (0, 2), 8, 4, plan_oracle)
        assert L(m.decode_swa_lens) == want["d_lens"]
        assert L(m.tile_sched["c2a"][0]) == want["sched"]["c2a"][0]
    assert len(traces) == 1
    # a new token bucket traces once more, then is reused
    big = _batch_list(rng, 3, 5, T=128)
    for b in big:
        m = build(b.common())
        assert L(m.prefill_swa_lens) == o_sparse_swa(b, 16, 5, 1, (0, 2), 8, 4, plan_oracle)["p_lens"]
    assert len(traces) == 2
    build(small[0].common())
    assert len(traces) == 2


def test_no_retrace_within_a_bucket_compressed_slot_mapping():
    traces = []

    @jax.jit
    def f(slot_mapping, qsl, seq_lens, block_table):
        traces.append(1)
        return compressed_slot_mapping(slot_mapping, qsl, seq_lens, block_table, states_per_page=3, compress_ratio=2)

    rng = np.random.default_rng(12)
    for b in _batch_list(rng, 5, 6):
        c = b.common()
        assert L(f(c.slot_mapping, c.query_start_loc, c.seq_lens, c.block_table)) == o_compressed_slots(b, 2, 3)
    assert len(traces) == 1
    for b in _batch_list(rng, 2, 6, R=16):
        c = b.common()
        assert L(f(c.slot_mapping, c.query_start_loc, c.seq_lens, c.block_table)) == o_compressed_slots(b, 2, 3)
    assert len(traces) == 2


# ---------------------------------------------------------------------------------- bad inputs
def _c():
    return make_common_attention_metadata([2, 1], [9, 4], [[1, 2], [3]], [5, 6, 7], num_tokens=16, num_reqs=8,
                                          num_blocks=4)


def test_bad_inputs_token_functions():
    c = _c()
    with pytest.raises(ValueError, match="query_start_loc"):
        token_to_req_indices(c.query_start_loc[None], 16)
    with pytest.raises(TypeError, match="query_start_loc"):
        token_to_req_indices(c.query_start_loc.astype(jnp.float32), 16)
    with pytest.raises(TypeError, match="num_tokens"):
        token_to_req_indices(c.query_start_loc, jnp.int32(16))
    with pytest.raises(ValueError, match="num_tokens"):
        token_to_req_indices(c.query_start_loc, -1)
    with pytest.raises(ValueError, match="query_start_loc"):
        token_positions(c.query_start_loc[:-1], c.seq_lens, 16)
    with pytest.raises(TypeError, match="seq_lens"):
        token_positions(c.query_start_loc, c.seq_lens.astype(jnp.float32), 16)


def test_bad_inputs_slot_mappings():
    c = _c()
    args = (c.slot_mapping, c.query_start_loc, c.seq_lens, c.block_table)
    kw = dict(states_per_page=4, compress_ratio=2)
    with pytest.raises(ValueError, match="slot_mapping"):
        compressed_slot_mapping(c.slot_mapping[:, None], *args[1:], **kw)
    with pytest.raises(ValueError, match="block_table"):
        compressed_slot_mapping(*args[:3], c.block_table[0], **kw)
    with pytest.raises(TypeError, match="block_table"):
        compressed_slot_mapping(*args[:3], c.block_table.astype(jnp.float32), **kw)
    with pytest.raises(ValueError, match="block_table"):
        compressed_slot_mapping(*args[:3], c.block_table[:3], **kw)
    with pytest.raises(ValueError, match="states_per_page"):
        compressed_slot_mapping(*args, states_per_page=0, compress_ratio=2)
    with pytest.raises(TypeError, match="compress_ratio"):
        compressed_slot_mapping(*args, states_per_page=4, compress_ratio=jnp.int32(2))
    with pytest.raises(TypeError, match="compress_ratio"):
        compressed_slot_mapping(*args, states_per_page=4, compress_ratio=2.0)
    sw = (c.query_start_loc, c.seq_lens, c.block_table, c.slot_mapping)
    with pytest.raises(ValueError, match="window"):
        swa_window_indices(*sw, window=0, block_size=4)
    with pytest.raises(TypeError, match="block_size"):
        swa_window_indices(*sw, window=8, block_size=None)
    with pytest.raises(TypeError, match="slot_mapping"):
        swa_window_indices(*sw[:3], c.slot_mapping.astype(jnp.float32), window=8, block_size=4)
    with pytest.raises(ValueError, match="block_table"):
        swa_window_indices(c.query_start_loc, c.seq_lens, c.block_table[:, :, None], c.slot_mapping, window=8,
                           block_size=4)


def test_bad_inputs_topk_and_prefill():
    c = _c()
    tk = jnp.asarray(np.random.default_rng(5).integers(-1, 20, size=(16, 4)), jnp.int32)
    req = token_to_req_indices(c.query_start_loc, 16)
    with pytest.raises(ValueError, match="topk_indices"):
        global_topk_indices(tk[0], req, c.block_table, states_per_page=4)
    with pytest.raises(ValueError, match="token_to_req"):
        global_topk_indices(tk, req[:8], c.block_table, states_per_page=4)
    with pytest.raises(ValueError, match="is_valid_token"):
        global_topk_indices(tk, req, c.block_table, states_per_page=4, is_valid_token=jnp.ones(8, bool))
    with pytest.raises(TypeError, match="states_per_page"):
        global_topk_indices(tk, req, c.block_table, states_per_page="4")
    with pytest.raises(ValueError, match="window"):
        prefill_gather_lens(c.query_start_loc, c.seq_lens, window=0)
    gl = prefill_gather_lens(c.query_start_loc, c.seq_lens, window=4)
    base = dict(req_start=0, num_chunk_reqs=2, swa_block_size=4, compress_ratio=2, states_per_page=2)
    with pytest.raises(ValueError, match="M must be >= N"):
        trace_only(prefill_workspace_slots, c.seq_lens, gl, c.block_table, c.block_table, N=8, M=4, **base)
    with pytest.raises(ValueError, match="compressed_block_table"):
        trace_only(prefill_workspace_slots, c.seq_lens, gl, c.block_table, None, N=4, M=8, **base)
    with pytest.raises(TypeError, match="gather_lens"):
        trace_only(prefill_workspace_slots, c.seq_lens, gl.astype(jnp.float32), c.block_table, c.block_table,
                   N=4, M=8, **base)
    with pytest.raises(TypeError, match="num_chunk_reqs"):
        trace_only(prefill_workspace_slots, c.seq_lens, gl, c.block_table, c.block_table, N=4, M=8,
                   **{**base, "num_chunk_reqs": jnp.int32(2)})
    with pytest.raises(ValueError, match="seq_lens"):
        prefill_chunk_plan([1, 2], [1], window=8, compress_ratio=2, max_model_len=64, max_num_batched_tokens=8)
    with pytest.raises(ValueError, match="max_model_len"):
        prefill_chunk_plan([1], [1], window=8, compress_ratio=2, max_model_len=0, max_num_batched_tokens=8)
    with pytest.raises(ValueError, match="compress_ratio"):
        prefill_chunk_plan([1], [1], window=8, compress_ratio=-1, max_model_len=8, max_num_batched_tokens=8)
    with pytest.raises(ValueError, match="N must be >= 0"):
        combine_topk_swa_indices(tk, c.query_start_loc, c.seq_lens, gl, req_start=0, req_end=2, window=4,
                                 compress_ratio=2, N=-1, M=8)
