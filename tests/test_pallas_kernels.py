"""CPU tests of the `impl="pallas"` Mosaic GPU kernels (pallas_kernels/).

1. Interpret mode: each kernel runs at small shapes in Mosaic GPU interpret mode against the
   float64 oracle of tests/attention_cases.py (`assert_close`, FlashMLA's tolerances): fp8_ds_mla
   and bf16 caches, an extra cache with its own page size and format, variable / zero lengths,
   invalid indices (-1, INT_MIN, INT_MAX, capacity), NaN-poisoned unused slots, sinks of +-inf,
   padded head counts, several splits (partial outputs + combine), prefill with s_kv < topk; two
   cases (decode fp8, prefill bf16, several blocks each) also run the interpreter's race detector.
   Two hand-built decode cases pin the kernel's precision (f16 tensor-core operands, f32
   accumulation): q and K/V values of 1e6 saturate to +-65504 (finite outputs equal to the oracle
   on the saturated values), and a peaked softmax over cancelling large values meets FlashMLA's
   decode output tolerance with f16 P where a float64 model of bf16 P misses it.
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
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER_TIMEOUT_S = 210

# id -> (kind, case kwargs, forced num_splits or None, detect races)
CASES = {
    "decode_fp8_p61_sinkinf_b2": ("decode", dict(fmt="fp8_ds_mla", block_size=61, topk=128, h_q=16, b=2, s_q=1,
                                                  s_kv=300, sink="inf"), None, False),
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
                                                s_kv=400, sink="inf"), 3, True),
    "decode_bf16_skv_lt_topk_splits2": ("decode", dict(fmt="bf16", block_size=16, topk=128, h_q=8, b=2, s_q=1,
                                                       s_kv=40), 2, False),
    "prefill_h128_sinkinf": ("prefill", dict(s_q=2, h_q=128, topk=128, s_kv=200, sink="inf"), None, False),
    "prefill_skv_lt_topk_invalid_row": ("prefill", dict(s_q=3, h_q=16, topk=128, s_kv=60, all_invalid_row=True),
                                        None, False),
    "prefill_zero_lengths_scale_half": ("prefill", dict(s_q=2, h_q=8, topk=64, s_kv=100, lengths="zero",
                                                        softmax_scale=0.5), None, False),
    "prefill_no_lengths_splits2_races": ("prefill", dict(s_q=1, h_q=16, topk=256, s_kv=300, lengths="none"), 2, True),
}

# Hand-built decode cases: id -> builder returning (DecodeCase, check(out, lse)); see the tests at the end.
BUILT_CASES = {
    "decode_saturation_1e6": "_saturation_case",
    "decode_fp16_p_cancelling": "_p_precision_case",
}
F16_MAX = 65504.0


# ------------------------------------------------------------------------ hand-built cases
def _decode_case_from_rows(q, pools, softmax_scale, sink):
    """A one-request decode case (b = s_q = 1) over explicit latent rows.

    q float [h, 512]; pools: one or two (fmt, rows float [n, 512]) (main, extra), each stored in a
    cache of one 64-token page per 64 rows at shuffled slots and attended in full (topk = n)."""
    import jax.numpy as jnp

    from dsv41_jax import kv_cache as kvc
    from tests.attention_cases import DecodeCase

    rng = np.random.default_rng(12345)
    parts = []
    for fmt, rows in pools:
        n = rows.shape[0]
        nb = -(-n // 64)
        slots = rng.permutation(nb * 64)[:n].astype(np.int32)
        cache = kvc.insert(kvc.allocate(nb, 64, fmt), jnp.asarray(rows, jnp.bfloat16), jnp.asarray(slots),
                           fmt=fmt, block_size=64)
        parts.append((fmt, cache, jnp.asarray(slots.reshape(1, 1, n)), jnp.asarray([n], jnp.int32)))
    (fmt, cache, idx, lens), extra = parts[0], parts[1:]
    case = DecodeCase(jnp.asarray(q[None, None], jnp.bfloat16), cache, idx, lens, fmt, 64, softmax_scale,
                      None if sink is None else jnp.asarray(sink, jnp.float32))
    if extra:
        efmt, ecache, eidx, elens = extra[0]
        case = dataclasses.replace(case, extra_kv_cache=ecache, extra_indices=eidx, extra_topk_length=elens,
                                   extra_kv_format=efmt, extra_block_size=64)
    return case


def _expected_decode(case, unclamped: str | None = None):
    """float64 oracle (out, lse) of `case` with q and the dequantized K/V saturated to +-65504, the
    kernel's documented behaviour; `unclamped` ("q", "main", "extra_nope", "extra_rope") leaves
    that one site as given (to show that each saturation matters)."""
    import jax.numpy as jnp

    from tests.attention_cases import dequantized_table, oracle_rows

    def sat(x, keep=slice(0, 0)):  # saturate every column but `keep`
        cols = np.ones(x.shape[-1], bool)
        cols[keep] = False
        x = x.copy()
        x[..., cols] = np.clip(x[..., cols], -F16_MAX, F16_MAX)
        return x

    b, s_q, h, d = case.q.shape
    q = np.asarray(case.q.astype(jnp.float32), np.float64).reshape(b * s_q, h, d)
    q = q if unclamped == "q" else sat(q)
    pools = []
    for name, cache, fmt, idx, lens in (("main", case.kv_cache, case.kv_format, case.indices, case.topk_length),
                                        ("extra", case.extra_kv_cache, case.extra_kv_format, case.extra_indices,
                                         case.extra_topk_length)):
        if cache is None:
            continue
        keep = {name: slice(0, 512), name + "_nope": slice(0, 448), name + "_rope": slice(448, 512)}.get(
            unclamped, slice(0, 0))
        table = sat(dequantized_table(cache, fmt, 64), keep)
        pools.append((table, np.asarray(idx).reshape(b * s_q, -1), np.repeat(np.asarray(lens), s_q)))
    sink = None if case.attn_sink is None else np.asarray(case.attn_sink, np.float64)
    out, _, lse = oracle_rows(q, pools, case.softmax_scale, sink)
    return out.reshape(b, s_q, h, d), lse.reshape(b, s_q, h)


def _saturation_case():
    """Values of magnitude 1e6 (bf16 999424) in q and in every kind of K/V storage: the main pool's
    bf16 rows, the extra fp8_ds_mla pool's NoPE part (e4m3 * 2^12 = -983040) and its bf16 RoPE part.
    Dims holding a huge K/V value have q = 0 (they move the output, not the scores); the huge q
    entries meet small, varied K values (scores of a few nats). Without saturation f16 would hold
    inf (-> NaN); against the oracle on unsaturated values each site fails (see the test)."""
    rng = np.random.default_rng(7)
    h, n = 16, 64
    main = rng.standard_normal((n, 512)) * 0.5
    extra = rng.standard_normal((n, 512)) * 0.5
    q = rng.standard_normal((h, 512))
    for dim in (5, 300):  # q saturates here: K small and varied in both pools
        main[:, dim] = rng.standard_normal(n) * 1e-3
        extra[:, dim] = rng.standard_normal(n) * 1e-3
    q[0, 5], q[1, 300] = 1e6, -1e6
    q[:, [100, 400, 401, 470, 500]] = 0.0  # K/V saturates here
    main[3, 400], main[4, 401] = 1e6, -1e6  # bf16 rows
    extra[7, 100] = -1e6  # fp8 NoPE tile
    extra[9, 470], extra[10, 500] = 1e6, -1e6  # bf16 RoPE bytes of the fp8 record
    case = _decode_case_from_rows(q, [("bf16", main), ("fp8_ds_mla", extra)], 512 ** -0.5, rng.standard_normal(h))

    def check(out, lse):
        from tests.attention_cases import assert_close

        o = np.asarray(out.astype(np.float32))
        assert np.isfinite(o).all() and np.isfinite(np.asarray(lse)).all(), "non-finite output"
        e_out, e_lse = _expected_decode(case)
        assert_close(out, e_out, "decode_out", "saturation out")
        assert_close(lse, e_lse, "decode_lse", "saturation lse")

    return case, check


def _p_precision_case():
    """A peaked softmax over cancelling large values (h = 64, topk = 64, fp8_ds_mla).

    Dims 0..255 decide the scores (q is 0 on dims 256..511): tokens 0 and 1 align with every head's
    q and score ~9 nats above the other 62, typically within ~0.1 nats of each other (per head), so
    P = (1, p1 ~ 0.9..1, ~1e-4 ...). On dims 256..511 token 1 holds exactly -(token 0's) values of
    magnitude 1.5..2.5, so out = ((1 - p1) w + small) / l, about 0.01..0.1: rounding p1 to bf16
    (up to 2^-9) moves it by up to ~2.5e-3, mostly over 1e-3 absolute and 2/128 relative, while f16
    (up to 2^-12, ~3e-4) stays inside both."""
    rng = np.random.default_rng(0)
    h, n = 64, 64
    u = np.full(256, 15.0 / 16.0)
    rows = np.zeros((n, 512))
    rows[:, :256] = rng.standard_normal((n, 256)) * 0.3
    rows[0, :256] = u + rng.standard_normal(256) * 0.1
    rows[1, :256] = u + rng.standard_normal(256) * 0.1
    w = rng.uniform(1.5, 2.5, 256) * rng.choice([-1.0, 1.0], 256)
    rows[0, 256:], rows[1, 256:] = w, -w
    rows[2:, 256:] = rng.standard_normal((n - 2, 256)) * 0.5
    q = np.zeros((h, 512))
    q[:, :256] = u + rng.standard_normal((h, 256)) * 0.3
    case = _decode_case_from_rows(q, [("fp8_ds_mla", rows)], 512 ** -0.5, None)
    return case, lambda out, lse: case.check(out, lse, "fp16 P case")


def _p_rounding_model(case, p_dtype):
    """float64 model of the kernel's output with only P rounded (to `p_dtype`) and the output
    rounded to bf16: exact scores, exp and row sum l, exact P V accumulation."""
    import jax.numpy as jnp

    from tests.attention_cases import dequantized_table

    b, s_q, h, d = case.q.shape
    k = dequantized_table(case.kv_cache, case.kv_format, case.block_size)[np.asarray(case.indices).reshape(-1)]
    q = np.asarray(case.q.astype(jnp.float32), np.float64).reshape(h, d)
    s = case.softmax_scale * (q @ k.T)
    p = np.exp(s - s.max(axis=1, keepdims=True))
    p_r = np.asarray(jnp.asarray(p, jnp.float32).astype(p_dtype).astype(jnp.float32), np.float64)
    out = (p_r @ k) / p.sum(axis=1, keepdims=True)
    return np.asarray(jnp.asarray(out, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32)).reshape(b, s_q, h, d)


# ----------------------------------------------------------------------------- the worker
def _run_case(name: str) -> dict:
    """Runs one case in interpret mode (in a worker process) and checks it against the oracle."""
    import jax

    import dsv41_jax as d
    import pallas_kernels
    from pallas_kernels import _interpret
    from tests.attention_cases import make_decode_case, make_prefill_case

    if name in BUILT_CASES:
        kind, splits, races = "decode", None, False
        case, check = globals()[BUILT_CASES[name]]()
    else:
        kind, kw, splits, races = CASES[name]
        seed = sum(map(ord, name))
        case = make_decode_case(seed, **kw) if kind == "decode" else make_prefill_case(seed, **kw)
        check = (lambda out, lse: case.check(out, lse, name)) if kind == "decode" else (lambda *r: case.check(r, name))
    t0 = time.time()
    with _interpret.interpret_mode(detect_races=races), pallas_kernels.num_splits_override(splits):
        if kind == "decode":
            res = jax.jit(lambda *a: d.sparse_mla_decode(*a, **case.kwargs(), impl="pallas"))(*case.args())
        else:
            res = jax.jit(lambda *a: d.sparse_mla_prefill(*a, **case.kwargs(), impl="pallas"))(*case.args())
        res = jax.block_until_ready(res)
    check(*res)
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
    """One worker subprocess running every interpret case (one process: parallel workers were
    slower on 2 cores). Started by the first test of this module so that the in-process lowering
    tests overlap with it; `results()` waits for it (with a timeout)."""

    def __init__(self):
        env = dict(os.environ, NPROC="16", JAX_PLATFORMS="cpu",
                   PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        names = list(CASES) + list(BUILT_CASES)
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
def interpret_worker():
    w = _Worker()
    yield w
    if w.proc.poll() is None:
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
}


@pytest.mark.parametrize("name", list(LOWER_CASES))
def test_lowers_for_cuda(name):
    import jax

    import dsv41_jax as d
    import pallas_kernels
    from pallas_kernels import _interpret
    from tests.attention_cases import make_decode_case, make_prefill_case

    kind, kw, splits = LOWER_CASES[name]
    with _interpret.gpu_mode(), pallas_kernels.num_splits_override(splits):
        if kind == "decode":
            case = make_decode_case(1, **kw)
            f = jax.jit(lambda *a: d.sparse_mla_decode(*a, **case.kwargs(), impl="pallas"))
        else:
            case = make_prefill_case(1, **kw)
            f = jax.jit(lambda *a: d.sparse_mla_prefill(*a, **case.kwargs(), impl="pallas"))
        text = f.trace(*case.args()).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text, "no Mosaic GPU custom call in the lowered module"


# --------------------------------------------------------------------------- registration
def test_import_touches_no_gpu():
    # With JAX_PLATFORMS=cuda on a machine without one, any backend initialisation would raise.
    env = dict(os.environ, JAX_PLATFORMS="cuda", PYTHONPATH=ROOT)
    code = ("import pallas_kernels, dsv41_jax.attention as a; "
            "assert 'pallas' in a.decode_impls() and 'pallas' in a.prefill_impls(); print('ok')")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr


def test_registration_supports_and_availability():
    import jax.numpy as jnp

    import dsv41_jax as d
    import pallas_kernels
    from dsv41_jax import kv_cache as kvc

    assert "pallas" in d.attention.decode_impls() and "pallas" in d.attention.prefill_impls()
    assert pallas_kernels.availability_reason() is not None  # CPU: not runnable natively
    q = jnp.zeros((1, 1, 4, 512), jnp.bfloat16)
    idx = jnp.zeros((1, 1, 64), jnp.int32)
    for fmt in ("mxfp8_ds_mla", "nvfp4_ds_mla"):
        cache = kvc.allocate(2, 64, fmt)
        with pytest.raises(ValueError, match="pallas"):
            d.sparse_mla_decode(q, cache, idx, kv_format=fmt, block_size=64, softmax_scale=0.1, impl="pallas")
        # auto falls back to the reference
        out, lse = d.sparse_mla_decode(q, cache, idx, kv_format=fmt, block_size=64, softmax_scale=0.1, impl="auto")
        assert out.shape == q.shape and lse.shape == (1, 1, 4)
    mx_cache = kvc.allocate(2, 64, "fp8_ds_mla")
    with pytest.raises(ValueError, match="pallas"):
        d.sparse_mla_decode(q, mx_cache, idx, kv_format="fp8_ds_mla", block_size=64, softmax_scale=0.1, impl="pallas",
                            extra_kv_cache=kvc.allocate(2, 32, "nvfp4_ds_mla"), extra_indices=idx,
                            extra_kv_format="nvfp4_ds_mla", extra_block_size=32)


# ----------------------------------------------------- interpret results (run last: they wait)
def _worker_result(worker, name):
    results, log = worker.results()
    rec = results.get(name)
    assert rec is not None, f"case {name} produced no result (worker crashed or timed out); log tail:\n{log[-3000:]}"
    assert rec["ok"], rec["error"]


@pytest.mark.parametrize("name", list(CASES))
def test_interpret_matches_oracle(name, interpret_worker):
    _worker_result(interpret_worker, name)


def test_saturation_at_f16_max(interpret_worker):
    """q / K / V values of magnitude 1e6 saturate to +-65504: the kernel's outputs are finite and match
    the oracle on the saturated values (worker); each saturation site changes that oracle beyond
    FlashMLA's tolerances, so a kernel that skipped any of them would fail."""
    import jax.numpy as jnp

    from pallas_kernels._kernel import _sat_f16, to_f16
    from tests.attention_cases import assert_close

    # The kernel's order (round to f16, then clamp) gives bit for bit the clamp-first rule used for q.
    x = jnp.asarray([1e6, 65504.0, 65519.99, 65520.0, 7e4, np.inf, 3e-8, 2.0**-25, 1.0 / 3.0, 0.0, np.nan], jnp.float32)
    x = jnp.concatenate([x, -x])
    a, b = np.asarray(to_f16(x)), np.asarray(_sat_f16(x))
    assert a.dtype == b.dtype == np.float16
    assert np.array_equal(a.view(np.uint16), b.view(np.uint16)), (a, b)
    assert np.abs(a[[0, 1, 2, 3, 4, 5]]).tolist() == [F16_MAX] * 6
    assert np.isnan(a[10]) and np.isnan(a[-1])

    case, _ = _saturation_case()
    e_out, e_lse = _expected_decode(case)
    assert np.isfinite(e_out).all() and np.isfinite(e_lse).all()
    for site, kind in (("q", "decode_lse"), ("main", "decode_out"), ("extra_nope", "decode_out"),
                       ("extra_rope", "decode_out")):
        u_out, u_lse = _expected_decode(case, unclamped=site)
        with pytest.raises(AssertionError, match="out of tolerance"):
            assert_close(u_lse if kind == "decode_lse" else u_out, e_lse if kind == "decode_lse" else e_out, kind,
                         f"oracle with {site} unclamped")
    _worker_result(interpret_worker, "decode_saturation_1e6")


def test_fp16_p_meets_tolerance_where_bf16_p_fails(interpret_worker):
    """Why P is f16: on this case a float64 model with P rounded to bf16 (FlashMLA's choice) misses
    FlashMLA's decode output tolerance on thousands of elements, the same model with f16 P passes,
    and so does the kernel (worker)."""
    import jax.numpy as jnp

    from tests.attention_cases import TOL, assert_close

    case, _ = _p_precision_case()
    e_out, _ = case.expected()
    bf16_p = _p_rounding_model(case, jnp.bfloat16)
    abs_tol, rel_tol = TOL["decode_out"]
    err = np.abs(bf16_p - e_out)
    n_bad = int(((err >= abs_tol) & (err >= rel_tol * np.abs(e_out))).sum())
    assert n_bad >= 1000, f"only {n_bad} of {e_out.size} bf16-P outputs miss the tolerance: case not discriminating"
    with pytest.raises(AssertionError, match="out of tolerance"):
        assert_close(bf16_p, e_out, "decode_out", "bf16 P model")
    assert_close(_p_rounding_model(case, jnp.float16), e_out, "decode_out", "f16 P model")
    _worker_result(interpret_worker, "decode_fp16_p_cancelling")


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--worker":
    sys.path.insert(0, ROOT)
    _worker([n for n in sys.argv[2].split(",") if n])
