// AVX-512 GEMM micro-kernels (M > 1: prefill, batches) for a block of NBLK512 weight rows against
// all M input rows, compiled where the build has AVX-512 F/BW/VL (float) and AVX-512 VNNI (int8,
// int4, W8A8). Each keeps the contract of gptc_tiles.h output by output, so its values are bitwise
// those of the AVX2 tiles and the GEMV (tests/test_kernel_tiles.py runs both builds):
//  - int (int_block512): the block's weights are packed once per block, 4 codes of one row per 32-bit lane, 16
//    rows a register (an output per lane), so `vpdpbusd` of an input row's 4 codes (broadcast)
//    accumulates 16 outputs' dots at once with no horizontal sum. vpdpbusd multiplies unsigned by
//    signed bytes: the inputs are packed as x + 128 (0..255) and each accumulator starts at the
//    block's -128 * sum(w), so it ends at the exact int32 dot of the block. Then one convert and
//    one fma per block, float(dot) times the scale product sx * sw, into the output's float sum,
//    in block order; + bias at the end. For few input rows the lane kernels (int_block_lanes,
//    below) read the weight rows as stored instead, with the same per-block arithmetic.
//  - float: a register holds the 8 lanes of two input rows (packed pairs of rows, 8 k positions
//    each) against one weight row's 8 k positions broadcast to both halves, so every output keeps
//    the AVX2 tile's 8-lane fma order over k; then the same hsum, the scalar k tail, + bias.
// Part of the one translation unit gptc_ops.cc (included there in order; formats and contract: its head comment).
#ifndef GPTC_KERNELS_GPTC_GEMM512_H_
#define GPTC_KERNELS_GPTC_GEMM512_H_

#include <type_traits>

#include "gptc_tiles.h"

namespace {

#if defined(GPTC_F512)
// Weight rows of one block (NBLK, gptc_tiles.h): three registers of 16 outputs (int), twelve
// passes of 4 rows (float).
constexpr int NBLK512 = NBLK;
static_assert(NBLK512 == 48, "three registers of 16 outputs");

// ------------------------------------------------------------------ float
// xp: the M input rows in pairs, (M+1)/2 x (K/8) x 16 floats: chunk c of pair p holds row 2p's
// k = 8c..8c+7 then row 2p+1's (zeros for the missing row of an odd M). Only the K/8 full chunks:
// the k tail is read from x itself.
inline void pack_pairs_f(const float* x, int64_t M, int64_t K, float* xp) {
  const int64_t kc = K / 8;
  for (int64_t p = 0; p < (M + 1) / 2; ++p) {
    const float* r0 = x + 2 * p * K;
    const float* r1 = 2 * p + 1 < M ? r0 + K : nullptr;
    float* d = xp + p * kc * 16;
    for (int64_t c = 0; c < kc; ++c) {
      _mm256_storeu_ps(d + 16 * c, _mm256_loadu_ps(r0 + 8 * c));
      _mm256_storeu_ps(d + 16 * c + 8, r1 ? _mm256_loadu_ps(r1 + 8 * c) : _mm256_setzero_ps());
    }
  }
}

// PR pairs of input rows (2 PR rows: m0..) x NR weight rows (w, K apart), the 8-float k steps
// [c0, c1) of kc = K / 8: the accumulators start at zero (c0 == 0) or at the values slot holds
// from the steps before (pair p, weight row n at slot + (p * NBLK512 + n) * 16: an exact store
// and load), and after the last step (c1 == kc) y[m][n] (ldy apart) gets hsum, the k tail and
// + bias; rows past M skipped.
// pf: pf_lines cache lines from there are prefetched, spread over the k steps (see int_tile_lanes).
template <int PR, int NR>
inline void float_tile512(const float* xp, const float* x, int64_t m0, int64_t M, int64_t K, int64_t c0, int64_t c1,
                          const float* w, float* slot, float* y, int64_t ldy, const float* bias,
                          const char* pf = nullptr, int64_t pf_lines = 0) {
  const int64_t kc = K / 8;
  __m512 acc[PR][NR];
  GPTC_UNROLL for (int p = 0; p < PR; ++p)
    GPTC_UNROLL for (int n = 0; n < NR; ++n)
      acc[p][n] = c0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(slot + (p * NBLK512 + n) * 16);
  const float* xb = xp + (m0 / 2) * kc * 16;
  for (int64_t c = c0; c < c1; ++c) {
    if (pf != nullptr)
      for (int64_t l = (c - c0) * pf_lines / (c1 - c0); l < (c - c0 + 1) * pf_lines / (c1 - c0); ++l)
        _mm_prefetch(pf + 64 * l, _MM_HINT_T1);
    __m512 wv[NR];
    GPTC_UNROLL for (int n = 0; n < NR; ++n) {
      wv[n] = _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(w + n * K + 8 * c))));
      GPTC_PIN(wv[n]);
    }
    GPTC_UNROLL for (int p = 0; p < PR; ++p) {
      __m512 xv = _mm512_loadu_ps(xb + (p * kc + c) * 16);
      GPTC_PIN(xv);
      GPTC_UNROLL for (int n = 0; n < NR; ++n) acc[p][n] = _mm512_fmadd_ps(xv, wv[n], acc[p][n]);
    }
  }
  if (c1 < kc) {
    GPTC_UNROLL for (int p = 0; p < PR; ++p)
      GPTC_UNROLL for (int n = 0; n < NR; ++n) _mm512_storeu_ps(slot + (p * NBLK512 + n) * 16, acc[p][n]);
    return;
  }
  const int64_t k = kc * 8;
  GPTC_UNROLL for (int p = 0; p < PR; ++p)
    GPTC_UNROLL for (int h = 0; h < 2; ++h) {
      const int64_t m = m0 + 2 * p + h;
      if (m >= M) continue;
      GPTC_UNROLL for (int n = 0; n < NR; ++n) {
        const __m256 a = h ? _mm512_extractf32x8_ps(acc[p][n], 1) : _mm512_castps512_ps256(acc[p][n]);
        float s = hsum(a);
        for (int64_t kk = k; kk < K; ++kk) s = std::fma(x[m * K + kk], w[n * K + kk], s);
        y[m * ldy + n] = s + (bias ? bias[n] : 0.f);
      }
    }
}

// Float weights (nr <= NBLK512 rows, K apart) against all M input rows x (M, K) into y (M, ldy).
// xp: x packed by pack_pairs_f (once per Linear, not per block: repacking per block moves about
// as many bytes as the tiles read); slots: (M + 1) / 2 * NBLK512 * 16 floats of scratch.
inline void float_block512(const float* x, const float* xp, int64_t M, int64_t K, const float* w, int nr, float* y,
                           int64_t ldy, const float* bias, float* slots) {
  // 12 rows (6 pairs) x 4 weight rows: 24 accumulators, 10 loads per 24 fmas. The k steps in
  // chunks of 24 KB of a tile's inputs, so a tile's chunk stays in L1 while the block's weight
  // rows pass over it (4 broadcasts of 32 bytes per 24 fmas, from L2); the accumulators wait in
  // slots between chunks.
  constexpr int NR = 4;
  const int64_t kc = K / 8, chunk = std::max<int64_t>(1, (24 << 10) / (12 * 32));
  auto b_at = [&](int n) { return bias ? bias + n : nullptr; };
  auto tiles = [&](auto pr, int64_t m, int64_t c0, int64_t c1) {
    constexpr int PR = decltype(pr)::value;
    float* sl = slots + (m / 2) * NBLK512 * 16;
    // The first row tile's pass over the block prefetches the rows eight tiles ahead (memory-bound
    // at small M; past the block's rows, the next block's, which follow them in memory).
    const bool first = m == 0 && c0 == 0;
    int n = 0;
    for (; n + NR <= nr; n += NR)
      float_tile512<PR, NR>(xp, x, m, M, K, c0, c1, w + n * K, sl + n * 16, y + n, ldy, b_at(n),
                            first ? reinterpret_cast<const char*>(w + (n + 8 * NR) * K) : nullptr, NR * K * 4 / 64);
    for (; n < nr; ++n) float_tile512<PR, 1>(xp, x, m, M, K, c0, c1, w + n * K, sl + n * 16, y + n, ldy, b_at(n));
  };
  for (int64_t c0 = 0; c0 < kc || c0 == 0; c0 += chunk) {  // K < 8: one pass of the tail alone
    const int64_t c1 = std::min(kc, c0 + chunk);
    int64_t m = 0;
    for (; m + 12 <= M; m += 12) tiles(std::integral_constant<int, 6>(), m, c0, c1);
    switch ((M - m + 1) / 2) {  // the pairs left, 0 to 6 (the last one half empty for an odd M)
      case 6: tiles(std::integral_constant<int, 6>(), m, c0, c1); break;  // 11 rows left
      case 5: tiles(std::integral_constant<int, 5>(), m, c0, c1); break;
      case 4: tiles(std::integral_constant<int, 4>(), m, c0, c1); break;
      case 3: tiles(std::integral_constant<int, 3>(), m, c0, c1); break;
      case 2: tiles(std::integral_constant<int, 2>(), m, c0, c1); break;
      case 1: tiles(std::integral_constant<int, 1>(), m, c0, c1); break;
      default: break;
    }
  }
}
#endif

#if defined(GPTC_VNNI512)
// ------------------------------------------------------------------ int (VNNI)
// A block of int weight rows packed for the micro-kernel: codes (K/4) x NBLK512 x 4 bytes (group g
// of row n at (g * NBLK512 + n) * 4; rows past nr zero), start nb x NBLK512 int32 (-128 * the
// block's code sum of each row: the accumulators' start), sw nb x NBLK512 scales (transposed).
struct Packed512 {
  int8_t* codes;
  int32_t* start;
  float* sw;
};

// r[i] (16 int32 each) -> r[j] holding element j of every r[i] (lane i): a 16 x 16 transpose in
// four rounds of unpacks and 128-bit shuffles.
inline void transpose16(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // u[4i + j], 128-bit lane L: rows 4i..4i+3 at element 4L + j
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int j = 0; j < 4; ++j) {
    const __m512i v0 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x88), w0 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xDD);
    const __m512i v1 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x88);
    const __m512i w1 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xDD);
    r[j] = _mm512_shuffle_i32x4(v0, v1, 0x88);
    r[8 + j] = _mm512_shuffle_i32x4(v0, v1, 0xDD);
    r[4 + j] = _mm512_shuffle_i32x4(w0, w1, 0x88);
    r[12 + j] = _mm512_shuffle_i32x4(w0, w1, 0xDD);
  }
}

// Rows q[0..nr) (int8 codes, int4 rows unpacked by the caller; K % 4 == 0, blk % 4 == 0) with
// scales sw[n] (nb a row): 16 rows x 16 groups at a time, transposed in registers.
inline void pack_block512(const int8_t* const* q, const float* const* sw, int nr, int64_t K, int64_t nb,
                          int64_t blk, Packed512 pk) {
  int32_t* codes = reinterpret_cast<int32_t*>(pk.codes);
  const int64_t G = K / 4;  // 4-code groups a row
  for (int jb = 0; jb < NBLK512 / 16; ++jb)
    for (int64_t g0 = 0; g0 < G; g0 += 16) {
      const int take = int(std::min<int64_t>(16, G - g0));
      const __mmask16 mk = take == 16 ? __mmask16(0xFFFF) : __mmask16((1u << take) - 1);
      __m512i r[16];
      for (int i = 0; i < 16; ++i) {
        const int n = 16 * jb + i;
        r[i] = n < nr ? _mm512_maskz_loadu_epi32(mk, q[n] + 4 * g0) : _mm512_setzero_si512();
      }
      transpose16(r);
      for (int j = 0; j < take; ++j) _mm512_storeu_si512(codes + (g0 + j) * NBLK512 + 16 * jb, r[j]);
    }
  // Each accumulator's start: -128 * the row's code sum over the block (vpdpbusd of 128s).
  const __m512i c128 = _mm512_set1_epi8(char(0x80));
  const int64_t gpb = blk / 4;
  for (int64_t b = 0; b < nb; ++b)
    for (int jb = 0; jb < NBLK512 / 16; ++jb) {
      __m512i s = _mm512_setzero_si512();
      for (int64_t g = b * gpb; g < (b + 1) * gpb; ++g)
        s = _mm512_dpbusd_epi32(s, c128, _mm512_loadu_si512(codes + g * NBLK512 + 16 * jb));
      _mm512_storeu_si512(pk.start + b * NBLK512 + 16 * jb, _mm512_sub_epi32(_mm512_setzero_si512(), s));
    }
  for (int n = 0; n < NBLK512; ++n)
    for (int64_t b = 0; b < nb; ++b) pk.sw[b * NBLK512 + n] = n < nr ? sw[n][b] : 0.f;
}

// acc += vpdpbusd(u, s) in place. An asm, because with GCC's intrinsic (its accumulator a tied
// operand) the allocator copies accumulators into another register and back on each step; a
// macro, not a function, because an accumulator passed by reference lives in memory.
#define GPTC_DPBUSD512(acc, u, s) __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s))

// The int tiles of three registers (int_tile512; grouped_tile512_rx3, gptc_grouped.h): one input row's three
// accumulators a0..a2 += vpdpbusd(u_j, s_j) (unsigned operand first), and a block's end, its three
// float sums s_j += float(a_j) * (xs * w_j) with the block's weight scales w0..w2 in scope.
#define GPTC_DOT3(a0, a1, a2, u0, u1, u2, s0, s1, s2) \
  {                                                   \
    GPTC_DPBUSD512(a0, u0, s0);                       \
    GPTC_DPBUSD512(a1, u1, s1);                       \
    GPTC_DPBUSD512(a2, u2, s2);                       \
  }
#define GPTC_FMA3(xs, a0, a1, a2, s0, s1, s2)                                 \
  {                                                                           \
    s0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a0), _mm512_mul_ps(xs, w0), s0);  \
    s1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a1), _mm512_mul_ps(xs, w1), s1);  \
    s2 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a2), _mm512_mul_ps(xs, w2), s2);  \
  }

thread_local std::vector<uint8_t> t_zero_row;  // K bytes of 128 (x = 0): the rows past M of a tile
thread_local std::vector<float> t_zero_scales;

// The int8 inputs as vpdpbusd's unsigned operand: x + 128 (0..255), (M, K).
inline void pack_u8(const int8_t* xq, int64_t M, int64_t K, uint8_t* xu) {
  const __m512i flip = _mm512_set1_epi8(char(0x80));
  int64_t i = 0, n = M * K;
  for (; i + 64 <= n; i += 64)
    _mm512_storeu_si512(xu + i, _mm512_xor_si512(_mm512_loadu_si512(xq + i), flip));
  for (; i < n; ++i) xu[i] = uint8_t(xq[i] ^ 0x80);
}

// 4 input rows (codes + 128 at xr[r], scales sr[r] nb apart) x the block's 48 weight rows: yr[r][0..48)
// (the lanes past nr hold the zero rows' values, never read). Registers: the 12 int32
// accumulators of a block (zmm16-27), the 12 float sums (zmm4-15), the block's 3 weight vectors
// and one broadcast input. The accumulators are named, not an array (an array of them stays in
// memory), and pinned (GCC's allocator otherwise copies some to a scratch register and back
// around each vpdpbusd).
// Blocks [b0, b1) of the K range: the float sums start at zero (b0 == 0) or at the values yr holds
// from the blocks before (an exact store and load), and get + bias after the last block (b1 == nb).
inline void int_tile512(const uint8_t* const* xr, const float* const* sr, int64_t b0, int64_t b1, int64_t nb,
                        int64_t blk, const Packed512& pk, float* const* yr, const float* bias) {
  static_assert(NBLK512 == 48, "three registers of 16 outputs");
  const int32_t* codes = reinterpret_cast<const int32_t*>(pk.codes);
  const int64_t gpb = blk / 4;  // 4-code groups per block
  const uint8_t *x0 = xr[0], *x1 = xr[1], *x2 = xr[2], *x3 = xr[3];
  auto start = [&](int r, int j) { return b0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(yr[r] + 16 * j); };
  register __m512 f00 asm("zmm4") = start(0, 0), f01 asm("zmm5") = start(0, 1), f02 asm("zmm6") = start(0, 2);
  register __m512 f10 asm("zmm7") = start(1, 0), f11 asm("zmm8") = start(1, 1), f12 asm("zmm9") = start(1, 2);
  register __m512 f20 asm("zmm10") = start(2, 0), f21 asm("zmm11") = start(2, 1), f22 asm("zmm12") = start(2, 2);
  register __m512 f30 asm("zmm13") = start(3, 0), f31 asm("zmm14") = start(3, 1), f32 asm("zmm15") = start(3, 2);
  for (int64_t b = b0; b < b1; ++b) {
    const int32_t* st = pk.start + b * NBLK512;
    register __m512i d00 asm("zmm16") = _mm512_loadu_si512(st), d01 asm("zmm17") = _mm512_loadu_si512(st + 16);
    register __m512i d02 asm("zmm18") = _mm512_loadu_si512(st + 32);
    register __m512i d10 asm("zmm19") = d00, d11 asm("zmm20") = d01, d12 asm("zmm21") = d02;
    register __m512i d20 asm("zmm22") = d00, d21 asm("zmm23") = d01, d22 asm("zmm24") = d02;
    register __m512i d30 asm("zmm25") = d00, d31 asm("zmm26") = d01, d32 asm("zmm27") = d02;
    const int32_t* cb = codes + b * gpb * NBLK512;
    const int64_t o = b * blk;
    for (int64_t g = 0; g < gpb; ++g, cb += NBLK512) {
      const __m512i w0 = _mm512_loadu_si512(cb), w1 = _mm512_loadu_si512(cb + 16), w2 = _mm512_loadu_si512(cb + 32);
      int32_t f;
#define GPTC_ROW4(x, a0, a1, a2)             \
  {                                          \
    std::memcpy(&f, x + o + 4 * g, 4);       \
    const __m512i xv = _mm512_set1_epi32(f); \
    GPTC_DOT3(a0, a1, a2, xv, xv, xv, w0, w1, w2) \
  }
      GPTC_ROW4(x0, d00, d01, d02)
      GPTC_ROW4(x1, d10, d11, d12)
      GPTC_ROW4(x2, d20, d21, d22)
      GPTC_ROW4(x3, d30, d31, d32)
#undef GPTC_ROW4
    }
    const float* ws = pk.sw + b * NBLK512;
    const __m512 w0 = _mm512_loadu_ps(ws), w1 = _mm512_loadu_ps(ws + 16), w2 = _mm512_loadu_ps(ws + 32);
    GPTC_FMA3(_mm512_set1_ps(sr[0][b]), d00, d01, d02, f00, f01, f02)
    GPTC_FMA3(_mm512_set1_ps(sr[1][b]), d10, d11, d12, f10, f11, f12)
    GPTC_FMA3(_mm512_set1_ps(sr[2][b]), d20, d21, d22, f20, f21, f22)
    GPTC_FMA3(_mm512_set1_ps(sr[3][b]), d30, d31, d32, f30, f31, f32)
  }
  const __m512 out[4][3] = {{f00, f01, f02}, {f10, f11, f12}, {f20, f21, f22}, {f30, f31, f32}};
  if (b1 < nb) {  // more blocks to come: the sums as they are
    GPTC_UNROLL for (int r = 0; r < 4; ++r)
      GPTC_UNROLL for (int j = 0; j < 3; ++j) _mm512_storeu_ps(yr[r] + 16 * j, out[r][j]);
    return;
  }
  const __m512 bv[3] = {bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps(),
                        bias ? _mm512_loadu_ps(bias + 16) : _mm512_setzero_ps(),
                        bias ? _mm512_loadu_ps(bias + 32) : _mm512_setzero_ps()};
  GPTC_UNROLL for (int r = 0; r < 4; ++r)
    GPTC_UNROLL for (int j = 0; j < 3; ++j) _mm512_storeu_ps(yr[r] + 16 * j, _mm512_add_ps(out[r][j], bv[j]));
}

// Int weights (nr <= NBLK512 rows, int8 codes at q[n], scales sw[n]) against all M int8 input rows
// (xu: xq packed by pack_u8, once per Linear) into y (M rows ldy >= 48 apart, all 48 lanes written).
inline void int_block512(const int8_t* xq, const float* sx, int64_t M, int64_t K, int64_t nb, int64_t blk,
                         const int8_t* const* q, const float* const* sw, int nr, float* y, int64_t ldy,
                         const float* bias, Packed512 pk, const uint8_t* xu) {
  pack_block512(q, sw, nr, K, nb, blk, pk);
  // The bias of the block's 48 outputs (zeros past nr), so the tiles read whole registers.
  alignas(64) float bias48[NBLK512];
  for (int n = 0; n < NBLK512; ++n) bias48[n] = bias && n < nr ? bias[n] : 0.f;
  const float* bz = bias ? bias48 : nullptr;
  // 4 rows x 48 outputs: 12 int32 accumulators, 7 loads per 12 vpdpbusd. The rows past M (the
  // last tile of an M not a multiple of 4) read a row of 128s (x = 0) with zero scales into a
  // row of their own, not y.
  std::vector<uint8_t>& zx = t_zero_row;
  if (int64_t(zx.size()) < K) zx.assign(size_t(K), 0x80);
  std::vector<float>& zs = t_zero_scales;
  if (int64_t(zs.size()) < nb) zs.assign(size_t(nb), 0.f);
  // The blocks in chunks of about 24 KB of packed codes, each chunk through every row tile: the
  // chunk stays in L1 while the rows pass (a whole block of a long K, 48 x K bytes, comes from L2
  // for every tile otherwise); the tiles keep their float sums in y between chunks.
  const int64_t chunk = std::max<int64_t>(1, (24 << 10) / (NBLK512 * blk));
  alignas(64) float spare_rows[4][NBLK512];
  for (int64_t b0 = 0; b0 < nb; b0 += chunk) {
    const int64_t b1 = std::min(nb, b0 + chunk);
    for (int64_t m = 0; m < M; m += 4) {
      const uint8_t* xr[4];
      const float* sr[4];
      float* yr[4];
      for (int r = 0; r < 4; ++r) {
        const bool real = m + r < M;
        xr[r] = real ? xu + (m + r) * K : zx.data();
        sr[r] = real ? sx + (m + r) * nb : zs.data();
        yr[r] = real ? y + (m + r) * ldy : spare_rows[r];
      }
      int_tile512(xr, sr, b0, b1, nb, blk, pk, yr, bz);
    }
  }
}

// ------------------------------------------------------------------ int, few input rows (VNNI)
// M <= LANES_MAX input rows (batched decode steps, speculative verification, short prompts): the
// input rows are the lanes of a 512-bit register, so the weight rows are read where they lie,
// with no per-block packing (which costs as much as several rows' dots at such M). A register
// holds P consecutive 4-code groups of each of 16 / P rows (P = 1 for up to 16 rows, 2 for up
// to 8, 4 for up to 4): lane r * P + p holds row r's group p of the step. vpdpbusd's unsigned operand is the
// weight, P groups broadcast straight from the row (a load, no shuffle): int8 codes + 128 (xor
// 0x80), or int4 codes as stored (0..15, w + 8); its signed operand, the input codes. Lane r * P
// of each accumulator starts at -128 (int8) or -8 (int4) times row r's input code sum over the
// block (the other lanes at 0), and the P lanes of a row are added at the block's end, so each
// ends at the exact int32 dot of the block; then the same one convert and one fma per block,
// float(dot) times sx * sw, in block order, + bias at the end: bitwise the other int paths' values.
constexpr int64_t LANES_MAX = 16;

// The inputs of one Linear call as the lane kernels read them: x, K / (4 P) steps of 16 lanes;
// s, nb blocks of 16 input scales (each row's in its P lanes; 0 past M); start, nb blocks of 16
// accumulator starts. p: P.
struct LaneInputs {
  const int32_t* x = nullptr;
  const float* s = nullptr;
  const int32_t* start = nullptr;
  int p = 0;
};

inline int lane_groups(int64_t M) { return M <= 4 ? 4 : M <= 8 ? 2 : 1; }

// shift: 7 for int8 weights (start -128 * sum), 3 for int4 (-8 * sum).
inline void pack_lanes(const int8_t* xq, const float* sx, int64_t M, int64_t K, int64_t nb, int64_t blk, int shift,
                       int P, int32_t* x, float* s, int32_t* start) {
  const int R = 16 / P;  // rows a register
  for (int64_t st = 0; st < K / (4 * P); ++st)
    for (int r = 0; r < R; ++r)
      for (int p = 0; p < P; ++p) {
        int32_t v = 0;
        if (r < M) std::memcpy(&v, xq + r * K + 4 * (st * P + p), 4);
        x[st * 16 + r * P + p] = v;
      }
  for (int64_t b = 0; b < nb; ++b)
    for (int r = 0; r < R; ++r) {
      int32_t t = 0;
      if (r < M)
        for (int64_t j = 0; j < blk; ++j) t += xq[r * K + b * blk + j];
      for (int p = 0; p < P; ++p) {
        s[b * 16 + r * P + p] = r < M ? sx[r * nb + b] : 0.f;
        start[b * 16 + r * P + p] = p == 0 ? -t * (int32_t(1) << shift) : 0;
      }
    }
}

// P groups of weight row codes at w, in every lane group of a register.
template <int P>
inline __m512i bcast_groups(const int8_t* w) {
  if constexpr (P == 1) {
    int32_t v;
    std::memcpy(&v, w, 4);
    return _mm512_set1_epi32(v);
  } else if constexpr (P == 2) {
    long long v;
    std::memcpy(&v, w, 8);
    return _mm512_set1_epi64(v);
  } else {
    static_assert(P == 4, "one, two or four groups a lane group");
    return _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
  }
}

// NR weight rows (int8 codes at q[n], or packed int4 ones, as stored) against the lanes of in:
// out[n * 16 + r * P] = row r's output n (+ bias[n]), every k and block. int4: the 4 P bytes at
// byte 4 P t of a 32-code chunk hold, in their low nibbles, the codes of step t of the chunk
// and, in their high ones, those of step t + 4 / P (export/fused.py's pack_int4: byte j holds
// codes j and j + 16), split with two ands and a shift.
// pf: pf_lines cache lines from there are prefetched, spread over the blocks (the rows of the
// tiles ahead: at small M a tile is memory-bound, and rows as short as a head's leave the hardware
// prefetchers too little to lock on to).
// After a block's P-lane sums, G weight rows share one register (lane r * P + j: row r's output
// n + j, j < G; G = P for P = 2 and 4 when NR allows, else 1): one convert and one fma for the G
// rows, each lane's value the same float(dot) * (sx * sw) fma as alone. v[0..G) (the G rows'
// scales or biases), in order, in every lane group of G.
template <int G>
inline __m512 lane_group_values(const float* v) {
  if constexpr (G == 2) {
    int64_t pair;
    std::memcpy(&pair, v, 8);
    return _mm512_castsi512_ps(_mm512_set1_epi64(pair));
  } else {
    static_assert(G == 4, "two or four rows a register");
    return _mm512_broadcast_f32x4(_mm_loadu_ps(v));
  }
}

template <int P, int NR, bool I4>
inline void int_tile_lanes(const LaneInputs& in, int64_t nb, int64_t blk, const int8_t* const* q,
                           const float* const* sw, float* out, const float* bias, const char* pf, int64_t pf_lines) {
  constexpr int S = 8 / P;  // steps a 32-code chunk
  constexpr int G = P == 4 && NR % 4 == 0 ? 4 : P >= 2 && NR % 2 == 0 ? 2 : 1;  // rows a float register
  constexpr int NF = NR / G;
  __m512 f[NF];
  GPTC_UNROLL for (int n = 0; n < NF; ++n) f[n] = _mm512_setzero_ps();
  const __m512i mask = _mm512_set1_epi32(I4 ? 0x0F0F0F0F : int32_t(0x80808080));  // int4: nibbles; int8: + 128
  const int64_t chunks = blk / 32;
  for (int64_t b = 0; b < nb; ++b) {
    for (int64_t l = b * pf_lines / nb; l < (b + 1) * pf_lines / nb; ++l) _mm_prefetch(pf + 64 * l, _MM_HINT_T1);
    __m512i acc[NR];
    const __m512i st = _mm512_loadu_si512(in.start + b * 16);
    GPTC_UNROLL for (int n = 0; n < NR; ++n) acc[n] = st;
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t k0 = b * blk + 32 * c;
      const int32_t* xs = in.x + (k0 / (4 * P)) * 16;
      if constexpr (I4) {
        GPTC_UNROLL for (int t = 0; t < S / 2; ++t) {
          __m512i xlo = _mm512_loadu_si512(xs + t * 16), xhi = _mm512_loadu_si512(xs + (t + S / 2) * 16);
          GPTC_PIN(xlo);
          GPTC_PIN(xhi);
          GPTC_UNROLL for (int n = 0; n < NR; ++n) {
            const __m512i wv = bcast_groups<P>(q[n] + k0 / 2 + 4 * P * t);
            const __m512i lo = _mm512_and_si512(wv, mask), hi = _mm512_and_si512(_mm512_srli_epi16(wv, 4), mask);
            GPTC_DPBUSD512(acc[n], lo, xlo);
            GPTC_DPBUSD512(acc[n], hi, xhi);
          }
        }
      } else {
        GPTC_UNROLL for (int t = 0; t < S; ++t) {
          __m512i xv = _mm512_loadu_si512(xs + t * 16);
          GPTC_PIN(xv);
          GPTC_UNROLL for (int n = 0; n < NR; ++n) {
            const __m512i wv = _mm512_xor_si512(bcast_groups<P>(q[n] + k0 + 4 * P * t), mask);
            GPTC_DPBUSD512(acc[n], wv, xv);
          }
        }
      }
    }
    if constexpr (P >= 2)  // a row's P lanes: each gets their sum (exact int32)
      GPTC_UNROLL for (int n = 0; n < NR; ++n) acc[n] = _mm512_add_epi32(acc[n], _mm512_shuffle_epi32(acc[n], _MM_PERM_CDAB));
    if constexpr (P == 4)
      GPTC_UNROLL for (int n = 0; n < NR; ++n) acc[n] = _mm512_add_epi32(acc[n], _mm512_shuffle_epi32(acc[n], _MM_PERM_BADC));
    const __m512 xsc = _mm512_loadu_ps(in.s + b * 16);
    if constexpr (G == 1) {
      GPTC_UNROLL for (int n = 0; n < NR; ++n)
        f[n] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[n]), _mm512_mul_ps(xsc, _mm512_set1_ps(sw[n][b])), f[n]);
    } else {
      GPTC_UNROLL for (int j = 0; j < NF; ++j) {
        __m512i c = _mm512_mask_blend_epi32(0xAAAA, acc[G * j], acc[G * j + 1]);  // odd lanes: row + 1
        if constexpr (G == 4)
          c = _mm512_mask_blend_epi32(0xCCCC, c, _mm512_mask_blend_epi32(0xAAAA, acc[4 * j + 2], acc[4 * j + 3]));
        float sj[G];
        GPTC_UNROLL for (int i = 0; i < G; ++i) sj[i] = sw[G * j + i][b];
        f[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(c), _mm512_mul_ps(xsc, lane_group_values<G>(sj)), f[j]);
      }
    }
  }
  if constexpr (G == 1) {
    GPTC_UNROLL for (int n = 0; n < NR; ++n)
      _mm512_storeu_ps(out + n * 16, _mm512_add_ps(f[n], _mm512_set1_ps(bias ? bias[n] : 0.f)));
  } else {
    // Row n + j's outputs sit in lanes r * P + j: stored j floats early, so that out[(n + j) * 16 + r * P]
    // holds them (the lanes this writes over, r * P + j' with j' > 0, are never read).
    GPTC_UNROLL for (int j = 0; j < NF; ++j) {
      const __m512 v = _mm512_add_ps(f[j], bias ? lane_group_values<G>(bias + G * j) : _mm512_setzero_ps());
      GPTC_UNROLL for (int i = 0; i < G; ++i) _mm512_storeu_ps(out + (G * j + i) * 16 - i, v);
    }
  }
}

// Int weights (nr rows: int8 codes, or packed int4 ones, at q[n], `row` bytes apart in memory;
// scales sw[n]) against M <= 16 / in.p input rows into y (M rows, ldy apart; the nr outputs).
// Rows a multiple of 4 KB apart fall in the same L1 sets: 6 a tile then, 12 otherwise.
template <int P, bool I4>
inline void int_block_lanes(const LaneInputs& in, int64_t M, int64_t nb, int64_t blk, const int8_t* const* q,
                            const float* const* sw, int nr, int64_t row, float* y, int64_t ldy, const float* bias) {
  alignas(64) float out[12 * 16];
  auto put = [&](int n0, int rows) {
    for (int64_t m = 0; m < M; ++m)
      for (int n = 0; n < rows; ++n) y[m * ldy + n0 + n] = out[n * 16 + m * P];
  };
  auto b_at = [&](int n) { return bias ? bias + n : nullptr; };
  // The rows eight tiles ahead of a tile's, into L2 (the rows follow each other in memory; past the block's
  // last row, the next block's; a prefetch past the weights' end is harmless).
  auto ahead = [&](int n, int rows) { return reinterpret_cast<const char*>(q[n]) + 8 * rows * row; };
  auto lines = [&](int rows) { return rows * row / 64; };
  int n = 0;
  if (row % 4096 != 0)
    for (; n + 12 <= nr; n += 12)
      int_tile_lanes<P, 12, I4>(in, nb, blk, q + n, sw + n, out, b_at(n), ahead(n, 12), lines(12)), put(n, 12);
  for (; n + 6 <= nr; n += 6)
    int_tile_lanes<P, 6, I4>(in, nb, blk, q + n, sw + n, out, b_at(n), ahead(n, 6), lines(6)), put(n, 6);
  for (; n + 2 <= nr; n += 2)
    int_tile_lanes<P, 2, I4>(in, nb, blk, q + n, sw + n, out, b_at(n), ahead(n, 2), lines(2)), put(n, 2);
  for (; n < nr; ++n)
    int_tile_lanes<P, 1, I4>(in, nb, blk, q + n, sw + n, out, b_at(n), ahead(n, 1), lines(1)), put(n, 1);
}
#endif

}  // namespace

#endif  // GPTC_KERNELS_GPTC_GEMM512_H_
