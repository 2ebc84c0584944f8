// Sparse MLA prefill over bf16 KV rows (device build of kernels.cuh).
#include "kernels.cuh"
#include "launch.h"
#include "seesaw.cuh"

namespace dsv41 {

template <bool kPair>
__global__ void __launch_bounds__(kThreads, 1) dsv41_prefill_kernel(const __grid_constant__ PrefillParams p) {
  extern __shared__ __align__(128) char smem[];
  prefill_cta<kPair>(p, smem);
}

// f16 rows (kFmtF16): the seesaw CTA on sm_90a; builds without wgmma (sm_100a) run prefill_cta, whose
// producers copy f16 rows unconverted.
__global__ void __launch_bounds__(kThreads, 1) dsv41_prefill_f16_kernel(const __grid_constant__ PrefillParams p) {
  extern __shared__ __align__(128) char smem[];
#if DSV41_WGMMA
  prefill_seesaw_cta(p, smem);
#else
  prefill_cta<false>(p, smem);
#endif
}

cudaError_t launch_prefill(const PrefillParams& p, cudaStream_t stream) {
  static unsigned long long done = 0;
  static unsigned long long done_f16 = 0;
  const long long grid = (long long)p.num_groups * p.s_q;
  if (grid <= 0) return cudaSuccess;
  if (p.kv.fmt == kFmtF16) {
    cudaError_t e = ensure_smem_limit((const void*)dsv41_prefill_f16_kernel, kSmemLaunchBytes, &done_f16);
    if (e != cudaSuccess) return e;
    return launch_attention(dsv41_prefill_f16_kernel, p, grid, false, stream);
  }
  // p.pair is always 0 (host_params.h): one CTA per head group, the paired kernel is not built
  auto* kernel = dsv41_prefill_kernel<false>;
  cudaError_t e = ensure_smem_limit((const void*)kernel, kSmemLaunchBytes, &done);
  if (e != cudaSuccess) return e;
  return launch_attention(kernel, p, grid, false, stream);
}

}  // namespace dsv41
