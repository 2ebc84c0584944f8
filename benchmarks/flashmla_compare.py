"""Side by side with FlashMLA on its own V4 cases: the same inputs, the same clock.

    python -m benchmarks.flashmla_compare [--cases decode,prefill,few_heads,<names>] [--impls cuda] [--out DIR]
                                          [--record benchmarks/RESULTS.md]

FlashMLA (`flash_mla`, built on the GPU machine for measurement only; never part of this repository) gets
our inputs through DLPack (`benchmarks/flashmla_cases.py`: its generator's recipe) and reuses its
scheduling metadata across calls, as vLLM does; our decode reuses a plan made once (and, for "cuda", is also
timed with the plan made in the call). Both are timed by `benchmarks.cupti.kernel_times` (the sum of each
call's CUPTI kernel durations, after an L2 flush), and both outputs are compared. Prints the per-case table,
the geometric mean of FlashMLA's time over ours (> 1: we are faster) per op, and writes JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # FlashMLA's PyTorch allocator needs room too


def _flashmla_decode(case, x):
    """run() and its output of FlashMLA's sparse decode over the case's arrays."""
    import flash_mla
    import torch

    def t(a):
        return torch.from_dlpack(a)

    def cache(c, bs):
        return t(c)[:, : bs * 584].view(c.shape[0], bs, 1, 584).view(torch.float8_e4m3fn)

    sched, _ = flash_mla.get_mla_metadata()
    args = dict(q=t(x["q"]), k=cache(x["kv_cache"], case.block_size), idx=t(x["indices"]), sink=t(x["attn_sink"]))
    if case.extra_topk:
        args.update(ek=cache(x["extra_kv_cache"], case.extra_block_size), eidx=t(x["extra_indices"]),
                    el=t(x["extra_topk_length"]) if x["extra_topk_length"] is not None else None)

    def run():
        return flash_mla.flash_mla_with_kvcache(
            args["q"], args["k"], None, None, 512, sched, None, x["softmax_scale"], False, True, args["idx"],
            args["sink"], args.get("ek"), args.get("eidx"), None, args.get("el"))

    return run


def _flashmla_prefill(case, x):
    import flash_mla
    import torch

    q, kv, idx, sink = (torch.from_dlpack(x[k]) for k in ("q", "kv", "indices", "attn_sink"))

    def run():
        return flash_mla.flash_mla_sparse_fwd(q, kv[:, None, :], idx[:, None, :], x["softmax_scale"], 512, sink, None)

    return run


def _padded_heads(x: dict, heads: int) -> dict:
    """x with q's heads (axis -2) padded with zeros to `heads` and the sink with -inf: FlashMLA's input for a
    call of fewer heads than it supports (vLLM pads the same way)."""
    import jax.numpy as jnp

    q, sink = x["q"], x["attn_sink"]
    h = q.shape[-2]
    pads = [(0, 0)] * q.ndim
    pads[-2] = (0, heads - h)
    return dict(x, q=jnp.pad(q, pads), attn_sink=jnp.pad(sink, (0, heads - h), constant_values=-jnp.inf))


def copy_gbps(iterations: int = 10) -> float:
    """The device's measured copy bandwidth (GB/s): bytes read + written by an elementwise pass over 1 GiB,
    over its CUPTI kernel time."""
    import jax
    import jax.numpy as jnp

    from benchmarks.cupti import kernel_times

    holder = {"x": jnp.zeros((256 << 20,), jnp.float32)}
    f = jax.jit(lambda a: a + 1.0, donate_argnums=0)

    def run():
        holder["x"] = f(holder["x"])

    us, _ = kernel_times(run, sync=lambda: jax.block_until_ready(holder["x"]), iterations=iterations)
    return 2 * holder["x"].nbytes / us / 1e3


def compare_case(case, impl: str, iterations: int, copy_bw: float | None = None) -> dict:
    import jax
    import numpy as np
    import torch

    import dsv41_jax as d
    from benchmarks import flashmla_cases as F
    from benchmarks.cupti import kernel_times
    from benchmarks.sparse_mla import run_flashmla_case

    decode = isinstance(case, F.DecodeCase)
    x = F.decode_inputs(case) if decode else F.prefill_inputs(case)
    ours = run_flashmla_case(case, impl, iterations, breakdown=True, inputs=x)
    fm_heads = F.flashmla_heads(case.h_q)
    fx = x if fm_heads == case.h_q else _padded_heads(x, fm_heads)
    run = _flashmla_decode(case, fx) if decode else _flashmla_prefill(case, fx)
    buf = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    holder = {}

    def call():
        holder["v"] = run()

    fm_us, fm_kernels = kernel_times(call, sync=torch.cuda.synchronize, iterations=iterations,
                                     flush=lambda: buf.zero_())
    # outputs side by side (our op on the same arrays)
    if decode:
        kw = dict(kv_format="fp8_ds_mla", block_size=case.block_size, softmax_scale=x["softmax_scale"],
                  attn_sink=x["attn_sink"], impl=impl)
        if case.extra_topk:
            kw.update(extra_kv_cache=x["extra_kv_cache"], extra_indices=x["extra_indices"],
                      extra_topk_length=x["extra_topk_length"], extra_kv_format="fp8_ds_mla",
                      extra_block_size=case.extra_block_size)
        mine = d.sparse_mla_decode(x["q"], x["kv_cache"], x["indices"], None, **kw)[0]
    else:
        mine = d.sparse_mla_prefill(x["q"], x["kv"], x["indices"], softmax_scale=x["softmax_scale"],
                                    attn_sink=x["attn_sink"], impl=impl)[0]
    theirs = holder["v"][0].float().cpu().numpy()[..., : case.h_q, :]
    mine = np.asarray(jax.device_get(mine), np.float32)
    err = float(np.abs(mine - theirs).max() / max(np.abs(theirs).max(), 1e-30))
    res = dict(ours, flashmla_us=fm_us, flashmla_kernels=fm_kernels, speedup=fm_us / ours["us"],
               speedup_noplan=fm_us / ours["us_noplan"] if "us_noplan" in ours else None, rel_err_vs_flashmla=err,
               flashmla_heads=fm_heads, moved_bytes=x["moved_bytes"])
    if copy_bw:  # the memory bound of what the call moves, at the measured copy bandwidth
        res.update(copy_gbps=copy_bw, bound_us=x["moved_bytes"] / copy_bw / 1e3,
                   frac_copy_bw=x["moved_bytes"] / ours["us"] / 1e3 / copy_bw)
    return res


def _release() -> None:
    """Free the case's device memory (PyTorch's cache of FlashMLA's buffers, JAX's arrays)."""
    import gc

    import torch

    gc.collect()
    torch.cuda.empty_cache()


def _geomean(v):
    v = [a for a in v if a]
    return math.exp(sum(math.log(a) for a in v) / len(v)) if v else float("nan")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="decode,prefill")
    ap.add_argument("--impls", default="cuda")
    ap.add_argument("--iterations", type=int, default=10)
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    ap.add_argument("--record", default=None)
    from benchmarks.inputs import PALLAS_CTAS_HELP, pallas_ctas

    ap.add_argument("--pallas-ctas", default=None, help=PALLAS_CTAS_HELP)
    args = ap.parse_args(argv)
    with pallas_ctas(args.pallas_ctas):
        return _main(ap, args, argv)


def _main(ap, args, argv) -> int:

    import jax

    from benchmarks import flashmla_cases as F
    from benchmarks.cupti import available
    from benchmarks.inputs import git_commit

    why = available()
    if why is not None:
        ap.error(f"needs CUPTI on a GPU: {why}")
    try:
        import flash_mla  # noqa: F401
    except ImportError as e:
        ap.error(f"FlashMLA is not importable ({e}); build it on the GPU machine first")
    cases = F.select_cases(args.cases)  # (few_heads, head_counts: FlashMLA on q padded to 64 or 128 heads)
    device = jax.devices()[0].device_kind
    copy_bw = copy_gbps()
    print(f"# measured copy bandwidth {copy_bw:.0f} GB/s (read + write of 1 GiB)")
    print(f"# device {device}; commit {git_commit()}; FlashMLA time / ours (> 1: ours faster)")
    os.makedirs(args.out, exist_ok=True)
    meta = dict(date=datetime.date.today().isoformat(), commit=git_commit(), device=device,
                command="python -m benchmarks.flashmla_compare " + " ".join(argv or sys.argv[1:]))

    def save():  # after every case: a run cut short keeps what it measured
        with open(os.path.join(args.out, "flashmla_compare.json"), "w") as f:
            json.dump(dict(meta=meta, results=rows), f, indent=1, default=str)

    rows = []
    for c in cases:
        for impl in args.impls.split(","):
            try:
                r = compare_case(c, impl, args.iterations, copy_bw)
            except Exception as e:
                print(f"{c.name:44s} {impl:7s} FAILED: {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
                continue
            rows.append(r)
            save()
            _release()
            np_ = f"  in-call plan {r['us_noplan']:8.1f} us ({r['speedup_noplan']:.3f}x)" if r.get("speedup_noplan") else ""
            fm_h = f" at {r['flashmla_heads']} heads" if r["flashmla_heads"] != c.h_q else ""
            print(f"{c.name:44s} {impl:7s} FlashMLA{fm_h} {r['flashmla_us']:8.1f} us  ours {r['us']:8.1f} us  "
                  f"{r['speedup']:.3f}x{np_}  moved {r['moved_bytes'] / 1e6:.1f} MB, bound {r['bound_us']:.1f} us "
                  f"({r['frac_copy_bw']:.2f} of copy bw)  (rel diff {r['rel_err_vs_flashmla']:.1e})", flush=True)
    for op in ("decode", "prefill"):
        sel = [r for r in rows if r["op"] == op]
        if sel:
            print(f"# {op}: geomean {_geomean([r['speedup'] for r in sel]):.3f}x over {len(sel)} cases, worst "
                  f"{min(r['speedup'] for r in sel):.3f}x" + (
                      f"; in-call plan {_geomean([r['speedup_noplan'] for r in sel]):.3f}x" if op == "decode" and
                      all(r.get("speedup_noplan") for r in sel) else ""))
    if args.record and rows:
        with open(args.record, "a") as f:
            for r in rows:
                noplan = f" (plan in the call: {r['us_noplan']:.1f})" if "us_noplan" in r else ""
                fm_h = f" at {r['flashmla_heads']} heads" if r["flashmla_heads"] != r["config"]["h_q"] else ""
                f.write(f"| {meta['date']} | {meta['commit']} | {device} | {r['case']} | {r['impl']} | "
                        f"{r['us']:.1f}{noplan} | FlashMLA{fm_h} {r['flashmla_us']:.1f} | {r['speedup']:.3f}x | "
                        f"moved {r['moved_bytes'] / 1e6:.1f} MB, {r['frac_copy_bw']:.2f} of {r['copy_gbps']:.0f} GB/s | "
                        f"`{meta['command']}` |\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
