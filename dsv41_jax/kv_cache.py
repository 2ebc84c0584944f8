"""Paged KV caches of the DeepSeek-V4/V4.1 MLA latent (512 dims = 448 NoPE + 64 RoPE, one KV head).

A cache holds `num_blocks` pages of `block_size` (P) tokens; a token lives at
`slot = block * P + offset`. All byte layouts, quantizers and dequantizers live in this module so
that a layout change touches one file.

Formats (`kv_format`; the aliases "fp8"/"auto" -> "fp8_ds_mla" and "bfloat16" -> "bf16" are accepted; every
function also takes the format as `fmt=`, its older keyword):

- ``"bf16"``: `bfloat16[num_blocks, P, 512]`; records are the 1024 little-endian bf16 bytes.
- ``"fp8_ds_mla"`` (V4, 584 B/token): `uint8[num_blocks, page_bytes]`. A page is
  `[P x 576 B data][P x 8 B scales][zero pad]`: token t's data (448 e4m3 NoPE bytes, then the 64
  RoPE values as bf16, little-endian) is at byte `t*576`, its scales (7 UE8M0 bytes, one per 64
  NoPE dims, then one zero byte) at `P*576 + t*8`. Pages are padded to a multiple of 576 B:
  `page_bytes = ceil(P*584/576)*576` (P=64 -> 37440). RoPE dims are stored unquantized.
- ``"mxfp8_ds_mla"`` (V4.1, 528 B/token): all 512 dims e4m3 in 16 tiles of 32 dims, one UE8M0
  byte per tile. Upstream describes this record both per token (data then scales, token after
  token) and per page; this module uses the per-page structure of arrays, like the V4 record:
  `[P x 512 B data][P x 16 B scales][zero pad]`, padded to a multiple of 512 B.
- ``"nvfp4_ds_mla"`` (V4.1 compressed cache, 288 B/token): 32 tiles of 16 dims; per tile one e4m3
  scale `s = e4m3(clamp(amax/6, 2^-9, 448))` (no global scale); values `e2m1(x/s)`, round to
  nearest even, saturating at +-6; two per byte, dim 2i in the LOW nibble and 2i+1 in the HIGH
  nibble (code bit 3 = sign, bits 0-2 index {0, .5, 1, 1.5, 2, 3, 4, 6}). A page is
  `[P x 256 B data][P x 32 B scales][zero pad]`, padded to a multiple of 512 B.

FP8 rule (fp8_ds_mla NoPE tiles of 64, mxfp8_ds_mla tiles of 32): `amax` = max|x| over the tile in
fp32 of the bf16 input; `scale = 2^e`, `e = ceil(log2(max(amax, 1e-4) / 448))` (so e >= -22);
stored byte `clamp(e + 127, 0, 255)`; value `e4m3(clamp(x / scale, -448, 448))`, round to
nearest even. Dequantization `e4m3 * 2^(byte - 127)` is exact in bf16 (and in fp32).

Round-trip error bounds (elementwise, x the bf16 input as a real number, d = dequantize(quantize(x))):

- bf16, and the RoPE dims of fp8_ds_mla: exact, d == x.
- fp8 tiles: `|x - d| <= max(|x| * 2^-4, scale * 2^-10)`. e4m3 has 3 mantissa bits, so rounding
  in a normal binade [2^m, 2^(m+1)) (m >= -6) errs by at most 2^(m-4) <= |x/scale| * 2^-4, and the
  subnormal grid (|x/scale| < 2^-6, spacing 2^-9) errs by at most 2^-10; the rule's scale never
  lets |x/scale| exceed 448, so the clamp never adds error. Holds for finite |x| < 248 * 2^120
  (~3.3e38); the few larger bf16 values round up to 2^128 and dequantize to inf.
- nvfp4 tiles, with s the stored e4m3 scale:
  `|x - d| <= max(|x| * 2^-2, s * 2^-2, |x| - 6*s)`. The e2m1 grid has spacing 0.5 below 2,
  1 in [2, 4) and 2 in [4, 6], so RNE errs by at most max(|x/s|, 1)/4 in units of s; beyond 6
  the code saturates, erring by |x| - 6s. When amax/6 lies in e4m3's normal range [2^-6, 448],
  s is within a factor (1 +- 2^-4) of amax/6, so |x/s| <= 6.4, the saturation term is dominated
  and `|x - d| <= max(|x|, s) / 4 <= max(|x| / 4, amax * 17/384)`; when amax/6 < 2^-9, s = 2^-9
  and `|x - d| <= max(|x|, s) / 4` too. Only scales in e4m3's subnormal range or clamped at 448
  (amax > 2688) make saturation dominate. A tile holding NaN gets a NaN scale (0x7F), so the
  whole tile dequantizes to NaN. e2m1 * e4m3 is exact in bf16.

Non-finite inputs to the fp8 formats give unspecified (but in-bounds) records. bf16 subnormal
inputs (|x| < 2^-126) may be flushed to zero by XLA before quantization; the bounds still hold.

Implementation notes: XLA rewrites divisions by constants and by broadcast operands into
multiplications by a reciprocal, which misrounds exact ties (x = 1.25 * s becomes 1.2500001), so
the quantizers divide nowhere: fp8 exponents come from fp32 bits, e2m1 codes from comparing |x|
with exact multiples of s, the nvfp4 scale from a multiply shown exact in `_fp4_scale_code`.
XLA:CPU's vectorized max reduction may drop NaNs, so NaN tiles are detected explicitly.

Writes (`insert`) are one scatter into the (donatable) cache: slots < 0 or >= capacity are
dropped, never written. If one call holds the same valid slot more than once, that slot's
content afterwards is unspecified (it may even mix the bytes of several of the records).
Reads (`gather`) clamp indices before reading and then select 0 for invalid slots, so
garbage or NaN in unused pages never reaches the result.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "KV_FORMATS",
    "V41_FORMATS",
    "KV_FORMAT_ALIASES",
    "canonical_kv_format",
    "FORMATS",
    "KV_CACHE_FORMATS",
    "canonical_kv_cache_dtype",
    "LATENT_DIM",
    "NOPE_DIM",
    "ROPE_DIM",
    "RecordLayout",
    "layout",
    "record_bytes",
    "page_bytes",
    "allocate",
    "cache_capacity",
    "quantize",
    "dequantize",
    "ue8m0_exponent",
    "pack_pages",
    "unpack_pages",
    "insert",
    "gather",
    "gather_f32",
    "F16_MAX",
    "to_f16_saturating",
    "f16_rows_pay",
]

LATENT_DIM = 512  # the MLA latent: K = V, one KV head; every op, cache and kernel of the library has this width
KV_FORMATS = ("bf16", "fp8_ds_mla", "mxfp8_ds_mla", "nvfp4_ds_mla")
V41_FORMATS = ("mxfp8_ds_mla", "nvfp4_ds_mla")  # DeepSeek-V4.1's records (the others are V4's)
# vLLM's cache dtype names: "auto" is the model's native record, the V4 584-byte one, for every backend
KV_FORMAT_ALIASES = types.MappingProxyType({"fp8": "fp8_ds_mla", "auto": "fp8_ds_mla", "bfloat16": "bf16"})
FORMATS = KV_FORMATS  # older name
KV_CACHE_FORMATS = KV_FORMATS  # the name `dsv41_jax.backends` exported
NOPE_DIM = 448
ROPE_DIM = 64

_E4M3_MAX = 448.0
F16_MAX = 65504.0


def canonical_kv_format(name: Any, *, arg: str = "kv_format") -> str:
    """Resolve the aliases ("fp8", "auto", "bfloat16") to one of `KV_FORMATS`; errors name `arg`."""
    if not isinstance(name, str):
        raise TypeError(f"{arg} must be a str, got {type(name).__name__} {name!r}")
    kv_format = KV_FORMAT_ALIASES.get(name, name)
    if kv_format not in KV_FORMATS:
        raise ValueError(f"{arg} must be one of {list(KV_FORMATS) + sorted(KV_FORMAT_ALIASES)}, got {name!r}")
    return kv_format


def canonical_kv_cache_dtype(name: Any) -> str:
    """`canonical_kv_format` under vLLM's name of the concept (`kv_cache_dtype`), which its errors use."""
    return canonical_kv_format(name, arg="kv_cache_dtype")


def to_f16_saturating(x: Any) -> jax.Array:
    """Values -> f16 as the kernels that compute in f16 take their operands: rounded once (from f32, so bf16
    inputs are exact until then), saturated to +-65504 (infinities included), NaN kept. The rule of the pallas
    f16 tiles and of the f16 kv rows both prefills convert (pallas_kernels, cuda_ffi)."""
    y = jnp.asarray(x).astype(jnp.float32)
    return jnp.minimum(jnp.maximum(y, -F16_MAX), F16_MAX).astype(jnp.float16)


def f16_rows_pay(s_kv: int, s_q: int, topk: int, heads: int) -> bool:
    """Whether a prefill should convert its bf16 kv rows to f16 once (`to_f16_saturating`: one read + write of
    2 KiB per row, ~0.6 ns per row on an H200) for a kernel that then runs on f16 rows: when the rows are
    re-read often enough, s_kv <= s_q * topk * heads / LATENT_DIM. Measured savings on the H200 (s_q 4096, h 128,
    topk 2048): pallas one P V wgmma instead of two, 1.76 of 6.87 ms; cuda the seesaw CTA, 5.69 -> 3.58 ms
    (benchmarks/RESULTS.md)."""
    return s_kv * LATENT_DIM <= s_q * topk * heads
_AMAX_FLOOR = 1e-4
_FP8_NOPE_TILE = 64  # fp8_ds_mla
_MXFP8_TILE = 32
_FP4_TILE = 16
_FP4_MAX = 6.0
_FP4_SCALE_MIN = 2.0**-9  # smallest positive e4m3 (subnormal)
# e2m1 code -> value; bit 3 is the sign.
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_TABLE = np.array(_E2M1_VALUES + tuple(-v for v in _E2M1_VALUES), np.float32)
# RNE decision points on |x/s|: ties at 0.25, 1.25, 2.5 and 5 go down to the even code,
# ties at 0.75, 1.75 and 3.5 go up (codes 1, 3 and 5 are odd).
_E2M1_UP_STRICT = (0.25, 1.25, 2.5, 5.0)
_E2M1_UP_TIES = (0.75, 1.75, 3.5)


@dataclasses.dataclass(frozen=True)
class RecordLayout:
    """Per-token byte counts of a format and the page alignment.

    A quantized page of P tokens is `[P x data_bytes][P x scale_bytes]` padded with zeros to a
    multiple of `page_align`; a record (`quantize` output) is the token's data then its scales.
    For "bf16" the record is the 1024 bf16 bytes (`scale_bytes == 0`).
    """

    data_bytes: int
    scale_bytes: int
    page_align: int

    @property
    def record_bytes(self) -> int:
        return self.data_bytes + self.scale_bytes


_LAYOUTS = {
    "bf16": RecordLayout(2 * LATENT_DIM, 0, 1),
    "fp8_ds_mla": RecordLayout(NOPE_DIM + 2 * ROPE_DIM, NOPE_DIM // _FP8_NOPE_TILE + 1, 576),
    "mxfp8_ds_mla": RecordLayout(LATENT_DIM, LATENT_DIM // _MXFP8_TILE, 512),
    "nvfp4_ds_mla": RecordLayout(LATENT_DIM // 2, LATENT_DIM // _FP4_TILE, 512),
}


# ------------------------------------------------------------------------------- checks
def _kv_format(kv_format: Any, fmt: Any = None) -> str:
    """Canonical format name of `kv_format`, or of `fmt`, its older keyword (one of them); errors name
    `kv_format`, the accepted names and the value."""
    if fmt is not None:
        if kv_format is not None:
            raise TypeError(f"give kv_format or fmt (its older name), not both: got {kv_format!r} and {fmt!r}")
        kv_format = fmt
    return canonical_kv_format(kv_format)


def _check_pos_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be a positive int, got {type(value).__name__} {value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value}")
    return int(value)


def _check_cache(cache: Any, kv_format: str, block_size: int) -> jax.Array:
    """Validate a cache against `kv_format`/`block_size`; returns it as a jax array."""
    cache = jnp.asarray(cache)
    if kv_format == "bf16":
        want_dtype, want_shape = jnp.bfloat16, f"[num_blocks, {block_size}, {LATENT_DIM}]"
        ok_shape = cache.ndim == 3 and cache.shape[1:] == (block_size, LATENT_DIM)
    else:
        pb = page_bytes(kv_format, block_size)
        want_dtype, want_shape = jnp.uint8, f"[num_blocks, {pb}]"
        ok_shape = cache.ndim == 2 and cache.shape[1] == pb
    if cache.dtype != want_dtype:
        raise ValueError(
            f"cache for kv_format={kv_format!r} must have dtype {jnp.dtype(want_dtype).name}, got {cache.dtype}"
        )
    if not ok_shape:
        raise ValueError(
            f"cache for kv_format={kv_format!r}, block_size={block_size} must have shape {want_shape}, "
            f"got {list(cache.shape)}"
        )
    if cache.shape[0] < 1:
        raise ValueError(f"cache must hold at least one block, got shape {list(cache.shape)}")
    return cache


def _check_int_array(name: str, x: Any) -> jax.Array:
    """Integer array as int32 (int64 if it is 64-bit): narrow types such as uint8 could not hold
    the out-of-range block index used to drop a write, and unsigned values that wrap to negative
    are beyond any capacity anyway."""
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name} must have an integer dtype, got {x.dtype}")
    return x.astype(jnp.int64 if x.dtype.itemsize == 8 else jnp.int32)


def _check_latent(name: str, x: Any) -> jax.Array:
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{name} must be a floating array (bf16), got {x.dtype}")
    if x.ndim < 1 or x.shape[-1] != LATENT_DIM:
        raise ValueError(f"{name} must have shape [..., {LATENT_DIM}], got {list(x.shape)}")
    return x


# ------------------------------------------------------------------------------- sizes
def layout(kv_format: str | None = None, *, fmt: str | None = None) -> RecordLayout:
    """The `RecordLayout` of `kv_format` (aliases accepted)."""
    return _LAYOUTS[_kv_format(kv_format, fmt)]


def record_bytes(kv_format: str | None = None, *, fmt: str | None = None) -> int:
    """Bytes per token: 1024 (bf16), 584 (fp8_ds_mla), 528 (mxfp8_ds_mla), 288 (nvfp4_ds_mla)."""
    return layout(kv_format, fmt=fmt).record_bytes


def page_bytes(kv_format: str | None = None, block_size: int | None = None, *, fmt: str | None = None) -> int:
    """Bytes of one page of `block_size` tokens, alignment padding included."""
    lay = layout(kv_format, fmt=fmt)
    block_size = _check_pos_int("block_size", block_size)
    return -(-block_size * lay.record_bytes // lay.page_align) * lay.page_align


def allocate(num_blocks: int, block_size: int, kv_format: str | None = None, *,
             fmt: str | None = None) -> jax.Array:
    """Zero-filled cache: `uint8[num_blocks, page_bytes]`, or `bf16[num_blocks, block_size, 512]`."""
    kv_format = _kv_format(kv_format, fmt)
    num_blocks = _check_pos_int("num_blocks", num_blocks)
    block_size = _check_pos_int("block_size", block_size)
    if kv_format == "bf16":
        return jnp.zeros((num_blocks, block_size, LATENT_DIM), jnp.bfloat16)
    return jnp.zeros((num_blocks, page_bytes(kv_format, block_size)), jnp.uint8)


def cache_capacity(cache: Any, kv_format: str | None = None, block_size: int | None = None, *,
                   fmt: str | None = None) -> int:
    """Number of token slots of a (validated) cache: `num_blocks * block_size`."""
    kv_format = _kv_format(kv_format, fmt)
    block_size = _check_pos_int("block_size", block_size)
    return _check_cache(cache, kv_format, block_size).shape[0] * block_size


# ------------------------------------------------------------------------------- scalar codecs
def _ue8m0_value(byte: jax.Array) -> jax.Array:
    """fp32 2^(byte - 127) for UE8M0 bytes: built from exponent bits (cheaper to compile than
    ldexp); byte 0 gives the subnormal 2^-127 and 255 gives inf."""
    b = byte.astype(jnp.uint32)
    normal = jax.lax.bitcast_convert_type(jnp.clip(b, 1, 254) << 23, jnp.float32)
    return jnp.where(b == 0, np.float32(2.0**-127), jnp.where(b == 255, np.float32(np.inf), normal))


def ue8m0_exponent(amax: jax.Array) -> jax.Array:
    """int32 e = ceil(log2(max(amax, 1e-4) / 448)) of finite amax >= 0, from its bits, without dividing (see the
    module notes): with m = max(amax, 1e-4) = 1.f * 2^E (normal) and 448 = 1.75 * 2^8, e = E - 8 + (1.f > 1.75).
    The caches' and the mega output's scale rule (the pallas kernel evaluates it in its epilogue)."""
    bits = jax.lax.bitcast_convert_type(jnp.maximum(amax, _AMAX_FLOOR), jnp.int32)
    return ((bits >> 23) & 0xFF) - 127 - 8 + jnp.where((bits & 0x7FFFFF) > 0x600000, 1, 0)


def _fp8_quantize_tiles(x: jax.Array, tile: int) -> tuple[jax.Array, jax.Array]:
    """fp32 [..., n] -> (e4m3 bytes uint8 [..., n], UE8M0 bytes uint8 [..., n // tile])."""
    t = x.reshape(*x.shape[:-1], x.shape[-1] // tile, tile)
    amax = jnp.max(jnp.abs(t), axis=-1)
    byte = jnp.clip(ue8m0_exponent(amax) + 127, 0, 255)
    inv_scale = _ue8m0_value(254 - byte)  # 2^-e, exact for the bytes 105..247 reachable here
    y = jnp.clip(t * inv_scale[..., None], -_E4M3_MAX, _E4M3_MAX)
    q = jax.lax.bitcast_convert_type(y.astype(jnp.float8_e4m3fn), jnp.uint8)
    return q.reshape(x.shape), byte.astype(jnp.uint8)


def _fp8_dequantize_tiles(q: jax.Array, byte: jax.Array, tile: int) -> jax.Array:
    """(uint8 [..., n], uint8 [..., n // tile]) -> fp32 [..., n]."""
    v = jax.lax.bitcast_convert_type(q, jnp.float8_e4m3fn).astype(jnp.float32)
    v = v.reshape(*v.shape[:-1], v.shape[-1] // tile, tile)
    scale = _ue8m0_value(byte)
    return (v * scale[..., None]).reshape(q.shape)


def _fp4_quantize_tiles(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """fp32 [..., n] -> (packed e2m1 uint8 [..., n // 2], e4m3 scale bytes uint8 [..., n // 16])."""
    t = x.reshape(*x.shape[:-1], x.shape[-1] // _FP4_TILE, _FP4_TILE)
    # NaN is detected explicitly: XLA:CPU's vectorized max reduction can drop NaNs.
    amax = jnp.where(jnp.isnan(t).any(axis=-1), jnp.nan, jnp.max(jnp.abs(t), axis=-1))
    scale_code = _fp4_scale_code(amax)
    s = _e4m3_value(scale_code)[..., None]
    # RNE of |x|/s against the e2m1 decision points, compared as |x| vs c*s (exact in fp32:
    # at most 3 + 4 significant bits) instead of dividing. A NaN scale fails every compare.
    a = jnp.abs(t)
    code = sum((a > c * s).astype(jnp.uint8) for c in _E2M1_UP_STRICT)
    code = code + sum((a >= c * s).astype(jnp.uint8) for c in _E2M1_UP_TIES)
    code = code | (jnp.signbit(t).astype(jnp.uint8) << 3)
    code = code.reshape(x.shape)
    packed = code[..., 0::2] | (code[..., 1::2] << 4)
    return packed, scale_code


def _e4m3_value(code: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(code.astype(jnp.uint8), jnp.float8_e4m3fn).astype(jnp.float32)


def _fp4_scale_code(amax: jax.Array) -> jax.Array:
    """e4m3 bits of clamp(amax / 6, 2^-9, 448), rounded to nearest even; NaN -> 0x7F.

    amax is a bf16 value (8 significant bits), which makes `amax * fl(1/6)` safe although it is
    not the division (XLA would emit the same multiply for `amax / 6`): the product errs by
    under 2^-23 relative, e4m3 midpoints m have at most 5 significant bits, so amax = 6m exactly
    gives exactly m (then the cast breaks the tie to even), and amax != 6m keeps amax/6 about
    2^-9 relative away from any midpoint.
    """
    approx = jnp.clip(amax * (1.0 / _FP4_MAX), _FP4_SCALE_MIN, _E4M3_MAX)
    code = jax.lax.bitcast_convert_type(approx.astype(jnp.float8_e4m3fn), jnp.uint8)
    return jnp.where(jnp.isnan(amax), np.uint8(0x7F), code)


def _fp4_dequantize_tiles(packed: jax.Array, scale_bytes: jax.Array) -> jax.Array:
    """(uint8 [..., n // 2], uint8 [..., n // 16]) -> fp32 [..., n]."""
    codes = jnp.stack([packed & 0xF, packed >> 4], axis=-1)
    v = jnp.asarray(_E2M1_TABLE)[codes.astype(jnp.int32)]
    v = v.reshape(*packed.shape[:-1], 2 * packed.shape[-1] // _FP4_TILE, _FP4_TILE)
    return (v * _e4m3_value(scale_bytes)[..., None]).reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def _bf16_to_bytes(x: jax.Array) -> jax.Array:
    """bf16 [..., n] -> uint8 [..., 2n], little-endian regardless of the host."""
    u = jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16)
    lo, hi = (u & 0xFF).astype(jnp.uint8), (u >> 8).astype(jnp.uint8)
    return jnp.stack([lo, hi], axis=-1).reshape(*x.shape[:-1], 2 * x.shape[-1])


def _bytes_to_bf16(b: jax.Array) -> jax.Array:
    """uint8 [..., 2n] little-endian -> bf16 [..., n]."""
    b = b.reshape(*b.shape[:-1], b.shape[-1] // 2, 2).astype(jnp.uint16)
    return jax.lax.bitcast_convert_type(b[..., 0] | (b[..., 1] << 8), jnp.bfloat16)


# ------------------------------------------------------------------------------- records
def quantize(kv: Any, kv_format: str | None = None, *, fmt: str | None = None) -> jax.Array:
    """Quantize latents into per-token records.

    kv: floating `[..., 512]`, rounded to bf16 first (the formats are defined on bf16 input).
    Returns uint8 `[..., record_bytes(kv_format)]`: the token's data bytes then its scale bytes
    (fp8_ds_mla: 448 e4m3 + 128 RoPE bf16 bytes + 7 UE8M0 + 1 zero; mxfp8_ds_mla: 512 e4m3 + 16
    UE8M0; nvfp4_ds_mla: 256 packed e2m1 + 32 e4m3 scales; bf16: 1024 little-endian bytes).
    """
    kv_format = _kv_format(kv_format, fmt)
    kv = _check_latent("kv", kv).astype(jnp.bfloat16)
    x = kv.astype(jnp.float32)
    if kv_format == "bf16":
        return _bf16_to_bytes(kv)
    if kv_format == "fp8_ds_mla":
        q, e = _fp8_quantize_tiles(x[..., :NOPE_DIM], _FP8_NOPE_TILE)
        pad = jnp.zeros((*kv.shape[:-1], 1), jnp.uint8)
        return jnp.concatenate([q, _bf16_to_bytes(kv[..., NOPE_DIM:]), e, pad], axis=-1)
    if kv_format == "mxfp8_ds_mla":
        q, e = _fp8_quantize_tiles(x, _MXFP8_TILE)
        return jnp.concatenate([q, e], axis=-1)
    q, s = _fp4_quantize_tiles(x)
    return jnp.concatenate([q, s], axis=-1)


def _dequantize_f32(records: Any, kv_format: str) -> jax.Array:
    kv_format = _kv_format(kv_format)
    records = jnp.asarray(records)
    rb = record_bytes(kv_format)
    if records.dtype != jnp.uint8 or records.ndim < 1 or records.shape[-1] != rb:
        raise ValueError(
            f"records for kv_format={kv_format!r} must be uint8 [..., {rb}], "
            f"got {records.dtype} {list(records.shape)}"
        )
    if kv_format == "bf16":
        return _bytes_to_bf16(records).astype(jnp.float32)
    d = layout(kv_format).data_bytes
    if kv_format == "fp8_ds_mla":
        n_tiles = NOPE_DIM // _FP8_NOPE_TILE
        nope = _fp8_dequantize_tiles(records[..., :NOPE_DIM], records[..., d : d + n_tiles], _FP8_NOPE_TILE)
        rope = _bytes_to_bf16(records[..., NOPE_DIM:d]).astype(jnp.float32)
        return jnp.concatenate([nope, rope], axis=-1)
    if kv_format == "mxfp8_ds_mla":
        return _fp8_dequantize_tiles(records[..., :d], records[..., d:], _MXFP8_TILE)
    return _fp4_dequantize_tiles(records[..., :d], records[..., d:])


def dequantize(records: Any, kv_format: str | None = None, *, fmt: str | None = None) -> jax.Array:
    """uint8 records `[..., record_bytes(kv_format)]` -> bf16 `[..., 512]` (exact: no rounding happens)."""
    return _dequantize_f32(records, _kv_format(kv_format, fmt)).astype(jnp.bfloat16)


# ------------------------------------------------------------------------------- pages
def pack_pages(records: Any, kv_format: str | None = None, *, fmt: str | None = None) -> jax.Array:
    """Per-token records uint8 `[num_blocks, P, R]` -> the cache array of those pages.

    Quantized formats give uint8 `[num_blocks, page_bytes(kv_format, P)]` (data rows, scale rows, zero
    pad); "bf16" gives bf16 `[num_blocks, P, 512]`.
    """
    kv_format = _kv_format(kv_format, fmt)
    records = jnp.asarray(records)
    if records.ndim != 3 or records.dtype != jnp.uint8 or records.shape[-1] != record_bytes(kv_format):
        raise ValueError(
            f"records must be uint8 [num_blocks, P, {record_bytes(kv_format)}], "
            f"got {records.dtype} {list(records.shape)}"
        )
    if kv_format == "bf16":
        return _bytes_to_bf16(records)
    lay = layout(kv_format)
    nb, p, _ = records.shape
    data = records[..., : lay.data_bytes].reshape(nb, p * lay.data_bytes)
    scales = records[..., lay.data_bytes :].reshape(nb, p * lay.scale_bytes)
    pad = jnp.zeros((nb, page_bytes(kv_format, p) - p * lay.record_bytes), jnp.uint8)
    return jnp.concatenate([data, scales, pad], axis=1)


def unpack_pages(cache: Any, kv_format: str | None = None, block_size: int | None = None, *,
                 fmt: str | None = None) -> jax.Array:
    """Inverse of `pack_pages`: cache -> per-token records uint8 `[num_blocks, P, R]`."""
    kv_format = _kv_format(kv_format, fmt)
    block_size = _check_pos_int("block_size", block_size)
    cache = _check_cache(cache, kv_format, block_size)
    if kv_format == "bf16":
        return _bf16_to_bytes(cache)
    lay = layout(kv_format)
    nb, p = cache.shape[0], block_size
    data = cache[:, : p * lay.data_bytes].reshape(nb, p, lay.data_bytes)
    scales = cache[:, p * lay.data_bytes : p * lay.record_bytes].reshape(nb, p, lay.scale_bytes)
    return jnp.concatenate([data, scales], axis=-1)


def _unit_rows(offset: jax.Array, kv_format: str, block_size: int) -> jax.Array:
    """Rows of a token's record when a page is viewed as `[page_bytes // S, S]`, S = scale_bytes.

    Every quantized layout has data_bytes % S == 0 and page_bytes % S == 0, so a record is
    data_bytes // S whole rows at `offset * (data_bytes // S)` plus one scale row at
    `P * (data_bytes // S) + offset`; one scatter/gather of S-byte rows then moves whole records.
    offset: int `[...]` in [0, P). Returns `[..., data_bytes // S + 1]` of offset's dtype.
    """
    lay = layout(kv_format)
    k = lay.data_bytes // lay.scale_bytes
    data_rows = offset[..., None] * k + jnp.arange(k, dtype=offset.dtype)
    scale_row = block_size * k + offset[..., None]
    return jnp.concatenate([data_rows, scale_row], axis=-1)


def _split_slots(slots: jax.Array, num_blocks: int, block_size: int):
    """(valid, block, offset) for int slots; block/offset are garbage where not valid."""
    block = slots // block_size  # no multiplication anywhere, so INT_MIN/INT_MAX cannot overflow
    valid = (slots >= 0) & (block < num_blocks)
    return valid, block, slots % block_size


# ------------------------------------------------------------------------------- insert / gather
def insert(cache: Any, kv: Any, slot_mapping: Any, *, kv_format: str | None = None, block_size: int,
           fmt: str | None = None) -> jax.Array:
    """Return `cache` with `kv[t]` quantized and written at slot `slot_mapping[t]`.

    cache: the layout of `allocate(num_blocks, block_size, kv_format)`. kv: bf16 `[T, 512]`.
    slot_mapping: integer `[T]`, slot = block * block_size + offset; slots < 0 or
    >= num_blocks * block_size are skipped. Duplicate valid slots leave that slot unspecified.
    A single scatter with mode="drop", so under `jax.jit(insert, static_argnames=("kv_format",
    "block_size"), donate_argnums=0)` the cache is updated in place.
    """
    kv_format = _kv_format(kv_format, fmt)
    block_size = _check_pos_int("block_size", block_size)
    cache = _check_cache(cache, kv_format, block_size)
    kv = jnp.asarray(kv)
    if kv.dtype != jnp.bfloat16:
        raise TypeError(f"kv must have dtype bfloat16, got {kv.dtype}")
    if kv.ndim != 2 or kv.shape[1] != LATENT_DIM:
        raise ValueError(f"kv must have shape [T, {LATENT_DIM}], got {list(kv.shape)}")
    slot_mapping = _check_int_array("slot_mapping", slot_mapping)
    if slot_mapping.shape != (kv.shape[0],):
        raise ValueError(
            f"slot_mapping must have shape [T] = [{kv.shape[0]}] (T from kv), got {list(slot_mapping.shape)}"
        )
    nb = cache.shape[0]
    valid, block, offset = _split_slots(slot_mapping, nb, block_size)
    # An out-of-range block (never a negative one: .at[] wraps negatives) is dropped by the scatter.
    block = jnp.where(valid, block, nb)
    if kv_format == "bf16":
        return cache.at[block, offset].set(kv, mode="drop")
    lay = layout(kv_format)
    s = lay.scale_bytes
    rows = _unit_rows(offset, kv_format, block_size)
    updates = quantize(kv, kv_format).reshape(kv.shape[0], rows.shape[-1], s)
    pages = cache.reshape(nb, cache.shape[1] // s, s)
    pages = pages.at[block[:, None], rows].set(updates, mode="drop")
    return pages.reshape(cache.shape)


def _gather(cache: Any, slots: Any, kv_format: str, block_size: int) -> jax.Array:
    kv_format = _kv_format(kv_format)
    block_size = _check_pos_int("block_size", block_size)
    cache = _check_cache(cache, kv_format, block_size)
    slots = _check_int_array("slots", slots)
    nb = cache.shape[0]
    valid, block, offset = _split_slots(slots, nb, block_size)
    block = jnp.where(valid, block, 0)
    offset = jnp.where(valid, offset, 0)
    if kv_format == "bf16":
        x = cache.at[block, offset].get(mode="promise_in_bounds").astype(jnp.float32)
    else:
        s = layout(kv_format).scale_bytes
        pages = cache.reshape(nb, cache.shape[1] // s, s)
        rows = pages.at[block[..., None], _unit_rows(offset, kv_format, block_size)].get(
            mode="promise_in_bounds"
        )
        x = _dequantize_f32(rows.reshape(*slots.shape, record_bytes(kv_format)), kv_format)
    # A select, not a multiply: garbage/NaN read from an unused slot must not leak (0*NaN).
    return jnp.where(valid[..., None], x, 0.0)


def gather(cache: Any, slots: Any, *, kv_format: str | None = None, block_size: int,
           fmt: str | None = None) -> jax.Array:
    """Dequantized rows bf16 `[..., 512]` for integer `slots [...]`; invalid slots (< 0 or
    >= capacity) give exactly 0 whatever the cache holds there."""
    return _gather(cache, slots, _kv_format(kv_format, fmt), block_size).astype(jnp.bfloat16)


def gather_f32(cache: Any, slots: Any, *, kv_format: str | None = None, block_size: int,
               fmt: str | None = None) -> jax.Array:
    """As `gather`, in float32 (the same values: dequantization is exact in bf16)."""
    return _gather(cache, slots, _kv_format(kv_format, fmt), block_size)
