// Argument checking and kernel-parameter building, shared by the XLA FFI handlers (ffi.cu)
// and the host emulator (emu_main.cc): both hand in plain tensor views, so the CPU tests
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

inline int64_t fp8_page_bytes(int64_t block_size) {
  return (block_size * (kFp8TokenData + kFp8TokenScale) + kFp8TokenData - 1) / kFp8TokenData * kFp8TokenData;
}

constexpr int64_t kMaxI32 = 2147483647;
// The split planner's positions (kernels.cuh, plan_warp) reach twice the plan's total cost
// sum_i(blocks(i) + overhead) in int32: bound it by every request at its longest.
inline std::string check_plan_cost(int64_t b, int64_t topk, int64_t extra_topk, bool has_extra, int64_t overhead) {
  const int64_t t = topk > 1 ? topk : 1;
  const int64_t len = has_extra ? (t + 63) / 64 * 64 + extra_topk : t;
  const int64_t worst = b * ((len + 63) / 64 + overhead);
  if (worst >= (int64_t)1 << 30)
    return cat("split plan too large: b * (blocks per request + ", overhead, ") = ", worst,
               " blocks may reach 2^30 (b = ", b, ", topk = ", topk, ", extra topk = ", extra_topk, ")");
  return "";
}

// A paged cache + its indices/lengths. `which` is "kv_cache" or "extra_kv_cache".
inline std::string make_pool(const char* which, const char* idx_name, const char* len_name, const TensorView& cache,
                             const TensorView& idx, const TensorView& len, int64_t fmt, int64_t block_size,
                             int64_t b, int64_t s_q, Pool* pool) {
  std::string e;
  if (fmt != kFmtBf16 && fmt != kFmtFp8DsMla)
    return cat(which, " format: expected 0 (bf16) or 1 (fp8_ds_mla), got ", fmt);
  if (block_size < 1 || block_size > (1 << 20)) return cat(which, " block_size: expected 1..1048576, got ", block_size);
  int64_t num_blocks, page_bytes;
  if (fmt == kFmtBf16) {
    if (!(e = expect(which, cache, DType::kBF16, 3)).empty()) return e + " (bf16 caches are [num_blocks, block_size, 512])";
    if (!(e = expect_dims(which, cache, {-1, block_size, kHeadDim})).empty()) return e;
    num_blocks = cache.dims[0];
    page_bytes = block_size * kHeadDim * 2;
  } else {
    if (!(e = expect(which, cache, DType::kU8, 2)).empty()) return e + " (fp8_ds_mla caches are uint8 [num_blocks, page_bytes])";
    page_bytes = fp8_page_bytes(block_size);
    if (!(e = expect_dims(which, cache, {-1, page_bytes})).empty())
      return e + cat(" (page_bytes = ceil(", block_size, " * 584 / 576) * 576 for block_size ", block_size, ")");
    num_blocks = cache.dims[0];
  }
  if (!(e = expect(idx_name, idx, DType::kS32, 3)).empty()) return e;
  if (!(e = expect_dims(idx_name, idx, {b, s_q, -1})).empty()) return e;
  if (idx.dims[2] < 1 || idx.dims[2] > kMaxI32) return cat(idx_name, ": expected topk in [1, 2^31), got ", idx.dims[2]);
  if (!(e = expect(len_name, len, DType::kS32, 1)).empty()) return e;
  if (!(e = expect_dims(len_name, len, {b})).empty()) return e;
  pool->base = static_cast<const uint8_t*>(cache.data);
  pool->page_bytes = page_bytes;
  pool->capacity = num_blocks * block_size;
  pool->indices = static_cast<const int32_t*>(idx.data);
  pool->lengths = static_cast<const int32_t*>(len.data);
  pool->block_size = (int32_t)block_size;
  pool->fmt = (int32_t)fmt;
  pool->topk = (int32_t)idx.dims[2];
  pool->pad_ = 0;
  return "";
}

// Decode: q [b, s_q, h_pad, 512] bf16 (h_pad % 64 == 0), kv_cache, indices [b, s_q, topk] int32,
// topk_length [b] int32, attn_sink [h_pad] f32, tile_scheduler_metadata_in [num_parts, 8] int32
// and num_splits_in [b + 1] int32 (read only when device_plan == 0; any int32 arrays otherwise),
// extra_* (ignored when has_extra == 0); results out [b, s_q, h_pad, 512] bf16, lse [b, s_q,
// h_pad] f32, o_accum [b + num_parts, s_q, h_pad, 512] f32, lse_accum [b + num_parts, s_q,
// h_pad] f32, tile_scheduler_metadata [num_parts, 8] int32 and num_splits [b + 1] int32 (the
// plan the kernels used: computed on the device, or copied from the inputs). num_parts is the
// first dimension of the tile_scheduler_metadata result.
// Head groups 2k and 2k + 1 of one query row attend to the same tokens: with an even number of
// groups their decode CTAs run as 2-CTA clusters that split every tile's gather (kernels.cuh). The
// DSV41_EXP_NO_PAIR experiment build keeps one CTA per group (timing comparisons).
inline int32_t pair_groups(int64_t num_groups) {
#ifdef DSV41_EXP_NO_PAIR
  (void)num_groups;
  return 0;
#else
  return num_groups % 2 == 0 ? 1 : 0;
#endif
}

inline std::string make_decode_params(const TensorView* in /*10*/, const TensorView* out /*6*/, float softmax_scale,
                                      int64_t kv_format, int64_t block_size, int64_t has_extra,
                                      int64_t extra_kv_format, int64_t extra_block_size, int64_t device_plan,
                                      DecodeParams* p, PlanParams* plan) {
  const TensorView &q = in[0], &kv = in[1], &idx = in[2], &tl = in[3], &sink = in[4], &sched_in = in[5],
                   &nsplit_in = in[6], &ekv = in[7], &eidx = in[8], &etl = in[9];
  const TensorView &sched = out[4], &nsplit = out[5];
  std::string e;
  if (!(e = expect("q", q, DType::kBF16, 4)).empty()) return e;
  const int64_t b = q.dims[0], s_q = q.dims[1], h_pad = q.dims[2];
  if (q.dims[3] != kHeadDim) return cat("q: expected head dim ", kHeadDim, ", got shape ", shape_str(q));
  if (h_pad < kHeadsPerCta || h_pad % kHeadsPerCta)
    return cat("q: expected the head count padded to a positive multiple of ", kHeadsPerCta, ", got shape ", shape_str(q));
  if (b < 1 || s_q < 1) return cat("q: expected b >= 1 and s_q >= 1, got shape ", shape_str(q));
  if (b >= kMaxI32 / 2 || s_q > 65535 * 64 || h_pad > (1 << 20)) return cat("q: shape too large: ", shape_str(q));
  if (!(softmax_scale == softmax_scale) || softmax_scale == 1.0f / 0.0f || softmax_scale == -1.0f / 0.0f)
    return cat("softmax_scale: expected a finite float, got ", softmax_scale);
  if (has_extra != 0 && has_extra != 1) return cat("has_extra: expected 0 or 1, got ", has_extra);
  if (device_plan != 0 && device_plan != 1) return cat("device_plan: expected 0 or 1, got ", device_plan);
  if (!(e = make_pool("kv_cache", "indices", "topk_length", kv, idx, tl, kv_format, block_size, b, s_q, &p->main)).empty())
    return e;
  if (has_extra) {
    if (!(e = make_pool("extra_kv_cache", "extra_indices", "extra_topk_length", ekv, eidx, etl, extra_kv_format,
                        extra_block_size, b, s_q, &p->extra))
             .empty())
      return e;
  } else {
    p->extra = p->main;
  }
  if (!(e = expect("attn_sink", sink, DType::kF32, 1)).empty()) return e;
  if (!(e = expect_dims("attn_sink", sink, {h_pad})).empty()) return e + " (pad with -inf)";
  if (!(e = expect("tile_scheduler_metadata (result)", sched, DType::kS32, 2)).empty()) return e;
  if (!(e = expect_dims("tile_scheduler_metadata (result)", sched, {-1, 8})).empty()) return e;
  const int64_t parts = sched.dims[0];
  if (parts < 1 || parts > 65535) return cat("tile_scheduler_metadata (result): expected 1..65535 parts, got ", parts);
  if (!(e = expect("num_splits (result)", nsplit, DType::kS32, 1)).empty()) return e;
  if (!(e = expect_dims("num_splits (result)", nsplit, {b + 1})).empty()) return e;
  if (!(e = expect("tile_scheduler_metadata", sched_in, DType::kS32, 2)).empty()) return e;
  if (!(e = expect("num_splits", nsplit_in, DType::kS32, 1)).empty()) return e;
  if (!device_plan) {
    if (!(e = expect_dims("tile_scheduler_metadata", sched_in, {parts, 8})).empty()) return e;
    if (!(e = expect_dims("num_splits", nsplit_in, {b + 1})).empty()) return e;
  }
  const int64_t slots = b + parts;
  if (!(e = expect("out", out[0], DType::kBF16, 4)).empty()) return e;
  if (!(e = expect_dims("out", out[0], {b, s_q, h_pad, kHeadDim})).empty()) return e;
  if (!(e = expect("lse", out[1], DType::kF32, 3)).empty()) return e;
  if (!(e = expect_dims("lse", out[1], {b, s_q, h_pad})).empty()) return e;
  if (!(e = expect("o_accum", out[2], DType::kF32, 4)).empty()) return e;
  if (!(e = expect_dims("o_accum", out[2], {slots, s_q, h_pad, kHeadDim})).empty()) return e + " ([b + num_parts, ...])";
  if (!(e = expect("lse_accum", out[3], DType::kF32, 3)).empty()) return e;
  if (!(e = expect_dims("lse_accum", out[3], {slots, s_q, h_pad})).empty()) return e + " ([b + num_parts, ...])";
  const int64_t grid = (h_pad / kHeadsPerCta) * s_q * parts;
  if (grid > kMaxI32) return cat("decode grid too large: ", grid, " CTAs (h_pad/64 * s_q * num_parts)");
  if (b * s_q * (h_pad / 8) > kMaxI32) return cat("combine grid too large for q shape ", shape_str(q));
  p->q = static_cast<const uint16_t*>(q.data);
  p->sink = static_cast<const float*>(sink.data);
  p->sched = static_cast<const int32_t*>(sched.data);
  p->num_splits = static_cast<const int32_t*>(nsplit.data);
  if (!(e = check_plan_cost(b, p->main.topk, has_extra ? p->extra.topk : 0, has_extra, kPlanFixedOverhead)).empty())
    return e;
  plan->lengths = p->main.lengths;
  plan->extra_lengths = has_extra ? p->extra.lengths : p->main.lengths;
  plan->sched = static_cast<int32_t*>(sched.data);
  plan->num_splits = static_cast<int32_t*>(nsplit.data);
  plan->sched_in = static_cast<const int32_t*>(sched_in.data);
  plan->num_splits_in = static_cast<const int32_t*>(nsplit_in.data);
  plan->b = (int32_t)b;
  plan->num_parts = (int32_t)parts;
  plan->topk = p->main.topk;
  plan->extra_topk = has_extra ? p->extra.topk : 0;
  plan->has_extra = (int32_t)has_extra;
  plan->fixed_overhead = kPlanFixedOverhead;
  plan->device_plan = (int32_t)device_plan;
  plan->pad_ = 0;
  p->out = static_cast<uint16_t*>(out[0].data);
  p->lse = static_cast<float*>(out[1].data);
  p->o_accum = static_cast<float*>(out[2].data);
  p->lse_accum = static_cast<float*>(out[3].data);
  p->scale_log2 = softmax_scale * 1.4426950408889634f;
  p->b = (int32_t)b;
  p->s_q = (int32_t)s_q;
  p->h_pad = (int32_t)h_pad;
  p->num_groups = (int32_t)(h_pad / kHeadsPerCta);
  p->num_parts = (int32_t)parts;
  p->has_extra = (int32_t)has_extra;
  p->pair = pair_groups(p->num_groups);
  p->pad_ = 0;
  return "";
}

// The planner alone (emulator tests): topk_length [b] int32, extra_topk_length [b] int32 (when
// has_extra); results tile_scheduler_metadata [num_parts, 8] int32, num_splits [b + 1] int32.
inline std::string make_plan_params(const TensorView& tl, const TensorView& etl, const TensorView& sched,
                                    const TensorView& nsplit, int64_t topk, int64_t extra_topk, int64_t has_extra,
                                    int64_t fixed_overhead, PlanParams* plan) {
  std::string e;
  if (!(e = expect("topk_length", tl, DType::kS32, 1)).empty()) return e;
  const int64_t b = tl.dims[0];
  if (b < 1 || b >= kMaxI32 / 2) return cat("topk_length: expected 1 <= b < 2^30, got shape ", shape_str(tl));
  if (has_extra != 0 && has_extra != 1) return cat("has_extra: expected 0 or 1, got ", has_extra);
  if (has_extra) {
    if (!(e = expect("extra_topk_length", etl, DType::kS32, 1)).empty()) return e;
    if (!(e = expect_dims("extra_topk_length", etl, {b})).empty()) return e;
  }
  if (topk < 0 || topk > kMaxI32 || extra_topk < 0 || extra_topk > kMaxI32) return "topk / extra_topk out of range";
  if (fixed_overhead < 0 || fixed_overhead > 1 << 20) return cat("fixed_overhead out of range: ", fixed_overhead);
  if (!(e = expect("tile_scheduler_metadata", sched, DType::kS32, 2)).empty()) return e;
  if (!(e = expect_dims("tile_scheduler_metadata", sched, {-1, 8})).empty()) return e;
  if (sched.dims[0] < 1 || sched.dims[0] > 65535) return "tile_scheduler_metadata: expected 1..65535 parts";
  if (!(e = expect("num_splits", nsplit, DType::kS32, 1)).empty()) return e;
  if (!(e = expect_dims("num_splits", nsplit, {b + 1})).empty()) return e;
  if (!(e = check_plan_cost(b, topk, has_extra ? extra_topk : 0, has_extra != 0, fixed_overhead)).empty()) return e;
  *plan = PlanParams{};
  plan->lengths = static_cast<const int32_t*>(tl.data);
  plan->extra_lengths = has_extra ? static_cast<const int32_t*>(etl.data) : plan->lengths;
  plan->sched = static_cast<int32_t*>(sched.data);
  plan->num_splits = static_cast<int32_t*>(nsplit.data);
  plan->b = (int32_t)b;
  plan->num_parts = (int32_t)sched.dims[0];
  plan->topk = (int32_t)topk;
  plan->extra_topk = (int32_t)extra_topk;
  plan->has_extra = (int32_t)has_extra;
  plan->fixed_overhead = (int32_t)fixed_overhead;
  plan->device_plan = 1;
  return "";
}

// Prefill pairs (head groups 2k, 2k + 1 of one query token sharing each tile's gather, as decode's):
// the DSV41_EXP_PREFILL_PAIR experiment build only (bf16 rows measured slower paired on 2026-11-30).
inline int32_t prefill_pair_groups(int64_t num_groups) {
#ifdef DSV41_EXP_PREFILL_PAIR
  return pair_groups(num_groups);
#else
  (void)num_groups;
  return 0;
#endif
}

// Prefill: q [s_q, h_pad, 512] bf16, kv [s_kv, 512] bf16 or f16, indices [s_q, topk] int32, topk_length
// [s_q] int32, attn_sink [h_pad] f32; results out [s_q, h_pad, 512] bf16, max_logits and lse
// [s_q, h_pad] f32.
inline std::string make_prefill_params(const TensorView* in /*5*/, const TensorView* out /*3*/, float softmax_scale,
                                       PrefillParams* p) {
  const TensorView &q = in[0], &kv = in[1], &idx = in[2], &tl = in[3], &sink = in[4];
  std::string e;
  if (!(e = expect("q", q, DType::kBF16, 3)).empty()) return e;
  const int64_t s_q = q.dims[0], h_pad = q.dims[1];
  if (q.dims[2] != kHeadDim) return cat("q: expected head dim ", kHeadDim, ", got shape ", shape_str(q));
  if (h_pad < kHeadsPerCta || h_pad % kHeadsPerCta)
    return cat("q: expected the head count padded to a positive multiple of ", kHeadsPerCta, ", got shape ", shape_str(q));
  if (s_q < 1) return cat("q: expected s_q >= 1, got shape ", shape_str(q));
  if (!(softmax_scale == softmax_scale) || softmax_scale == 1.0f / 0.0f || softmax_scale == -1.0f / 0.0f)
    return cat("softmax_scale: expected a finite float, got ", softmax_scale);
  const bool kv_f16 = (DType)kv.dtype == DType::kF16;  // rows converted by the wrapper (seesaw.cuh)
  if (!(e = expect("kv", kv, kv_f16 ? DType::kF16 : DType::kBF16, 2)).empty()) return e + " (or float16)";
  if (!(e = expect_dims("kv", kv, {-1, kHeadDim})).empty()) return e;
  if (!(e = expect("indices", idx, DType::kS32, 2)).empty()) return e;
  if (!(e = expect_dims("indices", idx, {s_q, -1})).empty()) return e;
  if (idx.dims[1] < 1 || idx.dims[1] > kMaxI32) return cat("indices: expected topk in [1, 2^31), got ", idx.dims[1]);
  if (!(e = expect("topk_length", tl, DType::kS32, 1)).empty()) return e;
  if (!(e = expect_dims("topk_length", tl, {s_q})).empty()) return e;
  if (!(e = expect("attn_sink", sink, DType::kF32, 1)).empty()) return e;
  if (!(e = expect_dims("attn_sink", sink, {h_pad})).empty()) return e + " (pad with -inf)";
  if (!(e = expect("out", out[0], DType::kBF16, 3)).empty()) return e;
  if (!(e = expect_dims("out", out[0], {s_q, h_pad, kHeadDim})).empty()) return e;
  if (!(e = expect("max_logits", out[1], DType::kF32, 2)).empty()) return e;
  if (!(e = expect_dims("max_logits", out[1], {s_q, h_pad})).empty()) return e;
  if (!(e = expect("lse", out[2], DType::kF32, 2)).empty()) return e;
  if (!(e = expect_dims("lse", out[2], {s_q, h_pad})).empty()) return e;
  const int64_t grid = (h_pad / kHeadsPerCta) * s_q;
  if (grid > kMaxI32) return cat("prefill grid too large: ", grid, " CTAs (h_pad/64 * s_q)");
  p->q = static_cast<const uint16_t*>(q.data);
  p->sink = static_cast<const float*>(sink.data);
  p->out = static_cast<uint16_t*>(out[0].data);
  p->max_logits = static_cast<float*>(out[1].data);
  p->lse = static_cast<float*>(out[2].data);
  p->kv.base = static_cast<const uint8_t*>(kv.data);
  p->kv.page_bytes = kHeadDim * 2;
  p->kv.capacity = kv.dims[0];
  p->kv.indices = static_cast<const int32_t*>(idx.data);
  p->kv.lengths = static_cast<const int32_t*>(tl.data);
  p->kv.block_size = 1;
  p->kv.fmt = kv_f16 ? kFmtF16 : kFmtBf16;
  p->kv.topk = (int32_t)idx.dims[1];
  p->kv.pad_ = 0;
  p->scale_log2 = softmax_scale * 1.4426950408889634f;
  p->s_q = (int32_t)s_q;
  p->h_pad = (int32_t)h_pad;
  p->num_groups = (int32_t)(h_pad / kHeadsPerCta);
  p->pair = prefill_pair_groups(p->num_groups);
  return "";
}

}  // namespace dsv41
