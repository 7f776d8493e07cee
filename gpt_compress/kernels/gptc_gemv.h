// The GEMV kernels (M = 1: batch-1 decode) and the Linear entry points that choose between them
// and the blocks (linear_rows, linear_for, linear).
// Part of the one translation unit gptc_ops.cc (included there in order; formats and contract: its head comment).
#ifndef GPTC_KERNELS_GPTC_GEMV_H_
#define GPTC_KERNELS_GPTC_GEMV_H_

#include "gptc_linear.h"

namespace {

// ------------------------------------------------------------------ M = 1: GEMV (batch-1 decode)
// One input row has kernels of its own. They walk GEMV_ROWS weight rows at a time straight from
// the weights (no per-block row tables or tile copies), NR rows per pass (independent
// accumulator chains: the fma latency is hidden, the loads stream), step the block index
// without a division and form each pass's scale products sx[b] * sw[n][b] once. An output's
// arithmetic is the contract above (the same operations in the same order as ftile/itile), so
// its value is bitwise the tiles' (tests/test_fused.py: token by token vs one prefill).
// AVX2 only; other layers (float-input int weights, K or blocks not in steps of 32) keep the
// blocks above. Standalone copies of the loops on the AMD EPYC here (best of 60-200 runs,
// contended): the 50304 x 384 int8 head on one core 15-22 GB/s with the blocks, 25-29 GB/s
// with these; the float32 head (77 MB) on 2 threads 24-26 -> 35-36 GB/s (bench/results.md).
constexpr int64_t GEMV_ROWS = 64;  // rows per work item (and per epilogue pass)
constexpr int GEMV_NR_F = 8;       // float weight rows per pass
constexpr int GEMV_NR_I = 4;       // int weight rows per pass
constexpr int GEMV_NR_I32 = 8;     // int weight rows per pass, blocks of 32 (igemv32_tile)
// Prefetch distance, bytes ahead of a pass's weights. A pass's NR rows are one contiguous span
// (rows K apart), and fgemv_tile / igemv32_tile prefetch it in address order, NR lines at a
// time, as fast as the pass consumes it: one sequential stream, where a prefetch per row
// (NR interleaved streams 384 B apart at gpt-bench's K) left the int8 head at 60% of a plain read's
// speed from DRAM. Standalone copy (/tmp scratch, the 50304 x 384 head on 2 threads after a 64 MB
// read evicts it, means of 10, AMD EPYC here): int8 1755-2027 -> 1312-1446 us, float32 (3072 x
// 1024) 566-656 -> 469-522 us; outputs bitwise the same.
constexpr int GEMV_PREFETCH = 6144;

inline bool gemv_ok(const Lin& L, const In& in) {
#if defined(__AVX2__)
  return L.bits == 32 || (in.xq != nullptr && L.k % 32 == 0 && L.blk % 32 == 0);
#else
  return false;
#endif
}

#if defined(__AVX2__)
// NR float weight rows (K apart) against x: y[n] = x . w_n + bias[n]. Every 64 bytes of the rows,
// NR lines GEMV_PREFETCH bytes ahead of the pass (in address order; see GEMV_PREFETCH).
template <int NR>
inline void fgemv_tile(const float* x, const float* w, int64_t K, float* y, const float* bias) {
  __m256 acc[NR];
  GPTC_UNROLL for (int n = 0; n < NR; ++n) acc[n] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    const __m256 xv = _mm256_loadu_ps(x + k);
    if (!(k & 15)) {  // the pass's k-th 64 bytes of its NR rows: NR lines, in address order
      const char* p = reinterpret_cast<const char*>(w) + (k / 16) * NR * 64 + GEMV_PREFETCH;
      GPTC_UNROLL for (int n = 0; n < NR; ++n) _mm_prefetch(p + n * 64, _MM_HINT_T0);
    }
    GPTC_UNROLL for (int n = 0; n < NR; ++n) acc[n] = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w + n * K + k), acc[n]);
  }
  GPTC_UNROLL for (int n = 0; n < NR; ++n) {
    float s = hsum(acc[n]);
    for (int64_t kk = k; kk < K; ++kk) s = std::fma(x[kk], w[n * K + kk], s);
    y[n] = s + (bias ? bias[n] : 0.f);
  }
}

// NR int weight rows (codes ldq bytes apart; I4: packed int4) against the int8 input: xq its
// codes, ax their magnitudes, prod the rows' scale products (row n at n * nb). The NR rows'
// codes are loaded before the dots; a prefetch GEMV_PREFETCH bytes ahead every 64 bytes.
template <int NR, bool I4>
inline void igemv_tile(const int8_t* xq, const int8_t* ax, int64_t nb, int64_t blk, const int8_t* q,
                       int64_t ldq, const float* prod, float* y, const float* bias) {
  __m256 acc[NR];
  GPTC_UNROLL for (int n = 0; n < NR; ++n) acc[n] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m256 sc[NR];
    GPTC_UNROLL for (int n = 0; n < NR; ++n) sc[n] = _mm256_broadcast_ss(prod + n * nb + b);
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
      if (!(off & 63)) {
        GPTC_UNROLL for (int n = 0; n < NR; ++n)
          _mm_prefetch(reinterpret_cast<const char*>(q + n * ldq + off) + GEMV_PREFETCH, _MM_HINT_T0);
      }
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + c));
      const __m256i av = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ax + c));
      GPTC_UNROLL for (int n = 0; n < NR; ++n)
        acc[n] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot32_i8(av, xv, wv[n])), sc[n], acc[n]);
    }
  }
  GPTC_UNROLL for (int n = 0; n < NR; ++n) y[n] = hsum(acc[n]) + (bias ? bias[n] : 0.f);
}

// igemv_tile for blocks of 32 inputs (the default format: one 32-code step per block): the block
// loop flat (no inner step loop, no per-step prefetch test), two blocks a pass, GEMV_NR_I32 rows.
// The same operations in the same order per output as igemv_tile (bitwise equal). Standalone copy
// on the AMD EPYC here (one core, 1024 x 384 int8 weights in L2, best of 400): 21.9 -> 14.5 us;
// the 50304 x 384 head on 2 threads 608 -> 453-477 us.
template <int NR, bool I4>
inline void igemv32_tile(const int8_t* xq, const int8_t* ax, int64_t nb, const int8_t* q, int64_t ldq,
                         const float* prod, float* y, const float* bias) {
  __m256 acc[NR];
  GPTC_UNROLL for (int n = 0; n < NR; ++n) acc[n] = _mm256_setzero_ps();
  const __m256i m4 = _mm256_set1_epi8(0x0F), eight = _mm256_set1_epi8(8);
  auto block = [&](int64_t b) {
    const int64_t c = b * 32, off = I4 ? c / 2 : c;
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + c));
    const __m256i av = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ax + c));
    GPTC_UNROLL for (int n = 0; n < NR; ++n) {
      __m256i wv;
      if (I4) {
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + n * ldq + off));
        wv = _mm256_sub_epi8(_mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), m4), eight);
      } else {
        wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + n * ldq + off));
      }
      acc[n] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot32_i8(av, xv, wv)), _mm256_broadcast_ss(prod + n * nb + b),
                               acc[n]);
    }
  };
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) {
    if (!I4 || !(b & 3)) {  // NR lines (the pass's codes of 64 bytes a row), in address order
      const char* p = reinterpret_cast<const char*>(q) + (I4 ? b * 16 : b * 32) * NR + GEMV_PREFETCH;
      GPTC_UNROLL for (int n = 0; n < NR; ++n) _mm_prefetch(p + n * 64, _MM_HINT_T0);
    }
    block(b);
    block(b + 1);
  }
  if (b < nb) block(b);
  GPTC_UNROLL for (int n = 0; n < NR; ++n) y[n] = hsum(acc[n]) + (bias ? bias[n] : 0.f);
}

// Rows [n0, n0 + nr) of an int layer into t.
template <bool I4>
void igemv(const Lin& L, const In& in, const int8_t* ax, int64_t n0, int64_t nr, float* t, Scratch& sc) {
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
  int64_t n = 0;
  if (L.blk == 32) {
    for (; n + GEMV_NR_I32 <= nr; n += GEMV_NR_I32)
      igemv32_tile<GEMV_NR_I32, I4>(in.xq, ax, nb, q + n * ldq, ldq, prod + n * nb, t + n, bias ? bias + n : nullptr);
    for (; n < nr; ++n)
      igemv32_tile<1, I4>(in.xq, ax, nb, q + n * ldq, ldq, prod + n * nb, t + n, bias ? bias + n : nullptr);
    return;
  }
  for (; n + GEMV_NR_I <= nr; n += GEMV_NR_I)
    igemv_tile<GEMV_NR_I, I4>(in.xq, ax, nb, L.blk, q + n * ldq, ldq, prod + n * nb, t + n, bias ? bias + n : nullptr);
  for (; n < nr; ++n)
    igemv_tile<1, I4>(in.xq, ax, nb, L.blk, q + n * ldq, ldq, prod + n * nb, t + n, bias ? bias + n : nullptr);
}
#endif

// Rows [r0, r1) of y (one input row) = epilogue(x @ W^T + bias): linear_block's epilogue (`act`,
// + res, res may be y), GEMV_ROWS rows at a time. Only where gemv_ok.
void gemv_rows(const Lin& L, const In& in, int64_t r0, int64_t r1, float* y, const float* res, int act,
               Scratch& sc) {
#if defined(__AVX2__)
  const int64_t K = L.k;
  const int8_t* ax = nullptr;
  if (L.bits != 32) {  // |x| codes, shared by every row
    thread_local std::vector<int8_t> t_abs;
    int8_t* a = grow(t_abs, size_t(K));
    for (int64_t c = 0; c < K; c += 32) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in.xq + c));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(a + c), _mm256_sign_epi8(xv, xv));
    }
    ax = a;
  }
  float t[GEMV_ROWS];
  for (int64_t n0 = r0; n0 < r1; n0 += GEMV_ROWS) {
    const int64_t nr = std::min(GEMV_ROWS, r1 - n0);
    if (L.bits == 32) {
      const float* w = L.wf + n0 * K;
      const float* bias = L.bias ? L.bias + n0 : nullptr;
      int64_t n = 0;
      for (; n + GEMV_NR_F <= nr; n += GEMV_NR_F)
        fgemv_tile<GEMV_NR_F>(in.x, w + n * K, K, t + n, bias ? bias + n : nullptr);
      for (; n < nr; ++n) fgemv_tile<1>(in.x, w + n * K, K, t + n, bias ? bias + n : nullptr);
    } else if (L.bits == 4) {
      igemv<true>(L, in, ax, n0, nr, t, sc);
    } else {
      igemv<false>(L, in, ax, n0, nr, t, sc);
    }
    if (act >= 0) activate(t, nr, act);
    for (int64_t n = 0; n < nr; ++n) y[n0 + n] = res != nullptr ? res[n0 + n] + t[n] : t[n];
  }
#endif
}

// A stream's start (a grab of gemv_for's schedule, the first rows of a weight): the first
// GEMV_PREFETCH bytes of the weights from row r0 on, which the passes' own prefetches (always
// GEMV_PREFETCH ahead) never ask for, and the scales of the chunk, all requested at once instead
// of missing one line after another.
inline void gemv_prefetch_start(const Lin& L, int64_t r0) {
#if defined(__AVX2__)
  const int64_t rows = std::min(GEMV_ROWS, L.n - r0);
  const int64_t row_bytes = L.bits == 32 ? L.k * 4 : L.k * L.bits / 8;
  const char* w = L.bits == 32 ? reinterpret_cast<const char*>(L.wf) : reinterpret_cast<const char*>(L.wq);
  const int64_t wb = std::min<int64_t>(GEMV_PREFETCH, rows * row_bytes);
  for (int64_t o = 0; o < wb; o += 64) _mm_prefetch(w + r0 * row_bytes + o, _MM_HINT_T0);
  if (L.bits != 32) {
    const int64_t nb = L.k / L.blk;
    const char* s = reinterpret_cast<const char*>(L.scale + r0 * nb);
    for (int64_t o = 0; o < rows * nb * 4; o += 64) _mm_prefetch(s + o, _MM_HINT_T0);
  }
#endif
}

// y (1, N) = epilogue(x @ W^T + bias), the GEMV_ROWS chunks shared out among the threads of the
// enclosing region as they come for them, `grain` at a time (about 16 grabs per thread): a
// thread that a busy machine delays, or that joins the region late (woken from its sleep
// between ops), leaves its share to the others instead of making them wait at the barrier.
// Consecutive chunks of a grab keep the rows' streams (and prefetches) running on one core.
// Which thread computes an output never changes its value.
void gemv_for(const Lin& L, const In& in, float* y, const float* res, int act) {
  const int64_t chunks = (L.n + GEMV_ROWS - 1) / GEMV_ROWS;
  const int64_t grain = std::max<int64_t>(1, chunks / (16 * omp_get_num_threads()));
  Scratch& sc = t_scratch;
  int64_t next = -1;  // the chunk after this thread's previous one: its stream is already running
#pragma omp for schedule(dynamic, grain)
  for (int64_t c = 0; c < chunks; ++c) {
    if (c != next) gemv_prefetch_start(L, c * GEMV_ROWS);
    gemv_rows(L, in, c * GEMV_ROWS, std::min(L.n, (c + 1) * GEMV_ROWS), y, res, act, sc);
    next = c + 1;
  }
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
