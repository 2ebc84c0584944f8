"""`python -m dsv41_jax.info`: what this install can run, and what to do for what it cannot.

Reports the python, jax, jaxlib (and jax CUDA plugin) versions; the devices (platform, kind, compute
capability, SMs) and the SM count split planning uses (`device.default_num_sms`); for each
implementation, in the order `impl="auto"` tries them, whether it imports, whether it can run here,
why not and the fix; the CUDA library (the path it loads from, its build_info.json: archs, nvcc,
commit) and the build tools. It asks the availability probes without building anything
(`cuda_ffi.backend_unavailable_reason(build_missing=False)`) and needs no GPU. `report()` returns the
same as data (`--json` prints it); `dsv41_jax.explain_impl` answers for one call.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import platform
import sys
from typing import Any

__all__ = ["ImplStatus", "DeviceSummary", "Report", "report", "format_report", "main"]

_GPU_FIX = ("run on a CUDA GPU of compute capability 9.x or 10.x with jax's CUDA plugin "
            "(`pip install -e \".[cuda]\"` in a checkout, `pip install \"dsv41-jax[cuda]\"` otherwise)")
_PLUGINS = ("jax-cuda13-plugin", "jax-cuda12-plugin")


@dataclasses.dataclass(frozen=True)
class ImplStatus:
    """One implementation here: importable, usable (can run on the default device), and when it cannot,
    the reason and what to do."""

    impl: str
    importable: bool
    usable: bool
    reason: str | None = None
    fix: str | None = None


@dataclasses.dataclass(frozen=True)
class DeviceSummary:
    """`count` devices alike: their `DeviceInfo` fields (platform, compute capability, SMs) and kind."""

    platform: str
    kind: str
    compute_capability: tuple[int, int] | None
    num_sms: int | None
    count: int


@dataclasses.dataclass(frozen=True)
class Report:
    """Everything `python -m dsv41_jax.info` prints. cuda_library: the path the library loads from (or
    would, once built); cuda_build: its build_info.json, None without one; build_tools: nvcc and cmake
    paths (None: not found); error: why the devices could not be listed, if they could not."""

    dsv41_jax: str
    python: str
    jax: str
    jaxlib: str
    plugins: dict[str, str]
    default_backend: str
    devices: tuple[DeviceSummary, ...]
    planning_sms: int
    impls: tuple[ImplStatus, ...]
    cuda_library: str | None
    cuda_library_present: bool
    cuda_build: dict[str, Any] | None
    build_tools: dict[str, str | None]
    error: str | None = None


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _devices() -> tuple[str, tuple[DeviceSummary, ...], str | None]:
    import jax

    from dsv41_jax.device import DeviceInfo

    try:
        backend, devs = jax.default_backend(), jax.devices()
    except Exception as e:  # noqa: BLE001 - a backend that fails to start is reported, not raised
        return "unavailable", (), f"{type(e).__name__}: {e}"
    groups: dict[tuple, int] = {}
    for dev in devs:
        try:
            info = DeviceInfo.from_device(dev)
        except (TypeError, ValueError):
            info = DeviceInfo.from_platform(dev.platform)
        key = (info.platform, str(getattr(dev, "device_kind", dev.platform)), info.compute_capability, info.num_sms)
        groups[key] = groups.get(key, 0) + 1
    return backend, tuple(DeviceSummary(*key, count=n) for key, n in groups.items()), None


def _gpu_suitable() -> bool:
    """Whether the default device is a GPU the pallas and cuda kernels are written for."""
    from dsv41_jax.device import gpu_unsupported_reason
    from dsv41_jax.sparse_mla.capabilities import CUDA_SPARSE_DSV41

    try:
        return gpu_unsupported_reason(CUDA_SPARSE_DSV41.compute_capability_majors) is None
    except Exception:  # noqa: BLE001 - no readable device: not suitable
        return False


def _import_failed(impl: str, module: str, e: Exception) -> ImplStatus:
    return ImplStatus(impl, False, False, f"import {module} failed: {type(e).__name__}: {e}",
                      "reinstall the package (`pip install -e .` in a checkout); the error names what is missing")


def _pallas_status() -> ImplStatus:
    try:
        import pallas_kernels
    except Exception as e:  # noqa: BLE001 - reported
        return _import_failed("pallas", "pallas_kernels", e)
    why = pallas_kernels.availability_reason()
    return ImplStatus("pallas", True, why is None, why, None if why is None else _GPU_FIX)


def _cuda_status(gpu_ok: bool) -> ImplStatus:
    try:
        import cuda_ffi
        from cuda_ffi import build
    except Exception as e:  # noqa: BLE001 - reported
        return _import_failed("cuda", "cuda_ffi", e)
    why = cuda_ffi.backend_unavailable_reason(build_missing=False)
    if why is None:
        return ImplStatus("cuda", True, True)
    fixes = []
    if not cuda_ffi.library_present():
        fixes.append(build.build_hint())
    elif gpu_ok:  # present and on a suitable GPU, yet refused: it does not load, or lacks this architecture
        fixes.append("rebuild it: `python -m cuda_ffi.build`")
    if not gpu_ok:
        fixes.append(_GPU_FIX)
    return ImplStatus("cuda", True, False, why, "; ".join(fixes))


def report() -> Report:
    """The install's report as data (what `main` prints); builds nothing and needs no GPU."""
    import jax

    import dsv41_jax
    from dsv41_jax.device import default_num_sms
    from dsv41_jax.sparse_mla.capabilities import AUTO_ORDER

    backend, devices, error = _devices()
    gpu_ok = _gpu_suitable()
    status = {"cuda": _cuda_status(gpu_ok), "pallas": _pallas_status(), "xla": ImplStatus("xla", True, True)}
    lib, present, build_info, tools = None, False, None, {"nvcc": None, "cmake": None}
    try:
        import cuda_ffi
        from cuda_ffi import build

        lib, present, build_info = str(cuda_ffi.library_path()), cuda_ffi.library_present(), cuda_ffi.build_info()
        tools = {"nvcc": build.find_nvcc(), "cmake": build.find_cmake()}
    except Exception:  # noqa: BLE001 - its import error is in the cuda status
        pass
    return Report(
        dsv41_jax=dsv41_jax.__version__, python=platform.python_version(), jax=jax.__version__,
        jaxlib=_version("jaxlib") or "?", plugins={p: v for p in _PLUGINS if (v := _version(p))},
        default_backend=backend, devices=devices, planning_sms=default_num_sms(),
        impls=tuple(status[name] for name in AUTO_ORDER), cuda_library=lib, cuda_library_present=present,
        cuda_build=build_info, build_tools=tools, error=error,
    )


def format_report(r: Report) -> str:
    """The report as `python -m dsv41_jax.info` prints it."""
    plugins = "".join(f", {k} {v}" for k, v in r.plugins.items()) or ", no jax CUDA plugin"
    lines = [f"dsv41-jax {r.dsv41_jax}: python {r.python}, jax {r.jax}, jaxlib {r.jaxlib}{plugins}",
             f"default backend: {r.default_backend}" + (f" ({r.error})" if r.error else "")]
    for d in r.devices:
        cc = "" if d.compute_capability is None else ", compute capability %d.%d" % d.compute_capability
        sms = "" if d.num_sms is None else f", {d.num_sms} SMs"
        lines.append(f"  {d.count} x {d.kind} ({d.platform}{cc}{sms})")
    gpu = any(d.num_sms for d in r.devices)
    lines.append(f"split planning: {r.planning_sms} SMs" + ("" if gpu else " (the default: no GPU to ask)"))
    lines.append("implementations, in the order impl='auto' tries them:")
    for s in r.impls:
        state = "usable" if s.usable else ("importable, not usable here" if s.importable else "not importable")
        lines.append(f"  {s.impl:<7}{state}" + (f": {s.reason}" if s.reason else ""))
        if s.fix:
            lines.append(f"  {'':<7}fix: {s.fix}")
    if r.cuda_library is not None:
        lines.append(f"CUDA library: {r.cuda_library}" + ("" if r.cuda_library_present else " (not built)"))
        b = r.cuda_build
        if b:
            commit = (b.get("commit") or "unknown")[:12]
            if b.get("sources_modified"):
                commit += " with modified sources"
            lines.append(f"  built {b.get('built_at', '?')}: archs {', '.join(b.get('archs') or [])}; "
                         f"nvcc {b.get('nvcc') or '?'}; commit {commit}; jax {b.get('jax', '?')}")
        elif r.cuda_library_present:
            lines.append("  no build_info.json beside it (its build is not recorded)")
    lines.append("build tools: " + ", ".join(f"{k} {v or 'not found'}" for k, v in r.build_tools.items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dsv41_jax.info", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    a = ap.parse_args(argv)
    r = report()
    print(json.dumps(dataclasses.asdict(r), indent=1) if a.json else format_report(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
