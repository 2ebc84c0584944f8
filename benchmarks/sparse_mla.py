"""Benchmark sparse MLA decode / prefill for every available implementation.

    python -m benchmarks.sparse_mla [--impls xla,pallas,cuda] [--cases decode,prefill] [--quick]
                                    [--out bench_out] [--record benchmarks/RESULTS.md] [--breakdown]
    python -m benchmarks.sparse_mla --suite flashmla [--cases decode,prefill,<names>] [--impls cuda]
    python -m benchmarks.sparse_mla --suite step [--step-batches 64,128] [--impls cuda]
    python -m benchmarks.sparse_mla --suite mega [--cases <names> | mega_decode | mega_prefill] [--impls cuda]

Suites: "default" (the cases below); "flashmla" (FlashMLA's own V4 decode and prefill performance cases
and inputs, `benchmarks/flashmla_cases.py`, each call after an L2 flush; decode over a plan made once and
reused, as FlashMLA reuses its metadata, and for "cuda" also with the plan made in the call); "step" (one
V4.1-Flash decode step's attention, `benchmarks/step_attention.py`); "mega" (the fused mega decode and prefill
against the plain decode / prefill and the unfused chain, `benchmarks/mega_decode.py`,
`benchmarks/mega_prefill.py`). `benchmarks/flashmla_compare.py` runs the flashmla cases beside FlashMLA itself.

Device-side timing with CUPTI (`jax.experimental.mosaic.gpu.profiler.measure`: the sum of the
kernels each call launches, so host dispatch is excluded); wall clock with block_until_ready as a
fallback (CPU). Each case draws several independent input sets (fresh indices and queries over a
cache far larger than L2) and reports the median over sets x iterations, so L2 never serves a
repeat. FLOPs and bytes follow FlashMLA's test harness (flashmla.md section 5):
decode FLOPs = 2 h_q attended (512 + 512), bytes = Q + unique tokens x record bytes (584, 528 or 288 with their
scales; FlashMLA's harness counts 576 for the V4 record) + O;
prefill FLOPs = 2 sum(topk_length) h_q (512 + 512), bytes = Q + unique kv rows x 1024 + O.
Prints a table with TFLOP/s, GB/s and the fraction of the H200 ceilings measured here
(bf16 matmul ~780 TFLOP/s, copy ~4.3 TB/s), writes JSON and a roofline PNG, and appends a dated
row per case to the results file when --record is given. --breakdown also prints each kernel's CUPTI time.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys
import time

PEAK_TFLOPS = 780.0  # bf16 dense matmul measured on this workplace's H200 (device/KINDS.md)
PEAK_GBPS = 4300.0  # device-to-device copy, read + write, same source


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    op: str  # "decode" | "prefill"
    b: int = 1
    s_q: int = 1
    h_q: int = 128
    topk: int = 2048
    block_size: int = 64
    fmt: str = "fp8_ds_mla"
    extra_fmt: str | None = None  # the extra cache's format (None: fmt)
    extra_topk: int = 0
    extra_block_size: int = 64
    s_kv: int = 16384  # tokens per request in the cache (decode) / rows of kv (prefill)
    sink: bool = True


DECODE_CASES = [
    Case("decode_headline_h128", "decode", b=128, s_q=2, h_q=128, topk=2048),
    Case("decode_h64_topk2048", "decode", b=128, s_q=2, h_q=64, topk=2048),
    Case("decode_v4_h128_b128", "decode", b=128, s_q=2, h_q=128, topk=128, block_size=256, extra_topk=1024),
    Case("decode_v4_h64_b128", "decode", b=128, s_q=2, h_q=64, topk=128, block_size=256, extra_topk=512),
    Case("decode_v4_h128_b64", "decode", b=64, s_q=2, h_q=128, topk=128, block_size=256, extra_topk=1024),
    Case("decode_v4_h128_b256", "decode", b=256, s_q=2, h_q=128, topk=128, block_size=256, extra_topk=1024),
    Case("decode_v4_h64_b256", "decode", b=256, s_q=2, h_q=64, topk=128, block_size=256, extra_topk=512),
    Case("decode_v4_h64_b64", "decode", b=64, s_q=2, h_q=64, topk=128, block_size=256, extra_topk=512),
    Case("decode_v4_h8_b128", "decode", b=128, s_q=2, h_q=8, topk=128, block_size=256, extra_topk=512),  # a TP-8 shard
]
# V4.1's records (528 B mxfp8_ds_mla SWA cache, 288 B nvfp4_ds_mla compressed cache) at the V4 shapes above
V41_CASES = [
    Case(f"decode_v41_h{h}_b{b}", "decode", b=b, s_q=2, h_q=h, topk=128, block_size=256,
         extra_topk=1024 if h == 128 else 512, fmt="mxfp8_ds_mla", extra_fmt="nvfp4_ds_mla")
    for h, b in ((64, 64), (64, 128), (64, 256), (128, 128), (8, 128))
]
DECODE_CASES += V41_CASES
PREFILL_CASES = [
    Case("prefill_h128_topk2048", "prefill", s_q=4096, h_q=128, topk=2048, s_kv=32768, fmt="bf16"),
    Case("prefill_v4_h128_topk1024", "prefill", s_q=4096, h_q=128, topk=1024, s_kv=32768, fmt="bf16"),
    Case("prefill_v4_h64_topk512", "prefill", s_q=4096, h_q=64, topk=512, s_kv=32768, fmt="bf16"),
]
QUICK = {"decode_headline_h128", "decode_v4_h128_b128", "prefill_h128_topk2048"}




def _timer(method: str = "auto"):
    """Returns time_fn(f, args, iterations) -> list of ms per call, and the method's name.
    method "wall" skips CUPTI (needed under Nsight Compute, which owns the profiling interface)."""
    import jax

    if method == "auto" and jax.default_backend() == "gpu":
        try:
            from jax.experimental.mosaic.gpu import profiler

            def cupti(f, args, iterations):
                _, t = profiler.measure(f, aggregate=True, iterations=iterations)(*args)
                if t is None:
                    raise RuntimeError("CUPTI returned no kernel timings")
                return list(t) if isinstance(t, (list, tuple)) else [t]

            return cupti, "cupti"
        except Exception as e:  # pragma: no cover - depends on the GPU image
            print(f"# CUPTI timing unavailable ({e}); falling back to wall clock", file=sys.stderr)

    def wall(f, args, iterations):
        jax.block_until_ready(f(*args))
        out = []
        for _ in range(iterations):
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args))
            out.append(1e3 * (time.perf_counter() - t0))
        return out

    return wall, "wallclock"


def _breakdown(f, args, iterations: int) -> dict[str, float]:
    """CUPTI per-kernel times of one call of f: {kernel name: median us over `iterations` calls}."""
    from jax.experimental.mosaic.gpu import profiler

    _, runs = profiler.measure(f, aggregate=False, iterations=iterations)(*args)
    if runs and isinstance(runs[0], tuple):  # (iterations == 1: one run, not a list of runs)
        runs = [runs]
    per: dict[str, list[float]] = {}
    for run in runs or []:
        for name, ms in run:
            per.setdefault(name, []).append(1e3 * ms)
    return {name: statistics.median(v) for name, v in per.items()}


def _make_decode_inputs(case: Case, key):
    """A large fp8/bf16 cache (b * s_kv tokens) and `sets` draws of (q, indices, lengths)."""
    import jax

    from benchmarks.inputs import filled_cache

    k0, k1 = jax.random.split(key)
    main, cap = filled_cache(k0, case.b * case.s_kv, case.block_size, case.fmt)
    extra = ecap = None
    if case.extra_topk:
        extra, ecap = filled_cache(k1, case.b * max(case.s_kv // 4, case.extra_topk), case.extra_block_size,
                                   case.extra_fmt or case.fmt)
    return main, cap, extra, ecap


def _decode_draw(case: Case, key, cap, ecap):
    import jax
    import jax.numpy as jnp

    from benchmarks.inputs import request_indices

    kq, ki, ke = jax.random.split(key, 3)
    q = jax.random.normal(kq, (case.b, case.s_q, case.h_q, 512), jnp.float32).astype(jnp.bfloat16)
    idx = request_indices(ki, case.b, case.s_q, case.topk, cap)
    eidx = request_indices(ke, case.b, case.s_q, case.extra_topk, ecap) if case.extra_topk else None
    return q, idx, eidx


def _unique(x) -> int:
    import numpy as np

    return int(np.unique(np.asarray(x)).size)


def run_case(case: Case, impl: str, timer, sets: int, iterations: int, seed: int = 0, breakdown: bool = False) -> dict:
    """Times `impl` on `case` (median over sets x iterations); breakdown: also the CUPTI per-kernel times of the
    last set (key "kernels": {name: us})."""
    import jax
    import jax.numpy as jnp

    import dsv41_jax as d
    from dsv41_jax import kv_cache as kvc

    key = jax.random.PRNGKey(seed)
    sink = jax.random.normal(jax.random.PRNGKey(seed + 1), (case.h_q,), jnp.float32) if case.sink else None
    times = []
    if case.op == "decode":
        main, cap, extra, ecap = _make_decode_inputs(case, key)
        kw = dict(kv_format=case.fmt, block_size=case.block_size, softmax_scale=512 ** -0.5, attn_sink=sink, impl=impl)
        if extra is not None:
            kw.update(extra_kv_format=case.extra_fmt or case.fmt, extra_block_size=case.extra_block_size)
        f = jax.jit(lambda q, c, i, e, ei: d.sparse_mla_decode(
            q, c, i, None, **kw, **({"extra_kv_cache": e, "extra_indices": ei} if e is not None else {})))
        rec, erec = kvc.record_bytes(case.fmt), kvc.record_bytes(case.extra_fmt or case.fmt)
        kv_bytes = 0
        for s in range(sets):
            q, idx, eidx = _decode_draw(case, jax.random.fold_in(key, 100 + s), cap, ecap)
            args = (q, main, idx, extra, eidx)
            times += timer(f, args, iterations)
            kv_bytes += _unique(idx) * rec + (_unique(eidx) * erec if eidx is not None else 0)
        attended = case.b * case.s_q * (case.topk + case.extra_topk)
        flops = 2 * case.h_q * attended * 1024
        bytes_ = 2 * 2 * case.b * case.s_q * case.h_q * 512 + kv_bytes / sets
    else:
        kk, kq = jax.random.split(key)
        kv = jax.random.normal(kk, (case.s_kv, 512), jnp.float32).astype(jnp.bfloat16)
        f = jax.jit(lambda q, kv, i: d.sparse_mla_prefill(q, kv, i, softmax_scale=512 ** -0.5, attn_sink=sink, impl=impl))
        uniq = 0
        for s in range(sets):
            k1, k2 = jax.random.split(jax.random.fold_in(kq, s))
            q = jax.random.normal(k1, (case.s_q, case.h_q, 512), jnp.float32).astype(jnp.bfloat16)
            idx = jax.random.randint(k2, (case.s_q, case.topk), 0, case.s_kv).astype(jnp.int32)
            args = (q, kv, idx)
            times += timer(f, args, iterations)
            uniq += _unique(idx)
        flops = 2 * case.s_q * case.topk * case.h_q * 1024
        bytes_ = 2 * 2 * case.s_q * case.h_q * 512 + (uniq / sets) * 1024
    kernels = _breakdown(f, args, iterations) if breakdown else None
    ms = statistics.median(times)
    tflops = flops / (ms * 1e-3) / 1e12
    gbps = bytes_ / (ms * 1e-3) / 1e9
    return dict(case=case.name, op=case.op, impl=impl, ms=ms, us=ms * 1e3, tflops=tflops, gbps=gbps,
                frac_flops=tflops / PEAK_TFLOPS, frac_bw=gbps / PEAK_GBPS, flops=flops, bytes=bytes_,
                samples=len(times), spread=(max(times) - min(times)) / ms if ms else 0.0, config=dataclasses.asdict(case),
                **({"kernels": kernels} if kernels is not None else {}))


def _plot(results: list[dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("# matplotlib not installed: no roofline plot", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(7, 5))
    xs = [10 ** (i / 10) for i in range(-10, 41)]
    ax.plot(xs, [min(PEAK_TFLOPS, x * PEAK_GBPS / 1e3) for x in xs], "k-", lw=1, label="H200 roofline (measured ceilings)")
    markers = {"xla": "s", "pallas": "o", "cuda": "^"}
    for r in results:
        ai = r["flops"] / r["bytes"]
        ax.loglog(ai, r["tflops"], markers.get(r["impl"], "x"), label=f"{r['impl']} {r['case']}")
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("TFLOP/s")
    ax.set_title("sparse MLA on the H200")
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run_flashmla_case(case, impl: str, iterations: int, breakdown: bool = False, inputs: dict | None = None) -> dict:
    """One FlashMLA case (`benchmarks.flashmla_cases`): decode over a plan made once (and, for cuda, also with
    the plan made in the call: key "us_noplan"), or prefill; CUPTI kernel time per call after an L2 flush.
    inputs: the case's draw (default: drawn here)."""
    import jax
    import jax.numpy as jnp

    import dsv41_jax as d
    from benchmarks import flashmla_cases as F
    from benchmarks.cupti import kernel_times

    holder = {"flush": jnp.zeros((64 << 20,), jnp.uint32)}  # 256 MB, several times the L2
    flush_fn = jax.jit(lambda b: b + 1, donate_argnums=0)

    def flush():
        holder["flush"] = flush_fn(holder["flush"])

    def timed(f, *args):
        def run():
            holder["v"] = f(*args)

        return kernel_times(run, sync=lambda: jax.block_until_ready((holder.get("v"), holder["flush"])),
                            iterations=iterations, flush=flush)

    res = dict(case=case.name, impl=impl, config=dataclasses.asdict(case))
    if isinstance(case, F.DecodeCase):
        op = "decode"
        x = inputs or F.decode_inputs(case)
        kw = dict(kv_format="fp8_ds_mla", block_size=case.block_size, softmax_scale=x["softmax_scale"], impl=impl)
        if case.extra_topk:
            kw.update(extra_kv_format="fp8_ds_mla", extra_block_size=case.extra_block_size)
        f = jax.jit(lambda plan, q, c, i, s, ec, ei, el: d.sparse_mla_decode(
            q, c, i, None, attn_sink=s, extra_kv_cache=ec, extra_indices=ei, extra_topk_length=el, plan=plan, **kw))
        el = x["extra_topk_length"]
        plan = jax.block_until_ready(d.make_decode_plan(
            jnp.full((case.b,), case.topk, jnp.int32), s_q=case.s_q, num_heads=case.h_q, topk=case.topk,
            extra_topk_length=el, extra_topk=case.extra_topk))
        args = (x["q"], x["kv_cache"], x["indices"], x["attn_sink"], x["extra_kv_cache"], x["extra_indices"], el)
        us, kernels = timed(f, plan, *args)
        if impl == "cuda":
            res["us_noplan"], res["kernels_noplan"] = timed(f, None, *args)
    else:
        op = "prefill"
        x = inputs or F.prefill_inputs(case)
        f = jax.jit(lambda q, kv, i, s: d.sparse_mla_prefill(q, kv, i, softmax_scale=x["softmax_scale"], attn_sink=s,
                                                             impl=impl))
        us, kernels = timed(f, x["q"], x["kv"], x["indices"], x["attn_sink"])
    res.update(op=op, us=us, ms=us / 1e3, flops=x["flops"], bytes=x["bytes"], tflops=x["flops"] / us / 1e6,
               gbps=x["bytes"] / us / 1e3)
    res.update(frac_flops=res["tflops"] / PEAK_TFLOPS, frac_bw=res["gbps"] / PEAK_GBPS, spread=0.0)
    if breakdown:
        res["kernels"] = kernels
    return res


def _attempt(label: str, run):
    """run() or, when it raises, None after a FAILED line naming the case (the suite goes on with the next)."""
    try:
        return run()
    except Exception as e:
        print(f"{label} FAILED: {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
        return None


def _flashmla_suite(args, impls) -> list[dict]:
    from benchmarks import flashmla_cases as F

    cases = F.select_cases(args.cases)
    results = []
    for c in cases:
        for impl in impls:
            r = _attempt(f"{c.name:44s} {impl:7s}",
                         lambda: run_flashmla_case(c, impl, args.iterations, breakdown=args.breakdown))
            if r is None:
                continue
            results.append(r)
            noplan = f"  (plan in the call {r['us_noplan']:8.1f} us)" if "us_noplan" in r else ""
            print(f"{c.name:44s} {impl:7s} {r['us']:9.1f} us {r['tflops']:7.1f} TFLOP/s {r['gbps']:6.0f} GB/s{noplan}",
                  flush=True)
            for name, us in sorted(r.get("kernels", {}).items(), key=lambda kv: -kv[1]):
                print(f"    kernel {us:10.1f} us  {name[:100]}", flush=True)
    return results


def _step_suite(args, impls) -> list[dict]:
    from benchmarks.step_attention import run_step

    results = []
    for b in (int(x) for x in args.step_batches.split(",")):
        for impl in impls:
            r = _attempt(f"step_v41_flash_b{b} {impl:7s}", lambda: run_step(b, impl, iterations=args.iterations))
            if r is None:
                continue
            r["case"], r["us"] = f"step_v41_flash_b{b}", r["step_us"]
            results.append(r)
            print(f"step_v41_flash_b{b:<4d} {impl:7s} step {r['step_us']:9.1f} us = metadata {r['metadata_us']:7.1f} + "
                  f"attention {r['attention_us']:9.1f} us; the {r['layers']} calls alone {r['calls_us']:9.1f} us "
                  f"(attention / calls {r['ratio']:.3f})", flush=True)
            for name, us in sorted(r["metadata_kernels"].items(), key=lambda kv: -kv[1]):
                print(f"    metadata kernel {us:8.2f} us  {name[:90]}", flush=True)
    return results


def _mega_suite(args, impls) -> list[dict]:
    from benchmarks.mega_decode import MEGA_CASES, run_mega_case
    from benchmarks.mega_prefill import MEGA_PREFILL_CASES, run_mega_prefill_case

    wanted = set(args.cases.split(","))
    everything = MEGA_CASES + MEGA_PREFILL_CASES
    cases = [c for c in everything if c.name in wanted or ("mega_prefill" in wanted and c in MEGA_PREFILL_CASES)
             or ("mega_decode" in wanted and c in MEGA_CASES)] or everything
    timer, _ = _timer(args.timer)
    results = []
    for c in cases:
        prefill = c in MEGA_PREFILL_CASES
        run = run_mega_prefill_case if prefill else run_mega_case
        for impl in impls:
            r = _attempt(f"{c.name:24s} {impl:7s}", lambda: run(c, impl, timer, args.sets, args.iterations,
                                                               breakdown=args.breakdown))
            if r is None:
                continue
            results.append(r)
            plain = "prefill" if prefill else "decode"
            print(f"{c.name:24s} {impl:7s} mega {r['mega_us']:9.1f} us  plain {plain} {r['plain_us']:9.1f} us  "
                  f"unfused chain {r['chain_us']:9.1f} us  (mega / plain {r['mega_over_plain']:.3f}, chain / mega "
                  f"{r['chain_over_mega']:.3f})", flush=True)
            for way, kernels in r.get("kernels", {}).items():
                for name, us in sorted(kernels.items(), key=lambda kv: -kv[1]):
                    print(f"    {way:5s} kernel {us:10.1f} us  {name[:90]}", flush=True)
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--impls", default=None, help="comma list (default: every registered implementation)")
    ap.add_argument("--cases", default="decode,prefill",
                    help="decode, prefill, v41 (the V4.1 records beside the V4 ones), or case names, comma separated")
    ap.add_argument("--quick", action="store_true", help="headline cases only")
    ap.add_argument("--sets", type=int, default=3, help="independent input draws per case")
    ap.add_argument("--iterations", type=int, default=5)
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    ap.add_argument("--record", default=None, help="append rows to this markdown file (benchmarks/RESULTS.md)")
    ap.add_argument("--timer", choices=("auto", "wall"), default="auto",
                    help="auto: CUPTI on GPUs; wall: wall clock (under ncu)")
    ap.add_argument("--breakdown", action="store_true",
                    help="also print the CUPTI time of each kernel a call launches (CUPTI timing only)")
    ap.add_argument("--suite", choices=("default", "flashmla", "step", "mega"), default="default")
    ap.add_argument("--step-batches", default="64,128", help="requests of the step suite")
    from benchmarks.inputs import PALLAS_CTAS_HELP, pallas_ctas

    ap.add_argument("--pallas-ctas", default=None, help=PALLAS_CTAS_HELP)
    args = ap.parse_args(argv)
    with pallas_ctas(args.pallas_ctas):
        return _main(ap, args, argv)


def _main(ap, args, argv) -> int:

    import jax

    import dsv41_jax as d
    from benchmarks.inputs import git_commit

    wanted = set(args.cases.split(","))
    if "v41" in wanted:  # the V4.1 records beside the 584 B decode of the same shapes
        wanted |= {c.name for c in V41_CASES} | {c.name.replace("v41", "v4") for c in V41_CASES}
    cases = [c for c in DECODE_CASES + PREFILL_CASES
             if c.op in wanted or c.name in wanted]
    if args.quick:
        cases = [c for c in cases if c.name in QUICK]
    impls = args.impls.split(",") if args.impls else sorted(set(d.attention.decode_impls()) | set(d.attention.prefill_impls()))
    timer, method = _timer(args.timer)
    if args.breakdown and method != "cupti":
        ap.error(f"--breakdown needs CUPTI timing, got {method!r} (a GPU, and no --timer wall)")
    dev = jax.devices()[0]
    device = getattr(dev, "device_kind", dev.platform)
    print(f"# device: {device}; timing: {method}; jax {jax.__version__}; commit {git_commit()}; suite {args.suite}")
    results = []
    if args.suite != "default":
        if method != "cupti":
            ap.error(f"--suite {args.suite} needs CUPTI timing (a GPU), got {method!r}")
        cases = []
        results = {"flashmla": _flashmla_suite, "step": _step_suite, "mega": _mega_suite}[args.suite](args, impls)
    for c in cases:
        for impl in impls:
            table = d.attention.decode_impls() if c.op == "decode" else d.attention.prefill_impls()
            if impl not in table:
                continue
            r = _attempt(f"{c.name:28s} {impl:7s}",
                         lambda: run_case(c, impl, timer, args.sets, args.iterations, breakdown=args.breakdown))
            if r is None:
                continue
            results.append(r)
            print(f"{c.name:28s} {impl:7s} {r['us']:10.1f} us {r['tflops']:8.1f} TFLOP/s ({100 * r['frac_flops']:5.1f}%)"
                  f" {r['gbps']:8.0f} GB/s ({100 * r['frac_bw']:5.1f}%)  spread {100 * r['spread']:.1f}%", flush=True)
            for name, us in sorted(r.get("kernels", {}).items(), key=lambda kv: -kv[1]):
                print(f"    kernel {us:10.1f} us  {name[:100]}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    meta = dict(date=datetime.date.today().isoformat(), commit=git_commit(), device=device, timing=method,
                jax=jax.__version__, command="python -m benchmarks.sparse_mla " + " ".join(argv or sys.argv[1:]))
    with open(os.path.join(args.out, "sparse_mla.json"), "w") as f:
        json.dump(dict(meta=meta, results=results), f, indent=1)
    _plot([r for r in results if "flops" in r], os.path.join(args.out, "roofline.png"))
    if args.record and results:
        with open(args.record, "a") as f:
            for r in results:
                if "flops" in r:
                    extra = f" (plan in the call: {r['us_noplan']:.1f} us)" if "us_noplan" in r else ""
                    nums = f"{r['us']:.1f}{extra} | {r['tflops']:.1f} | {r['gbps']:.0f}"
                elif "mega_us" in r:
                    plain = "prefill" if r["op"] == "mega_prefill" else "decode"
                    nums = (f"{r['mega_us']:.1f} (plain {plain} {r['plain_us']:.1f}, unfused chain {r['chain_us']:.1f}) "
                            f"| - | -")
                else:  # the step suite
                    nums = (f"{r['us']:.1f} (metadata {r['metadata_us']:.1f}, attention {r['attention_us']:.1f}, "
                            f"calls alone {r['calls_us']:.1f}) | - | -")
                f.write(f"| {meta['date']} | {meta['commit']} | {device} | {r['case']} | {r['impl']} | {nums} | "
                        f"`{meta['command']}` |\n")
    print(f"# wrote {args.out}/sparse_mla.json and {args.out}/roofline.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
