// Matrix tiles and blocks (M > 1: prefill, batches; M = 1 where the GEMV does not apply): the
// float and int8/int4 GEMM tiles, their scalar forms, a block of NBLK weight rows against all M
// input rows (float_block, int_block), and the AVX2 kernels with input rows in lanes
// (int_block_lanes8).
// Part of the one translation unit gptc_ops.cc (included there in order; formats and contract: its head comment).
#ifndef GPTC_KERNELS_GPTC_TILES_H_
#define GPTC_KERNELS_GPTC_TILES_H_

#include "gptc_common.h"

namespace {

// ------------------------------------------------------------------ matrix kernels
// Batch invariance (the serving engine relies on it): every output y[m][n] is computed by the
// same sequence of operations whatever M, the tile it falls in or the other rows. Float: one
// 8-lane accumulator over k in steps of 8, then hsum, then the k tail with scalar fmas in order.
// Int: per block, the exact int32 dot of its codes (integers: any order, any instructions, the
// same total), then one scalar-valued fma into the output's float sum, float(dot) times the scale
// product sx * sw (one float multiply), in block order from 0; then + bias. Tiles only decide
// which outputs share a pass over the weights (and, int, which four share a vector lane-wise).

#if defined(__AVX2__)
// Every loop over the MR x NR accumulators fully unrolled: otherwise GCC keeps the array in
// memory and stores all accumulators on every step of the k loop (store-bound).
#define GPTC_UNROLL _Pragma("GCC unroll 16")
// Pins a loaded vector in a register (an empty asm the value goes through). Without it GCC
// folds the loads into the fmas as memory operands, one load per fma instead of one per row:
// a 4x3 float tile then issues 16 loads per 12 fmas and is load-bound. The values are the same.
// "v": any vector register, the 32 of AVX-512 included ("x", the first 16 only, makes GCC copy
// AVX-512 accumulators between register halves on every step).
#if defined(__AVX512F__)
#define GPTC_PIN(v) __asm__("" : "+v"(v))
#else
#define GPTC_PIN(v) __asm__("" : "+x"(v))
#endif

// Software prefetch of the next weight block while a block computes (M > 1, linear_block):
// `lines` cache lines from p, spread evenly over a tile's `steps` k steps (a burst of them at
// once stalls the loads). Prefill reads every layer's weights from memory once (gpt-bench fp32:
// 42 MB, past the L3), and the hardware prefetcher alone leaves the tiles waiting for them,
// most at small M.
struct Prefetch {
  const char* p;
  int64_t left, every, per, cnt = 0;
  Prefetch(const char* p_, int64_t lines, int64_t steps) : p(p_), left(p_ ? lines : 0) {
    every = left > 0 ? std::max<int64_t>(1, steps / left) : steps + 1;
    per = left > steps ? (left + steps - 1) / steps : 1;
  }
  inline void step() {
    if (++cnt < every) return;
    cnt = 0;
    for (int64_t i = 0; i < per && left > 0; ++i, --left, p += 64) _mm_prefetch(p, _MM_HINT_T0);
  }
  inline void rest() {
    for (; left > 0; --left, p += 64) _mm_prefetch(p, _MM_HINT_T0);
  }
};

// MR input rows x NR weight rows (float); y rows ldy apart.
template <int MR, int NR>
inline void float_tile(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t K, float* y, int64_t ldy,
                       const float* bias, const char* pf = nullptr, int64_t npf = 0) {
  __m256 acc[MR][NR];
  GPTC_UNROLL for (int r = 0; r < MR; ++r)
    GPTC_UNROLL for (int n = 0; n < NR; ++n) acc[r][n] = _mm256_setzero_ps();
  Prefetch ahead(pf, npf, K / 8);
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    if (pf) ahead.step();
    __m256 wv[NR];
    GPTC_UNROLL for (int n = 0; n < NR; ++n) {
      wv[n] = _mm256_loadu_ps(w + n * ldw + k);
      if (MR > 1) GPTC_PIN(wv[n]);
    }
    GPTC_UNROLL for (int r = 0; r < MR; ++r) {
      __m256 xv = _mm256_loadu_ps(x + r * ldx + k);
      if (NR > 1) GPTC_PIN(xv);
      GPTC_UNROLL for (int n = 0; n < NR; ++n) acc[r][n] = _mm256_fmadd_ps(xv, wv[n], acc[r][n]);
    }
  }
  if (pf) ahead.rest();
  GPTC_UNROLL for (int r = 0; r < MR; ++r)
    GPTC_UNROLL for (int n = 0; n < NR; ++n) {
      float s = hsum(acc[r][n]);
      for (int64_t kk = k; kk < K; ++kk) s = std::fma(x[r * ldx + kk], w[n * ldw + kk], s);
      y[r * ldy + n] = s + (bias ? bias[n] : 0.f);
    }
}

// MR int8 input rows (K apart, scales sx nb apart) x NR int8 weight rows (pointers q, scales sw).
// I4: the rows are packed int4 (weight_format, gptc_common.h), unpacked in registers (the same codes).
// The int contract (above): each 32-code step's dots are reduced to their exact totals four
// outputs at a time (totals4), grouped by weight row when MR is 4 (lanes: the input rows), else
// by input row when NR is 4 (lanes: the weight rows), else one output at a time; at a block's
// end one convert and one fma a group, with the group's scale products.
template <int MR, int NR, bool I4 = false>
inline void int_tile(const int8_t* xq, const float* sx, int64_t K, int64_t nb, int64_t blk, const int8_t* const* q,
                     const float* const* sw, float* y, int64_t ldy, const float* bias, const char* pf = nullptr,
                     int64_t npf = 0) {
  constexpr bool by_n = MR == 4, by_r = !by_n && NR == 4;
  constexpr int G = by_n ? NR : by_r ? MR : MR * NR;  // groups (accumulators)
  __m128 acc[G];
  __m128i sb[G];  // the block's totals so far (blocks of more than 32 codes)
  GPTC_UNROLL for (int g = 0; g < G; ++g) acc[g] = _mm_setzero_ps(), sb[g] = _mm_setzero_si128();
  Prefetch ahead(pf, npf, K / 32);
  const int64_t spb = blk / 32;  // 32-code steps per block; blk is a multiple of 32 here
  int64_t b = 0, left = spb;
  // Group g's totals of a step; the block's fma when the step ends it (every group's, below).
  auto add = [&](int g, __m128i s) {
    if (spb > 1) sb[g] = _mm_add_epi32(sb[g], s);
    else sb[g] = s;
  };
  auto finish_block = [&]() {
    if (spb > 1 && --left) return;
    left = spb;
    if constexpr (by_n) {
      const __m128 xs = _mm_set_ps(sx[3 * nb + b], sx[2 * nb + b], sx[nb + b], sx[b]);
      GPTC_UNROLL for (int n = 0; n < NR; ++n)
        acc[n] = _mm_fmadd_ps(_mm_cvtepi32_ps(sb[n]), _mm_mul_ps(xs, _mm_set1_ps(sw[n][b])), acc[n]);
    } else if constexpr (by_r) {
      const __m128 ws = _mm_set_ps(sw[3][b], sw[2][b], sw[1][b], sw[0][b]);
      GPTC_UNROLL for (int r = 0; r < MR; ++r)
        acc[r] = _mm_fmadd_ps(_mm_cvtepi32_ps(sb[r]), _mm_mul_ps(_mm_set1_ps(sx[r * nb + b]), ws), acc[r]);
    } else {
      GPTC_UNROLL for (int r = 0; r < MR; ++r)
        GPTC_UNROLL for (int n = 0; n < NR; ++n)
          acc[r * NR + n] = _mm_fmadd_ps(_mm_cvtepi32_ps(sb[r * NR + n]), _mm_set_ss(sx[r * nb + b] * sw[n][b]),
                                         acc[r * NR + n]);
    }
    if (spb > 1) GPTC_UNROLL for (int g = 0; g < G; ++g) sb[g] = _mm_setzero_si128();
    ++b;
  };
  auto weights = [&](int n, int64_t c) {
    if (I4) return unpack_i4(q[n] + c / 2);
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q[n] + c));
  };
  for (int64_t c = 0; c < K; c += 32) {
    if (pf) ahead.step();
    __m256i xv[MR], ax[MR];
    GPTC_UNROLL for (int r = 0; r < MR; ++r) {
      xv[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * K + c));
      ax[r] = _mm256_sign_epi8(xv[r], xv[r]);
    }
    if constexpr (by_n) {  // per weight row: the 4 input rows' dots, one group
      GPTC_UNROLL for (int n = 0; n < NR; ++n) {
        __m256i wv = weights(n, c);
        GPTC_PIN(wv);
        add(n, totals4(dot32_i8(ax[0], xv[0], wv), dot32_i8(ax[1], xv[1], wv), dot32_i8(ax[2], xv[2], wv),
                       dot32_i8(ax[3], xv[3], wv)));
      }
    } else {
      __m256i wv[NR];
      GPTC_UNROLL for (int n = 0; n < NR; ++n) {
        wv[n] = weights(n, c);
        if (MR > 1) GPTC_PIN(wv[n]);
      }
      GPTC_UNROLL for (int r = 0; r < MR; ++r) {
        if constexpr (by_r) {
          add(r, totals4(dot32_i8(ax[r], xv[r], wv[0]), dot32_i8(ax[r], xv[r], wv[1]), dot32_i8(ax[r], xv[r], wv[2]),
                         dot32_i8(ax[r], xv[r], wv[3])));
        } else {
          GPTC_UNROLL for (int n = 0; n < NR; ++n)
            add(r * NR + n, _mm_cvtsi32_si128(total(dot32_i8(ax[r], xv[r], wv[n]))));
        }
      }
    }
    finish_block();
  }
  if (pf) ahead.rest();
  alignas(16) float out[G][4];
  GPTC_UNROLL for (int g = 0; g < G; ++g) _mm_store_ps(out[g], acc[g]);
  GPTC_UNROLL for (int r = 0; r < MR; ++r)
    GPTC_UNROLL for (int n = 0; n < NR; ++n) {
      const float v = by_n ? out[n][r] : by_r ? out[r][n] : out[r * NR + n][0];
      y[r * ldy + n] = v + (bias ? bias[n] : 0.f);
    }
}
#endif

// Scalar forms: float_tile_scalar where the build has no AVX2; int_tile_scalar there too and for
// int layers the vector tiles do not cover (K or blk not a multiple of 32), then for the whole layer.
inline void float_tile_scalar(const float* x, int64_t ldx, int MR, const float* w, int64_t ldw, int NR, int64_t K,
                              float* y, int64_t ldy, const float* bias) {
  for (int r = 0; r < MR; ++r)
    for (int n = 0; n < NR; ++n) {
      float s = 0.f;
      for (int64_t k = 0; k < K; ++k) s = std::fma(x[r * ldx + k], w[n * ldw + k], s);
      y[r * ldy + n] = s + (bias ? bias[n] : 0.f);
    }
}

inline void int_tile_scalar(const int8_t* xq, const float* sx, int MR, int64_t K, int64_t nb, int64_t blk,
                            const int8_t* const* q, const float* const* sw, int NR, float* y, int64_t ldy,
                            const float* bias) {
  for (int r = 0; r < MR; ++r)
    for (int n = 0; n < NR; ++n) {
      float acc = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        int32_t s = 0;
        for (int64_t j = b * blk; j < (b + 1) * blk; ++j) s += int32_t(xq[r * K + j]) * int32_t(q[n][j]);
        acc = std::fma(float(s), sx[r * nb + b] * sw[n][b], acc);
      }
      y[r * ldy + n] = acc + (bias ? bias[n] : 0.f);
    }
}

// Row n of an int weight as int8 codes (int4 unpacked into buf).
inline const int8_t* int_row(const LinearWeights& L, int64_t n, int8_t* buf) {
  if (L.bits == 8) return L.wq + n * L.k;
  const uint8_t* p = reinterpret_cast<const uint8_t*>(L.wq) + n * (L.k / 2);
  for (int64_t c = 0; c < L.k; c += 32, p += 16) {
#if defined(__AVX2__)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(buf + c), unpack_i4(reinterpret_cast<const int8_t*>(p)));
#else
    for (int j = 0; j < 16; ++j) {
      buf[c + j] = int8_t(int(p[j] & 0xF) - 8);
      buf[c + j + 16] = int8_t(int(p[j] >> 4) - 8);
    }
#endif
  }
  return buf;
}

// Weight rows per block: the unit of work of a thread. A block's weights are read from memory
// once for all M input rows (GEMM for M > 1: prefill, batches); int4 rows that a kernel does not
// read packed are unpacked (and float-input int rows dequantized, AVX-512 int blocks packed) once
// per block. AVX-512 builds take
// blocks of 48 (gptc_gemm512.h: three registers of 16 outputs), AVX2 ones of 12 (4 x 3 tiles).
#if defined(GPTC_F512)
constexpr int NBLK = 48;
#else
constexpr int NBLK = 12;
#endif

// Float weights (NBLK or fewer rows) against all M input rows; the 4-row tiles prefetch pf_bytes
// from pf (the next block's weights; null: none), an even part each.
inline void float_block(const float* x, int64_t M, int64_t K, const float* w, int nr, float* y, int64_t ldy,
                        const float* bias, const char* pf = nullptr, int64_t pf_bytes = 0) {
#if defined(__AVX2__)
  if (nr == NBLK) {
    static_assert(NBLK % 3 == 0, "float_block's 4 x 3 tiles");
    const int64_t lines = (pf_bytes + 63) / 64, parts = std::max<int64_t>(1, NBLK / 3 * (M / 4));
    int64_t part = 0;
    for (int s = 0; s < NBLK; s += 3) {  // 4 x 3 tiles: 12 accumulators, 7 loads per 12 fmas
      int64_t m = 0;
      for (; m + 4 <= M; m += 4, ++part) {
        const int64_t a = lines * part / parts, b = lines * (part + 1) / parts;
        float_tile<4, 3>(x + m * K, K, w + s * K, K, K, y + m * ldy + s, ldy, bias ? bias + s : nullptr,
                         pf ? pf + a * 64 : nullptr, b - a);
      }
      for (; m < M; ++m)
        float_tile<1, 3>(x + m * K, K, w + s * K, K, K, y + m * ldy + s, ldy, bias ? bias + s : nullptr);
    }
    return;
  }
  for (int n = 0; n < nr; ++n)
    for (int64_t m = 0; m < M; ++m)
      float_tile<1, 1>(x + m * K, K, w + n * K, K, K, y + m * ldy + n, ldy, bias ? bias + n : nullptr);
#else
  float_tile_scalar(x, K, int(M), w, K, nr, K, y, ldy, bias);
#endif
}

// Whether int_block takes packed int4 rows as they are (unpacked in registers): the vector path, and
// few input rows (each input row of a tile unpacks them again; more rows unpack once into a buffer).
inline bool packed4_ok(int64_t M, int64_t K, int64_t blk) {
#if defined(__AVX2__)
  return M <= 2 && K % 32 == 0 && blk % 32 == 0;
#else
  return false;
#endif
}

template <bool I4 = false>
inline void int_block(const int8_t* xq, const float* sx, int64_t M, int64_t K, int64_t nb, int64_t blk,
                      const int8_t* const* q, const float* const* sw, int nr, float* y, int64_t ldy, const float* bias,
                      const char* pf = nullptr, int64_t pf_bytes = 0) {
#if defined(__AVX2__)
  if (!I4 && K % 32 == 0 && blk % 32 == 0) {  // int8 rows: 4 x 3 tiles, as the float ones (pf: see float_block)
    const int64_t lines = (pf_bytes + 63) / 64, parts = std::max<int64_t>(1, nr / 3 * (M / 4));
    int64_t part = 0;
    int n = 0;
    for (; n + 3 <= nr; n += 3) {
      int64_t m = 0;
      for (; m + 4 <= M; m += 4, ++part) {
        const int64_t a = lines * part / parts, b = lines * (part + 1) / parts;
        int_tile<4, 3>(xq + m * K, sx + m * nb, K, nb, blk, q + n, sw + n, y + m * ldy + n, ldy,
                       bias ? bias + n : nullptr, pf ? pf + a * 64 : nullptr, b - a);
      }
      for (; m + 2 <= M; m += 2)
        int_tile<2, 3>(xq + m * K, sx + m * nb, K, nb, blk, q + n, sw + n, y + m * ldy + n, ldy,
                       bias ? bias + n : nullptr);
      for (; m < M; ++m)
        int_tile<1, 3>(xq + m * K, sx + m * nb, K, nb, blk, q + n, sw + n, y + m * ldy + n, ldy,
                       bias ? bias + n : nullptr);
    }
    for (; n < nr; ++n)
      for (int64_t m = 0; m < M; ++m)
        int_tile<1, 1>(xq + m * K, sx + m * nb, K, nb, blk, q + n, sw + n, y + m * ldy + n, ldy,
                       bias ? bias + n : nullptr);
    return;
  }
  if (I4) {  // packed int4 rows (few input rows, packed4_ok): unpacked in registers per tile
    int n = 0;
    for (; n + 4 <= nr; n += 4) {
      int64_t m = 0;
      for (; m + 2 <= M; m += 2)
        int_tile<2, 4, I4>(xq + m * K, sx + m * nb, K, nb, blk, q + n, sw + n, y + m * ldy + n, ldy,
                           bias ? bias + n : nullptr);
      for (; m < M; ++m)
        int_tile<1, 4, I4>(xq + m * K, sx + m * nb, K, nb, blk, q + n, sw + n, y + m * ldy + n, ldy,
                           bias ? bias + n : nullptr);
    }
    for (; n < nr; ++n)
      for (int64_t m = 0; m < M; ++m)
        int_tile<1, 1, I4>(xq + m * K, sx + m * nb, K, nb, blk, q + n, sw + n, y + m * ldy + n, ldy,
                           bias ? bias + n : nullptr);
    return;
  }
#endif
  for (int64_t m = 0; m < M; ++m)
    int_tile_scalar(xq + m * K, sx + m * nb, 1, K, nb, blk, q, sw, nr, y + m * ldy, ldy, bias);
}

#if defined(__AVX2__)
// ------------------------------------------------------------------ int, rows in lanes (AVX2)
// Int weights against int8 inputs of more than one row, 8 input rows at a time in the 8 lanes of
// a register (panels of 8 rows), each weight row's 4-code groups broadcast straight from the row:
// no horizontal sums (the 4 x 3 tiles above reduce every dot of 32 codes with hadds), no weight
// packing (the inputs are packed once per Linear call, pack_lanes8).
// vpmaddubsw multiplies |x| (unsigned, <= 128) by w * sign(x) (|w| <= 127: the codes' range), so
// each pair of products is at most 2 * 128 * 127 = 32512 and never saturates int16; vpmaddwd
// adds the pairs into the lane's int32 total (dot32_u8: one vpdpbusd where the build has 256-bit
// VNNI): every block ends at the exact int32 dot, then the
// one convert and one fma per block, in block order, + bias: the other int paths' values.
// The inputs of one Linear call: per panel of 8 rows, K/4 groups of 8 lanes (row r's 4 codes in
// lane r: xs the codes, xa their absolute values; rows past M zero), nb blocks of 8 scales.
// Rows of a panel below which the 4 x 3 tiles are faster (most lanes would idle).
constexpr int64_t LANES8_MIN = 6;

struct LaneInputs8 {
  const int32_t* xs = nullptr;
  const int32_t* xa = nullptr;
  const float* s = nullptr;
};

inline void pack_lanes8(const int8_t* xq, const float* sx, int64_t M, int64_t K, int64_t nb, int32_t* xs, int32_t* xa,
                        float* s) {
  for (int64_t p = 0; p < (M + 7) / 8; ++p)
    for (int64_t g = 0; g < K / 4; ++g)
      for (int r = 0; r < 8; ++r) {
        const int64_t m = 8 * p + r;
        int32_t v = 0;
        if (m < M) std::memcpy(&v, xq + m * K + 4 * g, 4);
        const __m128i b = _mm_cvtsi32_si128(v);
        xs[(p * (K / 4) + g) * 8 + r] = v;
        xa[(p * (K / 4) + g) * 8 + r] = _mm_cvtsi128_si32(_mm_abs_epi8(b));
      }
  for (int64_t p = 0; p < (M + 7) / 8; ++p)
    for (int64_t b = 0; b < nb; ++b)
      for (int r = 0; r < 8; ++r) s[(p * nb + b) * 8 + r] = 8 * p + r < M ? sx[(8 * p + r) * nb + b] : 0.f;
}

// NR weight rows against one panel: out[n * 8 + r] = row r's output n (+ bias[n]). int4: the 4
// bytes at byte 4 t of a 32-code chunk hold groups t (low nibbles) and t + 4 (high ones).
template <int NR, bool I4>
inline void int_tile_lanes8(const int32_t* xs, const int32_t* xa, const float* s, int64_t nb, int64_t blk,
                            const int8_t* const* q, const float* const* sw, float* out, const float* bias) {
  const __m256i nib = _mm256_set1_epi8(0x0F), eight = _mm256_set1_epi8(8);
  __m256 f[NR];
  GPTC_UNROLL for (int n = 0; n < NR; ++n) f[n] = _mm256_setzero_ps();
  auto bcast = [](const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
  };
  auto load = [](const int32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); };
  const int64_t chunks = blk / 32;
  for (int64_t b = 0; b < nb; ++b) {
    __m256i acc[NR];
    GPTC_UNROLL for (int n = 0; n < NR; ++n) acc[n] = _mm256_setzero_si256();
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t k0 = b * blk + 32 * c;
      const int32_t *gs = xs + (k0 / 4) * 8, *ga = xa + (k0 / 4) * 8;
      if constexpr (I4) {
        GPTC_UNROLL for (int t = 0; t < 4; ++t) {
          __m256i slo = load(gs + t * 8), alo = load(ga + t * 8), shi = load(gs + (t + 4) * 8), ahi = load(ga + (t + 4) * 8);
          GPTC_PIN(slo);
          GPTC_PIN(alo);
          GPTC_PIN(shi);
          GPTC_PIN(ahi);
          GPTC_UNROLL for (int n = 0; n < NR; ++n) {
            const __m256i wv = bcast(q[n] + k0 / 2 + 4 * t);
            const __m256i lo = _mm256_sub_epi8(_mm256_and_si256(wv, nib), eight);
            const __m256i hi = _mm256_sub_epi8(_mm256_and_si256(_mm256_srli_epi16(wv, 4), nib), eight);
            acc[n] = _mm256_add_epi32(acc[n], dot32_u8(alo, _mm256_sign_epi8(lo, slo)));
            acc[n] = _mm256_add_epi32(acc[n], dot32_u8(ahi, _mm256_sign_epi8(hi, shi)));
          }
        }
      } else {
        GPTC_UNROLL for (int g = 0; g < 8; ++g) {
          __m256i sv = load(gs + g * 8), av = load(ga + g * 8);
          GPTC_PIN(sv);
          GPTC_PIN(av);
          GPTC_UNROLL for (int n = 0; n < NR; ++n) {
            const __m256i wv = bcast(q[n] + k0 + 4 * g);
            acc[n] = _mm256_add_epi32(acc[n], dot32_u8(av, _mm256_sign_epi8(wv, sv)));
          }
        }
      }
    }
    const __m256 xsc = _mm256_loadu_ps(s + b * 8);
    GPTC_UNROLL for (int n = 0; n < NR; ++n)
      f[n] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[n]), _mm256_mul_ps(xsc, _mm256_set1_ps(sw[n][b])), f[n]);
  }
  GPTC_UNROLL for (int n = 0; n < NR; ++n)
    _mm256_storeu_ps(out + n * 8, _mm256_add_ps(f[n], _mm256_set1_ps(bias ? bias[n] : 0.f)));
}

// Int weights (nr rows at q[n]: int8 codes, or packed int4 ones; scales sw[n]) against M input
// rows packed by pack_lanes8 into y (M rows, ldy apart; the nr outputs).
template <bool I4>
inline void int_block_lanes8(const LaneInputs8& in, int64_t M, int64_t K, int64_t nb, int64_t blk,
                             const int8_t* const* q, const float* const* sw, int nr, float* y, int64_t ldy,
                             const float* bias) {
  alignas(32) float out[4 * 8];
  auto b_at = [&](int n) { return bias ? bias + n : nullptr; };
  for (int64_t p = 0; p < (M + 7) / 8; ++p) {
    const int32_t *xs = in.xs + p * (K / 4) * 8, *xa = in.xa + p * (K / 4) * 8;
    const float* s = in.s + p * nb * 8;
    const int64_t rows = std::min<int64_t>(8, M - 8 * p);
    auto put = [&](int n0, int cnt) {
      for (int64_t r = 0; r < rows; ++r)
        for (int n = 0; n < cnt; ++n) y[(8 * p + r) * ldy + n0 + n] = out[n * 8 + r];
    };
    int n = 0;
    for (; n + 4 <= nr; n += 4) int_tile_lanes8<4, I4>(xs, xa, s, nb, blk, q + n, sw + n, out, b_at(n)), put(n, 4);
    for (; n < nr; ++n) int_tile_lanes8<1, I4>(xs, xa, s, nb, blk, q + n, sw + n, out, b_at(n)), put(n, 1);
  }
}
#endif

}  // namespace

#endif  // GPTC_KERNELS_GPTC_TILES_H_
