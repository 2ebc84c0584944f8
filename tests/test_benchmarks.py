"""The benchmark tools that run without a GPU: the Nsight Compute condenser on a small report."""

from __future__ import annotations

import csv
import functools

from benchmarks import ncu_summary


def _write(path, rows):
    with open(path, "w", newline="") as f:
        csv.writer(f, quoting=csv.QUOTE_ALL).writerows(rows)


def test_ncu_summary_ranks_stalls_and_instructions(tmp_path, capsys):
    raw = tmp_path / "raw.csv"
    _write(raw, [
        ["ID", "Kernel Name", "gpu__time_duration.sum",
         "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",
         "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio"],
        ["", "", "us", "", ""],
        ["0", "dsv41_decode_kernel<1>", "555.0", "2.5", "0.75"],
    ])
    src = tmp_path / "sass.csv"
    _write(src, [
        ["Kernel Name", "dsv41_decode_kernel<1>"],
        ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed", "stall_barrier", "stall_wait"],
        ["0x10", "BAR.SYNC 0x2, 0x180", "90", "4", "88", "2"],
        ["0x20", "HGMMA.64x32x16.F32", "10", "4", "0", "10"],
    ])
    ncu_summary.main(["--raw", str(raw), "--source", str(src), "--top", "5"])
    out = capsys.readouterr().out
    assert "dsv41_decode_kernel<1>" in out and "555.000" in out
    # stall reasons sorted by cycles per issued instruction
    assert out.index("stalled_barrier") < out.index("stalled_wait")
    assert "total samples 100" in out
    lines = out.splitlines()
    top = [l for l in lines if "BAR.SYNC" in l or "HGMMA" in l]
    assert "BAR.SYNC" in top[0] and "90.0%" in top[0] and "barrier=88" in top[0]


def test_sparse_mla_breakdown_needs_cupti(capsys):
    """--breakdown is refused with the reason where CUPTI timing is not used (here: --timer wall)."""
    import pytest

    from benchmarks import sparse_mla

    with pytest.raises(SystemExit) as e:
        sparse_mla.main(["--breakdown", "--timer", "wall", "--cases", "no_such_case"])
    assert e.value.code == 2
    assert "--breakdown needs CUPTI timing, got 'wallclock'" in capsys.readouterr().err


def test_flashmla_cases_draw_valid_inputs():
    # the side-by-side inputs: FlashMLA's case list, valid fp8 records (no NaN codes), per-row distinct indices that
    # stay inside each request's pages, FLOPs as FlashMLA counts them
    import jax.numpy as jnp
    import numpy as np

    from benchmarks import flashmla_cases as F
    from dsv41_jax import kv_cache as kvc

    assert len(F.DECODE_CASES) == 28 and len(F.PREFILL_CASES) == 7
    case = F.DecodeCase(3, 8, 128, 16, 300, 64, 2, 200, True)
    x = F.decode_inputs(case)
    idx = np.asarray(x["indices"])
    assert idx.shape == (3, 2, 128) and (idx >= -1).all() and (idx >= 0).any()
    for row in idx.reshape(6, 128):  # distinct slots, then -1 past a sequence shorter than topk
        valid = row[row >= 0]
        assert np.unique(valid).size == valid.size and (row[valid.size:] == -1).all()
    g = np.asarray(kvc.gather(x["kv_cache"], jnp.asarray(idx.reshape(-1)), fmt="fp8_ds_mla", block_size=16), np.float32)
    assert np.isfinite(g).all() and np.abs(g).max() > 0
    el = np.asarray(x["extra_topk_length"])
    assert el.shape == (3,) and ((el >= 0) & (el <= 64)).all()
    assert x["flops"] == 2 * 8 * (3 * 2 * 128 + 2 * int(el.sum())) * 1024


def test_benchmark_suites_need_cupti(capsys):
    import pytest

    from benchmarks import sparse_mla

    for suite in ("flashmla", "step", "mega"):
        with pytest.raises(SystemExit):
            sparse_mla.main(["--suite", suite, "--impls", "xla"])
        assert "needs CUPTI timing" in capsys.readouterr().err


def test_mega_benchmark_times_the_three_ways_on_one_input():
    # the mega suite's case runner on a small case with the wall clock (CPU): every way runs and is timed
    from benchmarks import mega_decode, sparse_mla

    case = mega_decode.MegaCase("tiny", tokens=3, h_q=4, topk=64, block_size=64, extra_topk=64, extra_block_size=2,
                                s_kv=128, max_pos=256)
    timer, method = sparse_mla._timer("wall")
    r = mega_decode.run_mega_case(case, "xla", timer, sets=1, iterations=1)
    assert method == "wallclock" and r["samples"] == 1
    assert all(r[k] > 0 for k in ("mega_us", "plain_us", "chain_us"))
    assert r["mega_over_plain"] == r["mega_us"] / r["plain_us"]


def test_mega_prefill_benchmark_times_the_three_ways_on_one_input():
    from benchmarks import mega_prefill, sparse_mla

    case = mega_prefill.MegaPrefillCase("tiny", s_q=3, h_q=4, topk=64, s_kv=128, max_pos=256)
    timer, _ = sparse_mla._timer("wall")
    r = mega_prefill.run_mega_prefill_case(case, "xla", timer, sets=1, iterations=1)
    assert r["op"] == "mega_prefill" and r["samples"] == 1
    assert all(r[k] > 0 for k in ("mega_us", "plain_us", "chain_us"))
    assert r["chain_over_mega"] == r["chain_us"] / r["mega_us"]


def test_gather_ceiling_rows_hold_the_attended_records():
    # benchmarks.gather_ceiling reads each attended record's 576 data bytes as one row of the pool: the rows it
    # picks must be the records the decode attends (valid entries within the lengths, in the decode's order)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks import flashmla_cases as F
    from benchmarks.gather_ceiling import record_rows
    from dsv41_jax import kv_cache as kvc

    P, nb = 61, 5
    cache = F.random_fp8_cache(jax.random.PRNGKey(3), nb, P)
    rng = np.random.default_rng(3)
    idx = rng.integers(-1, nb * P, size=(2, 3, 40)).astype(np.int32)
    lens = np.array([40, 17])
    rows = record_rows(idx, P, lens)
    keep = (idx >= 0) & (np.arange(40)[None, None, :] < lens[:, None, None])
    want = idx[keep]
    assert rows.shape == want.shape and 0 < rows.size < idx.size
    records = np.asarray(kvc.unpack_pages(cache, fmt="fp8_ds_mla", block_size=P))
    pool_rows = np.asarray(cache).reshape(-1, 576)
    np.testing.assert_array_equal(pool_rows[rows], records.reshape(nb * P, -1)[want, :576])


def test_narrow_trace_patches_apply_and_summarize(tmp_path):
    # benchmarks.narrow_trace patches the narrow CTA's loops (they must still match the sources) and reads the
    # step medians off the stamps: a synthetic timeline with known step lengths gives them back
    import numpy as np

    from benchmarks import cuda_ablations as A
    from benchmarks import narrow_trace as T
    from cuda_ffi import build as cbuild

    for variant in ("default", "no_gather", "narrow_no_prefetch"):
        src = cbuild.copy_sources(tmp_path / variant / "csrc", A.ABLATIONS[variant].patches + T.TRACE_PATCHES)
        text = (src / "narrow.cuh").read_text() + (src / "producer.cuh").read_text()
        assert text.count("narrow_trace(0,") == 10 and text.count("narrow_trace(1 + pw,") == 4, variant
    tr = np.zeros((8, 9, 256, 8), np.uint32)
    n, period = 20, 1000
    t = np.arange(n, dtype=np.int64) * period + 5000
    c, p = tr[1, 0], tr[1, 1]
    c[:n, 0], c[:n, 1], c[:n, 2], c[:n, 3], c[:n, 4] = t - 100, t - 40, t, t + 300, t + 350
    c[:n, 5] = t + period - 30  # PV done 10 cycles after the next tile's FULL was seen, 30 before its S
    p[:n, 0], p[:n, 1], p[:n, 2] = t - 500, t - 450, t - 100
    for k in range(8):  # every producer warp: warp k arrives on FULL at t - 200 + 10k (warp 7 last)
        tr[1, 1 + k, :n, :3] = p[:n, :3]
        tr[1, 1 + k, :n, 3] = t - 200 + 10 * k
    s = T.summarize(tr)
    assert (s["empty_wait_all"], s["full_spread"], s["wake_after_last"]) == (50, 70, 90)
    assert s["last_share"] == "0.00/0.00/0.00/0.00/0.00/0.00/0.00/1.00"
    assert s["ctas"] == 1 and s["tiles_per_cta"] == n
    assert (s["full_wait"], s["softmax"], s["pv_issue"], s["period"]) == (60, 300, 50, period)
    assert (s["pv_tail"], s["s_tail"], s["empty_wait"], s["fill"], s["arrive_loop"]) == (10, 30, 50, 350, 600)


def test_pallas_lowering_counts_the_module_ops():
    # benchmarks.pallas_lowering: the Mosaic GPU module inside a cross-lowered pallas decode is unpacked and counted
    from benchmarks import pallas_lowering as L
    from pallas_kernels import _interpret

    with _interpret.gpu_mode():
        lowered, t_trace, t_lower = L._lowered("decode", (2, 1, 64, 64, 64, 64))
    (counts,) = L.module_op_counts(lowered)
    assert sum(counts.values()) > 1000 and counts["llvm.inline_asm"] > 0 and t_trace >= 0 and t_lower > 0


def test_pallas_mega_ablation_variants_change_the_kernel():
    # benchmarks.pallas_mega_ablation: each variant's patch reaches the lowered Mosaic GPU module (a module unlike the
    # default's), and leaving the variant restores the kernel
    import jax

    import dsv41_jax as d
    import pallas_kernels
    from benchmarks import pallas_lowering as L
    from benchmarks.pallas_mega_ablation import VARIANTS, patched
    from pallas_kernels import _interpret
    from tests.attention_cases import make_decode_case, make_mega_case

    case = make_mega_case(1, b=2, h_q=64, topk=64, fmt="mxfp8_ds_mla", extra=dict(topk=64, block_size=64,
                                                                                  fmt="nvfp4_ds_mla"))

    plain_only = {"register_out"}  # variants of the plain kernels' output: the mega kernel is theirs unchanged

    def module(variant, op=d.sparse_mla_mega_decode, args=case.args(), kwargs=case.kwargs()):
        with _interpret.gpu_mode(), pallas_kernels.num_splits_override(1), patched(variant):
            f = jax.jit(lambda *a: op(*a, **kwargs, impl="pallas"))
            lowered = f.trace(*args).lower(lowering_platforms=("cuda",))
            (text,) = L.module_texts(lowered, without_dump_basename=True)
        return text

    default = module("default")
    for v in VARIANTS:
        if v != "default" and v not in plain_only:
            assert module(v) != default, v
    assert module("default") == default
    plain = make_decode_case(1, b=2, s_q=1, h_q=64, topk=64, fmt="mxfp8_ds_mla",
                             extra=dict(topk=64, block_size=64, fmt="nvfp4_ds_mla"))
    plain_module = functools.partial(module, op=d.sparse_mla_decode, args=plain.args(), kwargs=plain.kwargs())
    plain_default = plain_module("default")
    for v in plain_only:
        assert module(v) == default and plain_module(v) != plain_default, v


def test_pallas_ctas_flag_sets_the_kernel_option():
    # `--pallas-ctas` (benchmarks.sparse_mla, benchmarks.flashmla_compare) runs the pallas kernels as persistent CTAs
    import pytest

    from benchmarks.inputs import pallas_ctas
    from pallas_kernels import ops

    def current():
        return getattr(ops._override, "options", {}).get("ctas")

    assert current() is None
    with pallas_ctas("sms"):
        assert current() == "sms"
        with pallas_ctas("7"):
            assert current() == 7
        with pallas_ctas(None):
            assert current() == "sms"
    assert current() is None
    with pytest.raises(ValueError, match="ctas must be a count"):
        with pallas_ctas("-3"):
            pass
