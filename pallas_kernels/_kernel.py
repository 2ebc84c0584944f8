"""One Mosaic GPU (`plgpu.kernel`) program for sparse MLA attention rows, shared by decode and prefill.

A *row* is one query token (decode: one (request, s_q) pair; prefill: one query). Each row attends
over the union of up to two token *pools* (decode: the main and the extra cache; prefill: `kv`),
each given per row as a list of record indices / row numbers (-1 = masked) prepared by `ops.py`.

Item = (row, split, 64-head group); one CTA per item on a 1-D grid (rows may exceed 65535), or with
`KernelSpec.ctas` that many persistent CTAs, each looping over items cta, cta + ctas, ...; heads are padded
to a multiple of 64 by the caller (the wgmma M is 64). Three warpgroups (Pallas "threads", "wg"),
lane-level lowering semantics (explicit register layouts):

- wg 2, the memory warpgroup (`_memory.py`): copies Q, then gathers each 64-token block into a
  double-buffered K tile in the swizzled wgmma operand layout (quantized records converted there), and
  publishes it;
- wg 0 and wg 1, the compute warpgroups (`_compute.py`): warpgroup w owns latent dims
  [256 w, 256 w + 256); per block S = Q K^T (each contracts its own dims, the partial scores are
  exchanged through SMEM), an online softmax, O += P V (K = V = the latent), then the epilogue.

Synchronization: `q_bar` / `c_bar` (Q / the constants landed: the sink, the mega ops' cos / sin),
`q_free` / `c_free` (both compute warpgroups are done with the item's Q / constants: the next item's may
land), `full[b]` / `free[b]` (buffer b published by the memory warpgroup / released by both compute
warpgroups), `x_post` / `x_read` (score exchange),
`ibar_idx` / `ibar` (interpreter only: the Pallas-level gather's copies). SMEM: Q 64 KiB + K
2 x 64 KiB + the exchange buffers (`KernelSpec.xbufs`) + indices, scale bytes and sink.

The ring's slots are counted across the CTA's items: each block takes one, and the one-split bf16 output
takes one more (`KernelSpec.stage_in_ring`), in which the compute warpgroups stage it for its bulk copy (each
in its own half, which only it reads), so that Q is free for the next item once the item's last Q K^T has
run. The mega output's e4m3 stage (its own tiling) lies in Q's SMEM instead (a `RefUnion`), which the next
item's Q then waits for.

The mega ops (`spec.mega`, `_mega.py`): Q arrives unroped with the row's cos / sin; warpgroup 1 ropes
Q's last 64 dims in SMEM before its first wgmma and, with one split, the epilogue inverse-ropes O and writes
it as e4m3 values with UE8M0 exponents per 32 dims (with several splits the partials stay f32 and the
XLA combine finishes them).

Outputs: with one split, the final bf16 O (normalized, sink in the denominator), the natural-log
lse (+inf for an empty row, sink excluded) and max_logits (-inf when empty); with several
splits, f32 partials (O / l, and lse / max with -inf when empty) for `ops.combine_splits`.

Interpret mode (`spec.interpret`, see `_interpret.py`) takes wgmma A operands from SMEM only,
cannot store into an accumulator and cannot run `inline_mgpu`: P is staged in SMEM and P V added
to O after the wgmma, the memory warpgroup gathers with Pallas-level copies and dequantizes the
records with Pallas operations (`_conversions.py`). The barrier protocol and the compute are the
same program. SM100 (Blackwell) runs this SM90-style kernel (wgmma; no tcgen05/TMEM, no TMA gather).
Design notes and measurements: docs/pallas_kernels.md.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels._compute import compute_warpgroup
from pallas_kernels._memory import memory_warpgroup
from pallas_kernels._spec import (D, HALF, HB, NBUF, OUT_GROUP, OUT_STAGE_TRANSFORMS, OUT_WORD, SCALE_GROUPS,
                                  SMEM_LIMIT, STAGE_PITCH, SWIZZLE, TILE, KernelSpec, T, smem_bytes)

__all__ = ["build_kernel", "Program", "Scratch"]


@dataclasses.dataclass(frozen=True)
class Scratch:
    """The kernel's SMEM buffers and barriers (None where the spec needs none), in allocation order."""

    q: Any  # Q halves [2, 64, 256]
    k: Any  # the K tile ring [NBUF, 2, 64, 256]
    stage: Any  # interpreter: the quantized records of a block [64, STAGE_PITCH] uint8
    # the block's scales: bytes [64, scale_pitch] (GPU) or f32 factors [SCALE_GROUPS, 64] (interpreter)
    scales: Any
    idx: Any  # the block's sources [NBUF, 64]
    combiner: Any  # interpreter, fp8_ds_mla pools: `rope_combiner`
    sink: Any  # [64] f32 (a row of the constants buffer)
    cs: Any  # mega: the row's per-dim cos and signed sin [2, 64] f32 (`_mega.rope_rows`; rows of the same buffer)
    q_bar: Any
    full: Any
    free: Any
    x: Any  # partial scores [xbufs, 64 heads, 64 tokens] f32
    x_post: Any
    x_read: Any
    p: Any  # interpreter: P per compute warpgroup [2, 2, 64, 64] (wgmma A operands from SMEM)
    rope: Any  # interpreter, fp8_ds_mla pools: the RoPE bytes of a block as bf16 [64, 128]
    ibar_idx: Any  # interpreter: the gather's barriers (sources; one arrival per copy)
    ibar: Any
    q_free: Any
    c_free: Any  # None without constants (as c_bar)
    c_bar: Any
    # the mega output (one split): warpgroup w's e4m3 half [64, 256] staged in its own Q half's bytes for one bulk
    # copy out (`out_stage.at[w, 0]`); the bf16 output stages in the ring (`k.at[b, w]`)
    out_stage: Any = None


@dataclasses.dataclass(frozen=True)
class Program:
    """One CTA's view of the kernel: the spec, the operands, the scratch and the coordinates of its current item
    (`at`)."""

    spec: KernelSpec
    q: Any  # bf16 [R, Hp, 512]
    sink: Any  # f32 [Hp] or None
    cs: Any  # mega: f32 [R, 2, 64] or None
    pools: tuple  # per pool (cache, src, scales or None)
    out: Any
    lse: Any
    mx: Any  # max_logits (None for the mega output)
    scale: Any  # the mega output's exponent bytes, four per word: uint32 [R, Hp, 4] (else None)
    s: Scratch
    counts: Any  # int32 [R, n_pools]: blocks per row and pool
    row: Any = None
    split: Any = None
    h0: Any = None  # first head of the head group
    ranges: tuple = ()  # per pool (first block, end block) of this split

    def for_items(self, body, carry):
        """`carry = body(item_program, k, carry)` over this CTA's items cta, cta + grid, ... (k: the item's ordinal
        in the CTA); one item, without a loop, unless the CTAs are persistent."""
        cta = lax.axis_index("cta")
        if self.spec.ctas is None:
            return body(self.at(cta), jnp.int32(0), carry)
        grid = self.spec.grid
        count = (self.spec.items - cta + grid - 1) // grid
        return lax.fori_loop(0, count, lambda k, c: body(self.at(cta + k * grid), k, c), carry)

    def at(self, item) -> Program:
        """This program at item `item`: its (row, split, head group) and block ranges."""
        HG, NS = self.spec.head_groups, self.spec.num_splits
        rest = item // HG
        split, row = rest % NS, rest // NS
        return dataclasses.replace(self, row=row, split=split, h0=(item % HG) * HB,
                                   ranges=_split_ranges(self.counts, row, split, self.spec))

    def send_out_half(self, w, stage):
        """Warpgroup w's staged one-split output half [64, 256] (`Scratch.out_stage`, bf16 or the mega output's e4m3)
        to its place in `out` with one bulk copy: register stores of a wgmma-layout tile write a few bytes in each
        of 8 rows per warp instruction."""
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(stage, self.out.at[self.row, pl.ds(self.h0, HB), pl.ds(w * HALF, HALF)])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the slot may be refilled once its SMEM is read


def _split_ranges(counts_ref, row, split, spec: KernelSpec):
    """Per-pool block ranges of this split: the row's valid blocks (main then extra) cut in NS parts."""
    NS, npools = spec.num_splits, len(spec.pools)
    nblk = [counts_ref[row, p] for p in range(npools)]
    tot = nblk[0] if npools == 1 else nblk[0] + nblk[1]
    per = (tot + NS - 1) // NS
    start = jnp.minimum(split * per, tot)
    end = jnp.minimum(start + per, tot)
    ranges = []
    base = jnp.int32(0)
    for p in range(npools):
        lo = jnp.clip(start - base, 0, nblk[p])
        hi = jnp.clip(end - base, 0, nblk[p])
        ranges.append((lo, hi))
        base = base + nblk[p]
    return tuple(ranges)


def _program(spec: KernelSpec, refs) -> Program:
    """Unpacks the kernel's refs (the item coordinates are set by `Program.at`)."""
    it = iter(refs)
    q_ref = next(it)
    counts_ref = next(it)
    sink_ref = next(it) if spec.has_sink else None
    cs_ref = next(it) if spec.mega else None
    pools = []
    for p in spec.pools:
        cache = next(it)
        src = next(it)
        scales = next(it) if p.quantized else None
        pools.append((cache, src, scales))
    out_ref, lse_ref, third = next(it), next(it), next(it)
    mx_ref, scale_ref = (None, third) if spec.mega_out else (third, None)
    scratch = _scratch(spec, next(it))
    rest = list(it)
    assert not rest, rest

    return Program(spec, q_ref, sink_ref, cs_ref, tuple(pools), out_ref, lse_ref, mx_ref, scale_ref, scratch,
                   counts_ref)


def _scratch(spec: KernelSpec, refs) -> Scratch:
    """`Scratch` from the allocated refs (`_scratch_types`' order): the sink and cos / sin are views of the one
    constants buffer."""
    refs = list(refs)
    q, out_stage = refs[0] if spec.mega_out else (refs[0], None)
    consts = refs[6]
    sink = consts.at[0] if spec.has_sink else None
    cs = consts.at[pl.ds(int(spec.has_sink), 2)] if spec.mega else None
    return Scratch(q, *refs[1:6], sink, cs, *refs[7:], out_stage=out_stage)


def _scratch_types(spec: KernelSpec) -> tuple:
    """SMEM buffers and barriers, in `Scratch`'s order (the sink and cos / sin as one constants buffer,
    `KernelSpec.row_consts` rows)."""
    quant, interpret, xbufs = spec.has_quantized, spec.interpret, spec.xbufs
    rope_bf16 = interpret and spec.has_rope_bf16
    if not quant:
        scales = None
    elif spec.scale_offsets:
        scales = plgpu.SMEM((T, spec.scale_pitch), jnp.uint8)
    else:
        scales = plgpu.SMEM((SCALE_GROUPS, T), jnp.float32)
    q = plgpu.SMEM((2, HB, HALF), spec.dtype, transforms=(TILE, SWIZZLE))
    assert jnp.dtype(spec.dtype).itemsize == 2, "an output stage [w] must lie inside its buffer's half w"
    if spec.mega_out:
        # Q's bytes twice over as e4m3 [2, 2, 64, 256]: [w, 0] lies inside Q's half w, which only warpgroup w
        # reads, so each warpgroup stages its output once its own last wgmma has read its Q
        q = plgpu.RefUnion(q, plgpu.SMEM((2, 2, HB, HALF), jnp.float8_e4m3fn, transforms=OUT_STAGE_TRANSFORMS))
    return (
        q,
        plgpu.SMEM((NBUF, 2, T, HALF), spec.dtype, transforms=(TILE, SWIZZLE)),
        plgpu.SMEM((T, STAGE_PITCH), jnp.uint8) if quant and interpret else None,
        scales,
        plgpu.SMEM((NBUF, T), jnp.int32),
        plgpu.SMEM((128, 64), jnp.bfloat16, transforms=(TILE, SWIZZLE)) if rope_bf16 else None,
        # rows of 64: the sink's HB heads, cos / sin's ROPE_DIM dims
        plgpu.SMEM((spec.row_consts, HB), jnp.float32) if spec.row_consts else None,
        plgpu.Barrier(num_arrivals=2),  # q_bar: Q's halves
        plgpu.Barrier(num_arrivals=1, num_barriers=NBUF),  # full: the memory warpgroup published a block
        plgpu.Barrier(num_arrivals=2, num_barriers=NBUF),  # free: both compute warpgroups released a buffer
        plgpu.SMEM((xbufs, HB, T), jnp.float32, transforms=(plgpu.TilingTransform((8, 32)), SWIZZLE)),
        # x_post / x_read (see `_compute.exchange_scores`): with two buffers each counts both warpgroups,
        # with one buffer x_post is wg 0's post and x_read wg 1's
        plgpu.Barrier(num_arrivals=xbufs),
        plgpu.Barrier(num_arrivals=xbufs),
        plgpu.SMEM((2, 2, HB, T), spec.dtype, transforms=(TILE, SWIZZLE)) if interpret else None,
        plgpu.SMEM((T, 128), jnp.bfloat16, transforms=(TILE, SWIZZLE)) if rope_bf16 else None,
        plgpu.Barrier(num_arrivals=1) if interpret else None,
        plgpu.Barrier(num_arrivals=2 * T + 1) if interpret else None,  # two arrivals per token, one more
        plgpu.Barrier(num_arrivals=2),  # q_free: both compute warpgroups' last Q K^T of the item has run
        plgpu.Barrier(num_arrivals=2) if spec.row_consts else None,  # c_free: both are done with the constants
        # c_bar: the constants landed (the sink, cos / sin: one copy each)
        plgpu.Barrier(num_arrivals=spec.has_sink + spec.mega) if spec.row_consts else None,
    )


def _out_types(spec: KernelSpec) -> tuple:
    R, Hp, NS = spec.rows, spec.heads, spec.num_splits
    if spec.mega_out:
        return (jax.ShapeDtypeStruct((R, Hp, D), jnp.float8_e4m3fn),
                jax.ShapeDtypeStruct((R, Hp), jnp.float32),
                jax.ShapeDtypeStruct((R, Hp, D // OUT_GROUP // OUT_WORD), jnp.uint32))
    if spec.final:  # f16 kernels stage the bf16 output's bits in their f16 ring: `out` holds them as f16
        return (jax.ShapeDtypeStruct((R, Hp, D), spec.dtype),
                jax.ShapeDtypeStruct((R, Hp), jnp.float32),
                jax.ShapeDtypeStruct((R, Hp), jnp.float32))
    return (jax.ShapeDtypeStruct((R, NS, Hp, D), jnp.float32),
            jax.ShapeDtypeStruct((R, NS, Hp), jnp.float32),
            jax.ShapeDtypeStruct((R, NS, Hp), jnp.float32))


def build_kernel(spec: KernelSpec):
    """Returns `f(q, counts, [sink], [cos_sin], *pool_operands) -> (out, lse, max_logits)`.

    q: `spec.dtype` bits [R, Hp, 512] (bf16 values; for `spec.mega` not roped); counts: int32 [R, n_pools]
    (64-token blocks per row and pool); sink: f32 [Hp] (if `has_sink`); cos_sin: f32 [R, 2, 64] (if
    `spec.mega`: `_mega.rope_rows`); per pool: the cache operand (quantized formats:
    uint8 [bytes]; bf16: `spec.dtype` [rows, 512]), src int32 [R, kpad] (index of the record in units of
    its data bytes / row number, -1 = masked), and for quantized pools the scales: with
    `spec.scale_offsets` the bytes from each record to its scale bytes, int32 [R, kpad], else f32
    [R, kpad / 64, SCALE_GROUPS, 64] (per block, scale group and token: the factor of the entry's scale
    byte, 0 when masked; `ops.pool_operands`). Final mode returns out bf16 [R, Hp, 512], lse f32
    [R, Hp], max_logits f32 [R, Hp]; split mode returns f32 [R, S, Hp, 512], [R, S, Hp], [R, S, Hp]. The mega
    output (`spec.mega`, one split) is out e4m3 [R, Hp, 512], lse f32 [R, Hp] and the UE8M0 exponents as
    uint32 [R, Hp, 4], four bytes per word with the lowest dims' first (inverse-roped O x 2^-e per 32 dims;
    `ops` bitcasts them to the bytes [R, Hp, 16]).
    """
    if smem_bytes(spec) > SMEM_LIMIT:
        raise ValueError(f"kernel needs {smem_bytes(spec)} B of SMEM (> {SMEM_LIMIT})")

    def sparse_mla_kernel(*refs):
        prog = _program(spec, refs)
        wg = lax.axis_index("wg")

        @pl.when(wg == 2)
        def _memory():
            memory_warpgroup(prog)

        # one copy of the compute code for both warpgroups (w traced): two copies of the block loop and the
        # epilogue miss in the instruction cache (benchmarks/RESULTS.md)
        @pl.when(wg < 2)
        def _compute():
            compute_warpgroup(prog, wg)

    return plgpu.kernel(
        sparse_mla_kernel,
        out_type=_out_types(spec),
        scratch_types=(_scratch_types(spec),),
        grid=(spec.grid,),
        grid_names=("cta",),
        num_threads=3,
        thread_name="wg",
        # no cross-warp reductions (the row max / sum stay within a warp): no reduction scratch, whose
        # 2 KiB default would leave no room for the second exchange buffer
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane,
                                             reduction_scratch_bytes=0),
    )
