"""The step shapes an engine can meet: its serving limits mapped through the bucket policy.

A step's shape (`StepShape`) is what its compiled executable is specialised to: the token bucket, the
request bucket, the SWA block-table width and one compressed block-table width per compress ratio. The
widths follow from the longest sequence in the step (`block_widths`), as every request holds exactly the
pages its sequence needs. `envelope_shapes` lists every shape a step within the limits can have:

- tokens: each token bucket of 1 .. `max_tokens_per_step` tokens;
- requests: each bucket of 1 .. `max_reqs` requests;
- a (tokens, requests) pair only when some step fits it: at least one token per request and at most
  `max_tokens_per_req` tokens per request;
- block tables: every width combination of a longest sequence from the shortest such a step allows
  (its tokens spread evenly over its requests) up to `max_model_len`.
The list is exact: every shape in it is the shape of some step within the limits.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from dsv41_jax.buckets import BucketPolicy

__all__ = ["StepShape", "ServingLimits", "block_widths", "step_shape", "envelope_shapes"]


@dataclasses.dataclass(frozen=True, order=True)
class StepShape:
    """The padded sizes of one step; `comp_blocks` holds (compress ratio, width) by ascending ratio."""

    tokens: int
    reqs: int
    blocks: int
    comp_blocks: tuple[tuple[int, int], ...] = ()

    def __str__(self) -> str:
        comp = "".join(f", c{r}={w}" for r, w in self.comp_blocks)
        return f"tokens={self.tokens}, reqs={self.reqs}, blocks={self.blocks}{comp}"


@dataclasses.dataclass(frozen=True)
class ServingLimits:
    """What an engine serves: requests at once, tokens per sequence, per request per step, per step."""

    max_reqs: int
    max_model_len: int
    max_tokens_per_req: int
    max_tokens_per_step: int

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"ServingLimits.{f.name} must be a positive int, got {v!r}")


def block_widths(buckets: BucketPolicy, max_seq_len: int, *, block_size: int, comp_block_size: int,
                 ratios: Sequence[int]) -> tuple[int, tuple[tuple[int, int], ...]]:
    """(SWA width, ((ratio, compressed width), ...)) of a step whose longest sequence has `max_seq_len` tokens."""
    swa = buckets.blocks(max(-(-max_seq_len // block_size), 1))
    comp = tuple((r, buckets.blocks(max(-(-(max_seq_len // r) // comp_block_size), 1))) for r in sorted(ratios))
    return swa, comp


def step_shape(buckets: BucketPolicy, *, num_tokens: int, num_reqs: int, max_seq_len: int, block_size: int,
               comp_block_size: int, ratios: Sequence[int]) -> StepShape:
    """The shape of a step with these real sizes."""
    swa, comp = block_widths(buckets, max_seq_len, block_size=block_size, comp_block_size=comp_block_size,
                             ratios=ratios)
    return StepShape(buckets.tokens(max(num_tokens, 1)), buckets.reqs(max(num_reqs, 1)), swa, comp)


def _runs(f, hi: int) -> list[tuple[object, int, int]]:
    """(value, first, last) of each run of the non-decreasing `f` over 1..hi, found by binary search (a
    handful of calls per run, so long contexts and large step budgets cost no more than a few)."""
    out, lo = [], 1
    while lo <= hi:
        v = f(lo)
        a, b = lo, hi  # the last n >= lo with f(n) == v
        while a < b:
            m = (a + b + 1) // 2
            if f(m) == v:
                a = m
            else:
                b = m - 1
        out.append((v, lo, a))
        lo = a + 1
    return out


def envelope_shapes(buckets: BucketPolicy, limits: ServingLimits, *, block_size: int, comp_block_size: int,
                    ratios: Sequence[int]) -> tuple[StepShape, ...]:
    """Every step shape within `limits`, sorted (see the module doc)."""
    lim = limits
    # every width is non-decreasing in the sequence length, so equal width tuples form runs
    widths = _runs(lambda s: block_widths(buckets, s, block_size=block_size, comp_block_size=comp_block_size,
                                          ratios=ratios), lim.max_model_len)
    shapes = set()
    for t, t_lo, t_hi in _runs(buckets.tokens, lim.max_tokens_per_step):
        for r, r_lo, r_hi in _runs(buckets.reqs, lim.max_reqs):
            # the shortest longest-sequence of a step of n requests and n_tok tokens in these buckets, each
            # request with 1 .. max_tokens_per_req tokens: its largest share, ceil(n_tok / n)
            shortest = None
            for n in range(r_lo, min(r_hi, t_hi) + 1):
                n_tok = max(t_lo, n)
                if n_tok <= min(t_hi, n * lim.max_tokens_per_req):
                    s = -(-n_tok // n)
                    shortest = s if shortest is None else min(shortest, s)
            if shortest is None:
                continue  # no step has these buckets
            for (swa, comp), _, s1 in widths:
                if s1 >= shortest:
                    shapes.add(StepShape(t, r, swa, comp))
    return tuple(sorted(shapes))
