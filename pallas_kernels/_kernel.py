"""One Mosaic GPU (`plgpu.kernel`) program for sparse MLA attention rows, shared by decode and prefill.

A *row* is one query token (decode: one (request, s_q) pair; prefill: one query). Each row attends
over the union of up to two token *pools* (decode: the main and the extra cache; prefill: `kv`),
each given per row as a list of byte offsets / row numbers (-1 = masked) prepared by `ops.py`.

Program (CTA) = (row, split, 64-head group), a 1-D grid (rows may exceed 65535); heads are padded
to a multiple of 64 by the caller (the wgmma M is 64). Three warpgroups (Pallas "threads", "wg"),
lane-level lowering semantics (`LoweringSemantics.Lane`: explicit register layouts):

Two modes:
- *direct* (the default): tokens land in a double-buffered K tile (the swizzled wgmma operand
  layout), so the compute warpgroups only do matmuls and softmax: bf16 rows are copied there, fp8
  records are copied into their own token's K row and converted in place by the memory warpgroup;
- *staged* (`fp8_direct=False`, kept for comparison: 8f294f1's kernel): fp8 records land as raw
  bytes in a staging buffer and the compute warpgroups dequantize / relayout them into a single K tile.

- wg 2, the *memory* warpgroup (40 registers; 56 when it converts fp8 records): copies the Q tile
  (TMA, swizzled), then for every 64-token block issues the block's gather from all 128 threads as
  16-byte `cp.async` copies (`_gather.py`, through `plgpu.inline_mgpu`), plus the block's 64 sources.
  Direct: the 1 KiB bf16 row into the K tile row; the fp8 record's 448 NoPE bytes into the token's
  own half-0 row and its 128 RoPE bytes (bf16 values) to their final place, its 8 UE8M0 scale bytes
  (offsets from XLA) to a byte row, in four commit groups, the next block's records prefetched into
  L2; each group converted as it lands (e4m3 * 2^(e - 127) -> bf16, or f16 with the RoPE values
  rewritten too, one token per warp at a time, the next token's reads ahead of this one's conversion).
  Staged: the NoPE bytes to the staging row, the RoPE bytes to a bf16 RoPE row, the f32 scale
  factors [8 groups, 64 tokens] (prepared by XLA). Masked tokens are never read: their copies
  zero-fill. It waits for its own copies (`cp.async.wait_group`), fences them for the async proxy
  and arrives on the buffer's `full` barrier. bf16-only direct kernels publish block n - 1 before
  waiting for the release of block n's buffer; fp8 kernels publish each block once converted.
- wg 0 and wg 1, the *compute* warpgroups (232 registers; 224 beside an fp8-converting memory
  warpgroup: `KernelSpec.registers`): warpgroup w owns latent dims
  [256 w, 256 w + 256). In staged mode, per block it dequantizes its dims of the staged tokens
  into its half of the bf16 K tile (swizzled SMEM): e4m3 * 2^(e - 127) for NoPE tiles, the RoPE
  rows copied as they are (masked rows are already 0) and releases the staging buffer. Then
  S = Q K^T (wgmma): with `qk_exchange` each warpgroup contracts its own 256 dims and the two f32
  partials are exchanged through SMEM (two 16 KiB buffers where SMEM allows: both post at once;
  one buffer in direct fp8 kernels: wg 0 posts, wg 1 takes it and posts its own); both sum S_0 + S_1 in
  that order, so both hold bitwise-identical scores. Without the exchange (staged bf16 + fp8 pools,
  whose two staging views leave no room for the buffer) both contract all 512 dims. Both run the same
  online softmax (exp2 domain, masked columns -inf, running max starts at -inf with a guard so
  (-inf) - (-inf) never occurs) and accumulate their own half of O += P V (wgmma, P from
  registers, V = the K tile: K = V = the latent) with P = P_hi + P_lo in two bf16 terms: one bf16
  P (FlashMLA's choice) misses the output tolerance on rows mixing large and small values; with
  f16 operands (`KernelSpec.f16_operands`: Q rewritten in SMEM by each compute warpgroup, f16 K
  tile) one f16 P. In direct mode the K buffer is released after P V.

Synchronization: `q_bar` (Q + sink landed), `full[b]` / `free[b]` (buffer b published by the
memory warpgroup / released by both compute warpgroups), `x_post` / `x_read` (score exchange),
`k_ready` / `k_free` (shared K tile, staged mode without the exchange), `ibar_idx` / `ibar`
(interpreter only: the Pallas-level gather's copies). SMEM, staged fp8 (GPU):
Q 64 KiB + K 64 KiB + staging 41 KiB + RoPE rows 9 KiB + scales 2 KiB + exchange 32 KiB; direct:
Q 64 KiB + K 2 x 64 KiB + exchange 16 KiB (+ 0.5 KiB of scale bytes). In direct mode the gather
(and conversion) of block n + 1 overlaps the whole compute chain of block n; in staged mode the
gather overlaps the matmuls and softmax, the dequantization does not.

Outputs: with one split, the final bf16 O (normalized, sink in the denominator), the natural-log
lse (+inf for an empty row, sink excluded) and max_logits (-inf when empty); with several
splits, f32 partials (O / l, and lse / max with -inf when empty) for `_ops.combine_splits`.
Written directly from registers to global memory.

Interpreter differences (`spec.interpret`, see `_interpret.py`): Mosaic GPU interpret mode takes
wgmma A operands from SMEM only and cannot store into an accumulator, so P is staged in SMEM and
P V is added to O after the wgmma; it cannot run `inline_mgpu`, so the memory warpgroup gathers
with Pallas-level copies (one per token, masked rows of the direct-mode K tile stored as zeros,
masked staged rows selected to 0), fp8 records are staged whole and dequantized with Pallas
operations (by the memory warpgroup in direct mode, from f32 scale rows), and the fp8 RoPE bytes
are recombined into bf16 by a small integer wgmma (`_rope_combiner`: lo + 256 hi, since Pallas has
no width-changing bitcast). The barrier protocol and the compute are the same program.

SM100 (Blackwell) runs this same SM90-style kernel for now (wgmma; no tcgen05/TMEM, no TMA gather).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from dsv41_jax.kv_cache import to_f16_saturating
from pallas_kernels import _gather


__all__ = ["PoolSpec", "KernelSpec", "build_kernel", "T", "HB", "smem_bytes", "fp8_scale_offsets"]

T = 64  # tokens per block (the wgmma N of Q K^T and the K of P V)
HB = 64  # heads per program (the wgmma M)
D = 512
HALF = 256
NOPE = 448
FP8_RECORD = 576
FP8_PITCH = 656  # staging row pitch: 164 words, rows 4 banks apart -> conflict-free wgmma-layout loads
BF16_PITCH = 520  # bf16 elements; 1040 B = 260 words, likewise
ROPE_PITCH = 72  # bf16 elements; 144 B = 36 words: the RoPE staging rows (GPU path), likewise
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
REG_BUDGET = 504  # registers per (memory, compute, compute) thread triple: 65536 // 384 rounded to 8, x 3
_SMEM_LIMIT = 232448  # bytes of dynamic SMEM a Hopper CTA may use

_TILE = plgpu.TilingTransform((8, 64))
_SWZ = plgpu.SwizzleTransform(128)
_ROW = plgpu.Layout.WGMMA.reduce(1)  # one value per row of a [64, n] wgmma-layout tile
_COL = plgpu.Layout.WGMMA.reduce(0)  # one value per column


@dataclasses.dataclass(frozen=True)
class PoolSpec:
    """A token pool: `fmt` "fp8_ds_mla" (uint8 byte view of the cache) or "bf16" (rows [n, 512]);
    `kpad` the per-row index count, a multiple of T."""

    fmt: str
    kpad: int


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    rows: int
    heads: int  # padded, a multiple of HB
    pools: tuple[PoolSpec, ...]
    num_splits: int
    softmax_scale: float
    has_sink: bool
    interpret: bool  # trace the interpreter-compatible formulation
    qk_exchange: bool = True  # split Q K^T by dims across the two compute warpgroups (else both do all)
    p_split: bool = True  # P V as (P_hi + P_lo) V; False only for timing experiments (misses tolerances)
    # Timing experiments only (wrong results): "no_copy" (the memory warpgroup arrives without copying
    # tokens), "no_compute" (compute warpgroups only wait and release), "no_dequant" (staged fp8 kernels:
    # the K tile not rewritten).
    ablate: str = ""
    # fp8 pools dequantized by the memory warpgroup straight into the K ring (False: staged in SMEM
    # and dequantized by the compute warpgroups, the 8f294f1 kernel; kept for comparison)
    fp8_direct: bool = True
    # Registers per thread of the memory warpgroup (0: 56 when it converts fp8 records, else 40);
    # the compute warpgroups get the rest of the CTA's 504 (`registers`).
    mem_regs: int = 0
    # Q, the K tile and P in float16 (direct kernels with the score exchange; see `f16_operands`):
    # `_ops` asks for it in large prefills
    f16: bool = False

    @property
    def head_groups(self) -> int:
        return self.heads // HB

    @property
    def final(self) -> bool:
        return self.num_splits == 1

    @property
    def has_fp8(self) -> bool:
        return any(p.fmt == "fp8_ds_mla" for p in self.pools)

    @property
    def has_bf16(self) -> bool:
        return any(p.fmt == "bf16" for p in self.pools)

    @property
    def direct(self) -> bool:
        """Tokens land straight in the (double-buffered) swizzled K tile: bf16 rows copied, fp8
        records dequantized by the memory warpgroup (`fp8_direct`)."""
        return not self.has_fp8 or self.fp8_direct

    @property
    def registers(self) -> tuple[int, int]:
        """(memory, compute) registers per thread for `setmaxnreg`.

        A CTA of 384 threads is launched with 168 registers per thread, 504 per (memory + 2 compute)
        thread triple; `setmaxnreg.inc` blocks until registers are free, so the three warpgroups must
        not ask for more than 504 in all (64 + 224 + 224 = 512 hung the GPU). Multiples of 8."""
        mem = self.mem_regs or (56 if self.has_fp8 and self.direct else 40)
        return mem, (REG_BUDGET - mem) // 16 * 8

    @property
    def f16_operands(self) -> bool:
        """The wgmma operands are float16: Q (converted in SMEM by each compute warpgroup, its own
        half), the K tile (fp8 records converted to f16 by the memory warpgroup, bf16 row pools
        given as f16 rows by the caller) and P, so P V is one wgmma with an 11-bit P (FlashMLA's
        single bf16 P misses the output tolerance on the project's test data; in bf16 P = P_hi +
        P_lo costs a second P V wgmma). Values beyond +-65504 saturate. Direct kernels with the
        score exchange only (each compute warpgroup converts its own Q half)."""
        return self.f16 and self.direct and self.qk_exchange

    @property
    def dtype(self):
        """Element type of the Q and K tiles (and of bf16 row pool operands)."""
        return jnp.float16 if self.f16_operands else jnp.bfloat16

    @property
    def scale_offsets(self) -> bool:
        """fp8 scale operands are byte offsets of the UE8M0 bytes (GPU direct kernel), not f32 rows."""
        return self.has_fp8 and fp8_scale_offsets(self.fp8_direct, self.interpret)

    @property
    def xbufs(self) -> int:
        """Score-exchange buffers: two where SMEM allows (both warpgroups post at once: staged
        kernels, direct bf16-row kernels), else one (direct fp8 kernels: Q + 2 K tiles + 2 buffers
        + scale bytes + indices + sink exceed 227 KiB by the 1 KiB alignment of each buffer)."""
        return 2 if not self.direct or smem_bytes(self, xbufs=2) <= _SMEM_LIMIT else 1

    @property
    def nbuf(self) -> int:
        """Buffers of the gather ring: K tiles in direct mode, the raw staging buffer otherwise."""
        return 2 if self.direct else 1


def fp8_scale_offsets(fp8_direct: bool, interpret: bool) -> bool:
    """Whether a kernel's fp8 pools take scale byte offsets (the GPU direct kernel reads the UE8M0
    bytes itself) or f32 scale rows (staged kernels; the interpreter's Pallas-level dequantization).
    `_ops` asks before it builds the operands, `KernelSpec.scale_offsets` after."""
    return fp8_direct and not interpret


def smem_bytes(spec: KernelSpec, xbufs: int | None = None) -> int:
    """Dynamic SMEM the GPU kernel asks for, with 1 KiB alignment per buffer (what Mosaic GPU pads to).

    The same figure for interpreter specs (whose extra buffers -- P and RoPE staging, the combiner, the
    direct fp8 record staging -- are not counted), so that CPU tests make the same choices
    (`qk_exchange`) as the GPU. The scale buffer is counted as the f32 [8, 64] rows (2 KiB) in every
    mode (the GPU direct kernel's byte rows take 0.5 KiB). `xbufs`: count that many exchange buffers
    instead of `spec.xbufs`. Barriers: 1 KiB (they take < 100 B; the kernel asks for no reduction scratch)."""
    def al(n):
        return -(-n // 1024) * 1024

    nb = spec.nbuf
    total = al(HB * D * 2) + nb * al(T * D * 2) + al(nb * T * 4) + 1024  # Q, K, indices, barriers
    if not spec.direct:
        stage = max(T * FP8_PITCH if spec.has_fp8 else 0, T * BF16_PITCH * 2 if spec.has_bf16 else 0)
        total += al(stage)
    if spec.has_fp8:  # scale factors; staged: RoPE rows
        total += al(8 * T * 4) + (0 if spec.direct else al(T * ROPE_PITCH * 2))
    if spec.has_sink:
        total += al(HB * 4)
    if spec.qk_exchange:
        total += (xbufs or spec.xbufs) * al(HB * T * 4)
    return total


def build_kernel(spec: KernelSpec):
    """Returns `f(q, counts, [sink], *pool_operands) -> (out, lse, max_logits)`.

    q: bf16 [R, Hp, 512]; counts: int32 [R, n_pools] (64-token blocks per row and pool); sink:
    f32 [Hp] (if `has_sink`); per pool: the cache operand (fp8: uint8 [bytes]; bf16: `spec.dtype`
    [rows, 512]), src int32 [R, kpad] (byte offset of the record / row number, -1 = masked),
    and for fp8 pools scales f32 [R, kpad / 64, 8, 64] (per 64-token block, group g of the 7
    NoPE groups (row 7 unused) and token: the factor 2^(e - 127) of the entry's UE8M0 byte; 0 when masked),
    or with `spec.scale_offsets` the byte offsets int32 [R, kpad] of the entries' 8 UE8M0 bytes.
    Final mode returns out bf16 [R, Hp, 512], lse f32 [R, Hp], max_logits f32 [R, Hp]; split mode
    returns f32 [R, S, Hp, 512], [R, S, Hp], [R, S, Hp].
    """
    R, Hp, NS, HG = spec.rows, spec.heads, spec.num_splits, spec.head_groups
    npools = len(spec.pools)
    c2 = spec.softmax_scale * LOG2E
    has_fp8, has_bf16, has_sink = spec.has_fp8, spec.has_bf16, spec.has_sink
    if spec.ablate not in ("", "no_copy", "no_compute", "no_dequant"):
        raise ValueError(f"ablate must be '', 'no_copy', 'no_compute' or 'no_dequant', got {spec.ablate!r}")
    if spec.mem_regs and (spec.mem_regs % 8 or not 24 <= spec.mem_regs <= 120):
        raise ValueError(f"mem_regs must be 0 (automatic) or a multiple of 8 in [24, 120], got {spec.mem_regs}")
    if spec.ablate == "no_dequant" and spec.has_fp8 and spec.direct:
        raise ValueError("ablate='no_dequant' applies to staged fp8 kernels (fp8_direct=False)")
    if spec.ablate == "no_compute" and not spec.qk_exchange and not spec.direct:
        raise ValueError("ablate='no_compute' needs qk_exchange=True (the k_free barrier would never complete)")
    if smem_bytes(spec) > _SMEM_LIMIT:
        raise ValueError(f"kernel needs {smem_bytes(spec)} B of SMEM (> {_SMEM_LIMIT}); try qk_exchange=False")

    def sparse_mla_kernel(*refs):
        it = iter(refs)
        q_ref = next(it)
        counts_ref = next(it)
        sink_ref = next(it) if has_sink else None
        pool_refs = []
        for p in spec.pools:
            cache = next(it)
            src = next(it)
            scales = next(it) if p.fmt == "fp8_ds_mla" else None
            pool_refs.append((cache, src, scales))
        out_ref, lse_ref, mx_ref = next(it), next(it), next(it)
        scratch = next(it)
        rest = list(it)
        assert not rest, rest
        (q_smem, k_smem, stage, scale_smem, idx_smem, w_smem, sink_smem,
         q_bar, full, free, k_ready, k_free, x_smem, x_post, x_read,
         a_smem, u_smem, ibar_idx, ibar) = scratch
        exchange = spec.qk_exchange
        direct, NB = spec.direct, spec.nbuf
        if has_fp8 and has_bf16 and not direct:
            stage_u8, stage_bf = stage
        elif has_fp8:  # direct: the interpreter's fp8 record staging (None on the GPU)
            stage_u8, stage_bf = stage, None
        else:
            stage_u8, stage_bf = None, stage

        cta = lax.axis_index("cta")
        hgi = cta % HG
        rest_i = cta // HG
        split = rest_i % NS
        row = rest_i // NS
        h0 = hgi * HB

        # Per-pool block ranges of this split: the row's valid blocks (main then extra) cut in NS parts.
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

        wg = lax.axis_index("wg")

        def buf(n):
            return n % NB if NB > 1 else 0

        # ------------------------------------------------------------------ memory warpgroup
        def fill_interpret(j, b, cache, src, scales, fp8):
            """Pallas-level copies of block j into buffer b (the interpreter cannot run `_gather`)."""
            plgpu.copy_gmem_to_smem(src.at[row, pl.ds(j * T, T)], idx_smem.at[b], ibar_idx)
            plgpu.barrier_wait(ibar_idx)
            # ibar counts T + 1 arrivals (staged) or 2 T + 1 (direct: two per token, one more)
            if fp8:
                plgpu.copy_gmem_to_smem(scales.at[row, j], scale_smem, ibar)
            else:
                plgpu.barrier_arrive(ibar)

            @pl.loop(0, T)
            def _tok(i):
                off = idx_smem[b, i]

                @pl.when(off >= 0)
                def _copy():
                    if fp8:
                        plgpu.copy_gmem_to_smem(cache.at[pl.ds(off, FP8_RECORD)],
                                                stage_u8.at[i, pl.ds(0, FP8_RECORD)], ibar)
                        if direct:
                            plgpu.barrier_arrive(ibar)
                    elif direct:
                        for h in range(2):
                            plgpu.copy_gmem_to_smem(cache.at[pl.ds(off, 1), pl.ds(h * HALF, HALF)],
                                                    k_smem.at[b, h, pl.ds(i, 1)], ibar)
                    else:
                        plgpu.copy_gmem_to_smem(cache.at[pl.ds(off, 1)], stage_bf.at[pl.ds(i, 1), pl.ds(0, D)],
                                                ibar)

                @pl.when(off < 0)
                def _skip():
                    if direct and fp8:
                        plgpu.barrier_arrive(ibar)
                        plgpu.barrier_arrive(ibar)
                    elif direct:  # a masked row of the K tile must be 0 (it feeds the wgmmas unselected)
                        for h in range(2):
                            k_smem.at[b, h, pl.ds(i, 1)][...] = jnp.zeros((1, HALF), spec.dtype)
                            plgpu.barrier_arrive(ibar)
                    else:
                        plgpu.barrier_arrive(ibar)

            plgpu.barrier_wait(ibar)
            if direct and fp8:  # the memory warpgroup dequantizes both halves into the K ring
                idx_row = plgpu.load(idx_smem.at[b], layout=_ROW)
                vrow = lax.broadcast_in_dim(idx_row >= 0, (T, 64), [0])
                for h in range(2):
                    _dequant_fp8(h, stage_u8, scale_smem, w_smem, k_smem.at[b], vrow, u_smem)

        mem_regs, compute_regs = spec.registers

        @pl.when(wg == 2)
        def _memory():
            plgpu.set_max_registers(mem_regs, action="decrease")
            if has_fp8 and direct and spec.interpret:
                w_smem[...] = _rope_combiner()
                plgpu.commit_smem()
            plgpu.copy_gmem_to_smem(q_ref.at[row, pl.ds(h0, HB), pl.ds(0, HALF)], q_smem.at[0], q_bar)
            plgpu.copy_gmem_to_smem(q_ref.at[row, pl.ds(h0, HB), pl.ds(HALF, HALF)], q_smem.at[1], q_bar)
            if has_sink:
                plgpu.copy_gmem_to_smem(sink_ref.at[pl.ds(h0, HB)], sink_smem, q_bar)

            def publish(b):
                # This thread's copies have landed (cp.async.wait_group / the interpreter's barrier);
                # fence them for the wgmma (async proxy) and release the block to the compute warpgroups.
                if not spec.interpret:
                    _gather.wait_groups(0)()
                plgpu.commit_smem()
                plgpu.barrier_arrive(full.at[b])

            # Direct bf16 blocks are published one iteration later (their copies land meanwhile);
            # kernels with fp8 pools convert each block before the issue returns: published at once.
            deferred = NB == 2 and not has_fp8
            n = jnp.int32(0)
            for p, pspec in enumerate(spec.pools):
                cache, src, scales = pool_refs[p]
                fp8 = pspec.fmt == "fp8_ds_mla"
                kind = ("fp8_tile" if direct else "fp8_stage") if fp8 else ("bf16_tile" if direct else "bf16_stage")

                def blk(j, n, cache=cache, src=src, scales=scales, fp8=fp8, kind=kind, pspec=pspec):
                    b = buf(n)
                    if deferred:
                        # Publish the previous block (issued one iteration ago) before waiting for this
                        # buffer's release, so the compute warpgroups never wait on this issue.
                        @pl.when(n >= 1)
                        def _():
                            publish(buf(n + 1))

                    @pl.when(n >= NB)
                    def _():
                        plgpu.barrier_wait(free.at[b])
                        # The compute warpgroups read the buffers with generic loads and wgmmas; order
                        # those reads before the copies that refill them.
                        plgpu.commit_smem()

                    if spec.interpret:
                        fill_interpret(j, b, cache, src, scales, fp8)
                    elif spec.ablate != "no_copy":
                        dst = k_smem.at[b] if direct else (stage_u8 if fp8 else stage_bf)
                        if fp8 and direct:
                            # the next block's sources (this one's at the pool's end): L2 prefetch only
                            jn = jnp.minimum(j + 1, pspec.kpad // T - 1)
                            extra = (scales.at[row, pl.ds(j * T, T)], scale_smem, src.at[row, pl.ds(jn * T, T)],
                                     scales.at[row, pl.ds(jn * T, T)])
                        elif fp8:
                            extra = (scales.at[row, j], scale_smem, w_smem)
                        else:
                            extra = ()
                        _gather.issue_block(kind, FP8_PITCH if fp8 else BF16_PITCH * 2, ROPE_PITCH * 2,
                                            f16=spec.f16_operands)(
                            cache, src.at[row, pl.ds(j * T, T)], dst, idx_smem.at[b], *extra)
                    if not deferred:
                        publish(b)
                    return n + 1

                n = lax.fori_loop(ranges[p][0], ranges[p][1], blk, n)

            if deferred:
                @pl.when(n >= 1)
                def _():
                    publish(buf(n + 1))

            # Observe the last phases too (every phase of a barrier must be awaited by its waiters).
            for k in range(NB):
                @pl.when(n - NB + k >= 0)
                def _():
                    plgpu.barrier_wait(free.at[buf(n - NB + k)])

        # ----------------------------------------------------------------- compute warpgroups
        def compute(w: int):
            plgpu.set_max_registers(compute_regs, action="increase")
            if has_fp8 and w == 1 and spec.interpret and not direct:
                w_smem[...] = _rope_combiner()
                plgpu.commit_smem()
            plgpu.barrier_wait(q_bar)
            if spec.f16_operands:
                # Q arrived as the bits of bf16 values: rewrite this warpgroup's half (the only one
                # it contracts) as f16. GPU: 16-byte chunks in place (inline PTX, elementwise: the
                # swizzle does not matter); interpreter: 64 dims at a time through registers.
                if spec.interpret:
                    for j in range(HALF // 64):
                        qj = q_smem.at[w, :, pl.ds(64 * j, 64)]
                        x = plgpu.load(qj, layout=plgpu.Layout.WGMMA)
                        qj[...] = _to_tile(lax.bitcast_convert_type(x, jnp.bfloat16).astype(jnp.float32),
                                           jnp.float16)
                else:
                    _gather.bf16_to_f16_in_place(HB * HALF * 2)(q_smem.at[w])
                plgpu.commit_smem()
            if has_sink:
                sink = plgpu.load(sink_smem, layout=_ROW)
            def exchange_scores(s_own, n):
                """S = S_0 + S_1 from this warpgroup's partial (its 256 dims) and the peer's. Both sum
                S_0 + S_1 in that order, so both hold bitwise-identical scores.

                Two buffers (`spec.xbufs`): both post their partial at once (x_post), read the other's
                and release the buffers (x_read), which the next block waits for before posting.
                One buffer (direct fp8 kernels, whose SMEM leaves room for one): wg 0 posts (x_post), wg 1
                takes it and posts its own (x_read), wg 0 takes that."""
                if spec.xbufs == 1:
                    if w == 0:
                        x_smem.at[0][...] = s_own
                        plgpu.barrier_arrive(x_post)
                        plgpu.barrier_wait(x_read)
                        return s_own + plgpu.load(x_smem.at[0], layout=plgpu.Layout.WGMMA)
                    plgpu.barrier_wait(x_post)
                    s_peer = plgpu.load(x_smem.at[0], layout=plgpu.Layout.WGMMA)
                    x_smem.at[0][...] = s_own
                    plgpu.barrier_arrive(x_read)
                    return s_peer + s_own

                @pl.when(n > 0)
                def _():
                    plgpu.barrier_wait(x_read)

                x_smem.at[w][...] = s_own
                plgpu.barrier_arrive(x_post)
                plgpu.barrier_wait(x_post)
                s_peer = plgpu.load(x_smem.at[1 - w], layout=plgpu.Layout.WGMMA)
                plgpu.barrier_arrive(x_read)
                return s_own + s_peer if w == 0 else s_peer + s_own

            def softmax_step(s, idx_col, m, l, o):
                """Online softmax over one block's scores: (P_hi, P_lo or None, O rescaled, m, l)."""
                vcol = lax.broadcast_in_dim(idx_col >= 0, (HB, T), [1])
                t = jnp.where(vcol, s * c2, -jnp.inf)
                m_new = jnp.maximum(m, t.max(axis=1))
                m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
                alpha = jnp.exp2(m - m_use)
                pexp = jnp.exp2(t - lax.broadcast_in_dim(m_use, (HB, T), [0]))
                l = l * alpha + pexp.sum(axis=1)
                o = o * lax.broadcast_in_dim(alpha, (HB, HALF), [0])
                if spec.f16_operands:  # one f16 P (11 bits; pexp <= 1)
                    return pexp.astype(jnp.float16), None, o, m_new, l
                # P V with P = P_hi + P_lo (two bf16 terms, ~2^-16 relative): a single bf16 P
                # (2^-9) misses FlashMLA's output tolerance on rows that mix large and small values.
                p_hi = pexp.astype(jnp.bfloat16)
                p_lo = (pexp - p_hi.astype(jnp.float32)).astype(jnp.bfloat16) if spec.p_split else None
                return p_hi, p_lo, o, m_new, l

            def stage_p(p_hi, p_lo):
                # The interpreter takes wgmma A operands from SMEM only: stage P there.
                a_smem.at[w, 0][...] = p_hi
                if p_lo is not None:
                    a_smem.at[w, 1][...] = p_lo
                plgpu.commit_smem()
                return a_smem.at[w, 0], (a_smem.at[w, 1] if p_lo is not None else None)

            o = plgpu.layout_cast(jnp.zeros((HB, HALF), jnp.float32), plgpu.Layout.WGMMA)
            m = plgpu.layout_cast(jnp.full((HB,), -jnp.inf, jnp.float32), _ROW)
            l = plgpu.layout_cast(jnp.zeros((HB,), jnp.float32), _ROW)
            n = jnp.int32(0)
            for p, pspec in enumerate(spec.pools):
                fp8 = pspec.fmt == "fp8_ds_mla"

                def blk(j, carry, fp8=fp8):
                    n, o, m, l = carry
                    b = buf(n)
                    plgpu.barrier_wait(full.at[b])
                    kb = k_smem.at[b] if direct else k_smem.at[0]

                    if not exchange and not direct:
                        @pl.when(n > 0)
                        def _():
                            plgpu.barrier_wait(k_free)

                    if spec.ablate == "no_compute":
                        plgpu.barrier_arrive(free.at[b])
                        return n + 1, o, m, l
                    idx_row = plgpu.load(idx_smem.at[b], layout=_ROW)
                    idx_col = plgpu.load(idx_smem.at[b], layout=_COL)
                    if not direct:
                        # the GPU gather zero-fills masked records; the interpreter's leaves them stale
                        vrow = lax.broadcast_in_dim(idx_row >= 0, (T, 64), [0]) if spec.interpret else None
                        if spec.ablate == "no_dequant":
                            pass
                        elif fp8:
                            _dequant_fp8(w, stage_u8, scale_smem, w_smem, kb, vrow, u_smem)
                        else:
                            _copy_bf16(w, stage_bf, kb, vrow)
                        plgpu.barrier_arrive(free.at[b])
                        plgpu.commit_smem()
                    if exchange:
                        # Each warpgroup contracts its own 256 dims; the two partial scores meet in SMEM.
                        def qk(acc):
                            plgpu.wgmma(acc, q_smem.at[w], kb.at[w].transpose((1, 0)))
                            return acc[...]

                        s = exchange_scores(pl.run_scoped(qk, plgpu.ACC((HB, T), jnp.float32)), n)
                    else:
                        if not direct:  # both halves of the K tile written
                            plgpu.barrier_arrive(k_ready)
                            plgpu.barrier_wait(k_ready)

                        def qk(acc):
                            plgpu.wgmma(acc, q_smem.at[0], kb.at[0].transpose((1, 0)))
                            plgpu.wgmma(acc, q_smem.at[1], kb.at[1].transpose((1, 0)))
                            return acc[...]

                        s = pl.run_scoped(qk, plgpu.ACC((HB, T), jnp.float32))
                    p_hi, p_lo, o, m_new, l = softmax_step(s, idx_col, m, l, o)
                    if spec.interpret:
                        # The interpreter cannot store into an accumulator either: add P V to O.
                        p_hi, p_lo = stage_p(p_hi, p_lo)

                        def pv(acc):
                            plgpu.wgmma(acc, p_hi, kb.at[w])
                            if p_lo is not None:
                                plgpu.wgmma(acc, p_lo, kb.at[w])
                            return acc[...]

                        o = o + pl.run_scoped(pv, plgpu.ACC((HB, HALF), jnp.float32))
                    else:
                        def pv(acc):
                            acc[...] = o
                            plgpu.wgmma(acc, p_hi, kb.at[w])
                            if p_lo is not None:
                                plgpu.wgmma(acc, p_lo, kb.at[w])
                            return acc[...]

                        o = pl.run_scoped(pv, plgpu.ACC((HB, HALF), jnp.float32))
                    if direct:
                        plgpu.barrier_arrive(free.at[b])  # P V has read the K tile
                    elif not exchange:
                        plgpu.barrier_arrive(k_free)
                    return n + 1, o, m_new, l

                n, o, m, l = lax.fori_loop(ranges[p][0], ranges[p][1], blk, (n, o, m, l))

            if not exchange and not direct:
                # Observe the last phase (every phase of a barrier must be awaited by its waiters).
                @pl.when(n > 0)
                def _():
                    plgpu.barrier_wait(k_free)

            if exchange and spec.xbufs == 2 and spec.ablate != "no_compute":
                @pl.when(n > 0)
                def _():
                    plgpu.barrier_wait(x_read)  # the last block's release

            # ------------------------------------------------------------------ epilogue
            empty = l == 0.0
            l_safe = jnp.where(empty, 1.0, l)
            lse = jnp.where(empty, jnp.inf if spec.final else -jnp.inf, (m + jnp.log2(l_safe)) * LN2)
            mx = jnp.where(empty, -jnp.inf, m * LN2)
            inv = 1.0 / l_safe
            if spec.final and has_sink:
                # out = (O / l) / (1 + exp(sink - lse)); sink = +inf -> 0, -inf -> 1.
                inv = inv / (1.0 + jnp.exp(sink - jnp.where(empty, 0.0, lse)))
            inv = jnp.where(empty, 0.0, inv)
            res = o * lax.broadcast_in_dim(inv, (HB, HALF), [0])
            if spec.final:
                out_ref.at[row, pl.ds(h0, HB), pl.ds(w * HALF, HALF)][...] = res.astype(jnp.bfloat16)
                if w == 0:
                    lse_ref.at[row, pl.ds(h0, HB)][...] = lse
                    mx_ref.at[row, pl.ds(h0, HB)][...] = mx
            else:
                out_ref.at[row, split, pl.ds(h0, HB), pl.ds(w * HALF, HALF)][...] = res
                if w == 0:
                    lse_ref.at[row, split, pl.ds(h0, HB)][...] = lse
                    mx_ref.at[row, split, pl.ds(h0, HB)][...] = mx

        @pl.when(wg == 0)
        def _c0():
            compute(0)

        @pl.when(wg == 1)
        def _c1():
            compute(1)

    NB = spec.nbuf
    if spec.direct:  # the interpreter stages fp8 records for the memory warpgroup's dequantization
        stage = plgpu.SMEM((T, FP8_PITCH), jnp.uint8) if has_fp8 and spec.interpret else None
    else:
        stage_types = []
        if has_fp8:
            stage_types.append(plgpu.SMEM((T, FP8_PITCH), jnp.uint8))
        if has_bf16:
            stage_types.append(plgpu.SMEM((T, BF16_PITCH), jnp.bfloat16))
        stage = plgpu.RefUnion(*stage_types) if len(stage_types) == 2 else stage_types[0]
    staged_no_x = not spec.qk_exchange and not spec.direct
    scratch = (
        plgpu.SMEM((2, HB, HALF), spec.dtype, transforms=(_TILE, _SWZ)),  # Q halves
        plgpu.SMEM((NB, 2, T, HALF), spec.dtype, transforms=(_TILE, _SWZ)),  # K tile halves (ring)
        stage,
        # per-group scale factors of the block: f32 [8, 64] (staged; interpreter), or the tokens' UE8M0
        # bytes [64, 8] (the GPU direct kernel reads them from the cache)
        (plgpu.SMEM((T, 8), jnp.uint8) if spec.scale_offsets else plgpu.SMEM((8, T), jnp.float32)) if has_fp8 else None,
        plgpu.SMEM((NB, T), jnp.int32),  # the block's sources (ring)
        # fp8: the RoPE combiner (interpreter) or the RoPE staging rows (GPU staged kernels: the gather
        # copies a record's RoPE bytes here, where they read as the bf16 values they are)
        (plgpu.SMEM((128, 64), jnp.bfloat16, transforms=(_TILE, _SWZ)) if spec.interpret
         else plgpu.SMEM((T, ROPE_PITCH), jnp.bfloat16)) if has_fp8 and (spec.interpret or not spec.direct) else None,
        plgpu.SMEM((HB,), jnp.float32) if has_sink else None,
        plgpu.Barrier(num_arrivals=3 if has_sink else 2),  # q_bar
        plgpu.Barrier(num_arrivals=1, num_barriers=NB),  # full: the memory warpgroup published a block
        plgpu.Barrier(num_arrivals=2, num_barriers=NB),  # free: both compute warpgroups released a buffer
        plgpu.Barrier(num_arrivals=2) if staged_no_x else None,  # k_ready
        plgpu.Barrier(num_arrivals=2) if staged_no_x else None,  # k_free
        # exchange of partial scores: f32 [64 heads, 64 tokens]
        plgpu.SMEM((spec.xbufs, HB, T), jnp.float32, transforms=(plgpu.TilingTransform((8, 32)), _SWZ))
        if spec.qk_exchange else None,
        # x_post / x_read (see exchange_scores): with two buffers each counts both warpgroups, with
        # one buffer x_post is wg 0's post and x_read wg 1's
        plgpu.Barrier(num_arrivals=spec.xbufs) if spec.qk_exchange else None,
        plgpu.Barrier(num_arrivals=spec.xbufs) if spec.qk_exchange else None,
        # interpreter only: wgmma A operands staged in SMEM (P per compute warpgroup, RoPE bytes)
        plgpu.SMEM((2, 2, HB, T), spec.dtype, transforms=(_TILE, _SWZ)) if spec.interpret else None,
        plgpu.SMEM((T, 128), jnp.bfloat16, transforms=(_TILE, _SWZ)) if spec.interpret and has_fp8 else None,
        # interpreter only: the Pallas-level gather's own barriers (sources; one arrival per copy)
        plgpu.Barrier(num_arrivals=1) if spec.interpret else None,
        plgpu.Barrier(num_arrivals=2 * T + 1 if spec.direct else T + 1) if spec.interpret else None,
    )
    if spec.final:
        out_type = (jax.ShapeDtypeStruct((R, Hp, D), jnp.bfloat16),
                    jax.ShapeDtypeStruct((R, Hp), jnp.float32),
                    jax.ShapeDtypeStruct((R, Hp), jnp.float32))
    else:
        out_type = (jax.ShapeDtypeStruct((R, NS, Hp, D), jnp.float32),
                    jax.ShapeDtypeStruct((R, NS, Hp), jnp.float32),
                    jax.ShapeDtypeStruct((R, NS, Hp), jnp.float32))
    return plgpu.kernel(
        sparse_mla_kernel,
        out_type=out_type,
        scratch_types=(scratch,),
        grid=(R * NS * HG,),
        grid_names=("cta",),
        num_threads=3,
        thread_name="wg",
        # no cross-warp reductions (the row max / sum stay within a warp): no reduction scratch, whose
        # 2 KiB default would leave no room for the second exchange buffer
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane,
                                             reduction_scratch_bytes=0),
    )


def _rope_combiner():
    """bf16 [128, 64]: W[2j, j] = 1, W[2j+1, j] = 256, else 0.

    For the RoPE bytes U (uint8 [64 tok, 128], as exact bf16 integers), U @ W = lo + 256 * hi,
    the bf16 bit pattern of each RoPE value, exact in the f32 accumulator.
    """
    r = plgpu.broadcasted_iota(jnp.int32, (128, 64), 0, layout=plgpu.Layout.WGMMA)
    c = plgpu.broadcasted_iota(jnp.int32, (128, 64), 1, layout=plgpu.Layout.WGMMA)
    one = jnp.full((128, 64), 1.0, jnp.float32)
    big = jnp.full((128, 64), 256.0, jnp.float32)
    zero = jnp.zeros((128, 64), jnp.float32)
    w = jnp.where((r // 2) == c, jnp.where((r % 2) == 0, one, big), zero)
    return w.astype(jnp.bfloat16)


def _dequant_fp8(w, stage_u8, scale_smem, w_smem, k_smem, vrow, u_smem):
    """K half w <- dequantized staged fp8_ds_mla records; masked rows 0.

    scale_smem: f32 [8, 64], group g's 2^(e - 127) per token (0 when masked). `vrow` None (the GPU
    path): the gather zero-filled the masked records, so no select is needed, and `w_smem` holds
    the RoPE values as bf16 rows (copied there as bytes); otherwise `w_smem` is the RoPE combiner
    and the RoPE bytes are read from the staged records."""
    groups = range(0, 4) if w == 0 else range(4, 7)
    for g in groups:
        scale_g = plgpu.load(scale_smem.at[g], layout=_ROW)  # [64] per token
        x8 = plgpu.load(stage_u8.at[:, pl.ds(64 * g, 64)], layout=plgpu.Layout.WGMMA)
        x = lax.bitcast_convert_type(x8, jnp.float8_e4m3fn).astype(jnp.float32)
        y = x * lax.broadcast_in_dim(scale_g, (T, 64), [0])
        if vrow is not None:
            y = jnp.where(vrow, y, jnp.zeros((T, 64), jnp.float32))
        k_smem.at[w, :, pl.ds(64 * (g - 4 * w), 64)][...] = _to_tile(y, k_smem.dtype)
    if w == 1 and vrow is None:  # (staged kernels only: bf16 tiles)
        k_smem.at[1, :, pl.ds(HALF - 64, 64)][...] = plgpu.load(w_smem.at[:, pl.ds(0, 64)], layout=plgpu.Layout.WGMMA)
    elif w == 1:
        ub = plgpu.load(stage_u8.at[:, pl.ds(NOPE, 128)], layout=plgpu.Layout.WGMMA)  # RoPE bytes
        u = ub.astype(jnp.float32).astype(jnp.bfloat16)

        # only the interpreter gets here (the GPU gather copies the RoPE rows): A operands from SMEM
        u_smem[...] = u
        plgpu.commit_smem()
        u = u_smem

        def comb(acc):
            plgpu.wgmma(acc, u, w_smem)
            return acc[...]

        bits = pl.run_scoped(comb, plgpu.ACC((T, 64), jnp.float32))
        y = lax.bitcast_convert_type(bits.astype(jnp.int32).astype(jnp.int16), jnp.bfloat16)
        if vrow is not None:
            y = jnp.where(vrow, y, jnp.zeros((T, 64), jnp.bfloat16))
        k_smem.at[1, :, pl.ds(HALF - 64, 64)][...] = _to_tile(y.astype(jnp.float32), k_smem.dtype)


def _to_tile(y, dtype):
    """f32 values -> the tile's element type, rounded once; f16 saturates at +-65504 (NaN stays NaN)."""
    if dtype == jnp.float16:
        return to_f16_saturating(y)
    return y.astype(dtype)


def _copy_bf16(w, stage_bf, k_smem, vrow):
    """K half w <- staged bf16 rows; masked rows 0 (`vrow` None: already zero-filled by the gather)."""
    for j in range(4):
        x = plgpu.load(stage_bf.at[:, pl.ds(w * HALF + 64 * j, 64)], layout=plgpu.Layout.WGMMA)
        if vrow is not None:
            x = jnp.where(vrow, x, jnp.zeros((T, 64), jnp.bfloat16))
        k_smem.at[w, :, pl.ds(64 * j, 64)][...] = x
