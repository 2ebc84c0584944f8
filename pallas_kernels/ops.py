"""`impl="pallas"` sparse MLA decode and prefill and the mega ops: operand preparation, kernel call, split combine.

The XLA side only touches indices and per-entry metadata, never the KV data:
- per pool and selected entry, the source of the token in the cache -- the index of its
  quantized record in units of the format's data bytes (576 / 512 / 256 for fp8_ds_mla / mxfp8_ds_mla /
  nvfp4_ds_mla: `block * page_bytes / unit + offset`; a page is a whole number of units) or its bf16
  row (the global slot) -- or -1 when the entry is masked (index < 0, index >= capacity, or position >=
  topk_length); sources stay int32 for caches of any size and the kernel forms 64-bit addresses;
- for quantized pools, the entry's scale bytes (fp8_ds_mla: 7 UE8M0 exponents + pad; mxfp8_ds_mla: 16
  UE8M0; nvfp4_ds_mla: 32 e4m3): on the GPU their distance in bytes from the record, read by the kernel
  itself; for the interpreter one gather per entry, turned into f32 factors (2^(e - 127), or the e4m3
  value) laid out [row, block, group, token], so the kernel loads one group's per-token factors as one
  row vector; masked entries read nothing and get 0 (-1 offsets);
- per row and pool, the number of 64-token blocks `ceil(min(topk_length, topk) / 64)`.

Splits: a fixed split of each row's valid blocks into `num_splits` equal parts (not FlashMLA's
`plan_decode_splits`, whose per-SM request ranges would need a persistent kernel with
data-dependent output routing). `num_splits` is chosen statically so that rows x head-groups x
splits fills at most one wave of the GPU (`choose_num_splits`); with one split the kernel writes
the final output, otherwise f32 partials merged by `combine_splits` (jnp).

The mega ops run the same kernels with `KernelSpec.mega`: q goes in unroped with each row's cos / sin
(`_mega.rope_rows`, one small gather), and with one split the kernel writes the e4m3 output and its
exponents; split partials are merged by `combine_splits` and finished by the reference's `mega_finish`
(inverse RoPE and quantisation, fused by XLA into the combine's pass).
"""

from __future__ import annotations

import contextlib
import functools
import threading

import jax
import jax.numpy as jnp

from dsv41_jax import kv_cache as kvc
from dsv41_jax.device import default_num_sms
from dsv41_jax.sparse_mla.reference import mega_finish
from pallas_kernels import _interpret
from pallas_kernels._conversions import to_tile
from pallas_kernels._kernel import build_kernel
from pallas_kernels._mega import rope_rows
from pallas_kernels._spec import (HB, OUT_GROUP, QUANTIZED_FORMATS, SCALE_GROUPS, KernelSpec, PoolSpec, T,
                                  item_count, scale_offsets_mode)

__all__ = ["decode", "prefill", "mega_decode", "mega_prefill", "combine_splits", "choose_num_splits", "pool_operands",
           "unsupported_reason", "to_f16", "prefill_rows_f16", "decode_operands_f16", "num_splits_override",
           "kernel_options", "KV_FORMATS", "V41_FORMATS"]

KV_FORMATS = ("bf16",) + QUANTIZED_FORMATS  # the cache formats the kernels read: every one
assert set(KV_FORMATS) == set(kvc.KV_FORMATS)
V41_FORMATS = kvc.V41_FORMATS  # V4.1's records: decodes of these alone run on f16 operands


_override = threading.local()


@contextlib.contextmanager
def num_splits_override(n: int | None):
    """Force the split count of kernels traced inside (tests, benchmarks); None restores the heuristic."""
    prev = getattr(_override, "n", None)
    _override.n = n
    try:
        yield
    finally:
        _override.n = prev


@contextlib.contextmanager
def kernel_options(*, f16: bool | None = None, ctas: int | str | None = None):
    """Choose how kernels traced inside are built (benchmarks, tests).

    `f16=True` runs Q, the K tile and P in float16 (one P V wgmma; values beyond +-65504 saturate; a decode
    call's bf16 caches are converted, whole, per call), `f16=False` keeps bf16 operands with P = P_hi + P_lo,
    exact over bf16's range (default: f16 for large prefills and for decodes of V4.1 records only:
    `prefill_rows_f16`, `decode_operands_f16`).

    `ctas=N` runs at most N persistent CTAs, each looping over (row, split, head group) items, so that an item's
    Q and first block load while the previous item's last block and epilogue run; `ctas="sms"`: one per SM of
    the default device; 0 restores one CTA per item (the default). None leaves either choice as it is."""
    if ctas is not None and ctas != "sms" and not (isinstance(ctas, int) and ctas >= 0):
        raise ValueError(f"ctas must be a count >= 0 or 'sms', got {ctas!r}")
    prev = getattr(_override, "options", {})
    _override.options = {**prev, **({} if f16 is None else {"f16": bool(f16)}),
                         **({} if ctas is None else {"ctas": ctas})}
    try:
        yield
    finally:
        _override.options = prev


def _cdiv(a, b):
    return -(-a // b)


def choose_num_splits(rows: int, head_groups: int, max_blocks: int, num_sms: int | None = None) -> int:
    """Static split count: as many parts as fit the programs in one wave (`num_sms // (rows x head groups)`), at
    least 4 blocks (256 tokens) per split, at most 64.

    A split is worth its cost only where it shortens the wave count: every split of a 64-head program writes and
    the combine reads 128 KiB of f32 partials, more than the ~33 KiB of records it reads per V4.1 block. Splitting
    a call that already fills about one wave only adds waves of shorter programs plus that traffic
    (benchmarks/RESULTS.md: 128 rows of the V4.1-Flash decode, 49.5 us in one split against 78.7 us in two)."""
    num_sms = num_sms or default_num_sms()
    ctas = max(rows * head_groups, 1)
    return int(max(1, min(num_sms // ctas, max_blocks // 4, 64)))


def unsupported_reason(kv_format: str, cache) -> str | None:
    """Why the kernels cannot read this cache, or None."""
    if kv_format not in KV_FORMATS:
        return f"the pallas kernels read kv formats {list(KV_FORMATS)}, not {kv_format!r} (use impl='xla')"
    if kv_format != "bf16" and _interpret.active() and cache.size >= 2**31 - 4096:
        # the interpreter addresses records and scale rows with int32 byte arithmetic; the GPU kernel does not
        return f"in interpret mode the pallas kernels read {kv_format} caches below 2 GiB (int32 byte offsets)"
    return None


def _scale_factors(scale_bytes, kv_format: str):
    """The interpreter's f32 factor of each scale byte: 2^(e - 127) (UE8M0; e = 0 -> 0, a byte the quantizer
    never writes) or the e4m3 value (nvfp4_ds_mla; 0x7F is NaN, as in the reference)."""
    if kv_format == "nvfp4_ds_mla":
        return jax.lax.bitcast_convert_type(scale_bytes, jnp.float8_e4m3fn).astype(jnp.float32)
    return jax.lax.bitcast_convert_type(scale_bytes.astype(jnp.int32) << 23, jnp.float32)


def pool_operands(cache, kv_format: str, block_size: int, idx, lens, scale_offsets: bool = False):
    """(operands, PoolSpec, blocks per row) of one pool. idx int32 [R, K]; lens int32 [R].

    Operands: the cache view, the sources src int32 [R, kpad] (quantized formats: the record's index in
    units of its data bytes; bf16: the row; -1 masked) and, for quantized pools, the scales: f32
    [R, kpad / 64, SCALE_GROUPS, 64] (per block, scale group and token: the interpreter; groups past the
    format's count are 0), or with `scale_offsets` (the GPU kernel, which reads the scale bytes itself)
    the bytes from the record to them, int32 [R, kpad] (-1 masked). Every source is int32 and every
    address the kernel forms is 64-bit, so caches of any size are read."""
    R, K = idx.shape
    kpad = max(_cdiv(K, T), 1) * T
    cap = kvc.cache_capacity(cache, kv_format, block_size)
    pos = jnp.arange(K, dtype=jnp.int32)[None, :]
    valid = (pos < lens[:, None]) & (idx >= 0) & (idx < cap)
    safe = jnp.where(valid, idx, 0)
    if kv_format == "bf16":
        view = cache.reshape(-1, cache.shape[-1])
        src = jnp.where(valid, safe, -1)
        extra = ()
    else:
        lay = kvc.layout(kv_format)
        unit, sb = lay.data_bytes, lay.scale_bytes
        pb = kvc.page_bytes(kv_format, block_size)
        view = cache.reshape(-1)
        blk, t = safe // block_size, safe % block_size
        # Record units (a page is a whole number of them) keep every cache of fewer than 2^31 records in int32
        # (1.1 TiB of fp8_ds_mla, 0.5 TiB of nvfp4_ds_mla); the kernels form the 64-bit byte address.
        src = jnp.where(valid, blk * (pb // unit) + t, -1)
        if scale_offsets:
            # the entry's scale bytes, as bytes past its record (small, whatever the cache's size)
            ssrc = jnp.where(valid, (block_size - t) * unit + t * sb, -1)
            extra = (jnp.pad(ssrc, ((0, 0), (0, kpad - K)), constant_values=-1).astype(jnp.int32),)
        else:
            rows = cache.reshape(-1, sb)
            scale_row = blk * (pb // sb) + block_size * (unit // sb) + t  # in rows of sb bytes
            # one gather per entry; masked entries index past the end and read nothing (fill 0)
            sc = rows.at[jnp.where(valid, scale_row, rows.shape[0])].get(mode="fill", fill_value=0)
            sc = jnp.pad(sc, ((0, 0), (0, kpad - K), (0, SCALE_GROUPS - sb)))  # [R, kpad, SCALE_GROUPS] uint8
            sf = _scale_factors(sc, kv_format)
            # laid out [R, block, group, token] for per-token row loads
            extra = (sf.reshape(R, kpad // T, T, SCALE_GROUPS).transpose(0, 1, 3, 2),)
    if kpad > K:
        src = jnp.pad(src, ((0, 0), (0, kpad - K)), constant_values=-1)
    nblk = (jnp.clip(lens, 0, K) + T - 1) // T
    return (view, src.astype(jnp.int32)) + extra, PoolSpec(kv_format, kpad), nblk.astype(jnp.int32)


def combine_splits(o, lse, mx, sink):
    """Merge split partials. o f32 [R, S, H, D] (each O_i / l_i), lse/mx f32 [R, S, H] (-inf empty).

    Returns (out f32 [R, H, D] with the sink applied, lse [R, H] (+inf empty), max_logits [R, H])."""
    M = jnp.max(lse, axis=1)
    M_safe = jnp.where(jnp.isneginf(M), 0.0, M)
    wts = jnp.exp(lse - M_safe[:, None, :])  # 0 for empty splits
    S = jnp.sum(wts, axis=1)
    empty = S == 0
    lse_f = jnp.where(empty, jnp.inf, M_safe + jnp.log(jnp.where(empty, 1.0, S)))
    out = jnp.einsum("rsh,rshd->rhd", wts, o) / jnp.where(empty, 1.0, S)[..., None]
    if sink is not None:
        out = out / (1.0 + jnp.exp(sink[None, :] - jnp.where(empty, 0.0, lse_f)))[..., None]
    out = jnp.where(empty[..., None], 0.0, out)
    return out, lse_f, jnp.max(mx, axis=1)


def to_f16(x):
    """bf16 rows -> f16, rounded once, saturated to +-65504 (NaN stays NaN): f16 kernels' row pools."""
    return to_tile(x.astype(jnp.float32), jnp.float16)  # the kernel's own rounding and saturation


@functools.lru_cache(maxsize=None)
def _kernel_fn(spec: KernelSpec):
    """The kernel of `spec` as one jitted function. Every call of a step (each layer of one type calls the same
    spec) then traces to the same jaxpr, which JAX lowers once per module: the layers share one Mosaic GPU
    module and one kernel hash, so the GPU compiles each kernel configuration once per step, not once per layer.

    For the GPU the kernel is also lowered once per operand shapes for the whole process (`_exported_kernel`) and
    embedded as it is wherever it is called, so every computation that calls it (the engine's step shapes of one
    token bucket, the warm-up's threads) holds the same module and the same kernel hash, and jaxlib's Mosaic GPU
    compile cache, keyed by that hash, compiles it once. Lowered anew per computation, each module would carry
    its own `mosaic_gpu.dump_basename` (a per-process counter jaxlib sets at lowering), hence its own hash."""
    if spec.interpret:  # the interpreter's kernels are host callbacks: nothing to compile once
        return jax.jit(build_kernel(spec))

    @jax.jit
    def run(*args):
        avals = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args)
        return _exported_kernel(spec, avals).call(*args)

    return run


@functools.lru_cache(maxsize=None)
def _exported_kernel(spec: KernelSpec, avals: tuple):
    """The GPU kernel of `spec` over operands `avals`, lowered once for CUDA (`jax.export`).

    The module is used in this process only, never serialised, so it needs none of export's guarantees: the
    Mosaic GPU custom call need not be a stable one, and the kernel is lowered as a direct call lowers it (not
    in the forward-compatible IR version an export otherwise writes)."""
    from jax import export
    from jax._src import config as jax_config  # private: the flag has no public context manager in jax 0.11

    with jax_config.export_ignore_forward_compatibility(True):
        return export.export(jax.jit(build_kernel(spec)), platforms=("cuda",),
                             disabled_checks=[export.DisabledSafetyCheck.custom_call("mosaic_gpu_v2")])(*avals)


def _run(q_rows, pools, sink, softmax_scale, num_splits, f16=False, rope=None):
    """q_rows bf16 [R, h, 512]; pools: list of (operands, PoolSpec, nblk). Returns out, mx, lse.

    `f16` (unless `kernel_options` says otherwise): run the kernel with f16 operands
    (`KernelSpec.f16`), bf16 row pools converted to f16 here (their whole operand). `rope`: the mega ops'
    (positions int32 [R], cos_sin_cache f32 [max_pos, 64]), q_rows not roped; returns (out e4m3 [R, h, 512],
    out_scale uint8 [R, h, 16], lse) instead, finished in the kernel with one split, else after the combine
    (`reference.mega_finish`)."""
    R, h, _ = q_rows.shape
    if R == 0:
        if rope is not None:
            return (jnp.zeros((0, h, q_rows.shape[2]), jnp.float8_e4m3fn),
                    jnp.zeros((0, h, q_rows.shape[2] // OUT_GROUP), jnp.uint8), jnp.zeros((0, h), jnp.float32))
        return (jnp.zeros((0, h, q_rows.shape[2]), jnp.bfloat16), jnp.zeros((0, h), jnp.float32),
                jnp.zeros((0, h), jnp.float32))
    Hp = _cdiv(h, HB) * HB
    if Hp != h:
        q_rows = jnp.pad(q_rows, ((0, 0), (0, Hp - h), (0, 0)))
    counts = jnp.stack([nb for _, _, nb in pools], axis=1)
    max_blocks = sum(ps.kpad // T for _, ps, _ in pools)
    if num_splits is None:
        num_splits = getattr(_override, "n", None)
    if num_splits is None:
        num_splits = choose_num_splits(R, Hp // HB, max_blocks)
    num_splits = int(max(1, min(num_splits, max(max_blocks, 1))))
    f16 = getattr(_override, "options", {}).get("f16", f16)
    ctas = getattr(_override, "options", {}).get("ctas") or None
    if ctas == "sms":
        ctas = default_num_sms()
    items = item_count(R, num_splits, Hp)
    spec = KernelSpec(rows=R, heads=Hp, pools=tuple(ps for _, ps, _ in pools), num_splits=num_splits,
                      softmax_scale=float(softmax_scale), has_sink=sink is not None,
                      interpret=_interpret.active(), f16=f16, mega=rope is not None,
                      ctas=None if ctas is None or ctas >= items else ctas)
    if spec.f16:  # the kernel converts Q's values in SMEM (an XLA pass would cost a q round trip)
        q_rows = jax.lax.bitcast_convert_type(q_rows, jnp.float16)
    args = [q_rows, counts]
    sink_p = None
    if sink is not None:
        sink_p = jnp.pad(sink.astype(jnp.float32), (0, Hp - h), constant_values=-jnp.inf) if Hp != h else sink
        args.append(sink_p.astype(jnp.float32))
    if rope is not None:
        args.append(rope_rows(*rope))
    for ops, ps, _ in pools:
        if ps.quantized and (ops[2].ndim == 2) != spec.scale_offsets:  # operands built for another kernel
            raise RuntimeError(f"scale operand of shape {ops[2].shape} does not match the kernel "
                               f"(scale_offsets={spec.scale_offsets})")
        if not ps.quantized and spec.f16:
            ops = (to_f16(ops[0]),) + tuple(ops[1:])
        args.extend(ops)
    with _interpret.kernel_context():
        out, lse, mx = _kernel_fn(spec)(*args)
    if spec.mega_out:  # mx holds the exponents, four bytes per uint32 word (little-endian: the lowest dims first)
        scale = jax.lax.bitcast_convert_type(mx[:, :h], jnp.uint8).reshape(R, h, -1)
        return out[:, :h], scale, lse[:, :h]
    if rope is not None:
        out, lse, _ = combine_splits(out, lse, mx, sink_p)
        return mega_finish(out[:, :h], rope[0], rope[1], lse[:, :h])
    if num_splits > 1:
        out, lse, mx = combine_splits(out, lse, mx, sink_p)
    elif out.dtype != jnp.bfloat16:  # an f16 kernel's bf16 bits (`_compute.store_final_out`)
        out = jax.lax.bitcast_convert_type(out, jnp.bfloat16)
    out = out.astype(jnp.bfloat16)
    return out[:, :h], mx[:, :h], lse[:, :h]


def _decode_rows(call, num_splits, rope=None):
    """`_run` over a `DecodeCall`'s rows, one per (request, query token): the main and the extra cache's pool
    operands, one split when batch-invariant, f16 operands for V4.1 pools alone."""
    b, s_q, h, d = call.q.shape
    R = b * s_q

    def rows(idx, lens):
        return idx.reshape(R, idx.shape[2]), jnp.repeat(lens.astype(jnp.int32), s_q)

    so = scale_offsets_mode(_interpret.active())  # the form of the kernel `_run` builds
    tl, etl = call.lengths()
    pools = [pool_operands(call.kv_cache, call.kv_format, call.block_size, *rows(call.indices, tl), scale_offsets=so)]
    if call.has_extra:
        pools.append(pool_operands(call.extra_kv_cache, call.extra_kv_format, call.extra_block_size,
                                   *rows(call.extra_indices, etl), scale_offsets=so))
    if call.batch_invariant:  # one program per row and head group over the whole row: no split-KV
        num_splits = 1
    return _run(call.q.reshape(R, h, d), pools, call.attn_sink, call.softmax_scale, num_splits,
                f16=decode_operands_f16([ps.kv_format for _, ps, _ in pools]), rope=rope)


def _prefill_rows(call, num_splits, rope=None):
    """`_run` over a `PrefillCall`'s queries: one bf16 row pool (`kv`), f16 operands where `prefill_rows_f16` says."""
    kv = call.kv
    pool = pool_operands(kv.reshape(1, kv.shape[0], kv.shape[1]), "bf16", kv.shape[0], call.indices,
                         call.lengths().astype(jnp.int32))
    s_q, h, _ = call.q.shape
    return _run(call.q, [pool], call.attn_sink, call.softmax_scale, num_splits,
                f16=prefill_rows_f16(kv.shape[0], s_q, call.indices.shape[1], h), rope=rope)


def decode(call, *, num_splits: int | None = None):
    """`impl="pallas"` decode of a checked `DecodeCall`: (out bf16 [b, s_q, h, 512], lse f32 [b, s_q, h]).

    The kernel splits each row into `num_splits` equal parts (`choose_num_splits`); a plan's
    FlashMLA part ranges are not used (its shapes were checked by the op), batch_invariant gives one
    split."""
    b, s_q, h, d = call.q.shape
    out, _, lse = _decode_rows(call, num_splits)
    return out.reshape(b, s_q, h, d), lse.reshape(b, s_q, h)


def mega_decode(call, *, num_splits: int | None = None):
    """`impl="pallas"` mega decode of a checked `MegaDecodeCall`: (out e4m3 [T, h, 512], out_scale uint8
    [T, h, 16], lse f32 [T, h]). The decode's kernel with Q roped in it and, with one split, the output stage in
    its epilogue (`KernelSpec.mega`); the T one-token requests are T rows."""
    return _decode_rows(call.decode, num_splits, rope=(call.positions, call.cos_sin_cache))


def mega_prefill(call, *, num_splits: int | None = None):
    """`impl="pallas"` mega prefill of a checked `MegaPrefillCall`: (out e4m3 [s_q, h, 512], out_scale uint8
    [s_q, h, 16], lse f32 [s_q, h]), as `mega_decode` over the prefill's kernel."""
    return _prefill_rows(call.prefill, num_splits, rope=(call.positions, call.cos_sin_cache))


def prefill(call, *, num_splits: int | None = None):
    """`impl="pallas"` prefill of a checked `PrefillCall`: (out bf16 [s_q, h, 512], max_logits, lse f32 [s_q, h])."""
    return _prefill_rows(call, num_splits)


def decode_operands_f16(kv_formats) -> bool:
    """Whether a decode runs with f16 operands (`KernelSpec.f16`): when every pool holds V4.1 records
    (mxfp8_ds_mla, nvfp4_ds_mla). The memory warpgroup's conversion bounds the decode, and theirs is one
    e4m3x2 -> f16x2 conversion and one f16x2 multiply per pair in f16 against six instructions in bf16;
    nvfp4 values never leave f16's range, mxfp8 ones beyond +-65504 saturate, as in the cuda kernels. fp8_ds_mla
    pools (their RoPE chunks converted too) and bf16 pools (converted whole per call) stay bf16, where f16 is
    no faster (benchmarks/RESULTS.md)."""
    return all(f in V41_FORMATS for f in kv_formats)


def prefill_rows_f16(s_kv: int, s_q: int, topk: int, h: int) -> bool:
    """Whether prefill converts kv to f16 for the f16 kernel, which saves the second P V wgmma
    (`dsv41_jax.kv_cache.f16_rows_pay`: s_kv <= s_q * topk * h / 512)."""
    return kvc.f16_rows_pay(s_kv, s_q, topk, h)
