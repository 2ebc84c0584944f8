"""Layer types of DeepSeek-V4 / V4.1 attention and the split-scheduler plans a model needs.

A layer type names what a decode step attends: the sliding window only (`swaonly`), or the
window plus a compressed cache at some ratio. Layers of one type share one split plan per step
(`plan_decode_splits`), because the plan depends only on the per-request lengths and the
cache geometry, which every layer of the type has in common.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

__all__ = [
    "LAYER_TYPE_SWAONLY",
    "LAYER_TYPE_C1A",
    "LAYER_TYPE_C2A",
    "LAYER_TYPE_C4A",
    "LAYER_TYPE_C128A",
    "deepseek_v41_layer_type",
    "deepseek_v40_layer_type",
    "required_layer_types",
    "DecodePlanSpec",
    "decode_plan_spec",
]

LAYER_TYPE_SWAONLY = "swaonly"
LAYER_TYPE_C1A = "c1a"
LAYER_TYPE_C2A = "c2a"
LAYER_TYPE_C4A = "c4a"
LAYER_TYPE_C128A = "c128a"

_V41 = {0: LAYER_TYPE_SWAONLY, 1: LAYER_TYPE_C1A, 2: LAYER_TYPE_C2A}
_TYPE_RATIO = {LAYER_TYPE_SWAONLY: 0, LAYER_TYPE_C1A: 1, LAYER_TYPE_C2A: 2, LAYER_TYPE_C4A: 4, LAYER_TYPE_C128A: 128}


def _check_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        try:
            import numpy as np

            if isinstance(value, np.integer):
                return int(value)
        except ImportError:  # pragma: no cover
            pass
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    return value


def _int_or_none(value: object) -> int | None:
    """`value` as an int if it is an integer (Python or numpy, bool excluded), else None."""
    try:
        return _check_int("compress_ratio", value)
    except TypeError:
        return None


def deepseek_v41_layer_type(compress_ratio: int) -> str:
    """V4.1: 0 -> "swaonly", 1 -> "c1a", 2 -> "c2a"; anything else (non-integers included, as
    the API contract says) raises ValueError."""
    r = _int_or_none(compress_ratio)
    if r not in _V41:
        shown = compress_ratio if r is not None else repr(compress_ratio)
        raise ValueError(f"Unsupported DeepSeek V4.1 compress_ratio={shown}; expected 0, 1, or 2.")
    return _V41[r]


def deepseek_v40_layer_type(compress_ratio: int) -> str:
    """V4.0: r <= 1 -> "swaonly", 4 -> "c4a", 128 -> "c128a"; anything else (non-integers
    included) raises ValueError."""
    r = _int_or_none(compress_ratio)
    if r is None:
        raise ValueError(f"Unsupported DeepSeek V4 compress_ratio={compress_ratio!r}; expected <= 1, 4, or 128.")
    if r <= 1:
        return LAYER_TYPE_SWAONLY
    if r == 4:
        return LAYER_TYPE_C4A
    if r == 128:
        return LAYER_TYPE_C128A
    raise ValueError(f"Unsupported DeepSeek V4 compress_ratio={r}; expected <= 1, 4, or 128.")


def required_layer_types(compress_ratios: Iterable[int] | None, *, version: str = "v4.1") -> tuple[str, ...]:
    """The layer types present in a model: one split-scheduler plan is needed per entry.

    `compress_ratios` None or empty means `[0]` (a pure sliding-window model), as the seed's
    V4.1 SWA builder does. The result is sorted by compress ratio.
    """
    if version not in ("v4.0", "v4.1"):
        raise ValueError(f"version must be 'v4.0' or 'v4.1', got {version!r}")
    ratios = list(compress_ratios) if compress_ratios is not None else []
    if not ratios:
        ratios = [0]
    fn = deepseek_v41_layer_type if version == "v4.1" else deepseek_v40_layer_type
    return tuple(sorted({fn(int(r)) for r in ratios}, key=_TYPE_RATIO.__getitem__))


@dataclasses.dataclass(frozen=True)
class DecodePlanSpec:
    """Geometry of one layer type's decode call, i.e. the key of its split plan.

    topk: width of the main (sliding-window) index list; page_block_size: main cache tokens per
    page; extra_topk / extra_page_block_size: the compressed cache's index width and states per
    page (0 when the type has no compressed cache).
    """

    layer_type: str
    topk: int
    page_block_size: int
    extra_topk: int
    extra_page_block_size: int

    @property
    def has_extra(self) -> bool:
        return self.extra_topk > 0


def decode_plan_spec(
    layer_type: str,
    *,
    window: int,
    swa_block_size: int,
    kernel_block_tokens: int,
    index_topk: int,
    max_model_len: int,
) -> DecodePlanSpec:
    """The decode geometry of `layer_type`.

    swaonly: window only. c1a / c2a / c4a: extra topk `index_topk`, `kernel_block_tokens // r`
    states per compressed page. c128a: every compressed entry, extra topk padded to a multiple
    of 128 of cdiv(max_model_len, 128), 2 states per 256-token page (V4.0 geometry).
    """
    if layer_type not in _TYPE_RATIO:
        raise ValueError(f"layer_type must be one of {sorted(_TYPE_RATIO)}, got {layer_type!r}")
    for name, v in (("window", window), ("swa_block_size", swa_block_size),
                    ("kernel_block_tokens", kernel_block_tokens), ("index_topk", index_topk),
                    ("max_model_len", max_model_len)):
        if _check_int(name, v) <= 0:
            raise ValueError(f"{name} must be > 0, got {v}")
    r = _TYPE_RATIO[layer_type]
    if r == 0:
        return DecodePlanSpec(layer_type, window, swa_block_size, 0, 0)
    if r == 128:
        n = -(-max_model_len // 128)
        return DecodePlanSpec(layer_type, window, swa_block_size, -(-n // 128) * 128, 2)
    if kernel_block_tokens % r:
        raise ValueError(f"kernel_block_tokens must be a multiple of the compress ratio {r}, got {kernel_block_tokens}")
    return DecodePlanSpec(layer_type, window, swa_block_size, index_topk, kernel_block_tokens // r)
