"""The memory warpgroup's token gather on the GPU: 16-byte `cp.async` copies issued by all 128 threads.

Pallas' own `copy_gmem_to_smem` issues one bulk copy at a time from an elected thread, behind a
warpgroup barrier and a 128-thread barrier arrival per copy; with one copy per token that loop
took ~190 cycles per token and, measured alone, 680 us of the 1270 us decode headline
(benchmarks/pallas_notes.md, section 6). Here every thread of the memory warpgroup issues its own
share of a 64-token block as 16-byte `cp.async.cg` copies, written with `plgpu.inline_mgpu`
(Mosaic GPU's escape hatch; this is the only use of it, and the interpreter cannot run it, so the
kernel keeps a Pallas-level formulation for interpret mode).

Work split: warp `w` of the memory warpgroup takes tokens w, w + 4, ..., w + 60; per token its 32
lanes copy consecutive 16-byte chunks (one coalesced 512 B request per instruction). Each lane
reads the token's source (byte offset / row number, -1 masked) itself from global memory. Masked
tokens copy with source size 0, which zero-fills the destination (required where the kernel feeds
the destination straight into a wgmma: a masked row must be 0, never stale or NaN).

Destinations:
- `fp8_stage`: the record's 448 NoPE bytes into row i (pitch `pitch` bytes) of the raw staging
  buffer, its 128 RoPE bytes into row i (pitch `rope_pitch` bytes) of a bf16 RoPE buffer (bytes in, bf16 values
  out: no conversion needed), and the block's scale factors (f32 [8, 64], prepared by XLA) into
  the scale buffer;
- `bf16_stage`: the 1 KiB row into row i (pitch `pitch`) of the staging buffer;
- `bf16_tile`: the 1 KiB row straight into row i of the two swizzled K halves [2, 64, 256] (bf16,
  (8, 64) tiles of 1 KiB, 128-byte swizzle: the 16 B chunk q of a 128 B line r goes to q ^ (r % 8)),
  i.e. the wgmma operand layout, so the compute warpgroups do no relayout.
Plus the block's 64 sources (256 B) into the index buffer, for the compute warpgroups' masks.

The copies are committed as one `cp.async` group; `wait_groups` waits for this thread's groups
(`cp.async.wait_group`), after which the caller fences and arrives on the block's barrier.
"""

from __future__ import annotations

import jax.experimental.pallas.mosaic_gpu as plgpu
from jax.experimental.mosaic.gpu import utils as mgu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, llvm

__all__ = ["issue_block", "wait_groups"]

_T = 64


def _i32(v):
    return arith.constant(ir.IntegerType.get_signless(32), v)


def _i64(v):
    return arith.constant(ir.IntegerType.get_signless(64), v)


def _addr64(ref):
    """Generic (global) address of a GMEM memref's first element, as i64."""
    return llvm.ptrtoint(ir.IntegerType.get_signless(64), mgu.memref_ptr(ref))


def _smem32(ref):
    """Shared-window address of an SMEM memref's first element, as i32."""
    return llvm.ptrtoint(ir.IntegerType.get_signless(32), mgu.memref_ptr(ref))


def _ld(n, addr64, volatile=False):
    """`n` (1, 2 or 4) 32-bit words from global memory as i32 values: the non-coherent path, or
    `volatile` (ptxas keeps volatile accesses in program order: see `_dequant_tile`)."""
    i32 = ir.IntegerType.get_signless(32)
    op = "ld.volatile.global" if volatile else "ld.global.nc"
    if n == 1:
        return [llvm.inline_asm(i32, [addr64], f"{op}.b32 $0, [$1];", "=r,l", has_side_effects=True)]
    ty = ir.Type.parse("!llvm.struct<(" + ", ".join(["i32"] * n) + ")>")
    outs = ", ".join(f"${k}" for k in range(n))
    cons = ",".join(["=r"] * n) + ",l"
    st = llvm.inline_asm(ty, [addr64], f"{op}.v{n}.b32 {{{outs}}}, [${n}];", cons, has_side_effects=True)
    return [llvm.extractvalue(i32, st, [k]) for k in range(n)]


def _e4m3x2_to_bf16x2(pair16, scale):
    """Two e4m3 bytes (i16, low byte first) times an f32 scale -> bf16x2 (i32, low element first).

    e4m3 -> f16 is exact (hardware cvt), f16 -> f32 exact, the product is rounded once to bf16:
    the same value as the reference's f32 dequantization rounded to bf16 (NaN codes stay NaN)."""
    i32 = ir.IntegerType.get_signless(32)
    asm = ("{\n.reg .b32 h;\n.reg .b16 l, u;\n.reg .f32 fl, fu;\n"
           "cvt.rn.f16x2.e4m3x2 h, $1;\nmov.b32 {l, u}, h;\n"
           "cvt.f32.f16 fl, l;\ncvt.f32.f16 fu, u;\n"
           "mul.f32 fl, fl, $2;\nmul.f32 fu, fu, $2;\n"
           "cvt.rn.bf16x2.f32 $0, fu, fl;\n}")
    return llvm.inline_asm(i32, [pair16, scale], asm, "=r,h,f", has_side_effects=False)


def _st_v4(dst32, words):
    llvm.inline_asm(ir.Type.parse("!llvm.void"), [dst32, *words], "st.volatile.shared.v4.b32 [$0], {$1, $2, $3, $4};",
                    "r,r,r,r,r", has_side_effects=True)


def _cp16(dst32, src64, nbytes32):
    """cp.async of 16 B; `nbytes32` (0 or 16) bytes are read, the rest zero-filled."""
    llvm.inline_asm(ir.Type.parse("!llvm.void"), [dst32, src64, nbytes32],
                    "cp.async.cg.shared.global [$0], [$1], 16, $2;", "r,l,r", has_side_effects=True)


def _cp16_if(pred, dst32, src64, nbytes32=None):
    """`_cp16` by the threads whose `pred` (i32) is nonzero."""
    nbytes32 = nbytes32 if nbytes32 is not None else _i32(16)
    llvm.inline_asm(ir.Type.parse("!llvm.void"), [pred, dst32, src64, nbytes32],
                    "{\n.reg .pred p;\nsetp.ne.b32 p, $0, 0;\n@p cp.async.cg.shared.global [$1], [$2], 16, $3;\n}",
                    "r,r,l,r", has_side_effects=True)


def issue_block(kind: str, pitch: int = 0, rope_pitch: int = 0, batch: int = 4):
    """Returns `f(cache, src_blk, dst, idx_dst[, scales_blk, scale_dst, rope_dst])` for `plgpu` code
    (memory warpgroup).

    cache: the pool's GMEM operand (fp8: uint8 bytes; bf16: [rows, 512]); src_blk: int32 [64], this
    block's sources; dst: the staging buffer (`*_stage`) or the K buffer [2, 64, 256] (`bf16_tile`);
    idx_dst: int32 [64] SMEM; fp8 only: scales_blk f32 [8, 64] (GMEM), scale_dst (SMEM) and rope_dst
    (SMEM bf16 rows of `rope_pitch` bytes).
    """
    if kind not in ("fp8_stage", "bf16_stage", "bf16_tile", "fp8_tile"):
        raise ValueError(f"kind must be fp8_stage, bf16_stage, bf16_tile or fp8_tile, got {kind!r}")
    types = [plgpu.RefType()] * {"fp8_stage": 7, "fp8_tile": 5}.get(kind, 4)
    if kind in ("bf16_tile", "fp8_tile"):  # the K ring buffer carries the kernel's tiling and swizzle
        types[2] = plgpu.RefType(transforms=(plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)))

    @plgpu.inline_mgpu(arg_types=tuple(types))
    def issue(ctx, cache, src_blk, dst, idx_dst, *fp8_refs):
        del ctx
        i32 = ir.IntegerType.get_signless(32)
        i64 = ir.IntegerType.get_signless(64)
        tid = arith.andi(mgu.thread_idx(), _i32(127))
        lane = arith.andi(tid, _i32(31))
        warp = arith.shrui(tid, _i32(5))
        cache64 = _addr64(cache)
        src64 = _addr64(src_blk)
        dst32 = _smem32(dst)
        lane16 = arith.muli(lane, _i32(16))
        lane16_64 = arith.extui(i64, lane16)
        tid16 = arith.muli(tid, _i32(16))
        tid16_64 = arith.extui(i64, tid16)
        # The block's sources for the compute warpgroups: 16 threads x 16 B.
        _cp16_if(arith.extui(i32, arith.cmpi(arith.CmpIPredicate.ult, tid, _i32(16))),
                 arith.addi(_smem32(idx_dst), tid16), arith.addi(src64, tid16_64))
        if kind == "fp8_stage":
            rope32 = _smem32(fp8_refs[2])
            # the block's scale factors (f32 [8, 64] = 2 KiB): 16 B per thread
            _cp16(arith.addi(_smem32(fp8_refs[1]), tid16), arith.addi(_addr64(fp8_refs[0]), tid16_64), _i32(16))
        if kind == "fp8_tile":
            _dequant_tile(fp8_refs[0], cache64, src64, dst32, lane, warp, batch)
            llvm.inline_asm(ir.Type.parse("!llvm.void"), [], "cp.async.commit_group;", "", has_side_effects=True)
            return
        for k in range(_T // 4):
            tok = arith.addi(warp, _i32(4 * k))
            off = _ld(1, arith.addi(src64, arith.extui(i64, arith.muli(tok, _i32(4)))))[0]
            valid = arith.cmpi(arith.CmpIPredicate.sge, off, _i32(0))
            nbytes = arith.select(valid, _i32(16), _i32(0))
            if kind == "fp8_stage":
                base = arith.select(valid, arith.extsi(i64, off), _i64(0))
                g = arith.addi(cache64, base)
                row = arith.addi(dst32, arith.muli(tok, _i32(pitch)))
                rope = arith.addi(rope32, arith.muli(tok, _i32(rope_pitch)))  # the RoPE row
                # chunk `lane` (bytes 0..511): NoPE chunks 0..27 to the staging row, RoPE chunks 0..3
                # (lanes 28..31) to the RoPE row; masked records are zero-filled
                nope = arith.cmpi(arith.CmpIPredicate.ult, lane, _i32(28))
                d = arith.select(nope, arith.addi(row, lane16), arith.addi(rope, arith.subi(lane16, _i32(448))))
                _cp16(d, arith.addi(g, lane16_64), nbytes)
                # RoPE chunks 4..7 (bytes 512..575) by lanes 0..3
                tail = arith.cmpi(arith.CmpIPredicate.ult, lane, _i32(4))
                _cp16_if(arith.extui(i32, tail), arith.addi(rope, arith.addi(lane16, _i32(64))),
                         arith.addi(g, arith.addi(lane16_64, _i64(512))), nbytes)
            else:
                base = arith.muli(arith.select(valid, arith.extsi(i64, off), _i64(0)), _i64(1024))
                g = arith.addi(cache64, base)
                if kind == "bf16_stage":  # chunk `lane` of the row's half 0 in the staging row
                    d0 = arith.addi(arith.addi(dst32, arith.muli(tok, _i32(pitch))), lane16)
                else:
                    # half 0: tile (tok // 8, lane // 8), line tok % 8, chunk (lane % 8) ^ (tok % 8)
                    r = arith.andi(tok, _i32(7))
                    tile = arith.addi(arith.muli(arith.shrui(tok, _i32(3)), _i32(4)), arith.shrui(lane, _i32(3)))
                    q = arith.xori(arith.andi(lane, _i32(7)), r)
                    d0 = arith.addi(dst32, arith.muli(tile, _i32(1024)))
                    d0 = arith.addi(d0, arith.addi(arith.muli(r, _i32(128)), arith.muli(q, _i32(16))))
                # half h (dims [256 h + 8 lane, +8)): 512 B further in a staging row, 32 KiB (the
                # other K half) further in the tile
                half_step = 512 if kind == "bf16_stage" else _T * 256 * 2
                for h in range(2):
                    src = arith.addi(g, arith.addi(lane16_64, _i64(512 * h)))
                    _cp16(arith.addi(d0, _i32(half_step * h)), src, nbytes)
        llvm.inline_asm(ir.Type.parse("!llvm.void"), [], "cp.async.commit_group;", "", has_side_effects=True)

    return issue


def _tile_dst(dst32, h, tok, lane):
    """Shared address of chunk `lane` (dims 8 lane .. 8 lane + 7 of half h) of row `tok` of a K buffer
    [2, 64, 256] bf16: (8, 64) tiles of 1 KiB, 128-byte swizzle (16-byte chunk q of line r at q ^ (r % 8))."""
    r = arith.andi(tok, _i32(7))
    tile = arith.addi(arith.muli(arith.shrui(tok, _i32(3)), _i32(4)), arith.shrui(lane, _i32(3)))
    q = arith.xori(arith.andi(lane, _i32(7)), r)
    d = arith.addi(dst32, _i32(h * _T * 256 * 2))
    d = arith.addi(d, arith.muli(tile, _i32(1024)))
    return arith.addi(d, arith.addi(arith.muli(r, _i32(128)), arith.muli(q, _i32(16))))


def _dequant_tile(scales_ref, cache64, src64, dst32, lane, warp, batch):
    """fp8_ds_mla records of the block -> bf16 rows of the K buffer, in registers.

    Warp w takes tokens w, w + 4, ...; lane l produces chunk l of half 0 (NoPE dims 8 l.., record
    bytes 8 l.., group l // 8) and chunk l of half 1: NoPE dims 256 + 8 l (bytes 256 + 8 l, group
    4 + l // 8) for l < 24, else the RoPE dims 448 + 8 (l - 24), whose 16 record bytes at
    448 + 16 (l - 24) are already bf16. Scale factors: f32 [8 groups, 64 tokens] (XLA, 0 when
    masked). Masked tokens store zeros (their loads read the cache's first record, then discarded).
    Tokens go in batches of `batch` per warp whose loads are in flight together."""
    i32 = ir.IntegerType.get_signless(32)
    i64 = ir.IntegerType.get_signless(64)
    i16 = ir.IntegerType.get_signless(16)
    f32 = ir.F32Type.get()
    sc64 = _addr64(scales_ref)
    g0 = arith.shrui(lane, _i32(3))
    rope = arith.cmpi(arith.CmpIPredicate.uge, lane, _i32(24))
    # record byte offsets of this lane's loads (every load 8- or 16-byte aligned and inside the
    # 576-byte record): half 0's 8 NoPE bytes at 8 l; half 1 one 16-byte load: for l < 24 the aligned
    # 16 bytes holding NoPE bytes 256 + 8 l (words 0-1 for even l, 2-3 for odd l), for l >= 24 the
    # RoPE bytes at 16 l + 64
    o0 = arith.extui(i64, arith.muli(lane, _i32(8)))
    o1 = arith.extui(i64, arith.select(rope, arith.addi(arith.muli(lane, _i32(16)), _i32(64)),
                                       arith.addi(arith.muli(arith.shrui(lane, _i32(1)), _i32(16)), _i32(256))))
    odd = arith.cmpi(arith.CmpIPredicate.ne, arith.andi(lane, _i32(1)), _i32(0))
    s0_off = arith.muli(g0, _i32(256))  # group g0's row of the scale block (64 f32)
    s1_off = arith.muli(arith.addi(g0, _i32(4)), _i32(256))
    zero = _i32(0)
    def sources(first):
        toks = [arith.addi(warp, _i32(4 * k)) for k in range(first, first + batch)]
        return toks, [_ld(1, arith.addi(src64, arith.extui(i64, arith.muli(tok, _i32(4)))), True)[0] for tok in toks]

    # One batch's sources ahead (all 16 at once would not fit the memory warpgroup's registers), so
    # that a batch's record loads do not wait for its source loads.
    nxt = sources(0)
    for first in range(0, _T // 4, batch):
        toks, offs = nxt
        loaded = []
        for tok, off in zip(toks, offs):
            valid = arith.cmpi(arith.CmpIPredicate.sge, off, zero)
            rec = arith.addi(cache64, arith.select(valid, arith.extsi(i64, off), _i64(0)))
            tok4 = arith.muli(tok, _i32(4))
            sc0 = _ld(1, arith.addi(sc64, arith.extui(i64, arith.addi(s0_off, tok4))), True)[0]
            sc1 = _ld(1, arith.addi(sc64, arith.extui(i64, arith.addi(s1_off, tok4))), True)[0]
            d0 = _ld(2, arith.addi(rec, o0), True)
            d1 = _ld(4, arith.addi(rec, o1), True)
            loaded.append((tok, valid, sc0, sc1, d0, d1))
        if first + batch < _T // 4:
            nxt = sources(first + batch)
        for tok, valid, sc0, sc1, d0, d1 in loaded:
            def conv(word, sc):
                lo = arith.trunci(i16, word)
                hi = arith.trunci(i16, arith.shrui(word, _i32(16)))
                f = llvm.bitcast(f32, sc)
                return [_e4m3x2_to_bf16x2(lo, f), _e4m3x2_to_bf16x2(hi, f)]

            w0 = conv(d0[0], sc0) + conv(d0[1], sc0)
            n0, n1 = arith.select(odd, d1[2], d1[0]), arith.select(odd, d1[3], d1[1])
            w1n = conv(n0, sc1) + conv(n1, sc1)
            w1 = [arith.select(rope, d1[k], w1n[k]) for k in range(4)]
            w0 = [arith.select(valid, x, zero) for x in w0]
            w1 = [arith.select(valid, x, zero) for x in w1]
            _st_v4(_tile_dst(dst32, 0, tok, lane), w0)
            _st_v4(_tile_dst(dst32, 1, tok, lane), w1)


def wait_groups(pending: int):
    """`cp.async.wait_group pending` for the calling threads (0: all of this thread's copies landed)."""

    @plgpu.inline_mgpu()
    def wait(ctx):
        del ctx
        llvm.inline_asm(ir.Type.parse("!llvm.void"), [], f"cp.async.wait_group {pending};", "",
                        has_side_effects=True)

    return wait
