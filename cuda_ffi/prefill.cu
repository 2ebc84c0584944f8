// Sparse MLA prefill over bf16 KV rows (device build of kernels.cuh).
#include "kernels.cuh"
#include "launch.h"

namespace dsv41 {

__global__ void __launch_bounds__(kThreads, 1) dsv41_prefill_kernel(const __grid_constant__ PrefillParams p) {
  extern __shared__ __align__(128) char smem[];
  prefill_cta(p, smem);
}

cudaError_t launch_prefill(const PrefillParams& p, cudaStream_t stream) {
  static unsigned long long done = 0;
  const long long grid = (long long)p.num_groups * p.s_q;
  if (grid <= 0) return cudaSuccess;
  cudaError_t e = ensure_smem_limit((const void*)dsv41_prefill_kernel, kSmemLaunchBytes, &done);
  if (e != cudaSuccess) return e;
  return launch_attention(dsv41_prefill_kernel, p, grid, false, stream);
}

}  // namespace dsv41
