// Host emulation of the dsv41 kernels (CPU tests only; never part of the GPU library).
// Built with: g++ -std=c++17 -O2 -fPIC -shared -DDSV41_EMULATE emu_main.cc -o libdsv41_emu.so
// It runs the device code of kernels.cuh thread by thread (emu_runtime.h) behind the same
// argument checks as the FFI handlers (host_params.h).
#include <cstdio>
#include <cstring>
#include <string>

#include "host_params.h"
#include "kernels.cuh"

namespace {

int report(const std::string& err, char* errbuf, int errlen) {
  if (err.empty()) return 0;
  if (errbuf && errlen > 0) {
    std::snprintf(errbuf, (size_t)errlen, "%s", err.c_str());
  }
  return 1;
}

}  // namespace

extern "C" {

int dsv41_emu_abi_version() { return 2; }

namespace {
void emu_plan(const dsv41::PlanParams& plan, uint64_t seed, int workers) {
  if (plan.device_plan)
    emu::launch(1, dsv41::kPlanThreads, 0, [&plan](char*) { dsv41::plan_warp(plan, dsv41::lane_idx()); }, seed,
                workers);
  else
    emu::launch(1, 256, 0, [&plan](char*) { dsv41::plan_copy(plan, dsv41::thread_idx(), 256); }, seed, workers);
}
}  // namespace

// in: 10 tensor views, out: 6 (see make_decode_params). Returns 0 or 1 (message in errbuf).
int dsv41_emu_decode(const dsv41::TensorView* in, const dsv41::TensorView* out, float softmax_scale,
                     int64_t kv_format, int64_t block_size, int64_t has_extra, int64_t extra_kv_format,
                     int64_t extra_block_size, int64_t device_plan, uint64_t seed, int workers, char* errbuf,
                     int errlen) {
  dsv41::DecodeParams p{};
  dsv41::PlanParams plan{};
  std::string err = dsv41::make_decode_params(in, out, softmax_scale, kv_format, block_size, has_extra,
                                              extra_kv_format, extra_block_size, device_plan, &p, &plan);
  if (!err.empty()) return report("dsv41_sparse_mla_decode: " + err, errbuf, errlen);
  emu_plan(plan, seed + 2, workers);
  const int64_t grid = (int64_t)p.num_groups * p.s_q * p.num_parts;
  emu::launch(grid, dsv41::kThreads, dsv41::kSmemLaunchBytes, [&p](char* smem) {
                if (p.pair) dsv41::decode_cta<true>(p, smem);
                else dsv41::decode_cta<false>(p, smem);
              }, seed,
              workers, p.pair ? 2 : 1);
  const int64_t cgrid = (int64_t)p.b * p.s_q * (p.h_pad / 8);
  emu::launch(cgrid, dsv41::kCombineThreads, 0, [&p](char*) { dsv41::combine_cta(p); }, seed + 1, workers);
  return 0;
}

// The split planner alone: topk_length, extra_topk_length (read when has_extra) -> sched, num_splits.
int dsv41_emu_plan(const dsv41::TensorView* tl, const dsv41::TensorView* etl, const dsv41::TensorView* sched,
                   const dsv41::TensorView* nsplit, int64_t topk, int64_t extra_topk, int64_t has_extra,
                   int64_t fixed_overhead, uint64_t seed, char* errbuf, int errlen) {
  dsv41::PlanParams plan{};
  std::string err =
      dsv41::make_plan_params(*tl, *etl, *sched, *nsplit, topk, extra_topk, has_extra, fixed_overhead, &plan);
  if (!err.empty()) return report("dsv41 plan: " + err, errbuf, errlen);
  emu_plan(plan, seed, 1);
  return 0;
}

// in: 5 tensor views, out: 3 (see make_prefill_params).
int dsv41_emu_prefill(const dsv41::TensorView* in, const dsv41::TensorView* out, float softmax_scale, uint64_t seed,
                      int workers, char* errbuf, int errlen) {
  dsv41::PrefillParams p{};
  std::string err = dsv41::make_prefill_params(in, out, softmax_scale, &p);
  if (!err.empty()) return report("dsv41_sparse_mla_prefill: " + err, errbuf, errlen);
  const int64_t grid = (int64_t)p.num_groups * p.s_q;
  emu::launch(grid, dsv41::kThreads, dsv41::kSmemLaunchBytes, [&p](char* smem) { dsv41::prefill_cta(p, smem); }, seed,
              workers);
  return 0;
}

}  // extern "C"
