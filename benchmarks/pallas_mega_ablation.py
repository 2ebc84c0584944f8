"""What the pallas mega ops' stages cost: the mega decode or prefill with parts of its in-kernel stages removed,
against the plain op, on the same inputs (needs a CUDA GPU; experiments, not recorded as results).

    PYTHONPATH=. python3 -m benchmarks.pallas_mega_ablation [--cases mega_v41_h64_t512,mega_v41_h64_t128]
                                                            [--variants default,no_stage,...] [--splits 1]

Each variant patches one piece of `pallas_kernels` while its kernels are traced (the output stage, its stores, the
inverse rotation or Q's RoPE); the outputs of every variant but `default` are wrong by design:

- `default`: the kernel as it is;
- `no_stage`: no output stage (only lse is stored): the kernel's cost without the stage;
- `no_scale_store` / `no_value_store`: the stage without storing the exponents / without the e4m3 values' bulk
  copy out (their SMEM staging kept);
- `no_inverse_rope`: the stage without warpgroup 1's inverse RoPE;
- `no_q_rope`: Q not roped in the kernel (the output stage kept);
- `no_exponent`: every exponent 0 (no amax reduction);
- `unswizzled_stage`: the e4m3 staging view without its tiles and swizzle (`OUT_STAGE_TRANSFORMS`);
- `register_out`: the plain kernels' bf16 output stored from registers instead of staged (`store_final_out`): it
  changes the plain column, not the mega one;
- `neither`: no output stage and no Q RoPE: what the mega spec costs by itself (its cos / sin copy and buffer).

Cases are `benchmarks.mega_decode.MEGA_CASES` or `benchmarks.mega_prefill.MEGA_PREFILL_CASES` names; `--splits`
forces the split count (default 1: the output stage runs in the kernel). Times are CUPTI sums of every kernel per
call (`benchmarks.sparse_mla`'s timer), the median over `--iterations` calls of one input draw.
"""

from __future__ import annotations

import argparse
import contextlib
import sys

__all__ = ["VARIANTS", "patched", "main"]


class _Discard:
    """A stand-in output ref: every store into it is dropped (`ref.at[...][...] = v`)."""

    @property
    def at(self):
        return self

    def __getitem__(self, idx):
        return self

    def __setitem__(self, idx, value):
        pass


def _without(field: str):
    """`_kernel._program` with a mega kernel's `field` output (out / scale) replaced by `_Discard` (the plain kernel
    as it is)."""
    import dataclasses

    from pallas_kernels import _kernel

    program = _kernel._program

    def patched_program(spec, refs):
        prog = program(spec, refs)
        return dataclasses.replace(prog, **{field: _Discard()}) if spec.mega_out else prog

    return patched_program


def _copies_skipping_discarded():
    """`_kernel`'s `plgpu` (`Program.send_out_half`'s) whose bulk copies into a `_Discard` (see `_without`) are
    dropped."""
    import types

    import jax.experimental.pallas.mosaic_gpu as plgpu

    def copy_smem_to_gmem(src, dst, *args, **kwargs):
        if not isinstance(dst, _Discard):
            plgpu.copy_smem_to_gmem(src, dst, *args, **kwargs)

    return types.SimpleNamespace(**{**vars(plgpu), "copy_smem_to_gmem": copy_smem_to_gmem})


def _no_inverse_rope():
    from pallas_kernels import _mega

    rotate = _mega._rotate
    return lambda prog, x, sign: x if sign < 0 else rotate(prog, x, sign)


def _no_exponent():
    """`_mega`'s `kv_cache` with `ue8m0_exponent` a constant 0 (no amax reduction kept live); the caches'
    quantiser, outside the kernel, keeps the real rule."""
    import types

    import jax.experimental.pallas.mosaic_gpu as plgpu
    import jax.numpy as jnp

    from dsv41_jax import kv_cache
    from pallas_kernels._spec import ROW

    kvc = types.SimpleNamespace(**vars(kv_cache))
    # a splat would carry no register layout for the scale stores: cast to the amax's own (a row vector)
    kvc.ue8m0_exponent = lambda amax: plgpu.layout_cast(jnp.zeros(amax.shape, jnp.int32), ROW)
    return kvc


def _register_final_out():
    """`_compute.store_final_out` storing the bf16 O half from registers into global memory (no SMEM staging)."""
    import jax.experimental.pallas as pl
    import jax.numpy as jnp
    from jax import lax

    from pallas_kernels._spec import HALF, HB

    def store(prog, w, res, slot):
        del slot
        dst = prog.out.at[prog.row, pl.ds(prog.h0, HB), pl.ds(w * HALF, HALF)]
        dst[...] = lax.bitcast_convert_type(res.astype(jnp.bfloat16), dst.dtype)  # f16 kernels: `out` holds bf16 bits

    return store


# variant -> {(module, attribute): replacement factory}
VARIANTS = {
    "default": {},
    "no_stage": {("_compute", "store_mega_out"): lambda: (lambda prog, w, res: None)},
    "no_scale_store": {("_kernel", "_program"): lambda: _without("scale")},
    "no_value_store": {("_kernel", "_program"): lambda: _without("out"),
                       ("_kernel", "plgpu"): _copies_skipping_discarded},
    "no_inverse_rope": {("_mega", "_rotate"): _no_inverse_rope},
    "no_q_rope": {("_compute", "rope_q"): lambda: (lambda prog: None)},
    "no_exponent": {("_mega", "kvc"): _no_exponent},
    # the e4m3 staging view without its tiles and swizzle: a warp's two-byte stores hit one bank pair 8 ways
    "unswizzled_stage": {("_kernel", "OUT_STAGE_TRANSFORMS"): lambda: ()},
    # the plain kernels' one-split bf16 output stored from registers (the mega kernel is unchanged)
    "register_out": {("_compute", "store_final_out"): _register_final_out},
    "neither": {("_compute", "store_mega_out"): lambda: (lambda prog, w, res: None),
                ("_compute", "rope_q"): lambda: (lambda prog: None)},
}


@contextlib.contextmanager
def patched(variant: str):
    """Inside: kernels traced with `variant`'s stages (fresh kernels: the kernel caches are cleared on entry and
    exit, so no variant reuses another's compiled kernel)."""
    import importlib

    from pallas_kernels import ops

    targets = {key: importlib.import_module(f"pallas_kernels.{key[0]}") for key in VARIANTS[variant]}
    saved = {key: getattr(mod, key[1]) for key, mod in targets.items()}
    ops._kernel_fn.cache_clear()
    ops._exported_kernel.cache_clear()
    try:
        for key, make in VARIANTS[variant].items():
            setattr(targets[key], key[1], make())
        yield
    finally:
        for key, fn in saved.items():
            setattr(targets[key], key[1], fn)
        ops._kernel_fn.cache_clear()
        ops._exported_kernel.cache_clear()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="mega_v41_h64_t512,mega_v41_h64_t128")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--splits", type=int, default=1)
    ap.add_argument("--iterations", type=int, default=5)
    args = ap.parse_args(argv)

    import jax

    if jax.default_backend() != "gpu":
        print(f"needs a CUDA GPU (jax.default_backend() is {jax.default_backend()!r})", file=sys.stderr)
        return 2
    import pallas_kernels
    from benchmarks.mega_decode import MEGA_CASES, run_mega_case
    from benchmarks.mega_prefill import MEGA_PREFILL_CASES, run_mega_prefill_case
    from benchmarks.sparse_mla import _timer

    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        print(f"unknown variants {unknown}; known: {list(VARIANTS)}", file=sys.stderr)
        return 2
    timer, _ = _timer("auto")
    by_name = {c.name: c for c in (*MEGA_CASES, *MEGA_PREFILL_CASES)}
    runner = {**{c.name: run_mega_case for c in MEGA_CASES},
              **{c.name: run_mega_prefill_case for c in MEGA_PREFILL_CASES}}
    for name in args.cases.split(","):
        if name not in by_name:
            print(f"unknown case {name!r}; known: {list(by_name)}", file=sys.stderr)
            return 2
        for v in variants:
            with patched(v), pallas_kernels.num_splits_override(args.splits):
                r = runner[name](by_name[name], "pallas", timer, 1, args.iterations)
            print(f"{name:22s} splits={args.splits} {v:16s} mega {r['mega_us']:8.1f} us  "
                  f"plain {r['plain_us']:8.1f} us  (mega / plain {r['mega_over_plain']:.3f})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
