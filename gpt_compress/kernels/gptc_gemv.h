// The GEMV kernels (M = 1: batch-1 decode): float and int weight rows against one input row,
// in streams of rows (gemv_rows) shared out among a region's threads (gemv_for). linear_rows and
// linear_for (gptc_linear.h) choose them where gemv_ok.
// Part of the one translation unit gptc_ops.cc (included there in order; formats and contract: its head comment).
#ifndef GPTC_KERNELS_GPTC_GEMV_H_
#define GPTC_KERNELS_GPTC_GEMV_H_

#include "gptc_inputs.h"
#include "gptc_tiles.h"

namespace {

// ------------------------------------------------------------------ M = 1: GEMV (batch-1 decode)
// One input row has kernels of its own. They walk the weight rows straight from the weights (no
// per-block row tables or tile copies), NR rows per pass (independent accumulator chains: the
// fma latency is hidden, the loads stream), step the block index without a division and form
// each pass's scale products sx[b] * sw[n][b] once. An output's arithmetic is gptc_tiles.h's
// contract (the same operations in the same order as float_tile/int_tile), so its value is bitwise the tiles'
// (tests/test_fused.py, test_kernel_tiles.py: token by token vs one prefill, one head row vs
// many), whichever rows share a pass.
//
// The rows of a pass are far apart, not adjacent: the rows a thread takes at once (a grab of
// gemv_for) are cut into NR equal parts, and pass i takes row i of each part, so the thread
// reads NR sequential streams (each part's rows follow each other in memory), which the
// hardware prefetchers follow on their own, with NR times the requests in flight of one stream.
// Adjacent rows (one span of NR rows a pass) are NR streams that end after one row each: the
// prefetchers never lock on, and software prefetches make up only part of it.
// AVX2 only; other layers (float-input int weights, K or blocks not in steps of 32) take the
// blocks (linear_block, gptc_linear.h) even at M = 1.
//
// Float weights take this path for a few input rows too (M <= GEMV_M_F: batched decode steps,
// speculative verification): each pass's weight rows are read from memory once, by the first
// group of GEMV_MR_F input rows, and from L1 by the others. The block kernels' adjacent rows
// stream the weights at about half the GEMV's rate, which at these M is the step's cost.
constexpr int64_t GEMV_ROWS = 64;  // a grab of gemv_for is a multiple of this many rows
constexpr int GEMV_NR_F = 8;       // float weight rows per pass (streams), one input row
constexpr int GEMV_NR_I = 4;       // int weight rows per pass (int_gemv_tile: 4 or 1)
constexpr int64_t GEMV_M_F = 8;    // float weights: input rows up to which the GEMV serves
// Float weights, several input rows: NR weight rows x MR input rows a tile (accumulators: their
// product, within the vector registers of the build: 32 with AVX-512 VL, else 16).
#if defined(GPTC_F512)
constexpr int GEMV_NR_FM = 4, GEMV_MR_F = 4;
#else
constexpr int GEMV_NR_FM = 4, GEMV_MR_F = 2;
#endif

// int8 rows (not int4, not float) also prefetch their codes this many bytes ahead: on hosts where
// the int8 dots run about as fast as the memory, the hardware prefetchers alone leave the loads
// behind; much further ahead (4 KB) evicts lines before their use. int4 (compute-bound) gains
// nothing from it.
constexpr int64_t GEMV_AHEAD_I8 = 256;

inline bool gemv_ok(const LinearWeights& L, const LinearInputs& in, int64_t M) {
#if defined(__AVX2__)
  if (L.grouped) return false;  // the grouped kernels serve M = 1 too (gptc_grouped.h)
  if (L.bits == 32) return M <= GEMV_M_F;
  return M == 1 && in.xq != nullptr && L.k % 32 == 0 && L.blk % 32 == 0;
#else
  (void)L, (void)in, (void)M;
  return false;
#endif
}

// Passes of NR rows over nr rows: tile(i, R) computes rows i, i + R, ..., i + (NR - 1) * R (NR
// streams of R = nr / NR rows); one(n) the rows left over, alone.
template <int NR, class Tile, class One>
inline void gemv_streams(int64_t nr, Tile tile, One one) {
  const int64_t R = nr / NR;
  for (int64_t i = 0; i < R; ++i) tile(i, R);
  for (int64_t n = R * NR; n < nr; ++n) one(n);
}

#if defined(__AVX2__)
// NR float weight rows (ldw apart) against MR input rows (K apart):
// y[m * ldm + n * ldy] = x_m . w_n + bias[n * ldy].
template <int NR, int MR = 1>
inline void float_gemv_tile(const float* x, const float* w, int64_t ldw, int64_t K, float* y, int64_t ldy,
                            const float* bias, int64_t ldm = 0) {
  __m256 acc[MR][NR];
  GPTC_UNROLL for (int m = 0; m < MR; ++m)
    GPTC_UNROLL for (int n = 0; n < NR; ++n) acc[m][n] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    if constexpr (MR == 1) {
      const __m256 xv = _mm256_loadu_ps(x + k);
      GPTC_UNROLL for (int n = 0; n < NR; ++n)
        acc[0][n] = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w + n * ldw + k), acc[0][n]);
    } else {  // each weight vector loaded once for the MR rows (pinned: not a memory operand per fma)
      __m256 xv[MR];
      GPTC_UNROLL for (int m = 0; m < MR; ++m) {
        xv[m] = _mm256_loadu_ps(x + m * K + k);
        GPTC_PIN(xv[m]);
      }
      GPTC_UNROLL for (int n = 0; n < NR; ++n) {
        __m256 wv = _mm256_loadu_ps(w + n * ldw + k);
        GPTC_PIN(wv);
        GPTC_UNROLL for (int m = 0; m < MR; ++m) acc[m][n] = _mm256_fmadd_ps(xv[m], wv, acc[m][n]);
      }
    }
  }
  GPTC_UNROLL for (int m = 0; m < MR; ++m)
    GPTC_UNROLL for (int n = 0; n < NR; ++n) {
      float s = hsum(acc[m][n]);
      for (int64_t kk = k; kk < K; ++kk) s = std::fma(x[m * K + kk], w[n * ldw + kk], s);
      y[m * ldm + n * ldy] = s + (bias ? bias[n * ldy] : 0.f);
    }
}

// NR float weight rows (ldw apart) against all M input rows (K apart), GEMV_MR_F at a time; the
// outputs as float_gemv_tile's (row m's at y + m * ldm).
template <int NR>
inline void float_gemv_rows(const float* x, int64_t M, const float* w, int64_t ldw, int64_t K, float* y,
                            int64_t ldy, const float* bias, int64_t ldm) {
  int64_t m = 0;
  for (; m + GEMV_MR_F <= M; m += GEMV_MR_F)
    float_gemv_tile<NR, GEMV_MR_F>(x + m * K, w, ldw, K, y + m * ldm, ldy, bias, ldm);
  switch (M - m) {
    case 3: float_gemv_tile<NR, 3>(x + m * K, w, ldw, K, y + m * ldm, ldy, bias, ldm); break;
    case 2: float_gemv_tile<NR, 2>(x + m * K, w, ldw, K, y + m * ldm, ldy, bias, ldm); break;
    case 1: float_gemv_tile<NR, 1>(x + m * K, w, ldw, K, y + m * ldm, ldy, bias, ldm); break;
    default: break;
  }
}

// NR int weight rows (NR = 4 or 1; codes ldq bytes apart, scales lds apart; I4: packed int4)
// against the int8 input (xq its codes, ax their magnitudes (int8 weights only), sx its block
// scales): the contract's arithmetic (gptc_tiles.h): per row, each block's exact int32 dot, one
// fma of it times the block's scale product into the row's float sum, in block order. Four rows'
// 32-code dots are reduced to their totals together (totals4: three hadds for the four rows, then
// one 4-lane convert and fma), not a convert and an fma of 8 lanes per row and block: on CPUs
// whose 256-bit integer multiplies are two uops on one pipe, that is what the GEMV is bound by.
// The four rows' scale products are formed once per call (prod: 4 per block, interleaved); one
// row forms its own block by block.
// int4 (I4) codes stay unsigned (c = w + 8, 0..15): their dot with x needs neither |x| nor
// sign(w, x), and its total less corr[step] (the total of 8 * x over the step, the same for every
// row) is exactly the signed dot.
template <int NR, bool I4>
inline void int_gemv_tile(const int8_t* xq, const int8_t* ax, const int32_t* corr, const float* sx, int64_t nb,
                          int64_t blk, const int8_t* q, int64_t ldq, const float* sw, int64_t lds, float* y,
                          int64_t ldy, const float* bias, float* prod) {
  static_assert(NR == 4 || NR == 1, "int_gemv_tile: 4 rows (totals4) or 1");
  const int64_t K = nb * blk, spb = blk / 32;  // 32-code steps per block
  // prod[4 b + j] = sx[b] * sw[j][b]: 4 blocks at a time, a 128-bit 4 x 4 transpose (on CPUs that
  // split 256-bit ops in two, 8-block 256-bit transposes with a scalar tail are slower).
  if constexpr (NR == 4) {
    int64_t b = 0;
    for (; b + 4 <= nb; b += 4) {
      const __m128 s4 = _mm_loadu_ps(sx + b);
      __m128 v0 = _mm_mul_ps(s4, _mm_loadu_ps(sw + b)), v1 = _mm_mul_ps(s4, _mm_loadu_ps(sw + lds + b));
      __m128 v2 = _mm_mul_ps(s4, _mm_loadu_ps(sw + 2 * lds + b)), v3 = _mm_mul_ps(s4, _mm_loadu_ps(sw + 3 * lds + b));
      _MM_TRANSPOSE4_PS(v0, v1, v2, v3);
      _mm_storeu_ps(prod + 4 * b, v0), _mm_storeu_ps(prod + 4 * b + 4, v1);
      _mm_storeu_ps(prod + 4 * b + 8, v2), _mm_storeu_ps(prod + 4 * b + 12, v3);
    }
    for (; b < nb; ++b)
      for (int j = 0; j < 4; ++j) prod[4 * b + j] = sx[b] * sw[j * lds + b];
  }
  __m128 acc = _mm_setzero_ps();
  __m128i sb = _mm_setzero_si128();  // the block's totals so far (blocks of more than 32 codes)
  int64_t b = 0, left = spb;
  // One 32-code step's totals (lane j: row j's; I4: less the step's correction) into the block's,
  // and at a block's end its fma.
  auto add = [&](__m128i s) {
    if (spb > 1) {
      sb = _mm_add_epi32(sb, s);
      if (--left) return;
      s = sb, sb = _mm_setzero_si128(), left = spb;
    }
    const __m128 p = NR == 4 ? _mm_loadu_ps(prod + 4 * b) : _mm_set_ss(sx[b] * sw[b]);
    acc = _mm_fmadd_ps(_mm_cvtepi32_ps(s), p, acc);
    ++b;
  };
  // The rows' totals of one step's dots (NR == 4: lane j row j's; else lane 0).
  auto totals = [&](__m256i d0, __m256i d1, __m256i d2, __m256i d3) {
    if constexpr (NR == 4) return totals4(d0, d1, d2, d3);
    else return _mm_cvtsi32_si128(total(d0));
  };
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  auto row = [&](int n) { return q + n * ldq; };
  int64_t c = 0;
  if constexpr (I4) {
    // Two steps a 32-byte load: its low nibbles are inputs 0..15 of both steps, its high ones
    // 16..31, so x is rearranged to match (once for every row) instead of the codes in each row;
    // a row's dot has step c's sums in lanes 0-3 and step c + 1's in lanes 4-7 (dot2_u4).
    for (; c + 64 <= K; c += 64) {
      const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + c));
      const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + c + 32));
      const __m256i xa = _mm256_permute2x128_si256(x0, x1, 0x20), xb = _mm256_permute2x128_si256(x0, x1, 0x31);
      __m256i d[4];
      GPTC_UNROLL for (int n = 0; n < NR; ++n) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row(n) + c / 2));
        d[n] = dot2_u4(_mm256_and_si256(v, m4), xa, _mm256_and_si256(_mm256_srli_epi16(v, 4), m4), xb);
      }
      __m128i s0, s1;  // the two steps' totals
      if constexpr (NR == 4) {
        const __m256i h = hadd4(d[0], d[1], d[2], d[3]);  // lanes 0-3 step c's, 4-7 step c + 1's
        s0 = _mm256_castsi256_si128(h), s1 = _mm256_extracti128_si256(h, 1);
      } else {
        s0 = _mm_cvtsi32_si128(total(_mm256_blend_epi32(d[0], _mm256_setzero_si256(), 0xF0)));
        s1 = _mm_cvtsi32_si128(total(_mm256_blend_epi32(d[0], _mm256_setzero_si256(), 0x0F)));
      }
      add(_mm_sub_epi32(s0, _mm_set1_epi32(corr[c / 32])));
      add(_mm_sub_epi32(s1, _mm_set1_epi32(corr[c / 32 + 1])));
    }
  }
  for (; c < K; c += 32) {
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + c));
    __m256i d[4];
    if constexpr (I4) {
      GPTC_UNROLL for (int n = 0; n < NR; ++n) d[n] = dot32_u8(unpack_u4(row(n) + c / 2), xv);
      add(_mm_sub_epi32(totals(d[0], d[NR > 1 ? 1 : 0], d[NR > 1 ? 2 : 0], d[NR > 1 ? 3 : 0]),
                        _mm_set1_epi32(corr[c / 32])));
    } else {
      const __m256i av = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ax + c));
      if ((c & 63) == 0)  // a line a row every other step, GEMV_AHEAD_I8 ahead
        GPTC_UNROLL for (int n = 0; n < NR; ++n)
          _mm_prefetch(reinterpret_cast<const char*>(row(n) + c + GEMV_AHEAD_I8), _MM_HINT_T0);
      GPTC_UNROLL for (int n = 0; n < NR; ++n)
        d[n] = dot32_i8(av, xv, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row(n) + c)));
      add(totals(d[0], d[NR > 1 ? 1 : 0], d[NR > 1 ? 2 : 0], d[NR > 1 ? 3 : 0]));
    }
  }
  alignas(16) float out[4];
  _mm_store_ps(out, acc);
  GPTC_UNROLL for (int n = 0; n < NR; ++n) y[n * ldy] = out[n] + (bias ? bias[n * ldy] : 0.f);
}

// Rows [n0, n0 + nr) of an int layer into t, 4 streams (see above); prod: 4 per block.
template <bool I4>
void int_gemv(const LinearWeights& L, const LinearInputs& in, const int8_t* ax, const int32_t* corr, int64_t n0,
              int64_t nr, float* t, Scratch& sc) {
  const int64_t K = L.k, nb = K / L.blk, ldq = I4 ? K / 2 : K;
  float* prod = grow(sc.tile, size_t(4 * nb));
  const int8_t* q = L.wq + n0 * ldq;
  const float* sw = L.scale + n0 * nb;
  const float* bias = L.bias ? L.bias + n0 : nullptr;
  auto at = [&](int64_t n) { return bias ? bias + n : nullptr; };
  gemv_streams<GEMV_NR_I>(
      nr,
      [&](int64_t i, int64_t R) {
        int_gemv_tile<GEMV_NR_I, I4>(in.xq, ax, corr, in.sx, nb, L.blk, q + i * ldq, R * ldq, sw + i * nb, R * nb,
                                     t + i, R, at(i), prod);
      },
      [&](int64_t n) {
        int_gemv_tile<1, I4>(in.xq, ax, corr, in.sx, nb, L.blk, q + n * ldq, ldq, sw + n * nb, nb, t + n, 1, at(n),
                             prod);
      });
}
#endif

// Rows [r0, r1) of y (M input rows, ldy apart) = epilogue(x @ W^T + bias): linear_block's
// epilogue (`act`, + res in y's layout, res may be y), the range's rows in NR streams. Only where
// gemv_ok.
void gemv_rows(const LinearWeights& L, const LinearInputs& in, int64_t M, int64_t r0, int64_t r1, float* y,
               int64_t ldy, const float* res, int act, Scratch& sc) {
#if defined(__AVX2__)
  const int64_t K = L.k, nr = r1 - r0;
  if (nr <= 0) return;
  const int8_t* ax = nullptr;
  const int32_t* corr = nullptr;
  if (L.bits == 4) {  // each 32-code step's total of dot32_u8(8, x) (int_gemv_tile), shared by every row
    thread_local std::vector<int32_t> t_corr;
    int32_t* cr = grow(t_corr, size_t(K / 32));
    for (int64_t c = 0; c < K; c += 32)
      cr[c / 32] =
          total(dot32_u8(_mm256_set1_epi8(8), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in.xq + c))));
    corr = cr;
  } else if (L.bits != 32) {  // |x| codes, shared by every row
    thread_local std::vector<int8_t> t_abs;
    int8_t* a = grow(t_abs, size_t(K));
    for (int64_t c = 0; c < K; c += 32) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in.xq + c));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(a + c), _mm256_sign_epi8(xv, xv));
    }
    ax = a;
  }
  float* t = grow(sc.gemv, size_t(M * nr));  // the range's x @ W^T + bias: M rows of nr, in row order
  if (L.bits == 32) {
    const float* w = L.wf + r0 * K;
    const float* bias = L.bias ? L.bias + r0 : nullptr;
    auto at = [&](int64_t n) { return bias ? bias + n : nullptr; };
    auto streams = [&](auto streams_c) {  // NR streams of the range's rows, every input row a pass
      constexpr int NR = decltype(streams_c)::value;
      gemv_streams<NR>(
          nr, [&](int64_t i, int64_t R) { float_gemv_rows<NR>(in.x, M, w + i * K, R * K, K, t + i, R, at(i), nr); },
          [&](int64_t n) { float_gemv_rows<1>(in.x, M, w + n * K, K, K, t + n, 1, at(n), nr); });
    };
    if (M == 1)
      streams(std::integral_constant<int, GEMV_NR_F>());
    else
      streams(std::integral_constant<int, GEMV_NR_FM>());
  } else if (L.bits == 4) {
    int_gemv<true>(L, in, ax, corr, r0, nr, t, sc);
  } else {
    int_gemv<false>(L, in, ax, nullptr, r0, nr, t, sc);
  }
  if (act >= 0) activate(t, M * nr, act);
  for (int64_t m = 0; m < M; ++m) {
    const float* tm = t + m * nr;
    float* ym = y + m * ldy + r0;
    const float* rm = res != nullptr ? res + m * ldy + r0 : nullptr;
    for (int64_t n = 0; n < nr; ++n) ym[n] = rm != nullptr ? rm[n] + tm[n] : tm[n];
  }
#endif
}

// y (1, N) = epilogue(x @ W^T + bias), grabs of GEMV_ROWS rows shared out among the threads of
// the enclosing region as they come for them (up to about 16 grabs per thread, each but the
// last at least GEMV_GRAB_BYTES of weights): a thread that a busy machine delays, or that joins the region
// late (woken from its sleep between ops), leaves its share to the others instead of making them
// wait at the barrier. Each grab is read as NR streams (gemv_rows), which the prefetchers need a
// few lines of to lock on: streams of a few KB (64 rows of int8 codes at K = 384) are too short,
// hence the least grab of GEMV_GRAB_BYTES. Which thread computes an output never changes its value.
constexpr int64_t GEMV_GRAB_BYTES = 64 << 10;
void gemv_for(const LinearWeights& L, const LinearInputs& in, int64_t M, float* y, const float* res, int act) {
  const int64_t chunks = (L.n + GEMV_ROWS - 1) / GEMV_ROWS;
  const int64_t row_bytes = L.bits == 32 ? 4 * L.k : L.k * L.bits / 8 + 4 * (L.k / L.blk);
  const int64_t least = (GEMV_GRAB_BYTES + GEMV_ROWS * row_bytes - 1) / (GEMV_ROWS * row_bytes);
  const int64_t rows = GEMV_ROWS * std::max<int64_t>({1, least, chunks / (16 * omp_get_num_threads())});
  const int64_t grabs = (L.n + rows - 1) / rows;
  Scratch& sc = t_scratch;
#pragma omp for schedule(dynamic, 1)
  for (int64_t g = 0; g < grabs; ++g)
    gemv_rows(L, in, M, g * rows, std::min(L.n, (g + 1) * rows), y, L.n, res, act, sc);
}

}  // namespace

#endif  // GPTC_KERNELS_GPTC_GEMV_H_
