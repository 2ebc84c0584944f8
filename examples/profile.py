"""Profile the paged engine: a `jax.profiler` trace with a named scope per stage.

    python examples/profile.py [--out /tmp/dsv41_trace] [--platform cpu|gpu] [--impl auto|xla|pallas|cuda]

Runs a prefill and a few decode steps of the tiny model (compiled before tracing), traces three
decode steps, and prints where the trace is. Every op of a step sits under
`layer{i}_{type}/{qkv_proj,compressor,indexer,sparse_attention,o_proj}`, and the attention ops
under `dsv41_sparse_mla_decode` / `dsv41_sparse_mla_prefill` (the Pallas and CUDA kernels appear
as their own kernels inside those scopes: Mosaic GPU kernels by their body name, FFI calls by
their target name). The script also prints how many compiled HLO instructions carry each scope,
read from the compiled step, so you can see the names before opening the trace.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/dsv41_trace")
    ap.add_argument("--platform", default="cpu", choices=["cpu", "gpu"])
    ap.add_argument("--impl", default="auto", choices=["auto", "xla", "pallas", "cuda"])
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu" if args.platform == "cpu" else "cuda,cpu")

    import jax
    import numpy as np
    from flax import nnx

    import dsv41_jax as d

    cfg = d.TINY
    model = d.DeepseekV41Model(cfg, rngs=nnx.Rngs(0))
    engine = d.InferenceEngine(model, d.EngineConfig(max_model_len=128, max_reqs=4, impl=args.impl))
    rng = np.random.default_rng(0)
    rids = [engine.add_request(rng.integers(0, cfg.vocab_size, n).tolist() + [0] * (args.steps + 2)) for n in (20, 33)]
    engine.step([(r, 20) for r in rids])  # prefill (compiles the prefill bucket)
    engine.step([(r, 13 if i else 0) for i, r in enumerate(rids)])
    engine.step([(r, 1) for r in rids])  # compiles the decode bucket
    with jax.profiler.trace(args.out, create_perfetto_trace=True):
        for _ in range(args.steps):
            with jax.profiler.TraceAnnotation("dsv41_decode_step"):
                engine.step([(r, 1) for r in rids])

    # names in the compiled step: count HLO instructions per named scope
    inp, _ = engine.prepare([(r, 1) for r in rids])  # same bucket as the traced decode steps
    lowered = engine._fn.lower(engine.params, engine.caches, inp, engine.tables)
    text = lowered.compile().as_text()
    scopes = collections.Counter()
    for m in re.finditer(r'op_name="([^"]+)"', text):
        name = m.group(1)
        for part in name.split("/"):
            if part.startswith(("layer", "dsv41_")) or part in ("qkv_proj", "compressor", "indexer", "sparse_attention", "o_proj"):
                scopes[part if not part.startswith("layer") else part.split("_")[0] + "_*"] += 1
    print("named scopes in the compiled decode step (HLO instructions):")
    for k, v in sorted(scopes.items()):
        print(f"  {k:30s} {v}")
    files = [os.path.join(dp, f) for dp, _, fs in os.walk(args.out) for f in fs]
    print(f"trace written under {args.out} ({len(files)} files, e.g. {files[0] if files else '-'})")
    print("open it with TensorBoard/XProf (`pip install xprof; xprof --logdir " + args.out + "`) or load the "
          "*.trace.json.gz in https://ui.perfetto.dev")
    return 0


if __name__ == "__main__":
    sys.exit(main())
