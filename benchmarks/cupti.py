"""Kernel time per call from CUPTI, for JAX and non-JAX callables alike (FlashMLA through PyTorch).

`kernel_times` records every kernel the process launches (CUPTI's activity records, through jax's Mosaic GPU
extension, the collector `jax.experimental.mosaic.gpu.profiler.measure` uses) while `run()` is called
`iterations` times, each call after `flush()` (an L2 flush: writes a buffer larger than the L2), and returns
the mean per call of the kernels that are not the flush's (their names are learnt from a flush-only pass).
So both libraries of a comparison are timed by the same clock, as the sum of their kernels' durations.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["kernel_times", "available"]


def _ext():
    from jax._src.lib import mosaic_gpu as mosaic_gpu_lib

    return mosaic_gpu_lib._mosaic_gpu_ext


def available() -> str | None:
    """None when CUPTI timing works here, else why not."""
    try:
        import jax

        if jax.default_backend() != "gpu":
            return f"the default JAX backend is {jax.default_backend()!r}, not 'gpu'"
        _ext()
    except Exception as e:  # noqa: BLE001 - any failure means no CUPTI here
        return f"{type(e).__name__}: {e}"
    return None


def _record(fn: Callable[[], None], sync: Callable[[], None]) -> list[tuple[str, float]]:
    ext = _ext()
    ext._cupti_init()
    try:
        fn()
        sync()
    finally:
        timings = ext._cupti_get_timings(True)
    return list(timings or [])


def kernel_times(run: Callable[[], object], *, sync: Callable[[], None], iterations: int,
                 flush: Callable[[], object] | None = None) -> tuple[float, dict[str, float]]:
    """(mean kernel microseconds per call, {kernel name: mean us per call}) of `run()`."""
    skip: set[str] = set()
    if flush is not None:
        flush()
        sync()
        skip = {name for name, _ in _record(flush, sync)}
    run()  # warm-up (compilation, autotuning, first-touch)
    sync()

    def calls():
        for _ in range(iterations):
            if flush is not None:
                flush()
            run()

    per: dict[str, float] = {}
    for name, ms in _record(calls, sync):
        if name not in skip:
            per[name] = per.get(name, 0.0) + 1e3 * ms / iterations
    return sum(per.values()), per
