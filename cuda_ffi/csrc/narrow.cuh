// The narrow decode CTA: 16 or 32 query heads of one query token (a tensor-parallel shard of V4.1's 64 or
// 128 heads), without padding them to a 64-head group (docs/cuda_kernels.md, section 5).
#pragma once

#include "decode_cta.cuh"

namespace dsv41 {

// The CTA is the single-CTA decode's (producers warpgroup, 8 consumer warps, same tiles, K buffers,
// validity masks and plan); only the consumers differ. A 64-row warpgroup MMA would be three quarters
// padding at 16 heads, so the consumers use warp MMAs (mma.sync m16n8k16) of kRows = 16R rows:
//   S: warp w computes the scores of tokens 8w..8w+7 of the tile for all rows (R m-blocks, 32 k-steps);
//   the 8 warps exchange row maxima through shared memory (B1), write P (B2);
//   PV: warp w accumulates O[:, 64w..64w+63] for all rows (P via ldmatrix, V via ldmatrix.trans).
// A thread's score rows (16r + g, +8) are also its O rows, so the rescale needs no exchange.
// Q, P and the K tiles keep the 64-row layouts of params.h (rows 0..kRows-1 used); the row maxima and the
// partial row sums live in the exchange region.
constexpr int kNarrowMaxRows = 32;
constexpr int kSmemNarrowMax = kSmemXS;                                     // f32 [8 warps][32 rows]
constexpr int kSmemNarrowL = kSmemNarrowMax + kConsumerWarps * kNarrowMaxRows * 4;  // f32 [8 warps][32 rows]
static_assert(kSmemNarrowL + kConsumerWarps * kNarrowMaxRows * 4 <= kSmemBytes, "narrow exchange beyond the map");

// The head counts the narrow CTA serves: h_pad = 16 or 32 (host_params.h, cuda_ffi/ops.py).
constexpr bool narrow_rows_ok(int64_t h_pad) { return h_pad == 16 || h_pad == 32; }

// O fragment: o[r][n] = rows 16r + g (e < 2) / + 8, dims 64w + 8n + 2t + (e & 1).
template <int R>
struct NarrowAcc {
  float o[R][8][4];
  float m[R][2];      // lazy base of P (kLazyLog2), identical in every warp
  float l[R][2];      // this thread's share of the row sums (its 2 tokens of every tile)
  float mtrue[R][2];  // running maximum of S (identical in every warp)
};

template <int R>
DEVFN void narrow_reset(NarrowAcc<R>& a) {
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) a.o[r][n][e] = 0.f;
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      a.m[r][hr] = a.mtrue[r][hr] = -finf();
      a.l[r][hr] = 0.f;
    }
  }
}

// Q rows 0..16R-1 of one query token (bf16 [16R][512] from global) as f16 into the swizzled Q region;
// all 256 consumer threads, 4R loads each in flight; ends with the consumer barrier.
template <int R>
DEVFN void narrow_load_q(char* smem, const uint16_t* q, int ct) {
  constexpr int kPer = 4 * R;
  uint4 v[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int c = ct + kConsumerThreads * i;
    v[i] = ldg_nc_v4(q + (c >> 6) * kHeadDim + (c & 63) * 8);
  }
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int c = ct + kConsumerThreads * i;
    *reinterpret_cast<uint4*>(smem + kSmemQ + tile_off(c >> 6, c & 63)) = bf16x8_to_f16x8(v[i]);
  }
  bar_sync(kBarConsumers, kConsumerThreads);
}

template <int R>
DEVFN void narrow_consume_tile(char* smem, int buf, NarrowAcc<R>& acc, float scale_log2, int w, int lane) {
  const int g = lane >> 2, t = lane & 3;
  const char* qs = smem + kSmemQ;
  const char* ks = smem + kSmemK + buf * kTileBytes;
  char* ps = smem + kSmemP + buf * kSmemPBytes;
  float* rmax = reinterpret_cast<float*>(smem + kSmemNarrowMax);

  // S = Q K^T for tokens 8w..8w+7. B (K rows) via ldmatrix.x4 over four 8-dim chunks: {b[0], b[1]} of
  // k-step 2m, {b[2], b[3]} of k-step 2m + 1. A (Q rows 16r..) as consume_tile_mma_sync's.
  float s[R][4];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[r][e] = 0.f;
  const int b_tok = 8 * w + (lane & 7), b_chunk = lane >> 3;
  const int a_row = lane & 15, a_chunk = lane >> 4;
#pragma unroll 4
  for (int m = 0; m < kHeadDim / 32; ++m) {
    uint32_t b[4];
    ldsm_x4(b, ks + tile_off(b_tok, 4 * m + b_chunk));
#pragma unroll
    for (int r = 0; r < R; ++r) {
      uint32_t a0[4], a1[4];
      ldsm_x4(a0, qs + tile_off(16 * r + a_row, 4 * m + a_chunk));
      ldsm_x4(a1, qs + tile_off(16 * r + a_row, 4 * m + 2 + a_chunk));
      mma_f16_16816(s[r], a0, b[0], b[1]);
      mma_f16_16816(s[r], a1, b[2], b[3]);
    }
  }

  // Mask (token 8w + 2t + (e & 1): bit 2t + (e & 1) of mask word w), log2 domain, this warp's row maxima.
  const uint32_t vw = reinterpret_cast<const uint32_t*>(smem + kSmemValid)[8 * buf + w] >> (2 * t);
  const float ninf = -finf();
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int e = 0; e < 4; ++e) s[r][e] = ((vw >> (e & 1)) & 1u) ? s[r][e] * scale_log2 : ninf;
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      float v = fmaxf(s[r][2 * hr], s[r][2 * hr + 1]);
      v = fmaxf(v, shfl_xor_f32(v, 1));
      v = fmaxf(v, shfl_xor_f32(v, 2));
      if (t == 0) rmax[w * kNarrowMaxRows + 16 * r + g + 8 * hr] = v;
    }
  }
  bar_sync(kBarConsumers, kConsumerThreads);  // B1

  // Every warp derives the same maximum, base and alpha for a row (the same values in the same order).
  float alpha[R][2];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int row = 16 * r + g + 8 * hr;
      float mt = rmax[row];
#pragma unroll
      for (int j = 1; j < kConsumerWarps; ++j) mt = fmaxf(mt, rmax[j * kNarrowMaxRows + row]);
      acc.mtrue[r][hr] = fmaxf(acc.mtrue[r][hr], mt);
      const bool move = mt > acc.m[r][hr] + kLazyLog2;
      const float mnew = move ? mt : acc.m[r][hr];
      const float base = (mnew == -finf()) ? 0.f : mnew;
      alpha[r][hr] = move ? fexp2(acc.m[r][hr] - base) : 1.f;
      acc.m[r][hr] = mnew;
      const float p0 = fexp2(s[r][2 * hr] - base), p1 = fexp2(s[r][2 * hr + 1] - base);
      acc.l[r][hr] = acc.l[r][hr] * alpha[r][hr] + (p0 + p1);
      // P row `row`, tokens 8w + 2t, +1: chunk w of the [64][64] f16 P tile
      *reinterpret_cast<uint32_t*>(ps + swz128(row, w) + 4 * t) = pack_f16x2(p0, p1);
    }
  bar_sync(kBarConsumers, kConsumerThreads);  // B2: all of P written

  bool moved = false;
#pragma unroll
  for (int r = 0; r < R; ++r) moved |= alpha[r][0] != 1.f || alpha[r][1] != 1.f;
  if (ballot(moved) != 0u) {
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int n = 0; n < 8; ++n) {
        acc.o[r][n][0] *= alpha[r][0];
        acc.o[r][n][1] *= alpha[r][0];
        acc.o[r][n][2] *= alpha[r][1];
        acc.o[r][n][3] *= alpha[r][1];
      }
  }
  // O[:, 64w..] += P V: V via ldmatrix.x4.trans as consume_tile_mma_sync's.
  const int v_tok = (lane & 7) + (((lane >> 3) & 1) << 3);
  const int v_chunk = 8 * w + (lane >> 4);
#pragma unroll
  for (int kk = 0; kk < kTileTokens / 16; ++kk) {
    uint32_t ph[R][4];
#pragma unroll
    for (int r = 0; r < R; ++r) ldsm_x4(ph[r], ps + swz128(16 * r + (lane & 15), 2 * kk + (lane >> 4)));
#pragma unroll
    for (int np = 0; np < 4; ++np) {
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

// Row statistics of the finished segment: the row sums' shares to shared memory, the maxima (identical in
// every warp) from warp 0; returns after the consumer barrier (B3).
template <int R>
DEVFN void narrow_publish_stats(char* smem, const NarrowAcc<R>& acc, int w, int lane) {
  const int g = lane >> 2, t = lane & 3;
  float* lsum = reinterpret_cast<float*>(smem + kSmemNarrowL);
  float* mfin = reinterpret_cast<float*>(smem + kSmemMfin);
  float* mtrue = reinterpret_cast<float*>(smem + kSmemMtrue);
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      float l = acc.l[r][hr];
      l += shfl_xor_f32(l, 1);
      l += shfl_xor_f32(l, 2);
      const int row = 16 * r + g + 8 * hr;
      if (t == 0) {
        lsum[w * kNarrowMaxRows + row] = l;
        if (w == 0) {
          mfin[row] = acc.m[r][hr];
          mtrue[row] = acc.mtrue[r][hr];
        }
      }
    }
  bar_sync(kBarConsumers, kConsumerThreads);  // B3
}

DEVFN float narrow_row_sum(const char* smem, int row) {
  const float* lsum = reinterpret_cast<const float*>(smem + kSmemNarrowL);
  float L = 0.f;
#pragma unroll
  for (int j = 0; j < kConsumerWarps; ++j) L += lsum[j * kNarrowMaxRows + row];  // fixed order
  return L;
}

// Final epilogue of a one-piece request: out bf16 = O * factor, lse (natural; +inf if empty).
template <int R>
DEVFN void narrow_write_final(const char* smem, const NarrowAcc<R>& acc, int w, int lane, uint16_t* orow0,
                              float* lse0, const float* sink0) {
  const int g = lane >> 2, t = lane & 3;
  const float* mfin = reinterpret_cast<const float*>(smem + kSmemMfin);
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int row = 16 * r + g + 8 * hr;
      const float L = narrow_row_sum(smem, row);
      float factor = 0.f, lse_nat = finf();
      if (L > 0.f) {
        const float lse2 = mfin[row] + flog2(L);
        const float sink2 = sink0 ? ldg_nc_f32(sink0 + row) * kLog2e : -finf();
        factor = 1.f / (L * (1.f + fexp2(sink2 - lse2)));
        lse_nat = lse2 * kLn2;
      }
      uint16_t* orow = orow0 + (int64_t)row * kHeadDim + 64 * w + 2 * t;
#pragma unroll
      for (int n = 0; n < 8; ++n)
        *reinterpret_cast<uint32_t*>(orow + 8 * n) =
            pack_bf16x2(acc.o[r][n][2 * hr] * factor, acc.o[r][n][2 * hr + 1] * factor);
      if (w == 0 && t == 0) lse0[row] = lse_nat;
    }
}

// Split epilogue: o_accum f32 = O / L (0 if empty), lse_accum = M + log2 L (-inf if empty).
template <int R>
DEVFN void narrow_write_split(const char* smem, const NarrowAcc<R>& acc, int w, int lane, float* arow0,
                              float* alse0) {
  const int g = lane >> 2, t = lane & 3;
  const float* mfin = reinterpret_cast<const float*>(smem + kSmemMfin);
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int row = 16 * r + g + 8 * hr;
      const float L = narrow_row_sum(smem, row);
      const float inv = L > 0.f ? 1.f / L : 0.f;
      float* arow = arow0 + (int64_t)row * kHeadDim + 64 * w + 2 * t;
#pragma unroll
      for (int n = 0; n < 8; ++n) {
        float2 v;
        v.x = acc.o[r][n][2 * hr] * inv;
        v.y = acc.o[r][n][2 * hr + 1] * inv;
        *reinterpret_cast<float2*>(arow + 8 * n) = v;
      }
      if (w == 0 && t == 0) alse0[row] = L > 0.f ? mfin[row] + flog2(L) : -finf();
    }
}

template <int R, class C>
DEVFN void narrow_consumer_loop(const DecodeParams& p, const DecodeWork& wk, char* smem, const C& crew, int s, int w,
                                int lane) {
  NarrowAcc<R> acc;
  int tc = 0;
  const int ct = thread_idx();
  for (int req = wk.begin_req; req <= wk.end_req; ++req) {
    const DecodeSeg sg = decode_segment(p, wk, req);
    const int64_t head_row = ((int64_t)req * p.s_q + s) * p.h_pad;  // row of [b*s_q*h_pad]
    if (sg.blk0 >= sg.blk1) {  // (never for the call's own plan; the producers skip it too)
      write_empty_piece(p, wk, req, s, head_row, 0, ct, 16 * R);
      continue;
    }
    const int ntiles = sg.blk1 - sg.blk0;
    narrow_load_q<R>(smem, p.q + head_row * kHeadDim, ct);
    narrow_reset(acc);
    for (int i = 0; i < ntiles; ++i, ++tc) {
      await_tile(crew, tc, w);
      narrow_consume_tile<R>(smem, tc & 1, acc, p.scale_log2, w, lane);
      release_tile(crew, tc, lane);
    }
    const int first = ldg_nc_s32(p.num_splits + req);
    const int pieces = ldg_nc_s32(p.num_splits + req + 1) - first;
    narrow_publish_stats(smem, acc, w, lane);
    if (pieces <= 1 || p.num_slots <= 1) {
      narrow_write_final(smem, acc, w, lane, p.out + head_row * kHeadDim, p.lse + head_row, p.sink);
    } else {
      const int64_t slot = (int64_t)first + (req == wk.begin_req ? wk.begin_split : 0);
      if (slot >= 0 && slot < p.num_slots) {
        const int64_t arow = (slot * p.s_q + s) * p.h_pad;
        narrow_write_split(smem, acc, w, lane, p.o_accum + arow * kHeadDim, p.lse_accum + arow);
      }
    }
    // (the next segment's Q load rewrites the Q region and ends with a barrier; the statistics are read
    // before it)
  }
}

// Grid: s_q * num_parts CTAs (one head group), query token fastest.
template <int R>
DEVFN void decode_narrow_cta(const DecodeParams& p, char* smem_raw) {
  static_assert(R == 1 || R == 2, "the narrow CTA serves 16 or 32 rows");
  char* smem = align_smem(smem_raw);
  const auto crew = crew_setup<false, false>(smem);
  const int64_t bid = block_idx();
  const int s = (int)(bid % p.s_q);
  const int part = (int)(bid / p.s_q);
  const DecodeWork wk = decode_work(p, part);
  const int w = warp_idx(), lane = lane_idx();
  if (w >= kConsumerWarps) {
    setmaxnreg_dec<crew.producer_regs>();
    decode_producers(p, wk, smem, crew, s, w - kConsumerWarps, lane);
  } else {
    setmaxnreg_inc<crew.consumer_regs>();
    narrow_consumer_loop<R>(p, wk, smem, crew, s, w, lane);
  }
  crew_teardown(crew);
}

}  // namespace dsv41
