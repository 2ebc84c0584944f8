"""Per-tile timeline of the cuda decode (an experiment; sm_90a on an H200 only).

    python -m benchmarks.decode_trace [--variants consumers,full] [--case decode_headline_h128] [--out DIR]

Builds the library with `DSV41_EXP_TRACE` (kernels.cuh: lane 0 of producer warp 0 and of consumer warps 0
and 4 of the first 8 CTAs stamp `%clock` at fixed points of every tile), runs the case a few times, copies
the last call's stamps out (`dsv41_trace_read`) and prints, per role, the median cycles of each step over
the steady-state tiles (the first and last 4 tiles of each CTA left out), the tile period, its mean over all
tiles (period_mean: segment boundaries included), the median gap at a segment boundary (segment_gap: from the
release of a request's last tile to the next tile's loop top, i.e. the epilogue, the next Q and metadata), and the
hand-off latencies between the roles of one CTA (same SM, same clock):

  consumer events  (symmetric consumers) 0 before FULL wait, 1 after it, 2 S wgmma done, 3 partial scores exchanged (B0),
                   4 row maxima exchanged (B1), 8 P stored, 9 proxy fence done, 5 P written (B2), 6 PV done,
                   7 tile released; (split consumers) 0 / 1 FULL wait, 2 S done (warpgroup 0), 4 P packed,
                   5 P and alpha published (warpgroup 0) / received (warpgroup 1), 6 PV done, 7 released
  producer events  8 loop top, 9 next tile's indices issued, 10 addresses done, 1 before EMPTY wait, 3 after EMPTY + PEMPTY, 0 rows stored, 2 proxy fence done,
                   7 copies to the peer issued, 4 fill_tile done, 6 PFULL done, 5 FULL arrived

Variants: `consumers` (consumer stamps only: the default build's registers, no spill), `full` (producer
stamps too: they need producers at 112 registers, consumers 192: a few bytes of spill, so its period is
not the default build's), and either with `_no_mma` / `_no_gather` / `_one_copy` / `_pv_late` (kernels.cuh's
DSV41_EXP_NO_MMA / DSV41_EXP_NO_GATHER / DSV41_EXP_ONE_COPY / DSV41_EXP_WG0_PV_LATE; warpgroup 0's PV done and release stamps are
those of the iteration after it). Timing-only builds: their outputs are not checked. Not recorded in RESULTS.md by
itself; quote what it prints there with the commit.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

VARIANTS = {
    "consumers": ("DSV41_EXP_TRACE", "DSV41_TRACE_NO_P"),
    "full": ("DSV41_EXP_TRACE", "DSV41_EXP_PAIR_REGS_P=112"),
}
for _base in list(VARIANTS):
    VARIANTS[_base + "_no_mma"] = VARIANTS[_base] + ("DSV41_EXP_NO_MMA",)
    VARIANTS[_base + "_no_gather"] = VARIANTS[_base] + ("DSV41_EXP_NO_GATHER",)
    VARIANTS[_base + "_one_copy"] = VARIANTS[_base] + ("DSV41_EXP_ONE_COPY", "DSV41_EXP_COPY_BLOCKS=8")
    VARIANTS[_base + "_pv_late"] = VARIANTS[_base] + ("DSV41_EXP_WG0_PV_LATE",)

C_STEPS = [("full_wait", 0, 1), ("qk", 1, 2), ("b0_xchg", 2, 3), ("softmax_b1", 3, 4), ("p_store", 4, 8),
           ("p_fence", 8, 9), ("b2", 9, 5), ("pv", 5, 6), ("release", 6, 7)]
# split consumers (the default of a pair): warpgroup 0 / warpgroup 1
C_STEPS_SPLIT = {"wg0": [("full_wait", 0, 1), ("qk", 1, 2), ("softmax", 2, 4), ("p_store_fence", 4, 5), ("pv", 5, 6),
                         ("release", 6, 7)],
                 "wg1": [("full_wait", 0, 1), ("p_wait", 1, 5), ("pv", 5, 6), ("release", 6, 7)]}
P_STEPS = [("index", 8, 9), ("addr", 9, 10), ("prefetch", 10, 1), ("empty_wait", 1, 3), ("dequant_store", 3, 0), ("fence", 0, 2), ("copies", 2, 7), ("fill", 3, 4),
           ("pfull", 4, 6), ("full_arrive", 6, 5)]


def _d(a, b):
    """Cycles from stamp a to stamp b (u32 clock, wrapping)."""
    import numpy as np

    return ((b.astype(np.int64) - a.astype(np.int64)) % (1 << 32)).astype(np.float64)


def _steady(tr, slot: int):
    """(cta, n, steady slice) for each CTA whose warp in `slot` stamped at least 12 tiles (n counted from its
    FULL-wait stamps); the slice leaves out the first and last 4 tiles."""
    import numpy as np

    for cta in range(tr.shape[0]):
        n = int(np.count_nonzero(tr[cta, slot, :, 1]))
        if n >= 12:
            yield cta, n, slice(4, n - 4)


def summarize(tr, has_p: bool) -> dict:
    """tr: u32 [ctas][3 slots][tiles][12 events]. Medians over CTAs and steady-state tiles."""
    import numpy as np

    out: dict = {}
    split = not np.count_nonzero(tr[:, 1, :, 3])  # no B0 stamp: split consumers
    for slot, name in ((1, "wg0"), (2, "wg1")):
        steps = C_STEPS_SPLIT[name] if split else C_STEPS
        rows = {k: [] for k, _, _ in steps}
        rows["period"], rows["loop"] = [], []
        per_all, gaps = [], []  # over each CTA's whole sequence, segment boundaries included
        for cta, n, sl in _steady(tr, slot):
            c = tr[cta, slot]
            for k, a, b in steps:
                rows[k].append(_d(c[sl, a], c[sl, b]))
            rows["period"].append(_d(c[4:n - 5, 0], c[5:n - 4, 0]))
            rows["loop"].append(_d(c[4:n - 5, 7], c[5:n - 4, 0]))
            per_all.append(_d(c[:n - 1, 0], c[1:n, 0]))
            gaps.append(_d(c[:n - 1, 7], c[1:n, 0]))
        out[name] = {k: float(np.median(np.concatenate(v))) for k, v in rows.items() if v}
        # the mean period, and the median gap from the release of a segment's last tile to the next tile's
        # loop top over the gaps above 4x the median loop (the epilogue, the next request's Q and metadata)
        if per_all and "loop" in out[name]:
            g = np.concatenate(gaps)
            big = g[g > 4 * max(out[name]["loop"], 1.0)]
            out[name]["period_mean"] = float(np.mean(np.concatenate(per_all)))
            if big.size:
                out[name]["segment_gap"] = float(np.median(big))
    if has_p:
        rows = {k: [] for k, _, _ in P_STEPS}
        rows["loop"], rows["full_to_wake"], rows["release_to_refill"] = [], [], []
        for cta, n, sl in _steady(tr, 1):
            p, c = tr[cta, 0], tr[cta, 1]
            for k, a, b in P_STEPS:
                rows[k].append(_d(p[sl, a], p[sl, b]))
            rows["loop"].append(_d(p[4:n - 5, 5], p[5:n - 4, 8]))
            rows["full_to_wake"].append(_d(p[sl, 6], c[sl, 1]))  # FULL arrival -> consumer wakes (<0: it was late)
            rows["release_to_refill"].append(_d(c[4:n - 6, 7], p[6:n - 4, 3]))  # tile t released -> t + 2 may fill
        out["producer"] = {}
        for k, v in rows.items():
            x = np.concatenate(v)
            x = np.where(x > (1 << 31), x - (1 << 32), x)  # signed
            out["producer"][k] = float(np.median(x))
    return out


def run_variant(case_name: str, out: Path) -> dict:
    """In this process (DSV41_CUDA_LIB already set): run the case, read the stamps, summarize."""
    import numpy as np

    import cuda_ffi
    from benchmarks import sparse_mla as bm

    case = next(c for c in bm.DECODE_CASES if c.name == case_name)
    res = bm.run_case(case, "cuda", bm._timer("auto")[0], sets=2, iterations=5)
    lib = cuda_ffi.load_library()
    shape = (ctypes.c_int * 4)()
    lib.dsv41_trace_shape(shape)
    tr = np.zeros(tuple(shape), np.uint32)
    rc = lib.dsv41_trace_read(tr.ctypes.data_as(ctypes.c_void_p), ctypes.c_size_t(tr.nbytes))
    if rc != 0:
        raise RuntimeError(f"dsv41_trace_read failed: cudaError {rc}")
    np.save(out, tr)
    s = summarize(tr, has_p=bool(np.count_nonzero(tr[:, 0])))
    s["us"] = res["us"]
    return s


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.decode_trace", description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", default="consumers,full")
    ap.add_argument("--case", default="decode_headline_h128")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu_out")))
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    if a.child:
        s = run_variant(a.case, a.out / f"trace_{a.child}.npy")
        print("TRACE " + json.dumps(s))
        return 0
    from cuda_ffi.build import build_library

    for v in a.variants.split(","):
        lib = build_library(archs="90a", out_dir=Path(f"/tmp/dsv41_tr_{v}"), build_dir=Path(f"/tmp/dsv41_trb_{v}"),
                            defines=VARIANTS[v])
        env = dict(os.environ, DSV41_CUDA_LIB=str(lib))
        r = subprocess.run([sys.executable, "-m", "benchmarks.decode_trace", "--child", v, "--case", a.case,
                            "--out", str(a.out)], env=env, capture_output=True, text=True)
        line = [x for x in r.stdout.splitlines() if x.startswith("TRACE ")]
        if r.returncode or not line:
            print(f"--- {v}: failed\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
            continue
        s = json.loads(line[0][6:])
        print(f"--- {v} ({' '.join(VARIANTS[v])}): {s.pop('us'):.1f} us per call; median cycles per tile")
        for role, d in s.items():
            print(f"  {role:9s} " + "  ".join(f"{k} {x:.0f}" for k, x in d.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
