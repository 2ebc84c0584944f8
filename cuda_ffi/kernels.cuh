// dsv41 sparse MLA kernels: the bodies of the decode, combine and prefill CTAs.
//
// Written against prims.cuh only, so the same code builds for sm_90a / sm_100a (decode.cu,
// prefill.cu) and for the host emulator (emu_main.cc).
//
// ---------------------------------------------------------------------------------------------
// Attention CTA (decode and prefill share it): 64 query heads x one query token, 384 threads.
//   warps 0..7  consumers: sm_90a wgmma (consume_tile_wgmma), sm_100a mma.sync (consume_tile_mma_sync)
//   warps 8..11 producers (gather the selected KV rows of each 64-token tile, all 64 or, in a
//               2-CTA pair, 32 of them; dequantize fp8 -> f16)
// setmaxnreg gives the consumer warpgroups 184 registers and the producer warpgroup 128 (a pair,
// decode's: 200 and 104; one CTA with split consumers, prefill's default: 192 and 120; params.h).
// Consumers, two shapes (Crew::split): symmetric (below: one CTA's decode, and the sm_100a build's
// mma.sync path) or FlashMLA's split (consume_tile_split: warpgroup 0 S + softmax + O[:, :256],
// warpgroup 1 O[:, 256:]; a pair's decode and prefill on sm_90a).
// Tensor-core operands are f16 with f32 accumulation (bf16 / e4m3 x 2^e inputs convert exactly inside
// f16's range, magnitudes below 2^-17 round on its subnormal grid, beyond +-65504 they saturate).
// Shared memory (params.h, 231264 B from a 1024-aligned base): Q f16 [64 heads][512], K/V f16
// [2 buffers][64 tokens][512], P f16 [2 buffers][64 heads][64 tokens], small f32 exchange arrays,
// per buffer a validity mask (8 words of 8 bits), the pair's mbarriers, a pair's 16 KB of partial
// scores (sym_qk_ksplit).
// Q and K/V use the 128-byte-swizzle layout wgmma reads (8 column blocks of [64 rows][128 B], chunk c
// of row r at c ^ (r & 7)); the same XOR keeps every ldmatrix of the mma.sync path conflict-free.
//
// Per tile (64 tokens), consumer warp w (warpgroup th = w >> 2 owns tokens 32th..32th+31 for Q K^T):
//   S = Q K^T for rows 16 (w & 3) + g (+8), its 32 tokens (a pair: partial sums of all 64 tokens over
//   dims 256th.., the other half's partials exchanged; sym_qk_ksplit); masked, scaled to the log2 domain.
//   row max of the two token halves exchanged through smem (barrier B1); the base M moves lazily (only
//   when the tile maximum exceeds it by more than kLazyLog2), alpha = 2^(M_old - M) when it moves and
//   1 otherwise, P = 2^(S - M) (0 for an empty row: base 0), partial row sums l; P as f16 to smem
//   (barrier B2).
//   O += P V: wgmma path, warpgroup th owns dims 256th..+255 of all 64 heads (rows = its S rows, so
//   alpha stays in registers); mma.sync path, warp w owns dims 64w..64w+63 (alpha through smem).
// Producer/consumer hand-off uses named barriers per K buffer: FULL[b] (producers arrive, consumers
// sync) and EMPTY[b] (consumers arrive, producers sync); a decode head-group pair (2-CTA cluster
// that splits every tile's gather) adds the peer's mbarriers, waited on by producers only (see
// "crew" below). Consumer-only exchanges use one 256-thread named barrier (split consumers: a P-ready
// barrier and a FULL[b] per warpgroup instead; enum below). Both roles of every CTA
// of a crew walk the same tile sequence, so the counts always balance (producers drain the last
// EMPTYs).
//
// Fragment layouts (mma.sync m16n8k16, ldmatrix) are written down in prims.cuh.
// Prefill over f16 rows (the wrapper converted kv) runs another CTA on sm_90a: seesaw.cuh.
// Decode walks the split plan of dsv41_jax.scheduler.plan_decode_splits (see decode_work);
// prefill has one segment per CTA. Epilogues: final (bf16 out with the sink, natural-log lse)
// or split (f32 O/L and log2-domain lse into the accumulators, merged by combine_cta).
//
// Masking: a token is valid iff its position < length (already clamped to [0, topk]) and its
// index is in [0, capacity). Invalid tokens are never read: producers write zero rows and a
// 0 bit in the mask, consumers set their scores to -inf. So NaN in unused cache slots never
// reaches a product.
// ---------------------------------------------------------------------------------------------
#pragma once

#include "params.h"
#include "prims.cuh"

// Planted bugs for the emulator's own tests (tests/test_cuda_ffi.py builds emulator variants with
// -DDSV41_TEST_PLANT=N): 1 skips the PFULL wait, 2 the PEMPTY wait, 3 the final cluster barrier.
#ifndef DSV41_TEST_PLANT
#define DSV41_TEST_PLANT 0
#endif

namespace dsv41 {

// Timeline experiment (DSV41_EXP_TRACE, device builds only; benchmarks/decode_trace.py): lane 0 of
// producer warp 0 (slot 0) and of consumer warps 0 and 4 (slots 1, 2) of the first kTrCtas CTAs stamp
// %clock at a few points of every tile; decode.cu exports dsv41_trace_read to copy the stamps out.
#if defined(DSV41_EXP_TRACE) && defined(DSV41_TRACE_HERE) && DSV41_DEVICE
}  // namespace dsv41
__device__ unsigned dsv41_trace_buf[8 * 3 * 192 * 12];  // (unmangled: the asm below names it)
namespace dsv41 {
constexpr int kTrCtas = 8, kTrSlots = 3, kTrTiles = 192, kTrEvents = 12;
static_assert(sizeof(dsv41_trace_buf) == 4 * kTrCtas * kTrSlots * kTrTiles * kTrEvents, "trace buffer");
// All in one asm block, so the compiler cannot hoist the address work out of the loops (the pair's
// producers have no register to spare: a hoisted base spilled 24 bytes).
template <int kSlot, int kEv>
DEVFN void trace_mark(int tile) {
  asm volatile(
      "{\n .reg .u32 c, b, l, i;\n .reg .u64 a;\n .reg .pred p, q;\n"
      " mov.u32 c, %%clock;\n mov.u32 b, %%ctaid.x;\n mov.u32 l, %%laneid;\n"
      " setp.lt.u32 p, b, %1;\n setp.lt.and.u32 p, %0, %2, p;\n setp.eq.and.u32 p, l, 0, p;\n"
      " mad.lo.u32 i, b, %3, %0;\n mad.lo.u32 i, i, %4, %5;\n"
      " mov.u64 a, dsv41_trace_buf;\n mad.wide.u32 a, i, 4, a;\n"
      " @p st.global.u32 [a], c;\n}\n" ::"r"(tile),
      "n"(kTrCtas), "n"(kTrTiles), "n"(kTrSlots * kTrTiles), "n"(kTrEvents), "n"(kSlot * kTrTiles * kTrEvents + kEv)
      : "memory");
}
#define DSV41_TRACE(slot, tile, ev) ::dsv41::trace_mark<slot, ev>(tile)
#ifdef DSV41_TRACE_NO_P  // consumers only
#define DSV41_TRACE_P(tile, ev) ((void)0)
#else
#define DSV41_TRACE_P(tile, ev) DSV41_TRACE(0, tile, ev)
#endif
#else
#define DSV41_TRACE(slot, tile, ev) ((void)0)
#define DSV41_TRACE_P(tile, ev) ((void)0)
#endif
// The consumer slot of warp w (-1: not traced) and a mark for it.
#ifndef DSV41_TRACE_NO_C
#define DSV41_TRACE_C(w, tile, ev) \
  do { if ((w) == 0) DSV41_TRACE(1, tile, ev); else if ((w) == 4) DSV41_TRACE(2, tile, ev); } while (0)
#else
#define DSV41_TRACE_C(w, tile, ev) ((void)0)
#endif

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Named barriers: the whole CTA, the 256 consumers, FULL b = 2 + b, EMPTY b = 4 + b.
enum : int { kBarCta = 0, kBarConsumers = 1, kBarFull0 = 2, kBarEmpty0 = 4 };
// Split consumers only (consume_tile_split): P[b] written (warpgroup 0 arrives, 1 syncs) and FULL b
// for warpgroup 1 (FULL b is then warpgroup 0's: each warpgroup waits for the tile
// on its own, so warpgroup 0 can start tile n + 1 while warpgroup 1 is still in tile n).
enum : int { kBarPReady0 = 6, kBarFullWg1_0 = 9 };
// A pair's split decode (AddrGen): warpgroup 1 has published the first tiles' addresses (warpgroup 1
// arrives, the producers sync; once per CTA). DSV41_EXP_NO_WG1_ADDR: the producers compute them.
enum : int { kBarAddr = 8 };
#ifdef DSV41_EXP_NO_WG1_ADDR
constexpr bool kWg1Addr = false;
#else
constexpr bool kWg1Addr = true;
#endif
constexpr int kConsumerThreads = 32 * kConsumerWarps;  // 256

// Byte offset of 16-byte chunk `chunk` (dims 8*chunk..+7) of row `row` in a [64][512] f16 matrix
// (Q, a K/V tile): 8 column blocks of [64 rows][128 B], 128-byte swizzle (prims.cuh, params.h).
DEVFN int swz128(int row, int chunk) { return row * 128 + ((chunk ^ (row & 7)) << 4); }
DEVFN int tile_off(int row, int chunk) { return (chunk >> 3) * 8192 + swz128(row, chunk & 7); }
DEVFN int clamp_len(int32_t len, int32_t topk) { return len < 0 ? 0 : (len > topk ? topk : len); }
// Row i's length clamped to [0, topk]: lengths[i * stride] (stride 0: one length for every row).
DEVFN int load_len(const int32_t* lengths, int32_t stride, int64_t i, int32_t topk) {
  return clamp_len(ldg_nc_s32(lengths + i * stride), topk);
}
// The sinks of head group `group` (nullptr: no sink).
DEVFN const float* group_sink(const float* sink, int group) {
  return sink ? sink + (int64_t)group * kHeadsPerCta : nullptr;
}

// ============================================================================== crew
// The CTAs that share a tile sequence: one CTA, or the 2-CTA cluster of head groups 2k, 2k + 1
// (`pair`). In a pair, each CTA gathers and dequantises 32 of every tile's 64 tokens (rank r:
// tokens 32r..32r+31), stores them into its own K buffer and copies them to its peer's, so each CTA does half
// the gather work (FlashMLA's "crossover", flashmla.md section 4).
// Inside a CTA the hand-off uses named barriers per K buffer (hardware waits, no polling): FULL[b]
// (producers arrive, consumers sync) and EMPTY[b] (consumers arrive, producers sync). A pair adds
// two mbarriers per buffer in each CTA (kSmemBars): PFULL[b] completes when this CTA's producer
// warps have arrived (each expecting the bytes of its peer counterpart) and the peer's copies
// into this CTA have landed (their complete_tx brings the transaction count back to 0);
// PEMPTY[b] takes one arrival per peer consumer warp once it has finished reading its own copy.
// With bulk copies PEMPTY[b] also frees this CTA's own rows of buffer b as copy sources: the peer's
// consumers arrive only after the peer's PFULL[b] phase completed, which needs every byte of this
// CTA's copies of that tile, so their source reads are done.
// Only producer warps wait on them: before refilling buffer b they need EMPTY[b] and PEMPTY[b],
// and before arriving at FULL[b] they wait for PFULL[b], so this CTA's consumers see both halves.
// Tile tc uses buffer tc & 1 and phase (tc >> 1) of the mbarriers. The remote rows are
// cp.async.bulk copies of the local ones, 1 KB per producer warp and column block (kPairBulk):
// FlashMLA's lane st.async stores (DSV41_EXP_PAIR_ST_ASYNC) made the pair hand-off the decode's
// largest cost, and generic st.shared::cluster stores followed by a releasing arrival measured
// slower than one CTA gathering everything (RESULTS.md, "cuda head-group pairs").
// A compile-time property of the kernel (two instantiations), so a single CTA's code carries no
// cluster instructions or pair branches.
// kSplit: the consumers' roles. false: two symmetric warpgroups (each S for 32 of a tile's tokens,
// a row-max exchange, O[:, 256 w]); true: FlashMLA's split (consume_tile_split). wgmma builds only.
// kBf16: the tensor-core operands (Q, K/V tiles, P) are bf16 instead of f16 (wgmma builds only):
// prefill's bf16 rows then go to shared memory as loaded, without a conversion per element.
// ksplit: a pair's symmetric consumers compute S split over the dims (sym_qk_ksplit; off under
// DSV41_EXP_NO_QK_KSPLIT).
#ifdef DSV41_EXP_NO_QK_KSPLIT
constexpr bool kQkKSplit = false;
#else
constexpr bool kQkKSplit = true;
#endif
template <bool kPair, bool kSplit = false, bool kBf16 = false>
struct Crew {
  static constexpr int ncta = kPair ? 2 : 1;
  static constexpr bool split = kSplit && kWgmma;
  static constexpr bool bf16 = kBf16 && kWgmma;
  static constexpr bool ksplit = kPair && !split && kWgmma && kQkKSplit;
  // A pair's producers fit 104 registers either way; one CTA's (two batches per warp) need 120 with
  // split consumers (192) and 128 with symmetric ones (184).
  static constexpr bool split_regs = split && !kPair;
  static constexpr int producer_regs = split_regs ? kSplitProducerRegs : kPair ? kPairProducerRegs : kProducerRegs;
  static constexpr int consumer_regs = split_regs ? kSplitConsumerRegs : kPair ? kPairConsumerRegs : kConsumerRegs;
  static constexpr int full_count = split ? 256 : kThreads;  // FULL b: producers + the consumers waiting
  static constexpr bool wg1_addr = kWg1Addr && kPair && split;  // warpgroup 1 computes the gather addresses
  int rank;       // in the cluster
  uint32_t peer;  // cluster address of the peer's shared-memory base (pairs)
};

DEVFN int bar_pfull(int buf) { return kSmemBars + 8 * buf; }
DEVFN int bar_pempty(int buf) { return kSmemBars + 16 + 8 * buf; }

// Every thread of the CTA: mbarrier initialisation (pairs), then a barrier over the crew (no CTA
// touches its peer before the peer's mbarriers exist).
template <bool kPair, bool kSplit = false, bool kBf16 = false>
DEVFN Crew<kPair, kSplit, kBf16> crew_setup(char* smem) {
  Crew<kPair, kSplit, kBf16> c{0, 0u};
  if constexpr (kPair) {
    c.rank = cluster_rank();
    if (thread_idx() == 0) {
      for (int b = 0; b < 2; ++b) {
        mbar_init(smem_addr(smem + bar_pfull(b)), kProducerWarps);
        mbar_init(smem_addr(smem + bar_pempty(b)), kConsumerWarps);
      }
      fence_mbar_init();
    }
    c.peer = cluster_map(smem_addr(smem), c.rank ^ 1);
    cluster_sync();
  }
  return c;
}

// Every thread of the CTA, last: a CTA of a pair may not exit while its peer can still store into
// its shared memory or arrive on its barriers.
template <class C>
DEVFN void crew_teardown(const C&) {
  if constexpr (C::ncta == 2 && DSV41_TEST_PLANT != 3) cluster_sync();
}

// How a pair's producer warp sends its rows to the peer: local stores only, then eight 1 KB
// cp.async.bulk copies of them (the warp's 8 rows are contiguous in each column block; default since
// the seventh session: decode 536 -> 399 us), or, under DSV41_EXP_PAIR_ST_ASYNC, each lane's 16-byte
// st.async per chunk next to its local store (2048 stores per CTA and tile, which drained slowly and
// held the producers' registers: RESULTS.md, "cuda seventh session").
#ifdef DSV41_EXP_PAIR_ST_ASYNC
constexpr bool kPairBulk = false;
#else
constexpr bool kPairBulk = true;
#endif

// Tokens per tile one producer warp of a pair gathers (one batch), and the bytes it sends to its peer
// per tile: its 8 rows (eight 1 KB cp.async.bulk copies, or lane st.async stores under
// DSV41_EXP_PAIR_ST_ASYNC) + its mask word (st.async): 8 x 1024 + 4.
constexpr int kPairTokensPerWarp = kTileTokens / 2 / kProducerWarps;
static_assert(kPairTokensPerWarp == 8, "fill_tile sends one 8-token batch (one mask word) per warp and tile");
static_assert(kTileTokens / kProducerWarps == 16, "one CTA's producer warp gathers two 8-token batches per tile");
// Timing-only experiment DSV41_EXP_PEER_BLOCKS=k (0..8; wrong results): a pair sends only column blocks 0..k-1
// of its rows to the peer (how much of the decode's time the shared-memory traffic between the CTAs sets).
#ifdef DSV41_EXP_PEER_BLOCKS
constexpr int kPeerBlocks = DSV41_EXP_PEER_BLOCKS;
#else
constexpr int kPeerBlocks = 8;
#endif
constexpr uint32_t kPeerBytesPerWarp = kPairTokensPerWarp * kHeadDim * 2 / 8 * kPeerBlocks + 4;

// One arrival of the calling warp on the peer's mbarrier at `bar_off`, after the warp's earlier
// shared-memory accesses (the __syncwarp orders the lanes' accesses before lane 0's release).
template <class C>
DEVFN void peer_arrive(const C& c, int bar_off, int lane) {
  syncwarp();
  if (lane == 0) mbar_arrive(c.peer + (uint32_t)bar_off);
}

// The tokens of each tile that producer warp pw gathers: [base, base + 8 NB) (NB = 1 in a pair, 2
// for one CTA; produce_tiles).
struct Share {
  int base;
};
template <class C>
DEVFN Share producer_share(const C& c, int pw) {
  return C::ncta == 2 ? Share{kTileTokens / 2 * c.rank + kPairTokensPerWarp * pw} : Share{16 * pw};
}

// ============================================================================== producer
// 16 fp8 (one 16-byte chunk) * 2^(e-127) -> 16 f16 in two 16-byte chunks (exact in f16's range).
// Fast path, scale exponent k = e - 127 in [-14, 7]: e4m3x2 -> f16x2 and one f16x2 multiply by the
// f16 power of two (exact: |e4m3| <= 448 so |x 2^k| <= 57344, and the smallest product m 2^-23
// is on f16's subnormal grid). Other scales go through f32: k >= 8 saturates beyond 65504, k <= -16
// rounds on f16's subnormal grid (error < 2^-25). kKnownFast: the caller has checked dequant_fast_ok.
DEVFN bool dequant_fast_ok(uint32_t e8m0) { return e8m0 - 113u <= 21u; }  // k = e8m0 - 127 in [-14, 7]
template <bool kKnownFast = false>
DEVFN void dequant16(const uint4& raw, uint32_t e8m0, uint4& first, uint4& second) {
  const uint32_t wv[4] = {raw.x, raw.y, raw.z, raw.w};
  uint32_t o[8];
  const int k = (int)e8m0 - 127;
  if (kKnownFast || dequant_fast_ok(e8m0)) {
    const uint32_t h = (uint32_t)(k + 15) << 10;
    const uint32_t sc2 = h | (h << 16);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      o[2 * i] = hmul2(e4m3x2_to_f16x2(wv[i] & 0xffffu), sc2);  // elements 4i, 4i+1
      o[2 * i + 1] = hmul2(e4m3x2_to_f16x2(wv[i] >> 16), sc2);  // elements 4i+2, 4i+3
    }
  } else {
    // UE8M0 scale 2^(byte-127), built exactly (byte 0 -> 2^-127, a float subnormal).
    const float scale = e8m0 ? bits_f32(e8m0 << 23) : bits_f32(0x00400000u);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 a = e4m3x2_to_f32x2(wv[i] & 0xffffu);
      const float2 b = e4m3x2_to_f32x2(wv[i] >> 16);
      o[2 * i] = pack_f16x2(a.x * scale, a.y * scale);
      o[2 * i + 1] = pack_f16x2(b.x * scale, b.y * scale);
    }
  }
  first = make_u4(o[0], o[1], o[2], o[3]);
  second = make_u4(o[4], o[5], o[6], o[7]);
}

// The two token pools a producer reads (decode: main and extra cache; prefill: kv twice), as the
// addresses of kernel parameters. A tile names its pool by a flag and every field is chosen field
// by field (`field`): a pool pointer chosen at run time and carried across the loop lost its
// parameter-space provenance and turned each field read into a dependent generic load (seen in
// Nsight Compute as long-scoreboard stalls ahead of every index load).
struct Pools {
  const Pool* main;
  const Pool* extra;
};
#define DSV41_POOL(ps, t, f) ((t).extra ? (ps).extra->f : (ps).main->f)

// A tile to gather: positions tok0..tok0+63 of indices row `row` of pool `extra` ? extra : main
// (ok = false: none).
struct TileSrc {
  int64_t row;
  int len, tok0;
  bool ok, extra;
};
// Lane layout of the producers: a warp's share of a tile is NB batches of 8 tokens (NB = 1 in a
// pair, 2 for one CTA); in every batch lane l works on token j = l / 4 (row sh.base + 8b + j of
// the tile) with its quarter q = l % 4 of that token's bytes, so each lane converts the same amount
// of data with the same instructions (no divergence between fp8 and RoPE lanes), needs only its own
// token's address (no shuffles) and stores at offsets known up to a per-lane base.
//   fp8_ds_mla: 16-byte chunks c = q + 4i (i = 0..6) of the 448 e4m3 bytes (dims 16c..16c+15, scale
//   byte i), and bytes 32q..32q+31 of the 128-byte bf16 RoPE; bf16: chunks 8(i / 2) + 4((i % 2) ^
//   (j % 2)) + q (i = 0..15) of the 1024-byte row (odd tokens take their two 4-chunk halves in the
//   other order, so the 8 lanes of a store phase hit 8 distinct bank groups).
template <int NB>
struct TileAddr {
  int64_t doff[NB], soff[NB];  // byte offsets of this lane's token of batch b (0 when invalid)
  uint32_t vmask;              // bit 8b + j: token j of batch b is valid
};
template <int NB>
struct TileIdx {
  int32_t v[NB];
};

// Index of the token at position tok0 + off of tile t (-1 past the length or for no tile).
DEVFN int32_t token_index(const Pools& ps, const TileSrc& t, int off) {
  const int pos = t.tok0 + off;
  return (t.ok && pos < t.len) ? ldg_nc_s32(DSV41_POOL(ps, t, indices) + t.row * (int64_t)DSV41_POOL(ps, t, topk) + pos)
                               : -1;
}

// Producers run a 3-stage look-ahead per tile tc: the indices of tile tc+2 are loaded (no use
// yet), the addresses of tile tc+1 are computed from the indices loaded one tile earlier and its
// rows are prefetched into L2, then tile tc is gathered (its rows prefetched one tile earlier).
// So the index load and the HBM latency of a tile overlap the previous tile's gather.
template <int NB>
DEVFN TileIdx<NB> tile_index(const Pools& ps, const TileSrc& t, const Share& sh, int lane) {
  TileIdx<NB> r;
#pragma unroll
  for (int b = 0; b < NB; ++b) r.v[b] = token_index(ps, t, sh.base + 8 * b + (lane >> 2));
  return r;
}

// The fields of a tile's pool that place its tokens (read once per tile).
struct PoolGeom {
  bool fp8;
  int64_t cap, pb;
  int32_t bs;
};
DEVFN PoolGeom pool_geom(const Pools& ps, const TileSrc& t) {
  PoolGeom g;
  g.fp8 = DSV41_POOL(ps, t, fmt) == kFmtFp8DsMla;
  g.cap = DSV41_POOL(ps, t, capacity);
  g.bs = DSV41_POOL(ps, t, block_size);
  g.pb = DSV41_POOL(ps, t, page_bytes);
  return g;
}
// Byte offsets of token `i` (its validity `valid`: position < length, i in [0, capacity)) in its pool:
// its data (doff) and, fp8_ds_mla, its scale bytes (soff); untouched when masked.
DEVFN void token_offsets(const PoolGeom& g, bool valid, int32_t i, int64_t& doff, int64_t& soff) {
  if (valid) {
    if (g.fp8) {  // 0 <= i < capacity < 2^31: a 32-bit division
      const uint32_t blk = (uint32_t)i / (uint32_t)g.bs;
      const uint32_t off = (uint32_t)i - blk * (uint32_t)g.bs;
      doff = (int64_t)blk * g.pb + (int64_t)off * kFp8TokenData;
      soff = (int64_t)blk * g.pb + (int64_t)g.bs * kFp8TokenData + (int64_t)off * kFp8TokenScale;
    } else {
      doff = (int64_t)i * (kHeadDim * 2);
    }
  }
}

// Warp-uniform in t.ok (ballot inside).
template <int NB>
DEVFN TileAddr<NB> tile_addr(const Pools& ps, const TileSrc& t, const TileIdx<NB>& idx, const Share& sh, int lane) {
  TileAddr<NB> a;
  a.vmask = 0u;
#pragma unroll
  for (int b = 0; b < NB; ++b) a.doff[b] = a.soff[b] = 0;
  if (!t.ok) return a;
  const PoolGeom g = pool_geom(ps, t);
#pragma unroll
  for (int b = 0; b < NB; ++b) {
    const int pos = t.tok0 + sh.base + 8 * b + (lane >> 2);
    const int32_t i = idx.v[b];
    const bool valid = pos < t.len && i >= 0 && (int64_t)i < g.cap;
    token_offsets(g, valid, i, a.doff[b], a.soff[b]);
    // bit 4j (+ q) of the ballot: token j (the 4 lanes of a token agree); fold bit 4j to bit j
    uint32_t m = ballot(valid) & 0x11111111u;
    m = (m | (m >> 3)) & 0x03030303u;
    m = (m | (m >> 6)) & 0x000f000fu;
    m = (m | (m >> 12)) & 0xffu;
    a.vmask |= m << (8 * b);
  }
  return a;
}

// Address ring (a pair's split decode; DSV41_EXP_NO_WG1_ADDR turns it off): warpgroup 1, idle while
// warpgroup 0 computes S and the softmax, computes the gather addresses (index loads, the page division)
// for the producers, which set the decode's tile period (benchmarks/decode_trace.py). A ring of
// kAddrSlots slots in the (then unused) k-split exchange region, one per tile: the byte offsets of the
// CTA's 32 tokens (data, scales) and their validity bits. Warpgroup 1's warp 4 writes the slot of tile
// tc + 3 while it consumes tile tc, before its release of tc; the producers read that slot in their
// iteration tc + 2, after their EMPTY wait for tile tc, which that release orders (bar.arrive /
// bar.sync); tiles 0..2 come from a prologue, published through kBarAddr. Reuse needs no barrier: the
// slot of tile tc + 3 held tile tc - 1, read by the producers in their iteration tc - 2, before FULL of
// tile tc, which warpgroup 1 observed (through warpgroup 0) before consuming tile tc.
constexpr int kAddrSlots = 4, kAddrSlotBytes = 32 * 16 + 16, kAddrLead = 3;
static_assert(kAddrSlots * kAddrSlotBytes <= kSmemBytes - kSmemXS, "address ring beyond the k-split region");
DEVFN char* addr_slot(char* smem, int tc) { return smem + kSmemXS + (tc % kAddrSlots) * kAddrSlotBytes; }

// Warp 4: lane l gathers token 32 rank + l of tile t; its index (-1 past the length).
DEVFN int32_t half_index(const Pools& ps, const TileSrc& t, int rank, int lane) {
  return token_index(ps, t, 32 * rank + lane);
}
DEVFN void publish_half_addr(char* slot, const Pools& ps, const TileSrc& t, int32_t i, int rank, int lane) {
  int64_t doff = 0, soff = 0;
  bool valid = false;
  if (t.ok) {
    const PoolGeom g = pool_geom(ps, t);
    valid = t.tok0 + 32 * rank + lane < t.len && i >= 0 && (int64_t)i < g.cap;
    token_offsets(g, valid, i, doff, soff);
  }
  int64_t* d = reinterpret_cast<int64_t*>(slot);
  d[lane] = doff;
  d[32 + lane] = soff;
  const uint32_t m = ballot(valid);
  if (lane == 0) *reinterpret_cast<uint32_t*>(slot + 512) = m;
}
// Producer warp pw, lane l: token l / 4 of its 8 (NB = 1).
DEVFN TileAddr<1> read_half_addr(const char* slot, int pw, int lane) {
  const int64_t* d = reinterpret_cast<const int64_t*>(slot);
  TileAddr<1> a;
  a.doff[0] = d[8 * pw + (lane >> 2)];
  a.soff[0] = d[32 + 8 * pw + (lane >> 2)];
  a.vmask = (*reinterpret_cast<const uint32_t*>(slot + 512) >> (8 * pw)) & 0xffu;
  return a;
}

// L2 prefetch of this lane's token's lines (the 4 lanes of a token split them).
template <int NB>
DEVFN void tile_prefetch(const Pools& ps, const TileSrc& t, const TileAddr<NB>& a, int lane) {
#if defined(DSV41_EXP_NO_GATHER) || defined(DSV41_EXP_NO_PREFETCH)  // experiment: no L2 prefetch
  return;
#endif
  if (!t.ok) return;
  const uint8_t* base = DSV41_POOL(ps, t, base);
  const bool fp8 = DSV41_POOL(ps, t, fmt) == kFmtFp8DsMla;
  const int q = lane & 3;
#pragma unroll
  for (int b = 0; b < NB; ++b) {
    if (!((a.vmask >> (8 * b + (lane >> 2))) & 1u)) continue;
    const uint8_t* d = base + a.doff[b];
    if (fp8) {  // 576 data bytes (5-6 lines) + 8 scale bytes
      prefetch_l2(d + 128 * q);
      if (q == 0) prefetch_l2(d + 512);
      if (q == 1) prefetch_l2(d + kFp8TokenData - 1);
      if (q == 2) prefetch_l2(base + a.soff[b]);
    } else {  // 1024 bytes (8-9 lines)
      prefetch_l2(d + 128 * q);
      prefetch_l2(d + 512 + 128 * q);
      if (q == 3) prefetch_l2(d + kHeadDim * 2 - 1);
    }
  }
}

// One batch (8 tokens) of a warp's share in registers: loads issued, not yet used. fp8_ds_mla:
// v[0..6] the e4m3 chunks, v[7], v[8] the RoPE bytes, sc the 8 scale bytes (v[9..] unused); bf16:
// v[0..15] (NV = 16) or, in a pair (NV = 9: the producers' registers are the decode's scarcest
// resource), one half of the 16 chunks at a time in v[0..7] (sc unused). Invalid tokens are zero
// (with scale byte 127: the fast dequantisation path).
template <int NV>
struct BatchT {
  static_assert(NV == 16 || NV == 9, "a batch holds all bf16 chunks or one fp8 token quarter");
  static constexpr int kBf16Chunks = NV == 16 ? 16 : 8;  // bf16 chunks per load (one half when 8)
  uint4 v[NV];
  uint2 sc;
};

DEVFN int bf16_chunk(int i, int lane) { return 8 * (i >> 1) + 4 * ((i & 1) ^ ((lane >> 2) & 1)) + (lane & 3); }

// half: which 8 of the 16 bf16 chunks (batches of 8-chunk capacity only).
template <int NB, int NV>
DEVFN void load_batch(const Pools& ps, const TileSrc& t, const TileAddr<NB>& a, int b, int lane, BatchT<NV>& bt,
                      int half = 0) {
#pragma unroll
  for (int i = 0; i < NV; ++i) bt.v[i] = make_u4(0, 0, 0, 0);
  bt.sc.x = bt.sc.y = 0x7f7f7f7fu;
#ifdef DSV41_EXP_NO_GATHER  // experiment: no cache reads (zero rows), everything else unchanged
  return;
#endif
  if (!((a.vmask >> (8 * b + (lane >> 2))) & 1u)) return;
  const uint8_t* base = DSV41_POOL(ps, t, base);
  const uint8_t* d = base + a.doff[b];
  const int q = lane & 3;
  if (DSV41_POOL(ps, t, fmt) == kFmtFp8DsMla) {  // warp-uniform
#pragma unroll
    for (int i = 0; i < 7; ++i) bt.v[i] = ldg_nc_v4(d + 16 * (q + 4 * i));
    bt.v[7] = ldg_nc_v4(d + 448 + 32 * q);
    bt.v[8] = ldg_nc_v4(d + 448 + 32 * q + 16);
    bt.sc = ldg_nc_v2(base + a.soff[b]);
  } else {
#pragma unroll
    for (int i = 0; i < BatchT<NV>::kBf16Chunks; ++i) bt.v[i] = ldg_nc_v4(d + 16 * bf16_chunk(i + 8 * half, lane));
  }
}

// Two 16-byte f16 chunks at byte offsets o0, o1 of K buffer `kbuf` and, when `remote`, by st.async
// at the same offsets of the peer's copy `rbuf`, completing on the peer's mbarrier `rbar`.
DEVFN void store_chunk(char* kbuf, bool remote, uint32_t rbuf, uint32_t rbar, int o, const uint4& v) {
  *reinterpret_cast<uint4*>(kbuf + o) = v;
  if (remote) st_async_v4(rbuf + (uint32_t)o, v, rbar);
}

DEVFN uint4 bf16x8_to_f16x8(const uint4& v) {
  return make_u4(bf16x2_to_f16x2(v.x), bf16x2_to_f16x2(v.y), bf16x2_to_f16x2(v.z), bf16x2_to_f16x2(v.w));
}

// Validity word of tokens 8i..8i+7 of buffer `buf` (bits 0..7) into this CTA (and, when `remote`,
// the peer's, by st.async completing on `rbar`).
DEVFN void store_valid_word(char* smem, bool remote, uint32_t peer, uint32_t rbar, int buf, int i, uint32_t bits) {
  const int off = kSmemValid + 4 * (8 * buf + i);
  *reinterpret_cast<uint32_t*>(smem + off) = bits & 0xffu;
  if (remote) st_async_u32(peer + (uint32_t)off, bits & 0xffu, rbar);
}

template <int NV>
DEVFN uint32_t scale_byte(const BatchT<NV>& bt, int i) { return ((i < 4 ? bt.sc.x : bt.sc.y) >> (8 * (i & 3))) & 0xffu; }

// The 16 f16 chunks of this lane's quarter of an fp8_ds_mla token (row offsets e0 / e1 of its even /
// odd chunks in column block 0): block i < 7 from e4m3 chunk i, block 7 the RoPE.
// hook(i, stored): called for block i once converted (stored = false) and once stored (true): a pair's
// progressive copies to the peer.
template <bool kFast, int NV, class Hook>
DEVFN void store_fp8_rows(char* kbuf, bool remote, uint32_t rbuf, uint32_t rbar, int e0, int e1, const BatchT<NV>& bt,
                          const Hook& hook) {
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    uint4 first, second;
    if (i < 7) {
      dequant16<kFast>(bt.v[i], scale_byte(bt, i), first, second);
    } else {
      first = bf16x8_to_f16x8(bt.v[7]);
      second = bf16x8_to_f16x8(bt.v[8]);
    }
    hook(i, false);
    store_chunk(kbuf, remote, rbuf, rbar, i * 8192 + e0, first);
    store_chunk(kbuf, remote, rbuf, rbar, i * 8192 + e1, second);
    hook(i, true);
  }
}
// Progressive copies: a pair's producer warp sends its fp8 rows to the peer one column block (1 KB) at a time,
// as soon as the block is stored, so the copies (rate-bound, ~20 B per cycle and SM) overlap the dequantisation
// of the later blocks instead of following all of it (decode 348.5 -> 344.7 us; RESULTS.md, fourteenth session;
// 2 and 4 blocks at a time measured between). DSV41_EXP_COPY_BLOCKS=k (2, 4, 8: all after the rows) for ablations.
#ifdef DSV41_EXP_COPY_BLOCKS
constexpr int kCopyBlocks = DSV41_EXP_COPY_BLOCKS;
#else
constexpr int kCopyBlocks = 1;
#endif
static_assert(kCopyBlocks == 1 || kCopyBlocks == 2 || kCopyBlocks == 4 || kCopyBlocks == 8, "DSV41_EXP_COPY_BLOCKS");
// Lagged copies (the default, with one block at a time): block i - 1's fence and copy come after block i is
// converted and before it is stored, so the fence (MEMBAR.ALL.CTA in SASS: it waits for all of the thread's earlier
// memory operations) does not wait for the stores it does not need to order (decode 333.5 -> 329.4 us with the
// staged boundary; RESULTS.md, fifteenth session). DSV41_EXP_NO_COPY_LAG restores fence-after-store.
#if defined(DSV41_EXP_NO_COPY_LAG) || defined(DSV41_EXP_COPY_BLOCKS)
constexpr bool kCopyLag = false;
#else
constexpr bool kCopyLag = true;
#endif
static_assert(!kCopyLag || kCopyBlocks == 1, "lagged copies send one block at a time");
struct NoHook {
  DEVFN void operator()(int, bool) const {}
};

// Dequantise / convert loaded batch b (rows sh.base + 8b ..) and store it with its mask word; bf16
// batches of one half (NV = 9): `half` 0 stores the first 8 chunks and returns (`last` false), the
// caller loads and stores half 1; a pair sends the rows to its peer after the last part.
// f16 chunk k of row r sits at (k / 8) * 8192 + r * 128 + ((k % 8) ^ (r % 8)) * 16 (params.h):
// fp8 chunk c = q + 4i becomes f16 chunks 2c, 2c + 1 = 8i + 2q (+1), the RoPE f16 chunks 56 + 2q (+1).
template <class C, int NV>
DEVFN void store_batch(char* smem, const C& crew, int buf, int32_t fmt, uint32_t vmask, const Share& sh, int b,
                       int lane, const BatchT<NV>& bt, int half = 0, bool last = true, int tr = -1) {
  // raw: rows stored as loaded (bf16 operands, or f16 rows: those reach prefill_cta only in builds
  // without wgmma, seesaw.cuh takes them elsewhere; so the decode's producers carry no such test)
  const bool fp8 = fmt == kFmtFp8DsMla, raw = C::bf16 || (!kWgmma && fmt == kFmtF16);
  char* kbuf = smem + kSmemK + buf * kTileBytes;
  constexpr bool remote = C::ncta == 2 && !kPairBulk;  // rows by st.async (the mask word always is)
  const uint32_t peer = crew.peer;
  const uint32_t rbuf = peer + (uint32_t)(kSmemK + buf * kTileBytes);
  const uint32_t rbar = peer + (uint32_t)bar_pfull(buf);
  if (lane == 0 && last) store_valid_word(smem, C::ncta == 2, peer, rbar, buf, (sh.base + 8 * b) >> 3, vmask >> (8 * b));
  const int row = sh.base + 8 * b + (lane >> 2), q = lane & 3, r7 = row & 7;
  // progressive copies (kCopyBlocks < 8): fp8 rows of a pair's last part only
  constexpr bool prog = C::ncta == 2 && kPairBulk && kCopyBlocks < 8;
  const uint32_t o = (uint32_t)(128 * (sh.base + 8 * b));
  if (!C::bf16 && fp8) {  // warp-uniform (bf16-operand crews: prefill, bf16 rows only)
    const int e0 = row * 128 + (((2 * q) ^ r7) << 4), e1 = row * 128 + (((2 * q + 1) ^ r7) << 4);
    // One warp-uniform test of all seven scale bytes instead of a (possibly divergent) branch per chunk.
    bool fast = true;
#pragma unroll
    for (int i = 0; i < 7; ++i) fast &= dequant_fast_ok(scale_byte(bt, i));
    if constexpr (prog) {
      const auto hook = [&](int i, bool stored) {  // (trace events of the last block as the copies after all rows)
        int last;  // the last block this call sends (blocks last + 1 - kCopyBlocks .. last), or none
        if (kCopyLag) last = stored ? (i == 7 ? 7 : -1) : i - 1;
        else last = stored && (i + 1) % kCopyBlocks == 0 ? i : -1;
        if (last < 0) return;
        if (last == 7 && tr >= 0) DSV41_TRACE_P(tr, 0);
        fence_proxy_async_always();  // this lane's stores -> the async proxy that reads the copy's source
        syncwarp();
        if (last == 7 && tr >= 0) DSV41_TRACE_P(tr, 2);
        if (lane == 0) {
#pragma unroll
          for (int j = last + 1 - kCopyBlocks; j <= last; ++j)
            if (j < kPeerBlocks) bulk_copy_to_peer(rbuf + o + 8192u * j, smem_addr(kbuf) + o + 8192u * j, 1024u, rbar);
        }
        if (last == 7 && tr >= 0) DSV41_TRACE_P(tr, 7);
      };
      if (ballot(fast) == 0xffffffffu) {
        store_fp8_rows<true>(kbuf, remote, rbuf, rbar, e0, e1, bt, hook);
      } else {
        store_fp8_rows<false>(kbuf, remote, rbuf, rbar, e0, e1, bt, hook);
      }
      return;  // (last: fp8 batches are whole)
    }
    if (ballot(fast) == 0xffffffffu) {
      store_fp8_rows<true>(kbuf, remote, rbuf, rbar, e0, e1, bt, NoHook{});
    } else {
      store_fp8_rows<false>(kbuf, remote, rbuf, rbar, e0, e1, bt, NoHook{});
    }
  } else {
#pragma unroll
    for (int i = 0; i < BatchT<NV>::kBf16Chunks; ++i) {
      const int k = bf16_chunk(i + 8 * half, lane);
      store_chunk(kbuf, remote, rbuf, rbar, (k >> 3) * 8192 + row * 128 + (((k & 7) ^ r7) << 4),
                  raw ? bt.v[i] : bf16x8_to_f16x8(bt.v[i]));
    }
  }
  if (!last) return;
  if constexpr (C::ncta == 2 && kPairBulk) {
    // rows sh.base + 8b .. + 7: 1 KB at j * 8192 + 128 * row0 of column block j, in both CTAs
    if (tr >= 0) DSV41_TRACE_P(tr, 0);
    fence_proxy_async_always();  // this lane's stores -> the async proxy that reads the copy's source
    syncwarp();
    if (tr >= 0) DSV41_TRACE_P(tr, 2);
#ifdef DSV41_EXP_ONE_COPY  // timing only (wrong rows in the peer): one 8 KB copy per warp instead of eight 1 KB
    if (lane == 0) bulk_copy_to_peer(rbuf + o, smem_addr(kbuf) + o, 8192u, rbar);
#else
    if (lane == 0) {  // (lanes 0..7 issuing one copy each measured the same: RESULTS.md, seventh session)
#pragma unroll
      for (int j = 0; j < 8; ++j)
        bulk_copy_to_peer(rbuf + o + 8192u * j, smem_addr(kbuf) + o + 8192u * j, 1024u, rbar);
    }
#endif
    if (tr >= 0) DSV41_TRACE_P(tr, 7);
  }
}

// Producer warp pw fills rows sh.base.. of K buffer `buf` (its own and, in a pair, its peer's) with
// its NB batches of tile `t` (addresses `a` from tile_addr) and their bits of the validity mask.
// The first batch (`first`) was loaded by the caller before it waited for the buffer, so its
// latency overlaps that wait. (Measured alternatives, cuda_notes.md: one lane per 16 dims of a
// token with fp8 and RoPE lanes diverging, one batch of 16 fp8 tokens, a continuous 8-deep token
// ring across tiles.)
template <int NB, class C, int NV>
DEVFN void fill_tile(char* smem, const C& crew, int buf, const Pools& ps, const TileSrc& t, const TileAddr<NB>& a,
                     const Share& sh, int lane, BatchT<NV>& first, int tr = -1) {
  static_assert(NV == 16 || NB == 1, "half-row batches serve one batch per warp and tile (pairs)");
  const int32_t fmt = DSV41_POOL(ps, t, fmt);
  if (NV < 16 && fmt != kFmtFp8DsMla) {  // 2-byte rows in halves (warp-uniform)
    store_batch(smem, crew, buf, fmt, a.vmask, sh, 0, lane, first, 0, false);
    load_batch(ps, t, a, 0, lane, first, 1);
    store_batch(smem, crew, buf, fmt, a.vmask, sh, 0, lane, first, 1, true);
  } else {
    store_batch(smem, crew, buf, fmt, a.vmask, sh, 0, lane, first, 0, true, tr);
  }
#pragma unroll 1
  for (int b = 1; b < NB; ++b) {
    BatchT<NV> bt;
    load_batch(ps, t, a, b, lane, bt);
    store_batch(smem, crew, buf, fmt, a.vmask, sh, b, lane, bt);
  }
  // bar.arrive FULL orders these local stores before the consumers' bar.sync returns (the PTX
  // ISA's producer/consumer example); wgmma reads them through the async proxy, hence the fence
  // (a pair's lanes fenced their rows before the bulk copies in store_batch; under
  // DSV41_EXP_PAIR_ST_ASYNC the fence after the PFULL wait in produce_tiles covers them).
  if constexpr (C::ncta == 1) fence_proxy_async();
}

// The producer loop over a tile sequence given by `next()` (returns the next TileSrc, ok = false
// past the end): look-ahead as described above, FULL / EMPTY hand-off (and, in a pair, PFULL /
// PEMPTY), final drain.
template <class C, class Next>
DEVFN void produce_tiles(char* smem, const C& crew, const Pools& ps, int pw, int lane, Next&& next) {
  const Share sh = producer_share(crew, pw);
  constexpr bool pair = C::ncta == 2;
  constexpr int NB = pair ? 1 : 2;  // 8-token batches per warp and tile
  constexpr bool gen = C::wg1_addr;
  TileSrc t0 = next();
  TileSrc t1 = next();
  TileIdx<NB> i1;
  TileAddr<NB> a0;
  if constexpr (gen) {
    bar_sync(kBarAddr, 256);  // warpgroup 1's prologue: tiles 0..kAddrLead - 1
    a0 = read_half_addr(addr_slot(smem, 0), pw, lane);
  } else {
    i1 = tile_index<NB>(ps, t1, sh, lane);
    a0 = tile_addr<NB>(ps, t0, tile_index<NB>(ps, t0, sh, lane), sh, lane);
  }
  // Pairs load the first batch of tile tc at the end of iteration tc - 1, as soon as the registers
  // of tile tc - 1's batch are free: its latency overlaps the PFULL wait, the next tile's index and
  // address work and the wait for the buffer (decode 578 -> 534 us). One CTA (two batches per warp,
  // prefill's bf16 rows) loads it just before the wait for the buffer: held across the iteration,
  // the 16 bf16 chunks cost prefill 5.9 -> 7.2 ms (RESULTS.md, "cuda producer lanes"). A pair holds
  // half a bf16 row (BatchT<9>): the second half is loaded inside fill_tile, its latency exposed (the
  // fp8 rows, the decode's case, fit one batch).
  constexpr bool kEarly = pair;
  BatchT<pair ? 9 : 16> first;
  if (kEarly) load_batch(ps, t0, a0, 0, lane, first);
  int tc = 0;
  for (; t0.ok; ++tc) {
    TileSrc t2;
    TileIdx<NB> i2;
    TileAddr<NB> a1;
    if constexpr (gen) {
      t2 = next();
    } else {
      if (pw == 0) DSV41_TRACE_P(tc, 8);
      t2 = next();
      i2 = tile_index<NB>(ps, t2, sh, lane);  // consumed one tile later
      if (pw == 0) DSV41_TRACE_P(tc, 9);
      a1 = tile_addr<NB>(ps, t1, i1, sh, lane);
      if (pw == 0) DSV41_TRACE_P(tc, 10);
      tile_prefetch<NB>(ps, t1, a1, lane);
    }
    const int buf = tc & 1;
    if (!kEarly) load_batch(ps, t0, a0, 0, lane, first);
    if (pw == 0) DSV41_TRACE_P(tc, 1);
    if (tc >= 2) {  // tile tc - 2 released by this CTA's consumers (and the peer's)
      bar_sync(kBarEmpty0 + buf, kThreads);
      if (pair && DSV41_TEST_PLANT != 2) mbar_wait(smem_addr(smem + bar_pempty(buf)), (uint32_t)((tc >> 1) - 1) & 1u);
    }
    // (gen: published before the consumers' release of tile tc - 2, or by the prologue; read again after
    // the fill, not held across it: the producers have no register to spare)
    if constexpr (gen) tile_prefetch<NB>(ps, t1, read_half_addr(addr_slot(smem, tc + 1), pw, lane), lane);
    if (pw == 0) DSV41_TRACE_P(tc, 3);
    fill_tile<NB>(smem, crew, buf, ps, t0, a0, sh, lane, first, pw == 0 ? tc : -1);
    if (pw == 0) DSV41_TRACE_P(tc, 4);
    if constexpr (gen) a1 = read_half_addr(addr_slot(smem, tc + 1), pw, lane);
    if (kEarly) load_batch(ps, t1, a1, 0, lane, first);  // the next tile's (nothing when !t1.ok)
    if constexpr (pair) {  // wait until the peer's half has landed in ours
      if (lane == 0) mbar_arrive_expect_tx(smem_addr(smem + bar_pfull(buf)), kPeerBytesPerWarp);
      if (DSV41_TEST_PLANT != 1) mbar_wait(smem_addr(smem + bar_pfull(buf)), (uint32_t)(tc >> 1) & 1u);
      // Bulk copies (default): the peer's rows are async-proxy writes made visible by the PFULL
      // completion, and this warp's own rows were fenced before its copies (store_batch), so no
      // fence here. st.async rows (DSV41_EXP_PAIR_ST_ASYNC): the peer's rows, observed through the
      // PFULL wait, and this warp's own stores: one proxy fence before FULL makes both visible to
      // the consumers' wgmma, here rather than in every consumer thread, where `.shared::cluster`
      // compiled to a GPU-scope MEMBAR per thread and tile (RESULTS.md, sixth session).
      // Assumptions shared with FlashMLA and CUTLASS's cluster pipelines, not spelled out by the PTX
      // ISA: the CTA-scope acquire of the PFULL wait observes the peer's writes (bulk copies and
      // st.async; complete_tx releases at cluster scope; prims.cuh, mbarriers), and, for st.async
      // rows only, the `.shared::cta` fence covers rows the peer wrote into this CTA's window.
      if constexpr (!kPairBulk) fence_proxy_async();
    }
    if (pw == 0) DSV41_TRACE_P(tc, 6);
    bar_arrive(kBarFull0 + buf, C::full_count);
    if (pw == 0) DSV41_TRACE_P(tc, 5);
    if constexpr (C::split) bar_arrive(kBarFullWg1_0 + buf, C::full_count);
    t0 = t1;
    a0 = a1;
    t1 = t2;
    if constexpr (!gen) i1 = i2;
  }
  // Drain: consume the consumers' EMPTY arrivals of the last two tiles so every named-barrier
  // phase completes before the CTA exits (the peer's PEMPTY arrivals need no drain).
  for (int i = tc - 2 < 0 ? 0 : tc - 2; i < tc; ++i) bar_sync(kBarEmpty0 + (i & 1), kThreads);
}

// Consumers, before reading tile tc / after their last read of it.
template <class C>
DEVFN void await_tile(const C&, int tc, int w) {
  bar_sync((C::split && w >= 4 ? kBarFullWg1_0 : kBarFull0) + (tc & 1), C::full_count);
}
template <class C>
DEVFN void release_tile(const C& crew, int tc, int lane) {
  bar_arrive(kBarEmpty0 + (tc & 1), kThreads);
  if constexpr (C::ncta == 2) peer_arrive(crew, bar_pempty(tc & 1), lane);
}

// ============================================================================== consumers
// Fragment ownership of the 256 consumer threads (warp w, g = lane / 4, t = lane % 4):
//  * QK role, both paths: rows r0 = 16 (w & 3) + g and r0 + 8, tokens 32 (w >> 2) + 8j + 2t + 0..1
//    (j = 0..3) of each tile; running max m and partial row sums l of those rows.
//  * O, o[i][e] (i = 0..31): wgmma path rows r0 (e < 2) / r0 + 8, dims 256 (w >> 2) + 8i + 2t + (e & 1);
//    mma.sync path rows 16 (i / 8) + g (+ 8), dims 64 w + 8 (i % 8) + 2t + (e & 1).
struct Acc {
  float o[32][4];
  float m[2];      // base of P = 2^(S - m) (lazy: may lag the running maximum by up to kLazyLog2)
  float l[2];
  float mtrue[2];  // running maximum of S (max_logits)
};
// Lazy rescaling (as FlashAttention-4 and FlashMLA's SM100 kernels do it): the base m moves only
// when a tile's maximum exceeds it by more than this (log2 units), so P <= 2^8 (exact range for
// f16) and most tiles leave O alone (alpha = 1) instead of 128 multiplies per thread.
constexpr float kLazyLog2 = 8.f;
constexpr int kORowBlocks = kWgmma ? 1 : 4;  // distinct 16-row blocks of o per thread
constexpr int kOCols = 32 / kORowBlocks;     // 8-column blocks per row block
DEVFN int o_row(int w, int rb, int g) { return 16 * (kWgmma ? (w & 3) : rb) + g; }
DEVFN int o_dim(int w, int n, int t) { return (kWgmma ? 256 * (w >> 2) : 64 * w) + 8 * n + 2 * t; }

DEVFN void acc_reset(Acc& a) {
#pragma unroll
  for (int i = 0; i < 32; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) a.o[i][e] = 0.f;
  a.m[0] = a.m[1] = a.mtrue[0] = a.mtrue[1] = -finf();
  a.l[0] = a.l[1] = 0.f;
}

// Q rows of one (query token, 64-head group): 64 x 512 bf16 from global, as f16 (kBf16: as loaded)
// into the swizzled tile layout. Called by all 256 consumer threads; ends with the consumer barrier.
// kRound: loads in flight per thread (16: one latency instead of two, for callers with the registers free).
template <bool kBf16 = false, int kRound = 8>
DEVFN void load_q(char* smem, const uint16_t* q, int ct) {
#pragma unroll
  for (int i0 = 0; i0 < 16; i0 += kRound) {
    uint4 v[kRound];
#pragma unroll
    for (int i = 0; i < kRound; ++i) {
      const int c = ct + kConsumerThreads * (i0 + i);
      v[i] = ldg_nc_v4(q + (c >> 6) * kHeadDim + (c & 63) * 8);
    }
#pragma unroll
    for (int i = 0; i < kRound; ++i) {
      const int c = ct + kConsumerThreads * (i0 + i);
      *reinterpret_cast<uint4*>(smem + kSmemQ + tile_off(c >> 6, c & 63)) = kBf16 ? v[i] : bf16x8_to_f16x8(v[i]);
    }
  }
  fence_proxy_async();
  bar_sync(kBarConsumers, kConsumerThreads);
}

// Online-softmax update of row hr (this tile's maximum mt, log2 domain) with the lazy base: returns
// the base of P = 2^(S - base) and sets alpha, the factor for the row's O and l.
DEVFN float lazy_row_update(Acc& acc, int hr, float mt, float& alpha) {
  acc.mtrue[hr] = fmaxf(acc.mtrue[hr], mt);
  const bool move = mt > acc.m[hr] + kLazyLog2;  // from a -inf base: any finite maximum
  const float mnew = move ? mt : acc.m[hr];
  const float base = (mnew == -finf()) ? 0.f : mnew;  // keeps (-inf) - (-inf) out
  alpha = move ? fexp2(acc.m[hr] - base) : 1.f;       // 0 when moving off -inf
  acc.m[hr] = mnew;
  return base;
}

// O *= alpha (rows r0 / r0 + 8 of the wgmma layout), skipped unless a row of the warp moved its base;
// warp-uniform because the .aligned wgmma fence follows.
DEVFN void rescale_o(Acc& acc, const float (&alpha)[2]) {
  if (ballot(alpha[0] != 1.f || alpha[1] != 1.f) != 0u) {
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      acc.o[i][0] *= alpha[0];
      acc.o[i][1] *= alpha[0];
      acc.o[i][2] *= alpha[1];
      acc.o[i][3] *= alpha[1];
    }
  }
}

// Row hr's maximum over this thread's J column blocks of S and over its quad (the 4 lanes of a row).
template <int J>
DEVFN float quad_row_max(const float (&s)[J][4], int hr) {
  float v = -finf();
#pragma unroll
  for (int j = 0; j < J; ++j) v = fmaxf(v, fmaxf(s[j][2 * hr], s[j][2 * hr + 1]));
  v = fmaxf(v, shfl_xor_f32(v, 1));
  return fmaxf(v, shfl_xor_f32(v, 2));
}

// Row hr of S becomes P = 2^(S - base) in place (2^-inf = 0 for masked tokens); l = l * alpha + the
// row's new partial sum. kScaled: S is unscaled, P = 2^(S * scale - base) (one FFMA).
template <int J, bool kScaled = false>
DEVFN void exp_row(float (&s)[J][4], int hr, float base, float alpha, Acc& acc, float scale = 1.f) {
  float sum = 0.f;
#pragma unroll
  for (int j = 0; j < J; ++j) {
    const float p0 = fexp2(kScaled ? fmaf(s[j][2 * hr], scale, -base) : s[j][2 * hr] - base);
    const float p1 = fexp2(kScaled ? fmaf(s[j][2 * hr + 1], scale, -base) : s[j][2 * hr + 1] - base);
    s[j][2 * hr] = p0;
    s[j][2 * hr + 1] = p1;
    sum += p0 + p1;
  }
  acc.l[hr] = acc.l[hr] * alpha + sum;
}

// S (16 scores per thread, QK-role layout) -> masked, scaled to the log2 domain; exchange of the row
// maxima between the two token halves (barrier B1); online-softmax update of m, l; returns
// alpha (rescale factor of rows r0, r0 + 8) and leaves P = 2^(S - base) in s.
DEVFN void softmax_tile(char* smem, int buf, float (&s)[4][4], Acc& acc, float scale_log2, int w, int lane,
                        float (&alpha)[2], int tr = 0) {
  const int g = lane >> 2, t = lane & 3, rq = w & 3, th = w >> 2;
  float* rmax = reinterpret_cast<float*>(smem + kSmemRowMax);
  // tokens 32th..32th+31: mask words 4th..4th+3 (8 tokens each)
  const uint4 vw = reinterpret_cast<const uint4*>(smem + kSmemValid)[buf * 2 + th];
  const uint32_t vm = vw.x | (vw.y << 8) | (vw.z << 16) | (vw.w << 24);
  const float ninf = -finf();
#pragma unroll
  for (int j = 0; j < 4; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int bit = 8 * j + 2 * t + (e & 1);
      s[j][e] = ((vm >> bit) & 1u) ? s[j][e] * scale_log2 : ninf;
    }
  const float mx[2] = {quad_row_max(s, 0), quad_row_max(s, 1)};
  const int r0 = 16 * rq + g;
  if (t == 0) {
    rmax[th * 64 + r0] = mx[0];
    rmax[th * 64 + r0 + 8] = mx[1];
  }
  bar_sync(kBarConsumers, kConsumerThreads);  // B1
  DSV41_TRACE_C(w, tr, 4);
  // both token halves of a row compute the identical M
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int r = r0 + 8 * hr;
    const float base = lazy_row_update(acc, hr, fmaxf(rmax[r], rmax[64 + r]), alpha[hr]);  // sets alpha[hr]
    exp_row(s, hr, base, alpha[hr], acc);
  }
}

// P (f16, one term: 11 significant bits; bf16 operands: 8) of this thread's 4J entries into the P tile of `buf`:
// [64 heads][64 tokens], 128-byte rows, chunk c of row r at c ^ (r & 7). The thread holds rows
// 16 (w & 3) + lane / 4 (+ 8) and, in column block j, chunk chunk0 + j.
// pack_p: the entries as f16 pairs, pk[j][hr] = row r0 + 8 hr of column block j (also the A
// fragments of a register-operand wgmma: wgmma_m64n256k16_rs_tb); store_p writes them.
template <int J, bool kBf16 = false>
DEVFN void pack_p(const float (&s)[J][4], uint32_t (&pk)[J][2]) {
#pragma unroll
  for (int j = 0; j < J; ++j)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) pk[j][hr] = pack_x2<kBf16>(s[j][2 * hr], s[j][2 * hr + 1]);
}
template <int J>
DEVFN void store_p(char* smem, int buf, const uint32_t (&pk)[J][2], int chunk0, int w, int lane) {
  const int t = lane & 3, r0 = 16 * (w & 3) + (lane >> 2);
  char* ps = smem + kSmemP + buf * kSmemPBytes;
#pragma unroll
  for (int j = 0; j < J; ++j)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) *reinterpret_cast<uint32_t*>(ps + swz128(r0 + 8 * hr, chunk0 + j) + 4 * t) = pk[j][hr];
}

// Byte offset of k-step ks (dims 16ks..16ks+15) in a [64][512] swizzled tile (Q, K): column block ks / 4,
// 32 bytes per step inside it; descriptors move by it (wgmma_desc_add).
DEVFN uint32_t kstep_off(int ks) { return (uint32_t)(ks >> 2) * 8192u + (uint32_t)(ks & 3) * 32u; }

// S = Q K^T over kSteps x 16 dims (all 512 by default) as the fragment of wgmma m64nNk16 (N = 32
// or 64 tokens), Q and K from shared memory through the descriptors of their first 16 dims; returns
// with the products in s.
template <int N, bool kBf16 = false, int kSteps = kHeadDim / 16>
DEVFN void qk_wgmma(float (&s)[N / 8][4], uint64_t qd, uint64_t kd) {
#pragma unroll
  for (int j = 0; j < N / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[j][e] = 0.f;
  reg_fence<N / 2>(&s[0][0]);
  wgmma_fence();
#ifndef DSV41_EXP_NO_MMA  // experiment: no tensor-core work, everything else unchanged
#pragma unroll
  for (int ks = 0; ks < kSteps; ++ks) {
    const uint32_t koff = kstep_off(ks);
    if constexpr (N == 32)
      wgmma_m64n32k16<kBf16>(&s[0][0], wgmma_desc_add(qd, koff), wgmma_desc_add(kd, koff));
    else
      wgmma_m64n64k16<kBf16>(&s[0][0], wgmma_desc_add(qd, koff), wgmma_desc_add(kd, koff));
  }
#endif
  wgmma_commit();
  wgmma_wait<0>();
  reg_fence<N / 2>(&s[0][0]);
}

// O[:, 256th..256th+255] += P V over the tile's 64 tokens (m64n256k16 x 4; P and V from shared
// memory through descriptors pd / vd); O already rescaled. pv_issue commits the group and returns
// (the caller waits: seesaw.cuh); pv_wgmma returns with O updated.
template <bool kBf16 = false>
DEVFN void pv_issue(Acc& acc, uint64_t pd, uint64_t vd) {
  reg_fence<128>(&acc.o[0][0]);
  wgmma_fence();
#ifndef DSV41_EXP_NO_MMA
#pragma unroll
  for (int kk = 0; kk < kTileTokens / 16; ++kk)
    wgmma_m64n256k16_tb<kBf16>(&acc.o[0][0], wgmma_desc_add(pd, 32u * kk), wgmma_desc_add(vd, 16u * 128u * kk));
#endif
  wgmma_commit();
}
template <bool kBf16 = false>
DEVFN void pv_wgmma(Acc& acc, uint64_t pd, uint64_t vd) {
  pv_issue<kBf16>(acc, pd, vd);
  wgmma_wait<0>();
  reg_fence<128>(&acc.o[0][0]);
}
// The same with P from registers (pk: pack_p's words of all 64 tokens of the thread's rows; split
// consumers' warpgroup 0): no shared-memory round trip, no barrier before it.
template <bool kBf16 = false>
DEVFN void pv_issue_regp(Acc& acc, const uint32_t (&pk)[8][2], uint64_t vd) {
  reg_fence<128>(&acc.o[0][0]);
  wgmma_fence();
#ifndef DSV41_EXP_NO_MMA
#pragma unroll
  for (int kk = 0; kk < kTileTokens / 16; ++kk) {
    const uint32_t a[4] = {pk[2 * kk][0], pk[2 * kk][1], pk[2 * kk + 1][0], pk[2 * kk + 1][1]};
    wgmma_m64n256k16_rs_tb<kBf16>(&acc.o[0][0], a, wgmma_desc_add(vd, 16u * 128u * kk));
  }
#endif
  wgmma_commit();
}
template <bool kBf16 = false>
DEVFN void pv_wgmma_regp(Acc& acc, const uint32_t (&pk)[8][2], uint64_t vd) {
  pv_issue_regp<kBf16>(acc, pk, vd);
  wgmma_wait<0>();
  reg_fence<128>(&acc.o[0][0]);
}

// A pair's symmetric consumers (Crew::ksplit; off under DSV41_EXP_NO_QK_KSPLIT): S split over the
// dims instead of the tokens. Warpgroup th computes partial scores of all 64 tokens over dims
// 256th..256th+255 (m64n64k16 x 16: Q read once per tile instead of once per warpgroup, half the
// wgmma issues), sends the other token half's partials to the warpgroup that owns those tokens
// (the thread with the same rows and columns there) and adds the partials it receives for its own
// 32 tokens, ending in the fragment layout of the m64n32 scores (s[j] = tokens 32th + 8j + ...).
// Shared-memory operand bytes per tile: 128 KB instead of 192 KB (the m64n32 S was bound by them),
// plus 32 KB of exchange traffic (a 16 KB region); needs 200 consumer registers (params.h
// kPairConsumerRegs). Decode -1.6% (eighth session). The exchange region is reused per tile: a
// warpgroup writes it again only after B1 of this tile, which the other one reaches after its reads.
template <bool kBf16>
DEVFN void sym_qk_ksplit(char* smem, int buf, float (&s)[4][4], int w, int lane, int tr = 0) {
  const uint32_t th = (uint32_t)(w >> 2);
  const uint32_t ka = smem_addr(smem + kSmemK + buf * kTileBytes) + th * 4u * 8192u;
  // (opaque: hoisted out of the tile loop, the 16 Q descriptors spilled)
  const uint64_t qd = opaque_u64(wgmma_desc(smem_addr(smem + kSmemQ) + th * 4u * 8192u, 16, 1024));
  const uint64_t kd = opaque_u64(wgmma_desc(ka, 16, 1024));
  float p[8][4];
  qk_wgmma<64, kBf16, kHeadDim / 32>(p, qd, kd);
  DSV41_TRACE_C(w, tr, 2);
  const int tid = 32 * (w & 3) + lane;
  float4* xo = reinterpret_cast<float4*>(smem + kSmemXS + (int)th * 8192) + tid;
  const float4* xi = reinterpret_cast<const float4*>(smem + kSmemXS + (1 - (int)th) * 8192) + tid;
#pragma unroll
  for (int j = 0; j < 4; ++j)  // the other warpgroup's tokens: column blocks 4 (1 - th) + j
    xo[128 * j] = th ? make_f4(p[j][0], p[j][1], p[j][2], p[j][3])
                     : make_f4(p[4 + j][0], p[4 + j][1], p[4 + j][2], p[4 + j][3]);
  bar_sync(kBarConsumers, kConsumerThreads);  // B0: partial scores exchanged
  DSV41_TRACE_C(w, tr, 3);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float4 v = xi[128 * j];
    s[j][0] = (th ? p[4 + j][0] : p[j][0]) + v.x;
    s[j][1] = (th ? p[4 + j][1] : p[j][1]) + v.y;
    s[j][2] = (th ? p[4 + j][2] : p[j][2]) + v.z;
    s[j][3] = (th ? p[4 + j][3] : p[j][3]) + v.w;
  }
}

// sm_90a: warpgroup MMAs. Warpgroup th = w >> 2 computes S for tokens 32th..32th+31 of all 64
// heads (m64n32k16 x 32 k-steps over the 512 dims, Q and K from shared memory), and then O for
// dims 256th..256th+255 of all 64 heads (m64n256k16 x 4 token steps, P and V from shared memory:
// V is the K tile read MN-major). The thread that owns a score row also owns that row of O, so
// the rescale needs no exchange.
template <bool kBf16, bool kKSplit>
DEVFN void consume_tile_wgmma(char* smem, int buf, Acc& acc, float scale_log2, int w, int lane, int tr = 0) {
  // Operand descriptors built once per tile; each wgmma adds a constant offset (wgmma_desc_add).
  // (Taking th through a lane-0 shuffle, to make it uniform, cost the pair kernel 8 bytes of spills.)
  const uint32_t th = (uint32_t)(w >> 2);
  const uint32_t ka = smem_addr(smem + kSmemK + buf * kTileBytes);
  const uint64_t qd = wgmma_desc(smem_addr(smem + kSmemQ), 16, 1024);
  const uint64_t kd = wgmma_desc(ka + 32u * 128u * th, 16, 1024);
  const uint64_t pd = wgmma_desc(smem_addr(smem + kSmemP + buf * kSmemPBytes), 16, 1024);
  const uint64_t vd = wgmma_desc(ka + 4u * 8192u * th, 8192, 1024);
  float s[4][4];
  if constexpr (kKSplit)
    sym_qk_ksplit<kBf16>(smem, buf, s, w, lane, tr);
  else
    qk_wgmma<32, kBf16>(s, qd, kd);

  float alpha[2];
  softmax_tile(smem, buf, s, acc, scale_log2, w, lane, alpha, tr);
  uint32_t pk[4][2];
  pack_p<4, kBf16>(s, pk);
  store_p(smem, buf, pk, 4 * (w >> 2), w, lane);
  DSV41_TRACE_C(w, tr, 8);
  fence_proxy_async();
  DSV41_TRACE_C(w, tr, 9);
  bar_sync(kBarConsumers, kConsumerThreads);  // B2: all of P written
  DSV41_TRACE_C(w, tr, 5);

  rescale_o(acc, alpha);
  pv_wgmma<kBf16>(acc, pd, vd);
  DSV41_TRACE_C(w, tr, 6);
  // The tile's operands have been read: the caller releases the buffer (release_tile).
}

// sm_100a (and DSV41_FORCE_MMA_SYNC): warp-level mma.sync m16n8k16 with ldmatrix operands.
//   QK: warp w = rows 16 (w & 3)..+16, tokens 32 (w >> 2)..+32, all 512 dims.
//   PV: warp w = all 64 heads x dims 64w..64w+63 (P via ldmatrix, V via ldmatrix.trans from the
//   K tile); the per-row alpha travels through shared memory (the rows of O are not the QK rows).
DEVFN void consume_tile_mma_sync(char* smem, int buf, Acc& acc, float scale_log2, int w, int lane) {
  const int g = lane >> 2, t = lane & 3;
  const int rq = w & 3, th = w >> 2;
  const char* qs = smem + kSmemQ;
  const char* ks = smem + kSmemK + buf * kTileBytes;
  const char* ps = smem + kSmemP + buf * kSmemPBytes;
  float* alpha_s = reinterpret_cast<float*>(smem + kSmemAlpha);

  float s[4][4];
#pragma unroll
  for (int j = 0; j < 4; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[j][e] = 0.f;
  // A (Q) via ldmatrix.x4: lanes 0-7 rows 0-7 / k 0-7, 8-15 rows 8-15 / k 0-7, 16-23 rows 0-7 /
  // k 8-15, 24-31 rows 8-15 / k 8-15 -> a[0..3] in mma order.
  const int a_row = 16 * rq + (lane & 15);
  const int a_chunk = lane >> 4;
  // B (K rows) via ldmatrix.x4, two n-tiles per load: matrix i = lane/8 covers tokens
  // 8*(i/2) + 0..7 (relative) and dims chunk 2kk + (i&1) -> {b_lo, b_hi} of n-tile 2jp and 2jp+1.
  const int b_tok = 32 * th + (lane & 7) + ((lane >> 4) << 3);
  const int b_chunk = (lane >> 3) & 1;
#pragma unroll 4
  for (int kk = 0; kk < kHeadDim / 16; ++kk) {
    uint32_t a[4], b0[4], b1[4];
    ldsm_x4(a, qs + tile_off(a_row, 2 * kk + a_chunk));
    ldsm_x4(b0, ks + tile_off(b_tok, 2 * kk + b_chunk));
    ldsm_x4(b1, ks + tile_off(b_tok + 16, 2 * kk + b_chunk));
    mma_f16_16816(s[0], a, b0[0], b0[1]);
    mma_f16_16816(s[1], a, b0[2], b0[3]);
    mma_f16_16816(s[2], a, b1[0], b1[1]);
    mma_f16_16816(s[3], a, b1[2], b1[3]);
  }

  float alpha[2];
  softmax_tile(smem, buf, s, acc, scale_log2, w, lane, alpha);
  uint32_t pk[4][2];
  pack_p(s, pk);
  store_p(smem, buf, pk, 4 * (w >> 2), w, lane);
  if (th == 0 && t == 0) {
    alpha_s[16 * rq + g] = alpha[0];
    alpha_s[16 * rq + g + 8] = alpha[1];
  }
  bar_sync(kBarConsumers, kConsumerThreads);  // B2

#pragma unroll
  for (int mt = 0; mt < 4; ++mt) {
    const float alo = alpha_s[16 * mt + g], ahi = alpha_s[16 * mt + g + 8];
#pragma unroll
    for (int n = 0; n < 8; ++n) {
      acc.o[8 * mt + n][0] *= alo;
      acc.o[8 * mt + n][1] *= alo;
      acc.o[8 * mt + n][2] *= ahi;
      acc.o[8 * mt + n][3] *= ahi;
    }
  }
  // V via ldmatrix.x4.trans: matrix i = lane/8 covers tokens 16kk + 8*(i&1) + 0..7 and dims chunk
  // 8w + 2np + (i>>1) -> {b_lo, b_hi} of n-tile 2np, then of n-tile 2np+1.
  const int v_tok = (lane & 7) + (((lane >> 3) & 1) << 3);
  const int v_chunk = 8 * w + (lane >> 4);
#pragma unroll
  for (int kk = 0; kk < kTileTokens / 16; ++kk) {
    uint32_t ph[4][4];
#pragma unroll
    for (int mt = 0; mt < 4; ++mt) ldsm_x4(ph[mt], ps + swz128(16 * mt + (lane & 15), 2 * kk + (lane >> 4)));
#pragma unroll
    for (int np = 0; np < 4; ++np) {
      uint32_t vb[4];
      ldsm_x4_trans(vb, ks + tile_off(16 * kk + v_tok, v_chunk + 2 * np));
#pragma unroll
      for (int mt = 0; mt < 4; ++mt) {
        mma_f16_16816(acc.o[8 * mt + 2 * np], ph[mt], vb[0], vb[1]);
        mma_f16_16816(acc.o[8 * mt + 2 * np + 1], ph[mt], vb[2], vb[3]);
      }
    }
  }
  // Every ldmatrix of this buffer has delivered its registers to an mma issued above, so the
  // caller may release the buffer (release_tile).
}

// Work warpgroup 1 does while its PV of tile tc runs (a pair's split decode: the producers' addresses,
// AddrGen); none elsewhere.
struct NoSide {
  DEVFN void operator()(int) const {}
};

#if DSV41_WGMMA
// FlashMLA's consumer split (flashmla.md section 4). Warpgroup 0
// computes S for the whole tile (m64n64k16: no row-max exchange, two thirds of the operand bytes of
// two m64n32 halves), the softmax, P into shared memory with the per-row alpha (for warpgroup 1),
// and O[:, 0:256] with its own P as the wgmma's register operand (pv_wgmma_regp); warpgroup 1 only
// rescales and adds P V into O[:, 256:512], so its PV of tile n runs while warpgroup 0 computes S of
// tile n + 1. Warpgroup 1 keeps l = 0 and never moves m (the epilogue
// adds the two halves' l and takes warpgroup 0's m). P and alpha are double-buffered (buffer tc & 1);
// reusing one needs no barrier of its own: tile tc is filled only after every consumer thread
// released tile tc - 2 (EMPTY), i.e. after warpgroup 1's PV of tile tc - 2 completed. The default
// for prefill and a pair's decode (test_emulated_flipped_consumer_shapes flips both).
// Experiments for warpgroup 0's softmax, both measured slower (346.8 and 349.7 vs 343.6 us; RESULTS.md,
// fifteenth session): DSV41_EXP_STSM_P stores P with 4 stmatrix.x4
// instead of 16 4-byte stores; DSV41_EXP_FUSED_SCALE masks the raw scores and folds the scale into the
// exponent's FFMA, 2^(s * scale - base) (one multiply less per score; for positive scales only, the
// maximum of the raw scores then being that of the scaled ones; others take the default path).
#ifdef DSV41_EXP_STSM_P
constexpr bool kStsmP = true;
#else
constexpr bool kStsmP = false;
#endif
#ifdef DSV41_EXP_FUSED_SCALE
constexpr bool kFusedScale = true;
#else
constexpr bool kFusedScale = false;
#endif
// store_p's 64 x 64 tile by stmatrix: matrix m of column block pair (j, j + 1) is column block j + (m >> 1),
// rows 8 (m & 1) .. + 7 of the warp's 16; lane l addresses row l & 7 of matrix l >> 3.
DEVFN void store_p_stsm(char* smem, int buf, const uint32_t (&pk)[8][2], int w, int lane) {
  const int m = lane >> 3, row = 16 * (w & 3) + 8 * (m & 1) + (lane & 7);
  char* ps = smem + kSmemP + buf * kSmemPBytes;
#pragma unroll
  for (int j = 0; j < 8; j += 2) {
    const uint32_t r[4] = {pk[j][0], pk[j][1], pk[j + 1][0], pk[j + 1][1]};
    stsm_x4(ps + swz128(row, j + (m >> 1)), r);
  }
}
// The split's mask (token 8j + 2t + (e & 1): bit 2t + (e & 1) of word j of vw) and, when kScale, the scale
// to the log2 domain.
template <bool kScale>
DEVFN void mask_scores(float (&s)[8][4], const uint32_t* vw, int t, float scale_log2) {
  const float ninf = -finf();
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const uint32_t bits = vw[j] >> (2 * t);
#pragma unroll
    for (int e = 0; e < 4; ++e) s[j][e] = ((bits >> (e & 1)) & 1u) ? (kScale ? s[j][e] * scale_log2 : s[j][e]) : ninf;
  }
}
// Warpgroup 0 of the split, after S of tile tc: mask, softmax, P (packed into pk) and alpha to shared
// memory for warpgroup 1 (the P-ready barrier), O rescaled; its PV is the caller's.
template <bool kBf16>
DEVFN void split_softmax_publish(char* smem, int tc, float (&s)[8][4], uint32_t (&pk)[8][2], Acc& acc,
                                 float scale_log2, int w, int lane) {
  const int buf = tc & 1, g = lane >> 2, t = lane & 3;
  const int r0 = 16 * (w & 3) + g;
  float* alpha_b = reinterpret_cast<float*>(smem + kSmemRowMax) + 64 * buf;
  float alpha[2] = {1.f, 1.f};
  const uint32_t* vw = reinterpret_cast<const uint32_t*>(smem + kSmemValid) + 8 * buf;
  const bool fused = kFusedScale && scale_log2 > 0.f;  // (uniform)
  if (fused) mask_scores<false>(s, vw, t, scale_log2);
  else mask_scores<true>(s, vw, t, scale_log2);
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const float mt = quad_row_max(s, hr);
    const float base = lazy_row_update(acc, hr, fused ? mt * scale_log2 : mt, alpha[hr]);  // sets alpha[hr]
    if (fused) exp_row<8, true>(s, hr, base, alpha[hr], acc, scale_log2);
    else exp_row(s, hr, base, alpha[hr], acc);
  }
  pack_p<8, kBf16>(s, pk);
  DSV41_TRACE_C(w, tc, 4);
  if constexpr (kStsmP) store_p_stsm(smem, buf, pk, w, lane);  // for warpgroup 1
  else store_p(smem, buf, pk, 0, w, lane);
  if (t == 0) {
    alpha_b[r0] = alpha[0];
    alpha_b[r0 + 8] = alpha[1];
  }
  fence_proxy_async();
  bar_arrive(kBarPReady0 + buf, kConsumerThreads);
  DSV41_TRACE_C(w, tc, 5);
  rescale_o(acc, alpha);
}

template <bool kBf16, class Side = NoSide>
DEVFN void consume_tile_split(char* smem, int tc, Acc& acc, float scale_log2, int w, int lane,
                              const Side& side = Side{}) {
  const int buf = tc & 1, th = w >> 2, g = lane >> 2;
  const int r0 = 16 * (w & 3) + g;
  const uint32_t ka = smem_addr(smem + kSmemK + buf * kTileBytes);
  const float* alpha_b = reinterpret_cast<const float*>(smem + kSmemRowMax) + 64 * buf;  // warpgroup 0's alpha
  if (th == 0) {
    const uint64_t qd = wgmma_desc(smem_addr(smem + kSmemQ), 16, 1024);
    const uint64_t kd = wgmma_desc(ka, 16, 1024);
    float s[8][4];
    qk_wgmma<64, kBf16>(s, qd, kd);
    DSV41_TRACE_C(w, tc, 2);
    uint32_t pk[8][2];
    split_softmax_publish<kBf16>(smem, tc, s, pk, acc, scale_log2, w, lane);
    pv_wgmma_regp<kBf16>(acc, pk, wgmma_desc(ka, 8192, 1024));  // its own P from registers
    DSV41_TRACE_C(w, tc, 6);
    return;
  }
  bar_sync(kBarPReady0 + buf, kConsumerThreads);
  DSV41_TRACE_C(w, tc, 5);
  const float alpha[2] = {alpha_b[r0], alpha_b[r0 + 8]};
  rescale_o(acc, alpha);
  pv_issue<kBf16>(acc, wgmma_desc(smem_addr(smem + kSmemP + buf * kSmemPBytes), 16, 1024),
                 wgmma_desc(ka + 4u * 8192u, 8192, 1024));
  side(tc);
  wgmma_wait<0>();
  reg_fence<128>(&acc.o[0][0]);
  DSV41_TRACE_C(w, tc, 6);
}
#endif

// Which consumers each kernel uses (measured on the H200, RESULTS.md "cuda split consumers", "cuda
// sixth session" and "thirteenth session"): the split wins for prefill (5878 -> 5412 us) and for a pair's
// decode (396.4 -> 376.4 us in one call once its producers keep their 104 registers: the earlier
// comparisons gave them 120 and a 24-byte spill). The split shortens the time a tile is held (warpgroup
// 1's PV of tile n overlaps warpgroup 0's S of tile n + 1, and no row-max or P barrier joins both), and
// with two K buffers that time, plus the producers' refill, sets the tile period. One CTA's decode keeps
// the symmetric consumers (the split spills 16 bytes there at 120 / 192 registers).
// DSV41_EXP_DECODE_SYM / DSV41_EXP_NO_WG_SPLIT flip them for ablations.
#ifdef DSV41_EXP_DECODE_SYM
constexpr bool kDecodeSplit = false;
#else
constexpr bool kDecodeSplit = true;
#endif
#ifdef DSV41_EXP_NO_WG_SPLIT
constexpr bool kPrefillSplit = false;
#else
constexpr bool kPrefillSplit = true;
#endif
// Prefill's operands: f16 as decode's, or, in the DSV41_EXP_PREFILL_BF16 experiment build, bf16 (its
// rows are bf16: no conversion in the producers or load_q). Not the default: P rounded to bf16 (as
// FlashMLA's kernels do) fails the prefill tolerance on a few elements of the emulator tests
// (test_emulated_prefill_grid: 10 of 40960 outputs, abs error 1.0e-3 against 8e-4).
#ifdef DSV41_EXP_PREFILL_BF16
constexpr bool kPrefillBf16 = true;
#else
constexpr bool kPrefillBf16 = false;
#endif

// tc: the tile's index in the CTA's sequence (buffer tc & 1).
template <class C, class Side = NoSide>
DEVFN void consume_tile(const C&, char* smem, int tc, Acc& acc, float scale_log2, int w, int lane,
                        const Side& side = Side{}) {
#if DSV41_WGMMA
  if constexpr (C::split) {
    consume_tile_split<C::bf16>(smem, tc, acc, scale_log2, w, lane, side);
    return;
  }
#endif
  if constexpr (kWgmma)
    consume_tile_wgmma<C::bf16, C::ksplit>(smem, tc & 1, acc, scale_log2, w, lane, tc);
  else
    consume_tile_mma_sync(smem, tc & 1, acc, scale_log2, w, lane);
}

// Tiles tc0 .. tc0 + n - 1 of the CTA's sequence: wait, consume, release each. (Keeping a tile's PV
// in flight across the wait for the next tile and its QK issue made the decode 6.5% slower: the
// release of the tile comes later; RESULTS.md, eighth session.)
#if DSV41_WGMMA && defined(DSV41_EXP_WG0_PV_LATE)
constexpr bool kWg0PvLate = true;
// Experiment (a pair's split decode): warpgroup 0's PV of tile tc stays in flight across the wait for tile
// tc + 1 (one function, the wait_group unconditional at the top of each iteration, so ptxas keeps the
// wgmma in flight); tile tc is released after that wait. Needs 208 registers (decode_cta). Measured slower
// (354.8 vs 347.1 us; RESULTS.md, fourteenth session): the later release delays the producers' refill.
template <class C>
DEVFN void wg0_tiles_pv_late(const C& crew, char* smem, int tc0, int n, Acc& acc, float scale_log2, int w, int lane) {
  const uint64_t qd = wgmma_desc(smem_addr(smem + kSmemQ), 16, 1024);
  for (int tc = tc0; tc < tc0 + n; ++tc) {
    DSV41_TRACE_C(w, tc, 0);
    await_tile(crew, tc, w);
    DSV41_TRACE_C(w, tc, 1);
    wgmma_wait<0>();  // the PV of tile tc - 1 (nothing in flight at tc0)
    reg_fence<128>(&acc.o[0][0]);
    if (tc > tc0) {
      DSV41_TRACE_C(w, tc - 1, 6);
      release_tile(crew, tc - 1, lane);
      DSV41_TRACE_C(w, tc - 1, 7);
    }
    const uint32_t ka = smem_addr(smem + kSmemK + (tc & 1) * kTileBytes);
    float s[8][4];
    qk_wgmma<64, C::bf16>(s, qd, wgmma_desc(ka, 16, 1024));
    DSV41_TRACE_C(w, tc, 2);
    uint32_t pk[8][2];
    split_softmax_publish<C::bf16>(smem, tc, s, pk, acc, scale_log2, w, lane);
    pv_issue_regp<C::bf16>(acc, pk, wgmma_desc(ka, 8192, 1024));
  }
  wgmma_wait<0>();
  reg_fence<128>(&acc.o[0][0]);
  if (n > 0) release_tile(crew, tc0 + n - 1, lane);
}
#else
constexpr bool kWg0PvLate = false;
#endif

template <class C, class Side = NoSide>
DEVFN void consume_tiles(const C& crew, char* smem, int tc0, int n, Acc& acc, float scale_log2, int w, int lane,
                         const Side& side = Side{}) {
#if DSV41_WGMMA && defined(DSV41_EXP_WG0_PV_LATE)
  if constexpr (C::split && C::ncta == 2) {
    if (w < 4) {
      wg0_tiles_pv_late(crew, smem, tc0, n, acc, scale_log2, w, lane);
      return;
    }
  }
#endif
  for (int tc = tc0; tc < tc0 + n; ++tc) {
    DSV41_TRACE_C(w, tc, 0);
    await_tile(crew, tc, w);
    DSV41_TRACE_C(w, tc, 1);
    consume_tile(crew, smem, tc, acc, scale_log2, w, lane, side);
    release_tile(crew, tc, lane);
    DSV41_TRACE_C(w, tc, 7);
  }
}


// Row statistics of the finished segment to smem; returns after the consumer barrier (B3).
DEVFN void publish_row_stats(char* smem, Acc& acc, int w, int lane) {
  const int g = lane >> 2, t = lane & 3, rq = w & 3, th = w >> 2;
  float* lsum = reinterpret_cast<float*>(smem + kSmemLsum);
  float* mfin = reinterpret_cast<float*>(smem + kSmemMfin);
  float* mtrue = reinterpret_cast<float*>(smem + kSmemMtrue);
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    float l = acc.l[hr];
    l += shfl_xor_f32(l, 1);
    l += shfl_xor_f32(l, 2);
    const int r = 16 * rq + g + 8 * hr;
    if (t == 0) {
      lsum[th * 64 + r] = l;
      if (th == 0) {
        mfin[r] = acc.m[hr];
        mtrue[r] = acc.mtrue[hr];
      }
    }
  }
  bar_sync(kBarConsumers, kConsumerThreads);  // B3
}

// Row r's output factor 1 / L / (1 + 2^(sink*log2e - lse2)), natural-log lse (+inf if empty) and
// max_logits (natural, -inf if empty) from the published statistics.
struct FinalRow {
  float factor, lse_nat, maxl;
};
DEVFN FinalRow final_row(const char* smem, int r, const float* sink0) {
  const float* lsum = reinterpret_cast<const float*>(smem + kSmemLsum);
  const float* mfin = reinterpret_cast<const float*>(smem + kSmemMfin);
  const float* mtrue = reinterpret_cast<const float*>(smem + kSmemMtrue);
  const float L = lsum[r] + lsum[64 + r];
  const float M = mfin[r];
  FinalRow f{0.f, finf(), -finf()};
  if (L > 0.f) {
    const float lse2 = M + flog2(L);
    const float sink2 = sink0 ? ldg_nc_f32(sink0 + r) * kLog2e : -finf();  // +-inf stay +-inf
    f.factor = 1.f / (L * (1.f + fexp2(sink2 - lse2)));  // sink=+inf -> 1/inf = 0
    f.lse_nat = lse2 * kLn2;
    f.maxl = mtrue[r] * kLn2;
  }
  return f;
}

// Final epilogue: out bf16 = O * factor, lse, optional max_logits (final_row). `orow0` points at head 0
// of this CTA's group. Row statistics are written by the threads holding dims 0..1 of a row.
DEVFN void write_final(const char* smem, const Acc& acc, int w, int lane, uint16_t* orow0, float* lse0,
                       float* maxl0, const float* sink0) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int rb = 0; rb < kORowBlocks; ++rb)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int r = o_row(w, rb, g) + 8 * hr;
      const FinalRow fr = final_row(smem, r, sink0);
      uint16_t* orow = orow0 + (int64_t)r * kHeadDim;
#pragma unroll
      for (int n = 0; n < kOCols; ++n) {
        const float* o = acc.o[kOCols * rb + n];
        *reinterpret_cast<uint32_t*>(orow + o_dim(w, n, t)) =
            pack_bf16x2(o[2 * hr] * fr.factor, o[2 * hr + 1] * fr.factor);
      }
      if (o_dim(w, 0, t) == 0) {
        lse0[r] = fr.lse_nat;
        if (maxl0) maxl0[r] = fr.maxl;
      }
    }
}

// write_final through shared memory (wgmma layout; the Q region, free once every S of the segment is done):
// each thread's bf16 pairs go to a [64][1024 B] staging tile (16-byte chunk c of row r at c ^ (r & 7): no bank
// conflicts), then the 256 consumers store it with coalesced 16-byte writes (the direct 4-byte stores leave each
// 32-byte sector half used). lse and max_logits (when kMaxl) as write_final. kBarAfter: a barrier after the
// copy-out, so that the caller may overwrite the Q region (the next segment's load_q).
template <bool kMaxl, bool kBarAfter>
DEVFN void write_final_staged(char* smem, const Acc& acc, int w, int lane, uint16_t* orow0, float* lse0,
                              float* maxl0, const float* sink0) {
  const int g = lane >> 2, t = lane & 3;
  char* stage = smem + kSmemQ;
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int r = o_row(w, 0, g) + 8 * hr;
    const FinalRow fr = final_row(smem, r, sink0);
#pragma unroll
    for (int n = 0; n < 32; ++n) {
      const int c = 32 * (w >> 2) + n;  // dims 8c..8c+7
      *reinterpret_cast<uint32_t*>(stage + r * 1024 + ((c ^ (r & 7)) << 4) + 4 * t) =
          pack_bf16x2(acc.o[n][2 * hr] * fr.factor, acc.o[n][2 * hr + 1] * fr.factor);
    }
    if ((w >> 2) == 0 && t == 0) {
      lse0[r] = fr.lse_nat;
      if constexpr (kMaxl) maxl0[r] = fr.maxl;
    }
  }
  bar_sync(kBarConsumers, kConsumerThreads);
  const int ct = thread_idx();
#pragma unroll 4
  for (int i = 0; i < 16; ++i) {
    const int k = ct + kConsumerThreads * i, r = k >> 6, c = k & 63;
    *reinterpret_cast<uint4*>(orow0 + (int64_t)r * kHeadDim + 8 * c) =
        *reinterpret_cast<const uint4*>(stage + r * 1024 + ((c ^ (r & 7)) << 4));
  }
  if constexpr (kBarAfter) bar_sync(kBarConsumers, kConsumerThreads);
}

// Split epilogue: o_accum f32 = O / L (0 if empty), lse_accum = M + log2 L (-inf if empty).
DEVFN void write_split(const char* smem, const Acc& acc, int w, int lane, float* arow0, float* alse0) {
  const int g = lane >> 2, t = lane & 3;
  const float* lsum = reinterpret_cast<const float*>(smem + kSmemLsum);
  const float* mfin = reinterpret_cast<const float*>(smem + kSmemMfin);
#pragma unroll
  for (int rb = 0; rb < kORowBlocks; ++rb)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int r = o_row(w, rb, g) + 8 * hr;
      const float L = lsum[r] + lsum[64 + r];
      const float inv = L > 0.f ? 1.f / L : 0.f;
      float* arow = arow0 + (int64_t)r * kHeadDim;
#pragma unroll
      for (int n = 0; n < kOCols; ++n) {
        const float* o = acc.o[kOCols * rb + n];
        float2 v;
        v.x = o[2 * hr] * inv;
        v.y = o[2 * hr + 1] * inv;
        *reinterpret_cast<float2*>(arow + o_dim(w, n, t)) = v;
      }
      if (o_dim(w, 0, t) == 0) alse0[r] = L > 0.f ? mfin[r] + flog2(L) : -finf();
    }
}

// ============================================================================== decode
// The CTA's share of the split plan (flashmla.md section 3): requests begin_req..end_req;
// blocks [begin_blk, ...) of the first and [..., end_blk) of the last. A request's blocks are
// its main-cache blocks (nmain = ceil(max(len, 1) / 64)), then its extra-cache blocks
// (ceil(extra_len / 64)), exactly as plan_decode_splits counts them. The plan is a value of the
// caller's (dsv41_jax.plans), possibly made from other lengths: ranges are cut to the request's own
// blocks, so every block is attended at most once and nothing outside the request is read.
struct DecodeWork {
  int begin_req, end_req, begin_blk, end_blk, begin_split;
};

DEVFN DecodeWork decode_work(const DecodeParams& p, int part) {
  const int32_t* m = p.sched + (int64_t)part * 8;
  DecodeWork wk;
  wk.begin_req = ldg_nc_s32(m + 0);
  wk.end_req = ldg_nc_s32(m + 1);
  wk.begin_blk = ldg_nc_s32(m + 2);
  wk.end_blk = ldg_nc_s32(m + 3);
  wk.begin_split = ldg_nc_s32(m + 4);
  if (wk.begin_req < 0) wk.begin_req = 0;
  if (wk.end_req > p.b - 1) wk.end_req = p.b - 1;
  return wk;
}

struct DecodeSeg {
  int blk0, blk1, nmain, len_main, len_extra;
};

DEVFN DecodeSeg decode_segment(const DecodeParams& p, const DecodeWork& wk, int req) {
  DecodeSeg sg;
  sg.len_main = load_len(p.main.lengths, p.main.lengths_stride, req, p.main.topk);
  sg.len_extra = p.has_extra ? load_len(p.extra.lengths, p.extra.lengths_stride, req, p.extra.topk) : 0;
  const int lm = sg.len_main > 0 ? sg.len_main : 1;
  sg.nmain = (lm + kTileTokens - 1) / kTileTokens;
  const int nblk = sg.nmain + (sg.len_extra + kTileTokens - 1) / kTileTokens;
  sg.blk0 = req == wk.begin_req ? wk.begin_blk : 0;
  sg.blk1 = req == wk.end_req ? wk.end_blk : nblk;
  if (sg.blk0 < 0) sg.blk0 = 0;
  if (sg.blk1 > nblk) sg.blk1 = nblk;  // a plan for longer requests (a stale or a batch-invariant one)
  return sg;
}

// Cursor over a CTA's tiles in the consumers' order: requests begin_req..end_req, blocks [blk0, blk1) of
// each (empty segments give no tile); next() returns ok = false past the end.
struct TileCursor {
  const DecodeParams& p;
  DecodeWork wk;
  int s, req, blk;
  DecodeSeg sg;
  DEVFN TileCursor(const DecodeParams& p_, const DecodeWork& wk_, int s_)
      : p(p_), wk(wk_), s(s_), req(wk_.begin_req), blk(0), sg{0, 0, 0, 0, 0} {
    if (req <= wk.end_req) {
      sg = decode_segment(p, wk, req);
      blk = sg.blk0;
    }
  }
  DEVFN TileSrc next() {
    while (req <= wk.end_req && blk >= sg.blk1) {
      if (++req > wk.end_req) break;
      sg = decode_segment(p, wk, req);
      blk = sg.blk0;
    }
    TileSrc t{0, 0, 0, false, false};
    if (req > wk.end_req) return t;
    t.ok = true;
    t.row = (int64_t)req * p.s_q + s;
    if (!p.has_extra || blk < sg.nmain) {
      t.len = sg.len_main;
      t.tok0 = blk * kTileTokens;
    } else {
      t.extra = true;
      t.len = sg.len_extra;
      t.tok0 = (blk - sg.nmain) * kTileTokens;
    }
    ++blk;
    return t;
  }
};

template <class C>
DEVFN void decode_producers(const DecodeParams& p, const DecodeWork& wk, char* smem, const C& crew, int s, int pw,
                            int lane) {
  TileCursor cur(p, wk, s);
  produce_tiles(smem, crew, Pools{&p.main, &p.extra}, pw, lane, [&]() -> TileSrc { return cur.next(); });
}

// The staged segment boundary (the default in wgmma builds): a decode CTA's boundary between requests (~16900
// cycles in the trace at 9b430d7, against a ~4000-cycle tile) with fewer serial latencies: the split counts loaded
// before the row statistics' barrier, the output staged in the Q region and stored with coalesced 16-byte writes
// (write_final_staged), Q loaded with all 16 loads in flight, and the next request's Q prefetched into L2 when a
// segment starts (decode 343.6 -> 333.5 us; RESULTS.md, fifteenth session). DSV41_EXP_SERIAL_EPI restores the old
// boundary.
#if !defined(DSV41_EXP_SERIAL_EPI) && DSV41_WGMMA
constexpr bool kStagedEpi = true;
#else
constexpr bool kStagedEpi = false;
#endif
// The piece of an empty segment (a plan made for longer requests than the call's), so that every slot the plan
// names holds a value: O = 0, lse2 = -inf into its accumulator slot, or, when the request is one piece, out = 0,
// lse = +inf. Written by the consumer threads, with no tile.
DEVFN void write_empty_piece(const DecodeParams& p, const DecodeWork& wk, int req, int s, int64_t head_row,
                             int group, int ct) {
  const int first = ldg_nc_s32(p.num_splits + req);
  const int pieces = ldg_nc_s32(p.num_splits + req + 1) - first;
  const uint4 zero = make_u4(0u, 0u, 0u, 0u);
  if (pieces <= 1 || p.num_slots <= 1) {
    uint4* o = reinterpret_cast<uint4*>(p.out + head_row * kHeadDim);
    for (int i = ct; i < kHeadsPerCta * kHeadDim / 8; i += kConsumerThreads) o[i] = zero;
    if (ct < kHeadsPerCta) p.lse[head_row + ct] = finf();
    return;
  }
  const int64_t slot = (int64_t)first + (req == wk.begin_req ? wk.begin_split : 0);
  if (slot < 0 || slot >= p.num_slots) return;
  const int64_t arow = (slot * p.s_q + s) * p.h_pad + (int64_t)group * kHeadsPerCta;
  uint4* o = reinterpret_cast<uint4*>(p.o_accum + arow * kHeadDim);
  for (int i = ct; i < kHeadsPerCta * kHeadDim / 4; i += kConsumerThreads) o[i] = zero;
  if (ct < kHeadsPerCta) p.lse_accum[arow + ct] = -finf();
}

template <class C, class Side>
DEVFN void decode_consumer_loop(const DecodeParams& p, const DecodeWork& wk, char* smem, const C& crew, int group,
                                int s, int w, int lane, const Side& side) {
  Acc acc;
  int tc = 0;
  const int ct = thread_idx();
  for (int req = wk.begin_req; req <= wk.end_req; ++req) {
    const DecodeSeg sg = decode_segment(p, wk, req);
    const int64_t row = (int64_t)req * p.s_q + s;
    const int64_t head_row = row * p.h_pad + (int64_t)group * kHeadsPerCta;  // row of [b*s_q*h_pad]
    if (sg.blk0 >= sg.blk1) {  // (never for the call's own plan; the producers skip it too)
      write_empty_piece(p, wk, req, s, head_row, group, ct);
      continue;
    }
    const int ntiles = sg.blk1 - sg.blk0;
    load_q<false, kStagedEpi ? 16 : 8>(smem, p.q + head_row * kHeadDim, ct);
    if (kStagedEpi && req < wk.end_req) {  // the next request's 64 KB of Q rows: two 128-byte lines per thread
      const char* qn = reinterpret_cast<const char*>(p.q + (head_row + (int64_t)p.s_q * p.h_pad) * kHeadDim);
      prefetch_l2(qn + 128 * ct);
      prefetch_l2(qn + 128 * (ct + kConsumerThreads));
    }
    acc_reset(acc);
    consume_tiles(crew, smem, tc, ntiles, acc, p.scale_log2, w, lane, side);
    tc += ntiles;
    int first, pieces;
    if constexpr (kStagedEpi) {  // (their latency under the barrier's)
      first = ldg_nc_s32(p.num_splits + req);
      pieces = ldg_nc_s32(p.num_splits + req + 1) - first;
    }
    publish_row_stats(smem, acc, w, lane);
    if constexpr (!kStagedEpi) {
      first = ldg_nc_s32(p.num_splits + req);
      pieces = ldg_nc_s32(p.num_splits + req + 1) - first;
    }
    if (pieces <= 1 || p.num_slots <= 1) {  // (one slot: the caller's plan has no split-KV, no combine runs)
      if constexpr (kStagedEpi)
        write_final_staged<false, true>(smem, acc, w, lane, p.out + head_row * kHeadDim, p.lse + head_row, nullptr,
                                        group_sink(p.sink, group));
      else
        write_final(smem, acc, w, lane, p.out + head_row * kHeadDim, p.lse + head_row, nullptr,
                    group_sink(p.sink, group));
    } else {
      const int64_t slot = (int64_t)first + (req == wk.begin_req ? wk.begin_split : 0);
      if (slot >= 0 && slot < p.num_slots) {  // (the combine reads only slots inside the buffer too)
        const int64_t arow = (slot * p.s_q + s) * p.h_pad + (int64_t)group * kHeadsPerCta;
        write_split(smem, acc, w, lane, p.o_accum + arow * kHeadDim, p.lse_accum + arow);
      }
    }
  }
}

// Warp 4's walk over the CTA's tiles, kAddrLead ahead of the consumers, publishing each tile's addresses
// into the ring ("address ring" above); its index loads one tile ahead of that.
struct AddrGen {
  TileCursor cur;
  TileSrc ta;  // the next tile to publish and this lane's index of it
  int32_t ia;
  DEVFN AddrGen(const DecodeParams& p, const DecodeWork& wk, int s) : cur(p, wk, s), ta{0, 0, 0, false, false}, ia(-1) {}
  DEVFN void prologue(char* smem, int rank, int lane) {  // tiles 0..kAddrLead - 1
    const Pools ps{&cur.p.main, &cur.p.extra};
    TileSrc t[kAddrLead];
    int32_t i[kAddrLead];
#pragma unroll
    for (int k = 0; k < kAddrLead; ++k) {
      t[k] = cur.next();
      i[k] = half_index(ps, t[k], rank, lane);
    }
#pragma unroll
    for (int k = 0; k < kAddrLead; ++k) publish_half_addr(addr_slot(smem, k), ps, t[k], i[k], rank, lane);
    ta = cur.next();
    ia = half_index(ps, ta, rank, lane);
  }
  DEVFN void step(char* smem, int tc, int rank, int lane) {  // while consuming tile tc
    const Pools ps{&cur.p.main, &cur.p.extra};
    publish_half_addr(addr_slot(smem, tc + kAddrLead), ps, ta, ia, rank, lane);
    ta = cur.next();
    ia = half_index(ps, ta, rank, lane);
  }
};

// Warpgroup 1's side work (consume_tile_split): warp 4 steps the generator.
struct Wg1Side {
  mutable AddrGen gen;
  char* smem;
  int rank, lane;
  bool on;
  DEVFN void operator()(int tc) const {
    if (on) gen.step(smem, tc, rank, lane);
  }
};

template <class C>
DEVFN void decode_consumers(const DecodeParams& p, const DecodeWork& wk, char* smem, const C& crew, int group,
                            int s, int w, int lane) {
  if constexpr (C::wg1_addr) {
    if (w >= 4) {
      Wg1Side side{AddrGen(p, wk, s), smem, crew.rank, lane, w == 4};
      if (side.on) side.gen.prologue(smem, crew.rank, lane);
      bar_arrive(kBarAddr, 256);
      decode_consumer_loop(p, wk, smem, crew, group, s, w, lane, side);
      return;
    }
  }
  decode_consumer_loop(p, wk, smem, crew, group, s, w, lane, NoSide{});
}

// Grid: num_groups * s_q * num_parts CTAs, head group fastest (CTAs sharing tokens run together;
// with p.pair, groups 2k and 2k + 1 form one 2-CTA cluster).
template <bool kPair>
DEVFN void decode_cta(const DecodeParams& p, char* smem_raw) {
  char* smem = align_smem(smem_raw);
  const auto crew = crew_setup<kPair, kDecodeSplit && kPair>(smem);
  const int64_t bid = block_idx();
  const int group = (int)(bid % p.num_groups);
  const int64_t rest = bid / p.num_groups;
  const int s = (int)(rest % p.s_q);
  const int part = (int)(rest / p.s_q);
  const DecodeWork wk = decode_work(p, part);
  const int w = warp_idx(), lane = lane_idx();
  // (the DSV41_EXP_WG0_PV_LATE experiment: warpgroup 0 of a pair needs 208 registers to keep a PV in flight
  // without ptxas serialising every wgmma, C7512; warpgroup 1 gets 192. The three warpgroups' budgets must fit
  // the 3 x kLaunchRegs the CTA was launched with: setmaxnreg.inc beyond that pool blocks for ever.)
  constexpr int kPvLateShift = kWg0PvLate && crew.ncta == 2 && crew.split ? 8 : 0;
  static_assert(crew.producer_regs + 2 * crew.consumer_regs <= 3 * kLaunchRegs, "setmaxnreg beyond the launch's registers");
  if (w >= kConsumerWarps) {
    setmaxnreg_dec<crew.producer_regs>();
    decode_producers(p, wk, smem, crew, s, w - kConsumerWarps, lane);
  } else if constexpr (kPvLateShift != 0) {
    if (w < 4) {
      setmaxnreg_inc<crew.consumer_regs + kPvLateShift>();
      decode_consumers(p, wk, smem, crew, group, s, w, lane);
    } else {
      setmaxnreg_inc<crew.consumer_regs - kPvLateShift>();
      decode_consumers(p, wk, smem, crew, group, s, w, lane);
    }
  } else {
    setmaxnreg_inc<crew.consumer_regs>();
    decode_consumers(p, wk, smem, crew, group, s, w, lane);
  }
  crew_teardown(crew);
}

// ============================================================================== split planner
// dsv41_jax.scheduler.plan_decode_splits (FlashMLA's greedy split planner) on the device, run
// before the decode kernel (same stream), writing the plan the decode CTAs read.
// blocks(i) = ceil(L / 64) with L = max(len_i, 1), or with an extra cache
// L = roundup(max(len_i, 1), 64) + extra_len_i; lengths clamped to [0, topk] as in the decode
// kernel (decode_segment counts the same blocks). Every part gets the budget
// ceil(sum_i(blocks(i) + ov) / parts) + ov, takes whole requests (blocks + ov) while they fit,
// then splits the next one when more than ov is left.
// Records: [begin_req, end_req, begin_blk, end_blk, begin_split, first_split, last_split, 0];
// num_splits[0] = 0, num_splits[i + 1] = cumulative pieces of requests 0..i (0 for requests
// no part reached, as in the JAX version). sum_i(blocks(i) + ov) < 2^30 (host_params.h, check_plan_cost).
//
// Two implementations, bit-identical: plan_cta (below; one CTA per plan, a serial walk of one shared-memory load
// per part) wherever its cost table fits in shared memory (host_params.h plan_smem_bytes), and plan_warp (one
// warp per plan) elsewhere. plan_warp's walk is serial over the parts but not over the requests: with
// C[i] = sum_{k<i}(blocks(k) + ov), a part starting at block blk of request r may reach the cost position
// T = C[r] + blk + budget, and takes whole every request j with C[j + 1] <= T (the greedy's "fits" test, summed),
// so one ballot over a 32-request window of C (lane l holds C[base + l + 1], a warp scan) finds where it ends; the
// rest of the budget, less ov, splits the next request. Each completed request i gets num_splits[i + 1] =
// i + 1 + (splits so far) from its own lane. The serial loop keeps only that recurrence and leaves each part's end
// state in its record; the records are then written 32 parts at a time, each lane taking its part's start from the
// part before.
// Request i's lengths, clamped (0 past b).
DEVFN void plan_load(const PlanParams& p, int i, int32_t& len, int32_t& elen) {
  len = 0;
  elen = 0;
  if (i < p.b) {
    len = load_len(p.lengths, p.lengths_stride, i, p.topk);
    if (p.has_extra) elen = load_len(p.extra_lengths, p.extra_lengths_stride, i, p.extra_topk);
  }
}

DEVFN int plan_blocks(const PlanParams& p, int32_t len, int32_t elen) {
  int l = len == 0 ? 1 : len;
  if (p.has_extra) l = (l + kTileTokens - 1) / kTileTokens * kTileTokens + elen;
  return (l - 1) / kTileTokens + 1;
}

// C[base + lane + 1] of the window base.. (cbase = C[base]; INT_MAX past b, so those never fit).
DEVFN int plan_window_cost(const PlanParams& p, int base, int cbase, int nblk, int lane) {
  const bool in = base + lane < p.b;
  int v = in ? nblk + p.fixed_overhead : 0;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int t = (int)shfl_idx_u32((uint32_t)v, lane >= d ? lane - d : 0);
    if (lane >= d) v += t;
  }
  return in ? cbase + v : 0x7fffffff;
}

// One record: request range, block range, split index, and whether the first / last request is split (one
// request: either); end_nblk = blocks(end_req), so the last request is split iff the part stops inside it.
DEVFN void plan_write_record(int32_t* dst, int begin_req, int end_req, int begin_blk, int end_blk, int end_nblk,
                             int begin_split) {
  int first = begin_blk != 0 ? 1 : 0, last = end_blk != end_nblk ? 1 : 0;
  if (begin_req == end_req) first = last = (first | last);
  const int32_t row[8] = {begin_req, end_req, begin_blk, end_blk, begin_split, first, last, 0};
#pragma unroll
  for (int f = 0; f < 8; ++f) dst[f] = row[f];
}

DEVFN void plan_warp(const PlanParams& p, int lane) {
  const int b = p.b, parts = p.num_parts, ov = p.fixed_overhead;
  // ---- total = sum(blocks + ov), payload per part
  uint32_t total = 0;
#pragma unroll 4
  for (int i = lane; i < b; i += 32) {
    int32_t l, e;
    plan_load(p, i, l, e);
    total += (uint32_t)(plan_blocks(p, l, e) + ov);
  }
#pragma unroll
  for (int m = 16; m; m >>= 1) total += shfl_xor_u32(total, m);
  const int payload = ((int)total + parts - 1) / parts + ov;

  // ---- the window: requests base .. base + 31, the next window's lengths loaded one window ahead
  int32_t cl, ce, nl, ne;
  plan_load(p, lane, cl, ce);
  plan_load(p, 32 + lane, nl, ne);
  int base = 0, cbase = 0;
  int nblk = plan_blocks(p, cl, ce);                          // blocks(base + lane)
  int cin = plan_window_cost(p, base, cbase, nblk, lane);     // C[base + lane + 1]
  int nb_before = (int)shfl_idx_u32((uint32_t)nblk, 0);       // blocks(base - 1); blocks(0) in the first window
  // ---- the walk, serial over the parts and kept to the recurrence: the position x = C[req] + blk, the current
  // request, its splits so far, all splits so far. Each part's end state goes to fields 4..7 of its record (scratch
  // until the records are written below): the request j it ends in, the block it ends at (0: at j's start), the
  // blocks of the request the record's end_blk / last_split need, and its begin_split.
  int x = 0, req = 0, nsplit = 0, splits = 0;
  if (lane == 0) p.num_splits[0] = 0;
  for (int part = 0; part < parts; ++part) {
    const int begin_split = nsplit;
    int j = req, cj = x;  // (req == b: nothing left, x = C[b])
    if (req < b) {
      const int reach = x + payload;  // T
      int cnt;
      for (;;) {
        cnt = popc32(ballot(cin <= reach));  // requests base .. base + cnt - 1 end by T
        j = base + cnt;
        if (base + lane >= req && base + lane < j) p.num_splits[base + lane + 1] = base + lane + 1 + splits;
        if (cnt < 32 || base + 32 >= b) break;
        nb_before = (int)shfl_idx_u32((uint32_t)nblk, 31);  // the window is used up: the next one
        cbase = (int)shfl_idx_u32((uint32_t)cin, 31);
        base += 32;
        nblk = plan_blocks(p, nl, ne);
        plan_load(p, base + 32 + lane, nl, ne);
        cin = plan_window_cost(p, base, cbase, nblk, lane);
      }
      const int c = (int)shfl_idx_u32((uint32_t)cin, cnt > 0 ? cnt - 1 : 0);
      cj = cnt > 0 ? c : cbase;                                  // C[j]
      const bool split = j < b && reach - (x > cj ? x : cj) > ov;  // more than ov left for request j
      x = split ? reach - ov : cj;
      nsplit = split ? (j > req ? 1 : nsplit + 1) : 0;
      splits += split ? 1 : 0;
      req = j;
    }
    const int blk = x - cj;
    const int bi = blk > 0 ? j - base : j - base - 1;  // blocks(j) when split, else blocks(j - 1)
    const int bv = (int)shfl_idx_u32((uint32_t)nblk, bi > 0 ? bi : 0);
    if (lane == 0) {
      int32_t* row = p.sched + (int64_t)part * 8;
      row[4] = j;
      row[5] = blk;
      row[6] = bi >= 0 ? bv : nb_before;
      row[7] = begin_split;
    }
  }
  for (int i = req + 1 + lane; i <= b; i += 32) p.num_splits[i] = 0;
  syncwarp();  // (orders lane 0's scratch before the other lanes read it)
  // ---- the records, 32 parts at a time: part k begins where part k - 1 ended
  int pj = 0, pblk = 0;
  for (int k0 = 0; k0 < parts; k0 += 32) {
    const int k = k0 + lane;
    int32_t* row = p.sched + (int64_t)k * 8;
    int j = 0, blk = 0, nb = 0, bsplit = 0;
    if (k < parts) {
      j = row[4];
      blk = row[5];
      nb = row[6];
      bsplit = row[7];
    }
    const int qj = (int)shfl_idx_u32((uint32_t)j, lane > 0 ? lane - 1 : 0);
    const int qb = (int)shfl_idx_u32((uint32_t)blk, lane > 0 ? lane - 1 : 0);
    const int begin_req = lane > 0 ? qj : pj, begin_blk = lane > 0 ? qb : pblk;
    pj = (int)shfl_idx_u32((uint32_t)j, 31);
    pblk = (int)shfl_idx_u32((uint32_t)blk, 31);
    syncwarp();  // every read of these rows before any write
    if (k < parts) plan_write_record(row, begin_req, blk > 0 ? j : j - 1, begin_blk, blk > 0 ? blk : nb, nb, bsplit);
  }
}

// ---- the planner of one CTA per plan (PlanBatch::smem_bytes > 0; the warp planner above otherwise)
// With C[i] = sum_{k<i}(blocks(k) + ov) and D = ceil(C[b] / parts), a part starting at cost position x ends at
//   N(x) = min(C[b], max(x + D, floorC(x + D + ov))),
// floorC(y) = max{C[i] <= y}: the greedy takes whole every request ending by x + D + ov, and splits the next one at
// x + D unless that leaves it ov or less. Part k covers [X[k], X[k + 1]) with X[k] = N^k(0). N is a table over the
// positions [0, C[b]] (built from delta[y] = y - floorC(y)), and so is N^kPlanStride, so one thread walks only
// every kPlanStride-th part and the CTA fills in the others; everything else (the cost scan, the tables, the
// records, num_splits) runs on the whole CTA. The result is bit-identical to the warp planner and to
// plan_decode_splits. Shared memory (host_params.h plan_smem_bytes): C [b + 1], X, R (the request each X lies in)
// and S (split points among X[1..k]) [parts + 1] each, 32 of scan scratch, N [C[b] + 1], and one more table of
// C[b] + 1 int32 holding first delta (uint16), then N^kPlanStride; all int32.
constexpr int kPlanBar = 0;
constexpr int kPlanStride = 8;

// Largest i in [0, n) with a[i] <= v (a non-decreasing, a[0] <= v).
DEVFN int plan_last_le(const int32_t* a, int n, int v) {
  int lo = 0, hi = n - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (a[mid] <= v) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

// a[0..n) <- its inclusive prefix sums (shared memory; every thread of the CTA calls it; ends with a barrier).
DEVFN void cta_inclusive_scan(int32_t* a, int n, int32_t* scratch) {
  constexpr int kWarps = kPlanCtaThreads / 32;
  const int tid = thread_idx(), lane = lane_idx(), warp = warp_idx();
  const int chunk = (n + kPlanCtaThreads - 1) / kPlanCtaThreads;
  const int lo = tid * chunk < n ? tid * chunk : n, hi = lo + chunk < n ? lo + chunk : n;
  int sum = 0;
  for (int i = lo; i < hi; ++i) sum += a[i];
  int inc = sum;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int t = (int)shfl_idx_u32((uint32_t)inc, lane >= d ? lane - d : 0);
    if (lane >= d) inc += t;
  }
  if (lane == 31) scratch[warp] = inc;
  bar_sync(kPlanBar, kPlanCtaThreads);
  int off = inc - sum;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) off += w < warp ? scratch[w] : 0;
  for (int i = lo; i < hi; ++i) {
    off += a[i];
    a[i] = off;
  }
  bar_sync(kPlanBar, kPlanCtaThreads);
}

DEVFN void plan_cta(const PlanParams& p, char* smem) {
  const int b = p.b, parts = p.num_parts, ov = p.fixed_overhead;
  const int tid = thread_idx(), lane = lane_idx(), warp = warp_idx();
  constexpr int kWarps = kPlanCtaThreads / 32;
  int32_t* C = reinterpret_cast<int32_t*>(smem);
  int32_t* X = C + (b + 1);
  int32_t* R = X + (parts + 1);
  int32_t* S = R + (parts + 1);
  int32_t* scratch = S + (parts + 1);
  int32_t* N = scratch + 32;
  // ---- costs and their prefix sums C
  for (int i = tid; i < b; i += kPlanCtaThreads) {
    int32_t l, e;
    plan_load(p, i, l, e);
    C[i + 1] = plan_blocks(p, l, e) + ov;
  }
  if (tid == 0) C[0] = 0;
  bar_sync(kPlanBar, kPlanCtaThreads);
  cta_inclusive_scan(C + 1, b, scratch);
  const int total = C[b], D = (total + parts - 1) / parts;
  int32_t* NS = N + (total + 1);  // delta (uint16), then N^kPlanStride
  uint16_t* delta = reinterpret_cast<uint16_t*>(NS);
  // ---- delta[C[r] + j] = j for j < blocks(r) + ov; delta[C[b]] = 0
  for (int r = warp; r < b; r += kWarps) {
    const int base = C[r], cost = C[r + 1] - base;
    for (int j = lane; j < cost; j += 32) delta[base + j] = (uint16_t)j;
  }
  if (tid == 0) delta[total] = 0;
  bar_sync(kPlanBar, kPlanCtaThreads);
  for (int x = tid; x <= total; x += kPlanCtaThreads) {
    const int y = x + D;
    const int z = y + ov < total ? y + ov : total;
    const int f = z - (int)delta[z];
    const int m = y > f ? y : f;
    N[x] = m < total ? m : total;
  }
  bar_sync(kPlanBar, kPlanCtaThreads);
  // ---- N^kPlanStride, four positions at a time (their chains of loads interleave)
  for (int x0 = tid; x0 <= total; x0 += 4 * kPlanCtaThreads) {
    int y[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) y[u] = x0 + u * kPlanCtaThreads <= total ? x0 + u * kPlanCtaThreads : total;
#pragma unroll
    for (int t = 0; t < kPlanStride; ++t)
#pragma unroll
      for (int u = 0; u < 4; ++u) y[u] = N[y[u]];
#pragma unroll
    for (int u = 0; u < 4; ++u)
      if (x0 + u * kPlanCtaThreads <= total) NS[x0 + u * kPlanCtaThreads] = y[u];
  }
  bar_sync(kPlanBar, kPlanCtaThreads);
  // ---- the walk over every kPlanStride-th part, then the parts between
  if (tid == 0) {
    int x = 0;
    X[0] = 0;
    for (int k = kPlanStride; k <= parts; k += kPlanStride) {
      x = NS[x];
      X[k] = x;
    }
  }
  bar_sync(kPlanBar, kPlanCtaThreads);
  for (int k = tid; k <= parts; k += kPlanCtaThreads) {
    const int j = k % kPlanStride;
    if (j == 0) continue;
    int x = X[k - j];
    for (int t = 0; t < j; ++t) x = N[x];
    X[k] = x;
  }
  bar_sync(kPlanBar, kPlanCtaThreads);
  // ---- the request of each X, and whether it splits one
  for (int k = tid; k <= parts; k += kPlanCtaThreads) {
    const int x = X[k];
    const int r = plan_last_le(C, b + 1, x);
    R[k] = r;
    S[k] = x < total && x != C[r] ? 1 : 0;
  }
  bar_sync(kPlanBar, kPlanCtaThreads);
  cta_inclusive_scan(S, parts + 1, scratch);
  // ---- the records (a part starting at C[b] is empty: begin past end, as the greedy leaves it)
  for (int k = tid; k < parts; k += kPlanCtaThreads) {
    const int x0 = X[k], x1 = X[k + 1];
    const bool empty = x0 >= total;
    const int r0 = empty ? b : R[k], bb = empty ? 0 : x0 - C[r0];
    const int bs = bb == 0 ? 0 : S[k] - S[plan_last_le(X, parts + 1, C[r0])];
    const int r1 = empty ? b : R[k + 1];
    const bool at_start = x1 == C[r1];  // (x1 == C[b] included)
    const int er = at_start ? r1 - 1 : r1;
    const int nb = C[er + 1] - C[er] - ov;
    plan_write_record(p.sched + (int64_t)k * 8, r0, er, bb, at_start ? nb : x1 - C[r1], nb, bs);
  }
  // ---- num_splits[r + 1] = r + 1 + (split points before request r's end)
  if (tid == 0) p.num_splits[0] = 0;
  for (int r = tid; r < b; r += kPlanCtaThreads)
    p.num_splits[r + 1] = r + 1 + S[plan_last_le(X, parts + 1, C[r + 1] - 1)];
}

// ============================================================================== combine
// One warp per (request, query token, head) of requests with more than one piece:
// m = max lse2_i; S = sum 2^(lse2_i - m); g = m + log2 S; lse = g ln2;
// out = sum_i 2^(lse2_i - g) O_i / (1 + 2^(sink log2e - g)). All pieces empty -> 0, +inf.
// Only pieces inside the accumulators are read (num_splits comes with the plan, a value of the caller's).
// The lanes load 32 pieces' lse2 at once and reduce them by shuffles, and the O rows are read kCombineUnroll
// pieces at a time: at small batches the combine's cost is its chain of load latencies, one per round.
// The O sum runs over the pieces in order, so the result does not depend on the unrolling.
constexpr int kCombineUnroll = 2;
DEVFN float warp_max(float v) {
#pragma unroll
  for (int o = 16; o; o >>= 1) v = fmaxf(v, shfl_xor_f32(v, o));
  return v;
}
DEVFN float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o; o >>= 1) v += shfl_xor_f32(v, o);
  return v;
}

DEVFN void combine_cta(const DecodeParams& p) {
  const int hgroups = p.h_pad / 8;
  const int64_t bid = block_idx();
  const int hg = (int)(bid % hgroups);
  const int64_t rest = bid / hgroups;
  const int s = (int)(rest % p.s_q);
  const int req = (int)(rest / p.s_q);
  const int first = p.num_splits[req];
  int n = p.num_splits[req + 1] - first;
  if (n <= 1) return;
  if (first < 0 || first >= p.num_slots) n = 0;
  if (n > p.num_slots - first) n = p.num_slots - first;
  const int head = hg * 8 + warp_idx();
  const int lane = lane_idx();
  const int64_t stride = (int64_t)p.s_q * p.h_pad;  // between consecutive slots
  const float* la = p.lse_accum + ((int64_t)first * p.s_q + s) * p.h_pad + head;
  const int64_t orow = (((int64_t)req * p.s_q + s) * p.h_pad + head);
  uint16_t* out = p.out + orow * kHeadDim;
  float m = -finf();
  for (int i = lane; i < n; i += 32) m = fmaxf(m, la[i * stride]);
  m = warp_max(m);
  if (m == -finf()) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      uint32_t* o = reinterpret_cast<uint32_t*>(out + 4 * lane + 128 * j);
      o[0] = 0u;
      o[1] = 0u;
    }
    if (lane == 0) p.lse[orow] = finf();
    return;
  }
  float sum = 0.f;
  for (int i = lane; i < n; i += 32) sum += fexp2(la[i * stride] - m);
  const float gl = m + flog2(warp_sum(sum));
  const float sink2 = p.sink ? p.sink[head] * kLog2e : -finf();
  const float factor = 1.f / (1.f + fexp2(sink2 - gl));
  float acc[4][4];
#pragma unroll
  for (int j = 0; j < 4; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[j][e] = 0.f;
  const float* oa = p.o_accum + (((int64_t)first * p.s_q + s) * p.h_pad + head) * kHeadDim + 4 * lane;
  for (int i0 = 0; i0 < n; i0 += 32) {
    const int cnt = n - i0 < 32 ? n - i0 : 32;
    const uint32_t wl = f32_bits(lane < cnt ? fexp2(la[(i0 + lane) * stride] - gl) * factor : 0.f);  // lse2 -inf -> 0
    int k = 0;
    for (; k + kCombineUnroll <= cnt; k += kCombineUnroll) {
      float4 v[kCombineUnroll][4];
#pragma unroll
      for (int u = 0; u < kCombineUnroll; ++u) {
        const float* src = oa + (int64_t)(i0 + k + u) * stride * kHeadDim;
#pragma unroll
        for (int j = 0; j < 4; ++j) v[u][j] = *reinterpret_cast<const float4*>(src + 128 * j);
      }
#pragma unroll
      for (int u = 0; u < kCombineUnroll; ++u) {
        const float wgt = bits_f32(shfl_idx_u32(wl, k + u));
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          acc[j][0] += wgt * v[u][j].x;
          acc[j][1] += wgt * v[u][j].y;
          acc[j][2] += wgt * v[u][j].z;
          acc[j][3] += wgt * v[u][j].w;
        }
      }
    }
    for (; k < cnt; ++k) {
      const float wgt = bits_f32(shfl_idx_u32(wl, k));
      const float* src = oa + (int64_t)(i0 + k) * stride * kHeadDim;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float4 v = *reinterpret_cast<const float4*>(src + 128 * j);
        acc[j][0] += wgt * v.x;
        acc[j][1] += wgt * v.y;
        acc[j][2] += wgt * v.z;
        acc[j][3] += wgt * v.w;
      }
    }
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    uint32_t* o = reinterpret_cast<uint32_t*>(out + 4 * lane + 128 * j);
    o[0] = pack_bf16x2(acc[j][0], acc[j][1]);
    o[1] = pack_bf16x2(acc[j][2], acc[j][3]);
  }
  if (lane == 0) p.lse[orow] = gl * kLn2;
}

// ============================================================================== prefill
// One CTA per (query token, 64-head group), group fastest; tiles 0..ceil(len/64)-1 of the
// query's own indices row over bf16 kv rows. No split: the epilogue writes out, lse and
// max_logits directly (empty row: out 0, lse +inf, max_logits -inf).
// One CTA per group (kPair false): for bf16 rows (no dequantisation) a pair's hand-off costs more
// than the halved gather saves (st.async: 8.1 vs 6.5 ms, RESULTS.md cuda pair ablation; bulk
// copies: +9%, RESULTS.md seventh session); the DSV41_EXP_PREFILL_PAIR build (p.pair) runs groups 2k, 2k + 1 as decode's pairs.
template <bool kPair>
DEVFN void prefill_cta(const PrefillParams& p, char* smem_raw) {
  char* smem = align_smem(smem_raw);
  const auto crew = crew_setup<kPair, kPrefillSplit, kPrefillBf16>(smem);
  const int64_t bid = block_idx();
  const int group = (int)(bid % p.num_groups);
  const int64_t s = bid / p.num_groups;
  const int w = warp_idx(), lane = lane_idx();
  const int len = load_len(p.kv.lengths, p.kv.lengths_stride, s, p.kv.topk);
  const int ntiles = (len + kTileTokens - 1) / kTileTokens;
  if (w >= kConsumerWarps) {
    setmaxnreg_dec<crew.producer_regs>();
    int tn = 0;
    auto next = [&]() -> TileSrc {
      TileSrc t{s, len, tn * kTileTokens, tn < ntiles, false};
      tn += tn < ntiles ? 1 : 0;
      return t;
    };
    produce_tiles(smem, crew, Pools{&p.kv, &p.kv}, w - kConsumerWarps, lane, next);
  } else {
    setmaxnreg_inc<crew.consumer_regs>();
    Acc acc;
    const int64_t head_row = s * p.h_pad + (int64_t)group * kHeadsPerCta;
    if (ntiles > 0) load_q<crew.bf16>(smem, p.q + head_row * kHeadDim, thread_idx());
    acc_reset(acc);
    consume_tiles(crew, smem, 0, ntiles, acc, p.scale_log2, w, lane);
    publish_row_stats(smem, acc, w, lane);
    write_final(smem, acc, w, lane, p.out + head_row * kHeadDim, p.lse + head_row, p.max_logits + head_row,
                group_sink(p.sink, group));
  }
  crew_teardown(crew);
}

}  // namespace dsv41
