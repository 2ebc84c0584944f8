// The crew: one CTA or a 2-CTA cluster (a head-group pair) sharing a tile sequence, and the pair
// protocol's barriers (setup, teardown, the peer's mbarriers).
#pragma once

#include "common.cuh"

namespace dsv41 {

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
// cp.async.bulk copies of the local ones, 1 KB per producer warp and column block: lane st.async
// stores of every chunk make the hand-off the decode's largest cost (they drain slowly and hold the
// producers' registers), and generic st.shared::cluster stores followed by a releasing arrival are
// slower than one CTA gathering everything (benchmarks/RESULTS.md, "cuda head-group pairs").
// A compile-time property of the kernel (two instantiations), so a single CTA's code carries no
// cluster instructions or pair branches.
// kSplit: the consumers' roles. false: two symmetric warpgroups (each S for 32 of a tile's tokens,
// a row-max exchange, O[:, 256 w]); true: FlashMLA's split (consume_tile_split). wgmma builds only.
template <bool kPair, bool kSplit = false>
struct Crew {
  static constexpr int ncta = kPair ? 2 : 1;
  static constexpr bool split = kSplit && kWgmma;
  // A pair's producers fit 104 registers either way; one CTA's (two batches per warp) need 120 with
  // split consumers (192) and 128 with symmetric ones (184).
  static constexpr bool split_regs = split && !kPair;
  static constexpr int producer_regs = split_regs ? kSplitProducerRegs : kPair ? kPairProducerRegs : kProducerRegs;
  static constexpr int consumer_regs = split_regs ? kSplitConsumerRegs : kPair ? kPairConsumerRegs : kConsumerRegs;
  static constexpr int full_count = split ? 256 : kThreads;  // FULL b: producers + the consumers waiting
  static constexpr bool wg1_addr = kPair && split;  // warpgroup 1 computes the gather addresses
  static constexpr int producer_warps = kProducerWarps;  // warps 8..11
  static constexpr int batches = kPair ? 1 : 2;          // 8-token batches per producer warp and tile
  int rank;       // in the cluster
  uint32_t peer;  // cluster address of the peer's shared-memory base (pairs)
};

DEVFN int bar_pfull(int buf) { return kSmemBars + 8 * buf; }
DEVFN int bar_pempty(int buf) { return kSmemBars + 16 + 8 * buf; }

// Every thread of the CTA: mbarrier initialisation (pairs), then a barrier over the crew (no CTA
// touches its peer before the peer's mbarriers exist).
template <bool kPair, bool kSplit = false>
DEVFN Crew<kPair, kSplit> crew_setup(char* smem) {
  Crew<kPair, kSplit> c{0, 0u};
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
  if constexpr (C::ncta == 2) cluster_sync();
}

// Tokens per tile one producer warp of a pair gathers (one batch), and the bytes it sends to its peer
// per tile: its 8 rows (eight 1 KB cp.async.bulk copies) + its mask word (st.async): 8 x 1024 + 4.
constexpr int kPairTokensPerWarp = kTileTokens / 2 / kProducerWarps;
static_assert(kPairTokensPerWarp == 8, "fill_tile sends one 8-token batch (one mask word) per warp and tile");
static_assert(kTileTokens / kProducerWarps == 16, "one CTA's producer warp gathers two 8-token batches per tile");
constexpr uint32_t kPeerBytesPerWarp = kPairTokensPerWarp * kHeadDim * 2 + 4;

// One arrival of the calling warp on the peer's mbarrier at `bar_off`, after the warp's earlier
// shared-memory accesses (the __syncwarp orders the lanes' accesses before lane 0's release).
template <class C>
DEVFN void peer_arrive(const C& c, int bar_off, int lane) {
  syncwarp();
  if (lane == 0) mbar_arrive(c.peer + (uint32_t)bar_off);
}

// The tokens of each tile that producer warp pw gathers: [base, base + 8 NB) (NB = C::batches: 1 in a
// pair and in the narrow CTA's eight producer warps, 2 for one CTA's four; produce_tiles).
struct Share {
  int base;
};
template <class C>
DEVFN Share producer_share(const C& c, int pw) {
  return C::ncta == 2 ? Share{kTileTokens / 2 * c.rank + kPairTokensPerWarp * pw} : Share{8 * C::batches * pw};
}

}  // namespace dsv41
