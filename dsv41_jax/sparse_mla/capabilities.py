"""Backend capabilities: which backend of the sparse MLA ops serves a device and a cache format.

Each `BackendSpec` is a frozen descriptor of capabilities, as vLLM's attention backends are
(the seed's `FLASHMLA_SPARSE_DSV41` and `FLASHMLA_MEGA_ATTN_DSV41` carry exactly the seed's
flags), naming the implementation (`impl`, a key of `IMPLEMENTATIONS`) that serves it.
`select_backend` filters the registered backends by device and request and returns the
highest-priority match, or raises `BackendSelectionError` listing why every candidate was
rejected. `AUTO_ORDER`, the order `impl="auto"` tries the implementations in, comes from the
priorities of the built-in backends.

Mutable state: the backend registry (`register_backend` adds a descriptor, e.g. a deployment's own
envelope of an implementation; the five built-in ones are registered at import). Which implementations
exist is fixed (`dsv41_jax.sparse_mla.implementations`), and so is `AUTO_ORDER`.

KV-cache dtype names (vLLM's, `kv_cache_dtype`): `"fp8"` is an alias of `"fp8_ds_mla"`; `"auto"` means
the model's native cache record, `"fp8_ds_mla"` (the V4 584-byte record), for every backend
(`dsv41_jax.kv_cache.canonical_kv_format`).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from dsv41_jax.device import DeviceInfo
from dsv41_jax.kv_cache import KV_CACHE_FORMATS, LATENT_DIM, canonical_kv_cache_dtype
from dsv41_jax.sparse_mla import implementations

__all__ = [
    "DeviceInfo",
    "BackendSpec",
    "BackendSelectionError",
    "FLASHMLA_SPARSE_DSV41",
    "FLASHMLA_MEGA_ATTN_DSV41",
    "CUDA_SPARSE_DSV41",
    "PALLAS_SPARSE_DSV41",
    "XLA_SPARSE_DSV41",
    "BUILTIN_BACKENDS",
    "AUTO_ORDER",
    "auto_order",
    "KV_CACHE_FORMATS",
    "canonical_kv_cache_dtype",
    "register_backend",
    "registered_backends",
    "get_backend",
    "select_backend",
]


@dataclasses.dataclass(frozen=True)
class BackendSpec:
    """Capabilities of one backend.

    impl: the op implementation that serves it ("cuda", "pallas", "xla"), or None when no
    implementation of this library does (the descriptor then records a capability only; with
    `require_available`, `select_backend` rejects it).
    platforms: platforms it runs on (None: any). compute_capability_majors: required CUDA
    major versions (None: no requirement). kernel_block_sizes: function of the compute
    capability returning the page sizes (tokens) the kernel accepts, or None for any.
    interfaces: "sparse" (the FlashMLA sparse decode/prefill interface) and/or "mega" (the fused
    mega-attention interface: unroped q in, inverse-RoPE'd fp8 out).
    priority: higher wins among matches.
    """

    name: str
    impl: str | None
    priority: int
    supported_dtypes: tuple[str, ...]
    supported_kv_cache_dtypes: tuple[str, ...]
    supported_head_sizes: tuple[int, ...]
    platforms: tuple[str, ...] | None
    compute_capability_majors: tuple[int, ...] | None
    kernel_block_sizes: Callable[[tuple[int, int] | None], tuple[int, ...] | None]
    is_mla: bool = True
    is_sparse: bool = True
    supports_sink: bool = True
    interfaces: tuple[str, ...] = ("sparse",)
    supports_mm_prefix: bool = False
    notes: str = ""

    # --- vLLM-style capability queries -------------------------------------------
    def supports_kv_cache_dtype(self, kv_cache_dtype: str) -> bool:
        return kv_cache_dtype in self.supported_kv_cache_dtypes

    def supports_compute_capability(self, capability: tuple[int, int] | None) -> bool:
        if self.compute_capability_majors is None:
            return True
        return capability is not None and capability[0] in self.compute_capability_majors

    def get_supported_kernel_block_sizes(self, capability: tuple[int, int] | None = None) -> tuple[int, ...] | None:
        return self.kernel_block_sizes(capability)

    def supports_combination(
        self,
        head_size: int,
        dtype: Any,
        kv_cache_dtype: str | None,
        block_size: int | None,
        use_mla: bool,
        has_sink: bool,
        use_sparse: bool,
        use_mm_prefix: bool,
        device_capability: tuple[int, int] | None,
    ) -> str | None:
        """None if this backend supports the combination, else the first reason it does not."""
        reasons = self._reasons(
            head_size=head_size, dtype=dtype, kv_cache_dtype=kv_cache_dtype, block_size=block_size,
            use_mla=use_mla, has_sink=has_sink, use_sparse=use_sparse, use_mm_prefix=use_mm_prefix,
            device_capability=device_capability,
        )
        return reasons[0] if reasons else None

    def _reasons(
        self,
        *,
        head_size: int,
        dtype: Any,
        kv_cache_dtype: str | None,
        block_size: int | None,
        use_mla: bool,
        has_sink: bool,
        use_sparse: bool,
        use_mm_prefix: bool,
        device_capability: tuple[int, int] | None,
    ) -> list[str]:
        out = []
        if head_size not in self.supported_head_sizes:
            out.append(f"head_size {head_size} not in {list(self.supported_head_sizes)}")
        dname = _dtype_name(dtype)
        if dname not in self.supported_dtypes:
            out.append(f"dtype {dname} not in {list(self.supported_dtypes)}")
        if kv_cache_dtype is not None and kv_cache_dtype not in self.supported_kv_cache_dtypes:
            out.append(f"kv_cache_dtype {kv_cache_dtype!r} not in {list(self.supported_kv_cache_dtypes)}")
        if use_mla != self.is_mla:
            out.append("needs an MLA model" if self.is_mla else "does not serve MLA")
        if use_sparse != self.is_sparse:
            out.append("needs sparse attention" if self.is_sparse else "does not serve sparse attention")
        if has_sink and not self.supports_sink:
            out.append("does not support attention sinks")
        if use_mm_prefix and not self.supports_mm_prefix:
            out.append("does not support multimodal bidirectional prefixes")
        if not self.supports_compute_capability(device_capability):
            cc = "none" if device_capability is None else f"{device_capability[0]}.{device_capability[1]}"
            out.append(f"compute capability {cc} not in majors {list(self.compute_capability_majors or [])}")
        elif block_size is not None:
            sizes = self.kernel_block_sizes(device_capability)
            if sizes is not None and block_size not in sizes:
                out.append(f"block_size {block_size} not in supported kernel block sizes {list(sizes)}")
        return out


def _dtype_name(dtype: Any) -> str:
    if isinstance(dtype, str):
        return {"bfloat16": "bfloat16", "bf16": "bfloat16"}.get(dtype, dtype)
    try:
        return np.dtype(dtype).name
    except TypeError:
        return str(dtype)


def _flashmla_block_sizes(cc: tuple[int, int] | None) -> tuple[int, ...]:
    return (64,) if (cc is not None and cc[0] == 9) else (128,)


FLASHMLA_SPARSE_DSV41 = BackendSpec(
    name="FLASHMLA_SPARSE_DSV41",
    impl="cuda",
    priority=30,
    supported_dtypes=("bfloat16",),
    supported_kv_cache_dtypes=("auto", "fp8_ds_mla", "fp8"),
    supported_head_sizes=(LATENT_DIM,),
    platforms=("cuda",),
    compute_capability_majors=(9, 10),
    kernel_block_sizes=_flashmla_block_sizes,
    notes="FlashMLA-compatible sparse decode/prefill; served by our CUDA FFI kernels (cuda_ffi/).",
)

FLASHMLA_MEGA_ATTN_DSV41 = BackendSpec(
    name="FLASHMLA_MEGA_ATTN_DSV41",
    impl=None,
    priority=40,
    supported_dtypes=("bfloat16",),
    supported_kv_cache_dtypes=("auto", "fp8_ds_mla", "fp8", "nvfp4_ds_mla"),
    supported_head_sizes=(LATENT_DIM,),
    platforms=("cuda",),
    compute_capability_majors=(10,),
    kernel_block_sizes=lambda cc: (128,),
    interfaces=("mega",),
    notes="FlashMLA's fused q RoPE + sparse attention + inverse RoPE + fp8 output kernel (SM100 only, no SM90 "
          "kernel): the seed's flags. No kernel of this library is FlashMLA's; sparse_mla_mega_decode and "
          "sparse_mla_mega_prefill run CUDA_SPARSE_DSV41's fused decode and prefill kernels on SM90 (run) and "
          "SM100 (compiled only, never run here), PALLAS_SPARSE_DSV41's on SM90 (run; on SM100 the same SM90-style "
          "kernel, never run here), and the xla reference elsewhere.",
)

CUDA_SPARSE_DSV41 = BackendSpec(
    name="CUDA_SPARSE_DSV41",
    impl="cuda",
    priority=25,
    supported_dtypes=("bfloat16",),
    supported_kv_cache_dtypes=("auto", "fp8_ds_mla", "fp8", "bf16", "mxfp8_ds_mla", "nvfp4_ds_mla"),
    supported_head_sizes=(LATENT_DIM,),
    platforms=("cuda",),
    compute_capability_majors=(9, 10),
    kernel_block_sizes=lambda cc: None,
    interfaces=("sparse", "mega"),
    notes=("Our CUDA kernels beyond FlashMLA's envelope: bf16 caches, V4.1's mxfp8_ds_mla / nvfp4_ds_mla records "
           "on SM90 (run) and SM100 (compiled only), any page size, any head count (a decode of 1..32 heads runs "
           "unpadded). One decode call reads bf16 / fp8_ds_mla pools or mxfp8_ds_mla / nvfp4_ds_mla pools. The "
           "mega interface: the fused mega decode and prefill (q RoPE, attention, inverse RoPE, e4m3 output inside "
           "the decode and prefill kernels)."),
)

PALLAS_SPARSE_DSV41 = BackendSpec(
    name="PALLAS_SPARSE_DSV41",
    impl="pallas",
    priority=20,
    supported_dtypes=("bfloat16",),
    supported_kv_cache_dtypes=("auto", "fp8_ds_mla", "fp8", "bf16", "mxfp8_ds_mla", "nvfp4_ds_mla"),
    supported_head_sizes=(LATENT_DIM,),
    platforms=("cuda",),
    compute_capability_majors=(9, 10),
    kernel_block_sizes=lambda cc: None,
    interfaces=("sparse", "mega"),
    notes=("Pallas Mosaic GPU kernels (pallas_kernels/); any page size; decode reads every cache format in any mix "
           "of main and extra cache (V4.1's records dequantized by the kernel). The mega interface: the same kernels "
           "with q RoPE inside and, when a call runs in one split, the inverse RoPE and the e4m3 output in their "
           "epilogue (split calls: in the XLA combine)."),
)

XLA_SPARSE_DSV41 = BackendSpec(
    name="XLA_SPARSE_DSV41",
    impl="xla",
    priority=0,
    supported_dtypes=("bfloat16",),
    supported_kv_cache_dtypes=("auto", "fp8", "bf16", "fp8_ds_mla", "mxfp8_ds_mla", "nvfp4_ds_mla"),
    supported_head_sizes=(LATENT_DIM,),
    platforms=None,
    compute_capability_majors=None,
    kernel_block_sizes=lambda cc: None,
    interfaces=("sparse", "mega"),
    notes="Pure-jnp reference, fp32 math; any JAX device, every format and page size.",
)

BUILTIN_BACKENDS = (FLASHMLA_SPARSE_DSV41, FLASHMLA_MEGA_ATTN_DSV41, CUDA_SPARSE_DSV41, PALLAS_SPARSE_DSV41,
                    XLA_SPARSE_DSV41)


def auto_order(specs: Iterable[BackendSpec]) -> tuple[str, ...]:
    """The implementations serving the sparse interface, by the highest priority of their backends."""
    best: dict[str, int] = {}
    for s in specs:
        if s.impl is not None and "sparse" in s.interfaces:
            best[s.impl] = max(best.get(s.impl, s.priority), s.priority)
    return tuple(sorted(best, key=lambda impl: -best[impl]))


AUTO_ORDER = auto_order(BUILTIN_BACKENDS)  # ("cuda", "pallas", "xla"): the reference, priority 0, comes last
assert set(AUTO_ORDER) == set(implementations.IMPLEMENTATIONS), "every implementation has a built-in backend"

_lock = threading.Lock()
_REGISTRY: dict[str, BackendSpec] = {}


def register_backend(spec: BackendSpec, *, replace: bool = False) -> None:
    """Add `spec` to the registry (ValueError if the name exists and `replace` is False)."""
    if not isinstance(spec, BackendSpec):
        raise TypeError(f"spec must be a BackendSpec, got {type(spec).__name__}")
    if spec.impl is not None and spec.impl not in implementations.IMPLEMENTATIONS:
        raise ValueError(f"spec.impl must be one of {list(implementations.IMPLEMENTATIONS)} or None, "
                         f"got {spec.impl!r}")
    with _lock:
        if spec.name in _REGISTRY and not replace:
            raise ValueError(f"backend {spec.name!r} is already registered")
        _REGISTRY[spec.name] = spec


def registered_backends() -> tuple[BackendSpec, ...]:
    """Every registered backend, highest priority first."""
    with _lock:
        return tuple(sorted(_REGISTRY.values(), key=lambda s: -s.priority))


def get_backend(name: str) -> BackendSpec:
    """The registered backend called `name` (ValueError naming the registered ones if none is)."""
    with _lock:
        try:
            return _REGISTRY[name]
        except KeyError:
            raise ValueError(f"unknown backend {name!r}; registered: {sorted(_REGISTRY)}") from None


for _spec in BUILTIN_BACKENDS:
    register_backend(_spec)


class BackendSelectionError(ValueError):
    """No registered backend serves the request; `.reasons` maps backend name -> reasons."""

    def __init__(self, message: str, reasons: dict[str, list[str]]):
        super().__init__(message)
        self.reasons = reasons


def select_backend(
    device: Any = None,
    *,
    platform: str | None = None,
    compute_capability: Any = None,
    kv_cache_dtype: str = "auto",
    block_size: int | None = None,
    head_size: int = LATENT_DIM,
    dtype: Any = "bfloat16",
    has_sink: bool = True,
    use_mla: bool = True,
    use_sparse: bool = True,
    use_mm_prefix: bool = False,
    mega: bool = False,
    impls: Sequence[str] | None = None,
    require_available: bool = True,
) -> BackendSpec:
    """The best registered backend for a device and request.

    Give either `device` (a `jax.Device` or `DeviceInfo`) or `platform` (+ `compute_capability`
    on CUDA); with neither, the default JAX device is used. `impls` restricts the candidates
    to those implementations. With `require_available`, a backend whose implementation cannot
    run here (library not built, kernel missing), or that no implementation of this library serves,
    is rejected with that reason.
    """
    if device is not None and platform is not None:
        raise ValueError("give either device or platform, not both")
    if device is None and platform is None:
        info = DeviceInfo.default()
    elif device is not None:
        info = device if isinstance(device, DeviceInfo) else DeviceInfo.from_device(device)
    else:
        info = DeviceInfo.from_platform(platform, compute_capability)
    if isinstance(block_size, bool) or (block_size is not None and not isinstance(block_size, (int, np.integer))):
        raise TypeError(f"block_size must be an int or None, got {block_size!r}")
    if block_size is not None and block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    raw_kv = kv_cache_dtype
    canonical_kv_cache_dtype(raw_kv)  # validates the name
    reasons: dict[str, list[str]] = {}
    for spec in registered_backends():
        why: list[str] = []
        want = "mega" if mega else "sparse"
        if want not in spec.interfaces:
            why.append(f"does not serve the {want} interface (serves {list(spec.interfaces)})")
        if impls is not None and spec.impl not in impls:
            what = "no implementation of this library" if spec.impl is None else f"implementation {spec.impl!r}"
            why.append(f"{what} not in requested {list(impls)}")
        if spec.platforms is not None and info.platform not in spec.platforms:
            why.append(f"platform {info.platform!r} not in {list(spec.platforms)}")
        kv_ok = raw_kv if raw_kv in spec.supported_kv_cache_dtypes else canonical_kv_cache_dtype(raw_kv)
        why += spec._reasons(
            head_size=head_size, dtype=dtype, kv_cache_dtype=kv_ok, block_size=block_size,
            use_mla=use_mla, has_sink=has_sink, use_sparse=use_sparse, use_mm_prefix=use_mm_prefix,
            device_capability=info.compute_capability if info.platform == "cuda" else None,
        )
        if not why and require_available:
            r = (implementations.unavailable_reason(spec.impl) if spec.impl is not None
                 else "no kernel of this library serves it")
            if r is not None:
                why.append(r)
        if not why:
            return spec
        reasons[spec.name] = why
    cc = "" if info.compute_capability is None else f" (compute capability {info.compute_capability[0]}.{info.compute_capability[1]})"
    lines = [f"no attention backend serves platform {info.platform!r}{cc}, kv_cache_dtype={raw_kv!r}, "
             f"block_size={block_size}, head_size={head_size}, dtype={_dtype_name(dtype)}, mega={mega}:"]
    lines += [f"  {name}: " + "; ".join(rs) for name, rs in reasons.items()]
    raise BackendSelectionError("\n".join(lines), reasons)
