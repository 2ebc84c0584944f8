"""CPU tests of the `impl="cuda"` path (cuda_ffi/).

1. Build: the CUDA library with nvcc + cmake (module fixture; skipped with the reason when a tool
   is missing), its exported handler symbols, and that it loads on a machine without a GPU.
2. Lowering: `sparse_mla_decode` / `sparse_mla_prefill` with impl="cuda" traced and lowered for
   the CUDA platform on CPU; the custom-call targets appear in the module text. Bad arguments
   raise clear errors at trace time.
3. The kernels themselves, on the CPU: `libdsv41_emu.so` (tests/cuda_emulator/) compiles cuda_ffi/csrc/ for the
   host (every CUDA thread a fiber; ldmatrix / mma.sync / shfl / named barriers emulated with
   their PTX semantics; random interleavings) behind the same argument checks as the FFI
   handlers. Decode and prefill cases of the shared grid (plus split-heavy, multi-group and
   multi-request shapes) are compared with the float64 oracle under FlashMLA's tolerances, and
   two runs under different thread interleavings must agree bitwise.
4. The device split planner (one warp per plan, run by the emulator) against
   `dsv41_jax.scheduler.plan_decode_splits` bit for bit on many random cases; the decode over a
   plan made in the call, passed in, stale (made from other lengths) or batch-invariant.
5. Variant emulators (planted synchronisation bugs), each built from a patched copy of csrc/ and run
   in a fresh interpreter. These builds and runs, and the builds of the two default
   emulators, run one at a time in a background thread started with the module (`background`), so
   that they overlap the in-process tests; their tests come last and wait for their results.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cuda_ffi
from cuda_ffi import build as cbuild
from tests.cuda_emulator import build as ebuild
from dsv41_jax import make_decode_plan, plan_decode_splits, plan_is_stale, sparse_mla_decode, sparse_mla_prefill
from dsv41_jax.sparse_mla.base import DecodeCall, PrefillCall
from dsv41_jax.sparse_mla.base import make_decode_call as _make_decode_call, make_prefill_call as _make_prefill_call
from tests.attention_cases import (
    DECODE_GRID,
    MEGA_DECODE_GRID,
    MEGA_PREFILL_GRID,
    PREFILL_GRID,
    V41_DECODE_GRID,
    MegaCase,
    MegaPrefillCase,
    assert_close,
    assert_mega_close,
    assert_mega_exact,
    make_mega_case,
    make_mega_exact_case,
    mega_out_exact,
    make_mega_prefill_case,
    make_decode_case,
    make_prefill_case,
    make_growing_scores_prefill_case,
    make_saturating_prefill_case,
    make_two_scale_decode_case,
)


ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def cuda_lib():
    missing = [name for name, tool in (("nvcc", cbuild.find_nvcc()), ("cmake", cbuild.find_cmake())) if tool is None]
    if missing:
        pytest.skip(f"cannot build the CUDA library here: {', '.join(missing)} not found")
    path = cbuild.build_library(archs="90a;100a")
    assert cuda_ffi.refresh(), "library built but cuda_ffi does not see it"
    return path


class _Background:
    """Emulator builds (g++ on one core) and the runs of the variant emulators (subprocesses), one at a time in a
    thread beside the module's in-process tests, so that they overlap; each test waits for its own job."""

    def __init__(self, jobs: dict):
        self._pool = ThreadPoolExecutor(max_workers=1)
        self._futures = {name: self._pool.submit(fn) for name, fn in jobs.items()}

    def result(self, name: str, fn):
        """The job's result (re-raising its exception); `fn()` here when the job was not started."""
        return self._futures[name].result() if name in self._futures else fn()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def _variant(background, name: str, tmp_path: Path) -> tuple[int, str]:
    """(return code, output) of the emulator variant `name` (_VARIANTS) running its script, built in the
    background; skips without a C++ compiler."""
    if cbuild.find_cxx() is None:
        pytest.skip("no C++ compiler (g++/c++/clang++) to build the kernel emulator")
    return background.result(name, lambda: _build_and_run(*_VARIANTS[name], tmp_path))


def _build_and_run(patches: tuple[tuple[str, str, str], ...], script: str, out_dir: Path) -> tuple[int, str]:
    """Build the emulator from csrc/ with `patches` (cuda_ffi.build.copy_sources; none: the default library),
    run `script` over it in a fresh interpreter; (return code, output)."""
    if patches:
        src = cbuild.copy_sources(out_dir / "csrc", patches)
        lib = ebuild.build_emulator(out_dir=out_dir, src_dir=src)
    else:
        lib = ebuild.build_emulator()
    r = subprocess.run([sys.executable, "-c", script, str(lib)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    return r.returncode, r.stdout + r.stderr


def _jobs(items, tmp_path_factory) -> dict:
    """The background jobs the selected tests of this module need, in the order they are run: the two default
    emulators first (most tests need them), then the variant builds, whose tests come last in the module."""
    names = set()
    for it in items:
        fixtures = getattr(it, "fixturenames", ())
        names |= {f for f in ("emu", "emu_mma_sync") if f in fixtures}
        params = getattr(getattr(it, "callspec", None), "params", {})
        variant = _VARIANT_TESTS.get(getattr(it, "originalname", ""))
        if variant == "plant":
            variant = f"plant{params['plant']}"
        if variant:
            names.add(variant)
    jobs = {}
    for name in ("emu", "emu_mma_sync", *_VARIANTS):
        if name not in names:
            continue
        if name.startswith("emu"):
            consumer = "wgmma" if name == "emu" else name.removeprefix("emu_")
            jobs[name] = functools.partial(ebuild.build_emulator, consumer=consumer)
        else:
            patches, script = _VARIANTS[name]
            jobs[name] = functools.partial(_build_and_run, patches, script, tmp_path_factory.mktemp(name))
    return jobs


@pytest.fixture(scope="module", autouse=True)
def background(request, tmp_path_factory):
    mine = [it for it in request.session.items if getattr(it, "module", None) is request.module]
    bg = _Background(_jobs(mine, tmp_path_factory) if cbuild.find_cxx() is not None else {})
    yield bg
    bg.close()


def _emulator(consumer: str, background: _Background):
    if cbuild.find_cxx() is None:
        pytest.skip("no C++ compiler (g++/c++/clang++) to build the kernel emulator")
    from tests.cuda_emulator import emulate

    name = "emu" if consumer == "wgmma" else f"emu_{consumer}"
    return emulate.load(background.result(name, lambda: ebuild.build_emulator(consumer=consumer)), consumer=consumer)


@pytest.fixture(scope="module")
def emu(background):
    return _emulator("wgmma", background)


@pytest.fixture(scope="module")
def emu_mma_sync(background):
    """The emulator built with sm_100a's consumer warps (mma.sync), which sm_90a replaces by wgmma."""
    return _emulator("mma_sync", background)


def _decode_call(case) -> DecodeCall:
    kw = case.kwargs()
    return _make_decode_call(case.q, case.kv_cache, case.indices, case.topk_length, kw["kv_format"],
                             kw["block_size"], kw["softmax_scale"], kw["attn_sink"], kw.get("extra_kv_cache"),
                             kw.get("extra_indices"), kw.get("extra_topk_length"), kw.get("extra_kv_format"),
                             kw.get("extra_block_size"))


def _prefill_call(case) -> PrefillCall:
    return _make_prefill_call(case.q, case.kv, case.indices, case.softmax_scale, case.attn_sink, case.topk_length)


# ------------------------------------------------------------------------------ build + load
def test_library_builds_and_exports_handlers(cuda_lib):
    lib = ctypes.CDLL(str(cuda_lib))
    for sym in (*cuda_ffi.EXPORTED_SYMBOLS.values(), "dsv41_cuda_abi_version"):
        assert hasattr(lib, sym), f"{cuda_lib} does not export {sym}"
    lib.dsv41_cuda_abi_version.restype = ctypes.c_int
    assert lib.dsv41_cuda_abi_version() == cuda_ffi.ABI_VERSION
    assert cuda_ffi.load_library() is not None
    report = (cuda_lib.parent / "ptxas_report.txt").read_text()
    for kernel in ("dsv41_decode_kernel", "dsv41_combine_kernel", "dsv41_plan_kernel", "dsv41_prefill_kernel"):
        for arch in ("sm_90a", "sm_100a"):
            assert any(kernel in line and arch in line for line in report.splitlines()), (kernel, arch, report)
    # ptxas keeps every wgmma pipeline as written: no injected warpgroup waits, no serialised wgmmas
    # (a build that defers the PV wait across the tile loop got both and measured 10-30% slower)
    assert "(C75" not in report, [line for line in report.splitlines() if "(C75" in line]


def test_registration_and_availability_on_cpu(cuda_lib):
    from dsv41_jax.sparse_mla.implementations import decode_impls, prefill_impls

    assert "cuda" in decode_impls() and "cuda" in prefill_impls()
    cuda_ffi.ensure_registered()  # registering FFI targets for CUDA works on a CPU-only jax
    if jax.default_backend() != "gpu":
        why = cuda_ffi.backend_unavailable_reason()
        assert why is not None and "gpu" in why


@pytest.mark.parametrize("main,extra", [("mxfp8_ds_mla", "fp8_ds_mla"), ("fp8_ds_mla", "nvfp4_ds_mla"),
                                        ("bf16", "mxfp8_ds_mla")])
def test_supports_refuses_pools_of_both_families(main, extra):
    # one decode kernel reads bf16 / fp8_ds_mla pools or mxfp8_ds_mla / nvfp4_ds_mla pools (params.h kFamV4 / kFamV41)
    case = make_decode_case(3, fmt=main, block_size=64, topk=64, h_q=4, extra=dict(topk=64, block_size=2, fmt=extra))
    why = cuda_ffi.decode_supports(_decode_call(case))
    assert why is not None and main in why and extra in why


@pytest.mark.parametrize("main,extra", [("bf16", None), ("mxfp8_ds_mla", None), ("nvfp4_ds_mla", None),
                                        ("mxfp8_ds_mla", "nvfp4_ds_mla"), ("mxfp8_ds_mla", "mxfp8_ds_mla"),
                                        ("fp8_ds_mla", "bf16")])
def test_supports_reads_every_format_of_one_family(main, extra):
    ex = None if extra is None else dict(topk=64, block_size=2, fmt=extra)
    assert cuda_ffi.decode_supports(_decode_call(make_decode_case(3, fmt=main, topk=64, h_q=4, extra=ex))) is None


# ------------------------------------------------------------------------------ lowering
def _lower_decode(case):
    kw = case.kwargs()
    extra = {k: kw[k] for k in ("extra_kv_format", "extra_block_size") if k in kw}
    arrays = dict(q=case.q, kv=case.kv_cache, idx=case.indices, tl=case.topk_length, sink=case.attn_sink)
    if case.extra_kv_cache is not None:
        arrays.update(ekv=case.extra_kv_cache, eidx=case.extra_indices, etl=case.extra_topk_length)

    def f(a):
        return sparse_mla_decode(a["q"], a["kv"], a["idx"], a["tl"], kv_format=kw["kv_format"],
                                 block_size=kw["block_size"], softmax_scale=kw["softmax_scale"],
                                 attn_sink=a["sink"], extra_kv_cache=a.get("ekv"), extra_indices=a.get("eidx"),
                                 extra_topk_length=a.get("etl"), impl="cuda", **extra)

    traced = jax.jit(f).trace(arrays)
    out_shapes = [tuple(o.shape) for o in jax.tree.leaves(traced.out_info)]
    return traced.lower(lowering_platforms=("cuda",)).as_text(), out_shapes


@pytest.mark.parametrize("fmt,extra", [
    ("fp8_ds_mla", None),
    ("bf16", None),
    ("fp8_ds_mla", dict(topk=128, block_size=2, fmt="fp8_ds_mla")),
    ("bf16", dict(topk=64, block_size=61, fmt="fp8_ds_mla")),
])
def test_decode_lowers_to_custom_call(cuda_lib, fmt, extra):
    case = make_decode_case(11, fmt=fmt, block_size=64, topk=100, h_q=20, b=2, s_q=3, extra=extra)
    text, shapes = _lower_decode(case)
    assert "dsv41_sparse_mla_decode" in text
    assert shapes == [(2, 3, 20, 512), (2, 3, 20)]
    # the plan is computed by the planner kernel: no XLA while loops in the module
    assert "stablehlo.while" not in text and "dsv41_plan_decode_splits" in text


def test_prefill_lowers_to_custom_call(cuda_lib):
    case = make_prefill_case(12, s_q=5, h_q=70, s_kv=100, topk=90)

    def f(q, kv, idx, tl, sink):
        return sparse_mla_prefill(q, kv, idx, softmax_scale=0.1, attn_sink=sink, topk_length=tl, impl="cuda")

    traced = jax.jit(f).trace(case.q, case.kv, case.indices, case.topk_length, case.attn_sink)
    assert [tuple(o.shape) for o in traced.out_info] == [(5, 70, 512), (5, 70), (5, 70)]
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert "dsv41_sparse_mla_prefill" in text


def test_bad_arguments_raise_at_trace_time(cuda_lib):
    case = make_decode_case(13, fmt="fp8_ds_mla", topk=64, h_q=4)
    kw = case.kwargs()
    with pytest.raises(TypeError, match="q must"):
        jax.jit(lambda q: sparse_mla_decode(q, case.kv_cache, case.indices, case.topk_length, impl="cuda", **kw)
                ).trace(case.q.astype(jnp.float32))
    # The cuda wrapper checks on its own too (for direct callers of cuda_ffi.decode).
    bad = dataclasses.replace(_decode_call(case), indices=case.indices.astype(jnp.int16))
    with pytest.raises(TypeError, match="cuda: indices must have dtype int32"):
        jax.jit(lambda: cuda_ffi.decode(bad)).trace()
    bad = dataclasses.replace(_decode_call(case), kv_cache=case.kv_cache[:, :-576])
    with pytest.raises(ValueError, match=r"cuda: kv_cache \(fp8_ds_mla, block_size 64\) must be uint8\[num_blocks, 37440\]"):
        cuda_ffi.decode(bad)
    pcase = make_prefill_case(14, s_q=3, h_q=4, topk=64)
    bad = dataclasses.replace(_prefill_call(pcase), kv=pcase.kv.astype(jnp.float32))
    with pytest.raises(TypeError, match="cuda: kv must have dtype bfloat16"):
        cuda_ffi.prefill(bad)


def test_auto_falls_back_to_xla_on_cpu():
    case = make_decode_case(15, fmt="fp8_ds_mla", topk=64, h_q=4, b=2, s_q=1)
    out, lse = sparse_mla_decode(*case.args(), impl="auto", **case.kwargs())
    ref_out, ref_lse = sparse_mla_decode(*case.args(), impl="xla", **case.kwargs())
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(ref_out, np.float32))


# ------------------------------------------------------------------------------ the kernels (emulated)
def _check_decode(case, *, num_sms=132, seed=1, consumer="wgmma"):
    from tests.cuda_emulator.emulate import decode_emulated

    out, lse = decode_emulated(_decode_call(case), num_sms=num_sms, seed=seed, consumer=consumer)
    case.check(out, lse, "emulated decode")
    return out, lse


DECODE_IDS = [name for name, _ in DECODE_GRID]


@pytest.mark.parametrize("name", DECODE_IDS)
def test_emulated_decode_grid(emu, name):
    i = DECODE_IDS.index(name)
    kw = DECODE_GRID[i][1]
    if kw["fmt"] not in cuda_ffi.ops.FORMAT_CODES or (kw.get("extra") or {}).get("fmt", "bf16") not in cuda_ffi.ops.FORMAT_CODES:
        pytest.skip(f"cuda kernels do not read {kw['fmt']} / {(kw.get('extra') or {}).get('fmt')} (impl='auto' falls back)")
    _check_decode(make_decode_case(100 + i, **kw))


@pytest.mark.parametrize("kw,num_sms", [
    # few parts: each part walks several requests (segments, Q reloads, pipeline across them) and splits some
    (dict(b=7, s_q=2, h_q=16, topk=200, block_size=64, fmt="fp8_ds_mla", lengths="var"), 8),
    # two head groups (h=80: the second of 16 heads; one 2-CTA pair), topk not a multiple of 64, the pair walks both
    # requests
    (dict(b=2, s_q=1, h_q=80, topk=130, block_size=16, fmt="bf16", lengths="full", sink="inf"), 2),
    # main + extra cache, many blocks per request, many splits
    (dict(b=3, s_q=1, h_q=8, topk=128, block_size=64, fmt="fp8_ds_mla",
          extra=dict(topk=320, block_size=2, fmt="fp8_ds_mla", lengths="full")), 132),
])
def test_emulated_decode_shapes(emu, kw, num_sms):
    _check_decode(make_decode_case(21, **kw), num_sms=num_sms)


# An even number of 64-head groups runs decode as 2-CTA clusters (each CTA gathers half of every tile
# and sends it to its peer by bulk copies); the emulator runs both CTAs of a cluster together.
PAIR_CASES = [
    # fp8 main + fp8 extra cache (page 2), varying lengths, few SMs: split requests, partial tiles
    (dict(b=3, s_q=2, h_q=128, topk=192, block_size=61, s_kv=300, fmt="fp8_ds_mla", lengths="var",
          extra=dict(topk=128, block_size=2, fmt="fp8_ds_mla")), 8),
    # four head groups (two pairs per query row), infinite sinks, invalid indices
    (dict(b=2, s_q=1, h_q=200, topk=130, block_size=64, fmt="fp8_ds_mla", sink="inf", invalid_frac=0.3), 8),
    # the same at 132 SMs: about one tile per part, so the groups run unpaired (host_params.h, pair_groups)
    (dict(b=2, s_q=1, h_q=200, topk=130, block_size=64, fmt="fp8_ds_mla", sink="inf", invalid_frac=0.3), 132),
]


def test_pair_groups_rule(emu):
    # pairs for an even number of head groups where the parts hold two blocks or more at full lengths, or
    # always for a plan without split-KV (one slot: batch-invariant results)
    import tests.cuda_emulator.emulate as E

    rule = E.load().dsv41_emu_pair_groups
    for args in ((3, 64, 18, 33, 97), (1, 64, 18, 33, 97), (2, 2, 18, 33, 35), (4, 2, 3, 33, 35)):
        assert rule(*(ctypes.c_int64(a) for a in args)) == 0, args
    for args in ((2, 64, 18, 33, 97), (2, 2, 18, 18, 20), (2, 2, 18, 33, 1), (4, 2, 3, 2, 4)):
        assert rule(*(ctypes.c_int64(a) for a in args)) == 1, args


@pytest.mark.parametrize("kw,num_sms", PAIR_CASES)
def test_emulated_decode_head_group_pairs(emu, kw, num_sms):
    _check_decode(make_decode_case(41, **kw), num_sms=num_sms)


# Edge cases of the reference grid, run as pairs (h_q = 128: two head groups; 4 SMs: one part per query
# token, so these few requests pair).
PAIR_GRID_IDS = ["fp8_zero_len", "fp8_all_invalid_row", "bf16_extra_fp8", "fp8_skv_lt_topk"]


@pytest.mark.parametrize("name", PAIR_GRID_IDS)
def test_emulated_decode_grid_as_pairs(emu, name):
    kw = dict(dict(DECODE_GRID)[name], h_q=128)
    _check_decode(make_decode_case(300 + PAIR_GRID_IDS.index(name), **kw), num_sms=4)


# Every head count passes q as it is and gets its results at h_q heads: the narrow CTA (csrc/narrow.cuh) takes
# h_q <= 32, the 64-head CTA everything above, a last partial group completed with zero Q rows in the kernel.
@pytest.mark.parametrize("h", [8, 24, 48, 100])
def test_decode_passes_q_unpadded(h):
    call = _decode_call(make_decode_case(5, h_q=h, topk=64, fmt="fp8_ds_mla"))
    plan = cuda_ffi.ops.call_plan(call, num_sms=8, planner="jax")
    args, _, results, _ = cuda_ffi.ops.prepare_decode(call, plan)
    assert args[0] is call.q and args[4].shape == (h,)
    assert [r.shape[2] for r in results] == [h] * 4


NARROW_GRID_IDS = ["fp8_p61", "fp8_extra_p2", "bf16_p64", "fp8_all_invalid_row", "fp8_zero_len"]


@pytest.mark.parametrize("h_q", [1, 3, 8, 16, 24, 32])
@pytest.mark.parametrize("name", NARROW_GRID_IDS)
def test_emulated_decode_narrow_heads(emu, name, h_q):
    kw = dict(dict(DECODE_GRID)[name], h_q=h_q)
    _check_decode(make_decode_case(500 + NARROW_GRID_IDS.index(name) + 7 * h_q, **kw), num_sms=16)


@pytest.mark.parametrize("h_q,num_sms", [(8, 6), (32, 5)])
def test_emulated_decode_narrow_split_pieces(emu, h_q, num_sms):
    # few parts over long requests with an extra cache: split pieces, the combine, several segments per CTA
    kw = dict(b=5, s_q=2, h_q=h_q, topk=256, block_size=64, fmt="fp8_ds_mla", lengths="var",
              extra=dict(topk=192, block_size=2, fmt="fp8_ds_mla", lengths="var"))
    _check_decode(make_decode_case(530 + h_q, **kw), num_sms=num_sms)


# The grid's edge cases on one 64-head CTA (h_q 33..64: no pair, not narrow).
ONE_GROUP_GRID_IDS = ["fp8_p61", "fp8_extra_p2", "fp8_zero_len", "fp8_all_invalid_row"]


@pytest.mark.parametrize("name", ONE_GROUP_GRID_IDS)
def test_emulated_decode_grid_one_group(emu, name):
    kw = dict(dict(DECODE_GRID)[name], h_q=48)
    _check_decode(make_decode_case(540 + ONE_GROUP_GRID_IDS.index(name), **kw), num_sms=16)


_WGMMA_SELFTEST = '''
import ctypes, sys
import numpy as np
lib = ctypes.CDLL(sys.argv[1])
out = np.full((128, 16), np.nan, np.float32)
flags = np.full(128, -1, np.int32)
lib.dsv41_emu_wgmma_selftest(ctypes.c_int(int(sys.argv[2])), ctypes.c_void_p(out.ctypes.data),
                             ctypes.c_void_p(flags.ctypes.data))
np.save(sys.argv[3], out)
np.save(sys.argv[4], flags)
print("SELFTEST-DONE")
'''


@pytest.mark.parametrize("scenario", [0, 1, 2, 3])
def test_emulator_wgmma_model(emu, scenario, tmp_path):
    # The emulator's asynchronous wgmma (emu_main.cc dsv41_emu_wgmma_selftest): commit groups chained on
    # one accumulator, an empty commit group, an operand overwritten in flight, a thread exiting with a
    # group in flight. The kernels only use wait<0> today; these keep the model honest for pipelines.
    o, f = tmp_path / "out.npy", tmp_path / "flags.npy"
    r = subprocess.run([sys.executable, "-c", _WGMMA_SELFTEST, emu._name, str(scenario), str(o), str(f)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    msg = r.stdout + r.stderr
    if scenario == 2:
        assert r.returncode != 0 and "operand changed while the wgmma was in flight" in msg, msg[-2000:]
        return
    if scenario == 3:
        assert r.returncode != 0 and "exited with a wgmma not waited on" in msg, msg[-2000:]
        return
    assert r.returncode == 0 and "SELFTEST-DONE" in msg, msg[-2000:]
    a = np.fromfunction(lambda r_, k: (3 * r_ + k) % 7 - 3, (64, 16))
    b = np.fromfunction(lambda n, k: (n + 2 * k) % 5 - 2, (32, 16))
    c = a @ b.T * (2 if scenario == 0 else 1)
    t = np.arange(128)
    w, g, q = t // 32, (t % 32) >> 2, t & 3
    expect = np.empty((128, 16))
    for nb in range(4):
        for e in range(4):
            expect[:, 4 * nb + e] = c[16 * w + g + 8 * (e >> 1), 8 * nb + 2 * q + (e & 1)]
    np.testing.assert_array_equal(np.load(o), expect)
    assert (np.load(f) == (1 if scenario == 0 else 0)).all()

@pytest.mark.slow
@pytest.mark.parametrize("kw,num_sms", [
    (dict(b=7, s_q=2, h_q=16, topk=200, block_size=64, fmt="fp8_ds_mla", lengths="var"), 8),
    (dict(b=2, s_q=1, h_q=80, topk=130, block_size=16, fmt="bf16", lengths="full", sink="inf"), 2),
    PAIR_CASES[0],
])
def test_emulated_decode_mma_sync_consumers(emu_mma_sync, kw, num_sms):
    # sm_100a's consumer warps (mma.sync + ldmatrix over the same tile layout)
    _check_decode(make_decode_case(31, **kw), num_sms=num_sms, consumer="mma_sync")


@pytest.mark.slow
def test_emulated_prefill_mma_sync_consumers(emu_mma_sync):
    from tests.cuda_emulator.emulate import prefill_emulated

    case = make_prefill_case(32, s_q=3, h_q=100, s_kv=300, topk=200, sink="inf")
    out, ml, lse = prefill_emulated(_prefill_call(case), consumer="mma_sync")
    e_out, e_ml, e_lse = case.expected()
    assert_close(out, e_out, "prefill_out", "out")
    assert_close(ml, e_ml, "prefill_max_logits", "max_logits")
    assert_close(lse, e_lse, "prefill_lse", "lse")


@pytest.mark.parametrize("kv_f16", [False, True], ids=["bf16_rows", "f16_rows"])
def test_f16_operands_saturate_and_stay_finite(emu, kv_f16):
    # The kernels' tensor-core operands are f16: a latent value beyond 65504 saturates to 65504
    # instead of becoming inf (which would turn scores into NaN); f16_rows: the wrapper's conversion.
    from tests.cuda_emulator.emulate import prefill_emulated

    big, sat = make_saturating_prefill_case(33)
    out, ml, lse = prefill_emulated(_prefill_call(big), kv_f16=kv_f16)
    assert np.isfinite(np.asarray(out, np.float32)).all() and np.isfinite(np.asarray(lse)).all()
    e_out, _, e_lse = sat.expected()
    assert np.abs(e_out).max() > 6e4  # the saturated values do reach the output
    assert_close(out, e_out, "prefill_out", "out")
    assert_close(lse, e_lse, "prefill_lse", "lse")


@pytest.mark.parametrize("kv_f16", [False, True], ids=["bf16_rows", "f16_rows"])
def test_emulated_prefill_lazy_rescaling(emu, kv_f16):
    # Tile maxima rise by 3, 12, 13 (natural log): the lazily moved softmax base stays, moves, then lags
    # the true maximum; out, lse and max_logits must not notice. f16_rows: the seesaw's two warpgroups
    # move the base in turn (warpgroup 1 from warpgroup 0's, which then rescales its P and O).
    from tests.cuda_emulator.emulate import prefill_emulated

    case = make_growing_scores_prefill_case(35)
    _, e_ml, _ = case.expected()
    assert np.all(np.asarray(e_ml) > 12.5)  # the last tile holds the maximum
    case.check(prefill_emulated(_prefill_call(case), kv_f16=kv_f16), "emulated prefill, growing scores")


@pytest.mark.parametrize("h_q,tiny", [(8, False), (128, False), (128, True)])
def test_emulated_decode_both_dequant_paths(emu, h_q, tiny):
    # h_q = 128: the paired kernel's producers (each warp's warp-uniform choice of dequantisation loop);
    # tiny: exponents k <= -19, where the f16 fast path would be wrong
    _check_decode(make_two_scale_decode_case(34, h_q=h_q, tiny=tiny), num_sms=4)


V41_IDS = [n for n, _ in V41_DECODE_GRID]


@pytest.mark.parametrize("name", V41_IDS)
def test_emulated_decode_v41_formats(emu, name):
    i = V41_IDS.index(name)
    _check_decode(make_decode_case(300 + i, **V41_DECODE_GRID[i][1]), num_sms=8)


@pytest.mark.parametrize("h_q,tiny", [(64, False), (128, False), (16, True)])
def test_emulated_decode_mxfp8_both_dequant_paths(emu, h_q, tiny):
    # UE8M0 exponents past [-14, 7]: the warp-uniform choice of dequant16's f32 path, next to an nvfp4 extra cache
    case = make_two_scale_decode_case(36, h_q=h_q, tiny=tiny, fmt="mxfp8_ds_mla",
                                      extra=dict(topk=64, block_size=2, fmt="nvfp4_ds_mla", lengths="full"))
    _check_decode(case, num_sms=4)


def test_emulated_decode_v41_mma_sync_consumers(emu_mma_sync):
    # the sm_100a build's consumers over the V4.1 producers
    case = make_decode_case(37, b=3, s_q=2, h_q=64, topk=128, block_size=64, fmt="mxfp8_ds_mla", lengths="var",
                            extra=dict(topk=128, block_size=2, fmt="nvfp4_ds_mla"))
    _check_decode(case, num_sms=8, consumer="mma_sync")


@pytest.mark.parametrize("fmt", ["nvfp4_ds_mla", "mxfp8_ds_mla"])
def test_emulated_v41_dequantization_is_exact(emu, fmt):
    # every code of the format: query token j attends to token j alone, so its output row is that token's
    # dequantized value, rounded once to bf16
    from tests.attention_cases import assert_v41_exact, make_v41_exact_decode_case

    case, want = make_v41_exact_decode_case(fmt)
    out, _ = _check_decode(case, num_sms=4)
    assert_v41_exact(out, want)


def test_emulated_decode_lengths_past_topk_and_poison(emu):
    # topk_length > topk is clamped; every slot not written is NaN / 0xFF; q rows of padded heads are 0.
    case = make_decode_case(22, b=3, s_q=1, h_q=5, topk=70, fmt="fp8_ds_mla", lengths="full", invalid_frac=0.3)
    case = dataclasses.replace(case, topk_length=jnp.asarray([70, 500, 3], jnp.int32))
    out, lse = _check_decode(case, num_sms=4)
    assert np.isfinite(np.asarray(out, np.float32)).all()


@pytest.mark.parametrize("seed,kw,num_sms,other_seed", [
    (23, dict(b=3, s_q=2, h_q=16, topk=192, fmt="fp8_ds_mla", extra=dict(topk=64, block_size=2, fmt="bf16")), 16, 7),
    # a head-group pair: other landing orders of the peer's copies and CTA skews too
    (42, dict(b=2, s_q=2, h_q=128, topk=160, block_size=61, s_kv=300, fmt="fp8_ds_mla",
              extra=dict(topk=64, block_size=2, fmt="fp8_ds_mla")), 8, 9),
], ids=["single_cta", "pair"])
def test_emulated_decode_is_deterministic(emu, seed, kw, num_sms, other_seed):
    from tests.cuda_emulator.emulate import decode_emulated

    call = _decode_call(make_decode_case(seed, **kw))
    a = decode_emulated(call, num_sms=num_sms, seed=1)
    b = decode_emulated(call, num_sms=num_sms, seed=other_seed, workers=1)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


PREFILL_IDS = [name for name, _ in PREFILL_GRID]


@pytest.mark.parametrize("kv_f16", [False, True], ids=["bf16_rows", "f16_rows"])
@pytest.mark.parametrize("name", PREFILL_IDS)
def test_emulated_prefill_grid(emu, name, kv_f16):
    # bf16_rows: prefill_cta (the producers convert); f16_rows: kv converted by the wrapper, the seesaw
    # CTA (cp.async producers, each warpgroup S of every other tile; seesaw.cuh)
    from tests.cuda_emulator.emulate import prefill_emulated

    i = PREFILL_IDS.index(name)
    case = make_prefill_case(200 + i, **PREFILL_GRID[i][1])
    out, ml, lse = prefill_emulated(_prefill_call(case), kv_f16=kv_f16)
    e_out, e_ml, e_lse = case.expected()
    assert_close(out, e_out, "prefill_out", "out")
    assert_close(ml, e_ml, "prefill_max_logits", "max_logits")
    assert_close(lse, e_lse, "prefill_lse", "lse")


@pytest.mark.parametrize("kv_f16", [False, True], ids=["bf16_rows", "f16_rows"])
def test_emulated_prefill_two_groups_and_seeds(emu, kv_f16):
    from tests.cuda_emulator.emulate import prefill_emulated

    case = make_prefill_case(24, s_q=3, h_q=100, s_kv=300, topk=200, sink="inf")
    a = prefill_emulated(_prefill_call(case), seed=3, kv_f16=kv_f16)
    b = prefill_emulated(_prefill_call(case), seed=11, workers=1, kv_f16=kv_f16)
    e_out, e_ml, e_lse = case.expected()
    assert_close(a[0], e_out, "prefill_out", "out")
    assert_close(a[1], e_ml, "prefill_max_logits", "max_logits")
    assert_close(a[2], e_lse, "prefill_lse", "lse")
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


def test_handler_refuses_pools_of_both_families(emu):
    # the FFI handler's own check (decode_supports keeps such calls away from it): one kernel family per call
    from cuda_ffi import ops as _ops
    from tests.cuda_emulator.emulate import run_decode_ffi

    case = make_decode_case(25, fmt="mxfp8_ds_mla", topk=64, h_q=4, extra=dict(topk=64, block_size=2, fmt="fp8_ds_mla"))
    call = _decode_call(case)
    args, attrs, results, _ = _ops.prepare_decode(call, _ops.call_plan(call, num_sms=8, planner="jax"))
    with pytest.raises(ValueError, match="kv_cache / extra_kv_cache formats: mxfp8_ds_mla next to fp8_ds_mla is not "
                                         "supported"):
        run_decode_ffi(args, attrs, results)
    bad = dict(attrs, extra_kv_format=np.int64(4))  # an fp8_ds_mla extra cache named nvfp4_ds_mla: its page size
    with pytest.raises(ValueError, match=r"extra_kv_cache: expected shape \[\*, 1024\], got \[43, 1728\] \(nvfp4_ds_mla "
                                         r"page_bytes = ceil\(2 \* 288 / 512\) \* 512 for block_size 2\)"):
        run_decode_ffi(args, bad, results)


def test_handler_checks_name_the_argument(emu):
    from cuda_ffi import ops as _ops
    from tests.cuda_emulator.emulate import run_decode_ffi, run_prefill_ffi

    case = make_decode_case(25, fmt="fp8_ds_mla", topk=64, h_q=4)
    call = _decode_call(case)
    args, attrs, results, _ = _ops.prepare_decode(call, _ops.call_plan(call, num_sms=8, planner="jax"))
    bad = list(args)
    bad[4] = bad[4][:2]  # attn_sink (the narrow CTA: q's 4 heads as they are)
    with pytest.raises(ValueError, match=r"attn_sink: expected shape \[4\], got \[2\]"):
        run_decode_ffi(bad, attrs, results)
    bad = list(args)
    bad[0] = jnp.zeros(bad[0].shape[:2] + (0, 512), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"q: expected at least one head, got shape \[3, 2, 0, 512\]"):
        run_decode_ffi(bad, attrs, results)
    bad[0] = jnp.zeros(bad[0].shape[:2] + (40, 512), jnp.bfloat16)  # any head count; the sink must match it
    with pytest.raises(ValueError, match=r"attn_sink: expected shape \[40\], got \[4\] \(or \[0\]: no sink\)"):
        run_decode_ffi(bad, attrs, results)
    bad = list(args)
    bad[2] = bad[2].astype(jnp.float32)  # indices
    with pytest.raises(ValueError, match="indices: expected dtype int32, got float32"):
        run_decode_ffi(bad, attrs, results)
    bad = list(args)
    bad[3] = bad[3][:2]  # topk_length: [b] or [1]
    with pytest.raises(ValueError, match=r"topk_length: expected shape \[3\] \(one per row\) or \[1\]"):
        run_decode_ffi(bad, attrs, results)
    with pytest.raises(ValueError, match="kv_cache block_size: expected 1..1048576, got 0"):
        run_decode_ffi(args, dict(attrs, block_size=np.int64(0)), results)
    bad = list(args)
    bad[6] = bad[6][:-1]  # num_splits
    with pytest.raises(ValueError, match=r"num_splits: expected shape \[4\], got \[3\]"):
        run_decode_ffi(bad, attrs, results)
    bad = list(results)
    bad[2] = jax.ShapeDtypeStruct((5,) + bad[2].shape[1:], bad[2].dtype)  # o_accum: b + parts slots, or 1
    with pytest.raises(ValueError, match=r"o_accum: expected 7 slots \(b \+ num_parts\) or 1"):
        run_decode_ffi(args, attrs, bad)
    with pytest.raises(ValueError, match="planner must be one of"):
        _ops.call_plan(call, planner="host")
    pcase = make_prefill_case(26, s_q=2, h_q=4, topk=64)
    pargs, pattrs, presults, _ = _ops.prepare_prefill(_prefill_call(pcase))
    assert pargs[0].shape == (2, 4, 512)  # q's 4 heads as they are: the kernel completes the group itself
    with pytest.raises(ValueError, match=r"attn_sink: expected shape \[4\], got \[64\] \(or \[0\]: no sink\)"):
        run_prefill_ffi(tuple(pargs[:4]) + (jnp.zeros((64,), jnp.float32),), pattrs, presults)
    bad = (jax.ShapeDtypeStruct((2, 64, 512), jnp.bfloat16),) + tuple(presults[1:])
    with pytest.raises(ValueError, match=r"out: expected shape \[2, 4, 512\], got \[2, 64, 512\]"):
        run_prefill_ffi(pargs, pattrs, bad)


# ------------------------------------------------------------------------------ the split planner (emulated)
def _random_plan_case(rng, b):
    topk = int(rng.choice([64, 2048, 20000]))
    mode = int(rng.integers(0, 4))
    if mode == 0:
        tl = rng.integers(0, 20001, b)
    elif mode == 1:
        tl = np.full(b, topk)
    elif mode == 2:
        tl = rng.integers(-5, 130, b)  # short requests, zeros, negatives
    else:
        tl = np.where(rng.random(b) < 0.5, 0, rng.integers(0, 20001, b))
    tl = np.clip(tl, 0, topk).astype(np.int32)  # the wrapper's clamp (the planner clamps too)
    et = None
    if rng.random() < 0.5:
        et = np.clip(rng.integers(0, 5000, b), 0, 4096).astype(np.int32)
    return tl, topk, et


# (b, num_sm_parts): one compile of plan_decode_splits each (with and without extra), many length draws
PLAN_SHAPES = [(1, 1), (3, 66), (7, 3), (33, 2), (128, 33), (128, 66), (257, 132), (300, 17), (300, 200)]


@pytest.mark.parametrize("b,parts", PLAN_SHAPES)
def test_emulated_planner_matches_plan_decode_splits(emu, b, parts):
    from tests.cuda_emulator.emulate import plan_emulated

    rng = np.random.default_rng(1000 * b + parts)
    jplan = jax.jit(lambda t: plan_decode_splits(t, topk=1 << 20, num_sm_parts=parts))
    jplan_x = jax.jit(lambda t, e: plan_decode_splits(t, topk=1 << 20, num_sm_parts=parts, extra_topk_length=e))
    for _ in range(8):
        tl, topk, et = _random_plan_case(rng, b)
        meta, splits = plan_emulated(tl, topk=topk, num_sm_parts=parts, extra_topk_length=et,
                                     extra_topk=4096, seed=int(rng.integers(1 << 30)))
        want = jplan(tl) if et is None else jplan_x(tl, et)
        np.testing.assert_array_equal(meta, np.asarray(want[0]), err_msg=f"metadata b={b} parts={parts}")
        np.testing.assert_array_equal(splits, np.asarray(want[1]), err_msg=f"num_splits b={b} parts={parts}")


def test_emulated_planner_many_random_cases(emu, plan_oracle):
    # 300 more draws (b up to 300, lengths 0..20000, with/without extra, several part counts) against
    # the plain-Python FlashMLA planner, which tests/test_scheduler.py ties to plan_decode_splits.
    from tests.cuda_emulator.emulate import plan_emulated

    rng = np.random.default_rng(7)
    for i in range(300):
        b = int(rng.integers(1, 301))
        parts = int(rng.choice([1, 2, 3, 5, 16, 33, 66, 132, 264]))
        tl, topk, et = _random_plan_case(rng, b)
        meta, splits = plan_emulated(tl, topk=topk, num_sm_parts=parts, extra_topk_length=et, extra_topk=4096,
                                     seed=i)
        rows, ns = plan_oracle(tl.tolist(), topk=topk, num_sm_parts=parts,
                               extra_topk_length=None if et is None else et.tolist())
        np.testing.assert_array_equal(meta, np.asarray(rows, np.int32), err_msg=f"case {i}: b={b} parts={parts}")
        np.testing.assert_array_equal(splits, np.asarray(ns, np.int32), err_msg=f"case {i}: b={b} parts={parts}")


@pytest.mark.parametrize("b,parts,topk,extra,want_cta", [
    (2, 66, 16384, None, True),        # few long requests: long walks inside one request
    (5, 7, 2048, 512, True),           # fewer parts than the walk's stride
    (64, 66, 16384, None, True),       # top-k 16384: a 16.7k-entry cost table
    (148, 66, 16384, None, False),     # FlashMLA's top-k 16384 case: 38.6k entries, past the CTA planner's tables
    (128, 132, 128, 512, True),        # a V4.1 step's c1a plan (every part ends on a request boundary)
    (3, 5, 64 << 16, None, False),     # one request of 2^16 blocks or more: the warp planner
])
def test_emulated_planner_paths(emu, b, parts, topk, extra, want_cta):
    # the CTA planner where its table fits and the warp planner elsewhere, both equal to plan_decode_splits
    from tests.cuda_emulator.emulate import plan_emulated

    rng = np.random.default_rng(b * 7 + parts)
    for draw in range(3):
        tl = rng.integers(0, topk + 1, b).astype(np.int32)
        if draw == 0:
            tl[:] = topk
        et = None if extra is None else rng.integers(0, extra + 1, b).astype(np.int32)
        meta, splits, smem = plan_emulated(tl, topk=topk, num_sm_parts=parts, extra_topk_length=et,
                                           extra_topk=extra or 0, seed=draw, return_smem_bytes=True)
        assert (smem > 0) == want_cta, smem
        want = plan_decode_splits(tl, topk=topk, num_sm_parts=parts, extra_topk_length=et)
        np.testing.assert_array_equal(meta, np.asarray(want[0]), err_msg=f"metadata, draw {draw}")
        np.testing.assert_array_equal(splits, np.asarray(want[1]), err_msg=f"num_splits, draw {draw}")


def test_emulated_planner_clamps_like_the_kernel(emu):
    # lengths past topk / negative are clamped to [0, topk] (the decode kernel's clamp_len), so the
    # plan equals plan_decode_splits of the clamped lengths
    from tests.cuda_emulator.emulate import plan_emulated

    tl = np.array([-7, 0, 5000, 63, 64, 65, 1 << 30], np.int32)
    et = np.array([9000, -1, 0, 1, 4096, 100, 7], np.int32)
    meta, splits = plan_emulated(tl, topk=2048, num_sm_parts=9, extra_topk_length=et, extra_topk=512)
    want = plan_decode_splits(jnp.clip(tl, 0, 2048), topk=2048, num_sm_parts=9,
                              extra_topk_length=jnp.clip(et, 0, 512))
    np.testing.assert_array_equal(meta, np.asarray(want[0]))
    np.testing.assert_array_equal(splits, np.asarray(want[1]))


def test_emulated_planner_refuses_plans_past_its_int32_positions(emu):
    # the planner's positions reach twice the plan's total cost in int32: a plan that could pass 2^30 blocks
    # is refused by the handler's checks before any kernel runs
    from tests.cuda_emulator.emulate import plan_emulated

    tl = np.zeros(32, np.int32)
    with pytest.raises(ValueError, match=r"split plan too large: b \* \(blocks per request \+ 5\) = 1073741984"):
        plan_emulated(tl, topk=(1 << 31) - 1, num_sm_parts=4)
    meta, splits = plan_emulated(tl, topk=(1 << 31) - 1 - 64 * 32, num_sm_parts=4)  # just below: planned
    assert splits.shape == (33,) and meta.shape == (4, 8)


def test_emulated_batch_planner_plans_each_layer_type(emu):
    # one launch, one warp per plan: every plan equals plan_decode_splits of its own lengths
    from tests.cuda_emulator.emulate import plan_batch_emulated

    rng = np.random.default_rng(11)
    b, parts = 37, 13
    tl = rng.integers(0, 129, b).astype(np.int32)
    e1, e2 = rng.integers(0, 600, b).astype(np.int32), rng.integers(0, 300, b).astype(np.int32)
    etl = np.stack([np.zeros(b, np.int32), e1, e2])
    meta, splits = plan_batch_emulated(tl, etl, batch=b, topk=128, extra_topk=[0, 512, 512], has_extra=[0, 1, 1],
                                       num_sm_parts=parts)
    wants = [plan_decode_splits(tl, topk=128, num_sm_parts=parts),
             plan_decode_splits(tl, topk=128, num_sm_parts=parts, extra_topk_length=np.minimum(e1, 512)),
             plan_decode_splits(tl, topk=128, num_sm_parts=parts, extra_topk_length=e2)]
    for j, (wm, ws) in enumerate(wants):
        np.testing.assert_array_equal(meta[j], np.asarray(wm), err_msg=f"plan {j}")
        np.testing.assert_array_equal(splits[j], np.asarray(ws), err_msg=f"plan {j}")
    # one length for every request ([1] operands)
    meta1, splits1 = plan_batch_emulated(np.array([100], np.int32), np.array([[0], [300]], np.int32), batch=b,
                                         topk=128, extra_topk=[0, 512], has_extra=[0, 1], num_sm_parts=parts)
    full = np.full(b, 100, np.int32)
    for j, et in enumerate([None, np.full(b, 300, np.int32)]):
        wm, ws = plan_decode_splits(full, topk=128, num_sm_parts=parts, extra_topk_length=et)
        np.testing.assert_array_equal(meta1[j], np.asarray(wm))
        np.testing.assert_array_equal(splits1[j], np.asarray(ws))


def test_emulated_decode_plan_in_call_and_passed_in(emu):
    # the plan made in the call (emulated planner kernel) is FlashMLA's; passing a plan made by make_decode_plan
    # gives bitwise the same outputs (same plan, same accumulation order)
    from tests.cuda_emulator.emulate import decode_emulated

    case = make_decode_case(27, b=5, s_q=1, h_q=8, topk=256, block_size=64, fmt="fp8_ds_mla", lengths="var",
                            extra=dict(topk=128, block_size=2, fmt="bf16"))
    call = _decode_call(case)
    got = decode_emulated(call, num_sms=16, return_plan=True)
    topk = call.indices.shape[2]
    plan = make_decode_plan(call.topk_length, s_q=1, num_heads=8, topk=topk, extra_topk_length=call.extra_topk_length,
                            extra_topk=call.extra_indices.shape[2], num_sms=16, planner="jax")
    want = plan_decode_splits(jnp.clip(call.topk_length, 0, topk), topk=topk, num_sm_parts=16,
                              extra_topk_length=jnp.clip(call.extra_topk_length, 0, call.extra_indices.shape[2]))
    for p in (got[2], plan):
        np.testing.assert_array_equal(np.asarray(p.tile_scheduler_metadata), np.asarray(want[0]))
        np.testing.assert_array_equal(np.asarray(p.num_splits), np.asarray(want[1]))
    assert np.asarray(want[1])[-1] > 5, "the case should split some requests"
    given = decode_emulated(dataclasses.replace(call, plan=plan), num_sms=16)
    for x, y in zip(got[:2], given):
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))
    e_out, e_lse = case.expected()
    assert_close(got[0], e_out, "decode_out", "out")
    assert_close(got[1], e_lse, "decode_lse", "lse")


def _stale_case(seed, **kw):
    # 4 requests of up to 4 + 2 blocks over 24 parts: every request splits, so a plan from other lengths
    # moves split boundaries over both caches
    return make_decode_case(seed, b=4, s_q=2, h_q=8, topk=256, block_size=64, fmt="fp8_ds_mla", lengths="var",
                            extra=dict(topk=128, block_size=2, fmt="fp8_ds_mla", lengths="var"), **kw)


@pytest.mark.slow
def test_emulated_decode_stale_plans_stay_in_bounds(emu):
    # a plan made from other lengths: finite everywhere, never NaN from the poisoned unused slots; from longer
    # lengths (every request at topk) exact; from shorter ones the tokens outside the plan's blocks are dropped
    from tests.cuda_emulator.emulate import decode_emulated

    case = _stale_case(28)
    call = _decode_call(case)
    b, topk, etopk = call.q.shape[0], call.indices.shape[2], call.extra_indices.shape[2]
    rng = np.random.default_rng(3)

    def plan_for(tl, etl):
        return make_decode_plan(jnp.asarray(tl, jnp.int32), s_q=2, num_heads=8, topk=topk,
                                extra_topk_length=jnp.asarray(etl, jnp.int32), extra_topk=etopk, num_sms=24,
                                planner="jax")

    longest = plan_for(np.full(b, topk), np.full(b, etopk))
    assert (np.diff(np.asarray(longest.num_splits)) > 1).all(), "every request should split"
    out, lse = decode_emulated(dataclasses.replace(call, plan=longest), num_sms=24)
    e_out, e_lse = case.expected()
    assert_close(out, e_out, "decode_out", "out")
    assert_close(lse, e_lse, "decode_lse", "lse")
    for i in range(4):
        stale = plan_for(rng.integers(0, topk + 1, b), rng.integers(0, etopk + 1, b))
        assert bool(plan_is_stale(stale, call.topk_length, call.extra_topk_length))
        out, lse = decode_emulated(dataclasses.replace(call, plan=stale), num_sms=24, seed=5 + i)
        assert np.isfinite(np.asarray(out, np.float32)).all(), f"stale plan {i}: out not finite"
        assert not np.isnan(np.asarray(lse)).any(), f"stale plan {i}: lse NaN"
    fresh = plan_for(call.topk_length, call.extra_topk_length)
    assert not bool(plan_is_stale(fresh, call.topk_length, call.extra_topk_length))


@pytest.mark.slow
@pytest.mark.parametrize("h_q,pair", [(8, False), (128, True)])
def test_emulated_decode_batch_invariant(emu, h_q, pair):
    # no split-KV and one part per request: a request's out and lse are bitwise the same alone and in any batch
    from tests.cuda_emulator.emulate import decode_emulated

    case = make_decode_case(29, b=5, s_q=2, h_q=h_q, topk=300, block_size=61, fmt="fp8_ds_mla", lengths="var",
                            s_kv=900, extra=dict(topk=128, block_size=2, fmt="fp8_ds_mla", lengths="var"))
    call = dataclasses.replace(_decode_call(case), batch_invariant=True)
    full = decode_emulated(call, num_sms=16)
    e_out, e_lse = case.expected()
    assert_close(full[0], e_out, "decode_out", "out")
    assert_close(full[1], e_lse, "decode_lse", "lse")
    perm = np.array([3, 0, 4])
    sub = dataclasses.replace(call, q=call.q[perm], indices=call.indices[perm], topk_length=call.topk_length[perm],
                              extra_indices=call.extra_indices[perm], extra_topk_length=call.extra_topk_length[perm])
    part = decode_emulated(sub, num_sms=16, seed=9)
    for x, y in zip(full, part):
        np.testing.assert_array_equal(np.asarray(x, np.float32)[perm], np.asarray(y, np.float32))


# ------------------------------------------------------------------- variant emulators (run in the background)
# Each builds the emulator from a patched copy of csrc/ and runs a script over it in a fresh interpreter; the
# module's `background` fixture starts them with the module, so they overlap the tests above.
_PLANT_SCRIPT = '''
import sys
import tests.cuda_emulator.emulate as E
E.load(path=sys.argv[1])
from tests.attention_cases import make_decode_case
from tests.test_cuda_ffi import _decode_call
case = make_decode_case(43, b=2, s_q=2, h_q=128, topk=256, block_size=64, fmt="fp8_ds_mla", lengths="full")
for seed in (1, 2, 3):
    case.check(*E.decode_emulated(_decode_call(case), num_sms=4, seed=seed), "planted")
print("PLANT-OK")
'''


# ------------------------------------------------------------------------------ the mega decode (emulated)
def _mega_call(case: MegaCase, **kw):
    from dsv41_jax.sparse_mla.base import make_mega_decode_call

    q, pos, cs, kv, idx, tl = case.args()
    k = dict(case.kwargs(), **kw)
    return make_mega_decode_call(q, pos, cs, kv, idx, tl, k["kv_format"], k["block_size"], k["softmax_scale"],
                                 k["attn_sink"], k.get("extra_kv_cache"), k.get("extra_indices"),
                                 k.get("extra_topk_length"), k.get("extra_kv_format"), k.get("extra_block_size"),
                                 k.get("plan"), k.get("batch_invariant"))


MEGA_IDS = [n for n, _ in MEGA_DECODE_GRID]


# num_sms 132: requests split into pieces (the combine's mega stage); 3: most requests one piece (the staged
# epilogue's, and in the narrow CTA the combine's for every request)
@pytest.mark.parametrize("num_sms", [132, 3])
@pytest.mark.parametrize("name", MEGA_IDS)
def test_emulated_mega_decode_grid(emu, name, num_sms):
    from tests.cuda_emulator.emulate import mega_decode_emulated

    i = MEGA_IDS.index(name)
    case = make_mega_case(400 + i, **MEGA_DECODE_GRID[i][1])
    out, scale, lse = mega_decode_emulated(_mega_call(case), num_sms=num_sms)
    assert_mega_close(out, scale, lse, case.expected(), f"emulated mega decode {name}")


@pytest.mark.parametrize("h_q,num_sms", [(64, 3), (24, 132)])
def test_emulated_mega_decode_mma_sync_consumers(emu_mma_sync, h_q, num_sms):
    # the sm_100a build: no staged epilogue, the combine finishes every request
    from tests.cuda_emulator.emulate import mega_decode_emulated

    case = make_mega_case(420, b=4, h_q=h_q, topk=128, block_size=64, fmt="mxfp8_ds_mla",
                          extra=dict(topk=64, block_size=2, fmt="nvfp4_ds_mla"))
    out, scale, lse = mega_decode_emulated(_mega_call(case), num_sms=num_sms, consumer="mma_sync")
    assert_mega_close(out, scale, lse, case.expected(), "emulated mega decode (mma.sync)")


@pytest.mark.parametrize("h_q,num_sms", [(64, 3), (64, 132), (128, 3), (8, 3)])
def test_emulated_mega_output_stage_is_exact(emu, h_q, num_sms):
    # Each query attends to one token with no sink: the inverse RoPE and the quantisation must give the exact
    # bytes wherever the output stage runs (staged epilogue, combine).
    from tests.cuda_emulator.emulate import mega_decode_emulated

    case, want = make_mega_exact_case(h_q)
    out, scale, _ = mega_decode_emulated(_mega_call(case), num_sms=num_sms)
    assert_mega_exact(out, scale, want, f"emulated mega decode h{h_q}")


def test_emulated_mega_decode_many_requests_per_cta(emu):
    # one part over 300 requests: past the CTA's kMegaPositions (256) staged positions, the rest read from global memory
    from tests.cuda_emulator.emulate import mega_decode_emulated

    case = make_mega_case(427, b=300, h_q=64, topk=64, block_size=64, fmt="mxfp8_ds_mla", s_kv=256, invalid_frac=0.2)
    out, scale, lse = mega_decode_emulated(_mega_call(case), num_sms=1)
    assert_mega_close(out, scale, lse, case.expected(), "mega decode, 300 requests in one CTA")


def test_emulated_mega_decode_batch_invariant(emu):
    # batch_invariant: request 0's bytes do not depend on the requests beside it
    from tests.cuda_emulator.emulate import mega_decode_emulated

    case = make_mega_case(422, b=5, h_q=64, topk=128, block_size=64, fmt="mxfp8_ds_mla",
                          extra=dict(topk=192, block_size=2, fmt="nvfp4_ds_mla"))
    whole = mega_decode_emulated(_mega_call(case, batch_invariant=True), num_sms=132)
    c = case.base
    one_base = dataclasses.replace(c, q=c.q[:1], indices=c.indices[:1], topk_length=c.topk_length[:1],
                                   extra_indices=c.extra_indices[:1], extra_topk_length=c.extra_topk_length[:1])
    one = mega_decode_emulated(_mega_call(MegaCase(one_base, case.positions[:1], case.cos_sin_cache),
                                          batch_invariant=True), num_sms=132)
    for x, y in zip(whole, one):
        np.testing.assert_array_equal(np.asarray(x)[:1].view(np.uint8), np.asarray(y).view(np.uint8))
    assert_mega_close(*whole, case.expected(), "batch-invariant mega decode")


def test_emulated_mega_decode_over_a_stale_plan(emu):
    # a plan made for longer requests than the call's: the outputs stay finite and correct for the call's lengths
    from tests.cuda_emulator.emulate import mega_decode_emulated

    case = make_mega_case(423, b=6, h_q=64, topk=128, block_size=64, fmt="mxfp8_ds_mla",
                          extra=dict(topk=128, block_size=2, fmt="nvfp4_ds_mla"))
    c = case.base
    plan = make_decode_plan(jnp.full((6,), 128, jnp.int32), topk=128, s_q=1, num_heads=64, num_sms=132,
                            extra_topk_length=jnp.full((6,), 128, jnp.int32), extra_topk=128)
    assert bool(plan_is_stale(plan, c.topk_length, c.extra_topk_length))
    out, scale, lse = mega_decode_emulated(_mega_call(case, plan=plan), num_sms=132)
    assert_mega_close(out, scale, lse, case.expected(), "mega decode over a stale plan")


def test_mega_supports_refuses_pools_of_both_families():
    from cuda_ffi import ops as _ops

    case = make_mega_case(424, fmt="mxfp8_ds_mla", topk=64, h_q=4, extra=dict(topk=64, block_size=2, fmt="fp8_ds_mla"))
    assert "not both in one call" in _ops.mega_decode_supports(_mega_call(case))


def test_mega_handler_checks_name_the_argument(emu):
    from cuda_ffi import ops as _ops
    from tests.cuda_emulator.emulate import run_mega_decode_ffi

    case = make_mega_case(425, fmt="mxfp8_ds_mla", topk=64, h_q=4)
    call = _mega_call(case)
    args, attrs, results, _ = _ops.prepare_mega_decode(call, _ops.call_plan(call.decode, num_sms=8, planner="jax"))
    bad = list(args)
    bad[10] = bad[10][:2]
    with pytest.raises(ValueError, match=r"dsv41_sparse_mla_mega_decode: positions: expected shape \[4, 1\], got \[2, 1\]"):
        run_mega_decode_ffi(bad, attrs, results)
    bad = list(args)
    bad[11] = bad[11][:, :32]
    with pytest.raises(ValueError, match=r"cos_sin_cache: expected shape \[\*, 64\], got \[512, 32\]"):
        run_mega_decode_ffi(bad, attrs, results)
    wrong = list(results)
    wrong[3] = jax.ShapeDtypeStruct((1,) + results[3].shape[1:], jnp.float32)
    wrong[4] = jax.ShapeDtypeStruct((1,) + results[4].shape[1:], jnp.float32)
    with pytest.raises(ValueError, match=r"o_accum: expected \d+ slots \(b \+ num_parts; a mega decode\)"):
        run_mega_decode_ffi(args, attrs, wrong)
    wrong = list(results)
    wrong[1] = jax.ShapeDtypeStruct(results[1].shape[:-1] + (8,), jnp.uint8)
    with pytest.raises(ValueError, match=r"out_scale: expected shape \[4, 1, 4, 16\]"):
        run_mega_decode_ffi(args, attrs, wrong)


def test_mega_decode_lowers_to_custom_call(cuda_lib):
    from dsv41_jax import sparse_mla_mega_decode

    case = make_mega_case(426, fmt="mxfp8_ds_mla", topk=128, block_size=64, h_q=64, b=3,
                          extra=dict(topk=64, block_size=2, fmt="nvfp4_ds_mla"))
    traced = jax.jit(lambda *a: sparse_mla_mega_decode(*a, impl="cuda", **case.kwargs())).trace(*case.args())
    assert [(tuple(o.shape), o.dtype) for o in traced.out_info] == [
        ((3, 64, 512), jnp.float8_e4m3fn), ((3, 64, 16), jnp.uint8), ((3, 64), jnp.float32)]
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert "dsv41_sparse_mla_mega_decode" in text and "dsv41_sparse_mla_decode\"" not in text


# ------------------------------------------------------------------------------ the mega prefill (emulated)
def _mega_prefill_call(case: MegaPrefillCase):
    from dsv41_jax.sparse_mla.base import make_mega_prefill_call

    return make_mega_prefill_call(*case.args(), **case.kwargs())


MEGA_PREFILL_IDS = [n for n, _ in MEGA_PREFILL_GRID]


# bf16 rows (prefill_cta) and f16 rows (the seesaw CTA in the wgmma build), each consumer build
@pytest.mark.parametrize("consumer", ["wgmma", "mma_sync"])
@pytest.mark.parametrize("kv_f16", [False, True])
@pytest.mark.parametrize("name", MEGA_PREFILL_IDS)
def test_emulated_mega_prefill_grid(emu, emu_mma_sync, name, kv_f16, consumer):
    from tests.cuda_emulator.emulate import mega_prefill_emulated

    i = MEGA_PREFILL_IDS.index(name)
    case = make_mega_prefill_case(500 + i, **MEGA_PREFILL_GRID[i][1])
    out, scale, lse = mega_prefill_emulated(_mega_prefill_call(case), kv_f16=kv_f16, consumer=consumer)
    assert_mega_close(out, scale, lse, case.expected(), f"emulated mega prefill {name}", kind="prefill")


@pytest.mark.parametrize("consumer", ["wgmma", "mma_sync"])
@pytest.mark.parametrize("kv_f16,h_q", [(False, 64), (True, 64), (True, 100), (False, 8)])
def test_emulated_mega_prefill_output_stage_is_exact(emu, emu_mma_sync, kv_f16, h_q, consumer):
    # As the mega decode's: each query attends to one row with no sink, so the inverse RoPE and the quantisation of
    # that row (exact in f16: small integers times a power of two) must give these bytes exactly.
    from tests.cuda_emulator.emulate import mega_prefill_emulated

    case = make_mega_prefill_case(510, s_q=6, h_q=h_q, s_kv=64, topk=64, invalid_frac=0.0, sink="none")
    rng = np.random.default_rng(511)
    kv = (rng.integers(-64, 65, size=(64, 512)) * 2.0 ** rng.integers(-6, 3, size=(64, 1))).astype(np.float32)
    case.base = dataclasses.replace(case.base, kv=jnp.asarray(kv, jnp.bfloat16), topk_length=jnp.ones(6, jnp.int32))
    rows = kv[np.asarray(case.base.indices[:, 0])]  # [s_q, 512]
    out, scale, _ = mega_prefill_emulated(_mega_prefill_call(case), kv_f16=kv_f16, consumer=consumer)
    assert_mega_exact(out, scale, mega_out_exact(rows, case.positions, case.cos_sin_cache),
                      f"emulated mega prefill h{h_q}")


def test_emulated_mega_prefill_ropes_at_the_positions(emu):
    # the same call at other positions gives another output: the kernel reads positions (and a wrong rotation is
    # out of the grid's bounds)
    from tests.cuda_emulator.emulate import mega_prefill_emulated

    case = make_mega_prefill_case(512, s_q=4, h_q=64, s_kv=128, topk=64)
    moved = dataclasses.replace(case, positions=(case.positions + 7) % 512)
    out, scale, lse = mega_prefill_emulated(_mega_prefill_call(moved))
    assert_mega_close(out, scale, lse, moved.expected(), "mega prefill at moved positions", kind="prefill")
    with pytest.raises(AssertionError, match="out of bound"):
        assert_mega_close(out, scale, lse, case.expected(), "", kind="prefill")


def test_mega_prefill_handler_checks_name_the_argument(emu):
    from cuda_ffi import ops as _ops
    from tests.cuda_emulator.emulate import run_mega_prefill_ffi

    case = make_mega_prefill_case(513, s_q=3, h_q=4, topk=64)
    args, attrs, results, _ = _ops.prepare_mega_prefill(_mega_prefill_call(case))
    bad = list(args)
    bad[5] = bad[5][:2]
    with pytest.raises(ValueError, match=r"dsv41_sparse_mla_mega_prefill: cos_sin_rows: expected shape \[3, 64\], "
                                         r"got \[2, 64\]"):
        run_mega_prefill_ffi(bad, attrs, results)
    bad = list(args)
    bad[5] = bad[5][:, :32]
    with pytest.raises(ValueError, match=r"cos_sin_rows: expected shape \[3, 64\], got \[3, 32\]"):
        run_mega_prefill_ffi(bad, attrs, results)
    bad = list(args)
    bad[5] = np.asarray(bad[5]).astype(np.float16)
    with pytest.raises(ValueError, match=r"cos_sin_rows: expected dtype float32"):
        run_mega_prefill_ffi(bad, attrs, results)
    wrong = list(results)
    wrong[1] = jax.ShapeDtypeStruct((3, 4, 8), jnp.uint8)
    with pytest.raises(ValueError, match=r"out_scale: expected shape \[3, 4, 16\], got \[3, 4, 8\]"):
        run_mega_prefill_ffi(args, attrs, wrong)
    wrong = list(results)
    wrong[0] = jax.ShapeDtypeStruct((3, 4, 512), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"dsv41_sparse_mla_mega_prefill: out: expected dtype uint8"):
        run_mega_prefill_ffi(args, attrs, wrong)


def test_mega_prefill_lowers_to_custom_call(cuda_lib):
    from dsv41_jax import sparse_mla_mega_prefill

    case = make_mega_prefill_case(514, s_q=5, h_q=70, s_kv=100, topk=90)
    traced = jax.jit(lambda *a: sparse_mla_mega_prefill(*a, impl="cuda", **case.kwargs())).trace(*case.args())
    assert [(tuple(o.shape), o.dtype) for o in traced.out_info] == [
        ((5, 70, 512), jnp.float8_e4m3fn), ((5, 70, 16), jnp.uint8), ((5, 70), jnp.float32)]
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert "dsv41_sparse_mla_mega_prefill" in text and "dsv41_sparse_mla_prefill\"" not in text


@pytest.mark.slow
@pytest.mark.parametrize("plant,what", [(0, None), (1, "PFULL wait"), (2, "PEMPTY wait"), (3, "final cluster barrier")])
def test_emulator_catches_planted_pair_bugs(background, plant, what, tmp_path):
    # The emulator's cluster model must make each missing synchronisation of the pair protocol visible
    # (_PLANTS: each removes one wait or barrier from a copy of csrc/); plant 0 is the unmodified kernel through
    # the same script.
    rc, out = _variant(background, f"plant{plant}", tmp_path)
    if plant == 0:
        assert rc == 0 and "PLANT-OK" in out, out[-3000:]
    else:
        assert rc != 0 and "PLANT-OK" not in out, f"the emulator missed a removed {what}"
        assert "emu:" in out or "AssertionError" in out, out[-3000:]


# The planted bugs: (file in csrc/, the exact synchronisation it removes, what replaces it). copy_sources fails when
# a snippet no longer occurs exactly once, so an edit of the pair protocol that moves one shows up here.
_PLANTS = {
    1: ("producer.cuh", "      mbar_wait(smem_addr(smem + bar_pfull(buf)), (uint32_t)(tc >> 1) & 1u);\n", ""),
    2: ("producer.cuh", "if (pair) mbar_wait(smem_addr(smem + bar_pempty(buf)), (uint32_t)((tc >> 1) - 1) & 1u);", ""),
    3: ("pair.cuh", "if constexpr (C::ncta == 2) cluster_sync();", ""),
}
# background job -> (patches of csrc/, script); the test each belongs to
_VARIANTS = {
    "plant0": ((), _PLANT_SCRIPT),
    **{f"plant{n}": ((patch,), _PLANT_SCRIPT) for n, patch in _PLANTS.items()},
}
_VARIANT_TESTS = {"test_emulator_catches_planted_pair_bugs": "plant"}
