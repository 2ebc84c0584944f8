"""The mega decode against the plain decode and the unfused chain, on the same inputs (`--suite mega`).

One V4.1 decode step's tokens as T one-token requests (V4.1-Flash: SWA top-k 128 on pages of 256 from a 528 B
`mxfp8_ds_mla` cache, compressed top-k 512 (h_q 128: 1024) on pages of 64 from a 288 B `nvfp4_ds_mla` cache),
three ways, each over the same plan made once beforehand (as a step shares its layer type's plan):

- "mega": `sparse_mla_mega_decode(impl=...)` (q unroped in; e4m3 out with UE8M0 exponents);
- "plain": `sparse_mla_decode(impl=...)` of the same call, q as it comes (bf16 out: the decode alone);
- "chain": q RoPE, the plain decode, the inverse RoPE and the quantisation as separate ops (`dsv41_jax.rope`,
  `quantize_output_fp8`: what a model without the fused op runs).

Times are CUPTI sums of every kernel a call launches (XLA's fusions of the chain included), medians over input
draws and iterations; the report gives mega / plain and chain / mega.
"""

from __future__ import annotations

import dataclasses
import statistics

__all__ = ["MegaCase", "MEGA_CASES", "run_mega_case"]


@dataclasses.dataclass(frozen=True)
class MegaCase:
    name: str
    tokens: int
    h_q: int
    topk: int = 128
    block_size: int = 256
    extra_topk: int = 512
    extra_block_size: int = 64
    fmt: str = "mxfp8_ds_mla"
    extra_fmt: str = "nvfp4_ds_mla"
    s_kv: int = 16384  # cache tokens per request
    max_pos: int = 65536


MEGA_CASES = [
    *(MegaCase(f"mega_v41_h64_t{t}", tokens=t, h_q=64) for t in (128, 256, 512)),
    MegaCase("mega_v41_h128_t256", tokens=256, h_q=128, extra_topk=1024),
    MegaCase("mega_v41_h8_t256", tokens=256, h_q=8),  # a TP-8 shard
]


def run_mega_case(case: MegaCase, impl: str, timer, sets: int, iterations: int, seed: int = 0,
                  breakdown: bool = False, batch_invariant: bool = False) -> dict:
    """{"mega_us", "plain_us", "chain_us", ...} of one case (see the module docstring); breakdown: also each
    way's CUPTI per-kernel times of the last draw ("kernels": {way: {kernel: us}}); batch_invariant: over the
    batch-invariant plan (no split-KV, no combine kernel)."""
    import jax
    import jax.numpy as jnp

    import dsv41_jax as d
    from benchmarks.inputs import filled_cache, request_indices
    from dsv41_jax.rope import apply_inverse_rope, apply_rope, cos_sin_cache
    from dsv41_jax.sparse_mla import quantize_output_fp8

    T = case.tokens
    key = jax.random.PRNGKey(seed)
    k0, k1, k2 = jax.random.split(key, 3)
    main, cap = filled_cache(k0, T * case.s_kv // 2, case.block_size, case.fmt)
    extra, ecap = filled_cache(k1, T * max(case.s_kv // 8, case.extra_topk), case.extra_block_size, case.extra_fmt)
    sink = jax.random.normal(k2, (case.h_q,), jnp.float32)
    cs = cos_sin_cache(case.max_pos, theta=160000.0)
    kw = dict(kv_format=case.fmt, block_size=case.block_size, softmax_scale=512 ** -0.5, attn_sink=sink,
              extra_kv_format=case.extra_fmt, extra_block_size=case.extra_block_size, impl=impl)
    plan = d.make_decode_plan(jnp.full((T,), case.topk, jnp.int32), s_q=1, num_heads=case.h_q, topk=case.topk,
                              extra_topk_length=jnp.full((T,), case.extra_topk, jnp.int32),
                              extra_topk=case.extra_topk, batch_invariant=batch_invariant)

    def plain(q, pos, c, i, e, ei, p):
        return d.sparse_mla_decode(q[:, None], c, i[:, None], None, extra_kv_cache=e, extra_indices=ei[:, None],
                                   plan=p, **kw)

    def mega(q, pos, c, i, e, ei, p):
        return d.sparse_mla_mega_decode(q, pos, cs, c, i, None, extra_kv_cache=e, extra_indices=ei, plan=p, **kw)

    def chain(q, pos, c, i, e, ei, p):
        out, lse = plain(apply_rope(q, pos, cs), pos, c, i, e, ei, p)
        vals, exps = quantize_output_fp8(apply_inverse_rope(out[:, 0].astype(jnp.float32), pos, cs))
        return vals, exps, lse[:, 0]

    fns = {name: jax.jit(f) for name, f in (("mega", mega), ("plain", plain), ("chain", chain))}
    times: dict[str, list[float]] = {name: [] for name in fns}
    for s in range(sets):
        kq, ki, ke, kp = jax.random.split(jax.random.fold_in(key, 100 + s), 4)
        q = jax.random.normal(kq, (T, case.h_q, 512), jnp.float32).astype(jnp.bfloat16)
        idx = request_indices(ki, T, 1, case.topk, cap)[:, 0]
        eidx = request_indices(ke, T, 1, case.extra_topk, ecap)[:, 0]
        pos = jax.random.randint(kp, (T,), 0, case.max_pos).astype(jnp.int32)
        args = (q, pos, main, idx, extra, eidx, plan)
        for name, f in fns.items():
            times[name] += timer(f, args, iterations)
    us = {name: 1e3 * statistics.median(v) for name, v in times.items()}
    extra = {}
    if breakdown:
        from benchmarks.sparse_mla import _breakdown

        extra["kernels"] = {name: _breakdown(f, args, iterations) for name, f in fns.items()}
    return dict(case=case.name + ("_invariant" if batch_invariant else ""), op="mega", impl=impl, us=us["mega"],
                mega_us=us["mega"], plain_us=us["plain"], chain_us=us["chain"], mega_over_plain=us["mega"] / us["plain"],
                chain_over_mega=us["chain"] / us["mega"], samples=len(times["mega"]), config=dataclasses.asdict(case),
                **extra)
