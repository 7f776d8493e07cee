// A Linear's inputs as the kernels take them: per-thread scratch (Scratch, Shared), the int8
// input quantization (per token and block, or one calibrated scale) and LinearInputs (made by
// prepare_inputs on every thread, or shared out among them by prepare_rows).
// Part of the one translation unit gptc_ops.cc (included there in order; formats and contract: its head comment).
#ifndef GPTC_KERNELS_GPTC_INPUTS_H_
#define GPTC_KERNELS_GPTC_INPUTS_H_

#include "gptc_common.h"

namespace {

void activate(float* h, int64_t n, int act);

// Scratch of one thread, kept across calls (libgomp's threads persist): no allocation per call
// once grown. The op's calling thread also keeps the buffers its threads share (Shared).
struct Scratch {
  std::vector<float> h, sx, wbuf, tile, p, gemv;
  std::vector<int8_t> xq, ibuf;
  std::vector<float> xp, pk_sw;  // AVX-512 blocks: packed input pairs, a packed block's scales,
  std::vector<float> facc;       // float accumulators between k chunks
  std::vector<int8_t> pk_codes;  // and codes
  std::vector<int32_t> pk_start;
  std::vector<uint8_t> xu;       // int8 inputs + 128
  std::vector<int32_t> lane_x, lane_start;  // int8 input rows in lanes (LaneInputs, LaneInputs8)
  std::vector<float> lane_s;
  std::vector<int32_t> gstart;  // grouped weights: the accumulators' starts per input row and block
};
struct Shared {
  std::vector<float> q, ctx, f, sel, h;
  std::vector<int32_t> keys;
  std::vector<int64_t> nkeys;
  std::vector<float> rows_h, rows_sx;  // prepare_rows' layer norms and input scales (M > 1)
  std::vector<int8_t> rows_xq;         // and int8 inputs
};
thread_local Scratch t_scratch;
thread_local Shared t_shared;

template <class T>
inline T* grow(std::vector<T>& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}

// After a call: buffers past 8 MB (long prompts, scoring batches) are freed, not kept for the
// life of the thread; decode-sized ones stay.
template <class T>
inline void trim(std::vector<T>& v) {
  if (v.capacity() * sizeof(T) > (size_t(8) << 20)) std::vector<T>().swap(v);
}
inline void trim(Scratch& s) {
  trim(s.h), trim(s.sx), trim(s.wbuf), trim(s.tile), trim(s.p), trim(s.gemv), trim(s.xq), trim(s.ibuf);
  trim(s.xp), trim(s.pk_sw), trim(s.facc), trim(s.pk_codes), trim(s.pk_start), trim(s.xu);
  trim(s.lane_x), trim(s.lane_start), trim(s.lane_s), trim(s.gstart);
}
inline void trim(Shared& s) {
  trim(s.q), trim(s.ctx), trim(s.f), trim(s.sel), trim(s.h), trim(s.keys), trim(s.nkeys);
  trim(s.rows_h), trim(s.rows_sx), trim(s.rows_xq);
}

inline bool is_integer(const LinearWeights& L) { return !(L.bits == 32 || L.act < 0.f); }

// The inputs of an integer layer as int8: (M, K) codes into xq, (M, K/blk) scales into sx.
void quantize_inputs(const LinearWeights& L, const float* x, int64_t M, int8_t* xq, float* sx) {
  const int64_t K = L.k, nb = K / L.blk;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + m * K + b * L.blk;
      float s = L.act;
      if (s == 0.f) {
        float amax = 0.f;
        int64_t j = 0;
#if defined(__AVX2__)
        if (L.blk >= 8) {  // max is exact in any order; a NaN is skipped as std::max skips it
          __m256 acc = _mm256_setzero_ps();
          for (; j + 8 <= L.blk; j += 8)
            acc = _mm256_max_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.f), _mm256_loadu_ps(xb + j)), acc);
          // The lanes' maximum in registers (no NaN is left in acc, so any order is exact).
          __m128 h = _mm_max_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
          h = _mm_max_ps(h, _mm_movehl_ps(h, h));
          amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
        }
#endif
        for (; j < L.blk; ++j) amax = std::max(amax, std::fabs(xb[j]));
        s = std::max(amax, 1e-30f) / 127.0f;
      }
      sx[m * nb + b] = s;
      int8_t* qb = xq + m * K + b * L.blk;
      int64_t j = 0;
#if defined(GPTC_F512)
      {  // 16 at a time, each code as the 8-lane loop below makes it (the step added under a mask)
        const __m512 vs = _mm512_set1_ps(s), half = _mm512_set1_ps(0.5f), one = _mm512_set1_ps(1.f);
        const __m512i sgn = _mm512_set1_epi32(int32_t(0x80000000u));
        for (; j + 16 <= L.blk; j += 16) {
          const __m512 v = _mm512_div_ps(_mm512_loadu_ps(xb + j), vs);
          const __m512 t = _mm512_roundscale_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
          const __m512i vi = _mm512_castps_si512(v);
          const __mmask16 away = _mm512_cmp_ps_mask(
              _mm512_castsi512_ps(_mm512_andnot_si512(sgn, _mm512_castps_si512(_mm512_sub_ps(v, t)))), half, _CMP_GE_OQ);
          const __m512 step = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(one), _mm512_and_si512(sgn, vi)));
          const __m512 r = _mm512_min_ps(_mm512_max_ps(_mm512_mask_add_ps(t, away, t, step), _mm512_set1_ps(-128.f)),
                                         _mm512_set1_ps(127.f));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + j), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(r)));
        }
      }
#endif
#if defined(__AVX2__)
      // The scalar loop's exact values, 8 at a time: the same IEEE division, std::round's
      // half-away-from-zero as trunc + (|v - trunc| >= 0.5 ? sign : 0), the same clamps.
      const __m256 vs = _mm256_set1_ps(s), half = _mm256_set1_ps(0.5f), one = _mm256_set1_ps(1.f);
      const __m256 sgn = _mm256_set1_ps(-0.f);
      for (; j + 8 <= L.blk; j += 8) {
        const __m256 v = _mm256_div_ps(_mm256_loadu_ps(xb + j), vs);
        const __m256 t = _mm256_round_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
        const __m256 away = _mm256_cmp_ps(_mm256_andnot_ps(sgn, _mm256_sub_ps(v, t)), half, _CMP_GE_OQ);
        __m256 r = _mm256_add_ps(t, _mm256_and_ps(away, _mm256_or_ps(one, _mm256_and_ps(sgn, v))));
        r = _mm256_min_ps(_mm256_max_ps(r, _mm256_set1_ps(-128.f)), _mm256_set1_ps(127.f));
        const __m256i i32 = _mm256_cvtps_epi32(r);
        const __m128i i16 = _mm_packs_epi32(_mm256_castsi256_si128(i32), _mm256_extracti128_si256(i32, 1));
        _mm_storel_epi64(reinterpret_cast<__m128i*>(qb + j), _mm_packs_epi16(i16, i16));
      }
#endif
      for (; j < L.blk; ++j) {
        const float v = std::round(xb[j] / s);
        qb[j] = int8_t(std::min(127.f, std::max(-128.f, v)));
      }
    }
}

// A linear's inputs as this thread's kernels take them: x itself, or its int8 codes and scales
// (made by this thread into its scratch: every thread of a region quantizes the same rows the
// same way, so no thread waits for another).
struct LinearInputs {
  const float* x;
  const int8_t* xq = nullptr;
  const float* sx = nullptr;
};

LinearInputs prepare_inputs(const LinearWeights& L, const float* x, int64_t M, Scratch& sc) {
  LinearInputs in{x};
  if (is_integer(L)) {
    int8_t* xq = grow(sc.xq, size_t(M * L.k));
    float* sx = grow(sc.sx, size_t(M * (L.k / L.blk)));
    quantize_inputs(L, x, M, xq, sx);
    in.xq = xq;
    in.sx = sx;
  }
  return in;
}

void layer_norm(const float* x, int64_t M, int64_t C, const float* w, const float* b, float eps, float* y);

// Inside a parallel region: rows 0..M-1 shared out as one run of consecutive rows a thread,
// f(first, count) on each (a worksharing loop: its end is a barrier). Runs let the row kernels
// take several rows at a time (layer_norm_rows: 8 a lane group).
template <class F>
inline void for_row_runs(int64_t M, F f) {
  const int64_t parts = omp_get_num_threads();
#pragma omp for schedule(static)
  for (int64_t part = 0; part < parts; ++part) {
    const int64_t first = M * part / parts;
    f(first, M * (part + 1) / parts - first);
  }
}

// M > 1 (prefill, batches), inside a parallel region: prepare_inputs' values, the rows shared
// out among the threads (one run of consecutive rows each) into the op's buffers xq, sx (the
// worksharing loop's end is the barrier) instead of every thread making all of them; with ln_w,
// each row's layer norm first (into h, rows C = L.k apart; the linear's inputs are then h). The
// same values per row however the rows are shared out.
LinearInputs prepare_rows(const LinearWeights& L, const float* x, int64_t M, const float* ln_w, const float* ln_b,
                          float eps, float* h, int8_t* xq, float* sx) {
  const bool integer = is_integer(L);
  if (!integer && ln_w == nullptr) return LinearInputs{x};  // nothing to make (every thread alike: no barrier)
  const int64_t K = L.k, nb = integer ? K / L.blk : 0;
  for_row_runs(M, [&](int64_t m0, int64_t rows) {
    const float* xm = x + m0 * K;
    if (ln_w != nullptr) {
      layer_norm(xm, rows, K, ln_w, ln_b, eps, h + m0 * K);
      xm = h + m0 * K;
    }
    if (integer) quantize_inputs(L, xm, rows, xq + m0 * K, sx + m0 * nb);
  });
  LinearInputs in{ln_w != nullptr ? h : x};
  if (integer) in.xq = xq, in.sx = sx;
  return in;
}

}  // namespace

#endif  // GPTC_KERNELS_GPTC_INPUTS_H_
