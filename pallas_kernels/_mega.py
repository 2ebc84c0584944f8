"""The mega ops' stages inside the kernel (`KernelSpec.mega`): Q's RoPE, the output's inverse RoPE and its
e4m3 quantisation with UE8M0 exponents per 32 dims.

The RoPE is GPT-J's (pairs (2i, 2i + 1) of the last 64 dims, `dsv41_jax.rope`), and a CTA is one row, i.e.
one position: the XLA side gives each row's cos / sin as two per-dim vectors, `rope_rows`, so a rotation is
`x * cos + swap(x) * sin` with `swap` exchanging each pair's two values. In the wgmma register layout a
pair is one thread's two-element register vector, so on the GPU the swap is a register shuffle
(`plgpu.inline_mgpu`); the interpreter swaps with a reshape. Warpgroup 1 owns dims 448..511 (the last 64
of its half): it ropes Q's in SMEM before its first wgmma and inverse-ropes O's in the epilogue. The
exponent rule is the caches' (`kv_cache.ue8m0_exponent`, the reference's `ceil(log2(max(amax, 1e-4) / 448))`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
from jax import lax

from dsv41_jax import kv_cache as kvc
from pallas_kernels._spec import COL, HALF, HB, OUT_GROUP, OUT_WORD, ROPE_DIM

if TYPE_CHECKING:
    from pallas_kernels._kernel import Program

__all__ = ["rope_rows", "swap_pairs", "rope_q", "store_mega_out"]

WGMMA = plgpu.Layout.WGMMA


def rope_rows(positions, cos_sin_cache):
    """f32 [R, 2, 64] per row: cos per dim (cos_i at dims 2i, 2i + 1) and the rotation's signed sin per dim
    (-sin_i at 2i, +sin_i at 2i + 1); positions clamped into the table as the reference clamps them."""
    pos = jnp.clip(positions.astype(jnp.int32), 0, cos_sin_cache.shape[0] - 1)
    cs = cos_sin_cache[pos].astype(jnp.float32)
    cos, sin = cs[:, : ROPE_DIM // 2], cs[:, ROPE_DIM // 2:]
    cosd = jnp.repeat(cos, 2, axis=1)
    sind = jnp.stack([-sin, sin], axis=-1).reshape(pos.shape[0], ROPE_DIM)
    return jnp.stack([cosd, sind], axis=1)


def swap_pairs(x, interpret: bool):
    """x f32 [64, n] (n even) in the wgmma layout with each pair's two values exchanged."""
    rows, n = x.shape
    if interpret:
        return x.reshape(rows, n // 2, 2)[..., ::-1].reshape(rows, n)
    from jax._src.lib.mlir.dialects import vector
    from jax.experimental.mosaic.gpu import fragmented_array as fa

    @plgpu.inline_mgpu(arg_types=(WGMMA,), return_type=plgpu.ShapeDtypeStruct((rows, n), jnp.float32, WGMMA))
    def swap(ctx, a):
        del ctx
        regs = np.empty_like(a.registers)
        for i, r in np.ndenumerate(a.registers):
            if r.type.shape != [2]:  # the layout's register vector must be a pair (dims 2i, 2i + 1)
                raise NotImplementedError(f"wgmma register vector {r.type}, not a pair")
            regs[i] = vector.shuffle(r, r, [1, 0])
        return fa.FragmentedArray(_registers=regs, _layout=a.layout, _is_signed=None)

    return swap(x)


def _rotate(prog: Program, x, sign: float):
    """x f32 [64 heads, 64 dims] rotated by the row's angle (sign 1) or back (sign -1)."""
    cosd = lax.broadcast_in_dim(plgpu.load(prog.s.cs.at[0], layout=COL), (HB, ROPE_DIM), [1])
    sind = lax.broadcast_in_dim(plgpu.load(prog.s.cs.at[1], layout=COL), (HB, ROPE_DIM), [1])
    xs = swap_pairs(x, prog.spec.interpret)
    return x * cosd + xs * sind if sign > 0 else x * cosd - xs * sind


def rope_q(prog: Program):
    """Warpgroup 1: Q's dims 448..511 (its half's last 64; bf16 bits, whatever the tile's type) roped in SMEM,
    in f32 and rounded to bf16 as the reference ropes q."""
    qr = prog.s.q.at[1, :, pl.ds(HALF - ROPE_DIM, ROPE_DIM)]
    bits = plgpu.load(qr, layout=WGMMA)
    x = lax.bitcast_convert_type(bits, jnp.bfloat16).astype(jnp.float32)
    qr[...] = lax.bitcast_convert_type(_rotate(prog, x, 1.0).astype(jnp.bfloat16), qr.dtype)


def store_mega_out(prog: Program, w, res):
    """Warpgroup w's half of the final O (f32 [64, 256], normalized): inverse RoPE (warpgroup 1), then per
    32 dims the exponent and the e4m3 values x 2^-e. The values are staged in SMEM (`Scratch.out_stage`, one
    swizzled tile column per group) and stored with one bulk copy; the exponents go out as uint32 words of four
    bytes, two per row."""
    row, h0 = prog.row, prog.h0
    tail = res[:, HALF - ROPE_DIM:]
    tail = jnp.where(w == 1, _rotate(prog, tail, -1.0), tail)  # w traced: warpgroup 1 holds the RoPE dims
    pieces = [res[:, g * OUT_GROUP:(g + 1) * OUT_GROUP] for g in range((HALF - ROPE_DIM) // OUT_GROUP)]
    pieces += [tail[:, g * OUT_GROUP:(g + 1) * OUT_GROUP] for g in range(ROPE_DIM // OUT_GROUP)]
    words = HALF // OUT_GROUP // OUT_WORD
    stage = prog.s.out_stage.at[w, 0]
    word = None
    for g, x in enumerate(pieces):
        e = kvc.ue8m0_exponent(jnp.abs(x).max(axis=1))
        inv = lax.bitcast_convert_type((127 - e) << 23, jnp.float32)  # 2^-e, a normal f32
        v = jnp.clip(x * lax.broadcast_in_dim(inv, (HB, OUT_GROUP), [0]), -448.0, 448.0)
        stage.at[:, pl.ds(g * OUT_GROUP, OUT_GROUP)][...] = v.astype(jnp.float8_e4m3fn)
        byte = (e + 127) << (8 * (g % OUT_WORD))
        word = byte if g % OUT_WORD == 0 else word | byte
        if g % OUT_WORD == OUT_WORD - 1:
            # one four-byte store per row instead of four one-byte ones
            prog.scale.at[row, pl.ds(h0, HB), w * words + g // OUT_WORD][...] = lax.bitcast_convert_type(
                word, jnp.uint32)
    prog.send_out_half(w, stage)
