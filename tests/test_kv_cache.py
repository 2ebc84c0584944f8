"""Tests of dsv41_jax.kv_cache: byte layouts against pages built by hand in numpy, the
quantization rules, round-trip error bounds, insert/gather masking, jit + donation, and argument
validation. Oracles are float64 numpy plus struct/ml_dtypes, written independently of the module.

Compilation dominates the runtime on CPU, so every call goes through a few jitted helpers whose
shapes are padded to fixed sizes: each (format, block size) compiles once.
"""

from __future__ import annotations

import functools
import re
import struct

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from dsv41_jax import kv_cache as K

BF16 = ml_dtypes.bfloat16
E4M3 = ml_dtypes.float8_e4m3fn
E2M1 = ml_dtypes.float4_e2m1fn
INT_MIN, INT_MAX = -(2**31), 2**31 - 1
QUANT = ("fp8_ds_mla", "mxfp8_ds_mla", "nvfp4_ds_mla")
# (data bytes, scale bytes, page alignment) per token, written out from the spec.
SPEC = {"fp8_ds_mla": (576, 8, 576), "mxfp8_ds_mla": (512, 16, 512), "nvfp4_ds_mla": (256, 32, 512)}
E2M1_GRID = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float64)
NB = 3  # blocks in every test cache
T_PAD, READ_SHAPE = 128, (2, 128)


# ------------------------------------------------------------------------------- jitted helpers
_jq = jax.jit(K.quantize, static_argnames="fmt")
_jdq = jax.jit(K.dequantize, static_argnames="fmt")
_jpack = jax.jit(K.pack_pages, static_argnames="fmt")
_junpack = jax.jit(K.unpack_pages, static_argnames=("fmt", "block_size"))
_jgather_f32 = jax.jit(K.gather_f32, static_argnames=("fmt", "block_size"))


def quant(x: np.ndarray, fmt: str) -> np.ndarray:
    """bf16 [t <= 64, 512] -> records uint8 [t, R] (padded to 64 rows: one compile per fmt)."""
    pad = np.zeros((64, 512), BF16)
    pad[: len(x)] = x
    return np.asarray(_jq(jnp.asarray(pad), fmt=fmt))[: len(x)]


def dequant(rec: np.ndarray, fmt: str) -> np.ndarray:
    pad = np.zeros((64, rec.shape[-1]), np.uint8)
    pad[: len(rec)] = rec
    return as_f64(_jdq(jnp.asarray(pad), fmt=fmt))[: len(rec)]


@functools.partial(jax.jit, static_argnames=("fmt", "p"), donate_argnums=0)
def _step(cache, kv, slots, read, *, fmt, p):
    cache = K.insert(cache, kv, slots, fmt=fmt, block_size=p)
    return cache, K.gather(cache, read, fmt=fmt, block_size=p)


def step(cache: np.ndarray, kv: np.ndarray, slots, read, fmt: str, p: int):
    """insert(kv at slots) then gather(read) on a copy of `cache` (donated, checked deleted).
    Returns (new cache as numpy, float64 rows [len(read), 512])."""
    kv_pad = np.zeros((T_PAD, 512), BF16)
    kv_pad[: len(kv)] = kv
    slots_pad = np.full(T_PAD, -1, np.int32)
    slots_pad[: len(slots)] = slots
    read_pad = np.full(np.prod(READ_SHAPE), -1, np.int32)
    read_pad[: len(read)] = read
    c = jnp.array(np.array(cache, copy=True))
    args = (jnp.asarray(kv_pad), jnp.asarray(slots_pad), jnp.asarray(read_pad.reshape(READ_SHAPE)))
    new, rows = _step(c, *args, fmt=fmt, p=p)
    assert c.is_deleted()
    return np.asarray(new), as_f64(rows).reshape(-1, 512)[: len(read)]


def as_f64(x) -> np.ndarray:
    return np.asarray(x).astype(np.float64)


def zeros_cache(fmt: str, p: int) -> np.ndarray:
    return np.asarray(K.allocate(NB, p, fmt))


# ------------------------------------------------------------------------------- oracles
def rand_latent(rng: np.random.Generator, t: int) -> np.ndarray:
    """bf16 [t, 512] with per-16-dim magnitudes over 1e-9..1e6, zero tiles, tiny tiles (amax
    below the 1e-4 floor) and in-tile outliers that push the rest into e4m3's subnormal range."""
    mag = 10.0 ** rng.uniform(-9, 6, size=(t, 32, 1))
    x = rng.standard_normal((t, 32, 16)) * mag
    kind = rng.integers(0, 6, size=(t, 32))
    x[kind == 0] = 0.0
    x[kind == 1] *= 1e-7 / mag[kind == 1]
    out = kind == 2
    x[out, 0] = x[out, 0] * 1e4 + 1.0
    x = x.reshape(t, 512)
    x[:, :64][rng.random(t) < 0.2] = 0.0  # a whole fp8_ds_mla tile of zeros
    return x.astype(BF16)


def ref_fp8(x: np.ndarray, tile: int):
    """float64 [..., n] -> (e4m3 bytes [..., n], UE8M0 bytes [..., n/tile], scale float64 [..., n/tile])."""
    t = x.reshape(*x.shape[:-1], -1, tile)
    e = np.ceil(np.log2(np.maximum(np.abs(t).max(-1), 1e-4) / 448.0))
    scale = 2.0**e
    q = np.clip(t / scale[..., None], -448, 448).astype(E4M3)
    return q.view(np.uint8).reshape(x.shape), (e + 127).astype(np.uint8), scale


def ref_fp4(x: np.ndarray):
    """float64 [..., n] -> (packed e2m1 [..., n/2], e4m3 scale bytes [..., n/16], scale float64)."""
    t = x.reshape(*x.shape[:-1], -1, 16)
    s = np.clip(np.abs(t).max(-1) / 6.0, 2.0**-9, 448.0).astype(E4M3)
    s64 = s.astype(np.float64)
    codes = np.clip(t / s64[..., None], -6, 6).astype(E2M1).view(np.uint8).reshape(x.shape) & 0xF
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8), s.view(np.uint8), s64


def ref_records(rows: np.ndarray, fmt: str) -> tuple[np.ndarray, np.ndarray]:
    """bf16 [t, 512] -> (data bytes uint8 [t, D], scale bytes uint8 [t, S])."""
    x = rows.astype(np.float64)
    t = len(rows)
    if fmt == "bf16":
        raw = struct.pack(f"<{512 * t}H", *rows.view(np.uint16).ravel().tolist())
        return np.frombuffer(raw, np.uint8).reshape(t, 1024), np.zeros((t, 0), np.uint8)
    if fmt == "fp8_ds_mla":
        q, e, _ = ref_fp8(x[:, :448], 64)
        rope = struct.pack(f"<{64 * t}H", *rows[:, 448:].view(np.uint16).ravel().tolist())
        data = np.concatenate([q, np.frombuffer(rope, np.uint8).reshape(t, 128)], axis=1)
        return data, np.concatenate([e, np.zeros((t, 1), np.uint8)], axis=1)
    if fmt == "mxfp8_ds_mla":
        q, e, _ = ref_fp8(x, 32)
        return q, e
    q, s, _ = ref_fp4(x)
    return q, s


def ref_write(pages: np.ndarray, p: int, slot: int, row: np.ndarray, fmt: str) -> None:
    """Write one token's record into uint8 pages [nb, page_bytes] at `slot`, by byte offsets."""
    d, s, _ = SPEC[fmt]
    data, scales = ref_records(row[None], fmt)
    blk, off = divmod(slot, p)
    pages[blk, off * d : (off + 1) * d] = data[0]
    pages[blk, p * d + off * s : p * d + (off + 1) * s] = scales[0]


def ref_decode_page(page: np.ndarray, p: int, fmt: str) -> np.ndarray:
    """Independent decode of one page's bytes to float64 [p, 512]."""
    d, s, _ = SPEC[fmt]
    data = page[: p * d].reshape(p, d)
    sc = page[p * d : p * (d + s)].reshape(p, s)
    if fmt == "nvfp4_ds_mla":
        codes = np.stack([data & 0xF, data >> 4], axis=-1).reshape(p, 512)
        v = E2M1_GRID[codes & 7] * np.where(codes & 8, -1.0, 1.0)
        return (v.reshape(p, 32, 16) * sc.view(E4M3).astype(np.float64)[..., None]).reshape(p, 512)
    n_q, tile = (448, 64) if fmt == "fp8_ds_mla" else (512, 32)
    v = data[:, :n_q].view(E4M3).astype(np.float64).reshape(p, -1, tile)
    scale = 2.0 ** (sc[:, : n_q // tile].astype(np.float64) - 127)
    out = (v * scale[..., None]).reshape(p, n_q)
    if fmt == "fp8_ds_mla":
        assert not sc[:, 7].any(), "pad byte of the scale record must be zero"
        bits = np.frombuffer(data[:, 448:].tobytes(), "<u2").astype(np.uint32) << 16
        out = np.concatenate([out, bits.view(np.float32).reshape(p, 64)], axis=1)
    return out


def check_bounds(x: np.ndarray, d: np.ndarray, fmt: str) -> None:
    """The documented elementwise round-trip bounds; x bf16 [t, 512], d float64."""
    x64 = x.astype(np.float64)
    err, ax = np.abs(x64 - d), np.abs(x64)
    if fmt == "bf16":
        np.testing.assert_array_equal(d, x64)
        return
    if fmt in ("fp8_ds_mla", "mxfp8_ds_mla"):
        n, tile = (448, 64) if fmt == "fp8_ds_mla" else (512, 32)
        scale = np.repeat(ref_fp8(x64[:, :n], tile)[2], tile, axis=1)
        assert np.all(err[:, :n] <= np.maximum(ax[:, :n] * 2.0**-4, scale * 2.0**-10))
        np.testing.assert_array_equal(d[:, n:], x64[:, n:])  # RoPE of fp8_ds_mla: exact
        return
    s = np.repeat(ref_fp4(x64)[2], 16, axis=1)
    assert np.all(err <= np.maximum(np.maximum(ax, s) / 4, ax - 6 * s))
    amax6 = np.repeat(ax.reshape(len(x64), 32, 16).max(-1) / 6, 16, axis=1)
    normal = (amax6 >= 2.0**-6) & (amax6 <= 448)
    tame = normal | (amax6 < 2.0**-9)
    assert np.all((err <= np.maximum(ax, s) / 4)[tame])
    assert np.all((err <= np.maximum(ax / 4, amax6 * 6 * 17 / 384))[normal])


# ------------------------------------------------------------------------------- names
def test_format_names_and_the_older_keyword():
    assert K.KV_FORMATS == K.FORMATS == K.KV_CACHE_FORMATS
    assert [K.canonical_kv_format(a) for a in ("fp8", "auto", "bfloat16")] == ["fp8_ds_mla", "fp8_ds_mla", "bf16"]
    with pytest.raises(ValueError, match="kv_format must be one of"):
        K.canonical_kv_format("fp9")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        K.canonical_kv_cache_dtype("fp9")  # vLLM's name, in its own errors
    # `fmt=` (the older keyword) and `kv_format=` are the same argument
    kv = jnp.asarray(np.random.default_rng(0).standard_normal((3, 512)), jnp.bfloat16)
    slots = jnp.array([0, 5, 2], jnp.int32)
    for f in ("bf16", "fp8_ds_mla", "nvfp4_ds_mla"):
        assert K.page_bytes(kv_format=f, block_size=4) == K.page_bytes(fmt=f, block_size=4) == K.page_bytes(f, 4)
        a = K.insert(K.allocate(2, 4, kv_format=f), kv, slots, kv_format=f, block_size=4)
        b = K.insert(K.allocate(2, 4, fmt=f), kv, slots, fmt=f, block_size=4)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        np.testing.assert_array_equal(np.asarray(K.gather(a, slots, kv_format=f, block_size=4), np.float32),
                                      np.asarray(K.gather(b, slots, fmt=f, block_size=4), np.float32))


# ------------------------------------------------------------------------------- sizes
def test_record_and_page_bytes():
    assert K.FORMATS == ("bf16", "fp8_ds_mla", "mxfp8_ds_mla", "nvfp4_ds_mla")
    assert [K.record_bytes(f) for f in K.FORMATS] == [1024, 584, 528, 288]
    assert [K.page_bytes("fp8_ds_mla", p) for p in (64, 2, 61, 69, 576)] == [37440, 1728, 35712, 40320, 336384]
    for p in (1, 2, 61, 64, 69, 576):
        assert K.page_bytes("mxfp8_ds_mla", p) == -(-p * 528 // 512) * 512
        assert K.page_bytes("nvfp4_ds_mla", p) == -(-p * 288 // 512) * 512
        assert K.page_bytes("bf16", p) == p * 1024
    assert K.page_bytes("fp8", 64) == K.page_bytes("auto", 64) == 37440
    assert K.record_bytes("bfloat16") == 1024


@pytest.mark.parametrize("fmt", K.FORMATS)
def test_allocate_and_capacity(fmt):
    c = K.allocate(3, 61, fmt)
    want = (3, 61, 512) if fmt == "bf16" else (3, K.page_bytes(fmt, 61))
    assert c.shape == want and c.dtype == (jnp.bfloat16 if fmt == "bf16" else jnp.uint8)
    assert not np.asarray(c).view(np.uint8).any()
    assert K.cache_capacity(c, fmt, 61) == 183


# ------------------------------------------------------------------------------- bit-level layouts
@pytest.mark.parametrize("fmt", QUANT)
@pytest.mark.parametrize("p", [2, 61])
def test_pages_match_hand_built_bytes(fmt, p):
    rng = np.random.default_rng(p)
    written = np.concatenate([np.arange(2 * p - 1), 2 * p + rng.choice(p, size=min(p, 5), replace=False)])
    slots = rng.permutation(np.concatenate([written, [-1, -1]])).astype(np.int32)
    kv = rand_latent(rng, len(slots))
    cache, rows = step(zeros_cache(fmt, p), kv, slots, np.arange(NB * p), fmt, p)
    d, s, align = SPEC[fmt]
    pb = -(-p * (d + s) // align) * align
    want = np.zeros((NB, pb), np.uint8)
    for slot, row in zip(slots, kv):
        if slot >= 0:
            ref_write(want, p, int(slot), row, fmt)
    assert cache.shape == (NB, pb)
    np.testing.assert_array_equal(cache, want)
    assert not cache[:, p * (d + s) :].any()
    np.testing.assert_array_equal(rows, np.concatenate([ref_decode_page(pg, p, fmt) for pg in cache]))
    recs = np.asarray(_junpack(jnp.asarray(cache), fmt=fmt, block_size=p))
    for slot, row in zip(slots, kv):
        if slot >= 0:
            assert recs[slot // p, slot % p].tobytes() == b"".join(a.tobytes() for a in ref_records(row[None], fmt))
    np.testing.assert_array_equal(np.asarray(_jpack(jnp.asarray(recs), fmt=fmt)), cache)


@pytest.mark.parametrize("fmt", K.FORMATS)
def test_quantize_records_match_oracle(fmt):
    kv = rand_latent(np.random.default_rng(7), 64)
    rec = quant(kv, fmt)
    assert rec.shape == (64, K.record_bytes(fmt)) and rec.dtype == np.uint8
    np.testing.assert_array_equal(rec, np.concatenate(ref_records(kv, fmt), axis=1))


def test_fp8_ds_mla_byte_positions():
    """Token 1 of a 2-token page: NoPE at 576, RoPE little-endian at 576+448, scales at 2*576+8."""
    row = np.zeros(512, np.float32)
    row[:64] = 3.0  # amax 3 -> scale 2^-7 (3/448 in (2^-8, 2^-7]); 3 * 2^7 = 384 = e4m3 0x7C
    row[64:128] = -448.0  # scale 1, value -448 = 0xFE
    row[448] = 1.0  # bf16 0x3F80 -> bytes 80 3F
    row[449] = -2.5  # bf16 0xC020 -> bytes 20 C0
    kv = np.stack([np.zeros(512, np.float32), row]).astype(BF16)
    cache, _ = step(zeros_cache("fp8_ds_mla", 2), kv, [0, 1], [], "fp8_ds_mla", 2)
    page = cache[0]
    assert page.shape == (1728,)
    assert (page[576 : 576 + 64] == 0x7C).all() and (page[576 + 64 : 576 + 128] == 0xFE).all()
    assert list(page[576 + 448 : 576 + 452]) == [0x80, 0x3F, 0x20, 0xC0]
    assert list(page[1152 + 8 : 1152 + 16]) == [120, 127] + [105] * 5 + [0]
    assert list(page[1152 : 1152 + 8]) == [105] * 7 + [0]  # zero token: amax floor 1e-4 -> 2^-22
    assert not page[1168:].any() and not cache[1:].any()


def test_nvfp4_nibble_order_codes_and_nan():
    tile = [6, -0.5, 1, 1.5, 2, 3, 4, -6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -5]  # amax 6 -> s 1
    row = np.zeros(512, np.float32)
    row[:16] = tile
    row[16:32] = np.array(tile) * 1000  # amax 6016 -> s clamps at 448 (0x7E): saturation
    row[64:80] = 1.0
    row[70] = np.nan
    rec = quant(row[None].astype(BF16), "nvfp4_ds_mla")[0]
    assert list(rec[:8]) == [0x97, 0x32, 0x54, 0xF6, 0x20, 0x42, 0x64, 0xE6]
    assert rec[256] == 0x38 and rec[257] == 0x7E and rec[258] == 0x01  # 1.0, 448, 2^-9
    assert rec[260] == 0x7F  # a tile holding NaN gets a NaN scale
    # x/448 for 6016, -500, 1000, 1500: 13.4 -> 6 (sat), -1.116 -> -1, 2.23 -> 2, 3.35 -> 3
    assert list(rec[8:10]) == [0xA7, 0x54]
    d = dequant(rec[None], "nvfp4_ds_mla")[0]
    np.testing.assert_array_equal(d[:16], [6, -0.5, 1, 1.5, 2, 3, 4, -6, 0, 1, 1, 2, 2, 4, 4, -4])
    np.testing.assert_array_equal(d[16:20], [6 * 448, -448, 2 * 448, 3 * 448])
    assert np.isnan(d[64:80]).all() and not np.isnan(np.delete(d, np.s_[64:80])).any()


def test_nvfp4_exact_ties_non_power_of_two_scale():
    """XLA turns x / broadcast(s) and x / 6 into multiplies by reciprocals; ties must still go to even."""
    s = 15 / 512  # e4m3 0x0F (1.875 * 2^-6)
    mult = np.array([6, 1.25, -2.5, 0.75, 1.75, 3.5, 5, 0.25, -1.25, 2.5, 4, 3, 1.5, 0.5, 1, 0])
    row = np.zeros(512)
    row[:16] = mult * s
    row[16] = 6.375  # amax/6 = 1.0625, a tie -> 1.0 (0x38, even)
    row[32] = 7.125  # amax/6 = 1.1875, a tie -> 1.25 (0x3A, even)
    rec = quant(row[None].astype(BF16), "nvfp4_ds_mla")[0]
    assert list(rec[256:259]) == [0x0F, 0x38, 0x3A]
    assert list(rec[:8]) == [0x27, 0x2C, 0x64, 0x06, 0x4A, 0x56, 0x13, 0x02]
    np.testing.assert_array_equal(rec, np.concatenate(ref_records(row[None].astype(BF16), "nvfp4_ds_mla"), axis=1)[0])


def test_mxfp8_layout_and_ties():
    row = np.zeros(512, np.float32)
    row[:4] = [448, 17, 19, -0.0005]  # scale 1: 17 -> 16 (even), 19 -> 20, tiny -> -0 (0x80)
    row[480:512] = 2.0**-20  # last tile (RoPE dims): amax below the 1e-4 floor -> scale 2^-22
    rec = quant(row[None].astype(BF16), "mxfp8_ds_mla")[0]
    assert list(rec[:4]) == [0x7E, 0x58, 0x5A, 0x80]
    assert rec[512] == 127 and (rec[513:528] == 105).all()
    assert (rec[480:512] == 0x48).all()  # 2^-20 / 2^-22 = 4.0


# ------------------------------------------------------------------------------- quantization rules
@pytest.mark.parametrize("fmt,tile", [("fp8_ds_mla", 64), ("mxfp8_ds_mla", 32)])
def test_fp8_scale_rule(fmt, tile):
    n = 448 if fmt == "fp8_ds_mla" else 512
    amaxes = [448.0, 450.0, 0.0, 1e-6, 1e-4, 2.0**-10, 7 * 2.0**100, 3e38, 1.0, 896.0, 5.0, -448.0, 1e-5, 2e-4]
    rows = np.zeros((2, 512), np.float32)
    for i, a in enumerate(amaxes):
        r, c = divmod(i, n // tile)
        rows[r, c * tile : c * tile + tile] = np.linspace(-abs(a), abs(a), tile)[::-1] * (-1 if a < 0 else 1)
    rows = rows.astype(BF16)
    rec = quant(rows, fmt)
    exp_at = 576 if fmt == "fp8_ds_mla" else 512
    exps = rec[:, exp_at : exp_at + n // tile]
    amax = np.abs(rows.astype(np.float64)[:, :n]).reshape(2, -1, tile).max(-1)
    scale = 2.0 ** (exps.astype(np.float64) - 127)  # power of two by construction of UE8M0
    # the smallest power of two with amax/scale <= 448, unless the 1e-4 floor decides
    assert np.all(amax / scale <= 448)
    floor = amax <= 1e-4
    assert np.all((amax / (scale / 2) > 448)[~floor])
    assert floor.sum() >= 3 and np.all(exps[floor] == 105)  # ceil(log2(1e-4/448)) = -22
    at_max = amax == 448 * scale
    assert at_max.sum() >= 4  # the 448, 896, 7*2^100 and -448 tiles reach +-448 exactly
    first = rec[:, :n].reshape(2, -1, tile)[..., 0][at_max]  # element 0 holds the signed amax
    assert set(first.tolist()) == {0x7E, 0xFE}


def test_scale_exponents_at_exact_powers_of_two():
    """amax = 448 * 2^k gives exponent k (not k + 1); the next bf16 up gives k + 1; floor at -22."""
    ks = np.arange(-40, 120)
    base = 448 * 2.0**ks
    flat = np.concatenate([base, base * (1 + 2.0**-7)])  # 1 + 2^-7: the next bf16 after 1.75
    x = np.zeros((len(flat) // 16 + 1, 16, 32))
    x.reshape(-1, 32)[: len(flat), 5] = flat
    x = x.reshape(-1, 512).astype(BF16)
    got = quant(x, "mxfp8_ds_mla")[:, 512:].reshape(-1)[: len(flat)].astype(int)
    np.testing.assert_array_equal(got[: len(ks)], np.maximum(ks, -22) + 127)
    np.testing.assert_array_equal(got[len(ks) :], np.maximum(ks + 1, -22) + 127)


def test_nvfp4_scale_rounding_sweep():
    """amax = 6 * every positive e4m3 value and 6 * every midpoint between neighbours (exact ties),
    plus the clamps: the scale byte equals the float64 oracle's."""
    vals = np.arange(1, 127, dtype=np.uint8).view(E4M3).astype(np.float64)
    clamps = [6 * 2.0**-12, 0.0, 2816.0, 6016.0]  # below 2^-9, zero, just and far above 448
    amax = np.concatenate([6 * vals, 3 * (vals[:-1] + vals[1:]), clamps])
    assert np.all(amax.astype(BF16).astype(np.float64) == amax)  # all exact in bf16
    x = np.zeros((len(amax) // 32 + 1, 32, 16))
    x.reshape(-1, 16)[: len(amax), 3] = amax
    x = x.reshape(-1, 512).astype(BF16)
    got = np.concatenate([quant(x[i : i + 64], "nvfp4_ds_mla") for i in range(0, len(x), 64)])
    got = got[:, 256:].reshape(-1)[: len(amax)]
    np.testing.assert_array_equal(got, ref_fp4(amax[:, None] * np.eye(16)[3])[1].reshape(-1))


# ------------------------------------------------------------------------------- round-trip bounds
@pytest.mark.parametrize("fmt", K.FORMATS)
def test_round_trip_bounds(fmt):
    x = rand_latent(np.random.default_rng(11), 64)
    check_bounds(x, dequant(quant(x, fmt), fmt), fmt)


@settings(max_examples=25, deadline=None)
@given(
    fmt=st.sampled_from(K.FORMATS),
    x=hnp.arrays(np.float32, (4, 512), elements=st.floats(-(2.0**127), 2.0**127, allow_subnormal=False, width=32)),
)
def test_round_trip_bounds_hypothesis(fmt, x):
    """Arbitrary finite values (bf16 subnormals excluded: XLA on CPU flushes them)."""
    x = x.astype(BF16)
    rec = quant(x, fmt)
    np.testing.assert_array_equal(rec, np.concatenate(ref_records(x, fmt), axis=1))
    check_bounds(x, dequant(rec, fmt), fmt)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), lo=st.integers(-30, 30), span=st.integers(0, 12))
def test_round_trip_bounds_magnitudes(seed, lo, span):
    rng = np.random.default_rng(seed)
    mag = 2.0 ** rng.integers(lo, lo + span + 1, size=(8, 512))
    x = (rng.standard_normal((8, 512)) * mag).astype(BF16)
    for fmt in K.FORMATS:
        check_bounds(x, dequant(quant(x, fmt), fmt), fmt)


# ------------------------------------------------------------------------------- insert / gather
def garbage_cache(rng, p, fmt):
    if fmt == "bf16":
        bits = rng.integers(0, 2**16, size=(NB, p, 512), dtype=np.uint16)
        bits[:, :, ::7] = 0x7FC1  # NaN
        return bits.view(BF16)
    return rng.integers(0, 256, size=(NB, K.page_bytes(fmt, p)), dtype=np.uint8)


@pytest.mark.parametrize("fmt", K.FORMATS)
def test_insert_skips_invalid_slots_and_keeps_other_bytes(fmt):
    rng = np.random.default_rng(3)
    p = 61
    cap = NB * p
    before = garbage_cache(rng, p, fmt)
    slots = np.array([-1, cap, cap + 3, INT_MAX, INT_MIN, 3, 122, cap - 1, -7, 0, 60, 61], np.int32)
    kv = rand_latent(rng, len(slots))
    after, rows = step(before, kv, slots, slots, fmt, p)
    want = before.copy()
    for s, row in zip(slots, kv):
        if 0 <= s < cap:
            if fmt == "bf16":
                want[s // p, s % p] = row
            else:
                ref_write(want, p, int(s), row, fmt)
    view = np.uint16 if fmt == "bf16" else np.uint8
    np.testing.assert_array_equal(after.view(view), want.view(view))
    valid = (slots >= 0) & (slots < cap)
    np.testing.assert_array_equal(rows[~valid], 0)
    np.testing.assert_array_equal(rows[valid], dequant(quant(kv[valid], fmt), fmt))


@pytest.mark.parametrize("fmt", K.FORMATS)
def test_gather_invalid_slots_are_zero(fmt):
    p = 2
    cap = NB * p
    if fmt == "bf16":
        cache = np.full((NB, p, 512), np.nan, BF16)
    else:  # 0xFF: e4m3 NaN data, scale 2^128 / e4m3 NaN
        cache = np.full((NB, K.page_bytes(fmt, p)), 0xFF, np.uint8)
    read = [-1, INT_MIN, INT_MAX, cap, cap + 1, -cap, 0, cap - 1]
    _, rows = step(cache, np.zeros((0, 512), BF16), [], read, fmt, p)
    assert np.all(rows[:6] == 0) and not np.signbit(rows[:6]).any()
    assert np.isnan(rows[6:]).any()  # the valid slots really do read the poisoned bytes
    out32 = np.asarray(_jgather_f32(jnp.asarray(cache), jnp.array(read[:6], jnp.int32), fmt=fmt, block_size=p))
    assert out32.dtype == np.float32 and out32.shape == (6, 512) and np.all(out32 == 0)


@pytest.mark.parametrize("fmt", K.FORMATS)
@pytest.mark.parametrize("p", [2, 61, 64, 69])
def test_insert_gather_round_trip(fmt, p):
    rng = np.random.default_rng(p)
    cap = NB * p
    t = min(cap, 100)
    slots = rng.permutation(cap)[:t].astype(np.int32)  # spread over all pages
    slots[::9] = -1
    kv = rand_latent(rng, t)
    read = np.concatenate([slots, rng.integers(0, cap, 20), [-1, cap, INT_MAX]]).astype(np.int32)
    _, out = step(zeros_cache(fmt, p), kv, slots, read, fmt, p)
    expect = np.concatenate([dequant(quant(kv[i : i + 64], fmt), fmt) for i in range(0, t, 64)])
    by_slot = {int(s): expect[i] for i, s in enumerate(slots) if s >= 0}
    want = np.stack([by_slot.get(int(s), np.zeros(512)) for s in read])
    np.testing.assert_array_equal(out, want)
    if fmt == "bf16":
        np.testing.assert_array_equal(expect, kv.astype(np.float64))


@pytest.mark.parametrize("fmt", K.FORMATS)
def test_jit_donation_documented_form(fmt):
    rng = np.random.default_rng(5)
    p = 64
    ins = jax.jit(K.insert, static_argnames=("fmt", "block_size"), donate_argnums=0)
    cache = K.allocate(NB, p, fmt)
    kv = jnp.asarray(rand_latent(rng, 6))
    slots = jnp.array([0, 63, 64, 191, -1, 192], jnp.int32)
    compiled = ins.lower(cache, kv, slots, fmt=fmt, block_size=p).compile()
    # in place: the cache aliases the output and no cache-sized copy is made
    hlo = compiled.as_text()
    assert "input_output_alias" in hlo
    for m in re.finditer(r"= \w+\[([\d,]*)\]\S* copy(?:-start)?\(", hlo):
        assert np.prod([int(d) for d in m.group(1).split(",") if d]) < cache.size, m.group(0)
    new = compiled(cache, kv, slots)
    assert cache.is_deleted()
    newer = compiled(new, kv[::-1], jnp.array([1, 65, 2, 3, 4, 5], jnp.int32))
    assert new.is_deleted()
    _, out = step(np.asarray(newer), np.zeros((0, 512), BF16), [], [0, 63, 64, 191, 1, 65, 6], fmt, p)
    ref = dequant(quant(np.asarray(kv), fmt), fmt)
    np.testing.assert_array_equal(out, np.stack([ref[0], ref[1], ref[2], ref[3], ref[5], ref[4], np.zeros(512)]))


def _count_prims(jaxpr, name: str) -> int:
    n = 0
    for eqn in jaxpr.eqns:
        n += eqn.primitive.name == name
        for v in eqn.params.values():
            for sub in v if isinstance(v, (list, tuple)) else [v]:
                sub = getattr(sub, "jaxpr", sub)  # ClosedJaxpr -> Jaxpr
                if hasattr(sub, "eqns"):
                    n += _count_prims(sub, name)
    return n


@pytest.mark.parametrize("fmt", K.FORMATS)
def test_insert_is_one_scatter(fmt):
    f = functools.partial(K.insert, fmt=fmt, block_size=69)
    jpr = jax.make_jaxpr(f)(K.allocate(2, 69, fmt), jnp.zeros((5, 512), jnp.bfloat16), jnp.zeros(5, jnp.int32))
    assert _count_prims(jpr.jaxpr, "scatter") == 1


@pytest.mark.parametrize("fmt", K.FORMATS)
def test_empty_inputs_and_aliases(fmt):
    c = jax.ShapeDtypeStruct(K.allocate(1, 4, fmt).shape, K.allocate(1, 4, fmt).dtype)
    kv, sl = jax.ShapeDtypeStruct((0, 512), jnp.bfloat16), jax.ShapeDtypeStruct((0,), jnp.int32)
    alias = {"bf16": "bfloat16", "fp8_ds_mla": "fp8"}.get(fmt, fmt)
    assert jax.eval_shape(functools.partial(K.insert, fmt=alias, block_size=4), c, kv, sl).shape == c.shape
    g = jax.eval_shape(functools.partial(K.gather, fmt=fmt, block_size=4), c, jax.ShapeDtypeStruct((0, 3), jnp.int32))
    assert g.shape == (0, 3, 512) and g.dtype == jnp.bfloat16


# ------------------------------------------------------------------------------- validation
def _kv(t=3):
    return jnp.ones((t, 512), jnp.bfloat16)


_C8 = K.allocate(2, 4, "fp8_ds_mla")
_S3 = jnp.array([0, 1, 2], jnp.int32)
_ins8 = functools.partial(K.insert, fmt="fp8_ds_mla", block_size=4)
_gat_mx = functools.partial(K.gather, fmt="mxfp8_ds_mla", block_size=4)
BAD = [
    ("unknown kv_format", lambda: K.allocate(2, 4, "fp16"), ValueError, "kv_format"),
    ("kv_format not str", lambda: K.record_bytes(8), TypeError, "kv_format"),
    ("kv_format and fmt", lambda: K.record_bytes("bf16", fmt="bf16"), TypeError, "not both"),
    ("no kv_format", lambda: K.gather(_C8, _S3, block_size=4), TypeError, "kv_format"),
    ("block_size 0", lambda: K.allocate(2, 0, "bf16"), ValueError, "block_size"),
    ("block_size float", lambda: K.page_bytes("bf16", 2.5), TypeError, "block_size"),
    ("block_size bool", lambda: K.page_bytes("bf16", True), TypeError, "block_size"),
    ("num_blocks 0", lambda: K.allocate(0, 4, "bf16"), ValueError, "num_blocks"),
    ("insert block_size -1", lambda: K.insert(_C8, _kv(), _S3, fmt="fp8", block_size=-1), ValueError, "block_size"),
    ("gather block_size 0", lambda: K.gather(_C8, _S3, fmt="fp8_ds_mla", block_size=0), ValueError, "block_size"),
    ("kv f32", lambda: _ins8(_C8, _kv().astype(jnp.float32), _S3), TypeError, "kv"),
    ("kv width", lambda: _ins8(_C8, jnp.ones((3, 448), jnp.bfloat16), _S3), ValueError, "kv"),
    ("kv 1-D", lambda: _ins8(_C8, jnp.ones(512, jnp.bfloat16), _S3[:1]), ValueError, "kv"),
    ("slots float", lambda: _ins8(_C8, _kv(), _S3.astype(jnp.float32)), TypeError, "slot_mapping"),
    ("slots 2-D", lambda: _ins8(_C8, _kv(), _S3[:, None]), ValueError, "slot_mapping"),
    ("slots length", lambda: _ins8(_C8, _kv(4), _S3), ValueError, "slot_mapping"),
    ("cache dtype", lambda: _ins8(K.allocate(2, 4, "bf16"), _kv(), _S3), ValueError, "dtype"),
    ("page width", lambda: K.insert(_C8, _kv(), _S3, fmt="fp8_ds_mla", block_size=5), ValueError, "shape"),
    ("page width +1", lambda: K.gather(jnp.zeros((2, 1729), jnp.uint8), _S3, fmt="fp8", block_size=2),
     ValueError, "1728"),
    ("other fmt page", lambda: _gat_mx(K.allocate(2, 4, "nvfp4_ds_mla"), _S3), ValueError, "shape"),
    ("bf16 block", lambda: K.gather(K.allocate(2, 4, "bf16"), _S3, fmt="bf16", block_size=8), ValueError, "shape"),
    ("cache 1-D", lambda: K.cache_capacity(jnp.zeros(2304, jnp.uint8), "fp8_ds_mla", 4), ValueError, "shape"),
    ("cache no blocks", lambda: K.cache_capacity(jnp.zeros((0, 2304), jnp.uint8), "fp8", 4), ValueError, "block"),
    ("gather float slots", lambda: K.gather(_C8, jnp.zeros(2), fmt="fp8_ds_mla", block_size=4), TypeError, "slots"),
    ("quantize ints", lambda: K.quantize(jnp.ones((2, 512), jnp.int32), "mxfp8_ds_mla"), TypeError, "kv"),
    ("quantize width", lambda: K.quantize(jnp.ones((2, 500), jnp.bfloat16), "mxfp8_ds_mla"), ValueError, "kv"),
    ("records width", lambda: K.dequantize(jnp.zeros((2, 584), jnp.uint8), "mxfp8_ds_mla"), ValueError, "528"),
    ("records dtype", lambda: K.dequantize(jnp.zeros((2, 288), jnp.int8), "nvfp4_ds_mla"), ValueError, "uint8"),
    ("pack shape", lambda: K.pack_pages(jnp.zeros((2, 288), jnp.uint8), "nvfp4_ds_mla"), ValueError, "records"),
    ("under jit", lambda: jax.jit(_ins8)(_C8, _kv().astype(jnp.float32), _S3), TypeError, "bfloat16"),
]


@pytest.mark.parametrize("case", BAD, ids=[b[0] for b in BAD])
def test_bad_inputs_raise(case):
    _, fn, exc, match = case
    with pytest.raises(exc, match=match):
        fn()


def test_to_f16_saturating():
    # bf16 rows as the f16 kernels take them: rounded once to f16, +-inf and values past 65504 saturate, NaN stays
    x = jnp.asarray(np.array([1e6, -np.inf, 65519.0, 1.5, 3e-8, np.nan], np.float32)).astype(jnp.bfloat16)
    y = K.to_f16_saturating(x)
    assert y.dtype == jnp.float16
    expect = np.asarray(x, np.float32).clip(-65504, 65504).astype(np.float16)
    np.testing.assert_array_equal(np.asarray(y)[:5], expect[:5])
    assert np.asarray(y)[0] == 65504 and np.asarray(y)[1] == -65504 and np.isnan(np.asarray(y)[5])
