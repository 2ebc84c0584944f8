"""Per-tile timeline of the narrow decode CTA (h_q <= 32; cuda_ffi/csrc/narrow.cuh), sm_90a on a GPU only.

    python -m benchmarks.narrow_trace [--case fm_decode_b128_h8_k128p256+512p64] [--variants default,no_gather]

Builds patched copies of the library (benchmarks/cuda_ablations.py's mechanism: the product carries no trace
hook) in which lane 0 of consumer warp 0 and of every producer warp in the first 8 CTAs stamp `%clock` at
fixed points of every tile, runs the FlashMLA-style case (benchmarks/flashmla_cases.py), copies the last call's stamps
out and prints the median cycles of each step over the steady-state tiles (each CTA's first and last 2 tiles
left out), per role:

  consumer  full_wait: waiting for the tile's FULL barrier; s_tail: S^T still running after the previous
            tile's PV completed; softmax: mask, column maxima (B1), P stores and fence (B2), rescale;
            pv_issue: issuing the 32 PV wgmmas; pv_tail: PV running on behind the next tile's S issue;
            period: softmax end to softmax end.
  producer  (warp 0) empty_wait: waiting for the buffer's release; fill: dequantise and store the loaded batch
            (its load latency included where it is not yet hidden); arrive_loop: FULL arrival, the next
            tile's load issue, index and address work, L2 prefetch.
  warps     (all eight producer warps) empty_wait_all: the EMPTY wait of every warp; full_spread: first to last
            warp's FULL arrival of a tile; wake_after_last: the last arrival to the consumer's wake-up;
            last_share: how often each warp arrives last.

Timing only (variant no_gather: zero rows, as cuda_ablations); not recorded by itself: quote it in
benchmarks/RESULTS.md with the commit.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import subprocess
import sys
from pathlib import Path

__all__ = ["TRACE_PATCHES", "summarize", "main"]

_CTAS, _SLOTS, _TILES, _EVENTS = 8, 9, 256, 8  # slots: consumer warp 0, producer warps 0..7

_BUF = f"""namespace dsv41 {{

// (benchmarks/narrow_trace.py) one copy per translation unit: decode.cu's is read out
static __device__ unsigned narrow_trace_buf[{_CTAS * _SLOTS * _TILES * _EVENTS}];
DEVFN void narrow_trace(int slot, int tile, int ev) {{
#if DSV41_DEVICE
  if (lane_idx() == 0 && block_idx() < {_CTAS} && tile < {_TILES}) {{
    unsigned c;
    asm volatile("mov.u32 %0, %%clock;" : "=r"(c));
    narrow_trace_buf[((block_idx() * {_SLOTS} + slot) * {_TILES} + tile) * {_EVENTS} + ev] = c;
  }}
#endif
}}
"""

# (file, exact snippet, replacement): consumer events 0..5 (slot 0, warp 0), producer events 0..3 (slot 1 + pw).
# The anchors leave out the release and EMPTY lines, so the patches also apply over ablations that change those.
TRACE_PATCHES = (
    ("narrow.cuh", "#include \"decode_cta.cuh\"\n\nnamespace dsv41 {\n", "#include \"decode_cta.cuh\"\n\n" + _BUF),
    ("narrow.cuh",
     "  float s[8 * R];\n  await_tile(crew, tc0, w);\n  narrow_issue_s<R>(smem, tc0 & 1, s);\n  wgmma_wait<0>();\n"
     "  reg_fence<8 * R>(s);\n  for (int tc = tc0; tc < tc0 + n; ++tc) {\n"
     "    narrow_softmax<R>(smem, tc & 1, s, acc, scale_log2, w, lane);\n    narrow_issue_pv<R>(smem, tc & 1, acc);\n"
     "    if (tc + 1 < tc0 + n) {\n      await_tile(crew, tc + 1, w);\n      narrow_issue_s<R>(smem, (tc + 1) & 1, s);\n"
     "      wgmma_wait<1>();\n      reg_fence<64 * R>(&acc.o[0][0]);\n",
     "  float s[8 * R];\n  const bool tr = w == 0;\n  if (tr) narrow_trace(0, tc0, 0);\n  await_tile(crew, tc0, w);\n"
     "  if (tr) narrow_trace(0, tc0, 1);\n  narrow_issue_s<R>(smem, tc0 & 1, s);\n  wgmma_wait<0>();\n"
     "  reg_fence<8 * R>(s);\n  if (tr) narrow_trace(0, tc0, 2);\n  for (int tc = tc0; tc < tc0 + n; ++tc) {\n"
     "    narrow_softmax<R>(smem, tc & 1, s, acc, scale_log2, w, lane);\n    if (tr) narrow_trace(0, tc, 3);\n"
     "    narrow_issue_pv<R>(smem, tc & 1, acc);\n    if (tr) narrow_trace(0, tc, 4);\n"
     "    if (tc + 1 < tc0 + n) {\n      if (tr) narrow_trace(0, tc + 1, 0);\n      await_tile(crew, tc + 1, w);\n"
     "      if (tr) narrow_trace(0, tc + 1, 1);\n      narrow_issue_s<R>(smem, (tc + 1) & 1, s);\n"
     "      wgmma_wait<1>();\n      reg_fence<64 * R>(&acc.o[0][0]);\n      if (tr) narrow_trace(0, tc, 5);\n"),
    ("narrow.cuh",
     "      wgmma_wait<0>();\n      reg_fence<8 * R>(s);\n    } else {\n      wgmma_wait<0>();\n"
     "      reg_fence<64 * R>(&acc.o[0][0]);\n",
     "      wgmma_wait<0>();\n      reg_fence<8 * R>(s);\n      if (tr) narrow_trace(0, tc + 1, 2);\n    } else {\n"
     "      wgmma_wait<0>();\n      reg_fence<64 * R>(&acc.o[0][0]);\n      if (tr) narrow_trace(0, tc, 5);\n"),
    ("producer.cuh", "    const int buf = tc & 1;\n    if (tc >= 2) ",
     "    const int buf = tc & 1;\n    narrow_trace(1 + pw, tc, 0);\n    if (tc >= 2) "),
    ("producer.cuh",
     "    fill_tile<1>(smem, crew, buf, ps, t0, a0, sh, lane, first);\n"
     "    load_batch(ps, t1, a1, 0, lane, first);  // (nothing when !t1.ok)\n"
     "    bar_arrive(kBarFull0 + buf, C::full_count);\n",
     "    narrow_trace(1 + pw, tc, 1);\n    fill_tile<1>(smem, crew, buf, ps, t0, a0, sh, lane, first);\n"
     "    narrow_trace(1 + pw, tc, 2);\n    load_batch(ps, t1, a1, 0, lane, first);  // (nothing when !t1.ok)\n"
     "    bar_arrive(kBarFull0 + buf, C::full_count);\n    narrow_trace(1 + pw, tc, 3);\n"),
    # the producers' loop is in producer.cuh, included before narrow.cuh: declare the stamp function there
    ("producer.cuh", "#include \"pair.cuh\"\n\nnamespace dsv41 {\n",
     "#include \"pair.cuh\"\n\nnamespace dsv41 {\nDEVFN void narrow_trace(int slot, int tile, int ev);\n"),
    ("decode.cu", "}  // namespace dsv41\n",
     "}  // namespace dsv41\n\nextern \"C\" __attribute__((visibility(\"default\"))) int dsv41_narrow_trace_read("
     "void* dst, size_t bytes) {\n  if (bytes > sizeof(dsv41::narrow_trace_buf)) bytes = sizeof(dsv41::narrow_trace_buf);\n"
     "  cudaError_t e = cudaDeviceSynchronize();\n"
     "  if (e == cudaSuccess) e = cudaMemcpyFromSymbol(dst, dsv41::narrow_trace_buf, bytes);\n  return (int)e;\n}\n"),
)

C_STEPS = (("full_wait", 0, 1), ("softmax", 2, 3), ("pv_issue", 3, 4))
P_STEPS = (("empty_wait", 0, 1), ("fill", 1, 2))


def _d(a, b):
    import numpy as np

    return ((b.astype(np.int64) - a.astype(np.int64)) % (1 << 32)).astype(np.float64)


def summarize(tr) -> dict:
    """tr: uint32 [ctas][9 slots][tiles][8 events]. Medians over CTAs and steady-state tiles (cycles)."""
    import numpy as np

    rows: dict[str, list] = {k: [] for k in ("full_wait", "s_tail", "softmax", "pv_issue", "pv_tail", "period",
                                             "empty_wait", "fill", "arrive_loop", "p_period", "empty_wait_all",
                                             "full_spread", "wake_after_last")}
    tiles, last = [], []
    for cta in range(tr.shape[0]):
        c, p = tr[cta, 0], tr[cta, 1]
        n = int(np.count_nonzero(c[:, 3]))
        if n < 8:
            continue
        tiles.append(n)
        sl, nx = slice(2, n - 3), slice(3, n - 2)  # tile t and t + 1
        for k, a, b in C_STEPS:
            rows[k].append(_d(c[sl, a], c[sl, b]))
        rows["pv_tail"].append(_d(c[nx, 1], c[sl, 5]))   # next tile's FULL seen -> this tile's PV complete
        rows["s_tail"].append(_d(c[sl, 5], c[nx, 2]))    # PV complete -> next tile's S complete
        rows["period"].append(_d(c[sl, 3], c[nx, 3]))
        for k, a, b in P_STEPS:
            rows[k].append(_d(p[sl, a], p[sl, b]))
        rows["arrive_loop"].append(_d(p[sl, 2], p[nx, 0]))
        rows["p_period"].append(_d(p[sl, 0], p[nx, 0]))
        pw = tr[cta, 1:, sl]  # [8 warps][steady tiles][events]
        arr = pw[:, :, 3].astype(np.int64)
        rows["empty_wait_all"].append(_d(pw[:, :, 0], pw[:, :, 1]).ravel())
        rows["full_spread"].append(((arr.max(0) - arr.min(0)) % (1 << 32)).astype(np.float64))
        rows["wake_after_last"].append(_d(arr.max(0).astype(np.uint32), c[sl, 1]))
        last.append(np.bincount(arr.argmax(0), minlength=arr.shape[0]))
    out = {k: float(np.median(np.concatenate(v))) for k, v in rows.items() if v}
    out["ctas"], out["tiles_per_cta"] = len(tiles), float(np.median(tiles)) if tiles else 0.0
    if last:
        share = np.sum(last, axis=0) / max(int(np.sum(last)), 1)
        out["last_share"] = "/".join(f"{x:.2f}" for x in share)
    return out


def _build(variant: str, root: Path) -> Path:
    from benchmarks import cuda_ablations as A
    from cuda_ffi import build as cbuild

    src = root / "csrc"
    shutil.rmtree(src, ignore_errors=True)
    cbuild.copy_sources(src, A.ABLATIONS[variant].patches + TRACE_PATCHES)
    return cbuild.build_library(archs="90a", out_dir=root / "lib", build_dir=root / "cmake", src_dir=src)


def _child(case_name: str) -> int:
    import numpy as np

    import cuda_ffi
    from benchmarks import flashmla_cases as F
    from benchmarks.sparse_mla import run_flashmla_case

    case = F.select_cases(case_name)[0]
    res = run_flashmla_case(case, "cuda", iterations=5)
    lib = cuda_ffi.load_library()
    tr = np.zeros((_CTAS, _SLOTS, _TILES, _EVENTS), np.uint32)
    rc = lib.dsv41_narrow_trace_read(tr.ctypes.data_as(ctypes.c_void_p), ctypes.c_size_t(tr.nbytes))
    if rc != 0:
        raise RuntimeError(f"dsv41_narrow_trace_read: cudaError {rc}")
    s = summarize(tr)
    print(f"  us per call {res['us']:.1f}; " + ", ".join(f"{k} {v:.0f}" if isinstance(v, float) else f"{k} {v}"
                                                      for k, v in s.items()), flush=True)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.narrow_trace", description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", default="fm_decode_b128_h8_k128p256+512p64")
    ap.add_argument("--variants", default="default,no_gather")
    ap.add_argument("--root", type=Path, default=Path("/tmp/dsv41_narrow_trace"))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        return _child(a.case)
    status = 0
    for v in a.variants.split(","):
        lib = _build(v, a.root / v)
        print(f"--- {v} ({a.case})", flush=True)
        env = dict(os.environ, DSV41_CUDA_LIB=str(lib))
        status |= subprocess.call([sys.executable, "-m", "benchmarks.narrow_trace", "--child", "--case", a.case], env=env)
    return status


if __name__ == "__main__":
    sys.exit(main())
