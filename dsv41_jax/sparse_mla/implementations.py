"""The implementation table: which package implements each `impl=` name, loaded on first use.

`IMPLEMENTATIONS` is the one dispatch table of the sparse MLA ops, fixed at import: impl name ->
`Implementation` (the module that implements it). The core imports a backend package only when one of
its implementations is first asked for (downward: the backends import nothing of the dispatch), and a
package that fails to import is left out with the error as its reason.

A backend module implements this contract, read by name on every use (so a test can monkeypatch it):

- `decode(call: DecodeCall) -> (out, lse)` and `prefill(call: PrefillCall) -> (out, max_logits, lse)`;
- optionally `mega_decode(call: MegaDecodeCall)` and `mega_prefill(call: MegaPrefillCall)` -> (out e4m3,
  out_scale, lse) (a module without one has no kernel for that mega op);
- `decode_supports(call)` / `prefill_supports(call)` / `mega_decode_supports(call)` / `mega_prefill_supports(call)`
  -> None, or why the kernel
  refuses this call;
- `installed() -> bool`: the implementation can be traced here (e.g. the CUDA library exists; it
  may still be unable to run on this device, which is what `unavailable_reason` says);
- `unavailable_reason() -> str | None`: None when the kernels can run on the default device, else why not
  and what to do (it may build what is missing, see `cuda_ffi`).

The last four are optional (missing: always yes). Which backends serve a device and a cache format is
the capability side (`BackendSpec.impl` names the implementation, `dsv41_jax.sparse_mla.capabilities`).
The only state here is the memo of loaded modules and import errors.
"""

from __future__ import annotations

import dataclasses
import importlib
import threading
import types
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["Implementation", "IMPLEMENTATIONS", "load", "import_error", "installed", "unavailable_reason",
           "decode_impls", "prefill_impls"]


@dataclasses.dataclass(frozen=True)
class Implementation:
    """One `impl=` name and the module that implements it (the contract in the module docstring)."""

    name: str
    module: str
    doc: str

    def function(self, role: str) -> Callable[..., Any] | None:
        """The module's `role` function (decode, prefill, decode_supports, ...), or None when the module
        does not import or does not define it."""
        mod = load(self.name)
        return None if mod is None else getattr(mod, role, None)


IMPLEMENTATIONS: Mapping[str, Implementation] = types.MappingProxyType({
    "cuda": Implementation("cuda", "cuda_ffi", "CUDA kernels behind XLA FFI (SM90 / SM100)"),
    "pallas": Implementation("pallas", "pallas_kernels", "Pallas Mosaic GPU kernels (SM90 / SM100)"),
    "xla": Implementation("xla", "dsv41_jax.sparse_mla.reference", "the pure-jnp reference: any device"),
})

_lock = threading.Lock()
_loaded: dict[str, types.ModuleType] = {}
_import_errors: dict[str, str] = {}


def load(name: str) -> types.ModuleType | None:
    """The module of implementation `name`, imported once; None when its import fails (`import_error`)."""
    impl = IMPLEMENTATIONS[name]
    with _lock:
        if name in _loaded:
            return _loaded[name]
        if name in _import_errors:
            return None
    try:
        mod = importlib.import_module(impl.module)
    except Exception as e:  # noqa: BLE001 - any failure means the implementation is absent, with this reason
        with _lock:
            _import_errors[name] = f"import {impl.module} failed: {type(e).__name__}: {e}"
        return None
    with _lock:
        _loaded[name] = mod
    return mod


def import_error(name: str) -> str | None:
    """Why implementation `name`'s module does not import (after `load` tried), else None."""
    load(name)
    return _import_errors.get(name)


def installed(name: str) -> bool:
    """Whether implementation `name` can be traced here: its module imports and says it is installed."""
    impl = IMPLEMENTATIONS[name]
    if load(name) is None:
        return False
    check = impl.function("installed")
    return True if check is None else bool(check())


def unavailable_reason(name: str) -> str | None:
    """None when implementation `name` can run on the default device, else why not (an import error, or
    its module's `unavailable_reason`, which never raises through here)."""
    if name not in IMPLEMENTATIONS:
        return f"implementation {name!r} is not registered"
    why = import_error(name)
    if why is not None:
        return why
    check = IMPLEMENTATIONS[name].function("unavailable_reason")
    if check is None:
        return None
    try:
        return check()
    except Exception as e:  # noqa: BLE001 - an availability probe must never break selection
        return f"implementation {name!r} availability check failed: {e}"


def decode_impls() -> tuple[str, ...]:
    """The implementations `sparse_mla_decode(impl=...)` can trace here, in table order."""
    return tuple(name for name in IMPLEMENTATIONS if installed(name))


def prefill_impls() -> tuple[str, ...]:
    """The implementations `sparse_mla_prefill(impl=...)` can trace here, in table order."""
    return tuple(name for name in IMPLEMENTATIONS if installed(name))
