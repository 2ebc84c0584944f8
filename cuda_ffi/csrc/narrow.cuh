// The narrow decode CTA: at most 32 query heads of one query token (a tensor-parallel shard of V4.1's 64
// or 128 heads), read and written as they are, without padding them to a 64-head group
// (docs/cuda_kernels.md, section 5).
#pragma once

#include "decode_cta.cuh"

namespace dsv41 {

// A 64-row MMA over the heads would be three quarters padding at 16 heads, and the decode of few heads is
// bound by the gather, so the narrow CTA moves warps from the tensor work to the gather:
//   warpgroup 0 (warps 0..3): consumers over kRows = 16R heads (heads h_q..kRows - 1 are zero rows, never
//   written). sm_90a: warpgroup MMAs with the heads as N (NarrowAccT below); builds without wgmma (sm_100a):
//   warp MMAs (mma.sync m16n8k16, NarrowAcc): S: warp w computes the scores of tokens 16w..16w+15 for all
//   rows; the warps exchange row maxima through shared memory (B1) and write P (B2); PV: warp w accumulates
//   O[:, 128w..128w+127] for all rows. A thread's score rows (16r + g, + 8) are also its O rows, so the
//   rescale needs no exchange.
//   warpgroups 1 and 2 (warps 4..11): producers, one 8-token batch each per tile (produce_tiles_deep: the
//   L2 prefetch two tiles ahead), so twice the single 64-head CTA's rows are in flight.
// Tiles, K buffers, validity masks, the FULL / EMPTY hand-off (all 384 threads) and the plan are the
// decode's; Q and P keep the 64-row layouts of params.h (rows 0..kRows-1 used); the row maxima and the
// partial row sums live in the exchange region.
constexpr int kNarrowConsumerWarps = 4;
constexpr int kNarrowConsumerThreads = 32 * kNarrowConsumerWarps;  // 128: kBarConsumers' count here
constexpr int kNarrowProducerWarps = kConsumerWarps + kProducerWarps - kNarrowConsumerWarps;  // 8
constexpr int kNarrowTokensPerWarp = kTileTokens / kNarrowConsumerWarps;                       // 16 (S)
constexpr int kNarrowDimsPerWarp = kHeadDim / kNarrowConsumerWarps;                            // 128 (PV)
// setmaxnreg per warpgroup: 128 consumers x 232 + 256 producers x 136 = 384 x 168.
constexpr int kNarrowConsumerRegs = 232;
constexpr int kNarrowProducerRegs = 136;
static_assert(kNarrowConsumerRegs + 2 * kNarrowProducerRegs <= 3 * kLaunchRegs, "setmaxnreg beyond the launch");
constexpr int kSmemNarrowMax = kSmemXS;                                                 // f32 [4 warps][32 rows]
constexpr int kSmemNarrowL = kSmemNarrowMax + kNarrowConsumerWarps * kNarrowMaxHeads * 4;  // f32 [4][32]
static_assert(kSmemNarrowL + kNarrowConsumerWarps * kNarrowMaxHeads * 4 <= kSmemBytes, "narrow exchange beyond the map");

// The head counts the narrow CTA serves: 16 or 32 rows (host_params.h sets h_pad, cuda_ffi/ops.py).
constexpr bool narrow_rows_ok(int64_t h_pad) { return h_pad == 16 || h_pad == 32; }

// The crew of the narrow CTA (pair.cuh's Crew for one CTA, with eight producer warps of one batch each).
struct NarrowCrew {
  static constexpr int ncta = 1;
  static constexpr bool split = false;
  static constexpr int full_count = kThreads;
  static constexpr bool wg1_addr = false;
  static constexpr int producer_warps = kNarrowProducerWarps;
  static constexpr int batches = 1;
  static constexpr int producer_regs = kNarrowProducerRegs;
  static constexpr int consumer_regs = kNarrowConsumerRegs;
  int rank;
  uint32_t peer;
};
static_assert(NarrowCrew::producer_warps * 8 * NarrowCrew::batches == kTileTokens, "the producers cover a tile");

// O fragment: o[r][n] = rows 16r + g (e < 2) / + 8, dims 128w + 8n + 2t + (e & 1).
template <int R>
struct NarrowAcc {
  float o[R][16][4];
  float m[R][2];  // lazy base of P (kLazyLog2), identical in every warp
  float l[R][2];  // this thread's share of the row sums (its 4 tokens of every tile)
};

template <int R>
DEVFN void narrow_reset(NarrowAcc<R>& a) {
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int n = 0; n < 16; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) a.o[r][n][e] = 0.f;
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      a.m[r][hr] = -finf();
      a.l[r][hr] = 0.f;
    }
  }
}

DEVFN void narrow_sync() { bar_sync(kBarConsumers, kNarrowConsumerThreads); }
// The consumers' release of tile tc: one arrival per warp on the buffer's EMPTY mbarrier (the pair's PEMPTY
// slots, unused by one CTA), after the warp's reads of the tile (the __syncwarp orders its lanes' accesses
// before lane 0's arrival). Each producer warp then waits for the phase by itself, where a named barrier of
// all 384 threads would make every producer warp wait for the slowest of the others as well.
DEVFN void narrow_release(char* smem, int tc, int lane) {
  syncwarp();
  if (lane == 0) mbar_arrive(smem_addr(smem + bar_pempty(tc & 1)));
}

// Q rows 0..16R-1 of one query token (bf16 [h_q][512] from global; rows past h_q zero) as f16 into the
// swizzled Q region; the 128 consumer threads, 8R loads each in flight; ends with the consumer barrier.
// cs: as load_q's (the mega decode's RoPE of dims 448..511).
template <int R>
DEVFN void narrow_load_q(char* smem, const uint16_t* q, int h_q, int ct, const float* cs) {
  constexpr int kPer = 8 * R;
  const int chunk = ct & 63;  // (the same chunk of every row this thread loads)
  const bool rope = cs != nullptr && chunk >= kNopeDim / 8;
  RopeQuad rq{};
  if (rope) rq = rope_quad(cs, chunk - kNopeDim / 8);
  uint4 v[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int c = ct + kNarrowConsumerThreads * i;
    v[i] = (c >> 6) < h_q ? ldg_nc_v4(q + (c >> 6) * kHeadDim + (c & 63) * 8) : make_u4(0u, 0u, 0u, 0u);
  }
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int c = ct + kNarrowConsumerThreads * i;
    if (rope) v[i] = rope_q_chunk(v[i], rq);
    *reinterpret_cast<uint4*>(smem + kSmemQ + tile_off(c >> 6, c & 63)) = bf16x8_to_f16x8(v[i]);
  }
  fence_proxy_async();  // the warpgroup MMAs read Q through the async proxy (a no-op in builds without them)
  narrow_sync();
}

template <int R>
DEVFN void narrow_consume_tile(char* smem, int buf, NarrowAcc<R>& acc, float scale_log2, int w, int lane) {
  const int g = lane >> 2, t = lane & 3;
  const char* qs = smem + kSmemQ;
  const char* ks = smem + kSmemK + buf * kTileBytes;
  char* ps = smem + kSmemP + buf * kSmemPBytes;
  float* rmax = reinterpret_cast<float*>(smem + kSmemNarrowMax);

  // S = Q K^T for tokens 16w + 8j + (0..7), j = 0, 1. B (K rows) via ldmatrix.x4 over four 8-dim chunks:
  // {b[0], b[1]} of k-step 2m, {b[2], b[3]} of k-step 2m + 1; A (Q rows 16r..) as consume_tile_mma_sync's.
  // Even and odd k-steps accumulate apart (sa, sb): two chains of 16 dependent MMAs instead of one of 32.
  float sa[R][2][4], sb[R][2][4];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) sa[r][j][e] = sb[r][j][e] = 0.f;
  const int b_tok = kNarrowTokensPerWarp * w + (lane & 7), b_chunk = lane >> 3;
  const int a_row = lane & 15, a_chunk = lane >> 4;
#pragma unroll 4
  for (int m = 0; m < kHeadDim / 32; ++m) {
    uint32_t b0[4], b1[4];
    ldsm_x4(b0, ks + tile_off(b_tok, 4 * m + b_chunk));
    ldsm_x4(b1, ks + tile_off(b_tok + 8, 4 * m + b_chunk));
#pragma unroll
    for (int r = 0; r < R; ++r) {
      uint32_t a0[4], a1[4];
      ldsm_x4(a0, qs + tile_off(16 * r + a_row, 4 * m + a_chunk));
      ldsm_x4(a1, qs + tile_off(16 * r + a_row, 4 * m + 2 + a_chunk));
      mma_f16_16816(sa[r][0], a0, b0[0], b0[1]);
      mma_f16_16816(sa[r][1], a0, b1[0], b1[1]);
      mma_f16_16816(sb[r][0], a1, b0[2], b0[3]);
      mma_f16_16816(sb[r][1], a1, b1[2], b1[3]);
    }
  }

  // Mask (token 16w + 8j + 2t + (e & 1): bit 2t + (e & 1) of mask word 2w + j), log2 domain, row maxima.
  const uint32_t* vws = reinterpret_cast<const uint32_t*>(smem + kSmemValid) + 8 * buf + 2 * w;
  const uint32_t vw[2] = {vws[0] >> (2 * t), vws[1] >> (2 * t)};
  const float ninf = -finf();
  float (&s)[R][2][4] = sa;  // the scores, in place
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        s[r][j][e] = ((vw[j] >> (e & 1)) & 1u) ? (sa[r][j][e] + sb[r][j][e]) * scale_log2 : ninf;
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      float v = fmaxf(fmaxf(s[r][0][2 * hr], s[r][0][2 * hr + 1]), fmaxf(s[r][1][2 * hr], s[r][1][2 * hr + 1]));
      v = fmaxf(v, shfl_xor_f32(v, 1));
      v = fmaxf(v, shfl_xor_f32(v, 2));
      if (t == 0) rmax[w * kNarrowMaxHeads + 16 * r + g + 8 * hr] = v;
    }
  }
  narrow_sync();  // B1

  // Every warp derives the same maximum, base and alpha for a row (the same values in the same order).
  float alpha[R][2];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int row = 16 * r + g + 8 * hr;
      float mt = rmax[row];
#pragma unroll
      for (int k = 1; k < kNarrowConsumerWarps; ++k) mt = fmaxf(mt, rmax[k * kNarrowMaxHeads + row]);
      const float base = lazy_base_update(acc.m[r][hr], mt, alpha[r][hr]);
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const float p0 = fexp2(s[r][j][2 * hr] - base), p1 = fexp2(s[r][j][2 * hr + 1] - base);
        sum += p0 + p1;
        // P row `row`, tokens 16w + 8j + 2t, +1: chunk 2w + j of the [64][64] f16 P tile
        *reinterpret_cast<uint32_t*>(ps + swz128(row, 2 * w + j) + 4 * t) = pack_f16x2(p0, p1);
      }
      acc.l[r][hr] = acc.l[r][hr] * alpha[r][hr] + sum;
    }
  narrow_sync();  // B2: all of P written

  bool moved = false;
#pragma unroll
  for (int r = 0; r < R; ++r) moved |= alpha[r][0] != 1.f || alpha[r][1] != 1.f;
  if (ballot(moved) != 0u) {
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int n = 0; n < 16; ++n) {
        acc.o[r][n][0] *= alpha[r][0];
        acc.o[r][n][1] *= alpha[r][0];
        acc.o[r][n][2] *= alpha[r][1];
        acc.o[r][n][3] *= alpha[r][1];
      }
  }
  // O[:, 128w..] += P V: V via ldmatrix.x4.trans (matrix i = lane / 8: tokens 16kk + 8 (i & 1) + 0..7,
  // dims chunk 16w + 2np + (i >> 1)) -> {b_lo, b_hi} of n-tile 2np, then of n-tile 2np + 1.
  const int v_tok = (lane & 7) + (((lane >> 3) & 1) << 3);
  const int v_chunk = (kNarrowDimsPerWarp / 8) * w + (lane >> 4);
#pragma unroll
  for (int kk = 0; kk < kTileTokens / 16; ++kk) {
    uint32_t ph[R][4];
#pragma unroll
    for (int r = 0; r < R; ++r) ldsm_x4(ph[r], ps + swz128(16 * r + (lane & 15), 2 * kk + (lane >> 4)));
#pragma unroll
    for (int np = 0; np < 8; ++np) {
      uint32_t vb[4];
      ldsm_x4_trans(vb, ks + tile_off(16 * kk + v_tok, v_chunk + 2 * np));
#pragma unroll
      for (int r = 0; r < R; ++r) {
        mma_f16_16816(acc.o[r][2 * np], ph[r], vb[0], vb[1]);
        mma_f16_16816(acc.o[r][2 * np + 1], ph[r], vb[2], vb[3]);
      }
    }
  }
}

template <int R, class C>
DEVFN void narrow_consume_tiles(const C& crew, char* smem, int tc0, int n, NarrowAcc<R>& acc, float scale_log2,
                                int w, int lane) {
  for (int tc = tc0; tc < tc0 + n; ++tc) {
    await_tile(crew, tc, w);
    narrow_consume_tile<R>(smem, tc & 1, acc, scale_log2, w, lane);
    narrow_release(smem, tc, lane);
  }
}

// Row statistics of the finished segment: the row sums' shares to shared memory, the maxima (identical in
// every warp) from warp 0; returns after the consumer barrier (B3).
template <int R>
DEVFN void narrow_publish_stats(char* smem, const NarrowAcc<R>& acc, int w, int lane) {
  const int g = lane >> 2, t = lane & 3;
  float* lsum = reinterpret_cast<float*>(smem + kSmemNarrowL);
  float* mfin = reinterpret_cast<float*>(smem + kSmemMfin);
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      float l = acc.l[r][hr];
      l += shfl_xor_f32(l, 1);
      l += shfl_xor_f32(l, 2);
      const int row = 16 * r + g + 8 * hr;
      if (t == 0) {
        lsum[w * kNarrowMaxHeads + row] = l;
        if (w == 0) mfin[row] = acc.m[r][hr];
      }
    }
  narrow_sync();  // B3
}

DEVFN float narrow_row_sum(const char* smem, int row) {
  const float* lsum = reinterpret_cast<const float*>(smem + kSmemNarrowL);
  float L = 0.f;
#pragma unroll
  for (int k = 0; k < kNarrowConsumerWarps; ++k) L += lsum[k * kNarrowMaxHeads + row];  // fixed order
  return L;
}

// Head `row`'s epilogue factors from the published statistics: the final output's factor
// 1 / L / (1 + 2^(sink log2 e - lse2)) and natural lse (+inf if empty), the split piece's 1 / L and lse2
// (-inf if empty).
struct NarrowRow {
  float factor, lse_nat, inv, lse2;
};
DEVFN NarrowRow narrow_row(const char* smem, int row, const float* sink0) {
  const float* mfin = reinterpret_cast<const float*>(smem + kSmemMfin);
  const float L = narrow_row_sum(smem, row);
  NarrowRow f{0.f, finf(), 0.f, -finf()};
  if (L > 0.f) {
    f.lse2 = mfin[row] + flog2(L);
    f.inv = 1.f / L;
    const float sink2 = sink0 ? ldg_nc_f32(sink0 + row) * kLog2e : -finf();  // (split pieces pass none)
    f.factor = 1.f / (L * (1.f + fexp2(sink2 - f.lse2)));
    f.lse_nat = f.lse2 * kLn2;
  }
  return f;
}

// Final epilogue of a one-piece request: out bf16 = O * factor, lse (natural; +inf if empty); rows < h_q.
template <int R>
DEVFN void narrow_write_final(const char* smem, const NarrowAcc<R>& acc, int h_q, int w, int lane, uint16_t* orow0,
                              float* lse0, const float* sink0) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int row = 16 * r + g + 8 * hr;
      if (row >= h_q) continue;
      const NarrowRow fr = narrow_row(smem, row, sink0);
      const float factor = fr.factor;
      uint16_t* orow = orow0 + (int64_t)row * kHeadDim + kNarrowDimsPerWarp * w + 2 * t;
#pragma unroll
      for (int n = 0; n < 16; ++n)
        *reinterpret_cast<uint32_t*>(orow + 8 * n) =
            pack_bf16x2(acc.o[r][n][2 * hr] * factor, acc.o[r][n][2 * hr + 1] * factor);
      if (w == 0 && t == 0) lse0[row] = fr.lse_nat;
    }
}

// Split epilogue: o_accum f32 = O / L (0 if empty), lse_accum = M + log2 L (-inf if empty); rows < h_q.
template <int R>
DEVFN void narrow_write_split(const char* smem, const NarrowAcc<R>& acc, int h_q, int w, int lane, float* arow0,
                              float* alse0) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int row = 16 * r + g + 8 * hr;
      if (row >= h_q) continue;
      const NarrowRow fr = narrow_row(smem, row, nullptr);
      const float inv = fr.inv;
      float* arow = arow0 + (int64_t)row * kHeadDim + kNarrowDimsPerWarp * w + 2 * t;
#pragma unroll
      for (int n = 0; n < 16; ++n) {
        float2 v;
        v.x = acc.o[r][n][2 * hr] * inv;
        v.y = acc.o[r][n][2 * hr + 1] * inv;
        *reinterpret_cast<float2*>(arow + 8 * n) = v;
      }
      if (w == 0 && t == 0) alse0[row] = fr.lse2;
    }
}

#if DSV41_WGMMA
// sm_90a: the same tile with warpgroup MMAs, operands swapped so that the heads are the MMA's N (16 or 32)
// and the tile's 64 tokens (S) or 64 dims (PV) its M:
//   S^T = K Q^T: m64nNk16 x 32 k-steps, A = the K tile (K-major), B = Q (K-major, N rows);
//   column maxima over the tokens: shuffles over the 8 row groups of a warp, then the 4 warps (B1);
//   P = 2^(S - base) stored as [heads][tokens] (P tile, B2);
//   O^T += V^T P^T: per 64-dim block i, m64nNk16 x 4 token steps, A = the K tile read MN-major (transpose
//   bit), B = P (K-major).
// Fragments (m64nNk16 accumulator of warp w, g = lane / 4, t = lane % 4): S^T s[4n + e] = token 16w + g +
// 8 (e >> 1), head 8n + 2t + (e & 1); O^T o[i][4n + e] = dim 64i + 16w + g + 8 (e >> 1), same head. A thread's
// heads are the same in both, so alpha needs no exchange.
template <int R>
struct NarrowAccT {
  static constexpr int N = 16 * R;  // heads (the MMAs' N)
  float o[8][N / 2];
  float m[N / 8][2], l[N / 8][2];  // head 8n + 2t + c: lazy base, this thread's share of the row sums
};

template <int R>
DEVFN void narrow_reset(NarrowAccT<R>& a) {
#pragma unroll
  for (int i = 0; i < 8; ++i)
#pragma unroll
    for (int k = 0; k < NarrowAccT<R>::N / 2; ++k) a.o[i][k] = 0.f;
#pragma unroll
  for (int n = 0; n < NarrowAccT<R>::N / 8; ++n)
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      a.m[n][c] = -finf();
      a.l[n][c] = 0.f;
    }
}

template <int R, bool kTa>
DEVFN void narrow_wgmma(float* d, uint64_t da, uint64_t db) {
  if constexpr (R == 1) wgmma_m64n16k16_f16<kTa>(d, da, db);
  else wgmma_m64n32k16_f16<kTa>(d, da, db);
}

// Column c of an S^T column pair: its maximum over the warp's 16 tokens (2 per thread, 8 row groups).
DEVFN float narrow_col_max(float a, float b) {
  float v = fmaxf(a, b);
  v = fmaxf(v, shfl_xor_f32(v, 4));
  v = fmaxf(v, shfl_xor_f32(v, 8));
  return fmaxf(v, shfl_xor_f32(v, 16));
}
DEVFN float narrow_col_sum(float v) {
  v += shfl_xor_f32(v, 4);
  v += shfl_xor_f32(v, 8);
  return v + shfl_xor_f32(v, 16);
}

// S^T of the tile in buffer `buf` into s: issued and committed, not waited for.
template <int R>
DEVFN void narrow_issue_s(char* smem, int buf, float (&s)[8 * R]) {
  const uint32_t ka = smem_addr(smem + kSmemK + buf * kTileBytes);
  const uint64_t kd = wgmma_desc(ka, 16, 1024);
  const uint64_t qd = opaque_u64(wgmma_desc(smem_addr(smem + kSmemQ), 16, 1024));
#pragma unroll
  for (int k = 0; k < 8 * R; ++k) s[k] = 0.f;
  reg_fence<8 * R>(s);
  wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < kHeadDim / 16; ++ks) {
    const uint32_t koff = kstep_off(ks);
    narrow_wgmma<R, false>(s, wgmma_desc_add(kd, koff), wgmma_desc_add(qd, koff));
  }
  wgmma_commit();
}

// The tile's softmax (S^T complete in s): mask, column maxima (B1), the online update, P into the P tile
// (B2), O rescaled.
template <int R>
DEVFN void narrow_softmax(char* smem, int buf, float (&s)[8 * R], NarrowAccT<R>& acc, float scale_log2, int w,
                          int lane) {
  constexpr int N = NarrowAccT<R>::N;
  const int g = lane >> 2, t = lane & 3;
  char* ps = smem + kSmemP + buf * kSmemPBytes;
  float* rmax = reinterpret_cast<float*>(smem + kSmemNarrowMax);
  // Mask (tokens 16w + g: bit g of mask word 2w; + 8: of word 2w + 1), log2 domain, column maxima.
  const uint32_t* vws = reinterpret_cast<const uint32_t*>(smem + kSmemValid) + 8 * buf + 2 * w;
  const bool valid[2] = {((vws[0] >> g) & 1u) != 0u, ((vws[1] >> g) & 1u) != 0u};
  const float ninf = -finf();
#pragma unroll
  for (int n = 0; n < N / 8; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) s[4 * n + e] = valid[e >> 1] ? s[4 * n + e] * scale_log2 : ninf;
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const float v = narrow_col_max(s[4 * n + c], s[4 * n + 2 + c]);
      if (g == 0) rmax[w * kNarrowMaxHeads + 8 * n + 2 * t + c] = v;
    }
  }
  narrow_sync();  // B1

  float alpha[N / 8][2];
#pragma unroll
  for (int n = 0; n < N / 8; ++n)
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int head = 8 * n + 2 * t + c;
      float mt = rmax[head];
#pragma unroll
      for (int k = 1; k < kNarrowConsumerWarps; ++k) mt = fmaxf(mt, rmax[k * kNarrowMaxHeads + head]);
      const float base = lazy_base_update(acc.m[n][c], mt, alpha[n][c]);
      const float p0 = fexp2(s[4 * n + c] - base), p1 = fexp2(s[4 * n + 2 + c] - base);
      acc.l[n][c] = acc.l[n][c] * alpha[n][c] + (p0 + p1);
      // P [head][token] (f16): tokens 16w + g and + 8, chunks 2w and 2w + 1 of row `head`
      const uint32_t pk = pack_f16x2(p0, p1);
      *reinterpret_cast<uint16_t*>(ps + swz128(head, 2 * w) + 2 * g) = (uint16_t)(pk & 0xffffu);
      *reinterpret_cast<uint16_t*>(ps + swz128(head, 2 * w + 1) + 2 * g) = (uint16_t)(pk >> 16);
    }
  fence_proxy_async();
  narrow_sync();  // B2: all of P written (and every thread's B1 reads of rmax done)

  bool moved = false;
#pragma unroll
  for (int n = 0; n < N / 8; ++n) moved |= alpha[n][0] != 1.f || alpha[n][1] != 1.f;
  if (ballot(moved) != 0u) {
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
      for (int n = 0; n < N / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc.o[i][4 * n + e] *= alpha[n][e & 1];
  }
}

// O^T += V^T P^T of the tile in buffer `buf`: issued and committed, not waited for.
template <int R>
DEVFN void narrow_issue_pv(char* smem, int buf, NarrowAccT<R>& acc) {
  const uint32_t ka = smem_addr(smem + kSmemK + buf * kTileBytes);
  const uint64_t pd = wgmma_desc(smem_addr(smem + kSmemP + buf * kSmemPBytes), 16, 1024);
  reg_fence<64 * R>(&acc.o[0][0]);
  wgmma_fence();
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const uint64_t vd = wgmma_desc(ka + 8192u * i, 8192, 1024);
#pragma unroll
    for (int kk = 0; kk < kTileTokens / 16; ++kk)
      narrow_wgmma<R, true>(acc.o[i], wgmma_desc_add(vd, 16u * 128u * kk), wgmma_desc_add(pd, 32u * kk));
  }
  wgmma_commit();
}

// Tiles tc0 .. tc0 + n - 1 of one segment. The next tile's S is issued right behind this tile's PV, so the
// two overlap on the tensor pipe (and with the wait for the next tile); a tile is released once its PV
// completed (wait_group 1: the S issued after it may still run).
template <int R, class C>
DEVFN void narrow_consume_tiles(const C& crew, char* smem, int tc0, int n, NarrowAccT<R>& acc, float scale_log2,
                                int w, int lane) {
  float s[8 * R];
  await_tile(crew, tc0, w);
  narrow_issue_s<R>(smem, tc0 & 1, s);
  wgmma_wait<0>();
  reg_fence<8 * R>(s);
  for (int tc = tc0; tc < tc0 + n; ++tc) {
    narrow_softmax<R>(smem, tc & 1, s, acc, scale_log2, w, lane);
    narrow_issue_pv<R>(smem, tc & 1, acc);
    if (tc + 1 < tc0 + n) {
      await_tile(crew, tc + 1, w);
      narrow_issue_s<R>(smem, (tc + 1) & 1, s);
      wgmma_wait<1>();
      reg_fence<64 * R>(&acc.o[0][0]);
      narrow_release(smem, tc, lane);
      wgmma_wait<0>();
      reg_fence<8 * R>(s);
    } else {
      wgmma_wait<0>();
      reg_fence<64 * R>(&acc.o[0][0]);
      narrow_release(smem, tc, lane);
    }
  }
}

template <int R>
DEVFN void narrow_publish_stats(char* smem, const NarrowAccT<R>& acc, int w, int lane) {
  const int g = lane >> 2, t = lane & 3;
  float* lsum = reinterpret_cast<float*>(smem + kSmemNarrowL);
  float* mfin = reinterpret_cast<float*>(smem + kSmemMfin);
#pragma unroll
  for (int n = 0; n < NarrowAccT<R>::N / 8; ++n)
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const float l = narrow_col_sum(acc.l[n][c]);
      const int head = 8 * n + 2 * t + c;
      if (g == 0) {
        lsum[w * kNarrowMaxHeads + head] = l;
        if (w == 0) mfin[head] = acc.m[n][c];
      }
    }
  narrow_sync();  // B3
}

template <int R>
DEVFN void narrow_write_final(const char* smem, const NarrowAccT<R>& acc, int h_q, int w, int lane, uint16_t* orow0,
                              float* lse0, const float* sink0) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int n = 0; n < NarrowAccT<R>::N / 8; ++n)
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int head = 8 * n + 2 * t + c;
      if (head >= h_q) continue;
      const NarrowRow fr = narrow_row(smem, head, sink0);
      const float factor = fr.factor;
      uint16_t* orow = orow0 + (int64_t)head * kHeadDim + 16 * w + g;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const uint32_t pk = pack_bf16x2(acc.o[i][4 * n + c] * factor, acc.o[i][4 * n + 2 + c] * factor);
        orow[64 * i] = (uint16_t)(pk & 0xffffu);
        orow[64 * i + 8] = (uint16_t)(pk >> 16);
      }
      if (w == 0 && g == 0) lse0[head] = fr.lse_nat;
    }
}

template <int R>
DEVFN void narrow_write_split(const char* smem, const NarrowAccT<R>& acc, int h_q, int w, int lane, float* arow0,
                              float* alse0) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int n = 0; n < NarrowAccT<R>::N / 8; ++n)
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int head = 8 * n + 2 * t + c;
      if (head >= h_q) continue;
      const NarrowRow fr = narrow_row(smem, head, nullptr);
      const float inv = fr.inv;
      float* arow = arow0 + (int64_t)head * kHeadDim + 16 * w + g;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        arow[64 * i] = acc.o[i][4 * n + c] * inv;
        arow[64 * i + 8] = acc.o[i][4 * n + 2 + c] * inv;
      }
      if (w == 0 && g == 0) alse0[head] = fr.lse2;
    }
}
template <int R>
using NarrowAccOf = NarrowAccT<R>;
#else
template <int R>
using NarrowAccOf = NarrowAcc<R>;
#endif

template <int R>
DEVFN void narrow_consumer_loop(const DecodeParams& p, const DecodeWork& wk, char* smem, const NarrowCrew& crew, int s,
                                int w, int lane) {
  NarrowAccOf<R> acc;
  int tc = 0;
  const int ct = thread_idx();
  for (int req = wk.begin_req; req <= wk.end_req; ++req) {
    const DecodeSeg sg = decode_segment(p, wk, req);
    const int64_t head_row = ((int64_t)req * p.s_q + s) * p.h_q;  // row of [b*s_q*h_q]
    if (sg.blk0 >= sg.blk1) {  // (never for the call's own plan; the producers skip it too)
      if (p.mega)  // (its combine finishes every request)
        write_empty_piece<kNarrowConsumerThreads, kEmptyMegaCombine>(p, wk, req, s, head_row, p.h_q, 0, p.h_q, ct);
      else
        write_empty_piece<kNarrowConsumerThreads>(p, wk, req, s, head_row, p.h_q, 0, p.h_q, ct);
      continue;
    }
    const int ntiles = sg.blk1 - sg.blk0;
    narrow_load_q<R>(smem, p.q + head_row * kHeadDim, p.h_q, ct, mega_cs_row(p, (int64_t)req * p.s_q + s));
    narrow_reset(acc);
    narrow_consume_tiles<R>(crew, smem, tc, ntiles, acc, p.scale_log2, w, lane);
    tc += ntiles;
    const int first = ldg_nc_s32(p.num_splits + req);
    const int pieces = ldg_nc_s32(p.num_splits + req + 1) - first;
    narrow_publish_stats(smem, acc, w, lane);
    if ((pieces <= 1 || p.num_slots <= 1) && !p.mega) {  // (a mega decode's pieces all go to the combine)
      narrow_write_final(smem, acc, p.h_q, w, lane, p.out + head_row * kHeadDim, p.lse + head_row, p.sink);
    } else {
      const int64_t slot = (int64_t)first + (req == wk.begin_req ? wk.begin_split : 0);
      if (slot >= 0 && slot < p.num_slots) {
        const int64_t arow = (slot * p.s_q + s) * p.h_q;
        narrow_write_split(smem, acc, p.h_q, w, lane, p.o_accum + arow * kHeadDim, p.lse_accum + arow);
      }
    }
    // (the next segment's Q load rewrites the Q region and ends with a barrier; the statistics are read
    // before it)
  }
}

// Grid: s_q * num_parts CTAs (one head group), query token fastest. kFam: the cache formats it reads.
template <int R, int kFam>
DEVFN void decode_narrow_cta(const DecodeParams& p, char* smem_raw) {
  static_assert(R == 1 || R == 2, "the narrow CTA serves 16 or 32 rows");
  char* smem = align_smem(smem_raw);
  const NarrowCrew crew{0, 0u};
  const int64_t bid = block_idx();
  const int s = (int)(bid % p.s_q);
  const int part = (int)(bid / p.s_q);
  const DecodeWork wk = decode_work(p, part);
  const int w = warp_idx(), lane = lane_idx();
  if (thread_idx() == 0) {  // EMPTY: one arrival per consumer warp (narrow_release)
    mbar_init(smem_addr(smem + bar_pempty(0)), kNarrowConsumerWarps);
    mbar_init(smem_addr(smem + bar_pempty(1)), kNarrowConsumerWarps);
    fence_mbar_init();
  }
  bar_sync(kBarCta, kThreads);
  if (w >= kNarrowConsumerWarps) {
    setmaxnreg_dec<NarrowCrew::producer_regs>();
    TileCursor cur(p, wk, s);
    produce_tiles_deep(smem, crew, Pools<kFam>{&p.main, &p.extra}, w - kNarrowConsumerWarps, lane,
                       [&]() -> TileSrc { return cur.next(); });
  } else {
    setmaxnreg_inc<NarrowCrew::consumer_regs>();
    narrow_consumer_loop<R>(p, wk, smem, crew, s, w, lane);
  }
}

}  // namespace dsv41
