// The prefill CTA over bf16 rows (f16 rows on sm_90a: seesaw.cuh).
#pragma once

#include "consumer.cuh"

namespace dsv41 {

// One CTA per (query token, 64-head group), group fastest; tiles 0..ceil(len/64)-1 of the
// query's own indices row over bf16 kv rows. No split: the epilogue writes out, lse and
// max_logits directly (empty row: out 0, lse +inf, max_logits -inf), or the mega output and lse.
// One CTA per group (the kernel is built with kPair false only): for bf16 rows (no dequantisation) a
// pair's hand-off costs more than the halved gather saves (benchmarks/RESULTS.md, "cuda pair ablation").
// kMega: the mega prefill (PrefillParams::mega; its own kernels, so that the plain prefill's code stays as it is):
// q roped as it is loaded, the output through write_final_mega_staged.
template <bool kPair, bool kMega = false>
DEVFN void prefill_cta(const PrefillParams& p, char* smem_raw) {
  char* smem = align_smem(smem_raw);
  const auto crew = crew_setup<kPair, true>(smem);
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
    produce_tiles(smem, crew, Pools<>{&p.kv, &p.kv}, w - kConsumerWarps, lane, next);
  } else {
    setmaxnreg_inc<crew.consumer_regs>();
    Acc acc;
    const int64_t head_row = s * p.h_q + (int64_t)group * kHeadsPerCta;
    const int rows = group_rows(p.h_q, group);
    // (a mega CTA loads the cos / sin row even for an empty query: its epilogue reads load_q's copy; its Q loads
    // in one round, as the seesaw's)
    if (ntiles > 0 || kMega)
      load_q<kMega ? 16 : 8, kMega>(smem, p.q + head_row * kHeadDim, thread_idx(), rows,
                                    kMega ? p.cos_sin + s * kRopeDim : nullptr);
    acc_reset(acc);
    consume_tiles(crew, smem, 0, ntiles, acc, p.scale_log2, w, lane);
    publish_row_stats(smem, acc, w, lane);
    if constexpr (kMega)
      write_final_mega_staged<false>(smem, acc, w, lane, p.out_fp8 + head_row * kHeadDim,
                                     p.out_scale + head_row * kOutScales, p.lse + head_row, group_sink(p.sink, group),
                                     rows);
    else
      write_final(smem, acc, w, lane, p.out + head_row * kHeadDim, p.lse + head_row, p.max_logits + head_row,
                  group_sink(p.sink, group), rows);
  }
  crew_teardown(crew);
}

}  // namespace dsv41
