"""Wall time and peak memory of the xla reference decode on the CPU.

    python -m benchmarks.cpu_reference [--b 128] [--s-q 2] [--h 128] [--topk 128] [--extra-topk 1024]

The default is the V4 production decode shape the formats/reference issue asks about: b=128,
s_q=2, h_q=128, SWA top-k 128 (fp8_ds_mla, page 64) plus compressed top-k 1024 (fp8_ds_mla,
page 64). Reports compile time, the median of the timed runs, and the process's peak resident
memory (ru_maxrss), which must stay well under a 24 GiB CI machine.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--b", type=int, default=128)
    ap.add_argument("--s-q", type=int, default=2)
    ap.add_argument("--h", type=int, default=128)
    ap.add_argument("--topk", type=int, default=128)
    ap.add_argument("--extra-topk", type=int, default=1024)
    ap.add_argument("--tokens-per-req", type=int, default=2048)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp

    import dsv41_jax as d
    from benchmarks.inputs import filled_cache, request_indices

    key = jax.random.PRNGKey(0)
    bs, fmt = 64, "fp8_ds_mla"
    n = args.b * args.tokens_per_req
    k1, k2, k3, k4, k5 = jax.random.split(key, 5)
    (main_c, cap), (extra_c, _) = filled_cache(k1, n, bs, fmt), filled_cache(k2, n, bs, fmt)
    idx = request_indices(k3, args.b, args.s_q, args.topk, cap)
    eidx = request_indices(k4, args.b, args.s_q, args.extra_topk, cap)
    q = jax.random.normal(k5, (args.b, args.s_q, args.h, 512), jnp.float32).astype(jnp.bfloat16)
    sink = jnp.zeros((args.h,), jnp.float32)
    f = jax.jit(lambda q, c, i, e, ei: d.sparse_mla_decode(
        q, c, i, None, kv_format=fmt, block_size=bs, softmax_scale=512 ** -0.5, attn_sink=sink,
        extra_kv_cache=e, extra_indices=ei, impl="xla"))
    t0 = time.perf_counter()
    jax.block_until_ready(f(q, main_c, idx, extra_c, eidx))
    first = time.perf_counter() - t0
    times = []
    for _ in range(args.runs):
        t0 = time.perf_counter()
        jax.block_until_ready(f(q, main_c, idx, extra_c, eidx))
        times.append(time.perf_counter() - t0)
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    flops = 2 * args.h * args.b * args.s_q * (args.topk + args.extra_topk) * 1024
    med = statistics.median(times)
    print(f"xla reference decode b={args.b} s_q={args.s_q} h_q={args.h} topk={args.topk}+{args.extra_topk} "
          f"on {jax.devices()[0].device_kind}: first call (compile + run) {first:.2f} s, "
          f"median of {args.runs} runs {med:.2f} s ({flops / med / 1e9:.1f} GFLOP/s), peak RSS {peak_gib:.2f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
