// A Linear's inputs and one block of its outputs: per-thread scratch, the int8 input
// quantization (per token and block, or one calibrated scale), and linear_block (the tiles and
// the epilogue: activation, residual).
// Part of the one translation unit gptc_ops.cc (included there in order; formats and contract: its head comment).
#ifndef GPTC_KERNELS_GPTC_LINEAR_H_
#define GPTC_KERNELS_GPTC_LINEAR_H_

#include "gptc_gemm512.h"

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
  std::vector<int32_t> lane_x, lane_start;  // few rows' int8 inputs in lanes (LaneInputs)
  std::vector<float> lane_s;
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
  trim(s.lane_x), trim(s.lane_start), trim(s.lane_s);
}
inline void trim(Shared& s) {
  trim(s.q), trim(s.ctx), trim(s.f), trim(s.sel), trim(s.h), trim(s.keys), trim(s.nkeys);
  trim(s.rows_h), trim(s.rows_sx), trim(s.rows_xq);
}

inline bool is_integer(const Lin& L) { return !(L.bits == 32 || L.act < 0.f); }

// The inputs of an integer layer as int8: (M, K) codes into xq, (M, K/blk) scales into sx.
void quantize_inputs(const Lin& L, const float* x, int64_t M, int8_t* xq, float* sx) {
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
          alignas(32) float lanes[8];
          _mm256_store_ps(lanes, acc);
          for (int i = 0; i < 8; ++i) amax = std::max(amax, lanes[i]);
        }
#endif
        for (; j < L.blk; ++j) amax = std::max(amax, std::fabs(xb[j]));
        s = std::max(amax, 1e-30f) / 127.0f;
      }
      sx[m * nb + b] = s;
      int8_t* qb = xq + m * K + b * L.blk;
      int64_t j = 0;
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
struct In {
  const float* x;
  const int8_t* xq = nullptr;
  const float* sx = nullptr;
};

In prepare_inputs(const Lin& L, const float* x, int64_t M, Scratch& sc) {
  In in{x};
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

// M > 1 (prefill, batches), inside a parallel region: prepare_inputs' values, the rows shared
// out among the threads into the op's buffers xq, sx (the worksharing loop's end is the
// barrier) instead of every thread making all of them; with ln_w, each row's layer norm first
// (into h, rows C = L.k apart; the linear's inputs are then h). Per row, so the same values.
In prepare_rows(const Lin& L, const float* x, int64_t M, const float* ln_w, const float* ln_b, float eps, float* h,
                int8_t* xq, float* sx) {
  const bool integer = is_integer(L);
  if (!integer && ln_w == nullptr) return In{x};  // nothing to make (every thread alike: no barrier)
  const int64_t K = L.k, nb = integer ? K / L.blk : 0;
#pragma omp for schedule(static)
  for (int64_t m = 0; m < M; ++m) {
    const float* xm = x + m * K;
    if (ln_w != nullptr) {
      layer_norm(xm, 1, K, ln_w, ln_b, eps, h + m * K);
      xm = h + m * K;
    }
    if (integer) quantize_inputs(L, xm, 1, xq + m * K, sx + m * nb);
  }
  In in{ln_w != nullptr ? h : x};
  if (integer) in.xq = xq, in.sx = sx;
  return in;
}

// The inputs of a Linear as the AVX-512 micro-kernels read them (M > 1), made by the calling
// thread into its scratch once per Linear call that runs in blocks (not the GEMV): float inputs in
// pairs of rows (xp), int8 ones + 128 (xu). Null where the build has no such kernel.
struct Packs {
  const float* xp = nullptr;
  const uint8_t* xu = nullptr;
#if defined(GPTC_VNNI512)
  LaneInputs lanes;  // few rows of int inputs against int weights (lanes.x null otherwise)
#elif defined(__AVX2__)
  LaneInputs8 lanes8;  // rows of int inputs against int weights, 8 a panel (lanes8.xs null otherwise)
#endif
};

// Int weights against int inputs of whole 32-code chunks: M <= LANES_MAX rows take the lane kernels.
inline bool lanes_ok(const Lin& L, const In& in, int64_t M) {
#if defined(GPTC_VNNI512)
  return in.xq != nullptr && M <= LANES_MAX && (L.bits == 8 || L.bits == 4) && L.k % 32 == 0 && L.blk % 32 == 0;
#else
  (void)L, (void)in, (void)M;
  return false;
#endif
}

inline Packs pack_inputs(const Lin& L, const In& in, int64_t M, Scratch& sc) {
  Packs p;
#if !defined(GPTC_VNNI512) && defined(__AVX2__)
  if (in.xq != nullptr && M >= LANES8_MIN && (L.bits == 8 || L.bits == 4) && L.k % 32 == 0 && L.blk % 32 == 0) {
    const int64_t panels = (M + 7) / 8, nb = L.k / L.blk;
    int32_t* xs = grow(sc.lane_x, size_t(2 * panels * (L.k / 4) * 8));
    float* s = grow(sc.lane_s, size_t(panels * nb * 8));
    pack_lanes8(in.xq, in.sx, M, L.k, nb, xs, xs + panels * (L.k / 4) * 8, s);
    p.lanes8 = LaneInputs8{xs, xs + panels * (L.k / 4) * 8, s};
  }
#endif
#if defined(GPTC_F512)
  if (in.xq == nullptr) {  // float inputs (float weights, or int ones dequantized)
    float* xp = grow(sc.xp, size_t((M + 1) * L.k));
    pack_pairs_f(in.x, M, L.k, xp);
    p.xp = xp;
  }
#if defined(GPTC_VNNI512)
  if (lanes_ok(L, in, M)) {
    const int P = lane_groups(M);
    const int64_t nb = L.k / L.blk;
    LaneInputs& li = p.lanes;
    int32_t* x = grow(sc.lane_x, size_t(L.k / 4 * 16 / P));
    float* s = grow(sc.lane_s, size_t(nb * 16));
    int32_t* st = grow(sc.lane_start, size_t(nb * 16));
    pack_lanes(in.xq, in.sx, M, L.k, nb, L.blk, L.bits == 4 ? 3 : 7, P, x, s, st);
    li.x = x, li.s = s, li.start = st, li.p = P;
  } else if (in.xq != nullptr) {
    uint8_t* xu = grow(sc.xu, size_t(M * L.k));
    pack_u8(in.xq, M, L.k, xu);
    p.xu = xu;
  }
#endif
#else
  (void)L, (void)in, (void)M, (void)sc;
#endif
  return p;
}

// Output rows [n0, n0 + nr) (nr <= NBLK) of y (M, ldy) = x @ W^T + bias for all M input rows,
// then the epilogue on each new value: activation `act` (>= 0), and + res (same layout as y;
// may be y itself: each value is read before it is written, by the thread that writes it).
void linear_block(const Lin& L, const In& in, const Packs& pk_in, int64_t M, int64_t n0, int nr, float* y,
                  int64_t ldy, const float* res, int act, Scratch& sc) {
  const int64_t K = L.k;
  const float* bias = L.bias ? L.bias + n0 : nullptr;
  float* t = grow(sc.tile, size_t(M * NBLK));
  // M > 1: the next block's weights (this thread's next, but at the end of a grab of
  // linear_for's dynamic schedule) are prefetched by the tiles; its scales here.
  const char* pf = nullptr;
  int64_t pf_bytes = 0;
  if (M > 1 && n0 + NBLK < L.n) {
    const int64_t n1 = n0 + NBLK, rows = std::min<int64_t>(NBLK, L.n - n1);
    if (L.bits == 32) {
      pf = reinterpret_cast<const char*>(L.wf + n1 * K);
      pf_bytes = rows * K * int64_t(sizeof(float));
    } else {
      const int64_t row = L.bits == 4 ? K / 2 : K;
      pf = reinterpret_cast<const char*>(L.wq + n1 * row);
      pf_bytes = rows * row;
#if defined(__AVX2__)
      const int64_t nb = K / L.blk;
      const char* s1 = reinterpret_cast<const char*>(L.scale + n1 * nb);
      for (int64_t o = 0; o < rows * nb * int64_t(sizeof(float)); o += 64) _mm_prefetch(s1 + o, _MM_HINT_T0);
#endif
    }
  }
  // Float rows against all M inputs (AVX-512 builds: the pair micro-kernel, bitwise fblock's values).
  auto floats = [&](const float* w) {
#if defined(GPTC_F512)
    fblock512(in.x, pk_in.xp, M, K, w, nr, t, NBLK, bias, grow(sc.facc, size_t((M + 1) / 2 * NBLK * 16)));
#else
    fblock(in.x, M, K, w, nr, t, NBLK, bias, pf, pf_bytes);
#endif
  };
  if (L.bits == 32) {
    floats(L.wf + n0 * K);
  } else {
    const int8_t* q[NBLK];
    const float* sw[NBLK];
#if defined(GPTC_VNNI512)
    if (pk_in.lanes.x != nullptr) {  // few rows: the weight rows as stored (lane kernels)
      const int64_t row = L.bits == 4 ? K / 2 : K, nb = K / L.blk;
      for (int n = 0; n < nr; ++n) q[n] = L.wq + (n0 + n) * row, sw[n] = L.scale + (n0 + n) * nb;
      const LaneInputs& li = pk_in.lanes;
      if (li.p == 4)
        L.bits == 4 ? iblock_lanes<4, true>(li, M, nb, L.blk, q, sw, nr, row, t, NBLK, bias)
                    : iblock_lanes<4, false>(li, M, nb, L.blk, q, sw, nr, row, t, NBLK, bias);
      else if (li.p == 2)
        L.bits == 4 ? iblock_lanes<2, true>(li, M, nb, L.blk, q, sw, nr, row, t, NBLK, bias)
                    : iblock_lanes<2, false>(li, M, nb, L.blk, q, sw, nr, row, t, NBLK, bias);
      else
        L.bits == 4 ? iblock_lanes<1, true>(li, M, nb, L.blk, q, sw, nr, row, t, NBLK, bias)
                    : iblock_lanes<1, false>(li, M, nb, L.blk, q, sw, nr, row, t, NBLK, bias);
    } else
#endif
    {
    // AVX2 builds: whole panels of 8 rows (and a last one of 6 or 7) in the lane kernel, the rows
    // left (fewer than 6: most of a panel's lanes would idle) in the tiles.
    const In* ip = &in;
    int64_t mr = M;
    float* tr = t;
#if !defined(GPTC_VNNI512) && defined(__AVX2__)
    In rest = in;
    if (pk_in.lanes8.xs != nullptr) {
      const int64_t row = L.bits == 4 ? K / 2 : K, nb = K / L.blk;
      const int64_t done = M % 8 >= LANES8_MIN ? M : M / 8 * 8;
      for (int n = 0; n < nr; ++n) q[n] = L.wq + (n0 + n) * row, sw[n] = L.scale + (n0 + n) * nb;
      L.bits == 4 ? iblock_lanes8<true>(pk_in.lanes8, done, K, nb, L.blk, q, sw, nr, t, NBLK, bias)
                  : iblock_lanes8<false>(pk_in.lanes8, done, K, nb, L.blk, q, sw, nr, t, NBLK, bias);
      rest.x = in.x + done * K, rest.xq = in.xq + done * K, rest.sx = in.sx + done * nb;
      ip = &rest, mr = M - done, tr = t + done * NBLK;
    }
#endif
    if (mr > 0) {
    const bool packed = L.bits == 4 && ip->xq != nullptr && packed4_ok(mr, K, L.blk);
    int8_t* ibuf = L.bits == 4 && !packed ? grow(sc.ibuf, size_t(NBLK * K)) : nullptr;  // unpacked int4 rows
    for (int n = 0; n < nr; ++n) {
      q[n] = packed ? L.wq + (n0 + n) * (K / 2) : int_row(L, n0 + n, ibuf ? ibuf + n * K : nullptr);
      sw[n] = L.scale + (n0 + n) * (K / L.blk);
    }
    if (packed) {
      iblock<true>(ip->xq, ip->sx, mr, K, K / L.blk, L.blk, q, sw, nr, tr, NBLK, bias);
    } else if (ip->xq != nullptr) {
#if defined(GPTC_VNNI512)
      if (K % 4 == 0 && L.blk % 4 == 0) {  // whole 4-code groups (vpdpbusd's lanes)
        const int64_t nb = K / L.blk;
        const Packed512 pk{grow(sc.pk_codes, size_t(K * NBLK)), grow(sc.pk_start, size_t(nb * NBLK)),
                           grow(sc.pk_sw, size_t(nb * NBLK))};
        iblock512(ip->xq, ip->sx, mr, K, nb, L.blk, q, sw, nr, tr, NBLK, bias, pk, pk_in.xu);
      } else
#endif
      iblock(ip->xq, ip->sx, mr, K, K / L.blk, L.blk, q, sw, nr, tr, NBLK, bias, pf, pf_bytes);
    } else {
      float* wbuf = grow(sc.wbuf, size_t(NBLK * K));  // the fake-quant weight: codes * block scales
      for (int n = 0; n < nr; ++n)
        for (int64_t j = 0; j < K; ++j) wbuf[n * K + j] = float(q[n][j]) * sw[n][j / L.blk];
      floats(wbuf);
    }
    }
    }
  }
  // The activation elementwise: over the whole tile when its rows are contiguous (nr == NBLK; the
  // same values, a value's activation depending on it alone, without a padded tail per row).
  const bool whole = act >= 0 && nr == NBLK;
  if (whole) activate(t, M * NBLK, act);
#if defined(__AVX2__)
  if (nr == NBLK) {  // whole rows: 8- and 4-lane moves (a memcpy call per row costs more than the copy)
    static_assert(NBLK % 4 == 0, "the row moves below are 8 and 4 values");
    for (int64_t m = 0; m < M; ++m) {
      const float* tm = t + m * NBLK;
      float* ym = y + m * ldy + n0;
      const float* rm = res != nullptr ? res + m * ldy + n0 : nullptr;
      int j = 0;
      for (; j + 8 <= NBLK; j += 8) {
        __m256 a = _mm256_loadu_ps(tm + j);
        if (rm != nullptr) a = _mm256_add_ps(_mm256_loadu_ps(rm + j), a);  // rm + tm, as below
        _mm256_storeu_ps(ym + j, a);
      }
      if (j < NBLK) {
        __m128 b = _mm_loadu_ps(tm + j);
        if (rm != nullptr) b = _mm_add_ps(_mm_loadu_ps(rm + j), b);
        _mm_storeu_ps(ym + j, b);
      }
    }
    return;
  }
#endif
  for (int64_t m = 0; m < M; ++m) {
    float* tm = t + m * NBLK;
    if (act >= 0 && !whole) activate(tm, nr, act);
    float* ym = y + m * ldy + n0;
    if (res != nullptr) {
      const float* rm = res + m * ldy + n0;
      for (int n = 0; n < nr; ++n) ym[n] = rm[n] + tm[n];
    } else {
      std::memcpy(ym, tm, nr * sizeof(float));
    }
  }
}

}  // namespace

#endif  // GPTC_KERNELS_GPTC_LINEAR_H_
