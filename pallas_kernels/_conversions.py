"""Element conversions inside the kernel written with Pallas operations: f32 -> tile type, the
interpreter's fp8_ds_mla dequantization and Q's bf16 -> f16 rewrite.

On the GPU the memory warpgroup converts fp8 records and Q with inline PTX (`_gather.py`); the
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

__all__ = ["to_tile", "rope_combiner", "dequant_fp8", "q_to_f16"]


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

    scale_smem: f32 [8, 64], group g's 2^(e - 127) per token (0 when masked); `vrow` bool [64, 64],
    the valid tokens (the interpreter's gather leaves masked rows stale); `combiner` the
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
