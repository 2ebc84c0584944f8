// Sparse MLA decode over a paged KV cache + split combine (device build of kernels.cuh).
#include "kernels.cuh"
#include "launch.h"

namespace dsv41 {

// kPair: head groups 2k, 2k + 1 as 2-CTA clusters (kernels.cuh, "crew"); kFam: the cache formats read (producer.cuh);
// kMega: the mega decode (mega.cuh).
template <bool kPair, int kFam, bool kMega>
__global__ void __launch_bounds__(kThreads, 1) dsv41_decode_kernel(const __grid_constant__ DecodeParams p) {
  extern __shared__ __align__(128) char smem[];
  decode_cta<kPair, kFam, kMega>(p, smem);
}

// The narrow CTA (narrow.cuh): 16 R query heads, no head-group padding.
template <int R, int kFam>
__global__ void __launch_bounds__(kThreads, 1) dsv41_decode_narrow_kernel(const __grid_constant__ DecodeParams p) {
  extern __shared__ __align__(128) char smem[];
  decode_narrow_cta<R, kFam>(p, smem);
}

// One CTA per plan of the batch: the CTA planner, or the warp planner where its table does not fit.
__global__ void __launch_bounds__(kPlanCtaThreads) dsv41_plan_cta_kernel(const __grid_constant__ PlanBatch p) {
  extern __shared__ __align__(128) char smem[];
  plan_cta(p.plan[block_idx()], smem);
}
__global__ void __launch_bounds__(kPlanThreads) dsv41_plan_kernel(const __grid_constant__ PlanBatch p) {
  plan_warp(p.plan[block_idx()], lane_idx());
}

__global__ void __launch_bounds__(kCombineThreads) dsv41_combine_kernel(const __grid_constant__ DecodeParams p) {
  combine_cta(p);
}

cudaError_t ensure_smem_limit(const void* func, int bytes, unsigned long long* done_mask) {
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  const unsigned long long bit = dev < 64 ? (1ull << dev) : 0ull;
  if (bit && (__atomic_load_n(done_mask, __ATOMIC_ACQUIRE) & bit)) return cudaSuccess;
  int optin = 0;
  e = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
  if (e != cudaSuccess) return e;
  if (optin < bytes) return cudaErrorInvalidConfiguration;
  e = cudaFuncSetAttribute(func, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (e != cudaSuccess) return e;
  if (bit) __atomic_fetch_or(done_mask, bit, __ATOMIC_ACQ_REL);
  return cudaSuccess;
}

cudaError_t launch_plans(const PlanBatch& plans, cudaStream_t stream) {
  if (plans.count <= 0) return cudaSuccess;
  if (plans.smem_bytes > 0) {
    static unsigned long long done = 0;
    cudaError_t e = ensure_smem_limit((const void*)dsv41_plan_cta_kernel, kPlanSmemMax, &done);
    if (e != cudaSuccess) return e;
    dsv41_plan_cta_kernel<<<(unsigned)plans.count, kPlanCtaThreads, plans.smem_bytes, stream>>>(plans);
  } else {
    dsv41_plan_kernel<<<(unsigned)plans.count, kPlanThreads, 0, stream>>>(plans);
  }
  return cudaGetLastError();
}

cudaError_t launch_decode(const DecodeParams& p, cudaStream_t stream) {
  static unsigned long long done[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
  const long long grid = (long long)p.num_groups * p.s_q * p.num_parts;
  if (grid <= 0 || p.b <= 0) return cudaSuccess;
  const bool pair = p.pair != 0;
  // kernel k: 0 one 64-head CTA, 1 a pair, 2 / 3 the narrow CTA of 16 / 32 heads; + 4: the V4.1 formats;
  // 8 + (pair) + 2 (V4.1): the mega decode's 64-head CTAs (the narrow CTA reads p.mega)
  const int fam = decode_family(p) == kFamV41 ? 1 : 0;
  const int k = narrow_rows_ok(p.h_pad) ? 1 + p.h_pad / 16 + 4 * fam : p.mega ? 8 + (pair ? 1 : 0) + 2 * fam
                                                                             : (pair ? 1 : 0) + 4 * fam;
  void (*const kernels[12])(const DecodeParams) = {
      dsv41_decode_kernel<false, kFamV4, false>,  dsv41_decode_kernel<true, kFamV4, false>,
      dsv41_decode_narrow_kernel<1, kFamV4>,       dsv41_decode_narrow_kernel<2, kFamV4>,
      dsv41_decode_kernel<false, kFamV41, false>, dsv41_decode_kernel<true, kFamV41, false>,
      dsv41_decode_narrow_kernel<1, kFamV41>,      dsv41_decode_narrow_kernel<2, kFamV41>,
      dsv41_decode_kernel<false, kFamV4, true>,   dsv41_decode_kernel<true, kFamV4, true>,
      dsv41_decode_kernel<false, kFamV41, true>,  dsv41_decode_kernel<true, kFamV41, true>};
  auto* kernel = kernels[k];
  cudaError_t e = ensure_smem_limit((const void*)kernel, kSmemLaunchBytes, &done[k]);
  if (e != cudaSuccess) return e;
  e = launch_attention(kernel, p, grid, pair, stream);
  if (e != cudaSuccess) return e;
  if (p.num_slots <= 1) return cudaSuccess;  // a plan without split-KV: every request's CTA wrote its output
#if !defined(DSV41_FORCE_MMA_SYNC)
  if (p.no_split && p.mega && !narrow_rows_ok(p.h_pad)) {  // so did a mega decode's staged epilogue (sm_90a's)
    int dev = 0, major = 0;
    if (cudaGetDevice(&dev) == cudaSuccess &&
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess && major == 9)
      return cudaSuccess;
  }
#endif
  const long long cgrid = (long long)p.b * p.s_q * ((p.h_q + 7) / 8);
  dsv41_combine_kernel<<<(unsigned)cgrid, kCombineThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace dsv41
