"""GPU tests of `impl="pallas"` (the Mosaic GPU kernels of pallas_kernels/) on an SM90 / SM100 device.

Run on the GPU machine from the repository root:
    PYTHONPATH=. python3 -m pytest -q -m gpu tests/gpu/test_pallas_gpu.py

- the shared decode / prefill grids (tests/attention_cases.py) and the V4.1 decode grid (mxfp8_ds_mla and
  nvfp4_ds_mla pools) against the float64 oracle with FlashMLA's tolerances, in both operand modes; every
  V4.1 code dequantized exactly; mxfp8's fast and f32 f16 paths; the V4.1-Flash shape against xla;
- a few grid cases again with a forced split count (partial outputs + combine);
- large cases against the xla reference: decode b=128, s_q=2, h=128, topk 2048 (fp8_ds_mla),
  decode b=4 with topk 2048 + extra 1024 (splits), prefill s_q=512, h=128, topk 2048;
- determinism: two runs are bitwise equal; caches past 4 GiB in each quantized format; persistent CTAs
  (`kernel_options(ctas=...)`) bitwise equal to one CTA per item;
- the mega ops (`sparse_mla_mega_decode` / `sparse_mla_mega_prefill(impl="pallas")`): the mega grids in both
  operand modes, the decode with its output stage in the kernel and in the combine, the output stage's exact
  bytes, the V4.1-Flash decode shape and a prefill of s_q 700 against the reference;
- both operand modes (`kernel_options(f16=...)`: f16 Q / K / P, the default for large prefill; bf16
  with P = P_hi + P_lo, the default for decode and small prefill) on grid cases run in the other mode, the f16 conversion's saturation, and the fp8 -> f16 conversion's
  fast (exponents 113..134) and f32 paths (tokens of both ranges, and tiny ones only on the f32 path).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

if jax.default_backend() != "gpu":
    pytest.skip(f"needs a CUDA GPU: jax.default_backend() is {jax.default_backend()!r}", allow_module_level=True)

import pallas_kernels  # noqa: E402
from dsv41_jax import (  # noqa: E402
    sparse_mla_decode,
    sparse_mla_mega_decode,
    sparse_mla_mega_prefill,
    sparse_mla_prefill,
)
from tests.attention_cases import (  # noqa: E402
    DECODE_GRID,
    MEGA_DECODE_GRID,
    MEGA_PREFILL_GRID,
    PREFILL_GRID,
    V41_DECODE_GRID,
    assert_close,
    assert_mega_close,
    assert_mega_exact,
    assert_mega_like_reference,
    assert_v41_exact,
    make_decode_case,
    make_mega_case,
    make_mega_exact_case,
    make_mega_prefill_case,
    make_prefill_case,
    make_saturating_prefill_case,
    make_two_scale_decode_case,
    make_v41_exact_decode_case,
)

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def pallas_available():
    why = pallas_kernels.availability_reason()
    if why is not None:
        pytest.skip(why)


def _readable(kw) -> str | None:
    kv_formats = [kw["fmt"]] + ([kw["extra"]["fmt"]] if kw.get("extra") else [])
    bad = [f for f in kv_formats if f not in pallas_kernels.ops.KV_FORMATS]
    return f"the pallas kernels do not read {bad} (impl='auto' falls back to xla)" if bad else None


def _decode(case, impl="pallas", splits=None, **options):
    with pallas_kernels.num_splits_override(splits), pallas_kernels.kernel_options(**options):
        f = jax.jit(lambda *a: sparse_mla_decode(*a, impl=impl, **case.kwargs()))
        return jax.block_until_ready(f(*case.args()))


def _prefill(case, impl="pallas", splits=None, **options):
    with pallas_kernels.num_splits_override(splits), pallas_kernels.kernel_options(**options):
        f = jax.jit(lambda *a: sparse_mla_prefill(*a, impl=impl, **case.kwargs()))
        return jax.block_until_ready(f(*case.args()))


DECODE_IDS = [n for n, _ in DECODE_GRID]
PREFILL_IDS = [n for n, _ in PREFILL_GRID]


SPLIT_DECODE = ["fp8_extra_p2", "bf16_extra_fp8"]
SPLIT_PREFILL = ["scale_half"]
# decode grid cases run again with f16 operands (bf16 caches converted whole, fp8 records by the kernel)
OTHER_MODE_DECODE = ["fp8_extra_p2", "bf16_extra_fp8", "fp8_p69_sinkinf", "bf16_p64", "fp8_all_invalid_row"]


@pytest.mark.parametrize("name,splits,mode", [(n, None, "default") for n in DECODE_IDS]
                         + [(n, 3, "default") for n in SPLIT_DECODE]
                         + [(n, None, "other") for n in OTHER_MODE_DECODE])
def test_decode_grid(name, splits, mode):
    i = DECODE_IDS.index(name)
    kw = DECODE_GRID[i][1]
    if (why := _readable(kw)) is not None:
        pytest.skip(why)
    case = make_decode_case(100 + i, **kw)
    case.check(*_decode(case, splits=splits, **(dict(f16=True) if mode == "other" else {})), f"{name} {mode}")


V41_IDS = [n for n, _ in V41_DECODE_GRID]


@pytest.mark.parametrize("f16", [False, True], ids=["bf16_ops", "f16_ops"])
@pytest.mark.parametrize("name", V41_IDS)
def test_v41_decode_grid(name, f16):
    i = V41_IDS.index(name)
    case = make_decode_case(300 + i, **V41_DECODE_GRID[i][1])
    case.check(*_decode(case, f16=f16), f"{name} f16={f16}")


@pytest.mark.parametrize("f16", [False, True], ids=["bf16_ops", "f16_ops"])
@pytest.mark.parametrize("fmt", ["nvfp4_ds_mla", "mxfp8_ds_mla"])
def test_v41_dequantization_is_exact(fmt, f16):
    case, want = make_v41_exact_decode_case(fmt)
    assert_v41_exact(_decode(case, f16=f16)[0], want)


@pytest.mark.parametrize("tiny", [False, True])
def test_mxfp8_to_f16_both_paths(tiny):
    case = make_two_scale_decode_case(35, h_q=64, tiny=tiny, fmt="mxfp8_ds_mla",
                                      extra=dict(topk=64, block_size=2, fmt="nvfp4_ds_mla", lengths="full"))
    case.check(*_decode(case, f16=True), f"mxfp8 two scale ranges tiny={tiny}")


@pytest.mark.parametrize("name,splits,f16", [(n, None, None) for n in PREFILL_IDS] + [(n, 2, None) for n in SPLIT_PREFILL]
                         + [(n, None, True) for n in PREFILL_IDS] + [(n, 2, True) for n in SPLIT_PREFILL])
def test_prefill_grid(name, splits, f16):
    # at these sizes prefill runs with bf16 operands by default (kv larger than the work); f16 forced too
    i = PREFILL_IDS.index(name)
    case = make_prefill_case(200 + i, **PREFILL_GRID[i][1])
    case.check(_prefill(case, splits=splits, **({} if f16 is None else dict(f16=f16))), f"{name} f16={f16}")


def test_f16_saturates():
    # kv values beyond f16's range saturate to +-65504 (never inf, which would make scores NaN)
    big, sat = make_saturating_prefill_case(33)
    out, mx, lse = _prefill(big, f16=True)
    assert np.isfinite(np.asarray(out, np.float32)).all() and np.isfinite(np.asarray(lse)).all()
    e_out, _, e_lse = sat.expected()
    assert np.abs(e_out).max() > 6e4  # the saturated values reach the output
    assert_close(out, e_out, "prefill_out", "out")
    assert_close(lse, e_lse, "prefill_lse", "lse")


@pytest.mark.parametrize("h_q,tiny", [(8, False), (128, False), (128, True)])
def test_fp8_to_f16_both_paths(h_q, tiny):
    # tokens with exponents in the fast path's range (113..134) and above it in the same blocks (warps
    # vote for the f32 path); tiny: every token below it
    case = make_two_scale_decode_case(34, h_q=h_q, tiny=tiny)
    case.check(*_decode(case, f16=True), f"two scale ranges h{h_q} tiny={tiny}")


LARGE_DECODE = {
    "b128_sq2_h128_topk2048_fp8": dict(b=128, s_q=2, h_q=128, topk=2048, block_size=64, fmt="fp8_ds_mla",
                                       s_kv=8192, lengths="full", invalid_frac=0.02),
    "b4_h128_topk2048_extra1024_fp8": dict(b=4, s_q=2, h_q=128, topk=2048, block_size=64, fmt="fp8_ds_mla",
                                           s_kv=4096, extra=dict(topk=1024, block_size=2, fmt="fp8_ds_mla",
                                                                 s_kv=2048)),
    "b64_h64_swa128_extra512_bf16_fp8": dict(b=64, s_q=2, h_q=64, topk=128, block_size=256, fmt="bf16",
                                             s_kv=1024, extra=dict(topk=512, block_size=64, fmt="fp8_ds_mla")),
    # V4.1-Flash: SWA 128 from mxfp8_ds_mla pages of 256, compressed 512 from nvfp4_ds_mla pages of 64
    "b64_h64_swa128_mxfp8_extra512_nvfp4": dict(b=64, s_q=2, h_q=64, topk=128, block_size=256, fmt="mxfp8_ds_mla",
                                                s_kv=1024, extra=dict(topk=512, block_size=64, fmt="nvfp4_ds_mla",
                                                                      s_kv=4096)),
    "b16_h128_swa128_mxfp8_extra1024_nvfp4": dict(b=16, s_q=2, h_q=128, topk=128, block_size=256,
                                                  fmt="mxfp8_ds_mla", s_kv=1024,
                                                  extra=dict(topk=1024, block_size=64, fmt="nvfp4_ds_mla", s_kv=4096)),
}


@pytest.mark.parametrize("name", list(LARGE_DECODE))
def test_large_decode_vs_xla(name):
    case = make_decode_case(7, **LARGE_DECODE[name])
    out, lse = _decode(case)
    r_out, r_lse = _decode(case, impl="xla")
    assert_close(out, np.asarray(r_out, np.float32), "decode_out", f"{name} out")
    assert_close(lse, np.asarray(r_lse), "decode_lse", f"{name} lse")


def test_large_prefill_vs_xla():
    case = make_prefill_case(8, s_q=512, h_q=128, topk=2048, s_kv=8192, lengths="var", invalid_frac=0.02)
    out, mx, lse = _prefill(case)
    r_out, r_mx, r_lse = _prefill(case, impl="xla")
    assert_close(out, np.asarray(r_out, np.float32), "prefill_out", "out")
    assert_close(mx, np.asarray(r_mx), "prefill_max_logits", "max_logits")
    assert_close(lse, np.asarray(r_lse), "prefill_lse", "lse")


def test_deterministic():
    case = make_decode_case(9, b=16, s_q=2, h_q=128, topk=1024, block_size=64, fmt="fp8_ds_mla", s_kv=4096,
                            extra=dict(topk=256, block_size=2, fmt="fp8_ds_mla"))
    a = _decode(case)
    b = _decode(case)
    for x, y in zip(a, b):
        assert np.array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32), equal_nan=True)
    p = make_prefill_case(10, s_q=64, h_q=128, topk=512, s_kv=2048)
    a = _prefill(p)
    b = _prefill(p)
    for x, y in zip(a, b):
        assert np.array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32), equal_nan=True)


PERSISTENT_DECODE = {
    "fp8_h128_b16_sq2": dict(b=16, s_q=2, h_q=128, topk=1024, block_size=64, fmt="fp8_ds_mla", s_kv=4096,
                             lengths="var", extra=dict(topk=256, block_size=2, fmt="fp8_ds_mla", lengths="zero")),
    "bf16_extra_fp8_b40_h64": dict(b=40, s_q=2, h_q=64, topk=128, block_size=256, fmt="bf16", s_kv=1024,
                                   lengths="var", extra=dict(topk=512, block_size=64, fmt="fp8_ds_mla")),
    "mxfp8_extra_nvfp4_b96_h64": dict(b=96, s_q=2, h_q=64, topk=128, block_size=256, fmt="mxfp8_ds_mla",
                                      s_kv=1024, extra=dict(topk=512, block_size=64, fmt="nvfp4_ds_mla", s_kv=4096)),
}


@pytest.mark.parametrize("ctas", [7, "sms"])
@pytest.mark.parametrize("name", list(PERSISTENT_DECODE))
def test_persistent_ctas_decode(name, ctas):
    # persistent CTAs (`kernel_options(ctas=...)`) compute every item as one CTA per item does: bitwise equal, and
    # against the oracle
    case = make_decode_case(61, **PERSISTENT_DECODE[name])
    want = _decode(case)
    got = _decode(case, ctas=ctas)
    for x, y in zip(want, got):
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))
    case.check(*got, f"{name} ctas={ctas}")
    with pallas_kernels.num_splits_override(3):  # split partials
        for x, y in zip(_decode(case), _decode(case, ctas=ctas)):
            np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


@pytest.mark.parametrize("ctas", [5, "sms"])
def test_persistent_ctas_prefill_and_mega(ctas):
    p = make_prefill_case(62, s_q=300, h_q=128, topk=512, s_kv=2048, lengths="var", invalid_frac=0.02)
    for f16 in (False, True):
        for x, y in zip(_prefill(p, f16=f16), _prefill(p, f16=f16, ctas=ctas)):
            np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))
    m = make_mega_case(63, fmt="mxfp8_ds_mla", block_size=256, topk=128, s_kv=1024, h_q=64, b=40,
                       extra=dict(topk=512, block_size=64, fmt="nvfp4_ds_mla", s_kv=4096))
    for x, y in zip(_mega(m), _mega(m, ctas=ctas)):
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))
    mp = make_mega_prefill_case(64, s_q=200, h_q=128, s_kv=1024, topk=256)
    for x, y in zip(_mega_prefill(mp), _mega_prefill(mp, ctas=ctas)):
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


def test_plan_and_batch_invariance():
    # a plan is accepted (its shapes checked) and changes nothing; batch_invariant=True (one split) is bitwise
    # invariant to the batch
    from dsv41_jax import make_decode_plan

    case = make_decode_case(81, b=12, s_q=2, h_q=64, topk=1024, block_size=64, fmt="fp8_ds_mla", lengths="var",
                            s_kv=3000, extra=dict(topk=512, block_size=64, fmt="fp8_ds_mla", lengths="var"))
    kw = case.kwargs()
    q, cache, idx, tl = case.args()
    plan = make_decode_plan(tl, s_q=2, num_heads=64, topk=1024, extra_topk_length=kw["extra_topk_length"],
                            extra_topk=512)
    with_plan = jax.jit(lambda p, *a: sparse_mla_decode(*a, impl="pallas", plan=p, **kw))(plan, *case.args())
    without = _decode(case)
    for x, y in zip(with_plan, without):
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))
    f = jax.jit(lambda q, i, t, ei, et: sparse_mla_decode(q, cache, i, t, impl="pallas", batch_invariant=True,
                                                          **{**kw, "extra_indices": ei, "extra_topk_length": et}))
    full = f(q, idx, tl, kw["extra_indices"], kw["extra_topk_length"])
    case.check(*full, "pallas batch-invariant decode")
    perm = np.array([9, 2, 4])
    part = f(q[perm], idx[perm], tl[perm], kw["extra_indices"][perm], kw["extra_topk_length"][perm])
    for x, y in zip(full, part):
        np.testing.assert_array_equal(np.asarray(x, np.float32)[perm], np.asarray(y, np.float32))


@pytest.mark.parametrize("kv_format", ["fp8_ds_mla", "mxfp8_ds_mla", "nvfp4_ds_mla"])
def test_decode_reads_a_cache_past_4_gib(kv_format):
    """A 4.5 GiB cache, poisoned with 0xFF bytes (NaN records, huge or NaN scales) except the rows
    written; the selected slots lie beyond 2^31 and 2^32 bytes (and a few at the start, some masked).
    The pallas decode matches the reference and stays finite."""
    import jax.numpy as jnp

    from dsv41_jax import kv_cache

    bs, b, s_q, h_q, topk = 64, 2, 2, 64, 128
    pb = kv_cache.page_bytes(kv_format, bs)
    num_blocks = -(-(9 << 29) // pb)
    rng = np.random.default_rng(45)
    first_high = -(-(2**31) // pb) + 1
    high = rng.choice(np.arange(first_high * bs, num_blocks * bs), size=b * s_q * topk - 64, replace=False)
    low = rng.choice(np.arange(0, 4 * bs), size=64, replace=False)
    slots = np.concatenate([high, low]).astype(np.int32)
    assert int(high.min()) // bs * pb >= 2**31 and int(high.max()) // bs * pb >= 2**32
    kv = rng.standard_normal((slots.size, 512), np.float32) * np.exp(rng.uniform(-1, 1, (slots.size, 1)))
    cache = jnp.full((num_blocks, pb), 0xFF, jnp.uint8)
    insert = jax.jit(lambda c, x, s: kv_cache.insert(c, x, s, kv_format=kv_format, block_size=bs), donate_argnums=0)
    cache = insert(cache, jnp.asarray(kv, jnp.bfloat16), jnp.asarray(slots))
    idx = rng.permutation(slots).reshape(b, s_q, topk)
    idx[:, :, rng.choice(topk, 9, replace=False)] = -1  # masked entries too
    q = jnp.asarray(rng.standard_normal((b, s_q, h_q, 512), np.float32), jnp.bfloat16)
    lens = jnp.array([topk, topk - 37], jnp.int32)
    sink = jnp.asarray(rng.standard_normal(h_q), jnp.float32)
    kw = dict(kv_format=kv_format, block_size=bs, softmax_scale=512 ** -0.5, attn_sink=sink)

    def run(impl):
        f = jax.jit(lambda *a: sparse_mla_decode(*a, impl=impl, **kw))
        return jax.block_until_ready(f(q, cache, jnp.asarray(idx), lens))

    out, lse = run("pallas")
    r_out, r_lse = run("xla")
    assert np.isfinite(np.asarray(out, np.float32)).all() and np.isfinite(np.asarray(lse)).all()
    assert_close(out, np.asarray(r_out, np.float32), "decode_out", "out")
    assert_close(lse, np.asarray(r_lse), "decode_lse", "lse")


def test_sharded_ops_on_one_device_equal_the_plain_calls():
    # the head-sharded ops call the kernel inside shard_map, through the module lowered once per process
    # (pallas_kernels.ops._exported_kernel): bitwise the plain calls' results
    from jax.sharding import Mesh

    from dsv41_jax.sharding import sparse_mla_decode_sharded, sparse_mla_prefill_sharded

    mesh = Mesh(np.array(jax.devices()[:1]), ("tp",))
    case = make_decode_case(83, b=6, s_q=2, h_q=64, topk=256, block_size=64, fmt="fp8_ds_mla", lengths="var",
                            s_kv=3000, sink="random", extra=dict(topk=128, block_size=2, fmt="fp8_ds_mla"))
    kw = case.kwargs()
    got = jax.jit(lambda *a: sparse_mla_decode_sharded(*a, mesh=mesh, head_axis="tp", impl="pallas", **kw))(
        *case.args())
    for x, y in zip(got, _decode(case)):
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))
    case.check(*got, "pallas head-sharded decode")
    p = make_prefill_case(84, s_q=40, h_q=64, topk=128, s_kv=700, sink="random")
    got = jax.jit(lambda *a: sparse_mla_prefill_sharded(*a, mesh=mesh, head_axis="tp", impl="pallas",
                                                        **p.kwargs()))(*p.args())
    for x, y in zip(got, _prefill(p)):
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


# ----------------------------------------------------------------------------------- the mega ops
MEGA_IDS = [n for n, _ in MEGA_DECODE_GRID]
MEGA_PREFILL_IDS = [n for n, _ in MEGA_PREFILL_GRID]


def _mega(case, splits=None, impl="pallas", **options):
    with pallas_kernels.num_splits_override(splits), pallas_kernels.kernel_options(**options):
        f = jax.jit(lambda *a: sparse_mla_mega_decode(*a, impl=impl, **case.kwargs()))
        return jax.block_until_ready(f(*case.args()))


def _mega_prefill(case, splits=None, impl="pallas", **options):
    with pallas_kernels.num_splits_override(splits), pallas_kernels.kernel_options(**options):
        f = jax.jit(lambda *a: sparse_mla_mega_prefill(*a, impl=impl, **case.kwargs()))
        return jax.block_until_ready(f(*case.args()))


@pytest.mark.parametrize("splits", [1, 3], ids=["in_kernel", "combine"])
@pytest.mark.parametrize("f16", [False, True], ids=["bf16_ops", "f16_ops"])
@pytest.mark.parametrize("name", MEGA_IDS)
def test_mega_decode_grid(name, f16, splits):
    # one split: the output stage runs in the kernel's epilogue; three: the combine finishes the partials
    i = MEGA_IDS.index(name)
    case = make_mega_case(400 + i, **MEGA_DECODE_GRID[i][1])
    assert_mega_close(*_mega(case, splits=splits, f16=f16), case.expected(), f"pallas mega decode {name}")


@pytest.mark.parametrize("f16", [False, True], ids=["bf16_ops", "f16_ops"])
@pytest.mark.parametrize("h_q", [64, 128, 8])
def test_mega_output_stage_is_exact(h_q, f16):
    case, want = make_mega_exact_case(h_q)
    out, scale, _ = _mega(case, splits=1, f16=f16)
    assert_mega_exact(out, scale, want, f"pallas mega decode h{h_q} f16={f16}")


@pytest.mark.parametrize("f16", [False, True], ids=["bf16_ops", "f16_ops"])
@pytest.mark.parametrize("name", MEGA_PREFILL_IDS)
def test_mega_prefill_grid(name, f16):
    i = MEGA_PREFILL_IDS.index(name)
    case = make_mega_prefill_case(500 + i, **MEGA_PREFILL_GRID[i][1])
    assert_mega_close(*_mega_prefill(case, f16=f16), case.expected(), f"pallas mega prefill {name}", kind="prefill")


def test_mega_v41_flash_shape_vs_xla():
    # the V4.1-Flash decode shape (SWA 128 from mxfp8_ds_mla pages of 256, compressed 512 from nvfp4_ds_mla pages of
    # 64), 128 tokens: the default split choice (one split at 128 rows: the output stage in the kernel), against the
    # reference's exponents and values
    case = make_mega_case(433, b=128, h_q=64, topk=128, block_size=256, fmt="mxfp8_ds_mla", s_kv=1024,
                          max_pos=65536, extra=dict(topk=512, block_size=64, fmt="nvfp4_ds_mla", s_kv=4096))
    assert_mega_like_reference(_mega(case), _mega(case, impl="xla"), case.expected(),
                               "pallas mega decode, V4.1-Flash shape")


def test_mega_prefill_large_sq_vs_xla():
    case = make_mega_prefill_case(532, s_q=700, h_q=128, s_kv=1521, topk=512, sink="inf", max_pos=4096)
    assert_mega_like_reference(_mega_prefill(case), _mega_prefill(case, impl="xla"), case.expected(),
                               "pallas mega prefill s_q 700 h 128", kind="prefill")
