"""BucketPolicy: the padded sizes against loop oracles of the documented policy."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv41_jax import DEFAULT_BUCKETS, BucketPolicy


def tokens_oracle(n, min_tokens, gap):
    """Powers of two (times min_tokens) up to the gap, then multiples of the gap."""
    if n <= gap:
        b = min_tokens
        while b < n:
            b *= 2
        return min(b, gap)
    m = gap
    while m < n:
        m += gap
    return m


def pow2_oracle(n, lo):
    b = lo
    while b < n:
        b *= 2
    return b


@pytest.mark.parametrize("n,want", [
    (0, 16), (1, 16), (15, 16), (16, 16), (17, 32), (33, 64), (300, 512), (511, 512), (512, 512),
    (513, 1024), (1024, 1024), (1025, 1536), (1536, 1536), (1537, 2048), (8192, 8192), (8193, 8704),
])
def test_default_token_buckets(n, want):
    assert DEFAULT_BUCKETS.tokens(n) == want


@pytest.mark.parametrize("n,want", [(0, 8), (1, 8), (8, 8), (9, 16), (100, 128), (256, 256)])
def test_default_req_buckets(n, want):
    assert DEFAULT_BUCKETS.reqs(n) == want


@pytest.mark.parametrize("n,want", [(0, 4), (1, 4), (4, 4), (5, 8), (17, 32), (4096, 4096)])
def test_default_block_buckets(n, want):
    assert DEFAULT_BUCKETS.blocks(n) == want


def test_default_token_bucket_list():
    assert DEFAULT_BUCKETS.token_buckets(3000) == [16, 32, 64, 128, 256, 512, 1024, 1536, 2048, 2560, 3072]
    assert DEFAULT_BUCKETS.token_buckets(1) == [16]


policies = st.builds(
    lambda mt, gap_mult, mr, mb: BucketPolicy(min_tokens=mt, token_gap=mt * gap_mult, min_reqs=mr, min_blocks=mb),
    st.sampled_from([1, 2, 3, 8, 16, 24]), st.sampled_from([1, 2, 5, 32]),
    st.integers(1, 16), st.integers(1, 16),
)


@settings(max_examples=60, deadline=None)
@given(policy=policies, n=st.integers(0, 20000))
def test_buckets_match_oracle(policy, n):
    t = policy.tokens(n)
    assert t == tokens_oracle(n, policy.min_tokens, policy.token_gap)
    assert t >= n
    assert policy.tokens(t) == t  # a bucket size is its own bucket
    assert policy.tokens(n + 1) >= t  # monotone
    r = policy.reqs(n)
    assert r == pow2_oracle(n, policy.min_reqs) and r >= n and policy.reqs(r) == r
    b = policy.blocks(n)
    assert b == pow2_oracle(n, policy.min_blocks) and b >= n and policy.blocks(b) == b


@settings(max_examples=30, deadline=None)
@given(policy=policies, max_tokens=st.integers(1, 3000))
def test_token_bucket_list_is_every_bucket(policy, max_tokens):
    want = []
    for n in range(1, max_tokens + 1):
        b = tokens_oracle(n, policy.min_tokens, policy.token_gap)
        if b not in want:
            want.append(b)
    assert policy.token_buckets(max_tokens) == want


def test_count_errors():
    with pytest.raises(ValueError, match="num_tokens"):
        DEFAULT_BUCKETS.tokens(-1)
    with pytest.raises(TypeError, match="num_tokens"):
        DEFAULT_BUCKETS.tokens(3.0)
    with pytest.raises(TypeError, match="num_reqs"):
        DEFAULT_BUCKETS.reqs(True)
    with pytest.raises(ValueError, match="num_blocks"):
        DEFAULT_BUCKETS.blocks(-4)


@pytest.mark.parametrize("kw,key", [
    (dict(min_tokens=0), "min_tokens"),
    (dict(token_gap=-1), "token_gap"),
    (dict(min_reqs=0), "min_reqs"),
    (dict(min_blocks=2.0), "min_blocks"),
    (dict(min_reqs=True), "min_reqs"),
    (dict(min_tokens=1024, token_gap=512), "min_tokens"),
])
def test_policy_errors(kw, key):
    with pytest.raises(ValueError, match=key):
        BucketPolicy(**kw)
