// The GEMV kernels (M = 1: batch-1 decode) and the Linear entry points that choose between them
// and the blocks (linear_rows, linear_for, linear).
// Part of the one translation unit gptc_ops.cc (included there in order; formats and contract: its head comment).
#ifndef GPTC_KERNELS_GPTC_GEMV_H_
#define GPTC_KERNELS_GPTC_GEMV_H_

#include "gptc_linear.h"

namespace {

// ------------------------------------------------------------------ M = 1: GEMV (batch-1 decode)
// One input row has kernels of its own. They walk the weight rows straight from the weights (no
// per-block row tables or tile copies), NR rows per pass (independent accumulator chains: the
// fma latency is hidden, the loads stream), step the block index without a division and form
// each pass's scale products sx[b] * sw[n][b] once. An output's arithmetic is the contract above
// (the same operations in the same order as ftile/itile), so its value is bitwise the tiles'
// (tests/test_fused.py: token by token vs one prefill), whichever rows share a pass.
//
// The rows of a pass are far apart, not adjacent: the rows a thread takes at once (a grab of
// gemv_for) are cut into NR equal parts, and pass i takes row i of each part, so the thread
// reads NR sequential streams (each part's rows follow each other in memory), which the
// hardware prefetchers follow on their own, with NR times the requests in flight of one stream. Adjacent rows (one span of NR rows a
// pass) are NR streams that end after one row each: the prefetchers never lock on, and software
// prefetches (which the kernels no longer issue) made up only part of it. Standalone copy
// (/tmp scratch, 2 threads, the weights evicted by a 64 MB read before each run, means of 10,
// AMD EPYC here, outputs bitwise the same): the float32 head (50304 x 384) 4.8-4.9 -> 2.9-3.2 ms,
// a plain read of the same bytes 3.9-4.4 ms in one stream a thread and 2.8-3.4 ms in eight;
// float32 1152 x 384 102 -> 69 us, 384 x 1536 102 -> 77 us.
// AVX2 only; other layers (float-input int weights, K or blocks not in steps of 32) keep the
// blocks above.
constexpr int64_t GEMV_ROWS = 64;  // a grab of gemv_for is a multiple of this many rows
constexpr int GEMV_NR_F = 8;       // float weight rows per pass (streams)
constexpr int GEMV_NR_I = 4;       // int weight rows per pass
// Int weight rows per pass, blocks of 32 (igemv32_tile): 4 streams. In the decode loop (gpt-bench
// int8, GPTC_PROFILE, builds of 4 and 8 alternating, 8 pairs) 4 rows ran the head faster in 6
// pairs (mean 831 vs 954 us) and the blocks' linears too; the int4 head the same either way.
constexpr int GEMV_NR_I32 = 4;

inline bool gemv_ok(const Lin& L, const In& in) {
#if defined(__AVX2__)
  return L.bits == 32 || (in.xq != nullptr && L.k % 32 == 0 && L.blk % 32 == 0);
#else
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
// NR float weight rows (ldw apart) against x: y[n * ldy] = x . w_n + bias[n * ldy].
template <int NR>
inline void fgemv_tile(const float* x, const float* w, int64_t ldw, int64_t K, float* y, int64_t ldy,
                       const float* bias) {
  __m256 acc[NR];
  GPTC_UNROLL for (int n = 0; n < NR; ++n) acc[n] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    const __m256 xv = _mm256_loadu_ps(x + k);
    GPTC_UNROLL for (int n = 0; n < NR; ++n) acc[n] = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w + n * ldw + k), acc[n]);
  }
  GPTC_UNROLL for (int n = 0; n < NR; ++n) {
    float s = hsum(acc[n]);
    for (int64_t kk = k; kk < K; ++kk) s = std::fma(x[kk], w[n * ldw + kk], s);
    y[n * ldy] = s + (bias ? bias[n * ldy] : 0.f);
  }
}

// NR int weight rows (codes ldq bytes apart; I4: packed int4) against the int8 input: xq its
// codes, ax their magnitudes, prod the rows' scale products (row n's at n * ldp); y and bias
// ldy apart. The NR rows' codes are loaded before the dots.
template <int NR, bool I4>
inline void igemv_tile(const int8_t* xq, const int8_t* ax, int64_t nb, int64_t blk, const int8_t* q,
                       int64_t ldq, const float* prod, int64_t ldp, float* y, int64_t ldy, const float* bias) {
  __m256 acc[NR];
  GPTC_UNROLL for (int n = 0; n < NR; ++n) acc[n] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m256 sc[NR];
    GPTC_UNROLL for (int n = 0; n < NR; ++n) sc[n] = _mm256_broadcast_ss(prod + n * ldp + b);
    for (int64_t c = b * blk; c < (b + 1) * blk; c += 32) {
      const int64_t off = I4 ? c / 2 : c;  // byte offset of the 32 codes in a row
      __m256i wv[NR];
      GPTC_UNROLL for (int n = 0; n < NR; ++n) {
        if (I4) {
          const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + n * ldq + off)), m4 = _mm_set1_epi8(0x0F);
          wv[n] = _mm256_sub_epi8(_mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m4), _mm_and_si128(v, m4)),
                                  _mm256_set1_epi8(8));
        } else {
          wv[n] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + n * ldq + off));
        }
      }
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + c));
      const __m256i av = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ax + c));
      GPTC_UNROLL for (int n = 0; n < NR; ++n)
        acc[n] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot32_i8(av, xv, wv[n])), sc[n], acc[n]);
    }
  }
  GPTC_UNROLL for (int n = 0; n < NR; ++n) y[n * ldy] = hsum(acc[n]) + (bias ? bias[n * ldy] : 0.f);
}

// igemv_tile for blocks of 32 inputs (the default format: one 32-code step per block): the block
// loop flat (no inner step loop), two blocks a pass, GEMV_NR_I32 rows. The same operations in the
// same order per output as igemv_tile (bitwise equal). Standalone copy on the AMD EPYC here (one
// core, 1024 x 384 int8 weights in L2, best of 400): 21.9 -> 14.5 us.
// int4 (I4, corr given): a pass's two blocks are one 32-byte load a row, and the codes stay
// unsigned (c = w + 8, 0..15): dot32_u8(c, x) needs neither |x| nor sign(w, x), and each 32-bit
// lane less corr[b]'s (dot32_u8(8, x), the same for every row) is exactly the lane of the signed
// form (maddubs pairs < 2^15 either way), so the outputs are bitwise the same with 2 fewer
// operations a block.
template <int NR, bool I4>
inline void igemv32_tile(const int8_t* xq, const int8_t* ax, int64_t nb, const int8_t* q, int64_t ldq,
                         const float* prod, int64_t ldp, float* y, int64_t ldy, const float* bias,
                         const int32_t* corr = nullptr) {
  __m256 acc[NR];
  GPTC_UNROLL for (int n = 0; n < NR; ++n) acc[n] = _mm256_setzero_ps();
  const __m256i m4 = _mm256_set1_epi8(0x0F), eight = _mm256_set1_epi8(8);
  // corr's lanes of block b
  auto lanes = [&](int64_t b) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(corr + 8 * b)); };
  auto block = [&](int64_t b) {
    const int64_t c = b * 32, off = I4 ? c / 2 : c;
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + c));
    if (I4 && corr != nullptr) {  // the unsigned form (below), one block
      GPTC_UNROLL for (int n = 0; n < NR; ++n) {
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + n * ldq + off));
        const __m256i cv = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), m4);
        const __m256i d = _mm256_sub_epi32(dot32_u8(cv, xv), lanes(b));
        acc[n] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_broadcast_ss(prod + n * ldp + b), acc[n]);
      }
      return;
    }
    const __m256i av = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ax + c));
    GPTC_UNROLL for (int n = 0; n < NR; ++n) {
      __m256i wv;
      if (I4) {
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + n * ldq + off));
        wv = _mm256_sub_epi8(_mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), m4), eight);
      } else {
        wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + n * ldq + off));
      }
      acc[n] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot32_i8(av, xv, wv)), _mm256_broadcast_ss(prod + n * ldp + b),
                               acc[n]);
    }
  };
  int64_t b = 0;
  if (I4 && corr != nullptr) {
    for (; b + 2 <= nb; b += 2) {
      const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * 32));
      const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * 32 + 32));
      GPTC_UNROLL for (int n = 0; n < NR; ++n) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + n * ldq + b * 16));
        const __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
        const __m256i c0 = _mm256_permute2x128_si256(lo, hi, 0x20), c1 = _mm256_permute2x128_si256(lo, hi, 0x31);
        const __m256i d0 = _mm256_sub_epi32(dot32_u8(c0, x0), lanes(b));
        const __m256i d1 = _mm256_sub_epi32(dot32_u8(c1, x1), lanes(b + 1));
        acc[n] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d0), _mm256_broadcast_ss(prod + n * ldp + b), acc[n]);
        acc[n] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d1), _mm256_broadcast_ss(prod + n * ldp + b + 1), acc[n]);
      }
    }
  }
  for (; b + 2 <= nb; b += 2) {
    block(b);
    block(b + 1);
  }
  if (b < nb) block(b);
  GPTC_UNROLL for (int n = 0; n < NR; ++n) y[n * ldy] = hsum(acc[n]) + (bias ? bias[n * ldy] : 0.f);
}

// Rows [n0, n0 + nr) of an int layer into t, NR streams (see above).
template <bool I4>
void igemv(const Lin& L, const In& in, const int8_t* ax, const int32_t* corr, int64_t n0, int64_t nr, float* t,
           Scratch& sc) {
  const int64_t K = L.k, nb = K / L.blk, ldq = I4 ? K / 2 : K;
  float* prod = grow(sc.tile, size_t(nr * nb));  // the scale products of the nr rows
  for (int64_t n = 0; n < nr; ++n) {
    const float* sw = L.scale + (n0 + n) * nb;
    int64_t b = 0;
    for (; b + 8 <= nb; b += 8)
      _mm256_storeu_ps(prod + n * nb + b, _mm256_mul_ps(_mm256_loadu_ps(in.sx + b), _mm256_loadu_ps(sw + b)));
    for (; b < nb; ++b) prod[n * nb + b] = in.sx[b] * sw[b];
  }
  const int8_t* q = L.wq + n0 * ldq;
  const float* bias = L.bias ? L.bias + n0 : nullptr;
  auto at = [&](int64_t n) { return bias ? bias + n : nullptr; };
  if (L.blk == 32) {
    gemv_streams<GEMV_NR_I32>(
        nr,
        [&](int64_t i, int64_t R) {
          igemv32_tile<GEMV_NR_I32, I4>(in.xq, ax, nb, q + i * ldq, R * ldq, prod + i * nb, R * nb, t + i, R, at(i),
                                        corr);
        },
        [&](int64_t n) {
          igemv32_tile<1, I4>(in.xq, ax, nb, q + n * ldq, ldq, prod + n * nb, nb, t + n, 1, at(n), corr);
        });
    return;
  }
  gemv_streams<GEMV_NR_I>(
      nr,
      [&](int64_t i, int64_t R) {
        igemv_tile<GEMV_NR_I, I4>(in.xq, ax, nb, L.blk, q + i * ldq, R * ldq, prod + i * nb, R * nb, t + i, R, at(i));
      },
      [&](int64_t n) { igemv_tile<1, I4>(in.xq, ax, nb, L.blk, q + n * ldq, ldq, prod + n * nb, nb, t + n, 1, at(n)); });
}
#endif

// Rows [r0, r1) of y (one input row) = epilogue(x @ W^T + bias): linear_block's epilogue (`act`,
// + res, res may be y), the range's rows in NR streams. Only where gemv_ok.
void gemv_rows(const Lin& L, const In& in, int64_t r0, int64_t r1, float* y, const float* res, int act,
               Scratch& sc) {
#if defined(__AVX2__)
  const int64_t K = L.k, nr = r1 - r0;
  if (nr <= 0) return;
  const int8_t* ax = nullptr;
  const int32_t* corr = nullptr;
  if (L.bits == 4 && L.blk == 32) {  // dot32_u8(8, x), a block each (igemv32_tile), shared by every row
    thread_local std::vector<int32_t> t_corr;  // 8 lanes a block
    int32_t* cr = grow(t_corr, size_t(K / 4));
    for (int64_t c = 0; c < K; c += 32)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(cr + c / 4),
                          dot32_u8(_mm256_set1_epi8(8), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in.xq + c))));
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
  float* t = grow(sc.gemv, size_t(nr));  // the range's x @ W^T + bias, in row order
  if (L.bits == 32) {
    constexpr int NR = GEMV_NR_F;
    const float* w = L.wf + r0 * K;
    const float* bias = L.bias ? L.bias + r0 : nullptr;
    auto at = [&](int64_t n) { return bias ? bias + n : nullptr; };
    gemv_streams<NR>(
        nr, [&](int64_t i, int64_t R) { fgemv_tile<NR>(in.x, w + i * K, R * K, K, t + i, R, at(i)); },
        [&](int64_t n) { fgemv_tile<1>(in.x, w + n * K, K, K, t + n, 1, at(n)); });
  } else if (L.bits == 4) {
    igemv<true>(L, in, ax, corr, r0, nr, t, sc);
  } else {
    igemv<false>(L, in, ax, nullptr, r0, nr, t, sc);
  }
  if (act >= 0) activate(t, nr, act);
  for (int64_t n = 0; n < nr; ++n) y[r0 + n] = res != nullptr ? res[r0 + n] + t[n] : t[n];
#endif
}

// y (1, N) = epilogue(x @ W^T + bias), grabs of GEMV_ROWS rows shared out among the threads of
// the enclosing region as they come for them (about 16 grabs per thread, each at least
// GEMV_GRAB_BYTES of weights): a thread that a busy machine delays, or that joins the region
// late (woken from its sleep between ops), leaves its share to the others instead of making them
// wait at the barrier. Each grab is read as NR streams (gemv_rows), which the prefetchers need a
// few lines of to lock on: streams of a few KB (64 rows of int8 codes at K = 384) ran the
// 1536 x 384 int8 weights from DRAM in 47-63 us, 192-384-row grabs in 36-49 (standalone copy,
// 4 alternating runs). Which thread computes an output never changes its value.
constexpr int64_t GEMV_GRAB_BYTES = 64 << 10;
void gemv_for(const Lin& L, const In& in, float* y, const float* res, int act) {
  const int64_t chunks = (L.n + GEMV_ROWS - 1) / GEMV_ROWS;
  const int64_t row_bytes = L.bits == 32 ? 4 * L.k : L.k * L.bits / 8 + 4 * (L.k / L.blk);
  const int64_t least = (GEMV_GRAB_BYTES + GEMV_ROWS * row_bytes - 1) / (GEMV_ROWS * row_bytes);
  const int64_t rows = GEMV_ROWS * std::max<int64_t>({1, least, chunks / (16 * omp_get_num_threads())});
  const int64_t grabs = (L.n + rows - 1) / rows;
  Scratch& sc = t_scratch;
#pragma omp for schedule(dynamic, 1)
  for (int64_t g = 0; g < grabs; ++g) gemv_rows(L, in, g * rows, std::min(L.n, (g + 1) * rows), y, res, act, sc);
}

// Rows [r0, r1) of the output in blocks of NBLK from r0, on the calling thread.
void linear_rows(const Lin& L, const In& in, int64_t M, int64_t r0, int64_t r1, float* y, int64_t ldy,
                 const float* res, int act, Scratch& sc) {
  if (M == 1 && gemv_ok(L, in)) return gemv_rows(L, in, r0, r1, y, res, act, sc);
  for (int64_t n0 = r0; n0 < r1; n0 += NBLK)
    linear_block(L, in, M, n0, int(std::min<int64_t>(NBLK, r1 - n0)), y, ldy, res, act, sc);
}

// y (M, N) = epilogue(x (M, K) @ W^T + bias), the blocks shared out among the threads of the
// enclosing parallel region (an orphaned worksharing loop; its end is a barrier) as they come
// for them, `grain` consecutive blocks at a time (about 8 grabs a thread: a delayed thread's
// share goes to the others, as in gemv_for; the next-block prefetch misses only at a grab's
// end), or all on the calling thread outside one.
void linear_for(const Lin& L, const In& in, int64_t M, float* y, const float* res, int act) {
  if (M == 1 && gemv_ok(L, in)) return gemv_for(L, in, y, res, act);
  const int64_t nblocks = (L.n + NBLK - 1) / NBLK;
  const int64_t grain = std::max<int64_t>(1, nblocks / (8 * omp_get_num_threads()));
  Scratch& sc = t_scratch;
#pragma omp for schedule(dynamic, grain)
  for (int64_t blk = 0; blk < nblocks; ++blk)
    linear_block(L, in, M, blk * NBLK, int(std::min<int64_t>(NBLK, L.n - blk * NBLK)), y, L.n, res, act, sc);
}

// y (M, N) = x (M, K) @ W^T + bias, in a parallel region of its own.
void linear(const Lin& L, const float* x, int64_t M, float* y) {
  const In in = prepare_inputs(L, x, M, t_scratch);  // once, by the calling thread
#pragma omp parallel num_threads(nthreads())
  linear_for(L, in, M, y, nullptr, -1);
}

}  // namespace

#endif  // GPTC_KERNELS_GPTC_GEMV_H_
