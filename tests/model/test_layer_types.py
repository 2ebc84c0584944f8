"""Layer-type classification (README API contract, vllm_deepseek_v4.md 2.1) and decode plan geometry."""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv41_jax import (
    DecodePlanSpec,
    decode_plan_spec,
    deepseek_v40_layer_type,
    deepseek_v41_layer_type,
    required_layer_types,
)

RATIO_ORDER = {"swaonly": 0, "c1a": 1, "c2a": 2, "c4a": 4, "c128a": 128}


def v41_oracle(r):
    return {0: "swaonly", 1: "c1a", 2: "c2a"}[r]


def v40_oracle(r):
    if r <= 1:
        return "swaonly"
    return {4: "c4a", 128: "c128a"}[r]


# ---------------------------------------------------------------------------- V4.1
@pytest.mark.parametrize("r,want", [(0, "swaonly"), (1, "c1a"), (2, "c2a")])
def test_v41_layer_type_values(r, want):
    assert deepseek_v41_layer_type(r) == want
    assert deepseek_v41_layer_type(np.int64(r)) == want
    assert deepseek_v41_layer_type(np.int32(r)) == want


@pytest.mark.parametrize("r", [3, 4, 128, -1, -2, 5, 64, 1 << 40])
def test_v41_layer_type_rejects_other_ints(r):
    with pytest.raises(ValueError) as e:
        deepseek_v41_layer_type(r)
    msg = str(e.value)
    assert str(r) in msg
    assert "0, 1, or 2" in msg


@pytest.mark.parametrize("r", [None, "1", 1.5, "c1a"])
def test_v41_layer_type_rejects_non_ints_with_value_error(r):
    # Contract: "anything else ValueError naming the value and `0, 1, or 2`".
    with pytest.raises(ValueError) as e:
        deepseek_v41_layer_type(r)
    assert str(r) in str(e.value)
    assert "0, 1, or 2" in str(e.value)


@settings(max_examples=60, deadline=None)
@given(st.integers(-(1 << 20), 1 << 20))
def test_v41_layer_type_any_int(r):
    if r in (0, 1, 2):
        assert deepseek_v41_layer_type(r) == v41_oracle(r)
    else:
        with pytest.raises(ValueError, match=re.escape(str(r))):
            deepseek_v41_layer_type(r)


# ---------------------------------------------------------------------------- V4.0
@pytest.mark.parametrize("r,want", [
    (-5, "swaonly"), (-1, "swaonly"), (0, "swaonly"), (1, "swaonly"), (4, "c4a"), (128, "c128a"),
])
def test_v40_layer_type_values(r, want):
    assert deepseek_v40_layer_type(r) == want
    assert deepseek_v40_layer_type(np.int64(r)) == want


@pytest.mark.parametrize("r", [2, 3, 5, 8, 64, 127, 129, 256])
def test_v40_layer_type_rejects(r):
    with pytest.raises(ValueError, match=re.escape(str(r))):
        deepseek_v40_layer_type(r)


@pytest.mark.parametrize("r", [None, "4", 4.0])
def test_v40_layer_type_rejects_non_ints_with_value_error(r):
    with pytest.raises(ValueError):
        deepseek_v40_layer_type(r)


@settings(max_examples=60, deadline=None)
@given(st.integers(-1000, 1000))
def test_v40_layer_type_any_int(r):
    if r <= 1 or r in (4, 128):
        assert deepseek_v40_layer_type(r) == v40_oracle(r)
    else:
        with pytest.raises(ValueError):
            deepseek_v40_layer_type(r)


def test_raw_ratio_1_differs_between_versions():
    # vllm_deepseek_v4.md 2.1: raw 1 is c1a under V4.1 but swaonly under V4.0; 4/128 rejected under V4.1.
    assert deepseek_v41_layer_type(1) == "c1a"
    assert deepseek_v40_layer_type(1) == "swaonly"
    for r in (4, 128):
        with pytest.raises(ValueError):
            deepseek_v41_layer_type(r)


# -------------------------------------------------------------------- required_layer_types
def test_required_layer_types_default_is_swaonly():
    assert tuple(required_layer_types(None)) == ("swaonly",)
    assert tuple(required_layer_types([])) == ("swaonly",)
    assert tuple(required_layer_types(())) == ("swaonly",)


def test_required_layer_types_v41_flash():
    ratios = [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0]
    assert tuple(required_layer_types(ratios)) == ("swaonly", "c1a", "c2a")
    assert tuple(required_layer_types([2, 2])) == ("c2a",)
    assert tuple(required_layer_types([1])) == ("c1a",)


def test_required_layer_types_v40_flash():
    ratios = [0, 0] + [4, 128] * 20 + [4, 0]
    assert tuple(required_layer_types(ratios, version="v4.0")) == ("swaonly", "c4a", "c128a")
    assert tuple(required_layer_types([1, 1], version="v4.0")) == ("swaonly",)


def test_required_layer_types_errors():
    with pytest.raises(ValueError, match="0, 1, or 2"):
        required_layer_types([0, 4])
    with pytest.raises(ValueError):
        required_layer_types([0, 2], version="v4.0")
    with pytest.raises(ValueError, match="version"):
        required_layer_types([0], version="v5")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from([0, 1, 2]), max_size=50))
def test_required_layer_types_v41_oracle(ratios):
    want = set()
    for r in ratios or [0]:
        want.add(v41_oracle(r))
    got = tuple(required_layer_types(ratios))
    assert set(got) == want and len(got) == len(want)
    assert [RATIO_ORDER[t] for t in got] == sorted(RATIO_ORDER[t] for t in got)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from([-1, 0, 1, 4, 128]), max_size=50))
def test_required_layer_types_v40_oracle(ratios):
    want = {v40_oracle(r) for r in (ratios or [0])}
    got = tuple(required_layer_types(ratios, version="v4.0"))
    assert set(got) == want and len(got) == len(want)
    assert [RATIO_ORDER[t] for t in got] == sorted(RATIO_ORDER[t] for t in got)


# ------------------------------------------------------------------------ decode_plan_spec
def test_decode_plan_spec_geometry():
    kw = dict(window=128, swa_block_size=64, index_topk=512, max_model_len=1 << 20)
    assert decode_plan_spec("swaonly", kernel_block_tokens=64, **kw) == DecodePlanSpec("swaonly", 128, 64, 0, 0)
    assert not decode_plan_spec("swaonly", kernel_block_tokens=64, **kw).has_extra
    # V4.1: states per compressed kernel page = kernel_block_tokens / r (64 on SM90, 128 on SM100)
    assert decode_plan_spec("c1a", kernel_block_tokens=64, **kw) == DecodePlanSpec("c1a", 128, 64, 512, 64)
    assert decode_plan_spec("c2a", kernel_block_tokens=64, **kw) == DecodePlanSpec("c2a", 128, 64, 512, 32)
    assert decode_plan_spec("c2a", kernel_block_tokens=128, **kw) == DecodePlanSpec("c2a", 128, 64, 512, 64)
    assert decode_plan_spec("c2a", kernel_block_tokens=128, **kw).has_extra
    # V4.0: 256-token compressed pages -> C4A 64 states/page, extra_topk = index_topk
    assert decode_plan_spec("c4a", kernel_block_tokens=256, **kw) == DecodePlanSpec("c4a", 128, 64, 512, 64)
    # V4.0 C128A: every compressed entry, padded cdiv(max_len, 128) to a multiple of 128; 2 states/page
    got = decode_plan_spec("c128a", kernel_block_tokens=256, window=128, swa_block_size=64, index_topk=512,
                           max_model_len=1 << 20)
    assert got == DecodePlanSpec("c128a", 128, 64, 8192, 2)
    got = decode_plan_spec("c128a", kernel_block_tokens=256, window=128, swa_block_size=64, index_topk=512,
                           max_model_len=100_000)
    assert got.extra_topk == 896  # cdiv(100000, 128) = 782 -> 896
    assert got.extra_page_block_size == 2


def test_decode_plan_spec_errors():
    kw = dict(window=128, swa_block_size=64, kernel_block_tokens=64, index_topk=512, max_model_len=4096)
    with pytest.raises(ValueError, match="layer_type"):
        decode_plan_spec("c3a", **kw)
    for key in ("window", "swa_block_size", "kernel_block_tokens", "index_topk", "max_model_len"):
        with pytest.raises(ValueError, match=key):
            decode_plan_spec("c1a", **{**kw, key: 0})
        with pytest.raises(TypeError, match=key):
            decode_plan_spec("c1a", **{**kw, key: 1.5})
    with pytest.raises(ValueError, match="kernel_block_tokens"):
        decode_plan_spec("c2a", **{**kw, "kernel_block_tokens": 63})
