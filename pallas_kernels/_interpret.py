"""The one place that touches Mosaic GPU interpret mode (running `plgpu.kernel`s on the CPU).

Three modes decide how this package's kernels are traced:

- `interpret_mode()`: every `plgpu.kernel` traced inside runs in Mosaic GPU interpret mode
  (memories, warpgroups, barriers and TMA simulated on the host, `plgpu.InterpretGPUParams`).
- `gpu_mode()`: kernels are built for a real GPU even when the default backend is the CPU, for
  cross-lowering (`jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))`).
- neither (the default): interpret when `jax.default_backend() != "gpu"`, so `impl="pallas"`
  works (slowly) on a CPU-only machine; `impl="auto"` never picks it there (see
  `pallas_kernels.availability_reason`).

`active()` tells the kernel builders whether they are being traced for the interpreter, which
lacks three things the GPU path uses (wgmma A operands in registers, storing into a wgmma
accumulator, `plgpu.inline_mgpu`, which the gather in `_gather.py` is written with; see
`_kernel.py`); the builders then emit an equivalent formulation. The mode is
read at trace time and is not part of `jax.jit`'s cache key: trace a fresh function per mode.

Caveat: the interpreter runs every warpgroup of a block as a host thread that blocks inside XLA
host callbacks (barrier waits). When XLA's CPU thread pool has fewer threads than there are
blocked warpgroups -- on a 2-core machine -- a kernel can deadlock. Set `NPROC=16` (it sizes
that pool) in the environment before JAX initialises its CPU backend; the CPU tests run their
interpret cases in a subprocess that does so.
"""

from __future__ import annotations

import contextlib
import threading

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu

__all__ = ["interpret_mode", "gpu_mode", "active", "kernel_context", "races_found"]

_state = threading.local()


def _mode() -> str | None:
    return getattr(_state, "mode", None)


@contextlib.contextmanager
def _set_mode(mode: str):
    prev = _mode()
    _state.mode = mode
    try:
        yield
    finally:
        _state.mode = prev


@contextlib.contextmanager
def interpret_mode(**params):
    """Trace the package's kernels for Mosaic GPU interpret mode inside this block.

    `params` go to `plgpu.InterpretGPUParams` (e.g. `detect_races=True`).
    """
    with _set_mode("interpret"), plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams(**params)):
        yield


@contextlib.contextmanager
def gpu_mode():
    """Trace the package's kernels for a real GPU (Mosaic GPU custom call), whatever the backend."""
    with _set_mode("gpu"):
        yield


def active() -> bool:
    """True when kernels traced now will be interpreted."""
    mode = _mode()
    if mode is not None:
        return mode == "interpret"
    return jax.default_backend() != "gpu"


@contextlib.contextmanager
def kernel_context():
    """Wrap a kernel's trace: enters interpret mode when `active()` by default (no explicit mode)."""
    if _mode() is None and active():
        with interpret_mode():
            yield
    else:
        yield


def races_found() -> bool:
    """Whether the interpreter's race detector (`interpret_mode(detect_races=True)`) reported a race."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks  # private: jax 0.11.2 has no public accessor

    try:
        return bool(gpu_callbacks.get_races().races_found)
    except AssertionError:  # no kernel ran with race detection
        return False
