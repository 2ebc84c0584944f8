"""A paged inference engine for `DeepseekV41Model` under `jax.jit`.

Host side (Python): requests, page allocation, scheduling of prefill chunks and decode steps,
padding into buckets (`make_common_attention_metadata`), greedy sampling. Device side: one pure,
jitted step per bucket, `step(params, caches, inputs) -> (logits, caches)`, with the caches donated
so a step updates them in place.

Caches (one set per engine):
- every layer has a paged SWA cache in `kv_format` (page `block_size` tokens);
- every kv-source layer has a paged compressed cache in `comp_kv_format` (page `comp_block_size`
  states) and a float32 index-key cache with the same slots;
- ratio-2 kv sources keep a per-request float32 ring of the open group's (value, gate) rows,
  capacity the next power of two >= max(8, num_speculative_tokens + 2), so a group split across
  steps (chunked prefill, decode) pools exactly as in one pass.
Pages are allocated for the whole sequence (no sliding-window page reclaim) and freed when a
request finishes. Compressed caches of the same ratio share one block table per request.

Per layer and step: q and the SWA latent are projected and RoPE'd, the latent is written at
`slot_mapping`; a kv source pools and writes its compressed latent and index key at the
compressed slot mapping; an index source scores the visible compressed entries and selects its
top-k. Decode tokens (query length <= 1 + num_speculative_tokens) attend through
`sparse_mla_decode` over the SWA and compressed caches; prefill tokens through
`sparse_mla_prefill` over a gathered workspace (compressed entries, then the window) with the
combined indices, as vLLM does.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv41_jax import kv_cache as kvc
from dsv41_jax import metadata as md
from dsv41_jax import attention as _ops
from dsv41_jax import sharding
from dsv41_jax.backends import canonical_kv_cache_dtype
from dsv41_jax.buckets import DEFAULT_BUCKETS, BucketPolicy
from dsv41_jax.model import RopeTables, decoder_tail, index_keys, make_rope_tables, run_indexer
from dsv41_jax.nn import DeepseekV41Model
from dsv41_jax.rope import apply_inverse_rope, apply_rope

__all__ = ["EngineConfig", "InferenceEngine", "StepInputs"]

_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Static settings of an engine (changing any of them recompiles)."""

    max_model_len: int = 256
    max_reqs: int = 8
    block_size: int = 16
    comp_block_size: int = 16
    num_blocks: int | None = None  # pages per cache group; default: max_reqs full-length sequences
    kv_format: str = "bf16"
    comp_kv_format: str | None = None  # default: kv_format
    impl: str = "auto"
    num_speculative_tokens: int = 0
    buckets: BucketPolicy = DEFAULT_BUCKETS
    mesh: jax.sharding.Mesh | None = None  # heads of the attention split over `head_axis`
    head_axis: str = "tp"

    def __post_init__(self):
        for k in ("max_model_len", "max_reqs", "block_size", "comp_block_size"):
            v = getattr(self, k)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"EngineConfig.{k} must be a positive int, got {v!r}")
        for k in ("kv_format", "comp_kv_format"):
            v = getattr(self, k)
            if v is not None:
                canonical_kv_cache_dtype(v)

    @property
    def comp_format(self) -> str:
        return self.comp_kv_format or self.kv_format

    @property
    def ring_capacity(self) -> int:
        n = max(8, self.num_speculative_tokens + 2)
        return 1 << (n - 1).bit_length()

    def pages(self, per_page: int) -> int:
        if self.num_blocks is not None:
            return self.num_blocks
        return self.max_reqs * (-(-self.max_model_len // per_page)) + 1


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepInputs:
    """Device inputs of one step: tokens int32[T], the SWA metadata, one compressed block table
    int32[R, Bc] per compress ratio present, and each request's ring row int32[R]."""

    tokens: jax.Array
    common: md.CommonAttentionMetadata
    comp_block_tables: dict
    ring_rows: jax.Array


def _flat_gather(cache: jax.Array, slots: jax.Array) -> jax.Array:
    """Rows of a float32 `[pages, per_page, d]` cache at slots (0 where slot < 0)."""
    flat = cache.reshape(-1, cache.shape[-1])
    ok = (slots >= 0) & (slots < flat.shape[0])
    return jnp.where(ok[..., None], flat[jnp.clip(slots, 0, flat.shape[0] - 1)], 0.0)


def _flat_scatter(cache: jax.Array, slots: jax.Array, rows: jax.Array) -> jax.Array:
    flat = cache.reshape(-1, cache.shape[-1])
    idx = jnp.where(slots >= 0, slots, flat.shape[0])  # out of range: dropped
    return flat.at[idx].set(rows.astype(flat.dtype), mode="drop").reshape(cache.shape)


def _pool_groups(attn, rows, ring, ring_rows, cm, tp, valid, r: int, cap: int):
    """Pooled latents `[T, 512]` of ratio-r groups, and the updated ring.

    A group member earlier in this step comes from `rows`; one from an earlier step from the
    request's ring (`[max_reqs, cap, 2, 512]`, indexed by position mod cap). Only each request's
    last r - 1 tokens are written back: they are all a later step can need, and writing no
    more keeps a long prefill from wrapping the ring onto rows it still reads.
    """
    T = rows.shape[0]
    ql = cm.query_start_loc[1:] - cm.query_start_loc[:-1]
    start = cm.seq_lens[tp.req] - ql[tp.req]  # first position of the request in this step
    rrow = ring_rows[tp.req]
    flat_ring = ring.reshape(-1, 2 * 512)
    t = jnp.arange(T)
    members = []
    for j in range(r):
        p = tp.pos - (r - 1) + j
        in_step = p >= start
        from_step = rows[jnp.clip(t - (tp.pos - p), 0, T - 1)]
        from_ring = flat_ring[jnp.clip(rrow * cap + p % cap, 0, flat_ring.shape[0] - 1)].reshape(T, 2, 512)
        members.append(jnp.where(in_step[:, None, None], from_step, from_ring))
    latent = attn.compressor.pool(jnp.stack(members, axis=1))
    keep = valid & (tp.pos >= cm.seq_lens[tp.req] - (r - 1))
    slot = jnp.where(keep, rrow * cap + tp.pos % cap, -1)
    ring = _flat_scatter(flat_ring, slot, rows.reshape(T, -1)).reshape(ring.shape)
    return latent, ring


def _step_plans(ecfg: EngineConfig) -> bool:
    """Whether a step builds its split plans: the cuda kernels run over them and the xla reference checks them
    (the JAX planner is cheap on a CPU); the pallas kernels do not use them, and on a GPU without the cuda
    planner kernel the JAX planner's loops would cost the step host round trips."""
    from dsv41_jax.plans import resolve_planner

    if ecfg.impl == "pallas":
        return False
    if ecfg.impl == "auto":
        return resolve_planner("auto") == "device" or jax.default_backend() == "cpu"
    return True


def _attention_ops(ecfg: EngineConfig):
    if ecfg.mesh is None:
        return _ops.sparse_mla_decode, _ops.sparse_mla_prefill
    return sharding.sparse_mla_decode_sharded, sharding.sparse_mla_prefill_sharded


def _param_sharding(path: tuple, value: jax.Array, mesh: jax.sharding.Mesh, axis: str):
    """Head-parallel placement: q heads (wq_b columns), sinks and wo_a groups split; the rest replicated."""
    P = jax.sharding.PartitionSpec
    names = [str(p) for p in path]
    spec = P()
    if "self_attn" in names and "indexer" not in names:
        if names[-2:] == ["wq_b", "kernel"]:
            spec = P(None, axis)
        elif names[-1] == "attn_sink":
            spec = P(axis)
        elif names[-1] == "wo_a":
            spec = P(axis, None, None)
    return jax.sharding.NamedSharding(mesh, spec)


def _step(graphdef, params, caches, inp: StepInputs, tables: RopeTables, *, ecfg: EngineConfig):
    """One engine step (pure): returns logits float32 [T, vocab] and the updated caches."""
    model: DeepseekV41Model = nnx.merge(graphdef, params)
    cfg = model.cfg
    cm = inp.common
    T = inp.tokens.shape[0]
    R = cm.padded_num_reqs
    W, BS, CBS = cfg.sliding_window, ecfg.block_size, ecfg.comp_block_size
    fmt, cfmt = ecfg.kv_format, ecfg.comp_format
    ratios = sorted({r for r in cfg.compress_ratios[: cfg.num_hidden_layers] if r})
    # one split plan per layer type for the whole step (the heads of one shard's call), shared by its layers
    heads = cfg.num_attention_heads // (ecfg.mesh.shape[ecfg.head_axis] if ecfg.mesh is not None else 1)
    sm = md.build_sparse_swa_metadata(cm, window=W, block_size=BS, num_speculative_tokens=ecfg.num_speculative_tokens,
                                      compress_ratios=list(cfg.compress_ratios[: cfg.num_hidden_layers]),
                                      index_topk=cfg.index_topk if ratios else None,
                                      num_heads=heads if _step_plans(ecfg) else None)
    tp = md.token_positions(cm.query_start_loc, cm.seq_lens, T)
    valid = cm.slot_mapping >= 0
    t_idx = jnp.arange(T)
    is_dec = t_idx < sm.num_decode_tokens
    gl = sm.prefill_gather_lens
    cslots = {r: md.compressed_slot_mapping(cm.slot_mapping, cm.query_start_loc, cm.seq_lens, inp.comp_block_tables[r],
                                            states_per_page=CBS, compress_ratio=r) for r in ratios}
    swa, comp, ikey, ring = dict(caches["swa"]), dict(caches["comp"]), dict(caches["ikey"]), dict(caches["ring"])
    x = model.embed_tokens[...].astype(_F32)[inp.tokens]
    selected: dict[int, jax.Array] = {}
    cands: dict[int, jax.Array] = {}
    for layer, role in zip(model.layers, model.roles()):
        lid = str(role.layer_id)
        attn = layer.self_attn
        cs = tables.for_role(role)
        with jax.named_scope(f"layer{role.layer_id}_{role.layer_type}"):
            h = layer.input_layernorm(x)
            with jax.named_scope("qkv_proj"):
                q, qr = attn.q_and_qr(h)
                q = apply_rope(q, tp.pos, cs).astype(jnp.bfloat16)
                kv = apply_rope(attn.swa_latent(h), tp.pos, cs).astype(jnp.bfloat16)
                swa[lid] = kvc.insert(swa[lid], kv, cm.slot_mapping, fmt=fmt, block_size=BS)
            r = role.compress_ratio
            if r:
                cbt = inp.comp_block_tables[r]
                if role.owns_compressed_cache:
                    with jax.named_scope("compressor"):
                        rows = attn.compressor.rows(h)  # [T, 2, 512]
                        if r == 1:
                            latent = attn.compressor.pool(rows[:, None])
                        else:
                            latent, ring[lid] = _pool_groups(attn, rows, ring[lid], inp.ring_rows, cm, tp, valid,
                                                             r, ecfg.ring_capacity)
                        gpos = (tp.pos // r) * r
                        main = apply_rope(latent, gpos, cs).astype(jnp.bfloat16)
                        comp[lid] = kvc.insert(comp[lid], main, cslots[r], fmt=cfmt, block_size=CBS)
                        ikey[lid] = _flat_scatter(ikey[lid], cslots[r], index_keys(attn, latent, gpos, cs))
                src = str(role.kv_source_layer)
                n_vis = jnp.where(valid, (tp.pos + 1) // r, 0)
                if role.owns_indexer:
                    with jax.named_scope("indexer"):
                        nmax = ecfg.max_model_len // r
                        lslots = md._paged_slot(cbt, tp.req[:, None], jnp.arange(nmax)[None, :], CBS)
                        keys = _flat_gather(ikey[src], lslots)
                        selected[role.layer_id] = run_indexer(attn, role, cfg, h, qr, tp.pos, cs, keys, n_vis, cands)
                sel = selected[role.index_source_layer]
            with jax.named_scope("sparse_attention"):
                kw = dict(softmax_scale=cfg.softmax_scale, attn_sink=attn.attn_sink[...], impl=ecfg.impl)
                if ecfg.mesh is not None:
                    kw.update(mesh=ecfg.mesh, head_axis=ecfg.head_axis)
                sparse_mla_decode, sparse_mla_prefill = _attention_ops(ecfg)
                dec_kw = dict(kv_format=fmt, block_size=BS)
                if r:
                    gidx, glens = md.global_topk_indices(sel, tp.req, cbt, states_per_page=CBS, is_valid_token=is_dec & valid)
                    dec_kw.update(extra_kv_cache=comp[src], extra_indices=gidx[:, None], extra_topk_length=glens,
                                  extra_kv_format=cfmt, extra_block_size=CBS)
                out_d, _ = sparse_mla_decode(q[:, None], swa[lid], sm.decode_swa_indices, sm.decode_swa_lens,
                                             plan=sm.tile_sched.get(role.layer_type), **dec_kw, **kw)
                N = ecfg.max_model_len // r if r else 0
                M = N + T + W - 1
                c_sl, s_sl = md.prefill_workspace_slots(
                    cm.seq_lens, gl, cm.block_table, cbt if r else None, req_start=sm.num_decodes, num_chunk_reqs=R,
                    N=N, M=M, swa_block_size=BS, compress_ratio=r, states_per_page=CBS)
                parts = [kvc.gather(comp[src], c_sl, fmt=cfmt, block_size=CBS)] if N else []
                parts.append(kvc.gather(swa[lid], s_sl, fmt=fmt, block_size=BS))
                ws = jnp.concatenate(parts, axis=1).reshape(R * M, 512)
                tk = sel if r else jnp.zeros((T, 0), jnp.int32)
                pidx, plens = md.combine_topk_swa_indices(
                    tk, cm.query_start_loc, cm.seq_lens, gl, req_start=sm.num_decodes, req_end=cm.num_reqs,
                    window=W, compress_ratio=r, N=N, M=M)
                out_p, _, _ = sparse_mla_prefill(q, ws, pidx, topk_length=plens, **kw)
                out = jnp.where(is_dec[:, None, None], out_d[:, 0], out_p)
            with jax.named_scope("o_proj"):
                o = apply_inverse_rope(out.astype(_F32), tp.pos, cs)
                x = decoder_tail(layer, x, attn.output(o))
    logits = model.lm_head(model.norm(x))
    return logits, {"swa": swa, "comp": comp, "ikey": ikey, "ring": ring}


class InferenceEngine:
    """Paged prefill + decode for a batch of requests of different lengths (greedy sampling)."""

    def __init__(self, model: DeepseekV41Model, config: EngineConfig = EngineConfig()):
        self.model, self.ecfg = model, config
        cfg = model.cfg
        if config.max_model_len > cfg.max_position_embeddings:
            raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's max_position_embeddings "
                             f"{cfg.max_position_embeddings}")
        self.graphdef, self.params = nnx.split(model)
        if config.mesh is not None:
            n = config.mesh.shape.get(config.head_axis)
            if n is None:
                raise ValueError(f"EngineConfig.head_axis {config.head_axis!r} is not an axis of the mesh {dict(config.mesh.shape)}")
            if cfg.num_attention_heads % n or cfg.o_groups % n:
                raise ValueError(f"num_attention_heads ({cfg.num_attention_heads}) and o_groups ({cfg.o_groups}) must be "
                                 f"divisible by the head axis size {n}")
            flat = nnx.to_flat_state(self.params)
            shardings = nnx.from_flat_state([(p, _param_sharding(p, v, config.mesh, config.head_axis)) for p, v in flat])
            self.params = jax.device_put(self.params, shardings)
        self.tables = make_rope_tables(cfg, config.max_model_len)
        self.roles = model.roles()
        self.ratios = sorted({r.compress_ratio for r in self.roles if r.compress_ratio})
        self.decode_threshold = md.decode_threshold(config.num_speculative_tokens)
        n_swa = config.pages(config.block_size)
        caches = {"swa": {}, "comp": {}, "ikey": {}, "ring": {}}
        for role in self.roles:
            caches["swa"][str(role.layer_id)] = kvc.allocate(n_swa, config.block_size, config.kv_format)
            if role.owns_compressed_cache:
                r = role.compress_ratio
                n_c = config.pages(config.comp_block_size)
                caches["comp"][str(role.layer_id)] = kvc.allocate(n_c, config.comp_block_size, config.comp_format)
                caches["ikey"][str(role.layer_id)] = jnp.zeros((n_c, config.comp_block_size, cfg.index_head_dim), _F32)
                if r > 1:
                    caches["ring"][str(role.layer_id)] = jnp.zeros((config.max_reqs, config.ring_capacity, 2, 512), _F32)
        if config.mesh is not None:  # the MQA latent caches are read by every head: replicated
            caches = jax.device_put(caches, jax.sharding.NamedSharding(config.mesh, jax.sharding.PartitionSpec()))
        self.caches = caches
        self.free = {"swa": list(range(1, n_swa))}  # page 0 stays unused: a -1 clamped to 0 never hits live data
        for r in self.ratios:
            self.free[r] = list(range(1, config.pages(config.comp_block_size)))
        self.free_rows = list(range(config.max_reqs))
        self.requests: dict[int, dict] = {}
        self._next_id = 0
        self._fn = jax.jit(functools.partial(_step, self.graphdef, ecfg=config), donate_argnums=(1,))
        self.compiled_shapes: set = set()

    # ------------------------------------------------------------------ request bookkeeping
    def add_request(self, prompt: Sequence[int]) -> int:
        if not self.free_rows:
            raise RuntimeError(f"no free request slot (max_reqs={self.ecfg.max_reqs})")
        toks = [int(t) for t in prompt]
        if not toks:
            raise ValueError("prompt must have at least one token")
        if any(not 0 <= t < self.model.cfg.vocab_size for t in toks):
            raise ValueError(f"prompt tokens must be in [0, {self.model.cfg.vocab_size})")
        rid = self._next_id
        self._next_id += 1
        self.requests[rid] = dict(tokens=toks, done=0, row=self.free_rows.pop(0), pages={"swa": []} | {r: [] for r in self.ratios})
        return rid

    def finish(self, rid: int) -> None:
        req = self.requests.pop(rid)
        for key, pages in req["pages"].items():
            self.free[key].extend(pages)
        self.free_rows.append(req["row"])

    def _ensure_pages(self, req: dict, seq_len: int) -> None:
        if seq_len > self.ecfg.max_model_len:
            raise ValueError(f"sequence length {seq_len} exceeds max_model_len {self.ecfg.max_model_len}")
        need = {"swa": -(-seq_len // self.ecfg.block_size)}
        for r in self.ratios:
            need[r] = -(-(seq_len // r) // self.ecfg.comp_block_size)
        for key, n in need.items():
            pages = req["pages"][key]
            while len(pages) < n:
                if not self.free[key]:
                    raise RuntimeError(f"out of cache pages for {key!r}")
                pages.append(self.free[key].pop(0))

    # ------------------------------------------------------------------------------ steps
    def prepare(self, feeds: Sequence[tuple[int, int]]) -> tuple[StepInputs, list[tuple[int, int]]]:
        """Host side of a step: order the feeds decodes first, allocate pages, pad into buckets.

        `feeds`: (request id, number of its next known tokens to process). Returns the device
        inputs and the feeds in the order their tokens are packed.
        """
        feeds = [(rid, n) for rid, n in feeds if n > 0]
        order = md.reorder_decodes_first([n for _, n in feeds], decode_threshold=self.decode_threshold)
        feeds = [feeds[i] for i in order]
        qlens, seqs, bts, slots, toks, rows, cbts = [], [], [], [], [], [], {r: [] for r in self.ratios}
        for rid, n in feeds:
            req = self.requests[rid]
            start = req["done"]
            if start + n > len(req["tokens"]):
                raise ValueError(f"request {rid} has {len(req['tokens']) - start} unprocessed tokens, asked for {n}")
            self._ensure_pages(req, start + n)
            pg = req["pages"]["swa"]
            bs = self.ecfg.block_size
            slots += [pg[p // bs] * bs + p % bs for p in range(start, start + n)]
            toks += req["tokens"][start : start + n]
            qlens.append(n)
            seqs.append(start + n)
            bts.append(pg)
            rows.append(req["row"])
            for r in self.ratios:
                cbts[r].append(req["pages"][r])
        bp = self.ecfg.buckets
        cm = md.make_common_attention_metadata(qlens, seqs, bts, slots, buckets=bp)
        R, T = cm.padded_num_reqs, cm.padded_num_tokens
        cbt_arr = {}
        for r in self.ratios:
            width = bp.blocks(max([len(b) for b in cbts[r]] + [1]))
            a = np.full((R, width), -1, np.int32)
            for i, b in enumerate(cbts[r]):
                a[i, : len(b)] = b
            cbt_arr[r] = jnp.asarray(a)
        tok = np.zeros(T, np.int32)
        tok[: len(toks)] = toks
        ring_rows = np.zeros(R, np.int32)
        ring_rows[: len(rows)] = rows
        return StepInputs(jnp.asarray(tok), cm, cbt_arr, jnp.asarray(ring_rows)), feeds

    def step(self, feeds: Sequence[tuple[int, int]]) -> dict[int, np.ndarray]:
        """Run one step (see `prepare`). Returns each request's logits float32 `[n, vocab]` for the
        tokens it processed."""
        inp, feeds = self.prepare(feeds)
        cm, cbt_arr = inp.common, inp.comp_block_tables
        self.compiled_shapes.add((cm.padded_num_tokens, cm.padded_num_reqs, cm.block_table.shape[1])
                                 + tuple(a.shape[1] for a in cbt_arr.values()))
        logits, self.caches = self._fn(self.params, self.caches, inp, self.tables)
        logits = np.asarray(logits)
        out, off = {}, 0
        for rid, n in feeds:
            out[rid] = logits[off : off + n]
            self.requests[rid]["done"] += n
            off += n
        return out

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        *,
        prefill_chunk: int | None = None,
        on_step: Callable[[int, int], None] | None = None,
    ) -> list[list[int]]:
        """Greedy generation: chunked prefill of every prompt, then one token per request per step.

        `on_step(step_index, tokens_this_step)` is called after each decode step (progress bars).
        Returns the generated tokens of each prompt.
        """
        rids = [self.add_request(p) for p in prompts]
        outs: dict[int, list[int]] = {r: [] for r in rids}
        last: dict[int, np.ndarray] = {}
        try:
            while True:  # prefill, chunked
                feeds = []
                for rid in rids:
                    req = self.requests[rid]
                    left = len(req["tokens"]) - req["done"]
                    if left:
                        feeds.append((rid, left if prefill_chunk is None else min(left, prefill_chunk)))
                if not feeds:
                    break
                for rid, lg in self.step(feeds).items():
                    last[rid] = lg[-1]
            for i in range(max_new_tokens):
                for rid in rids:
                    nxt = int(np.argmax(last[rid]))
                    outs[rid].append(nxt)
                    self.requests[rid]["tokens"].append(nxt)
                if i == max_new_tokens - 1:
                    break
                res = self.step([(rid, 1) for rid in rids])
                for rid, lg in res.items():
                    last[rid] = lg[-1]
                if on_step is not None:
                    on_step(i, len(rids))
        finally:
            for rid in rids:
                if rid in self.requests:
                    self.finish(rid)
        return [outs[r] for r in rids]
