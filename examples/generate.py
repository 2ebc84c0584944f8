"""Greedy generation with a DeepSeek-V4.1 model through the paged engine (random weights by default).

    python examples/generate.py [--preset tiny] [--platform cpu|gpu] [--requests 4] [--max-new-tokens 32]
                                [--kv-format bf16|fp8_ds_mla|mxfp8_ds_mla] [--comp-kv-format nvfp4_ds_mla]
                                [--impl auto|xla|pallas|cuda]
                                [--weights model.safetensors|checkpoint-dir] [--prefill-chunk 16]
                                [--max-batched-tokens 32] [--max-model-len 128]

Builds the model (tiny preset: 7 layers covering every V4.1 layer role) and an engine whose limits are
the run's (requests, sequence length, prefill chunk, tokens per step), compiles every step shape of
those limits ahead of time (`warmup`, one progress line per shape on stderr), then prefills requests of
different lengths in chunks and decodes one token per request per step. Prints the warm-up's count and
seconds, the generated tokens, and prefill and decode tokens/s with each step's host and device time
(no compilation happens in the steps).
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny", help="config preset (tiny, v4.1-flash)")
    ap.add_argument("--platform", default="cpu", choices=["cpu", "gpu"])
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--prefill-chunk", type=int, default=16)
    ap.add_argument("--kv-format", default="bf16", help="the caches' record (bf16, fp8_ds_mla, mxfp8_ds_mla, ...)")
    ap.add_argument("--comp-kv-format", default=None,
                    help="the compressed caches' record (default: --kv-format; V4.1: nvfp4_ds_mla)")
    ap.add_argument("--impl", default="auto", choices=["auto", "xla", "pallas", "cuda"])
    ap.add_argument("--weights", default=None, help="safetensors file or directory in Hugging Face names")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-model-len", type=int, default=128)
    ap.add_argument("--max-batched-tokens", type=int, default=32, help="most tokens in one step")
    ap.add_argument("--compile-threads", type=int, default=None,
                    help="threads compiling the warm-up's step shapes (default: the engine's)")
    args = ap.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu" if args.platform == "cpu" else "cuda,cpu")

    import jax
    import numpy as np
    from flax import nnx
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    import dsv41_jax as d

    cfg = d.get_preset(args.preset)
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; preset {args.preset}: "
          f"{cfg.num_hidden_layers} layers {cfg.layer_types[: cfg.num_hidden_layers]}, {cfg.num_attention_heads} heads, "
          f"window {cfg.sliding_window}, index_topk {cfg.index_topk}")
    model = d.DeepseekV41Model(cfg, rngs=nnx.Rngs(args.seed))
    if args.weights:
        d.load_safetensors(model, args.weights)
        print(f"loaded weights from {args.weights}")
    engine = d.InferenceEngine(model, d.EngineConfig(
        max_model_len=args.max_model_len, max_reqs=max(args.requests, 1), kv_format=args.kv_format,
        comp_kv_format=args.comp_kv_format, impl=args.impl,
        prefill_chunk=args.prefill_chunk, max_num_batched_tokens=max(args.max_batched_tokens, args.requests)))
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(0, cfg.vocab_size, int(n)).tolist() for n in rng.integers(5, 40, args.requests)]
    comp = args.comp_kv_format or args.kv_format
    print(f"{len(prompts)} prompts of lengths {[len(p) for p in prompts]}, {args.kv_format} caches "
          f"({comp} compressed), impl={args.impl}")

    ws = engine.warmup(compile_threads=args.compile_threads)
    print(f"warm-up: {ws.num_compiled} step shapes compiled in {ws.seconds:.1f} s on {ws.compile_threads} threads "
          f"(before generate, not in the figures below)")
    with Progress(TextColumn("decode"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn()) as bar:
        task = bar.add_task("decode", total=max(args.max_new_tokens - 1, 0))
        outs, stats = engine.generate(prompts, args.max_new_tokens, on_step=lambda i, n: bar.advance(task),
                                      return_stats=True)
    for i, o in enumerate(outs):
        print(f"request {i}: {o[:16]}{' ...' if len(o) > 16 else ''}")
    print(stats.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
