// Host-side launchers of the dsv41 kernels (defined in decode.cu / prefill.cu).
#pragma once

#include <cuda_runtime.h>

#include "params.h"

namespace dsv41 {

// Enqueue the decode kernel over the plan in `p` and the split combine kernel (none when the plan
// has no split-KV: p.num_slots == 1) on `stream`. No allocation, no sync.
cudaError_t launch_decode(const DecodeParams& p, cudaStream_t stream);
// Enqueue the split planner: one warp per plan of `plans`.
cudaError_t launch_plans(const PlanBatch& plans, cudaStream_t stream);
// Enqueue the prefill kernel on `stream`.
cudaError_t launch_prefill(const PrefillParams& p, cudaStream_t stream);

// Launches an attention kernel (kThreads threads, kSmemLaunchBytes of dynamic shared memory) over
// `grid` CTAs, as 2-CTA clusters when `pair` (the head-group pairs of kernels.cuh's crew).
// Single CTAs use a plain launch: a cluster launch, even of 1-CTA clusters, is slower.
template <class Params>
cudaError_t launch_attention(void (*kernel)(const Params), const Params& p, long long grid, bool pair,
                             cudaStream_t stream) {
  if (!pair) {
    kernel<<<(unsigned)grid, kThreads, kSmemLaunchBytes, stream>>>(p);
    return cudaGetLastError();
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3((unsigned)grid, 1, 1);
  cfg.blockDim = dim3(kThreads, 1, 1);
  cfg.dynamicSmemBytes = kSmemLaunchBytes;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = 2;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, kernel, p);
}

// Raises the dynamic shared-memory limit of `func` to `bytes` on the current device (once per
// device and kernel) after checking the device's opt-in limit.
cudaError_t ensure_smem_limit(const void* func, int bytes, unsigned long long* done_mask);

}  // namespace dsv41
