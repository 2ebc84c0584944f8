// Thin wrappers over the few GPU instructions the dsv41 kernels use.
//
// Two back ends with one interface:
//  * device (nvcc, no DSV41_EMULATE): inline PTX / CUDA intrinsics;
//  * host emulation (any C++17 compiler with DSV41_EMULATE): every CUDA thread is a fiber of
//    emu_runtime.h; warp-collective instructions (ldmatrix, mma.sync, wgmma, shfl, ballot) exchange
//    their operands through a per-warp slot and compute the exact PTX fragment semantics
//    written down below, named barriers count arrivals per thread.
// The kernels in kernels.cuh are written only against this header, so the emulation runs the
// very same index math, masking, barriers and softmax as the GPU build.
#pragma once

#include <stdint.h>

#if defined(__CUDACC__) && !defined(DSV41_EMULATE)
#define DSV41_DEVICE 1
#define DEVFN __device__ __forceinline__
#include <cuda_runtime.h>
#else
#define DSV41_DEVICE 0
#define DEVFN inline
#include <cmath>
#include <cstring>
#include "emu_runtime.h"
#endif

namespace dsv41 {

#if !DSV41_DEVICE
using emu::uint4;
using emu::uint2;
using emu::float2;
using emu::float4;
#endif

DEVFN uint4 make_u4(uint32_t x, uint32_t y, uint32_t z, uint32_t w) {
  uint4 r;
  r.x = x; r.y = y; r.z = z; r.w = w;
  return r;
}
DEVFN uint2 make_u2(uint32_t x, uint32_t y) {
  uint2 r;
  r.x = x; r.y = y;
  return r;
}
DEVFN float4 make_f4(float x, float y, float z, float w) {
  float4 r;
  r.x = x; r.y = y; r.z = z; r.w = w;
  return r;
}

// ------------------------------------------------------------------------------ identity
#if DSV41_DEVICE
DEVFN int thread_idx() { return (int)threadIdx.x; }
DEVFN int64_t block_idx() { return (int64_t)blockIdx.x; }
#else
inline int thread_idx() { return emu::cur_fiber->tid; }
inline int64_t block_idx() { return emu::cur_cta->block; }
#endif
DEVFN int lane_idx() { return thread_idx() & 31; }
DEVFN int warp_idx() { return thread_idx() >> 5; }

// ------------------------------------------------------------------------------ barriers
// Named barrier `id` (1..15) over `n` threads (a multiple of 32; every lane of each
// participating warp executes it). bar.sync waits, bar.arrive only counts.
#if DSV41_DEVICE
DEVFN void bar_sync(int id, int n) { asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(n) : "memory"); }
DEVFN void bar_arrive(int id, int n) { asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(n) : "memory"); }
DEVFN void fence_cta() { asm volatile("membar.cta;" ::: "memory"); }
DEVFN void syncwarp() { __syncwarp(); }
#else
inline void bar_sync(int id, int n) { emu::bar_sync(id, n); }
inline void bar_arrive(int id, int n) { emu::bar_arrive(id, n); }
inline void fence_cta() {}
inline void syncwarp() { emu::warp_collective(emu::kTagSyncwarp, nullptr, 0, [](auto&) {}); }
#endif

// setmaxnreg (sm_90a / sm_100a): move registers between warpgroups. Every warp of a warpgroup
// must execute the same one. A no-op in the emulator.
template <int N>
DEVFN void setmaxnreg_inc() {
#if DSV41_DEVICE
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N));
#endif
}
template <int N>
DEVFN void setmaxnreg_dec() {
#if DSV41_DEVICE
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N));
#endif
}

// ------------------------------------------------------------------------------ warp shuffles
#if DSV41_DEVICE
DEVFN float shfl_xor_f32(float v, int m) { return __shfl_xor_sync(0xffffffffu, v, m); }
DEVFN uint32_t shfl_idx_u32(uint32_t v, int src) { return __shfl_sync(0xffffffffu, v, src); }
DEVFN uint32_t shfl_xor_u32(uint32_t v, int m) { return __shfl_xor_sync(0xffffffffu, v, m); }
DEVFN uint32_t ballot(bool p) { return __ballot_sync(0xffffffffu, p); }
DEVFN int popc32(uint32_t v) { return __popc(v); }
#else
inline int popc32(uint32_t v) { return __builtin_popcount(v); }
inline float shfl_xor_f32(float v, int m) {
  float r;
  int lane = lane_idx();
  emu::warp_collective(emu::kTagShfl, &v, sizeof v, [&](auto& d) { std::memcpy(&r, d[lane ^ m], sizeof r); });
  return r;
}
inline uint32_t shfl_idx_u32(uint32_t v, int src) {
  uint32_t r;
  emu::warp_collective(emu::kTagShfl, &v, sizeof v, [&](auto& d) { std::memcpy(&r, d[src & 31], sizeof r); });
  return r;
}
inline uint32_t shfl_xor_u32(uint32_t v, int m) {
  uint32_t r;
  int lane = lane_idx();
  emu::warp_collective(emu::kTagShfl, &v, sizeof v, [&](auto& d) { std::memcpy(&r, d[lane ^ m], sizeof r); });
  return r;
}
inline uint32_t ballot(bool p) {
  uint32_t r = 0;
  unsigned char b = p ? 1 : 0;
  emu::warp_collective(emu::kTagBallot, &b, 1, [&](auto& d) {
    for (int i = 0; i < 32; ++i) r |= (uint32_t)(d[i][0] & 1) << i;
  });
  return r;
}
#endif

// ------------------------------------------------------------------------------ global loads
// Read-only (non-coherent) loads: only for buffers nothing writes during the kernel.
#if DSV41_DEVICE
DEVFN uint4 ldg_nc_v4(const void* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }
DEVFN uint2 ldg_nc_v2(const void* p) { return __ldg(reinterpret_cast<const uint2*>(p)); }
DEVFN int32_t ldg_nc_s32(const int32_t* p) { return __ldg(p); }
DEVFN float ldg_nc_f32(const float* p) { return __ldg(p); }
#else
inline uint4 ldg_nc_v4(const void* p) { uint4 r; std::memcpy(&r, p, 16); return r; }
inline uint2 ldg_nc_v2(const void* p) { uint2 r; std::memcpy(&r, p, 8); return r; }
inline int32_t ldg_nc_s32(const int32_t* p) { return *p; }
inline float ldg_nc_f32(const float* p) { return *p; }
#endif

// L2 prefetch of the cache line holding `p` (a hint: no result, no fault semantics relied on;
// only called on addresses inside the cache). A no-op in the emulator.
#if DSV41_DEVICE
DEVFN void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }
#else
inline void prefetch_l2(const void*) {}
#endif

// ------------------------------------------------------------------------------ conversions
DEVFN uint32_t f32_bits(float f) {
#if DSV41_DEVICE
  return __float_as_uint(f);
#else
  uint32_t u; std::memcpy(&u, &f, 4); return u;
#endif
}
DEVFN float bits_f32(uint32_t u) {
#if DSV41_DEVICE
  return __uint_as_float(u);
#else
  float f; std::memcpy(&f, &u, 4); return f;
#endif
}
DEVFN float bf16_lo(uint32_t packed) { return bits_f32(packed << 16); }
DEVFN float bf16_hi(uint32_t packed) { return bits_f32(packed & 0xffff0000u); }

// Two f32 -> packed bf16x2, round to nearest even; `lo` goes to bits 0..15 (the element at the
// lower address / lower index), `hi` to bits 16..31.
DEVFN uint32_t pack_bf16x2(float lo, float hi) {
#if DSV41_DEVICE
  uint32_t r;
  // cvt.rn.bf16x2.f32 d, a, b puts a in the UPPER half and b in the lower half.
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
#else
  auto rn = [](float f) -> uint32_t {
    uint32_t u = f32_bits(f);
    if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu)) return 0x7fffu;  // canonical NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return u >> 16;
  };
  return rn(lo) | (rn(hi) << 16);
#endif
}

// f16 <-> f32. The kernels' tensor-core operands are f16 (11-bit significand, f32 accumulation):
// bf16 values with 2^-17 <= |x| <= 65504 and e4m3 x 2^k with k >= -15 convert exactly (smaller
// magnitudes round on f16's subnormal grid, error < 2^-25; larger ones saturate), and a single f16 P
// is accurate enough for FlashMLA's output tolerance where a single bf16 P is not (docs/cuda_kernels.md).
DEVFN float f16_to_f32(uint32_t h) {
#if DSV41_DEVICE
  float f;
  unsigned short u = (unsigned short)(h & 0xffffu);
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(u));
  return f;
#else
  const uint32_t s = (h >> 15) & 1u, e = (h >> 10) & 31u, m = h & 1023u;
  float v;
  if (e == 31) v = m ? NAN : INFINITY;
  else if (e == 0) v = std::ldexp((float)m, -24);
  else v = std::ldexp((float)(m | 1024u), (int)e - 25);
  return s ? -v : v;
#endif
}
DEVFN float f16_lo(uint32_t packed) { return f16_to_f32(packed & 0xffffu); }
DEVFN float f16_hi(uint32_t packed) { return f16_to_f32(packed >> 16); }

#if !DSV41_DEVICE
// f32 -> f16 bits, round to nearest even, saturating finite values to +-65504 (cvt .satfinite).
// satfinite = false: IEEE overflow to +-inf (mul.rn.f16x2).
inline uint32_t f32_to_f16_satfinite(float f, bool satfinite = true) {
  const uint32_t u = f32_bits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return 0x7fffu;  // NaN
  if (a >= 0x477ff000u) return sign | (satfinite ? 0x7bffu : 0x7c00u);  // >= 65520 rounds past 65504
  if (a < 0x38800000u) {  // below 2^-14: f16 subnormal (or zero), units of 2^-24
    const float q = std::ldexp(bits_f32(a), 24);
    return sign | (uint32_t)std::nearbyint(q);  // default rounding mode: to nearest even
  }
  uint32_t r = ((a - 0x38000000u) >> 13);  // rebias 127 -> 15, drop 13 mantissa bits
  const uint32_t rem = a & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) ++r;
  return sign | r;
}
#endif

// Two f32 -> packed f16x2, round to nearest even, finite values beyond +-65504 saturate; `lo` goes
// to bits 0..15.
DEVFN uint32_t pack_f16x2(float lo, float hi) {
#if DSV41_DEVICE
  uint32_t r;
  asm("cvt.rn.satfinite.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
#else
  return f32_to_f16_satfinite(lo) | (f32_to_f16_satfinite(hi) << 16);
#endif
}
// Two packed bf16 -> two packed f16 (exact inside f16's range).
DEVFN uint32_t bf16x2_to_f16x2(uint32_t v) { return pack_f16x2(bf16_lo(v), bf16_hi(v)); }

DEVFN float2 e4m3x2_to_f32x2(uint32_t two_bytes);

// Two e4m3 in one 16-bit word -> packed f16x2 (exact; the low byte is the first element).
DEVFN uint32_t e4m3x2_to_f16x2(uint32_t two_bytes) {
#if DSV41_DEVICE
  uint32_t h2;
  unsigned short in = (unsigned short)(two_bytes & 0xffffu);
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(in));
  return h2;
#else
  const float2 f = e4m3x2_to_f32x2(two_bytes);
  return pack_f16x2(f.x, f.y);
#endif
}
// Two e4m3 (OCP fp8, finite-only "fn" variant) in one 16-bit word -> two f32; the low byte is
// the first element. Exact: e4m3 values are representable in f16 and f32.
DEVFN float2 e4m3x2_to_f32x2(uint32_t two_bytes) {
  float2 r;
#if DSV41_DEVICE
  const uint32_t h2 = e4m3x2_to_f16x2(two_bytes);
  r.x = f16_lo(h2);
  r.y = f16_hi(h2);
#else
  auto dec = [](uint32_t b) -> float {
    uint32_t s = (b >> 7) & 1, e = (b >> 3) & 15, m = b & 7;
    float v;
    if (e == 15 && m == 7) v = NAN;
    else if (e == 0) v = std::ldexp((float)m / 8.0f, -6);
    else v = std::ldexp(1.0f + (float)m / 8.0f, (int)e - 7);
    return s ? -v : v;
  };
  r.x = dec(two_bytes & 0xff);
  r.y = dec((two_bytes >> 8) & 0xff);
#endif
  return r;
}

// Two f32 -> two e4m3 (OCP "fn") in one 16-bit word, round to nearest even, finite values beyond +-448
// saturate to +-448 (cvt .satfinite); `lo` goes to the low byte.
#if !DSV41_DEVICE
inline uint32_t f32_to_e4m3_satfinite(float f) {
  const uint32_t sign = (f32_bits(f) >> 24) & 0x80u;
  const float a = std::fabs(f);
  if (a != a) return 0x7fu;
  if (a >= 464.f) return sign | 0x7eu;  // rounds past 448 (the largest finite e4m3): saturate
  if (a < 0.015625f) return sign | (uint32_t)std::nearbyint(std::ldexp(a, 9));  // subnormals: units of 2^-9
  int e = 0;
  const float m = std::frexp(a, &e);                  // a = m 2^e, m in [0.5, 1)
  uint32_t q = (uint32_t)std::nearbyint(std::ldexp(m, 4));  // 8..16: 1.mmm with the rounding carry
  int ee = e - 1 + 7;                                 // biased exponent of 1.mmm x 2^(e-1)
  if (q == 16u) { q = 8u; ++ee; }
  const uint32_t r = ((uint32_t)ee << 3) | (q - 8u);
  return sign | (r > 0x7eu ? 0x7eu : r);
}
#endif
DEVFN uint32_t pack_e4m3x2(float lo, float hi) {
#if DSV41_DEVICE
  unsigned short r;
  // cvt.rn.satfinite.e4m3x2.f32 d, a, b puts a in the UPPER byte and b in the lower one.
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  return (uint32_t)r;
#else
  return f32_to_e4m3_satfinite(lo) | (f32_to_e4m3_satfinite(hi) << 8);
#endif
}

// Byte permute (prmt.b32, default mode): byte k of the result is byte (sel >> 4k) & 7 of the 8 bytes {a, b}
// (a's bytes 0..3, b's 4..7); `sel` has no bit 3 set in its four nibbles (the sign-replicating mode).
DEVFN uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
#if DSV41_DEVICE
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
  return r;
#else
  const uint64_t v = (uint64_t)a | ((uint64_t)b << 32);
  uint32_t r = 0;
  for (int k = 0; k < 4; ++k) r |= (uint32_t)((v >> (8 * ((sel >> (4 * k)) & 7))) & 0xffu) << (8 * k);
  return r;
#endif
}

// Packed f16x2 product, round to nearest even (mul.rn.f16x2).
DEVFN uint32_t hmul2(uint32_t a, uint32_t b) {
#if DSV41_DEVICE
  uint32_t r;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
#else
  // the f32 product of two f16 is exact, so one rounding to f16 (overflow to +-inf) is the GPU's result
  return f32_to_f16_satfinite(f16_lo(a) * f16_lo(b), false) | (f32_to_f16_satfinite(f16_hi(a) * f16_hi(b), false) << 16);
#endif
}

// 2^x with subnormal results flushed to 0 (ex2.approx.ftz: one MUFU; exp2f adds a range test and
// two multiplies per call to produce subnormals, which P, alpha and the sink term never need).
DEVFN float fexp2(float x) {
#if DSV41_DEVICE
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
#else
  return std::exp2(x);
#endif
}
DEVFN float flog2(float x) {
#if DSV41_DEVICE
  return log2f(x);
#else
  return std::log2(x);
#endif
}
DEVFN float finf() { return bits_f32(0x7f800000u); }

// ------------------------------------------------------------------------------ shared memory
// Shared-window address of a shared-memory pointer (emulator: offset from the CTA's shared base).
DEVFN uint32_t smem_addr(const void* p) {
#if DSV41_DEVICE
  return (uint32_t)__cvta_generic_to_shared(p);
#else
  return (uint32_t)(static_cast<const char*>(p) - emu::cur_cta->smem);
#endif
}

// ------------------------------------------------------------------------------ clusters, mbarriers
// A cluster address names byte `off` of CTA `rank`'s shared memory (device: mapa; emulator:
// rank << 24 | off). mbarriers live in shared memory (8 bytes, 8-aligned). Arrivals release and
// waits acquire at CTA scope (the PTX defaults, as CUTLASS's cluster pipelines use them):
//  * PFULL (the peer's cp.async.bulk rows and st.async mask words; complete_tx): the transaction mechanism makes the peer's writes
//    visible to the threads that observe the phase (assumed, as CUTLASS and FlashMLA do, to hold
//    for a CTA-scope acquire of a phase completed by another CTA's writes; kernels.cuh).
//  * PEMPTY (remote arrivals of the peer's consumer warps): each arrives after wgmma.wait_group (and,
//    on the mma.sync path, after the ldmatrix results were used; the mask words were read before the
//    softmax), so the peer's reads of the buffer have completed, not merely been ordered, before the
//    arrival. Strictly, the PTX memory model calls a CTA-scope release/acquire pair across CTAs not
//    morally strong; like CUTLASS and FlashMLA this relies on the reads being complete. With bulk
//    copies it also means this CTA's outgoing copies of the buffer have completed (source reads
//    included): the peer's consumers arrive only after its PFULL phase, which needs every byte.
// Cluster-scope semantics cost a MEMBAR.ALL.GPU per remote arrival and an L1 invalidation
// (CCTL.IVALL, which also waits for every outstanding load) per wait: Nsight Compute put 8% of the
// pair decode's samples there (benchmarks/RESULTS.md, "cuda decode profile").
#if DSV41_DEVICE
DEVFN int cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return (int)r;
}
DEVFN uint32_t cluster_map(uint32_t saddr, int rank) {
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(saddr), "r"(rank));
  return r;
}
// barrier.cluster: every thread of every CTA of the cluster (release / acquire).
DEVFN void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
DEVFN void mbar_init(uint32_t saddr, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(saddr), "r"(count) : "memory");
}
// Makes mbarrier initialisation visible to the cluster (before the cluster barrier that follows).
DEVFN void fence_mbar_init() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
DEVFN void mbar_arrive(uint32_t caddr) {
  asm volatile("mbarrier.arrive.release.cta.shared::cluster.b64 _, [%0];" ::"r"(caddr) : "memory");
}
// Arrival on this CTA's mbarrier that also expects `bytes` more of asynchronous stores this phase.
DEVFN void mbar_arrive_expect_tx(uint32_t saddr, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [%0], %1;" ::"r"(saddr), "r"(bytes)
               : "memory");
}
// st.async: a store into another CTA's shared memory that, once performed, completes its size in
// bytes of the transaction count of mbarrier `cbar` (in the same CTA as the destination); no wait.
DEVFN void st_async_v4(uint32_t caddr, const uint4& v, uint32_t cbar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, [%5];" ::"r"(caddr),
               "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "r"(cbar)
               : "memory");
}
// cp.async.bulk from this CTA's shared memory (saddr) to another CTA's (cluster address caddr): `bytes`
// (a multiple of 16, both 16-byte aligned), completing that many bytes of the transaction count of
// mbarrier `cbar` in the destination CTA. An async-proxy read of the source: generic stores into it
// need fence.proxy.async first.
DEVFN void bulk_copy_to_peer(uint32_t caddr, uint32_t saddr, uint32_t bytes, uint32_t cbar) {
  asm volatile("cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(caddr),
               "r"(saddr), "r"(bytes), "r"(cbar)
               : "memory");
}
DEVFN void st_async_u32(uint32_t caddr, uint32_t v, uint32_t cbar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];" ::"r"(caddr), "r"(v),
               "r"(cbar)
               : "memory");
}
// cp.async.cg of 16 bytes from global memory into this CTA's shared memory at saddr (16-byte
// aligned), with the L2 fetch widened to 256 B (a K row's neighbouring chunks come next); src_bytes 0
// reads nothing and writes 16 zero bytes (masked tokens). Completion is tracked by
// cp_async_arrive_noinc.
DEVFN void cp_async16(uint32_t saddr, const void* src, uint32_t src_bytes) {
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;" ::"r"(saddr), "l"(src), "r"(src_bytes)
               : "memory");
}
// One arrival on this CTA's mbarrier at saddr, made once every cp.async this thread issued before
// it has landed (.noinc: the arrival counts against the mbarrier's expected count).
DEVFN void cp_async_arrive_noinc(uint32_t saddr) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(saddr) : "memory");
}
DEVFN void mbar_wait(uint32_t saddr, uint32_t parity) {
  uint32_t ok = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.acquire.cta.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(ok)
        : "r"(saddr), "r"(parity)
        : "memory");
  } while (!ok);
}
#else
inline int cluster_rank() { return emu::cur_cta->rank; }
inline uint32_t cluster_map(uint32_t saddr, int rank) { return ((uint32_t)rank << 24) | (saddr & 0xffffffu); }
inline void cluster_sync() { emu::cluster_sync(); }
inline void mbar_init(uint32_t saddr, int count) { emu::mbar_init(saddr, count); }
inline void fence_mbar_init() {}
inline void mbar_arrive(uint32_t caddr) { emu::mbar_arrive(caddr); }
inline void mbar_arrive_expect_tx(uint32_t saddr, uint32_t bytes) { emu::mbar_arrive(saddr | emu::cluster_self(), bytes); }
inline void st_async_v4(uint32_t caddr, const uint4& v, uint32_t cbar) { emu::st_async(caddr, &v, sizeof v, cbar); }
inline void st_async_u32(uint32_t caddr, uint32_t v, uint32_t cbar) { emu::st_async(caddr, &v, sizeof v, cbar); }
// (the source bytes are read at issue, so a kernel that rewrote them before the copy completed would
// go unnoticed here; the proxy fence before it is not modelled either)
inline void bulk_copy_to_peer(uint32_t caddr, uint32_t saddr, uint32_t bytes, uint32_t cbar) {
  if ((caddr | saddr | bytes) & 15u) emu::fail("cp.async.bulk: addresses and size must be multiples of 16");
  if (saddr + bytes > emu::cur_cta->smem_bytes) emu::fail("cp.async.bulk: source outside the CTA's shared memory");
  emu::st_async(caddr, emu::cur_cta->smem + saddr, bytes, cbar);
}
inline void mbar_wait(uint32_t saddr, uint32_t parity) { emu::mbar_wait(saddr, parity); }
inline void cp_async16(uint32_t saddr, const void* src, uint32_t src_bytes) { emu::cp_async(saddr, src, src_bytes); }
inline void cp_async_arrive_noinc(uint32_t saddr) { emu::cp_async_arrive_noinc(saddr); }
#endif

// ldmatrix.sync.aligned.m8n8.x4.shared.b16: lanes 8i..8i+7 give the row addresses (16 B each)
// of 8x8 b16 matrix i; lane l receives r[i] = {M_i[l/4][2(l%4)], M_i[l/4][2(l%4)+1]} (first
// element in the low half).
DEVFN void ldsm_x4(uint32_t r[4], const void* row_addr) {
#if DSV41_DEVICE
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(row_addr)));
#else
  const void* a = row_addr;
  int lane = lane_idx();
  emu::warp_collective(emu::kTagLdsm, &a, sizeof a, [&](auto& d) {
    for (int i = 0; i < 4; ++i) {
      const unsigned char* row;
      std::memcpy(&row, d[8 * i + (lane >> 2)], sizeof row);
      std::memcpy(&r[i], row + 4 * (lane & 3), 4);
    }
  });
#endif
}
// stmatrix.sync.aligned.m8n8.x4.shared.b16, ldsm_x4's inverse: lanes 8i..8i+7 give the row addresses of
// 8x8 b16 matrix i, and lane l's r[i] holds {M_i[l/4][2(l%4)], M_i[l/4][2(l%4)+1]}.
DEVFN void stsm_x4(void* row_addr, const uint32_t (&r)[4]) {
#if DSV41_DEVICE
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1,%2,%3,%4};" ::"r"(smem_addr(row_addr)), "r"(r[0]),
               "r"(r[1]), "r"(r[2]), "r"(r[3])
               : "memory");
#else
  struct In { void* a; uint32_t r[4]; } in{row_addr, {r[0], r[1], r[2], r[3]}};
  const int lane = lane_idx();
  emu::warp_collective(emu::kTagStsm, &in, sizeof in, [&](auto& d) {
    const int i = lane >> 3, rr = lane & 7;  // this lane's address: row rr of matrix i
    for (int c = 0; c < 4; ++c) {
      In x;
      std::memcpy(&x, d[4 * rr + c], sizeof x);
      std::memcpy(static_cast<unsigned char*>(in.a) + 4 * c, &x.r[i], 4);
    }
  });
#endif
}
// .trans variant: lane l receives r[i] = {M_i[2(l%4)][l/4], M_i[2(l%4)+1][l/4]}.
DEVFN void ldsm_x4_trans(uint32_t r[4], const void* row_addr) {
#if DSV41_DEVICE
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(row_addr)));
#else
  const void* a = row_addr;
  int lane = lane_idx();
  emu::warp_collective(emu::kTagLdsmT, &a, sizeof a, [&](auto& d) {
    for (int i = 0; i < 4; ++i) {
      const unsigned char *r0, *r1;
      std::memcpy(&r0, d[8 * i + 2 * (lane & 3)], sizeof r0);
      std::memcpy(&r1, d[8 * i + 2 * (lane & 3) + 1], sizeof r1);
      uint16_t e0, e1;
      std::memcpy(&e0, r0 + 2 * (lane >> 2), 2);
      std::memcpy(&e1, r1 + 2 * (lane >> 2), 2);
      r[i] = (uint32_t)e0 | ((uint32_t)e1 << 16);
    }
  });
#endif
}

// mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32, d += A * B.
// With g = lane / 4 and t = lane % 4 (pairs: first element in the low half):
//   A (16x16, row major): a[0] = A[g][2t..2t+1],   a[1] = A[g+8][2t..2t+1],
//                         a[2] = A[g][2t+8..2t+9], a[3] = A[g+8][2t+8..2t+9]
//   B (16x8, k x n):      b[0] = B[2t..2t+1][g],   b[1] = B[2t+8..2t+9][g]
//   C/D (16x8, f32):      d[0] = C[g][2t], d[1] = C[g][2t+1], d[2] = C[g+8][2t], d[3] = C[g+8][2t+1]
DEVFN void mma_f16_16816(float d[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
#if DSV41_DEVICE
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  struct In { uint32_t a[4]; uint32_t b[2]; } in;
  for (int i = 0; i < 4; ++i) in.a[i] = a[i];
  in.b[0] = b0; in.b[1] = b1;
  int lane = lane_idx();
  emu::warp_collective(emu::kTagMma, &in, sizeof in, [&](auto& dd) {
    float A[16][16], B[16][8];
    for (int l = 0; l < 32; ++l) {
      In x;
      std::memcpy(&x, dd[l], sizeof x);
      int g = l >> 2, t = l & 3;
      A[g][2 * t] = f16_lo(x.a[0]);     A[g][2 * t + 1] = f16_hi(x.a[0]);
      A[g + 8][2 * t] = f16_lo(x.a[1]); A[g + 8][2 * t + 1] = f16_hi(x.a[1]);
      A[g][2 * t + 8] = f16_lo(x.a[2]); A[g][2 * t + 9] = f16_hi(x.a[2]);
      A[g + 8][2 * t + 8] = f16_lo(x.a[3]); A[g + 8][2 * t + 9] = f16_hi(x.a[3]);
      B[2 * t][g] = f16_lo(x.b[0]);     B[2 * t + 1][g] = f16_hi(x.b[0]);
      B[2 * t + 8][g] = f16_lo(x.b[1]); B[2 * t + 9][g] = f16_hi(x.b[1]);
    }
    int g = lane >> 2, t = lane & 3;
    const int rows[4] = {g, g, g + 8, g + 8};
    const int cols[4] = {2 * t, 2 * t + 1, 2 * t, 2 * t + 1};
    for (int i = 0; i < 4; ++i) {
      float acc = d[i];
      for (int k = 0; k < 16; ++k) acc += A[rows[i]][k] * B[k][cols[i]];
      d[i] = acc;
    }
  });
#endif
}


// ------------------------------------------------------------------------------ wgmma (sm_90a)
// Warpgroup MMA, f16 x f16 (or bf16 x bf16) -> f32, operands from shared memory through 64-bit
// matrix descriptors (A may instead come from registers: wgmma_m64n256k16_rs_tb). Only the sm_90a
// device build issues them (DSV41_WGMMA); the emulator computes the same products from the same
// descriptors, warp by warp (warp r of the warpgroup owns rows
// 16r..16r+15, as on the GPU).
//
// Descriptor (PTX ISA, "Matrix Descriptor Format", wgmma): bits 0-13 start address >> 4, 16-29
// leading-dimension byte offset >> 4, 32-45 stride-dimension byte offset >> 4, 62-63 swizzle
// (1 = 128-byte). Every operand here uses the 128-byte swizzle: rows of 128 B (64 f16), 8-row
// atoms of 1024 B (1024-aligned), 16-byte chunk c of row r stored at chunk c ^ (r & 7), i.e.
// byte-address bits 4-6 XOR bits 7-9.
//  * K-major (rows = M or N, 16 k-elements per instruction inside one 128-B row): SBO = the
//    stride between 8-row groups (1024 B); LBO unused; k-step j of an atom starts at +32j B.
//  * MN-major (B with the transpose bit; rows = k, 64 contiguous n per 128-B row): LBO = the
//    stride between 64-column blocks, SBO = the stride between 8-row (k) groups.
// The accumulator fragment of m64nNk16 is mma.sync's C fragment per 8-column block n:
//   d[4n + 0..1] = D[16r + g][8n + 2t + 0..1], d[4n + 2..3] = D[16r + g + 8][8n + 2t + 0..1].
#ifndef DSV41_WGMMA
#if DSV41_DEVICE
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL) && \
    !defined(DSV41_FORCE_MMA_SYNC)
#define DSV41_WGMMA 1
#else
#define DSV41_WGMMA 0
#endif
#else
#define DSV41_WGMMA 1  // emulator default; -DDSV41_WGMMA=0 builds the mma.sync consumers instead
#endif
#endif
#if DSV41_DEVICE && defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 900) && !DSV41_WGMMA && !defined(DSV41_FORCE_MMA_SYNC)
#error "sm_90 device code without wgmma: build for sm_90a (the 'a' target) or define DSV41_FORCE_MMA_SYNC"
#endif
constexpr bool kWgmma = DSV41_WGMMA != 0;


// The kernels' shared-memory base: the dynamic allocation rounded up to a 1024-byte boundary of
// the shared window (launches request kSmemAlign extra bytes; the emulator's base is aligned).
DEVFN char* align_smem(char* raw) {
  return raw + ((1024u - (smem_addr(raw) & 1023u)) & 1023u);
}

DEVFN uint64_t wgmma_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return (uint64_t)((addr & 0x3ffffu) >> 4) | ((uint64_t)((lbo >> 4) & 0x3fffu) << 16) |
         ((uint64_t)((sbo >> 4) & 0x3fffu) << 32) | (1ull << 62);
}
// The descriptor of `desc`'s operand moved by `off` bytes (a multiple of 16): one 32-bit add on the
// start-address field (bits 0..13 = address / 16), which cannot carry into the next field because
// shared memory is below 2^18 bytes. Built once per tile, the descriptors then cost one add per
// wgmma instead of the mask / shift / or of wgmma_desc (13 instructions per wgmma in the profile).
DEVFN uint64_t wgmma_desc_add(uint64_t desc, uint32_t off) {
  return (desc & 0xffffffff00000000ull) | (uint32_t)((uint32_t)desc + (off >> 4));
}
// `v`, opaque to the compiler's loop-invariant code motion: nvcc hoisted the per-k-step descriptors of a
// loop-invariant operand (Q) out of the tile loop and ptxas spilled them to local memory; recomputing
// each add next to its wgmma costs one instruction.
DEVFN uint64_t opaque_u64(uint64_t v) {
#if DSV41_DEVICE
  asm volatile("mov.b64 %0, %0;" : "+l"(v));
#endif
  return v;
}

// Generic-proxy shared-memory writes (st.shared) become visible to the async proxy (wgmma operand
// reads) once a thread that wrote them, or observed them through a barrier or mbarrier, executed this
// and then synchronised with the reader. A no-op where nothing reads shared memory through the async
// proxy (builds without wgmma), except fence_proxy_async_always (cp.async.bulk sources).
DEVFN void fence_proxy_async() {
#if DSV41_DEVICE && DSV41_WGMMA
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}
DEVFN void fence_proxy_async_always() {
#if DSV41_DEVICE
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}

#if DSV41_DEVICE && DSV41_WGMMA
DEVFN void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
DEVFN void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
// Waits until at most N of this warpgroup's committed wgmma groups are still in flight (in order).
template <int N>
DEVFN void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory"); }
// Keeps the compiler from moving accumulator reads/writes across the asynchronous wgmma.
template <int N>
DEVFN void reg_fence(float* d) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// Each wgmma below is one asm statement written once as a macro over its operand type TY ("f16" or
// "bf16", joined into the instruction by string-literal concatenation), instantiated per kBf16.
// d[16] += A[64x16] (K-major) * B[16x32] (K-major: 32 rows of n)
#define DSV41_WGMMA_M64N32K16(TY) \
  asm volatile( \
    "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n" \
    "wgmma.mma_async.sync.aligned.m64n32k16.f32." TY "." TY " {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, %16, %17, p, 1, 1, 0, 0;\n}\n" \
    : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]) \
    : "l"(da), "l"(db), "r"(1))
template <bool kBf16 = false>
DEVFN void wgmma_m64n32k16(float* d, uint64_t da, uint64_t db) {
  if constexpr (kBf16) DSV41_WGMMA_M64N32K16("bf16");
  else DSV41_WGMMA_M64N32K16("f16");
}
#undef DSV41_WGMMA_M64N32K16
// d[32] += A[64x16] * B[16x64] (both K-major from shared memory)
#define DSV41_WGMMA_M64N64K16(TY) \
  asm volatile( \
    "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n" \
    "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, %32, %33, p, 1, 1, 0, 0;\n}\n" \
    : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]) \
    : "l"(da), "l"(db), "r"(1))
template <bool kBf16 = false>
DEVFN void wgmma_m64n64k16(float* d, uint64_t da, uint64_t db) {
  if constexpr (kBf16) DSV41_WGMMA_M64N64K16("bf16");
  else DSV41_WGMMA_M64N64K16("f16");
}
#undef DSV41_WGMMA_M64N64K16
// d[8] += A[64x16] * B[16x16] (B K-major: 16 rows of n); kTa: A MN-major (transpose bit set: rows of A are
// 64 contiguous m per 128-B row of the layout, k along the rows), else K-major. f16 only (the narrow CTA).
template <bool kTa>
DEVFN void wgmma_m64n16k16_f16(float* d, uint64_t da, uint64_t db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7}, %8, %9, p, 1, 1, %11, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
      : "l"(da), "l"(db), "r"(1), "n"(kTa ? 1 : 0));
}
// d[16] += A[64x16] * B[16x32] (B K-major), A as wgmma_m64n16k16_f16's.
template <bool kTa>
DEVFN void wgmma_m64n32k16_f16(float* d, uint64_t da, uint64_t db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, "
      "%16, %17, p, 1, 1, %19, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "l"(da), "l"(db), "r"(1), "n"(kTa ? 1 : 0));
}
// d[128] += A[64x16] (K-major) * B[16x256] (MN-major: transpose bit set)
#define DSV41_WGMMA_M64N256K16_TB(TY) \
  asm volatile( \
    "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n" \
    "wgmma.mma_async.sync.aligned.m64n256k16.f32." TY "." TY " {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127}, %128, %129, p, 1, 1, 0, 1;\n}\n" \
    : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127]) \
    : "l"(da), "l"(db), "r"(1))
template <bool kBf16 = false>
DEVFN void wgmma_m64n256k16_tb(float* d, uint64_t da, uint64_t db) {
  if constexpr (kBf16) DSV41_WGMMA_M64N256K16_TB("bf16");
  else DSV41_WGMMA_M64N256K16_TB("f16");
}
#undef DSV41_WGMMA_M64N256K16_TB
// d[128] += A[64x16] * B[16x256] (MN-major: transpose bit set), A from registers: this thread's
// four f16x2 words of its warp's 16 rows, in the accumulator layout of m64nNk16 (a[0]: row g,
// k 2t..2t+1; a[1]: row g + 8, same k; a[2], a[3]: k + 8), i.e. two adjacent 8-column blocks of an
// m64nN accumulator packed by pack_f16x2 become one k-step's A (FlashAttention-3's P reuse).
#define DSV41_WGMMA_M64N256K16_RS_TB(TY) \
  asm volatile( \
    "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n" \
    "wgmma.mma_async.sync.aligned.m64n256k16.f32." TY "." TY " {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127}, {%128,%129,%130,%131}, %132, p, 1, 1, 1;\n}\n" \
    : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127]) \
    : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1))
template <bool kBf16 = false>
DEVFN void wgmma_m64n256k16_rs_tb(float* d, const uint32_t (&a)[4], uint64_t db) {
  if constexpr (kBf16) DSV41_WGMMA_M64N256K16_RS_TB("bf16");
  else DSV41_WGMMA_M64N256K16_RS_TB("f16");
}
#undef DSV41_WGMMA_M64N256K16_RS_TB
#else
DEVFN void wgmma_fence() {}
template <int N>
DEVFN void reg_fence(float*) {}
#if DSV41_DEVICE  // builds without wgmma (sm_100a, DSV41_FORCE_MMA_SYNC) never call these
DEVFN void wgmma_commit() {}
template <int N>
DEVFN void wgmma_wait() {}
template <bool kBf16 = false>
DEVFN void wgmma_m64n32k16(float*, uint64_t, uint64_t) { __trap(); }
template <bool kBf16 = false>
DEVFN void wgmma_m64n64k16(float*, uint64_t, uint64_t) { __trap(); }
template <bool kBf16 = false>
DEVFN void wgmma_m64n256k16_tb(float*, uint64_t, uint64_t) { __trap(); }
template <bool kBf16 = false>
DEVFN void wgmma_m64n256k16_rs_tb(float*, const uint32_t (&)[4], uint64_t) { __trap(); }
template <bool kTa>
DEVFN void wgmma_m64n16k16_f16(float*, uint64_t, uint64_t) { __trap(); }
template <bool kTa>
DEVFN void wgmma_m64n32k16_f16(float*, uint64_t, uint64_t) { __trap(); }
#else
namespace wgemu {
// Byte offset of element (row, col) of an operand described by `desc` (128-byte swizzle).
// kmajor: row = m or n, col = k in 0..15. mn-major: row = k in 0..15, col = n.
inline uint32_t elem_addr(uint64_t desc, int row, int col, bool kmajor) {
  const uint32_t start = (uint32_t)(desc & 0x3fffu) << 4;
  const uint32_t lbo = (uint32_t)((desc >> 16) & 0x3fffu) << 4;
  const uint32_t sbo = (uint32_t)((desc >> 32) & 0x3fffu) << 4;
  if ((desc >> 62) != 1u) emu::fail("wgmma emulation: only the 128-byte swizzle is modelled");
  if ((start >> 7) & 7u) emu::fail("wgmma: start address not in row 0 of a 1024-byte swizzle atom (base offset 0)");
  uint32_t a;
  if (kmajor) a = start + (uint32_t)(row >> 3) * sbo + (uint32_t)(row & 7) * 128u + 2u * (uint32_t)col;
  else a = start + (uint32_t)(col >> 6) * lbo + 2u * (uint32_t)(col & 63) + (uint32_t)(row & 7) * 128u +
           (uint32_t)(row >> 3) * sbo;
  a ^= ((a >> 7) & 7u) << 4;
  if (a + 2 > emu::cur_cta->smem_bytes) emu::fail("wgmma: operand outside the CTA's shared memory");
  return a;
}
inline float elem(uint64_t desc, int row, int col, bool kmajor, bool bf16) {
  uint16_t h;
  std::memcpy(&h, emu::cur_cta->smem + elem_addr(desc, row, col, kmajor), 2);
  return bf16 ? bf16_lo(h) : f16_to_f32(h);
}
// Checksum of the shared-memory bytes one warp's wgmma reads: its 16 rows of A (unless A comes
// from registers), all of B.
inline uint64_t operand_sum(uint64_t da, uint64_t db, int n, bool b_trans, bool a_reg, int wr, bool a_trans = false) {
  uint64_t h = 1469598103934665603ull;
  auto mix = [&](uint32_t a) {
    uint16_t x;
    std::memcpy(&x, emu::cur_cta->smem + a, 2);
    h = (h ^ x) * 1099511628211ull;
  };
  if (!a_reg)
    for (int r = 16 * wr; r < 16 * wr + 16; ++r)
      for (int k = 0; k < 16; ++k) mix(a_trans ? elem_addr(da, k, r, false) : elem_addr(da, r, k, true));
  for (int k = 0; k < 16; ++k)
    for (int c = 0; c < n; ++c) mix(b_trans ? elem_addr(db, k, c, false) : elem_addr(db, c, k, true));
  return h;
}
// One warp's share of m64nNk16: rows 16*(warp & 3) .. +15. Asynchronous like the hardware: the
// products are computed at issue (operands read now) but reach `d` only when their commit group is
// waited on (wgmma_wait<N>); until then d holds NaN, so reading an accumulator early shows up in
// the results, and the wait checks that no operand byte changed in between. Chained wgmmas on the
// same accumulator continue from its pending value (in the same group or in an earlier one still in
// flight, as PTX allows for one shape). areg: A from registers (each lane's four f16x2 words,
// wgmma_m64n256k16_rs_tb's layout), gathered from the warp's lanes; da is then unused.
// a_trans: A MN-major (the transpose bit of A; element (m, k) at the MN-major address of row k, column m).
inline void run(float* d, int n, uint64_t da, uint64_t db, bool b_trans, bool bf16, const uint32_t* areg = nullptr,
                bool a_trans = false) {
  struct In { uint64_t da, db; uint32_t a[4]; } in{areg ? 0 : da, db, {0, 0, 0, 0}};
  if (areg) std::memcpy(in.a, areg, sizeof in.a);
  const int lane = lane_idx(), wr = warp_idx() & 3;
  float ar[16][16] = {};  // register A: [row of the warp's 16][k]
  emu::warp_collective(emu::kTagWgmma, &in, sizeof in, [&](auto& dd) {
    for (int l = 0; l < 32; ++l) {
      In x;
      std::memcpy(&x, dd[l], sizeof x);
      if (x.da != in.da || x.db != in.db) emu::fail("wgmma: lanes of a warp passed different descriptors");
      if (!areg) continue;
      const int lg = l >> 2, lt = l & 3;
      for (int i = 0; i < 4; ++i) {
        const int r = lg + 8 * (i & 1), k = 2 * lt + 8 * (i >> 1);
        ar[r][k] = bf16 ? bf16_lo(x.a[i]) : f16_to_f32((uint16_t)(x.a[i] & 0xffffu));
        ar[r][k + 1] = bf16 ? bf16_hi(x.a[i]) : f16_to_f32((uint16_t)(x.a[i] >> 16));
      }
    }
  });
  auto& gs = emu::cur_fiber->wgmma_groups;
  if (gs.empty() || !gs.back().open) gs.emplace_back();
  auto& grp = gs.back();
  std::vector<float>* acc = nullptr;
  for (auto& a : grp.acc)
    if (a.d == d) acc = &a.v;
  if (!acc) {
    const std::vector<float>* prior = nullptr;  // the newest pending value of d in an earlier group
    for (size_t i = 0; i + 1 < gs.size(); ++i)
      for (auto& a : gs[i].acc)
        if (a.d == d) {
          if (a.v.size() != (size_t)n / 2) emu::fail("wgmma: chained onto an in-flight accumulator of another shape");
          prior = &a.v;
        }
    grp.acc.push_back({d, prior ? *prior : std::vector<float>(d, d + n / 2)});
    acc = &grp.acc.back().v;
  }
  const int g = lane >> 2, t = lane & 3;
  for (int nb = 0; nb < n / 8; ++nb)
    for (int e = 0; e < 4; ++e) {
      const int row = 16 * wr + g + 8 * (e >> 1), col = 8 * nb + 2 * t + (e & 1);
      float v = (*acc)[4 * nb + e];
      for (int k = 0; k < 16; ++k)
        v += (areg ? ar[row - 16 * wr][k] : a_trans ? elem(da, k, row, false, bf16) : elem(da, row, k, true, bf16)) *
             (b_trans ? elem(db, k, col, false, bf16) : elem(db, col, k, true, bf16));
      (*acc)[4 * nb + e] = v;
    }
  if (lane == 0)
    grp.reads.push_back(
        {da, db, n, b_trans, areg != nullptr, a_trans, operand_sum(da, db, n, b_trans, areg != nullptr, wr, a_trans)});
  for (int i = 0; i < n / 2; ++i) d[i] = NAN;
}
inline void commit() {  // with no wgmma since the last commit: an empty group (it counts for wait)
  auto& gs = emu::cur_fiber->wgmma_groups;
  if (gs.empty() || !gs.back().open) gs.emplace_back();
  gs.back().open = false;
}
inline void wait(int n_left) {
  auto& gs = emu::cur_fiber->wgmma_groups;
  int closed = 0;
  for (auto& g : gs) closed += g.open ? 0 : 1;
  const int wr = warp_idx() & 3;
  while (closed > n_left) {
    auto& g = gs.front();
    for (auto& r : g.reads)
      if (operand_sum(r.da, r.db, r.n, r.b_trans, r.a_reg, wr, r.a_trans) != r.sum)
        emu::fail("wgmma: a shared-memory operand changed while the wgmma was in flight");
    for (auto& a : g.acc) {
      bool later = false;  // a later group still in flight accumulates into d: it stays undefined
      for (size_t i = 1; i < gs.size(); ++i)
        for (auto& b : gs[i].acc) later = later || b.d == a.d;
      if (!later) std::memcpy(a.d, a.v.data(), a.v.size() * sizeof(float));
    }
    gs.erase(gs.begin());
    --closed;
  }
}
}  // namespace wgemu
inline void wgmma_commit() { wgemu::commit(); }
template <int N>
inline void wgmma_wait() { wgemu::wait(N); }
// kBf16: bf16 operands (else f16), as the device versions.
template <bool kBf16 = false>
inline void wgmma_m64n32k16(float* d, uint64_t da, uint64_t db) { wgemu::run(d, 32, da, db, false, kBf16); }
template <bool kBf16 = false>
inline void wgmma_m64n64k16(float* d, uint64_t da, uint64_t db) { wgemu::run(d, 64, da, db, false, kBf16); }
template <bool kBf16 = false>
inline void wgmma_m64n256k16_tb(float* d, uint64_t da, uint64_t db) { wgemu::run(d, 256, da, db, true, kBf16); }
template <bool kBf16 = false>
inline void wgmma_m64n256k16_rs_tb(float* d, const uint32_t (&a)[4], uint64_t db) {
  wgemu::run(d, 256, 0, db, true, kBf16, a);
}
template <bool kTa>
inline void wgmma_m64n16k16_f16(float* d, uint64_t da, uint64_t db) { wgemu::run(d, 16, da, db, false, false, nullptr, kTa); }
template <bool kTa>
inline void wgmma_m64n32k16_f16(float* d, uint64_t da, uint64_t db) { wgemu::run(d, 32, da, db, false, false, nullptr, kTa); }
#endif
#endif

}  // namespace dsv41
