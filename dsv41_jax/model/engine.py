"""A paged inference engine for `DeepseekV41Model` under `jax.jit`.

Host side (Python): requests, page allocation, scheduling of prefill chunks and decode steps,
padding into buckets (`make_common_attention_metadata`), greedy sampling. Device side: one pure
step, `run_step(params, caches, inputs) -> (logits, caches)` (`dsv41_jax.model.step`: the step's
metadata, then the model's forward pass), compiled once per step shape with the caches donated so a
step updates them in place.

Compilation happens ahead of time, never inside `generate`: the engine's limits (`EngineConfig`:
max_reqs, max_model_len, prefill_chunk, max_num_batched_tokens) map through the bucket policy to
the envelope of step shapes it can meet (`dsv41_jax.model.envelope`), and `warmup()` lowers and
compiles each (`jax.jit(...).lower(...).compile()`), keeping the executables by shape. `generate`
warms a cold engine up first and reports that apart (`GenerateStats.warmup`); its steps run
compiled executables only. `step()` on a cold engine compiles the one shape it needs. A step
outside the limits is a `ValueError` naming the limit. Every step's host and device time is
recorded (`dsv41_jax.model.engine_stats`).

Caches (one set per engine):
- every layer has a paged SWA cache in `kv_format` (page `block_size` tokens);
- every kv-source layer has a paged compressed cache in `comp_kv_format` (page `comp_block_size`
  states) and a float32 index-key cache with the same slots;
- ratio-2 kv sources keep a per-request float32 ring of the open group's (value, gate) rows,
  capacity the next power of two >= max(8, num_speculative_tokens + 2), so a group split across
  steps (chunked prefill, decode) pools exactly as in one pass.
Pages are allocated for the whole sequence (no sliding-window page reclaim) and freed when a
request finishes. Compressed caches of the same ratio share one block table per request.

Per layer and step the decoder layer's `__call__` (`dsv41_jax.model.nn`) projects q and the latents,
writes the caches, selects the compressed entries and calls the sparse attention ops (`dsv41_jax.model.step`
says how decode and prefill tokens attend).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import sys
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv41_jax import kv_cache as kvc
from dsv41_jax import metadata as md
from dsv41_jax.kv_cache import canonical_kv_cache_dtype
from dsv41_jax.buckets import DEFAULT_BUCKETS, BucketPolicy
from dsv41_jax.kv_cache import LATENT_DIM
from dsv41_jax.model.engine_stats import GenerateStats, StepTiming, WarmupStats
from dsv41_jax.model.envelope import ServingLimits, StepShape, envelope_shapes, step_shape
from dsv41_jax.model.nn import DeepseekV41Model
from dsv41_jax.model.rope_tables import make_rope_tables
from dsv41_jax.model.step import StepInputs, run_step

__all__ = ["EngineConfig", "InferenceEngine", "StepInputs"]

_F32 = jnp.float32
_log = logging.getLogger("dsv41_jax.engine")  # the name users configure, whatever the module path
# The step token budget without an explicit max_num_batched_tokens (vLLM's chunked-prefill default): every
# token bucket up to it is compiled, so the default keeps warm-up bounded whatever max_model_len is.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
# Threads compiling step shapes in `warmup` (each XLA compile is mostly single-threaded, and holds a step's
# HLO and kernels in memory while it runs).
DEFAULT_COMPILE_THREADS = 4


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Static settings of an engine (changing any of them recompiles)."""

    max_model_len: int = 256
    max_reqs: int = 8
    block_size: int = 16
    comp_block_size: int = 16
    num_blocks: int | None = None  # pages per cache group; default: max_reqs full-length sequences
    kv_format: str = "bf16"
    comp_kv_format: str | None = None  # default: kv_format
    impl: str = "auto"
    num_speculative_tokens: int = 0
    buckets: BucketPolicy = DEFAULT_BUCKETS
    mesh: jax.sharding.Mesh | None = None  # heads of the attention split over `head_axis`
    head_axis: str = "tp"
    prefill_chunk: int | None = None  # most tokens of one request in one step; default: max_model_len
    # most tokens in one step; default: DEFAULT_MAX_NUM_BATCHED_TOKENS, or a decode step of every request if
    # that is more, or max_reqs * the per-request limit if that is less
    max_num_batched_tokens: int | None = None

    def __post_init__(self):
        for k in ("max_model_len", "max_reqs", "block_size", "comp_block_size"):
            v = getattr(self, k)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"EngineConfig.{k} must be a positive int, got {v!r}")
        for k in ("prefill_chunk", "max_num_batched_tokens"):
            v = getattr(self, k)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
                raise ValueError(f"EngineConfig.{k} must be a positive int or None, got {v!r}")
        need = self.max_reqs * (1 + self.num_speculative_tokens)
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < need:
            raise ValueError(f"EngineConfig.max_num_batched_tokens ({self.max_num_batched_tokens}) must hold a decode "
                             f"step of every request: >= max_reqs * (1 + num_speculative_tokens) = {need}")
        for k in ("kv_format", "comp_kv_format"):
            v = getattr(self, k)
            if v is not None:
                canonical_kv_cache_dtype(v)

    @property
    def limits(self) -> ServingLimits:
        """What the engine serves: a request feeds at most `prefill_chunk` tokens per step (at least
        1 + num_speculative_tokens, at most max_model_len), a step holds at most `max_num_batched_tokens`."""
        chunk = self.max_model_len if self.prefill_chunk is None else self.prefill_chunk
        per_req = min(self.max_model_len, max(chunk, 1 + self.num_speculative_tokens))
        per_step = self.max_num_batched_tokens or min(
            self.max_reqs * per_req,
            max(DEFAULT_MAX_NUM_BATCHED_TOKENS, self.max_reqs * (1 + self.num_speculative_tokens)))
        return ServingLimits(self.max_reqs, self.max_model_len, per_req, per_step)

    @property
    def comp_format(self) -> str:
        return self.comp_kv_format or self.kv_format

    @property
    def ring_capacity(self) -> int:
        n = max(8, self.num_speculative_tokens + 2)
        return 1 << (n - 1).bit_length()

    def pages(self, per_page: int) -> int:
        if self.num_blocks is not None:
            return self.num_blocks
        return self.max_reqs * (-(-self.max_model_len // per_page)) + 1


def _param_sharding(path: tuple, value: jax.Array, mesh: jax.sharding.Mesh, axis: str):
    """Head-parallel placement: q heads (wq_b columns), sinks and wo_a groups split; the rest replicated."""
    P = jax.sharding.PartitionSpec
    names = [str(p) for p in path]
    spec = P()
    if "self_attn" in names and "indexer" not in names:
        if names[-2:] == ["wq_b", "kernel"]:
            spec = P(None, axis)
        elif names[-1] == "attn_sink":
            spec = P(axis)
        elif names[-1] == "wo_a":
            spec = P(axis, None, None)
    return jax.sharding.NamedSharding(mesh, spec)


class InferenceEngine:
    """Paged prefill + decode for a batch of requests of different lengths (greedy sampling)."""

    def __init__(self, model: DeepseekV41Model, config: EngineConfig = EngineConfig()):
        self.model, self.ecfg = model, config
        cfg = model.cfg
        if config.max_model_len > cfg.max_position_embeddings:
            raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's max_position_embeddings "
                             f"{cfg.max_position_embeddings}")
        self.graphdef, self.params = nnx.split(model)
        if config.mesh is not None:
            n = config.mesh.shape.get(config.head_axis)
            if n is None:
                raise ValueError(f"EngineConfig.head_axis {config.head_axis!r} is not an axis of the mesh {dict(config.mesh.shape)}")
            if cfg.num_attention_heads % n or cfg.o_groups % n:
                raise ValueError(f"num_attention_heads ({cfg.num_attention_heads}) and o_groups ({cfg.o_groups}) must be "
                                 f"divisible by the head axis size {n}")
            flat = nnx.to_flat_state(self.params)
            shardings = nnx.from_flat_state([(p, _param_sharding(p, v, config.mesh, config.head_axis)) for p, v in flat])
            self.params = jax.device_put(self.params, shardings)
        self.tables = make_rope_tables(cfg, config.max_model_len)
        self.roles = model.roles()
        self.ratios = sorted({r.compress_ratio for r in self.roles if r.compress_ratio})
        self.decode_threshold = md.decode_threshold(config.num_speculative_tokens)
        n_swa = config.pages(config.block_size)
        caches = {"swa": {}, "comp": {}, "ikey": {}, "ring": {}}
        for role in self.roles:
            caches["swa"][str(role.layer_id)] = kvc.allocate(n_swa, config.block_size, config.kv_format)
            if role.owns_compressed_cache:
                r = role.compress_ratio
                n_c = config.pages(config.comp_block_size)
                caches["comp"][str(role.layer_id)] = kvc.allocate(n_c, config.comp_block_size, config.comp_format)
                caches["ikey"][str(role.layer_id)] = jnp.zeros((n_c, config.comp_block_size, cfg.index_head_dim), _F32)
                if r > 1:
                    caches["ring"][str(role.layer_id)] = jnp.zeros((config.max_reqs, config.ring_capacity, 2, LATENT_DIM), _F32)
        if config.mesh is not None:  # the MQA latent caches are read by every head: replicated
            caches = jax.device_put(caches, jax.sharding.NamedSharding(config.mesh, jax.sharding.PartitionSpec()))
        self.caches = caches
        self.free = {"swa": list(range(1, n_swa))}  # page 0 stays unused: a -1 clamped to 0 never hits live data
        for r in self.ratios:
            self.free[r] = list(range(1, config.pages(config.comp_block_size)))
        self.free_rows = list(range(config.max_reqs))
        self.requests: dict[int, dict] = {}
        self._next_id = 0
        self._fn = jax.jit(functools.partial(run_step, self.graphdef, engine_config=config), donate_argnums=(1,))
        self.limits = config.limits
        self.envelope: tuple[StepShape, ...] = envelope_shapes(
            config.buckets, self.limits, block_size=config.block_size, comp_block_size=config.comp_block_size,
            ratios=self.ratios)
        self._envelope_set = frozenset(self.envelope)
        self._executables: dict[StepShape, jax.stages.Compiled] = {}
        self.warmup_stats: WarmupStats | None = None
        self.last_step: StepTiming | None = None
        self.last_generate_stats: GenerateStats | None = None

    # ------------------------------------------------------------------ compilation
    @property
    def compiled_shapes(self) -> frozenset[StepShape]:
        """The step shapes compiled so far."""
        return frozenset(self._executables)

    @property
    def is_warm(self) -> bool:
        """Whether every shape of the envelope is compiled."""
        return self._envelope_set <= self._executables.keys()

    def _dummy_inputs(self, shape: StepShape) -> StepInputs:
        """An empty batch padded to `shape`, built like `prepare`'s inputs (same types and placement)."""
        cm = md.make_common_attention_metadata([], [], [], [], buckets=self.ecfg.buckets, num_tokens=shape.tokens,
                                               num_reqs=shape.reqs, num_blocks=shape.blocks)
        cbt = {r: jnp.asarray(np.full((shape.reqs, w), -1, np.int32)) for r, w in shape.comp_blocks}
        return StepInputs(jnp.asarray(np.zeros(shape.tokens, np.int32)), cm, cbt,
                          jnp.asarray(np.zeros(shape.reqs, np.int32)))

    def _trace(self, shape: StepShape) -> jax.stages.Traced:
        return self._fn.trace(self.params, self.caches, self._dummy_inputs(shape), self.tables)

    def _lower(self, shape: StepShape) -> jax.stages.Lowered:
        return self._trace(shape).lower()

    def _compile(self, shape: StepShape) -> jax.stages.Compiled:
        exe = self._lower(shape).compile()
        self._executables[shape] = exe
        return exe

    def warmup(self, *, progress: bool = True, compile_threads: int | None = None) -> WarmupStats:
        """Compile every step shape of the envelope not compiled yet; returns (and keeps in `warmup_stats`)
        the count and seconds. Each shape logs a line on the `dsv41_jax.engine` logger (INFO) and, with
        `progress`, on stderr.

        Shapes are lowered one after another (tracing holds the GIL) and compiled on `compile_threads`
        threads (default: min(shapes, DEFAULT_COMPILE_THREADS)), XLA's compile running outside the GIL, so
        the next shape lowers while the last ones compile. A shape's seconds are its own lowering plus its
        compile, which may overlap other shapes'; `seconds` is the warm-up's wall time."""
        todo = [sh for sh in self.envelope if sh not in self._executables]
        if compile_threads is None:
            compile_threads = max(1, min(len(todo), DEFAULT_COMPILE_THREADS))
        elif isinstance(compile_threads, bool) or not isinstance(compile_threads, int) or compile_threads < 1:
            raise ValueError(f"warmup(compile_threads=...) must be a positive int or None, got {compile_threads!r}")
        t0 = time.perf_counter()
        per: dict[StepShape, float] = {}
        done = 0

        def report(shape: StepShape, t_lower: float, t_compile: float) -> None:
            nonlocal done
            done += 1
            per[shape] = t_lower + t_compile
            line = (f"warm-up [{done}/{len(todo)}] {shape}: compiled in {t_lower + t_compile:.1f} s "
                    f"(lowering {t_lower:.1f} s)")
            _log.info(line)
            if progress:
                print(line, file=sys.stderr, flush=True)

        def compile_one(lowered: jax.stages.Lowered) -> tuple[jax.stages.Compiled, float]:
            tc = time.perf_counter()
            exe = lowered.compile()
            return exe, time.perf_counter() - tc

        pending: dict[concurrent.futures.Future, tuple[StepShape, float]] = {}

        def finish(fut: concurrent.futures.Future) -> None:
            shape, t_lower = pending.pop(fut)
            exe, t_compile = fut.result()
            self._executables[shape] = exe
            report(shape, t_lower, t_compile)

        with concurrent.futures.ThreadPoolExecutor(max_workers=compile_threads,
                                                   thread_name_prefix="dsv41-compile") as pool:
            for shape in todo:
                tl = time.perf_counter()
                lowered = self._lower(shape)
                pending[pool.submit(compile_one, lowered)] = (shape, time.perf_counter() - tl)
                for fut in [f for f in pending if f.done()]:  # what finished while this shape lowered
                    finish(fut)
            for fut in concurrent.futures.as_completed(list(pending)):
                finish(fut)
        stats = WarmupStats(num_compiled=len(todo), num_shapes=len(self.envelope), seconds=time.perf_counter() - t0,
                            per_shape=tuple((sh, per[sh]) for sh in todo), compile_threads=compile_threads)
        self.warmup_stats = stats
        return stats

    # ------------------------------------------------------------------ request bookkeeping
    def _check_prompt(self, prompt: Sequence[int], name: str) -> list[int]:
        toks = [int(t) for t in prompt]
        if not toks:
            raise ValueError(f"{name} must have at least one token")
        if any(not 0 <= t < self.model.cfg.vocab_size for t in toks):
            raise ValueError(f"{name} tokens must be in [0, {self.model.cfg.vocab_size})")
        return toks

    def add_request(self, prompt: Sequence[int]) -> int:
        if not self.free_rows:
            raise RuntimeError(f"no free request slot (max_reqs={self.ecfg.max_reqs})")
        toks = self._check_prompt(prompt, "prompt")
        rid = self._next_id
        self._next_id += 1
        self.requests[rid] = dict(tokens=toks, done=0, row=self.free_rows.pop(0), pages={"swa": []} | {r: [] for r in self.ratios})
        return rid

    def finish(self, rid: int) -> None:
        req = self.requests.pop(rid)
        for key, pages in req["pages"].items():
            self.free[key].extend(pages)
        self.free_rows.append(req["row"])

    def _ensure_pages(self, req: dict, seq_len: int) -> None:
        if seq_len > self.ecfg.max_model_len:
            raise ValueError(f"sequence length {seq_len} exceeds max_model_len {self.ecfg.max_model_len}")
        need = {"swa": -(-seq_len // self.ecfg.block_size)}
        for r in self.ratios:
            need[r] = -(-(seq_len // r) // self.ecfg.comp_block_size)
        for key, n in need.items():
            pages = req["pages"][key]
            while len(pages) < n:
                if not self.free[key]:
                    raise RuntimeError(f"out of cache pages for {key!r}")
                pages.append(self.free[key].pop(0))

    # ------------------------------------------------------------------------------ steps
    def prepare(self, feeds: Sequence[tuple[int, int]]) -> tuple[StepInputs, list[tuple[int, int]]]:
        """Host side of a step: order the feeds decodes first, allocate pages, pad into buckets.

        `feeds`: (request id, number of its next known tokens to process). Returns the device
        inputs and the feeds in the order their tokens are packed. Raises ValueError naming the
        limit (`EngineConfig.prefill_chunk`, `max_num_batched_tokens`, `max_model_len`) a step
        would pass.
        """
        inp, feeds, _ = self._prepare(feeds)
        return inp, feeds

    def _check_limits(self, feeds: Sequence[tuple[int, int]]) -> None:
        lim, ecfg = self.limits, self.ecfg
        for rid, n in feeds:
            req = self.requests[rid]
            start = req["done"]
            if start + n > len(req["tokens"]):
                raise ValueError(f"request {rid} has {len(req['tokens']) - start} unprocessed tokens, asked for {n}")
            if n > lim.max_tokens_per_req:
                raise ValueError(f"request {rid} feeds {n} tokens in one step, more than the engine's "
                                 f"{lim.max_tokens_per_req} per request (EngineConfig.prefill_chunk="
                                 f"{ecfg.prefill_chunk}, num_speculative_tokens={ecfg.num_speculative_tokens}, "
                                 f"max_model_len={ecfg.max_model_len})")
            if start + n > lim.max_model_len:
                raise ValueError(f"sequence length {start + n} exceeds max_model_len {lim.max_model_len}")
        total = sum(n for _, n in feeds)
        if total > lim.max_tokens_per_step:
            raise ValueError(f"a step of {total} tokens exceeds the engine's {lim.max_tokens_per_step} per step "
                             f"(EngineConfig.max_num_batched_tokens={ecfg.max_num_batched_tokens}, "
                             f"max_reqs={ecfg.max_reqs})")

    def _prepare(self, feeds: Sequence[tuple[int, int]]) -> tuple[StepInputs, list[tuple[int, int]], StepShape]:
        feeds = [(rid, n) for rid, n in feeds if n > 0]
        self._check_limits(feeds)
        order = md.reorder_decodes_first([n for _, n in feeds], decode_threshold=self.decode_threshold)
        feeds = [feeds[i] for i in order]
        ecfg = self.ecfg
        bp = ecfg.buckets
        shape = step_shape(bp, num_tokens=sum(n for _, n in feeds), num_reqs=len(feeds),
                           max_seq_len=max([self.requests[rid]["done"] + n for rid, n in feeds] + [0]),
                           block_size=ecfg.block_size, comp_block_size=ecfg.comp_block_size, ratios=self.ratios)
        if shape not in self._envelope_set:
            raise ValueError(f"step shape ({shape}) is outside the engine's envelope of {len(self.envelope)} shapes "
                             f"for its limits {self.limits}")
        qlens, seqs, bts, slots, toks, rows, cbts = [], [], [], [], [], [], {r: [] for r in self.ratios}
        for rid, n in feeds:
            req = self.requests[rid]
            start = req["done"]
            self._ensure_pages(req, start + n)
            pg = req["pages"]["swa"]
            bs = ecfg.block_size
            slots += [pg[p // bs] * bs + p % bs for p in range(start, start + n)]
            toks += req["tokens"][start : start + n]
            qlens.append(n)
            seqs.append(start + n)
            bts.append(pg)
            rows.append(req["row"])
            for r in self.ratios:
                cbts[r].append(req["pages"][r])
        cm = md.make_common_attention_metadata(qlens, seqs, bts, slots, buckets=bp, num_tokens=shape.tokens,
                                               num_reqs=shape.reqs, num_blocks=shape.blocks)
        R, T = shape.reqs, shape.tokens
        cbt_arr = {}
        for r, width in shape.comp_blocks:
            a = np.full((R, width), -1, np.int32)
            for i, b in enumerate(cbts[r]):
                a[i, : len(b)] = b
            cbt_arr[r] = jnp.asarray(a)
        tok = np.zeros(T, np.int32)
        tok[: len(toks)] = toks
        ring_rows = np.zeros(R, np.int32)
        ring_rows[: len(rows)] = rows
        return StepInputs(jnp.asarray(tok), cm, cbt_arr, jnp.asarray(ring_rows)), feeds, shape

    def _run_step(self, feeds: Sequence[tuple[int, int]], kind: str,
                  host_start: float | None = None) -> tuple[dict[int, np.ndarray], StepTiming]:
        """One step and its timing; host time counts from `host_start` (default: now)."""
        t0 = time.perf_counter() if host_start is None else host_start
        inp, feeds, shape = self._prepare(feeds)
        exe = self._executables.get(shape)
        compile_s = 0.0
        if exe is None:
            _log.info("compiling step shape (%s) on demand: warmup() compiles the envelope's %d shapes ahead of time",
                      shape, len(self.envelope))
            tc = time.perf_counter()
            exe = self._compile(shape)
            compile_s = time.perf_counter() - tc
        t1 = time.perf_counter()
        logits, self.caches = exe(self.params, self.caches, inp, self.tables)
        jax.block_until_ready((logits, self.caches))
        t2 = time.perf_counter()
        logits = np.asarray(logits)
        out, off = {}, 0
        for rid, n in feeds:
            out[rid] = logits[off : off + n]
            self.requests[rid]["done"] += n
            off += n
        host_s = (t1 - t0 - compile_s) + (time.perf_counter() - t2)
        timing = StepTiming(kind=kind, num_tokens=off, shape=shape, host_s=host_s, device_s=t2 - t1)
        self.last_step = timing
        return out, timing

    def step(self, feeds: Sequence[tuple[int, int]]) -> dict[int, np.ndarray]:
        """Run one step (see `prepare`). Returns each request's logits float32 `[n, vocab]` for the
        tokens it processed; its timing is in `last_step`. A cold engine compiles the step's shape first."""
        kind = "decode" if all(n <= self.decode_threshold for _, n in feeds) else "prefill"
        return self._run_step(feeds, kind)[0]

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        *,
        prefill_chunk: int | None = None,
        on_step: Callable[[int, int], None] | None = None,
        return_stats: bool = False,
    ) -> list[list[int]] | tuple[list[list[int]], GenerateStats]:
        """Greedy generation: chunked prefill of every prompt, then one token per request per step.

        Prefill steps give each request up to `prefill_chunk` tokens (default and at most the engine's
        `EngineConfig.prefill_chunk`) within the `max_num_batched_tokens` of a step. A cold engine is
        warmed up first (`warmup()`, progress on stderr); the steps themselves run compiled executables
        only. Requests outside the engine's limits (more prompts than free request slots, a prompt plus
        its new tokens longer than `max_model_len`) are a ValueError before any step.
        `on_step(step_index, tokens_this_step)` is called after each decode step (progress bars).
        Returns the generated tokens of each prompt, and with `return_stats` also the `GenerateStats`
        (warm-up, and every step's host and device time), which `last_generate_stats` keeps either way.
        """
        lim = self.limits
        chunk = lim.max_tokens_per_req if prefill_chunk is None else prefill_chunk
        if not isinstance(chunk, int) or isinstance(chunk, bool) or not 0 < chunk <= lim.max_tokens_per_req:
            raise ValueError(f"prefill_chunk must be an int in 1..{lim.max_tokens_per_req} (the engine's per-request "
                             f"limit, EngineConfig.prefill_chunk={self.ecfg.prefill_chunk}), got {prefill_chunk!r}")
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        if len(prompts) > len(self.free_rows):
            raise ValueError(f"{len(prompts)} prompts exceed the {len(self.free_rows)} free request slots "
                             f"(EngineConfig.max_reqs={self.ecfg.max_reqs})")
        for i, p in enumerate(prompts):  # before a warm-up that may take minutes
            n = len(self._check_prompt(p, f"prompt {i}")) + max(max_new_tokens - 1, 0)
            if n > lim.max_model_len:
                raise ValueError(f"prompt {i} ({len(p)} tokens) with {max_new_tokens} new tokens needs {n} positions, "
                                 f"more than max_model_len {lim.max_model_len}")
        warm = None if self.is_warm else self.warmup()
        rids: list[int] = []
        outs: dict[int, list[int]] = {}
        last: dict[int, np.ndarray] = {}
        steps: list[StepTiming] = []
        try:
            for p in prompts:
                rids.append(self.add_request(p))
                outs[rids[-1]] = []
            while True:  # prefill, chunked, within the step's token budget
                t0 = time.perf_counter()
                feeds, budget = [], lim.max_tokens_per_step
                for rid in rids:
                    req = self.requests[rid]
                    take = min(len(req["tokens"]) - req["done"], chunk, budget)
                    if take:
                        feeds.append((rid, take))
                        budget -= take
                if not feeds:
                    break
                res, timing = self._run_step(feeds, "prefill", host_start=t0)
                steps.append(timing)
                for rid, lg in res.items():
                    last[rid] = lg[-1]
            for i in range(max_new_tokens):
                t0 = time.perf_counter()
                for rid in rids:
                    nxt = int(np.argmax(last[rid]))
                    outs[rid].append(nxt)
                    self.requests[rid]["tokens"].append(nxt)
                if i == max_new_tokens - 1:
                    break
                res, timing = self._run_step([(rid, 1) for rid in rids], "decode", host_start=t0)
                steps.append(timing)
                for rid, lg in res.items():
                    last[rid] = lg[-1]
                if on_step is not None:
                    on_step(i, len(rids))
        finally:
            for rid in rids:
                if rid in self.requests:
                    self.finish(rid)
        stats = GenerateStats(warmup=warm, steps=tuple(steps))
        self.last_generate_stats = stats
        tokens = [outs[r] for r in rids]
        return (tokens, stats) if return_stats else tokens
