// Sparse MLA prefill over bf16 KV rows (device build of kernels.cuh), plain and mega (PrefillParams::mega).
#include "kernels.cuh"
#include "launch.h"
#include "seesaw.cuh"

namespace dsv41 {

template <bool kPair, bool kMega>
__global__ void __launch_bounds__(kThreads, 1) dsv41_prefill_kernel(const __grid_constant__ PrefillParams p) {
  extern __shared__ __align__(128) char smem[];
  prefill_cta<kPair, kMega>(p, smem);
}

// f16 rows (kFmtF16): the seesaw CTA on sm_90a; builds without wgmma (sm_100a) run prefill_cta, whose
// producers copy f16 rows unconverted.
template <bool kMega>
__global__ void __launch_bounds__(kThreads, 1) dsv41_prefill_f16_kernel(const __grid_constant__ PrefillParams p) {
  extern __shared__ __align__(128) char smem[];
#if DSV41_WGMMA
  prefill_seesaw_cta<kMega>(p, smem);
#else
  prefill_cta<false, kMega>(p, smem);
#endif
}

template <bool kMega>
cudaError_t launch_prefill_of(const PrefillParams& p, cudaStream_t stream) {
  static unsigned long long done = 0;
  static unsigned long long done_f16 = 0;
  const long long grid = (long long)p.num_groups * p.s_q;
  if (grid <= 0) return cudaSuccess;
  if (p.kv.fmt == kFmtF16) {
    auto* kernel = dsv41_prefill_f16_kernel<kMega>;
    cudaError_t e = ensure_smem_limit((const void*)kernel, kSmemLaunchBytes, &done_f16);
    if (e != cudaSuccess) return e;
    return launch_attention(kernel, p, grid, false, stream);
  }
  // p.pair is always 0 (host_params.h): one CTA per head group, the paired kernel is not built
  auto* kernel = dsv41_prefill_kernel<false, kMega>;
  cudaError_t e = ensure_smem_limit((const void*)kernel, kSmemLaunchBytes, &done);
  if (e != cudaSuccess) return e;
  return launch_attention(kernel, p, grid, false, stream);
}

cudaError_t launch_prefill(const PrefillParams& p, cudaStream_t stream) {
  return p.mega ? launch_prefill_of<true>(p, stream) : launch_prefill_of<false>(p, stream);
}

}  // namespace dsv41
