"""End-to-end walk through the public API on CPU: caches, metadata builders, one prefill, one decode.

No model weights: latents are random. What it shows is the plumbing a DeepSeek-V4.1 attention
layer runs every step:
  1. allocate a paged SWA cache (fp8_ds_mla) and a ratio-2 compressed cache (fp8_ds_mla);
  2. a prefill step for three prompts: pad the batch to its buckets, write each token's latent at
     `slot_mapping` and each closed pair's pooled latent at `compressed_slot_mapping`;
  3. gather the prefill workspace and the combined (top-k + window) indices, run
     `sparse_mla_prefill`;
  4. a decode step (one new token per request): window indices, global top-k indices into the
     compressed cache, `sparse_mla_decode` over both caches in one softmax;
  5. check the decode output against a prefill-style recomputation of the same token.

Run: python examples/decode_prefill.py [--impl auto|xla|pallas|cuda] [--platform cpu|gpu]
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--impl", default="auto", choices=["auto", "xla", "pallas", "cuda"])
    ap.add_argument("--platform", default="cpu", choices=["cpu", "gpu"], help="JAX platform (default cpu)")
    ap.add_argument("--heads", type=int, default=16)
    args = ap.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", args.platform if args.platform == "cpu" else "cuda,cpu")

    import jax
    import jax.numpy as jnp
    import numpy as np

    import dsv41_jax as d
    from dsv41_jax import kv_cache as kvc

    rng = np.random.default_rng(0)
    W, BS, R2 = 16, 16, 2  # window, SWA page tokens, compress ratio
    CBS = 32  # compressed cache: states per page
    H, TOPK = args.heads, 8  # query heads, indexer top-k (compressed entries)
    fmt = "fp8_ds_mla"
    scale = 512 ** -0.5
    sink = jnp.asarray(rng.standard_normal(H), jnp.float32)
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; impl={args.impl}")

    # ---- 1. caches and a trivial host page allocator
    num_blocks = 16
    swa = kvc.allocate(num_blocks, BS, fmt)
    comp = kvc.allocate(num_blocks, CBS, fmt)
    print(f"SWA cache {swa.shape} {swa.dtype} ({kvc.page_bytes(fmt, BS)} B/page), "
          f"compressed cache {comp.shape} ({kvc.page_bytes(fmt, CBS)} B/page)")
    prompts = [37, 20, 9]
    free = list(range(num_blocks))
    swa_bt = [[free.pop(0) for _ in range(-(-(n + 1) // BS))] for n in prompts]
    free_c = list(range(num_blocks))
    comp_bt = [[free_c.pop(0)] for _ in prompts]
    print(f"prompts {prompts}; SWA block tables {swa_bt}; compressed block tables {comp_bt}")

    # ---- 2. prefill step: write latents
    lat = [jnp.asarray(rng.standard_normal((n + 1, 512)), jnp.bfloat16) for n in prompts]  # +1 for the decode token
    slots = np.concatenate([[bt[p // BS] * BS + p % BS for p in range(n)] for bt, n in zip(swa_bt, prompts)])
    cm = d.make_common_attention_metadata(prompts, prompts, swa_bt, slots)
    T = cm.padded_num_tokens
    kv_tokens = jnp.zeros((T, 512), jnp.bfloat16).at[: sum(prompts)].set(jnp.concatenate([x[:n] for x, n in zip(lat, prompts)]))

    @jax.jit
    def write(swa, comp, cm, kv_tokens, comp_bt):
        swa = kvc.insert(swa, kv_tokens, cm.slot_mapping, fmt=fmt, block_size=BS)
        cslots = d.compressed_slot_mapping(cm.slot_mapping, cm.query_start_loc, cm.seq_lens, comp_bt,
                                           states_per_page=CBS, compress_ratio=R2)
        # stand-in for the learned gated pooling: the mean of each closed pair (token pos-1, pos)
        prev = jnp.concatenate([kv_tokens[:1], kv_tokens[:-1]])
        pooled = ((kv_tokens.astype(jnp.float32) + prev.astype(jnp.float32)) / 2).astype(jnp.bfloat16)
        return swa, kvc.insert(comp, pooled, cslots, fmt=fmt, block_size=CBS), cslots

    comp_bt_arr = jnp.full(cm.block_table.shape, -1, jnp.int32).at[: len(prompts), :1].set(jnp.asarray(comp_bt))
    swa, comp, cslots = write(swa, comp, cm, kv_tokens, comp_bt_arr)
    print(f"prefill: {int(cm.num_actual_tokens)} tokens padded to {T}, {int(cm.num_reqs)} requests padded to "
          f"{cm.padded_num_reqs}; wrote {int((cslots >= 0).sum())} compressed states")

    # ---- 3. prefill attention over workspace rows [compressed entries | window tokens]
    plan = d.prefill_chunk_plan(prompts, prompts, window=W, compress_ratio=R2, max_model_len=256,
                                max_num_batched_tokens=T)
    print(f"prefill chunk plan (start, end, N, M): {[tuple(c) for c in plan]}")
    gl = d.prefill_gather_lens(cm.query_start_loc, cm.seq_lens, window=W)
    tp = d.token_positions(cm.query_start_loc, cm.seq_lens, T)
    # short-context shortcut of the indexer: select every visible compressed entry
    k = jnp.arange(TOPK)[None, :]
    vis = (tp.pos + 1) // R2
    topk_local = jnp.where(k < jnp.minimum(vis, TOPK)[:, None], jnp.maximum(vis[:, None] - TOPK, 0) + k, -1)
    outs = []
    for ch in plan:
        C = ch.end - ch.start
        cs, ss = d.prefill_workspace_slots(cm.seq_lens, gl, cm.block_table, comp_bt_arr, req_start=ch.start,
                                           num_chunk_reqs=C, N=ch.N, M=ch.M, swa_block_size=BS,
                                           compress_ratio=R2, states_per_page=CBS)
        ws = jnp.concatenate([kvc.gather(comp, cs, fmt=fmt, block_size=CBS), kvc.gather(swa, ss, fmt=fmt, block_size=BS)],
                             axis=1).reshape(C * ch.M, 512)
        idx, lens = d.combine_topk_swa_indices(topk_local, cm.query_start_loc, cm.seq_lens, gl, req_start=ch.start,
                                               req_end=ch.end, window=W, compress_ratio=R2, N=ch.N, M=ch.M)
        q = jnp.asarray(rng.standard_normal((T, H, 512)), jnp.bfloat16)
        out, mx, lse = d.sparse_mla_prefill(q, ws, idx, softmax_scale=scale, attn_sink=sink, topk_length=lens,
                                            impl=args.impl)
        outs.append(out)
        print(f"  chunk {tuple(ch)}: workspace {ws.shape}, indices {idx.shape}, attended per token "
              f"{np.asarray(lens)[: int(cm.num_actual_tokens)].min()}..{np.asarray(lens).max()}, "
              f"out {out.shape} finite={bool(jnp.isfinite(out.astype(jnp.float32)).all())}")

    # ---- 4. decode step: one new token per request
    new_slots = [bt[n // BS] * BS + n % BS for bt, n in zip(swa_bt, prompts)]
    seq = [n + 1 for n in prompts]
    dm = d.make_common_attention_metadata([1] * 3, seq, swa_bt, new_slots)
    Td = dm.padded_num_tokens
    kv_new = jnp.zeros((Td, 512), jnp.bfloat16).at[:3].set(jnp.stack([x[n] for x, n in zip(lat, prompts)]))
    swa = kvc.insert(swa, kv_new, dm.slot_mapping, fmt=fmt, block_size=BS)
    # one split plan per layer type for the step (H heads per call), shared by every layer of the type
    sm = d.build_sparse_swa_metadata(dm, window=W, block_size=BS, compress_ratios=[0, R2], index_topk=TOPK,
                                     num_heads=H)
    dtp = d.token_positions(dm.query_start_loc, dm.seq_lens, Td)
    dvis = (dtp.pos + 1) // R2
    dtop = jnp.where(k < jnp.minimum(dvis, TOPK)[:, None], jnp.maximum(dvis[:, None] - TOPK, 0) + k, -1)
    dcomp_bt = jnp.full(dm.block_table.shape, -1, jnp.int32).at[:3, :1].set(jnp.asarray(comp_bt))
    gidx, glens = d.global_topk_indices(dtop, sm.token_to_req_indices, dcomp_bt, states_per_page=CBS,
                                        is_valid_token=sm.is_valid_token)
    qd = jnp.asarray(rng.standard_normal((Td, 1, H, 512)), jnp.bfloat16)
    t0 = time.perf_counter()
    out, lse = d.sparse_mla_decode(qd, swa, sm.decode_swa_indices, sm.decode_swa_lens, kv_format=fmt, block_size=BS,
                                   softmax_scale=scale, attn_sink=sink, extra_kv_cache=comp,
                                   extra_indices=gidx[:, None], extra_topk_length=glens, extra_kv_format=fmt,
                                   extra_block_size=CBS, impl=args.impl, plan=sm.tile_sched["c2a"])
    out.block_until_ready()
    print(f"decode: {int(sm.num_decode_tokens)} decode tokens (padded {Td}), window lens "
          f"{np.asarray(sm.decode_swa_lens)[:3].tolist()}, compressed lens {np.asarray(glens)[:3].tolist()}, "
          f"split plan for {sorted(sm.tile_sched)}; out {out.shape} lse {lse.shape} in {1e3 * (time.perf_counter() - t0):.1f} ms")

    # ---- 5. the same attention recomputed prefill-style from gathered rows
    rows = jnp.concatenate([kvc.gather(swa, sm.decode_swa_indices[:, 0], fmt=fmt, block_size=BS),
                            kvc.gather(comp, gidx, fmt=fmt, block_size=CBS)], axis=1)  # [Td, W+K, 512]
    flat = rows.reshape(-1, 512)
    ridx = jnp.arange(Td)[:, None] * rows.shape[1] + jnp.arange(rows.shape[1])[None, :]
    valid = jnp.concatenate([jnp.arange(W)[None, :] < sm.decode_swa_lens[:, None],
                             jnp.arange(TOPK)[None, :] < glens[:, None]], axis=1)
    ref, _, ref_lse = d.sparse_mla_prefill(qd[:, 0], flat, jnp.where(valid, ridx, -1), softmax_scale=scale,
                                           attn_sink=sink, impl="xla")
    err = float(jnp.max(jnp.abs(ref[:3].astype(jnp.float32) - out[:3, 0].astype(jnp.float32))))
    lerr = float(jnp.max(jnp.abs(ref_lse[:3] - lse[:3, 0])))
    print(f"decode vs prefill-style recomputation: max |out diff| = {err:.2e}, max |lse diff| = {lerr:.2e}")
    ok = err < 2e-2 and lerr < 1e-3
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
