"""Head-parallel sparse MLA decode over 1 and 2 (or more) GPUs: scaling of one decode call.

    python -m benchmarks.sharded_decode [--devices 1,2] [--impl auto] [--b 128] [--h 128] [--topk 2048]
                                        [--record benchmarks/RESULTS.md]

The query heads are split over a 'tp' mesh axis with `sparse_mla_decode_sharded`; each GPU holds a
full copy of the (replicated) MQA latent cache. Timing: one jitted call runs `--calls` decode
steps back to back over different queries (`lax.map`), wall clock over several repeats, median,
divided by the number of steps, so host dispatch is amortised the same way for every device
count (CUPTI would sum the kernels of all GPUs). Prints time per step, TFLOP/s (FlashMLA's
count) and the speed-up over one device.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", default="1,2")
    ap.add_argument("--impl", default="auto")
    ap.add_argument("--b", type=int, default=128)
    ap.add_argument("--s-q", type=int, default=2)
    ap.add_argument("--h", type=int, default=128)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--fmt", default="fp8_ds_mla")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--tokens-per-req", type=int, default=8192)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--record", default=None)
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from benchmarks.inputs import filled_cache, git_commit, request_indices
    from dsv41_jax.sharding import sparse_mla_decode_sharded

    devs = jax.devices()
    counts = [int(x) for x in args.devices.split(",")]
    bs, fmt = args.block_size, args.fmt
    key = jax.random.PRNGKey(0)
    k1, k2, k3, k4 = jax.random.split(key, 4)
    cache, cap = filled_cache(k1, args.b * args.tokens_per_req, bs, fmt)
    idx = request_indices(k2, args.b, args.s_q, args.topk, cap)
    qs = jax.random.normal(k3, (args.calls, args.b, args.s_q, args.h, 512), jnp.float32).astype(jnp.bfloat16)
    sink = jax.random.normal(k4, (args.h,), jnp.float32)
    flops = 2 * args.h * args.b * args.s_q * args.topk * 1024
    commit = git_commit()
    print(f"# {devs[0].device_kind} x{len(devs)}; b={args.b} s_q={args.s_q} h={args.h} topk={args.topk} {fmt}; "
          f"impl={args.impl}; commit {commit}")
    base = None
    rows_out = []
    for n in counts:
        if n > len(devs):
            print(f"{n} devices: skipped, only {len(devs)} present")
            continue
        mesh = Mesh(np.array(devs[:n]), ("tp",))
        rep = NamedSharding(mesh, P())
        c = jax.device_put(cache, rep)
        i = jax.device_put(idx, rep)
        q = jax.device_put(qs, NamedSharding(mesh, P(None, None, None, "tp", None)))
        s = jax.device_put(sink, NamedSharding(mesh, P("tp")))

        @jax.jit
        def steps(q, c, i, s):
            def one(qq):
                out, lse = sparse_mla_decode_sharded(qq, c, i, None, mesh=mesh, head_axis="tp", kv_format=fmt,
                                                     block_size=bs, softmax_scale=512 ** -0.5, attn_sink=s,
                                                     impl=args.impl)
                return out, lse
            return jax.lax.map(one, q)

        jax.block_until_ready(steps(q, c, i, s))
        ts = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(steps(q, c, i, s))
            ts.append((time.perf_counter() - t0) / args.calls)
        t = statistics.median(ts)
        base = base or t
        tf = flops / t / 1e12
        print(f"{n} device(s): {t * 1e6:9.1f} us/step  {tf:7.1f} TFLOP/s  speed-up {base / t:4.2f}x  "
              f"efficiency {100 * base / t / n:5.1f}%", flush=True)
        rows_out.append((n, t, tf, base / t))
    if args.record and rows_out:
        date = datetime.date.today().isoformat()
        with open(args.record, "a") as f:
            for n, t, tf, sp in rows_out:
                f.write(f"| {date} | {commit} | {devs[0].device_kind} x{n} | sharded decode b={args.b} s_q={args.s_q} "
                        f"h={args.h} topk={args.topk} {fmt} (heads over tp) | {args.impl} | {t * 1e6:.1f} | {tf:.1f} | "
                        f"speed-up {sp:.2f}x | `python -m benchmarks.sharded_decode {' '.join(argv or sys.argv[1:])}` |\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
