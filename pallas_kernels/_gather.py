"""The memory warpgroup's token gather on the GPU: 16-byte `cp.async` copies issued by all 128 threads.

Pallas' own `copy_gmem_to_smem` issues one bulk copy at a time from an elected thread, behind a
warpgroup barrier and a 128-thread barrier arrival per copy: with one copy per token that bounds
decode (docs/pallas_kernels.md). Here every thread of the memory warpgroup issues its own share
of a 64-token block as 16-byte `cp.async.cg` copies (and, for fp8 scale bytes, 8-byte
`cp.async.ca`), written with `plgpu.inline_mgpu` (Mosaic GPU's escape hatch; the interpreter
cannot run it, so the kernel keeps a Pallas-level formulation for interpret mode).

Work split: warp `w` of the memory warpgroup takes tokens w, w + 4, ..., w + 60; per token its 32
lanes copy consecutive 16-byte chunks (one coalesced 512 B request per instruction). Each lane
reads the token's source (record index in 576-byte units / row number, -1 masked) itself from global memory (fp8:
lane l loads token w + 4 (l % 16)'s and the warp shuffles them). Masked tokens copy with source
size 0, which zero-fills the destination (required: the destination feeds a wgmma unselected, so
a masked row must be 0, never stale or NaN).

Destination: the K tile, two swizzled halves [2, 64, 256] ((8, 64) tiles of 1 KiB, 128-byte
swizzle: the 16 B chunk q of a 128 B line r goes to q ^ (r % 8)), i.e. the wgmma operand layout,
so the compute warpgroups do no relayout:
- bf16 rows: the 1 KiB row straight into row i;
- quantized records (fp8_ds_mla, mxfp8_ds_mla, nvfp4_ds_mla): copied into the same tile and converted
  there before the issue returns (`_fp8_in_place`, `_v41_in_place`): the dequantization stays out of the
  compute warpgroups, and no registers are held while the copies are in flight (records loaded into
  registers get each load scheduled next to its use by ptxas, one record in flight per warp).
Plus the block's 64 sources (256 B) into the index buffer, for the compute warpgroups' masks.

The copies are committed as one `cp.async` group (quantized records: four, all landed when it returns);
`wait_groups` waits for this thread's groups (`cp.async.wait_group`), after which the caller fences
and arrives on the block's barrier.
"""

from __future__ import annotations

import jax.experimental.pallas.mosaic_gpu as plgpu
from jax.experimental.mosaic.gpu import utils as mgu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, llvm

from dsv41_jax import kv_cache as kvc
from pallas_kernels._spec import HALF, QUANTIZED_FORMATS, SWIZZLE, TILE, T

FP8_RECORD = kvc.layout("fp8_ds_mla").data_bytes  # an fp8_ds_mla record's data bytes (scales apart)

__all__ = ["issue_block", "wait_groups", "bf16_to_f16_in_place"]


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


def _ld_b32(addr64):
    return llvm.inline_asm(ir.IntegerType.get_signless(32), [addr64], "ld.global.nc.b32 $0, [$1];", "=r,l",
                           has_side_effects=True)


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


def _token_f16_asm() -> str:
    """PTX of `_e4m3_token_f16`: outputs $0..$7, inputs $8..$11 (words), $12, $13 (e0, e1), $14 (low)."""
    lines = [
        "{", ".reg .b32 s0, s1, t0, t1, h;", ".reg .b16 a, b, c, d;", ".reg .f32 x, y, f0, f1;", ".reg .pred p, q;",
        "sub.s32 t0, $12, 112;", "shl.b32 s0, t0, 10;", "prmt.b32 s0, s0, 0, 0x1010;",
        "sub.s32 t1, $13, 112;", "shl.b32 s1, t1, 10;", "prmt.b32 s1, s1, 0, 0x1010;",
        "sub.s32 t0, t0, 1;", "setp.gt.u32 p, t0, 21;", "sub.s32 t1, t1, 1;", "setp.gt.u32 q, t1, 21;",
        "setp.ne.and.b32 q, $14, 0, q;", "or.pred p, p, q;", "vote.sync.any.pred p, p, -1;", "@p bra SLOW;",
    ]
    for i in range(4):  # fast: word i -> outputs 2 i, 2 i + 1
        s = "s0" if i < 2 else "s1"
        lines += [f"mov.b32 {{a, b}}, ${8 + i};",
                  "cvt.rn.f16x2.e4m3x2 h, a;", f"mul.rn.f16x2 ${2 * i}, h, {s};",
                  "cvt.rn.f16x2.e4m3x2 h, b;", f"mul.rn.f16x2 ${2 * i + 1}, h, {s};"]
    lines += ["bra DONE;", "SLOW:", "shl.b32 t0, $12, 23;", "mov.b32 f0, t0;", "shl.b32 t1, $13, 23;",
              "mov.b32 f1, t1;"]
    for i in range(4):
        f = "f0" if i < 2 else "f1"
        lines.append(f"mov.b32 {{a, b}}, ${8 + i};")
        for j, half in enumerate("ab"):
            lines += [f"cvt.rn.f16x2.e4m3x2 h, {half};", "mov.b32 {c, d}, h;", "cvt.f32.f16 x, c;", "cvt.f32.f16 y, d;",
                      f"mul.f32 x, x, {f};", f"mul.f32 y, y, {f};", f"cvt.rn.satfinite.f16x2.f32 ${2 * i + j}, y, x;"]
    lines += ["DONE:", "}"]  # labels are local to the braces: the block may be inlined many times
    return "\n".join(lines)


def _e4m3_token_f16(words, e0, e1, low):
    """One token's conversion by one lane in f16 mode: `words` (i32 x 4: 8 e4m3 of half 0, then 8 of
    half 1) times 2^(e0 - 127) and 2^(e1 - 127) (the UE8M0 bytes, i32) -> 8 f16x2 words (i32, low
    element first), half 0's then half 1's (`low` nonzero: the lane's half-1 bytes are NoPE values;
    zero: ignored, and so is e1).

    Fast path, when every lane's exponents lie in [113, 134] (scale and products normal f16 numbers,
    the products at most 448 * 2^7: every scale the quantizer writes for tiles of amax in [0.014,
    28672]): e4m3x2 -> f16x2 (exact) times the f16x2 scale, rounded once. Otherwise (the warp votes)
    the f32 path: x * 2^(e - 127) in f32 (e = 0 -> 0), rounded once to f16, saturated to +-65504.
    Both give the reference's f32 value rounded to f16."""
    i32 = ir.IntegerType.get_signless(32)
    ty = ir.Type.parse("!llvm.struct<(" + ", ".join(["i32"] * 8) + ")>")
    st = llvm.inline_asm(ty, [*words, e0, e1, low], _token_f16_asm(), ",".join(["=r"] * 8 + ["r"] * 7),
                         has_side_effects=True)
    return [llvm.extractvalue(i32, st, [k]) for k in range(8)]


def _chunk_f16_asm() -> str:
    """PTX of `_chunk_to_f16`: input $0, the chunk's shared address."""
    lines = ["{", ".reg .b32 w<4>, o<4>;", ".reg .f32 l, h;", "ld.shared.v4.b32 {w0, w1, w2, w3}, [$0];"]
    for i in range(4):  # bf16 -> f32 is a 16-bit shift
        lines += [f"shl.b32 l, w{i}, 16;", f"and.b32 h, w{i}, 0xffff0000;",
                  f"cvt.rn.satfinite.f16x2.f32 o{i}, h, l;"]
    lines += ["st.shared.v4.b32 [$0], {o0, o1, o2, o3};", "}"]
    return "\n".join(lines)


def _chunk_to_f16(addr32):
    """The 16-byte chunk at `addr32` (8 bf16: fp8 records' RoPE values, Q) rewritten in place as 8
    f16: each value rounded once, saturated to +-65504."""
    llvm.inline_asm(ir.Type.parse("!llvm.void"), [addr32], _chunk_f16_asm(), "r", has_side_effects=True)


def _st_v4(dst32, words):
    llvm.inline_asm(ir.Type.parse("!llvm.void"), [dst32, *words], "st.shared.v4.b32 [$0], {$1, $2, $3, $4};",
                    "r,r,r,r,r", has_side_effects=True)


def _cp16(dst32, src64, nbytes32):
    """cp.async of 16 B; `nbytes32` (0 or 16) bytes are read, the rest zero-filled."""
    llvm.inline_asm(ir.Type.parse("!llvm.void"), [dst32, src64, nbytes32],
                    "cp.async.cg.shared.global [$0], [$1], 16, $2;", "r,l,r", has_side_effects=True)


def _if(pred, instr, operands, constraints):
    """The PTX instruction `instr` (operands $1.., constraints without the predicate's) by the threads
    whose `pred` (i32) is nonzero."""
    llvm.inline_asm(ir.Type.parse("!llvm.void"), [pred, *operands],
                    "{\n.reg .pred p;\nsetp.ne.b32 p, $0, 0;\n@p " + instr + "\n}", "r," + constraints,
                    has_side_effects=True)


def _cp16_if(pred, dst32, src64, nbytes32=None):
    """`_cp16` by the threads whose `pred` (i32) is nonzero."""
    nbytes32 = nbytes32 if nbytes32 is not None else _i32(16)
    _if(pred, "cp.async.cg.shared.global [$1], [$2], 16, $3;", [dst32, src64, nbytes32], "r,l,r")


def _commit():
    llvm.inline_asm(ir.Type.parse("!llvm.void"), [], "cp.async.commit_group;", "", has_side_effects=True)


def _wait(pending: int):
    llvm.inline_asm(ir.Type.parse("!llvm.void"), [], f"cp.async.wait_group {pending};", "", has_side_effects=True)


def _record(cache64, valid, index, unit: int):
    """Global address of the record of `index` (in units of `unit` data bytes; 64-bit arithmetic: any cache
    size); the cache's start when masked (never read: its copies are zero-filled or predicated off)."""
    i64 = ir.IntegerType.get_signless(64)
    return arith.addi(cache64, arith.muli(arith.select(valid, arith.extsi(i64, index), _i64(0)), _i64(unit)))


def _past(addr64, valid, delta):
    """`addr64 + delta` (a small int32 byte distance), or `addr64` when masked."""
    return arith.addi(addr64, arith.select(valid, arith.extsi(ir.IntegerType.get_signless(64), delta), _i64(0)))


def issue_block(kv_format: str, f16: bool = False, scale_pitch: int = 0):
    """Returns `f(cache, src_blk, dst, idx_dst, *fp8_refs)` for `plgpu` code (memory warpgroup).

    cache: the pool's GMEM operand (quantized formats: uint8 bytes; bf16: [rows, 512]); src_blk: int32
    [64], this block's sources; dst: the K buffer [2, 64, 256]; idx_dst: int32 [64] SMEM. scale_refs
    (quantized formats): the block's scale bytes' distances from their records int32 [64] (GMEM), scale_dst
    uint8 [64, scale_pitch] (SMEM, at least the format's scale bytes), and the next block's sources and scale
    distances (GMEM, for the L2 prefetch). `f16`: the K tile holds float16 (records and fp8_ds_mla's RoPE
    values are converted to f16; bf16 row pools are copied as they are, so the caller gives f16 rows).
    """
    if kv_format not in ("bf16",) + QUANTIZED_FORMATS:
        raise ValueError(f"kv_format must be one of {['bf16', *QUANTIZED_FORMATS]}, got {kv_format!r}")
    quant = kv_format != "bf16"
    if quant and scale_pitch < kvc.layout(kv_format).scale_bytes:
        raise ValueError(f"scale_pitch must be at least {kv_format}'s {kvc.layout(kv_format).scale_bytes} scale "
                         f"bytes, got {scale_pitch}")
    types = [plgpu.RefType()] * (8 if quant else 4)
    # the K ring buffer carries the kernel's tiling and swizzle
    types[2] = plgpu.RefType(transforms=(TILE, SWIZZLE))

    @plgpu.inline_mgpu(arg_types=tuple(types))
    def issue(ctx, cache, src_blk, dst, idx_dst, *scale_refs):
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
        if quant:
            args = (cache64, src64, _addr64(scale_refs[0]), _addr64(scale_refs[2]), _addr64(scale_refs[3]),
                    dst32, _smem32(scale_refs[1]), lane, warp, f16, scale_pitch)
            if kv_format == "fp8_ds_mla":
                _fp8_in_place(*args)
            else:
                _v41_in_place(kv_format, *args)
            return
        tile_base = _row_base(dst32, 0, warp, lane)
        for k in range(T // 4):
            tok = arith.addi(warp, _i32(4 * k))
            off = _ld_b32(arith.addi(src64, arith.extui(i64, arith.muli(tok, _i32(4)))))
            valid = arith.cmpi(arith.CmpIPredicate.sge, off, _i32(0))
            nbytes = arith.select(valid, _i32(16), _i32(0))
            base = arith.muli(arith.select(valid, arith.extsi(i64, off), _i64(0)), _i64(1024))
            g = arith.addi(cache64, base)
            d0 = _row_at(tile_base, k)  # chunk `lane` of half 0 of K row tok (swizzled)
            for h in range(2):  # half h (dims [256 h + 8 lane, +8)): the other K half is 32 KiB further
                src = arith.addi(g, arith.addi(lane16_64, _i64(512 * h)))
                _cp16(arith.addi(d0, _i32(T * HALF * 2 * h)), src, nbytes)
        _commit()

    return issue


def _row_base(dst32, h, warp, c):
    """Shared address of 16-byte chunk `c` (dims 8 c .. 8 c + 7 of half h) of row tok = warp + 4 k of
    a K buffer [2, 64, 256] bf16 ((8, 64) tiles of 1 KiB, 128-byte swizzle: chunk q of line r at
    q ^ (r % 8)), as a base that `_row_at` turns into any k's address: for warp < 4, tok // 8 = k // 2
    (a tile row: 4 KiB) and tok % 8 = warp + 4 (k % 2); the odd line r + 4 moves the chunk 512 B
    down and flips bit 2 of its swizzled position: address ^ 0x240 (the buffer is 1 KiB aligned)."""
    q = arith.xori(arith.andi(c, _i32(7)), warp)
    d = arith.addi(dst32, _i32(h * T * HALF * 2))
    d = arith.addi(d, arith.muli(arith.shrui(c, _i32(3)), _i32(1024)))
    return arith.addi(d, arith.addi(arith.muli(warp, _i32(128)), arith.muli(q, _i32(16))))


def _row_at(base, k):
    """`_row_base`'s address for row tok = warp + 4 k: k an int (constants folded) or an i32 value."""
    if isinstance(k, int):
        b = arith.xori(base, _i32(0x240)) if k % 2 else base
        return arith.addi(b, _i32((k // 2) * 4096)) if k >= 2 else b
    b = arith.xori(base, arith.muli(arith.andi(k, _i32(1)), _i32(0x240)))
    return arith.addi(b, arith.muli(arith.shrui(k, _i32(1)), _i32(4096)))


def _shfl(value, src_lane):
    return llvm.inline_asm(ir.IntegerType.get_signless(32), [value, src_lane],
                           "shfl.sync.idx.b32 $0, $1, $2, 31, -1;", "=r,r,r", has_side_effects=True)


def _lds(n, addr32):
    """`n` (1 or 2) 32-bit words from shared memory."""
    i32 = ir.IntegerType.get_signless(32)
    if n == 1:
        return [llvm.inline_asm(i32, [addr32], "ld.shared.b32 $0, [$1];", "=r,r", has_side_effects=True)]
    ty = ir.Type.parse("!llvm.struct<(i32, i32)>")
    st = llvm.inline_asm(ty, [addr32], "ld.shared.v2.b32 {$0, $1}, [$2];", "=r,=r,r", has_side_effects=True)
    return [llvm.extractvalue(i32, st, [k]) for k in range(2)]


def _lds_u8(addr32):
    """One byte from shared memory, zero-extended to i32."""
    return llvm.inline_asm(ir.IntegerType.get_signless(32), [addr32], "ld.shared.u8 $0, [$1];", "=r,r",
                           has_side_effects=True)


def _warp_sync():
    llvm.inline_asm(ir.Type.parse("!llvm.void"), [], "bar.warp.sync -1;", "", has_side_effects=True)


def _block_sources(src64, ssrc64, next64, snext64, lane, warp):
    """(sources, scale distances, next block's sources, next scale distances): lane l (mod 16) holds those of
    token w + 4 (l % 16), read by each lane itself; `_shfl` hands token w + 4 k's to the warp."""
    i64 = ir.IntegerType.get_signless(64)
    my_tok4 = arith.extui(i64, arith.muli(arith.addi(warp, arith.muli(arith.andi(lane, _i32(15)), _i32(4))),
                                          _i32(4)))
    return tuple(_ld_b32(arith.addi(a, my_tok4)) for a in (src64, ssrc64, next64, snext64))


def _bf16_pairs(word, sc):
    """4 e4m3 bytes (i32) times the f32 scale of bits `sc` -> 2 bf16x2 words."""
    i16 = ir.IntegerType.get_signless(16)
    f = llvm.bitcast(ir.F32Type.get(), sc)
    lo = arith.trunci(i16, word)
    hi = arith.trunci(i16, arith.shrui(word, _i32(16)))
    return [_e4m3x2_to_bf16x2(lo, f), _e4m3x2_to_bf16x2(hi, f)]


def _e4m3_lane(words, e, f16: bool, low):
    """One lane's 16 e4m3 bytes (`words`: half 0's 8, then half 1's) times 2^(e - 127) of its UE8M0 bytes
    e = (half 0's, half 1's) -> 8 f16x2 (`_e4m3_token_f16`, `low` as there) or bf16x2 words."""
    if f16:
        return _e4m3_token_f16(words, e[0], e[1], low)
    sc0, sc1 = (arith.shli(x, _i32(23)) for x in e)  # 2^(e - 127) as f32 bits (e = 0 -> 0)
    return _bf16_pairs(words[0], sc0) + _bf16_pairs(words[1], sc0) + _bf16_pairs(words[2], sc1) + \
        _bf16_pairs(words[3], sc1)


def _token_bytes(k, raw0, raw1, nwords: int, s0_off, s1_off, pitch: int):
    """Token k's raw words (`nwords` of half 0, then of half 1) and its two scale bytes (i32)."""
    words = _lds(nwords, _row_at(raw0, k)) + _lds(nwords, _row_at(raw1, k))
    return words, [_lds_u8(arith.addi(s0_off, _i32(4 * pitch * k))), _lds_u8(arith.addi(s1_off, _i32(4 * pitch * k)))]


def _await_group(k: int, per: int) -> bool:
    """Before token k's reads: wait for its commit group when k opens one (True then)."""
    if k % per:
        return False
    _wait(_GROUPS - 1 - k // per)
    _warp_sync()  # this warp's tokens of the group (copied by its own lanes) visible
    return True


def _convert_tokens(load, convert, store):
    """The warp's 16 tokens: load(k) -> convert(*loaded) -> store(k, words), software-pipelined by one token:
    token k + 1's reads (another row) are issued before token k's conversion, so their latency overlaps it
    (each warp has one token chain otherwise)."""
    nxt = load(0)
    for k in range(T // 4):
        cur = nxt
        if k + 1 < T // 4:
            nxt = load(k + 1)
        w = convert(*cur)
        _warp_sync()  # every lane has read token k's raw bytes before any lane overwrites them
        store(k, w)


_GROUPS = 4  # cp.async groups per fp8 block: the conversion of one overlaps the later ones' copies
assert (T // 4 // _GROUPS) % 4 == 0  # f16: a group's RoPE chunks (8 per token) cover the warp's lanes


def _fp8_in_place(cache64, src64, ssrc64, next64, snext64, dst32, sc_smem32, lane, warp, f16, pitch):
    """fp8_ds_mla records of the block -> bf16 rows of the K buffer, converted in place.

    Warp w takes tokens w, w + 4, ... . Copies (`cp.async`, so that all 64 records are in flight
    without holding registers): record chunk c < 28 (NoPE bytes 16 c ..) into chunk c of the
    token's own half-0 row (the row's bf16 output covers it, and no other token writes there); the
    8 RoPE chunks (bf16 already) straight to their place, chunks 24..31 of half 1; the 8 UE8M0 scale
    bytes (offsets `ssrc64`) to row tok of the scale buffer uint8 [64, pitch]. Masked tokens zero-fill
    (and convert to 0). The copies go in `_GROUPS` commit groups; the next block's records and scale
    bytes (`next64`, `snext64`) are prefetched into L2 behind them. Each group is converted as soon as it has
    landed, one token at a time: lane l reads its 8 e4m3 of half 0 (bytes 8 l, group l // 8) and,
    for l < 24, of half 1 (bytes 256 + 8 l, group 4 + l // 8), the warp synchronizes (the reads of
    the raw bytes precede the writes that overwrite them), and lane l writes chunk l of both halves
    (x * 2^(e - 127), rounded once to bf16; e = 0 gives 0, as the interpreter's XLA factors do:
    the reference's 2^-127 differs by < 448 * 2^-127, and the quantizer never writes a 0 byte).
    `f16`: the rows are written as f16 (`_e4m3_token_f16`), and once a group has landed each lane
    also rewrites one RoPE chunk of the group's tokens (bf16 -> f16, `_chunk_to_f16`)."""
    i32 = ir.IntegerType.get_signless(32)
    i64 = ir.IntegerType.get_signless(64)
    lane16_64 = arith.extui(i64, arith.muli(lane, _i32(16)))
    offs, soffs, noffs, nsoffs = _block_sources(src64, ssrc64, next64, snext64, lane, warp)
    nope = arith.cmpi(arith.CmpIPredicate.ult, lane, _i32(28))
    tail = arith.extui(i32, arith.cmpi(arith.CmpIPredicate.ult, lane, _i32(4)))
    lane4 = arith.extui(i32, arith.cmpi(arith.CmpIPredicate.eq, lane, _i32(4)))
    sc_row = arith.addi(sc_smem32, arith.muli(warp, _i32(pitch)))  # row tok = warp + 4 k: 4 pitch k further
    per = T // 4 // _GROUPS
    # chunk `lane` of a record: NoPE to half 0 chunk `lane`, RoPE chunks 0..3 to half 1 chunks 24..27;
    # RoPE chunks 4..7 (record bytes 512..575) by lanes 0..3, to half 1 chunks 28..31
    dst_base = arith.select(nope, _row_base(dst32, 0, warp, lane), _row_base(dst32, 1, warp, arith.subi(lane, _i32(4))))
    tail_base = _row_base(dst32, 1, warp, arith.addi(lane, _i32(28)))
    for k in range(T // 4):
        off = _shfl(offs, _i32(k))
        valid = arith.cmpi(arith.CmpIPredicate.sge, off, _i32(0))
        nbytes = arith.select(valid, _i32(16), _i32(0))
        g = _record(cache64, valid, off, FP8_RECORD)
        _cp16(_row_at(dst_base, k), arith.addi(g, lane16_64), nbytes)
        _cp16_if(tail, _row_at(tail_base, k), arith.addi(g, arith.addi(lane16_64, _i64(512))), nbytes)
        soff = _shfl(soffs, _i32(k))
        # 8 B (0 read when masked: zero-filled)
        _if(lane4, "cp.async.ca.shared.global [$1], [$2], 8, $3;",
            [arith.addi(sc_row, _i32(4 * pitch * k)), _past(g, valid, soff), arith.select(valid, _i32(8), _i32(0))],
            "r,l,r")
        if k % per == per - 1:
            _commit()
    # the next block's records into L2 (5 lines of 128 B each): lanes 0..15 lines 0..2, 16..31 lines 3..4
    nvalid = arith.cmpi(arith.CmpIPredicate.sge, noffs, _i32(0))
    nbase = _record(cache64, nvalid, noffs, FP8_RECORD)
    lower = arith.cmpi(arith.CmpIPredicate.ult, lane, _i32(16))
    for line in range(3):
        ok = nvalid if line < 2 else arith.andi(nvalid, lower)
        off_b = arith.select(lower, _i64(128 * line), _i64(128 * (3 + line)))
        _if(arith.extui(i32, ok), "prefetch.global.L2 [$1];", [arith.addi(nbase, off_b)], "l")
    # and its scale bytes (8 of them, never across a line): lanes 0..15
    _if(arith.extui(i32, arith.andi(nvalid, lower)), "prefetch.global.L2 [$1];", [_past(nbase, nvalid, nsoffs)], "l")

    half = arith.shrui(lane, _i32(1))
    sub = arith.muli(arith.andi(lane, _i32(1)), _i32(8))  # the lane's 8 bytes within the 16-byte chunk
    low32 = arith.extui(i32, arith.cmpi(arith.CmpIPredicate.ult, lane, _i32(24)))
    g0 = arith.shrui(lane, _i32(3))
    s0_off = arith.addi(sc_row, g0)  # the token's scale bytes of groups g0 and g0 + 4
    s1_off = arith.addi(sc_row, arith.addi(g0, _i32(4)))
    # half 1's bytes 256 + 8 l sit in chunk 16 + l // 2 (lanes >= 24 read chunk 16 + 12..15 and discard)
    raw0 = arith.addi(_row_base(dst32, 0, warp, half), sub)
    raw1 = arith.addi(_row_base(dst32, 0, warp, arith.addi(half, _i32(16))), sub)
    out0, out1 = _row_base(dst32, 0, warp, lane), _row_base(dst32, 1, warp, lane)
    if f16:
        # lane l's RoPE chunk of a group: chunk 24 + l % 8 of half 1 of token k0 + l // 8 (k0 even)
        kk = arith.shrui(lane, _i32(3))
        rope = _row_at(_row_base(dst32, 1, warp, arith.addi(arith.andi(lane, _i32(7)), _i32(24))), kk)

    def load(k):
        """Token k's raw words (4 x i32: half 0's 8 bytes, then half 1's) and scale bytes (i32 x 2),
        once its commit group has landed (and, f16, the group's RoPE chunks rewritten)."""
        if _await_group(k, per) and f16:
            for k0 in range(k, k + per, 4):
                _chunk_to_f16(arith.addi(rope, _i32((k0 // 2) * 4096)))
        return _token_bytes(k, raw0, raw1, 2, s0_off, s1_off, pitch)

    def store(k, w):
        _st_v4(_row_at(out0, k), w[:4])
        _if(low32, "st.shared.v4.b32 [$1], {$2, $3, $4, $5};", [_row_at(out1, k), *w[4:]], "r,r,r,r,r")

    _convert_tokens(load, lambda words, e: _e4m3_lane(words, e, f16, low32), store)


def _nvfp4_word_asm(f16: bool) -> str:
    """PTX of `_nvfp4_word`: outputs $0..$3, inputs $4 (8 e2m1 codes, dim 2i in byte i's low nibble), $5 (the
    e4m3 scale byte, i32)."""
    lines = ["{", ".reg .b32 lo, hi, t, s, h, a, b;", ".reg .b16 p, q, c, d;", ".reg .f32 x, y;",
             # the scale as f16x2 (e4m3 -> f16 is exact), times 2^6 (exact: <= 28672)
             "mul.lo.u32 s, $5, 257;", "mov.b32 {p, q}, s;", "cvt.rn.f16x2.e4m3x2 s, p;", "mov.b32 t, 0x54005400;",
             "mul.rn.f16x2 s, s, t;",
             # each code (s, e1 e0 m) as the e4m3 byte (s << 7) | (e1 e0 m) << 2: its value x 2^-6
             "and.b32 lo, $4, 0x08080808;", "shl.b32 lo, lo, 4;", "and.b32 t, $4, 0x07070707;", "shl.b32 t, t, 2;",
             "or.b32 lo, lo, t;", "and.b32 hi, $4, 0x80808080;", "and.b32 t, $4, 0x70707070;", "shr.b32 t, t, 2;",
             "or.b32 hi, hi, t;", "prmt.b32 a, lo, hi, 0x5140;", "prmt.b32 b, lo, hi, 0x7362;"]
    for j, word in enumerate("ab"):
        lines.append(f"mov.b32 {{p, q}}, {word};")
        for i, half in enumerate("pq"):
            out = f"${2 * j + i}"
            lines.append(f"cvt.rn.f16x2.e4m3x2 h, {half};")
            if f16:
                lines.append(f"mul.rn.f16x2 {out}, h, s;")
            else:  # the f16 product is exact, and so is its bf16 rounding (at most 6 significant bits)
                lines += ["mul.rn.f16x2 h, h, s;", "mov.b32 {c, d}, h;", "cvt.f32.f16 x, c;", "cvt.f32.f16 y, d;",
                          f"cvt.rn.bf16x2.f32 {out}, y, x;"]
    lines.append("}")
    return "\n".join(lines)


def _nvfp4_word(word, scale_byte, f16: bool):
    """8 nvfp4_ds_mla values (one i32 of e2m1 pairs) times their e4m3 scale -> 4 f16x2 / bf16x2 words (i32,
    low element first). Exact: the products lie in [2^-10, 2688] with at most 6 significant bits; a NaN scale
    (0x7F, 0xFF) gives NaN values, as `dsv41_jax.kv_cache.dequantize` does."""
    i32 = ir.IntegerType.get_signless(32)
    ty = ir.Type.parse("!llvm.struct<(i32, i32, i32, i32)>")
    st = llvm.inline_asm(ty, [word, scale_byte], _nvfp4_word_asm(f16), "=r,=r,=r,=r,r,r", has_side_effects=False)
    return [llvm.extractvalue(i32, st, [k]) for k in range(4)]


def _v41_in_place(kv_format, cache64, src64, ssrc64, next64, snext64, dst32, sc_smem32, lane, warp, f16, pitch):
    """V4.1 records (mxfp8_ds_mla, nvfp4_ds_mla) of the block -> rows of the K buffer, converted in place.

    The structure of `_fp8_in_place`: warp w takes tokens w, w + 4, ...; cp.async copies of the record's
    data bytes into the token's own half-0 row (mxfp8: 512 B, chunk `lane` by lane `lane`; nvfp4: 256 B, by
    lanes 0..15) and of its scale bytes into row tok of the scale buffer (mxfp8: 16 UE8M0 by lane 0; nvfp4:
    32 e4m3 by lanes 16, 17), masked tokens zero-filled (and converted to 0); `_GROUPS` commit groups; the
    next block's records and scales prefetched into L2. Each group is converted once it has landed, one
    token at a time, pipelined by one token: lane l reads the bytes of dims 8 l .. 8 l + 7 of half 0 and of
    half 1 (mxfp8: 8 + 8 bytes, scales l / 4 and 8 + l / 4; nvfp4: 4 + 4 bytes, scales l / 2 and
    16 + l / 2), the warp synchronizes, and lane l writes chunk l of both halves. mxfp8 converts as
    fp8_ds_mla's NoPE bytes do (`_e4m3_token_f16` / `_e4m3x2_to_bf16x2`), nvfp4 with `_nvfp4_word`."""
    i32 = ir.IntegerType.get_signless(32)
    i64 = ir.IntegerType.get_signless(64)
    nv = kv_format == "nvfp4_ds_mla"
    unit = kvc.layout(kv_format).data_bytes
    lane16_64 = arith.extui(i64, arith.muli(lane, _i32(16)))
    offs, soffs, noffs, nsoffs = _block_sources(src64, ssrc64, next64, snext64, lane, warp)
    sc_row = arith.addi(sc_smem32, arith.muli(warp, _i32(pitch)))  # row tok = warp + 4 k: 4 pitch k further
    per = T // 4 // _GROUPS
    dst_base = _row_base(dst32, 0, warp, lane)  # chunk `lane` of the token's half-0 row
    if nv:
        data_lane = arith.extui(i32, arith.cmpi(arith.CmpIPredicate.ult, lane, _i32(16)))
        scale_lane = arith.extui(i32, arith.cmpi(arith.CmpIPredicate.ult, arith.subi(lane, _i32(16)), _i32(2)))
        piece = arith.muli(arith.andi(lane, _i32(1)), _i32(16))  # lanes 16, 17: scale bytes 0..15, 16..31
        piece_64 = arith.extui(i64, piece)
    else:
        scale_lane = arith.extui(i32, arith.cmpi(arith.CmpIPredicate.eq, lane, _i32(0)))
    for k in range(T // 4):
        off = _shfl(offs, _i32(k))
        valid = arith.cmpi(arith.CmpIPredicate.sge, off, _i32(0))
        nbytes = arith.select(valid, _i32(16), _i32(0))
        g = _record(cache64, valid, off, unit)
        soff = _shfl(soffs, _i32(k))
        srow = arith.addi(sc_row, _i32(4 * pitch * k))
        if nv:
            _cp16_if(data_lane, _row_at(dst_base, k), arith.addi(g, lane16_64), nbytes)
            _cp16_if(scale_lane, arith.addi(srow, piece), arith.addi(_past(g, valid, soff), piece_64), nbytes)
        else:
            _cp16(_row_at(dst_base, k), arith.addi(g, lane16_64), nbytes)
            _cp16_if(scale_lane, srow, _past(g, valid, soff), nbytes)
        if k % per == per - 1:
            _commit()
    # the next block's records into L2 (unit / 128 lines: lanes 0..15 the first half, 16..31 the second) and
    # their scale bytes (16 or 32, never across a line): lanes 0..15
    nvalid = arith.cmpi(arith.CmpIPredicate.sge, noffs, _i32(0))
    nbase = _record(cache64, nvalid, noffs, unit)
    lower = arith.cmpi(arith.CmpIPredicate.ult, lane, _i32(16))
    lines = unit // 128
    for line in range(lines // 2):
        off_b = arith.select(lower, _i64(128 * line), _i64(128 * (lines // 2 + line)))
        _if(arith.extui(i32, nvalid), "prefetch.global.L2 [$1];", [arith.addi(nbase, off_b)], "l")
    _if(arith.extui(i32, arith.andi(nvalid, lower)), "prefetch.global.L2 [$1];", [_past(nbase, nvalid, nsoffs)], "l")

    # lane l's raw bytes: dims 8 l .. 8 l + 7 of each half are 8 l * bits / 8 bytes in, `nbytes` = 4 (nvfp4) or 8
    # (mxfp8) of them, so `lanes` = 16 / nbytes lanes share a 16-byte chunk: half 0's chunk l / lanes, half 1's
    # 32 / lanes further; their scales: tile (8 l) / tile_dims of half 0, 256 / tile_dims further for half 1
    nwords = 1 if nv else 2
    shift = 2 if nv else 1  # log2(lanes)
    tile_shift = 1 if nv else 2  # log2(tile_dims / 8): tiles of 16 / 32 dims
    sub = arith.muli(arith.andi(lane, _i32((1 << shift) - 1)), _i32(4 * nwords))
    q = arith.shrui(lane, _i32(shift))
    raw0 = arith.addi(_row_base(dst32, 0, warp, q), sub)
    raw1 = arith.addi(_row_base(dst32, 0, warp, arith.addi(q, _i32(32 >> shift))), sub)
    g0 = arith.shrui(lane, _i32(tile_shift))
    s0_off, s1_off = arith.addi(sc_row, g0), arith.addi(sc_row, arith.addi(g0, _i32(32 >> tile_shift)))
    out0, out1 = _row_base(dst32, 0, warp, lane), _row_base(dst32, 1, warp, lane)

    def load(k):
        _await_group(k, per)
        return _token_bytes(k, raw0, raw1, nwords, s0_off, s1_off, pitch)

    def convert(words, e):
        if nv:
            return _nvfp4_word(words[0], e[0], f16) + _nvfp4_word(words[1], e[1], f16)
        return _e4m3_lane(words, e, f16, _i32(1))

    def store(k, w):
        _st_v4(_row_at(out0, k), w[:4])
        _st_v4(_row_at(out1, k), w[4:])

    _convert_tokens(load, convert, store)


def bf16_to_f16_in_place(nbytes: int):
    """Returns `f(ref)` for `plgpu` code run by one warpgroup: the `nbytes` bytes of the SMEM ref
    (bf16 values, any tiling or swizzle: elementwise) rewritten as f16 (`_chunk_to_f16`), each thread
    on 16-byte chunks tid, tid + 128, ... (independent chains, conflict-free)."""
    if nbytes % (128 * 16):
        raise ValueError(f"nbytes must be a multiple of 2048, got {nbytes}")

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(transforms=(TILE, SWIZZLE)),))
    def convert(ctx, ref):
        del ctx
        base = arith.addi(_smem32(ref), arith.muli(arith.andi(mgu.thread_idx(), _i32(127)), _i32(16)))
        for i in range(nbytes // (128 * 16)):
            _chunk_to_f16(arith.addi(base, _i32(i * 128 * 16)))

    return convert


def wait_groups(pending: int):
    """`cp.async.wait_group pending` for the calling threads (0: all of this thread's copies landed)."""

    @plgpu.inline_mgpu()
    def wait(ctx):
        del ctx
        _wait(pending)

    return wait
