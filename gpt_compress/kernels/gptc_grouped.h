// Int8 weights stored in row groups (weight_format::kInt8Grouped): the layout the exporter writes
// for an int8 Linear whose inputs are int8 too, so that every M (the GEMV of a decode step, a
// batch, a verify step, a prefill) reads the stored bytes straight into vpdpbusd's vector operand,
// with no packing per call and no horizontal sum:
//   codes: groups of 48 weight rows (the last one padded with zero codes); group g, step j (inputs
//     4j..4j+3) is 192 bytes at (g * K / 4 + j) * 192, bytes 4i..4i+3 holding row 48g + i's four
//     codes, each + 128 (0..255: vpdpbusd's unsigned operand, as stored): three registers of 16
//     rows a step, and a group's codes one sequential stream (the next group's follow it);
//   scales: group g, block b is 48 floats at (g * nb + b) * 48 (zeros for the padded rows).
// A register of 16 rows' four codes times an input row's four codes (broadcast) accumulates 16
// outputs' dots at once. The + 128 adds 128 times the input codes' sum: each accumulator starts
// at -128 times that sum over the block (GroupedInputs), so it ends at the exact int32 dot of
// the block. Then one convert and one fma per block, float(dot) times sx * sw, into the output's
// float sum, in block order, + bias at the end: each output's arithmetic is the other int paths'
// (gptc_ops.cc's head comment), so its values are bitwise theirs, on every ISA and M.
// AVX2 builds without VNNI read the same bytes with maddubs: the codes back to signed (xor 0x80)
// take the input's signs, |x| is the unsigned operand (pairs below 2^15: exact), no start.
// Part of the one translation unit gptc_ops.cc (included there in order; formats and contract: its head comment).
#ifndef GPTC_KERNELS_GPTC_GROUPED_H_
#define GPTC_KERNELS_GPTC_GROUPED_H_

#include "gptc_gemm512.h"
#include "gptc_inputs.h"
#include "gptc_tiles.h"

namespace {

constexpr int GROUP_ROWS = weight_format::kGroupRows;  // a group: linear_for's unit of work
constexpr int GROUP_REGS = GROUP_ROWS / 16;            // 16-row registers a step
constexpr int64_t GROUP_STEP = 4 * GROUP_ROWS;         // bytes of a step
static_assert(GROUP_ROWS == 48, "three registers of 16 rows a step");
// A pass over a group's codes for up to 8 input rows (AVX2: the group's first pass) prefetches the
// codes and scales this many groups ahead into L2, spread over the pass: at few rows it is
// memory-bound, and the hardware prefetchers alone leave the loads behind (as in the GEMV,
// gptc_gemv.h); two groups ahead measured slower than one.
constexpr int64_t GROUPED_AHEAD_GROUPS = 1;

// 256-bit vpdpbusd (dot32_u8's VNNI form): the AVX2 kernels' unsigned operand is the codes as stored.
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
#define GPTC_GROUPED_VNNI256 1
#endif
#if defined(GPTC_VNNI512) || defined(GPTC_GROUPED_VNNI256)
constexpr bool kGroupedStart = true;  // vpdpbusd of the + 128 codes: accumulators start at -128 * sum(x)
#else
constexpr bool kGroupedStart = false;  // signed codes (maddubs, scalar): they start at zero
#endif

// The int8 inputs of a grouped Linear: codes xq (M, K), scales sx (M, nb) and the accumulators'
// starts st (M, nb: -128 times the block's code sum; null where kGroupedStart is false).
struct GroupedInputs {
  const int8_t* xq;
  const float* sx;
  const int32_t* st;
};

inline const int32_t* grouped_starts(const int8_t* xq, int64_t M, int64_t K, int64_t blk, int32_t* st) {
  if (!kGroupedStart) return nullptr;
  const int64_t nb = K / blk;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < nb; ++b) {
      int32_t t = 0;
      for (int64_t j = 0; j < blk; ++j) t += xq[m * K + b * blk + j];
      st[m * nb + b] = -128 * t;
    }
  return st;
}

#if defined(GPTC_VNNI512)
// R <= 4 input rows x a group's three 16-row registers: yr[r][0..48). codes, sw: the group's codes
// and scales; bias: its 48 values. Registers: 3 R int32 accumulators and float sums, 3 weight
// vectors, one broadcast input; prefetches as GROUPED_AHEAD_GROUPS says.
template <int R>
inline void grouped_tile512(const GroupedInputs& in, const int64_t* rows, int64_t K, int64_t nb, int64_t blk,
                            const int8_t* codes, const float* sw, float* const* yr, const float* bias) {
  constexpr int C = GROUP_REGS;
  const int64_t steps = blk / 4, ahead = GROUPED_AHEAD_GROUPS * GROUP_ROWS * K;
  __m512 f[R][C];
  GPTC_UNROLL for (int r = 0; r < R; ++r)
    GPTC_UNROLL for (int c = 0; c < C; ++c) f[r][c] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512i acc[R][C];
    GPTC_UNROLL for (int r = 0; r < R; ++r) {
      const __m512i s0 = _mm512_set1_epi32(in.st[rows[r] * nb + b]);
      GPTC_UNROLL for (int c = 0; c < C; ++c) acc[r][c] = s0;
    }
    const int8_t* cb = codes + b * steps * GROUP_STEP;
    GPTC_UNROLL for (int c = 0; c < C; ++c)
      _mm_prefetch(reinterpret_cast<const char*>(sw + (nb + b) * GROUP_ROWS + 16 * c), _MM_HINT_T1);
    for (int64_t j = 0; j < steps; ++j) {
      const int8_t* cj = cb + j * GROUP_STEP;
      GPTC_UNROLL for (int c = 0; c < C; ++c) _mm_prefetch(reinterpret_cast<const char*>(cj) + ahead + 64 * c, _MM_HINT_T1);
      __m512i w[C];
      GPTC_UNROLL for (int c = 0; c < C; ++c) w[c] = _mm512_loadu_si512(cj + 64 * c);
      GPTC_UNROLL for (int r = 0; r < R; ++r) {
        int32_t v;
        std::memcpy(&v, in.xq + rows[r] * K + b * blk + 4 * j, 4);
        const __m512i xb = _mm512_set1_epi32(v);
        GPTC_UNROLL for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbusd_epi32(acc[r][c], w[c], xb);
      }
    }
    GPTC_UNROLL for (int c = 0; c < C; ++c) {
      const __m512 ws = _mm512_loadu_ps(sw + b * GROUP_ROWS + 16 * c);
      GPTC_UNROLL for (int r = 0; r < R; ++r)
        f[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][c]),
                                  _mm512_mul_ps(_mm512_set1_ps(in.sx[rows[r] * nb + b]), ws), f[r][c]);
    }
  }
  GPTC_UNROLL for (int c = 0; c < C; ++c) {
    const __m512 bv = _mm512_loadu_ps(bias + 16 * c);
    GPTC_UNROLL for (int r = 0; r < R; ++r) _mm512_storeu_ps(yr[r] + 16 * c, _mm512_add_ps(f[r][c], bv));
  }
}

// R = 5 to 8 input rows x a group's three registers, in one pass over its codes (each load
// feeding R rows), prefetching as grouped_tile512: the 3 R accumulators named and pinned to
// registers (zmm4-27: an array of them is kept in memory, or copied around each vpdpbusd); the
// float sums wait in yr (48 floats a row, an exact store and load per block), + bias after the
// last block. R is exact (no padded rows): at few rows the vpdpbusd issue is the cost, so a
// verify step of 6 rows pays for 6, not 8.
#define GPTC_ACCS3(r, z0, z1, z2)                                                              \
  register __m512i d##r##0 asm(z0) = _mm512_set1_epi32(in.st[rows[r] * nb + b]), d##r##1 asm(z1) = d##r##0; \
  register __m512i d##r##2 asm(z2) = d##r##0;
template <int R>
inline void grouped_tile512_rx3(const GroupedInputs& in, const int64_t* rows, int64_t K, int64_t nb, int64_t blk,
                                const int8_t* codes, const float* sw, float* const* yr, const float* bias) {
  static_assert(R >= 5 && R <= 8, "grouped_tile512_rx3: 5 to 8 rows (fewer: grouped_tile512)");
  const int64_t steps = blk / 4, ahead = GROUPED_AHEAD_GROUPS * GROUP_ROWS * K;
  const int8_t *x0 = in.xq + rows[0] * K, *x1 = in.xq + rows[1] * K, *x2 = in.xq + rows[2] * K, *x3 = in.xq + rows[3] * K;
  const int8_t *x4 = in.xq + rows[4] * K, *x5 = in.xq + rows[5] * K, *x6 = in.xq + rows[6] * K, *x7 = in.xq + rows[7] * K;
  for (int r = 0; r < R; ++r) std::memset(yr[r], 0, GROUP_ROWS * sizeof(float));
  for (int64_t b = 0; b < nb; ++b) {
    GPTC_ACCS3(0, "zmm4", "zmm5", "zmm6")
    GPTC_ACCS3(1, "zmm7", "zmm8", "zmm9")
    GPTC_ACCS3(2, "zmm10", "zmm11", "zmm12")
    GPTC_ACCS3(3, "zmm13", "zmm14", "zmm15")
    GPTC_ACCS3(4, "zmm16", "zmm17", "zmm18")
    GPTC_ACCS3(5, "zmm19", "zmm20", "zmm21")
    GPTC_ACCS3(6, "zmm22", "zmm23", "zmm24")
    GPTC_ACCS3(7, "zmm25", "zmm26", "zmm27")
    GPTC_UNROLL for (int c = 0; c < GROUP_REGS; ++c)
      _mm_prefetch(reinterpret_cast<const char*>(sw + (nb + b) * GROUP_ROWS + 16 * c), _MM_HINT_T1);
    const int8_t* cb = codes + b * steps * GROUP_STEP;
    const int64_t o = b * blk;
    for (int64_t j = 0; j < steps; ++j, cb += GROUP_STEP) {
      GPTC_UNROLL for (int c = 0; c < GROUP_REGS; ++c) _mm_prefetch(reinterpret_cast<const char*>(cb) + ahead + 64 * c, _MM_HINT_T1);
      const __m512i w0 = _mm512_loadu_si512(cb), w1 = _mm512_loadu_si512(cb + 64), w2 = _mm512_loadu_si512(cb + 128);
      int32_t v;
#define GPTC_GROUP_ROW(x, a0, a1, a2)                \
  {                                                 \
    std::memcpy(&v, x + o + 4 * j, 4);              \
    const __m512i xv = _mm512_set1_epi32(v);        \
    GPTC_DOT3(a0, a1, a2, w0, w1, w2, xv, xv, xv)   \
  }
      GPTC_GROUP_ROW(x0, d00, d01, d02)
      GPTC_GROUP_ROW(x1, d10, d11, d12)
      GPTC_GROUP_ROW(x2, d20, d21, d22)
      GPTC_GROUP_ROW(x3, d30, d31, d32)
      GPTC_GROUP_ROW(x4, d40, d41, d42)
      if constexpr (R > 5) GPTC_GROUP_ROW(x5, d50, d51, d52)
      if constexpr (R > 6) GPTC_GROUP_ROW(x6, d60, d61, d62)
      if constexpr (R > 7) GPTC_GROUP_ROW(x7, d70, d71, d72)
#undef GPTC_GROUP_ROW
    }
    const __m512 w0 = _mm512_loadu_ps(sw + b * GROUP_ROWS), w1 = _mm512_loadu_ps(sw + b * GROUP_ROWS + 16);
    const __m512 w2 = _mm512_loadu_ps(sw + b * GROUP_ROWS + 32);
#define GPTC_GROUP_SUMS(r)                                                                                  \
  {                                                                                                         \
    __m512 f0 = _mm512_loadu_ps(yr[r]), f1 = _mm512_loadu_ps(yr[r] + 16), f2 = _mm512_loadu_ps(yr[r] + 32); \
    GPTC_FMA3(_mm512_set1_ps(in.sx[rows[r] * nb + b]), d##r##0, d##r##1, d##r##2, f0, f1, f2)              \
    _mm512_storeu_ps(yr[r], f0), _mm512_storeu_ps(yr[r] + 16, f1), _mm512_storeu_ps(yr[r] + 32, f2);         \
  }
    GPTC_GROUP_SUMS(0) GPTC_GROUP_SUMS(1) GPTC_GROUP_SUMS(2) GPTC_GROUP_SUMS(3) GPTC_GROUP_SUMS(4)
    if constexpr (R > 5) GPTC_GROUP_SUMS(5)
    if constexpr (R > 6) GPTC_GROUP_SUMS(6)
    if constexpr (R > 7) GPTC_GROUP_SUMS(7)
#undef GPTC_GROUP_SUMS
  }
  GPTC_UNROLL for (int r = 0; r < R; ++r)
    GPTC_UNROLL for (int c = 0; c < GROUP_REGS; ++c)
      _mm512_storeu_ps(yr[r] + 16 * c, _mm512_add_ps(_mm512_loadu_ps(yr[r] + 16 * c), _mm512_loadu_ps(bias + 16 * c)));
}
#undef GPTC_ACCS3

// One group's 48 rows against the M <= 8 input rows: y[m][0..48). 5 to 8 rows take the R x 3
// kernel (the group's codes read once, each load feeding every row); fewer take the R x 3 tiles.
inline void grouped_group(const GroupedInputs& in, int64_t M, int64_t K, int64_t nb, int64_t blk, const int8_t* codes,
                          const float* sw, const float* bias, float (*y)[GROUP_ROWS], int64_t m0) {
  int64_t rows[8];
  float* yr[8];
  for (int r = 0; r < 8; ++r) {  // past M: the last row again (read by no kernel of M rows)
    rows[r] = m0 + std::min<int64_t>(r, M - 1);
    yr[r] = y[std::min<int64_t>(r, M - 1)];
  }
  switch (M) {
    case 8: grouped_tile512_rx3<8>(in, rows, K, nb, blk, codes, sw, yr, bias); break;
    case 7: grouped_tile512_rx3<7>(in, rows, K, nb, blk, codes, sw, yr, bias); break;
    case 6: grouped_tile512_rx3<6>(in, rows, K, nb, blk, codes, sw, yr, bias); break;
    case 5: grouped_tile512_rx3<5>(in, rows, K, nb, blk, codes, sw, yr, bias); break;
    case 4: grouped_tile512<4>(in, rows, K, nb, blk, codes, sw, yr, bias); break;
    case 3: grouped_tile512<3>(in, rows, K, nb, blk, codes, sw, yr, bias); break;
    case 2: grouped_tile512<2>(in, rows, K, nb, blk, codes, sw, yr, bias); break;
    default: grouped_tile512<1>(in, rows, K, nb, blk, codes, sw, yr, bias); break;
  }
}
#elif defined(__AVX2__)
// R input rows x C of a group's 16-row registers from register c0 (two 8-row halves each):
// yr[r][16 c0..16 (c0 + C)); as grouped_tile512 (PF: the group's first pass, prefetching as it
// does). One row takes all three registers a step (the input broadcast and its |x| made once).
template <int R, int C, bool PF>
inline void grouped_tile256(const GroupedInputs& in, const int64_t* rows, int64_t K, int64_t nb, int64_t blk,
                            const int8_t* codes, const float* sw, int c0, float* const* yr, const float* bias) {
  const int64_t steps = blk / 4, ahead = GROUPED_AHEAD_GROUPS * GROUP_ROWS * K;
  __m256 f[R][2 * C];
  GPTC_UNROLL for (int r = 0; r < R; ++r)
    GPTC_UNROLL for (int h = 0; h < 2 * C; ++h) f[r][h] = _mm256_setzero_ps();
#if !defined(GPTC_GROUPED_VNNI256)
  const __m256i flip = _mm256_set1_epi8(char(0x80)), ones = _mm256_set1_epi16(1);
#endif
  for (int64_t b = 0; b < nb; ++b) {
    __m256i acc[R][2 * C];
    GPTC_UNROLL for (int r = 0; r < R; ++r) {
      const __m256i s0 = _mm256_set1_epi32(in.st != nullptr ? in.st[rows[r] * nb + b] : 0);
      GPTC_UNROLL for (int h = 0; h < 2 * C; ++h) acc[r][h] = s0;
    }
    const int8_t* cb = codes + b * steps * GROUP_STEP + 64 * c0;
    if constexpr (PF)  // the next group's scales
      GPTC_UNROLL for (int l = 0; l < GROUP_REGS; ++l)
        _mm_prefetch(reinterpret_cast<const char*>(sw + (nb + b) * GROUP_ROWS + 16 * l), _MM_HINT_T1);
    for (int64_t j = 0; j < steps; ++j) {
      if constexpr (PF)
        GPTC_UNROLL for (int l = 0; l < GROUP_REGS; ++l)
          _mm_prefetch(reinterpret_cast<const char*>(codes + (b * steps + j) * GROUP_STEP) + ahead + 64 * l, _MM_HINT_T1);
      __m256i xb[R];
      GPTC_UNROLL for (int r = 0; r < R; ++r) {
        int32_t v;
        std::memcpy(&v, in.xq + rows[r] * K + b * blk + 4 * j, 4);
        xb[r] = _mm256_set1_epi32(v);
      }
#if !defined(GPTC_GROUPED_VNNI256)
      __m256i ax[R];
      GPTC_UNROLL for (int r = 0; r < R; ++r) ax[r] = _mm256_abs_epi8(xb[r]);
#endif
      GPTC_UNROLL for (int h = 0; h < 2 * C; ++h) {
        __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cb + j * GROUP_STEP + 32 * h));
#if defined(GPTC_GROUPED_VNNI256)
        GPTC_UNROLL for (int r = 0; r < R; ++r) acc[r][h] = _mm256_add_epi32(acc[r][h], dot32_u8(w, xb[r]));
#else
        w = _mm256_xor_si256(w, flip);  // signed codes
        GPTC_UNROLL for (int r = 0; r < R; ++r)
          acc[r][h] = _mm256_add_epi32(acc[r][h],
                                       _mm256_madd_epi16(_mm256_maddubs_epi16(ax[r], _mm256_sign_epi8(w, xb[r])), ones));
#endif
      }
    }
    const float* sb = sw + b * GROUP_ROWS + 16 * c0;
    GPTC_UNROLL for (int h = 0; h < 2 * C; ++h) {
      const __m256 ws = _mm256_loadu_ps(sb + 8 * h);
      GPTC_UNROLL for (int r = 0; r < R; ++r)
        f[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][h]),
                                  _mm256_mul_ps(_mm256_set1_ps(in.sx[rows[r] * nb + b]), ws), f[r][h]);
    }
  }
  GPTC_UNROLL for (int r = 0; r < R; ++r)
    GPTC_UNROLL for (int h = 0; h < 2 * C; ++h)
      _mm256_storeu_ps(yr[r] + 16 * c0 + 8 * h, _mm256_add_ps(f[r][h], _mm256_loadu_ps(bias + 16 * c0 + 8 * h)));
}

// One group's 48 rows against the M input rows: y[m][0..48), two input rows a register at a
// time, a last single row all three registers at once.
inline void grouped_group(const GroupedInputs& in, int64_t M, int64_t K, int64_t nb, int64_t blk, const int8_t* codes,
                          const float* sw, const float* bias, float (*y)[GROUP_ROWS], int64_t m0) {
  for (int64_t m = 0; m < M; m += 2) {
    const int64_t rows[2] = {m0 + m, m0 + std::min(m + 1, M - 1)};
    float* yr[2] = {y[m], y[std::min(m + 1, M - 1)]};
    if (m + 1 == M) {
      m == 0 ? grouped_tile256<1, GROUP_REGS, true>(in, rows, K, nb, blk, codes, sw, 0, yr, bias)
             : grouped_tile256<1, GROUP_REGS, false>(in, rows, K, nb, blk, codes, sw, 0, yr, bias);
      continue;
    }
    for (int c = 0; c < GROUP_REGS; ++c)
      m == 0 && c == 0 ? grouped_tile256<2, 1, true>(in, rows, K, nb, blk, codes, sw, c, yr, bias)
                       : grouped_tile256<2, 1, false>(in, rows, K, nb, blk, codes, sw, c, yr, bias);
  }
}
#else
// Scalar: the same values, output by output.
inline void grouped_group(const GroupedInputs& in, int64_t M, int64_t K, int64_t nb, int64_t blk, const int8_t* codes,
                          const float* sw, const float* bias, float (*y)[GROUP_ROWS], int64_t m0) {
  for (int64_t m = 0; m < M; ++m)
    for (int i = 0; i < GROUP_ROWS; ++i) {
      float acc = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        int32_t d = 0;
        for (int64_t k = b * blk; k < (b + 1) * blk; ++k)
          d += (int32_t(uint8_t(codes[(k / 4) * GROUP_STEP + 4 * i + k % 4])) - 128) * int32_t(in.xq[(m0 + m) * K + k]);
        acc = std::fma(float(d), in.sx[(m0 + m) * nb + b] * sw[b * GROUP_ROWS + i], acc);
      }
      y[m][i] = acc + bias[i];
    }
}
#endif

// Weight rows [n0, n0 + nr) of a grouped Linear (L.grouped) against all M input rows into y
// (M rows, ldy apart; y[m * ldy + n - n0]): each group that holds some of them, whole, in panels
// of up to 8 input rows (a group starting at n0 into rows of 48 fills all 48: linear_block's tile).
void grouped_block(const LinearWeights& L, const GroupedInputs& in, int64_t M, int64_t n0, int nr, float* y,
                   int64_t ldy) {
  const int64_t K = L.k, nb = K / L.blk;
  alignas(64) float out[8][GROUP_ROWS];
  for (int64_t g = n0 / GROUP_ROWS; g * GROUP_ROWS < n0 + nr; ++g) {
    const int64_t first = g * GROUP_ROWS;
    alignas(64) float bias[GROUP_ROWS];
    for (int i = 0; i < GROUP_ROWS; ++i) bias[i] = L.bias != nullptr && first + i < L.n ? L.bias[first + i] : 0.f;
    const int64_t lo = std::max(n0, first), hi = std::min(n0 + nr, first + GROUP_ROWS);  // the rows kept
    // A whole group into rows of 48 (linear_block's tile) is written in place; otherwise through out.
    const bool direct = first == n0 && ldy == GROUP_ROWS;
    for (int64_t m0 = 0; m0 < M; m0 += 8) {
      const int64_t mp = std::min<int64_t>(8, M - m0);
      float(*dst)[GROUP_ROWS] = direct ? reinterpret_cast<float(*)[GROUP_ROWS]>(y + m0 * ldy) : out;
      grouped_group(in, mp, K, nb, L.blk, L.wq + first * K, L.scale + first * nb, bias, dst, m0);
      if (!direct)
        for (int64_t m = 0; m < mp; ++m)
          std::memcpy(y + (m0 + m) * ldy + (lo - n0), out[m] + (lo - first), size_t(hi - lo) * sizeof(float));
    }
  }
}

}  // namespace

#endif  // GPTC_KERNELS_GPTC_GROUPED_H_
