// Argument checking and kernel-parameter building, shared by the XLA FFI handlers (ffi.cu)
// and the host emulator (tests/cuda_emulator/emu_main.cc): both hand in plain tensor views, so the CPU tests
// exercise exactly the checks the GPU path runs. Every failed check returns a message naming
// the argument, the expected and the actual value; success returns "".
#pragma once

#include <stdint.h>

#include <sstream>
#include <string>

#include "params.h"

namespace dsv41 {

enum class DType : int32_t { kOther = 0, kBF16 = 1, kU8 = 2, kS32 = 3, kF32 = 4, kF16 = 5 };

inline const char* dtype_name(DType d) {
  switch (d) {
    case DType::kBF16: return "bfloat16";
    case DType::kU8: return "uint8";
    case DType::kS32: return "int32";
    case DType::kF32: return "float32";
    case DType::kF16: return "float16";
    default: return "another dtype";
  }
}

struct TensorView {
  void* data;
  int64_t dims[8];
  int32_t rank;
  int32_t dtype;  // DType
};

inline std::string shape_str(const TensorView& t) {
  std::ostringstream os;
  os << "[";
  for (int i = 0; i < t.rank; ++i) os << (i ? ", " : "") << t.dims[i];
  os << "]";
  return os.str();
}

template <class... Ts>
inline std::string cat(const Ts&... xs) {
  std::ostringstream os;
  (os << ... << xs);
  return os.str();
}

inline std::string expect(const char* name, const TensorView& t, DType dtype, int rank) {
  if (t.rank < 0 || t.rank > 8) return cat(name, ": unsupported rank ", t.rank);
  if ((DType)t.dtype != dtype)
    return cat(name, ": expected dtype ", dtype_name(dtype), ", got ", dtype_name((DType)t.dtype), " (shape ",
               shape_str(t), ")");
  if (t.rank != rank) return cat(name, ": expected rank ", rank, ", got rank ", t.rank, " (shape ", shape_str(t), ")");
  for (int i = 0; i < t.rank; ++i)
    if (t.dims[i] < 0) return cat(name, ": negative dimension in shape ", shape_str(t));
  return "";
}

inline std::string expect_dims(const char* name, const TensorView& t, std::initializer_list<int64_t> want) {
  int i = 0;
  bool ok = (int)want.size() == t.rank;
  for (int64_t w : want) {
    if (ok && w >= 0 && t.dims[i] != w) ok = false;
    ++i;
  }
  if (ok) return "";
  std::ostringstream os;
  os << name << ": expected shape [";
  i = 0;
  for (int64_t w : want) {
    os << (i++ ? ", " : "");
    if (w >= 0) os << w; else os << "*";
  }
  os << "], got " << shape_str(t);
  return os.str();
}

// Bytes of one page of a quantized format: P records, padded to a multiple of the format's page unit.
inline int64_t page_align(int64_t fmt) { return fmt == kFmtFp8DsMla ? kFp8TokenData : kV41PageAlign; }
inline int64_t quant_page_bytes(int64_t fmt, int64_t block_size) {
  const int64_t a = page_align(fmt), rec = token_data_bytes((int32_t)fmt) + token_scale_bytes((int32_t)fmt);
  return (block_size * rec + a - 1) / a * a;
}
inline const char* format_name(int64_t fmt) {
  return fmt == kFmtBf16 ? "bf16" : fmt == kFmtFp8DsMla ? "fp8_ds_mla" : fmt == kFmtMxfp8DsMla ? "mxfp8_ds_mla"
                                                                     : fmt == kFmtNvfp4DsMla ? "nvfp4_ds_mla" : "?";
}

constexpr int64_t kMaxI32 = 2147483647;
// sum_i(blocks(i) + overhead) with every request at its longest; *request_cost: the most of one request.
inline int64_t plan_worst_cost(int64_t b, int64_t topk, int64_t extra_topk, bool has_extra, int64_t overhead,
                               int64_t* request_cost) {
  const int64_t t = topk > 1 ? topk : 1;
  const int64_t len = has_extra ? (t + 63) / 64 * 64 + extra_topk : t;
  const int64_t one = (len + 63) / 64 + overhead;
  *request_cost = std::max(*request_cost, one);
  return b * one;
}

// The split planner's positions (kernels.cuh, plan_warp and plan_cta) reach twice the plan's total cost
// sum_i(blocks(i) + overhead) in int32: bound it by every request at its longest.
inline std::string check_plan_cost(int64_t b, int64_t topk, int64_t extra_topk, bool has_extra, int64_t overhead) {
  int64_t one = 0;
  const int64_t worst = plan_worst_cost(b, topk, extra_topk, has_extra, overhead, &one);
  if (worst >= (int64_t)1 << 30)
    return cat("split plan too large: b * (blocks per request + ", overhead, ") = ", worst,
               " blocks may reach 2^30 (b = ", b, ", topk = ", topk, ", extra topk = ", extra_topk, ")");
  return "";
}

// Shared memory of the CTA planner (kernels.cuh, plan_cta) over b requests, `parts` parts and costs up to
// `table`, or 0 where the warp planner runs instead: tables past kPlanSmemMax, or a request cost its uint16
// delta table cannot hold.
inline int32_t plan_smem_bytes(int64_t b, int64_t parts, int64_t table, int64_t request_cost) {
  if (request_cost >= (int64_t)1 << 16) return 0;
  const int64_t bytes = 4 * ((b + 1) + 3 * (parts + 1) + 32) + 8 * (table + 1);
  return bytes <= kPlanSmemMax ? (int32_t)((bytes + 15) / 16 * 16) : 0;
}

// A paged cache + its indices. `which` is "kv_cache" or "extra_kv_cache".
inline std::string make_pool(const char* which, const char* idx_name, const TensorView& cache, const TensorView& idx,
                             int64_t fmt, int64_t block_size, int64_t b, int64_t s_q, Pool* pool) {
  std::string e;
  if (fmt != kFmtBf16 && fmt != kFmtFp8DsMla && fmt != kFmtMxfp8DsMla && fmt != kFmtNvfp4DsMla)
    return cat(which, " format: expected 0 (bf16), 1 (fp8_ds_mla), 3 (mxfp8_ds_mla) or 4 (nvfp4_ds_mla), got ", fmt);
  if (block_size < 1 || block_size > (1 << 20)) return cat(which, " block_size: expected 1..1048576, got ", block_size);
  int64_t num_blocks, page_bytes;
  if (fmt == kFmtBf16) {
    if (!(e = expect(which, cache, DType::kBF16, 3)).empty()) return e + " (bf16 caches are [num_blocks, block_size, 512])";
    if (!(e = expect_dims(which, cache, {-1, block_size, kHeadDim})).empty()) return e;
    num_blocks = cache.dims[0];
    page_bytes = block_size * kHeadDim * 2;
  } else {
    const char* name = format_name(fmt);
    if (!(e = expect(which, cache, DType::kU8, 2)).empty())
      return e + cat(" (", name, " caches are uint8 [num_blocks, page_bytes])");
    page_bytes = quant_page_bytes(fmt, block_size);
    if (!(e = expect_dims(which, cache, {-1, page_bytes})).empty())
      return e + cat(" (", name, " page_bytes = ceil(", block_size, " * ",
                     token_data_bytes((int32_t)fmt) + token_scale_bytes((int32_t)fmt), " / ", page_align(fmt), ") * ",
                     page_align(fmt), " for block_size ", block_size, ")");
    num_blocks = cache.dims[0];
  }
  if (!(e = expect(idx_name, idx, DType::kS32, 3)).empty()) return e;
  if (!(e = expect_dims(idx_name, idx, {b, s_q, -1})).empty()) return e;
  if (idx.dims[2] < 1 || idx.dims[2] > kMaxI32) return cat(idx_name, ": expected topk in [1, 2^31), got ", idx.dims[2]);
  pool->base = static_cast<const uint8_t*>(cache.data);
  pool->page_bytes = page_bytes;
  pool->capacity = num_blocks * block_size;
  pool->indices = static_cast<const int32_t*>(idx.data);
  pool->lengths = nullptr;  // (set by the caller, with lengths_stride)
  pool->lengths_stride = 1;
  pool->block_size = (int32_t)block_size;
  pool->fmt = (int32_t)fmt;
  pool->topk = (int32_t)idx.dims[2];
  return "";
}

// A per-row int32 input (topk_length, extra_topk_length): shape [rows], or [1]: one length for every row
// (stride 0). Returns "" and sets *ptr, *stride.
inline std::string row_lengths(const char* name, const TensorView& t, int64_t rows, const int32_t** ptr,
                               int32_t* stride) {
  std::string e;
  if (!(e = expect(name, t, DType::kS32, 1)).empty()) return e;
  if (t.dims[0] != rows && t.dims[0] != 1)
    return cat(name, ": expected shape [", rows, "] (one per row) or [1] (one for every row), got ", shape_str(t));
  *ptr = static_cast<const int32_t*>(t.data);
  *stride = t.dims[0] == rows ? 1 : 0;
  return "";
}

// Decode: q [b, s_q, h, 512] bf16 (h <= 32: the narrow CTA, heads as they are; else h % 64 == 0),
// kv_cache, indices [b, s_q, topk] int32, topk_length [b] int32 (or [1]: one for all), attn_sink [h] f32
// (or [0]: no sink), the split plan tile_scheduler_metadata [num_parts, 8] int32 and num_splits [b + 1]
// int32 (dsv41_jax.scheduler), extra_* (ignored when has_extra == 0; extra_topk_length may be [1]); results
// out [b, s_q, h, 512] bf16, lse [b, s_q, h] f32, o_accum [slots, s_q, h, 512] f32 and lse_accum [slots,
// s_q, h] f32 with slots = b + num_parts, or 1 for a plan without split-KV (no combine runs).
// Head groups 2k and 2k + 1 of one query row attend to the same tokens: with an even number of
// groups their decode CTAs run as 2-CTA clusters that split every tile's gather (kernels.cuh). The
// pair's hand-off costs more than the halved gather saves where the plan's parts hold about one tile:
// so a plan with split-KV pairs only where its requests' blocks at full lengths (b x tiles_per_row,
// per query token and head group) reach two per part (b = 2 at h 128 is below; docs/cuda_kernels.md,
// section 3). A plan without split-KV (slots 1: batch-invariant) always pairs, so that a request's
// result never depends on the batch beside it.
inline int32_t pair_groups(int64_t num_groups, int64_t b, int64_t tiles_per_row, int64_t parts, int64_t slots) {
  if (num_groups % 2 != 0) return 0;
  return slots == 1 || b * tiles_per_row >= 2 * parts ? 1 : 0;
}

// The mega decode's extra operands (DecodeParams::mega): positions int32 [b, s_q], cos_sin f32 [max_pos, 64] and the
// result out_scale uint8 [b, s_q, h_q, 16] (out is then uint8 [b, s_q, h_q, 512], the e4m3 bytes). Its
// accumulators always have b + num_parts slots (the combine finishes requests of one piece too, mega.cuh), so
// whether the plan is batch-invariant comes as a flag.
struct MegaArgs {
  TensorView positions, cos_sin, out_scale;
  int64_t batch_invariant;
};

// The cos / sin table of a mega op: f32 [max_pos, 64], 1 <= max_pos < 2^31.
inline std::string check_rope_table(const TensorView& cs) {
  std::string e;
  if (!(e = expect("cos_sin_cache", cs, DType::kF32, 2)).empty()) return e;
  if (!(e = expect_dims("cos_sin_cache", cs, {-1, kRopeDim})).empty()) return e;
  if (cs.dims[0] < 1 || cs.dims[0] > kMaxI32)
    return cat("cos_sin_cache: expected 1 .. 2^31 - 1 positions, got shape ", shape_str(cs));
  return "";
}

// mega: nullptr for the plain decode.
inline std::string make_decode_params(const TensorView* in /*10*/, const TensorView* out /*4*/, float softmax_scale,
                                      int64_t kv_format, int64_t block_size, int64_t has_extra,
                                      int64_t extra_kv_format, int64_t extra_block_size, DecodeParams* p,
                                      const MegaArgs* mega = nullptr) {
  const TensorView &q = in[0], &kv = in[1], &idx = in[2], &tl = in[3], &sink = in[4], &sched = in[5],
                   &nsplit = in[6], &ekv = in[7], &eidx = in[8], &etl = in[9];
  std::string e;
  if (!(e = expect("q", q, DType::kBF16, 4)).empty()) return e;
  const int64_t b = q.dims[0], s_q = q.dims[1], h = q.dims[2];
  if (q.dims[3] != kHeadDim) return cat("q: expected head dim ", kHeadDim, ", got shape ", shape_str(q));
  // narrow.cuh's CTA up to kNarrowMaxHeads heads, else 64-head groups, a last partial one completed with zero Q
  // rows in the kernel: q's heads as they are either way
  const bool narrow = h >= 1 && h <= kNarrowMaxHeads;
  if (h < 1) return cat("q: expected at least one head, got shape ", shape_str(q));
  if (b < 1 || s_q < 1) return cat("q: expected b >= 1 and s_q >= 1, got shape ", shape_str(q));
  if (b >= kMaxI32 / 2 || s_q > 65535 * 64 || h > (1 << 20)) return cat("q: shape too large: ", shape_str(q));
  if (!(softmax_scale == softmax_scale) || softmax_scale == 1.0f / 0.0f || softmax_scale == -1.0f / 0.0f)
    return cat("softmax_scale: expected a finite float, got ", softmax_scale);
  if (has_extra != 0 && has_extra != 1) return cat("has_extra: expected 0 or 1, got ", has_extra);
  if (!(e = make_pool("kv_cache", "indices", kv, idx, kv_format, block_size, b, s_q, &p->main)).empty()) return e;
  if (!(e = row_lengths("topk_length", tl, b, &p->main.lengths, &p->main.lengths_stride)).empty()) return e;
  if (has_extra) {
    if (!(e = make_pool("extra_kv_cache", "extra_indices", ekv, eidx, extra_kv_format, extra_block_size, b, s_q,
                        &p->extra))
             .empty())
      return e;
    if (!(e = row_lengths("extra_topk_length", etl, b, &p->extra.lengths, &p->extra.lengths_stride)).empty())
      return e;
    if (v41_format(p->main.fmt) != v41_format(p->extra.fmt))
      return cat("kv_cache / extra_kv_cache formats: ", format_name(p->main.fmt), " next to ",
                 format_name(p->extra.fmt),
                 " is not supported (a decode kernel reads bf16 / fp8_ds_mla pools or mxfp8_ds_mla / nvfp4_ds_mla pools)");
  } else {
    p->extra = p->main;
  }
  if (!(e = expect("attn_sink", sink, DType::kF32, 1)).empty()) return e;
  if (sink.dims[0] != 0 && !(e = expect_dims("attn_sink", sink, {h})).empty()) return e + " (or [0]: no sink)";
  if (!(e = expect("tile_scheduler_metadata", sched, DType::kS32, 2)).empty()) return e;
  if (!(e = expect_dims("tile_scheduler_metadata", sched, {-1, 8})).empty()) return e;
  const int64_t parts = sched.dims[0];
  if (parts < 1 || parts > 65535) return cat("tile_scheduler_metadata: expected 1..65535 parts, got ", parts);
  if (!(e = expect("num_splits", nsplit, DType::kS32, 1)).empty()) return e;
  if (!(e = expect_dims("num_splits", nsplit, {b + 1})).empty()) return e;
  if (!(e = expect("out", out[0], mega ? DType::kU8 : DType::kBF16, 4)).empty()) return e;
  if (!(e = expect_dims("out", out[0], {b, s_q, h, kHeadDim})).empty()) return e;
  if (!(e = expect("lse", out[1], DType::kF32, 3)).empty()) return e;
  if (!(e = expect_dims("lse", out[1], {b, s_q, h})).empty()) return e;
  if (!(e = expect("o_accum", out[2], DType::kF32, 4)).empty()) return e;
  const int64_t slots = out[2].dims[0];
  if (mega && slots != b + parts)
    return cat("o_accum: expected ", b + parts, " slots (b + num_parts; a mega decode), got shape ", shape_str(out[2]));
  if (slots != 1 && slots != b + parts)
    return cat("o_accum: expected ", b + parts, " slots (b + num_parts) or 1 (a plan without split-KV), got shape ",
               shape_str(out[2]));
  if (mega) {
    if (!(e = expect("positions", mega->positions, DType::kS32, 2)).empty()) return e;
    if (!(e = expect_dims("positions", mega->positions, {b, s_q})).empty()) return e;
    if (!(e = check_rope_table(mega->cos_sin)).empty()) return e;
    if (!(e = expect("out_scale", mega->out_scale, DType::kU8, 4)).empty()) return e;
    if (!(e = expect_dims("out_scale", mega->out_scale, {b, s_q, h, kOutScales})).empty()) return e;
    if (mega->batch_invariant != 0 && mega->batch_invariant != 1)
      return cat("batch_invariant: expected 0 or 1, got ", mega->batch_invariant);
  }
  if (!(e = expect_dims("o_accum", out[2], {slots, s_q, h, kHeadDim})).empty()) return e;
  if (!(e = expect("lse_accum", out[3], DType::kF32, 3)).empty()) return e;
  if (!(e = expect_dims("lse_accum", out[3], {slots, s_q, h})).empty()) return e + " (as o_accum)";
  const int64_t groups = narrow ? 1 : (h + kHeadsPerCta - 1) / kHeadsPerCta;
  const int64_t grid = groups * s_q * parts;
  if (grid > kMaxI32) return cat("decode grid too large: ", grid, " CTAs (head groups * s_q * num_parts)");
  if (b * s_q * ((h + 7) / 8) > kMaxI32) return cat("combine grid too large for q shape ", shape_str(q));
  p->q = static_cast<const uint16_t*>(q.data);
  p->sink = sink.dims[0] ? static_cast<const float*>(sink.data) : nullptr;
  p->sched = static_cast<const int32_t*>(sched.data);
  p->num_splits = static_cast<const int32_t*>(nsplit.data);
  p->out = mega ? nullptr : static_cast<uint16_t*>(out[0].data);
  p->lse = static_cast<float*>(out[1].data);
  p->o_accum = static_cast<float*>(out[2].data);
  p->lse_accum = static_cast<float*>(out[3].data);
  p->scale_log2 = softmax_scale * 1.4426950408889634f;
  p->b = (int32_t)b;
  p->s_q = (int32_t)s_q;
  p->h_q = (int32_t)h;
  p->h_pad = narrow ? (h <= 16 ? 16 : kNarrowMaxHeads) : (int32_t)(groups * kHeadsPerCta);
  p->num_groups = (int32_t)groups;
  p->num_parts = (int32_t)parts;
  p->has_extra = (int32_t)has_extra;
  const int64_t tiles_per_row = (p->main.topk + kTileTokens - 1) / kTileTokens +
                                 (has_extra ? (p->extra.topk + kTileTokens - 1) / kTileTokens : 0);
  p->pair = narrow ? 0 : pair_groups(p->num_groups, b, tiles_per_row, parts, mega && mega->batch_invariant ? 1 : slots);
  p->num_slots = (int32_t)slots;
  p->no_split = slots == 1 || (mega && mega->batch_invariant) ? 1 : 0;
  if (mega) {
    p->mega = 1;
    p->positions = static_cast<const int32_t*>(mega->positions.data);
    p->cos_sin = static_cast<const float*>(mega->cos_sin.data);
    p->max_pos = (int32_t)mega->cos_sin.dims[0];
    p->out_fp8 = static_cast<uint8_t*>(out[0].data);
    p->out_scale = static_cast<uint8_t*>(mega->out_scale.data);
  }
  return "";
}

// The split planner over `count` plans of the same requests: topk_length [b] int32 (or [1]: one length for
// every request), extra_topk_length [count, b] int32 (or [count, 1]); per plan j: extra_topk[j], has_extra[j]
// (lengths are clamped to [0, topk] / [0, extra_topk[j]]); results tile_scheduler_metadata [count, num_parts,
// 8] int32 and num_splits [count, b + 1] int32.
inline std::string make_plan_params(const TensorView& tl, const TensorView& etl, const TensorView& sched,
                                    const TensorView& nsplit, int64_t topk, const int64_t* extra_topk,
                                    const int64_t* has_extra, int64_t count, int64_t fixed_overhead,
                                    PlanBatch* batch) {
  std::string e;
  if (count < 1 || count > kMaxPlans) return cat("plans: expected 1..", kMaxPlans, " plans, got ", count);
  if (!(e = expect("num_splits", nsplit, DType::kS32, 2)).empty()) return e;
  if (!(e = expect_dims("num_splits", nsplit, {count, -1})).empty()) return e;
  const int64_t b = nsplit.dims[1] - 1;
  if (b < 1 || b >= kMaxI32 / 2) return cat("num_splits: expected [plans, b + 1] with 1 <= b < 2^30, got ", shape_str(nsplit));
  if (!(e = expect("tile_scheduler_metadata", sched, DType::kS32, 3)).empty()) return e;
  if (!(e = expect_dims("tile_scheduler_metadata", sched, {count, -1, 8})).empty()) return e;
  const int64_t parts = sched.dims[1];
  if (parts < 1 || parts > 65535) return cat("tile_scheduler_metadata: expected 1..65535 parts, got ", parts);
  const int32_t* lengths = nullptr;
  int32_t stride = 1;
  if (!(e = row_lengths("topk_length", tl, b, &lengths, &stride)).empty()) return e;
  if (!(e = expect("extra_topk_length", etl, DType::kS32, 2)).empty()) return e;
  if (etl.dims[0] != count || (etl.dims[1] != b && etl.dims[1] != 1))
    return cat("extra_topk_length: expected shape [", count, ", ", b, "] (a row per plan) or [", count,
               ", 1] (one length per plan), got ", shape_str(etl));
  if (topk < 0 || topk > kMaxI32) return cat("topk out of range: ", topk);
  if (fixed_overhead < 0 || fixed_overhead > 1 << 20) return cat("fixed_overhead out of range: ", fixed_overhead);
  *batch = PlanBatch{};
  batch->count = (int32_t)count;
  int64_t table = 0, request_cost = 0;
  for (int64_t j = 0; j < count; ++j) {
    if (has_extra[j] != 0 && has_extra[j] != 1) return cat("has_extra[", j, "]: expected 0 or 1, got ", has_extra[j]);
    if (extra_topk[j] < 0 || extra_topk[j] > kMaxI32) return cat("extra_topk[", j, "] out of range: ", extra_topk[j]);
    if (!(e = check_plan_cost(b, topk, has_extra[j] ? extra_topk[j] : 0, has_extra[j] != 0, fixed_overhead)).empty())
      return e;
    PlanParams& plan = batch->plan[j];
    plan.lengths = lengths;
    plan.lengths_stride = stride;
    plan.extra_lengths = static_cast<const int32_t*>(etl.data) + j * etl.dims[1];
    plan.extra_lengths_stride = etl.dims[1] == b ? 1 : 0;
    plan.sched = static_cast<int32_t*>(sched.data) + j * parts * 8;
    plan.num_splits = static_cast<int32_t*>(nsplit.data) + j * (b + 1);
    plan.b = (int32_t)b;
    plan.num_parts = (int32_t)parts;
    plan.topk = (int32_t)topk;
    plan.extra_topk = (int32_t)extra_topk[j];
    plan.has_extra = (int32_t)has_extra[j];
    plan.fixed_overhead = (int32_t)fixed_overhead;
    table = std::max(table, plan_worst_cost(b, topk, has_extra[j] ? extra_topk[j] : 0, has_extra[j] != 0,
                                            fixed_overhead, &request_cost));
  }
  batch->smem_bytes = plan_smem_bytes(b, parts, table, request_cost);
  return "";
}

// Prefill runs one CTA per head group: for bf16 rows a pair's hand-off costs more than the halved
// gather saves (benchmarks/RESULTS.md), so PrefillParams::pair is always 0.

// Prefill: q [s_q, h_q, 512] bf16 (any h_q >= 1: the CTAs take groups of 64 heads, a last partial group's
// missing heads neither read nor written), kv [s_kv, 512] bf16 or f16, indices [s_q, topk] int32, topk_length
// [s_q] int32 (or [1]: one for all), attn_sink [h_q] f32 (or [0]: no sink); results out [s_q, h_q, 512] bf16,
// max_logits and lse [s_q, h_q] f32.
// The mega prefill's extra operands (PrefillParams::mega): each query token's cos / sin row, f32 [s_q, 64] (the table
// gathered at its position), and the result out_scale uint8 [s_q, h_q, 16] (out is then uint8 [s_q, h_q, 512], the
// e4m3 bytes; max_logits is not a result).
struct MegaPrefillArgs {
  TensorView cos_sin_rows, out_scale;
};

// mega: nullptr for the plain prefill.
inline std::string make_prefill_params(const TensorView* in /*5*/, const TensorView* out /*3*/, float softmax_scale,
                                       PrefillParams* p, const MegaPrefillArgs* mega = nullptr) {
  const TensorView &q = in[0], &kv = in[1], &idx = in[2], &tl = in[3], &sink = in[4];
  std::string e;
  if (!(e = expect("q", q, DType::kBF16, 3)).empty()) return e;
  const int64_t s_q = q.dims[0], h_q = q.dims[1];
  if (q.dims[2] != kHeadDim) return cat("q: expected head dim ", kHeadDim, ", got shape ", shape_str(q));
  if (h_q < 1 || h_q > kMaxI32 - kHeadsPerCta) return cat("q: expected 1 <= h_q < 2^31 - 64, got shape ", shape_str(q));
  const int64_t num_groups = (h_q + kHeadsPerCta - 1) / kHeadsPerCta;
  if (s_q < 1) return cat("q: expected s_q >= 1, got shape ", shape_str(q));
  if (!(softmax_scale == softmax_scale) || softmax_scale == 1.0f / 0.0f || softmax_scale == -1.0f / 0.0f)
    return cat("softmax_scale: expected a finite float, got ", softmax_scale);
  const bool kv_f16 = (DType)kv.dtype == DType::kF16;  // rows converted by the wrapper (seesaw.cuh)
  if (!(e = expect("kv", kv, kv_f16 ? DType::kF16 : DType::kBF16, 2)).empty()) return e + " (or float16)";
  if (!(e = expect_dims("kv", kv, {-1, kHeadDim})).empty()) return e;
  if (!(e = expect("indices", idx, DType::kS32, 2)).empty()) return e;
  if (!(e = expect_dims("indices", idx, {s_q, -1})).empty()) return e;
  if (idx.dims[1] < 1 || idx.dims[1] > kMaxI32) return cat("indices: expected topk in [1, 2^31), got ", idx.dims[1]);
  const int32_t* lengths = nullptr;
  int32_t stride = 1;
  if (!(e = row_lengths("topk_length", tl, s_q, &lengths, &stride)).empty()) return e;
  if (!(e = expect("attn_sink", sink, DType::kF32, 1)).empty()) return e;
  if (sink.dims[0] != 0 && !(e = expect_dims("attn_sink", sink, {h_q})).empty()) return e + " (or [0]: no sink)";
  if (!(e = expect("out", out[0], mega ? DType::kU8 : DType::kBF16, 3)).empty()) return e;
  if (!(e = expect_dims("out", out[0], {s_q, h_q, kHeadDim})).empty()) return e;
  if (mega) {
    if (!(e = expect("cos_sin_rows", mega->cos_sin_rows, DType::kF32, 2)).empty()) return e;
    if (!(e = expect_dims("cos_sin_rows", mega->cos_sin_rows, {s_q, kRopeDim})).empty()) return e;
    if (!(e = expect("out_scale", mega->out_scale, DType::kU8, 3)).empty()) return e;
    if (!(e = expect_dims("out_scale", mega->out_scale, {s_q, h_q, kOutScales})).empty()) return e;
  } else {
    if (!(e = expect("max_logits", out[1], DType::kF32, 2)).empty()) return e;
    if (!(e = expect_dims("max_logits", out[1], {s_q, h_q})).empty()) return e;
  }
  if (!(e = expect("lse", out[2], DType::kF32, 2)).empty()) return e;
  if (!(e = expect_dims("lse", out[2], {s_q, h_q})).empty()) return e;
  const int64_t grid = num_groups * s_q;
  if (grid > kMaxI32) return cat("prefill grid too large: ", grid, " CTAs (ceil(h_q / 64) * s_q)");
  p->q = static_cast<const uint16_t*>(q.data);
  p->sink = sink.dims[0] ? static_cast<const float*>(sink.data) : nullptr;
  p->out = mega ? nullptr : static_cast<uint16_t*>(out[0].data);
  p->max_logits = mega ? nullptr : static_cast<float*>(out[1].data);
  p->lse = static_cast<float*>(out[2].data);
  if (mega) {
    p->mega = 1;
    p->cos_sin = static_cast<const float*>(mega->cos_sin_rows.data);
    p->out_fp8 = static_cast<uint8_t*>(out[0].data);
    p->out_scale = static_cast<uint8_t*>(mega->out_scale.data);
  }
  p->kv.base = static_cast<const uint8_t*>(kv.data);
  p->kv.page_bytes = kHeadDim * 2;
  p->kv.capacity = kv.dims[0];
  p->kv.indices = static_cast<const int32_t*>(idx.data);
  p->kv.lengths = lengths;
  p->kv.lengths_stride = stride;
  p->kv.block_size = 1;
  p->kv.fmt = kv_f16 ? kFmtF16 : kFmtBf16;
  p->kv.topk = (int32_t)idx.dims[1];
  p->scale_log2 = softmax_scale * 1.4426950408889634f;
  p->s_q = (int32_t)s_q;
  p->h_q = (int32_t)h_q;
  p->num_groups = (int32_t)num_groups;
  p->pair = 0;
  return "";
}

}  // namespace dsv41
