// Parameter records of the dsv41 sparse MLA kernels (plain C structs: shared by the FFI
// handlers, the device launchers and the host emulator).
#pragma once

#include <stdint.h>

namespace dsv41 {

constexpr int kHeadDim = 512;       // latent: 448 NoPE + 64 RoPE; V = the full latent
constexpr int kRopeDim = 64;        // GPT-J pairs (2i, 2i + 1) of the last 64 dims (dsv41_jax.rope)
constexpr int kNopeDim = kHeadDim - kRopeDim;
constexpr int kOutGroup = 32;       // the mega output: one UE8M0 exponent per 32 dims
constexpr int kOutScales = kHeadDim / kOutGroup;
constexpr int kHeadsPerCta = 64;    // heads of one CTA (the JAX wrapper pads h_q to a multiple)
constexpr int kNarrowMaxHeads = 32; // decode heads the narrow CTA takes unpadded (narrow.cuh: 16 or 32 rows)
constexpr int kTileTokens = 64;     // tokens of one K/V tile (and one split-plan block)
constexpr int kConsumerWarps = 8;
constexpr int kProducerWarps = 4;  // one warpgroup: setmaxnreg needs whole warpgroups
constexpr int kThreads = 32 * (kConsumerWarps + kProducerWarps);  // 384
// setmaxnreg only moves registers inside the CTA's launch allocation: __launch_bounds__(384, 1)
// gives every thread 168 (65536 / 384, rounded down to a multiple of 8), so the warpgroups' sum
// must stay <= 3 x 168 = 504 per lane slot, or setmaxnreg.inc waits forever (a hang, not an error:
// the first split-consumer build asked for 128 + 2 x 192 = 512 and hung on the H200).
constexpr int kLaunchRegs = (65536 / kThreads) & ~7;  // 168
static_assert(kLaunchRegs == 168, "the register budgets below assume 384 threads");
constexpr int kProducerRegs = 128;       // symmetric consumers, one CTA: 128 + 2 x 184 = 496
constexpr int kConsumerRegs = 184;
// A pair's producers hold one fp8 token quarter or half a bf16 row (kernels.cuh BatchT<9>) and fit 104
// registers; its split consumers get 200 (warpgroup 0's S and packed P next to O). A spill in the
// producers costs the decode far more than the registers it frees (benchmarks/RESULTS.md).
constexpr int kPairProducerRegs = 104;  // 104 + 2 x 200 = 504
constexpr int kPairConsumerRegs = 200;
constexpr int kSplitProducerRegs = 120;  // split consumers (kernels.cuh consume_tile_split): 120 + 2 x 192
constexpr int kSplitConsumerRegs = 192;
// The f16-row prefill (seesaw.cuh): cp.async producers hold only addresses (72), each consumer keeps
// O (128), S / P in f32 (32) and P packed (16): 72 + 2 x 216 = 504.
constexpr int kSeesawProducerRegs = 72;
constexpr int kSeesawConsumerRegs = 216;
constexpr bool regs_fit(int producer, int consumer) {
  return kProducerWarps * producer + kConsumerWarps * consumer <= (kProducerWarps + kConsumerWarps) * kLaunchRegs;
}
static_assert(regs_fit(kProducerRegs, kConsumerRegs) && regs_fit(kSplitProducerRegs, kSplitConsumerRegs) &&
                  regs_fit(kPairProducerRegs, kPairConsumerRegs) && regs_fit(kSeesawProducerRegs, kSeesawConsumerRegs),
              "setmaxnreg asks for more registers than the launch allocation holds");
constexpr int kCombineThreads = 256;                              // 8 warps, one head each
constexpr int kPlanThreads = 32;                                  // the warp split planner
constexpr int kPlanCtaThreads = 256;                              // the CTA split planner
constexpr int kPlanSmemMax = 192 * 1024;                          // its shared memory at most (host_params.h)
constexpr int kPlanFixedOverhead = 5;                             // FlashMLA's per-request overhead (blocks)

// kFmtF16: prefill's kv rows converted to f16 by the JAX wrapper (seesaw.cuh; no conversion in the kernel).
// The quantized formats (dsv41_jax.kv_cache) are pages of [P x data][P x scales][zero pad].
enum KvFormat : int32_t { kFmtBf16 = 0, kFmtFp8DsMla = 1, kFmtF16 = 2, kFmtMxfp8DsMla = 3, kFmtNvfp4DsMla = 4 };

constexpr int kFp8TokenData = 576;    // fp8_ds_mla: 448 e4m3 + 64 bf16
constexpr int kFp8TokenScale = 8;     // 7 UE8M0 + 1 pad
constexpr int kMxfp8TokenData = 512;  // mxfp8_ds_mla: 512 e4m3
constexpr int kMxfp8TokenScale = 16;  // one UE8M0 per 32 dims
constexpr int kNvfp4TokenData = 256;  // nvfp4_ds_mla: 512 e2m1, dim 2i in the low nibble of byte i
constexpr int kNvfp4TokenScale = 32;  // one e4m3 per 16 dims
constexpr int kV41PageAlign = 512;    // mxfp8 / nvfp4 pages are padded to a multiple of this

// Per-token data and scale bytes of a quantized pool format (0 for bf16 / f16 rows).
#if defined(__CUDACC__)
#define DSV41_HD __host__ __device__
#else
#define DSV41_HD
#endif
DSV41_HD constexpr int32_t token_data_bytes(int32_t fmt) {
  return fmt == kFmtFp8DsMla ? kFp8TokenData : fmt == kFmtMxfp8DsMla ? kMxfp8TokenData
                                            : fmt == kFmtNvfp4DsMla ? kNvfp4TokenData : 0;
}
DSV41_HD constexpr int32_t token_scale_bytes(int32_t fmt) {
  return fmt == kFmtFp8DsMla ? kFp8TokenScale : fmt == kFmtMxfp8DsMla ? kMxfp8TokenScale
                                             : fmt == kFmtNvfp4DsMla ? kNvfp4TokenScale : 0;
}
DSV41_HD constexpr bool v41_format(int32_t fmt) { return fmt == kFmtMxfp8DsMla || fmt == kFmtNvfp4DsMla; }
// The format families of the decode kernels: each kernel carries the gather and dequantisation code of one family
// only (one producer body for three formats spills the one-CTA decode's producer registers).
constexpr int kFamV4 = 0;   // bf16, fp8_ds_mla
constexpr int kFamV41 = 1;  // mxfp8_ds_mla, nvfp4_ds_mla

// One token pool read by global slot `block * block_size + offset`.
struct Pool {
  const uint8_t* base;     // cache bytes (bf16 [nb, P, 512] or uint8 [nb, page_bytes])
  int64_t page_bytes;      // bytes per page
  int64_t capacity;        // slots: num_blocks * block_size (bf16 prefill: s_kv)
  const int32_t* indices;  // int32 [rows, topk] (decode rows = b * s_q)
  const int32_t* lengths;  // int32 [b] (decode, per request) or [s_q] (prefill), clamped to [0, topk] on use
  int32_t block_size;
  int32_t fmt;             // KvFormat
  int32_t topk;            // row length of `indices`
  int32_t lengths_stride;  // 1, or 0: lengths[0] for every row
};

struct DecodeParams {
  const uint16_t* q;         // bf16 [b, s_q, h_q, 512]
  const float* sink;         // f32 [h_q], natural log; nullptr: no sink (-inf)
  const int32_t* sched;      // int32 [num_parts, 8] (dsv41_jax.scheduler.plan_decode_splits)
  const int32_t* num_splits; // int32 [b + 1]
  uint16_t* out;             // bf16 [b, s_q, h_q, 512]
  float* lse;                // f32 [b, s_q, h_q]
  float* o_accum;            // f32 [num_slots, s_q, h_q, 512] (num_slots = b + num_parts, or 1: no split-KV)
  float* lse_accum;          // f32 [num_slots, s_q, h_q] (log2 domain)
  Pool main;
  Pool extra;
  float scale_log2;          // softmax_scale * log2(e)
  // h_q: the heads of q, out, lse and the accumulators (their row stride); h_pad: the heads the CTAs compute
  // (num_groups x 64; or the narrow CTA's 16 / 32 rows), h_q <= h_pad, rows past h_q neither read nor written
  int32_t b, s_q, h_q, h_pad, num_groups, num_parts, has_extra;
  int32_t pair;              // 1: CTAs of head groups 2k, 2k+1 run as a 2-CTA cluster sharing the gather
  int32_t num_slots;         // accumulator slots; a piece whose slot lies past them is never written or read
  // The mega decode (mega = 1; mega.cuh): q is not roped (the kernel ropes its last 64 dims at the row's
  // position), the output is inverse-roped and stored as e4m3 with one UE8M0 exponent per 32 dims; out and the
  // bf16 output are unused then.
  int32_t mega;
  int32_t no_split;          // the plan has no split-KV (batch-invariant): a staged mega epilogue needs no combine
  const int32_t* positions;  // int32 [b * s_q] (clamped to [0, max_pos) on use)
  const float* cos_sin;      // f32 [max_pos, 64]: [cos 32 | sin 32] per position
  int32_t max_pos;
  uint8_t* out_fp8;          // e4m3 [b, s_q, h_q, 512]
  uint8_t* out_scale;        // UE8M0 [b, s_q, h_q, 16]
};
// The family of the decode kernel that reads p's pools (make_decode_params refuses a pool of each family).
DSV41_HD constexpr int decode_family(const DecodeParams& p) {
  return v41_format(p.main.fmt) || (p.has_extra && v41_format(p.extra.fmt)) ? kFamV41 : kFamV4;
}

// The decode split planner (dsv41_jax.scheduler.plan_decode_splits, run on the device), one plan.
struct PlanParams {
  const int32_t* lengths;        // int32 [b] main lengths (clamped to [0, topk] here)
  const int32_t* extra_lengths;  // int32 [b] (has_extra)
  int32_t* sched;                // int32 [num_parts, 8]
  int32_t* num_splits;           // int32 [b + 1]
  int32_t b, num_parts, topk, extra_topk, has_extra, fixed_overhead;
  int32_t lengths_stride, extra_lengths_stride;  // 1, or 0: element 0 for every request
};

// Several plans over the same requests and part count, one CTA each: the split plans of a step's layer
// types in one launch. smem_bytes > 0: the CTA planner with that much shared memory; 0: the warp planner
// (a cost table that does not fit, or a request of 2^16 blocks or more).
constexpr int kMaxPlans = 8;
struct PlanBatch {
  PlanParams plan[kMaxPlans];
  int32_t count, smem_bytes;
};

struct PrefillParams {
  const uint16_t* q;   // bf16 [s_q, h_q, 512]
  const float* sink;   // f32 [h_q]
  uint16_t* out;       // bf16 [s_q, h_q, 512]
  float* max_logits;   // f32 [s_q, h_q]
  float* lse;          // f32 [s_q, h_q]
  Pool kv;             // bf16 (or f16: fmt kFmtF16) rows: capacity = s_kv, lengths per query token
  float scale_log2;
  // h_q: the heads of q and the results (their row stride); the CTAs compute num_groups = ceil(h_q / 64)
  // groups of 64, a last partial group's missing heads as zero Q rows that are never read nor written
  int32_t s_q, h_q, num_groups;
  int32_t pair;  // 1: CTAs of head groups 2k, 2k+1 (the same query token) as a 2-CTA cluster sharing the gather
  // The mega prefill (mega = 1; mega.cuh), as DecodeParams' mega fields: q is not roped, the output is
  // inverse-roped e4m3 with UE8M0 exponents; out and max_logits are unused then. The cos / sin rows come gathered
  // by position (one per query token, cuda_ffi/ops.py), so a CTA reads its row with no dependent load: a CTA is one
  // query token, and a position-then-row chain at its start was one exposed memory latency per CTA.
  int32_t mega;
  const float* cos_sin;      // f32 [s_q, 64]: query s's [cos 32 | sin 32]
  uint8_t* out_fp8;          // e4m3 [s_q, h_q, 512]
  uint8_t* out_scale;        // UE8M0 [s_q, h_q, 16]
};

// Shared-memory map of the attention CTA (bytes from a 1024-aligned base). Q, the K/V tiles and P
// are f16 in the 128-byte-swizzled layout wgmma reads (primitives.cuh): a [rows][512] matrix is 8
// column blocks of 64 dims, block j = [rows][128 B] at j * rows * 128, chunk c of a row at c ^ (row & 7).
constexpr int kTileBytes = kTileTokens * kHeadDim * 2;                 // 65536: one K/V tile
constexpr int kSmemQ = 0;                                              // f16 [64 heads][512]
constexpr int kSmemK = kSmemQ + kHeadsPerCta * kHeadDim * 2;           // f16 [2 buffers][64 tokens][512]
constexpr int kSmemP = kSmemK + 2 * kTileBytes;                        // f16 [2 buffers][64 heads][64 tokens]
constexpr int kSmemPBytes = kHeadsPerCta * kTileTokens * 2;
constexpr int kSmemRowMax = kSmemP + 2 * kSmemPBytes;                  // f32 [2][64]
constexpr int kSmemAlpha = kSmemRowMax + 2 * 64 * 4;                   // f32 [64] (mma.sync consumers)
constexpr int kSmemLsum = kSmemAlpha + 64 * 4;                         // f32 [2][64]
constexpr int kSmemMfin = kSmemLsum + 2 * 64 * 4;                      // f32 [64]
constexpr int kSmemMtrue = kSmemMfin + 64 * 4;                         // f32 [64] running maxima (max_logits)
constexpr int kSmemValid = kSmemMtrue + 64 * 4;                        // u32 [2 buffers][8]: bit j of word i = token 8i+j
constexpr int kSmemBars = kSmemValid + 64;                             // u64 mbarriers (pairs): PFULL[2], PEMPTY[2]
constexpr int kSmemXS = kSmemBars + 32;                                // 16 KB exchange region: a pair's address ring
                                                                       // (kernels.cuh AddrGen), seesaw.cuh's flags
constexpr int kSmemBytes = kSmemXS + 2 * 4 * 128 * 16;                 // 231264
constexpr int kSmemAlign = 1024;                                       // swizzle atoms
constexpr int kSmemLaunchBytes = kSmemBytes + kSmemAlign;              // dynamic bytes requested
static_assert(kSmemLaunchBytes <= 227 * 1024, "attention CTA shared memory exceeds the sm_90 limit");

}  // namespace dsv41
