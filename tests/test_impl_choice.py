"""What impl="auto" runs and why: `explain_impl`, and the warning when an accelerator falls back to the reference.

A GPU is simulated by making `DeviceInfo.default()` answer a compute capability 9.0 device and the
backend packages' contract functions (`unavailable_reason`, ...) answer as a test sets them (monkeypatched,
so nothing leaks); the ops themselves still run on the CPU.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsv41_jax as d
import pallas_kernels
from dsv41_jax import kv_cache
from dsv41_jax.device import DeviceInfo
from dsv41_jax.sparse_mla import api, base
from tests.attention_cases import make_decode_case, make_mega_case, make_mega_prefill_case, make_prefill_case

H200 = DeviceInfo("cuda", (9, 0), 132)


def _decode(case, **kw):
    return d.explain_impl(d.sparse_mla_decode, *case.args(), **case.kwargs(), **kw)


@pytest.fixture
def gpu(monkeypatch):
    """A simulated H200 default device whose kernels are all available; `gpu(cuda=..., pallas=...)` sets
    what their availability probes answer."""
    monkeypatch.setenv("DSV41_CUDA_AUTOBUILD", "0")  # nothing here may start a real build
    monkeypatch.setattr(DeviceInfo, "default", classmethod(lambda cls: H200))
    monkeypatch.setattr(api, "_WARNED", set())
    import cuda_ffi
    import pallas_kernels

    # the cuda implementation as it is when its library exists; it never runs here
    monkeypatch.setattr(cuda_ffi, "installed", lambda: True)
    monkeypatch.setattr(cuda_ffi, "decode", lambda c: None)
    monkeypatch.setattr(cuda_ffi, "mega_decode", lambda c: None)
    monkeypatch.setattr(cuda_ffi, "mega_prefill", lambda c: None)
    monkeypatch.setattr(cuda_ffi, "prefill", lambda c: None)

    def set_probes(cuda=None, pallas=None):
        monkeypatch.setattr(cuda_ffi, "unavailable_reason", lambda: cuda)
        monkeypatch.setattr(pallas_kernels, "unavailable_reason", lambda: pallas)

    set_probes()
    return set_probes


def _records(caplog):
    return [r for r in caplog.records if r.name.startswith("dsv41_jax") and r.levelno >= logging.WARNING]


# ------------------------------------------------------------------------------- explain_impl
def test_explain_on_cpu_names_every_candidate_and_matches_what_runs():
    case = make_decode_case(1, h_q=2, topk=64)
    choice = _decode(case)
    assert isinstance(choice, d.ImplChoice) and choice.op == "sparse_mla_decode"
    assert choice.impl == "xla" and choice.device.platform == jax.devices()[0].platform
    assert tuple(c.impl for c in choice.candidates) == d.AUTO_ORDER == ("cuda", "pallas", "xla")
    cuda, pallas, xla = choice.candidates
    assert not cuda.accepted and "FLASHMLA_SPARSE_DSV41" in cuda.reason and "platform 'cpu'" in cuda.reason
    assert not pallas.accepted and "PALLAS_SPARSE_DSV41" in pallas.reason
    assert xla.accepted and choice.declined() == (cuda, pallas)
    assert "runs 'xla'" in str(choice) and "declined" in str(choice)
    # the call record gives the same answer as the op's arguments
    call = base.make_decode_call(case.q, case.kv_cache, case.indices, case.topk_length, case.kv_format,
                                 case.block_size, case.softmax_scale, case.attn_sink, None, None, None, None, None)
    assert d.explain_impl(call) == choice
    p = make_prefill_case(2, h_q=2)
    pc = d.explain_impl("prefill", p.q, p.kv, p.indices, softmax_scale=p.softmax_scale, impl="auto")
    assert pc.op == "sparse_mla_prefill" and pc.impl == "xla"


def test_explain_on_a_gpu_accepts_the_kernels_in_order(gpu):
    choice = _decode(make_decode_case(1, h_q=2, topk=64, fmt="fp8_ds_mla", block_size=64))
    assert choice.impl == "cuda" and choice.device == H200
    assert all(c.accepted for c in choice.candidates)
    assert "FLASHMLA_SPARSE_DSV41 serves" in choice.candidates[0].reason
    # a page size outside FlashMLA's envelope goes to our own CUDA backend
    choice = _decode(make_decode_case(1, h_q=2, topk=64, fmt="bf16", block_size=61))
    assert choice.impl == "cuda" and "CUDA_SPARSE_DSV41 serves" in choice.candidates[0].reason
    # without the cuda library, pallas
    gpu(cuda="cuda_ffi: not built (test)")
    choice = _decode(make_decode_case(1, h_q=2, topk=64))
    assert choice.impl == "pallas" and "not built (test)" in choice.candidates[0].reason
    p = make_prefill_case(2, h_q=2)
    assert d.explain_impl(d.sparse_mla_prefill, p.q, p.kv, p.indices, softmax_scale=p.softmax_scale).impl == "pallas"


def test_explain_on_a_gpu_lists_the_registry_and_the_kernels_reasons(gpu):
    # an mxfp8_ds_mla main cache next to an fp8_ds_mla extra cache: the cuda kernels read one family per call,
    # the pallas kernels any mix
    choice = _decode(make_decode_case(1, h_q=2, topk=64, fmt="mxfp8_ds_mla", block_size=64,
                                      extra=dict(topk=64, block_size=2, fmt="fp8_ds_mla")))
    assert choice.impl == "pallas"
    cuda, pallas, _ = choice.candidates
    # the kernel's own `supports` answer where the registry accepts (CUDA_SPARSE_DSV41 lists both formats)
    assert not cuda.accepted and pallas.accepted
    assert "not both in one call (kv_format 'mxfp8_ds_mla', extra_kv_format 'fp8_ds_mla')" in cuda.reason
    # select_backend's rejection of a backend whose implementation is unavailable: the next one serves the call
    mega = make_mega_case(1, h_q=2, topk=64, fmt="fp8_ds_mla")
    gpu(cuda="cuda_ffi: not built (test)")
    choice = d.explain_impl(d.sparse_mla_mega_decode, *mega.args(), **mega.kwargs())
    assert choice.impl == "pallas"
    cuda, pallas, _ = choice.candidates
    assert "CUDA_SPARSE_DSV41: cuda_ffi: not built (test)" in cuda.reason
    assert pallas.accepted and "PALLAS_SPARSE_DSV41 serves" in pallas.reason, pallas.reason


def test_explain_on_a_gpu_takes_the_v41_records_to_cuda(gpu):
    choice = _decode(make_decode_case(1, h_q=2, topk=64, fmt="mxfp8_ds_mla", block_size=64,
                                      extra=dict(topk=64, block_size=2, fmt="nvfp4_ds_mla")))
    assert choice.impl == "cuda" and "CUDA_SPARSE_DSV41 serves" in choice.candidates[0].reason


def test_explain_a_large_cache_without_allocating_it(gpu):
    """A 3 GiB fp8 cache: the pallas kernels take it (64-bit addresses); asked under eval_shape, nothing is allocated."""
    gpu(cuda="cuda_ffi: not built (test)")
    pb = kv_cache.page_bytes("fp8_ds_mla", 64)
    num_blocks = -(-(3 << 30) // pb)
    got = {}

    def ask(q, cache, idx):
        got["choice"] = d.explain_impl(d.sparse_mla_decode, q, cache, idx, kv_format="fp8_ds_mla", block_size=64,
                                       softmax_scale=0.04)
        return q

    from pallas_kernels import _interpret

    with _interpret.gpu_mode():  # the kernels as a GPU traces them (the interpreter keeps a 2 GiB limit)
        jax.eval_shape(ask, jax.ShapeDtypeStruct((2, 1, 64, 512), jnp.bfloat16),
                       jax.ShapeDtypeStruct((num_blocks, pb), jnp.uint8), jax.ShapeDtypeStruct((2, 1, 64), jnp.int32))
    choice = got["choice"]
    assert choice.impl == "pallas", choice
    assert choice.candidates[1].accepted


def test_mega_decode_runs_the_cuda_kernels_on_hopper_and_the_reference_elsewhere(gpu):
    case = make_mega_case(3, h_q=8, topk=64, fmt="mxfp8_ds_mla", extra=dict(topk=64, block_size=2, fmt="nvfp4_ds_mla"))
    choice = d.explain_impl(d.sparse_mla_mega_decode, *case.args(), **case.kwargs())
    assert choice.op == "sparse_mla_mega_decode" and choice.impl == "cuda", choice
    assert choice.candidates[1].accepted  # pallas serves it too, after cuda
    # pools of both format families: the cuda kernels refuse the call, the pallas kernels run it
    mixed = make_mega_case(4, h_q=8, topk=64, fmt="mxfp8_ds_mla", extra=dict(topk=64, block_size=2, fmt="fp8_ds_mla"))
    choice = d.explain_impl("sparse_mla_mega_decode", *mixed.args(), **mixed.kwargs())
    assert choice.impl == "pallas" and "not both in one call" in choice.candidates[0].reason


def test_mega_decode_on_cpu_is_the_reference():
    case = make_mega_case(5, h_q=4, topk=64, fmt="mxfp8_ds_mla")
    choice = d.explain_impl(d.sparse_mla_mega_decode, *case.args(), **case.kwargs())
    assert choice.impl == "xla" and not choice.candidates[0].accepted
    auto = d.sparse_mla_mega_decode(*case.args(), **case.kwargs())
    ref = d.sparse_mla_mega_decode(*case.args(), **case.kwargs(), impl="xla")
    for a, b in zip(auto, ref):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


def test_mega_prefill_runs_the_cuda_kernels_on_hopper(gpu):
    case = make_mega_prefill_case(6, s_q=3, h_q=8, topk=64)
    choice = d.explain_impl(d.sparse_mla_mega_prefill, *case.args(), **case.kwargs())
    assert choice.op == "sparse_mla_mega_prefill" and choice.impl == "cuda", choice
    assert choice.candidates[1].accepted  # pallas serves it too, after cuda
    assert d.explain_impl("sparse_mla_mega_prefill", *case.args(), **case.kwargs()).impl == "cuda"


def test_mega_prefill_on_cpu_is_the_reference():
    case = make_mega_prefill_case(7, s_q=3, h_q=4, topk=64)
    call = d.explain_impl(d.sparse_mla_mega_prefill, *case.args(), **case.kwargs())
    assert call.impl == "xla" and not call.candidates[0].accepted
    auto = d.sparse_mla_mega_prefill(*case.args(), **case.kwargs())
    ref = d.sparse_mla_mega_prefill(*case.args(), **case.kwargs(), impl="xla")
    for a, b in zip(auto, ref):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


def test_explain_argument_errors():
    case = make_decode_case(1, h_q=2, topk=64)
    with pytest.raises(ValueError, match="op must be"):
        d.explain_impl("mega", *case.args(), **case.kwargs())
    with pytest.raises(ValueError, match="op must be"):
        d.explain_impl(np.zeros(3))
    with pytest.raises(TypeError, match="kv_format"):
        d.explain_impl(d.sparse_mla_decode, *case.args())
    with pytest.raises(ValueError, match="explain_impl explains impl='auto'"):
        _decode(case, impl="cuda")
    with pytest.raises(ValueError, match="impl must be one of"):
        _decode(case, impl="triton")
    with pytest.raises(TypeError, match="q must be bfloat16"):
        d.explain_impl(d.sparse_mla_decode, case.q.astype(jnp.float32), *case.args()[1:], **case.kwargs())
    call = base.make_prefill_call(*(lambda p: (p.q, p.kv, p.indices, p.softmax_scale, None, None))(
        make_prefill_case(2, h_q=2)))
    with pytest.raises(TypeError, match="alone"):
        d.explain_impl(call, softmax_scale=1.0)


# ------------------------------------------------------------------------------- the warning
def test_a_simulated_gpu_fallback_warns_once_per_reason(gpu, caplog, monkeypatch):
    gpu(cuda="cuda_ffi: not built (test)", pallas=None)
    monkeypatch.setattr(pallas_kernels, "mega_decode_supports", lambda call: "declined by the test")
    caplog.set_level(logging.WARNING, logger="dsv41_jax")
    mega = make_mega_case(3, h_q=2, topk=64, fmt="mxfp8_ds_mla")  # no kernel runs it
    out = d.sparse_mla_mega_decode(*mega.args(), **mega.kwargs())
    ref = d.sparse_mla_mega_decode(*mega.args(), **mega.kwargs(), impl="xla")
    for x, y in zip(out, ref):
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))
    (rec,) = _records(caplog)
    msg = rec.getMessage()
    assert "sparse_mla_mega_decode(impl='auto') runs the xla reference on cuda" in msg
    assert "cuda declined: FLASHMLA_SPARSE_DSV41: does not serve the mega interface" in msg
    assert "pallas declined: declined by the test" in msg and "explain_impl" in msg
    d.sparse_mla_mega_decode(*mega.args(), **mega.kwargs())  # the same reasons: no second warning
    assert len(_records(caplog)) == 1
    # another cause warns again: an fp8 cache when neither kernel is available
    gpu(cuda="cuda_ffi: not built (test)", pallas="pallas: broken (test)")
    case = make_decode_case(3, h_q=2, topk=64, fmt="fp8_ds_mla")
    d.sparse_mla_decode(*case.args(), **case.kwargs())
    assert len(_records(caplog)) == 2
    msg = _records(caplog)[1].getMessage()
    assert "cuda declined: FLASHMLA_SPARSE_DSV41, CUDA_SPARSE_DSV41: cuda_ffi: not built (test)" in msg
    assert "pallas declined: PALLAS_SPARSE_DSV41: pallas: broken (test)" in msg
    # a kernel that runs, or an explicit impl="xla", says nothing
    gpu(cuda="cuda_ffi: not built (test)", pallas=None)
    assert d.explain_impl(d.sparse_mla_decode, *case.args(), **case.kwargs()).impl == "pallas"
    d.sparse_mla_decode(*case.args(), **case.kwargs(), impl="xla")
    assert len(_records(caplog)) == 2


def test_the_cpu_reference_is_silent(caplog, monkeypatch):
    monkeypatch.setattr(api, "_WARNED", set())
    caplog.set_level(logging.DEBUG, logger="dsv41_jax")
    case = make_decode_case(4, h_q=2, topk=64, fmt="mxfp8_ds_mla")
    d.sparse_mla_decode(*case.args(), **case.kwargs())
    p = make_prefill_case(4, h_q=2)
    d.sparse_mla_prefill(p.q, p.kv, p.indices, softmax_scale=p.softmax_scale)
    assert _records(caplog) == []


def test_an_explicit_unavailable_impl_says_why(monkeypatch):
    import cuda_ffi

    monkeypatch.setattr(cuda_ffi, "installed", lambda: False)
    monkeypatch.setattr(cuda_ffi, "unavailable_reason", lambda: "cuda_ffi: no library (test); install nvcc")
    case = make_decode_case(5, h_q=2, topk=64)
    with pytest.raises(ValueError, match=r"impl='cuda' is not available here.*no library \(test\); install nvcc"):
        d.sparse_mla_decode(*case.args(), **case.kwargs(), impl="cuda")
