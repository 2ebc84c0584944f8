// Thin wrappers over the few GPU instructions the dsv41 kernels use.
//
// Two back ends with one interface:
//  * device (nvcc, no DSV41_EMULATE): inline PTX / CUDA intrinsics;
//  * host emulation (any C++17 compiler with DSV41_EMULATE): every CUDA thread is a fiber of
//    emu_runtime.h; warp-collective instructions (ldmatrix, mma.sync, shfl, ballot) exchange
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
using emu::float2;
using emu::float4;
#endif

DEVFN uint4 make_u4(uint32_t x, uint32_t y, uint32_t z, uint32_t w) {
  uint4 r;
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
#else
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
DEVFN int64_t shfl_idx_i64(int64_t v, int src) {
  uint32_t lo = shfl_idx_u32((uint32_t)(uint64_t)v, src);
  uint32_t hi = shfl_idx_u32((uint32_t)((uint64_t)v >> 32), src);
  return (int64_t)(((uint64_t)hi << 32) | lo);
}

// ------------------------------------------------------------------------------ global loads
// Read-only (non-coherent) loads: only for buffers nothing writes during the kernel.
#if DSV41_DEVICE
DEVFN uint4 ldg_nc_v4(const void* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }
DEVFN uint32_t ldg_nc_u8(const void* p) { return (uint32_t)__ldg(reinterpret_cast<const unsigned char*>(p)); }
DEVFN int32_t ldg_nc_s32(const int32_t* p) { return __ldg(p); }
DEVFN float ldg_nc_f32(const float* p) { return __ldg(p); }
#else
inline uint4 ldg_nc_v4(const void* p) { uint4 r; std::memcpy(&r, p, 16); return r; }
inline uint32_t ldg_nc_u8(const void* p) { return *reinterpret_cast<const unsigned char*>(p); }
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

// Two e4m3 (OCP fp8, finite-only "fn" variant) in one 16-bit word -> two f32; the low byte is
// the first element. Exact: e4m3 values are representable in f16 and f32.
DEVFN float2 e4m3x2_to_f32x2(uint32_t two_bytes) {
  float2 r;
#if DSV41_DEVICE
  uint32_t h2;
  unsigned short in = (unsigned short)(two_bytes & 0xffffu);
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(in));
  unsigned short lo = (unsigned short)(h2 & 0xffffu), hi = (unsigned short)(h2 >> 16);
  float flo, fhi;
  asm("cvt.f32.f16 %0, %1;" : "=f"(flo) : "h"(lo));
  asm("cvt.f32.f16 %0, %1;" : "=f"(fhi) : "h"(hi));
  r.x = flo; r.y = fhi;
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

DEVFN float fexp2(float x) {
#if DSV41_DEVICE
  return exp2f(x);
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
#if DSV41_DEVICE
DEVFN uint32_t smem_u32(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }
#endif

// ldmatrix.sync.aligned.m8n8.x4.shared.b16: lanes 8i..8i+7 give the row addresses (16 B each)
// of 8x8 b16 matrix i; lane l receives r[i] = {M_i[l/4][2(l%4)], M_i[l/4][2(l%4)+1]} (first
// element in the low half).
DEVFN void ldsm_x4(uint32_t r[4], const void* row_addr) {
#if DSV41_DEVICE
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(row_addr)));
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
// .trans variant: lane l receives r[i] = {M_i[2(l%4)][l/4], M_i[2(l%4)+1][l/4]}.
DEVFN void ldsm_x4_trans(uint32_t r[4], const void* row_addr) {
#if DSV41_DEVICE
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(row_addr)));
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

// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32, d += A * B.
// With g = lane / 4 and t = lane % 4 (pairs: first element in the low half):
//   A (16x16, row major): a[0] = A[g][2t..2t+1],   a[1] = A[g+8][2t..2t+1],
//                         a[2] = A[g][2t+8..2t+9], a[3] = A[g+8][2t+8..2t+9]
//   B (16x8, k x n):      b[0] = B[2t..2t+1][g],   b[1] = B[2t+8..2t+9][g]
//   C/D (16x8, f32):      d[0] = C[g][2t], d[1] = C[g][2t+1], d[2] = C[g+8][2t], d[3] = C[g+8][2t+1]
DEVFN void mma_bf16_16816(float d[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
#if DSV41_DEVICE
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
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
      A[g][2 * t] = bf16_lo(x.a[0]);     A[g][2 * t + 1] = bf16_hi(x.a[0]);
      A[g + 8][2 * t] = bf16_lo(x.a[1]); A[g + 8][2 * t + 1] = bf16_hi(x.a[1]);
      A[g][2 * t + 8] = bf16_lo(x.a[2]); A[g][2 * t + 9] = bf16_hi(x.a[2]);
      A[g + 8][2 * t + 8] = bf16_lo(x.a[3]); A[g + 8][2 * t + 9] = bf16_hi(x.a[3]);
      B[2 * t][g] = bf16_lo(x.b[0]);     B[2 * t + 1][g] = bf16_hi(x.b[0]);
      B[2 * t + 8][g] = bf16_lo(x.b[1]); B[2 * t + 9][g] = bf16_hi(x.b[1]);
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

}  // namespace dsv41
