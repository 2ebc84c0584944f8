"""How big the `impl="pallas"` kernels are before the GPU compiles them: Python trace and lowering time and the
operation count of each Mosaic GPU module, cross-lowered for CUDA on any machine (no GPU needed).

    python -m benchmarks.pallas_lowering

For a few configurations (fp8_ds_mla decode with an extra cache at the tiny and the V4.1-Flash shapes, bf16
prefill) it traces and lowers the op (`pallas_kernels._interpret.gpu_mode`, `lowering_platforms=("cuda",)`),
unpacks the Mosaic GPU module each custom call carries and counts its operations by name. The device then
compiles that module (to PTX, then ptxas) inside XLA's compile: the count is the input of that step. With
`--compile` (a GPU machine) each lowered configuration is also compiled for this GPU and that compile is timed
(`jax.stages.Lowered.compile`: XLA's and the Mosaic GPU module's). With `--engine` it lowers one step of the
tiny-model engine with `impl="pallas"` and fp8_ds_mla caches instead and counts its Mosaic GPU custom calls and
their distinct kernel hashes (the GPU compiles one module per hash: layers of one type must share theirs). Quote
the figures in benchmarks/RESULTS.md with the commit.

    python -m benchmarks.pallas_lowering --engine [--compile] [--engine-impl xla]

With `--engine-shapes` it lowers every step shape of that engine's envelope, as its warm-up does, and counts the
kernels each shape shares with earlier ones: by kernel hash (what the GPU's Mosaic compile cache is keyed by) and
by module text without `mosaic_gpu.dump_basename`, a per-process counter in each module.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time

__all__ = ["CONFIGS", "module_op_counts", "module_texts", "kernel_hashes", "engine_step_lowered",
           "engine_envelope_lowered", "main"]

# name -> (op, shapes): decode (b, s_q, h, topk, extra topk, page), prefill (s_q, h, topk, s_kv)
CONFIGS = {
    "decode_tiny_b4_h64_k128+512": ("decode", (4, 1, 64, 128, 512, 64)),
    "decode_b128_h64_k128+512": ("decode", (128, 2, 64, 128, 512, 64)),
    "decode_b4_h128_k128+1024": ("decode", (4, 1, 128, 128, 1024, 64)),
    "prefill_s16_h64_k128": ("prefill", (16, 64, 128, 128)),
    "prefill_s4096_h128_k2048": ("prefill", (4096, 128, 2048, 32768)),
}


def _lowered(op: str, shape: tuple):
    import jax
    import jax.numpy as jnp

    import dsv41_jax as d
    from dsv41_jax import kv_cache as kvc

    sd = jax.ShapeDtypeStruct
    if op == "decode":
        b, s_q, h, topk, etopk, page = shape
        cache = sd((64, kvc.page_bytes("fp8_ds_mla", page)), jnp.uint8)
        args = (sd((b, s_q, h, 512), jnp.bfloat16), cache, sd((b, s_q, topk), jnp.int32), sd((b,), jnp.int32), cache,
                sd((b, s_q, etopk), jnp.int32), sd((b,), jnp.int32))

        def f(q, c, idx, lens, ec, eidx, elens):
            return d.sparse_mla_decode(q, c, idx, lens, kv_format="fp8_ds_mla", block_size=page, softmax_scale=0.04,
                                       extra_kv_cache=ec, extra_indices=eidx, extra_topk_length=elens,
                                       extra_kv_format="fp8_ds_mla", extra_block_size=page, impl="pallas")
    else:
        s_q, h, topk, s_kv = shape
        args = (sd((s_q, h, 512), jnp.bfloat16), sd((s_kv, 512), jnp.bfloat16), sd((s_q, topk), jnp.int32))

        def f(q, kv, idx):
            return d.sparse_mla_prefill(q, kv, idx, softmax_scale=0.04, impl="pallas")

    t0 = time.perf_counter()
    traced = jax.jit(f).trace(*args)
    t1 = time.perf_counter()
    lowered = traced.lower(lowering_platforms=("cuda",))
    t2 = time.perf_counter()
    return lowered, t1 - t0, t2 - t1


def _tiny_engine(*, max_model_len: int, max_reqs: int, impl: str):
    from flax import nnx

    import dsv41_jax as d

    model = d.DeepseekV41Model(d.get_preset("tiny"), rngs=nnx.Rngs(0))
    return d.InferenceEngine(model, d.EngineConfig(max_model_len=max_model_len, max_reqs=max_reqs,
                                                   kv_format="fp8_ds_mla", impl=impl, prefill_chunk=16,
                                                   max_num_batched_tokens=32))


def _lower_step(eng, shape):
    t0 = time.perf_counter()
    traced = eng._trace(shape)
    t1 = time.perf_counter()
    lowered = traced.lower(lowering_platforms=("cuda",))
    return lowered, t1 - t0, time.perf_counter() - t1


def engine_step_lowered(*, max_model_len: int = 128, max_reqs: int = 4, impl: str = "pallas"):
    """(lowered step, trace s, lower s) of the tiny-model engine's first step shape, fp8_ds_mla caches, `impl`
    ("pallas", or "xla" for the same step without Mosaic GPU kernels), cross-lowered for CUDA (call inside
    `_interpret.gpu_mode()`)."""
    eng = _tiny_engine(max_model_len=max_model_len, max_reqs=max_reqs, impl=impl)
    return _lower_step(eng, eng.envelope[0])


def engine_envelope_lowered(*, max_model_len: int = 128, max_reqs: int = 4, limit: int | None = None):
    """[(step shape, lowered step)] for the shapes of the tiny-model engine's envelope (the first `limit`;
    impl="pallas", fp8_ds_mla), cross-lowered for CUDA in one process, as the warm-up lowers them (inside
    `gpu_mode()`)."""
    eng = _tiny_engine(max_model_len=max_model_len, max_reqs=max_reqs, impl="pallas")
    return [(sh, _lower_step(eng, sh)[0]) for sh in eng.envelope[:limit]]


def _walk(op, into, pred):
    for region in op.regions:
        for block in region.blocks:
            for o in block.operations:
                if pred(o):
                    into.append(o)
                _walk(o.operation, into, pred)


def _mosaic_calls(lowered) -> list:
    """The Mosaic GPU custom calls of a lowered computation, in module order."""
    calls: list = []
    _walk(lowered.compiler_ir("stablehlo").operation, calls, lambda o: o.operation.name == "stablehlo.custom_call"
          and "mosaic_gpu" in str(o.attributes["call_target_name"]))
    return calls


def kernel_hashes(lowered) -> list[bytes]:
    """The kernel hash of each Mosaic GPU custom call of a lowered computation (what the GPU compiles by)."""
    from jax._src.lib.mlir import ir

    mod = lowered.compiler_ir("stablehlo")
    with mod.context:
        return [ir.StringAttr(ir.DictAttr(c.attributes["mhlo.backend_config"])["kernel_hash"]).value_bytes
                for c in _mosaic_calls(lowered)]


def _inner_modules(lowered):
    """(context, [Mosaic GPU module of each custom call]) of a lowered computation, parsed in its context."""
    from jax._src.lib.mlir import ir

    mod = lowered.compiler_ir("stablehlo")
    ctx = mod.context
    with ctx:
        ctx.allow_unregistered_dialects = True  # the module's own dialects need not be registered to read it
        return ctx, [ir.Module.parse(ir.StringAttr(ir.DictAttr(c.attributes["mhlo.backend_config"])["module"]).value_bytes)
                     for c in _mosaic_calls(lowered)]


def module_texts(lowered, *, without_dump_basename: bool = False) -> list[str]:
    """The Mosaic GPU module of each custom call as text; `without_dump_basename` drops the module's
    `mosaic_gpu.dump_basename` attribute (a per-process counter set at lowering), which enters the kernel hash."""
    ctx, inner = _inner_modules(lowered)
    out = []
    with ctx:
        for m in inner:
            if without_dump_basename and "mosaic_gpu.dump_basename" in m.operation.attributes:
                del m.operation.attributes["mosaic_gpu.dump_basename"]
            out.append(str(m))
    return out


def module_op_counts(lowered) -> list[collections.Counter]:
    """Per Mosaic GPU custom call of a lowered computation: its module's operations counted by name."""
    ctx, inner = _inner_modules(lowered)
    out = []
    with ctx:
        for m in inner:
            ops: list = []
            _walk(m.operation, ops, lambda o: True)
            out.append(collections.Counter(o.operation.name.removeprefix("stable_mosaic_gpu.") for o in ops))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.pallas_lowering", description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--compile", action="store_true", help="also compile each configuration for this GPU, timed")
    ap.add_argument("--engine", action="store_true",
                    help="lower one tiny-model engine step (impl=pallas) instead: its custom calls and kernel hashes")
    ap.add_argument("--engine-impl", default="pallas", choices=("pallas", "xla"),
                    help="the engine step's attention impl (xla: the same step's compile without Mosaic GPU kernels)")
    ap.add_argument("--engine-shapes", action="store_true",
                    help="lower every step shape of the tiny engine's envelope: kernels shared with earlier shapes, "
                         "by hash and by module text without mosaic_gpu.dump_basename")
    a = ap.parse_args(argv)
    import jax

    from pallas_kernels import _interpret

    if a.compile and jax.default_backend() != "gpu":
        ap.error(f"--compile needs a GPU backend, got {jax.default_backend()!r}")
    if a.engine_shapes:
        with _interpret.gpu_mode():
            steps = engine_envelope_lowered()
        seen_h: set = set()
        seen_t: set = set()
        for shape, lowered in steps:
            hs, ts = kernel_hashes(lowered), module_texts(lowered, without_dump_basename=True)
            print(f"{shape}: {len(hs)} kernels, {sum(h in seen_h for h in hs)} with an earlier shape's hash, "
                  f"{sum(t in seen_t for t in ts)} an earlier shape's module but for mosaic_gpu.dump_basename",
                  flush=True)
            seen_h.update(hs)
            seen_t.update(ts)
        return 0
    if a.engine:
        with _interpret.gpu_mode():
            lowered, t_trace, t_lower = engine_step_lowered(impl=a.engine_impl)
        hashes = kernel_hashes(lowered)
        compiled = ""
        if a.compile:
            t0 = time.perf_counter()
            lowered.compile()
            compiled = f", compile {time.perf_counter() - t0:.1f} s"
        print(f"tiny engine step (impl={a.engine_impl}, fp8_ds_mla): {len(hashes)} Mosaic GPU custom calls, "
              f"{len(set(hashes))} distinct kernels; trace {t_trace:.1f} s, lower {t_lower:.1f} s{compiled}", flush=True)
        return 0
    for name in a.configs.split(","):
        op, shape = CONFIGS[name]
        with _interpret.gpu_mode():
            lowered, t_trace, t_lower = _lowered(op, shape)
        compiled = ""
        if a.compile:  # (the cross-lowered module is the device's own: same kernels, same platform)
            t0 = time.perf_counter()
            lowered.compile()
            compiled = f", compile {time.perf_counter() - t0:.1f} s"
        for i, c in enumerate(module_op_counts(lowered)):
            top = ", ".join(f"{k} {v}" for k, v in c.most_common(4))
            print(f"{name:28s} kernel {i}: {sum(c.values())} ops ({c['llvm.inline_asm']} inline asm; {top}); "
                  f"trace {t_trace:.1f} s, lower {t_lower:.1f} s{compiled}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
