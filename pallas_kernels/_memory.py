"""The memory warpgroup (wg 2): per item, Q in, then every 64-token block of the row's pools into the K ring.

It runs with few registers (40; 56 when it converts quantized records) and no matmul. Per block it
waits for the buffer's release, gathers the block's tokens straight into the swizzled K tile (bf16
rows copied; quantized records copied into their token's row and converted in place, `_gather.py`)
plus the block's 64 sources, and publishes the buffer (`full`). Masked tokens are never read:
their copies zero-fill. Kernels of bf16 pools only publish block n - 1 before waiting for the
release of block n's buffer (its copies land meanwhile); kernels of quantized pools publish each block
once converted. In interpret mode the gather is a loop of Pallas-level copies (`fill_interpret`).

With persistent CTAs an item's Q is copied once the previous item's last Q K^T has run (`q_free`), so that it
lands, and the item's first block with it, while the previous item's last block and epilogue run; its
constants follow its first block's gather (`c_free`: the previous item's epilogue reads them). The mega
output stages in Q, so a mega item's Q and constants wait for the previous epilogue together.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels import _gather
from pallas_kernels._conversions import dequant_fp8, dequant_mxfp8, dequant_nvfp4, rope_combiner
from pallas_kernels._spec import HALF, HB, NBUF, ROW, T

if TYPE_CHECKING:
    from pallas_kernels._kernel import Program

__all__ = ["memory_warpgroup", "fill_interpret"]


def _buf(n):
    """The ring buffer of the n-th block."""
    return n % NBUF


def _after(barrier, k):
    """From the CTA's second item on, wait for the compute warpgroups' release of the previous item's buffer, and
    order their reads before the copies that refill it."""
    @pl.when(k > 0)
    def _():
        plgpu.barrier_wait(barrier)
        plgpu.commit_smem()


def load_q(prog: Program, k):
    """Q's two halves into SMEM, arriving on `q_bar` (k: the item's ordinal in the CTA)."""
    s, row, h0 = prog.s, prog.row, prog.h0
    _after(s.q_free, k)
    plgpu.copy_gmem_to_smem(prog.q.at[row, pl.ds(h0, HB), pl.ds(0, HALF)], s.q.at[0], s.q_bar)
    plgpu.copy_gmem_to_smem(prog.q.at[row, pl.ds(h0, HB), pl.ds(HALF, HALF)], s.q.at[1], s.q_bar)


def load_consts(prog: Program, k):
    """The sink and the mega ops' cos / sin into the constants buffer, arriving on `c_bar`."""
    s, spec = prog.s, prog.spec
    if not spec.row_consts:
        return
    _after(s.c_free, k)
    if spec.has_sink:
        plgpu.copy_gmem_to_smem(prog.sink.at[pl.ds(prog.h0, HB)], s.sink, s.c_bar)
    if spec.mega:
        plgpu.copy_gmem_to_smem(prog.cs.at[prog.row], s.cs, s.c_bar)


def publish(prog: Program, b):
    """Release buffer b to the compute warpgroups: this thread's copies have landed
    (cp.async.wait_group / the interpreter's barrier); fence them for the wgmma (async proxy)."""
    if not prog.spec.interpret:
        _gather.wait_groups(0)()
    plgpu.commit_smem()
    plgpu.barrier_arrive(prog.s.full.at[b])


def fill_interpret(prog: Program, j, b, cache, src, scales, pspec):
    """Interpreter: Pallas-level copies of block j into buffer b (the interpreter cannot run `_gather`).

    bf16 rows go to the K tile, a masked row stored as 0 (it feeds the wgmmas unselected); quantized
    records are staged whole (their data bytes) and dequantized into both K halves. `ibar` counts two
    arrivals per token and one for the scales."""
    s, row, dtype = prog.s, prog.row, prog.spec.dtype
    quant = pspec.quantized
    unit = pspec.layout.data_bytes
    plgpu.copy_gmem_to_smem(src.at[row, pl.ds(j * T, T)], s.idx.at[b], s.ibar_idx)
    plgpu.barrier_wait(s.ibar_idx)
    if quant:
        plgpu.copy_gmem_to_smem(scales.at[row, j], s.scales, s.ibar)
    else:
        plgpu.barrier_arrive(s.ibar)

    @pl.loop(0, T)
    def _tok(i):
        off = s.idx[b, i]

        @pl.when(off >= 0)
        def _copy():
            if quant:
                plgpu.copy_gmem_to_smem(cache.at[pl.ds(off * unit, unit)], s.stage.at[i, pl.ds(0, unit)], s.ibar)
                plgpu.barrier_arrive(s.ibar)
            else:
                for h in range(2):
                    plgpu.copy_gmem_to_smem(cache.at[pl.ds(off, 1), pl.ds(h * HALF, HALF)],
                                            s.k.at[b, h, pl.ds(i, 1)], s.ibar)

        @pl.when(off < 0)
        def _skip():
            if quant:
                plgpu.barrier_arrive(s.ibar)
                plgpu.barrier_arrive(s.ibar)
            else:
                for h in range(2):
                    s.k.at[b, h, pl.ds(i, 1)][...] = jnp.zeros((1, HALF), dtype)
                    plgpu.barrier_arrive(s.ibar)

    plgpu.barrier_wait(s.ibar)
    if quant:
        idx_row = plgpu.load(s.idx.at[b], layout=ROW)
        vrow = lax.broadcast_in_dim(idx_row >= 0, (T, 64), [0])
        for h in range(2):
            if pspec.kv_format == "fp8_ds_mla":
                dequant_fp8(h, s.stage, s.scales, s.combiner, s.k.at[b], vrow, s.rope)
            elif pspec.kv_format == "mxfp8_ds_mla":
                dequant_mxfp8(h, s.stage, s.scales, s.k.at[b], vrow)
            else:
                dequant_nvfp4(h, s.stage, s.scales, s.k.at[b], vrow)


def _gather_block(prog: Program, j, b, pool, pspec):
    """GPU: block j of a pool into buffer b, issued by all 128 threads (`_gather.issue_block`)."""
    cache, src, scales = pool
    s, row = prog.s, prog.row
    if pspec.quantized:
        # the next block's sources (this one's at the pool's end): L2 prefetch only
        jn = jnp.minimum(j + 1, pspec.kpad // T - 1)
        extra = (scales.at[row, pl.ds(j * T, T)], s.scales, src.at[row, pl.ds(jn * T, T)],
                 scales.at[row, pl.ds(jn * T, T)])
    else:
        extra = ()
    _gather.issue_block(pspec.kv_format, f16=prog.spec.f16, scale_pitch=prog.spec.scale_pitch)(
        cache, src.at[row, pl.ds(j * T, T)], s.k.at[b], s.idx.at[b], *extra)


def _take_slot(prog: Program, n):
    """Wait for ring slot n's release from its previous use (slot n - NBUF): the compute warpgroups read the
    buffers with generic loads and wgmmas (and the epilogue's bulk copy); order those reads before the copies
    that refill it."""
    @pl.when(n >= NBUF)
    def _():
        plgpu.barrier_wait(prog.s.free.at[_buf(n)])
        plgpu.commit_smem()


def _item(prog: Program, k, n):
    """One item: Q, the blocks of every pool (ring slots n, n + 1, ...), then the epilogue's slot with one split.
    Returns the next free slot."""
    spec = prog.spec
    load_q(prog, k)
    # The constants come with Q for the CTA's first item and for the mega output (whose epilogue releases both);
    # otherwise after the item's first block (the previous item's epilogue reads the sink)
    late = (k > 0) & (not spec.mega_out)

    @pl.when(jnp.logical_not(late))
    def _():
        load_consts(prog, k)

    deferred = not spec.has_quantized  # bf16 blocks are published one iteration later
    n0 = n
    for p, pspec in enumerate(spec.pools):

        def blk(j, n, pool=prog.pools[p], pspec=pspec):
            b = _buf(n)
            if deferred:
                # Publish the previous block (issued one iteration ago) before waiting for this
                # buffer's release, so the compute warpgroups never wait on this issue.
                @pl.when(n > n0)
                def _():
                    publish(prog, _buf(n - 1))

            _take_slot(prog, n)
            if spec.interpret:
                fill_interpret(prog, j, b, *pool, pspec)
            else:
                _gather_block(prog, j, b, pool, pspec)
            if not deferred:
                publish(prog, b)

            @pl.when((n == n0) & late)  # the constants follow the item's first block
            def _():
                load_consts(prog, k)

            return n + 1

        n = lax.fori_loop(prog.ranges[p][0], prog.ranges[p][1], blk, n)

    @pl.when((n == n0) & late)  # an item without blocks
    def _():
        load_consts(prog, k)

    if deferred:
        @pl.when(n > n0)
        def _():
            publish(prog, _buf(n - 1))

    if spec.stage_in_ring:  # the epilogue stages the output in the next slot (no data, no `full` arrival)
        _take_slot(prog, n)
        n = n + 1
    return n


def memory_warpgroup(prog: Program):
    """The memory warpgroup's whole program: every item of the CTA (`Program.for_items`)."""
    spec, s = prog.spec, prog.s
    plgpu.set_max_registers(spec.registers[0], action="decrease")
    if spec.has_rope_bf16 and spec.interpret:
        s.combiner[...] = rope_combiner()
        plgpu.commit_smem()

    n = prog.for_items(_item, jnp.int32(0))

    # Observe the last phases too (every phase of a barrier must be awaited by its waiters).
    for k in range(NBUF):
        @pl.when(n - NBUF + k >= 0)
        def _():
            plgpu.barrier_wait(s.free.at[_buf(n - NBUF + k)])
    plgpu.barrier_wait(s.q_free)
    if spec.row_consts:
        plgpu.barrier_wait(s.c_free)
