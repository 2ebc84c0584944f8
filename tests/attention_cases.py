"""Random sparse-attention cases and the float64 NumPy oracle they are checked against.

Shared by the CPU tests (tests/test_attention.py), the interpret-mode kernel tests and the GPU
tests (tests/gpu/). Cases follow FlashMLA's test grid: odd page sizes, variable and zero
lengths, all-invalid rows, sinks of +-inf, unused cache slots poisoned with NaN, invalid index
values (-1, INT_MIN, INT_MAX, exactly the capacity), entries past topk_length pointing at
poisoned slots, an extra cache with its own page size and format.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from dsv41_jax import kv_cache as kvc

# The cache ops jitted: one compilation per case shape, where an eager call compiles each primitive it
# runs (seconds per new shape; the cases have many shapes).
_insert = jax.jit(kvc.insert, static_argnames=("kv_format", "block_size"))
_gather = jax.jit(kvc.gather, static_argnames=("kv_format", "block_size"))


def _f64(x) -> np.ndarray:
    """float64 copy of a bf16 / f32 array (exact), read on the host."""
    return np.asarray(x).astype(np.float64)

INT_MIN = np.iinfo(np.int32).min
INT_MAX = np.iinfo(np.int32).max

# FlashMLA's tolerances: (abs_tol, rel_tol)
TOL = {
    "decode_out": (1e-3, 2.01 / 128),
    "decode_lse": (1e-6, 8.01 / 65536),
    "prefill_out": (8e-4, 3.01 / 128),
    "prefill_max_logits": (1e-6, 2.01 / 65536),
    "prefill_lse": (1e-6, 2.01 / 65536),
}
COS_TOL = {"decode_out": 5e-6, "prefill_out": 7e-6}


def assert_close(actual, expected, kind: str, what: str = "") -> None:
    """FlashMLA's comparison: +-inf / NaN positions equal; else abs_err < abs_tol or rel_err < rel_tol."""
    a = _f64(actual)
    e = np.asarray(expected, np.float64)
    assert a.shape == e.shape, f"{what}: shape {a.shape} != {e.shape}"
    for name, fa, fe in (("nan", np.isnan(a), np.isnan(e)), ("+inf", np.isposinf(a), np.isposinf(e)),
                         ("-inf", np.isneginf(a), np.isneginf(e))):
        bad = np.argwhere(fa != fe)
        assert bad.size == 0, f"{what}: {name} positions differ at {bad[:5].tolist()} (actual {a[tuple(bad[0])]}, expected {e[tuple(bad[0])]})"
    fin = np.isfinite(e)
    abs_tol, rel_tol = TOL[kind]
    with np.errstate(invalid="ignore"):
        err = np.abs(a - e)
        rel = err / np.maximum(np.abs(e), 1e-30)
    ok = (err < abs_tol) | (rel < rel_tol) | ~fin
    if not ok.all():
        i = tuple(np.argwhere(~ok)[0])
        raise AssertionError(
            f"{what}: {int((~ok).sum())} of {ok.size} elements out of tolerance {kind} {TOL[kind]}; "
            f"first at {i}: actual {a[i]!r} expected {e[i]!r}"
        )
    if kind in COS_TOL:
        x, y = a[fin], e[fin]
        den = (x * x).sum() + (y * y).sum()
        if den > 0:
            cos_diff = 1 - 2 * (x * y).sum() / den
            assert cos_diff < COS_TOL[kind], f"{what}: cosine difference {cos_diff} >= {COS_TOL[kind]}"


# ------------------------------------------------------------------------------ the oracle
def oracle_rows(q, pools, scale, sink):
    """float64 reference. q [R, h, D]; pools: list of (table [cap, D] float64, idx [R, K], lens [R]).

    Returns (out [R, h, D], max_logits [R, h], lse [R, h]) with FlashMLA's conventions.
    """
    q = np.asarray(q, np.float64)
    R, H, D = q.shape
    out = np.zeros((R, H, D))
    mx = np.full((R, H), -np.inf)
    lse = np.full((R, H), np.inf)
    for r in range(R):
        rows = []
        for table, idx, lens in pools:
            cap = table.shape[0]
            for k in range(min(int(lens[r]), idx.shape[1])):
                j = int(idx[r, k])
                if 0 <= j < cap:
                    rows.append(table[j])
        if not rows:
            continue
        K = np.stack(rows)  # [n, D]
        s = scale * (q[r] @ K.T)  # [h, n]
        m = s.max(axis=1)
        p = np.exp(s - m[:, None])
        l = p.sum(axis=1)
        mx[r] = m
        lse[r] = m + np.log(l)
        o = (p @ K) / l[:, None]
        if sink is not None:
            with np.errstate(over="ignore"):
                o = o / (1.0 + np.exp(np.asarray(sink, np.float64) - lse[r]))[:, None]
        out[r] = o
    return out, mx, lse


def dequantized_table(cache, fmt: str, block_size: int) -> np.ndarray:
    cap = kvc.cache_capacity(cache, fmt, block_size)
    return _f64(_gather(cache, np.arange(cap, dtype=np.int32), kv_format=fmt, block_size=block_size))


# ------------------------------------------------------------------------------ decode cases
@dataclasses.dataclass
class DecodeCase:
    q: jnp.ndarray
    kv_cache: jnp.ndarray
    indices: jnp.ndarray
    topk_length: jnp.ndarray
    kv_format: str
    block_size: int
    softmax_scale: float
    attn_sink: jnp.ndarray | None
    extra_kv_cache: jnp.ndarray | None = None
    extra_indices: jnp.ndarray | None = None
    extra_topk_length: jnp.ndarray | None = None
    extra_kv_format: str | None = None
    extra_block_size: int | None = None

    def kwargs(self) -> dict:
        kw = dict(kv_format=self.kv_format, block_size=self.block_size, softmax_scale=self.softmax_scale,
                  attn_sink=self.attn_sink)
        if self.extra_kv_cache is not None:
            kw.update(extra_kv_cache=self.extra_kv_cache, extra_indices=self.extra_indices,
                      extra_topk_length=self.extra_topk_length, extra_kv_format=self.extra_kv_format,
                      extra_block_size=self.extra_block_size)
        return kw

    def args(self) -> tuple:
        return self.q, self.kv_cache, self.indices, self.topk_length

    def expected(self):
        b, s_q, h, d = self.q.shape
        R = b * s_q

        def pool(cache, fmt, bs, idx, lens):
            return (dequantized_table(cache, fmt, bs), np.asarray(idx).reshape(R, -1), np.repeat(np.asarray(lens), s_q))

        pools = [pool(self.kv_cache, self.kv_format, self.block_size, self.indices, self.topk_length)]
        if self.extra_kv_cache is not None:
            pools.append(pool(self.extra_kv_cache, self.extra_kv_format, self.extra_block_size, self.extra_indices,
                              self.extra_topk_length))
        q = _f64(self.q).reshape(R, h, d)
        sink = None if self.attn_sink is None else np.asarray(self.attn_sink, np.float64)
        out, _, lse = oracle_rows(q, pools, self.softmax_scale, sink)
        return out.reshape(b, s_q, h, d), lse.reshape(b, s_q, h)

    def check(self, out, lse, what: str = "") -> None:
        """Dtypes, shapes and FlashMLA's tolerances against the float64 oracle; no NaN in out."""
        assert out.dtype == jnp.bfloat16 and lse.dtype == jnp.float32, (out.dtype, lse.dtype)
        assert out.shape == self.q.shape and lse.shape == self.q.shape[:3], (out.shape, lse.shape)
        e_out, e_lse = self.expected()
        assert_close(out, e_out, "decode_out", f"{what} out")
        assert_close(lse, e_lse, "decode_lse", f"{what} lse")
        assert not np.isnan(_f64(out)).any(), f"{what}: NaN in out"


def _poisoned_cache(rng, num_blocks, block_size, fmt, n_written):
    """A cache whose every slot is poison (NaN rows / 0xFF bytes) except `n_written` random slots."""
    cap = num_blocks * block_size
    if fmt == "bf16":
        cache = np.full((num_blocks, block_size, 512), np.nan, jnp.bfloat16)
    else:
        cache = np.full((num_blocks, kvc.page_bytes(fmt, block_size)), 0xFF, np.uint8)
    written = rng.permutation(cap)[:n_written].astype(np.int32)
    # per-token magnitudes spanning several fp8 scale exponents, up to ~1.6x unit scale: FlashMLA's tolerances
    # assume unit-scale latents (its kernels round P to bf16, whose error grows with |v|)
    mag = np.exp(rng.uniform(-2.5, 0.5, size=(n_written, 1)))
    kv = (rng.standard_normal((n_written, 512)) * mag).astype(np.float32)
    cache = _insert(cache, jnp.asarray(kv, jnp.bfloat16), written, kv_format=fmt, block_size=block_size)
    return cache, written


def _indices(rng, shape, written, cap, invalid_frac, lens, poison_tail):
    """Indices drawn from written slots, some replaced by invalid values; past `lens`, garbage."""
    idx = rng.choice(written, size=shape).astype(np.int64)
    bad_vals = np.array([-1, INT_MIN, INT_MAX, cap, cap + 7, -5], np.int64)
    bad = rng.random(shape) < invalid_frac
    idx[bad] = rng.choice(bad_vals, size=int(bad.sum()))
    if poison_tail:
        unwritten = np.setdiff1d(np.arange(cap), written)
        if unwritten.size:
            k = np.arange(shape[-1])
            tail = k[None, None, :] >= np.asarray(lens).reshape(-1, 1, 1)
            tail = np.broadcast_to(tail, shape)
            idx[tail] = rng.choice(unwritten, size=int(tail.sum()))
    return idx.astype(np.int32)


def _sink(rng, h_q: int, mode: str):
    """None ("none"), random per-head sinks ("random"), or random with +inf and -inf heads ("inf")."""
    if mode == "none":
        return None
    sv = rng.standard_normal(h_q).astype(np.float32)
    if mode == "inf":
        sv[0], sv[-1] = np.inf, -np.inf
    return jnp.asarray(sv)


def make_decode_case(
    seed: int,
    *,
    b: int = 3,
    s_q: int = 2,
    h_q: int = 16,
    topk: int = 64,
    block_size: int = 64,
    fmt: str = "fp8_ds_mla",
    s_kv: int | None = None,
    lengths="var",  # "full" | "var" | "zero" | explicit int array [b]
    invalid_frac: float = 0.1,
    all_invalid_row: bool = False,
    sink: str = "random",  # "none" | "random" | "inf"
    extra: dict | None = None,  # {"topk", "block_size", "fmt", "s_kv"?, "lengths"?}
    softmax_scale: float | None = None,
) -> DecodeCase:
    rng = np.random.default_rng(seed)
    s_kv = s_kv or max(topk, 32)
    nb = -(-(s_kv + s_kv // 2) // block_size)
    cache, written = _poisoned_cache(rng, nb, block_size, fmt, min(s_kv, nb * block_size))
    if isinstance(lengths, str):
        lens = {"full": np.full(b, topk), "zero": np.zeros(b, int), "var": rng.integers(0, topk + 1, size=b)}[lengths]
        if lengths == "var" and b > 1:
            lens[0] = topk
    else:  # explicit per-request lengths, possibly < 0 or > topk (the ops clamp them)
        lens = np.asarray(lengths).reshape(b)
    idx = _indices(rng, (b, s_q, topk), written, nb * block_size, invalid_frac, np.clip(lens, 0, topk), poison_tail=True)
    if all_invalid_row:
        idx[b - 1] = rng.choice([-1, INT_MIN, INT_MAX, nb * block_size], size=(s_q, topk))
    q = jnp.asarray(rng.standard_normal((b, s_q, h_q, 512)), jnp.bfloat16)
    snk = _sink(rng, h_q, sink)
    case = DecodeCase(q, cache, jnp.asarray(idx), jnp.asarray(lens, jnp.int32), fmt, block_size,
                      softmax_scale if softmax_scale is not None else 512 ** -0.5, snk)
    if extra:
        ebs, efmt, etopk = extra["block_size"], extra["fmt"], extra["topk"]
        es_kv = extra.get("s_kv", max(etopk, 32))
        enb = -(-(es_kv + es_kv // 3) // ebs)
        ecache, ewritten = _poisoned_cache(rng, enb, ebs, efmt, min(es_kv, enb * ebs))
        elens = {"full": np.full(b, etopk), "zero": np.zeros(b, int),
                 "var": rng.integers(0, etopk + 1, size=b)}[extra.get("lengths", "var")]
        eidx = _indices(rng, (b, s_q, etopk), ewritten, enb * ebs, invalid_frac, elens, poison_tail=True)
        if all_invalid_row:
            eidx[b - 1] = -1
        case = dataclasses.replace(case, extra_kv_cache=ecache, extra_indices=jnp.asarray(eidx),
                                   extra_topk_length=jnp.asarray(elens, jnp.int32), extra_kv_format=efmt,
                                   extra_block_size=ebs)
    return case


# ------------------------------------------------------------------------- mega decode cases
def _cos_sin_of(positions, cos_sin_cache):
    cs = np.asarray(cos_sin_cache, np.float64)
    pn = np.clip(np.asarray(positions), 0, cs.shape[0] - 1)
    return cs[pn, :32][:, None], cs[pn, 32:][:, None]


def _roped_q(q, positions, cos_sin_cache) -> np.ndarray:
    """q [R, h, 512] roped at positions [R] in float32 and rounded to bf16, as the ops rope it (a float64 rotation
    would round some elements to the neighbouring bf16 value); float64."""
    cos, sin = _cos_sin_of(positions, cos_sin_cache)
    q = np.asarray(q, np.float32)
    a, b = q[..., 448::2].copy(), q[..., 449::2].copy()
    c32, s32 = cos.astype(np.float32), sin.astype(np.float32)
    q[..., 448::2], q[..., 449::2] = a * c32 - b * s32, a * s32 + b * c32
    return _f64(jnp.asarray(q, jnp.bfloat16))


def _unroped_out(out: np.ndarray, positions, cos_sin_cache) -> np.ndarray:
    """The float64 inverse RoPE of out [R, h, 512]'s last 64 dims (in place)."""
    cos, sin = _cos_sin_of(positions, cos_sin_cache)
    a, b = out[..., 448::2].copy(), out[..., 449::2].copy()
    out[..., 448::2], out[..., 449::2] = a * cos + b * sin, -a * sin + b * cos
    return out


@dataclasses.dataclass
class MegaCase:
    """A `sparse_mla_mega_decode` case: `base` is a decode case of T requests of one query token (its q NOT roped),
    positions int32 [T] (some past the table, which the ops clamp), cos_sin_cache f32 [max_pos, 64]."""

    base: DecodeCase
    positions: jnp.ndarray
    cos_sin_cache: jnp.ndarray

    def args(self):
        c = self.base
        return (c.q[:, 0], self.positions, self.cos_sin_cache, c.kv_cache, c.indices[:, 0], c.topk_length)

    def kwargs(self):
        c = self.base
        kw = dict(kv_format=c.kv_format, block_size=c.block_size, softmax_scale=c.softmax_scale, attn_sink=c.attn_sink)
        if c.extra_kv_cache is not None:
            kw.update(extra_kv_cache=c.extra_kv_cache, extra_indices=c.extra_indices[:, 0],
                      extra_topk_length=c.extra_topk_length, extra_kv_format=c.extra_kv_format,
                      extra_block_size=c.extra_block_size)
        return kw

    def expected(self):
        """float64 oracle: (out [T, h, 512] after the inverse RoPE, before quantisation; lse [T, h])."""
        c = self.base
        q = _roped_q(c.q[:, 0], self.positions, self.cos_sin_cache)
        pools = [(dequantized_table(c.kv_cache, c.kv_format, c.block_size), np.asarray(c.indices[:, 0]),
                  np.clip(np.asarray(c.topk_length), 0, c.indices.shape[2]))]
        if c.extra_kv_cache is not None:
            pools.append((dequantized_table(c.extra_kv_cache, c.extra_kv_format, c.extra_block_size),
                          np.asarray(c.extra_indices[:, 0]),
                          np.clip(np.asarray(c.extra_topk_length), 0, c.extra_indices.shape[2])))
        sink = None if c.attn_sink is None else np.asarray(c.attn_sink, np.float64)
        out, _, lse = oracle_rows(q, pools, c.softmax_scale, sink)
        return _unroped_out(out, self.positions, self.cos_sin_cache), lse


def make_mega_case(seed: int, *, b: int = 4, max_pos: int = 512, **kw) -> MegaCase:
    """`make_decode_case(seed, b=b, s_q=1, **kw)` with positions in [0, max_pos + 40) (past the table: clamped)
    and a YaRN-free table of theta 160000."""
    from dsv41_jax.rope import cos_sin_cache

    base = make_decode_case(seed, b=b, s_q=1, **kw)
    pos = np.random.default_rng(seed + 1000).integers(0, max_pos + 40, size=b)
    return MegaCase(base, jnp.asarray(pos, jnp.int32), cos_sin_cache(max_pos, theta=160000.0))


def dequantize_mega_out(out, out_scale) -> np.ndarray:
    """float64 values of a mega output: e4m3 x 2^(exponent - 127) per 32 dims."""
    return _f64(jnp.asarray(out).astype(jnp.float32)) * np.repeat(2.0 ** (_f64(out_scale) - 127), 32, axis=-1)


def assert_mega_close(out, out_scale, lse, expected, what: str = "", *, kind: str = "decode") -> None:
    """A mega output against the float64 oracle: each dequantised value within e4m3's rounding (2^-4 of |x|, plus half
    the group's subnormal step) of the exact one, widened by FlashMLA's decode tolerance; every exponent the rule's
    for the exact group maximum, or one off where rounding moves that maximum across a power of two; lse with
    FlashMLA's tolerance. kind: "decode" or "prefill" (whose tolerances widen the bounds)."""
    e_out, e_lse = expected
    assert out.dtype == jnp.float8_e4m3fn and out.shape == e_out.shape, f"{what}: out {out.dtype} {out.shape}"
    assert out_scale.dtype == jnp.uint8 and out_scale.shape == e_out.shape[:-1] + (16,), f"{what}: {out_scale.shape}"
    deq = dequantize_mega_out(out, out_scale)
    assert np.isfinite(deq).all(), f"{what}: non-finite output values"
    step = np.repeat(2.0 ** (_f64(out_scale) - 127), 32, axis=-1)
    abs_tol, rel_tol = TOL[f"{kind}_out"]
    bound = np.abs(e_out) * (2.0**-4 + rel_tol) + step * 2.0**-10 + abs_tol
    bad = np.abs(deq - e_out) > bound
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.size} values out of bound; first at "
                           f"{np.argwhere(bad)[0].tolist()}: {deq[bad][0]} vs {e_out[bad][0]}")
    amax = np.abs(e_out).reshape(e_out.shape[:-1] + (16, 32)).max(-1)
    rule = np.ceil(np.log2(np.maximum(amax, 1e-4) / 448.0))
    got = _f64(out_scale) - 127
    assert (np.abs(got - rule) <= 1).all() and (got == rule).mean() > 0.97, f"{what}: exponents off the rule"
    assert_close(lse, e_lse, f"{kind}_lse", what)


MEGA_DECODE_GRID = [
    ("mx_nv_h64", dict(fmt="mxfp8_ds_mla", block_size=256, topk=128, s_kv=400, h_q=64, b=6, sink="inf",
                       extra=dict(topk=192, block_size=64, fmt="nvfp4_ds_mla", lengths="var"))),
    ("mx_nv_h128_pair", dict(fmt="mxfp8_ds_mla", block_size=61, topk=128, s_kv=300, h_q=128, b=4,
                             extra=dict(topk=256, block_size=2, fmt="nvfp4_ds_mla", lengths="full"))),
    ("fp8_fp8_h100", dict(fmt="fp8_ds_mla", block_size=64, topk=64, h_q=100, b=3, invalid_frac=0.3,
                          extra=dict(topk=128, block_size=69, fmt="fp8_ds_mla"))),
    ("bf16_h8_narrow", dict(fmt="bf16", block_size=32, topk=128, h_q=8, b=5, sink="inf")),
    ("mx_nv_h24_narrow", dict(fmt="mxfp8_ds_mla", block_size=576, topk=64, s_kv=700, h_q=24,
                              extra=dict(topk=128, block_size=32, fmt="nvfp4_ds_mla"))),
    ("mx_nv_h3_zero", dict(fmt="mxfp8_ds_mla", block_size=64, topk=64, h_q=3, lengths="zero",
                           extra=dict(topk=64, block_size=64, fmt="nvfp4_ds_mla", lengths="zero"))),
    ("mx_nv_all_invalid_row", dict(fmt="mxfp8_ds_mla", block_size=64, topk=64, h_q=64, b=4, all_invalid_row=True,
                                   extra=dict(topk=64, block_size=2, fmt="nvfp4_ds_mla"))),
]


# ----------------------------------------------------------------------------- prefill cases
@dataclasses.dataclass
class PrefillCase:
    q: jnp.ndarray
    kv: jnp.ndarray
    indices: jnp.ndarray
    topk_length: jnp.ndarray | None
    softmax_scale: float
    attn_sink: jnp.ndarray | None

    def kwargs(self) -> dict:
        return dict(softmax_scale=self.softmax_scale, attn_sink=self.attn_sink, topk_length=self.topk_length)

    def args(self) -> tuple:
        return self.q, self.kv, self.indices

    def expected(self):
        s_kv = self.kv.shape[0]
        table = _f64(self.kv)
        lens = np.full(self.q.shape[0], self.indices.shape[1]) if self.topk_length is None else np.asarray(self.topk_length)
        sink = None if self.attn_sink is None else np.asarray(self.attn_sink, np.float64)
        q = _f64(self.q)
        assert table.shape[0] == s_kv
        return oracle_rows(q, [(table, np.asarray(self.indices), lens)], self.softmax_scale, sink)

    def check(self, results, what: str = "") -> None:
        """(out, max_logits, lse): dtypes, shapes and FlashMLA's tolerances against the float64 oracle."""
        out, mx, lse = results
        assert out.dtype == jnp.bfloat16 and mx.dtype == jnp.float32 and lse.dtype == jnp.float32
        assert out.shape == self.q.shape and mx.shape == lse.shape == self.q.shape[:2]
        e_out, e_mx, e_lse = self.expected()
        assert_close(out, e_out, "prefill_out", f"{what} out")
        assert_close(mx, e_mx, "prefill_max_logits", f"{what} max_logits")
        assert_close(lse, e_lse, "prefill_lse", f"{what} lse")


def make_prefill_case(
    seed: int,
    *,
    s_q: int = 5,
    h_q: int = 16,
    s_kv: int = 128,
    topk: int = 128,
    lengths: str = "var",
    invalid_frac: float = 0.1,
    all_invalid_row: bool = False,
    sink: str = "random",
    softmax_scale: float | None = None,
) -> PrefillCase:
    rng = np.random.default_rng(seed)
    kv = jnp.asarray(rng.standard_normal((s_kv, 512)) * np.exp(rng.uniform(-2, 0.5, (s_kv, 1))), jnp.bfloat16)
    idx = rng.integers(0, s_kv, size=(s_q, topk)).astype(np.int64)
    bad = rng.random((s_q, topk)) < invalid_frac
    idx[bad] = rng.choice(np.array([-1, INT_MIN, INT_MAX, s_kv, s_kv + 3]), size=int(bad.sum()))
    if all_invalid_row:
        idx[-1] = rng.choice(np.array([-1, INT_MIN, INT_MAX, s_kv]), size=topk)
    lens = None
    if lengths != "none":
        lens = {"full": np.full(s_q, topk), "zero": np.zeros(s_q, int), "var": rng.integers(0, topk + 1, size=s_q)}[lengths]
        lens = jnp.asarray(lens, jnp.int32)
    q = jnp.asarray(rng.standard_normal((s_q, h_q, 512)), jnp.bfloat16)
    snk = _sink(rng, h_q, sink)
    return PrefillCase(q, kv, jnp.asarray(idx.astype(np.int32)), lens,
                       softmax_scale if softmax_scale is not None else 512 ** -0.5, snk)


# The grid shared by CPU (reference) and GPU (kernels) tests: (id, kwargs)
DECODE_GRID = [
    ("bf16_p64", dict(fmt="bf16", block_size=64, topk=64)),
    ("fp8_p64_full", dict(fmt="fp8_ds_mla", block_size=64, topk=128, lengths="full", invalid_frac=0.0, sink="none")),
    ("fp8_p2_var", dict(fmt="fp8_ds_mla", block_size=2, topk=64)),
    ("fp8_p61", dict(fmt="fp8_ds_mla", block_size=61, topk=192, s_kv=300)),
    ("fp8_p69_sinkinf", dict(fmt="fp8_ds_mla", block_size=69, topk=64, sink="inf")),
    ("fp8_p576", dict(fmt="fp8_ds_mla", block_size=576, topk=128, s_kv=700)),
    ("fp8_zero_len", dict(fmt="fp8_ds_mla", block_size=64, topk=64, lengths="zero")),
    ("fp8_all_invalid_row", dict(fmt="fp8_ds_mla", block_size=64, topk=64, all_invalid_row=True, b=4)),
    ("fp8_skv_lt_topk", dict(fmt="fp8_ds_mla", block_size=64, topk=256, s_kv=40)),
    ("fp8_extra_p2", dict(fmt="fp8_ds_mla", block_size=64, topk=64, extra=dict(topk=128, block_size=2, fmt="fp8_ds_mla"))),
    ("bf16_extra_fp8", dict(fmt="bf16", block_size=32, topk=64, h_q=64, extra=dict(topk=64, block_size=61, fmt="fp8_ds_mla"))),
    ("mxfp8_extra_nvfp4", dict(fmt="mxfp8_ds_mla", block_size=64, topk=64, extra=dict(topk=128, block_size=32, fmt="nvfp4_ds_mla"))),
    ("fp8_sq1_h3", dict(fmt="fp8_ds_mla", block_size=64, topk=64, s_q=1, h_q=3)),
]

# The V4.1 formats (mxfp8_ds_mla main, nvfp4_ds_mla or mxfp8_ds_mla extra): every kernel shape (one CTA, a pair,
# a partial last group, the narrow CTA of 16 / 32 rows), odd pages, variable / zero lengths, invalid indices,
# NaN-poisoned (0xFF) unused slots, infinite sinks.
V41_DECODE_GRID = [
    ("mx_p64_full_nosink", dict(fmt="mxfp8_ds_mla", block_size=64, topk=128, lengths="full", invalid_frac=0.0,
                                sink="none", h_q=64)),
    ("mx_p61_var", dict(fmt="mxfp8_ds_mla", block_size=61, topk=192, s_kv=300, h_q=64)),
    ("nv_main_p2", dict(fmt="nvfp4_ds_mla", block_size=2, topk=64, h_q=64)),
    ("mx_nv_h64", dict(fmt="mxfp8_ds_mla", block_size=256, topk=128, s_kv=400, h_q=64, sink="inf",
                       extra=dict(topk=192, block_size=64, fmt="nvfp4_ds_mla", lengths="var"))),
    ("mx_nv_h128_pair", dict(fmt="mxfp8_ds_mla", block_size=61, topk=128, s_kv=300, h_q=128, b=2,
                             extra=dict(topk=256, block_size=2, fmt="nvfp4_ds_mla", lengths="full"))),
    ("mx_mx_h100", dict(fmt="mxfp8_ds_mla", block_size=64, topk=64, h_q=100, b=2, s_q=1, invalid_frac=0.3,
                        extra=dict(topk=128, block_size=69, fmt="mxfp8_ds_mla"))),
    ("mx_nv_h8_narrow", dict(fmt="mxfp8_ds_mla", block_size=64, topk=128, h_q=8, b=4,
                             extra=dict(topk=192, block_size=2, fmt="nvfp4_ds_mla", lengths="var"))),
    ("mx_nv_h24_narrow", dict(fmt="mxfp8_ds_mla", block_size=576, topk=64, s_kv=700, h_q=24, sink="inf",
                              extra=dict(topk=128, block_size=32, fmt="nvfp4_ds_mla"))),
    ("mx_nv_h3_zero", dict(fmt="mxfp8_ds_mla", block_size=64, topk=64, h_q=3, s_q=1, lengths="zero",
                           extra=dict(topk=64, block_size=64, fmt="nvfp4_ds_mla", lengths="zero"))),
    ("mx_nv_all_invalid_row", dict(fmt="mxfp8_ds_mla", block_size=64, topk=64, h_q=16, b=4, all_invalid_row=True,
                                   extra=dict(topk=64, block_size=2, fmt="nvfp4_ds_mla"))),
]


PREFILL_GRID = [
    ("skv128_topk128", dict(s_kv=128, topk=128)),
    ("sq1", dict(s_q=1, s_kv=256, topk=128)),
    ("skv_lt_topk", dict(s_kv=60, topk=128, s_q=7)),
    ("sink_inf", dict(sink="inf", topk=64, s_kv=200)),
    ("all_invalid_row", dict(all_invalid_row=True, topk=64)),
    ("no_lengths", dict(lengths="none", topk=64, sink="none")),
    ("zero_lengths", dict(lengths="zero", topk=64)),
    ("scale_half", dict(softmax_scale=0.5, topk=128, s_kv=1521, s_q=9)),
]


@dataclasses.dataclass
class MegaPrefillCase:
    """A `sparse_mla_mega_prefill` case: `base` is a prefill case (its q NOT roped), positions int32 [s_q] (some past
    the table, which the ops clamp), cos_sin_cache f32 [max_pos, 64]."""

    base: PrefillCase
    positions: jnp.ndarray
    cos_sin_cache: jnp.ndarray

    def args(self):
        c = self.base
        return (c.q, self.positions, self.cos_sin_cache, c.kv, c.indices)

    def kwargs(self):
        return self.base.kwargs()

    def expected(self):
        """float64 oracle: (out [s_q, h, 512] after the inverse RoPE, before quantisation; lse [s_q, h])."""
        c = self.base
        lens = (np.full(c.q.shape[0], c.indices.shape[1]) if c.topk_length is None
                else np.clip(np.asarray(c.topk_length), 0, c.indices.shape[1]))
        sink = None if c.attn_sink is None else np.asarray(c.attn_sink, np.float64)
        q = _roped_q(c.q, self.positions, self.cos_sin_cache)
        out, _, lse = oracle_rows(q, [(_f64(c.kv), np.asarray(c.indices), lens)], c.softmax_scale, sink)
        return _unroped_out(out, self.positions, self.cos_sin_cache), lse


def make_mega_prefill_case(seed: int, *, max_pos: int = 512, **kw) -> MegaPrefillCase:
    """`make_prefill_case(seed, **kw)` with positions in [0, max_pos + 40) (past the table: clamped) and a YaRN-free
    table of theta 160000."""
    from dsv41_jax.rope import cos_sin_cache

    base = make_prefill_case(seed, **kw)
    pos = np.random.default_rng(seed + 1000).integers(0, max_pos + 40, size=base.q.shape[0])
    return MegaPrefillCase(base, jnp.asarray(pos, jnp.int32), cos_sin_cache(max_pos, theta=160000.0))


# The mega prefill's grid (CPU through the emulator, and the H200): partial head groups, two groups, empty and
# all-invalid rows, sinks of +-inf, no lengths.
MEGA_PREFILL_GRID = [
    ("h64", dict(s_q=5, h_q=64, s_kv=300, topk=128)),
    ("h128_sink_inf", dict(s_q=3, h_q=128, s_kv=200, topk=192, sink="inf")),
    ("h100_partial", dict(s_q=4, h_q=100, s_kv=150, topk=64, invalid_frac=0.3)),
    ("h8_zero_len", dict(s_q=3, h_q=8, s_kv=128, topk=64, lengths="zero")),
    ("h16_all_invalid_row", dict(s_q=4, h_q=16, s_kv=128, topk=64, all_invalid_row=True, sink="none")),
    ("h64_no_lengths", dict(s_q=2, h_q=64, s_kv=60, topk=128, lengths="none")),
]


# ----------------------------------------------------------------------------- f16-kernel range cases
def make_saturating_prefill_case(seed: int) -> tuple[PrefillCase, PrefillCase]:
    """(case, saturated): kv dims 0..7 of every row at +-1e6, beyond f16's range, and the same case
    with those values clamped to +-65504 (f32 kv) — what kernels computing in f16 with saturating
    conversions must match."""
    case = make_prefill_case(seed, s_q=2, h_q=4, s_kv=64, topk=64)
    kv = np.asarray(case.kv, np.float32)
    kv[:, :8] = 1e6 * np.where(kv[:, :8] < 0, -1.0, 1.0)
    big = dataclasses.replace(case, kv=jnp.asarray(kv, jnp.bfloat16))
    sat = dataclasses.replace(case, kv=jnp.asarray(np.clip(np.asarray(big.kv, np.float32), -65504, 65504)))
    return big, sat


def make_two_scale_decode_case(seed: int, h_q: int = 8, tiny: bool = False, fmt: str = "fp8_ds_mla",
                               **kw) -> DecodeCase:
    """A UE8M0-scaled decode case (fp8_ds_mla, or mxfp8_ds_mla) whose selected tokens are half unit-scale
    (UE8M0 exponent k ~ -8) and half positive with x up to 59904 (every tile's amax pinned there: k = 8,
    still inside f16's range; positive, so no output cancels large terms, which FlashMLA's tolerance does
    not allow for). Kernels that dequantize k in [-14, 7] and other k differently exercise both paths.
    tiny: every selected token instead has |x| <= 2^-11 (k <= -19, below the f16 fast path's range),
    so the output itself is tiny and a token dequantized on the wrong path is visible. `kw` goes to
    make_decode_case (an extra cache, say)."""
    tile = {"fp8_ds_mla": 64, "mxfp8_ds_mla": 32}[fmt]
    case = make_decode_case(seed, **{**dict(b=2, s_q=2, h_q=h_q, topk=128, fmt=fmt, lengths="full"), **kw})
    idx = np.asarray(case.indices)
    cap = case.kv_cache.shape[0] * case.block_size
    slots = np.unique(idx[(idx >= 0) & (idx < cap)])
    rng = np.random.default_rng(seed + 1)
    rows = rng.uniform(-1, 1, (slots.size, 512))
    if tiny:
        rows *= 2.0 ** -11
    else:
        big = rng.random(slots.size) < 0.5
        rows[big] = rng.uniform(0.25, 1.0, (int(big.sum()), 512)) * 59.904
        rows[big, ::tile] = 59904.0
    cache = _insert(case.kv_cache, jnp.asarray(rows, jnp.bfloat16), slots.astype(np.int32), kv_format=fmt,
                    block_size=case.block_size)
    lay = kvc.layout(fmt)
    n_scales = (448 if fmt == "fp8_ds_mla" else 512) // tile
    pages = np.asarray(cache).reshape(cache.shape[0], -1)
    p = case.block_size
    scale_bytes = pages[:, p * lay.data_bytes:p * lay.record_bytes].reshape(cache.shape[0], p, lay.scale_bytes)
    blk, off = np.divmod(slots, p)
    k = scale_bytes[blk, off, :n_scales].astype(int) - 127
    if tiny:
        assert (k <= -15).all(), "every selected token below the fast path's range"
    else:
        assert (k == 8).any() and ((k >= -14) & (k <= 7)).any(), "both exponent ranges must be present"
    return dataclasses.replace(case, kv_cache=cache)


def make_v41_exact_decode_case(fmt: str, seed: int = 38, n: int = 64) -> tuple[DecodeCase, np.ndarray]:
    """(case, want): a decode case whose extra cache holds random `fmt` records (V4.1: "nvfp4_ds_mla", every
    e2m1 / e4m3 code, scales over e4m3's finite range, subnormals included; "mxfp8_ds_mla", every finite e4m3
    code, UE8M0 exponents k in [-14, 7], exact in f16) and whose query token j attends to extra token j alone
    (q = 0, so score 0 and weight 1; the main cache's lengths are 0), for j < n (n <= 64 query tokens). Every
    head of output row j must then be `want[j]`, that token's dequantized value (bf16 [n, 512], exact), rounded
    once to bf16: exactly it."""
    rng = np.random.default_rng(seed)
    p = 64
    lay = kvc.layout(fmt)
    rec = np.zeros((1, p, lay.record_bytes), np.uint8)
    if fmt == "nvfp4_ds_mla":
        rec[0, :, :256] = rng.integers(0, 256, (p, 256))
        rec[0, :, 256:] = rng.choice(np.r_[0:0x7f, 0x80:0xff], (p, 32))  # no NaN scale (0x7f / 0xff)
    elif fmt == "mxfp8_ds_mla":
        codes = rng.integers(0, 256, (p, 512))
        codes[(codes & 0x7f) == 0x7f] = 0x7e  # e4m3fn's NaN codes
        rec[0, :, :512] = codes
        rec[0, :, 512:] = rng.integers(127 - 14, 127 + 8, (p, 16))  # k in [-14, 7]: exact in f16
    else:
        raise ValueError(f"fmt must be 'nvfp4_ds_mla' or 'mxfp8_ds_mla', got {fmt!r}")
    cache = kvc.pack_pages(jnp.asarray(rec), fmt)
    want = np.asarray(kvc.dequantize(jnp.asarray(rec[0]), fmt))[:n]
    case = make_decode_case(seed, b=1, s_q=n, h_q=16, topk=64, block_size=64, fmt="mxfp8_ds_mla", lengths="full",
                            invalid_frac=0.0, sink="none", extra=dict(topk=64, block_size=p, fmt=fmt, lengths="full"))
    eidx = np.full((1, n, 64), -1, np.int32)
    eidx[0, :, 0] = np.arange(n)
    case = dataclasses.replace(case, topk_length=jnp.zeros((1,), jnp.int32), extra_kv_cache=cache,
                               extra_indices=jnp.asarray(eidx), q=jnp.zeros_like(case.q))
    return case, want


def assert_v41_exact(out, want) -> None:
    """`make_v41_exact_decode_case`'s check: every head of out [1, n, h, 512] equals want (as values: a -0
    code accumulates to +0)."""
    got = np.asarray(out)[0]
    for h in range(got.shape[1]):
        np.testing.assert_array_equal(got[:, h].astype(np.float32), np.asarray(want).astype(np.float32),
                                      err_msg=f"head {h}")


def make_mega_exact_case(h_q: int, seed: int = 421, b: int = 6) -> tuple[MegaCase, tuple[np.ndarray, np.ndarray]]:
    """(case, (want_values, want_exponents)): a mega decode case whose query token j attends to one mxfp8_ds_mla
    token with no sink, so its attention output is that token's row exactly (bf16 and f16 hold mxfp8's values), and
    the output stage has one exact result: the inverse RoPE (a c + b s, b c - a s in float32), the exponent rule
    and e4m3 round to nearest even give `want_values` (uint8 [b, 512]) and `want_exponents` (uint8 [b, 16]) for
    every head."""
    case = make_mega_case(seed, b=b, h_q=h_q, topk=64, block_size=64, fmt="mxfp8_ds_mla", lengths=np.ones(b, int),
                          invalid_frac=0.0, sink="none")
    c = case.base
    rows = np.asarray(kvc.gather(c.kv_cache, c.indices[:, 0, 0], kv_format=c.kv_format,
                                 block_size=c.block_size)).astype(np.float32)  # [b, 512]
    return case, mega_out_exact(rows, case.positions, case.cos_sin_cache)


def mega_out_exact(rows: np.ndarray, positions, cos_sin_cache) -> tuple[np.ndarray, np.ndarray]:
    """The mega output stage's exact result for float32 attention outputs rows [R, 512] at positions [R]: the inverse
    RoPE in float32 (a c + b s, b c - a s), then the exponent rule and e4m3 round to nearest even. Returns (e4m3
    bytes uint8 [R, 512], exponent bytes uint8 [R, 16])."""
    import ml_dtypes

    cs = np.asarray(cos_sin_cache)
    pos = np.clip(np.asarray(positions), 0, cs.shape[0] - 1)
    cos, sin = cs[pos, :32], cs[pos, 32:]
    x = np.array(rows, np.float32)
    a, b = x[:, 448::2].copy(), x[:, 449::2].copy()
    x[:, 448::2] = a * cos + b * sin
    x[:, 449::2] = b * cos - a * sin
    g = x.reshape(x.shape[:-1] + (16, 32)).astype(np.float64)
    amax = np.maximum(np.abs(g).max(-1), np.float64(np.float32(1e-4)))
    e = np.ceil(np.log2(amax / 448.0))  # exact in float64 for these float32 inputs
    v = np.clip(g * 2.0 ** -e[..., None], -448, 448).astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
    return v.reshape(x.shape).view(np.uint8), (e + 127).astype(np.uint8)


def assert_mega_like_reference(got, ref, expected, what: str, *, kind: str = "decode") -> None:
    """A kernel's mega output `got` against the float64 oracle (`assert_mega_close`) and, with `ref` the xla
    reference's output of the same call, more than 99% of its exponents equal the reference's."""
    assert_mega_close(*got, expected, what, kind=kind)
    same = np.asarray(got[1]) == np.asarray(ref[1])
    assert same.mean() > 0.99, f"{what}: exponents equal to the reference's: {same.mean():.4f}"


def assert_mega_exact(out, out_scale, want, what: str = "") -> None:
    """`make_mega_exact_case`'s check: the first and last head's exponents and values equal `want` (values
    compared as values: a -0 accumulates to +0)."""
    want_v, want_e = want
    got_v = np.asarray(out).view(np.uint8)
    for h in (0, got_v.shape[1] - 1):
        np.testing.assert_array_equal(np.asarray(out_scale)[:, h], want_e, err_msg=f"{what}: exponents, head {h}")
        np.testing.assert_array_equal(got_v[:, h].view(jnp.float8_e4m3fn).astype(np.float32),
                                      want_v.view(jnp.float8_e4m3fn).astype(np.float32),
                                      err_msg=f"{what}: values, head {h}")


def make_growing_scores_prefill_case(seed: int) -> PrefillCase:
    """A prefill case whose scores rise from one 64-token tile to the next by set amounts (natural log:
    tile means 0, +3, +12, +13 plus noise): for kernels that move their softmax base lazily (only when
    a tile's maximum exceeds it by more than a factor 2^8, i.e. 5.5 in natural log) the base stays at tile 1,
    moves at tile 2 and lags the true maximum at tile 3, which max_logits must still report."""
    rng = np.random.default_rng(seed)
    s_q, h_q, topk = 2, 4, 256
    u = rng.standard_normal(512)
    u /= np.linalg.norm(u)
    q = 8.0 * u + 0.05 * rng.standard_normal((s_q, h_q, 512))
    scale = 512 ** -0.5
    level = np.repeat(np.array([0.0, 3.0, 12.0, 13.0]) / (scale * 8.0), 64)  # per token, tile by tile
    kv = level[:, None] * u + 0.3 * rng.standard_normal((topk, 512))
    idx = np.tile(np.arange(topk, dtype=np.int32), (s_q, 1))
    return PrefillCase(jnp.asarray(q, jnp.bfloat16), jnp.asarray(kv, jnp.bfloat16), jnp.asarray(idx),
                       jnp.full((s_q,), topk, jnp.int32), scale, None)

