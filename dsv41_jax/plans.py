"""Decode split plans as values: made once per step and layer type, consumed by every layer's kernel.

A `DecodePlan` is FlashMLA's tile-scheduler plan (`tile_scheduler_metadata`, `num_splits`; see
`dsv41_jax.scheduler`) together with the static facts it was made for. `make_decode_plan` makes one;
`build_sparse_swa_metadata` makes one per V4.1 layer type. `sparse_mla_decode(..., plan=plan)` (and
the mega and sharded ops) then run the kernels over it without planning: as in vLLM, where every
layer of a type shares the FlashMLA plan of the step.

Static facts (checked at trace time against every call, `ValueError` naming `plan`): batch, s_q,
topk, extra_topk (None: no extra cache), num_sm_parts (with the num_sms / num_heads it came from;
checked by the kernels that split: `impl="cuda"` needs the parts its device and head count give),
batch_invariant. The plan does not depend on page geometry or formats.

Lengths: a plan is made from the call's lengths (clamped to [0, topk] as the kernels clamp them).
Used with other lengths it is *stale*, and the kernels stay in bounds and finite whatever the lengths:
every 64-token block a request has in both the plan and the call is attended once, blocks the plan
has and the call does not are skipped, blocks the call has and the plan does not are dropped (their
tokens are not attended). So a plan made from lengths at least the call's (e.g. `topk` for every
request) gives exact results, only balanced for the longer lengths; FlashMLA silently gives wrong
results on a stale plan. `plan_is_stale` says whether lengths differ from a plan's, as a jittable
check for tests and debugging.

`batch_invariant=True` (FlashMLA's `enable_batch_invariant`): one part per request and no split-KV,
so a request's `out` and `lse` do not depend on what else shares its batch (bitwise). Such a plan
depends only on the shapes, never goes stale, and runs no combine kernel.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dsv41_jax.scheduler import SCHED_META_FIELDS, default_num_sms, num_sm_parts_for, plan_decode_splits

__all__ = ["DecodePlan", "make_decode_plan", "make_plans", "plan_is_stale", "resolve_planner", "PLANNERS",
           "FIXED_OVERHEAD", "BLOCK_TOKENS"]

PLANNERS = ("auto", "device", "jax")
FIXED_OVERHEAD = 5  # FlashMLA's SM90 per-request overhead, in blocks
BLOCK_TOKENS = 64  # tokens per plan block (the kernels' tile)


def _static(field_default=dataclasses.MISSING):
    return dataclasses.field(default=field_default, metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodePlan:
    """A decode split plan and the facts it was made for (see the module docstring).

    tile_scheduler_metadata: int32 `[num_sm_parts, 8]` (fields `dsv41_jax.scheduler.SCHED_META_FIELDS`);
    num_splits: int32 `[batch + 1]`. Unpacks and indexes as the pair FlashMLA returns: `meta, splits = plan`.
    """

    tile_scheduler_metadata: jax.Array
    num_splits: jax.Array
    batch: int = _static()
    s_q: int = _static()
    topk: int = _static()
    extra_topk: int | None = _static()
    num_sm_parts: int = _static()
    num_sms: int | None = _static()  # None (and num_heads None): made for an explicit part count
    num_heads: int | None = _static()
    batch_invariant: bool = _static(False)

    def __iter__(self):
        return iter((self.tile_scheduler_metadata, self.num_splits))

    def __getitem__(self, i):
        return (self.tile_scheduler_metadata, self.num_splits)[i]

    def __len__(self) -> int:
        return 2

    @property
    def has_extra(self) -> bool:
        return self.extra_topk is not None

    def check_call(self, *, batch: int, s_q: int, topk: int, extra_topk: int | None) -> None:
        """Raise ValueError naming `plan` when the plan was made for another call shape."""
        want = dict(batch=batch, s_q=s_q, topk=topk, extra_topk=extra_topk)
        have = dict(batch=self.batch, s_q=self.s_q, topk=self.topk, extra_topk=self.extra_topk)
        bad = [k for k in want if want[k] != have[k]]
        if bad:
            what = "; ".join(f"{k}: plan {have[k]!r}, call {want[k]!r}" for k in bad)
            hint = " (extra_topk None: no extra cache)" if "extra_topk" in bad else ""
            raise ValueError(f"plan does not fit this call: {what}{hint}; make the plan for this call's shapes "
                             f"(dsv41_jax.make_decode_plan)")

    def check_parts(self, num_sm_parts: int, *, impl: str, num_sms: int, num_heads: int) -> None:
        """Raise ValueError naming `plan` when `impl` on this device needs another number of SM parts."""
        want = self.batch if self.batch_invariant else num_sm_parts
        if self.num_sm_parts != want:
            made = ("an explicit part count" if self.num_sms is None else
                    f"num_sms={self.num_sms}, s_q={self.s_q}, num_heads={self.num_heads}")
            raise ValueError(
                f"plan has {self.num_sm_parts} SM parts (made for {made}); impl={impl!r} on this device "
                f"({num_sms} SMs) with h_q={num_heads} needs {want}: make the plan with num_sms={num_sms}, "
                f"num_heads={num_heads}")


def _lengths(name: str, x: Any, b: int | None) -> jax.Array:
    if not hasattr(x, "shape"):
        x = np.asarray(x)
    if x.ndim != 1 or (b is not None and x.shape[0] != b):
        raise ValueError(f"{name} must be int32 [b]{'' if b is None else f' with b = {b}'}, got shape {tuple(x.shape)}")
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name} must be int32, got {x.dtype}")
    return jnp.asarray(x, jnp.int32)


def _static_int(name: str, v: Any, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{name} must be a static int, got {type(v).__name__} {v!r}")
    if v < lo:
        raise ValueError(f"{name} must be >= {lo}, got {v}")
    return int(v)


def _invariant_arrays(b: int, topk: int, extra_topk: int | None) -> tuple[jax.Array, jax.Array]:
    """One part per request covering every block a request of these shapes can have (the kernels stop at
    the request's own blocks), no split: a constant of the shapes."""
    t = max(topk, 1)
    most = -(-t // BLOCK_TOKENS) * BLOCK_TOKENS + extra_topk if extra_topk is not None else t
    nblk = max(-(-most // BLOCK_TOKENS), 1)
    meta = np.zeros((b, len(SCHED_META_FIELDS)), np.int32)
    meta[:, 0] = meta[:, 1] = np.arange(b)
    meta[:, 3] = nblk
    return jnp.asarray(meta), jnp.arange(b + 1, dtype=jnp.int32)


def resolve_planner(planner: str) -> str:
    """What "auto" means here: "device" where the cuda planner kernel can run, else "jax"."""
    if planner not in PLANNERS:
        raise ValueError(f"planner must be one of {PLANNERS}, got {planner!r}")
    if planner != "auto":
        return planner
    try:
        import cuda_ffi
    except Exception:  # noqa: BLE001 - no CUDA package: the JAX planner
        return "jax"
    return "device" if cuda_ffi.backend_unavailable_reason() is None else "jax"


def make_plans(
    topk_length: jax.Array,
    extras: dict[str, tuple[jax.Array | None, int] | None],
    *,
    s_q: int,
    num_heads: int | None,
    topk: int,
    num_sms: int | None = None,
    batch_invariant: bool = False,
    planner: str = "auto",
    num_sm_parts: int | None = None,
) -> dict[str, DecodePlan]:
    """Several plans over the same requests (e.g. a step's layer types): `extras[name]` is None (no extra
    cache) or `(extra_topk_length int32 [b] or None, extra_topk)`. With the device planner all of them
    come from one kernel launch. num_sm_parts: an explicit part count instead of the device's (the JAX
    planner; the plans record num_sms = num_heads = None, and num_heads may be None)."""
    tl = _lengths("topk_length", topk_length, None)
    b = int(tl.shape[0])
    topk = _static_int("topk", topk, 0)
    s_q = _static_int("s_q", s_q, 1)
    if num_sm_parts is not None:
        parts, num_sms, num_heads, planner = _static_int("num_sm_parts", num_sm_parts, 1), None, None, "jax"
    else:
        num_heads = _static_int("num_heads", num_heads, 1)
        num_sms = default_num_sms() if num_sms is None else _static_int("num_sms", num_sms, 1)
        parts = num_sm_parts_for("cuda", num_sms=num_sms, s_q=s_q, h_q=num_heads)
    if batch_invariant:
        parts = b
    if b < 1:
        raise ValueError(f"topk_length must have at least one request, got shape {tuple(tl.shape)}")
    norm: dict[str, tuple[jax.Array | None, int | None]] = {}
    for name, ex in extras.items():
        if ex is None:
            norm[name] = (None, None)
            continue
        el, et = ex
        et = _static_int("extra_topk", et, 0)
        norm[name] = (None if el is None else _lengths("extra_topk_length", el, b), et)

    def plan(meta, splits, et):
        return DecodePlan(meta, splits, batch=b, s_q=s_q, topk=topk, extra_topk=et, num_sm_parts=parts,
                          num_sms=num_sms, num_heads=num_heads, batch_invariant=batch_invariant)

    if batch_invariant:
        return {n: plan(*_invariant_arrays(b, topk, et), et) for n, (_, et) in norm.items()}
    how = resolve_planner(planner)
    if how == "device":
        from cuda_ffi import ops as _ops

        names = list(norm)
        meta, splits = _ops.plan_on_device(tl, [norm[n] for n in names], topk=topk, num_sm_parts=parts,
                                           fixed_overhead=FIXED_OVERHEAD)
        return {n: plan(meta[i], splits[i], norm[n][1]) for i, n in enumerate(names)}
    out = {}
    clamped = jnp.clip(tl, 0, topk)
    for n, (el, et) in norm.items():
        if et is not None:
            el = jnp.full((b,), et, jnp.int32) if el is None else jnp.clip(el, 0, et)
        m, s = plan_decode_splits(clamped, topk=topk, num_sm_parts=parts, extra_topk_length=el, extra_topk=et,
                                  fixed_overhead=FIXED_OVERHEAD, block_tokens=BLOCK_TOKENS)
        out[n] = plan(m, s, et)
    return out


def make_decode_plan(
    topk_length: jax.Array,
    *,
    s_q: int,
    num_heads: int,
    topk: int,
    extra_topk_length: jax.Array | None = None,
    extra_topk: int | None = None,
    num_sms: int | None = None,
    batch_invariant: bool = False,
    planner: str = "auto",
) -> DecodePlan:
    """The split plan of a `sparse_mla_decode` call: pure, jittable, no host sync.

    topk_length: int32 `[b]`, the lengths the call will pass (clamped to [0, topk]); s_q, num_heads
    (the call's h_q), topk (`indices.shape[-1]`): static. With an extra cache, extra_topk
    (`extra_indices.shape[-1]`) and optionally extra_topk_length int32 `[b]` (default: extra_topk for
    every request). num_sms: the SM count of the device the plan is for (default: the default
    device's, or 132). planner: "device" (the CUDA planner kernel, one warp; needs the cuda library on
    a GPU), "jax" (`plan_decode_splits` in XLA), or "auto" (device where it can run). Both planners
    give bit-identical plans: FlashMLA's `plan_decode_splits` over `num_sm_parts_for("cuda", ...)` parts.
    batch_invariant: see the module docstring.
    """
    if extra_topk is None and extra_topk_length is not None:
        raise ValueError("extra_topk_length needs extra_topk (the extra cache's indices.shape[-1])")
    extras = {"plan": None if extra_topk is None else (extra_topk_length, extra_topk)}
    return make_plans(topk_length, extras, s_q=s_q, num_heads=num_heads, topk=topk, num_sms=num_sms,
                      batch_invariant=batch_invariant, planner=planner)["plan"]


def plan_is_stale(plan: DecodePlan, topk_length: jax.Array, extra_topk_length: jax.Array | None = None) -> jax.Array:
    """bool scalar: whether these lengths give another plan than `plan` (jittable; it plans again with
    the JAX planner, so it costs a planner run: for tests and debugging, not for every call).
    Batch-invariant plans never go stale."""
    if plan.batch_invariant:
        return jnp.zeros((), bool)
    tl = _lengths("topk_length", topk_length, plan.batch)
    extra = None
    if plan.has_extra:
        extra = (None if extra_topk_length is None else _lengths("extra_topk_length", extra_topk_length, plan.batch),
                 plan.extra_topk)
    fresh = make_plans(tl, {"p": extra}, s_q=plan.s_q, num_heads=plan.num_heads, topk=plan.topk,
                       num_sms=plan.num_sms, planner="jax")["p"]
    if fresh.num_sm_parts != plan.num_sm_parts:
        return jnp.ones((), bool)
    return jnp.any(fresh.tile_scheduler_metadata != plan.tile_scheduler_metadata) | jnp.any(
        fresh.num_splits != plan.num_splits)
