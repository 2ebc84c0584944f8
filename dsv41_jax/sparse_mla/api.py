"""Public sparse MLA ops, and their dispatch to an implementation.

`sparse_mla_decode` attends each query token of a request over selected slots of a paged KV
cache (plus an optional extra cache, e.g. the compressed one); `sparse_mla_prefill` attends over
rows of a plain bf16 `kv`; `sparse_mla_mega_decode` / `sparse_mla_mega_prefill` are the fused
mega-attention contract (RoPE'd inside, inverse-RoPE'd and fp8-quantised output). Numerics are
FlashMLA's (see `dsv41_jax.sparse_mla.reference`). Every check runs at trace time and raises
ValueError / TypeError naming the argument, the expected and the actual value (`base`).

Implementations (`IMPLEMENTATIONS`, imported on first use): "xla" (reference, any device),
"pallas" (`pallas_kernels`) and "cuda" (`cuda_ffi`). `impl="auto"` tries them in `AUTO_ORDER`
(the backends' priorities): a kernel runs when `select_backend` finds one of its backends for the
default device and the call's format and page size (its implementation available here) and its
`supports` predicate accepts the call; else "xla" runs. `explain_impl` returns that decision with
every candidate's reasons, and `auto` decides through the same function, so the two never disagree.
On an accelerator, a call that lands on the reference logs a WARNING on the `dsv41_jax` logger
naming why each kernel declined, once per distinct set of reasons; on a CPU the reference is the
expected choice and nothing is logged.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from typing import Any

import jax
import jax.numpy as jnp

from dsv41_jax.device import DeviceInfo
from dsv41_jax.plans import DecodePlan
from dsv41_jax.sparse_mla import reference
from dsv41_jax.sparse_mla.base import (DecodeCall, MegaDecodeCall, MegaPrefillCall, PrefillCall, make_decode_call,
                                       make_mega_decode_call, make_mega_prefill_call, make_prefill_call)
from dsv41_jax.sparse_mla.reference import quantize_output_fp8
from dsv41_jax.sparse_mla.capabilities import AUTO_ORDER, BackendSelectionError, registered_backends, select_backend
from dsv41_jax.sparse_mla.implementations import (IMPLEMENTATIONS, decode_impls, import_error, installed,
                                                  prefill_impls, unavailable_reason)

__all__ = [
    "DecodeCall",
    "PrefillCall",
    "MegaDecodeCall",
    "MegaPrefillCall",
    "ImplCandidate",
    "ImplChoice",
    "AUTO_ORDER",
    "IMPLEMENTATIONS",
    "explain_impl",
    "sparse_mla_decode",
    "sparse_mla_prefill",
    "sparse_mla_mega_decode",
    "sparse_mla_mega_prefill",
    "decode_impls",
    "prefill_impls",
    "quantize_output_fp8",
]

_log = logging.getLogger("dsv41_jax")


def _check_impl(impl: Any) -> str:
    if not isinstance(impl, str):
        raise TypeError(f"impl must be a str, got {type(impl).__name__}")
    if impl != "auto" and impl not in AUTO_ORDER:
        raise ValueError(f"impl must be one of {', '.join(repr(n) for n in ('auto', *AUTO_ORDER))}, got {impl!r}")
    return impl


Call = DecodeCall | PrefillCall | MegaDecodeCall | MegaPrefillCall
_OPS = {"decode": "sparse_mla_decode", "prefill": "sparse_mla_prefill", "mega_decode": "sparse_mla_mega_decode",
        "mega_prefill": "sparse_mla_mega_prefill"}


def _role(call: Call) -> str:
    """The implementation function a call runs: "decode", "prefill", "mega_decode" or "mega_prefill"."""
    if isinstance(call, MegaDecodeCall):
        return "mega_decode"
    if isinstance(call, MegaPrefillCall):
        return "mega_prefill"
    return "decode" if isinstance(call, DecodeCall) else "prefill"


def _supports(name: str, call: Call) -> str | None:
    """The kernel's own answer for this call: None, or why it refuses it (an implementation without the
    role's function has no kernel for it)."""
    role = _role(call)
    if IMPLEMENTATIONS[name].function(role) is None:
        return f"implementation {name!r} has no {_OPS[role]} kernel"
    check = IMPLEMENTATIONS[name].function(f"{role}_supports")
    return None if check is None else check(call)


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

    op: "sparse_mla_decode", "sparse_mla_prefill", "sparse_mla_mega_decode" or "sparse_mla_mega_prefill"; device: the default device the choice was made
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


def _weigh(name: str, call: DecodeCall | PrefillCall, device: DeviceInfo) -> ImplCandidate:
    """One candidate: a backend of it must serve the device and the call's format and page size (the
    registry; its availability probe may build the library on first use) and its kernel must accept the
    call (its `supports`)."""
    if name == "xla":
        return ImplCandidate("xla", True, "the reference: any device, every format and page size")
    reasons: list[str] = []
    served = None
    mega = isinstance(call, (MegaDecodeCall, MegaPrefillCall))
    dcall = call.decode if isinstance(call, MegaDecodeCall) else call
    # decode asks for its cache's format and page size; prefill reads plain bf16 rows
    kv_format, bs = (dcall.kv_format, dcall.block_size) if isinstance(dcall, DecodeCall) else ("auto", None)
    try:
        served = select_backend(device, impls=(name,), kv_cache_dtype=kv_format, block_size=bs, mega=mega)
    except BackendSelectionError as e:
        # one entry per distinct list of reasons, naming the backends (of this implementation) it rejects
        groups: dict[tuple[str, ...], list[str]] = {}
        for spec in registered_backends():
            if spec.impl == name and spec.name in e.reasons:
                groups.setdefault(tuple(e.reasons[spec.name]), []).append(spec.name)
        reasons += [f"{', '.join(names)}: {'; '.join(rs)}" for rs, names in groups.items()]
    if not installed(name):  # asked after the probe, which may just have built the library
        why = import_error(name) or unavailable_reason(name) or f"implementation {name!r} is not installed here"
        if not any(why in r for r in reasons):
            reasons.append(why)
    else:
        why = _supports(name, call)
        if why is not None:
            reasons.append(why)
    if reasons:
        return ImplCandidate(name, False, " | ".join(reasons))
    return ImplCandidate(name, True, f"{served.name} serves the device and the cache format, and the kernel "
                                     f"accepts the call")


def _auto_choice(call: DecodeCall | PrefillCall) -> ImplChoice:
    """The decision of impl="auto" (what `explain_impl` returns and the ops run)."""
    op = _OPS[_role(call)]
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


def _choose(impl: str, call: DecodeCall | PrefillCall):
    """The function that runs `call` under `impl` ("auto": `_auto_choice`'s; else that implementation's,
    which must be installed here and accept the call)."""
    if impl == "auto":
        choice = _auto_choice(call)
        _warn_if_reference(choice)
        return IMPLEMENTATIONS[choice.impl].function(_role(call))
    probe = None if installed(impl) else unavailable_reason(impl)  # may build the library on first use
    if not installed(impl):
        errors = {IMPLEMENTATIONS[n].module: e for n in IMPLEMENTATIONS if (e := import_error(n))}
        available = sorted(n for n in IMPLEMENTATIONS if installed(n))
        raise ValueError(f"impl={impl!r} is not available here (available: {available}"
                         + (f"; import errors: {errors}" if errors else "")
                         + (f"; {probe}" if probe and probe not in errors.values() else "")
                         + "); build or install it, or use impl='auto'")
    why = _supports(impl, call)
    if why is not None:
        raise ValueError(f"impl={impl!r} does not support this call: {why}")
    return IMPLEMENTATIONS[impl].function(_role(call))


def explain_impl(op: Any, /, *args: Any, **kwargs: Any) -> ImplChoice:
    """What `impl="auto"` would run for a call, and why, without running it.

    op: `sparse_mla_decode`, `sparse_mla_prefill`, `sparse_mla_mega_decode` or `sparse_mla_mega_prefill` (the
    function or its name; "decode" / "prefill" too) followed by the op's own arguments, or a `DecodeCall` /
    `PrefillCall` / `MegaDecodeCall` / `MegaPrefillCall` alone. The arguments
    are checked as the op checks them (same errors); `impl` may be given only as "auto". Works under
    `jax.jit` and `jax.eval_shape`, so a call can be asked about with abstract arrays. Returns an
    `ImplChoice`: the chosen implementation and every candidate in `AUTO_ORDER` with its reasons
    (`str()` of it is a readable summary). `impl="auto"` decides through the same function, so asking
    on a GPU without the CUDA library runs its first-use build, as the call would (`cuda_ffi`).
    """
    if isinstance(op, (DecodeCall, PrefillCall, MegaDecodeCall, MegaPrefillCall)):
        if args or kwargs:
            raise TypeError("explain_impl(call) takes a DecodeCall / PrefillCall / MegaDecodeCall / MegaPrefillCall "
                            "alone, without op arguments")
        return _auto_choice(op)
    if op is sparse_mla_decode or (isinstance(op, str) and op in ("sparse_mla_decode", "decode")):
        fn, make = sparse_mla_decode, make_decode_call
    elif op is sparse_mla_prefill or (isinstance(op, str) and op in ("sparse_mla_prefill", "prefill")):
        fn, make = sparse_mla_prefill, make_prefill_call
    elif op is sparse_mla_mega_decode or (isinstance(op, str) and op == "sparse_mla_mega_decode"):
        fn, make = sparse_mla_mega_decode, make_mega_decode_call
    elif op is sparse_mla_mega_prefill or (isinstance(op, str) and op == "sparse_mla_mega_prefill"):
        fn, make = sparse_mla_mega_prefill, make_mega_prefill_call
    else:
        raise ValueError(f"op must be sparse_mla_decode, sparse_mla_prefill, sparse_mla_mega_decode or "
                         f"sparse_mla_mega_prefill (the function or its name), or a DecodeCall / PrefillCall / "
                         f"MegaDecodeCall / MegaPrefillCall, got {op!r}")
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
    call = make_decode_call(q, kv_cache, indices, topk_length, kv_format, block_size, softmax_scale, attn_sink,
                             extra_kv_cache, extra_indices, extra_topk_length, extra_kv_format, extra_block_size,
                             plan, batch_invariant)
    chosen = _choose(impl, call)
    with jax.named_scope("dsv41_sparse_mla_decode"):
        return chosen(call)


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
    call = make_prefill_call(q, kv, indices, softmax_scale, attn_sink, topk_length)
    chosen = _choose(impl, call)
    with jax.named_scope("dsv41_sparse_mla_prefill"):
        return chosen(call)


# ------------------------------------------------------------------------- mega interface
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
    """The mega-attention decode (the contract of FlashMLA's fused SM100 kernel): q RoPE, sparse attention,
    inverse RoPE and fp8 output in one op.

    q: bf16 `[T, h_q, 512]`, NOT roped (one query per token; V4.1 applies no per-head q norm);
    positions: int32 `[T]`; cos_sin_cache: f32 `[max_pos, 64]` (`dsv41_jax.rope.cos_sin_cache`; positions
    are clamped into it). The main cache is the V4.1 SWA cache (`mxfp8_ds_mla` by default; any decode
    format), indices int32 `[T, topk]` / topk_length int32 `[T]`; the extra (compressed) cache is
    `nvfp4_ds_mla` or another format. Steps: GPT-J RoPE of q's last 64 dims at `positions` (q stays
    bf16), sparse attention as `sparse_mla_decode`, inverse RoPE of the float32 output's last 64 dims,
    e4m3 quantisation with one UE8M0 exponent per 32 dims (`quantize_output_fp8`). Returns `(out
    float8_e4m3fn [T, h_q, 512], out_scale uint8 [T, h_q, 16], lse f32 [T, h_q])`; a row with no valid
    token gives out 0 and lse +inf.

    Implementations: "cuda" runs the steps inside the decode kernels (RoPE as Q is loaded; the output
    stage in the kernel's epilogue, or in the split combine); "xla" runs them as jnp ops. plan /
    batch_invariant: as `sparse_mla_decode` with b = T and s_q = 1.
    """
    impl = _check_impl(impl)
    call = make_mega_decode_call(q, positions, cos_sin_cache, kv_cache, indices, topk_length, kv_format, block_size,
                                 softmax_scale, attn_sink, extra_kv_cache, extra_indices, extra_topk_length,
                                 extra_kv_format, extra_block_size, plan, batch_invariant)
    chosen = _choose(impl, call)
    with jax.named_scope("dsv41_sparse_mla_mega_decode"):
        return chosen(call)


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
    `kv [s_kv, 512]` and combined indices of `sparse_mla_prefill`.

    q: bf16 `[s_q, h_q, 512]`, NOT roped; positions: int32 `[s_q]`; cos_sin_cache: f32 `[max_pos, 64]`
    (positions are clamped into it). Steps as the mega decode: RoPE of q's last 64 dims (q stays bf16), the
    sparse prefill, inverse RoPE of the float32 output's last 64 dims, e4m3 with one UE8M0 exponent per 32 dims.
    Returns `(out float8_e4m3fn [s_q, h_q, 512], out_scale uint8 [s_q, h_q, 16], lse f32 [s_q, h_q])`; a query
    with no valid token gives out 0 and lse +inf.

    Implementations: "cuda" runs the steps inside the prefill kernels (RoPE as Q is loaded, the output stage in
    the epilogue); "xla" runs them as jnp ops.
    """
    impl = _check_impl(impl)
    call = make_mega_prefill_call(q, positions, cos_sin_cache, kv, indices, softmax_scale, attn_sink, topk_length)
    chosen = _choose(impl, call)
    with jax.named_scope("dsv41_sparse_mla_mega_prefill"):
        return chosen(call)
