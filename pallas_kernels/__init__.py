"""`impl="pallas"`: sparse MLA decode and prefill as Pallas Mosaic GPU kernels (`plgpu.kernel`).

Importing this package touches no GPU. It is the "pallas" row of the core's implementation table
(`dsv41_jax.sparse_mla.implementations`, which imports it on first use): `decode`, `prefill`, the fused
mega ops `mega_decode` / `mega_prefill` (q RoPE, attention, inverse RoPE and e4m3 output in the kernel), their
`*_supports` predicates (always installed, so CPU tests can trace and interpret them) and
`unavailable_reason`, which reports the kernels runnable only when the default JAX backend is a GPU of
compute capability 9.x (Hopper) or 10.x (Blackwell, which runs the same SM90-style wgmma kernel).

Formats read: "bf16", "fp8_ds_mla" and V4.1's "mxfp8_ds_mla" / "nvfp4_ds_mla" (main and extra cache,
any page size, any mix; the quantized records are dequantized inside the kernel). Any head count: heads
are padded to a multiple of 64 internally (one program per 64 heads) and the padding is sliced off. On a machine without a GPU the kernels run in Mosaic GPU
interpret mode (slow; see `pallas_kernels._interpret`).

Design, numbers and limits: `pallas_kernels._kernel` and docs/pallas_kernels.md.
"""

from __future__ import annotations

from dsv41_jax.sparse_mla.base import DecodeCall, MegaDecodeCall, PrefillCall

from pallas_kernels import ops as _ops

__all__ = ["availability_reason", "decode", "prefill", "mega_decode", "mega_prefill", "supports_decode",
           "supports_prefill", "num_splits_override", "kernel_options", "decode_supports", "prefill_supports",
           "mega_decode_supports", "mega_prefill_supports", "unavailable_reason"]

decode = _ops.decode
prefill = _ops.prefill
mega_decode = _ops.mega_decode
mega_prefill = _ops.mega_prefill
num_splits_override = _ops.num_splits_override
kernel_options = _ops.kernel_options


def availability_reason() -> str | None:
    """None when the kernels can run natively here (a CUDA GPU of compute capability 9.x / 10.x)."""
    from dsv41_jax.device import gpu_unsupported_reason
    from dsv41_jax.sparse_mla.capabilities import PALLAS_SPARSE_DSV41

    why = gpu_unsupported_reason(PALLAS_SPARSE_DSV41.compute_capability_majors)
    return None if why is None else f"pallas Mosaic GPU kernels need a CUDA GPU of compute capability 9.x or 10.x: {why}"


def supports_decode(call: DecodeCall) -> str | None:
    why = _ops.unsupported_reason(call.kv_format, call.kv_cache)
    if why is None and call.has_extra:
        why = _ops.unsupported_reason(call.extra_kv_format, call.extra_kv_cache)
    return why


def supports_prefill(call: PrefillCall) -> str | None:
    return None


def supports_mega_decode(call: MegaDecodeCall) -> str | None:
    return supports_decode(call.decode)


# The names the core's implementation table reads (dsv41_jax.sparse_mla.implementations).
decode_supports = supports_decode
prefill_supports = supports_prefill
mega_decode_supports = supports_mega_decode
mega_prefill_supports = supports_prefill
unavailable_reason = availability_reason
