"""The paged engine at V4.1-Flash attention size: decode tokens/s and where a decode step's time goes.

    python -m benchmarks.engine_decode [--layers 10] [--batches 1,32,128] [--prompt 512] [--impl cuda]

The model is `DeepseekV41Model` with random bf16 weights and V4.1-Flash's attention configuration (64 heads
of 512 + 64 dims, window 128, index top-k 512, q / o LoRA ranks 1280 / 1024, hidden 5120; the dense SwiGLU
MLP stands in for the MoE) cut to `--layers` decoder layers that keep every role (SWA-only layers, ratio-2
and ratio-1 kv sources with sharing layers, the candidate source, a non-owning index source; one MTP layer
is configured and not run). Caches are fp8_ds_mla. For each batch size: `b` requests of `--prompt` random
tokens are prefilled in one step, then decode steps run one token per request (teacher-forced tokens, so
no sampling); the step shapes are compiled before any timed step.

Reported per batch size, from the engine's own step timing (`InferenceEngine.last_step`): decode tokens/s
and ms per step split into device time (dispatch to outputs ready) and host time (scheduling, page
allocation, padding into buckets, input transfer, reading the logits); and, from CUPTI kernel times over
further decode steps, the device time split into this library's sparse-attention kernels (the cuda
implementation's split planner, decode and combine kernels, or the Pallas kernels) and every other kernel
(projections, compressor, indexer and its top-k, metadata, RoPE, MLP, LM head, cache writes).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ATTENTION_KERNELS = ("dsv41_", "sparse_mla")  # name fragments of this library's attention kernels


def layer_cut_config(num_layers: int):
    """V4.1-Flash's attention configuration with `num_layers` decoder layers keeping every layer role."""
    import dsv41_jax as d
    from dsv41_jax.model.config import DeepseekV4AttentionConfig

    if num_layers < 8:
        raise ValueError(f"--layers must be >= 8 (every V4.1 layer role), got {num_layers}")
    n2 = (num_layers - 2) // 2
    n1 = num_layers - 2 - n2
    hf = d.V41_FLASH.to_hf_config()
    first1 = 2 + n2
    hf.update(num_hidden_layers=num_layers, num_nextn_predict_layers=1,
              compress_ratios=[0, 0] + [2] * n2 + [1] * n1 + [0],
              kv_source_layer_ids=[2, first1], index_source_layer_ids=[2, first1, first1 + 2],
              candidate_source_layer_id=first1)
    return DeepseekV4AttentionConfig.from_hf_config(hf)


def run_batch(model, cfg, b: int, *, prompt: int, steps: int, impl: str, kv_format: str, seed: int) -> dict:
    import jax
    import numpy as np

    import dsv41_jax as d
    from benchmarks import cupti

    cupti_iters = 3
    extra = steps + cupti_iters + 2  # teacher-forced decode tokens: timed steps, CUPTI's warm-up and calls
    ecfg = d.EngineConfig(max_model_len=prompt + extra + 1, max_reqs=b, kv_format=kv_format, impl=impl,
                          max_num_batched_tokens=b * prompt)  # every prompt prefilled in one step
    eng = d.InferenceEngine(model, ecfg)
    rng = np.random.default_rng(seed)
    rids = [eng.add_request(rng.integers(0, cfg.vocab_size, prompt + extra).tolist()) for _ in range(b)]
    t = time.perf_counter()
    eng.step([(r, prompt) for r in rids])  # compiles the prefill shape, then runs it
    prefill = eng.last_step
    prefill_wall = time.perf_counter() - t
    feeds = [(r, 1) for r in rids]
    t = time.perf_counter()
    eng.step(feeds)  # compiles the decode shape
    first_decode_wall = time.perf_counter() - t
    timings = []
    for _ in range(steps):
        eng.step(feeds)
        timings.append(eng.last_step)
    shapes = {s.shape for s in timings}
    if len(shapes) != 1:
        raise RuntimeError(f"the timed decode steps changed shape ({shapes}): raise --prompt or lower --steps")
    device_ms = 1e3 * float(np.median([s.device_s for s in timings]))
    host_ms = 1e3 * float(np.median([s.host_s for s in timings]))
    row = {
        "batch": b, "prompt": prompt, "layers": cfg.num_hidden_layers, "impl": impl, "kv_format": kv_format,
        "prefill_tokens": prefill.num_tokens, "prefill_device_ms": 1e3 * prefill.device_s,
        "prefill_wall_s_with_compile": prefill_wall, "first_decode_wall_s_with_compile": first_decode_wall,
        "decode_steps": steps, "decode_device_ms": device_ms, "decode_host_ms": host_ms,
        "decode_tokens_per_s": b / ((device_ms + host_ms) / 1e3),
    }
    why = cupti.available()
    if why is None:
        total, per = cupti.kernel_times(lambda: eng.step(feeds), sync=lambda: jax.block_until_ready(eng.caches),
                                        iterations=cupti_iters)
        attn = {k: v for k, v in per.items() if any(f in k for f in ATTENTION_KERNELS)}
        row.update(kernels_us=total, attention_kernels_us=sum(attn.values()), other_kernels_us=total - sum(attn.values()),
                   attention_kernels={k: round(v, 2) for k, v in sorted(attn.items(), key=lambda kv: -kv[1])},
                   top_other_kernels=dict(sorted(((k, round(v, 2)) for k, v in per.items() if k not in attn),
                                                 key=lambda kv: -kv[1])[:8]))
    else:
        row["cupti"] = why
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=10)
    ap.add_argument("--batches", default="1,32,128")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--impl", default="auto", choices=["auto", "xla", "pallas", "cuda"])
    ap.add_argument("--kv-format", default="fp8_ds_mla")
    ap.add_argument("--preset", default=None, help="a preset instead of the cut V4.1-Flash (e.g. tiny, for a CPU check)")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    from flax import nnx

    import dsv41_jax as d

    cfg = d.get_preset(args.preset) if args.preset else layer_cut_config(args.layers)
    t = time.perf_counter()
    model = d.DeepseekV41Model(cfg, rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16)
    print(f"# device {jax.devices()[0].device_kind}; {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
          f"{cfg.num_attention_heads} heads; model built in {time.perf_counter() - t:.1f} s", flush=True)
    rows = []
    for b in [int(x) for x in args.batches.split(",")]:
        row = run_batch(model, cfg, b, prompt=args.prompt, steps=args.steps, impl=args.impl,
                        kv_format=args.kv_format, seed=b)
        rows.append(row)
        split = ""
        if "kernels_us" in row:
            split = (f"; kernels {row['kernels_us'] / 1e3:.2f} ms = sparse attention {row['attention_kernels_us'] / 1e3:.2f}"
                     f" + other {row['other_kernels_us'] / 1e3:.2f}")
        print(f"b={b:<4} decode {row['decode_tokens_per_s']:9.1f} tokens/s: {row['decode_device_ms'] + row['decode_host_ms']:.2f}"
              f" ms/step = device {row['decode_device_ms']:.2f} + host {row['decode_host_ms']:.2f}{split}"
              f" (prefill of {row['prefill_tokens']} tokens: device {row['prefill_device_ms']:.1f} ms; compiling and"
              f" running the first prefill / decode step {row['prefill_wall_s_with_compile']:.1f} /"
              f" {row['first_decode_wall_s_with_compile']:.1f} s)", flush=True)
        if "kernels_us" in row:
            print(f"       attention kernels (us per step): {row['attention_kernels']}")
            print(f"       largest other kernels (us per step): {row['top_other_kernels']}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "engine_decode.json")
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)
    print(f"# wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
