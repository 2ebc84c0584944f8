"""Element conversions inside the kernel written with Pallas operations: f32 -> tile type, the
interpreter's dequantization of the quantized records and Q's bf16 -> f16 rewrite.

On the GPU the memory warpgroup converts the records and Q with inline PTX (`_gather.py`); the
interpreter cannot run that, so it uses the functions here, which give the same values.
"""

from __future__ import annotations

import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from dsv41_jax.kv_cache import to_f16_saturating
from pallas_kernels import _gather
from pallas_kernels._spec import HALF, HB, NOPE, ROW, T

__all__ = ["to_tile", "rope_combiner", "dequant_fp8", "dequant_mxfp8", "dequant_nvfp4", "q_to_f16"]


def to_tile(y, dtype):
    """f32 values -> the tile's element type, rounded once; f16 saturates at +-65504 (NaN stays NaN)."""
    if dtype == jnp.float16:
        return to_f16_saturating(y)
    return y.astype(dtype)


def rope_combiner():
    """bf16 [128, 64]: W[2j, j] = 1, W[2j+1, j] = 256, else 0.

    For the RoPE bytes U (uint8 [64 tok, 128], as exact bf16 integers), U @ W = lo + 256 * hi,
    the bf16 bit pattern of each RoPE value, exact in the f32 accumulator (Pallas has no
    width-changing bitcast).
    """
    r = plgpu.broadcasted_iota(jnp.int32, (128, 64), 0, layout=plgpu.Layout.WGMMA)
    c = plgpu.broadcasted_iota(jnp.int32, (128, 64), 1, layout=plgpu.Layout.WGMMA)
    one = jnp.full((128, 64), 1.0, jnp.float32)
    big = jnp.full((128, 64), 256.0, jnp.float32)
    zero = jnp.zeros((128, 64), jnp.float32)
    w = jnp.where((r // 2) == c, jnp.where((r % 2) == 0, one, big), zero)
    return w.astype(jnp.bfloat16)


def dequant_fp8(w, stage_u8, scale_smem, combiner, k_smem, vrow, u_smem):
    """Interpreter: K half w <- the staged fp8_ds_mla records, dequantized; masked rows 0.

    scale_smem: f32 [SCALE_GROUPS, 64], group g's 2^(e - 127) per token (0 when masked; rows 0..6
    used); `vrow` bool [64, 64], the valid tokens (the interpreter's gather leaves masked rows stale); `combiner` the
    `rope_combiner` matrix, which turns the RoPE bytes (staged in `u_smem`, wgmma A operands come
    from SMEM in the interpreter) into their bf16 values."""
    groups = range(0, 4) if w == 0 else range(4, 7)
    for g in groups:
        scale_g = plgpu.load(scale_smem.at[g], layout=ROW)  # [64] per token
        x8 = plgpu.load(stage_u8.at[:, pl.ds(64 * g, 64)], layout=plgpu.Layout.WGMMA)
        x = lax.bitcast_convert_type(x8, jnp.float8_e4m3fn).astype(jnp.float32)
        y = x * lax.broadcast_in_dim(scale_g, (T, 64), [0])
        y = jnp.where(vrow, y, jnp.zeros((T, 64), jnp.float32))
        k_smem.at[w, :, pl.ds(64 * (g - 4 * w), 64)][...] = to_tile(y, k_smem.dtype)
    if w == 1:
        ub = plgpu.load(stage_u8.at[:, pl.ds(NOPE, 128)], layout=plgpu.Layout.WGMMA)  # RoPE bytes
        u = ub.astype(jnp.float32).astype(jnp.bfloat16)
        u_smem[...] = u
        plgpu.commit_smem()
        u = u_smem

        def comb(acc):
            plgpu.wgmma(acc, u, combiner)
            return acc[...]

        bits = pl.run_scoped(comb, plgpu.ACC((T, 64), jnp.float32))
        y = lax.bitcast_convert_type(bits.astype(jnp.int32).astype(jnp.int16), jnp.bfloat16)
        y = jnp.where(vrow, y, jnp.zeros((T, 64), jnp.bfloat16))
        k_smem.at[1, :, pl.ds(HALF - 64, 64)][...] = to_tile(y.astype(jnp.float32), k_smem.dtype)


def _cols():
    return plgpu.broadcasted_iota(jnp.int32, (T, 64), 1, layout=plgpu.Layout.WGMMA)


def _per_tile(scale_smem, first: int, width: int):
    """[64 tokens, 64 dims] factors of dims whose scale tiles are `width` wide, the first tile `first`."""
    cols = _cols()
    f = jnp.zeros((T, 64), jnp.float32)
    for t in range(64 // width):
        row = lax.broadcast_in_dim(plgpu.load(scale_smem.at[first + t], layout=ROW), (T, 64), [0])
        f = jnp.where(cols // width == t, row, f)
    return f


def dequant_mxfp8(w, stage_u8, scale_smem, k_smem, vrow):
    """Interpreter: K half w <- the staged mxfp8_ds_mla records (512 e4m3, one UE8M0 factor per 32 dims:
    scale_smem f32 [SCALE_GROUPS, 64], 0 when masked), dequantized; masked rows 0 (`vrow` bool [64, 64])."""
    for j in range(HALF // 64):
        d0 = HALF * w + 64 * j
        x8 = plgpu.load(stage_u8.at[:, pl.ds(d0, 64)], layout=plgpu.Layout.WGMMA)
        x = lax.bitcast_convert_type(x8, jnp.float8_e4m3fn).astype(jnp.float32)
        y = jnp.where(vrow, x * _per_tile(scale_smem, d0 // 32, 32), jnp.zeros((T, 64), jnp.float32))
        k_smem.at[w, :, pl.ds(64 * j, 64)][...] = to_tile(y, k_smem.dtype)


def dequant_nvfp4(w, stage_u8, scale_smem, k_smem, vrow):
    """Interpreter: K half w <- the staged nvfp4_ds_mla records (e2m1 pairs, dim 2i in byte i's low nibble;
    one e4m3 factor per 16 dims: scale_smem f32 [SCALE_GROUPS, 64], 0 when masked), dequantized; masked
    rows 0. Each code becomes the e4m3 byte (s << 7) | (e1 e0 m) << 2, its value x 2^-6, as on the GPU."""
    cols = _cols()
    for j in range(HALF // 64):
        d0 = HALF * w + 64 * j
        b = plgpu.load(stage_u8.at[:, pl.ds(d0 // 2, 32)], layout=plgpu.Layout.WGMMA).astype(jnp.int32)
        b = jnp.repeat(b, 2, axis=1)  # dims d0 + c: byte c // 2
        code = jnp.where(cols % 2 == 0, b & 15, b >> 4)
        e4 = (((code & 8) << 4) | ((code & 7) << 2)).astype(jnp.uint8)
        x = lax.bitcast_convert_type(e4, jnp.float8_e4m3fn).astype(jnp.float32) * 64.0
        y = jnp.where(vrow, x * _per_tile(scale_smem, d0 // 16, 16), jnp.zeros((T, 64), jnp.float32))
        k_smem.at[w, :, pl.ds(64 * j, 64)][...] = to_tile(y, k_smem.dtype)


def q_to_f16(q_smem, w: int, interpret: bool):
    """Q half w (q_smem [2, 64, 256]) arrived as the bits of bf16 values: rewrite it as f16 in place.

    GPU: 16-byte chunks in place (inline PTX, elementwise: the swizzle does not matter); interpreter:
    64 dims at a time through registers."""
    if interpret:
        for j in range(HALF // 64):
            qj = q_smem.at[w, :, pl.ds(64 * j, 64)]
            x = plgpu.load(qj, layout=plgpu.Layout.WGMMA)
            qj[...] = to_tile(lax.bitcast_convert_type(x, jnp.bfloat16).astype(jnp.float32), jnp.float16)
    else:
        _gather.bf16_to_f16_in_place(HB * HALF * 2)(q_smem.at[w])
