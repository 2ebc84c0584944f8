// dsv41 sparse MLA kernels: the bodies of the decode, combine, planner and prefill CTAs, one header
// per role (included below in dependency order). Written against primitives.cuh only, so the same
// code builds for sm_90a / sm_100a (decode.cu, prefill.cu) and for the host emulator of the CPU
// tests (tests/cuda_emulator/).
//
// ---------------------------------------------------------------------------------------------
// Attention CTA (decode and prefill share it): 64 query heads x one query token, 384 threads.
//   warps 0..7  consumers: sm_90a wgmma (consume_tile_wgmma), sm_100a mma.sync (consume_tile_mma_sync)
//   warps 8..11 producers (gather the selected KV rows of each 64-token tile, all 64 or, in a
//               2-CTA pair, 32 of them; dequantize fp8 -> f16)
// setmaxnreg gives the consumer warpgroups 184 registers and the producer warpgroup 128 (a pair,
// decode's: 200 and 104; one CTA with split consumers, prefill's default: 192 and 120; params.h).
// Decode of at most 32 heads: the narrow CTA (narrow.cuh), one consumer warpgroup (swapped-operand MMAs:
// the heads as N) and two producer warpgroups, on q unpadded.
// Consumers, two shapes (Crew::split): symmetric (consumer.cuh: one CTA's decode, and the sm_100a
// build's mma.sync path) or FlashMLA's split (consume_tile_split: warpgroup 0 S + softmax + O[:, :256],
// warpgroup 1 O[:, 256:]; a pair's decode and prefill on sm_90a).
// Tensor-core operands are f16 with f32 accumulation (bf16 / e4m3 x 2^e inputs convert exactly inside
// f16's range, magnitudes below 2^-17 round on its subnormal grid, beyond +-65504 they saturate).
// Shared memory (params.h, 231264 B from a 1024-aligned base): Q f16 [64 heads][512], K/V f16
// [2 buffers][64 tokens][512], P f16 [2 buffers][64 heads][64 tokens], small f32 exchange arrays,
// per buffer a validity mask (8 words of 8 bits), the pair's mbarriers, a 16 KB exchange region (a
// pair's address ring, seesaw.cuh's flags).
// Q and K/V use the 128-byte-swizzle layout wgmma reads (8 column blocks of [64 rows][128 B], chunk c
// of row r at c ^ (r & 7)); the same XOR keeps every ldmatrix of the mma.sync path conflict-free.
//
// Per tile (64 tokens), symmetric consumer warp w (warpgroup th = w >> 2 owns tokens 32th..32th+31
// for Q K^T):
//   S = Q K^T for rows 16 (w & 3) + g (+8), its 32 tokens; masked, scaled to the log2 domain.
//   row max of the two token halves exchanged through smem (barrier B1); the base M moves lazily (only
//   when the tile maximum exceeds it by more than kLazyLog2), alpha = 2^(M_old - M) when it moves and
//   1 otherwise, P = 2^(S - M) (0 for an empty row: base 0), partial row sums l; P as f16 to smem
//   (barrier B2).
//   O += P V: wgmma path, warpgroup th owns dims 256th..+255 of all 64 heads (rows = its S rows, so
//   alpha stays in registers); mma.sync path, warp w owns dims 64w..64w+63 (alpha through smem).
// Producer/consumer hand-off uses named barriers per K buffer: FULL[b] (producers arrive, consumers
// sync) and EMPTY[b] (consumers arrive, producers sync); a decode head-group pair (2-CTA cluster
// that splits every tile's gather) adds the peer's mbarriers, waited on by producers only (see
// pair.cuh). Consumer-only exchanges use one 256-thread named barrier (split consumers: a P-ready
// barrier and a FULL[b] per warpgroup instead; common.cuh). Both roles of every CTA
// of a crew walk the same tile sequence, so the counts always balance (producers drain the last
// EMPTYs).
//
// Fragment layouts (mma.sync m16n8k16, ldmatrix) are written down in primitives.cuh.
// Prefill over f16 rows (the wrapper converted kv) runs another CTA on sm_90a: seesaw.cuh.
// Decode walks the split plan of dsv41_jax.scheduler.plan_decode_splits (see decode_work);
// prefill has one segment per CTA. Epilogues: final (bf16 out with the sink, natural-log lse)
// or split (f32 O/L and log2-domain lse into the accumulators, merged by combine_cta).
//
// Masking: a token is valid iff its position < length (already clamped to [0, topk]) and its
// index is in [0, capacity). Invalid tokens are never read: producers write zero rows and a
// 0 bit in the mask, consumers set their scores to -inf. So NaN in unused cache slots never
// reaches a product.
// ---------------------------------------------------------------------------------------------
#pragma once

#include "common.cuh"
#include "pair.cuh"
#include "producer.cuh"
#include "consumer.cuh"
#include "decode_cta.cuh"
#include "narrow.cuh"
#include "planner.cuh"
#include "combine_cta.cuh"
#include "prefill_cta.cuh"
