"""A paged inference engine for `DeepseekV41Model` under `jax.jit`.

Host side (Python): requests, page allocation, scheduling of prefill chunks and decode steps,
padding into buckets (`make_common_attention_metadata`), greedy sampling. Device side: one pure
step, `step(params, caches, inputs) -> (logits, caches)`, compiled once per step shape with the
caches donated so a step updates them in place.

Compilation happens ahead of time, never inside `generate`: the engine's limits (`EngineConfig`:
max_reqs, max_model_len, prefill_chunk, max_num_batched_tokens) map through the bucket policy to
the envelope of step shapes it can meet (`dsv41_jax.envelope`), and `warmup()` lowers and
compiles each (`jax.jit(...).lower(...).compile()`), keeping the executables by shape. `generate`
warms a cold engine up first and reports that apart (`GenerateStats.warmup`); its steps run
compiled executables only. `step()` on a cold engine compiles the one shape it needs. A step
outside the limits is a `ValueError` naming the limit. Every step's host and device time is
recorded (`dsv41_jax.engine_stats`).

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
import logging
import sys
import time
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
from dsv41_jax.engine_stats import GenerateStats, StepTiming, WarmupStats
from dsv41_jax.envelope import ServingLimits, StepShape, envelope_shapes, step_shape
from dsv41_jax.model import RopeTables, decoder_tail, index_keys, make_rope_tables, run_indexer
from dsv41_jax.nn import DeepseekV41Model
from dsv41_jax.rope import apply_inverse_rope, apply_rope

__all__ = ["EngineConfig", "InferenceEngine", "StepInputs"]

_F32 = jnp.float32
_log = logging.getLogger(__name__)
# The step token budget without an explicit max_num_batched_tokens (vLLM's chunked-prefill default): every
# token bucket up to it is compiled, so the default keeps warm-up bounded whatever max_model_len is.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048


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
    prefill_chunk: int | None = None  # most tokens of one request in one step; default: max_model_len
    # most tokens in one step; default: DEFAULT_MAX_NUM_BATCHED_TOKENS, or a decode step of every request if
    # that is more, or max_reqs * the per-request limit if that is less
    max_num_batched_tokens: int | None = None

    def __post_init__(self):
        for k in ("max_model_len", "max_reqs", "block_size", "comp_block_size"):
            v = getattr(self, k)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"EngineConfig.{k} must be a positive int, got {v!r}")
        for k in ("prefill_chunk", "max_num_batched_tokens"):
            v = getattr(self, k)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
                raise ValueError(f"EngineConfig.{k} must be a positive int or None, got {v!r}")
        need = self.max_reqs * (1 + self.num_speculative_tokens)
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < need:
            raise ValueError(f"EngineConfig.max_num_batched_tokens ({self.max_num_batched_tokens}) must hold a decode "
                             f"step of every request: >= max_reqs * (1 + num_speculative_tokens) = {need}")
        for k in ("kv_format", "comp_kv_format"):
            v = getattr(self, k)
            if v is not None:
                canonical_kv_cache_dtype(v)

    @property
    def limits(self) -> ServingLimits:
        """What the engine serves: a request feeds at most `prefill_chunk` tokens per step (at least
        1 + num_speculative_tokens, at most max_model_len), a step holds at most `max_num_batched_tokens`."""
        chunk = self.max_model_len if self.prefill_chunk is None else self.prefill_chunk
        per_req = min(self.max_model_len, max(chunk, 1 + self.num_speculative_tokens))
        per_step = self.max_num_batched_tokens or min(
            self.max_reqs * per_req,
            max(DEFAULT_MAX_NUM_BATCHED_TOKENS, self.max_reqs * (1 + self.num_speculative_tokens)))
        return ServingLimits(self.max_reqs, self.max_model_len, per_req, per_step)

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
        self.limits = config.limits
        self.envelope: tuple[StepShape, ...] = envelope_shapes(
            config.buckets, self.limits, block_size=config.block_size, comp_block_size=config.comp_block_size,
            ratios=self.ratios)
        self._envelope_set = frozenset(self.envelope)
        self._executables: dict[StepShape, jax.stages.Compiled] = {}
        self.warmup_stats: WarmupStats | None = None
        self.last_step: StepTiming | None = None
        self.last_generate_stats: GenerateStats | None = None

    # ------------------------------------------------------------------ compilation
    @property
    def compiled_shapes(self) -> frozenset[StepShape]:
        """The step shapes compiled so far."""
        return frozenset(self._executables)

    @property
    def is_warm(self) -> bool:
        """Whether every shape of the envelope is compiled."""
        return self._envelope_set <= self._executables.keys()

    def _dummy_inputs(self, shape: StepShape) -> StepInputs:
        """An empty batch padded to `shape`, built like `prepare`'s inputs (same types and placement)."""
        cm = md.make_common_attention_metadata([], [], [], [], buckets=self.ecfg.buckets, num_tokens=shape.tokens,
                                               num_reqs=shape.reqs, num_blocks=shape.blocks)
        cbt = {r: jnp.asarray(np.full((shape.reqs, w), -1, np.int32)) for r, w in shape.comp_blocks}
        return StepInputs(jnp.asarray(np.zeros(shape.tokens, np.int32)), cm, cbt,
                          jnp.asarray(np.zeros(shape.reqs, np.int32)))

    def _compile(self, shape: StepShape) -> jax.stages.Compiled:
        exe = self._fn.lower(self.params, self.caches, self._dummy_inputs(shape), self.tables).compile()
        self._executables[shape] = exe
        return exe

    def warmup(self, *, progress: bool = True) -> WarmupStats:
        """Compile every step shape of the envelope not compiled yet; returns (and keeps in `warmup_stats`)
        the count and seconds. Each shape logs a line on the `dsv41_jax.engine` logger (INFO) and, with
        `progress`, on stderr."""
        todo = [sh for sh in self.envelope if sh not in self._executables]
        t0 = time.perf_counter()
        per = []
        for i, shape in enumerate(todo):
            ts = time.perf_counter()
            self._compile(shape)
            dt = time.perf_counter() - ts
            per.append((shape, dt))
            line = f"warm-up [{i + 1}/{len(todo)}] {shape}: compiled in {dt:.1f} s"
            _log.info(line)
            if progress:
                print(line, file=sys.stderr, flush=True)
        stats = WarmupStats(num_compiled=len(todo), num_shapes=len(self.envelope), seconds=time.perf_counter() - t0,
                            per_shape=tuple(per))
        self.warmup_stats = stats
        return stats

    # ------------------------------------------------------------------ request bookkeeping
    def _check_prompt(self, prompt: Sequence[int], name: str) -> list[int]:
        toks = [int(t) for t in prompt]
        if not toks:
            raise ValueError(f"{name} must have at least one token")
        if any(not 0 <= t < self.model.cfg.vocab_size for t in toks):
            raise ValueError(f"{name} tokens must be in [0, {self.model.cfg.vocab_size})")
        return toks

    def add_request(self, prompt: Sequence[int]) -> int:
        if not self.free_rows:
            raise RuntimeError(f"no free request slot (max_reqs={self.ecfg.max_reqs})")
        toks = self._check_prompt(prompt, "prompt")
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
        inputs and the feeds in the order their tokens are packed. Raises ValueError naming the
        limit (`EngineConfig.prefill_chunk`, `max_num_batched_tokens`, `max_model_len`) a step
        would pass.
        """
        inp, feeds, _ = self._prepare(feeds)
        return inp, feeds

    def _check_limits(self, feeds: Sequence[tuple[int, int]]) -> None:
        lim, ecfg = self.limits, self.ecfg
        for rid, n in feeds:
            req = self.requests[rid]
            start = req["done"]
            if start + n > len(req["tokens"]):
                raise ValueError(f"request {rid} has {len(req['tokens']) - start} unprocessed tokens, asked for {n}")
            if n > lim.max_tokens_per_req:
                raise ValueError(f"request {rid} feeds {n} tokens in one step, more than the engine's "
                                 f"{lim.max_tokens_per_req} per request (EngineConfig.prefill_chunk="
                                 f"{ecfg.prefill_chunk}, num_speculative_tokens={ecfg.num_speculative_tokens}, "
                                 f"max_model_len={ecfg.max_model_len})")
            if start + n > lim.max_model_len:
                raise ValueError(f"sequence length {start + n} exceeds max_model_len {lim.max_model_len}")
        total = sum(n for _, n in feeds)
        if total > lim.max_tokens_per_step:
            raise ValueError(f"a step of {total} tokens exceeds the engine's {lim.max_tokens_per_step} per step "
                             f"(EngineConfig.max_num_batched_tokens={ecfg.max_num_batched_tokens}, "
                             f"max_reqs={ecfg.max_reqs})")

    def _prepare(self, feeds: Sequence[tuple[int, int]]) -> tuple[StepInputs, list[tuple[int, int]], StepShape]:
        feeds = [(rid, n) for rid, n in feeds if n > 0]
        self._check_limits(feeds)
        order = md.reorder_decodes_first([n for _, n in feeds], decode_threshold=self.decode_threshold)
        feeds = [feeds[i] for i in order]
        ecfg = self.ecfg
        bp = ecfg.buckets
        shape = step_shape(bp, num_tokens=sum(n for _, n in feeds), num_reqs=len(feeds),
                           max_seq_len=max([self.requests[rid]["done"] + n for rid, n in feeds] + [0]),
                           block_size=ecfg.block_size, comp_block_size=ecfg.comp_block_size, ratios=self.ratios)
        if shape not in self._envelope_set:
            raise ValueError(f"step shape ({shape}) is outside the engine's envelope of {len(self.envelope)} shapes "
                             f"for its limits {self.limits}")
        qlens, seqs, bts, slots, toks, rows, cbts = [], [], [], [], [], [], {r: [] for r in self.ratios}
        for rid, n in feeds:
            req = self.requests[rid]
            start = req["done"]
            self._ensure_pages(req, start + n)
            pg = req["pages"]["swa"]
            bs = ecfg.block_size
            slots += [pg[p // bs] * bs + p % bs for p in range(start, start + n)]
            toks += req["tokens"][start : start + n]
            qlens.append(n)
            seqs.append(start + n)
            bts.append(pg)
            rows.append(req["row"])
            for r in self.ratios:
                cbts[r].append(req["pages"][r])
        cm = md.make_common_attention_metadata(qlens, seqs, bts, slots, buckets=bp, num_tokens=shape.tokens,
                                               num_reqs=shape.reqs, num_blocks=shape.blocks)
        R, T = shape.reqs, shape.tokens
        cbt_arr = {}
        for r, width in shape.comp_blocks:
            a = np.full((R, width), -1, np.int32)
            for i, b in enumerate(cbts[r]):
                a[i, : len(b)] = b
            cbt_arr[r] = jnp.asarray(a)
        tok = np.zeros(T, np.int32)
        tok[: len(toks)] = toks
        ring_rows = np.zeros(R, np.int32)
        ring_rows[: len(rows)] = rows
        return StepInputs(jnp.asarray(tok), cm, cbt_arr, jnp.asarray(ring_rows)), feeds, shape

    def _run_step(self, feeds: Sequence[tuple[int, int]], kind: str,
                  host_start: float | None = None) -> tuple[dict[int, np.ndarray], StepTiming]:
        """One step and its timing; host time counts from `host_start` (default: now)."""
        t0 = time.perf_counter() if host_start is None else host_start
        inp, feeds, shape = self._prepare(feeds)
        exe = self._executables.get(shape)
        compile_s = 0.0
        if exe is None:
            _log.info("compiling step shape (%s) on demand: warmup() compiles the envelope's %d shapes ahead of time",
                      shape, len(self.envelope))
            tc = time.perf_counter()
            exe = self._compile(shape)
            compile_s = time.perf_counter() - tc
        t1 = time.perf_counter()
        logits, self.caches = exe(self.params, self.caches, inp, self.tables)
        jax.block_until_ready((logits, self.caches))
        t2 = time.perf_counter()
        logits = np.asarray(logits)
        out, off = {}, 0
        for rid, n in feeds:
            out[rid] = logits[off : off + n]
            self.requests[rid]["done"] += n
            off += n
        host_s = (t1 - t0 - compile_s) + (time.perf_counter() - t2)
        timing = StepTiming(kind=kind, num_tokens=off, shape=shape, host_s=host_s, device_s=t2 - t1)
        self.last_step = timing
        return out, timing

    def step(self, feeds: Sequence[tuple[int, int]]) -> dict[int, np.ndarray]:
        """Run one step (see `prepare`). Returns each request's logits float32 `[n, vocab]` for the
        tokens it processed; its timing is in `last_step`. A cold engine compiles the step's shape first."""
        kind = "decode" if all(n <= self.decode_threshold for _, n in feeds) else "prefill"
        return self._run_step(feeds, kind)[0]

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        *,
        prefill_chunk: int | None = None,
        on_step: Callable[[int, int], None] | None = None,
        return_stats: bool = False,
    ) -> list[list[int]] | tuple[list[list[int]], GenerateStats]:
        """Greedy generation: chunked prefill of every prompt, then one token per request per step.

        Prefill steps give each request up to `prefill_chunk` tokens (default and at most the engine's
        `EngineConfig.prefill_chunk`) within the `max_num_batched_tokens` of a step. A cold engine is
        warmed up first (`warmup()`, progress on stderr); the steps themselves run compiled executables
        only. Requests outside the engine's limits (more prompts than free request slots, a prompt plus
        its new tokens longer than `max_model_len`) are a ValueError before any step.
        `on_step(step_index, tokens_this_step)` is called after each decode step (progress bars).
        Returns the generated tokens of each prompt, and with `return_stats` also the `GenerateStats`
        (warm-up, and every step's host and device time), which `last_generate_stats` keeps either way.
        """
        lim = self.limits
        chunk = lim.max_tokens_per_req if prefill_chunk is None else prefill_chunk
        if not isinstance(chunk, int) or isinstance(chunk, bool) or not 0 < chunk <= lim.max_tokens_per_req:
            raise ValueError(f"prefill_chunk must be an int in 1..{lim.max_tokens_per_req} (the engine's per-request "
                             f"limit, EngineConfig.prefill_chunk={self.ecfg.prefill_chunk}), got {prefill_chunk!r}")
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        if len(prompts) > len(self.free_rows):
            raise ValueError(f"{len(prompts)} prompts exceed the {len(self.free_rows)} free request slots "
                             f"(EngineConfig.max_reqs={self.ecfg.max_reqs})")
        for i, p in enumerate(prompts):  # before a warm-up that may take minutes
            n = len(self._check_prompt(p, f"prompt {i}")) + max(max_new_tokens - 1, 0)
            if n > lim.max_model_len:
                raise ValueError(f"prompt {i} ({len(p)} tokens) with {max_new_tokens} new tokens needs {n} positions, "
                                 f"more than max_model_len {lim.max_model_len}")
        warm = None if self.is_warm else self.warmup()
        rids: list[int] = []
        outs: dict[int, list[int]] = {}
        last: dict[int, np.ndarray] = {}
        steps: list[StepTiming] = []
        try:
            for p in prompts:
                rids.append(self.add_request(p))
                outs[rids[-1]] = []
            while True:  # prefill, chunked, within the step's token budget
                t0 = time.perf_counter()
                feeds, budget = [], lim.max_tokens_per_step
                for rid in rids:
                    req = self.requests[rid]
                    take = min(len(req["tokens"]) - req["done"], chunk, budget)
                    if take:
                        feeds.append((rid, take))
                        budget -= take
                if not feeds:
                    break
                res, timing = self._run_step(feeds, "prefill", host_start=t0)
                steps.append(timing)
                for rid, lg in res.items():
                    last[rid] = lg[-1]
            for i in range(max_new_tokens):
                t0 = time.perf_counter()
                for rid in rids:
                    nxt = int(np.argmax(last[rid]))
                    outs[rid].append(nxt)
                    self.requests[rid]["tokens"].append(nxt)
                if i == max_new_tokens - 1:
                    break
                res, timing = self._run_step([(rid, 1) for rid in rids], "decode", host_start=t0)
                steps.append(timing)
                for rid, lg in res.items():
                    last[rid] = lg[-1]
                if on_step is not None:
                    on_step(i, len(rids))
        finally:
            for rid in rids:
                if rid in self.requests:
                    self.finish(rid)
        stats = GenerateStats(warmup=warm, steps=tuple(steps))
        self.last_generate_stats = stats
        tokens = [outs[r] for r in rids]
        return (tokens, stats) if return_stats else tokens
