// The split planner on the device: the warp planner and the CTA planner (bit-identical plans).
#pragma once

#include "common.cuh"

namespace dsv41 {

// dsv41_jax.scheduler.plan_decode_splits (FlashMLA's greedy split planner) on the device, run
// before the decode kernel (same stream), writing the plan the decode CTAs read.
// blocks(i) = ceil(L / 64) with L = max(len_i, 1), or with an extra cache
// L = roundup(max(len_i, 1), 64) + extra_len_i; lengths clamped to [0, topk] as in the decode
// kernel (decode_segment counts the same blocks). Every part gets the budget
// ceil(sum_i(blocks(i) + ov) / parts) + ov, takes whole requests (blocks + ov) while they fit,
// then splits the next one when more than ov is left.
// Records: [begin_req, end_req, begin_blk, end_blk, begin_split, first_split, last_split, 0];
// num_splits[0] = 0, num_splits[i + 1] = cumulative pieces of requests 0..i (0 for requests
// no part reached, as in the JAX version). sum_i(blocks(i) + ov) < 2^30 (host_params.h, check_plan_cost).
//
// Two implementations, bit-identical: plan_cta (below; one CTA per plan, a serial walk of one shared-memory load
// per part) wherever its cost table fits in shared memory (host_params.h plan_smem_bytes), and plan_warp (one
// warp per plan) elsewhere. plan_warp's walk is serial over the parts but not over the requests: with
// C[i] = sum_{k<i}(blocks(k) + ov), a part starting at block blk of request r may reach the cost position
// T = C[r] + blk + budget, and takes whole every request j with C[j + 1] <= T (the greedy's "fits" test, summed),
// so one ballot over a 32-request window of C (lane l holds C[base + l + 1], a warp scan) finds where it ends; the
// rest of the budget, less ov, splits the next request. Each completed request i gets num_splits[i + 1] =
// i + 1 + (splits so far) from its own lane. The serial loop keeps only that recurrence and leaves each part's end
// state in its record; the records are then written 32 parts at a time, each lane taking its part's start from the
// part before.
// Request i's lengths, clamped (0 past b).
DEVFN void plan_load(const PlanParams& p, int i, int32_t& len, int32_t& elen) {
  len = 0;
  elen = 0;
  if (i < p.b) {
    len = load_len(p.lengths, p.lengths_stride, i, p.topk);
    if (p.has_extra) elen = load_len(p.extra_lengths, p.extra_lengths_stride, i, p.extra_topk);
  }
}

DEVFN int plan_blocks(const PlanParams& p, int32_t len, int32_t elen) {
  int l = len == 0 ? 1 : len;
  if (p.has_extra) l = (l + kTileTokens - 1) / kTileTokens * kTileTokens + elen;
  return (l - 1) / kTileTokens + 1;
}

// C[base + lane + 1] of the window base.. (cbase = C[base]; INT_MAX past b, so those never fit).
DEVFN int plan_window_cost(const PlanParams& p, int base, int cbase, int nblk, int lane) {
  const bool in = base + lane < p.b;
  int v = in ? nblk + p.fixed_overhead : 0;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int t = (int)shfl_idx_u32((uint32_t)v, lane >= d ? lane - d : 0);
    if (lane >= d) v += t;
  }
  return in ? cbase + v : 0x7fffffff;
}

// One record: request range, block range, split index, and whether the first / last request is split (one
// request: either); end_nblk = blocks(end_req), so the last request is split iff the part stops inside it.
DEVFN void plan_write_record(int32_t* dst, int begin_req, int end_req, int begin_blk, int end_blk, int end_nblk,
                             int begin_split) {
  int first = begin_blk != 0 ? 1 : 0, last = end_blk != end_nblk ? 1 : 0;
  if (begin_req == end_req) first = last = (first | last);
  const int32_t row[8] = {begin_req, end_req, begin_blk, end_blk, begin_split, first, last, 0};
#pragma unroll
  for (int f = 0; f < 8; ++f) dst[f] = row[f];
}

DEVFN void plan_warp(const PlanParams& p, int lane) {
  const int b = p.b, parts = p.num_parts, ov = p.fixed_overhead;
  // ---- total = sum(blocks + ov), payload per part
  uint32_t total = 0;
#pragma unroll 4
  for (int i = lane; i < b; i += 32) {
    int32_t l, e;
    plan_load(p, i, l, e);
    total += (uint32_t)(plan_blocks(p, l, e) + ov);
  }
#pragma unroll
  for (int m = 16; m; m >>= 1) total += shfl_xor_u32(total, m);
  const int payload = ((int)total + parts - 1) / parts + ov;

  // ---- the window: requests base .. base + 31, the next window's lengths loaded one window ahead
  int32_t cl, ce, nl, ne;
  plan_load(p, lane, cl, ce);
  plan_load(p, 32 + lane, nl, ne);
  int base = 0, cbase = 0;
  int nblk = plan_blocks(p, cl, ce);                          // blocks(base + lane)
  int cin = plan_window_cost(p, base, cbase, nblk, lane);     // C[base + lane + 1]
  int nb_before = (int)shfl_idx_u32((uint32_t)nblk, 0);       // blocks(base - 1); blocks(0) in the first window
  // ---- the walk, serial over the parts and kept to the recurrence: the position x = C[req] + blk, the current
  // request, its splits so far, all splits so far. Each part's end state goes to fields 4..7 of its record (scratch
  // until the records are written below): the request j it ends in, the block it ends at (0: at j's start), the
  // blocks of the request the record's end_blk / last_split need, and its begin_split.
  int x = 0, req = 0, nsplit = 0, splits = 0;
  if (lane == 0) p.num_splits[0] = 0;
  for (int part = 0; part < parts; ++part) {
    const int begin_split = nsplit;
    int j = req, cj = x;  // (req == b: nothing left, x = C[b])
    if (req < b) {
      const int reach = x + payload;  // T
      int cnt;
      for (;;) {
        cnt = popc32(ballot(cin <= reach));  // requests base .. base + cnt - 1 end by T
        j = base + cnt;
        if (base + lane >= req && base + lane < j) p.num_splits[base + lane + 1] = base + lane + 1 + splits;
        if (cnt < 32 || base + 32 >= b) break;
        nb_before = (int)shfl_idx_u32((uint32_t)nblk, 31);  // the window is used up: the next one
        cbase = (int)shfl_idx_u32((uint32_t)cin, 31);
        base += 32;
        nblk = plan_blocks(p, nl, ne);
        plan_load(p, base + 32 + lane, nl, ne);
        cin = plan_window_cost(p, base, cbase, nblk, lane);
      }
      const int c = (int)shfl_idx_u32((uint32_t)cin, cnt > 0 ? cnt - 1 : 0);
      cj = cnt > 0 ? c : cbase;                                  // C[j]
      const bool split = j < b && reach - (x > cj ? x : cj) > ov;  // more than ov left for request j
      x = split ? reach - ov : cj;
      nsplit = split ? (j > req ? 1 : nsplit + 1) : 0;
      splits += split ? 1 : 0;
      req = j;
    }
    const int blk = x - cj;
    const int bi = blk > 0 ? j - base : j - base - 1;  // blocks(j) when split, else blocks(j - 1)
    const int bv = (int)shfl_idx_u32((uint32_t)nblk, bi > 0 ? bi : 0);
    if (lane == 0) {
      int32_t* row = p.sched + (int64_t)part * 8;
      row[4] = j;
      row[5] = blk;
      row[6] = bi >= 0 ? bv : nb_before;
      row[7] = begin_split;
    }
  }
  for (int i = req + 1 + lane; i <= b; i += 32) p.num_splits[i] = 0;
  syncwarp();  // (orders lane 0's scratch before the other lanes read it)
  // ---- the records, 32 parts at a time: part k begins where part k - 1 ended
  int pj = 0, pblk = 0;
  for (int k0 = 0; k0 < parts; k0 += 32) {
    const int k = k0 + lane;
    int32_t* row = p.sched + (int64_t)k * 8;
    int j = 0, blk = 0, nb = 0, bsplit = 0;
    if (k < parts) {
      j = row[4];
      blk = row[5];
      nb = row[6];
      bsplit = row[7];
    }
    const int qj = (int)shfl_idx_u32((uint32_t)j, lane > 0 ? lane - 1 : 0);
    const int qb = (int)shfl_idx_u32((uint32_t)blk, lane > 0 ? lane - 1 : 0);
    const int begin_req = lane > 0 ? qj : pj, begin_blk = lane > 0 ? qb : pblk;
    pj = (int)shfl_idx_u32((uint32_t)j, 31);
    pblk = (int)shfl_idx_u32((uint32_t)blk, 31);
    syncwarp();  // every read of these rows before any write
    if (k < parts) plan_write_record(row, begin_req, blk > 0 ? j : j - 1, begin_blk, blk > 0 ? blk : nb, nb, bsplit);
  }
}

// ---- the planner of one CTA per plan (PlanBatch::smem_bytes > 0; the warp planner above otherwise)
// With C[i] = sum_{k<i}(blocks(k) + ov) and D = ceil(C[b] / parts), a part starting at cost position x ends at
//   N(x) = min(C[b], max(x + D, floorC(x + D + ov))),
// floorC(y) = max{C[i] <= y}: the greedy takes whole every request ending by x + D + ov, and splits the next one at
// x + D unless that leaves it ov or less. Part k covers [X[k], X[k + 1]) with X[k] = N^k(0). N is a table over the
// positions [0, C[b]] (built from delta[y] = y - floorC(y)), and so is N^kPlanStride, so one thread walks only
// every kPlanStride-th part and the CTA fills in the others; everything else (the cost scan, the tables, the
// records, num_splits) runs on the whole CTA. The result is bit-identical to the warp planner and to
// plan_decode_splits. Shared memory (host_params.h plan_smem_bytes): C [b + 1], X, R (the request each X lies in)
// and S (split points among X[1..k]) [parts + 1] each, 32 of scan scratch, N [C[b] + 1], and one more table of
// C[b] + 1 int32 holding first delta (uint16), then N^kPlanStride; all int32.
constexpr int kPlanBar = 0;
constexpr int kPlanStride = 8;

// Largest i in [0, n) with a[i] <= v (a non-decreasing, a[0] <= v).
DEVFN int plan_last_le(const int32_t* a, int n, int v) {
  int lo = 0, hi = n - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (a[mid] <= v) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

// a[0..n) <- its inclusive prefix sums (shared memory; every thread of the CTA calls it; ends with a barrier).
DEVFN void cta_inclusive_scan(int32_t* a, int n, int32_t* scratch) {
  constexpr int kWarps = kPlanCtaThreads / 32;
  const int tid = thread_idx(), lane = lane_idx(), warp = warp_idx();
  const int chunk = (n + kPlanCtaThreads - 1) / kPlanCtaThreads;
  const int lo = tid * chunk < n ? tid * chunk : n, hi = lo + chunk < n ? lo + chunk : n;
  int sum = 0;
  for (int i = lo; i < hi; ++i) sum += a[i];
  int inc = sum;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int t = (int)shfl_idx_u32((uint32_t)inc, lane >= d ? lane - d : 0);
    if (lane >= d) inc += t;
  }
  if (lane == 31) scratch[warp] = inc;
  bar_sync(kPlanBar, kPlanCtaThreads);
  int off = inc - sum;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) off += w < warp ? scratch[w] : 0;
  for (int i = lo; i < hi; ++i) {
    off += a[i];
    a[i] = off;
  }
  bar_sync(kPlanBar, kPlanCtaThreads);
}

DEVFN void plan_cta(const PlanParams& p, char* smem) {
  const int b = p.b, parts = p.num_parts, ov = p.fixed_overhead;
  const int tid = thread_idx(), lane = lane_idx(), warp = warp_idx();
  constexpr int kWarps = kPlanCtaThreads / 32;
  int32_t* C = reinterpret_cast<int32_t*>(smem);
  int32_t* X = C + (b + 1);
  int32_t* R = X + (parts + 1);
  int32_t* S = R + (parts + 1);
  int32_t* scratch = S + (parts + 1);
  int32_t* N = scratch + 32;
  // ---- costs and their prefix sums C
  for (int i = tid; i < b; i += kPlanCtaThreads) {
    int32_t l, e;
    plan_load(p, i, l, e);
    C[i + 1] = plan_blocks(p, l, e) + ov;
  }
  if (tid == 0) C[0] = 0;
  bar_sync(kPlanBar, kPlanCtaThreads);
  cta_inclusive_scan(C + 1, b, scratch);
  const int total = C[b], D = (total + parts - 1) / parts;
  int32_t* NS = N + (total + 1);  // delta (uint16), then N^kPlanStride
  uint16_t* delta = reinterpret_cast<uint16_t*>(NS);
  // ---- delta[C[r] + j] = j for j < blocks(r) + ov; delta[C[b]] = 0
  for (int r = warp; r < b; r += kWarps) {
    const int base = C[r], cost = C[r + 1] - base;
    for (int j = lane; j < cost; j += 32) delta[base + j] = (uint16_t)j;
  }
  if (tid == 0) delta[total] = 0;
  bar_sync(kPlanBar, kPlanCtaThreads);
  for (int x = tid; x <= total; x += kPlanCtaThreads) {
    const int y = x + D;
    const int z = y + ov < total ? y + ov : total;
    const int f = z - (int)delta[z];
    const int m = y > f ? y : f;
    N[x] = m < total ? m : total;
  }
  bar_sync(kPlanBar, kPlanCtaThreads);
  // ---- N^kPlanStride, four positions at a time (their chains of loads interleave)
  for (int x0 = tid; x0 <= total; x0 += 4 * kPlanCtaThreads) {
    int y[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) y[u] = x0 + u * kPlanCtaThreads <= total ? x0 + u * kPlanCtaThreads : total;
#pragma unroll
    for (int t = 0; t < kPlanStride; ++t)
#pragma unroll
      for (int u = 0; u < 4; ++u) y[u] = N[y[u]];
#pragma unroll
    for (int u = 0; u < 4; ++u)
      if (x0 + u * kPlanCtaThreads <= total) NS[x0 + u * kPlanCtaThreads] = y[u];
  }
  bar_sync(kPlanBar, kPlanCtaThreads);
  // ---- the walk over every kPlanStride-th part, then the parts between
  if (tid == 0) {
    int x = 0;
    X[0] = 0;
    for (int k = kPlanStride; k <= parts; k += kPlanStride) {
      x = NS[x];
      X[k] = x;
    }
  }
  bar_sync(kPlanBar, kPlanCtaThreads);
  for (int k = tid; k <= parts; k += kPlanCtaThreads) {
    const int j = k % kPlanStride;
    if (j == 0) continue;
    int x = X[k - j];
    for (int t = 0; t < j; ++t) x = N[x];
    X[k] = x;
  }
  bar_sync(kPlanBar, kPlanCtaThreads);
  // ---- the request of each X, and whether it splits one
  for (int k = tid; k <= parts; k += kPlanCtaThreads) {
    const int x = X[k];
    const int r = plan_last_le(C, b + 1, x);
    R[k] = r;
    S[k] = x < total && x != C[r] ? 1 : 0;
  }
  bar_sync(kPlanBar, kPlanCtaThreads);
  cta_inclusive_scan(S, parts + 1, scratch);
  // ---- the records (a part starting at C[b] is empty: begin past end, as the greedy leaves it)
  for (int k = tid; k < parts; k += kPlanCtaThreads) {
    const int x0 = X[k], x1 = X[k + 1];
    const bool empty = x0 >= total;
    const int r0 = empty ? b : R[k], bb = empty ? 0 : x0 - C[r0];
    const int bs = bb == 0 ? 0 : S[k] - S[plan_last_le(X, parts + 1, C[r0])];
    const int r1 = empty ? b : R[k + 1];
    const bool at_start = x1 == C[r1];  // (x1 == C[b] included)
    const int er = at_start ? r1 - 1 : r1;
    const int nb = C[er + 1] - C[er] - ov;
    plan_write_record(p.sched + (int64_t)k * 8, r0, er, bb, at_start ? nb : x1 - C[r1], nb, bs);
  }
  // ---- num_splits[r + 1] = r + 1 + (split points before request r's end)
  if (tid == 0) p.num_splits[0] = 0;
  for (int r = tid; r < b; r += kPlanCtaThreads)
    p.num_splits[r + 1] = r + 1 + S[plan_last_le(X, parts + 1, C[r + 1] - 1)];
}

}  // namespace dsv41
