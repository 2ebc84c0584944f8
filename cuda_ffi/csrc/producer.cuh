// The producer warps: index and address look-ahead, L2 prefetch, the gather of a tile's KV rows,
// dequantisation of the quantized formats, stores into the K buffers (and a pair's copies to its peer), the FULL / EMPTY
// hand-off with the consumers.
#pragma once

#include "pair.cuh"

namespace dsv41 {

// 16 fp8 (one 16-byte chunk) * 2^(e-127) -> 16 f16 in two 16-byte chunks (exact in f16's range).
// Fast path, scale exponent k = e - 127 in [-14, 7]: e4m3x2 -> f16x2 and one f16x2 multiply by the
// f16 power of two (exact: |e4m3| <= 448 so |x 2^k| <= 57344, and the smallest product m 2^-23
// is on f16's subnormal grid). Other scales go through f32: k >= 8 saturates beyond 65504, k <= -16
// rounds on f16's subnormal grid (error < 2^-25). kKnownFast: the caller has checked dequant_fast_ok.
DEVFN bool dequant_fast_ok(uint32_t e8m0) { return e8m0 - 113u <= 21u; }  // k = e8m0 - 127 in [-14, 7]
template <bool kKnownFast = false>
DEVFN void dequant16(const uint4& raw, uint32_t e8m0, uint4& first, uint4& second) {
  const uint32_t wv[4] = {raw.x, raw.y, raw.z, raw.w};
  uint32_t o[8];
  const int k = (int)e8m0 - 127;
  if (kKnownFast || dequant_fast_ok(e8m0)) {
    const uint32_t h = (uint32_t)(k + 15) << 10;
    const uint32_t sc2 = h | (h << 16);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      o[2 * i] = hmul2(e4m3x2_to_f16x2(wv[i] & 0xffffu), sc2);  // elements 4i, 4i+1
      o[2 * i + 1] = hmul2(e4m3x2_to_f16x2(wv[i] >> 16), sc2);  // elements 4i+2, 4i+3
    }
  } else {
    // UE8M0 scale 2^(byte-127), built exactly (byte 0 -> 2^-127, a float subnormal).
    const float scale = e8m0 ? bits_f32(e8m0 << 23) : bits_f32(0x00400000u);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 a = e4m3x2_to_f32x2(wv[i] & 0xffffu);
      const float2 b = e4m3x2_to_f32x2(wv[i] >> 16);
      o[2 * i] = pack_f16x2(a.x * scale, a.y * scale);
      o[2 * i + 1] = pack_f16x2(b.x * scale, b.y * scale);
    }
  }
  first = make_u4(o[0], o[1], o[2], o[3]);
  second = make_u4(o[4], o[5], o[6], o[7]);
}

// 16 e2m1 (8 bytes, dim 2i in the low nibble of byte i) * e4m3 scale -> 16 f16 in two 16-byte chunks (exact:
// the products lie in [2^-10, 2688] with at most 6 significant bits). An e2m1 code (s, e1 e0 m) placed as the
// e4m3 byte (s << 7) | (e1 e0 m) << 2 is the code's value * 2^-6, the subnormal code 0.5 included (e4m3's
// subnormal 2^-7), so one e4m3x2 -> f16x2 conversion and one multiply by scale * 2^6 (<= 28672) make each pair.
// A NaN scale (0x7f, 0xff) makes the tile NaN, as dsv41_jax.kv_cache dequantizes it.
DEVFN void dequant_nvfp4_16(const uint2& raw, uint32_t scale_byte, uint4& first, uint4& second) {
  const uint32_t s64 = hmul2(e4m3x2_to_f16x2(scale_byte * 0x0101u), 0x54005400u);  // f16x2 (scale * 64)
  const uint32_t wv[2] = {raw.x, raw.y};
  uint32_t o[8];
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const uint32_t w = wv[j];
    const uint32_t lo = ((w & 0x08080808u) << 4) | ((w & 0x07070707u) << 2);  // e4m3 of dims 2i (low nibbles)
    const uint32_t hi = (w & 0x80808080u) | ((w & 0x70707070u) >> 2);         // dims 2i + 1
    const uint32_t a = prmt(lo, hi, 0x5140u), b = prmt(lo, hi, 0x7362u);      // dims in order, 4 per word
    o[4 * j] = hmul2(e4m3x2_to_f16x2(a & 0xffffu), s64);
    o[4 * j + 1] = hmul2(e4m3x2_to_f16x2(a >> 16), s64);
    o[4 * j + 2] = hmul2(e4m3x2_to_f16x2(b & 0xffffu), s64);
    o[4 * j + 3] = hmul2(e4m3x2_to_f16x2(b >> 16), s64);
  }
  first = make_u4(o[0], o[1], o[2], o[3]);
  second = make_u4(o[4], o[5], o[6], o[7]);
}

// The two token pools a producer reads (decode: main and extra cache; prefill: kv twice), as the
// addresses of kernel parameters. A tile names its pool by a flag and every field is chosen field
// by field (`field`): a pool pointer chosen at run time and carried across the loop lost its
// parameter-space provenance and turned each field read into a dependent generic load (seen in
// Nsight Compute as long-scoreboard stalls ahead of every index load).
// kFam: the format family the kernel reads (params.h).
template <int kFam = kFamV4>
struct Pools {
  static_assert(kFam == kFamV4 || kFam == kFamV41, "a format family");
  static constexpr int family = kFam;
  const Pool* main;
  const Pool* extra;
};
#define DSV41_POOL(ps, t, f) ((t).extra ? (ps).extra->f : (ps).main->f)

// A tile to gather: positions tok0..tok0+63 of indices row `row` of pool `extra` ? extra : main
// (ok = false: none).
struct TileSrc {
  int64_t row;
  int len, tok0;
  bool ok, extra;
};
// Lane layout of the producers: a warp's share of a tile is NB batches of 8 tokens (NB = 1 in a
// pair, 2 for one CTA); in every batch lane l works on token j = l / 4 (row sh.base + 8b + j of
// the tile) with its quarter q = l % 4 of that token's bytes, so each lane converts the same amount
// of data with the same instructions (no divergence between fp8 and RoPE lanes), needs only its own
// token's address (no shuffles) and stores at offsets known up to a per-lane base.
//   fp8_ds_mla: 16-byte chunks c = q + 4i (i = 0..6) of the 448 e4m3 bytes (dims 16c..16c+15, scale
//   byte i), and bytes 32q..32q+31 of the 128-byte bf16 RoPE; mxfp8_ds_mla: chunks c = q + 4i (i = 0..7) of
//   the 512 e4m3 bytes (scale byte c / 2 = 2i + q / 2) and all 16 scale bytes; nvfp4_ds_mla: bytes
//   32i + 8q..+7 (i = 0..7: dims 64i + 16q..+15, scale byte 4i + q) and all 32 scale bytes; bf16: chunks 8(i / 2) + 4((i % 2) ^
//   (j % 2)) + q (i = 0..15) of the 1024-byte row (odd tokens take their two 4-chunk halves in the
//   other order, so the 8 lanes of a store phase hit 8 distinct bank groups).
template <int NB>
struct TileAddr {
  int64_t doff[NB], soff[NB];  // byte offsets of this lane's token of batch b (0 when invalid)
  uint32_t vmask;              // bit 8b + j: token j of batch b is valid
};
template <int NB>
struct TileIdx {
  int32_t v[NB];
};

// Index of the token at position tok0 + off of tile t (-1 past the length or for no tile).
template <int kFam>
DEVFN int32_t token_index(const Pools<kFam>& ps, const TileSrc& t, int off) {
  const int pos = t.tok0 + off;
  return (t.ok && pos < t.len) ? ldg_nc_s32(DSV41_POOL(ps, t, indices) + t.row * (int64_t)DSV41_POOL(ps, t, topk) + pos)
                               : -1;
}

// Producers run a 3-stage look-ahead per tile tc: the indices of tile tc+2 are loaded (no use
// yet), the addresses of tile tc+1 are computed from the indices loaded one tile earlier and its
// rows are prefetched into L2, then tile tc is gathered (its rows prefetched one tile earlier).
// So the index load and the HBM latency of a tile overlap the previous tile's gather.
template <int NB, int kFam>
DEVFN TileIdx<NB> tile_index(const Pools<kFam>& ps, const TileSrc& t, const Share& sh, int lane) {
  TileIdx<NB> r;
#pragma unroll
  for (int b = 0; b < NB; ++b) r.v[b] = token_index(ps, t, sh.base + 8 * b + (lane >> 2));
  return r;
}

// The fields of a tile's pool that place its tokens (read once per tile).
struct PoolGeom {
  int32_t dbytes, sbytes;  // a quantized format's data and scale bytes per token (0: bf16 rows)
  int64_t cap, pb;
  int32_t bs;
};
template <int kFam>
DEVFN PoolGeom pool_geom(const Pools<kFam>& ps, const TileSrc& t) {
  PoolGeom g;
  const int32_t fmt = DSV41_POOL(ps, t, fmt);
  g.dbytes = token_data_bytes(fmt);
  g.sbytes = token_scale_bytes(fmt);
  g.cap = DSV41_POOL(ps, t, capacity);
  g.bs = DSV41_POOL(ps, t, block_size);
  g.pb = DSV41_POOL(ps, t, page_bytes);
  return g;
}
// Byte offsets of token `i` (its validity `valid`: position < length, i in [0, capacity)) in its pool:
// its data (doff) and, quantized formats, its scale bytes (soff); untouched when masked.
DEVFN void token_offsets(const PoolGeom& g, bool valid, int32_t i, int64_t& doff, int64_t& soff) {
  if (valid) {
    if (g.dbytes) {  // 0 <= i < capacity < 2^31: a 32-bit division
      const uint32_t blk = (uint32_t)i / (uint32_t)g.bs;
      const uint32_t off = (uint32_t)i - blk * (uint32_t)g.bs;
      doff = (int64_t)blk * g.pb + (int64_t)off * g.dbytes;
      soff = (int64_t)blk * g.pb + (int64_t)g.bs * g.dbytes + (int64_t)off * g.sbytes;
    } else {
      doff = (int64_t)i * (kHeadDim * 2);
    }
  }
}

// Warp-uniform in t.ok (ballot inside).
template <int NB, int kFam>
DEVFN TileAddr<NB> tile_addr(const Pools<kFam>& ps, const TileSrc& t, const TileIdx<NB>& idx, const Share& sh, int lane) {
  TileAddr<NB> a;
  a.vmask = 0u;
#pragma unroll
  for (int b = 0; b < NB; ++b) a.doff[b] = a.soff[b] = 0;
  if (!t.ok) return a;
  const PoolGeom g = pool_geom(ps, t);
#pragma unroll
  for (int b = 0; b < NB; ++b) {
    const int pos = t.tok0 + sh.base + 8 * b + (lane >> 2);
    const int32_t i = idx.v[b];
    const bool valid = pos < t.len && i >= 0 && (int64_t)i < g.cap;
    token_offsets(g, valid, i, a.doff[b], a.soff[b]);
    // bit 4j (+ q) of the ballot: token j (the 4 lanes of a token agree); fold bit 4j to bit j
    uint32_t m = ballot(valid) & 0x11111111u;
    m = (m | (m >> 3)) & 0x03030303u;
    m = (m | (m >> 6)) & 0x000f000fu;
    m = (m | (m >> 12)) & 0xffu;
    a.vmask |= m << (8 * b);
  }
  return a;
}

// Address ring (a pair's split decode): warpgroup 1, idle while warpgroup 0 computes S and the
// softmax, computes the gather addresses (index loads, the page division) for the producers, which
// otherwise set the decode's tile period. A ring of
// kAddrSlots slots in the (then unused) k-split exchange region, one per tile: the byte offsets of the
// CTA's 32 tokens (data, scales) and their validity bits. Warpgroup 1's warp 4 writes the slot of tile
// tc + 3 while it consumes tile tc, before its release of tc; the producers read that slot in their
// iteration tc + 2, after their EMPTY wait for tile tc, which that release orders (bar.arrive /
// bar.sync); tiles 0..2 come from a prologue, published through kBarAddr. Reuse needs no barrier: the
// slot of tile tc + 3 held tile tc - 1, read by the producers in their iteration tc - 2, before FULL of
// tile tc, which warpgroup 1 observed (through warpgroup 0) before consuming tile tc.
constexpr int kAddrSlots = 4, kAddrSlotBytes = 32 * 16 + 16, kAddrLead = 3;
static_assert(kAddrSlots * kAddrSlotBytes <= kSmemBytes - kSmemXS, "address ring beyond the k-split region");
DEVFN char* addr_slot(char* smem, int tc) { return smem + kSmemXS + (tc % kAddrSlots) * kAddrSlotBytes; }

// Warp 4: lane l gathers token 32 rank + l of tile t; its index (-1 past the length).
template <int kFam>
DEVFN int32_t half_index(const Pools<kFam>& ps, const TileSrc& t, int rank, int lane) {
  return token_index(ps, t, 32 * rank + lane);
}
template <int kFam>
DEVFN void publish_half_addr(char* slot, const Pools<kFam>& ps, const TileSrc& t, int32_t i, int rank, int lane) {
  int64_t doff = 0, soff = 0;
  bool valid = false;
  if (t.ok) {
    const PoolGeom g = pool_geom(ps, t);
    valid = t.tok0 + 32 * rank + lane < t.len && i >= 0 && (int64_t)i < g.cap;
    token_offsets(g, valid, i, doff, soff);
  }
  int64_t* d = reinterpret_cast<int64_t*>(slot);
  d[lane] = doff;
  d[32 + lane] = soff;
  const uint32_t m = ballot(valid);
  if (lane == 0) *reinterpret_cast<uint32_t*>(slot + 512) = m;
}
// Producer warp pw, lane l: token l / 4 of its 8 (NB = 1).
DEVFN TileAddr<1> read_half_addr(const char* slot, int pw, int lane) {
  const int64_t* d = reinterpret_cast<const int64_t*>(slot);
  TileAddr<1> a;
  a.doff[0] = d[8 * pw + (lane >> 2)];
  a.soff[0] = d[32 + 8 * pw + (lane >> 2)];
  a.vmask = (*reinterpret_cast<const uint32_t*>(slot + 512) >> (8 * pw)) & 0xffu;
  return a;
}

// L2 prefetch of this lane's token's lines (the 4 lanes of a token split them).
template <int NB, int kFam>
DEVFN void tile_prefetch(const Pools<kFam>& ps, const TileSrc& t, const TileAddr<NB>& a, int lane) {
  if (!t.ok) return;
  const uint8_t* base = DSV41_POOL(ps, t, base);
  const int32_t fmt = DSV41_POOL(ps, t, fmt);
  const int q = lane & 3;
#pragma unroll
  for (int b = 0; b < NB; ++b) {
    if (!((a.vmask >> (8 * b + (lane >> 2))) & 1u)) continue;
    const uint8_t* d = base + a.doff[b];
    if (kFam == kFamV4 && fmt == kFmtFp8DsMla) {  // 576 data bytes (5-6 lines) + 8 scale bytes
      prefetch_l2(d + 128 * q);
      if (q == 0) prefetch_l2(d + 512);
      if (q == 1) prefetch_l2(d + kFp8TokenData - 1);
      if (q == 2) prefetch_l2(base + a.soff[b]);
    } else if constexpr (kFam == kFamV41) {
      if (fmt == kFmtMxfp8DsMla) {  // 512 data bytes (4 lines) + 16 scale bytes
        prefetch_l2(d + 128 * q);
        if (q == 0) prefetch_l2(base + a.soff[b]);
      } else {  // nvfp4_ds_mla: 256 data bytes (2 lines) + 32 scale bytes
        if (q < 2) prefetch_l2(d + 128 * q);
        if (q == 2) prefetch_l2(base + a.soff[b]);
      }
    } else {  // 1024 bytes (8-9 lines)
      prefetch_l2(d + 128 * q);
      prefetch_l2(d + 512 + 128 * q);
      if (q == 3) prefetch_l2(d + kHeadDim * 2 - 1);
    }
  }
}

// One batch (8 tokens) of a warp's share in registers: loads issued, not yet used. fp8_ds_mla:
// v[0..6] the e4m3 chunks, v[7], v[8] the RoPE bytes, sc the 8 scale bytes (v[9..] unused); mxfp8_ds_mla:
// v[0..7] the e4m3 chunks, v[8] the 16 scale bytes; nvfp4_ds_mla: v[0..3] the eight 8-byte pieces (piece i in
// v[i / 2], .x.y or .z.w), v[4], v[5] the 32 scale bytes; bf16:
// v[0..15] (NV = 16) or, in a pair (NV = 9: the producers' registers are the decode's scarcest
// resource), one half of the 16 chunks at a time in v[0..7] (sc unused). Invalid tokens are zero
// (with scale bytes 127: the fast dequantisation path).
template <int NV>
struct BatchT {
  static_assert(NV == 16 || NV == 9, "a batch holds all bf16 chunks or one quantized token quarter");
  static constexpr int kBf16Chunks = NV == 16 ? 16 : 8;  // bf16 chunks per load (one half when 8)
  uint4 v[NV];
  uint2 sc;
};

DEVFN int bf16_chunk(int i, int lane) { return 8 * (i >> 1) + 4 * ((i & 1) ^ ((lane >> 2) & 1)) + (lane & 3); }

// half: which 8 of the 16 bf16 chunks (batches of 8-chunk capacity only).
template <int NB, int NV, int kFam>
DEVFN void load_batch(const Pools<kFam>& ps, const TileSrc& t, const TileAddr<NB>& a, int b, int lane, BatchT<NV>& bt,
                      int half = 0) {
#pragma unroll
  for (int i = 0; i < NV; ++i) bt.v[i] = make_u4(0, 0, 0, 0);
  bt.sc.x = bt.sc.y = 0x7f7f7f7fu;
  if (!((a.vmask >> (8 * b + (lane >> 2))) & 1u)) {
    if constexpr (kFam == kFamV41)
      if (DSV41_POOL(ps, t, fmt) == kFmtMxfp8DsMla) bt.v[8] = make_u4(0x7f7f7f7fu, 0x7f7f7f7fu, 0x7f7f7f7fu, 0x7f7f7f7fu);
    return;
  }
  const uint8_t* base = DSV41_POOL(ps, t, base);
  const uint8_t* d = base + a.doff[b];
  const int q = lane & 3;
  const int32_t fmt = DSV41_POOL(ps, t, fmt);  // warp-uniform
  if (kFam == kFamV4 && fmt == kFmtFp8DsMla) {
#pragma unroll
    for (int i = 0; i < 7; ++i) bt.v[i] = ldg_nc_v4(d + 16 * (q + 4 * i));
    bt.v[7] = ldg_nc_v4(d + 448 + 32 * q);
    bt.v[8] = ldg_nc_v4(d + 448 + 32 * q + 16);
    bt.sc = ldg_nc_v2(base + a.soff[b]);
  } else if constexpr (kFam == kFamV41) {
    if (fmt == kFmtMxfp8DsMla) {
#pragma unroll
      for (int i = 0; i < 8; ++i) bt.v[i] = ldg_nc_v4(d + 16 * (q + 4 * i));
      bt.v[8] = ldg_nc_v4(base + a.soff[b]);
    } else {  // nvfp4_ds_mla
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const uint2 e = ldg_nc_v2(d + 64 * i + 8 * q), o = ldg_nc_v2(d + 64 * i + 32 + 8 * q);
        bt.v[i] = make_u4(e.x, e.y, o.x, o.y);
      }
      bt.v[4] = ldg_nc_v4(base + a.soff[b]);
      bt.v[5] = ldg_nc_v4(base + a.soff[b] + 16);
    }
  } else {
#pragma unroll
    for (int i = 0; i < BatchT<NV>::kBf16Chunks; ++i) bt.v[i] = ldg_nc_v4(d + 16 * bf16_chunk(i + 8 * half, lane));
  }
}

// A 16-byte f16 chunk at byte offset o of K buffer `kbuf`.
DEVFN void store_chunk(char* kbuf, int o, const uint4& v) { *reinterpret_cast<uint4*>(kbuf + o) = v; }

DEVFN uint4 bf16x8_to_f16x8(const uint4& v) {
  return make_u4(bf16x2_to_f16x2(v.x), bf16x2_to_f16x2(v.y), bf16x2_to_f16x2(v.z), bf16x2_to_f16x2(v.w));
}

// Validity word of tokens 8i..8i+7 of buffer `buf` (bits 0..7) into this CTA (and, when `remote`,
// the peer's, by st.async completing on `rbar`).
DEVFN void store_valid_word(char* smem, bool remote, uint32_t peer, uint32_t rbar, int buf, int i, uint32_t bits) {
  const int off = kSmemValid + 4 * (8 * buf + i);
  *reinterpret_cast<uint32_t*>(smem + off) = bits & 0xffu;
  if (remote) st_async_u32(peer + (uint32_t)off, bits & 0xffu, rbar);
}

DEVFN uint32_t u4_word(const uint4& v, int k) { return k == 0 ? v.x : k == 1 ? v.y : k == 2 ? v.z : v.w; }
// The scale byte of this lane's (quarter q's) column block i: fp8_ds_mla byte i of sc; mxfp8_ds_mla byte
// 2i + q / 2 of v[8]; nvfp4_ds_mla byte 4i + q of v[4], v[5].
template <int kFmt, int NV>
DEVFN uint32_t scale_byte(const BatchT<NV>& bt, int i, int q) {
  if constexpr (kFmt == kFmtMxfp8DsMla) return (u4_word(bt.v[8], i >> 1) >> (16 * (i & 1) + 8 * (q >> 1))) & 0xffu;
  if constexpr (kFmt == kFmtNvfp4DsMla) return (u4_word(bt.v[4 + (i >> 2)], i & 3) >> (8 * q)) & 0xffu;
  return ((i < 4 ? bt.sc.x : bt.sc.y) >> (8 * (i & 3))) & 0xffu;
}
// Whether every scale of this lane's batch takes dequant16's fast path (nvfp4: no slow path).
template <int kFmt, int NV>
DEVFN bool scales_fast(const BatchT<NV>& bt, int q) {
  bool fast = true;
  if constexpr (kFmt != kFmtNvfp4DsMla) {
#pragma unroll
    for (int i = 0; i < (kFmt == kFmtFp8DsMla ? 7 : 8); ++i) fast &= dequant_fast_ok(scale_byte<kFmt>(bt, i, q));
  }
  return fast;
}

// The 16 f16 chunks of this lane's quarter q of a quantized token (row offsets e0 / e1 of its even / odd
// chunks in column block 0), column block i from the batch's piece i: fp8_ds_mla e4m3 chunk i < 7 and the
// RoPE as block 7; mxfp8_ds_mla e4m3 chunk i; nvfp4_ds_mla e2m1 piece i.
// hook(i, stored): called for block i once converted (stored = false) and once stored (true): a pair's
// progressive copies to the peer.
template <int kFmt, bool kFast, int NV, class Hook>
DEVFN void store_quant_rows(char* kbuf, int e0, int e1, const BatchT<NV>& bt, int q, const Hook& hook) {
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    uint4 first, second;
    if constexpr (kFmt == kFmtNvfp4DsMla) {
      const uint4& v = bt.v[i >> 1];
      dequant_nvfp4_16((i & 1) ? make_u2(v.z, v.w) : make_u2(v.x, v.y), scale_byte<kFmt>(bt, i, q), first,
                       second);
    } else if (kFmt == kFmtMxfp8DsMla || i < 7) {
      dequant16<kFast>(bt.v[i], scale_byte<kFmt>(bt, i, q), first, second);
    } else {
      first = bf16x8_to_f16x8(bt.v[7]);
      second = bf16x8_to_f16x8(bt.v[8]);
    }
    hook(i, false);
    store_chunk(kbuf, i * 8192 + e0, first);
    store_chunk(kbuf, i * 8192 + e1, second);
    hook(i, true);
  }
}
// Progressive copies: a pair's producer warp sends its quantized rows to the peer one column block (1 KB) at a time,
// as soon as the block is stored, so the copies (rate-bound, ~20 B per cycle and SM) overlap the dequantisation
// of the later blocks instead of following all of it (two, four or all eight blocks at a time are slower).
// Lagged: block i - 1's fence and copy come after block i is converted and before it is stored, so the
// fence (MEMBAR.ALL.CTA in SASS: it waits for all of the thread's earlier memory operations) does not wait
// for the stores it does not need to order.
struct NoHook {
  DEVFN void operator()(int, bool) const {}
};

// A quantized batch: dequantised and stored row by row (and, in a pair, sent to the peer progressively).
template <int kFmt, class C, int NV>
DEVFN void store_quant_batch(char* kbuf, uint32_t rbuf, uint32_t rbar, uint32_t o, int row, int q, int lane,
                             const BatchT<NV>& bt) {
  const int r7 = row & 7;
  const int e0 = row * 128 + (((2 * q) ^ r7) << 4), e1 = row * 128 + (((2 * q + 1) ^ r7) << 4);
  // One warp-uniform test of all scale bytes instead of a (possibly divergent) branch per chunk.
  const bool fast = kFmt == kFmtNvfp4DsMla || ballot(scales_fast<kFmt>(bt, q)) == 0xffffffffu;
  if constexpr (C::ncta == 2) {
    const auto hook = [&](int i, bool stored) {
      const int last = stored ? (i == 7 ? 7 : -1) : i - 1;  // the block this call sends, or none
      if (last < 0) return;
      fence_proxy_async_always();  // this lane's stores -> the async proxy that reads the copy's source
      syncwarp();
      if (lane == 0) bulk_copy_to_peer(rbuf + o + 8192u * last, smem_addr(kbuf) + o + 8192u * last, 1024u, rbar);
    };
    if (fast) {
      store_quant_rows<kFmt, true>(kbuf, e0, e1, bt, q, hook);
    } else {
      store_quant_rows<kFmt, false>(kbuf, e0, e1, bt, q, hook);
    }
  } else {
    (void)rbuf; (void)rbar; (void)o; (void)lane;
    if (fast) {
      store_quant_rows<kFmt, true>(kbuf, e0, e1, bt, q, NoHook{});
    } else {
      store_quant_rows<kFmt, false>(kbuf, e0, e1, bt, q, NoHook{});
    }
  }
}

// Dequantise / convert loaded batch b (rows sh.base + 8b ..) and store it with its mask word; bf16
// batches of one half (NV = 9): `half` 0 stores the first 8 chunks and returns (`last` false), the
// caller loads and stores half 1; a pair sends the rows to its peer after the last part.
// f16 chunk k of row r sits at (k / 8) * 8192 + r * 128 + ((k % 8) ^ (r % 8)) * 16 (params.h):
// fp8 chunk c = q + 4i becomes f16 chunks 2c, 2c + 1 = 8i + 2q (+1), the RoPE f16 chunks 56 + 2q (+1); the
// V4.1 formats' piece i of lane q (dims 64i + 16q..+15) the same two chunks.
template <int kFam, class C, int NV>
DEVFN void store_batch(char* smem, const C& crew, int buf, int32_t fmt, uint32_t vmask, const Share& sh, int b,
                       int lane, const BatchT<NV>& bt, int half = 0, bool last = true) {
  // raw: rows stored as loaded (f16 rows: those reach prefill_cta only in builds without wgmma,
  // seesaw.cuh takes them elsewhere; so the decode's producers carry no such test)
  const bool raw = !kWgmma && fmt == kFmtF16;
  char* kbuf = smem + kSmemK + buf * kTileBytes;
  const uint32_t peer = crew.peer;
  const uint32_t rbuf = peer + (uint32_t)(kSmemK + buf * kTileBytes);
  const uint32_t rbar = peer + (uint32_t)bar_pfull(buf);
  if (lane == 0 && last) store_valid_word(smem, C::ncta == 2, peer, rbar, buf, (sh.base + 8 * b) >> 3, vmask >> (8 * b));
  const int row = sh.base + 8 * b + (lane >> 2), q = lane & 3, r7 = row & 7;
  const uint32_t o = (uint32_t)(128 * (sh.base + 8 * b));
  if (kFam == kFamV41 || fmt == kFmtFp8DsMla) {  // warp-uniform; quantized batches are whole (`last`)
    if constexpr (kFam == kFamV4) {
      store_quant_batch<kFmtFp8DsMla, C>(kbuf, rbuf, rbar, o, row, q, lane, bt);
    } else if (fmt == kFmtMxfp8DsMla) {
      store_quant_batch<kFmtMxfp8DsMla, C>(kbuf, rbuf, rbar, o, row, q, lane, bt);
    } else {
      store_quant_batch<kFmtNvfp4DsMla, C>(kbuf, rbuf, rbar, o, row, q, lane, bt);
    }
    return;
  } else {
#pragma unroll
    for (int i = 0; i < BatchT<NV>::kBf16Chunks; ++i) {
      const int k = bf16_chunk(i + 8 * half, lane);
      store_chunk(kbuf, (k >> 3) * 8192 + row * 128 + (((k & 7) ^ r7) << 4),
                  raw ? bt.v[i] : bf16x8_to_f16x8(bt.v[i]));
    }
  }
  if (!last) return;
  if constexpr (C::ncta == 2) {
    // rows sh.base + 8b .. + 7: 1 KB at j * 8192 + 128 * row0 of column block j, in both CTAs
    fence_proxy_async_always();  // this lane's stores -> the async proxy that reads the copy's source
    syncwarp();
    if (lane == 0) {  // (lanes 0..7 issuing one copy each are no faster)
#pragma unroll
      for (int j = 0; j < 8; ++j)
        bulk_copy_to_peer(rbuf + o + 8192u * j, smem_addr(kbuf) + o + 8192u * j, 1024u, rbar);
    }
  }
}

// Producer warp pw fills rows sh.base.. of K buffer `buf` (its own and, in a pair, its peer's) with
// its NB batches of tile `t` (addresses `a` from tile_addr) and their bits of the validity mask.
// The first batch (`first`) was loaded by the caller before it waited for the buffer, so its
// latency overlaps that wait. (Slower alternatives, docs/cuda_kernels.md: one lane per 16 dims of a
// token with fp8 and RoPE lanes diverging, one batch of 16 fp8 tokens, a continuous 8-deep token
// ring across tiles.)
template <int NB, class C, int NV, int kFam>
DEVFN void fill_tile(char* smem, const C& crew, int buf, const Pools<kFam>& ps, const TileSrc& t, const TileAddr<NB>& a,
                     const Share& sh, int lane, BatchT<NV>& first) {
  static_assert(NV == 16 || NB == 1, "half-row batches serve one batch per warp and tile (pairs)");
  const int32_t fmt = DSV41_POOL(ps, t, fmt);
  if (NV < 16 && kFam == kFamV4 && fmt != kFmtFp8DsMla) {  // 2-byte rows in halves (warp-uniform)
    store_batch<kFam>(smem, crew, buf, fmt, a.vmask, sh, 0, lane, first, 0, false);
    load_batch(ps, t, a, 0, lane, first, 1);
    store_batch<kFam>(smem, crew, buf, fmt, a.vmask, sh, 0, lane, first, 1, true);
  } else {
    store_batch<kFam>(smem, crew, buf, fmt, a.vmask, sh, 0, lane, first, 0, true);
  }
#pragma unroll 1
  for (int b = 1; b < NB; ++b) {
    BatchT<NV> bt;
    load_batch(ps, t, a, b, lane, bt);
    store_batch<kFam>(smem, crew, buf, fmt, a.vmask, sh, b, lane, bt);
  }
  // bar.arrive FULL orders these local stores before the consumers' bar.sync returns (the PTX
  // ISA's producer/consumer example); wgmma reads them through the async proxy, hence the fence
  // (a pair's lanes fenced their rows before the bulk copies in store_batch).
  if constexpr (C::ncta == 1) fence_proxy_async();
}

// The producer loop over a tile sequence given by `next()` (returns the next TileSrc, ok = false
// past the end): look-ahead as described above, FULL / EMPTY hand-off (and, in a pair, PFULL /
// PEMPTY), final drain.
template <class C, int kFam, class Next>
DEVFN void produce_tiles(char* smem, const C& crew, const Pools<kFam>& ps, int pw, int lane, Next&& next) {
  const Share sh = producer_share(crew, pw);
  constexpr bool pair = C::ncta == 2;
  constexpr int NB = C::batches;  // 8-token batches per warp and tile
  constexpr bool gen = C::wg1_addr;
  TileSrc t0 = next();
  TileSrc t1 = next();
  TileIdx<NB> i1;
  TileAddr<NB> a0;
  if constexpr (gen) {
    bar_sync(kBarAddr, 256);  // warpgroup 1's prologue: tiles 0..kAddrLead - 1
    a0 = read_half_addr(addr_slot(smem, 0), pw, lane);
  } else {
    i1 = tile_index<NB>(ps, t1, sh, lane);
    a0 = tile_addr<NB>(ps, t0, tile_index<NB>(ps, t0, sh, lane), sh, lane);
  }
  // Pairs load the first batch of tile tc at the end of iteration tc - 1, as soon as the registers
  // of tile tc - 1's batch are free: its latency overlaps the PFULL wait, the next tile's index and
  // address work and the wait for the buffer. One CTA (two batches per warp, prefill's bf16 rows)
  // loads it just before the wait for the buffer: held across the iteration, the 16 bf16 chunks slow
  // prefill down (benchmarks/RESULTS.md, "cuda producer lanes"). A pair holds
  // half a bf16 row (BatchT<9>): the second half is loaded inside fill_tile, its latency exposed (the
  // fp8 rows, the decode's case, fit one batch).
  constexpr bool kEarly = pair;
  BatchT<pair ? 9 : 16> first;
  if (kEarly) load_batch(ps, t0, a0, 0, lane, first);
  int tc = 0;
  for (; t0.ok; ++tc) {
    TileSrc t2;
    TileIdx<NB> i2;
    TileAddr<NB> a1;
    if constexpr (gen) {
      t2 = next();
    } else {
      t2 = next();
      i2 = tile_index<NB>(ps, t2, sh, lane);  // consumed one tile later
      a1 = tile_addr<NB>(ps, t1, i1, sh, lane);
      tile_prefetch<NB>(ps, t1, a1, lane);
    }
    const int buf = tc & 1;
    if (!kEarly) load_batch(ps, t0, a0, 0, lane, first);
    if (tc >= 2) {  // tile tc - 2 released by this CTA's consumers (and the peer's)
      bar_sync(kBarEmpty0 + buf, kThreads);
      if (pair) mbar_wait(smem_addr(smem + bar_pempty(buf)), (uint32_t)((tc >> 1) - 1) & 1u);
    }
    // (gen: published before the consumers' release of tile tc - 2, or by the prologue; read again after
    // the fill, not held across it: the producers have no register to spare)
    if constexpr (gen) tile_prefetch<NB>(ps, t1, read_half_addr(addr_slot(smem, tc + 1), pw, lane), lane);
    fill_tile<NB>(smem, crew, buf, ps, t0, a0, sh, lane, first);
    if constexpr (gen) a1 = read_half_addr(addr_slot(smem, tc + 1), pw, lane);
    if (kEarly) load_batch(ps, t1, a1, 0, lane, first);  // the next tile's (nothing when !t1.ok)
    if constexpr (pair) {  // wait until the peer's half has landed in ours
      if (lane == 0) mbar_arrive_expect_tx(smem_addr(smem + bar_pfull(buf)), kPeerBytesPerWarp);
      mbar_wait(smem_addr(smem + bar_pfull(buf)), (uint32_t)(tc >> 1) & 1u);
      // The peer's rows are async-proxy writes made visible by the PFULL completion, and this warp's
      // own rows were fenced before its copies (store_batch), so no fence here.
      // An assumption shared with FlashMLA and CUTLASS's cluster pipelines, not spelled out by the PTX
      // ISA: the CTA-scope acquire of the PFULL wait observes the peer's writes (bulk copies and
      // st.async; complete_tx releases at cluster scope; primitives.cuh, mbarriers).
    }
    bar_arrive(kBarFull0 + buf, C::full_count);
    if constexpr (C::split) bar_arrive(kBarFullWg1_0 + buf, C::full_count);
    t0 = t1;
    a0 = a1;
    t1 = t2;
    if constexpr (!gen) i1 = i2;
  }
  // Drain: consume the consumers' EMPTY arrivals of the last two tiles so every named-barrier
  // phase completes before the CTA exits (the peer's PEMPTY arrivals need no drain).
  for (int i = tc - 2 < 0 ? 0 : tc - 2; i < tc; ++i) bar_sync(kBarEmpty0 + (i & 1), kThreads);
}

// The same loop one tile deeper, for one CTA whose producer warps gather one batch per tile (NB = 1: the
// narrow CTA): the indices of tile tc + 3 are loaded, the addresses of tile tc + 2 computed and its rows
// prefetched into L2, tile tc gathered, and tile tc + 1's batch loaded as soon as tile tc is stored. With
// one batch per warp the gather of a tile is one load latency, so the L2 prefetch must run a whole tile
// period ahead of the load it serves: a prefetch one tile ahead would precede its load by one fill only.
// EMPTY is the mbarrier pair of narrow_release (narrow.cuh): each warp waits for a buffer's release by itself,
// and mbarrier phases need no drain at the end.
template <class C, int kFam, class Next>
DEVFN void produce_tiles_deep(char* smem, const C& crew, const Pools<kFam>& ps, int pw, int lane, Next&& next) {
  static_assert(C::ncta == 1 && C::batches == 1 && !C::wg1_addr && !C::split, "one CTA, one batch per warp");
  const Share sh = producer_share(crew, pw);
  TileSrc t0 = next(), t1 = next(), t2 = next();
  TileIdx<1> i2 = tile_index<1>(ps, t2, sh, lane);
  TileAddr<1> a0 = tile_addr<1>(ps, t0, tile_index<1>(ps, t0, sh, lane), sh, lane);
  TileAddr<1> a1 = tile_addr<1>(ps, t1, tile_index<1>(ps, t1, sh, lane), sh, lane);
  tile_prefetch<1>(ps, t1, a1, lane);
  BatchT<16> first;
  load_batch(ps, t0, a0, 0, lane, first);
  int tc = 0;
  for (; t0.ok; ++tc) {
    const TileSrc t3 = next();
    const TileIdx<1> i3 = tile_index<1>(ps, t3, sh, lane);  // consumed one tile later
    const TileAddr<1> a2 = tile_addr<1>(ps, t2, i2, sh, lane);
    tile_prefetch<1>(ps, t2, a2, lane);
    const int buf = tc & 1;
    if (tc >= 2) mbar_wait(smem_addr(smem + bar_pempty(buf)), (uint32_t)((tc >> 1) - 1) & 1u);  // tile tc - 2 released
    fill_tile<1>(smem, crew, buf, ps, t0, a0, sh, lane, first);
    load_batch(ps, t1, a1, 0, lane, first);  // (nothing when !t1.ok)
    bar_arrive(kBarFull0 + buf, C::full_count);
    t0 = t1;
    a0 = a1;
    t1 = t2;
    a1 = a2;
    t2 = t3;
    i2 = i3;
  }
}

// Consumers, before reading tile tc / after their last read of it.
template <class C>
DEVFN void await_tile(const C&, int tc, int w) {
  bar_sync((C::split && w >= 4 ? kBarFullWg1_0 : kBarFull0) + (tc & 1), C::full_count);
}
template <class C>
DEVFN void release_tile(const C& crew, int tc, int lane) {
  bar_arrive(kBarEmpty0 + (tc & 1), kThreads);
  if constexpr (C::ncta == 2) peer_arrive(crew, bar_pempty(tc & 1), lane);
}

}  // namespace dsv41
