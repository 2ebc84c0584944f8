"""The mega prefill against the plain prefill and the unfused chain, on the same inputs (`--suite mega`).

A V4.1 prefill chunk (s_q query tokens at consecutive positions attending top-k rows of a gathered bf16 kv of s_kv
rows, sinks on, as FlashMLA's V4 prefill cases), three ways:

- "mega": `sparse_mla_mega_prefill(impl=...)` (q unroped in; e4m3 out with UE8M0 exponents);
- "plain": `sparse_mla_prefill(impl=...)` of the same call, q as it comes (bf16 out: the prefill alone);
- "chain": q RoPE, the plain prefill, the inverse RoPE and the quantisation as separate ops (`dsv41_jax.rope`,
  `quantize_output_fp8`).

Times are CUPTI sums of every kernel a call launches (XLA's conversions and fusions included), medians over
input draws and iterations; the report gives mega / plain and chain / mega.
"""

from __future__ import annotations

import dataclasses
import statistics

__all__ = ["MegaPrefillCase", "MEGA_PREFILL_CASES", "run_mega_prefill_case"]


@dataclasses.dataclass(frozen=True)
class MegaPrefillCase:
    name: str
    s_q: int
    h_q: int
    topk: int
    s_kv: int
    max_pos: int = 65536


MEGA_PREFILL_CASES = [
    MegaPrefillCase("mega_prefill_h64_k512_kv32768", s_q=4096, h_q=64, topk=512, s_kv=32768),
    MegaPrefillCase("mega_prefill_h128_k1024_kv32768", s_q=4096, h_q=128, topk=1024, s_kv=32768),
    MegaPrefillCase("mega_prefill_h8_k512_kv32768", s_q=4096, h_q=8, topk=512, s_kv=32768),  # a TP-8 shard
]


def run_mega_prefill_case(case: MegaPrefillCase, impl: str, timer, sets: int, iterations: int, seed: int = 0,
                          breakdown: bool = False) -> dict:
    """{"mega_us", "plain_us", "chain_us", ...} of one case (see the module docstring); breakdown: also each
    way's CUPTI per-kernel times of the last draw ("kernels": {way: {kernel: us}})."""
    import jax
    import jax.numpy as jnp

    import dsv41_jax as d
    from dsv41_jax.rope import apply_inverse_rope, apply_rope, cos_sin_cache
    from dsv41_jax.sparse_mla import quantize_output_fp8

    key = jax.random.PRNGKey(seed)
    cs = cos_sin_cache(case.max_pos, theta=160000.0)
    sink = jax.random.normal(jax.random.fold_in(key, 1), (case.h_q,), jnp.float32)
    kw = dict(softmax_scale=512 ** -0.5, attn_sink=sink, impl=impl)

    def plain(q, pos, kv, i):
        return d.sparse_mla_prefill(q, kv, i, **kw)

    def mega(q, pos, kv, i):
        return d.sparse_mla_mega_prefill(q, pos, cs, kv, i, **kw)

    def chain(q, pos, kv, i):
        out, _, lse = plain(apply_rope(q, pos, cs), pos, kv, i)
        vals, exps = quantize_output_fp8(apply_inverse_rope(out.astype(jnp.float32), pos, cs))
        return vals, exps, lse

    fns = {name: jax.jit(f) for name, f in (("mega", mega), ("plain", plain), ("chain", chain))}
    times: dict[str, list[float]] = {name: [] for name in fns}
    for s in range(sets):
        kq, kk, ki, kp = jax.random.split(jax.random.fold_in(key, 100 + s), 4)
        q = jax.random.normal(kq, (case.s_q, case.h_q, 512), jnp.float32).astype(jnp.bfloat16)
        kv = jax.random.normal(kk, (case.s_kv, 512), jnp.float32).astype(jnp.bfloat16)
        idx = jax.random.randint(ki, (case.s_q, case.topk), 0, case.s_kv).astype(jnp.int32)
        # a prefill chunk's tokens sit at consecutive positions
        pos = (jax.random.randint(kp, (), 0, case.max_pos - case.s_q) + jnp.arange(case.s_q)).astype(jnp.int32)
        args = (q, pos, kv, idx)
        for name, f in fns.items():
            times[name] += timer(f, args, iterations)
    us = {name: 1e3 * statistics.median(v) for name, v in times.items()}
    extra = {}
    if breakdown:
        from benchmarks.sparse_mla import _breakdown

        extra["kernels"] = {name: _breakdown(f, args, iterations) for name, f in fns.items()}
    return dict(case=case.name, op="mega_prefill", impl=impl, us=us["mega"], mega_us=us["mega"], plain_us=us["plain"],
                chain_us=us["chain"], mega_over_plain=us["mega"] / us["plain"], chain_over_mega=us["chain"] / us["mega"],
                samples=len(times["mega"]), config=dataclasses.asdict(case), **extra)
