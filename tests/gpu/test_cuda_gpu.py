"""GPU tests of `impl="cuda"` (our CUDA kernels behind XLA FFI) on an SM90 / SM100 device.

Run on the GPU machine from the repository root:
    python3 -m cuda_ffi.build --archs 90a && PYTHONPATH=. python3 -m pytest -q -m gpu tests/gpu/test_cuda_gpu.py

- the shared decode / prefill grids against the float64 oracle (FlashMLA's tolerances);
- split-heavy shapes (b=4 with topk 2048 + extra 1024, h=128; b=128, s_q=2, h=128, topk=2048)
  against the xla reference;
- poison: every unused cache slot is NaN / 0xFF and indices past topk_length point at them;
- determinism: two runs are bitwise equal.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

if jax.default_backend() != "gpu":
    pytest.skip(f"needs a CUDA GPU: jax.default_backend() is {jax.default_backend()!r}", allow_module_level=True)

import cuda_ffi  # noqa: E402
from dsv41_jax import sparse_mla_decode, sparse_mla_prefill  # noqa: E402
from tests.attention_cases import (  # noqa: E402
    DECODE_GRID,
    PREFILL_GRID,
    assert_close,
    make_decode_case,
    make_prefill_case,
)

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def cuda_library():
    if not cuda_ffi.library_present():
        from cuda_ffi import build

        if build.find_nvcc() is None or build.find_cmake() is None:
            pytest.skip(f"{cuda_ffi.library_path()} is not built and nvcc/cmake are missing")
        build.build_library(archs="90a;100a")
        cuda_ffi.refresh()
    why = cuda_ffi.backend_unavailable_reason()
    if why is not None:
        pytest.skip(why)


def _readable(kw) -> str | None:
    fmts = [kw["fmt"]] + ([kw["extra"]["fmt"]] if kw.get("extra") else [])
    bad = [f for f in fmts if f not in ("bf16", "fp8_ds_mla")]
    return f"the cuda kernels do not read {bad} (impl='auto' falls back to another implementation)" if bad else None


def _decode(case, impl="cuda"):
    f = jax.jit(lambda *a: sparse_mla_decode(*a, impl=impl, **case.kwargs()))
    return f(*case.args())


DECODE_IDS = [n for n, _ in DECODE_GRID]


@pytest.mark.parametrize("name", DECODE_IDS)
def test_decode_grid(name):
    i = DECODE_IDS.index(name)
    kw = DECODE_GRID[i][1]
    if (why := _readable(kw)) is not None:
        pytest.skip(why)
    case = make_decode_case(100 + i, **kw)
    out, lse = _decode(case)
    e_out, e_lse = case.expected()
    assert out.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
    assert_close(out, e_out, "decode_out", f"{name} out")
    assert_close(lse, e_lse, "decode_lse", f"{name} lse")


PREFILL_IDS = [n for n, _ in PREFILL_GRID]


@pytest.mark.parametrize("name", PREFILL_IDS)
def test_prefill_grid(name):
    i = PREFILL_IDS.index(name)
    case = make_prefill_case(200 + i, **PREFILL_GRID[i][1])
    f = jax.jit(lambda *a: sparse_mla_prefill(*a, impl="cuda", **case.kwargs()))
    out, ml, lse = f(*case.args())
    e_out, e_ml, e_lse = case.expected()
    assert_close(out, e_out, "prefill_out", f"{name} out")
    assert_close(ml, e_ml, "prefill_max_logits", f"{name} max_logits")
    assert_close(lse, e_lse, "prefill_lse", f"{name} lse")


def test_prefill_large_sq_two_groups():
    case = make_prefill_case(31, s_q=700, h_q=128, s_kv=1521, topk=512, sink="inf")
    f = jax.jit(lambda *a: sparse_mla_prefill(*a, impl="cuda", **case.kwargs()))
    out, ml, lse = f(*case.args())
    e_out, e_ml, e_lse = case.expected()
    assert_close(out, e_out, "prefill_out", "out")
    assert_close(ml, e_ml, "prefill_max_logits", "max_logits")
    assert_close(lse, e_lse, "prefill_lse", "lse")


@pytest.mark.parametrize("kw", [
    dict(b=4, s_q=2, h_q=128, topk=2048, block_size=64, fmt="fp8_ds_mla", s_kv=4096, lengths="var",
         extra=dict(topk=1024, block_size=2, fmt="fp8_ds_mla", s_kv=3000, lengths="var")),
    dict(b=128, s_q=2, h_q=128, topk=2048, block_size=64, fmt="fp8_ds_mla", s_kv=8192, lengths="full",
         invalid_frac=0.02),
    dict(b=5, s_q=3, h_q=20, topk=1000, block_size=61, fmt="bf16", s_kv=2000,
         extra=dict(topk=200, block_size=64, fmt="bf16")),
], ids=["b4_topk2048_extra1024_h128", "b128_sq2_h128_topk2048", "h20_bf16_extra"])
def test_decode_multi_split_vs_xla(kw):
    case = make_decode_case(41, **kw)
    out, lse = _decode(case)
    r_out, r_lse = _decode(case, impl="xla")
    assert_close(out, np.asarray(r_out, np.float32), "decode_out", "out vs xla")
    assert_close(lse, np.asarray(r_lse), "decode_lse", "lse vs xla")


def test_decode_poison_never_reaches_output():
    # Unused slots are NaN (bf16) / 0xFF (fp8: NaN e4m3 and a 2^128 scale), 40% of the indices are
    # invalid (-1, INT_MIN, INT_MAX, capacity, ...), and positions past topk_length point at unused slots.
    for fmt in ("fp8_ds_mla", "bf16"):
        case = make_decode_case(51, b=16, s_q=2, h_q=64, topk=512, block_size=64, fmt=fmt, invalid_frac=0.4,
                                extra=dict(topk=256, block_size=2, fmt="fp8_ds_mla"))
        out, lse = _decode(case)
        assert not np.isnan(np.asarray(out, np.float32)).any()
        e_out, e_lse = case.expected()
        assert_close(out, e_out, "decode_out", f"{fmt} out")
        assert_close(lse, e_lse, "decode_lse", f"{fmt} lse")


def test_deterministic():
    case = make_decode_case(61, b=32, s_q=2, h_q=128, topk=2048, block_size=64, fmt="fp8_ds_mla", s_kv=4096,
                            extra=dict(topk=512, block_size=64, fmt="fp8_ds_mla"))
    a = _decode(case)
    b = _decode(case)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))
    pcase = make_prefill_case(62, s_q=64, h_q=128, s_kv=4000, topk=1024)
    f = jax.jit(lambda *a: sparse_mla_prefill(*a, impl="cuda", **pcase.kwargs()))
    a, b = f(*pcase.args()), f(*pcase.args())
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))
