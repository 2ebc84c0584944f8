// The decode CTA: its share of the split plan, the tile cursor over requests and the two caches, the
// segment boundary, warpgroup 1's address generator (pairs).
#pragma once

#include "consumer.cuh"

namespace dsv41 {

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

template <int kFam, class C>
DEVFN void decode_producers(const DecodeParams& p, const DecodeWork& wk, char* smem, const C& crew, int s, int pw,
                            int lane) {
  TileCursor cur(p, wk, s);
  produce_tiles(smem, crew, Pools<kFam>{&p.main, &p.extra}, pw, lane, [&]() -> TileSrc { return cur.next(); });
}

// The staged segment boundary (wgmma builds: it needs their O layout): a decode CTA's boundary between
// requests with fewer serial latencies: the split counts loaded before the row statistics' barrier, the
// output staged in the Q region and stored with coalesced 16-byte writes (write_final_staged), Q loaded
// with all 16 loads in flight, and the next request's Q prefetched into L2 when a segment starts.
constexpr bool kStagedEpi = kWgmma;
// The piece of an empty segment (a plan made for longer requests than the call's), so that every slot the plan
// names holds a value: O = 0, lse2 = -inf into its accumulator slot, or, when the request is one piece, out = 0,
// lse = +inf. Written by the kThreadsT consumer threads (ct: this one's index among them), with no tile, for the
// CTA's `rows` heads from head `head0` (a 64-head group, fewer in a last partial one; the narrow CTA's h_q heads
// from 0) of rows of `heads` heads (h_q). head_row: row (request, token) times `heads`, plus head0.
// kMega: 0 the plain decode, 1 a mega decode finishing its requests of one piece here, 2 one whose combine
// finishes every request (mega_via_combine).
enum : int { kEmptyPlain = 0, kEmptyMegaFinal = 1, kEmptyMegaCombine = 2 };
template <int kThreadsT = kConsumerThreads, int kMega = kEmptyPlain>
DEVFN void write_empty_piece(const DecodeParams& p, const DecodeWork& wk, int req, int s, int64_t head_row,
                             int64_t heads, int64_t head0, int rows, int ct) {
  const int first = ldg_nc_s32(p.num_splits + req);
  const int pieces = ldg_nc_s32(p.num_splits + req + 1) - first;
  const uint4 zero = make_u4(0u, 0u, 0u, 0u);
  if ((pieces <= 1 || p.num_slots <= 1) && kMega != kEmptyMegaCombine) {
    if constexpr (kMega == kEmptyMegaFinal) {  // out 0: e4m3 zeros with the exponent of an all-zero group
      uint4* o = reinterpret_cast<uint4*>(p.out_fp8 + head_row * kHeadDim);
      for (int i = ct; i < rows * kHeadDim / 16; i += kThreadsT) o[i] = zero;
      const uint32_t e0 = out_scale_byte(out_exponent(0.f)) * 0x01010101u;
      uint4* sc = reinterpret_cast<uint4*>(p.out_scale + head_row * kOutScales);
      for (int i = ct; i < rows; i += kThreadsT) sc[i] = make_u4(e0, e0, e0, e0);
    } else {
      uint4* o = reinterpret_cast<uint4*>(p.out + head_row * kHeadDim);
      for (int i = ct; i < rows * kHeadDim / 8; i += kThreadsT) o[i] = zero;
    }
    if (ct < rows) p.lse[head_row + ct] = finf();
    return;
  }
  const int64_t slot = (int64_t)first + (req == wk.begin_req ? wk.begin_split : 0);
  if (slot < 0 || slot >= p.num_slots) return;
  const int64_t arow = (slot * p.s_q + s) * heads + head0;
  uint4* o = reinterpret_cast<uint4*>(p.o_accum + arow * kHeadDim);
  for (int i = ct; i < rows * kHeadDim / 4; i += kThreadsT) o[i] = zero;
  if (ct < rows) p.lse_accum[arow + ct] = -finf();
}

// The clamped positions of the CTA's first kMegaPositions requests (query token s) into kSmemMegaPos, by the
// consumers, once per CTA: the segments then find a request's cos / sin row without a dependent global load.
DEVFN void stage_mega_positions(const DecodeParams& p, const DecodeWork& wk, char* smem, int s, int ct) {
  int32_t* pos = reinterpret_cast<int32_t*>(smem + kSmemMegaPos);
  const int n = wk.end_req - wk.begin_req + 1;
  for (int i = ct; i < n && i < kMegaPositions; i += kConsumerThreads)
    pos[i] = clamp_pos(ldg_nc_s32(p.positions + (int64_t)(wk.begin_req + i) * p.s_q + s), p.max_pos);
  bar_sync(kBarConsumers, kConsumerThreads);
}
// The cos / sin row of request req's query token s (its staged position, or read from global memory past them).
DEVFN const float* mega_cs_of(const DecodeParams& p, const DecodeWork& wk, const char* smem, int req, int s) {
  const int i = req - wk.begin_req;
  if (i < kMegaPositions)
    return p.cos_sin + (int64_t)reinterpret_cast<const int32_t*>(smem + kSmemMegaPos)[i] * kRopeDim;
  return mega_cs_row(p, (int64_t)req * p.s_q + s);
}

// kMega: the mega decode (mega.cuh; its own kernels, so that the plain decode's registers stay as they are).
template <bool kMega, class C, class Side>
DEVFN void decode_consumer_loop(const DecodeParams& p, const DecodeWork& wk, char* smem, const C& crew, int group,
                                int s, int w, int lane, const Side& side) {
  Acc acc;
  int tc = 0;
  const int ct = thread_idx();
  const int rows = group_rows(p.h_q, group);
  if constexpr (kMega) stage_mega_positions(p, wk, smem, s, ct);
  for (int req = wk.begin_req; req <= wk.end_req; ++req) {
    const DecodeSeg sg = decode_segment(p, wk, req);
    const int64_t row = (int64_t)req * p.s_q + s;
    const int64_t head_row = row * p.h_q + (int64_t)group * kHeadsPerCta;  // row of [b*s_q*h_q]
    if (sg.blk0 >= sg.blk1) {  // (never for the call's own plan; the producers skip it too)
      constexpr int kEmpty = !kMega ? kEmptyPlain : kStagedEpi ? kEmptyMegaFinal : kEmptyMegaCombine;
      write_empty_piece<kConsumerThreads, kEmpty>(p, wk, req, s, head_row, p.h_q, (int64_t)group * kHeadsPerCta, rows,
                                                  ct);
      continue;
    }
    const int ntiles = sg.blk1 - sg.blk0;
    load_q<kStagedEpi ? 16 : 8, kMega>(smem, p.q + head_row * kHeadDim, ct, rows,
                                       kMega ? mega_cs_of(p, wk, smem, req, s) : nullptr);
    if (kStagedEpi && req < wk.end_req) {  // the next request's Q rows (64 KB): two 128-byte lines per thread
      const char* qn = reinterpret_cast<const char*>(p.q + (head_row + (int64_t)p.s_q * p.h_q) * kHeadDim);
      if (ct < 8 * rows) prefetch_l2(qn + 128 * ct);
      if (ct + kConsumerThreads < 8 * rows) prefetch_l2(qn + 128 * (ct + kConsumerThreads));
      // and its cos / sin row (256 B), the position of a staged request read from shared memory
      if (kMega && (ct & 127) == 0 && req + 1 - wk.begin_req < kMegaPositions)
        prefetch_l2(reinterpret_cast<const char*>(mega_cs_of(p, wk, smem, req + 1, s)) + (ct >> 7) * 128);
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
    // (one slot: the caller's plan has no split-KV, no combine runs; a mega decode without the staged epilogue:
    // the combine finishes every request, mega_via_combine)
    if ((pieces <= 1 || p.num_slots <= 1) && !(kMega && !kStagedEpi)) {
      if constexpr (kStagedEpi) {
        if constexpr (kMega)
          write_final_mega_staged<true>(smem, acc, w, lane, p.out_fp8 + head_row * kHeadDim,
                                        p.out_scale + head_row * kOutScales, p.lse + head_row,
                                        group_sink(p.sink, group), rows);
        else
          write_final_staged<false, true>(smem, acc, w, lane, p.out + head_row * kHeadDim, p.lse + head_row, nullptr,
                                          group_sink(p.sink, group), rows);
      } else
        write_final(smem, acc, w, lane, p.out + head_row * kHeadDim, p.lse + head_row, nullptr,
                    group_sink(p.sink, group), rows);
    } else {
      const int64_t slot = (int64_t)first + (req == wk.begin_req ? wk.begin_split : 0);
      if (slot >= 0 && slot < p.num_slots) {  // (the combine reads only slots inside the buffer too)
        const int64_t arow = (slot * p.s_q + s) * p.h_q + (int64_t)group * kHeadsPerCta;
        write_split(smem, acc, w, lane, p.o_accum + arow * kHeadDim, p.lse_accum + arow, rows);
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
    const Pools<> ps{&cur.p.main, &cur.p.extra};  // (addresses: any family)
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
    const Pools<> ps{&cur.p.main, &cur.p.extra};  // (addresses: any family)
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

template <bool kMega, class C>
DEVFN void decode_consumers(const DecodeParams& p, const DecodeWork& wk, char* smem, const C& crew, int group,
                            int s, int w, int lane) {
  if constexpr (C::wg1_addr) {
    // Both warpgroups run one copy of the loop (warpgroup 0's side is off): a second copy for warpgroup 0
    // (NoSide) doubles the consumers' code, and the two no longer fit the instruction cache beside the
    // producers' (stall_no_inst; benchmarks/RESULTS.md, "one consumer loop").
    Wg1Side side{AddrGen(p, wk, s), smem, crew.rank, lane, w == 4};
    if (side.on) side.gen.prologue(smem, crew.rank, lane);
    if (w >= 4) bar_arrive(kBarAddr, 256);
    decode_consumer_loop<kMega>(p, wk, smem, crew, group, s, w, lane, side);
  } else {
    decode_consumer_loop<kMega>(p, wk, smem, crew, group, s, w, lane, NoSide{});
  }
}

// Grid: num_groups * s_q * num_parts CTAs, head group fastest (CTAs sharing tokens run together;
// with p.pair, groups 2k and 2k + 1 form one 2-CTA cluster). kFam: the cache formats it reads (producer.cuh);
// kMega: a mega decode's kernel (p.mega).
template <bool kPair, int kFam, bool kMega = false>
DEVFN void decode_cta(const DecodeParams& p, char* smem_raw) {
  char* smem = align_smem(smem_raw);
  const auto crew = crew_setup<kPair, kPair>(smem);
  const int64_t bid = block_idx();
  const int group = (int)(bid % p.num_groups);
  const int64_t rest = bid / p.num_groups;
  const int s = (int)(rest % p.s_q);
  const int part = (int)(rest / p.s_q);
  const DecodeWork wk = decode_work(p, part);
  const int w = warp_idx(), lane = lane_idx();
  // (The three warpgroups' budgets must fit the 3 x kLaunchRegs the CTA was launched with: setmaxnreg.inc
  // beyond that pool blocks for ever.)
  static_assert(crew.producer_regs + 2 * crew.consumer_regs <= 3 * kLaunchRegs, "setmaxnreg beyond the launch's registers");
  if (w >= kConsumerWarps) {
    setmaxnreg_dec<crew.producer_regs>();
    decode_producers<kFam>(p, wk, smem, crew, s, w - kConsumerWarps, lane);
  } else {
    setmaxnreg_inc<crew.consumer_regs>();
    decode_consumers<kMega>(p, wk, smem, crew, group, s, w, lane);
  }
  crew_teardown(crew);
}

}  // namespace dsv41
