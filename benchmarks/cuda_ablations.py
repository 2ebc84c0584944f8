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
    ("producer.cuh", "DEVFN void tile_prefetch(const Pools& ps, const TileSrc& t, const TileAddr<NB>& a, int lane) {\n",
     "DEVFN void tile_prefetch(const Pools& ps, const TileSrc& t, const TileAddr<NB>& a, int lane) {\n  return;\n"),
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
    ("producer.cuh", "template <int NB, int NV>\nDEVFN void load_batch(",
     "DEVFN uint4 ldg_na_v4(const void* p) {\n  uint4 v;\n  asm volatile(\"ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, "
     "[%4];\" : \"=r\"(v.x), \"=r\"(v.y), \"=r\"(v.z), \"=r\"(v.w) : \"l\"(p));\n  return v;\n}\n"
     "template <int NB, int NV>\nDEVFN void load_batch("),
    ("producer.cuh", "    for (int i = 0; i < 7; ++i) bt.v[i] = ldg_nc_v4(d + 16 * (q + 4 * i));\n"
     "    bt.v[7] = ldg_nc_v4(d + 448 + 32 * q);\n    bt.v[8] = ldg_nc_v4(d + 448 + 32 * q + 16);",
     "    for (int i = 0; i < 7; ++i) bt.v[i] = ldg_na_v4(d + 16 * (q + 4 * i));\n"
     "    bt.v[7] = ldg_na_v4(d + 448 + 32 * q);\n    bt.v[8] = ldg_na_v4(d + 448 + 32 * q + 16);"),
)

# What the per-CTA Q read and output store cost (the prefill's 64-head CTAs hold 8 tiles at top-k 512): Q rows from
# a constant instead of global memory, the staged output not stored (shared with the decode's CTA; timing only).
_NO_Q_READ = (("consumer.cuh", "      v[i] = ldg_nc_v4(q + (c >> 6) * kHeadDim + (c & 63) * 8);\n",
               "      v[i] = make_u4(0x3c003c00u, 0x3c003c00u, 0x3c003c00u, 0x3c003c00u);\n      (void)q;\n"),)
_NO_OUT_STORE = (("consumer.cuh", "    *reinterpret_cast<uint4*>(orow0 + (int64_t)r * kHeadDim + 8 * c) =\n"
                  "        *reinterpret_cast<const uint4*>(stage + r * 1024 + ((c ^ (r & 7)) << 4));\n",
                  "    (void)orow0, (void)stage, (void)r, (void)c;\n"),)

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
    ("consumer.cuh", "      v[i] = ldg_nc_v4(q + (c >> 6) * kHeadDim + (c & 63) * 8);\n",
     "      asm volatile(\"ld.global.nc.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;\" : \"=r\"(v[i].x), \"=r\"(v[i].y), "
     "\"=r\"(v[i].z), \"=r\"(v[i].w) : \"l\"(q + (c >> 6) * kHeadDim + (c & 63) * 8), \"l\"(l2_evict_first()));\n"),
    ("consumer.cuh", "    *reinterpret_cast<uint4*>(orow0 + (int64_t)r * kHeadDim + 8 * c) =\n"
     "        *reinterpret_cast<const uint4*>(stage + r * 1024 + ((c ^ (r & 7)) << 4));\n",
     "    {\n      const uint4 ov = *reinterpret_cast<const uint4*>(stage + r * 1024 + ((c ^ (r & 7)) << 4));\n"
     "      asm volatile(\"st.global.L2::cache_hint.v4.u32 [%0], {%1, %2, %3, %4}, %5;\" ::\"l\"(orow0 + (int64_t)r * kHeadDim + 8 * c), "
     "\"r\"(ov.x), \"r\"(ov.y), \"r\"(ov.z), \"r\"(ov.w), \"l\"(l2_evict_first()) : \"memory\");\n    }\n"),
)

# The seesaw prefill's next Q: loaded under the output's copy-out into the accumulator's registers (dead once staged;
# ptxas keeps them in place over the item loop, other registers spill), converted to the Q region after the
# copy-out's barrier (ptxas warns C7511: the wgmmas serialised); or by load_q with 16 loads in flight per thread;
# or no persistence (one item per CTA, as many CTAs as items).
_SEESAW_Q_UNDER_COPY = (
    ("seesaw.cuh", "DEVFN void prefill_seesaw_cta(const PrefillParams& p, char* smem_raw) {\n",
     "DEVFN void seesaw_epilogue(char* smem, Acc& acc, int w, int lane, uint16_t* orow0, float* lse0, float* maxl0,\n"
     "                           const float* sink0, const uint16_t* next_q) {\n"
     "  const int ct = thread_idx();\n"
     "  stage_final<true>(smem, acc, w, lane, lse0, maxl0, sink0);\n"
     "  if (next_q) {\n"
     "#pragma unroll\n"
     "    for (int i = 0; i < 16; ++i) {\n"
     "      const int c = ct + kConsumerThreads * i;\n"
     "      const uint4 v = ldg_nc_v4(next_q + (c >> 6) * kHeadDim + (c & 63) * 8);\n"
     "      acc.o[i][0] = bits_f32(v.x);\n"
     "      acc.o[i][1] = bits_f32(v.y);\n"
     "      acc.o[i][2] = bits_f32(v.z);\n"
     "      acc.o[i][3] = bits_f32(v.w);\n"
     "    }\n"
     "  }\n"
     "  copy_out_staged(smem, orow0);\n"
     "  bar_sync(kBarConsumers, kConsumerThreads);\n"
     "  if (next_q) {\n"
     "#pragma unroll\n"
     "    for (int i = 0; i < 16; ++i) {\n"
     "      const int c = ct + kConsumerThreads * i;\n"
     "      const uint4 v = make_u4(f32_bits(acc.o[i][0]), f32_bits(acc.o[i][1]), f32_bits(acc.o[i][2]),\n"
     "                              f32_bits(acc.o[i][3]));\n"
     "      *reinterpret_cast<uint4*>(smem + kSmemQ + tile_off(c >> 6, c & 63)) = bf16x8_to_f16x8(v);\n"
     "    }\n"
     "    fence_proxy_async();\n"
     "    bar_sync(kBarConsumers, kConsumerThreads);\n"
     "  }\n"
     "}\n\n"
     "DEVFN void prefill_seesaw_cta(const PrefillParams& p, char* smem_raw) {\n"),
    ("seesaw.cuh",
     "    write_final_staged<true, true>(smem, acc, w, lane, p.out + head_row * kHeadDim, p.lse + head_row,\n"
     "                                   p.max_logits + head_row, group_sink(p.sink, group));\n"
     "    const int64_t nit = it + stride;  // the next item's Q (the staging region is free again)\n"
     "    int nlen = 0;\n"
     "    npairs = nit < items ? npairs_of(nit / p.num_groups, &nlen) : 0;\n"
     "    if (npairs > 0) {\n"
     "      const int64_t nrow = (nit / p.num_groups) * p.h_pad + (int64_t)(nit % p.num_groups) * kHeadsPerCta;\n"
     "      load_q(smem, p.q + nrow * kHeadDim, thread_idx());\n"
     "    }\n",
     "    const int64_t nit = it + stride;\n"
     "    int nlen = 0;\n"
     "    npairs = nit < items ? npairs_of(nit / p.num_groups, &nlen) : 0;\n"
     "    const int64_t nrow = (nit / p.num_groups) * p.h_pad + (int64_t)(nit % p.num_groups) * kHeadsPerCta;\n"
     "    seesaw_epilogue(smem, acc, w, lane, p.out + head_row * kHeadDim, p.lse + head_row, p.max_logits + head_row,\n"
     "                    group_sink(p.sink, group), npairs > 0 ? p.q + nrow * kHeadDim : nullptr);\n"),
)
_SEESAW_Q16 = (("seesaw.cuh", "      load_q(smem, p.q + nrow * kHeadDim, thread_idx());\n",
                "      load_q<16>(smem, p.q + nrow * kHeadDim, thread_idx());\n"),)
_SEESAW_PER_ITEM = (("prefill.cu", "    if (sms > 0 && grid > sms) q.num_ctas = sms;\n", "    (void)sms;\n"),)

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
    "seesaw_q_under_copy": Ablation("the seesaw's next Q loaded under the output's copy-out (accumulator registers)",
                                    _SEESAW_Q_UNDER_COPY),
    "seesaw_q16": Ablation("the seesaw's next Q by load_q with 16 loads in flight per thread", _SEESAW_Q16),
    "seesaw_per_item": Ablation("the seesaw without persistence: one item per CTA, as many CTAs as items",
                                _SEESAW_PER_ITEM),
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
