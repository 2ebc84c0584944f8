"""CPU tests of the `impl="pallas"` Mosaic GPU kernels (pallas_kernels/).

1. Interpret mode: each kernel runs at small shapes in Mosaic GPU interpret mode against the
   float64 oracle of tests/attention_cases.py (`assert_close`, FlashMLA's tolerances): fp8_ds_mla
   and bf16 caches, an extra cache with its own page size and format, variable / zero lengths,
   invalid indices (-1, INT_MIN, INT_MAX, capacity), NaN-poisoned unused slots, sinks of +-inf,
   padded head counts, several splits (partial outputs + combine), prefill with s_kv < topk; two
   cases (decode fp8, prefill bf16, several blocks each) also run the interpreter's race detector.
   The interpreter runs each warpgroup of a block as a host thread that blocks inside XLA
   callbacks, which deadlocks when XLA's CPU thread pool has fewer threads than there are
   blocked warpgroups (2-core machines). The cases therefore run in one worker subprocess
   started with `NPROC=16` (sizes that pool) and a timeout, overlapping the in-process tests;
   each test reads its case's result.
2. Lowering: every kernel variant is lowered for CUDA on the CPU
   (`jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))`), which runs Mosaic GPU's
   layout / tiling / transfer checks that the interpreter skips; the Mosaic GPU custom call must
   appear in the module.
3. Registration: importing the package touches no GPU, `supports` refuses the formats the kernels
   do not read, the availability probe reports the CPU as unavailable.
4. Static checks and operands: SMEM and registers of each kernel kind within the Hopper limits,
   argument errors of the gather, the operand type choice, and the XLA-side fp8 scale factors
   against the cache bytes. The GPU-only gather (`_gather.py`, inline PTX) is lowered here but
   only runs in tests/gpu/test_pallas_gpu.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER_TIMEOUT_S = 300

# id -> (kind, case kwargs, forced num_splits or None, detect races[, kernel_options])
# Operands: decode runs with bf16 operands by default, prefill too at these sizes (kv larger than the
# work: `prefill_rows_f16`); the options force f16 operands on some cases.
CASES = {
    "decode_fp8_p61_sinkinf_b2": ("decode", dict(fmt="fp8_ds_mla", block_size=61, topk=128, h_q=16, b=2, s_q=1,
                                                  s_kv=300, sink="inf"), None, False, dict(f16=True)),
    "decode_bf16_extra_fp8_sq2": ("decode", dict(fmt="bf16", block_size=32, topk=64, h_q=64, b=1, s_q=2,
                                                  extra=dict(topk=64, block_size=61, fmt="fp8_ds_mla")), None, False),
    "decode_fp8_p2_extra_invalid_rows": ("decode", dict(fmt="fp8_ds_mla", block_size=2, topk=64, h_q=8, b=3, s_q=1,
                                                        all_invalid_row=True,
                                                        extra=dict(topk=128, block_size=2, fmt="fp8_ds_mla")),
                                         None, False),
    "decode_fp8_zero_lengths": ("decode", dict(fmt="fp8_ds_mla", block_size=64, topk=64, h_q=8, b=2, s_q=1,
                                               lengths="zero"), None, False),
    "decode_fp8_h3_full_nosink": ("decode", dict(fmt="fp8_ds_mla", block_size=64, topk=128, h_q=3, b=1, s_q=1,
                                                 lengths="full", invalid_frac=0.0, sink="none"), None, False),
    "decode_fp8_splits3_races": ("decode", dict(fmt="fp8_ds_mla", block_size=64, topk=256, h_q=16, b=1, s_q=1,
                                                s_kv=400, sink="inf"), 3, True, dict(f16=True)),
    "decode_bf16_skv_lt_topk_splits2": ("decode", dict(fmt="bf16", block_size=16, topk=128, h_q=8, b=2, s_q=1,
                                                       s_kv=40), 2, False, dict(f16=True)),
    "prefill_h128_sinkinf": ("prefill", dict(s_q=2, h_q=128, topk=128, s_kv=200, sink="inf"), None, False,
                             dict(f16=True)),
    "prefill_skv_lt_topk_invalid_row": ("prefill", dict(s_q=3, h_q=16, topk=128, s_kv=60, all_invalid_row=True),
                                        None, False),
    "prefill_zero_lengths_scale_half": ("prefill", dict(s_q=2, h_q=8, topk=64, s_kv=100, lengths="zero",
                                                        softmax_scale=0.5), None, False),
    "prefill_no_lengths_splits2_races": ("prefill", dict(s_q=1, h_q=16, topk=256, s_kv=300, lengths="none"), 2, True,
                                         dict(f16=True)),
    # V4.1 records: mxfp8_ds_mla and nvfp4_ds_mla pools, next to each other and next to a V4 pool (one kernel reads
    # any mix), both operand types
    "decode_mx_p61_extra_nv_p2_sinkinf": ("decode", dict(fmt="mxfp8_ds_mla", block_size=61, topk=128, h_q=16, b=2,
                                                         s_q=1, s_kv=300, sink="inf",
                                                         extra=dict(topk=64, block_size=2, fmt="nvfp4_ds_mla",
                                                                    lengths="var")), None, False),
    "decode_nv_extra_mx_invalid_rows_f16": ("decode", dict(fmt="nvfp4_ds_mla", block_size=64, topk=64, h_q=8, b=3,
                                                           s_q=1, all_invalid_row=True,
                                                           extra=dict(topk=128, block_size=69, fmt="mxfp8_ds_mla")),
                                            None, False, dict(f16=True)),
    "decode_mx_extra_fp8_splits2": ("decode", dict(fmt="mxfp8_ds_mla", block_size=64, topk=128, h_q=8, b=1, s_q=2,
                                                   s_kv=300, extra=dict(topk=64, block_size=2, fmt="fp8_ds_mla")),
                                    2, False),
    # every code of a V4.1 format dequantized exactly (tests/attention_cases.make_v41_exact_decode_case; 16 query
    # tokens, 8192 values: every e2m1 / e4m3 code, most scale bytes)
    "exact_nvfp4": ("decode_exact", dict(fmt="nvfp4_ds_mla"), None, False),
    "exact_nvfp4_f16": ("decode_exact", dict(fmt="nvfp4_ds_mla"), None, False, dict(f16=True)),
    "exact_mxfp8": ("decode_exact", dict(fmt="mxfp8_ds_mla"), None, False),
    "exact_mxfp8_f16": ("decode_exact", dict(fmt="mxfp8_ds_mla"), None, False, dict(f16=True)),
    # the mega ops (q RoPE in the kernel; with one split the inverse RoPE and the e4m3 output in its epilogue, with
    # several the combine's): the decode over V4.1, fp8_ds_mla and bf16 pools, the prefill, partial head groups
    "mega_mx_nv_sinkinf": ("mega_decode", dict(fmt="mxfp8_ds_mla", block_size=256, topk=128, s_kv=400, h_q=64, b=3,
                                               sink="inf", extra=dict(topk=192, block_size=64, fmt="nvfp4_ds_mla",
                                                                      lengths="var")), None, False),
    "mega_fp8_h100_splits2": ("mega_decode", dict(fmt="fp8_ds_mla", block_size=64, topk=64, h_q=100, b=2,
                                                  invalid_frac=0.3, extra=dict(topk=128, block_size=69,
                                                                               fmt="fp8_ds_mla")), 2, False),
    "mega_bf16_h8_f16_invalid_row": ("mega_decode", dict(fmt="bf16", block_size=32, topk=128, h_q=8, b=3,
                                                         all_invalid_row=True), None, False, dict(f16=True)),
    "mega_exact": ("mega_exact", dict(h_q=64), None, False),
    "mega_exact_f16": ("mega_exact", dict(h_q=64), None, False, dict(f16=True)),
    "mega_prefill_h128_sinkinf": ("mega_prefill", dict(s_q=2, h_q=128, s_kv=200, topk=192, sink="inf"), None, False),
    "mega_prefill_h100_zero_len_f16": ("mega_prefill", dict(s_q=3, h_q=100, s_kv=150, topk=64, lengths="zero"), None,
                                       False, dict(f16=True)),
    # persistent CTAs (`kernel_options(ctas=N)`, fewer CTAs than items): each CTA loops over its items with the ring
    # and the barriers carried across them; empty items (zero lengths, an all-invalid row), split partials, the
    # deferred bf16 publish, the mega epilogue
    "decode_fp8_h128_sq2_ctas3_races": ("decode", dict(fmt="fp8_ds_mla", block_size=64, topk=128, h_q=128, b=2,
                                                       s_q=2, s_kv=300, sink="inf"), None, True, dict(ctas=3)),
    "decode_bf16_extra_fp8_invalid_row_ctas2": ("decode", dict(fmt="bf16", block_size=32, topk=64, h_q=16, b=4,
                                                               s_q=1, all_invalid_row=True, lengths=[0, 64, 17, 5],
                                                               extra=dict(topk=64, block_size=61, fmt="fp8_ds_mla",
                                                                          lengths="zero")), None, False,
                                                dict(ctas=2)),
    "decode_fp8_splits2_ctas3": ("decode", dict(fmt="fp8_ds_mla", block_size=64, topk=256, h_q=8, b=2, s_q=1,
                                                s_kv=400), 2, False, dict(ctas=3)),
    "prefill_h128_f16_ctas4_races": ("prefill", dict(s_q=3, h_q=128, topk=128, s_kv=200, sink="inf"), None, True,
                                     dict(f16=True, ctas=4)),
    "prefill_zero_lengths_ctas2": ("prefill", dict(s_q=5, h_q=8, topk=64, s_kv=100, lengths="zero"), None, False,
                                   dict(ctas=2)),
    "mega_mx_nv_ctas2_races": ("mega_decode", dict(fmt="mxfp8_ds_mla", block_size=256, topk=128, s_kv=400, h_q=64,
                                                   b=3, sink="inf", extra=dict(topk=128, block_size=64,
                                                                               fmt="nvfp4_ds_mla", lengths="var")),
                               None, True, dict(ctas=2)),
    # with a plan and batch_invariant=True (one split where the heuristic picks two): a sub-batch's rows are
    # bitwise the rows of the whole batch
    "decode_fp8_plan_batch_invariant": ("decode_invariant", dict(fmt="fp8_ds_mla", block_size=64, topk=512, h_q=8, b=3,
                                                                 s_q=1, s_kv=700), None, False),
}


# ----------------------------------------------------------------------------- the worker
def _run_case(name: str) -> dict:
    """Runs one case in interpret mode (in a worker process) and checks it against the oracle."""
    import jax

    import dsv41_jax as d
    import pallas_kernels
    from pallas_kernels import _interpret
    from tests.attention_cases import (assert_mega_close, assert_mega_exact, assert_v41_exact, make_decode_case,
                                       make_mega_case, make_mega_exact_case, make_mega_prefill_case, make_prefill_case,
                                       make_v41_exact_decode_case)

    kind, kw, splits, races, *opts = CASES[name]
    seed = sum(map(ord, name))
    t0 = time.time()
    with (_interpret.interpret_mode(detect_races=races), pallas_kernels.num_splits_override(splits),
          pallas_kernels.kernel_options(**(opts[0] if opts else {}))):
        if kind == "decode":
            case = make_decode_case(seed, **kw)
            res = jax.jit(lambda *a: d.sparse_mla_decode(*a, **case.kwargs(), impl="pallas"))(*case.args())
        elif kind == "decode_exact":
            case, want = make_v41_exact_decode_case(kw["fmt"], n=16)
            res = jax.jit(lambda *a: d.sparse_mla_decode(*a, **case.kwargs(), impl="pallas"))(*case.args())
            assert_v41_exact(res[0], want)
        elif kind == "decode_invariant":
            case = make_decode_case(seed, **kw)
            q, cache, idx, tl = case.args()
            plan = d.make_decode_plan(tl, s_q=1, num_heads=kw["h_q"], topk=kw["topk"], batch_invariant=True)
            f = jax.jit(lambda p, q, i, t: d.sparse_mla_decode(q, cache, i, t, **case.kwargs(), impl="pallas", plan=p))
            res = jax.block_until_ready(f(plan, q, idx, tl))
            sub = np.array([2, 0])
            plan_sub = d.make_decode_plan(tl[sub], s_q=1, num_heads=kw["h_q"], topk=kw["topk"], batch_invariant=True)
            part = jax.block_until_ready(f(plan_sub, q[sub], idx[sub], tl[sub]))
            for x, y in zip(res, part):
                np.testing.assert_array_equal(np.asarray(x, np.float32)[sub], np.asarray(y, np.float32))
        elif kind == "mega_decode":
            case = make_mega_case(seed, **kw)
            res = jax.jit(lambda *a: d.sparse_mla_mega_decode(*a, **case.kwargs(), impl="pallas"))(*case.args())
        elif kind == "mega_exact":
            case, want = make_mega_exact_case(kw["h_q"])
            res = jax.jit(lambda *a: d.sparse_mla_mega_decode(*a, **case.kwargs(), impl="pallas"))(*case.args())
            assert_mega_exact(res[0], res[1], want, name)
        elif kind == "mega_prefill":
            case = make_mega_prefill_case(seed, **kw)
            res = jax.jit(lambda *a: d.sparse_mla_mega_prefill(*a, **case.kwargs(), impl="pallas"))(*case.args())
        else:
            case = make_prefill_case(seed, **kw)
            res = jax.jit(lambda *a: d.sparse_mla_prefill(*a, **case.kwargs(), impl="pallas"))(*case.args())
        res = jax.block_until_ready(res)
    if kind in ("decode_exact", "mega_exact"):
        pass  # checked exactly above
    elif kind.startswith("mega"):
        assert_mega_close(*res, case.expected(), name, kind=kind.removeprefix("mega_"))
    elif kind != "prefill":
        case.check(*res, name)
    else:
        case.check(res, name)
    out = res[0]
    assert not np.isnan(np.asarray(out, np.float32)).any(), "NaN in the output"
    if races:
        assert not _interpret.races_found(), "the interpreter's race detector reported a race"
    return {"secs": round(time.time() - t0, 1)}


def _worker(names: list[str]) -> None:
    for name in names:
        try:
            info = _run_case(name)
            rec = {"name": name, "ok": True, **info}
        except BaseException as e:  # report and go on with the next case
            rec = {"name": name, "ok": False, "error": f"{type(e).__name__}: {e}"[:4000]}
        print("RESULT " + json.dumps(rec), flush=True)


# ------------------------------------------------------------------------------ the parent
class _Worker:
    """One worker subprocess running every interpret case (one process: parallel workers would only
    compete for the cores of a small machine). Started by the first test of this module so that the in-process lowering
    tests overlap with it; `results()` waits for it (with a timeout)."""

    def __init__(self, names: list[str]):
        env = dict(os.environ, NPROC="16", JAX_PLATFORMS="cpu",
                   PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", ",".join(names)],
                                     cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.started = time.time()
        self._done = None

    def results(self):
        if self._done is None:
            try:
                out, _ = self.proc.communicate(timeout=max(WORKER_TIMEOUT_S - (time.time() - self.started), 1))
            except subprocess.TimeoutExpired:
                self.proc.kill()
                out, _ = self.proc.communicate()
                out += f"\n[worker killed after {WORKER_TIMEOUT_S} s]"
            res = {}
            for line in out.splitlines():
                if line.startswith("RESULT "):
                    rec = json.loads(line[len("RESULT "):])
                    res[rec["name"]] = rec
            self._done = (res, out)
        return self._done


@pytest.fixture(scope="module", autouse=True)
def interpret_worker(request):
    """The worker, running the interpret cases whose tests are selected (none: no worker)."""
    names = [it.callspec.params["name"] for it in request.session.items if getattr(it, "module", None) is request.module
             and getattr(it, "originalname", "") == "test_interpret_matches_oracle"]
    w = _Worker(names) if names else None
    yield w
    if w is not None and w.proc.poll() is None:
        w.proc.kill()
        w.proc.communicate()


# ------------------------------------------------------------------------------- lowering
LOWER_CASES = {
    "decode_fp8": ("decode", dict(fmt="fp8_ds_mla", block_size=64, topk=128, h_q=64, b=2, s_q=2), None),
    "decode_bf16_extra_fp8_splits": ("decode", dict(fmt="bf16", block_size=32, topk=128, h_q=128, b=1, s_q=1,
                                                    extra=dict(topk=128, block_size=61, fmt="fp8_ds_mla")), 2),
    "decode_fp8_extra_fp8_h3": ("decode", dict(fmt="fp8_ds_mla", block_size=69, topk=64, h_q=3, b=1, s_q=1,
                                               sink="none", extra=dict(topk=64, block_size=2, fmt="fp8_ds_mla")), None),
    "prefill_bf16": ("prefill", dict(s_q=4, h_q=128, topk=128, s_kv=300), None),
    "prefill_bf16_splits": ("prefill", dict(s_q=1, h_q=64, topk=256, s_kv=300, sink="none"), 3),
    "prefill_f16": ("prefill", dict(s_q=4, h_q=128, topk=128, s_kv=300), None, dict(f16=True)),
    "decode_fp8_f16": ("decode", dict(fmt="fp8_ds_mla", block_size=64, topk=128, h_q=64, b=2, s_q=2), None,
                       dict(f16=True)),
    "decode_mx_extra_nv": ("decode", dict(fmt="mxfp8_ds_mla", block_size=256, topk=128, h_q=64, b=2, s_q=2,
                                          extra=dict(topk=128, block_size=64, fmt="nvfp4_ds_mla")), None),
    "decode_nv_extra_fp8_f16_splits": ("decode", dict(fmt="nvfp4_ds_mla", block_size=61, topk=128, h_q=128, b=1,
                                                      s_q=1, extra=dict(topk=64, block_size=2, fmt="fp8_ds_mla")),
                                       2, dict(f16=True)),
    "decode_mx_f16": ("decode", dict(fmt="mxfp8_ds_mla", block_size=64, topk=128, h_q=8, b=2, s_q=2), None,
                      dict(f16=True)),
    "mega_decode_mx_nv": ("mega_decode", dict(fmt="mxfp8_ds_mla", block_size=256, topk=128, h_q=64, b=2,
                                              extra=dict(topk=128, block_size=64, fmt="nvfp4_ds_mla")), None),
    "mega_decode_fp8_h100_splits": ("mega_decode", dict(fmt="fp8_ds_mla", block_size=64, topk=128, h_q=100, b=2),
                                    2),
    "mega_decode_bf16_f16": ("mega_decode", dict(fmt="bf16", block_size=32, topk=128, h_q=128, b=2), None,
                             dict(f16=True)),
    "mega_prefill": ("mega_prefill", dict(s_q=4, h_q=128, topk=128, s_kv=300), None),
    "mega_prefill_f16": ("mega_prefill", dict(s_q=4, h_q=64, topk=128, s_kv=300), None, dict(f16=True)),
    # persistent CTAs (fewer CTAs than items: each loops over its items)
    "decode_fp8_ctas3": ("decode", dict(fmt="fp8_ds_mla", block_size=64, topk=128, h_q=128, b=2, s_q=2), None,
                         dict(ctas=3)),
    "decode_bf16_extra_fp8_splits_ctas3": ("decode", dict(fmt="bf16", block_size=32, topk=128, h_q=128, b=1, s_q=1,
                                                          extra=dict(topk=128, block_size=61, fmt="fp8_ds_mla")), 2,
                                           dict(ctas=3)),
    "prefill_f16_ctas5": ("prefill", dict(s_q=4, h_q=128, topk=128, s_kv=300), None, dict(f16=True, ctas=5)),
    "mega_decode_mx_nv_ctas2": ("mega_decode", dict(fmt="mxfp8_ds_mla", block_size=256, topk=128, h_q=64, b=3,
                                                    extra=dict(topk=128, block_size=64, fmt="nvfp4_ds_mla")), None,
                                dict(ctas=2)),
}


@pytest.mark.parametrize("name", list(LOWER_CASES))
def test_lowers_for_cuda(name):
    import jax

    import dsv41_jax as d
    import pallas_kernels
    from pallas_kernels import _interpret
    from tests.attention_cases import make_decode_case, make_mega_case, make_mega_prefill_case, make_prefill_case

    kind, kw, splits, *opts = LOWER_CASES[name]
    with (_interpret.gpu_mode(), pallas_kernels.num_splits_override(splits),
          pallas_kernels.kernel_options(**(opts[0] if opts else {}))):
        if kind == "decode":
            case = make_decode_case(1, **kw)
            f = jax.jit(lambda *a: d.sparse_mla_decode(*a, **case.kwargs(), impl="pallas"))
        elif kind == "mega_decode":
            case = make_mega_case(1, **kw)
            f = jax.jit(lambda *a: d.sparse_mla_mega_decode(*a, **case.kwargs(), impl="pallas"))
        elif kind == "mega_prefill":
            case = make_mega_prefill_case(1, **kw)
            f = jax.jit(lambda *a: d.sparse_mla_mega_prefill(*a, **case.kwargs(), impl="pallas"))
        else:
            case = make_prefill_case(1, **kw)
            f = jax.jit(lambda *a: d.sparse_mla_prefill(*a, **case.kwargs(), impl="pallas"))
        text = f.trace(*case.args()).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text, "no Mosaic GPU custom call in the lowered module"


def test_compute_code_is_emitted_once():
    # both compute warpgroups run one traced copy of their code, with one block loop over every pool: a second pool
    # adds only the memory warpgroup's loop for its format. Two copies miss in the instruction cache (the mega
    # decode's compute warpgroups stalled 36-42% on instruction fetch; benchmarks/RESULTS.md)
    import collections

    import jax

    import dsv41_jax as d
    import pallas_kernels
    from benchmarks import pallas_lowering as L
    from pallas_kernels import _interpret
    from tests.attention_cases import make_decode_case

    def ops(**extra):
        case = make_decode_case(1, fmt="mxfp8_ds_mla", block_size=64, topk=64, h_q=64, b=2, s_q=1, **extra)
        with _interpret.gpu_mode(), pallas_kernels.num_splits_override(1):
            f = jax.jit(lambda *a: d.sparse_mla_decode(*a, **case.kwargs(), impl="pallas"))
            (counts,) = L.module_op_counts(f.trace(*case.args()).lower(lowering_platforms=("cuda",)))
        return collections.Counter(counts)

    one, two = ops(), ops(extra=dict(topk=64, block_size=64, fmt="nvfp4_ds_mla"))
    assert two["scf.for"] == one["scf.for"] + 1, (one["scf.for"], two["scf.for"])
    # the compute code's wgmmas (Q K^T, P V) appear once whatever the pool count
    assert two["nvvm.wgmma.fence.aligned"] == one["nvvm.wgmma.fence.aligned"], (one, two)


# --------------------------------------------------------------------------- registration
def test_import_touches_no_gpu():
    # With JAX_PLATFORMS=cuda on a machine without one, any backend initialisation would raise.
    env = dict(os.environ, JAX_PLATFORMS="cuda", PYTHONPATH=ROOT)
    code = ("import pallas_kernels, dsv41_jax.sparse_mla.implementations as a; "
            "assert 'pallas' in a.decode_impls() and 'pallas' in a.prefill_impls(); print('ok')")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr


def test_registration_supports_and_availability():
    import jax.numpy as jnp

    import dsv41_jax as d
    import pallas_kernels
    from dsv41_jax import kv_cache as kvc
    from dsv41_jax.sparse_mla.base import make_decode_call

    assert "pallas" in d.attention.decode_impls() and "pallas" in d.attention.prefill_impls()
    assert pallas_kernels.availability_reason() is not None  # CPU: not runnable natively
    q = jnp.zeros((1, 1, 4, 512), jnp.bfloat16)
    idx = jnp.zeros((1, 1, 64), jnp.int32)
    # every cache format, alone or next to any other as the extra cache
    for main in kvc.KV_FORMATS:
        for extra in (None,) + kvc.KV_FORMATS:
            ex = (None, None, None, None, None) if extra is None else (kvc.allocate(2, 32, extra), idx, None, extra, 32)
            call = make_decode_call(q, kvc.allocate(2, 64, main), idx, None, main, 64, 0.1, None, *ex)
            assert pallas_kernels.decode_supports(call) is None, (main, extra)
    with pytest.raises(ValueError, match="kv_format"):
        pallas_kernels.ops.pool_operands(kvc.allocate(2, 64, "bf16"), "fp4", 64, idx[0], jnp.ones((1,), jnp.int32))


# ------------------------------------------------------------------- static checks, operands
def test_kernel_spec_checks_and_smem():
    from pallas_kernels import _gather
    from pallas_kernels._kernel import build_kernel
    from pallas_kernels._spec import SMEM_LIMIT, KernelSpec, PoolSpec, smem_bytes

    fp8, bf16 = PoolSpec("fp8_ds_mla", 128), PoolSpec("bf16", 128)
    base = dict(rows=2, heads=64, num_splits=1, softmax_scale=0.1, has_sink=True, interpret=False)
    rows = KernelSpec(pools=(bf16,), **base)
    fp8_only = KernelSpec(pools=(fp8, fp8), **base)
    mixed = KernelSpec(pools=(bf16, fp8), **base)
    # two exchange buffers fit beside a bf16 ring, not beside an fp8 one (its scale bytes)
    assert rows.xbufs == 2 and fp8_only.xbufs == mixed.xbufs == 1
    # the mega ops' cos / sin share the sink's 1 KiB: a bf16 mega prefill with a sink keeps both exchange buffers
    mega_rows = KernelSpec(pools=(bf16,), mega=True, **base)
    assert mega_rows.row_consts == 3 and mega_rows.xbufs == 2 and smem_bytes(mega_rows) == smem_bytes(rows)
    assert KernelSpec(pools=(bf16,), mega=True, **{**base, "has_sink": False}).row_consts == 2
    # setmaxnreg: the three warpgroups together never ask for more than the CTA's 504 registers
    assert rows.registers == (40, 232)
    assert fp8_only.registers == mixed.registers == (56, 224)
    for spec in (rows, fp8_only, mixed, KernelSpec(pools=(fp8,), **{**base, "has_sink": False}),
                 KernelSpec(pools=(bf16,), f16=True, **base), mega_rows):
        assert smem_bytes(spec) <= SMEM_LIMIT, (spec, smem_bytes(spec))
        assert spec.registers[0] + 2 * spec.registers[1] <= 504 and spec.registers[1] % 8 == 0
        build_kernel(spec)
    # V4.1 pools: the scale buffer's rows hold the largest scale record of the call's pools
    mx, nv = PoolSpec("mxfp8_ds_mla", 128), PoolSpec("nvfp4_ds_mla", 128)
    assert KernelSpec(pools=(mx, nv), **base).scale_pitch == 32
    assert KernelSpec(pools=(fp8, mx), **base).scale_pitch == 16
    assert KernelSpec(pools=(fp8,), **base).scale_pitch == 8 and rows.scale_pitch == 0
    for pools in ((mx, nv), (nv,), (mx, fp8), (bf16, nv)):
        for f16 in (False, True):
            spec = KernelSpec(pools=pools, f16=f16, **base)
            assert smem_bytes(spec) <= SMEM_LIMIT and spec.registers == (56, 224) and spec.xbufs == 1, spec
            build_kernel(spec)
    with pytest.raises(ValueError, match="kv_format"):
        _gather.issue_block("fp8_direct")
    with pytest.raises(ValueError, match="scale_pitch must be at least nvfp4_ds_mla's 32"):
        _gather.issue_block("nvfp4_ds_mla", scale_pitch=16)


def test_operand_mode_choice():
    """f16 operands for prefill when converting kv costs less than the P_lo wgmma saved, for decode only of
    V4.1 records; `kernel_options` chooses the operand type and nothing else."""
    import jax.numpy as jnp

    import pallas_kernels
    from pallas_kernels import ops as _ops
    from pallas_kernels._spec import KernelSpec, PoolSpec

    assert _ops.prefill_rows_f16(65536, 4096, 2048, 128)  # the benchmark's prefill
    # decode: f16 operands where every pool holds V4.1 records
    assert _ops.decode_operands_f16(["mxfp8_ds_mla", "nvfp4_ds_mla"]) and _ops.decode_operands_f16(["nvfp4_ds_mla"])
    for formats in (["fp8_ds_mla"], ["bf16"], ["mxfp8_ds_mla", "fp8_ds_mla"], ["bf16", "nvfp4_ds_mla"]):
        assert not _ops.decode_operands_f16(formats), formats
    assert not _ops.prefill_rows_f16(300, 4, 128, 128) and not _ops.prefill_rows_f16(2**20, 16, 2048, 128)
    base = dict(rows=2, heads=64, num_splits=1, softmax_scale=0.1, has_sink=False, interpret=False)
    fp8 = PoolSpec("fp8_ds_mla", 128)
    assert KernelSpec(pools=(fp8,), f16=True, **base).dtype == jnp.float16
    assert KernelSpec(pools=(fp8,), **base).dtype == jnp.bfloat16  # the default: bf16
    with pytest.raises(TypeError):
        with pallas_kernels.kernel_options(fp8_direct=False):
            pass
    x = _ops.to_f16(np.array([1e6, -1e6, 1.5, np.nan], np.float32))
    assert x.dtype == np.float16
    np.testing.assert_array_equal(np.asarray(x)[:3], [65504, -65504, 1.5])
    assert np.isnan(np.asarray(x)[3])


def test_persistent_ctas_choice():
    """`kernel_options(ctas=...)`: at most that many persistent CTAs (never more than the items, one CTA per item
    when N covers them all); bad counts refused."""
    import jax

    import dsv41_jax as d
    import pallas_kernels
    from pallas_kernels import _interpret
    from pallas_kernels import ops as _ops
    from pallas_kernels._spec import KernelSpec, PoolSpec
    from tests.attention_cases import make_decode_case

    base = dict(rows=3, heads=128, num_splits=2, softmax_scale=0.1, has_sink=False, interpret=False,
                pools=(PoolSpec("fp8_ds_mla", 128),))
    spec = KernelSpec(ctas=5, **base)
    assert spec.items == 12 and spec.grid == 5 and KernelSpec(**base).grid == 12
    assert spec.stage_in_ring is False and KernelSpec(**{**base, "num_splits": 1}).stage_in_ring
    assert not KernelSpec(**{**base, "num_splits": 1}, mega=True).stage_in_ring  # the mega output stages in Q
    for bad in (0, 13):
        with pytest.raises(ValueError, match=r"ctas must lie in \[1, items = 12\]"):
            KernelSpec(ctas=bad, **base)
    for bad in (-1, "all", 2.5):
        with pytest.raises(ValueError, match="ctas must be a count >= 0 or 'sms'"):
            with pallas_kernels.kernel_options(ctas=bad):
                pass

    seen = []
    real = _ops.KernelSpec

    def spy(**kw):
        seen.append(real(**kw))
        return seen[-1]

    case = make_decode_case(1, fmt="fp8_ds_mla", block_size=64, topk=128, h_q=64, b=2, s_q=2)  # 4 rows, 4 items
    _ops.KernelSpec = spy
    try:
        for ctas, grid in ((3, 3), (4, 4), (64, 4), (0, 4)):
            with _interpret.gpu_mode(), pallas_kernels.num_splits_override(1), pallas_kernels.kernel_options(ctas=ctas):
                jax.jit(lambda *a: d.sparse_mla_decode(*a, **case.kwargs(), impl="pallas")).trace(*case.args())
            assert seen[-1].grid == grid and seen[-1].ctas == (3 if ctas == 3 else None), (ctas, seen[-1])
    finally:
        _ops.KernelSpec = real


def test_benchmark_script_needs_a_gpu(capsys):
    from benchmarks import pallas_kernels_bench

    assert pallas_kernels_bench.main([]) == 1
    assert "needs a CUDA GPU" in capsys.readouterr().out


@pytest.mark.parametrize("kv_format", ["fp8_ds_mla", "mxfp8_ds_mla", "nvfp4_ds_mla"])
def test_scale_factor_operand(kv_format):
    """pool_operands' f32 scale rows: [row, block, group, token] = the factor of the entry's scale byte g
    (UE8M0: 2^(e - 127), e = 0 -> 0; nvfp4_ds_mla: the e4m3 value), 0 past the format's scale count; and the
    GPU's form: the same bytes located past the record (whose index is in units of the data bytes)."""
    import jax.numpy as jnp

    from dsv41_jax import kv_cache as kvc
    from pallas_kernels import ops as _ops

    lay = kvc.layout(kv_format)
    unit, sb = lay.data_bytes, lay.scale_bytes
    rng = np.random.default_rng(5)
    bs, nb = 3, 40
    pb = kvc.page_bytes(kv_format, bs)
    cache = rng.integers(0, 256, (nb, pb), dtype=np.uint8)
    cap = nb * bs
    idx = rng.integers(0, cap, (2, 70)).astype(np.int32)
    idx[0, 5] = -1
    idx[1, 7] = cap  # out of range: masked
    lens = np.array([70, 40], np.int32)

    def factor(e):
        if kv_format == "nvfp4_ds_mla":
            return e.astype(np.uint8).view(jnp.float8_e4m3fn).astype(np.float32)
        with np.errstate(over="ignore"):  # byte 255: 2^128 is inf in f32, as in the operand
            return np.where(e == 0, 0.0, np.ldexp(1.0, e.astype(np.int64) - 127)).astype(np.float32)

    ops, spec, nblk = _ops.pool_operands(jnp.asarray(cache), kv_format, bs, jnp.asarray(idx), jnp.asarray(lens))
    view, src, sf = (np.asarray(x) for x in ops)
    assert spec.kpad == 128 and sf.shape == (2, 2, 32, 64) and sf.dtype == np.float32
    np.testing.assert_array_equal(np.asarray(nblk), [2, 1])
    for r in range(2):
        for k in range(128):
            i = idx[r, k] if k < 70 else -1
            valid = k < lens[r] and 0 <= i < cap
            got = sf[r, k // 64, :, k % 64]
            if not valid:
                assert src[r, k] == -1 and not got.any(), (r, k)
                continue
            blk, t = divmod(int(i), bs)
            assert src[r, k] * unit == blk * pb + t * unit  # the record's index in units of its data bytes
            e = cache[blk, bs * unit + t * sb: bs * unit + (t + 1) * sb]
            np.testing.assert_array_equal(got[:sb], factor(e), err_msg=f"row {r} entry {k}")
            assert not got[sb:].any()
    ops2, _, _ = _ops.pool_operands(jnp.asarray(cache), kv_format, bs, jnp.asarray(idx), jnp.asarray(lens),
                                    scale_offsets=True)
    view2, src2, ssrc = (np.asarray(x) for x in ops2)
    assert ssrc.shape == (2, 128) and ssrc.dtype == np.int32
    np.testing.assert_array_equal(src2, src)
    for r in range(2):
        for k in range(128):
            if src[r, k] < 0:
                assert ssrc[r, k] == -1, (r, k)
            else:
                at = src[r, k] * unit + ssrc[r, k]
                np.testing.assert_array_equal(factor(view2[at: at + sb]), sf[r, k // 64, :sb, k % 64],
                                              err_msg=f"row {r} entry {k}")


# ----------------------------------------------------- interpret results (run last: they wait)
@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_interpret_matches_oracle(name, interpret_worker):
    results, log = interpret_worker.results()
    rec = results.get(name)
    assert rec is not None, f"case {name} produced no result (worker crashed or timed out); log tail:\n{log[-3000:]}"
    assert rec["ok"], rec["error"]


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--worker":
    sys.path.insert(0, ROOT)
    _worker([n for n in sys.argv[2].split(",") if n])


@pytest.mark.parametrize("gib", [3, 40])
def test_lowers_for_cuda_with_caches_past_2_gib(gib):
    """Sources are int32 record indices and the kernel's addresses 64-bit: an fp8_ds_mla main cache and
    extra cache of `gib` GiB each lower for cuda (shape structs: nothing is allocated)."""
    import jax
    import jax.numpy as jnp

    import dsv41_jax as d
    from dsv41_jax import kv_cache
    from pallas_kernels import _interpret
    from pallas_kernels import ops as pops

    pb = kv_cache.page_bytes("fp8_ds_mla", 64)
    num_blocks = -(-(gib << 30) // pb)
    cache = jax.ShapeDtypeStruct((num_blocks, pb), jnp.uint8)
    args = (jax.ShapeDtypeStruct((2, 2, 64, 512), jnp.bfloat16), cache, jax.ShapeDtypeStruct((2, 2, 128), jnp.int32),
            jax.ShapeDtypeStruct((2,), jnp.int32))
    kw = dict(kv_format="fp8_ds_mla", block_size=64, softmax_scale=0.04, extra_kv_format="fp8_ds_mla",
              extra_block_size=64, impl="pallas")

    def f(q, c, idx, lens, ec, eidx, elens):
        return d.sparse_mla_decode(q, c, idx, lens, extra_kv_cache=ec, extra_indices=eidx, extra_topk_length=elens, **kw)

    with _interpret.gpu_mode():
        assert pops.unsupported_reason("fp8_ds_mla", cache) is None
        text = jax.jit(f).trace(*args, cache, jax.ShapeDtypeStruct((2, 2, 64), jnp.int32),
                                jax.ShapeDtypeStruct((2,), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


def test_fp8_sources_are_record_indices():
    """The GPU operands of an fp8_ds_mla pool: the record's index in 576-byte units and the distance in
    bytes to its scale bytes, both int32 and small whatever the cache's size; -1 where masked."""
    import jax.numpy as jnp

    from dsv41_jax import kv_cache
    from pallas_kernels import ops as pops

    bs = 64
    pb = kv_cache.page_bytes("fp8_ds_mla", bs)
    cache = jnp.zeros((5, pb), jnp.uint8)
    idx = jnp.array([[0, 1, 63, 64, 4 * 64 + 7, -1, 5 * 64]], jnp.int32)
    (view, src, sdelta), spec, nblk = pops.pool_operands(cache, "fp8_ds_mla", bs, idx, jnp.array([7]),
                                                         scale_offsets=True)
    blk, t = np.array([0, 0, 0, 1, 4]), np.array([0, 1, 63, 0, 7])
    rec_bytes = blk * pb + t * 576
    assert (np.asarray(src)[0, :5] * 576 == rec_bytes).all() and (np.asarray(src)[0, 5:] == -1).all()
    scale_bytes = blk * pb + bs * 576 + t * 8
    assert (np.asarray(src)[0, :5] * 576 + np.asarray(sdelta)[0, :5] == scale_bytes).all()
    assert (np.asarray(sdelta)[0, 5:7] == -1).all()


def test_interpret_mode_refuses_fp8_caches_it_cannot_address():
    import jax
    import jax.numpy as jnp

    from dsv41_jax import kv_cache
    from pallas_kernels import _interpret
    from pallas_kernels import ops as pops

    pb = kv_cache.page_bytes("fp8_ds_mla", 64)
    big = jax.ShapeDtypeStruct((-(-(3 << 30) // pb), pb), jnp.uint8)
    with _interpret.gpu_mode():
        assert pops.unsupported_reason("fp8_ds_mla", big) is None  # the GPU kernel: 64-bit addresses
    with _interpret.interpret_mode():
        assert "interpret mode" in pops.unsupported_reason("fp8_ds_mla", big)


def test_engine_step_compiles_each_kernel_configuration_once():
    # The GPU compiles one Mosaic GPU module per kernel hash. Every layer of one type calls the same kernel
    # configuration, so a step of the tiny model (seven layers of three types, two kernels each) must lower to
    # one module per configuration, each lowered once: with a module per call (14 distinct hashes, a counter in
    # each module's name) its first step took ~55 s to compile on the H200 (benchmarks/RESULTS.md).
    from benchmarks import pallas_lowering as L
    from pallas_kernels import _interpret

    with _interpret.gpu_mode():
        lowered, _, _ = L.engine_step_lowered()
    hashes = L.kernel_hashes(lowered)
    assert len(hashes) == len(set(hashes)) and 1 <= len(hashes) <= 6, [h.hex()[:8] for h in hashes]


def test_engine_shapes_of_one_token_bucket_lower_the_same_kernels():
    # The envelope's first two step shapes differ only in block-table widths, which the kernels never see: they must
    # hold the same kernels with the same hashes, the key of jaxlib's Mosaic GPU compile cache, so the second shape
    # compiles none. Each kernel is lowered once per process (`ops._exported_kernel`); lowered anew per shape, a
    # module would carry its own `mosaic_gpu.dump_basename`, a per-process counter, and its own hash
    # (benchmarks/RESULTS.md).
    from benchmarks import pallas_lowering as L
    from pallas_kernels import _interpret

    with _interpret.gpu_mode():
        (s0, l0), (s1, l1) = L.engine_envelope_lowered(limit=2)
    assert s0.tokens == s1.tokens and s0.blocks != s1.blocks
    assert L.module_texts(l0, without_dump_basename=True) == L.module_texts(l1, without_dump_basename=True)
    assert L.kernel_hashes(l0) == L.kernel_hashes(l1)


def test_sharded_decode_holds_the_plain_calls_kernel():
    # Inside shard_map a head shard calls the kernel lowered once per process for its operand shapes: the same
    # module and hash as a plain call at the shard's head count, so the GPU compiles it once for both.
    import jax
    import numpy as np
    from jax.sharding import Mesh

    import dsv41_jax as d
    from benchmarks import pallas_lowering as L
    from dsv41_jax.sharding import sparse_mla_decode_sharded
    from pallas_kernels import _interpret
    from tests.attention_cases import make_decode_case

    mesh = Mesh(np.array(jax.devices("cpu")[:8]), ("tp",))
    c = make_decode_case(21, b=3, s_q=2, h_q=512, topk=64, fmt="fp8_ds_mla", sink="inf",
                         extra=dict(topk=64, block_size=16, fmt="fp8_ds_mla"))
    kw = c.kwargs()
    q, *rest = c.args()
    with _interpret.gpu_mode():
        sharded = jax.jit(lambda *a: sparse_mla_decode_sharded(*a, mesh=mesh, head_axis="tp", **kw, impl="pallas"))
        plain = jax.jit(lambda q, *a: d.sparse_mla_decode(q, *a, **{**kw, "attn_sink": kw["attn_sink"][:64]},
                                                          impl="pallas"))
        hs = L.kernel_hashes(sharded.trace(q, *rest).lower(lowering_platforms=("cuda",)))
        hp = L.kernel_hashes(plain.trace(q[:, :, :64], *rest).lower(lowering_platforms=("cuda",)))
    assert len(hs) == 1 and hs == hp
