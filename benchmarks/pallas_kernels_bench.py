"""Times the `impl="pallas"` kernels on a GPU and prints a short table (needs a CUDA GPU).

    PYTHONPATH=. python3 -m benchmarks.pallas_kernels_bench            # all cases and variants (~3 min on an H200)
    PYTHONPATH=. python3 -m benchmarks.pallas_kernels_bench --quick    # the two target cases, default variant only

Per case and kernel variant: device time from CUPTI (`jax.experimental.mosaic.gpu.profiler`,
median over iterations) of the whole jitted call (index preparation + kernel + split combine) and
of the Mosaic kernel alone, TFLOP/s with FlashMLA's FLOP count (decode 2*h*attended*1024,
prefill 2*sum(topk)*h*1024), effective HBM GB/s (fewest bytes: each selected token record read
once, q read and out written once), and the two floors (FLOPs at 790 TFLOP/s bf16, bytes at
4.0 TB/s). Inputs are random (never zeros); the decode caches hold 8192 tokens per request
(0.6 GB for b=128), larger than the 50 MB L2, and each request draws its own tokens.
Variants, all of them what `impl="pallas"` can run: `default`, `f16` / `bf16_ops` (f16 Q, K tile
and P, one P V wgmma / bf16 ones with P = P_hi + P_lo, exact over bf16's range; the defaults: f16
for large prefill, bf16 for decode; `pallas_kernels.kernel_options`), `splits=N` (forced split
count, `pallas_kernels.num_splits_override`), `persistent` / `ctas=N` (one persistent CTA per SM / at most N,
each looping over the (row, split, head group) items: `pallas_kernels.kernel_options(ctas=...)`), `a+b` (both).
`--variants a,b --cases decode,prefill,v4,v41` picks them.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from dsv41_jax import kv_cache as kvc
from dsv41_jax import sparse_mla_decode, sparse_mla_prefill

PEAK_FLOPS = 790e12  # bf16 dense, measured on this workplace's H200 (device README)
PEAK_BYTES = 4.0e12  # HBM, conservative for the H200 (datasheet 4.8 TB/s)


def _fp8_cache(key, num_blocks, block_size):
    """A valid fp8_ds_mla cache of random records (no NaN codes), built on the device."""
    pb = kvc.page_bytes("fp8_ds_mla", block_size)
    k1, k2, k3 = jax.random.split(key, 3)
    data = jax.random.randint(k1, (num_blocks, block_size, 448), 0, 256, jnp.int32).astype(jnp.uint8)
    data = jnp.where((data & 0x7F) == 0x7F, jnp.uint8(0x7E), data)  # e4m3fn NaN -> 448
    rope = jax.random.normal(k2, (num_blocks, block_size, 64), jnp.float32).astype(jnp.bfloat16)
    rope = jax.lax.bitcast_convert_type(rope, jnp.uint8).reshape(num_blocks, block_size, 128)
    recs = jnp.concatenate([data, rope], axis=-1).reshape(num_blocks, block_size * 576)
    sc = jax.random.randint(k3, (num_blocks, block_size, 7), 117, 124, jnp.int32).astype(jnp.uint8)
    sc = jnp.concatenate([sc, jnp.zeros((num_blocks, block_size, 1), jnp.uint8)], -1).reshape(num_blocks, -1)
    pad = jnp.zeros((num_blocks, pb - block_size * 584), jnp.uint8)
    return jnp.concatenate([recs, sc, pad], axis=1)


def _cache(key, kv_format, num_blocks, block_size):
    if kv_format == "bf16":
        return jax.random.normal(key, (num_blocks, block_size, 512), jnp.float32).astype(jnp.bfloat16)
    if kv_format != "fp8_ds_mla":  # V4.1 records: quantized from random latents by the cache's own writer
        from benchmarks.inputs import filled_cache

        return filled_cache(key, num_blocks * block_size, block_size, kv_format)[0]
    return jax.jit(_fp8_cache, static_argnums=(1, 2))(key, num_blocks, block_size)


def _per_request_indices(key, b, s_q, topk, tokens_per_req):
    base = (jnp.arange(b, dtype=jnp.int32) * tokens_per_req)[:, None, None]
    return base + jax.random.randint(key, (b, s_q, topk), 0, tokens_per_req, jnp.int32)


def decode_case(b, s_q, h, topk, kv_format="fp8_ds_mla", block_size=64, extra=None, tokens_per_req=8192, seed=0):
    key = jax.random.PRNGKey(seed)
    ks = jax.random.split(key, 6)
    nb = -(-b * tokens_per_req // block_size)
    args = dict(q=jax.random.normal(ks[0], (b, s_q, h, 512), jnp.float32).astype(jnp.bfloat16),
                kv_cache=_cache(ks[1], kv_format, nb, block_size),
                indices=_per_request_indices(ks[2], b, s_q, topk, tokens_per_req))
    kw = dict(kv_format=kv_format, block_size=block_size, softmax_scale=512 ** -0.5,
              attn_sink=jax.random.normal(ks[3], (h,), jnp.float32))
    attended = b * s_q * topk
    nbytes = attended * kvc.record_bytes(kv_format)
    if extra is not None:
        etopk, ebs, extra_format, etok = extra
        enb = -(-b * etok // ebs)
        kw.update(extra_kv_cache=_cache(ks[4], extra_format, enb, ebs), extra_kv_format=extra_format, extra_block_size=ebs,
                  extra_indices=_per_request_indices(ks[5], b, s_q, etopk, etok))
        attended += b * s_q * etopk
        nbytes += b * s_q * etopk * kvc.record_bytes(extra_format)
    flops = 2 * h * attended * 1024
    nbytes += 2 * b * s_q * h * 512 * 2  # q in, out
    return args, kw, flops, nbytes


def prefill_case(s_q, h, topk, s_kv, seed=1):
    key = jax.random.PRNGKey(seed)
    k1, k2, k3, k4 = jax.random.split(key, 4)
    q = jax.random.normal(k1, (s_q, h, 512), jnp.float32).astype(jnp.bfloat16)
    kv = jax.random.normal(k2, (s_kv, 512), jnp.float32).astype(jnp.bfloat16)
    idx = jax.random.randint(k3, (s_q, topk), 0, s_kv, jnp.int32)
    kw = dict(softmax_scale=512 ** -0.5, attn_sink=jax.random.normal(k4, (h,), jnp.float32))
    flops = 2 * s_q * topk * h * 1024
    nbytes = min(s_q * topk, s_kv) * 1024 + 2 * s_q * h * 512 * 2
    return dict(q=q, kv=kv, indices=idx), kw, flops, nbytes


def _time(f, args, iters):
    """(median total ms, median Mosaic-kernel ms) over `iters` runs, CUPTI when available."""
    try:
        from jax.experimental.mosaic.gpu import profiler

        _, runs = profiler.measure(f, aggregate=False, iterations=iters)(*args)
        totals = [sum(t for _, t in r) for r in runs]
        kern = [sum(t for n, t in r if "sparse_mla_kernel" in n) for r in runs]
        return statistics.median(totals), statistics.median(kern)
    except Exception as e:  # CUPTI unavailable: wall clock over a synchronized loop
        print(f"  (CUPTI timing failed: {type(e).__name__}: {e}; using wall clock)", file=sys.stderr)
        ts = []
        for _ in range(iters):
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args))
            ts.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(ts), float("nan")


def run(name, kind, case, variant, iters):
    args, kw, flops, nbytes = case
    opts, splits = {}, None
    for part in variant.split("+"):  # "a+b": both changes
        if part == "f16":
            opts["f16"] = True
        elif part == "bf16_ops":
            opts["f16"] = False
        elif part.startswith("splits="):
            splits = int(part.split("=")[1])
        elif part == "persistent":
            opts["ctas"] = "sms"
        elif part.startswith("ctas="):
            opts["ctas"] = int(part.split("=")[1])
        elif part != "default":
            raise ValueError(f"unknown variant {part!r} in {variant!r}")
    op = sparse_mla_decode if kind == "decode" else sparse_mla_prefill
    names = list(args)
    with pallas_kernels.kernel_options(**opts), pallas_kernels.num_splits_override(splits):
        f = jax.jit(lambda *a: op(**dict(zip(names, a)), **kw, impl="pallas"))
        vals = [args[n] for n in names]
        t0 = time.perf_counter()
        jax.block_until_ready(f(*vals))
        compile_s = time.perf_counter() - t0
    total_ms, kern_ms = _time(f, vals, iters)
    row = dict(case=name, variant=variant, total_us=total_ms * 1e3, kernel_us=kern_ms * 1e3,
               tflops=flops / (total_ms * 1e-3) / 1e12, kernel_tflops=flops / (kern_ms * 1e-3) / 1e12,
               gbs=nbytes / (total_ms * 1e-3) / 1e9, floor_flop_us=flops / PEAK_FLOPS * 1e6,
               floor_byte_us=nbytes / PEAK_BYTES * 1e6, compile_s=compile_s)
    print(f"  {name:34s} {variant:13s} {row['total_us']:9.1f} us  kernel {row['kernel_us']:9.1f} us  "
          f"{row['tflops']:6.1f} TFLOP/s  (compile {compile_s:.0f} s)", flush=True)
    return row


def check_decode(case):
    """max |pallas - xla| / max |xla| on a decode case (sanity of the timed configuration)."""
    args, kw, _, _ = case
    names = list(args)
    vals = [args[n] for n in names]
    outs = [jax.jit(lambda *a, impl=impl: sparse_mla_decode(**dict(zip(names, a)), **kw, impl=impl))(*vals)
            for impl in ("pallas", "xla")]
    o, r = (np.asarray(x[0], np.float32) for x in outs)
    return float(np.abs(o - r).max() / max(np.abs(r).max(), 1e-30))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--variants", default=None,
                    help="comma-separated variants for the two target cases (default, f16, bf16_ops, splits=N, "
                         "a+b); implies --quick's case list")
    ap.add_argument("--cases", default="decode,prefill",
                    help="with --variants: decode, prefill, v4 (decode h128 SWA 128 + extra 1024) and/or v41 "
                         "(the V4.1-Flash decode: h64, SWA 128 from mxfp8_ds_mla + 512 from nvfp4_ds_mla)")
    a = ap.parse_args(argv)
    if jax.default_backend() != "gpu":
        print(f"needs a CUDA GPU (default backend {jax.default_backend()!r})")
        return 1
    dev = jax.devices()[0]
    print(f"device: {dev.device_kind}, {getattr(dev, 'core_count', '?')} SMs, jax {jax.__version__}", flush=True)
    rows = []
    dec = decode_case(128, 2, 128, 2048)
    print(f"check b128/s_q2/h128/topk2048 fp8 vs xla: max rel err {check_decode(dec):.2e}", flush=True)
    pre = prefill_case(4096, 128, 2048, 65536)
    plan = [("decode b128 sq2 h128 topk2048 fp8", "decode", dec, ["default"] if a.quick else
             ["default", "f16", "splits=2"]),
            ("prefill sq4096 h128 topk2048 bf16", "prefill", pre, ["default"] if a.quick else ["default", "bf16_ops"])]

    def v4():  # built only when planned (its caches take a while)
        return ("decode b128 sq2 h128 swa128+c1024", "decode",
                decode_case(128, 2, 128, 128, block_size=256, extra=(1024, 64, "fp8_ds_mla", 8192), tokens_per_req=256))

    def v41():
        return ("decode b128 sq2 h64 swa128mx+c512nv", "decode",
                decode_case(128, 2, 64, 128, kv_format="mxfp8_ds_mla", block_size=256,
                            extra=(512, 64, "nvfp4_ds_mla", 8192), tokens_per_req=256))

    if a.variants:
        vs = a.variants.split(",")
        plan = [(n, k, c, vs) for n, k, c, _ in plan if k in a.cases.split(",")]
        if "v4" in a.cases.split(","):
            plan.append((*v4(), vs))
        if "v41" in a.cases.split(","):
            plan.append((*v41(), vs))
    elif not a.quick:
        plan += [
            (*v4(), ["default"]),
            ("decode b128 sq2 h64 topk2048 fp8", "decode", decode_case(128, 2, 64, 2048), ["default"]),
            ("decode b4 sq2 h128 topk2048 fp8", "decode", decode_case(4, 2, 128, 2048), ["default", "splits=1"]),
            ("prefill sq4096 h64 topk512 bf16", "prefill", prefill_case(4096, 64, 512, 65536), ["default"]),
        ]
    for name, kind, case, variants in plan:
        for v in variants:
            try:
                rows.append(run(name, kind, case, v, a.iters))
            except Exception as e:
                print(f"  {name} {v}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
    print()
    print(f"{'case':34s} {'variant':13s} {'total us':>9s} {'kern us':>9s} {'TFLOP/s':>8s} {'kern TF/s':>9s} "
          f"{'GB/s':>7s} {'floor F us':>10s} {'floor B us':>10s}")
    for r in rows:
        print(f"{r['case']:34s} {r['variant']:13s} {r['total_us']:9.1f} {r['kernel_us']:9.1f} {r['tflops']:8.1f} "
              f"{r['kernel_tflops']:9.1f} {r['gbs']:7.0f} {r['floor_flop_us']:10.1f} {r['floor_byte_us']:10.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
