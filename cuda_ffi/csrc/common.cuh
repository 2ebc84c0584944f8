// What every CTA of the kernels shares: named barriers, the swizzled tile layout, length and sink
// helpers.
#pragma once

#include "params.h"
#include "primitives.cuh"

namespace dsv41 {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Named barriers: the whole CTA, the 256 consumers, FULL b = 2 + b, EMPTY b = 4 + b.
enum : int { kBarCta = 0, kBarConsumers = 1, kBarFull0 = 2, kBarEmpty0 = 4 };
// Split consumers only (consume_tile_split): P[b] written (warpgroup 0 arrives, 1 syncs) and FULL b
// for warpgroup 1 (FULL b is then warpgroup 0's: each warpgroup waits for the tile
// on its own, so warpgroup 0 can start tile n + 1 while warpgroup 1 is still in tile n).
enum : int { kBarPReady0 = 6, kBarFullWg1_0 = 9 };
// A pair's split decode (AddrGen): warpgroup 1 has published the first tiles' addresses (warpgroup 1
// arrives, the producers sync; once per CTA).
enum : int { kBarAddr = 8 };
constexpr int kConsumerThreads = 32 * kConsumerWarps;  // 256

// Byte offset of 16-byte chunk `chunk` (dims 8*chunk..+7) of row `row` in a [64][512] f16 matrix
// (Q, a K/V tile): 8 column blocks of [64 rows][128 B], 128-byte swizzle (primitives.cuh, params.h).
DEVFN int swz128(int row, int chunk) { return row * 128 + ((chunk ^ (row & 7)) << 4); }
DEVFN int tile_off(int row, int chunk) { return (chunk >> 3) * 8192 + swz128(row, chunk & 7); }
DEVFN int clamp_len(int32_t len, int32_t topk) { return len < 0 ? 0 : (len > topk ? topk : len); }
// Row i's length clamped to [0, topk]: lengths[i * stride] (stride 0: one length for every row).
DEVFN int load_len(const int32_t* lengths, int32_t stride, int64_t i, int32_t topk) {
  return clamp_len(ldg_nc_s32(lengths + i * stride), topk);
}
// The sinks of head group `group` (nullptr: no sink).
DEVFN const float* group_sink(const float* sink, int group) {
  return sink ? sink + (int64_t)group * kHeadsPerCta : nullptr;
}
// The heads of 64-head group `group` that exist among h_q (64 but in a last, partial group).
DEVFN int group_rows(int h_q, int group) {
  const int left = h_q - group * kHeadsPerCta;
  return left < kHeadsPerCta ? left : kHeadsPerCta;
}

}  // namespace dsv41
