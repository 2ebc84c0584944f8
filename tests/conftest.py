"""Shared test helpers: a plain-Python transcription of FlashMLA's decode split planner.

Written from the prose of flashmla.md section 3 (one warp, greedy fill), not from any source file.
Used by test_scheduler.py (against `plan_decode_splits`) and test_metadata.py (against the
tile-scheduler plans inside `build_sparse_swa_metadata`).
"""

from __future__ import annotations

import os
import sys

# The sharding tests need 8 simulated CPU devices; the flag only works before JAX initialises.
if "jax" not in sys.modules and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import pytest


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def flashmla_plan_oracle(topk_length, *, topk, num_sm_parts, extra_topk_length=None, extra_topk=None,
                         fixed_overhead=5, block=64):
    """Return (metadata rows as lists of 8 ints, num_splits list of b + 1 ints)."""
    b = len(topk_length)
    has_extra = extra_topk_length is not None or extra_topk is not None
    nblk = []
    for i in range(b):
        n = topk_length[i] if topk_length is not None else topk
        if n == 0:
            n = 1
        if has_extra:
            e = extra_topk_length[i] if extra_topk_length is not None else extra_topk
            n = _cdiv(n, block) * block + e
        nblk.append(max(_cdiv(n, block), 1))
    total = 0
    for n in nblk:
        total += n + fixed_overhead
    payload = _cdiv(total, num_sm_parts) + fixed_overhead

    rows = []
    num_splits = [0] * (b + 1)
    cum = 0
    req, blk, nsplit = 0, 0, 0
    for _part in range(num_sm_parts):
        begin_req, begin_blk, begin_split = req, blk, nsplit
        first = 1 if blk > 0 else 0
        remain = payload
        while req < b:
            left = nblk[req] - blk
            if remain >= left + fixed_overhead:
                cum += nsplit + 1
                num_splits[req + 1] = cum
                remain -= left + fixed_overhead
                req += 1
                blk = 0
                nsplit = 0
            else:
                if remain - fixed_overhead > 0:
                    blk += remain - fixed_overhead
                    nsplit += 1
                    remain = 0
                break
        if blk > 0:
            end_req, end_blk = req, blk
        else:
            end_req = req - 1
            end_blk = nblk[req - 1]
        last = 1 if end_blk != nblk[end_req] else 0
        if begin_req == end_req:
            first = last = 1 if (first or last) else 0
        rows.append([begin_req, end_req, begin_blk, end_blk, begin_split, first, last, 0])
    return rows, num_splits


@pytest.fixture(scope="session")
def plan_oracle():
    return flashmla_plan_oracle
