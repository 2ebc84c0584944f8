"""The xla reference of sparse MLA decode / prefill / mega against a float64 NumPy oracle."""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsv41_jax as d
from dsv41_jax.rope import apply_inverse_rope, apply_rope, cos_sin_cache
from tests.attention_cases import (
    DECODE_GRID,
    MEGA_PREFILL_GRID,
    PREFILL_GRID,
    assert_close,
    assert_mega_close,
    dequantized_table,
    make_decode_case,
    make_mega_prefill_case,
    make_prefill_case,
    oracle_rows,
)


def _seed(name: str) -> int:
    # a stable seed per case (str hash() is salted per process: a rare draw near the tolerance made CI flaky)
    return zlib.crc32(name.encode())


@pytest.mark.parametrize("name,kw", DECODE_GRID, ids=[n for n, _ in DECODE_GRID])
def test_decode_reference_matches_oracle(name, kw):
    case = make_decode_case(_seed(name), **kw)
    out, lse = jax.jit(lambda *a: d.sparse_mla_decode(*a, **case.kwargs(), impl="xla"))(*case.args())
    case.check(out, lse, name)


@pytest.mark.parametrize("name,kw", PREFILL_GRID, ids=[n for n, _ in PREFILL_GRID])
def test_prefill_reference_matches_oracle(name, kw):
    case = make_prefill_case(_seed(name), **kw)
    case.check(jax.jit(lambda *a: d.sparse_mla_prefill(*a, **case.kwargs(), impl="xla"))(*case.args()), name)


def test_empty_rows_give_zero_and_inf():
    case = make_decode_case(1, lengths="zero", sink="random")
    out, lse = d.sparse_mla_decode(*case.args(), **case.kwargs(), impl="xla")
    assert np.all(np.asarray(out, np.float32) == 0)
    assert np.all(np.isposinf(np.asarray(lse)))
    p = make_prefill_case(2, lengths="zero")
    out, mx, lse = d.sparse_mla_prefill(*p.args(), **p.kwargs(), impl="xla")
    assert np.all(np.asarray(out, np.float32) == 0)
    assert np.all(np.isneginf(np.asarray(mx))) and np.all(np.isposinf(np.asarray(lse)))


def test_sink_plus_inf_zeroes_output_and_minus_inf_is_neutral():
    case = make_decode_case(3, sink="none", h_q=4, lengths="full", invalid_frac=0.0)
    base, base_lse = d.sparse_mla_decode(*case.args(), **case.kwargs(), impl="xla")
    kw = case.kwargs()
    kw["attn_sink"] = jnp.array([np.inf, -np.inf, np.inf, -np.inf], jnp.float32)
    out, lse = d.sparse_mla_decode(*case.args(), **kw, impl="xla")
    o, b = np.asarray(out, np.float32), np.asarray(base, np.float32)
    assert np.all(o[:, :, 0::2] == 0)
    np.testing.assert_array_equal(o[:, :, 1::2], b[:, :, 1::2])
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(base_lse))  # lse excludes the sink


def test_topk_length_ignores_tail_even_if_it_points_at_nan():
    # make_decode_case points every entry past topk_length at a poisoned (NaN) slot
    case = make_decode_case(4, fmt="bf16", lengths="var", b=5)
    out, lse = d.sparse_mla_decode(*case.args(), **case.kwargs(), impl="xla")
    assert np.isfinite(np.asarray(out, np.float32)).all()
    # truncating the index list at max length changes nothing
    L = int(np.max(np.asarray(case.topk_length)))
    out2, lse2 = d.sparse_mla_decode(case.q, case.kv_cache, case.indices[:, :, : max(L, 1)],
                                     jnp.minimum(case.topk_length, max(L, 1)), **case.kwargs(), impl="xla")
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(out2, np.float32))


def test_extra_cache_joins_one_softmax():
    """Main-only and extra-only runs combine into the union run by their lse weights."""
    case = make_decode_case(5, fmt="fp8_ds_mla", sink="none", lengths="full", invalid_frac=0.0,
                            extra=dict(topk=64, block_size=16, fmt="fp8_ds_mla", lengths="full"))
    union, lse_u = d.sparse_mla_decode(*case.args(), **case.kwargs(), impl="xla")
    kw = dict(kv_format=case.kv_format, block_size=case.block_size, softmax_scale=case.softmax_scale)
    o1, l1 = d.sparse_mla_decode(*case.args(), **kw, impl="xla")
    o2, l2 = d.sparse_mla_decode(case.q, case.extra_kv_cache, case.extra_indices, case.extra_topk_length,
                                 kv_format=case.extra_kv_format, block_size=case.extra_block_size,
                                 softmax_scale=case.softmax_scale, impl="xla")
    l1, l2 = np.asarray(l1, np.float64), np.asarray(l2, np.float64)
    lse = np.logaddexp(l1, l2)
    comb = (np.exp(l1 - lse)[..., None] * np.asarray(o1, np.float64) + np.exp(l2 - lse)[..., None] * np.asarray(o2, np.float64))
    assert_close(lse_u, lse, "decode_lse")
    # o1 and o2 were each rounded to bf16 and can cancel, so compare in norm, not elementwise
    u = np.asarray(union, np.float64)
    assert np.linalg.norm(u - comb) / np.linalg.norm(comb) < 4e-3


def test_reference_decode_is_chunked_not_materialised():
    """topk much larger than one chunk exercises the online softmax across chunks and row blocks."""
    case = make_decode_case(6, b=2, s_q=1, h_q=2, topk=1600, block_size=64, s_kv=2000, fmt="bf16")
    out, lse = d.sparse_mla_decode(*case.args(), **case.kwargs(), impl="xla")
    e_out, e_lse = case.expected()
    assert_close(out, e_out, "decode_out")
    assert_close(lse, e_lse, "decode_lse")


def test_auto_falls_back_to_xla_on_cpu():
    case = make_decode_case(7, h_q=2, topk=64)
    a = d.sparse_mla_decode(*case.args(), **case.kwargs())
    b = d.sparse_mla_decode(*case.args(), **case.kwargs(), impl="xla")
    np.testing.assert_array_equal(np.asarray(a[0], np.float32), np.asarray(b[0], np.float32))


# ------------------------------------------------------------------------------- mega
def test_rope_inverse_roundtrip_and_gptj_pairs():
    cs = cos_sin_cache(64, theta=10000.0)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((5, 3, 512)), jnp.float32)
    pos = jnp.array([0, 1, 7, 33, 63])
    y = apply_rope(x, pos, cs)
    np.testing.assert_array_equal(np.asarray(y[..., :448]), np.asarray(x[..., :448]))
    np.testing.assert_allclose(np.asarray(apply_inverse_rope(y, pos, cs)), np.asarray(x), atol=2e-5)
    # pair (448, 449) of position p rotates by p * theta^0 = p radians
    p = 7
    c, s = np.cos(p), np.sin(p)
    a, b = np.asarray(x[2, :, 448]), np.asarray(x[2, :, 449])
    np.testing.assert_allclose(np.asarray(y[2, :, 448]), a * c - b * s, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(y[2, :, 449]), a * s + b * c, rtol=1e-5, atol=1e-5)


def _rope64(x, pos, cs):
    out = x.copy()
    half = 32
    c, s = cs[pos, :half], cs[pos, half:]
    a, b = x[..., 448::2], x[..., 449::2]
    out[..., 448::2] = a * c[:, None] - b * s[:, None]
    out[..., 449::2] = a * s[:, None] + b * c[:, None]
    return out


def test_mega_decode_matches_oracle():
    rng = np.random.default_rng(8)
    T, h = 6, 8
    cs = cos_sin_cache(256, theta=160000.0)
    pos = jnp.asarray(rng.integers(0, 256, T), jnp.int32)
    base = make_decode_case(9, b=T, s_q=1, h_q=h, topk=64, block_size=64, fmt="mxfp8_ds_mla",
                            extra=dict(topk=64, block_size=32, fmt="nvfp4_ds_mla"))
    q = base.q[:, 0]
    out, sc, lse = d.sparse_mla_mega_decode(
        q, pos, cs, base.kv_cache, base.indices[:, 0], base.topk_length, kv_format="mxfp8_ds_mla",
        block_size=64, softmax_scale=base.softmax_scale, attn_sink=base.attn_sink,
        extra_kv_cache=base.extra_kv_cache, extra_indices=base.extra_indices[:, 0],
        extra_topk_length=base.extra_topk_length, extra_kv_format="nvfp4_ds_mla", extra_block_size=32)
    assert out.dtype == jnp.float8_e4m3fn and sc.shape == (T, h, 16) and sc.dtype == jnp.uint8
    csn = np.asarray(cs, np.float64)
    pn = np.asarray(pos)
    qr = _rope64(np.asarray(q.astype(jnp.float32), np.float64), pn, csn)
    qr = np.asarray(jnp.asarray(qr, jnp.bfloat16).astype(jnp.float32), np.float64)  # q is roped in bf16
    pools = [(dequantized_table(base.kv_cache, "mxfp8_ds_mla", 64), np.asarray(base.indices[:, 0]), np.asarray(base.topk_length)),
             (dequantized_table(base.extra_kv_cache, "nvfp4_ds_mla", 32), np.asarray(base.extra_indices[:, 0]),
              np.asarray(base.extra_topk_length))]
    e_out, _, e_lse = oracle_rows(qr, pools, base.softmax_scale, np.asarray(base.attn_sink, np.float64))
    inv = e_out.copy()
    c, s = csn[pn, :32], csn[pn, 32:]
    a, b = e_out[..., 448::2], e_out[..., 449::2]
    inv[..., 448::2] = a * c[:, None] + b * s[:, None]
    inv[..., 449::2] = -a * s[:, None] + b * c[:, None]
    deq = np.asarray(out.astype(jnp.float32), np.float64) * np.repeat(2.0 ** (np.asarray(sc, np.float64) - 127), 32, axis=-1)
    # e4m3 keeps 3 mantissa bits: |err| <= 2^-4 |x| + half the group's smallest subnormal step
    grp_scale = np.repeat(2.0 ** (np.asarray(sc, np.float64) - 127), 32, axis=-1)
    bound = np.abs(inv) * 2.0**-4 + grp_scale * 2.0**-10 + 2e-3 * np.abs(inv) + 1e-3
    assert np.all(np.abs(deq - inv) <= bound)
    assert_close(lse, e_lse, "decode_lse")


@pytest.mark.parametrize("name", [n for n, _ in MEGA_PREFILL_GRID])
def test_mega_prefill_matches_oracle(name):
    i = [n for n, _ in MEGA_PREFILL_GRID].index(name)
    case = make_mega_prefill_case(500 + i, **MEGA_PREFILL_GRID[i][1])
    out, sc, lse = d.sparse_mla_mega_prefill(*case.args(), **case.kwargs(), impl="xla")
    assert_mega_close(out, sc, lse, case.expected(), f"xla mega prefill {name}", kind="prefill")


def test_mega_prefill_checks_its_rope_arguments():
    case = make_mega_prefill_case(520, s_q=3, h_q=4, topk=64)
    q, pos, cs, kv, idx = case.args()
    with pytest.raises(ValueError, match=r"positions must have shape \(3,\) \(one per query token\), got \(2,\)"):
        d.sparse_mla_mega_prefill(q, pos[:2], cs, kv, idx, **case.kwargs())
    with pytest.raises(ValueError, match=r"cos_sin_cache must be \[max_pos, 64\]"):
        d.sparse_mla_mega_prefill(q, pos, cs[:, :32], kv, idx, **case.kwargs())
    with pytest.raises(ValueError, match="impl must be one of"):
        d.sparse_mla_mega_prefill(q, pos, cs, kv, idx, **case.kwargs(), impl="triton")


def test_quantize_output_fp8_rule():
    x = jnp.asarray(np.random.default_rng(3).standard_normal((4, 64)) * 10, jnp.float32)
    v, e = d.attention.quantize_output_fp8(x)
    amax = np.abs(np.asarray(x)).reshape(4, 2, 32).max(-1)
    np.testing.assert_array_equal(np.asarray(e, np.int64) - 127, np.ceil(np.log2(np.maximum(amax, 1e-4) / 448)))
    back = np.asarray(v.astype(jnp.float32)) * np.repeat(2.0 ** (np.asarray(e, np.float64) - 127), 32, axis=-1)
    assert np.all(np.abs(back - np.asarray(x)) <= np.abs(np.asarray(x)) * 2**-4 + 1e-6)


# ------------------------------------------------------------------------- bad inputs
def _good():
    return make_decode_case(11, b=2, s_q=1, h_q=2, topk=64)


@pytest.mark.parametrize(
    "mutate,exc,match",
    [
        (lambda c, kw: (c.q.astype(jnp.float32),) + c.args()[1:], TypeError, "q must be bfloat16"),
        (lambda c, kw: (c.q[..., :448],) + c.args()[1:], ValueError, "head dim must be 512"),
        (lambda c, kw: (c.q[0],) + c.args()[1:], ValueError, "q must be 4-D"),
        (lambda c, kw: (c.q, c.kv_cache[:, :-1]) + c.args()[2:], ValueError, "kv_cache in format 'fp8_ds_mla'"),
        (lambda c, kw: (c.q, c.kv_cache, c.indices.astype(jnp.float32), c.topk_length), TypeError, "indices must have an integer dtype"),
        (lambda c, kw: (c.q, c.kv_cache, c.indices[:1], c.topk_length), ValueError, "indices must be"),
        (lambda c, kw: (c.q, c.kv_cache, c.indices, c.topk_length[:1]), ValueError, "topk_length must have shape"),
    ],
)
def test_decode_bad_inputs(mutate, exc, match):
    c = _good()
    with pytest.raises(exc, match=match):
        d.sparse_mla_decode(*mutate(c, c.kwargs()), **c.kwargs(), impl="xla")


@pytest.mark.parametrize(
    "change,exc,match",
    [
        (dict(kv_format="fp4"), ValueError, "kv_format"),
        (dict(block_size=0), ValueError, "block_size must be > 0"),
        (dict(block_size=32), ValueError, "with block_size=32"),
        (dict(softmax_scale="x"), TypeError, "softmax_scale"),
        (dict(attn_sink=jnp.zeros(3, jnp.float32)), ValueError, "attn_sink must have shape"),
        (dict(impl="triton"), ValueError, "impl must be one of"),
        (dict(extra_kv_cache=jnp.zeros((1, 37440), jnp.uint8)), ValueError, "must be given together"),
        (dict(extra_topk_length=jnp.zeros(2, jnp.int32)), ValueError, "need extra_kv_cache"),
    ],
)
def test_decode_bad_kwargs(change, exc, match):
    c = _good()
    kw = {**c.kwargs(), "impl": "xla", **change}
    with pytest.raises(exc, match=match):
        d.sparse_mla_decode(*c.args(), **kw)


def test_prefill_bad_inputs():
    p = make_prefill_case(12, s_q=3, h_q=2, topk=64)
    with pytest.raises(TypeError, match="kv must be bfloat16"):
        d.sparse_mla_prefill(p.q, p.kv.astype(jnp.float32), p.indices, softmax_scale=1.0)
    with pytest.raises(ValueError, match="kv must be"):
        d.sparse_mla_prefill(p.q, p.kv[:, :448], p.indices, softmax_scale=1.0)
    with pytest.raises(ValueError, match="indices must be"):
        d.sparse_mla_prefill(p.q, p.kv, p.indices[:2], softmax_scale=1.0)
    with pytest.raises(ValueError, match="topk_length must have shape"):
        d.sparse_mla_prefill(p.q, p.kv, p.indices, softmax_scale=1.0, topk_length=jnp.zeros(2, jnp.int32))
    for impl in ("cuda", "pallas"):
        if impl not in d.attention.prefill_impls():
            with pytest.raises(ValueError, match="not available here"):
                d.sparse_mla_prefill(p.q, p.kv, p.indices, softmax_scale=1.0, impl=impl)


def test_prefill_accepts_flashmla_layouts():
    p = make_prefill_case(13, s_q=3, h_q=2, topk=64)
    a = d.sparse_mla_prefill(*p.args(), **p.kwargs(), impl="xla")
    b = d.sparse_mla_prefill(p.q, p.kv[:, None], p.indices[:, None], **p.kwargs(), impl="xla")
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))
