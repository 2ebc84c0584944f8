"""Time the `impl="cuda"` kernels on the FlashMLA anchor shapes and print a short table.

    PYTHONPATH=. python3 -m cuda_ffi.bench            # all cases (about a minute on an H200)
    PYTHONPATH=. python3 -m cuda_ffi.bench --only decode --iters 50

Inputs are random (never zeros): a paged fp8_ds_mla cache written by `kv_cache.insert` with
`tokens_per_req` distinct tokens per request (several times the L2), indices drawn per query
token. Each time is the median over `--reps` timings of `--iters` back-to-back calls (one
`block_until_ready` per timing). Decode reports three times: "op" is the jitted public op
(`sparse_mla_decode(impl="cuda")`: padding, then the FFI call, whose handler runs the split
planner kernel, the decode and the combine kernels), "kernel" is the FFI call alone (planner +
decode + combine) and "given plan" the FFI call on a plan computed beforehand by
`plan_decode_splits` (copy + decode + combine; FlashMLA's own benchmark also reuses its plan).
TFLOP/s are from the "kernel" time. FLOPs as flashmla.md section 5: decode
2*h*attended*(512+512), prefill 2*sum(topk)*h*1024. Anchors: FlashMLA on this H200
(shared/spec/README.md). The last column is a correctness check against impl="xla" on a slice
(max |cuda - xla| / max |xla| over the first requests / query tokens).
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import cuda_ffi
from cuda_ffi import _ops
from dsv41_jax import kv_cache as kvc
from dsv41_jax import sparse_mla_decode, sparse_mla_prefill
from dsv41_jax.attention import _make_decode_call

DECODE_CASES = [
    # name, b, s_q, h, (main topk, page), (extra topk, extra page) or None, FlashMLA TFLOP/s
    ("decode b128 h128 topk2048", 128, 2, 128, (2048, 64), None, 428.8),
    ("decode b128 h64 topk2048", 128, 2, 64, (2048, 64), None, 282.1),
    ("decode b128 h128 swa128+1024", 128, 2, 128, (128, 256), (1024, 64), 379.2),
    ("decode b128 h64 swa128+512", 128, 2, 64, (128, 256), (512, 64), 236.4),
]
PREFILL_CASES = [
    # name, s_q, h, topk, s_kv, FlashMLA TFLOP/s
    ("prefill sq4096 h128 topk2048", 4096, 128, 2048, 65536, 636.7),
    ("prefill sq4096 h128 topk1024", 4096, 128, 1024, 65536, 599.1),
    ("prefill sq4096 h64 topk512", 4096, 64, 512, 65536, 500.9),
]


def _time(fn, args, iters: int, reps: int) -> float:
    jax.block_until_ready(fn(*args))  # compile + warm up
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        ts.append((time.perf_counter() - t0) / iters)
    return statistics.median(ts)


def _cache(key, n_tokens: int, page: int, fmt: str):
    nb = -(-n_tokens // page)
    kv = jax.random.normal(key, (nb * page, 512), jnp.float32)
    kv = (kv * jnp.exp(jax.random.uniform(jax.random.fold_in(key, 1), (nb * page, 1), minval=-2, maxval=1)))
    cache = kvc.allocate(nb, page, fmt)
    return kvc.insert(cache, kv.astype(jnp.bfloat16), jnp.arange(nb * page, dtype=jnp.int32), fmt=fmt,
                      block_size=page), nb * page


def bench_decode(iters: int, reps: int, tokens_per_req: int):
    rows = []
    for name, b, s_q, h, (topk, page), extra, anchor in DECODE_CASES:
        key = jax.random.PRNGKey(0)
        cache, cap = _cache(key, b * tokens_per_req, page, "fp8_ds_mla")
        q = jax.random.normal(jax.random.fold_in(key, 2), (b, s_q, h, 512), jnp.float32).astype(jnp.bfloat16)
        base = (jnp.arange(b, dtype=jnp.int32) * tokens_per_req)[:, None, None]
        idx = base + jax.random.randint(jax.random.fold_in(key, 3), (b, s_q, topk), 0, tokens_per_req, jnp.int32)
        kw = dict(kv_format="fp8_ds_mla", block_size=page, softmax_scale=512 ** -0.5,
                  attn_sink=jax.random.normal(jax.random.fold_in(key, 4), (h,), jnp.float32))
        args = [q, cache, idx, jnp.full((b,), topk, jnp.int32)]
        attended = b * s_q * topk
        if extra is not None:
            etopk, epage = extra
            ecache, _ = _cache(jax.random.fold_in(key, 5), b * tokens_per_req, epage, "fp8_ds_mla")
            eidx = base + jax.random.randint(jax.random.fold_in(key, 6), (b, s_q, etopk), 0, tokens_per_req, jnp.int32)
            args += [ecache, eidx, jnp.full((b,), etopk, jnp.int32)]
            kw.update(extra_kv_format="fp8_ds_mla", extra_block_size=epage)
            attended += b * s_q * etopk

        def op(q, c, i, t, *e, impl="cuda"):
            ex = dict(extra_kv_cache=e[0], extra_indices=e[1], extra_topk_length=e[2]) if e else {}
            return sparse_mla_decode(q, c, i, t, impl=impl, **kw, **ex)

        sec_op = _time(jax.jit(op), args, iters, reps)
        # the FFI call alone, on a precomputed plan
        e = args[4:] if extra is not None else [None, None, None]
        call = _make_decode_call(args[0], args[1], args[2], args[3], "fp8_ds_mla", page, kw["softmax_scale"],
                                 kw["attn_sink"], e[0], e[1], e[2], "fp8_ds_mla" if extra else None,
                                 extra[1] if extra else None)
        fargs, fattrs, fres, _ = _ops.prepare_decode(call)
        cuda_ffi.ensure_registered()
        kern = jax.jit(lambda *a: jax.ffi.ffi_call(_ops.DECODE_TARGET, fres)(*a, **fattrs)[:2])
        sec = _time(kern, fargs, iters, reps)
        gargs, gattrs, gres, _ = _ops.prepare_decode(call, plan="jax")
        gargs = jax.block_until_ready(gargs)
        given = jax.jit(lambda *a: jax.ffi.ffi_call(_ops.DECODE_TARGET, gres)(*a, **gattrs)[:2])
        sec_given = _time(given, gargs, iters, reps)
        flops = 2 * h * attended * 1024
        # correctness spot check on the first 4 requests (caches whole: indices address all of them)
        sl = [a if i in (1, 4) else a[:4] for i, a in enumerate(args)]
        got = np.asarray(jax.jit(op)(*sl)[0], np.float32)
        ref = np.asarray(jax.jit(lambda *a: op(*a, impl="xla"))(*sl)[0], np.float32)
        err = float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-30))
        rows.append((name, sec_op, sec, sec_given, flops / sec / 1e12, anchor, err))
        del cache, args, fargs, gargs
    return rows


def bench_prefill(iters: int, reps: int):
    rows = []
    for name, s_q, h, topk, s_kv, anchor in PREFILL_CASES:
        key = jax.random.PRNGKey(1)
        q = jax.random.normal(key, (s_q, h, 512), jnp.float32).astype(jnp.bfloat16)
        kv = jax.random.normal(jax.random.fold_in(key, 1), (s_kv, 512), jnp.float32).astype(jnp.bfloat16)
        idx = jax.random.randint(jax.random.fold_in(key, 2), (s_q, topk), 0, s_kv, jnp.int32)
        sink = jax.random.normal(jax.random.fold_in(key, 3), (h,), jnp.float32)

        def op(q, kv, idx, impl="cuda"):
            return sparse_mla_prefill(q, kv, idx, softmax_scale=512 ** -0.5, attn_sink=sink, impl=impl)

        f = jax.jit(op)
        sec = _time(f, (q, kv, idx), iters, reps)
        sec_op = sec
        flops = 2 * s_q * topk * h * 1024
        got = np.asarray(jax.jit(op)(q[:64], kv, idx[:64])[0], np.float32)
        ref = np.asarray(jax.jit(lambda *a: op(*a, impl="xla"))(q[:64], kv, idx[:64])[0], np.float32)
        err = float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-30))
        rows.append((name, sec_op, sec, float("nan"), flops / sec / 1e12, anchor, err))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cuda_ffi.bench")
    ap.add_argument("--only", choices=("decode", "prefill"), default=None)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tokens-per-req", type=int, default=8192)
    a = ap.parse_args(argv)
    dev = jax.devices()[0]
    print(f"device: {dev.device_kind} ({getattr(dev, 'core_count', '?')} SMs), jax {jax.__version__}")
    rows = []
    if a.only in (None, "decode"):
        rows += bench_decode(a.iters, a.reps, a.tokens_per_req)
    if a.only in (None, "prefill"):
        rows += bench_prefill(a.iters, a.reps)
    print(f"{'case':30s} {'op us':>8s} {'kernel us':>9s} {'given plan us':>13s} {'TFLOP/s':>8s} {'FlashMLA':>8s} "
          f"{'ratio':>6s} {'rel err':>8s}")
    for name, sec_op, sec, sec_given, tf, anchor, err in rows:
        print(f"{name:30s} {sec_op * 1e6:8.1f} {sec * 1e6:9.1f} {sec_given * 1e6:13.1f} {tf:8.1f} {anchor:8.1f} "
              f"{tf / anchor:6.2f} {err:8.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
