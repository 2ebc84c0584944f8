"""One engine step on the device: its inputs, its metadata and the layers' paged-cache operations.

`run_step(graphdef, params, caches, inputs, tables, engine_config=...)` is the pure function the engine
compiles per step shape: it builds the step's metadata once (`step_context`: token positions, the
decode / prefill split, window indices, compressed slots, split plans) and calls the model
(`DeepseekV41Model.__call__`), whose attention layers use the `StepContext` methods below to write and
read the paged caches and to call the sparse attention ops.

Caches (the pytree the engine donates to each step; layer ids as strings):
- `swa[layer]`: every layer's paged SWA cache in `kv_format` (page `block_size` tokens);
- `comp[layer]`, `ikey[layer]`: each kv-source layer's paged compressed cache in `comp_kv_format` (page
  `comp_block_size` states) and its float32 index keys at the same slots;
- `ring[layer]`: each ratio-2 kv source's per-request float32 ring of the open group's (value, gate) rows,
  so a group split across steps (chunked prefill, decode) pools exactly as in one pass.

Decode tokens (query length <= 1 + num_speculative_tokens) attend through `sparse_mla_decode` over the
SWA and compressed caches; prefill tokens through `sparse_mla_prefill` over a gathered workspace
(compressed entries, then the window) with the combined indices, as vLLM does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from flax import nnx

from dsv41_jax.sparse_mla import api as _ops
from dsv41_jax import kv_cache as kvc
from dsv41_jax import metadata as md
from dsv41_jax import sharding
from dsv41_jax.kv_cache import LATENT_DIM
from dsv41_jax.model.config import DeepseekV4AttentionConfig, LayerRole
from dsv41_jax.model.indexer import index_keys
from dsv41_jax.model.rope_tables import RopeTables
from dsv41_jax.rope import apply_rope

if TYPE_CHECKING:
    from dsv41_jax.model.engine import EngineConfig
    from dsv41_jax.model.nn import DeepseekV41Attention

__all__ = ["StepInputs", "StepContext", "step_context", "run_step", "builds_split_plans", "pool_groups"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepInputs:
    """Device inputs of one step: tokens int32[T], the SWA metadata, one compressed block table
    int32[R, Bc] per compress ratio present, and each request's ring row int32[R]."""

    tokens: jax.Array
    common: md.CommonAttentionMetadata
    comp_block_tables: dict
    ring_rows: jax.Array


def _gather_rows(cache: jax.Array, slots: jax.Array) -> jax.Array:
    """Rows of a float32 `[pages, per_page, d]` cache at slots (0 where slot < 0)."""
    flat = cache.reshape(-1, cache.shape[-1])
    ok = (slots >= 0) & (slots < flat.shape[0])
    return jnp.where(ok[..., None], flat[jnp.clip(slots, 0, flat.shape[0] - 1)], 0.0)


def _scatter_rows(cache: jax.Array, slots: jax.Array, rows: jax.Array) -> jax.Array:
    """`cache` with `rows` written at slots (slot < 0 writes nothing)."""
    flat = cache.reshape(-1, cache.shape[-1])
    idx = jnp.where(slots >= 0, slots, flat.shape[0])  # out of range: dropped
    return flat.at[idx].set(rows.astype(flat.dtype), mode="drop").reshape(cache.shape)


def _with_entry(caches: Mapping[str, Mapping[str, jax.Array]], kind: str, role: LayerRole,
                value: jax.Array) -> dict:
    """`caches` with `caches[kind][layer]` replaced (a new pytree of the same structure)."""
    return {**caches, kind: {**caches[kind], str(role.layer_id): value}}


def pool_groups(attn: "DeepseekV41Attention", rows: jax.Array, ring: jax.Array, ring_rows: jax.Array,
                common: md.CommonAttentionMetadata, tokens: md.TokenPositions, valid: jax.Array, ratio: int,
                capacity: int) -> tuple[jax.Array, jax.Array]:
    """Pooled latents `[T, 512]` of ratio-r groups, and the updated ring.

    A group member earlier in this step comes from `rows`; one from an earlier step from the
    request's ring (`[max_reqs, capacity, 2, 512]`, indexed by position mod capacity). Only each
    request's last r - 1 tokens are written back: they are all a later step can need, and writing no
    more keeps a long prefill from wrapping the ring onto rows it still reads.
    """
    num_tokens = rows.shape[0]
    query_lens = common.query_start_loc[1:] - common.query_start_loc[:-1]
    step_start = common.seq_lens[tokens.req] - query_lens[tokens.req]  # first position of the request in this step
    ring_row = ring_rows[tokens.req]
    flat_ring = ring.reshape(-1, 2 * LATENT_DIM)
    t = jnp.arange(num_tokens)
    members = []
    for j in range(ratio):
        member_pos = tokens.pos - (ratio - 1) + j
        in_step = member_pos >= step_start
        from_step = rows[jnp.clip(t - (tokens.pos - member_pos), 0, num_tokens - 1)]
        ring_slot = jnp.clip(ring_row * capacity + member_pos % capacity, 0, flat_ring.shape[0] - 1)
        from_ring = flat_ring[ring_slot].reshape(num_tokens, 2, LATENT_DIM)
        members.append(jnp.where(in_step[:, None, None], from_step, from_ring))
    latent = attn.compressor.pool(jnp.stack(members, axis=1))
    keep = valid & (tokens.pos >= common.seq_lens[tokens.req] - (ratio - 1))
    slot = jnp.where(keep, ring_row * capacity + tokens.pos % capacity, -1)
    ring = _scatter_rows(flat_ring, slot, rows.reshape(num_tokens, -1)).reshape(ring.shape)
    return latent, ring


def builds_split_plans(engine_config: "EngineConfig") -> bool:
    """Whether a step builds its split plans: the cuda kernels run over them and the xla reference checks them
    (the JAX planner is cheap on a CPU); the pallas kernels do not use them, and on a GPU without the cuda
    planner kernel the JAX planner's loops would cost the step host round trips."""
    from dsv41_jax.plans import resolve_planner

    if engine_config.impl == "pallas":
        return False
    if engine_config.impl == "auto":
        return resolve_planner("auto") == "device" or jax.default_backend() == "cpu"
    return True


@dataclasses.dataclass(frozen=True)
class StepContext:
    """What every layer of one step shares: the step's metadata (built once, traced), the RoPE tables,
    the engine's static settings and the attention ops; its methods are the layers' cache operations.

    Built by `step_context` inside the compiled step; every method is pure (caches in, caches out)."""

    model_config: DeepseekV4AttentionConfig
    engine_config: "EngineConfig"
    common: md.CommonAttentionMetadata
    sparse: md.DeepseekSparseSWAMetadata
    token_positions: md.TokenPositions  # each packed token's request and position
    valid: jax.Array  # bool [T]: a real token (not padding)
    is_decode: jax.Array  # bool [T]: a decode token (they come first)
    comp_block_tables: Mapping[int, jax.Array]  # compress ratio -> int32 [R, Bc]
    comp_slots: Mapping[int, jax.Array]  # compress ratio -> int32 [T]: each token's group's compressed slot
    ring_rows: jax.Array  # int32 [R]: each request's row of the rings
    tables: RopeTables
    decode_op: Callable[..., Any]
    prefill_op: Callable[..., Any]

    @property
    def positions(self) -> jax.Array:
        return self.token_positions.pos

    @property
    def num_tokens(self) -> int:
        return self.token_positions.pos.shape[0]

    def _op_kwargs(self, attn_sink: jax.Array) -> dict:
        ecfg = self.engine_config
        kw = dict(softmax_scale=self.model_config.softmax_scale, attn_sink=attn_sink, impl=ecfg.impl)
        if ecfg.mesh is not None:
            kw.update(mesh=ecfg.mesh, head_axis=ecfg.head_axis)
        return kw

    def write_swa(self, caches: dict, role: LayerRole, kv: jax.Array) -> dict:
        """Write the layer's RoPE'd SWA latents bf16 `[T, 512]` at the step's slot mapping."""
        ecfg = self.engine_config
        swa = kvc.insert(caches["swa"][str(role.layer_id)], kv, self.common.slot_mapping, kv_format=ecfg.kv_format,
                         block_size=ecfg.block_size)
        return _with_entry(caches, "swa", role, swa)

    def write_compressed(self, caches: dict, attn: "DeepseekV41Attention", h: jax.Array,
                         cos_sin: jax.Array) -> dict:
        """A kv-source layer: pool each token's group (through the ring when the group spans steps), write
        the RoPE'd latent to the compressed cache and its index key to the index-key cache."""
        ecfg, role = self.engine_config, attn.role
        ratio, layer = role.compress_ratio, str(role.layer_id)
        rows = attn.compressor.rows(h)  # [T, 2, 512]
        if ratio == 1:
            latent = attn.compressor.pool(rows[:, None])
        else:
            latent, ring = pool_groups(attn, rows, caches["ring"][layer], self.ring_rows, self.common,
                                       self.token_positions, self.valid, ratio, ecfg.ring_capacity)
            caches = _with_entry(caches, "ring", role, ring)
        group_pos = (self.token_positions.pos // ratio) * ratio
        main = apply_rope(latent, group_pos, cos_sin).astype(jnp.bfloat16)
        slots = self.comp_slots[ratio]
        comp = kvc.insert(caches["comp"][layer], main, slots, kv_format=ecfg.comp_format, block_size=ecfg.comp_block_size)
        caches = _with_entry(caches, "comp", role, comp)
        ikey = _scatter_rows(caches["ikey"][layer], slots, index_keys(attn, latent, group_pos, cos_sin))
        return _with_entry(caches, "ikey", role, ikey)

    def num_visible_compressed(self, ratio: int) -> jax.Array:
        """int32 [T]: the compressed entries each token sees, `(pos + 1) // ratio` (0 for padding)."""
        return jnp.where(self.valid, (self.token_positions.pos + 1) // ratio, 0)

    def index_keys(self, caches: dict, role: LayerRole) -> jax.Array:
        """Index keys float32 `[T, max_model_len // r, d_I]` of each token's request, from the layer's kv
        source (0 past the request's pages)."""
        ecfg = self.engine_config
        ratio = role.compress_ratio
        num_groups = ecfg.max_model_len // ratio
        slots = md.paged_slot(self.comp_block_tables[ratio], self.token_positions.req[:, None],
                              jnp.arange(num_groups)[None, :], ecfg.comp_block_size)
        return _gather_rows(caches["ikey"][str(role.kv_source_layer)], slots)

    def attend(self, q: jax.Array, caches: dict, role: LayerRole, topk: jax.Array | None,
               attn_sink: jax.Array) -> jax.Array:
        """Sparse attention of q bf16 `[T, H, 512]`: decode tokens through the decode op over the caches,
        prefill tokens through the prefill op over a gathered workspace; RoPE'd output `[T, H, 512]`."""
        kw = self._op_kwargs(attn_sink)
        decoded = self._decode(q, caches, role, topk, kw)
        prefilled = self._prefill(q, caches, role, topk, kw)
        return jnp.where(self.is_decode[:, None, None], decoded[:, 0], prefilled)

    def _decode(self, q: jax.Array, caches: dict, role: LayerRole, topk: jax.Array | None, kw: dict) -> jax.Array:
        ecfg, ratio = self.engine_config, role.compress_ratio
        extra = dict(kv_format=ecfg.kv_format, block_size=ecfg.block_size)
        if ratio:
            global_idx, global_lens = md.global_topk_indices(
                topk, self.token_positions.req, self.comp_block_tables[ratio], states_per_page=ecfg.comp_block_size,
                is_valid_token=self.is_decode & self.valid)
            extra.update(extra_kv_cache=caches["comp"][str(role.kv_source_layer)], extra_indices=global_idx[:, None],
                         extra_topk_length=global_lens, extra_kv_format=ecfg.comp_format,
                         extra_block_size=ecfg.comp_block_size)
        out, _ = self.decode_op(q[:, None], caches["swa"][str(role.layer_id)], self.sparse.decode_swa_indices,
                                self.sparse.decode_swa_lens, plan=self.sparse.tile_sched.get(role.layer_type),
                                **extra, **kw)
        return out  # [T, 1, H, 512]: one query per token

    def _prefill(self, q: jax.Array, caches: dict, role: LayerRole, topk: jax.Array | None, kw: dict) -> jax.Array:
        """Prefill tokens attend a per-request workspace of `N` compressed entries then the window's
        `num_tokens + W - 1` latents (`M` rows per request), gathered from the caches."""
        ecfg, cm, ratio = self.engine_config, self.common, role.compress_ratio
        window = self.model_config.sliding_window
        num_comp = ecfg.max_model_len // ratio if ratio else 0
        rows_per_req = num_comp + self.num_tokens + window - 1
        gather_lens = self.sparse.prefill_gather_lens
        num_reqs = cm.padded_num_reqs
        comp_slots, swa_slots = md.prefill_workspace_slots(
            cm.seq_lens, gather_lens, cm.block_table, self.comp_block_tables[ratio] if ratio else None,
            req_start=self.sparse.num_decodes, num_chunk_reqs=num_reqs, N=num_comp, M=rows_per_req,
            swa_block_size=ecfg.block_size, compress_ratio=ratio, states_per_page=ecfg.comp_block_size)
        parts = []
        if num_comp:
            parts.append(kvc.gather(caches["comp"][str(role.kv_source_layer)], comp_slots, kv_format=ecfg.comp_format,
                                    block_size=ecfg.comp_block_size))
        parts.append(kvc.gather(caches["swa"][str(role.layer_id)], swa_slots, kv_format=ecfg.kv_format,
                                block_size=ecfg.block_size))
        workspace = jnp.concatenate(parts, axis=1).reshape(num_reqs * rows_per_req, LATENT_DIM)
        local_topk = topk if ratio else jnp.zeros((self.num_tokens, 0), jnp.int32)
        indices, lens = md.combine_topk_swa_indices(
            local_topk, cm.query_start_loc, cm.seq_lens, gather_lens, req_start=self.sparse.num_decodes,
            req_end=cm.num_reqs, window=window, compress_ratio=ratio, N=num_comp, M=rows_per_req)
        out, _, _ = self.prefill_op(q, workspace, indices, topk_length=lens, **kw)
        return out


def step_context(model_config: DeepseekV4AttentionConfig, engine_config: "EngineConfig", inputs: StepInputs,
                 tables: RopeTables) -> StepContext:
    """The step's metadata, built once for all layers: token positions, the sparse-SWA metadata (decode /
    prefill split, window indices, one split plan per layer type for the heads of one shard's call) and
    each compress ratio's slot mapping."""
    cfg, ecfg, cm = model_config, engine_config, inputs.common
    num_tokens = inputs.tokens.shape[0]
    layer_ratios = list(cfg.compress_ratios[: cfg.num_hidden_layers])
    ratios = sorted({r for r in layer_ratios if r})
    shards = ecfg.mesh.shape[ecfg.head_axis] if ecfg.mesh is not None else 1
    heads = cfg.num_attention_heads // shards
    sparse = md.build_sparse_swa_metadata(
        cm, window=cfg.sliding_window, block_size=ecfg.block_size, num_speculative_tokens=ecfg.num_speculative_tokens,
        compress_ratios=layer_ratios, index_topk=cfg.index_topk if ratios else None,
        num_heads=heads if builds_split_plans(ecfg) else None)
    token_positions = md.token_positions(cm.query_start_loc, cm.seq_lens, num_tokens)
    valid = cm.slot_mapping >= 0
    is_decode = jnp.arange(num_tokens) < sparse.num_decode_tokens
    comp_slots = {r: md.compressed_slot_mapping(cm.slot_mapping, cm.query_start_loc, cm.seq_lens,
                                                inputs.comp_block_tables[r], states_per_page=ecfg.comp_block_size,
                                                compress_ratio=r) for r in ratios}
    if ecfg.mesh is None:
        decode_op, prefill_op = _ops.sparse_mla_decode, _ops.sparse_mla_prefill
    else:
        decode_op, prefill_op = sharding.sparse_mla_decode_sharded, sharding.sparse_mla_prefill_sharded
    return StepContext(cfg, ecfg, cm, sparse, token_positions, valid, is_decode, inputs.comp_block_tables, comp_slots,
                       inputs.ring_rows, tables, decode_op, prefill_op)


def run_step(graphdef: nnx.GraphDef, params: nnx.State, caches: dict, inputs: StepInputs, tables: RopeTables, *,
             engine_config: "EngineConfig") -> tuple[jax.Array, dict]:
    """One engine step (pure): logits float32 `[T, vocab]` of the packed tokens and the updated caches."""
    model = nnx.merge(graphdef, params)
    step = step_context(model.cfg, engine_config, inputs, tables)
    return model(inputs.tokens, step, caches)
