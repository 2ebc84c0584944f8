// The mega ops' arithmetic (DecodeParams::mega, PrefillParams::mega; dsv41_jax.sparse_mla.api's
// sparse_mla_mega_decode / sparse_mla_mega_prefill): GPT-J RoPE of q's last 64 dims as Q is loaded, and, on the
// output, the inverse RoPE and e4m3 quantisation with one UE8M0 exponent per 32 dims. The epilogues that use it:
// write_final_mega_staged (consumer.cuh: the sm_90a one-CTA and pair decode, and every prefill CTA) and the
// combine (combine_cta.cuh), which finishes every request of the decode kernels without a staged epilogue (the
// narrow CTA, the sm_100a mma.sync build): those write each piece, even a request's only one, to the
// accumulators.
#pragma once

#include "common.cuh"

namespace dsv41 {

DEVFN int32_t clamp_pos(int32_t pos, int32_t max_pos) { return pos < 0 ? 0 : (pos >= max_pos ? max_pos - 1 : pos); }

// cos / sin row of the query row `row` (request * s_q + token) of a mega decode, nullptr otherwise.
DEVFN const float* mega_cs_row(const DecodeParams& p, int64_t row) {
  if (!p.mega) return nullptr;
  return p.cos_sin + (int64_t)clamp_pos(ldg_nc_s32(p.positions + row), p.max_pos) * kRopeDim;
}

// The 64-head decode CTA's mega state in the exchange region, past a pair's address ring: the clamped positions of
// the CTA's first kMegaPositions requests (staged once per CTA, so the next request's cos / sin row can be
// prefetched into L2 a segment ahead without a dependent load), and the current request's cos / sin row (written
// as Q is roped, read by the epilogue's inverse RoPE).
constexpr int kMegaPositions = 256;
constexpr int kSmemMegaPos = kSmemXS + 8192;                      // int32 [kMegaPositions]
constexpr int kSmemMegaCs = kSmemMegaPos + 4 * kMegaPositions;    // f32 [64]
static_assert(kSmemMegaCs + 4 * kRopeDim <= kSmemBytes, "mega state beyond the exchange region");


// Whether the mega epilogue runs in the combine for every request (kernels without the staged epilogue).
DEVFN bool mega_via_combine(const DecodeParams& p) { return p.mega && (!kWgmma || p.h_pad <= kNarrowMaxHeads); }

// The cos / sin of pairs 4j..4j + 3 of the rotated slice (16-byte chunk 56 + j of a q row), from the row's table
// row cs (mega_cs_row).
struct RopeQuad {
  float4 c, s;
};
DEVFN RopeQuad rope_quad(const float* cs, int j) {
  const uint4 c = ldg_nc_v4(cs + 4 * j), s = ldg_nc_v4(cs + kRopeDim / 2 + 4 * j);
  return RopeQuad{make_f4(bits_f32(c.x), bits_f32(c.y), bits_f32(c.z), bits_f32(c.w)),
                  make_f4(bits_f32(s.x), bits_f32(s.y), bits_f32(s.z), bits_f32(s.w))};
}

// RoPE of one 16-byte chunk of q (8 bf16: the pairs of rope_quad r): (a, b) -> (a cos - b sin, a sin + b cos) in
// f32, rounded to bf16 as the reference ropes q (dsv41_jax.rope.apply_rope keeps q's dtype).
DEVFN uint4 rope_q_chunk(uint4 v, const RopeQuad& r) {
  const float c[4] = {r.c.x, r.c.y, r.c.z, r.c.w}, s[4] = {r.s.x, r.s.y, r.s.z, r.s.w};
  uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float a = bf16_lo(w[k]), b = bf16_hi(w[k]);
    w[k] = pack_bf16x2(a * c[k] - b * s[k], a * s[k] + b * c[k]);
  }
  return make_u4(w[0], w[1], w[2], w[3]);
}

// Inverse RoPE of one output pair (dims 2i, 2i + 1 of the rotated slice): (a, b) -> (a cos + b sin, b cos - a sin);
// cs: the row's [cos 32 | sin 32] (global or shared memory).
DEVFN void unrope_pair(float& a, float& b, const float* cs, int i) {
  const float c = cs[i], s = cs[kRopeDim / 2 + i];
  const float x = a * c + b * s, y = b * c - a * s;
  a = x;
  b = y;
}

// The UE8M0 exponent of a 32-dim group of largest magnitude amax: ceil(log2(a / 448)) for a = max(amax, 1e-4)
// (dsv41_jax.sparse_mla.reference.quantize_output_fp8's rule), exactly and without a division. With a = m 2^E,
// m in [1, 2): a <= 448 2^k = 1.75 2^(k + 8) first holds at k = E - 8 when m <= 1.75, else at k = E - 7. The
// rounded quotient fl(a / 448) gives the same exponent: the float after 1.75 2^(k + 8) lies beyond the point where
// the quotient would round down to 2^k. In [-22, 120].
DEVFN int out_exponent(float amax) {
  const uint32_t u = f32_bits(amax > 1e-4f ? amax : 1e-4f);
  return (int)((u >> 23) & 255u) - 127 - 8 + ((u & 0x7fffffu) > 0x600000u ? 1 : 0);
}
// 2^-e for an exponent of out_exponent (a normal f32).
DEVFN float out_inv_scale(int e) { return bits_f32((uint32_t)(127 - e) << 23); }
DEVFN uint32_t out_scale_byte(int e) { return (uint32_t)(e + 127); }

}  // namespace dsv41
