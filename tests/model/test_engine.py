"""The paged engine: its steps == the dense no-cache forward; warm-up, limits and generate behaviour."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsv41_jax import DeepseekV41Model
from dsv41_jax.buckets import BucketPolicy
from dsv41_jax.model.dense import dense_forward
from dsv41_jax.model.engine import EngineConfig, InferenceEngine
from dsv41_jax.model.rope_tables import make_rope_tables
from tests.model.cases import CFG, tiny_model

MAX_LEN = 48
# One token bucket and one block-table width for every step of SCHEDULE: the numerics tests compile once per
# cache format; crossing buckets is test_generate_never_compiles_after_warmup's part.
ONE_SHAPE = BucketPolicy(min_tokens=32, min_blocks=16)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


_DENSE: dict = {}


def _dense(model, tokens, kv_format="bf16", pad=True):
    """dense_forward's logits of `tokens`, one compilation per length and cache format in the module.

    With `pad` the sequence runs padded to MAX_LEN, which changes no row of a causal model beyond float
    reordering (a few 1e-3 after the bf16 roundings), so every sequence shares one compilation; the fp8
    comparison needs the cache's roundings bit for bit and runs unpadded."""
    n = MAX_LEN if pad else len(tokens)
    key = (id(model), kv_format, n)
    if key not in _DENSE:
        gd, st = nnx.split(model)
        tables = make_rope_tables(model.cfg, MAX_LEN)
        f = jax.jit(lambda st, t: dense_forward(nnx.merge(gd, st), t, tables=tables, kv_format=kv_format))
        _DENSE[key] = (f, st)
    f, st = _DENSE[key]
    padded = np.zeros(n, np.int32)
    padded[: len(tokens)] = tokens
    return np.asarray(f(st, jnp.asarray(padded)))[: len(tokens)]


def _run(engine, seqs, schedule):
    """Feed each request its known tokens following `schedule` (lists of per-request counts per step)."""
    rids = [engine.add_request(s) for s in seqs]
    got = {r: [] for r in rids}
    for counts in schedule:
        res = engine.step([(r, c) for r, c in zip(rids, counts)])
        for r, lg in res.items():
            got[r].append(lg)
    out = [np.concatenate(got[r]) for r in rids]
    for r in rids:
        engine.finish(r)
    return out


@pytest.fixture(scope="module")
def seqs():
    rng = np.random.default_rng(1)
    return [rng.integers(0, CFG.vocab_size, 40).tolist(), rng.integers(0, CFG.vocab_size, 24).tolist()]


# per step: (tokens of request 0, tokens of request 1). Chunked prefill (uneven chunks, groups split
# across steps), then single-token decode, then speculative-style 3- and 2-token decode steps.
SCHEDULE = [(13, 6), (9, 7), (1, 1), (1, 1), (3, 2), (3, 3), (1, 1), (2, 3), (7, 0)]


@pytest.mark.slow
def test_engine_matches_dense_bf16(model, seqs):
    eng = InferenceEngine(model, EngineConfig(max_model_len=MAX_LEN, max_reqs=4, block_size=8, comp_block_size=4,
                                              kv_format="bf16", impl="xla", num_speculative_tokens=2,
                                              buckets=ONE_SHAPE))
    got = _run(eng, seqs, SCHEDULE)
    assert len(eng.compiled_shapes) == 1
    for s, g in zip(seqs, got):
        ref = _dense(model, s)[: g.shape[0]]
        # bf16 attention outputs (the ops' contract) are the only rounding that differs in order
        np.testing.assert_allclose(g, ref, atol=3e-2, rtol=0)
        assert (g.argmax(-1) == ref.argmax(-1)).mean() > 0.95


@pytest.fixture(scope="module")
def model_all_candidates():
    """The tiny model with an indexer top-k that keeps every candidate (MAX_LEN): the fp8 comparison below checks
    the cache's roundings bit for bit, and with the preset's top-6 the paged and the dense orders of the same float
    sums can flip a near-tie in the indexer's selection, which moves that row's logits by O(1) (row 34 of 40 by
    0.66 on one CPU, no row on another). The selection itself is checked by test_engine_matches_dense_bf16."""
    return DeepseekV41Model(CFG.replace(index_topk=MAX_LEN), rngs=nnx.Rngs(0))


@pytest.mark.slow
def test_engine_matches_dense_fp8_within_quantisation(model_all_candidates, seqs):
    model = model_all_candidates
    eng = InferenceEngine(model, EngineConfig(max_model_len=MAX_LEN, max_reqs=4, block_size=8, comp_block_size=4,
                                              kv_format="fp8_ds_mla", impl="xla", num_speculative_tokens=2,
                                              buckets=ONE_SHAPE))
    got = _run(eng, seqs[:1], [(c,) for c, _ in SCHEDULE])[0]
    ref_q = _dense(model, seqs[0], kv_format="fp8_ds_mla", pad=False)[: got.shape[0]]  # the cache's roundings
    ref = _dense(model, seqs[0])[: got.shape[0]]  # unquantised
    np.testing.assert_allclose(got, ref_q, atol=3e-2, rtol=0)
    # e4m3 keeps 3 mantissa bits (up to 3% per element); through 5 random layers the logits move
    # about 10% (measured: 0.100); far more would mean the cache path does something else
    rel = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert rel < 0.2, f"fp8 caches move the logits by {rel:.3f} (relative), more than quantisation should"


@contextlib.contextmanager
def backend_compiles():
    """The functions XLA compiles inside the block (jax's monitoring event of every backend compilation)."""
    from jax._src.dispatch import BACKEND_COMPILE_EVENT

    names: list[str] = []

    def listener(event, duration, **kw):
        if event == BACKEND_COMPILE_EVENT:
            names.append(kw.get("fun_name", "?"))

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield names
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


@pytest.mark.slow
def test_generate_never_compiles_after_warmup(model):
    # 2 requests, chunks of 8, 16 tokens a step: one token bucket; sequences up to 48 cross every
    # block-table bucket: SWA 4 -> 8 pages at 33 tokens, ratio-1 4 -> 8 -> 16 at 17 and 33, ratio-2 4 -> 8 at 34
    eng = InferenceEngine(model, EngineConfig(max_model_len=MAX_LEN, max_reqs=2, block_size=8, comp_block_size=4,
                                              impl="xla", num_speculative_tokens=2, prefill_chunk=8,
                                              max_num_batched_tokens=16))
    assert [(s.tokens, s.blocks, s.comp_blocks) for s in eng.envelope] == [
        (16, 4, ((1, 4), (2, 4))), (16, 4, ((1, 8), (2, 4))), (16, 8, ((1, 16), (2, 4))), (16, 8, ((1, 16), (2, 8)))]
    with backend_compiles() as during_warmup:
        ws = eng.warmup(progress=False)
    assert ws.num_compiled == ws.num_shapes == len(eng.envelope) == len(ws.per_shape) and eng.is_warm
    assert ws.compile_threads == 4 and [sh for sh, _ in ws.per_shape] == list(eng.envelope)  # on threads, in order
    assert len(during_warmup) >= ws.num_compiled  # the listener sees compilations
    assert eng.warmup(progress=False).num_compiled == 0

    prompts = [list(range(3, 33)), [7, 7, 1]]  # 30 tokens + 12 new: 41 positions
    with backend_compiles() as during_generate:
        outs, stats = eng.generate(prompts, 12, return_stats=True)
    assert during_generate == []
    assert stats.warmup is None and eng.last_generate_stats is stats
    assert [s.num_tokens for s in stats.prefill_steps] == [11, 8, 8, 6]  # chunks of 8, 16 tokens a step
    assert len(stats.decode_steps) == 11 and all(s.num_tokens == 2 for s in stats.decode_steps)
    assert {s.shape for s in stats.steps} == set(eng.envelope)  # every bucket met, none compiled
    assert all(s.host_s > 0 and s.device_s > 0 for s in stats.steps)
    assert 0 < stats.decode_tokens_per_s < stats.decode_device_tokens_per_s
    assert "decode: 11 steps, 22 tokens" in stats.summary()
    for p, o in zip(prompts, outs):
        # causal: the dense logits at position i of the final sequence see exactly tokens 0..i
        ref = _dense(model, list(p) + o)
        for i, tok in enumerate(o):  # each generated token is the dense argmax given everything before it
            row = ref[len(p) - 1 + i]
            assert tok == int(np.argmax(row)) or row.max() - row[tok] < 3e-2
    assert not eng.requests and len(eng.free_rows) == 2  # everything was released

    # speculative-style steps (3 and 2 tokens a request, s_q > 1 decode) and a chunked prefill by hand
    rids = [eng.add_request(list(range(40))), eng.add_request(list(range(5, 25)))]
    with backend_compiles() as during_steps:
        for counts in [(8, 8), (8, 8), (3, 2), (1, 2), (8, 0), (8, 0), (3, 0), (1, 0)]:
            eng.step(list(zip(rids, counts)))
            assert eng.last_step.shape in eng.envelope
    assert during_steps == []
    assert eng.requests[rids[0]]["done"] == 40

    for r in rids:
        eng.finish(r)

    # outside the limits: a ValueError naming the limit, before anything compiles
    with backend_compiles() as refused:
        rid = eng.add_request(list(range(20)))
        with pytest.raises(ValueError, match=r"feeds 9 tokens in one step, more than the engine's 8 per request "
                                             r"\(EngineConfig.prefill_chunk=8"):
            eng.step([(rid, 9)])
        eng.finish(rid)
        with pytest.raises(ValueError, match=r"prefill_chunk must be an int in 1..8"):
            eng.generate([[1, 2]], 2, prefill_chunk=9)
        with pytest.raises(ValueError, match="needs 50 positions, more than max_model_len 48"):
            eng.generate([[1] * 40], 11)
        with pytest.raises(ValueError, match=r"3 prompts exceed the 2 free request slots \(EngineConfig.max_reqs=2\)"):
            eng.generate([[1], [2], [3]], 2)
    assert refused == [] and not eng.requests
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(5\) must hold .* = 6"):
        EngineConfig(max_reqs=2, num_speculative_tokens=2, max_num_batched_tokens=5)


def test_warmup_compile_threads(model):
    eng = InferenceEngine(model, EngineConfig(max_model_len=16, max_reqs=1, impl="xla"))
    with backend_compiles() as refused:
        for bad in (0, -1, True, 2.0, "2"):
            with pytest.raises(ValueError, match=r"warmup\(compile_threads=...\) must be a positive int or None, got"):
                eng.warmup(progress=False, compile_threads=bad)
    assert refused == [] and not eng.compiled_shapes
    ws = eng.warmup(progress=False, compile_threads=1)
    assert ws.compile_threads == 1 and eng.is_warm and [sh for sh, _ in ws.per_shape] == list(eng.envelope)
    assert all(0 < t <= ws.seconds for _, t in ws.per_shape)
    rid = eng.add_request([1, 2, 3])
    with backend_compiles() as during_step:
        eng.step([(rid, 3)])
    assert during_step == []


def test_engine_rejects_bad_requests(model):
    eng = InferenceEngine(model, EngineConfig(max_model_len=16, max_reqs=1, impl="xla"))
    with pytest.raises(ValueError, match="prompt must have at least one token"):
        eng.add_request([])
    with pytest.raises(ValueError, match="prompt tokens must be in"):
        eng.add_request([CFG.vocab_size])
    rid = eng.add_request([1, 2, 3])
    with pytest.raises(RuntimeError, match="no free request slot"):
        eng.add_request([1])
    with pytest.raises(ValueError, match="asked for 5"):
        eng.step([(rid, 5)])
    with pytest.raises(ValueError, match="EngineConfig.block_size"):
        EngineConfig(block_size=0)
