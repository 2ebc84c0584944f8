"""What the library reads from a device: platform, CUDA compute capability, SM count.

One place parses a compute capability and probes the SM count, so backend selection
(`dsv41_jax.sparse_mla.capabilities`), split planning (`dsv41_jax.scheduler`), the kernels' availability
probes and `python -m dsv41_jax.info` agree on what the device is.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

__all__ = ["DeviceInfo", "parse_compute_capability", "default_num_sms", "DEFAULT_NUM_SMS", "gpu_unsupported_reason"]

DEFAULT_NUM_SMS = 132  # H100 / H200: the SM count split plans assume without a GPU to ask


def _platform(name: str) -> str:
    """jax names CUDA devices "gpu"; the backend descriptors say "cuda"."""
    return {"gpu": "cuda"}.get(name, name)


def parse_compute_capability(cc: Any) -> tuple[int, int]:
    """`(major, minor)` from "9.0" (what jax reports), 90 or (9, 0)."""
    if isinstance(cc, str):
        parts = cc.split(".")
        try:
            return int(parts[0]), int(parts[1]) if len(parts) > 1 else 0
        except ValueError:
            raise ValueError(f"compute_capability must look like '9.0', got {cc!r}") from None
    if isinstance(cc, (int, np.integer)) and not isinstance(cc, bool):
        return (int(cc) // 10, int(cc) % 10) if cc >= 10 else (int(cc), 0)
    if isinstance(cc, (tuple, list)) and len(cc) == 2:
        return int(cc[0]), int(cc[1])
    raise TypeError(f"compute_capability must be '9.0', 90 or (9, 0), got {cc!r}")


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    """What backend selection needs to know about a device.

    platform: "cpu", "cuda", "rocm" or "tpu". compute_capability: (major, minor) on CUDA.
    num_sms: streaming multiprocessors (CUDA `core_count`), used by split planning.
    """

    platform: str
    compute_capability: tuple[int, int] | None = None
    num_sms: int | None = None

    @classmethod
    def from_device(cls, device: Any) -> "DeviceInfo":
        """From a `jax.Device` (reads `platform`, `compute_capability`, `core_count`)."""
        platform = getattr(device, "platform", None)
        if not isinstance(platform, str):
            raise TypeError(f"device must be a jax.Device, got {type(device).__name__}")
        platform = _platform(platform)
        cc = getattr(device, "compute_capability", None)
        cc_t = parse_compute_capability(cc) if (cc is not None and platform == "cuda") else None
        n = getattr(device, "core_count", None)
        return cls(platform, cc_t, int(n) if isinstance(n, (int, np.integer)) else None)

    @classmethod
    def from_platform(cls, platform: str, compute_capability: Any = None) -> "DeviceInfo":
        """From a platform name (jax's "gpu" is "cuda") and a compute capability in any form
        `parse_compute_capability` reads (None: unknown)."""
        if not isinstance(platform, str):
            raise TypeError(f"platform must be a str, got {type(platform).__name__}")
        cc = parse_compute_capability(compute_capability) if compute_capability is not None else None
        return cls(_platform(platform), cc)

    @classmethod
    def default(cls) -> "DeviceInfo":
        """The default JAX device's (`jax.devices()[0]`)."""
        import jax

        return cls.from_device(jax.devices()[0])


def default_num_sms() -> int:
    """SM count of the default device when it is a CUDA GPU (`core_count`), else DEFAULT_NUM_SMS."""
    try:
        info = DeviceInfo.default()
    except Exception:  # noqa: BLE001 - no device to ask: the default stands
        return DEFAULT_NUM_SMS
    if info.platform == "cuda" and info.num_sms is not None and info.num_sms > 0:
        return info.num_sms
    return DEFAULT_NUM_SMS


def gpu_unsupported_reason(majors: tuple[int, ...]) -> str | None:
    """None when jax's default device is a CUDA GPU whose compute-capability major is in `majors`, else why
    not (the availability probe of the GPU kernels, and of `python -m dsv41_jax.info`)."""
    import jax

    backend = jax.default_backend()
    if backend != "gpu":
        return f"the default JAX backend is {backend!r}, not 'gpu'"
    try:
        cc = DeviceInfo.default().compute_capability
    except (TypeError, ValueError) as e:
        return f"cannot read the GPU's compute capability: {e}"
    if cc is None or cc[0] not in majors:
        got = "none" if cc is None else f"{cc[0]}.{cc[1]}"
        return f"the GPU's compute capability is {got}, not {' or '.join(f'{m}.x' for m in majors)}"
    return None
