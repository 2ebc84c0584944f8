"""Call records and argument checks of the sparse MLA ops.

`make_decode_call` / `make_prefill_call` check an op's arguments at trace time (ValueError / TypeError
naming the argument, the expected and the actual value) and return the frozen `DecodeCall` /
`PrefillCall` every implementation receives, so no implementation checks them again.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dsv41_jax.kv_cache import LATENT_DIM, NOPE_DIM, ROPE_DIM, canonical_kv_format, page_bytes
from dsv41_jax.plans import DecodePlan

__all__ = ["DecodeCall", "PrefillCall", "MegaDecodeCall", "MegaPrefillCall", "make_decode_call", "make_prefill_call",
           "make_mega_decode_call", "make_mega_prefill_call", "check_rope_args", "check_q", "check_array"]


# --------------------------------------------------------------------------- call records
@dataclasses.dataclass(frozen=True)
class DecodeCall:
    """A checked decode call, as every implementation receives it.

    q bf16 [b, s_q, h_q, 512] (512: `LATENT_DIM`); kv_cache in `kv_format`; indices int32 [b, s_q, topk];
    topk_length int32 [b] or None (every request attends topk; `lengths()` fills it); attn_sink f32
    [h_q] or None; extra_* likewise or None (extra_topk_length None: every request attends the extra
    topk); plan: the caller's `DecodePlan` (checked against the call's shapes) or None;
    batch_invariant: no split-KV (the plan's, when one is given).
    """

    q: jax.Array
    kv_cache: jax.Array
    indices: jax.Array
    topk_length: jax.Array | None
    kv_format: str
    block_size: int
    softmax_scale: float
    attn_sink: jax.Array | None
    extra_kv_cache: jax.Array | None
    extra_indices: jax.Array | None
    extra_topk_length: jax.Array | None
    extra_kv_format: str | None
    extra_block_size: int | None
    plan: DecodePlan | None = None
    batch_invariant: bool = False

    @property
    def has_extra(self) -> bool:
        return self.extra_kv_cache is not None

    def lengths(self) -> tuple[jax.Array, jax.Array | None]:
        """(topk_length int32 [b], extra_topk_length int32 [b] or None without an extra cache), filled."""
        b = self.q.shape[0]
        tl = self.topk_length if self.topk_length is not None else jnp.full((b,), self.indices.shape[2], jnp.int32)
        if not self.has_extra:
            return tl, None
        etl = self.extra_topk_length
        return tl, etl if etl is not None else jnp.full((b,), self.extra_indices.shape[2], jnp.int32)


@dataclasses.dataclass(frozen=True)
class PrefillCall:
    """A checked prefill call: q bf16 [s_q, h_q, 512], kv bf16 [s_kv, 512], indices int32
    [s_q, topk], topk_length int32 [s_q] or None (every query attends topk; `lengths()` fills it),
    attn_sink f32 [h_q] or None."""

    q: jax.Array
    kv: jax.Array
    indices: jax.Array
    topk_length: jax.Array | None
    softmax_scale: float
    attn_sink: jax.Array | None

    def lengths(self) -> jax.Array:
        """topk_length int32 [s_q], filled."""
        if self.topk_length is not None:
            return self.topk_length
        return jnp.full((self.q.shape[0],), self.indices.shape[1], jnp.int32)


@dataclasses.dataclass(frozen=True)
class MegaDecodeCall:
    """A checked `sparse_mla_mega_decode` call: `decode` is the sparse decode it runs, over q NOT roped
    (bf16 [T, 1, h_q, 512]: T requests of one query token each); positions int32 [T]; cos_sin_cache f32
    [max_pos, 64] (`dsv41_jax.rope.cos_sin_cache`)."""

    decode: DecodeCall
    positions: jax.Array
    cos_sin_cache: jax.Array


@dataclasses.dataclass(frozen=True)
class MegaPrefillCall:
    """A checked `sparse_mla_mega_prefill` call: `prefill` is the sparse prefill it runs, over q NOT roped (bf16
    [s_q, h_q, 512]); positions int32 [s_q]; cos_sin_cache f32 [max_pos, 64]."""

    prefill: PrefillCall
    positions: jax.Array
    cos_sin_cache: jax.Array


# ------------------------------------------------------------------------------- checking
def _shape(x: Any) -> tuple:
    return tuple(getattr(x, "shape", np.shape(x)))


def check_array(name: str, x: Any, ndim: int, *, dtype=None, kind: str | None = None) -> jax.Array:
    """`x` as an array of `ndim` dims (and `dtype`, or an integer dtype for kind="int"); errors name `name`."""
    if x is None:
        raise ValueError(f"{name} is required")
    if not hasattr(x, "shape"):
        x = np.asarray(x)
    if x.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {_shape(x)}")
    if dtype is not None and x.dtype != dtype:
        raise TypeError(f"{name} must have dtype {jnp.dtype(dtype).name}, got {x.dtype}")
    if kind == "int" and not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name} must have an integer dtype (int32), got {x.dtype}")
    return x


def _check_scale(softmax_scale: Any) -> float:
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float, np.floating, np.integer)):
        raise TypeError(f"softmax_scale must be a Python float (static), got {type(softmax_scale).__name__}")
    s = float(softmax_scale)
    if not math.isfinite(s):
        raise ValueError(f"softmax_scale must be finite, got {s}")
    return s


def _check_sink(attn_sink: Any, h_q: int) -> jax.Array | None:
    if attn_sink is None:
        return None
    s = check_array("attn_sink", attn_sink, 1)
    if s.shape != (h_q,):
        raise ValueError(f"attn_sink must have shape ({h_q},) (one per query head), got {_shape(s)}")
    if not jnp.issubdtype(s.dtype, jnp.floating):
        raise TypeError(f"attn_sink must be float32, got {s.dtype}")
    return jnp.asarray(s, jnp.float32)


def _check_lengths(name: str, x: Any, n: int, what: str) -> jax.Array | None:
    if x is None:
        return None
    x = check_array(name, x, 1, kind="int")
    if x.shape != (n,):
        raise ValueError(f"{name} must have shape ({n},) ({what}), got {_shape(x)}")
    return jnp.asarray(x, jnp.int32)


def _check_cache(name: str, cache: Any, format_arg: str, given_format: Any, block_size: Any,
                 bs_arg: str) -> tuple[str, int]:
    """(canonical kv_format, block_size) of a paged cache checked against them; errors name the arguments."""
    kv_format = canonical_kv_format(given_format, arg=format_arg)
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)):
        raise TypeError(f"{bs_arg} must be a static int, got {type(block_size).__name__} {block_size!r}")
    bs = int(block_size)
    if bs <= 0:
        raise ValueError(f"{bs_arg} must be > 0, got {bs}")
    if not hasattr(cache, "shape"):
        raise TypeError(f"{name} must be an array, got {type(cache).__name__}")
    if kv_format == "bf16":
        if cache.ndim != 3 or cache.shape[1:] != (bs, LATENT_DIM):
            raise ValueError(f"{name} in format 'bf16' must be [num_blocks, {bs}, {LATENT_DIM}], got shape {_shape(cache)}")
        if cache.dtype != jnp.bfloat16:
            raise TypeError(f"{name} in format 'bf16' must be bfloat16, got {cache.dtype}")
    else:
        pb = page_bytes(kv_format, bs)
        if cache.ndim != 2 or cache.shape[1] != pb:
            raise ValueError(
                f"{name} in format {kv_format!r} with {bs_arg}={bs} must be uint8[num_blocks, {pb}], got shape {_shape(cache)}"
            )
        if cache.dtype != jnp.uint8:
            raise TypeError(f"{name} in format {kv_format!r} must be uint8, got {cache.dtype}")
    return kv_format, bs


def check_q(q: Any, ndim: int, layout: str) -> jax.Array:
    """A bf16 query of `ndim` dims whose last is the latent width; `layout` names the expected shape."""
    q = check_array("q", q, ndim)
    if q.dtype != jnp.bfloat16:
        raise TypeError(f"q must be bfloat16, got {q.dtype}")
    if q.shape[-1] != LATENT_DIM:
        raise ValueError(f"q's head dim must be {LATENT_DIM} ({NOPE_DIM} NoPE + {ROPE_DIM} RoPE), got {q.shape[-1]} (shape {_shape(q)}, expected {layout})")
    if q.shape[-2] < 1:
        raise ValueError(f"q must have at least one head, got shape {_shape(q)}")
    return q


def _check_plan(plan: Any, batch_invariant: Any, *, batch: int, s_q: int, topk: int,
                extra_topk: int | None) -> tuple[DecodePlan | None, bool]:
    if batch_invariant is not None and not isinstance(batch_invariant, (bool, np.bool_)):
        raise TypeError(f"batch_invariant must be a bool (static) or None, got {type(batch_invariant).__name__}")
    if plan is None:
        return None, bool(batch_invariant)
    if not isinstance(plan, DecodePlan):
        raise TypeError(f"plan must be a dsv41_jax.DecodePlan (make_decode_plan), got {type(plan).__name__}")
    plan.check_call(batch=batch, s_q=s_q, topk=topk, extra_topk=extra_topk)
    if batch_invariant is not None and bool(batch_invariant) != plan.batch_invariant:
        raise ValueError(f"batch_invariant={bool(batch_invariant)} but the plan was made with "
                         f"batch_invariant={plan.batch_invariant}: make the plan with the same setting")
    return plan, plan.batch_invariant


def make_decode_call(q, kv_cache, indices, topk_length, kv_format, block_size, softmax_scale, attn_sink,
                     extra_kv_cache, extra_indices, extra_topk_length, extra_kv_format, extra_block_size,
                     plan=None, batch_invariant=None) -> DecodeCall:
    """The checked `DecodeCall` of `sparse_mla_decode`'s arguments (in its order, every one given)."""
    q = check_q(q, 4, f"[b, s_q, h_q, {LATENT_DIM}]")
    b, s_q, h_q, _ = q.shape
    main_format, bs = _check_cache("kv_cache", kv_cache, "kv_format", kv_format, block_size, "block_size")
    indices = check_array("indices", indices, 3, kind="int")
    if indices.shape[:2] != (b, s_q):
        raise ValueError(f"indices must be [b, s_q, topk] = [{b}, {s_q}, topk], got {_shape(indices)}")
    topk = indices.shape[2]
    topk_length = _check_lengths("topk_length", topk_length, b, "one per request")
    scale = _check_scale(softmax_scale)
    sink = _check_sink(attn_sink, h_q)
    extras = (extra_kv_cache, extra_indices)
    if any(e is not None for e in extras) and not all(e is not None for e in extras):
        raise ValueError("extra_kv_cache and extra_indices must be given together")
    extra_format = ebs = etl = eidx = None
    if extra_kv_cache is not None:
        extra_format, ebs = _check_cache(
            "extra_kv_cache", extra_kv_cache, "extra_kv_format", main_format if extra_kv_format is None else extra_kv_format,
            bs if extra_block_size is None else extra_block_size, "extra_block_size",
        )
        eidx = check_array("extra_indices", extra_indices, 3, kind="int")
        if eidx.shape[:2] != (b, s_q):
            raise ValueError(f"extra_indices must be [b, s_q, extra_topk] = [{b}, {s_q}, extra_topk], got {_shape(eidx)}")
        etl = _check_lengths("extra_topk_length", extra_topk_length, b, "one per request")
        eidx = jnp.asarray(eidx, jnp.int32)
    elif extra_topk_length is not None or extra_kv_format is not None or extra_block_size is not None:
        raise ValueError("extra_topk_length / extra_kv_format / extra_block_size need extra_kv_cache")
    plan, invariant = _check_plan(plan, batch_invariant, batch=b, s_q=s_q, topk=topk,
                                  extra_topk=None if eidx is None else eidx.shape[2])
    return DecodeCall(q, kv_cache, jnp.asarray(indices, jnp.int32), topk_length, main_format, bs, scale, sink,
                      extra_kv_cache, eidx, etl, extra_format, ebs, plan, invariant)


def make_prefill_call(q, kv, indices, softmax_scale, attn_sink, topk_length) -> PrefillCall:
    """The checked `PrefillCall` of `sparse_mla_prefill`'s arguments; FlashMLA's `[s_kv, 1, 512]` kv and
    `[s_q, 1, topk]` indices are accepted and reshaped."""
    q = check_q(q, 3, f"[s_q, h_q, {LATENT_DIM}]")
    s_q, h_q, _ = q.shape
    kv = check_array("kv", kv, kv.ndim if hasattr(kv, "ndim") and kv.ndim in (2, 3) else 2)
    if kv.ndim == 3:  # FlashMLA's [s_kv, 1, d] layout
        if kv.shape[1] != 1:
            raise ValueError(f"kv must be [s_kv, {LATENT_DIM}] or [s_kv, 1, {LATENT_DIM}] (one latent head), got {_shape(kv)}")
        kv = kv.reshape(kv.shape[0], kv.shape[2])
    if kv.shape[1] != LATENT_DIM:
        raise ValueError(f"kv must be [s_kv, {LATENT_DIM}], got {_shape(kv)}")
    if kv.dtype != jnp.bfloat16:
        raise TypeError(f"kv must be bfloat16, got {kv.dtype}")
    if hasattr(indices, "ndim") and indices.ndim == 3:
        if indices.shape[1] != 1:
            raise ValueError(f"indices must be [s_q, topk] or [s_q, 1, topk], got {_shape(indices)}")
        indices = indices.reshape(indices.shape[0], indices.shape[2])
    indices = check_array("indices", indices, 2, kind="int")
    if indices.shape[0] != s_q:
        raise ValueError(f"indices must be [s_q, topk] with s_q = {s_q}, got {_shape(indices)}")
    topk_length = _check_lengths("topk_length", topk_length, s_q, "one per query token")
    return PrefillCall(q, kv, jnp.asarray(indices, jnp.int32), topk_length, _check_scale(softmax_scale),
                       _check_sink(attn_sink, h_q))


def check_rope_args(positions: Any, cos_sin_cache: Any, n: int) -> tuple[jax.Array, jax.Array]:
    """(positions int32 [n], cos_sin_cache f32 [max_pos, 64]) of the mega ops, checked."""
    pos = check_array("positions", positions, 1, kind="int")
    if pos.shape != (n,):
        raise ValueError(f"positions must have shape ({n},) (one per query token), got {_shape(pos)}")
    cs = check_array("cos_sin_cache", cos_sin_cache, 2)
    if cs.shape[1] != ROPE_DIM:
        raise ValueError(f"cos_sin_cache must be [max_pos, {ROPE_DIM}] ([cos {ROPE_DIM // 2} | sin {ROPE_DIM // 2}]), "
                         f"got {_shape(cs)}")
    return jnp.asarray(pos, jnp.int32), jnp.asarray(cs, jnp.float32)


def make_mega_decode_call(q, positions, cos_sin_cache, kv_cache, indices, topk_length, kv_format, block_size,
                          softmax_scale, attn_sink, extra_kv_cache, extra_indices, extra_topk_length, extra_kv_format,
                          extra_block_size, plan, batch_invariant) -> MegaDecodeCall:
    """`sparse_mla_mega_decode`'s arguments checked (q [T, h_q, 512], indices [T, topk]): the decode call of T
    one-token requests over the unroped q."""
    q = check_q(q, 3, "[T, h_q, 512]")
    pos, cs = check_rope_args(positions, cos_sin_cache, q.shape[0])

    def per_token(x):
        return None if x is None else x.reshape((x.shape[0], 1) + x.shape[1:])

    idx = check_array("indices", indices, 2, kind="int")
    eidx = None if extra_indices is None else check_array("extra_indices", extra_indices, 2, kind="int")
    call = make_decode_call(q[:, None], kv_cache, per_token(idx), topk_length, kv_format, block_size, softmax_scale,
                            attn_sink, extra_kv_cache, per_token(eidx), extra_topk_length, extra_kv_format,
                            extra_block_size, plan, batch_invariant)
    return MegaDecodeCall(call, pos, cs)


def make_mega_prefill_call(q, positions, cos_sin_cache, kv, indices, softmax_scale, attn_sink,
                           topk_length) -> MegaPrefillCall:
    """`sparse_mla_mega_prefill`'s arguments checked: the prefill call over the unroped q, and its RoPE operands."""
    call = make_prefill_call(q, kv, indices, softmax_scale, attn_sink, topk_length)
    pos, cs = check_rope_args(positions, cos_sin_cache, call.q.shape[0])
    return MegaPrefillCall(call, pos, cs)
