"""Sparse MLA attention (DeepSeek-V4.1, FlashMLA semantics): the public ops and their dispatch.

- `api`: the ops (`sparse_mla_decode`, `sparse_mla_prefill`, the mega ops), `explain_impl`, `AUTO_ORDER`;
- `base`: the call records every implementation receives (`DecodeCall`, `PrefillCall`, `MegaDecodeCall`) and the
  argument checks;
- `reference`: the `impl="xla"` reference;
- `capabilities`: the backend descriptors (`BackendSpec`, the five built-in ones) and `select_backend`;
- `implementations`: the implementation table (impl name -> the package that implements it, loaded on first use).

The kernels live outside this package, in `pallas_kernels` and `cuda_ffi`; nothing here imports them until an
implementation of theirs is asked for.
"""

from dsv41_jax.sparse_mla import api, base, capabilities, implementations, reference
from dsv41_jax.sparse_mla.api import (
    AUTO_ORDER,
    IMPLEMENTATIONS,
    ImplCandidate,
    ImplChoice,
    decode_impls,
    explain_impl,
    prefill_impls,
    quantize_output_fp8,
    sparse_mla_decode,
    sparse_mla_mega_decode,
    sparse_mla_mega_prefill,
    sparse_mla_prefill,
)
from dsv41_jax.sparse_mla.base import (DecodeCall, MegaDecodeCall, PrefillCall, make_decode_call,
                                       make_mega_decode_call, make_prefill_call)
from dsv41_jax.sparse_mla.capabilities import (
    BUILTIN_BACKENDS,
    CUDA_SPARSE_DSV41,
    FLASHMLA_MEGA_ATTN_DSV41,
    FLASHMLA_SPARSE_DSV41,
    PALLAS_SPARSE_DSV41,
    XLA_SPARSE_DSV41,
    BackendSelectionError,
    BackendSpec,
    DeviceInfo,
    get_backend,
    register_backend,
    registered_backends,
    select_backend,
)
from dsv41_jax.sparse_mla.implementations import Implementation

__all__ = [
    "api", "base", "capabilities", "implementations", "reference",
    "sparse_mla_decode", "sparse_mla_prefill", "sparse_mla_mega_decode", "sparse_mla_mega_prefill",
    "explain_impl", "ImplChoice", "ImplCandidate", "AUTO_ORDER", "quantize_output_fp8",
    "DecodeCall", "PrefillCall", "MegaDecodeCall", "make_decode_call", "make_prefill_call", "make_mega_decode_call",
    "IMPLEMENTATIONS", "Implementation", "decode_impls", "prefill_impls",
    "BackendSpec", "BackendSelectionError", "DeviceInfo", "BUILTIN_BACKENDS",
    "FLASHMLA_SPARSE_DSV41", "FLASHMLA_MEGA_ATTN_DSV41", "CUDA_SPARSE_DSV41", "PALLAS_SPARSE_DSV41", "XLA_SPARSE_DSV41",
    "register_backend", "registered_backends", "get_backend", "select_backend",
]
