"""Functional attention metadata: pure, jittable, static-shaped builders (the seed's metadata side).

Conventions for every builder here:
- A step's arrays are padded to static buckets (`dsv41_jax.buckets`): `T` packed tokens,
  `R` requests, `B` block-table columns. Shapes depend only on the buckets, never on the data,
  so nothing here syncs with the host or recompiles inside a bucket.
- `query_start_loc` is int32 `[R + 1]`, non-decreasing, `query_start_loc[0] == 0`; padded
  requests repeat the last value (query length 0). Tokens at or past `query_start_loc[-1]` are
  padding.
- A token's position is `pos = seq_len - query_len + (t - query_start)`; its slot in a paged
  cache is `block_table[req, pos // block_size] * block_size + pos % block_size`.
- Slots and indices are int32 (JAX's default integer width; vLLM uses int64 for the slot
  mapping). `-1` marks an invalid slot or index. Negative block-table entries and block-table
  columns past the table's width give `-1` instead of an out-of-range read.
- Integer scalars that vary per step (`num_reqs`, counts, maxima) are 0-d int32 arrays.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dsv41_jax.buckets import DEFAULT_BUCKETS, BucketPolicy
from dsv41_jax.model.layer_types import required_layer_types
from dsv41_jax.plans import make_plans

__all__ = [
    "CommonAttentionMetadata",
    "make_common_attention_metadata",
    "token_to_req_indices",
    "token_positions",
    "TokenPositions",
    "paged_slot",
    "decode_threshold",
    "DecodePrefillSplit",
    "split_decodes_and_prefills",
    "reorder_decodes_first",
    "compressed_slot_mapping",
    "swa_window_indices",
    "global_topk_indices",
    "prefill_gather_lens",
    "PrefillChunk",
    "prefill_chunk_plan",
    "prefill_workspace_slots",
    "combine_topk_swa_indices",
    "DeepseekV4FlashMLAMetadata",
    "build_flashmla_metadata",
    "DeepseekSparseSWAMetadata",
    "build_sparse_swa_metadata",
]

_I32 = jnp.int32


# ------------------------------------------------------------------------------- checks
def _arr(name: str, x: Any, ndim: int) -> jax.Array:
    """Validate an integer array argument at trace time and return it as int32."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        x = np.asarray(x)
    if x.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(x.shape)}")
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name} must have an integer dtype, got {x.dtype}")
    return jnp.asarray(x).astype(_I32)


def _static_int(name: str, v: Any, lo: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{name} must be a static int, got {type(v).__name__} {v!r}")
    if v < lo:
        raise ValueError(f"{name} must be >= {lo}, got {v}")
    return int(v)


def _check_rows(name: str, x: jax.Array, rows: int, what: str) -> None:
    if x.shape[0] != rows:
        raise ValueError(f"{name} must have {rows} rows ({what}), got shape {tuple(x.shape)}")


# ------------------------------------------------------------------------ common metadata
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CommonAttentionMetadata:
    """One step's batch, padded to static buckets (see the module docstring).

    query_start_loc int32[R+1]; seq_lens int32[R] (tokens in the request after this step);
    block_table int32[R, B]; slot_mapping int32[T] (-1: padding / do not write);
    num_reqs, num_actual_tokens, max_query_len, max_seq_len: int32[] scalars.
    """

    query_start_loc: jax.Array
    seq_lens: jax.Array
    block_table: jax.Array
    slot_mapping: jax.Array
    num_reqs: jax.Array
    num_actual_tokens: jax.Array
    max_query_len: jax.Array
    max_seq_len: jax.Array

    @property
    def padded_num_reqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def padded_num_tokens(self) -> int:
        return self.slot_mapping.shape[0]

    @property
    def query_lens(self) -> jax.Array:
        return self.query_start_loc[1:] - self.query_start_loc[:-1]

    def token_to_req_indices(self) -> jax.Array:
        return token_to_req_indices(self.query_start_loc, self.padded_num_tokens)


def make_common_attention_metadata(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    block_table: Sequence[Sequence[int]] | np.ndarray,
    slot_mapping: Sequence[int] | np.ndarray,
    *,
    buckets: BucketPolicy = DEFAULT_BUCKETS,
    num_tokens: int | None = None,
    num_reqs: int | None = None,
    num_blocks: int | None = None,
) -> CommonAttentionMetadata:
    """Host-side: validate one step's batch and pad it to its buckets.

    query_lens / seq_lens: per request (seq_len >= query_len). block_table: per request, a row
    of physical block ids (ragged rows allowed). slot_mapping: one slot per packed token.
    num_tokens / num_reqs / num_blocks override the bucketed sizes (each must fit the data).
    """
    ql = np.asarray(query_lens, dtype=np.int64).reshape(-1)
    sl = np.asarray(seq_lens, dtype=np.int64).reshape(-1)
    if ql.shape != sl.shape:
        raise ValueError(f"query_lens and seq_lens must have the same length, got {ql.shape[0]} and {sl.shape[0]}")
    if (ql < 0).any():
        raise ValueError(f"query_lens must be >= 0, got {ql.tolist()}")
    if (sl < ql).any():
        raise ValueError(f"seq_lens must be >= query_lens per request, got seq_lens={sl.tolist()} query_lens={ql.tolist()}")
    rows = [list(np.asarray(r).reshape(-1)) for r in block_table] if not isinstance(block_table, np.ndarray) \
        else [list(r) for r in block_table]
    if len(rows) != ql.shape[0]:
        raise ValueError(f"block_table must have one row per request ({ql.shape[0]}), got {len(rows)}")
    sm = np.asarray(slot_mapping, dtype=np.int64).reshape(-1)
    n_tok = int(ql.sum())
    if sm.shape[0] != n_tok:
        raise ValueError(f"slot_mapping must have sum(query_lens) = {n_tok} entries, got {sm.shape[0]}")
    if (np.abs(sm) >= 2**31).any():
        raise ValueError("slot_mapping entries must fit in int32")
    n_req = ql.shape[0]
    width = max([len(r) for r in rows] + [1])
    T = buckets.tokens(max(n_tok, 1)) if num_tokens is None else num_tokens
    R = buckets.reqs(max(n_req, 1)) if num_reqs is None else num_reqs
    B = buckets.blocks(width) if num_blocks is None else num_blocks
    if T < n_tok or R < n_req or B < width:
        raise ValueError(f"num_tokens/num_reqs/num_blocks ({T}/{R}/{B}) must fit the batch ({n_tok}/{n_req}/{width})")
    qsl = np.zeros(R + 1, np.int32)
    qsl[1 : n_req + 1] = np.cumsum(ql)
    qsl[n_req + 1 :] = n_tok
    seq = np.zeros(R, np.int32)
    seq[:n_req] = sl
    bt = np.full((R, B), -1, np.int32)
    for i, r in enumerate(rows):
        bt[i, : len(r)] = r
    slots = np.full(T, -1, np.int32)
    slots[:n_tok] = sm
    return CommonAttentionMetadata(
        query_start_loc=jnp.asarray(qsl),
        seq_lens=jnp.asarray(seq),
        block_table=jnp.asarray(bt),
        slot_mapping=jnp.asarray(slots),
        num_reqs=jnp.asarray(n_req, _I32),
        num_actual_tokens=jnp.asarray(n_tok, _I32),
        max_query_len=jnp.asarray(int(ql.max(initial=0)), _I32),
        max_seq_len=jnp.asarray(int(sl.max(initial=0)), _I32),
    )


# ------------------------------------------------------------------------ token -> request
def token_to_req_indices(query_start_loc: jax.Array, num_tokens: int) -> jax.Array:
    """int32[num_tokens]: the request owning each packed token; tokens at or past
    `query_start_loc[-1]` get 0. Zero-length requests own no token."""
    qsl = _arr("query_start_loc", query_start_loc, 1)
    n = _static_int("num_tokens", num_tokens, lo=0)
    t = jnp.arange(n, dtype=_I32)
    # compare_all: one vectorised comparison (the default scan method is an XLA while loop, a host round trip
    # per iteration on GPUs)
    req = jnp.searchsorted(qsl[1:], t, side="right", method="compare_all").astype(_I32)
    return jnp.where(t < qsl[-1], req, 0)


class TokenPositions(NamedTuple):
    req: jax.Array  # int32[T] owning request (0 for padding tokens)
    pos: jax.Array  # int32[T] absolute position in the request
    in_batch: jax.Array  # bool[T] the token belongs to a request


def token_positions(query_start_loc: jax.Array, seq_lens: jax.Array, num_tokens: int) -> TokenPositions:
    """Owning request, absolute position and membership of every packed token."""
    qsl = _arr("query_start_loc", query_start_loc, 1)
    sl = _arr("seq_lens", seq_lens, 1)
    if qsl.shape[0] != sl.shape[0] + 1:
        raise ValueError(f"query_start_loc must have len(seq_lens) + 1 = {sl.shape[0] + 1} entries, got {qsl.shape[0]}")
    req = token_to_req_indices(qsl, num_tokens)
    t = jnp.arange(num_tokens, dtype=_I32)
    start, end = qsl[req], qsl[req + 1]
    pos = sl[req] - (end - start) + (t - start)
    in_batch = (t < qsl[-1]) & (t >= qsl[0])
    return TokenPositions(req, jnp.where(in_batch, pos, 0), in_batch)


def paged_slot(block_table: jax.Array, req: jax.Array, pos: jax.Array, block_size: int) -> jax.Array:
    """Slot of `pos` in request `req`'s pages; -1 where the page is missing or out of the table.

    `block_table` int32 `[R, B]`; `req` and `pos` int arrays of one broadcast shape; `block_size` the
    entries per page. Pure, for any paged cache (the SWA cache, a compressed cache, the index keys)."""
    col = pos // block_size
    ok = (pos >= 0) & (col < block_table.shape[1])
    blk = block_table[req, jnp.clip(col, 0, block_table.shape[1] - 1)]
    ok = ok & (blk >= 0)
    return jnp.where(ok, blk * block_size + pos % block_size, -1)


_paged_slot = paged_slot  # the name this module's builders call


# ------------------------------------------------------------------- decode / prefill split
def decode_threshold(num_speculative_tokens: int = 0, *, parallel_drafting: bool = False) -> int:
    """Longest query that counts as a decode: 1 + num_speculative_tokens (doubled for
    parallel drafting), at least 1. Speculative tokens of a decode are decodes too."""
    n = _static_int("num_speculative_tokens", num_speculative_tokens, lo=0)
    return max(1, 1 + (2 if parallel_drafting else 1) * n)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodePrefillSplit:
    """Counts of a batch ordered decodes first (int32[] scalars)."""

    num_decodes: jax.Array
    num_prefills: jax.Array
    num_decode_tokens: jax.Array
    num_prefill_tokens: jax.Array


def split_decodes_and_prefills(common: CommonAttentionMetadata, *, decode_threshold: int = 1) -> DecodePrefillSplit:
    """vLLM's split: everything is decode if max_query_len <= threshold; otherwise the first
    request with query_len > threshold starts the prefills. Assumes decodes come first
    (`reorder_decodes_first`)."""
    thr = _static_int("decode_threshold", decode_threshold)
    qsl = common.query_start_loc
    R = common.padded_num_reqs
    ql = qsl[1:] - qsl[:-1]
    live = jnp.arange(R) < common.num_reqs
    is_prefill = (ql > thr) & live
    any_prefill = jnp.any(is_prefill) & (common.max_query_len > thr)
    first = jnp.where(any_prefill, jnp.argmax(is_prefill), common.num_reqs).astype(_I32)
    n_dec_tok = jnp.where(any_prefill, qsl[first], common.num_actual_tokens).astype(_I32)
    return DecodePrefillSplit(
        num_decodes=first,
        num_prefills=(common.num_reqs - first).astype(_I32),
        num_decode_tokens=n_dec_tok,
        num_prefill_tokens=(common.num_actual_tokens - n_dec_tok).astype(_I32),
    )


def reorder_decodes_first(query_lens: Sequence[int], *, decode_threshold: int = 1) -> np.ndarray:
    """Host-side: a stable permutation of requests putting decodes (query_len <= threshold) first."""
    ql = np.asarray(query_lens).reshape(-1)
    thr = _static_int("decode_threshold", decode_threshold)
    return np.argsort(ql > thr, kind="stable")


# --------------------------------------------------------------------- slot mappings / windows
def compressed_slot_mapping(
    slot_mapping: jax.Array,
    query_start_loc: jax.Array,
    seq_lens: jax.Array,
    block_table: jax.Array,
    *,
    states_per_page: int,
    compress_ratio: int,
) -> jax.Array:
    """int32[T]: where each token writes its group's compressed state, or -1.

    Token at position `pos` closes group `pos // r` iff `(pos + 1) % r == 0`; it then writes
    state `s = pos // r` at `block_table[req, s // states_per_page] * states_per_page +
    s % states_per_page`. Tokens whose own slot is -1, padding tokens, and states past the
    block table get -1. Negative block-table entries are clamped to 0 first, as the seed does.
    """
    sm = _arr("slot_mapping", slot_mapping, 1)
    bt = _arr("block_table", block_table, 2)
    spp = _static_int("states_per_page", states_per_page)
    r = _static_int("compress_ratio", compress_ratio)
    T = sm.shape[0]
    tp = token_positions(query_start_loc, seq_lens, T)
    _check_rows("block_table", bt, seq_lens.shape[0], "one per request")
    closes = ((tp.pos + 1) % r == 0) & tp.in_batch & (sm >= 0)
    slot = _paged_slot(jnp.maximum(bt, 0), tp.req, tp.pos // r, spp)
    return jnp.where(closes, slot, -1).astype(_I32)


def swa_window_indices(
    query_start_loc: jax.Array,
    seq_lens: jax.Array,
    block_table: jax.Array,
    slot_mapping: jax.Array,
    *,
    window: int,
    block_size: int,
) -> tuple[jax.Array, jax.Array]:
    """Sliding-window indices of every token: `(indices int32[T, window], lens int32[T])`.

    For the token at `pos`: `start = max(pos - window + 1, 0)`, `len = pos + 1 - start`,
    `indices[k]` = slot of position `start + k` for k < len, else -1. Tokens with slot -1 (and
    padding tokens) get len 0 and all -1.
    """
    sm = _arr("slot_mapping", slot_mapping, 1)
    bt = _arr("block_table", block_table, 2)
    W = _static_int("window", window)
    bs = _static_int("block_size", block_size)
    T = sm.shape[0]
    tp = token_positions(query_start_loc, seq_lens, T)
    _check_rows("block_table", bt, seq_lens.shape[0], "one per request")
    valid = tp.in_batch & (sm >= 0)
    start = jnp.maximum(tp.pos - W + 1, 0)
    lens = jnp.where(valid, tp.pos + 1 - start, 0).astype(_I32)
    k = jnp.arange(W, dtype=_I32)
    p = start[:, None] + k[None, :]
    idx = _paged_slot(bt, tp.req[:, None], p, bs)
    return jnp.where(k[None, :] < lens[:, None], idx, -1).astype(_I32), lens


def global_topk_indices(
    topk_indices: jax.Array,
    token_to_req: jax.Array,
    block_table: jax.Array,
    *,
    states_per_page: int,
    is_valid_token: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Indexer top-k (local compressed positions, -1 pad) -> global compressed-cache slots.

    `(indices int32[T, K], lens int32[T])`: `block_table[req, l // spp] * spp + l % spp` for
    every local `l >= 0` (-1 otherwise, also past the block table), `lens` = number of valid
    entries, 0 for invalid tokens. Like vLLM, consumers read the first `lens` entries, so the
    indexer must pack valid entries first (ours does).
    """
    tk = _arr("topk_indices", topk_indices, 2)
    req = _arr("token_to_req", token_to_req, 1)
    bt = _arr("block_table", block_table, 2)
    spp = _static_int("states_per_page", states_per_page)
    if req.shape[0] != tk.shape[0]:
        raise ValueError(f"token_to_req must have {tk.shape[0]} entries (one per topk row), got {req.shape[0]}")
    valid_tok = jnp.ones(tk.shape[0], bool) if is_valid_token is None else jnp.asarray(is_valid_token, bool)
    if valid_tok.shape != (tk.shape[0],):
        raise ValueError(f"is_valid_token must have shape ({tk.shape[0]},), got {tuple(valid_tok.shape)}")
    ok = (tk >= 0) & valid_tok[:, None]
    slot = _paged_slot(bt, req[:, None], tk, spp)
    idx = jnp.where(ok, slot, -1).astype(_I32)
    lens = jnp.sum(ok, axis=1).astype(_I32)
    return idx, lens


# ---------------------------------------------------------------------------- prefill side
def prefill_gather_lens(query_start_loc: jax.Array, seq_lens: jax.Array, *, window: int) -> jax.Array:
    """int32[R]: SWA tokens a prefill request gathers: `q_len + min(max(prefix, 0), window - 1)`."""
    qsl = _arr("query_start_loc", query_start_loc, 1)
    sl = _arr("seq_lens", seq_lens, 1)
    W = _static_int("window", window)
    ql = qsl[1:] - qsl[:-1]
    return (ql + jnp.clip(sl - ql, 0, W - 1)).astype(_I32)


class PrefillChunk(NamedTuple):
    """Requests [start, end) of the prefills; N compressed rows and M = N + max gather rows each."""

    start: int
    end: int
    N: int
    M: int


def prefill_chunk_plan(
    seq_lens: Sequence[int],
    query_lens: Sequence[int],
    *,
    window: int,
    compress_ratio: int,
    max_model_len: int,
    max_num_batched_tokens: int,
    chunk_size: int = 4,
    has_compressed: bool | None = None,
) -> list[PrefillChunk]:
    """Host-side greedy chunking of the prefill requests (vllm_deepseek_v4.md 2.3 step 6).

    Host-side by necessity: the number of chunks and each chunk's workspace size (N, M) are
    shapes. `seq_lens` / `query_lens` are the prefill requests only. A request has N_i
    compressed rows (`seq_len // r` when the layer has a compressed cache, else 0) and G_i =
    its gather length; a chunk grows while `#reqs * (max N + max G) <= chunk_size *
    (cdiv(max_model_len, r) + window + max_num_batched_tokens)` (the compressed term only with a
    compressed cache). `has_compressed` defaults to `compress_ratio != 0` (V4.1: ratio 1 has a
    full-length compressed cache); pass `compress_ratio > 1` for V4.0 semantics.
    """
    sl = np.asarray(seq_lens, dtype=np.int64).reshape(-1)
    ql = np.asarray(query_lens, dtype=np.int64).reshape(-1)
    if sl.shape != ql.shape:
        raise ValueError(f"seq_lens and query_lens must have the same length, got {sl.shape[0]} and {ql.shape[0]}")
    W = _static_int("window", window)
    r = _static_int("compress_ratio", compress_ratio, lo=0)
    _static_int("max_model_len", max_model_len)
    _static_int("max_num_batched_tokens", max_num_batched_tokens)
    _static_int("chunk_size", chunk_size)
    hc = (r != 0) if has_compressed is None else bool(has_compressed)
    if hc and r == 0:
        raise ValueError("has_compressed=True needs compress_ratio >= 1, got compress_ratio=0")
    area = chunk_size * ((math.ceil(max_model_len / r) if hc else 0) + W + max_num_batched_tokens)
    gather = ql + np.clip(sl - ql, 0, W - 1)
    comp = sl // r if hc else np.zeros_like(sl)
    plan: list[PrefillChunk] = []
    start, n = 0, sl.shape[0]
    while start < n:
        mn, mg, end = int(comp[start]), int(gather[start]), start + 1
        while end < n:
            cn, cg = max(mn, int(comp[end])), max(mg, int(gather[end]))
            if (end - start + 1) * (cn + cg) > area:
                break
            mn, mg, end = cn, cg, end + 1
        plan.append(PrefillChunk(start, end, mn, mn + mg))
        start = end
    return plan


def prefill_workspace_slots(
    seq_lens: jax.Array,
    gather_lens: jax.Array,
    swa_block_table: jax.Array,
    compressed_block_table: jax.Array | None,
    *,
    req_start: jax.Array | int,
    num_chunk_reqs: int,
    N: int,
    M: int,
    swa_block_size: int,
    compress_ratio: int,
    states_per_page: int | None = None,
    num_reqs_in_chunk: jax.Array | int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Slots that fill a prefill chunk's workspace `kv[num_chunk_reqs, M, 512]`.

    Row b of the chunk is request `req_start + b`. Workspace rows [0, N) are its compressed
    entries 0 .. seq_len // r - 1 (slots in the compressed cache), rows [N, N + G) are its SWA
    tokens seq_len - G .. seq_len - 1 (slots in the SWA cache); everything else is -1.
    Returns `(compressed_slots int32[C, N], swa_slots int32[C, M - N])`.
    """
    sl = _arr("seq_lens", seq_lens, 1)
    gl = _arr("gather_lens", gather_lens, 1)
    sbt = _arr("swa_block_table", swa_block_table, 2)
    C = _static_int("num_chunk_reqs", num_chunk_reqs)
    N = _static_int("N", N, lo=0)
    M = _static_int("M", M, lo=0)  # 0: a chunk of requests with nothing to gather
    if M < N:
        raise ValueError(f"M must be >= N, got M={M} N={N}")
    r = _static_int("compress_ratio", compress_ratio, lo=0)
    bs = _static_int("swa_block_size", swa_block_size)
    nlive = C if num_reqs_in_chunk is None else num_reqs_in_chunk
    b = jnp.arange(C, dtype=_I32)
    req = jnp.clip(req_start + b, 0, sl.shape[0] - 1)
    live = (b < nlive) & (req_start + b < sl.shape[0])
    seq = jnp.where(live, sl[req], 0)
    g = jnp.where(live, gl[req], 0)
    j = jnp.arange(M - N, dtype=_I32)
    pos = seq[:, None] - g[:, None] + j[None, :]
    swa = jnp.where(j[None, :] < g[:, None], _paged_slot(sbt, req[:, None], pos, bs), -1)
    if N == 0 or r == 0:
        comp = jnp.full((C, N), -1, _I32)
    else:
        if compressed_block_table is None:
            raise ValueError("compressed_block_table is required when N > 0 and compress_ratio > 0")
        cbt = _arr("compressed_block_table", compressed_block_table, 2)
        spp = _static_int("states_per_page", states_per_page)
        i = jnp.arange(N, dtype=_I32)
        comp = jnp.where(i[None, :] < (seq // r)[:, None], _paged_slot(cbt, req[:, None], i[None, :], spp), -1)
    return comp.astype(_I32), swa.astype(_I32)


def combine_topk_swa_indices(
    topk_indices: jax.Array,
    query_start_loc: jax.Array,
    seq_lens: jax.Array,
    gather_lens: jax.Array,
    *,
    req_start: jax.Array | int,
    req_end: jax.Array | int,
    window: int,
    compress_ratio: int,
    N: int,
    M: int,
    width: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Combined prefill indices into a chunk's flattened workspace `kv[C * M, 512]`.

    topk_indices: int32[T, K], the indexer's local compressed positions per packed token (K =
    index_topk; pass int32[T, 0] for SWA-only layers, where K counts as 0). For each token of
    requests [req_start, req_end) at position `pos`, in chunk row `b = req - req_start`:
    `tk = min((pos + 1) // r, K)`, `sw = min(pos + 1, window)`; entries are `topk_indices[t, k] +
    M * b` for k < tk, then `M * b + N + (pos - sw + 1 - (seq_len - G)) + j` for j < sw, and
    `len = tk + sw`. Width is `width` or `K + window` rounded up to 128, padded with -1; other
    tokens get len 0 and all -1. Like vLLM this assumes the indexer packs valid entries first; unlike
    vLLM, a top-k entry < 0 or >= N inside the first `tk` columns stays -1 (masked by the kernel)
    instead of being offset into a neighbouring request's workspace rows.
    Returns `(indices int32[T, width], lens int32[T])`.
    """
    tkv = _arr("topk_indices", topk_indices, 2)
    sl = _arr("seq_lens", seq_lens, 1)
    gl = _arr("gather_lens", gather_lens, 1)
    W = _static_int("window", window)
    r = _static_int("compress_ratio", compress_ratio, lo=0)
    N = _static_int("N", N, lo=0)
    M = _static_int("M", M)
    K = tkv.shape[1] if r else 0
    wid = -(-(K + W) // 128) * 128 if width is None else _static_int("width", width)
    if wid < K + W:
        raise ValueError(f"width must be >= index_topk + window = {K + W}, got {wid}")
    T = tkv.shape[0]
    tp = token_positions(query_start_loc, sl, T)
    in_chunk = tp.in_batch & (tp.req >= req_start) & (tp.req < req_end)
    b = tp.req - req_start
    pos = tp.pos
    tk = jnp.minimum((pos + 1) // r, K) if K else jnp.zeros_like(pos)
    sw = jnp.minimum(pos + 1, W)
    col = jnp.arange(wid, dtype=_I32)[None, :]
    # entries outside [0, N) stay -1 instead of being offset into another request's rows
    tkp = jnp.pad(tkv[:, :K], ((0, 0), (0, wid - K)), constant_values=-1)
    topk_part = jnp.where((tkp >= 0) & (tkp < N), tkp + (M * b)[:, None], -1)
    swa_base = M * b + N + (pos - sw + 1 - (sl[tp.req] - gl[tp.req]))
    swa_part = swa_base[:, None] + (col - tk[:, None])
    out = jnp.where(col < tk[:, None], topk_part, jnp.where(col < (tk + sw)[:, None], swa_part, -1))
    out = jnp.where(in_chunk[:, None], out, -1).astype(_I32)
    lens = jnp.where(in_chunk, tk + sw, 0).astype(_I32)
    return out, lens


# ------------------------------------------------------------------- FlashMLA metadata (seed)
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DeepseekV4FlashMLAMetadata:
    """The seed's `DeepseekV4FlashMLAMetadata`: metadata of a kv-source layer's compressed cache.

    slot_mapping is the compressed slot mapping for ratio 2, the per-token one for ratio 1.
    """

    num_reqs: jax.Array
    max_query_len: jax.Array
    max_seq_len: jax.Array
    num_actual_tokens: jax.Array
    query_start_loc: jax.Array
    slot_mapping: jax.Array
    block_table: jax.Array
    req_id_per_token: jax.Array
    block_size: int = dataclasses.field(metadata=dict(static=True))
    topk_tokens: int = dataclasses.field(metadata=dict(static=True))


def build_flashmla_metadata(
    common: CommonAttentionMetadata,
    *,
    compress_ratio: int,
    block_size: int,
    topk_tokens: int,
    num_states: int | None = None,
) -> DeepseekV4FlashMLAMetadata:
    """The seed's `DeepseekV4SparseMLAMetadataBuilder.build`, functional.

    compress_ratio: the compressed cache's tokens per state; only 1 and 2 are V4.1 ratios.
    block_size: tokens per compressed page (the kv-cache spec's block size); num_states: states
    per page (default block_size // compress_ratio). For ratio 2 the slot mapping becomes the
    compressed slot mapping, computed on the block table clamped to >= 0 (the seed clamps in
    place, so the returned block_table is the clamped one too).
    """
    if isinstance(compress_ratio, bool) or not isinstance(compress_ratio, (int, np.integer)):
        raise TypeError(f"compress_ratio must be an int, got {type(compress_ratio).__name__}")
    if compress_ratio not in (1, 2):
        raise ValueError(
            "DeepSeek V4.1 compressed-KV caches use compress_ratio 1 or 2; "
            f"got {compress_ratio}."
        )
    bs = _static_int("block_size", block_size)
    topk = _static_int("topk_tokens", topk_tokens)
    req_id = common.token_to_req_indices()
    slot_mapping, bt = common.slot_mapping, common.block_table
    if compress_ratio > 1:
        ns = bs // compress_ratio if num_states is None else _static_int("num_states", num_states)
        if ns < 1:
            raise ValueError(f"num_states must be >= 1 (block_size // compress_ratio), got {ns}")
        bt = jnp.maximum(bt, 0)
        slot_mapping = compressed_slot_mapping(
            common.slot_mapping, common.query_start_loc, common.seq_lens, bt,
            states_per_page=ns, compress_ratio=compress_ratio,
        )
    return DeepseekV4FlashMLAMetadata(
        num_reqs=common.num_reqs,
        max_query_len=common.max_query_len,
        max_seq_len=common.max_seq_len,
        num_actual_tokens=common.num_actual_tokens,
        query_start_loc=common.query_start_loc,
        slot_mapping=slot_mapping,
        block_table=bt,
        req_id_per_token=req_id,
        block_size=bs,
        topk_tokens=topk,
    )


# --------------------------------------------------------------- V4.1 sparse-SWA metadata
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DeepseekSparseSWAMetadata:
    """Sliding-window metadata shared by every attention layer of a step (V4.1).

    Per-token arrays are aligned with the packed tokens (row t is token t) rather than sliced
    at num_decode_tokens as vLLM does, so shapes stay static: decode rows of prefill tokens
    and prefill rows of decode tokens have len 0 and indices -1. Per-request prefill arrays
    are likewise aligned with requests (0 for decode requests).

    tile_sched: for each layer type present, its `DecodePlan` over the decode rows (each decode
    token is one batch row, s_q = 1), to pass as `sparse_mla_decode(..., plan=...)` to every layer
    of the type (it unpacks as `(tile_scheduler_metadata int32[P, 8], num_splits int32[T + 1])`), or
    {} when the builder was given neither `num_heads` nor `num_sm_parts`.
    """

    block_table: jax.Array
    slot_mapping: jax.Array
    seq_lens: jax.Array
    query_start_loc: jax.Array
    is_valid_token: jax.Array
    token_to_req_indices: jax.Array
    token_positions: jax.Array
    decode_swa_indices: jax.Array  # int32[T, 1, W]
    decode_swa_lens: jax.Array  # int32[T]
    prefill_swa_indices: jax.Array  # int32[T, 1, W]
    prefill_swa_lens: jax.Array  # int32[T]
    num_decodes: jax.Array
    num_prefills: jax.Array
    num_decode_tokens: jax.Array
    num_prefill_tokens: jax.Array
    prefill_seq_lens: jax.Array  # int32[R]
    prefill_query_lens: jax.Array  # int32[R]
    prefill_gather_lens: jax.Array  # int32[R]
    tile_sched: dict
    block_size: int = dataclasses.field(metadata=dict(static=True))
    window: int = dataclasses.field(metadata=dict(static=True))
    decode_threshold: int = dataclasses.field(metadata=dict(static=True))
    layer_types: tuple = dataclasses.field(metadata=dict(static=True))

    def decode_extra_topk_lens(self, compress_ratio: int, index_topk: int) -> jax.Array:
        """int32[T]: compressed entries a decode token attends, `min((pos + 1) // r, index_topk)`."""
        r = _static_int("compress_ratio", compress_ratio)
        dec = self.decode_swa_lens > 0
        return jnp.where(dec, jnp.minimum((self.token_positions + 1) // r, index_topk), 0).astype(_I32)


def build_sparse_swa_metadata(
    common: CommonAttentionMetadata,
    *,
    window: int,
    block_size: int,
    num_speculative_tokens: int = 0,
    compress_ratios: Sequence[int] | None = None,
    index_topk: int | None = None,
    num_sm_parts: int | None = None,
    num_heads: int | None = None,
    num_sms: int | None = None,
    batch_invariant: bool = False,
    planner: str = "auto",
) -> DeepseekSparseSWAMetadata:
    """The V4.1 sparse-SWA metadata builder (vLLM's `DeepseekV41SparseSWAMetadataBuilder`).

    Splits decodes from prefills at `decode_threshold(num_speculative_tokens)`, computes the
    window indices of both, the prefill gather lengths, and, given `num_heads` (the query heads of
    one decode call: per shard under head parallelism), one `DecodePlan` per V4.1 layer type present
    in `compress_ratios` (default `[0]`): swaonly plans the window alone; c1a / c2a add
    `min((pos + 1) // r, index_topk)` compressed entries. The plans of all types come from one
    planner launch on a GPU (`dsv41_jax.plans.make_plans`; num_sms, batch_invariant, planner as
    there). `num_sm_parts` (without `num_heads`) plans with that many parts instead, with the JAX
    planner (tests, other part counts); such plans fit impl="cuda" only where the counts agree.
    """
    W = _static_int("window", window)
    bs = _static_int("block_size", block_size)
    thr = decode_threshold(num_speculative_tokens)
    types = required_layer_types(compress_ratios, version="v4.1")
    T = common.padded_num_tokens
    split = split_decodes_and_prefills(common, decode_threshold=thr)
    tp = token_positions(common.query_start_loc, common.seq_lens, T)
    valid = common.slot_mapping >= 0
    idx, lens = swa_window_indices(
        common.query_start_loc, common.seq_lens, common.block_table, common.slot_mapping, window=W, block_size=bs
    )
    t = jnp.arange(T, dtype=_I32)
    is_dec = t < split.num_decode_tokens
    is_pre = (t >= split.num_decode_tokens) & (t < common.num_actual_tokens)
    d_lens = jnp.where(is_dec, lens, 0)
    p_lens = jnp.where(is_pre, lens, 0)
    d_idx = jnp.where(is_dec[:, None], idx, -1)[:, None, :]
    p_idx = jnp.where(is_pre[:, None], idx, -1)[:, None, :]
    R = common.padded_num_reqs
    rr = jnp.arange(R, dtype=_I32)
    is_pre_req = (rr >= split.num_decodes) & (rr < common.num_reqs)
    ql = common.query_lens
    gl = prefill_gather_lens(common.query_start_loc, common.seq_lens, window=W)
    tile_sched: dict = {}
    if num_heads is not None or num_sm_parts is not None:
        extras = {}
        for lt in types:
            if lt == "swaonly":
                extras[lt] = None
                continue
            if index_topk is None:
                raise ValueError(f"index_topk is required to plan layer type {lt!r}")
            K = _static_int("index_topk", index_topk)
            r = {"c1a": 1, "c2a": 2}[lt]
            # The plan must use the lengths the kernel gets (`decode_extra_topk_lens`): a decode token
            # with slot -1 (d_lens 0) attends no compressed entry either.
            extra = jnp.where(d_lens > 0, jnp.minimum((tp.pos + 1) // r, K), 0)
            extras[lt] = (extra.astype(_I32), K)
        tile_sched = make_plans(d_lens, extras, s_q=1, num_heads=num_heads, topk=W, num_sms=num_sms,
                                batch_invariant=batch_invariant, planner=planner,
                                num_sm_parts=num_sm_parts if num_heads is None else None)
    return DeepseekSparseSWAMetadata(
        block_table=common.block_table,
        slot_mapping=common.slot_mapping,
        seq_lens=common.seq_lens,
        query_start_loc=common.query_start_loc,
        is_valid_token=valid,
        token_to_req_indices=tp.req,
        token_positions=tp.pos,
        decode_swa_indices=d_idx,
        decode_swa_lens=d_lens,
        prefill_swa_indices=p_idx,
        prefill_swa_lens=p_lens,
        num_decodes=split.num_decodes,
        num_prefills=split.num_prefills,
        num_decode_tokens=split.num_decode_tokens,
        num_prefill_tokens=split.num_prefill_tokens,
        prefill_seq_lens=jnp.where(is_pre_req, common.seq_lens, 0),
        prefill_query_lens=jnp.where(is_pre_req, ql, 0),
        prefill_gather_lens=jnp.where(is_pre_req, gl, 0),
        tile_sched=tile_sched,
        block_size=bs,
        window=W,
        decode_threshold=thr,
        layer_types=types,
    )
