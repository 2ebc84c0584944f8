"""Sparse MLA across devices with JAX's own sharding: head parallelism and request parallelism.

`sparse_mla_decode_sharded` / `sparse_mla_prefill_sharded` wrap the single-device ops in
`jax.shard_map`, so every implementation (xla, pallas, cuda) runs unchanged on its shard:

- head parallelism (`head_axis`): q, the sink and the outputs are split over query heads; the MQA
  latent caches (SWA and compressed) are replicated, since every head reads the same rows. No
  communication inside the op; the grouped output projection that follows sums over heads.
- request parallelism (`batch_axis`, decode): requests (q rows, indices, lengths) are split over
  the axis and so are the cache pages: each shard owns `num_blocks / n` consecutive pages and its
  indices address its own pages (`block * block_size + offset` with a local block id), i.e. each
  shard builds its metadata against its local block table (`local_block_tables`). Prefill splits
  the query tokens and replicates `kv`.
Both axes may be given together (a 2-D mesh). The metadata builders are pure functions, so they run
inside `shard_map` on per-shard inputs as they do on one device.

Split plans: `make_decode_plan_sharded` makes a step's plan for one shard's call (its heads, its
requests), once, and `sparse_mla_decode_sharded(..., plan=...)` hands each shard its own: with
head parallelism only every shard runs the same plan (replicated); with request parallelism each
shard has its own plan over its requests (the plan's arrays carry a leading axis of the batch shards).
"""

from __future__ import annotations

import dataclasses

import numpy as np

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dsv41_jax.sparse_mla.api import sparse_mla_decode, sparse_mla_prefill
from dsv41_jax.plans import DecodePlan, make_decode_plan

__all__ = ["sparse_mla_decode_sharded", "sparse_mla_prefill_sharded", "make_decode_plan_sharded", "local_block_tables",
           "head_sharding"]


def _axis_size(mesh: Mesh, axis: str | None) -> int:
    if axis is None:
        return 1
    if axis not in mesh.shape:
        raise ValueError(f"axis {axis!r} is not an axis of the mesh (axes: {tuple(mesh.shape)})")
    return mesh.shape[axis]


def _check_div(name: str, n: int, axis: str | None, size: int) -> None:
    if n % size:
        raise ValueError(f"{name} ({n}) must be divisible by the size of mesh axis {axis!r} ({size})")


def head_sharding(mesh: Mesh, head_axis: str, ndim: int, head_dim_index: int) -> NamedSharding:
    """NamedSharding splitting dimension `head_dim_index` of an `ndim`-D array over `head_axis`."""
    spec = [None] * ndim
    spec[head_dim_index] = head_axis
    return NamedSharding(mesh, P(*spec))


def make_decode_plan_sharded(
    topk_length: jax.Array,
    *,
    mesh: Mesh,
    s_q: int,
    num_heads: int,
    topk: int,
    head_axis: str | None = None,
    batch_axis: str | None = None,
    extra_topk_length: jax.Array | None = None,
    extra_topk: int | None = None,
    **kwargs,
) -> DecodePlan:
    """The split plan of a `sparse_mla_decode_sharded` call (same mesh and axes): `make_decode_plan` for one
    shard's call (num_heads: all of q's heads; each shard gets num_heads / the head axis size). With
    `batch_axis` each shard plans its own requests (inside `shard_map`) and the plan's arrays gain a leading
    axis of the batch shards. kwargs: num_sms, batch_invariant, planner."""
    if head_axis is None and batch_axis is None:
        raise ValueError("give head_axis and/or batch_axis")
    nh, nb = _axis_size(mesh, head_axis), _axis_size(mesh, batch_axis)
    _check_div("num_heads", num_heads, head_axis, nh)
    b = topk_length.shape[0]
    _check_div("batch", b, batch_axis, nb)
    pk = dict(s_q=s_q, num_heads=num_heads // nh, topk=topk, extra_topk=extra_topk, **kwargs)
    if batch_axis is None:
        return make_decode_plan(topk_length, extra_topk_length=extra_topk_length, **pk)
    has_el = extra_topk_length is not None

    def body(tl, *el):
        p = make_decode_plan(tl, extra_topk_length=el[0] if has_el else None, **pk)
        return p.tile_scheduler_metadata[None], p.num_splits[None]

    args = (topk_length, extra_topk_length) if has_el else (topk_length,)
    meta, splits = jax.shard_map(body, mesh=mesh, in_specs=(P(batch_axis),) * len(args),
                                 out_specs=(P(batch_axis), P(batch_axis)), check_vma=False)(*args)
    shape = jax.eval_shape(lambda: make_decode_plan(jnp.zeros((b // nb,), jnp.int32), **pk))
    return dataclasses.replace(shape, tile_scheduler_metadata=meta, num_splits=splits)


def sparse_mla_decode_sharded(
    q: jax.Array,
    kv_cache: jax.Array,
    indices: jax.Array,
    topk_length: jax.Array | None = None,
    *,
    mesh: Mesh,
    head_axis: str | None = None,
    batch_axis: str | None = None,
    extra_kv_cache: jax.Array | None = None,
    extra_indices: jax.Array | None = None,
    extra_topk_length: jax.Array | None = None,
    attn_sink: jax.Array | None = None,
    plan: DecodePlan | None = None,
    **kwargs,
) -> tuple[jax.Array, jax.Array]:
    """`sparse_mla_decode` over a mesh; same arguments and results (see the module docstring).

    With `batch_axis`, `kv_cache` / `extra_kv_cache` hold every shard's pages concatenated along
    the block axis and each shard's indices are local to its pages. plan: from
    `make_decode_plan_sharded` with the same mesh and axes (each shard checks it against its call).
    """
    if head_axis is None and batch_axis is None:
        raise ValueError("give head_axis and/or batch_axis")
    nh, nb = _axis_size(mesh, head_axis), _axis_size(mesh, batch_axis)
    b, s_q, h_q, _ = q.shape
    _check_div("q heads", h_q, head_axis, nh)
    _check_div("batch", b, batch_axis, nb)
    _check_div("kv_cache blocks", kv_cache.shape[0], batch_axis, nb)
    if extra_kv_cache is not None:
        _check_div("extra_kv_cache blocks", extra_kv_cache.shape[0], batch_axis, nb)
    if topk_length is None:
        topk_length = jnp.full((b,), indices.shape[2], jnp.int32)
    has_extra = extra_kv_cache is not None
    if has_extra and extra_topk_length is None:
        extra_topk_length = jnp.full((b,), extra_indices.shape[2], jnp.int32)
    cache_spec = P(batch_axis) if batch_axis else P()
    row = P(batch_axis)
    args = [q, kv_cache, indices, topk_length]
    specs = [P(batch_axis, None, head_axis, None), cache_spec, P(batch_axis, None, None), row]
    if attn_sink is not None:
        args.append(attn_sink)
        specs.append(P(head_axis))
    if has_extra:
        args += [extra_kv_cache, extra_indices, extra_topk_length]
        specs += [cache_spec, P(batch_axis, None, None), row]
    if plan is not None:
        if not isinstance(plan, DecodePlan):
            raise TypeError(f"plan must be a dsv41_jax.DecodePlan (make_decode_plan_sharded), got {type(plan).__name__}")
        lead = plan.tile_scheduler_metadata.ndim == 3
        if lead != (batch_axis is not None) or (lead and plan.tile_scheduler_metadata.shape[0] != nb):
            raise ValueError(f"plan: with batch_axis={batch_axis!r} the plan needs a leading axis of {nb} batch shards "
                             f"(make_decode_plan_sharded with the same mesh and axes), got arrays of shape "
                             f"{tuple(plan.tile_scheduler_metadata.shape)}")
        args.append(plan)
        specs.append(jax.tree.map(lambda _: P(batch_axis) if batch_axis else P(), plan))

    def body(*a):
        q, cache, idx, tl, *rest = a
        sink = rest.pop(0) if attn_sink is not None else None
        extra = {}
        if has_extra:
            extra = dict(extra_kv_cache=rest[0], extra_indices=rest[1], extra_topk_length=rest[2])
            rest = rest[3:]
        shard_plan = None
        if plan is not None:
            shard_plan = rest[0]
            if batch_axis is not None:
                shard_plan = jax.tree.map(lambda x: x[0], shard_plan)
        return sparse_mla_decode(q, cache, idx, tl, attn_sink=sink, plan=shard_plan, **extra, **kwargs)

    f = jax.shard_map(body, mesh=mesh, in_specs=tuple(specs),
                      out_specs=(P(batch_axis, None, head_axis, None), P(batch_axis, None, head_axis)),
                      check_vma=False)
    return f(*args)


def sparse_mla_prefill_sharded(
    q: jax.Array,
    kv: jax.Array,
    indices: jax.Array,
    *,
    mesh: Mesh,
    head_axis: str | None = None,
    token_axis: str | None = None,
    attn_sink: jax.Array | None = None,
    topk_length: jax.Array | None = None,
    **kwargs,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`sparse_mla_prefill` over a mesh: heads over `head_axis`, query tokens over `token_axis`,
    `kv` replicated. Same results as the single-device op."""
    if head_axis is None and token_axis is None:
        raise ValueError("give head_axis and/or token_axis")
    nh, nt = _axis_size(mesh, head_axis), _axis_size(mesh, token_axis)
    s_q, h_q, _ = q.shape
    _check_div("q heads", h_q, head_axis, nh)
    _check_div("query tokens", s_q, token_axis, nt)
    if topk_length is None:
        topk_length = jnp.full((s_q,), indices.shape[-1], jnp.int32)
    args = [q, kv, indices, topk_length]
    specs = [P(token_axis, head_axis, None), P(), P(token_axis, *([None] * (indices.ndim - 1))), P(token_axis)]
    if attn_sink is not None:
        args.append(attn_sink)
        specs.append(P(head_axis))

    def body(q, kv, idx, tl, *rest):
        return sparse_mla_prefill(q, kv, idx, topk_length=tl, attn_sink=rest[0] if rest else None, **kwargs)

    f = jax.shard_map(body, mesh=mesh, in_specs=tuple(specs),
                      out_specs=(P(token_axis, head_axis, None), P(token_axis, head_axis), P(token_axis, head_axis)),
                      check_vma=False)
    return f(*args)


def local_block_tables(block_table: np.ndarray, shard_of_request: np.ndarray, blocks_per_shard: int) -> np.ndarray:
    """Host-side: global block ids -> each shard's local ids (`block - shard * blocks_per_shard`).

    Raises ValueError if a request's page lives outside its shard's range (negative ids, i.e.
    unallocated entries, are kept as they are).
    """
    bt = np.asarray(block_table)
    sh = np.asarray(shard_of_request).reshape(-1, 1)
    lo = sh * blocks_per_shard
    local = bt - lo
    bad = (bt >= 0) & ((local < 0) | (local >= blocks_per_shard))
    if bad.any():
        r, c = np.argwhere(bad)[0]
        raise ValueError(f"block_table[{r}, {c}] = {bt[r, c]} is not in shard {int(sh[r, 0])}'s pages "
                         f"[{int(lo[r, 0])}, {int(lo[r, 0]) + blocks_per_shard})")
    return np.where(bt >= 0, local, bt)
