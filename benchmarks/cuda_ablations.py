"""Ablation builds of the CUDA library: the product's sources (cuda_ffi/csrc/) copied and patched, so the
product carries no switch for them. Each leaves one stage out or changes one design choice, to measure what
that stage costs in the decode and prefill (benchmarks/gpu_check.sh cuda-ablation; figures in
benchmarks/RESULTS.md). Timing only: no_gather and neither compute on zero rows, no_mma and neither skip the
tensor-core work, so their outputs are wrong.

    python -m benchmarks.cuda_ablations no_gather --out-dir /tmp/dsv41_no_gather --build-dir /tmp/b_no_gather
    DSV41_CUDA_LIB=/tmp/dsv41_no_gather/libdsv41_cuda.so python -m benchmarks.sparse_mla --quick --impls cuda
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import sys
from pathlib import Path

from cuda_ffi import build as cbuild

__all__ = ["Ablation", "ABLATIONS", "build_ablation"]


@dataclasses.dataclass(frozen=True)
class Ablation:
    what: str
    patches: tuple[tuple[str, str, str], ...] = ()  # cuda_ffi.build.copy_sources: (file, exact snippet, replacement)
    force_mma_sync: bool = False


_NO_GATHER = (
    ("producer.cuh", "DEVFN void tile_prefetch(const Pools<kFam>& ps, const TileSrc& t, const TileAddr<NB>& a, int lane) {\n",
     "DEVFN void tile_prefetch(const Pools<kFam>& ps, const TileSrc& t, const TileAddr<NB>& a, int lane) {\n  return;\n"),
    ("producer.cuh", "  bt.sc.x = bt.sc.y = 0x7f7f7f7fu;\n", "  bt.sc.x = bt.sc.y = 0x7f7f7f7fu;\n  return;\n"),
)
_NO_MMA = (
    ("consumer.cuh", "  for (int ks = 0; ks < kSteps; ++ks) {\n    const uint32_t koff", "  for (int ks = 0; ks < 0; ++ks) {\n    const uint32_t koff"),
    ("consumer.cuh", "  for (int kk = 0; kk < kTileTokens / 16; ++kk)\n    wgmma_m64n256k16_tb",
     "  for (int kk = 0; kk < 0; ++kk)\n    wgmma_m64n256k16_tb"),
    ("consumer.cuh", "  for (int kk = 0; kk < kTileTokens / 16; ++kk) {\n    const uint32_t a[4]",
     "  for (int kk = 0; kk < 0; ++kk) {\n    const uint32_t a[4]"),
    # the narrow CTA's MMAs (S and PV): warpgroup MMAs (sm_90a) and warp MMAs (builds without wgmma)
    ("narrow.cuh", "  for (int ks = 0; ks < kHeadDim / 16; ++ks) {\n    const uint32_t koff = kstep_off(ks);\n    narrow_wgmma",
     "  for (int ks = 0; ks < 0; ++ks) {\n    const uint32_t koff = kstep_off(ks);\n    narrow_wgmma"),
    ("narrow.cuh", "    for (int kk = 0; kk < kTileTokens / 16; ++kk)\n      narrow_wgmma<R, true>",
     "    for (int kk = 0; kk < 0; ++kk)\n      narrow_wgmma<R, true>"),
    ("narrow.cuh", "  for (int m = 0; m < kHeadDim / 32; ++m) {", "  for (int m = 0; m < 0; ++m) {"),
    ("narrow.cuh", "  for (int kk = 0; kk < kTileTokens / 16; ++kk) {\n    uint32_t ph[R][4];",
     "  for (int kk = 0; kk < 0; ++kk) {\n    uint32_t ph[R][4];"),
)

_NARROW_NO_PREFETCH = (
    ("producer.cuh", "  tile_prefetch<1>(ps, t1, a1, lane);\n  BatchT<16> first;", "  BatchT<16> first;"),
    ("producer.cuh", "    tile_prefetch<1>(ps, t2, a2, lane);\n    const int buf = tc & 1;", "    const int buf = tc & 1;"),
)
_RECORDS_NO_L1 = (
    ("producer.cuh", "template <int NB, int NV, int kFam>\nDEVFN void load_batch(",
     "DEVFN uint4 ldg_na_v4(const void* p) {\n  uint4 v;\n  asm volatile(\"ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, "
     "[%4];\" : \"=r\"(v.x), \"=r\"(v.y), \"=r\"(v.z), \"=r\"(v.w) : \"l\"(p));\n  return v;\n}\n"
     "template <int NB, int NV, int kFam>\nDEVFN void load_batch("),
    ("producer.cuh", "    for (int i = 0; i < 7; ++i) bt.v[i] = ldg_nc_v4(d + 16 * (q + 4 * i));\n"
     "    bt.v[7] = ldg_nc_v4(d + 448 + 32 * q);\n    bt.v[8] = ldg_nc_v4(d + 448 + 32 * q + 16);",
     "    for (int i = 0; i < 7; ++i) bt.v[i] = ldg_na_v4(d + 16 * (q + 4 * i));\n"
     "    bt.v[7] = ldg_na_v4(d + 448 + 32 * q);\n    bt.v[8] = ldg_na_v4(d + 448 + 32 * q + 16);"),
)

# What the per-CTA Q read and output store cost (the prefill's 64-head CTAs hold 8 tiles at top-k 512): Q rows from
# a constant instead of global memory, the staged output not stored (shared with the decode's CTA; timing only).
_NO_Q_READ = (("consumer.cuh",
               "      v[i] = (c >> 6) < rows && !skip ? ldg_nc_v4(q + (c >> 6) * kHeadDim + (c & 63) * 8) : make_u4(0u, 0u, 0u, 0u);\n",
               "      v[i] = make_u4(0x3c003c00u, 0x3c003c00u, 0x3c003c00u, 0x3c003c00u);\n      (void)q, (void)rows;\n"),)
_NO_OUT_STORE = (("consumer.cuh", "    if (r < rows)\n      *reinterpret_cast<uint4*>(orow0 + (int64_t)r * kHeadDim + 8 * c) =\n"
                  "          *reinterpret_cast<const uint4*>(stage + r * 1024 + ((c ^ (r & 7)) << 4));\n",
                  "    (void)orow0, (void)stage, (void)r, (void)c, (void)rows;\n"),)

# An L2 evict_first policy for the 64-head CTAs' Q loads and output stores (both stream once), so that they do not push
# the gathered rows, which other CTAs re-read, out of L2. (An evict_last policy on the seesaw's kv cp.async copies
# builds, but faults with an illegal instruction on the H200: benchmarks/RESULTS.md.)
_L2_EVICT_FIRST = (
    ("primitives.cuh", "DEVFN void cp_async16(uint32_t saddr, const void* src, uint32_t src_bytes) {\n",
     "DEVFN uint64_t l2_evict_first() {\n  uint64_t pol;\n"
     "  asm volatile(\"createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\" : \"=l\"(pol));\n  return pol;\n}\n"
     "DEVFN void cp_async16(uint32_t saddr, const void* src, uint32_t src_bytes) {\n"),
)
_QO_EVICT_FIRST = (
    ("consumer.cuh",
     "      v[i] = (c >> 6) < rows && !skip ? ldg_nc_v4(q + (c >> 6) * kHeadDim + (c & 63) * 8) : make_u4(0u, 0u, 0u, 0u);\n",
     "      v[i] = make_u4(0u, 0u, 0u, 0u);\n"
     "      if ((c >> 6) < rows && !skip)\n"
     "        asm volatile(\"ld.global.nc.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;\" : \"=r\"(v[i].x), \"=r\"(v[i].y), "
     "\"=r\"(v[i].z), \"=r\"(v[i].w) : \"l\"(q + (c >> 6) * kHeadDim + (c & 63) * 8), \"l\"(l2_evict_first()));\n"),
    ("consumer.cuh", "    if (r < rows)\n      *reinterpret_cast<uint4*>(orow0 + (int64_t)r * kHeadDim + 8 * c) =\n"
     "          *reinterpret_cast<const uint4*>(stage + r * 1024 + ((c ^ (r & 7)) << 4));\n",
     "    if (r < rows) {\n      const uint4 ov = *reinterpret_cast<const uint4*>(stage + r * 1024 + ((c ^ (r & 7)) << 4));\n"
     "      asm volatile(\"st.global.L2::cache_hint.v4.u32 [%0], {%1, %2, %3, %4}, %5;\" ::\"l\"(orow0 + (int64_t)r * kHeadDim + 8 * c), "
     "\"r\"(ov.x), \"r\"(ov.y), \"r\"(ov.z), \"r\"(ov.w), \"l\"(l2_evict_first()) : \"memory\");\n    }\n"),
)

# The seesaw prefill's output by bulk copies: O staged in the free K buffers (rows 1040 bytes apart: conflict-free
# staging stores, each row contiguous), then one 1 KB cp.async.bulk per row; the CTA waits only until its shared
# memory has been read, not for the global writes.
_SEESAW_O_BULK = (
    ("seesaw.cuh", "DEVFN void prefill_seesaw_cta(const PrefillParams& p, char* smem_raw) {\n",
     "DEVFN void write_final_bulk(char* smem, const Acc& acc, int w, int lane, uint16_t* orow0, float* lse0,\n"
     "                             float* maxl0, const float* sink0, int rows) {\n"
     "  const int g = lane >> 2, t = lane & 3;\n"
     "  char* stage = smem + kSmemK;\n"
     "#pragma unroll\n"
     "  for (int hr = 0; hr < 2; ++hr) {\n"
     "    const int r = o_row(w, 0, g) + 8 * hr;\n"
     "    const FinalRow fr = final_row(smem, r, r < rows ? sink0 : nullptr);\n"
     "#pragma unroll\n"
     "    for (int n = 0; n < 32; ++n) {\n"
     "      const int c = 32 * (w >> 2) + n;\n"
     "      *reinterpret_cast<uint32_t*>(stage + r * 1040 + 16 * c + 4 * t) =\n"
     "          pack_bf16x2(acc.o[n][2 * hr] * fr.factor, acc.o[n][2 * hr + 1] * fr.factor);\n"
     "    }\n"
     "    if ((w >> 2) == 0 && t == 0 && r < rows) {\n"
     "      lse0[r] = fr.lse_nat;\n"
     "      maxl0[r] = fr.maxl;\n"
     "    }\n"
     "  }\n"
     "  fence_proxy_async_always();\n"
     "  bar_sync(kBarConsumers, kConsumerThreads);\n"
     "  const int r = thread_idx();\n"
     "  if (r < rows) {\n"
     "    asm volatile(\"cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], 1024;\" ::\"l\"(orow0 + (int64_t)r * kHeadDim),\n"
     "                 \"r\"(smem_addr(stage + r * 1040)) : \"memory\");\n"
     "    asm volatile(\"cp.async.bulk.commit_group;\" ::: \"memory\");\n"
     "    asm volatile(\"cp.async.bulk.wait_group.read 0;\" ::: \"memory\");\n"
     "  }\n"
     "}\n\n"
     "DEVFN void prefill_seesaw_cta(const PrefillParams& p, char* smem_raw) {\n"),
    ("seesaw.cuh", "  write_final_staged<true, false>(smem, acc, w, lane, p.out + head_row * kHeadDim, p.lse + head_row,\n",
     "  write_final_bulk(smem, acc, w, lane, p.out + head_row * kHeadDim, p.lse + head_row,\n"),
)
# The seesaw prefill's Q of the CTA that runs next on this SM (about one wave, 132 CTAs, later) prefetched into L2 at
# the CTA's start, so its load hits L2.
_SEESAW_Q_PREFETCH = (
    ("seesaw.cuh", "  const int len = load_len(p.kv.lengths, p.kv.lengths_stride, s, p.kv.topk);\n",
     "  if (thread_idx() == kConsumerThreads) {\n"
     "    const int64_t nb = bid + 132;\n"
     "    if (nb < (int64_t)p.num_groups * p.s_q) {\n"
     "      const uint16_t* qn = p.q + ((nb / p.num_groups) * p.h_q + (nb % p.num_groups) * kHeadsPerCta) * kHeadDim;\n"
     "      asm volatile(\"cp.async.bulk.prefetch.L2.global [%0], 65536;\" ::\"l\"(qn) : \"memory\");\n"
     "    }\n"
     "  }\n"
     "  const int len = load_len(p.kv.lengths, p.kv.lengths_stride, s, p.kv.topk);\n"),
)

ABLATIONS = {
    "default": Ablation("the product's kernels, built the same way (the reference row)"),
    "no_gather": Ablation("no cache reads and no L2 prefetch (zero rows), everything else unchanged", _NO_GATHER),
    "no_mma": Ablation("no tensor-core work (S and PV: wgmma, the narrow CTA's mma.sync), everything else unchanged",
                       _NO_MMA),
    "neither": Ablation("no cache reads and no wgmma work", _NO_GATHER + _NO_MMA),
    "no_pair": Ablation("decode with one CTA per head group instead of 2-CTA head-group pairs", (
        ("host_params.h", "  if (num_groups % 2 != 0) return 0;\n", "  if (num_groups > 0) return 0;\n"),)),
    "mma_sync": Ablation("sm_100a's mma.sync consumers on sm_90a", force_mma_sync=True),
    "narrow_no_prefetch": Ablation("the narrow CTA's producers without their L2 prefetch", _NARROW_NO_PREFETCH),
    "records_no_l1": Ablation("the producers' fp8 record loads without L1 allocation (ld.global.nc.L1::no_allocate)",
                              _RECORDS_NO_L1),
    "no_q_read": Ablation("the 64-head CTAs' Q rows from a constant, not read from global memory", _NO_Q_READ),
    "no_out_store": Ablation("the 64-head CTAs' staged output (decode's one-piece requests, prefill) not stored",
                             _NO_OUT_STORE),
    "narrow_no_prefetch_no_l1": Ablation("narrow_no_prefetch and records_no_l1", _NARROW_NO_PREFETCH + _RECORDS_NO_L1),
    "qo_evict_first": Ablation("the 64-head CTAs' Q loads and output stores with an L2 evict_first policy",
                               _L2_EVICT_FIRST + _QO_EVICT_FIRST),
    "o_bulk": Ablation("the seesaw prefill's output staged in the K buffers and stored by 1 KB bulk copies", _SEESAW_O_BULK),
    "q_prefetch": Ablation("the seesaw prefill prefetching the Q of the CTA one wave later into L2", _SEESAW_Q_PREFETCH),
    "o_bulk_q_prefetch": Ablation("o_bulk and q_prefetch", _SEESAW_O_BULK + _SEESAW_Q_PREFETCH),
}


def build_ablation(name: str, *, out_dir: Path, build_dir: Path, archs: str = "90a", jobs: int | None = None) -> Path:
    """Build ablation `name` into out_dir (never cuda_ffi/lib); its patched sources go to build_dir/csrc."""
    ab = ABLATIONS[name]
    if Path(out_dir).resolve() == cbuild.LIB_DIR.resolve():
        raise ValueError("ablation builds need an out_dir other than cuda_ffi/lib")
    src = Path(build_dir) / "csrc"
    shutil.rmtree(src, ignore_errors=True)
    cbuild.copy_sources(src, ab.patches)
    return cbuild.build_library(archs=archs, jobs=jobs, out_dir=Path(out_dir), build_dir=Path(build_dir) / "cmake",
                                force_mma_sync=ab.force_mma_sync, src_dir=src)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.cuda_ablations", description=__doc__.split("\n\n")[0])
    ap.add_argument("name", choices=sorted(ABLATIONS))
    ap.add_argument("--out-dir", type=Path, required=True)
    ap.add_argument("--build-dir", type=Path, required=True)
    ap.add_argument("--archs", default="90a")
    ap.add_argument("--jobs", type=int, default=None)
    a = ap.parse_args(argv)
    try:
        build_ablation(a.name, out_dir=a.out_dir, build_dir=a.build_dir, archs=a.archs, jobs=a.jobs)
    except cbuild.BuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
