// The split combine: merges the split-KV pieces of a request into out and lse.
#pragma once

#include "common.cuh"
#include "mega.cuh"

namespace dsv41 {

// One warp per (request, query token, head) of requests with more than one piece (8 heads per CTA):
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

// The mega output of one head row from the combine's layout (lane: dims 128j + 4 lane + 0..3): the inverse RoPE
// of dims 448..511 (j = 3, lanes 16..31), per 32-dim group (lanes 8k..8k + 7 of one j) the UE8M0 exponent and
// the e4m3 values (mega.cuh).
DEVFN void store_mega_row(float (&acc)[4][4], int lane, uint8_t* out, uint8_t* scale, const float* cs) {
  if (lane >= (kNopeDim - 384) / 4) {
    const int i = 2 * (lane - (kNopeDim - 384) / 4);
    unrope_pair(acc[3][0], acc[3][1], cs, i);
    unrope_pair(acc[3][2], acc[3][3], cs, i + 1);
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    float amax = fmaxf(fmaxf(fabsf(acc[j][0]), fabsf(acc[j][1])), fmaxf(fabsf(acc[j][2]), fabsf(acc[j][3])));
#pragma unroll
    for (int o = 1; o < 8; o <<= 1) amax = fmaxf(amax, shfl_xor_f32(amax, o));
    const int e = out_exponent(amax);
    const float inv = out_inv_scale(e);
    *reinterpret_cast<uint32_t*>(out + 128 * j + 4 * lane) =
        pack_e4m3x2(acc[j][0] * inv, acc[j][1] * inv) | (pack_e4m3x2(acc[j][2] * inv, acc[j][3] * inv) << 16);
    if ((lane & 7) == 0) scale[4 * j + (lane >> 3)] = (uint8_t)out_scale_byte(e);
  }
}

// The combine runs for requests of more than one piece and, in a mega decode whose kernel has no staged
// epilogue (mega_via_combine), for every request: it then writes the output of each one.
DEVFN void combine_cta(const DecodeParams& p) {
  const int hgroups = (p.h_q + 7) / 8;
  const int64_t bid = block_idx();
  const int hg = (int)(bid % hgroups);
  const int64_t rest = bid / hgroups;
  const int s = (int)(rest % p.s_q);
  const int req = (int)(rest / p.s_q);
  const int first = p.num_splits[req];
  int n = p.num_splits[req + 1] - first;
  const bool every = mega_via_combine(p);
  if (n <= 1 && !every) return;
  if (first < 0 || first >= p.num_slots) n = 0;
  if (n > p.num_slots - first) n = p.num_slots - first;
  if (n < 0) n = 0;
  const int head = hg * 8 + warp_idx();
  if (head >= p.h_q) return;
  const int lane = lane_idx();
  const int64_t stride = (int64_t)p.s_q * p.h_q;  // between consecutive slots
  const float* la = p.lse_accum + ((int64_t)first * p.s_q + s) * p.h_q + head;
  const int64_t orow = (((int64_t)req * p.s_q + s) * p.h_q + head);
  uint16_t* out = p.out + orow * kHeadDim;
  float m = -finf();
  for (int i = lane; i < n; i += 32) m = fmaxf(m, la[i * stride]);
  m = warp_max(m);
  if (m == -finf() && p.mega) {  // out 0 (quantised: e4m3 zeros, the exponent of an all-zero group), lse +inf
    float zero[4][4];
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) zero[j][e] = 0.f;
    store_mega_row(zero, lane, p.out_fp8 + orow * kHeadDim, p.out_scale + orow * kOutScales,
                   mega_cs_row(p, (int64_t)req * p.s_q + s));
    if (lane == 0) p.lse[orow] = finf();
    return;
  }
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
  const float* oa = p.o_accum + (((int64_t)first * p.s_q + s) * p.h_q + head) * kHeadDim + 4 * lane;
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
  if (p.mega) {
    store_mega_row(acc, lane, p.out_fp8 + orow * kHeadDim, p.out_scale + orow * kOutScales,
                   mega_cs_row(p, (int64_t)req * p.s_q + s));
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      uint32_t* o = reinterpret_cast<uint32_t*>(out + 4 * lane + 128 * j);
      o[0] = pack_bf16x2(acc[j][0], acc[j][1]);
      o[1] = pack_bf16x2(acc[j][2], acc[j][3]);
    }
  }
  if (lane == 0) p.lse[orow] = gl * kLn2;
}

}  // namespace dsv41
