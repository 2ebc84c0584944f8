"""The compute warpgroups (wg 0 and wg 1): scores, online softmax, P V and the epilogue.

Warpgroup w owns latent dims [256 w, 256 w + 256) of Q, K = V (the latent) and O. Per block:
S_w = Q_w K_w^T (wgmma), the two f32 partials exchanged through SMEM so that both hold
S = S_0 + S_1 bitwise identically, the same online softmax in both (exp2 domain, masked columns
-inf, the running max starts at -inf with a guard so (-inf) - (-inf) never occurs), then
O_w += P V_w (wgmma, P from registers) and the K buffer released; Q is released after the item's last
Q K^T, so that the next item's Q lands during its last block and epilogue. With bf16 operands P = P_hi +
P_lo in two bf16 terms: a single bf16 P misses the output tolerance on rows mixing large and small
values; with f16 operands one f16 P.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels._conversions import q_to_f16
from pallas_kernels._mega import rope_q, store_mega_out
from pallas_kernels._spec import COL, HALF, HB, LN2, LOG2E, NBUF, ROW, T

if TYPE_CHECKING:
    from pallas_kernels._kernel import Program

__all__ = ["compute_warpgroup", "exchange_scores", "softmax_step", "epilogue", "store_final_out"]


def exchange_scores(prog: Program, w, s_own, nx):
    """S = S_0 + S_1 from this warpgroup's partial (its 256 dims) and the peer's (w: the traced warpgroup
    index). Both hold bitwise-identical scores: each adds the other's partial to its own, and f32 addition
    commutes.

    Two buffers (`spec.xbufs`): both post their partial at once (x_post), read the other's and
    release the buffers (x_read), which the next block waits for before posting. One buffer (fp8
    kernels, whose SMEM leaves room for one): wg 0 posts (x_post), wg 1 takes it and posts its own
    (x_read), wg 0 takes that. nx: the exchanges this CTA has made before."""
    s = prog.s
    if prog.spec.xbufs == 1:
        @pl.when(w == 0)
        def _post():
            s.x.at[0][...] = s_own
            plgpu.barrier_arrive(s.x_post)
            plgpu.barrier_wait(s.x_read)

        @pl.when(w == 1)
        def _take():
            plgpu.barrier_wait(s.x_post)

        # wg 0 reads wg 1's partial, wg 1 wg 0's; each thread overwrites only the elements it has just read
        s_peer = plgpu.load(s.x.at[0], layout=plgpu.Layout.WGMMA)

        @pl.when(w == 1)
        def _reply():
            s.x.at[0][...] = s_own
            plgpu.barrier_arrive(s.x_read)

        return s_own + s_peer

    @pl.when(nx > 0)
    def _():
        plgpu.barrier_wait(s.x_read)

    s.x.at[w][...] = s_own
    plgpu.barrier_arrive(s.x_post)
    plgpu.barrier_wait(s.x_post)
    s_peer = plgpu.load(s.x.at[1 - w], layout=plgpu.Layout.WGMMA)
    plgpu.barrier_arrive(s.x_read)
    return s_own + s_peer  # f32 addition commutes: both warpgroups hold the same bits


def softmax_step(prog: Program, s, idx_col, m, l, o):
    """Online softmax over one block's scores: (P_hi, P_lo or None, O rescaled, m, l)."""
    c2 = prog.spec.softmax_scale * LOG2E
    vcol = lax.broadcast_in_dim(idx_col >= 0, (HB, T), [1])
    t = jnp.where(vcol, s * c2, -jnp.inf)
    m_new = jnp.maximum(m, t.max(axis=1))
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp2(m - m_use)
    pexp = jnp.exp2(t - lax.broadcast_in_dim(m_use, (HB, T), [0]))
    l = l * alpha + pexp.sum(axis=1)
    o = o * lax.broadcast_in_dim(alpha, (HB, HALF), [0])
    if prog.spec.f16:  # one f16 P (11 bits; pexp <= 1)
        return pexp.astype(jnp.float16), None, o, m_new, l
    # P = P_hi + P_lo (two bf16 terms, ~2^-16 relative)
    p_hi = pexp.astype(jnp.bfloat16)
    p_lo = (pexp - p_hi.astype(jnp.float32)).astype(jnp.bfloat16)
    return p_hi, p_lo, o, m_new, l


def _stage_p(prog: Program, w, p_hi, p_lo):
    """Interpreter: wgmma A operands come from SMEM only, so P is staged there."""
    a = prog.s.p
    a.at[w, 0][...] = p_hi
    if p_lo is not None:
        a.at[w, 1][...] = p_lo
    plgpu.commit_smem()
    return a.at[w, 0], (a.at[w, 1] if p_lo is not None else None)


def _pv(prog: Program, w, kb, p_hi, p_lo, o):
    """O_w + P V_w. The GPU accumulates onto O in the wgmma accumulator; the interpreter cannot
    store into an accumulator, so it adds P V to O afterwards."""
    if prog.spec.interpret:
        p_hi, p_lo = _stage_p(prog, w, p_hi, p_lo)

        def pv(acc):
            plgpu.wgmma(acc, p_hi, kb.at[w])
            if p_lo is not None:
                plgpu.wgmma(acc, p_lo, kb.at[w])
            return acc[...]

        return o + pl.run_scoped(pv, plgpu.ACC((HB, HALF), jnp.float32))

    def pv(acc):
        acc[...] = o
        plgpu.wgmma(acc, p_hi, kb.at[w])
        if p_lo is not None:
            plgpu.wgmma(acc, p_lo, kb.at[w])
        return acc[...]

    return pl.run_scoped(pv, plgpu.ACC((HB, HALF), jnp.float32))


def _block(prog: Program, w, carry, last):
    """One 64-token block in ring slot n: wait for its buffer, S (then Q's release if `last`, the item's last
    block), softmax, P V, release the buffer. nx counts the CTA's blocks (the score exchanges)."""
    s = prog.s
    n, nx, o, m, l = carry
    b = n % NBUF
    plgpu.barrier_wait(s.full.at[b])
    kb = s.k.at[b]
    idx_col = plgpu.load(s.idx.at[b], layout=COL)

    def qk(acc):  # this warpgroup's 256 dims
        plgpu.wgmma(acc, s.q.at[w], kb.at[w].transpose((1, 0)))
        return acc[...]

    s_own = pl.run_scoped(qk, plgpu.ACC((HB, T), jnp.float32))

    if not prog.spec.mega_out:  # (the mega output stages in Q)
        @pl.when(last)
        def _():
            plgpu.barrier_arrive(s.q_free)  # this warpgroup's wgmmas have read its Q half for the last time

    scores = exchange_scores(prog, w, s_own, nx)
    p_hi, p_lo, o, m_new, l = softmax_step(prog, scores, idx_col, m, l, o)
    o = _pv(prog, w, kb, p_hi, p_lo, o)
    plgpu.barrier_arrive(s.free.at[b])  # P V has read the K tile
    return n + 1, nx + 1, o, m_new, l


def store_final_out(prog: Program, w, res, slot):
    """Warpgroup w's bf16 half of the final O, staged in its own half of ring slot `slot` and sent with one bulk
    copy, as the mega output is (`Program.send_out_half`). An f16 ring holds the bf16 bits (`out` is then f16
    typed)."""
    stage = prog.s.k.at[slot, w]
    stage[...] = lax.bitcast_convert_type(res.astype(jnp.bfloat16), stage.dtype)
    prog.send_out_half(w, stage)


def epilogue(prog: Program, w, o, m, l, sink, slot):
    """O / l (with the sink in the denominator when final), lse and max_logits. One split: O staged in ring slot
    `slot` and bulk-copied (`store_final_out`), or the mega output, O as e4m3 with its exponents staged in Q
    (`_mega.store_mega_out`); several: the f32 partials stored from registers."""
    spec, row, split, h0 = prog.spec, prog.row, prog.split, prog.h0
    empty = l == 0.0
    l_safe = jnp.where(empty, 1.0, l)
    lse = jnp.where(empty, jnp.inf if spec.final else -jnp.inf, (m + jnp.log2(l_safe)) * LN2)
    mx = jnp.where(empty, -jnp.inf, m * LN2)
    inv = 1.0 / l_safe
    if spec.final and spec.has_sink:
        # out = (O / l) / (1 + exp(sink - lse)); sink = +inf -> 0, -inf -> 1.
        inv = inv / (1.0 + jnp.exp(sink - jnp.where(empty, 0.0, lse)))
    inv = jnp.where(empty, 0.0, inv)
    res = o * lax.broadcast_in_dim(inv, (HB, HALF), [0])
    if spec.mega_out:
        store_mega_out(prog, w, res)

        @pl.when(w == 0)
        def _lse():
            prog.lse.at[row, pl.ds(h0, HB)][...] = lse
    elif spec.final:
        store_final_out(prog, w, res, slot)

        @pl.when(w == 0)
        def _stats():
            prog.lse.at[row, pl.ds(h0, HB)][...] = lse
            prog.mx.at[row, pl.ds(h0, HB)][...] = mx
    else:
        prog.out.at[row, split, pl.ds(h0, HB), pl.ds(w * HALF, HALF)][...] = res

        @pl.when(w == 0)
        def _stats():
            prog.lse.at[row, split, pl.ds(h0, HB)][...] = lse
            prog.mx.at[row, split, pl.ds(h0, HB)][...] = mx


def _item(prog: Program, w, k, carry):
    """One item (ring slots n, n + 1, ...; nx exchanges made before): the blocks, then the epilogue, whose output
    takes one more slot with one split. Returns the next (n, nx)."""
    spec, s = prog.spec, prog.s
    n, nx = carry
    plgpu.barrier_wait(s.q_bar)
    if spec.mega:
        plgpu.barrier_wait(s.c_bar)  # cos / sin (and the sink)

        @pl.when(w == 1)  # the RoPE dims are this warpgroup's
        def _rope():
            rope_q(prog)
            plgpu.commit_smem()

    if spec.f16:  # Q arrived as bf16 bits: rewrite the half this warpgroup contracts
        q_to_f16(s.q, w, spec.interpret)
        plgpu.commit_smem()

    o = plgpu.layout_cast(jnp.zeros((HB, HALF), jnp.float32), plgpu.Layout.WGMMA)
    m = plgpu.layout_cast(jnp.full((HB,), -jnp.inf, jnp.float32), ROW)
    l = plgpu.layout_cast(jnp.zeros((HB,), jnp.float32), ROW)
    # the blocks of every pool in one loop: a block's work does not depend on its pool (the memory warpgroup
    # publishes them in the same order)
    blocks = sum(hi - lo for lo, hi in prog.ranges)
    n, nx, o, m, l = lax.fori_loop(0, blocks, lambda j, c: _block(prog, w, c, j == blocks - 1), (n, nx, o, m, l))

    if not spec.mega_out:
        @pl.when(blocks == 0)
        def _():
            plgpu.barrier_arrive(s.q_free)

    sink = None
    if spec.has_sink:
        if not spec.mega:
            plgpu.barrier_wait(s.c_bar)
        sink = plgpu.load(s.sink, layout=ROW)
    if spec.row_consts and not spec.mega:
        plgpu.barrier_arrive(s.c_free)  # the sink is in registers (the mega epilogue still reads cos / sin)
    epilogue(prog, w, o, m, l, sink, n % NBUF)
    if spec.stage_in_ring:
        plgpu.barrier_arrive(s.free.at[n % NBUF])  # the output's bulk copy has read its stage
        n = n + 1
    if spec.mega_out:
        plgpu.barrier_arrive(s.q_free)  # the output's bulk copy has read its stage in Q
    if spec.mega:
        plgpu.barrier_arrive(s.c_free)
    return n, nx


def compute_warpgroup(prog: Program, w):
    """Compute warpgroup w's whole program, every item of the CTA (w traced: both warpgroups run one copy of this
    code)."""
    spec, s = prog.spec, prog.s
    plgpu.set_max_registers(spec.registers[1], action="increase")
    _, nx = prog.for_items(lambda p, k, c: _item(p, w, k, c), (jnp.int32(0), jnp.int32(0)))

    if spec.xbufs == 2:
        @pl.when(nx > 0)
        def _():
            plgpu.barrier_wait(s.x_read)  # the last block's release
