"""What a kernel is built from: its static description (`KernelSpec`), tile sizes, SMEM budget.

One program (CTA) handles one (row, split, 64-head group): 64 heads are the wgmma M, 64 tokens
per block the N of Q K^T and the K of P V. Each compute warpgroup owns one half (256 dims) of the
512-dim latent.
"""

from __future__ import annotations

import dataclasses
import math

import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp

from dsv41_jax import kv_cache as kvc

__all__ = ["PoolSpec", "KernelSpec", "smem_bytes", "item_count", "scale_offsets_mode", "T", "HB", "D", "HALF", "NOPE",
           "ROPE_DIM", "STAGE_PITCH", "SCALE_GROUPS", "OUT_GROUP", "OUT_WORD", "LOG2E", "LN2", "REG_BUDGET",
           "SMEM_LIMIT", "NBUF", "TILE", "SWIZZLE", "OUT_STAGE_TRANSFORMS", "ROW", "COL", "QUANTIZED_FORMATS"]

T = 64  # tokens per block (the wgmma N of Q K^T and the K of P V)
HB = 64  # heads per program (the wgmma M)
D = kvc.LATENT_DIM
HALF = D // 2  # latent dims per compute warpgroup
NOPE = kvc.NOPE_DIM
ROPE_DIM = kvc.ROPE_DIM  # the roped dims, the last of the latent (warpgroup 1's)
assert ROPE_DIM == HB, "the constants buffer's rows hold a head group's sink or the RoPE dims' cos / sin"
# the records the memory warpgroup dequantizes: every format with scale bytes
QUANTIZED_FORMATS = tuple(f for f in kvc.KV_FORMATS if kvc.layout(f).scale_bytes)
STAGE_PITCH = 656  # interpreter staging row pitch (>= every record's data bytes): 164 words, rows 4 banks apart
SCALE_GROUPS = 32  # interpreter scale factor rows per token: the most scales a record has (nvfp4_ds_mla)
OUT_GROUP = 32  # mega output dims per UE8M0 exponent (the reference's `quantize_output_fp8` group)
OUT_WORD = 4  # the mega output's exponent bytes per stored uint32 word
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
REG_BUDGET = 504  # registers per (memory, compute, compute) thread triple: 65536 // 384 rounded to 8, x 3
SMEM_LIMIT = 232448  # bytes of dynamic SMEM a Hopper CTA may use
NBUF = 2  # K tiles in the gather ring: block n + 1 lands while block n is consumed

TILE = plgpu.TilingTransform((8, 64))
SWIZZLE = plgpu.SwizzleTransform(128)
# the mega output's e4m3 staging view: one tile column per exponent group, swizzled so that a warp's two-byte stores
# (eight rows, one group) fall in distinct banks
OUT_STAGE_TRANSFORMS = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(32))
ROW = plgpu.Layout.WGMMA.reduce(1)  # one value per row of a [64, n] wgmma-layout tile
COL = plgpu.Layout.WGMMA.reduce(0)  # one value per column


@dataclasses.dataclass(frozen=True)
class PoolSpec:
    """A token pool: `kv_format` one of `QUANTIZED_FORMATS` (uint8 byte view of the cache) or "bf16" (rows
    [n, 512]); `kpad` the per-row index count, a multiple of T."""

    kv_format: str
    kpad: int

    @property
    def quantized(self) -> bool:
        """Records dequantized by the kernel (their scales come as a third operand), not bf16 rows."""
        return self.kv_format in QUANTIZED_FORMATS

    @property
    def layout(self) -> kvc.RecordLayout:
        return kvc.layout(self.kv_format)


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """Everything static about one kernel: shapes, pools, split count and operand type."""

    rows: int
    heads: int  # padded, a multiple of HB
    pools: tuple[PoolSpec, ...]
    num_splits: int
    softmax_scale: float
    has_sink: bool
    interpret: bool  # trace the interpreter-compatible formulation
    # Q, the K tile and P in float16, so P V is one wgmma with an 11-bit P (bf16 needs P = P_hi + P_lo,
    # two wgmmas, to meet the output tolerance); values beyond +-65504 saturate. `ops` asks for it in
    # large prefills.
    f16: bool = False
    # The mega ops (`_mega.py`): the row's cos / sin in SMEM, Q's RoPE in the kernel, and with one split
    # the inverse RoPE and the e4m3 output with UE8M0 exponents per 32 dims (split partials stay f32).
    mega: bool = False
    # Persistent programs: `ctas` CTAs, each looping over the items (row, split, head group) cta, cta + ctas, ...,
    # so that an item's Q and first block load while the previous item's last block and epilogue run. None: one
    # CTA per item.
    ctas: int | None = None

    def __post_init__(self):
        if self.ctas is not None and not 1 <= self.ctas <= self.items:
            raise ValueError(f"ctas must lie in [1, items = {self.items}], got {self.ctas}")

    @property
    def head_groups(self) -> int:
        return self.heads // HB

    @property
    def items(self) -> int:
        """(row, split, head group) work items: one CTA each unless `ctas` is set."""
        return item_count(self.rows, self.num_splits, self.heads)

    @property
    def grid(self) -> int:
        """CTAs launched."""
        return self.items if self.ctas is None else self.ctas

    @property
    def final(self) -> bool:
        """One split: the kernel writes the final output, not f32 partials."""
        return self.num_splits == 1

    @property
    def mega_out(self) -> bool:
        """The kernel writes the mega output (e4m3 values, exponents, lse), not bf16 O or partials."""
        return self.mega and self.final

    @property
    def stage_in_ring(self) -> bool:
        """The one-split bf16 output is staged in a K ring slot of its own (the mega output: in Q's SMEM)."""
        return self.final and not self.mega

    @property
    def row_consts(self) -> int:
        """Rows of 64 f32 in the constants buffer: the sink (`has_sink`), then the mega ops' cos and signed sin
        (`_mega.rope_rows`). One buffer, so that the sink and cos / sin take one 1 KiB alignment unit together."""
        return self.has_sink + 2 * self.mega

    @property
    def has_quantized(self) -> bool:
        return any(p.quantized for p in self.pools)

    @property
    def has_rope_bf16(self) -> bool:
        """A pool of fp8_ds_mla records, whose RoPE dims are bf16 (the interpreter combines their bytes)."""
        return any(p.kv_format == "fp8_ds_mla" for p in self.pools)

    @property
    def scale_pitch(self) -> int:
        """Bytes per token of the GPU's scale buffer: the largest scale record of the pools."""
        return max((p.layout.scale_bytes for p in self.pools if p.quantized), default=0)

    @property
    def registers(self) -> tuple[int, int]:
        """(memory, compute) registers per thread for `setmaxnreg`.

        A CTA of 384 threads is launched with 168 registers per thread, 504 per (memory + 2 compute)
        thread triple; `setmaxnreg.inc` blocks until registers are free, so the three warpgroups must
        not ask for more than 504 in all (asking for more hangs the GPU). Multiples of 8. The memory
        warpgroup needs 56 when it converts quantized records, else 40."""
        mem = 56 if self.has_quantized else 40
        return mem, (REG_BUDGET - mem) // 16 * 8

    @property
    def dtype(self):
        """Element type of the Q and K tiles (and of bf16 row pool operands)."""
        return jnp.float16 if self.f16 else jnp.bfloat16

    @property
    def scale_offsets(self) -> bool:
        """Scale operands locate the scale bytes (GPU: bytes past the record), not f32 factor rows."""
        return self.has_quantized and scale_offsets_mode(self.interpret)

    @property
    def xbufs(self) -> int:
        """Score-exchange buffers: two where SMEM allows (both warpgroups post at once), else one
        (kernels of quantized pools: Q + 2 K tiles + 2 buffers + scale bytes + indices + sink exceed
        227 KiB by the 1 KiB alignment of each buffer)."""
        return 2 if smem_bytes(self, xbufs=2) <= SMEM_LIMIT else 1


def item_count(rows: int, num_splits: int, heads: int) -> int:
    """(row, split, 64-head group) items of a kernel over `heads` (padded) heads: `KernelSpec.items`."""
    return rows * num_splits * (heads // HB)


def scale_offsets_mode(interpret: bool) -> bool:
    """Whether quantized pools take scale locations (the GPU kernel reads the scale bytes itself) or
    f32 factor rows (the interpreter's Pallas-level dequantization). `ops` asks before it builds
    the operands, `KernelSpec.scale_offsets` after."""
    return not interpret


def smem_bytes(spec: KernelSpec, xbufs: int | None = None) -> int:
    """Dynamic SMEM the GPU kernel asks for, with 1 KiB alignment per buffer (what Mosaic GPU pads to).

    The same figure for interpreter specs (whose extra buffers -- P and record staging, the RoPE
    combiner -- are not counted), so that CPU tests make the same choices (`xbufs`) as the GPU. The
    scale buffer is counted as 2 KiB: the GPU's byte rows [64, scale_pitch] take 0.5 / 1 / 2 KiB (fp8_ds_mla /
    mxfp8_ds_mla / nvfp4_ds_mla; the interpreter's f32 factor rows take more).
    `xbufs`: count that many exchange buffers instead of `spec.xbufs`. Barriers: 1 KiB (they take
    < 100 B; the kernel asks for no reduction scratch)."""
    def al(n):
        return -(-n // 1024) * 1024

    total = al(HB * D * 2) + NBUF * al(T * D * 2) + al(NBUF * T * 4) + 1024  # Q, K, indices, barriers
    if spec.has_quantized:  # scale bytes
        total += al(T * 32)
    if spec.row_consts:  # the sink and the row's cos / sin share one buffer
        total += al(spec.row_consts * HB * 4)
    total += (xbufs or spec.xbufs) * al(HB * T * 4)
    return total
