// dsv41 sparse MLA prefill over f16 KV rows: the "seesaw" CTA (sm_90a wgmma builds).
//
// Used when the JAX wrapper hands the kernel f16 rows (cuda_ffi/ops.py converts bf16 kv once, in
// XLA, when the conversion costs less than the gathered rows it serves): the rows then need no
// conversion, so the producers copy them with cp.async straight into the K buffers and hold no
// registers across the copy latency, and the consumers can share the tensor work evenly. Other
// builds (the sm_100a mma.sync path) run prefill_cta over the same rows (no conversion there either).
//
// One CTA per (query token, 64-head group), 384 threads, the shared-memory map of kernels.cuh
// (params.h): Q f16 [64][512], K f16 [2 buffers][64 tokens][512], P f16 [2][64][64].
// Tiles go in pairs: tile 2i into buffer 0, tile 2i + 1 into buffer 1 (a missing last tile is an
// all-masked one: zero-filled, no reads). Each buffer is two halves, dims 0..255 (column blocks
// 0..3) and 256..511, each with its own READY and FREE mbarrier, so a half is refilled as soon as
// its last reader is done:
//   warpgroup 0 (O[:, 0:256]):  S0 = Q K0^T (buffer 0), softmax, O += P0 V0[:, :256] (P0 from
//                               registers), frees K0 low; then O += P1 V1[:, :256] (P1 from shared
//                               memory), frees K1 low; then S of the next tile 2i + 2.
//   warpgroup 1 (O[:, 256:]):   S1 = Q K1^T (buffer 1), softmax from warpgroup 0's base, O += P1
//                               V1[:, 256:] (registers), frees K1 high; O += P0 V0[:, 256:] (shared
//                               memory), frees K0 high.
// So each warpgroup issues half of every tile's products and one warpgroup's softmax runs while the
// other's wgmmas keep the tensor cores busy (FlashMLA's sparse prefill schedules its two consumer
// warpgroups this way; flashmla.md section 4).
// Row bases (lazy, as kernels.cuh's kLazyLog2): warpgroup 0 moves the base m0 for tile 2i, warpgroup 1
// moves it on from m0 for tile 2i + 1 (m1 >= m0) and publishes m1; warpgroup 0 then rescales P0, its
// O and l by 2^(m0 - m1) (only when a row of the warp moved) before P0 goes to shared memory, so both
// P tiles and both O halves use m1. Each warpgroup keeps its own partial row sums; the epilogue adds them.
// Hand-offs: named barriers between the warpgroups (the base m0, the base m1, P0 written, P1 written;
// each one warpgroup arrives and the other syncs, once per pair) and mbarriers between producers and
// consumers (READY: 128 cp.async arrivals + one plain arrival per producer warp after its mask word;
// FREE: the 128 threads of the half's last reader).
// Producers: thread p copies, per tile and half, chunk p % 8 of each of its rows 16 (p / 32) +
// (p / 8) % 4 + 4 lr (lr = 0..3) in the half's 4 column blocks: 16 cp.async of 16 bytes; a warp's
// ballot gives its 16 tokens' validity bits, lane 0 stores them as a 16-bit word of the buffer's mask.
#pragma once

#include "kernels.cuh"

namespace dsv41 {

#if DSV41_WGMMA
// Named barriers of the seesaw (ids of kernels.cuh's FULL / EMPTY, which it does not use).
enum : int { kBarSwM0 = 2, kBarSwM1 = 3, kBarSwP0 = 4, kBarSwP1 = 5 };
// mbarriers (8 bytes each) in the region kernels.cuh keeps for a pair's partial scores.
DEVFN int sw_ready(int buf, int half) { return kSmemXS + 8 * (2 * buf + half); }
DEVFN int sw_free(int buf, int half) { return kSmemXS + 32 + 8 * (2 * buf + half); }
constexpr int kSwStats = kSmemXS + 64;          // f32 [64]: warpgroup 1's running maxima for the epilogue
constexpr int kSwReadyCount = 128 + kProducerWarps;  // cp.async arrivals + the mask words' plain arrivals
static_assert(kSwStats + 64 * 4 <= kSmemBytes, "seesaw scratch beyond the CTA's shared memory");

// ------------------------------------------------------------------------------ producers
// Indices of this thread's four rows of tiles 2i and 2i + 1 (-1 past the length).
struct SwIdx {
  int32_t v[2][4];
};
DEVFN SwIdx sw_load_idx(const int32_t* row, int len, int pair, int rbase) {
  SwIdx x;
#pragma unroll
  for (int b = 0; b < 2; ++b)
#pragma unroll
    for (int lr = 0; lr < 4; ++lr) {
      const int pos = kTileTokens * (2 * pair + b) + rbase + 4 * lr;
      x.v[b][lr] = pos < len ? ldg_nc_s32(row + pos) : -1;
    }
  return x;
}

DEVFN void seesaw_produce(char* smem, const PrefillParams& p, int64_t s, int len, int npairs, int pt) {
  const int wp = pt >> 5, lane = pt & 31, ig = lane & 7;
  const int rbase = 16 * wp + (lane >> 3);  // rows rbase + 4 lr
  const int32_t* row = p.kv.indices + s * (int64_t)p.kv.topk;
  const uint8_t* kv = p.kv.base;
  const int64_t cap = p.kv.capacity;
  const uint32_t kb = smem_addr(smem + kSmemK);
  uint32_t dst[4];  // chunk ig of row rbase + 4 lr in a column block
#pragma unroll
  for (int lr = 0; lr < 4; ++lr) dst[lr] = (uint32_t)swz128(rbase + 4 * lr, ig);
  SwIdx nxt = sw_load_idx(row, len, 0, rbase);
#pragma unroll 1
  for (int i = 0; i < npairs; ++i) {
    const uint8_t* src[2][4];
    bool ok[2][4];
    uint32_t mask[2];
#pragma unroll
    for (int b = 0; b < 2; ++b) {
      mask[b] = 0u;
#pragma unroll
      for (int lr = 0; lr < 4; ++lr) {
        const int32_t t = nxt.v[b][lr];
        ok[b][lr] = t >= 0 && (int64_t)t < cap;
        src[b][lr] = ok[b][lr] ? kv + (int64_t)t * (kHeadDim * 2) + 16 * ig : kv;
        // lanes 0, 8, 16, 24 hold rows rbase (gi = 0..3) + 4 lr: bits gi + 4 lr of the warp's word
        const uint32_t m = ballot(ok[b][lr]);
        mask[b] |= ((m & 1u) | ((m >> 7) & 2u) | ((m >> 14) & 4u) | ((m >> 21) & 8u)) << (4 * lr);
      }
    }
    if (i + 1 < npairs) nxt = sw_load_idx(row, len, i + 1, rbase);  // consumed next iteration
    const uint32_t fpar = (uint32_t)(i & 1) ^ 1u;  // FREE: the first wait of each half passes at once
    // Halves in the order their readers release them: K0 low, K1 high, K0 high, K1 low.
#pragma unroll
    for (int st = 0; st < 4; ++st) {
      const int b = st & 1, h = (st == 1 || st == 2) ? 1 : 0;
      mbar_wait(smem_addr(smem + sw_free(b, h)), fpar);
      if (st < 2 && lane == 0)
        *reinterpret_cast<uint16_t*>(smem + kSmemValid + 8 * b + 2 * wp) = (uint16_t)mask[b];
      const uint32_t kbuf = kb + (uint32_t)(b * kTileBytes);
#pragma unroll
      for (int lr = 0; lr < 4; ++lr)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int cb = 4 * h + c;
          cp_async16(kbuf + (uint32_t)(cb * 8192) + dst[lr], src[b][lr] + 128 * cb, ok[b][lr] ? 16u : 0u);
        }
      const uint32_t rdy = smem_addr(smem + sw_ready(b, h));
      cp_async_arrive_noinc(rdy);
      if (lane == 0) mbar_arrive(rdy);  // after the mask word (released to the consumers' acquire)
    }
  }
}

// ------------------------------------------------------------------------------ consumers
// Issue (no commit) the k-steps of S += Q K^T over half `h` of the dims (column blocks 4h..4h+3).
// (The wgmma.fence in front of each half: after the READY wait's loop ptxas would otherwise insert its
// own and serialise the wgmmas, C7520.)
template <int H>
DEVFN void sw_qk_half(float (&s)[8][4], uint64_t qd, uint64_t kd) {
  reg_fence<32>(&s[0][0]);
  wgmma_fence();
#pragma unroll
  for (int ks = 16 * H; ks < 16 * H + 16; ++ks) {
    wgmma_m64n64k16<false>(&s[0][0], wgmma_desc_add(qd, kstep_off(ks)), wgmma_desc_add(kd, kstep_off(ks)));
  }
}
DEVFN void sw_zero(float (&s)[8][4]) {
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[j][e] = 0.f;
}
// S of the tile in buffer `buf`: both halves in the given order, each after its READY phase `par`;
// committed and waited on. kWaitOther: a PV group issued before is still in flight: wait for it
// (wait<1>) between the halves and arrive on `free_after` (its buffer half is then free).
template <int First>
DEVFN void sw_qk(char* smem, int buf, uint32_t par, float (&s)[8][4], uint32_t free_after) {
  const uint64_t qd = opaque_u64(wgmma_desc(smem_addr(smem + kSmemQ), 16, 1024));
  const uint64_t kd = opaque_u64(wgmma_desc(smem_addr(smem + kSmemK + buf * kTileBytes), 16, 1024));
  sw_zero(s);
  mbar_wait(smem_addr(smem + sw_ready(buf, First)), par);
  sw_qk_half<First>(s, qd, kd);
  wgmma_commit();
  if (free_after) {
    wgmma_wait<1>();  // the earlier PV group
    mbar_arrive(free_after);
  }
  mbar_wait(smem_addr(smem + sw_ready(buf, 1 - First)), par);
  sw_qk_half<1 - First>(s, qd, kd);
  wgmma_commit();
  wgmma_wait<0>();
  reg_fence<32>(&s[0][0]);
}

// Mask (bit 2t + (e & 1) of byte j: token 8j + 2t + (e & 1)) and scale to the log2 domain; returns
// row hr's maximum over the quad.
DEVFN void sw_mask(const char* smem, int buf, float (&s)[8][4], float scale_log2, int t) {
  const uint2 v = *reinterpret_cast<const uint2*>(smem + kSmemValid + 8 * buf);
  const float ninf = -finf();
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const uint32_t bits = ((j < 4 ? v.x : v.y) >> (8 * (j & 3) + 2 * t));
#pragma unroll
    for (int e = 0; e < 4; ++e) s[j][e] = ((bits >> (e & 1)) & 1u) ? s[j][e] * scale_log2 : ninf;
  }
}

DEVFN uint64_t sw_vdesc(char* smem, int buf, int half) {
  return wgmma_desc(smem_addr(smem + kSmemK + buf * kTileBytes) + (uint32_t)half * 4u * 8192u, 8192, 1024);
}
DEVFN uint64_t sw_pdesc(char* smem, int buf) {
  return wgmma_desc(smem_addr(smem + kSmemP + buf * kSmemPBytes), 16, 1024);
}

// Scale factor from base `from` to base `to` (to >= from, lazy bases; -inf = no finite score yet):
// 1 when equal, 0 from -inf (everything at that base is 0).
DEVFN float sw_rebase(float from, float to) {
  return from == to ? 1.f : (from == -finf() ? 0.f : fexp2(from - to));
}

// This warpgroup's row bases to the other warpgroup (`sm`: one slot per row), then its arrival on `bar`.
DEVFN void sw_publish_base(float* sm, const Acc& acc, int r0, int t, int bar) {
  if (t == 0) {
    sm[r0] = acc.m[0];
    sm[r0 + 8] = acc.m[1];
  }
  bar_arrive(bar, kConsumerThreads);
}

// Warpgroup 0: tiles 2i (buffer 0), O[:, 0:256].
DEVFN void seesaw_wg0(char* smem, int npairs, Acc& acc, float scale_log2, int w, int lane) {
  const int t = lane & 3, r0 = 16 * (w & 3) + (lane >> 2);
  float* sm = reinterpret_cast<float*>(smem + kSmemRowMax);  // the published base, [64]
  float s[8][4];
  sw_qk<0>(smem, 0, 0u, s, 0u);
#pragma unroll 1
  for (int i = 0; i < npairs; ++i) {
    sw_mask(smem, 0, s, scale_log2, t);
    float alpha[2];
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const float base = lazy_row_update(acc, hr, quad_row_max(s, hr), alpha[hr]);
      exp_row(s, hr, base, alpha[hr], acc);
    }
    rescale_o(acc, alpha);
    sw_publish_base(sm, acc, r0, t, kBarSwM0);
    uint32_t pk[8][2];
    pack_p<8>(s, pk);
    pv_issue_regp(acc, pk, sw_vdesc(smem, 0, 0));
    wgmma_wait<0>();
    reg_fence<128>(&acc.o[0][0]);
    mbar_arrive(smem_addr(smem + sw_free(0, 0)));
    bar_sync(kBarSwM1, kConsumerThreads);  // warpgroup 1's base m1
    float beta[2];
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const float m1 = sm[r0 + 8 * hr];
      beta[hr] = sw_rebase(acc.m[hr], m1);
      acc.m[hr] = m1;
    }
    const bool moved = ballot(beta[0] != 1.f || beta[1] != 1.f) != 0u;  // warp-uniform
    if (moved) {
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        acc.l[hr] *= beta[hr];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          s[j][2 * hr] *= beta[hr];
          s[j][2 * hr + 1] *= beta[hr];
        }
      }
      pack_p<8>(s, pk);
    }
    store_p(smem, 0, pk, 0, w, lane);
    fence_proxy_async();
    bar_arrive(kBarSwP0, kConsumerThreads);
    bar_sync(kBarSwP1, kConsumerThreads);  // P1 in shared memory
    if (moved) rescale_o(acc, beta);
    pv_issue(acc, sw_pdesc(smem, 1), sw_vdesc(smem, 1, 0));
    const uint32_t free_k1lo = smem_addr(smem + sw_free(1, 0));
    if (i + 1 < npairs) {
      sw_qk<0>(smem, 0, (uint32_t)(i + 1) & 1u, s, free_k1lo);
    } else {
      wgmma_wait<0>();
      mbar_arrive(free_k1lo);
    }
    reg_fence<128>(&acc.o[0][0]);
  }
}

// Warpgroup 1: tiles 2i + 1 (buffer 1), O[:, 256:512].
DEVFN void seesaw_wg1(char* smem, int npairs, Acc& acc, float scale_log2, int w, int lane) {
  const int t = lane & 3, r0 = 16 * (w & 3) + (lane >> 2);
  float* sm = reinterpret_cast<float*>(smem + kSmemRowMax);
  float s[8][4];
#pragma unroll 1
  for (int i = 0; i < npairs; ++i) {
    sw_qk<1>(smem, 1, (uint32_t)i & 1u, s, 0u);
    sw_mask(smem, 1, s, scale_log2, t);
    const float mt[2] = {quad_row_max(s, 0), quad_row_max(s, 1)};
    bar_sync(kBarSwM0, kConsumerThreads);  // warpgroup 0's base m0
    float alpha[2];
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const float m0 = sm[r0 + 8 * hr];
      acc.mtrue[hr] = fmaxf(acc.mtrue[hr], mt[hr]);
      const float m1 = mt[hr] > m0 + kLazyLog2 ? mt[hr] : m0;  // from a -inf base: any finite maximum
      alpha[hr] = sw_rebase(acc.m[hr], m1);
      acc.m[hr] = m1;
      exp_row(s, hr, m1 == -finf() ? 0.f : m1, alpha[hr], acc);
    }
    rescale_o(acc, alpha);
    sw_publish_base(sm, acc, r0, t, kBarSwM1);
    uint32_t pk[8][2];
    pack_p<8>(s, pk);
    pv_issue_regp(acc, pk, sw_vdesc(smem, 1, 1));
    store_p(smem, 1, pk, 0, w, lane);
    bar_sync(kBarSwP0, kConsumerThreads);  // P0 (at base m1) in shared memory
    pv_issue(acc, sw_pdesc(smem, 0), sw_vdesc(smem, 0, 1));
    fence_proxy_async();  // this warpgroup's P1 stores, for warpgroup 0's wgmma
    bar_arrive(kBarSwP1, kConsumerThreads);
    wgmma_wait<1>();
    mbar_arrive(smem_addr(smem + sw_free(1, 1)));
    wgmma_wait<0>();
    reg_fence<128>(&acc.o[0][0]);
    mbar_arrive(smem_addr(smem + sw_free(0, 1)));
  }
}

// Row statistics for write_final: publish_row_stats' (both warpgroups' partial sums; warpgroup 0's base,
// which both share at the end; warpgroup 0's running maxima), then the maximum with warpgroup 1's running
// maxima (each warpgroup saw only its own tiles).
DEVFN void seesaw_publish_stats(char* smem, Acc& acc, int w, int lane) {
  const int t = lane & 3, r0 = 16 * (w & 3) + (lane >> 2);
  float* mt1 = reinterpret_cast<float*>(smem + kSwStats);
  if (w >= 4 && t == 0) {
    mt1[r0] = acc.mtrue[0];
    mt1[r0 + 8] = acc.mtrue[1];
  }
  publish_row_stats(smem, acc, w, lane);  // its barrier also orders the stores above
  if (w < 4 && t == 0) {  // the thread that stored these rows of mtrue in publish_row_stats
    float* mtrue = reinterpret_cast<float*>(smem + kSmemMtrue);
    mtrue[r0] = fmaxf(mtrue[r0], mt1[r0]);
    mtrue[r0 + 8] = fmaxf(mtrue[r0 + 8], mt1[r0 + 8]);
  }
  bar_sync(kBarConsumers, kConsumerThreads);
}

// kMega: the mega prefill (as prefill_cta's).
template <bool kMega = false>
DEVFN void prefill_seesaw_cta(const PrefillParams& p, char* smem_raw) {
  char* smem = align_smem(smem_raw);
  const int64_t bid = block_idx();
  const int group = (int)(bid % p.num_groups);
  const int64_t s = bid / p.num_groups;
  const int w = warp_idx(), lane = lane_idx();
  if (thread_idx() == 0) {
    for (int b = 0; b < 2; ++b)
      for (int h = 0; h < 2; ++h) {
        mbar_init(smem_addr(smem + sw_ready(b, h)), kSwReadyCount);
        mbar_init(smem_addr(smem + sw_free(b, h)), 128);
      }
    fence_mbar_init();
  }
  bar_sync(kBarCta, kThreads);
  const int len = load_len(p.kv.lengths, p.kv.lengths_stride, s, p.kv.topk);
  const int npairs = (len + 2 * kTileTokens - 1) / (2 * kTileTokens);
  if (w >= kConsumerWarps) {
    setmaxnreg_dec<kSeesawProducerRegs>();
    seesaw_produce(smem, p, s, len, npairs, thread_idx() - kConsumerThreads);
    return;
  }
  setmaxnreg_inc<kSeesawConsumerRegs>();
  Acc acc;
  const int64_t head_row = s * p.h_q + (int64_t)group * kHeadsPerCta;
  const int rows = group_rows(p.h_q, group);
  // (a mega CTA loads the cos / sin row even for an empty query: its epilogue reads load_q's copy; and all its Q
  // loads in one round, beside the quad and the roped chunks: RESULTS.md, 2026-12-04 twenty-seventh session)
  if (npairs > 0 || kMega)
    load_q<kMega ? 16 : 8, kMega>(smem, p.q + head_row * kHeadDim, thread_idx(), rows,
                                  kMega ? p.cos_sin + s * kRopeDim : nullptr);
  acc_reset(acc);
  if (npairs > 0) {
    if (w < 4)
      seesaw_wg0(smem, npairs, acc, p.scale_log2, w, lane);
    else
      seesaw_wg1(smem, npairs, acc, p.scale_log2, w, lane);
  }
  seesaw_publish_stats(smem, acc, w, lane);
  if constexpr (kMega)
    write_final_mega_staged<false>(smem, acc, w, lane, p.out_fp8 + head_row * kHeadDim,
                                   p.out_scale + head_row * kOutScales, p.lse + head_row, group_sink(p.sink, group),
                                   rows);
  else
    write_final_staged<true, false>(smem, acc, w, lane, p.out + head_row * kHeadDim, p.lse + head_row,
                                    p.max_logits + head_row, group_sink(p.sink, group), rows);
}
#endif  // DSV41_WGMMA

}  // namespace dsv41
