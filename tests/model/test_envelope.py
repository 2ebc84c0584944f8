"""The engine's envelope of step shapes against a brute-force enumeration of the steps within its limits."""

from __future__ import annotations

import pytest

from dsv41_jax.buckets import BucketPolicy
from dsv41_jax.model.envelope import ServingLimits, StepShape, block_widths, envelope_shapes, step_shape


def reachable(buckets, lim, **kw):
    """Shapes of every step within `lim`: n requests, n_tok tokens (1..max_tokens_per_req each), any longest
    sequence from the largest share of a request up to max_model_len."""
    out = set()
    for n in range(1, lim.max_reqs + 1):
        for n_tok in range(n, min(lim.max_tokens_per_step, n * lim.max_tokens_per_req) + 1):
            for s in range(-(-n_tok // n), lim.max_model_len + 1):
                out.add(step_shape(buckets, num_tokens=n_tok, num_reqs=n, max_seq_len=s, **kw))
    return out


@pytest.mark.parametrize("buckets,lim,kw", [
    (BucketPolicy(min_tokens=2, token_gap=4, min_reqs=1, min_blocks=1), ServingLimits(3, 20, 5, 8),
     dict(block_size=3, comp_block_size=2, ratios=(1, 2))),
    (BucketPolicy(min_tokens=2, token_gap=8, min_reqs=2, min_blocks=2), ServingLimits(5, 33, 2, 7),
     dict(block_size=4, comp_block_size=3, ratios=(2,))),
    (BucketPolicy(), ServingLimits(8, 256, 16, 64), dict(block_size=16, comp_block_size=16, ratios=(1, 2))),
    (BucketPolicy(min_tokens=1, token_gap=2, min_reqs=1, min_blocks=1), ServingLimits(4, 9, 9, 30),
     dict(block_size=1, comp_block_size=1, ratios=())),
])
def test_envelope_is_exactly_the_reachable_shapes(buckets, lim, kw):
    env = envelope_shapes(buckets, lim, **kw)
    assert list(env) == sorted(set(env))
    assert set(env) == reachable(buckets, lim, **kw)


def test_block_widths_follow_the_longest_sequence():
    bp = BucketPolicy()
    assert block_widths(bp, 0, block_size=16, comp_block_size=16, ratios=[2, 1]) == (4, ((1, 4), (2, 4)))
    assert block_widths(bp, 65, block_size=16, comp_block_size=16, ratios=[1, 2]) == (8, ((1, 8), (2, 4)))
    assert block_widths(bp, 130, block_size=16, comp_block_size=16, ratios=[1, 2]) == (16, ((1, 16), (2, 8)))
    # the example's envelope: 4 requests, chunks of 16, sequences up to 128 -> 3 token buckets x 2 width pairs
    env = envelope_shapes(bp, ServingLimits(4, 128, 16, 64), block_size=16, comp_block_size=16, ratios=(1, 2))
    assert [(s.tokens, s.blocks) for s in env] == [(16, 4), (16, 8), (32, 4), (32, 8), (64, 4), (64, 8)]
    assert str(env[0]) == "tokens=16, reqs=8, blocks=4, c1=4, c2=4"
    assert StepShape(16, 8, 4) < StepShape(32, 8, 4)


def test_limits_are_validated():
    with pytest.raises(ValueError, match="ServingLimits.max_model_len must be a positive int, got 0"):
        ServingLimits(1, 0, 1, 1)
