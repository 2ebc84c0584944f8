// Host-side launchers of the dsv41 kernels (defined in decode.cu / prefill.cu).
#pragma once

#include <cuda_runtime.h>

#include "params.h"

namespace dsv41 {

// Enqueue the split planner (or the copy of a given plan), the decode kernel and the split
// combine kernel on `stream`. No allocation, no sync.
cudaError_t launch_decode(const DecodeParams& p, const PlanParams& plan, cudaStream_t stream);
// Enqueue the prefill kernel on `stream`.
cudaError_t launch_prefill(const PrefillParams& p, cudaStream_t stream);

// Raises the dynamic shared-memory limit of `func` to `bytes` on the current device (once per
// device and kernel) after checking the device's opt-in limit.
cudaError_t ensure_smem_limit(const void* func, int bytes, unsigned long long* done_mask);

}  // namespace dsv41
