// XLA FFI handlers of the dsv41 CUDA kernels (exported C symbols, loaded with ctypes):
//   Dsv41SparseMlaDecode   -> FFI target "dsv41_sparse_mla_decode"
//   Dsv41SparseMlaMegaDecode -> FFI target "dsv41_sparse_mla_mega_decode" (the same kernels, DecodeParams::mega)
//   Dsv41PlanDecodeSplits  -> FFI target "dsv41_plan_decode_splits"
//   Dsv41SparseMlaPrefill  -> FFI target "dsv41_sparse_mla_prefill"
//   Dsv41SparseMlaMegaPrefill -> FFI target "dsv41_sparse_mla_mega_prefill" (the prefill kernels, PrefillParams::mega)
// All are command-buffer compatible: they only enqueue kernels on XLA's stream, allocate nothing
// (the split accumulators are extra results) and never synchronise.
// Decode enqueues the decode kernel over the plan it is given and the combine kernel; the planner
// enqueues one warp per plan (dsv41_jax.scheduler.plan_decode_splits on the device).
#include <cuda_runtime.h>

#include <string>
#include <utility>

#include "host_params.h"
#include "launch.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

dsv41::TensorView view(const ffi::AnyBuffer& b) {
  dsv41::TensorView t{};
  t.data = b.untyped_data();
  auto dims = b.dimensions();
  t.rank = (int32_t)dims.size();
  for (int i = 0; i < t.rank && i < 8; ++i) t.dims[i] = dims[i];
  switch (b.element_type()) {
    case ffi::DataType::BF16: t.dtype = (int32_t)dsv41::DType::kBF16; break;
    case ffi::DataType::F16: t.dtype = (int32_t)dsv41::DType::kF16; break;
    case ffi::DataType::U8: t.dtype = (int32_t)dsv41::DType::kU8; break;
    case ffi::DataType::S32: t.dtype = (int32_t)dsv41::DType::kS32; break;
    case ffi::DataType::F32: t.dtype = (int32_t)dsv41::DType::kF32; break;
    default: t.dtype = (int32_t)dsv41::DType::kOther; break;
  }
  return t;
}

ffi::Error cuda_error(const char* what, cudaError_t e) {
  if (e == cudaErrorInvalidConfiguration)
    return ffi::Error::Internal(std::string(what) + ": the device does not allow " + std::to_string(dsv41::kSmemLaunchBytes) +
                                " bytes of shared memory per block (needs sm_90 / sm_100)");
  return ffi::Error::Internal(std::string(what) + ": " + cudaGetErrorName(e) + ": " + cudaGetErrorString(e));
}

ffi::Error DecodeImpl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer kv, ffi::AnyBuffer indices,
                      ffi::AnyBuffer topk_length, ffi::AnyBuffer attn_sink, ffi::AnyBuffer sched,
                      ffi::AnyBuffer num_splits, ffi::AnyBuffer extra_kv, ffi::AnyBuffer extra_indices,
                      ffi::AnyBuffer extra_topk_length, ffi::Result<ffi::AnyBuffer> out,
                      ffi::Result<ffi::AnyBuffer> lse, ffi::Result<ffi::AnyBuffer> o_accum,
                      ffi::Result<ffi::AnyBuffer> lse_accum, float softmax_scale, int64_t kv_format,
                      int64_t block_size, int64_t has_extra, int64_t extra_kv_format, int64_t extra_block_size) {
  const dsv41::TensorView in[10] = {view(q),         view(kv),         view(indices),       view(topk_length),
                                    view(attn_sink), view(sched),      view(num_splits),    view(extra_kv),
                                    view(extra_indices), view(extra_topk_length)};
  const dsv41::TensorView res[4] = {view(*out), view(*lse), view(*o_accum), view(*lse_accum)};
  dsv41::DecodeParams p{};
  std::string err = dsv41::make_decode_params(in, res, softmax_scale, kv_format, block_size, has_extra,
                                              extra_kv_format, extra_block_size, &p);
  if (!err.empty()) return ffi::Error::InvalidArgument("dsv41_sparse_mla_decode: " + err);
  cudaError_t e = dsv41::launch_decode(p, stream);
  if (e != cudaSuccess) return cuda_error("dsv41_sparse_mla_decode launch", e);
  return ffi::Error::Success();
}

ffi::Error MegaDecodeImpl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer kv, ffi::AnyBuffer indices,
                          ffi::AnyBuffer topk_length, ffi::AnyBuffer attn_sink, ffi::AnyBuffer sched,
                          ffi::AnyBuffer num_splits, ffi::AnyBuffer extra_kv, ffi::AnyBuffer extra_indices,
                          ffi::AnyBuffer extra_topk_length, ffi::AnyBuffer positions, ffi::AnyBuffer cos_sin,
                          ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> out_scale,
                          ffi::Result<ffi::AnyBuffer> lse, ffi::Result<ffi::AnyBuffer> o_accum,
                          ffi::Result<ffi::AnyBuffer> lse_accum, float softmax_scale, int64_t kv_format,
                          int64_t block_size, int64_t has_extra, int64_t extra_kv_format, int64_t extra_block_size,
                          int64_t batch_invariant) {
  const dsv41::TensorView in[10] = {view(q),         view(kv),         view(indices),       view(topk_length),
                                    view(attn_sink), view(sched),      view(num_splits),    view(extra_kv),
                                    view(extra_indices), view(extra_topk_length)};
  const dsv41::TensorView res[4] = {view(*out), view(*lse), view(*o_accum), view(*lse_accum)};
  const dsv41::MegaArgs mega{view(positions), view(cos_sin), view(*out_scale), batch_invariant};
  dsv41::DecodeParams p{};
  std::string err = dsv41::make_decode_params(in, res, softmax_scale, kv_format, block_size, has_extra,
                                              extra_kv_format, extra_block_size, &p, &mega);
  if (!err.empty()) return ffi::Error::InvalidArgument("dsv41_sparse_mla_mega_decode: " + err);
  cudaError_t e = dsv41::launch_decode(p, stream);
  if (e != cudaSuccess) return cuda_error("dsv41_sparse_mla_mega_decode launch", e);
  return ffi::Error::Success();
}

ffi::Error PlanImpl(cudaStream_t stream, ffi::AnyBuffer topk_length, ffi::AnyBuffer extra_topk_length,
                    ffi::Result<ffi::AnyBuffer> sched, ffi::Result<ffi::AnyBuffer> num_splits, int64_t topk,
                    ffi::Span<const int64_t> extra_topk, ffi::Span<const int64_t> has_extra, int64_t fixed_overhead) {
  if (extra_topk.size() != has_extra.size())
    return ffi::Error::InvalidArgument("dsv41_plan_decode_splits: extra_topk and has_extra differ in length");
  dsv41::PlanBatch plans{};
  std::string err = dsv41::make_plan_params(view(topk_length), view(extra_topk_length), view(*sched),
                                            view(*num_splits), topk, extra_topk.begin(), has_extra.begin(),
                                            (int64_t)extra_topk.size(), fixed_overhead, &plans);
  if (!err.empty()) return ffi::Error::InvalidArgument("dsv41_plan_decode_splits: " + err);
  cudaError_t e = dsv41::launch_plans(plans, stream);
  if (e != cudaSuccess) return cuda_error("dsv41_plan_decode_splits launch", e);
  return ffi::Error::Success();
}

ffi::Error PrefillImpl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer kv, ffi::AnyBuffer indices,
                       ffi::AnyBuffer topk_length, ffi::AnyBuffer attn_sink, ffi::Result<ffi::AnyBuffer> out,
                       ffi::Result<ffi::AnyBuffer> max_logits, ffi::Result<ffi::AnyBuffer> lse, float softmax_scale) {
  const dsv41::TensorView in[5] = {view(q), view(kv), view(indices), view(topk_length), view(attn_sink)};
  const dsv41::TensorView res[3] = {view(*out), view(*max_logits), view(*lse)};
  dsv41::PrefillParams p{};
  std::string err = dsv41::make_prefill_params(in, res, softmax_scale, &p);
  if (!err.empty()) return ffi::Error::InvalidArgument("dsv41_sparse_mla_prefill: " + err);
  cudaError_t e = dsv41::launch_prefill(p, stream);
  if (e != cudaSuccess) return cuda_error("dsv41_sparse_mla_prefill launch", e);
  return ffi::Error::Success();
}

ffi::Error MegaPrefillImpl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer kv, ffi::AnyBuffer indices,
                           ffi::AnyBuffer topk_length, ffi::AnyBuffer attn_sink, ffi::AnyBuffer cos_sin_rows,
                           ffi::Result<ffi::AnyBuffer> out,
                           ffi::Result<ffi::AnyBuffer> out_scale, ffi::Result<ffi::AnyBuffer> lse,
                           float softmax_scale) {
  const dsv41::TensorView in[5] = {view(q), view(kv), view(indices), view(topk_length), view(attn_sink)};
  const dsv41::TensorView res[3] = {view(*out), dsv41::TensorView{}, view(*lse)};  // (no max_logits)
  const dsv41::MegaPrefillArgs mega{view(cos_sin_rows), view(*out_scale)};
  dsv41::PrefillParams p{};
  std::string err = dsv41::make_prefill_params(in, res, softmax_scale, &p, &mega);
  if (!err.empty()) return ffi::Error::InvalidArgument("dsv41_sparse_mla_mega_prefill: " + err);
  cudaError_t e = dsv41::launch_prefill(p, stream);
  if (e != cudaSuccess) return cuda_error("dsv41_sparse_mla_mega_prefill launch", e);
  return ffi::Error::Success();
}

// The operands both decode targets begin with (the mega decode's q is not roped) and the attributes they share.
template <class B>
auto decode_args(B&& b) {
  return std::forward<B>(b)
      .template Arg<ffi::AnyBuffer>()   // q
      .template Arg<ffi::AnyBuffer>()   // kv_cache
      .template Arg<ffi::AnyBuffer>()   // indices
      .template Arg<ffi::AnyBuffer>()   // topk_length ([0]: topk)
      .template Arg<ffi::AnyBuffer>()   // attn_sink ([0]: none)
      .template Arg<ffi::AnyBuffer>()   // tile_scheduler_metadata (the split plan)
      .template Arg<ffi::AnyBuffer>()   // num_splits
      .template Arg<ffi::AnyBuffer>()   // extra_kv_cache
      .template Arg<ffi::AnyBuffer>()   // extra_indices
      .template Arg<ffi::AnyBuffer>();  // extra_topk_length ([0]: extra topk)
}
template <class B>
auto decode_attrs(B&& b) {
  return std::forward<B>(b)
      .template Attr<float>("softmax_scale")
      .template Attr<int64_t>("kv_format")
      .template Attr<int64_t>("block_size")
      .template Attr<int64_t>("has_extra")
      .template Attr<int64_t>("extra_kv_format")
      .template Attr<int64_t>("extra_block_size");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(Dsv41SparseMlaDecode, DecodeImpl,
                              decode_attrs(decode_args(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>())
                                               .Ret<ffi::AnyBuffer>()    // out
                                               .Ret<ffi::AnyBuffer>()    // lse
                                               .Ret<ffi::AnyBuffer>()    // o_accum
                                               .Ret<ffi::AnyBuffer>()),  // lse_accum
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(Dsv41SparseMlaMegaDecode, MegaDecodeImpl,
                              decode_attrs(decode_args(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>())
                                               .Arg<ffi::AnyBuffer>()    // positions [b, s_q]
                                               .Arg<ffi::AnyBuffer>()    // cos_sin_cache [max_pos, 64]
                                               .Ret<ffi::AnyBuffer>()    // out (e4m3 bytes)
                                               .Ret<ffi::AnyBuffer>()    // out_scale (UE8M0)
                                               .Ret<ffi::AnyBuffer>()    // lse
                                               .Ret<ffi::AnyBuffer>()    // o_accum
                                               .Ret<ffi::AnyBuffer>())   // lse_accum
                                  .Attr<int64_t>("batch_invariant"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(Dsv41PlanDecodeSplits, PlanImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // topk_length [b] ([0]: topk)
                                  .Arg<ffi::AnyBuffer>()  // extra_topk_length [plans, b] ([plans, 0]: extra topk)
                                  .Ret<ffi::AnyBuffer>()  // tile_scheduler_metadata [plans, parts, 8]
                                  .Ret<ffi::AnyBuffer>()  // num_splits [plans, b + 1]
                                  .Attr<int64_t>("topk")
                                  .Attr<ffi::Span<const int64_t>>("extra_topk")
                                  .Attr<ffi::Span<const int64_t>>("has_extra")
                                  .Attr<int64_t>("fixed_overhead"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(Dsv41SparseMlaPrefill, PrefillImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // q
                                  .Arg<ffi::AnyBuffer>()  // kv
                                  .Arg<ffi::AnyBuffer>()  // indices
                                  .Arg<ffi::AnyBuffer>()  // topk_length
                                  .Arg<ffi::AnyBuffer>()  // attn_sink
                                  .Ret<ffi::AnyBuffer>()  // out
                                  .Ret<ffi::AnyBuffer>()  // max_logits
                                  .Ret<ffi::AnyBuffer>()  // lse
                                  .Attr<float>("softmax_scale"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(Dsv41SparseMlaMegaPrefill, MegaPrefillImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // q (not roped)
                                  .Arg<ffi::AnyBuffer>()  // kv
                                  .Arg<ffi::AnyBuffer>()  // indices
                                  .Arg<ffi::AnyBuffer>()  // topk_length
                                  .Arg<ffi::AnyBuffer>()  // attn_sink
                                  .Arg<ffi::AnyBuffer>()  // cos_sin_rows [s_q, 64] (the table at each position)
                                  .Ret<ffi::AnyBuffer>()  // out (e4m3 bytes)
                                  .Ret<ffi::AnyBuffer>()  // out_scale (UE8M0)
                                  .Ret<ffi::AnyBuffer>()  // lse
                                  .Attr<float>("softmax_scale"),
                              {ffi::Traits::kCmdBufferCompatible});

// Version probe for the Python loader (bumped whenever an FFI signature changes).
extern "C" int dsv41_cuda_abi_version() { return 5; }
