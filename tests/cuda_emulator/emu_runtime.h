// A small cooperative emulator of CUDA thread blocks on the host, for testing the kernels of
// kernels.cuh on machines without a GPU (tests/cuda_emulator/build.py builds it with g++).
//
// Every CUDA thread is a fiber (ucontext). Fibers switch only at synchronisation points:
// named barriers (bar.sync / bar.arrive) and warp collectives (ldmatrix, mma.sync, shfl,
// ballot, __syncwarp). The scheduler resumes the fibers in a fresh random order every round,
// so a missing barrier between a writer and a reader in different warps shows up as a wrong
// result. Checks that abort with a message: a warp whose lanes reach different collectives
// (divergence), a thread arriving twice at one barrier phase, a barrier used with different
// thread counts, and deadlock (a full round without progress). Thread blocks run one after
// another on each of a few OS threads (blocks of one launch are independent, as on a GPU).
// Clusters: the CTAs of one cluster run together under one scheduler (their fibers interleave),
// with shared-memory mbarriers (arrival counts, transaction bytes, phases), distributed-shared-
// memory stores and arrivals addressed as (rank << 24 | offset), and the cluster barrier.
// (cp.async.bulk copies between CTAs are modelled as one st.async of the source bytes, read at issue.)
// Each st.async store lands at once or is held back until somebody waits on its mbarrier (a coin
// flip per store), and now and then one CTA of a cluster is stalled for a few scheduling rounds
// (released early when nothing else can progress), so a reader that skips a wait sees stale data
// and a writer that skips one overwrites data still in use. Checked: an mbarrier used before initialisation, more arrivals than its
// count in one phase, remote access to a CTA whose threads all exited, st.async stores nobody
// waited for, and, in a cluster with remote traffic, a thread whose last synchronisation was not
// a cluster barrier (a CTA may not exit while its peer can still write into it).
#pragma once

#include <ucontext.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <random>
#include <thread>
#include <utility>
#include <vector>

// Context switch. On x86-64 a hand-written switch (callee-saved registers, MXCSR and the x87
// control word; no system call), elsewhere ucontext (much slower: it saves the signal mask).
#if defined(__x86_64__) && !defined(DSV41_EMU_UCONTEXT)
#define DSV41_EMU_FAST_SWITCH 1
extern "C" void dsv41_emu_switch(void** save_sp, void* new_sp);
__asm__(
    ".text\n"
    ".weak dsv41_emu_switch\n"
    ".hidden dsv41_emu_switch\n"
    ".type dsv41_emu_switch,@function\n"
    "dsv41_emu_switch:\n"
    "  pushq %rbp\n  pushq %rbx\n  pushq %r12\n  pushq %r13\n  pushq %r14\n  pushq %r15\n"
    "  subq $8, %rsp\n  stmxcsr (%rsp)\n  fnstcw 4(%rsp)\n"
    "  movq %rsp, (%rdi)\n  movq %rsi, %rsp\n"
    "  ldmxcsr (%rsp)\n  fldcw 4(%rsp)\n  addq $8, %rsp\n"
    "  popq %r15\n  popq %r14\n  popq %r13\n  popq %r12\n  popq %rbx\n  popq %rbp\n"
    "  ret\n"
    ".size dsv41_emu_switch, .-dsv41_emu_switch\n");
#else
#define DSV41_EMU_FAST_SWITCH 0
#endif

namespace emu {

struct alignas(16) uint4 { uint32_t x, y, z, w; };
struct alignas(8) uint2 { uint32_t x, y; };
struct alignas(8) float2 { float x, y; };
struct alignas(16) float4 { float x, y, z, w; };

enum : int { kTagSyncwarp = 1, kTagShfl, kTagBallot, kTagLdsm, kTagLdsmT, kTagMma, kTagWgmma, kTagStsm };

struct Cta;
struct Cluster;

// A shared-memory mbarrier: `count` arrivals complete the current phase.
// A phase completes when `count` arrivals were made and the transaction count (bytes expected by
// arrive.expect_tx minus bytes completed by st.async) is back to 0.
struct MBar {
  int count = 0;
  int pending = 0;
  int64_t tx = 0;
  uint64_t phase = 0;  // completed phases
};

struct Fiber {
  ucontext_t ctx;
  void* sp = nullptr;  // saved stack pointer (fast switch)
  int tid = 0;
  bool done = false;
  // wgmmas not yet waited on, by commit group (oldest first; only the last may still be open): the
  // values their accumulators will hold, and a checksum of the shared-memory operands each read at
  // issue, compared again at the wait (an operand overwritten while in flight fails there).
  struct WgAcc {
    float* d;
    std::vector<float> v;
  };
  struct WgRead {
    uint64_t da, db;
    int n;
    bool b_trans;
    bool a_reg;  // A from registers: only B's bytes are summed
    bool a_trans;  // A MN-major
    uint64_t sum;
  };
  struct WgGroup {
    bool open = true;
    std::vector<WgAcc> acc;
    std::vector<WgRead> reads;
  };
  std::vector<WgGroup> wgmma_groups;
  bool cluster_synced = false;  // the last synchronisation was a cluster barrier
  // cp.async copies whose completion no mbarrier tracks yet: their destinations hold 0xff bytes
  // (f16 / bf16 NaN) until they land, so a read before the tracking mbarrier's phase shows up
  struct CpAsync {
    uint32_t saddr;
    const void* src;
    uint32_t src_bytes;
  };
  std::vector<CpAsync> cp_async;
};

struct Bar {
  int arrived = 0;
  int expected = 0;
  uint64_t gen = 0;
  std::vector<uint8_t> here;  // per thread: arrived in the current phase
};

struct WarpSlot {
  uint64_t gen = 0;
  int arrived = 0;
  int tag[2] = {0, 0};
  alignas(16) unsigned char data[2][32][64];
};

struct Cta {
  int nthreads = 0;
  int64_t block = 0;
  char* smem = nullptr;
  size_t smem_bytes = 0;
  std::vector<Fiber> fibers;
  std::vector<char*> stacks;
  size_t stack_bytes = 0;
  Bar bars[16];
  std::vector<WarpSlot> warps;
  ucontext_t sched;
  void* sched_sp = nullptr;
  uint64_t progress = 0;
  std::mt19937_64 rng;
  const std::function<void(char*)>* body = nullptr;
  int rank = 0;                      // in its cluster
  Cluster* cluster = nullptr;
  bool exited = false;               // every thread finished
  std::map<uint32_t, MBar> mbars;    // by shared-memory offset
};

// An st.async store not yet performed: bytes for (rank << 24 | off), completing on mbarrier `bar`.
struct AsyncStore {
  uint32_t caddr, bar;
  std::vector<char> bytes;
};

struct Cluster {
  std::vector<Cta*> ctas;
  Bar bar;  // barrier.cluster over every thread of every CTA
  bool remote_traffic = false;
  std::vector<AsyncStore> pending;
};

inline thread_local Cta* cur_cta = nullptr;
inline thread_local Fiber* cur_fiber = nullptr;

[[noreturn]] inline void fail(const char* what) {
  std::fprintf(stderr, "emu: %s (block %lld, thread %d)\n", what, (long long)(cur_cta ? cur_cta->block : -1),
               cur_fiber ? cur_fiber->tid : -1);
  std::fflush(stderr);
  std::abort();
}

inline void yield() {
#if DSV41_EMU_FAST_SWITCH
  dsv41_emu_switch(&cur_fiber->sp, cur_cta->sched_sp);
#else
  swapcontext(&cur_fiber->ctx, &cur_cta->sched);
#endif
}

// Arrival of slot `who` (of `slots`) at `b`; the n-th arrival completes the phase.
inline void bar_count(Bar& b, int n, int who, int slots) {
  if ((int)b.here.size() != slots) b.here.assign(slots, 0);
  if (b.here[who]) fail("thread arrived twice at one barrier phase");
  b.here[who] = 1;
  ++cur_cta->progress;
  if (++b.arrived == n) {
    b.arrived = 0;
    ++b.gen;
    std::fill(b.here.begin(), b.here.end(), 0);
  }
}

inline void bar_arrive_impl(int id, int n) {
  Cta* c = cur_cta;
  cur_fiber->cluster_synced = false;
  if (id < 0 || id >= 16) fail("barrier id out of range");
  if (n <= 0 || n % 32 || n > c->nthreads) fail("barrier thread count must be a positive multiple of 32 <= block size");
  Bar& b = c->bars[id];
  if (b.arrived == 0) b.expected = n;
  else if (b.expected != n) fail("barrier used with two different thread counts in one phase");
  bar_count(b, n, cur_fiber->tid, c->nthreads);
}

inline void bar_arrive(int id, int n) {
  bar_arrive_impl(id, n);
  yield();  // let others run: arrive never waits, but interleavings should vary
}

inline void bar_sync(int id, int n) {
  Bar& b = cur_cta->bars[id];
  uint64_t g = b.gen;
  bar_arrive_impl(id, n);
  while (b.gen == g) yield();
}

// cp.async.cg (16 bytes, global -> this CTA's shared memory; src_bytes < 16 zero-fills the rest).
inline void cp_async(uint32_t saddr, const void* src, uint32_t src_bytes) {
  if (saddr & 15u) fail("cp.async: shared-memory address must be 16-byte aligned");
  if (saddr + 16 > cur_cta->smem_bytes) fail("cp.async: destination outside the CTA's shared memory");
  if (src_bytes > 16) fail("cp.async: src-size above the copy size");
  if (src_bytes && (reinterpret_cast<uintptr_t>(src) & 15u)) fail("cp.async: global address must be 16-byte aligned");
  std::memset(cur_cta->smem + saddr, 0xff, 16);
  cur_fiber->cp_async.push_back({saddr, src, src_bytes});
}

// ---- clusters
inline Cta* cluster_cta(uint32_t caddr) {
  Cluster* cl = cur_cta->cluster;
  const uint32_t rank = caddr >> 24;
  if (!cl || rank >= cl->ctas.size()) fail("shared::cluster address names a CTA outside the cluster");
  Cta* t = cl->ctas[rank];
  if (t->exited) fail("access to the shared memory of a CTA that has exited");
  cur_fiber->cluster_synced = false;
  if (t != cur_cta) cl->remote_traffic = true;
  return t;
}

inline void cluster_sync() {
  Cluster* cl = cur_cta->cluster;
  const int n = (int)cl->ctas.size() * cur_cta->nthreads;
  Bar& b = cl->bar;
  const uint64_t g = b.gen;
  bar_count(b, n, cur_cta->rank * cur_cta->nthreads + cur_fiber->tid, n);
  while (b.gen == g) yield();
  cur_fiber->cluster_synced = true;
}

inline void mbar_init(uint32_t off, int count) {
  if (count <= 0) fail("mbarrier initialised with a count <= 0");
  if (off & 7u) fail("mbarrier not 8-byte aligned");
  cur_cta->mbars[off] = MBar{count, 0, 0, 0};
}

inline MBar& mbar_at(Cta* c, uint32_t off) {
  auto it = c->mbars.find(off);
  if (it == c->mbars.end()) fail("mbarrier used before it was initialised");
  return it->second;
}

inline uint32_t cluster_self() { return (uint32_t)cur_cta->rank << 24; }

inline void mbar_try_complete(MBar& m) {
  if (m.pending == m.count && m.tx == 0) {
    m.pending = 0;
    ++m.phase;
  }
}

// One arrival (expecting `tx_bytes` more bytes of asynchronous stores in this phase).
inline void mbar_arrive(uint32_t caddr, uint32_t tx_bytes = 0) {
  Cta* t = cluster_cta(caddr);
  MBar& m = mbar_at(t, caddr & 0xffffffu);
  ++cur_cta->progress;
  if (m.pending >= m.count) fail("mbarrier: more arrivals than its count in one phase");
  ++m.pending;
  m.tx += tx_bytes;
  mbar_try_complete(m);
  yield();
}

inline void st_cluster(uint32_t caddr, const void* v, size_t n) {
  Cta* t = cluster_cta(caddr);
  const uint32_t off = caddr & 0xffffffu;
  if (off + n > t->smem_bytes) fail("shared::cluster store outside the target CTA's shared memory");
  std::memcpy(t->smem + off, v, n);
}

// An st.async store taking effect: the bytes, then complete_tx of their size on mbarrier `m`.
inline void land_async(uint32_t caddr, const void* v, size_t n, MBar& m) {
  st_cluster(caddr, v, n);
  m.tx -= (int64_t)n;
  mbar_try_complete(m);
}

// Performs the held-back st.async stores that complete on this CTA's mbarrier at `off`.
inline void flush_async(uint32_t off) {
  const uint32_t bar = cluster_self() | off;
  auto& q = cur_cta->cluster->pending;
  for (size_t i = 0; i < q.size();) {
    if (q[i].bar != bar) {
      ++i;
      continue;
    }
    land_async(q[i].caddr, q[i].bytes.data(), q[i].bytes.size(), mbar_at(cur_cta, off));
    q.erase(q.begin() + (std::ptrdiff_t)i);
  }
}

// Returns once the phase with parity `parity` of this CTA's mbarrier at `off` has completed. Held-back
// stores on that barrier land only while the wait would block.
inline void mbar_wait(uint32_t off, uint32_t parity) {
  MBar& m = mbar_at(cur_cta, off);
  cur_fiber->cluster_synced = false;
  while ((uint32_t)(m.phase & 1u) == (parity & 1u)) {
    flush_async(off);
    if ((uint32_t)(m.phase & 1u) != (parity & 1u)) break;
    yield();
  }
  ++cur_cta->progress;
}

// cp.async.mbarrier.arrive.noinc: this thread's earlier copies land, then one arrival on this CTA's
// mbarrier at `off` (counted against its expected count).
inline void cp_async_arrive_noinc(uint32_t off) {
  for (const auto& c : cur_fiber->cp_async) {
    std::memset(cur_cta->smem + c.saddr, 0, 16);
    if (c.src_bytes) std::memcpy(cur_cta->smem + c.saddr, c.src, c.src_bytes);
  }
  cur_fiber->cp_async.clear();
  mbar_arrive(cluster_self() | off);
}

// st.async: the store and the complete_tx of its size on mbarrier `cbar` of the destination CTA,
// now or (coin flip) once a thread of that CTA waits on `cbar` (flush_async).
inline void st_async(uint32_t caddr, const void* v, size_t n, uint32_t cbar) {
  if ((caddr >> 24) != (cbar >> 24)) fail("st.async: the mbarrier must be in the destination CTA");
  Cta* t = cluster_cta(caddr);
  if ((caddr & 0xffffffu) + n > t->smem_bytes) fail("st.async outside the target CTA's shared memory");
  MBar& m = mbar_at(t, cbar & 0xffffffu);
  Cluster* cl = cur_cta->cluster;
  if (cl->ctas[0]->rng() & 1u) {
    land_async(caddr, v, n, m);
    return;
  }
  AsyncStore a{caddr, cbar, std::vector<char>(static_cast<const char*>(v), static_cast<const char*>(v) + n)};
  cl->pending.push_back(std::move(a));
}

// All 32 lanes of the calling warp deposit `size` bytes; once all arrived, each lane runs
// `read(data)` where data[lane] holds that lane's deposit.
template <class F>
inline void warp_collective(int tag, const void* in, size_t size, F&& read) {
  Cta* c = cur_cta;
  int tid = cur_fiber->tid;
  WarpSlot& w = c->warps[tid >> 5];
  cur_fiber->cluster_synced = false;
  uint64_t g = w.gen;
  int slot = (int)(g & 1);
  if (w.arrived == 0) w.tag[slot] = tag;
  else if (w.tag[slot] != tag) fail("lanes of one warp reached different warp-collective instructions");
  if (size > 64) fail("collective payload too large");
  if (size) std::memcpy(w.data[slot][tid & 31], in, size);
  ++w.arrived;
  ++c->progress;
  if (w.arrived == 32) {
    w.arrived = 0;
    ++w.gen;
  } else {
    while (w.gen == g) yield();
  }
  read(w.data[slot]);
}

inline void fiber_entry(int idx) {
  Cta* c = cur_cta;
  (*c->body)(c->smem);
  if (!c->fibers[idx].wgmma_groups.empty()) fail("thread exited with a wgmma not waited on");
  if (!c->fibers[idx].cp_async.empty()) fail("thread exited with a cp.async no mbarrier tracks");
  c->fibers[idx].done = true;
  ++c->progress;
  // returning switches to uc_link (the scheduler)
}

#if DSV41_EMU_FAST_SWITCH
[[noreturn]] inline void fiber_start() {
  Fiber* f = cur_fiber;
  Cta* c = cur_cta;
  (*c->body)(c->smem);
  if (!f->wgmma_groups.empty()) fail("thread exited with a wgmma not waited on");
  if (!f->cp_async.empty()) fail("thread exited with a cp.async no mbarrier tracks");
  f->done = true;
  ++c->progress;
  dsv41_emu_switch(&f->sp, c->sched_sp);
  fail("finished fiber resumed");
}

// A fresh stack whose first switch "returns" into fiber_start with the ABI's alignment.
inline void* init_stack(char* stack, size_t bytes) {
  uintptr_t top = (reinterpret_cast<uintptr_t>(stack) + bytes) & ~uintptr_t(15);
  uint64_t* sp = reinterpret_cast<uint64_t*>(top);
  *--sp = 0;                                                        // fake return address of fiber_start
  *--sp = reinterpret_cast<uint64_t>(reinterpret_cast<void*>(&fiber_start));  // ret target (16-aligned slot)
  for (int i = 0; i < 6; ++i) *--sp = 0;                            // rbp rbx r12 r13 r14 r15
  *--sp = 0x0000037f00001f80ull;                                    // mxcsr (low) | x87 control word
  return sp;
}
#endif

// Runs the CTAs of one cluster (each of `nthreads` threads) to completion, their fibers interleaved.
inline void run_cluster(Cluster& cl) {
  struct Ref { Cta* c; int i; };
  std::vector<Ref> order;
  for (Cta* cp : cl.ctas) {
    Cta& c = *cp;
    c.exited = false;
    c.mbars.clear();
    c.cluster = &cl;
    for (int i = 0; i < c.nthreads; ++i) {
      Fiber& f = c.fibers[i];
      f.tid = i;
      f.done = false;
      f.wgmma_groups.clear();
      f.cluster_synced = false;
#if DSV41_EMU_FAST_SWITCH
      f.sp = init_stack(c.stacks[i], c.stack_bytes);
#else
      getcontext(&f.ctx);
      f.ctx.uc_stack.ss_sp = c.stacks[i];
      f.ctx.uc_stack.ss_size = c.stack_bytes;
      f.ctx.uc_link = &c.sched;
      cur_cta = &c;
      makecontext(&f.ctx, (void (*)())fiber_entry, 1, i);
#endif
      order.push_back({&c, i});
    }
    for (auto& b : c.bars) { b.arrived = 0; b.expected = 0; b.here.assign(c.nthreads, 0); }
    for (auto& w : c.warps) { w.arrived = 0; w.tag[0] = w.tag[1] = 0; }
  }
  cl.bar = Bar{};
  cl.remote_traffic = false;
  cl.pending.clear();
  Cta& lead = *cl.ctas[0];
  size_t alive = order.size();
  Cta* stalled = nullptr;  // skew: a CTA left out for `stall_left` rounds
  int stall_left = 0;
  while (alive) {
    uint64_t before = 0;
    for (Cta* c : cl.ctas) before += c->progress;
    if (cl.ctas.size() > 1 && !stalled && lead.rng() % 8 == 0) {
      stalled = cl.ctas[lead.rng() % cl.ctas.size()];
      stall_left = 1 + (int)(lead.rng() % 16);
    }
    std::shuffle(order.begin(), order.end(), lead.rng);
    for (const Ref& r : order) {
      Fiber& f = r.c->fibers[r.i];
      if (f.done || r.c == stalled) continue;
      cur_cta = r.c;
      cur_fiber = &f;
#if DSV41_EMU_FAST_SWITCH
      dsv41_emu_switch(&r.c->sched_sp, f.sp);
#else
      swapcontext(&r.c->sched, &f.ctx);
#endif
      cur_fiber = nullptr;
      if (f.done) {
        if (cl.ctas.size() > 1 && cl.remote_traffic && !f.cluster_synced) {
          cur_cta = r.c;
          cur_fiber = &f;
          fail("a thread of a cluster with remote traffic finished without a final cluster barrier");
        }
        bool all = true;
        for (auto& g : r.c->fibers) all = all && g.done;
        r.c->exited = all;
      }
    }
    alive = 0;
    uint64_t after = 0;
    for (const Ref& r : order) alive += r.c->fibers[r.i].done ? 0 : 1;
    for (Cta* c : cl.ctas) after += c->progress;
    if (stalled && (after == before || --stall_left <= 0)) {  // never let the skew look like a deadlock
      stalled = nullptr;
      continue;
    }
    if (alive && after == before) {
      for (Cta* c : cl.ctas) {
        std::fprintf(stderr, "emu: deadlock in block %lld; barrier states:", (long long)c->block);
        for (int i = 0; i < 16; ++i)
          if (c->bars[i].arrived) std::fprintf(stderr, " [id %d: %d/%d]", i, c->bars[i].arrived, c->bars[i].expected);
        for (auto& kv : c->mbars)
          std::fprintf(stderr, " [mbarrier @%u: %d/%d, phase %llu]", kv.first, kv.second.pending, kv.second.count,
                       (unsigned long long)kv.second.phase);
        std::fprintf(stderr, "\n");
      }
      std::abort();
    }
  }
  if (!cl.pending.empty()) {
    cur_cta = cl.ctas[cl.pending[0].caddr >> 24];
    fail("st.async stores that nobody waited for (their mbarrier was never waited on)");
  }
  cur_cta = nullptr;
}

// Launch `grid` blocks of `nthreads` threads with `smem_bytes` of (poisoned) shared memory, in
// clusters of `cluster` consecutive blocks (grid must be a multiple). body(smem) runs once per
// thread; it reads its ids through cur_fiber / cur_cta.
inline void launch(int64_t grid, int nthreads, size_t smem_bytes, const std::function<void(char*)>& body,
                   uint64_t seed = 1, int workers = 0, int cluster = 1) {
  if (grid <= 0) return;
  if (cluster < 1 || grid % cluster) fail("launch: grid is not a multiple of the cluster size");
  const int64_t nclusters = grid / cluster;
  if (workers <= 0) workers = (int)std::max(1u, std::min(4u, std::thread::hardware_concurrency()));
  workers = (int)std::min<int64_t>(workers, nclusters);
  std::atomic<int64_t> next{0};
  auto work = [&](int wid) {
    std::vector<Cta> ctas(cluster);
    std::vector<std::vector<char>> mem(cluster);
    Cluster cl;
    for (int r = 0; r < cluster; ++r) {
      Cta& c = ctas[r];
      c.nthreads = nthreads;
      c.stack_bytes = 256 * 1024;
      c.fibers.resize(nthreads);
      c.stacks.resize(nthreads);
      for (int i = 0; i < nthreads; ++i) c.stacks[i] = static_cast<char*>(std::malloc(c.stack_bytes));
      c.warps.resize((nthreads + 31) / 32);
      // 1024-aligned, like the swizzle atoms the kernels align their shared memory to
      mem[r].resize(smem_bytes + 1024);
      c.smem = mem[r].data() + ((1024 - (reinterpret_cast<uintptr_t>(mem[r].data()) & 1023)) & 1023);
      c.smem_bytes = smem_bytes;
      c.body = &body;
      c.rank = r;
      cl.ctas.push_back(&c);
    }
    for (int64_t k; (k = next.fetch_add(1)) < nclusters;) {
      for (int r = 0; r < cluster; ++r) {
        Cta& c = ctas[r];
        std::memset(c.smem, 0xff, smem_bytes);  // poison: NaN-ish bf16 / f32 patterns
        c.block = k * cluster + r;
      }
      ctas[0].rng.seed(seed * 0x9E3779B97F4A7C15ull + (uint64_t)k * 1315423911ull + (uint64_t)wid);
      run_cluster(cl);
    }
    for (Cta& c : ctas)
      for (char* s : c.stacks) std::free(s);
  };
  std::vector<std::thread> ts;
  for (int w = 1; w < workers; ++w) ts.emplace_back(work, w);
  work(0);
  for (auto& t : ts) t.join();
}

}  // namespace emu
