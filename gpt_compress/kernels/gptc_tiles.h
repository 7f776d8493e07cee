// Matrix tiles and blocks (M > 1: prefill, batches): the float and int8/int4 GEMM tiles, their
// scalar forms, and a block of NBLK weight rows against all M input rows.
// Part of the one translation unit gptc_ops.cc (included there in order; formats and contract: its head comment).
#ifndef GPTC_KERNELS_GPTC_TILES_H_
#define GPTC_KERNELS_GPTC_TILES_H_

#include "gptc_common.h"

namespace {

// ------------------------------------------------------------------ matrix kernels
// Batch invariance (the serving engine relies on it): every output y[m][n] is computed by the
// same sequence of operations whatever M, the tile it falls in or the other rows: one 8-lane
// accumulator over k in steps of 8 (float) or of 32 (int8, one fma of the block's int32 dot
// times its scale), then hsum, then the k tail with scalar fmas in order. Tiles only decide
// which outputs share a pass over the weights.

#if defined(__AVX2__)
// Every loop over the MR x NR accumulators fully unrolled: otherwise GCC 12 keeps the array
// in memory and stores all accumulators on every step of the k loop (store-bound: 30 instead
// of 43 GFLOP/s for a 4x3 float tile on the AMD EPYC here).
#define GPTC_UNROLL _Pragma("GCC unroll 16")
// Pins a loaded vector in a register (an empty asm the value goes through). Without it GCC 12
// folds the loads into the fmas as memory operands, one load per fma instead of one per row:
// a 4x3 float tile then issues 16 loads per 12 fmas and is load-bound (44 vs 69 GFLOP/s on one
// core of the AMD EPYC here; the 4x3 int8 tile 57 -> 62). The values are the same.
#define GPTC_PIN(v) __asm__("" : "+x"(v))

// Software prefetch of the next weight block while a block computes (M > 1, linear_block):
// `lines` cache lines from p, spread evenly over a tile's `steps` k steps (a burst of them at
// once stalls the loads). Prefill reads every layer's weights from memory once (gpt-bench fp32:
// 42 MB, past the L3), and the hardware prefetcher alone left a 4x3 float tile at 56 instead of
// 66 GFLOP/s with M = 64, 28 instead of 49 with M = 8 (one core of the AMD EPYC here).
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
inline void ftile(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t K, float* y, int64_t ldy,
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
// I4: the rows are packed int4 (the layout above), unpacked in registers (the same codes).
template <int MR, int NR, bool I4 = false>
inline void itile(const int8_t* xq, const float* sx, int64_t K, int64_t nb, int64_t blk, const int8_t* const* q,
                  const float* const* sw, float* y, int64_t ldy, const float* bias, const char* pf = nullptr,
                  int64_t npf = 0) {
  __m256 acc[MR][NR];
  GPTC_UNROLL for (int r = 0; r < MR; ++r)
    GPTC_UNROLL for (int n = 0; n < NR; ++n) acc[r][n] = _mm256_setzero_ps();
  Prefetch ahead(pf, npf, K / 32);
  // The scale block of step c is c / blk, counted (a 64-bit division per step cost more than
  // the step's 12 dot products with a run-time blk); blk is a multiple of 32 here.
  const int64_t steps_per_blk = blk / 32;
  int64_t b = 0, left = steps_per_blk;
  for (int64_t c = 0; c < K; c += 32) {
    if (pf) ahead.step();
    __m256i wv[NR];
    float swb[NR];
    GPTC_UNROLL for (int n = 0; n < NR; ++n) {
      if (I4) {
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q[n] + c / 2)), m4 = _mm_set1_epi8(0x0F);
        wv[n] = _mm256_sub_epi8(_mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m4), _mm_and_si128(v, m4)),
                                _mm256_set1_epi8(8));
      } else {
        wv[n] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q[n] + c));
      }
      if (MR > 1) GPTC_PIN(wv[n]);
      swb[n] = sw[n][b];
    }
    GPTC_UNROLL for (int r = 0; r < MR; ++r) {
      __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * K + c));
      if (NR > 1) GPTC_PIN(xv);
      const __m256i ax = _mm256_sign_epi8(xv, xv);
      const float sxb = sx[r * nb + b];
      GPTC_UNROLL for (int n = 0; n < NR; ++n)  // the scale product: one float multiply, as before
        acc[r][n] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot32_i8(ax, xv, wv[n])), _mm256_set1_ps(sxb * swb[n]),
                                    acc[r][n]);
    }
    if (--left == 0) ++b, left = steps_per_blk;
  }
  if (pf) ahead.rest();
  GPTC_UNROLL for (int r = 0; r < MR; ++r)
    GPTC_UNROLL for (int n = 0; n < NR; ++n) y[r * ldy + n] = hsum(acc[r][n]) + (bias ? bias[n] : 0.f);
}
#endif

// Scalar forms (no AVX2, or shapes the vector tiles do not cover: then for the whole layer).
inline void ftile_scalar(const float* x, int64_t ldx, int MR, const float* w, int64_t ldw, int NR, int64_t K,
                         float* y, int64_t ldy, const float* bias) {
  for (int r = 0; r < MR; ++r)
    for (int n = 0; n < NR; ++n) {
      float s = 0.f;
      for (int64_t k = 0; k < K; ++k) s = std::fma(x[r * ldx + k], w[n * ldw + k], s);
      y[r * ldy + n] = s + (bias ? bias[n] : 0.f);
    }
}

inline void itile_scalar(const int8_t* xq, const float* sx, int MR, int64_t K, int64_t nb, int64_t blk,
                         const int8_t* const* q, const float* const* sw, int NR, float* y, int64_t ldy,
                         const float* bias) {
  for (int r = 0; r < MR; ++r)
    for (int n = 0; n < NR; ++n) {
      float acc = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        int32_t s = 0;
        for (int64_t j = b * blk; j < (b + 1) * blk; ++j) s += int32_t(xq[r * K + j]) * int32_t(q[n][j]);
        acc += float(s) * (sx[r * nb + b] * sw[n][b]);
      }
      y[r * ldy + n] = acc + (bias ? bias[n] : 0.f);
    }
}

// Row n of an int weight as int8 codes (int4 unpacked into buf).
inline const int8_t* int_row(const Lin& L, int64_t n, int8_t* buf) {
  if (L.bits == 8) return L.wq + n * L.k;
  const uint8_t* p = reinterpret_cast<const uint8_t*>(L.wq) + n * (L.k / 2);
  for (int64_t c = 0; c < L.k; c += 32, p += 16) {
#if defined(__AVX2__)
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), m = _mm_set1_epi8(0x0F);
    const __m256i u = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m), _mm_and_si128(v, m));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(buf + c), _mm256_sub_epi8(u, _mm256_set1_epi8(8)));
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
// once for all M input rows (GEMM for M > 1: prefill, batches); int4 rows are unpacked (and
// float-input int rows dequantized) once per block.
constexpr int NBLK = 12;

// Float weights (NBLK or fewer rows) against all M input rows; the 4-row tiles prefetch pf_bytes
// from pf (the next block's weights; null: none), an even part each.
inline void fblock(const float* x, int64_t M, int64_t K, const float* w, int nr, float* y, int64_t ldy,
                   const float* bias, const char* pf = nullptr, int64_t pf_bytes = 0) {
#if defined(__AVX2__)
  if (nr == NBLK) {
    const int64_t lines = (pf_bytes + 63) / 64, parts = std::max<int64_t>(1, NBLK / 3 * (M / 4));
    int64_t part = 0;
    for (int s = 0; s < NBLK; s += 3) {  // 4 x 3 tiles: 12 accumulators, 7 loads per 12 fmas
      int64_t m = 0;
      for (; m + 4 <= M; m += 4, ++part) {
        const int64_t a = lines * part / parts, b = lines * (part + 1) / parts;
        ftile<4, 3>(x + m * K, K, w + s * K, K, K, y + m * ldy + s, ldy, bias ? bias + s : nullptr,
                    pf ? pf + a * 64 : nullptr, b - a);
      }
      for (; m < M; ++m) ftile<1, 3>(x + m * K, K, w + s * K, K, K, y + m * ldy + s, ldy, bias ? bias + s : nullptr);
    }
    return;
  }
  for (int n = 0; n < nr; ++n)
    for (int64_t m = 0; m < M; ++m) ftile<1, 1>(x + m * K, K, w + n * K, K, K, y + m * ldy + n, ldy, bias ? bias + n : nullptr);
#else
  ftile_scalar(x, K, int(M), w, K, nr, K, y, ldy, bias);
#endif
}

// Whether iblock takes packed int4 rows as they are (unpacked in registers): the vector path, and
// few input rows (each input row of a tile unpacks them again; more rows unpack once into a buffer).
inline bool packed4_ok(int64_t M, int64_t K, int64_t blk) {
#if defined(__AVX2__)
  return M <= 2 && K % 32 == 0 && blk % 32 == 0;
#else
  return false;
#endif
}

template <bool I4 = false>
inline void iblock(const int8_t* xq, const float* sx, int64_t M, int64_t K, int64_t nb, int64_t blk,
                   const int8_t* const* q, const float* const* sw, int nr, float* y, int64_t ldy, const float* bias,
                   const char* pf = nullptr, int64_t pf_bytes = 0) {
#if defined(__AVX2__)
  if (!I4 && K % 32 == 0 && blk % 32 == 0) {  // int8 rows: 4 x 3 tiles, as the float ones (pf: see fblock;
    // in the 1-thread gpt-bench prefill, 4x2, 2x4, 3x3 and 2x6 tiles were within 2% of it)
    const int64_t lines = (pf_bytes + 63) / 64, parts = std::max<int64_t>(1, nr / 3 * (M / 4));
    int64_t part = 0;
    int n = 0;
    for (; n + 3 <= nr; n += 3) {
      int64_t m = 0;
      for (; m + 4 <= M; m += 4, ++part) {
        const int64_t a = lines * part / parts, b = lines * (part + 1) / parts;
        itile<4, 3>(xq + m * K, sx + m * nb, K, nb, blk, q + n, sw + n, y + m * ldy + n, ldy, bias ? bias + n : nullptr,
                    pf ? pf + a * 64 : nullptr, b - a);
      }
      for (; m + 2 <= M; m += 2)
        itile<2, 3>(xq + m * K, sx + m * nb, K, nb, blk, q + n, sw + n, y + m * ldy + n, ldy, bias ? bias + n : nullptr);
      for (; m < M; ++m)
        itile<1, 3>(xq + m * K, sx + m * nb, K, nb, blk, q + n, sw + n, y + m * ldy + n, ldy, bias ? bias + n : nullptr);
    }
    for (; n < nr; ++n)
      for (int64_t m = 0; m < M; ++m)
        itile<1, 1>(xq + m * K, sx + m * nb, K, nb, blk, q + n, sw + n, y + m * ldy + n, ldy, bias ? bias + n : nullptr);
    return;
  }
  if (I4) {  // packed int4 rows (few input rows, packed4_ok): unpacked in registers per tile
    int n = 0;
    for (; n + 4 <= nr; n += 4) {
      int64_t m = 0;
      for (; m + 2 <= M; m += 2)
        itile<2, 4, I4>(xq + m * K, sx + m * nb, K, nb, blk, q + n, sw + n, y + m * ldy + n, ldy, bias ? bias + n : nullptr);
      for (; m < M; ++m)
        itile<1, 4, I4>(xq + m * K, sx + m * nb, K, nb, blk, q + n, sw + n, y + m * ldy + n, ldy, bias ? bias + n : nullptr);
    }
    for (; n < nr; ++n)
      for (int64_t m = 0; m < M; ++m)
        itile<1, 1, I4>(xq + m * K, sx + m * nb, K, nb, blk, q + n, sw + n, y + m * ldy + n, ldy, bias ? bias + n : nullptr);
    return;
  }
#endif
  for (int64_t m = 0; m < M; ++m)
    itile_scalar(xq + m * K, sx + m * nb, 1, K, nb, blk, q, sw, nr, y + m * ldy, ldy, bias);
}

}  // namespace

#endif  // GPTC_KERNELS_GPTC_TILES_H_
