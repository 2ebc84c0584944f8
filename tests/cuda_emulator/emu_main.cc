// Host emulation of the dsv41 kernels (CPU tests only; never part of the GPU library).
// Built by tests/cuda_emulator/build.py: g++ -std=c++17 -O2 -fPIC -shared -DDSV41_EMULATE
// -I tests/cuda_emulator -I cuda_ffi/csrc emu_main.cc -o libdsv41_emu.so. It runs the device code of
// the product's kernels (cuda_ffi/csrc/) thread by thread (emu_runtime.h) behind the same argument
// checks as the FFI handlers (host_params.h).
#include <type_traits>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>

#include "host_params.h"
#include "kernels.cuh"
#include "seesaw.cuh"

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

int dsv41_emu_abi_version() { return 5; }

// host_params.h's choice of head-group pairs for a decode launch (1: 2-CTA clusters).
int dsv41_emu_pair_groups(int64_t num_groups, int64_t b, int64_t tiles_per_row, int64_t parts, int64_t slots) {
  return dsv41::pair_groups(num_groups, b, tiles_per_row, parts, slots);
}

// in: 10 tensor views, out: 4 (see make_decode_params): the decode and combine kernels over the given plan.
// Returns 0 or 1 (message in errbuf).
// mega: nullptr, or 3 views (positions, cos_sin, out_scale) with mega_invariant: the mega decode (make_decode_params).
int dsv41_emu_decode(const dsv41::TensorView* in, const dsv41::TensorView* out, float softmax_scale,
                     int64_t kv_format, int64_t block_size, int64_t has_extra, int64_t extra_kv_format,
                     int64_t extra_block_size, const dsv41::TensorView* mega, int64_t mega_invariant, uint64_t seed,
                     int workers, char* errbuf, int errlen) {
  dsv41::DecodeParams p{};
  dsv41::MegaArgs margs{};
  if (mega) margs = dsv41::MegaArgs{mega[0], mega[1], mega[2], mega_invariant};
  std::string err = dsv41::make_decode_params(in, out, softmax_scale, kv_format, block_size, has_extra,
                                              extra_kv_format, extra_block_size, &p, mega ? &margs : nullptr);
  if (!err.empty()) return report(std::string(mega ? "dsv41_sparse_mla_mega_decode: " : "dsv41_sparse_mla_decode: ") + err,
                                  errbuf, errlen);
  const int64_t grid = (int64_t)p.num_groups * p.s_q * p.num_parts;
  const auto run = [&p](char* smem, auto fam) {
    constexpr int kFam = decltype(fam)::value;
    if (p.h_pad == 16) dsv41::decode_narrow_cta<1, kFam>(p, smem);
    else if (p.h_pad == 32) dsv41::decode_narrow_cta<2, kFam>(p, smem);
    else if (p.pair && p.mega) dsv41::decode_cta<true, kFam, true>(p, smem);
    else if (p.mega) dsv41::decode_cta<false, kFam, true>(p, smem);
    else if (p.pair) dsv41::decode_cta<true, kFam>(p, smem);
    else dsv41::decode_cta<false, kFam>(p, smem);
  };
  const bool v41 = dsv41::decode_family(p) == dsv41::kFamV41;
  emu::launch(grid, dsv41::kThreads, dsv41::kSmemLaunchBytes, [&](char* smem) {
                if (v41) run(smem, std::integral_constant<int, dsv41::kFamV41>{});
                else run(smem, std::integral_constant<int, dsv41::kFamV4>{});
              }, seed,
              workers, p.pair ? 2 : 1);
  // (launch_decode's rule: a batch-invariant mega decode whose staged epilogue wrote every request runs no combine)
  const bool staged_all = p.no_split && p.mega && dsv41::kWgmma && !dsv41::narrow_rows_ok(p.h_pad);
  if (p.num_slots > 1 && !staged_all) {
    const int64_t cgrid = (int64_t)p.b * p.s_q * ((p.h_q + 7) / 8);
    emu::launch(cgrid, dsv41::kCombineThreads, 0, [&p](char*) { dsv41::combine_cta(p); }, seed + 1, workers);
  }
  return 0;
}

// The split planner: topk_length, extra_topk_length -> sched, num_splits (see make_plan_params).
int dsv41_emu_plan(const dsv41::TensorView* tl, const dsv41::TensorView* etl, const dsv41::TensorView* sched,
                   const dsv41::TensorView* nsplit, int64_t topk, const int64_t* extra_topk, const int64_t* has_extra,
                   int64_t count, int64_t fixed_overhead, uint64_t seed, char* errbuf, int errlen) {
  dsv41::PlanBatch plans{};
  std::string err = dsv41::make_plan_params(*tl, *etl, *sched, *nsplit, topk, extra_topk, has_extra, count,
                                            fixed_overhead, &plans);
  if (!err.empty()) return report("dsv41_plan_decode_splits: " + err, errbuf, errlen);
  if (plans.smem_bytes > 0)
    emu::launch(plans.count, dsv41::kPlanCtaThreads, (size_t)plans.smem_bytes,
                [&plans](char* smem) { dsv41::plan_cta(plans.plan[dsv41::block_idx()], smem); }, seed, 1);
  else
    emu::launch(plans.count, dsv41::kPlanThreads, 0,
                [&plans](char*) { dsv41::plan_warp(plans.plan[dsv41::block_idx()], dsv41::lane_idx()); }, seed, 1);
  return 0;
}

// The shared memory the planner launch of these shapes gets: > 0 the CTA planner, 0 the warp planner
// (-1: the shapes are refused; the message in errbuf).
int dsv41_emu_plan_smem_bytes(const dsv41::TensorView* tl, const dsv41::TensorView* etl, const dsv41::TensorView* sched,
                              const dsv41::TensorView* nsplit, int64_t topk, const int64_t* extra_topk,
                              const int64_t* has_extra, int64_t count, int64_t fixed_overhead, char* errbuf,
                              int errlen) {
  dsv41::PlanBatch plans{};
  std::string err = dsv41::make_plan_params(*tl, *etl, *sched, *nsplit, topk, extra_topk, has_extra, count,
                                            fixed_overhead, &plans);
  if (!err.empty()) {
    report("dsv41_plan_decode_splits: " + err, errbuf, errlen);
    return -1;
  }
  return plans.smem_bytes;
}

// in: 5 tensor views, out: 3 (see make_prefill_params). mega: nullptr, or 2 views (cos_sin_rows, out_scale): the
// mega prefill (out[0] the e4m3 bytes, out[1] not read).
int dsv41_emu_prefill(const dsv41::TensorView* in, const dsv41::TensorView* out, float softmax_scale,
                      const dsv41::TensorView* mega, uint64_t seed, int workers, char* errbuf, int errlen) {
  dsv41::PrefillParams p{};
  dsv41::MegaPrefillArgs margs{};
  if (mega) margs = dsv41::MegaPrefillArgs{mega[0], mega[1]};
  std::string err = dsv41::make_prefill_params(in, out, softmax_scale, &p, mega ? &margs : nullptr);
  if (!err.empty())
    return report(std::string(mega ? "dsv41_sparse_mla_mega_prefill: " : "dsv41_sparse_mla_prefill: ") + err, errbuf,
                  errlen);
  const int64_t grid = (int64_t)p.num_groups * p.s_q;
  const auto run = [&p](char* smem, auto mega_tag) {
    constexpr bool kMega = decltype(mega_tag)::value;
#if DSV41_WGMMA
    if (p.kv.fmt == dsv41::kFmtF16) return dsv41::prefill_seesaw_cta<kMega>(p, smem);
#endif
    if (p.pair) dsv41::prefill_cta<true, kMega>(p, smem);
    else dsv41::prefill_cta<false, kMega>(p, smem);
  };
  emu::launch(grid, dsv41::kThreads, dsv41::kSmemLaunchBytes, [&](char* smem) {
                if (p.mega) run(smem, std::true_type{});
                else run(smem, std::false_type{});
              }, seed,
              workers, p.pair ? 2 : 1);
  return 0;
}

// Self-test of the emulator's wgmma model (tests/test_cuda_ffi.py), one warpgroup: A [64 x 16] and
// B [32 x 16] (K-major, 128-byte swizzle, small integers, exact in f16), d = 0 then d += A B^T once per
// wgmma m64n32k16. out [128][16] = each thread's d at the end, flags [128] = whether d held NaN (the
// emulator's "not yet written") after the scenario's wait<1>.
//   0: two commit groups chained on d, wait<1>, wait<0>: out = 2 A B^T, flags = 1 (the later group
//      still in flight at wait<1>).
//   1: one group, an empty commit, wait<1>: out = A B^T, flags = 0 (the empty group is the one left).
//   2: an operand byte of B rewritten between the issue and the wait: must abort.
//   3: a thread returns with a group in flight: must abort.
int dsv41_emu_wgmma_selftest(int scenario, float* out, int* flags) {
  emu::launch(1, 128, 16384 + 1024, [scenario, out, flags](char* raw) {
    using namespace dsv41;
    char* smem = align_smem(raw);
    const int t = thread_idx();
    const uint64_t da = wgmma_desc(smem_addr(smem), 16, 1024);
    const uint64_t db = wgmma_desc(smem_addr(smem + 8192), 16, 1024);
    auto put = [&](uint32_t off, float v) {
      const uint16_t h = (uint16_t)f32_to_f16_satfinite(v);
      std::memcpy(emu::cur_cta->smem + off, &h, 2);
    };
    if (t == 0) {
      for (int r = 0; r < 64; ++r)
        for (int k = 0; k < 16; ++k) put(wgemu::elem_addr(da, r, k, true), (float)((3 * r + k) % 7 - 3));
      for (int n = 0; n < 32; ++n)
        for (int k = 0; k < 16; ++k) put(wgemu::elem_addr(db, n, k, true), (float)((n + 2 * k) % 5 - 2));
    }
    bar_sync(0, 128);
    float d[16];
    for (float& x : d) x = 0.f;
    wgmma_fence();
    wgmma_m64n32k16(d, da, db);
    wgmma_commit();
    int nan_after = 0;
    if (scenario == 0) {
      wgmma_m64n32k16(d, da, db);
      wgmma_commit();
      wgmma_wait<1>();
      nan_after = std::isnan(d[0]) ? 1 : 0;
      wgmma_wait<0>();
    } else if (scenario == 1) {
      wgmma_commit();
      wgmma_wait<1>();
      nan_after = std::isnan(d[0]) ? 1 : 0;
      wgmma_wait<0>();
    } else if (scenario == 2) {
      bar_sync(0, 128);  // every warp has issued
      if (t == 0) put(wgemu::elem_addr(db, 5, 3, true), 1.f + (float)((5 + 6) % 5 - 2));
      bar_sync(0, 128);
      wgmma_wait<0>();
    } else {
      return;
    }
    for (int i = 0; i < 16; ++i) out[16 * t + i] = d[i];
    flags[t] = nan_after;
  });
  return 0;
}

}  // extern "C"
