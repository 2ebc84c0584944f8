"""FlashMLA's own V4 performance cases, and inputs drawn the way its test generator draws them.

The cases are the `performance_cases` of FlashMLA's `tests/test_flash_mla_sparse_decoding.py` with
d_qk = 512 (four V4 production configurations at six batch sizes) plus the top-k 2048 and 16384
peak cases, and its seven V4 sparse prefill performance cases (s_q 4096). Inputs follow the same
recipe (our code, written from the generator's description): per-request sequence lengths drawn
around s_kv with a spread of s_kv / 2 (at least s_q), pages in a random permutation, each query
token's top-k a set of distinct positions of its own sequence mapped through the block table (-1
past a short sequence), sinks with some heads at +-inf, q in [-1, 1], softmax scale 512^-0.55;
the compressed-cache lengths of the configurations that have them uniform in [0, extra_topk].
FLOPs and bytes as FlashMLA counts them: decode 2 h_q attended (512 + 512), bytes Q + O + unique
tokens x 576; prefill 2 sum(topk) h_q (512 + 512), bytes Q + O + valid indices x 1024.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from dsv41_jax import kv_cache as kvc

__all__ = ["DecodeCase", "PrefillCase", "DECODE_CASES", "PREFILL_CASES", "FEW_HEAD_DECODE_CASES",
           "HEAD_COUNT_DECODE_CASES", "flashmla_heads",
           "FEW_HEAD_PREFILL_CASES", "CASE_GROUPS", "select_cases", "decode_inputs", "prefill_inputs", "random_fp8_cache"]

SOFTMAX_SCALE = 512 ** -0.55


@dataclasses.dataclass(frozen=True)
class DecodeCase:
    b: int
    h_q: int
    topk: int
    block_size: int
    s_kv: int
    extra_topk: int | None = None
    extra_block_size: int | None = None
    extra_s_kv: int | None = None
    extra_lengths: bool = False  # extra_topk_length drawn per request
    s_q: int = 2

    @property
    def name(self) -> str:
        extra = f"+{self.extra_topk}p{self.extra_block_size}{'L' if self.extra_lengths else ''}" if self.extra_topk else ""
        return f"fm_decode_b{self.b}_h{self.h_q}_k{self.topk}p{self.block_size}{extra}"


@dataclasses.dataclass(frozen=True)
class PrefillCase:
    h_q: int
    topk: int
    s_kv: int
    s_q: int = 4096

    @property
    def name(self) -> str:
        return f"fm_prefill_h{self.h_q}_k{self.topk}_skv{self.s_kv}"


_BATCHES = (2, 64, 74, 128, 148, 256)
_CONFIGS = (  # (h_q, topk, page, extra_topk, extra page, extra lengths): FlashMLA's MODEL1 CONFIG1..4
    (64, 128, 256, 512, 64, False),
    (128, 128, 256, 1024, 64, False),
    (64, 128, 256, 1024, 2, True),
    (128, 128, 256, 1024, 2, True),
)
DECODE_CASES = tuple(
    DecodeCase(b, h, k, p, 16384, et, ep, 16384, el) for h, k, p, et, ep, el in _CONFIGS for b in _BATCHES
) + tuple(DecodeCase(148, h, 16384, 64, 32768) for h in (64, 128)) + (
    DecodeCase(128, 128, 2048, 64, 32768), DecodeCase(128, 64, 2048, 64, 32768))
PREFILL_CASES = tuple(PrefillCase(64, 512, s) for s in (8192, 32768, 65536)) + tuple(
    PrefillCase(128, 1024, s) for s in (8192, 32768, 65536)) + (PrefillCase(128, 2048, 32768),)
# A tensor-parallel shard's few heads: the V4.1-Flash shape (the first configuration above) at h_q 8..64, and
# prefill at s_kv 32768, top-k 512, h_q 8 and 16. FlashMLA takes 64 or 128 heads, so it runs them padded to 64
# (as vLLM pads them): its time is what such a call costs it.
FEW_HEAD_DECODE_CASES = tuple(DecodeCase(b, h, 128, 256, 16384, 512, 64, 16384)
                              for b in (64, 128, 256) for h in (8, 16, 32, 64))
FEW_HEAD_PREFILL_CASES = tuple(PrefillCase(h, 512, 32768) for h in (8, 16))
# Other head counts at b 128 of the same shape: FlashMLA runs them padded to its nearest head count above
# (64 for 16..48, 128 for 96).
HEAD_COUNT_DECODE_CASES = tuple(DecodeCase(128, h, 128, 256, 16384, 512, 64, 16384) for h in (16, 32, 48, 96))
CASE_GROUPS = {"decode": DECODE_CASES, "prefill": PREFILL_CASES,
               "few_heads": FEW_HEAD_DECODE_CASES + FEW_HEAD_PREFILL_CASES, "head_counts": HEAD_COUNT_DECODE_CASES}


def flashmla_heads(h_q: int) -> int:
    """The head count FlashMLA runs a call of h_q heads with: 64 or 128, q padded up to it."""
    if h_q > 128:
        raise ValueError(f"h_q: FlashMLA takes at most 128 heads, got {h_q}")
    return 64 if h_q <= 64 else 128


def select_cases(spec: str) -> list:
    """The cases `spec` names (comma-separated case names and groups of CASE_GROUPS), in the groups' order,
    each case once."""
    wanted = set(spec.split(","))
    cases = []
    for group, members in CASE_GROUPS.items():
        cases += [c for c in members if (group in wanted or c.name in wanted) and c not in cases]
    return cases


@functools.partial(jax.jit, static_argnums=(1, 2))
def random_fp8_cache(key, num_blocks: int, block_size: int) -> jax.Array:
    """An fp8_ds_mla cache of valid records, drawn byte by byte in one elementwise pass (no NaN codes): e4m3
    NoPE values of both signs, UE8M0 exponents 2^-9..2^-6, bf16 RoPE values of magnitude 2^-5..2^-3."""
    P = block_size
    pb = kvc.page_bytes("fp8_ds_mla", P)
    bits = jax.random.bits(key, (num_blocks, pb), jnp.uint8)
    col = jax.lax.broadcasted_iota(jnp.int32, (num_blocks, pb), 1)
    within = col % 576
    in_data = col < P * 576
    nope = bits & jnp.uint8(0xFE)  # 0x7F / 0xFF are NaN
    rope_hi = (bits & jnp.uint8(0x80)) | jnp.uint8(0x3D)  # sign, exponent 122..123: |x| in [2^-5, 2^-3)
    data = jnp.where(within < 448, nope, jnp.where((within - 448) % 2 == 1, rope_hi, bits))
    j = (col - P * 576) % 8
    scale = jnp.where(j < 7, jnp.uint8(118) + (bits & jnp.uint8(3)), jnp.uint8(0))
    return jnp.where(in_data, data, jnp.where(col < P * 584, scale, jnp.uint8(0)))


def _seq_lens(rng, b: int, s_kv: int, s_q: int) -> np.ndarray:
    return np.maximum(rng.normal(s_kv, s_kv / 2, b), s_q).astype(np.int64)


@functools.partial(jax.jit, static_argnums=(2, 3))
def _distinct_positions(key, lens, topk: int, width: int):
    """int32 [rows, topk]: distinct positions in [0, lens[r]) per row (-1 past a short row)."""
    keys = jax.random.uniform(key, (lens.shape[0], width))
    keys = jnp.where(jnp.arange(width)[None, :] < lens[:, None], keys, -1.0)
    vals, pos = jax.lax.top_k(keys, topk)
    return jnp.where(vals >= 0, pos, -1).astype(jnp.int32)


def _pool(key, rng, b: int, s_q: int, s_kv: int, topk: int, block_size: int):
    """(cache, indices int32 [b, s_q, topk], seq_lens): one token pool of the generator."""
    lens = _seq_lens(rng, b, s_kv, s_q)
    align = 4 * block_size
    pad = max(math.ceil(int(lens.max()) / align), 1) * align
    per = pad // block_size
    bt = rng.permutation(b * per).reshape(b, per).astype(np.int32)
    k1, k2 = jax.random.split(key)
    pos = _distinct_positions(k1, jnp.asarray(np.repeat(lens, s_q), jnp.int32), topk, pad)
    pos = pos.reshape(b, s_q, topk)
    page = jnp.take_along_axis(jnp.asarray(bt)[:, None, :], jnp.clip(pos, 0) // block_size, axis=2)
    idx = jnp.where(pos >= 0, page * block_size + pos % block_size, -1).astype(jnp.int32)
    return random_fp8_cache(k2, b * per, block_size), idx, lens


def decode_inputs(case: DecodeCase, seed: int = 0) -> dict:
    """The arrays of one draw (on the default device): q, kv_cache, indices, attn_sink, softmax_scale, and for
    the extra pool extra_kv_cache, extra_indices, extra_topk_length (None unless drawn); plus flops and bytes."""
    rng = np.random.default_rng(seed)
    key = jax.random.PRNGKey(seed)
    kq, ks, km, ke = jax.random.split(key, 4)
    q = jnp.clip(jax.random.normal(kq, (case.b, case.s_q, case.h_q, 512), jnp.float32), -1, 1).astype(jnp.bfloat16)
    sink = jax.random.normal(ks, (case.h_q,), jnp.float32)
    u = rng.standard_normal(case.h_q)
    sink = jnp.where(jnp.asarray(u > 0.5), jnp.inf, jnp.where(jnp.asarray(u < -0.5), -jnp.inf, sink))
    cache, idx, _ = _pool(km, rng, case.b, case.s_q, case.s_kv, case.topk, case.block_size)
    out = dict(q=q, kv_cache=cache, indices=idx, attn_sink=sink, softmax_scale=SOFTMAX_SCALE, extra_kv_cache=None,
               extra_indices=None, extra_topk_length=None)
    attended = case.b * case.s_q * case.topk
    unique = int(np.unique(np.asarray(idx)).size)
    if case.extra_topk:
        ecache, eidx, _ = _pool(ke, rng, case.b, case.s_q, case.extra_s_kv, case.extra_topk, case.extra_block_size)
        out.update(extra_kv_cache=ecache, extra_indices=eidx)
        if case.extra_lengths:
            el = rng.integers(0, case.extra_topk + 1, case.b).astype(np.int32)
            out["extra_topk_length"] = jnp.asarray(el)
            attended += int(el.sum()) * case.s_q
            used = np.where(np.arange(case.extra_topk)[None, None, :] < el[:, None, None], np.asarray(eidx), -1)
            unique += int(np.unique(used).size)
        else:
            attended += case.b * case.s_q * case.extra_topk
            unique += int(np.unique(np.asarray(eidx)).size)
    out["flops"] = 2 * case.h_q * attended * 1024
    out["bytes"] = 2 * case.b * case.s_q * case.h_q * (512 + 512) + unique * 576
    # what a kernel that reads each attended record once per query token moves: the records (584 B with their
    # scales), the indices, Q in and O out (bf16)
    topks = case.topk + (case.extra_topk or 0)
    out["moved_bytes"] = attended * 584 + case.b * case.s_q * topks * 4 + 2 * case.b * case.s_q * case.h_q * 1024
    return out


def prefill_inputs(case: PrefillCase, seed: int = 0) -> dict:
    """q, kv, indices (distinct rows of kv per query), attn_sink, softmax_scale; flops, bytes."""
    key = jax.random.PRNGKey(seed)
    kq, kk, ki, ks = jax.random.split(key, 4)
    q = (jax.random.normal(kq, (case.s_q, case.h_q, 512), jnp.float32) / 10).astype(jnp.bfloat16)
    kv = (jax.random.normal(kk, (case.s_kv, 512), jnp.float32) / 10).astype(jnp.bfloat16)
    idx = _distinct_positions(ki, jnp.full((case.s_q,), case.s_kv, jnp.int32), case.topk, case.s_kv)
    sink = jax.random.normal(ks, (case.h_q,), jnp.float32)
    return dict(q=q, kv=kv, indices=idx, attn_sink=sink, softmax_scale=SOFTMAX_SCALE,
                flops=2 * case.s_q * case.topk * case.h_q * 1024,
                bytes=2 * case.s_q * case.h_q * 1024 + case.s_q * case.topk * 1024,
                moved_bytes=2 * case.s_q * case.h_q * 1024 + case.s_q * case.topk * (1024 + 4))
