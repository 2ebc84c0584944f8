"""Public sparse MLA ops: argument checking, and dispatch to an implementation.

`sparse_mla_decode` attends each query token of a request over selected slots of a paged KV
cache (plus an optional extra cache, e.g. the compressed one); `sparse_mla_prefill` attends over
rows of a plain bf16 `kv`; `sparse_mla_mega_decode` / `sparse_mla_mega_prefill` are the fused
mega-attention contract (RoPE'd inside, inverse-RoPE'd and fp8-quantised output). Numerics are
FlashMLA's (see `dsv41_jax.reference`). Every check runs at trace time and raises
ValueError / TypeError naming the argument, the expected and the actual value.

Implementations: "xla" (reference, any device), "pallas" and "cuda" (registered by
`pallas_kernels` / `cuda_ffi` when importable). `impl="auto"` tries them in `AUTO_ORDER`: a
kernel runs when `select_backend` finds one of its backends for the default device and the call's
format and page size (its implementation available here) and its `supports` predicate accepts the
call; else "xla" runs. `explain_impl` returns that decision with every candidate's reasons, and
`auto` decides through the same function, so the two never disagree. On an accelerator, a call
that lands on the reference logs a WARNING on the `dsv41_jax` logger naming why each kernel
declined, once per distinct set of reasons; on a CPU the reference is the expected choice and
nothing is logged.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dsv41_jax import kv_cache as kvc
from dsv41_jax.backends import (
    BackendSelectionError,
    DeviceInfo,
    _impl_unavailable_reason,
    canonical_kv_cache_dtype,
    registered_backends,
    select_backend,
)
from dsv41_jax.plans import DecodePlan
from dsv41_jax.reference import Pool, sparse_attention_rows

__all__ = [
    "DecodeCall",
    "PrefillCall",
    "ImplCandidate",
    "ImplChoice",
    "AUTO_ORDER",
    "explain_impl",
    "sparse_mla_decode",
    "sparse_mla_prefill",
    "sparse_mla_mega_decode",
    "sparse_mla_mega_prefill",
    "register_decode_impl",
    "register_prefill_impl",
    "decode_impls",
    "prefill_impls",
    "quantize_output_fp8",
]

HEAD_DIM = 512
_INT32_MIN = -(2**31)
AUTO_ORDER = ("cuda", "pallas", "xla")  # the order impl="auto" tries the implementations in
_MODULES = {"cuda": "cuda_ffi", "pallas": "pallas_kernels"}  # the packages that register the fast paths
_log = logging.getLogger("dsv41_jax")


# --------------------------------------------------------------------------- call records
@dataclasses.dataclass(frozen=True)
class DecodeCall:
    """A checked decode call, as every implementation receives it.

    q bf16 [b, s_q, h_q, 512]; kv_cache in `kv_format`; indices int32 [b, s_q, topk];
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
class _Impl:
    fn: Callable[[Any], tuple]
    supports: Callable[[Any], str | None]  # None: supported, else why not


_DECODE: dict[str, _Impl] = {}
_PREFILL: dict[str, _Impl] = {}


def register_decode_impl(name: str, fn: Callable[[DecodeCall], tuple], supports: Callable[[DecodeCall], str | None] | None = None) -> None:
    """Register `fn(call) -> (out, lse)` as decode implementation `name`."""
    _DECODE[name] = _Impl(fn, supports or (lambda c: None))


def register_prefill_impl(name: str, fn: Callable[[PrefillCall], tuple], supports: Callable[[PrefillCall], str | None] | None = None) -> None:
    """Register `fn(call) -> (out, max_logits, lse)` as prefill implementation `name`."""
    _PREFILL[name] = _Impl(fn, supports or (lambda c: None))


_IMPORT_ERRORS: dict[str, str] = {}


def _load_optional_impls() -> None:
    # The fast paths register themselves on import; a missing or broken one is left out, and
    # `impl=` names it with the reason.
    for mod in _MODULES.values():
        if mod in _IMPORT_ERRORS:
            continue
        try:
            __import__(mod)
        except Exception as e:  # noqa: BLE001 - any failure just means the fast path is absent
            _IMPORT_ERRORS[mod] = f"{type(e).__name__}: {e}"


def decode_impls() -> tuple[str, ...]:
    _load_optional_impls()
    return tuple(_DECODE)


def prefill_impls() -> tuple[str, ...]:
    _load_optional_impls()
    return tuple(_PREFILL)


# ------------------------------------------------------------------------------- checking
def _shape(x: Any) -> tuple:
    return tuple(getattr(x, "shape", np.shape(x)))


def _dtype(x: Any):
    return getattr(x, "dtype", np.asarray(x).dtype)


def _check_array(name: str, x: Any, ndim: int, *, dtype=None, kind: str | None = None) -> jax.Array:
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
    s = _check_array("attn_sink", attn_sink, 1)
    if s.shape != (h_q,):
        raise ValueError(f"attn_sink must have shape ({h_q},) (one per query head), got {_shape(s)}")
    if not jnp.issubdtype(s.dtype, jnp.floating):
        raise TypeError(f"attn_sink must be float32, got {s.dtype}")
    return jnp.asarray(s, jnp.float32)


def _check_lengths(name: str, x: Any, n: int, what: str) -> jax.Array | None:
    if x is None:
        return None
    x = _check_array(name, x, 1, kind="int")
    if x.shape != (n,):
        raise ValueError(f"{name} must have shape ({n},) ({what}), got {_shape(x)}")
    return jnp.asarray(x, jnp.int32)


def _check_cache(name: str, cache: Any, fmt_name: str, fmt_arg: Any, block_size: Any, bs_arg: str) -> tuple[str, int]:
    if not isinstance(fmt_arg, str):
        raise TypeError(f"{fmt_name} must be a str, got {type(fmt_arg).__name__}")
    try:
        fmt = canonical_kv_cache_dtype(fmt_arg)
    except ValueError as e:
        raise ValueError(f"{fmt_name}: {e}") from None
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)):
        raise TypeError(f"{bs_arg} must be a static int, got {type(block_size).__name__} {block_size!r}")
    bs = int(block_size)
    if bs <= 0:
        raise ValueError(f"{bs_arg} must be > 0, got {bs}")
    if not hasattr(cache, "shape"):
        raise TypeError(f"{name} must be an array, got {type(cache).__name__}")
    if fmt == "bf16":
        if cache.ndim != 3 or cache.shape[1:] != (bs, HEAD_DIM):
            raise ValueError(f"{name} in format 'bf16' must be [num_blocks, {bs}, {HEAD_DIM}], got shape {_shape(cache)}")
        if cache.dtype != jnp.bfloat16:
            raise TypeError(f"{name} in format 'bf16' must be bfloat16, got {cache.dtype}")
    else:
        pb = kvc.page_bytes(fmt, bs)
        if cache.ndim != 2 or cache.shape[1] != pb:
            raise ValueError(
                f"{name} in format {fmt!r} with {bs_arg}={bs} must be uint8[num_blocks, {pb}], got shape {_shape(cache)}"
            )
        if cache.dtype != jnp.uint8:
            raise TypeError(f"{name} in format {fmt!r} must be uint8, got {cache.dtype}")
    return fmt, bs


def _check_q(q: Any, ndim: int, layout: str) -> jax.Array:
    q = _check_array("q", q, ndim)
    if q.dtype != jnp.bfloat16:
        raise TypeError(f"q must be bfloat16, got {q.dtype}")
    if q.shape[-1] != HEAD_DIM:
        raise ValueError(f"q's head dim must be {HEAD_DIM} (448 NoPE + 64 RoPE), got {q.shape[-1]} (shape {_shape(q)}, expected {layout})")
    if q.shape[-2] < 1:
        raise ValueError(f"q must have at least one head, got shape {_shape(q)}")
    return q


def _check_impl(impl: Any) -> str:
    if not isinstance(impl, str):
        raise TypeError(f"impl must be a str, got {type(impl).__name__}")
    if impl != "auto" and impl not in AUTO_ORDER:
        raise ValueError(f"impl must be one of {', '.join(repr(n) for n in ('auto', *AUTO_ORDER))}, got {impl!r}")
    return impl


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


def _make_decode_call(q, kv_cache, indices, topk_length, kv_format, block_size, softmax_scale, attn_sink,
                      extra_kv_cache, extra_indices, extra_topk_length, extra_kv_format, extra_block_size,
                      plan=None, batch_invariant=None) -> DecodeCall:
    q = _check_q(q, 4, "[b, s_q, h_q, 512]")
    b, s_q, h_q, _ = q.shape
    fmt, bs = _check_cache("kv_cache", kv_cache, "kv_format", kv_format, block_size, "block_size")
    indices = _check_array("indices", indices, 3, kind="int")
    if indices.shape[:2] != (b, s_q):
        raise ValueError(f"indices must be [b, s_q, topk] = [{b}, {s_q}, topk], got {_shape(indices)}")
    topk = indices.shape[2]
    topk_length = _check_lengths("topk_length", topk_length, b, "one per request")
    scale = _check_scale(softmax_scale)
    sink = _check_sink(attn_sink, h_q)
    extras = (extra_kv_cache, extra_indices)
    if any(e is not None for e in extras) and not all(e is not None for e in extras):
        raise ValueError("extra_kv_cache and extra_indices must be given together")
    efmt = ebs = etl = eidx = None
    if extra_kv_cache is not None:
        efmt, ebs = _check_cache(
            "extra_kv_cache", extra_kv_cache, "extra_kv_format", fmt if extra_kv_format is None else extra_kv_format,
            bs if extra_block_size is None else extra_block_size, "extra_block_size",
        )
        eidx = _check_array("extra_indices", extra_indices, 3, kind="int")
        if eidx.shape[:2] != (b, s_q):
            raise ValueError(f"extra_indices must be [b, s_q, extra_topk] = [{b}, {s_q}, extra_topk], got {_shape(eidx)}")
        etl = _check_lengths("extra_topk_length", extra_topk_length, b, "one per request")
        eidx = jnp.asarray(eidx, jnp.int32)
    elif extra_topk_length is not None or extra_kv_format is not None or extra_block_size is not None:
        raise ValueError("extra_topk_length / extra_kv_format / extra_block_size need extra_kv_cache")
    plan, invariant = _check_plan(plan, batch_invariant, batch=b, s_q=s_q, topk=topk,
                                  extra_topk=None if eidx is None else eidx.shape[2])
    return DecodeCall(q, kv_cache, jnp.asarray(indices, jnp.int32), topk_length, fmt, bs, scale, sink,
                      extra_kv_cache, eidx, etl, efmt, ebs, plan, invariant)


def _make_prefill_call(q, kv, indices, softmax_scale, attn_sink, topk_length) -> PrefillCall:
    q = _check_q(q, 3, "[s_q, h_q, 512]")
    s_q, h_q, _ = q.shape
    kv = _check_array("kv", kv, kv.ndim if hasattr(kv, "ndim") and kv.ndim in (2, 3) else 2)
    if kv.ndim == 3:  # FlashMLA's [s_kv, 1, d] layout
        if kv.shape[1] != 1:
            raise ValueError(f"kv must be [s_kv, 512] or [s_kv, 1, 512] (one latent head), got {_shape(kv)}")
        kv = kv.reshape(kv.shape[0], kv.shape[2])
    if kv.shape[1] != HEAD_DIM:
        raise ValueError(f"kv must be [s_kv, {HEAD_DIM}], got {_shape(kv)}")
    if kv.dtype != jnp.bfloat16:
        raise TypeError(f"kv must be bfloat16, got {kv.dtype}")
    if hasattr(indices, "ndim") and indices.ndim == 3:
        if indices.shape[1] != 1:
            raise ValueError(f"indices must be [s_q, topk] or [s_q, 1, topk], got {_shape(indices)}")
        indices = indices.reshape(indices.shape[0], indices.shape[2])
    indices = _check_array("indices", indices, 2, kind="int")
    if indices.shape[0] != s_q:
        raise ValueError(f"indices must be [s_q, topk] with s_q = {s_q}, got {_shape(indices)}")
    topk_length = _check_lengths("topk_length", topk_length, s_q, "one per query token")
    return PrefillCall(q, kv, jnp.asarray(indices, jnp.int32), topk_length, _check_scale(softmax_scale),
                       _check_sink(attn_sink, h_q))


# ------------------------------------------------------------------------ the xla reference
def _gather_fn(cache, fmt: str, block_size: int):
    return lambda slots: kvc.gather(cache, slots, fmt=fmt, block_size=block_size)


def _decode_xla(c: DecodeCall) -> tuple[jax.Array, jax.Array]:
    out, lse = _decode_xla_f32(c)
    return out.astype(jnp.bfloat16), lse


def _decode_xla_f32(c: DecodeCall) -> tuple[jax.Array, jax.Array]:
    b, s_q, h_q, d = c.q.shape
    rows = b * s_q

    def pool(cache, fmt, bs, idx, lens):
        k = idx.shape[2]
        return Pool(_gather_fn(cache, fmt, bs), idx.reshape(rows, k), jnp.repeat(lens, s_q),
                    kvc.cache_capacity(cache, fmt, bs))

    tl, etl = c.lengths()
    pools = [pool(c.kv_cache, c.kv_format, c.block_size, c.indices, tl)]
    if c.has_extra:
        pools.append(pool(c.extra_kv_cache, c.extra_kv_format, c.extra_block_size, c.extra_indices, etl))
    out, _, lse = sparse_attention_rows(c.q.reshape(rows, h_q, d), pools, softmax_scale=c.softmax_scale,
                                        attn_sink=c.attn_sink)
    return out.reshape(b, s_q, h_q, d), lse.reshape(b, s_q, h_q)


def _prefill_xla(c: PrefillCall) -> tuple[jax.Array, jax.Array, jax.Array]:
    out, max_logits, lse = _prefill_xla_f32(c)
    return out.astype(jnp.bfloat16), max_logits, lse


def _prefill_xla_f32(c: PrefillCall) -> tuple[jax.Array, jax.Array, jax.Array]:
    kv = c.kv

    def gather(slots):
        return jnp.where((slots >= 0)[..., None], kv[jnp.clip(slots, 0, kv.shape[0] - 1)], 0)

    pool = Pool(gather, c.indices, c.lengths(), kv.shape[0])
    return sparse_attention_rows(c.q, [pool], softmax_scale=c.softmax_scale, attn_sink=c.attn_sink)


register_decode_impl("xla", _decode_xla)
register_prefill_impl("xla", _prefill_xla)


# ------------------------------------------------------------------------------- dispatch
@dataclasses.dataclass(frozen=True)
class ImplCandidate:
    """One implementation as `impl="auto"` weighed it: accepted, or the reasons it declined."""

    impl: str
    accepted: bool
    reason: str


@dataclasses.dataclass(frozen=True)
class ImplChoice:
    """What `impl="auto"` runs for one call and why (`explain_impl`).

    op: "sparse_mla_decode" or "sparse_mla_prefill"; device: the default device the choice was made
    for; impl: the implementation that runs (the first accepted candidate); candidates: every
    implementation in `AUTO_ORDER`, each with `select_backend`'s rejections of its backends and its
    kernel's `supports` answer (candidates after the chosen one are weighed too)."""

    op: str
    device: DeviceInfo
    impl: str
    candidates: tuple[ImplCandidate, ...]

    def declined(self) -> tuple[ImplCandidate, ...]:
        return tuple(c for c in self.candidates if not c.accepted)

    def __str__(self) -> str:
        cc = "" if self.device.compute_capability is None else " %d.%d" % self.device.compute_capability
        lines = [f"{self.op}(impl='auto') on {self.device.platform}{cc} runs {self.impl!r}:"]
        lines += [f"  {c.impl:<7}{'accepted' if c.accepted else 'declined'}: {c.reason}" for c in self.candidates]
        return "\n".join(lines)


def _table(call: DecodeCall | PrefillCall) -> dict[str, _Impl]:
    return _DECODE if isinstance(call, DecodeCall) else _PREFILL


def _weigh(name: str, call: DecodeCall | PrefillCall, device: DeviceInfo) -> ImplCandidate:
    """One candidate: a backend of it must serve the device and the call's format and page size (the
    registry; its availability probe may build the library on first use) and its kernel must accept the
    call (its `supports`)."""
    if name == "xla":
        return ImplCandidate("xla", True, "the reference: any device, every format and page size")
    reasons: list[str] = []
    served = None
    # decode asks for its cache's format and page size; prefill reads plain bf16 rows
    fmt, bs = (call.kv_format, call.block_size) if isinstance(call, DecodeCall) else ("auto", None)
    try:
        served = select_backend(device, impls=(name,), kv_cache_dtype=fmt, block_size=bs)
    except BackendSelectionError as e:
        # one entry per distinct list of reasons, naming the backends (of this implementation) it rejects
        groups: dict[tuple[str, ...], list[str]] = {}
        for spec in registered_backends():
            if spec.impl == name and "sparse" in spec.interfaces and spec.name in e.reasons:
                groups.setdefault(tuple(e.reasons[spec.name]), []).append(spec.name)
        reasons += [f"{', '.join(names)}: {'; '.join(rs)}" for rs, names in groups.items()]
    impl = _table(call).get(name)  # looked up after the probe, which registers a library it has just built
    if impl is None:
        mod = _MODULES.get(name)
        why = (f"import {mod} failed: {_IMPORT_ERRORS[mod]}" if mod in _IMPORT_ERRORS
               else _impl_unavailable_reason(name) or f"implementation {name!r} is not registered")
        if not any(why in r for r in reasons):
            reasons.append(why)
    else:
        why = impl.supports(call)
        if why is not None:
            reasons.append(why)
    if reasons:
        return ImplCandidate(name, False, " | ".join(reasons))
    return ImplCandidate(name, True, f"{served.name} serves the device and the cache format, and the kernel "
                                     f"accepts the call")


def _auto_choice(call: DecodeCall | PrefillCall) -> ImplChoice:
    """The decision of impl="auto" (what `explain_impl` returns and the ops run)."""
    _load_optional_impls()
    op = "sparse_mla_decode" if isinstance(call, DecodeCall) else "sparse_mla_prefill"
    device = DeviceInfo.default()
    cands = tuple(_weigh(name, call, device) for name in AUTO_ORDER)
    return ImplChoice(op, device, next(c.impl for c in cands if c.accepted), cands)


# The reason sets already warned about, per process: a serving loop traces many shapes and would
# otherwise repeat one warning per trace; a new cause (another format, a larger cache) warns again.
_WARNED: set[tuple] = set()


def _warn_if_reference(choice: ImplChoice) -> None:
    """On an accelerator the reference is 16-25x slower than the kernels (README): say why it runs."""
    if choice.impl != "xla" or choice.device.platform == "cpu":
        return
    key = (choice.op, tuple((c.impl, c.reason) for c in choice.declined()))
    if key in _WARNED:
        return
    _WARNED.add(key)
    _log.warning("%s(impl='auto') runs the xla reference on %s, far slower than the kernels: %s. "
                 "`dsv41_jax.explain_impl` explains a call, `python -m dsv41_jax.info` this install.",
                 choice.op, choice.device.platform, "; ".join(f"{c.impl} declined: {c.reason}" for c in choice.declined()))


def _choose(impl: str, call: DecodeCall | PrefillCall) -> _Impl:
    if impl == "auto":
        choice = _auto_choice(call)
        _warn_if_reference(choice)
        return _table(call)[choice.impl]
    _load_optional_impls()
    probe = None if impl in _table(call) else _impl_unavailable_reason(impl)  # may build the library on first use
    table = _table(call)
    if impl not in table:
        why = {k: v for k, v in _IMPORT_ERRORS.items() if v}
        raise ValueError(f"impl={impl!r} is not available here (available: {sorted(table)}"
                         + (f"; import errors: {why}" if why else "") + (f"; {probe}" if probe else "")
                         + "); build or install it, or use impl='auto'")
    why = table[impl].supports(call)
    if why is not None:
        raise ValueError(f"impl={impl!r} does not support this call: {why}")
    return table[impl]


def explain_impl(op: Any, /, *args: Any, **kwargs: Any) -> ImplChoice:
    """What `impl="auto"` would run for a call, and why, without running it.

    op: `sparse_mla_decode` or `sparse_mla_prefill` (the function or its name; "decode" / "prefill"
    too) followed by the op's own arguments, or a `DecodeCall` / `PrefillCall` alone. The arguments
    are checked as the op checks them (same errors); `impl` may be given only as "auto". Works under
    `jax.jit` and `jax.eval_shape`, so a call can be asked about with abstract arrays. Returns an
    `ImplChoice`: the chosen implementation and every candidate in `AUTO_ORDER` with its reasons
    (`str()` of it is a readable summary). `impl="auto"` decides through the same function, so asking
    on a GPU without the CUDA library runs its first-use build, as the call would (`cuda_ffi`).
    """
    if isinstance(op, (DecodeCall, PrefillCall)):
        if args or kwargs:
            raise TypeError("explain_impl(call) takes a DecodeCall / PrefillCall alone, without op arguments")
        return _auto_choice(op)
    if op is sparse_mla_decode or (isinstance(op, str) and op in ("sparse_mla_decode", "decode")):
        fn, make = sparse_mla_decode, _make_decode_call
    elif op is sparse_mla_prefill or (isinstance(op, str) and op in ("sparse_mla_prefill", "prefill")):
        fn, make = sparse_mla_prefill, _make_prefill_call
    else:
        raise ValueError(f"op must be sparse_mla_decode or sparse_mla_prefill (the function or its name), or a "
                         f"DecodeCall / PrefillCall, got {op!r}")
    bound = inspect.signature(fn).bind(*args, **kwargs)  # TypeError naming a missing or unknown argument
    bound.apply_defaults()
    a = dict(bound.arguments)
    impl = _check_impl(a.pop("impl"))
    if impl != "auto":
        raise ValueError(f"explain_impl explains impl='auto'; impl={impl!r} runs {impl!r} or raises")
    return _auto_choice(make(**a))


def sparse_mla_decode(
    q: jax.Array,
    kv_cache: jax.Array,
    indices: jax.Array,
    topk_length: jax.Array | None = None,
    *,
    kv_format: str,
    block_size: int,
    softmax_scale: float,
    attn_sink: jax.Array | None = None,
    extra_kv_cache: jax.Array | None = None,
    extra_indices: jax.Array | None = None,
    extra_topk_length: jax.Array | None = None,
    extra_kv_format: str | None = None,
    extra_block_size: int | None = None,
    impl: str = "auto",
    plan: DecodePlan | None = None,
    batch_invariant: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Sparse MLA decode over a paged cache (FlashMLA's `flash_mla_with_kvcache`, sparse mode).

    q: bf16 `[b, s_q, h_q, 512]` (any h_q >= 1). kv_cache: a paged cache in `kv_format`
    (`dsv41_jax.kv_cache`) with `block_size` tokens per page. indices: int32 `[b, s_q, topk]`
    global slots `block * block_size + offset`; topk_length: int32 `[b]` (default topk), only
    `indices[i, :, :topk_length[i]]` count. Any index < 0 or >= num_blocks * block_size is
    masked and never read. attn_sink: f32 `[h_q]`, in the denominator only. The optional extra
    cache (its own format and page size) joins the same softmax. Returns `(out bf16 [b, s_q,
    h_q, 512], lse f32 [b, s_q, h_q])`, lse natural-log without the sink, +inf for rows with no
    valid token (whose out is 0).

    plan: the split plan to run over (`dsv41_jax.make_decode_plan`, or a layer type's plan from
    `build_sparse_swa_metadata`): made once per step and layer type and shared by every layer's call,
    so the kernels do not plan (`dsv41_jax.plans` says what a plan made from other lengths yields).
    A plan for other shapes (batch, s_q, topk, extra cache or not, SM parts of this device) raises
    ValueError. Without one, the kernels that split plan in the call. batch_invariant: no split-KV,
    so a request's results are bitwise the same whatever else shares its batch (default: the plan's
    setting, else False).
    """
    impl = _check_impl(impl)
    call = _make_decode_call(q, kv_cache, indices, topk_length, kv_format, block_size, softmax_scale, attn_sink,
                             extra_kv_cache, extra_indices, extra_topk_length, extra_kv_format, extra_block_size,
                             plan, batch_invariant)
    chosen = _choose(impl, call)
    with jax.named_scope("dsv41_sparse_mla_decode"):
        return chosen.fn(call)


def sparse_mla_prefill(
    q: jax.Array,
    kv: jax.Array,
    indices: jax.Array,
    *,
    softmax_scale: float,
    attn_sink: jax.Array | None = None,
    topk_length: jax.Array | None = None,
    impl: str = "auto",
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Sparse MLA prefill over plain rows (FlashMLA's `flash_mla_sparse_fwd`).

    q: bf16 `[s_q, h_q, 512]`; kv: bf16 `[s_kv, 512]` (or `[s_kv, 1, 512]`); indices: int32
    `[s_q, topk]` (or `[s_q, 1, topk]`), invalid when < 0 or >= s_kv; topk_length: int32 `[s_q]`
    per query (default topk). Returns `(out bf16 [s_q, h_q, 512], max_logits f32 [s_q, h_q],
    lse f32 [s_q, h_q])`: natural-log lse without the sink; an empty row gives out 0,
    max_logits -inf, lse +inf.
    """
    impl = _check_impl(impl)
    call = _make_prefill_call(q, kv, indices, softmax_scale, attn_sink, topk_length)
    chosen = _choose(impl, call)
    with jax.named_scope("dsv41_sparse_mla_prefill"):
        return chosen.fn(call)


# ------------------------------------------------------------------------- mega interface
def quantize_output_fp8(x: jax.Array, *, group: int = 32) -> tuple[jax.Array, jax.Array]:
    """Per-`group` e4m3 quantisation of the last dim with UE8M0 scales.

    Returns `(values float8_e4m3fn [..., D], exponents uint8 [..., D // group])`; dequantise as
    `values * 2^(exponent - 127)`. Scale rule as the fp8 cache formats: `2^ceil(log2(max(amax,
    1e-4) / 448))`.
    """
    D = x.shape[-1]
    if D % group:
        raise ValueError(f"last dim {D} must be a multiple of group={group}")
    xf = x.astype(jnp.float32).reshape(x.shape[:-1] + (D // group, group))
    amax = jnp.max(jnp.abs(xf), axis=-1)
    e = jnp.ceil(jnp.log2(jnp.maximum(amax, 1e-4) / 448.0))
    vals = jnp.clip(xf * jnp.exp2(-e)[..., None], -448.0, 448.0).astype(jnp.float8_e4m3fn)
    return vals.reshape(x.shape), jnp.clip(e + 127, 0, 255).astype(jnp.uint8)


def _check_rope_args(positions: Any, cos_sin_cache: Any, n: int) -> tuple[jax.Array, jax.Array]:
    pos = _check_array("positions", positions, 1, kind="int")
    if pos.shape != (n,):
        raise ValueError(f"positions must have shape ({n},) (one per query token), got {_shape(pos)}")
    cs = _check_array("cos_sin_cache", cos_sin_cache, 2)
    if cs.shape[1] != 64:
        raise ValueError(f"cos_sin_cache must be [max_pos, 64] ([cos 32 | sin 32]), got {_shape(cs)}")
    return jnp.asarray(pos, jnp.int32), jnp.asarray(cs, jnp.float32)


def _mega_finish(out: jax.Array, positions: jax.Array, cs: jax.Array, lse: jax.Array):
    from dsv41_jax.rope import apply_inverse_rope

    out = apply_inverse_rope(out.astype(jnp.float32), positions, cs)
    vals, exps = quantize_output_fp8(out)
    return vals, exps, lse


def sparse_mla_mega_decode(
    q: jax.Array,
    positions: jax.Array,
    cos_sin_cache: jax.Array,
    kv_cache: jax.Array,
    indices: jax.Array,
    topk_length: jax.Array | None = None,
    *,
    kv_format: str = "mxfp8_ds_mla",
    block_size: int,
    softmax_scale: float,
    attn_sink: jax.Array | None = None,
    extra_kv_cache: jax.Array | None = None,
    extra_indices: jax.Array | None = None,
    extra_topk_length: jax.Array | None = None,
    extra_kv_format: str | None = None,
    extra_block_size: int | None = None,
    impl: str = "auto",
    plan: DecodePlan | None = None,
    batch_invariant: bool | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The mega-attention decode contract (FlashMLA's fused kernel, SM100 in vLLM), as a reference.

    q: bf16 `[T, h_q, 512]`, NOT roped (one query per token; V4.1 applies no per-head q norm);
    positions: int32 `[T]`; cos_sin_cache: f32 `[max_pos, 64]` (`dsv41_jax.rope.cos_sin_cache`).
    The main cache is the V4.1 SWA cache (`mxfp8_ds_mla` by default, `fp8_ds_mla` accepted),
    indices int32 `[T, topk]` / topk_length int32 `[T]`; the extra (compressed) cache is
    `nvfp4_ds_mla` or an fp8 format. Steps: GPT-J RoPE of q's last 64 dims at `positions`,
    sparse attention as `sparse_mla_decode`, inverse RoPE of the output's last 64 dims, e4m3
    quantisation with one UE8M0 exponent per 32 dims. Returns `(out float8_e4m3fn [T, h_q,
    512], out_scale uint8 [T, h_q, 16], lse f32 [T, h_q])`. Only the "xla" implementation
    exists (the fused SM100 kernel is not part of this library). plan / batch_invariant: as
    `sparse_mla_decode` with b = T and s_q = 1 (checked; the reference does not split).
    """
    impl = _check_impl(impl)
    if impl not in ("auto", "xla"):
        raise ValueError(f"sparse_mla_mega_decode has only the 'xla' implementation, got impl={impl!r}")
    q = _check_q(q, 3, "[T, h_q, 512]")
    T = q.shape[0]
    pos, cs = _check_rope_args(positions, cos_sin_cache, T)
    from dsv41_jax.rope import apply_rope

    qr = apply_rope(q, pos, cs)

    def per_token(x):
        return None if x is None else x.reshape((x.shape[0], 1) + x.shape[1:])

    idx = _check_array("indices", indices, 2, kind="int")
    eidx = None if extra_indices is None else _check_array("extra_indices", extra_indices, 2, kind="int")
    call = _make_decode_call(qr[:, None], kv_cache, per_token(idx), topk_length, kv_format, block_size,
                             softmax_scale, attn_sink, extra_kv_cache, per_token(eidx), extra_topk_length,
                             extra_kv_format, extra_block_size, plan, batch_invariant)
    with jax.named_scope("dsv41_sparse_mla_mega_decode"):
        # the output stays float32 until after the inverse RoPE, as in the fused kernel
        out, lse = _decode_xla_f32(call)
        return _mega_finish(out[:, 0], pos, cs, lse[:, 0])


def sparse_mla_mega_prefill(
    q: jax.Array,
    positions: jax.Array,
    cos_sin_cache: jax.Array,
    kv: jax.Array,
    indices: jax.Array,
    *,
    softmax_scale: float,
    attn_sink: jax.Array | None = None,
    topk_length: jax.Array | None = None,
    impl: str = "auto",
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The mega-attention prefill contract: as `sparse_mla_mega_decode` but over the gathered bf16
    `kv [s_kv, 512]` and combined indices of `sparse_mla_prefill`. Returns `(out e4m3 [s_q, h_q,
    512], out_scale uint8 [s_q, h_q, 16], lse f32 [s_q, h_q])`."""
    impl = _check_impl(impl)
    if impl not in ("auto", "xla"):
        raise ValueError(f"sparse_mla_mega_prefill has only the 'xla' implementation, got impl={impl!r}")
    q = _check_q(q, 3, "[s_q, h_q, 512]")
    pos, cs = _check_rope_args(positions, cos_sin_cache, q.shape[0])
    from dsv41_jax.rope import apply_rope

    call = _make_prefill_call(apply_rope(q, pos, cs), kv, indices, softmax_scale, attn_sink, topk_length)
    with jax.named_scope("dsv41_sparse_mla_mega_prefill"):
        out, _, lse = _prefill_xla_f32(call)
        return _mega_finish(out, pos, cs, lse)
