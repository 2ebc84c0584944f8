"""What an engine's warm-up and steps cost, as frozen records.

A step's wall time is split in two:
- `device_s`: from dispatching the compiled step until its outputs are ready (`block_until_ready`);
- `host_s`: the rest of the step: scheduling and sampling in `generate`, page allocation, padding into
  buckets and the input transfer (`InferenceEngine.prepare`), reading the logits back.
Compilation is never part of a step: `InferenceEngine.warmup` compiles every step shape ahead of time and
reports its count and seconds in `WarmupStats`.
"""

from __future__ import annotations

import dataclasses

from dsv41_jax.model.envelope import StepShape

__all__ = ["StepTiming", "WarmupStats", "GenerateStats"]


@dataclasses.dataclass(frozen=True)
class StepTiming:
    """One step: `kind` "prefill" or "decode", the real tokens it processed, its shape and its times."""

    kind: str
    num_tokens: int
    shape: StepShape
    host_s: float
    device_s: float

    @property
    def total_s(self) -> float:
        return self.host_s + self.device_s


@dataclasses.dataclass(frozen=True)
class WarmupStats:
    """One warm-up: executables compiled, of the envelope's `num_shapes`, in `seconds` (wall time of lowering and
    compiling), with each compiled shape's own seconds (its lowering and compile; with `compile_threads` > 1
    shapes compile concurrently, so these may sum to more than `seconds`)."""

    num_compiled: int
    num_shapes: int
    seconds: float
    per_shape: tuple[tuple[StepShape, float], ...] = ()
    compile_threads: int = 1


@dataclasses.dataclass(frozen=True)
class GenerateStats:
    """One `generate` call: the warm-up it ran first (None when the engine was warm) and every step."""

    warmup: WarmupStats | None
    steps: tuple[StepTiming, ...]

    def _of(self, kind: str) -> tuple[StepTiming, ...]:
        return tuple(s for s in self.steps if s.kind == kind)

    @property
    def prefill_steps(self) -> tuple[StepTiming, ...]:
        return self._of("prefill")

    @property
    def decode_steps(self) -> tuple[StepTiming, ...]:
        return self._of("decode")

    @staticmethod
    def _rate(steps: tuple[StepTiming, ...], device_only: bool = False) -> float:
        t = sum(s.device_s if device_only else s.total_s for s in steps)
        return sum(s.num_tokens for s in steps) / t if t > 0 else float("nan")

    @property
    def decode_tokens_per_s(self) -> float:
        """Decode tokens over the decode steps' wall time (host + device); no compilation is in it."""
        return self._rate(self.decode_steps)

    @property
    def decode_device_tokens_per_s(self) -> float:
        """Decode tokens over the decode steps' device time only."""
        return self._rate(self.decode_steps, device_only=True)

    @property
    def prefill_tokens_per_s(self) -> float:
        return self._rate(self.prefill_steps)

    def summary(self) -> str:
        """Lines: warm-up (if any), prefill and decode steps with tokens/s and ms per step (host, device)."""
        lines = []
        if self.warmup is not None:
            w = self.warmup
            lines.append(f"warm-up: {w.num_compiled} step shapes compiled in {w.seconds:.1f} s")
        for name, steps in (("prefill", self.prefill_steps), ("decode", self.decode_steps)):
            if not steps:
                continue
            n = len(steps)
            host = 1e3 * sum(s.host_s for s in steps) / n
            dev = 1e3 * sum(s.device_s for s in steps) / n
            lines.append(f"{name}: {n} steps, {sum(s.num_tokens for s in steps)} tokens, "
                         f"{self._rate(steps):.1f} tokens/s ({host + dev:.1f} ms/step: host {host:.1f}, "
                         f"device {dev:.1f})")
        return "\n".join(lines)
