"""Condense an Nsight Compute report into the few lines that place a kernel's time.

    ncu -i R.ncu-rep --page raw --csv > raw.csv
    ncu -i R.ncu-rep --page source --csv --print-source sass > sass.csv
    python -m benchmarks.ncu_summary --raw raw.csv --source sass.csv [--top 60]

--raw: the warp-state breakdown (cycles per issued instruction spent in each stall reason) and the
pipe utilisations of each profiled kernel. --source: the instructions with the most stall samples,
each with its largest reasons, and the samples summed per stall reason over the kernel.
"""

from __future__ import annotations

import argparse
import csv
import re
import sys


def _num(x: str) -> float | None:
    try:
        return float(x.replace(",", ""))
    except (ValueError, AttributeError):
        return None


def summarize_raw(path: str, top: int) -> None:
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    rows = [r for r in rows if r]
    head = rows[0]
    body = [r for r in rows[1:] if _num(r[0]) is not None or (r and r[0].isdigit())]
    units = rows[1] if len(rows) > 1 and _num(rows[1][0]) is None else None
    for r in body:
        kname = next((r[i] for i, h in enumerate(head) if h == "Kernel Name"), "?")
        print(f"## kernel {kname[:100]}")
        pairs = []
        for i, h in enumerate(head):
            v = _num(r[i]) if i < len(r) else None
            if v is None:
                continue
            if "issue_stalled" in h and (h.endswith(".ratio") or h.endswith(".pct")):
                pairs.append((v, h))
        for v, h in sorted(pairs, reverse=True)[:top]:
            print(f"  {v:10.3f}  {h}")
        for i, h in enumerate(head):
            if re.search(r"(inst_executed_pipe_.*|pipe_.*cycles_active).*pct_of_peak_sustained_active$", h) or \
                    h in ("gpu__time_duration.sum", "sm__throughput.avg.pct_of_peak_sustained_elapsed",
                          "smsp__inst_executed.sum", "sm__cycles_elapsed.avg.per_second",
                          "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum",
                          "l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum",
                          "smsp__cycles_active.avg", "sm__cycles_elapsed.max"):
                v = _num(r[i]) if i < len(r) else None
                if v is not None and v > 0:
                    u = units[i] if units else ""
                    print(f"  {v:14.3f} {u:8s} {h}")


def summarize_source(path: str, top: int) -> None:
    with open(path, newline="") as f:
        text = f.read().splitlines()
    # ncu prints a preamble before the CSV header on some versions
    start = next((i for i, line in enumerate(text) if '"Address"' in line or '"Source"' in line), 0)
    rows = list(csv.reader(text[start:]))
    head = rows[0]
    print("columns:", ", ".join(head)[:1500])
    col = {h: i for i, h in enumerate(head)}
    total_col = next((h for h in head if h.startswith("Warp Stall Sampling (All")), None)
    if total_col is None:
        print("no stall-sampling column")
        return
    src_col = "Source" if "Source" in col else head[1]
    reason_cols = [h for h in head if h.startswith("stall_") or h.startswith("Stall ")]
    data = []
    sums = {h: 0.0 for h in reason_cols}
    total = 0.0
    for r in rows[1:]:
        if len(r) != len(head):
            continue
        v = _num(r[col[total_col]])
        if v is None:
            continue
        total += v
        for h in reason_cols:
            x = _num(r[col[h]])
            if x:
                sums[h] += x
        data.append((v, r))
    print(f"total samples {total:.0f}")
    for h, v in sorted(sums.items(), key=lambda kv: -kv[1])[:20]:
        print(f"  {v:10.0f} ({100 * v / max(total, 1):5.1f}%) {h}")
    data.sort(key=lambda t: -t[0])
    for v, r in data[:top]:
        reasons = sorted(((_num(r[col[h]]) or 0.0, h) for h in reason_cols), reverse=True)[:3]
        rs = " ".join(f"{h.replace('stall_', '')}={x:.0f}" for x, h in reasons if x)
        addr = r[col["Address"]] if "Address" in col else ""
        print(f"{v:7.0f} {100 * v / max(total, 1):5.1f}% {addr:>6s} {r[col[src_col]][:70]:70s} {rs}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--raw")
    ap.add_argument("--source")
    ap.add_argument("--top", type=int, default=60)
    a = ap.parse_args(argv)
    if a.raw:
        summarize_raw(a.raw, a.top)
    if a.source:
        summarize_source(a.source, a.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
