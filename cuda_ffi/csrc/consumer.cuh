// The consumer warps: S = Q K^T, the online softmax, O += P V (sm_90a wgmma, symmetric or split; sm_100a
// mma.sync) and the epilogues (final and split).
#pragma once

#include "mega.cuh"
#include "producer.cuh"

namespace dsv41 {

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

// Q rows of one (query token, 64-head group): 64 x 512 bf16 from global, as f16
// into the swizzled tile layout; rows from `rows` on (a last group of fewer than 64 heads) are zero, never read.
// Called by all 256 consumer threads; ends with the consumer barrier.
// kRound: loads in flight per thread (16: one latency instead of two, for callers with the registers free).
// kRope, cs: the mega ops' cos / sin row (mega.cuh): the 8 chunks of dims 448..511 of every row are roped with it, and
// it is copied to kSmemMegaCs for the epilogue (not kRope: q is roped, cs unused). A compile-time flag, so that no
// Q load waits on the address of the row. The roped chunks are a second pass of
// two per thread (chunk 56 + (ct & 7), one cos / sin quad per thread) beside the first's 16 unroped ones: roping
// in the first pass would make an eighth of each warp's lanes diverge over 16 unrolled chunks, code that keeps
// the producers' loop out of the instruction cache.
template <int kRound = 8, bool kRope = false>
DEVFN void load_q(char* smem, const uint16_t* q, int ct, int rows = kHeadsPerCta, const float* cs = nullptr) {
  const int chunk = ct & 63;  // (the same chunk of every row this thread loads)
  const bool skip = kRope && chunk >= kNopeDim / 8;  // (the second pass's)
  constexpr int kRoped = kHeadsPerCta * (kRopeDim / 8) / kConsumerThreads;  // 2 chunks per thread
  const int rj = ct & 7;                                                    // their quad
  // (the cos / sin quad first: its latency then overlaps the Q loads' instead of following them)
  const RopeQuad rq = kRope ? rope_quad(cs, rj) : RopeQuad{};
  uint4 r[kRoped];
  if constexpr (kRope) {
#pragma unroll
    for (int k = 0; k < kRoped; ++k) {
      const int row = (ct + kConsumerThreads * k) >> 3;
      r[k] = row < rows ? ldg_nc_v4(q + row * kHeadDim + kNopeDim + 8 * rj) : make_u4(0u, 0u, 0u, 0u);
    }
  }
#pragma unroll
  for (int i0 = 0; i0 < 16; i0 += kRound) {
    uint4 v[kRound];
#pragma unroll
    for (int i = 0; i < kRound; ++i) {
      const int c = ct + kConsumerThreads * (i0 + i);
      v[i] = (c >> 6) < rows && !skip ? ldg_nc_v4(q + (c >> 6) * kHeadDim + (c & 63) * 8) : make_u4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int i = 0; i < kRound; ++i) {
      const int c = ct + kConsumerThreads * (i0 + i);
      if (!skip) *reinterpret_cast<uint4*>(smem + kSmemQ + tile_off(c >> 6, c & 63)) = bf16x8_to_f16x8(v[i]);
    }
  }
  if constexpr (kRope) {
    if (ct < 8) {
      float* st = reinterpret_cast<float*>(smem + kSmemMegaCs) + 4 * rj;
      *reinterpret_cast<float4*>(st) = rq.c;
      *reinterpret_cast<float4*>(st + kRopeDim / 2) = rq.s;
    }
#pragma unroll
    for (int k = 0; k < kRoped; ++k) {
      const int row = (ct + kConsumerThreads * k) >> 3;
      *reinterpret_cast<uint4*>(smem + kSmemQ + tile_off(row, kNopeDim / 8 + rj)) = bf16x8_to_f16x8(rope_q_chunk(r[k], rq));
    }
  }
  fence_proxy_async();
  bar_sync(kBarConsumers, kConsumerThreads);
}

// Online-softmax update of one row's lazy base m by this tile's maximum mt (log2 domain): returns the
// base of P = 2^(S - base) and sets alpha, the factor for the row's O and l.
DEVFN float lazy_base_update(float& m, float mt, float& alpha) {
  const bool move = mt > m + kLazyLog2;  // from a -inf base: any finite maximum
  const float mnew = move ? mt : m;
  const float base = (mnew == -finf()) ? 0.f : mnew;  // keeps (-inf) - (-inf) out
  alpha = move ? fexp2(m - base) : 1.f;               // 0 when moving off -inf
  m = mnew;
  return base;
}
// The same for row hr of acc, and its running maximum (max_logits).
DEVFN float lazy_row_update(Acc& acc, int hr, float mt, float& alpha) {
  acc.mtrue[hr] = fmaxf(acc.mtrue[hr], mt);
  return lazy_base_update(acc.m[hr], mt, alpha);
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
// row's new partial sum.
template <int J>
DEVFN void exp_row(float (&s)[J][4], int hr, float base, float alpha, Acc& acc) {
  float sum = 0.f;
#pragma unroll
  for (int j = 0; j < J; ++j) {
    const float p0 = fexp2(s[j][2 * hr] - base);
    const float p1 = fexp2(s[j][2 * hr + 1] - base);
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
                        float (&alpha)[2]) {
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
  // both token halves of a row compute the identical M
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int r = r0 + 8 * hr;
    const float base = lazy_row_update(acc, hr, fmaxf(rmax[r], rmax[64 + r]), alpha[hr]);  // sets alpha[hr]
    exp_row(s, hr, base, alpha[hr], acc);
  }
}

// P (f16, one term: 11 significant bits) of this thread's 4J entries into the P tile of `buf`:
// [64 heads][64 tokens], 128-byte rows, chunk c of row r at c ^ (r & 7). The thread holds rows
// 16 (w & 3) + lane / 4 (+ 8) and, in column block j, chunk chunk0 + j.
// pack_p: the entries as f16 pairs, pk[j][hr] = row r0 + 8 hr of column block j (also the A
// fragments of a register-operand wgmma: wgmma_m64n256k16_rs_tb); store_p writes them.
template <int J>
DEVFN void pack_p(const float (&s)[J][4], uint32_t (&pk)[J][2]) {
#pragma unroll
  for (int j = 0; j < J; ++j)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) pk[j][hr] = pack_f16x2(s[j][2 * hr], s[j][2 * hr + 1]);
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
template <int N, int kSteps = kHeadDim / 16>
DEVFN void qk_wgmma(float (&s)[N / 8][4], uint64_t qd, uint64_t kd) {
#pragma unroll
  for (int j = 0; j < N / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[j][e] = 0.f;
  reg_fence<N / 2>(&s[0][0]);
  wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < kSteps; ++ks) {
    const uint32_t koff = kstep_off(ks);
    if constexpr (N == 32)
      wgmma_m64n32k16(&s[0][0], wgmma_desc_add(qd, koff), wgmma_desc_add(kd, koff));
    else
      wgmma_m64n64k16(&s[0][0], wgmma_desc_add(qd, koff), wgmma_desc_add(kd, koff));
  }
  wgmma_commit();
  wgmma_wait<0>();
  reg_fence<N / 2>(&s[0][0]);
}

// O[:, 256th..256th+255] += P V over the tile's 64 tokens (m64n256k16 x 4; P and V from shared
// memory through descriptors pd / vd); O already rescaled. pv_issue commits the group and returns
// (the caller waits: seesaw.cuh); pv_wgmma returns with O updated.
DEVFN void pv_issue(Acc& acc, uint64_t pd, uint64_t vd) {
  reg_fence<128>(&acc.o[0][0]);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kTileTokens / 16; ++kk)
    wgmma_m64n256k16_tb(&acc.o[0][0], wgmma_desc_add(pd, 32u * kk), wgmma_desc_add(vd, 16u * 128u * kk));
  wgmma_commit();
}
DEVFN void pv_wgmma(Acc& acc, uint64_t pd, uint64_t vd) {
  pv_issue(acc, pd, vd);
  wgmma_wait<0>();
  reg_fence<128>(&acc.o[0][0]);
}
// The same with P from registers (pk: pack_p's words of all 64 tokens of the thread's rows; split
// consumers' warpgroup 0): no shared-memory round trip, no barrier before it.
DEVFN void pv_issue_regp(Acc& acc, const uint32_t (&pk)[8][2], uint64_t vd) {
  reg_fence<128>(&acc.o[0][0]);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kTileTokens / 16; ++kk) {
    const uint32_t a[4] = {pk[2 * kk][0], pk[2 * kk][1], pk[2 * kk + 1][0], pk[2 * kk + 1][1]};
    wgmma_m64n256k16_rs_tb(&acc.o[0][0], a, wgmma_desc_add(vd, 16u * 128u * kk));
  }
  wgmma_commit();
}
DEVFN void pv_wgmma_regp(Acc& acc, const uint32_t (&pk)[8][2], uint64_t vd) {
  pv_issue_regp(acc, pk, vd);
  wgmma_wait<0>();
  reg_fence<128>(&acc.o[0][0]);
}

// sm_90a: warpgroup MMAs. Warpgroup th = w >> 2 computes S for tokens 32th..32th+31 of all 64
// heads (m64n32k16 x 32 k-steps over the 512 dims, Q and K from shared memory), and then O for
// dims 256th..256th+255 of all 64 heads (m64n256k16 x 4 token steps, P and V from shared memory:
// V is the K tile read MN-major). The thread that owns a score row also owns that row of O, so
// the rescale needs no exchange.
DEVFN void consume_tile_wgmma(char* smem, int buf, Acc& acc, float scale_log2, int w, int lane) {
  // Operand descriptors built once per tile; each wgmma adds a constant offset (wgmma_desc_add).
  // (Taking th through a lane-0 shuffle, to make it uniform, cost the pair kernel 8 bytes of spills.)
  const uint32_t th = (uint32_t)(w >> 2);
  const uint32_t ka = smem_addr(smem + kSmemK + buf * kTileBytes);
  const uint64_t qd = wgmma_desc(smem_addr(smem + kSmemQ), 16, 1024);
  const uint64_t kd = wgmma_desc(ka + 32u * 128u * th, 16, 1024);
  const uint64_t pd = wgmma_desc(smem_addr(smem + kSmemP + buf * kSmemPBytes), 16, 1024);
  const uint64_t vd = wgmma_desc(ka + 4u * 8192u * th, 8192, 1024);
  float s[4][4];
  qk_wgmma<32>(s, qd, kd);

  float alpha[2];
  softmax_tile(smem, buf, s, acc, scale_log2, w, lane, alpha);
  uint32_t pk[4][2];
  pack_p<4>(s, pk);
  store_p(smem, buf, pk, 4 * (w >> 2), w, lane);
  fence_proxy_async();
  bar_sync(kBarConsumers, kConsumerThreads);  // B2: all of P written

  rescale_o(acc, alpha);
  pv_wgmma(acc, pd, vd);
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
// released tile tc - 2 (EMPTY), i.e. after warpgroup 1's PV of tile tc - 2 completed. Used by prefill
// and a pair's decode.
// The split's mask (token 8j + 2t + (e & 1): bit 2t + (e & 1) of word j of vw) and the scale to the log2
// domain.
DEVFN void mask_scores(float (&s)[8][4], const uint32_t* vw, int t, float scale_log2) {
  const float ninf = -finf();
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const uint32_t bits = vw[j] >> (2 * t);
#pragma unroll
    for (int e = 0; e < 4; ++e) s[j][e] = ((bits >> (e & 1)) & 1u) ? s[j][e] * scale_log2 : ninf;
  }
}
// Warpgroup 0 of the split, after S of tile tc: mask, softmax, P (packed into pk) and alpha to shared
// memory for warpgroup 1 (the P-ready barrier), O rescaled; its PV is the caller's.
DEVFN void split_softmax_publish(char* smem, int tc, float (&s)[8][4], uint32_t (&pk)[8][2], Acc& acc,
                                 float scale_log2, int w, int lane) {
  const int buf = tc & 1, g = lane >> 2, t = lane & 3;
  const int r0 = 16 * (w & 3) + g;
  float* alpha_b = reinterpret_cast<float*>(smem + kSmemRowMax) + 64 * buf;
  float alpha[2] = {1.f, 1.f};
  const uint32_t* vw = reinterpret_cast<const uint32_t*>(smem + kSmemValid) + 8 * buf;
  mask_scores(s, vw, t, scale_log2);
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const float mt = quad_row_max(s, hr);
    const float base = lazy_row_update(acc, hr, mt, alpha[hr]);  // sets alpha[hr]
    exp_row(s, hr, base, alpha[hr], acc);
  }
  pack_p<8>(s, pk);
  store_p(smem, buf, pk, 0, w, lane);  // for warpgroup 1
  if (t == 0) {
    alpha_b[r0] = alpha[0];
    alpha_b[r0 + 8] = alpha[1];
  }
  fence_proxy_async();
  bar_arrive(kBarPReady0 + buf, kConsumerThreads);
  rescale_o(acc, alpha);
}

template <class Side = NoSide>
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
    qk_wgmma<64>(s, qd, kd);
    uint32_t pk[8][2];
    split_softmax_publish(smem, tc, s, pk, acc, scale_log2, w, lane);
    pv_wgmma_regp(acc, pk, wgmma_desc(ka, 8192, 1024));  // its own P from registers
    return;
  }
  bar_sync(kBarPReady0 + buf, kConsumerThreads);
  const float alpha[2] = {alpha_b[r0], alpha_b[r0 + 8]};
  rescale_o(acc, alpha);
  pv_issue(acc, wgmma_desc(smem_addr(smem + kSmemP + buf * kSmemPBytes), 16, 1024),
                 wgmma_desc(ka + 4u * 8192u, 8192, 1024));
  side(tc);
  wgmma_wait<0>();
  reg_fence<128>(&acc.o[0][0]);
}
#endif

// Which consumers each kernel uses: the split (Crew::split) for prefill and a pair's decode, the symmetric
// ones for one CTA's decode (the split spills there at 120 / 192 registers). The split shortens the time a
// tile is held (warpgroup 1's PV of tile n overlaps warpgroup 0's S of tile n + 1, and no row-max or P
// barrier joins both), and with two K buffers that time, plus the producers' refill, sets the tile period
// (benchmarks/RESULTS.md, "cuda split consumers"). Prefill's tensor-core operands are f16 as decode's: P
// rounded to bf16 fails the prefill tolerance on a few elements.

// tc: the tile's index in the CTA's sequence (buffer tc & 1).
template <class C, class Side = NoSide>
DEVFN void consume_tile(const C&, char* smem, int tc, Acc& acc, float scale_log2, int w, int lane,
                        const Side& side = Side{}) {
#if DSV41_WGMMA
  if constexpr (C::split) {
    consume_tile_split(smem, tc, acc, scale_log2, w, lane, side);
    return;
  }
#endif
  if constexpr (kWgmma)
    consume_tile_wgmma(smem, tc & 1, acc, scale_log2, w, lane);
  else
    consume_tile_mma_sync(smem, tc & 1, acc, scale_log2, w, lane);
}

// Tiles tc0 .. tc0 + n - 1 of the CTA's sequence: wait, consume, release each. (A tile's PV stays
// out of flight across the wait for the next tile: keeping it there delays the tile's release, and with
// it the producers' refill.)

template <class C, class Side = NoSide>
DEVFN void consume_tiles(const C& crew, char* smem, int tc0, int n, Acc& acc, float scale_log2, int w, int lane,
                         const Side& side = Side{}) {
  for (int tc = tc0; tc < tc0 + n; ++tc) {
    await_tile(crew, tc, w);
    consume_tile(crew, smem, tc, acc, scale_log2, w, lane, side);
    release_tile(crew, tc, lane);
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
// of this CTA's group; rows from `rows` on (heads past the call's) are neither written nor their sink read.
// Row statistics are written by the threads holding dims 0..1 of a row.
DEVFN void write_final(const char* smem, const Acc& acc, int w, int lane, uint16_t* orow0, float* lse0,
                       float* maxl0, const float* sink0, int rows = kHeadsPerCta) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int rb = 0; rb < kORowBlocks; ++rb)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int r = o_row(w, rb, g) + 8 * hr;
      if (r >= rows) continue;
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
// 32-byte sector half used). lse and max_logits (when kMaxl) as write_final, rows from `rows` on neither
// written nor their sink read. kBarAfter: a barrier after the copy-out, so that the caller may overwrite the Q
// region (the next segment's load_q).
template <bool kMaxl, bool kBarAfter>
DEVFN void write_final_staged(char* smem, const Acc& acc, int w, int lane, uint16_t* orow0, float* lse0,
                              float* maxl0, const float* sink0, int rows = kHeadsPerCta) {
  const int g = lane >> 2, t = lane & 3;
  char* stage = smem + kSmemQ;
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int r = o_row(w, 0, g) + 8 * hr;
    const FinalRow fr = final_row(smem, r, r < rows ? sink0 : nullptr);
#pragma unroll
    for (int n = 0; n < 32; ++n) {
      const int c = 32 * (w >> 2) + n;  // dims 8c..8c+7
      *reinterpret_cast<uint32_t*>(stage + r * 1024 + ((c ^ (r & 7)) << 4) + 4 * t) =
          pack_bf16x2(acc.o[n][2 * hr] * fr.factor, acc.o[n][2 * hr + 1] * fr.factor);
    }
    if ((w >> 2) == 0 && t == 0 && r < rows) {
      lse0[r] = fr.lse_nat;
      if constexpr (kMaxl) maxl0[r] = fr.maxl;
    }
  }
  bar_sync(kBarConsumers, kConsumerThreads);
  const int ct = thread_idx();
#pragma unroll 4
  for (int i = 0; i < 16; ++i) {
    const int k = ct + kConsumerThreads * i, r = k >> 6, c = k & 63;
    if (r < rows)
      *reinterpret_cast<uint4*>(orow0 + (int64_t)r * kHeadDim + 8 * c) =
          *reinterpret_cast<const uint4*>(stage + r * 1024 + ((c ^ (r & 7)) << 4));
  }
  if constexpr (kBarAfter) bar_sync(kBarConsumers, kConsumerThreads);
}

// The mega ops' final epilogue: O * factor in f32, the inverse RoPE of dims 448..511 with the row's cos / sin
// (load_q's copy), then per 32-dim group (4 n-blocks of a quad: max by two shuffles) the UE8M0 exponent and the e4m3
// values (mega.cuh). Either O layout (o_row / o_dim: the wgmma one of write_final_staged, the mma.sync one). Staged
// in the Q region (free once every S is done) as [64][512 B] (16-byte chunk c of row r at c ^ (r & 7)) and
// [64][16 B] of exponents, then stored with coalesced 16-byte writes: out_fp8 / out_scale point at this CTA's head
// 0. lse as write_final; rows from `rows` on are neither written nor their sink read. kBarAfter: as
// write_final_staged.
template <bool kBarAfter>
DEVFN void write_final_mega_staged(char* smem, const Acc& acc, int w, int lane, uint8_t* out_fp8, uint8_t* out_scale,
                                   float* lse0, const float* sink0, int rows = kHeadsPerCta) {
  // This warp's block of dims: kWarpDims wide, wd-th of the row; the roped dims 448..511 are the n-blocks from
  // kRopeN on of the last block.
  constexpr int kWarpDims = 8 * kOCols, kLastWd = kHeadDim / kWarpDims - 1, kRopeN = (kNopeDim % kWarpDims) / 8;
  const int g = lane >> 2, t = lane & 3, wd = kWgmma ? (w >> 2) : w;
  const float* cs = reinterpret_cast<const float*>(smem + kSmemMegaCs);  // (load_q's copy of the row's cos / sin)
  char* stage = smem + kSmemQ;
  char* sstage = stage + kHeadsPerCta * kHeadDim;
#pragma unroll
  for (int rb = 0; rb < kORowBlocks; ++rb)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int r = o_row(w, rb, g) + 8 * hr;
      const FinalRow fr = final_row(smem, r, r < rows ? sink0 : nullptr);
#pragma unroll
      for (int grp = 0; grp < kOCols / 4; ++grp) {
        float v[4][2];
        float amax = 0.f;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const int n = 4 * grp + k;
          v[k][0] = acc.o[kOCols * rb + n][2 * hr] * fr.factor;
          v[k][1] = acc.o[kOCols * rb + n][2 * hr + 1] * fr.factor;
          if (wd == kLastWd && n >= kRopeN) unrope_pair(v[k][0], v[k][1], cs, 4 * (n - kRopeN) + t);
          amax = fmaxf(amax, fmaxf(fabsf(v[k][0]), fabsf(v[k][1])));
        }
        amax = fmaxf(amax, shfl_xor_f32(amax, 1));
        amax = fmaxf(amax, shfl_xor_f32(amax, 2));
        const int e = out_exponent(amax);
        const float inv = out_inv_scale(e);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const int d = kWarpDims * wd + 8 * (4 * grp + k) + 2 * t;  // this pair's dims d, d + 1
          *reinterpret_cast<uint16_t*>(stage + r * kHeadDim + ((((d >> 4) ^ (r & 7))) << 4) + (d & 15)) =
              (uint16_t)pack_e4m3x2(v[k][0] * inv, v[k][1] * inv);
        }
        if (t == 0) sstage[r * kOutScales + (kWarpDims / kOutGroup) * wd + grp] = (char)out_scale_byte(e);
      }
      if (wd == 0 && t == 0 && r < rows) lse0[r] = fr.lse_nat;
    }
  bar_sync(kBarConsumers, kConsumerThreads);
  const int ct = thread_idx();
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int k = ct + kConsumerThreads * i, r = k >> 5, c = k & 31;
    if (r < rows)
      *reinterpret_cast<uint4*>(out_fp8 + (int64_t)r * kHeadDim + 16 * c) =
          *reinterpret_cast<const uint4*>(stage + r * kHeadDim + ((c ^ (r & 7)) << 4));
  }
  if (ct < rows)
    *reinterpret_cast<uint4*>(out_scale + (int64_t)ct * kOutScales) =
        *reinterpret_cast<const uint4*>(sstage + ct * kOutScales);
  if constexpr (kBarAfter) bar_sync(kBarConsumers, kConsumerThreads);
}

// Split epilogue: o_accum f32 = O / L (0 if empty), lse_accum = M + log2 L (-inf if empty); rows < `rows`.
DEVFN void write_split(const char* smem, const Acc& acc, int w, int lane, float* arow0, float* alse0,
                       int rows = kHeadsPerCta) {
  const int g = lane >> 2, t = lane & 3;
  const float* lsum = reinterpret_cast<const float*>(smem + kSmemLsum);
  const float* mfin = reinterpret_cast<const float*>(smem + kSmemMfin);
#pragma unroll
  for (int rb = 0; rb < kORowBlocks; ++rb)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int r = o_row(w, rb, g) + 8 * hr;
      if (r >= rows) continue;
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

}  // namespace dsv41
