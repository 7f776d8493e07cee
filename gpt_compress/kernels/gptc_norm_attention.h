// Layer norm, the activations (ReLU, exact GELU, gelu_new) and attention of queries over their
// unmasked cache keys.
// Part of the one translation unit gptc_ops.cc (included there in order; formats and contract: its head comment).
#ifndef GPTC_KERNELS_GPTC_NORM_ATTENTION_H_
#define GPTC_KERNELS_GPTC_NORM_ATTENTION_H_

#include "gptc_common.h"
#include "gptc_tiles.h"

namespace {

// Layer norm (layer_norm_rows) of the M rows row(0) .. row(M - 1), C floats each, into y (M, C).
// Each row's mean and variance are summed in column order, as the scalar loop does; AVX2 builds
// take 8 rows at a time, one a lane (their columns transposed in registers), so every row's
// values are bitwise the scalar loop's on every ISA, whichever rows share its group (batch
// invariance), and its sums cost an eighth of a row's dependent chain of adds.
#if defined(__AVX2__)
// r[i] (8 floats each) -> r[j] holding element j of every r[i] (lane i).
inline void transpose8(__m256 r[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);      // rows 2i, 2i+1: elements 0, 1 | 4, 5
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);  // 2, 3 | 6, 7
  }
  for (int h = 0; h < 2; ++h) {  // rows 4h..4h+3: u[4h + e] holds element e | e + 4
    u[4 * h] = _mm256_shuffle_ps(t[4 * h], t[4 * h + 2], 0x44);
    u[4 * h + 1] = _mm256_shuffle_ps(t[4 * h], t[4 * h + 2], 0xEE);
    u[4 * h + 2] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], 0x44);
    u[4 * h + 3] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], 0xEE);
  }
  for (int e = 0; e < 4; ++e) {
    r[e] = _mm256_permute2f128_ps(u[e], u[4 + e], 0x20);
    r[e + 4] = _mm256_permute2f128_ps(u[e], u[4 + e], 0x31);
  }
}

// Column c of the 8 rows, row i in lane i.
inline __m256 column8(const float* const* xr, int64_t c) {
  return _mm256_setr_ps(xr[0][c], xr[1][c], xr[2][c], xr[3][c], xr[4][c], xr[5][c], xr[6][c], xr[7][c]);
}

// acc = f(acc, column) over the columns of the 8 rows, in column order.
template <class F>
inline __m256 fold_columns8(const float* const* xr, int64_t C, __m256 acc, F f) {
  int64_t c = 0;
  for (; c + 8 <= C; c += 8) {
    __m256 r[8];
    for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(xr[i] + c);
    transpose8(r);
    for (int j = 0; j < 8; ++j) acc = f(acc, r[j]);
  }
  for (; c < C; ++c) acc = f(acc, column8(xr, c));
  return acc;
}
#endif

template <class Row>
void layer_norm_rows(Row row, int64_t M, int64_t C, const float* w, const float* b, float eps, float* y) {
  int64_t m = 0;
  auto normalize = [&](int64_t r, float mean, float inv) {
    const float* xm = row(r);
    for (int64_t c = 0; c < C; ++c) y[r * C + c] = std::fma((xm[c] - mean) * inv, w[c], b[c]);
  };
#if defined(__AVX2__)
  const __m256 n = _mm256_set1_ps(float(C));
  for (; m + 8 <= M; m += 8) {
    const float* x8[8];
    for (int i = 0; i < 8; ++i) x8[i] = row(m + i);
    const __m256 mu = _mm256_div_ps(
        fold_columns8(x8, C, _mm256_setzero_ps(), [](__m256 s, __m256 v) { return _mm256_add_ps(s, v); }), n);
    const __m256 var = fold_columns8(x8, C, _mm256_setzero_ps(), [mu](__m256 s, __m256 v) {
      const __m256 d = _mm256_sub_ps(v, mu);
      return _mm256_fmadd_ps(d, d, s);
    });
    const __m256 inv = _mm256_div_ps(_mm256_set1_ps(1.f),
                                     _mm256_sqrt_ps(_mm256_add_ps(_mm256_div_ps(var, n), _mm256_set1_ps(eps))));
    alignas(32) float means[8], invs[8];
    _mm256_store_ps(means, mu);
    _mm256_store_ps(invs, inv);
    for (int i = 0; i < 8; ++i) normalize(m + i, means[i], invs[i]);
  }
#endif
  for (; m < M; ++m) {
    const float* xm = row(m);
    float mean = 0.f, var = 0.f;
    for (int64_t c = 0; c < C; ++c) mean += xm[c];
    mean /= C;
    for (int64_t c = 0; c < C; ++c) var = std::fma(xm[c] - mean, xm[c] - mean, var);
    normalize(m, mean, 1.f / std::sqrt(var / C + eps));
  }
}

// The M rows of x (M, C).
void layer_norm(const float* x, int64_t M, int64_t C, const float* w, const float* b, float eps, float* y) {
  layer_norm_rows([x, C](int64_t m) { return x + m * C; }, M, C, w, b, eps, y);
}

// Activation in place, elementwise (each value's result depends on that value only).
void activate(float* h, int64_t n, int act) {
  if (act == 0) {
    for (int64_t i = 0; i < n; ++i) h[i] = h[i] > 0.f ? h[i] : 0.f;
    return;
  }
  if (act == 1) {  // exact erf GELU (libm)
    for (int64_t i = 0; i < n; ++i) h[i] = 0.5f * h[i] * (1.f + std::erf(h[i] * 0.70710678118654752f));
    return;
  }
#if defined(__AVX2__)
  // gelu_new: 0.5 v (1 + tanh(u)), tanh(u) = 1 - 2 / (exp(2u) + 1); the tail goes through the
  // same 8-lane code (padded), so no value is computed two ways.
  auto gelu8 = [](__m256 v) {
    const __m256 u = _mm256_mul_ps(_mm256_set1_ps(0.79788456080286536f),
                                   _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(0.044715f), v), _mm256_mul_ps(v, v), v));
    const __m256 e = exp8(_mm256_mul_ps(_mm256_set1_ps(2.f), u));
    const __m256 t = _mm256_sub_ps(_mm256_set1_ps(1.f),
                                   _mm256_div_ps(_mm256_set1_ps(2.f), _mm256_add_ps(e, _mm256_set1_ps(1.f))));
    return _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), v), _mm256_add_ps(_mm256_set1_ps(1.f), t));
  };
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(h + i, gelu8(_mm256_loadu_ps(h + i)));
  if (i < n) {
    float buf[8] = {0.f};
    std::memcpy(buf, h + i, (n - i) * sizeof(float));
    _mm256_storeu_ps(buf, gelu8(_mm256_loadu_ps(buf)));
    std::memcpy(h + i, buf, (n - i) * sizeof(float));
  }
#else
  for (int64_t i = 0; i < n; ++i) {
    const float v = h[i];
    h[i] = 0.5f * v * (1.f + std::tanh(0.79788456080286536f * (v + 0.044715f * v * v * v)));
  }
#endif
}

// The KV cache holds float32, or bfloat16 (bf16_t): a float's upper 16 bits, rounded to nearest
// even when written (NaN kept a NaN), widened back exactly by a shift when read. Both are plain
// bit operations, the same on every ISA, so a bfloat16 cache keeps batch invariance and the
// bitwise agreement of the native and avx2 builds: every reader sees the same rounded values.
using bf16_t = uint16_t;
inline bf16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16_t((u >> 16) | 0x40u);  // a NaN stays a (quiet) NaN
  return bf16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
inline float cache_value(const float* p) { return *p; }
inline float cache_value(const bf16_t* p) {
  const uint32_t u = uint32_t(*p) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline void cache_write(float* dst, const float* src, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void cache_write(bf16_t* dst, const float* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = to_bf16(src[i]);
}
#if defined(__AVX2__)
inline __m256 cache_load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 cache_load8(const bf16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#endif

// Queries against their keys: query i, its first n[i] keys (rows idx[0..n[i]) of kb/vb, D values
// each): softmax(q.k * scale) @ v into o[i]. Keys are the query's unmasked cache columns in
// order, so every reduction runs over the same values in the same order whatever the padding,
// batch or prefill/decode split.
// AVX2: a query's keys are cut into 8 equal segments (m = ceil(n / 8) keys each) and pass t takes
// key t of each, so the keys and then the values are read as 8 sequential streams (as the GEMV
// reads its weights: 8 streams keep more memory requests in flight than one): its scores of pass
// t at p[8t..8t+8), a lane per segment; the softmax sum runs lane-wise over the passes, the values
// in pass order.
// Queries of one m (consecutive prompt positions: up to 8 share it) take every pass together
// (attend_rows): a pass's keys and values, read from memory or L2 once, serve each query from L1,
// and each query's arithmetic is its own pass by pass, so its output is bitwise what it gets alone.
#if defined(__AVX2__)
// A query's lanes of pass t that hold a key (j * m + t < n): the first at(t). Counted down as t
// grows (lane j's last pass is n - 1 - j * m) rather than by an integer division per pass.
struct Lanes {
  int64_t m, n;
  int l;
  Lanes(int64_t m_, int64_t n_) : m(m_), n(n_), l(int(std::min<int64_t>(8, (n_ - 1) / m_ + 1))) {}
  int at(int64_t t) {  // t ascending
    while (l > 0 && (l - 1) * m + t >= n) --l;
    return l;
  }
};

// Pass t's 8 scores of the query qv against the key rows kr[0..8) into p8: (q . k) * scale, each
// key's dot an fma chain per lane over D / 8 chunks, then one fixed tree.
template <class T>
inline void score_pass(const float* qv, const T* const* kr, int64_t D, float scale, float* p8) {
  __m256 a[8];
  for (int j = 0; j < 8; ++j) a[j] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) {
    const __m256 qd = _mm256_loadu_ps(qv + d);
    for (int j = 0; j < 8; ++j) a[j] = _mm256_fmadd_ps(qd, cache_load8(kr[j] + d), a[j]);
  }
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  const __m256 s = _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
  _mm256_storeu_ps(p8, _mm256_mul_ps(s, _mm256_set1_ps(scale)));
}

// A query's m passes of scores (n keys) in place into their exps, the lanes past the last key
// zeroed; returns 1 / their sum (lane-wise over the passes, then one tree).
inline float softmax_passes(float* p, int64_t m, int64_t n) {
  // The maximum over every lane: a masked lane repeats the last key's score (attend_rows clamps).
  __m256 vmax = _mm256_set1_ps(-INFINITY);
  for (int64_t t = 0; t < m; ++t) vmax = _mm256_max_ps(_mm256_loadu_ps(p + 8 * t), vmax);
  alignas(32) float lane_max[8];
  _mm256_store_ps(lane_max, vmax);
  float mx = -INFINITY;
  for (int j = 0; j < 8; ++j) mx = std::max(mx, lane_max[j]);
  __m256 sum = _mm256_setzero_ps();
  const __m256 vmx = _mm256_set1_ps(mx);
  Lanes lanes(m, n);
  for (int64_t t = 0; t < m; ++t) {
    __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + 8 * t), vmx));
    if (const int l = lanes.at(t); l < 8) {  // zero the lanes past the last key
      alignas(32) float keep[8];
      for (int j = 0; j < 8; ++j) keep[j] = j < l ? 1.f : 0.f;
      e = _mm256_mul_ps(e, _mm256_load_ps(keep));
    }
    _mm256_storeu_ps(p + 8 * t, e);
    sum = _mm256_add_ps(sum, e);
  }
  return 1.f / hsum(sum);
}

// Accumulators of value_sums: as many as there are vector registers for them (more chains of
// fmas in flight than one fma's latency needs; 32 registers on AVX-512 builds, 16 on AVX2 ones).
#if defined(GPTC_F512)
constexpr int kValueAccs = 16;
#else
constexpr int kValueAccs = 8;
#endif

// Passes t < full_passes(m, nmin) hold 8 keys (j * m + t < n) for every query of at least nmin.
inline int64_t full_passes(int64_t m, int64_t nmin) { return std::max<int64_t>(0, std::min(m, nmin - 7 * m)); }

// The G queries' sums of p v in pass order (query i: its weights p[i], its lanes Lanes(m, n[i]);
// the first `full` passes: all 8 lanes for every query), times inv[i], into o[i]: C chunks of 8
// dims a sweep over the passes (G * C accumulators), each pass's value rows loaded once for the G
// queries.
template <class T, int G>
void value_sums(const float* const* p, const int64_t* n, const float* inv, int64_t m, int64_t full, const T* vb,
                const int32_t* idx, int64_t D, float* const* o) {
  constexpr int C = std::min(8, std::max(1, kValueAccs / G));
  int64_t nmax = n[0];
  for (int i = 1; i < G; ++i) nmax = std::max(nmax, n[i]);
  for (int64_t d0 = 0; d0 < D; d0 += 8 * C) {
    const int nc = int(std::min<int64_t>(C, (D - d0) / 8));
    __m256 acc[G][C];
    GPTC_UNROLL for (int i = 0; i < G; ++i)
      GPTC_UNROLL for (int c = 0; c < C; ++c) acc[i][c] = _mm256_setzero_ps();
    // Key k = j * m + t into the sums of the queries that have it (every query: all).
    auto key = [&](int64_t t, int j, bool all) {
      const int64_t k = j * m + t;
      const T* vr = vb + int64_t(idx[k]) * D + d0;
      GPTC_UNROLL for (int c = 0; c < C; ++c) {
        if (c >= nc) break;
        const __m256 v = cache_load8(vr + 8 * c);
        GPTC_UNROLL for (int i = 0; i < G; ++i)
          if (all || k < n[i]) acc[i][c] = _mm256_fmadd_ps(_mm256_set1_ps(p[i][8 * t + j]), v, acc[i][c]);
      }
    };
    for (int64_t t = 0; t < full; ++t)
      GPTC_UNROLL for (int j = 0; j < 8; ++j) key(t, j, true);
    Lanes pass(m, nmax);
    for (int64_t t = full; t < m; ++t)
      for (int j = 0, l = pass.at(t); j < l; ++j) key(t, j, G == 1);
    GPTC_UNROLL for (int i = 0; i < G; ++i)
      GPTC_UNROLL for (int c = 0; c < C; ++c)
        if (c < nc) _mm256_storeu_ps(o[i] + d0 + 8 * c, _mm256_mul_ps(acc[i][c], _mm256_set1_ps(inv[i])));
  }
}
#endif

// The keys and values the next attention reads (two regions of `bytes` each), prefetched into L2
// over this one's passes: a decode step's rows each read a few KB of every head's cache, too
// short a stream for the hardware prefetcher to get ahead of.
struct NextKv {
  const char *k = nullptr, *v = nullptr;
  int64_t bytes = 0;
};

// The g <= 8 queries qv[i] (n[i] >= 1 keys; one m = ceil(n[i] / 8) on AVX2 builds) into o[i].
// p: scratch of g * (max n + 8) floats.
template <class T>
void attend_rows(const float* const* qv, const int64_t* n, int g, const T* kb, const T* vb, const int32_t* idx,
                 int64_t D, float scale, float* p, float* const* o, const NextKv& next = {}) {
#if defined(__AVX2__)
  if (D % 8 == 0) {
    const int64_t m = (n[0] + 7) / 8;  // keys per segment = passes; key of pass t, lane j: j * m + t
    int64_t nmin = n[0];
    for (int i = 1; i < g; ++i) nmin = std::min(nmin, n[i]);
    const int64_t full = full_passes(m, nmin);
    float* pi[8];
    for (int i = 0; i < g; ++i) pi[i] = p + i * 8 * m;
    const int64_t lines = (next.bytes + 63) / 64, per = (lines + m - 1) / m;
    for (int64_t t = 0; t < m; ++t) {
      for (int64_t l = t * per; l < std::min(lines, (t + 1) * per); ++l) {
        _mm_prefetch(next.k + 64 * l, _MM_HINT_T1);
        _mm_prefetch(next.v + 64 * l, _MM_HINT_T1);
      }
      const T* kr[8];
      for (int i = 0; i < g; ++i) {
        if (i == 0 || t >= full)  // past a query's n: its last key (a valid row, masked below)
          for (int j = 0; j < 8; ++j) kr[j] = kb + int64_t(idx[std::min<int64_t>(j * m + t, n[i] - 1)]) * D;
        score_pass(qv[i], kr, D, scale, pi[i] + 8 * t);
      }
    }
    float inv[8];
    for (int i = 0; i < g; ++i) inv[i] = softmax_passes(pi[i], m, n[i]);
    switch (g) {
      case 1: return value_sums<T, 1>(pi, n, inv, m, full, vb, idx, D, o);
      case 2: return value_sums<T, 2>(pi, n, inv, m, full, vb, idx, D, o);
      case 3: return value_sums<T, 3>(pi, n, inv, m, full, vb, idx, D, o);
      case 4: return value_sums<T, 4>(pi, n, inv, m, full, vb, idx, D, o);
      case 5: return value_sums<T, 5>(pi, n, inv, m, full, vb, idx, D, o);
      case 6: return value_sums<T, 6>(pi, n, inv, m, full, vb, idx, D, o);
      case 7: return value_sums<T, 7>(pi, n, inv, m, full, vb, idx, D, o);
      default: return value_sums<T, 8>(pi, n, inv, m, full, vb, idx, D, o);
    }
  }
#endif
  for (int i = 0; i < g; ++i) {
    float* oi = o[i];
    const float* q = qv[i];
    float mx = -INFINITY;
    for (int64_t k = 0; k < n[i]; ++k) {
      float s = 0.f;
      for (int64_t d = 0; d < D; ++d) s = std::fma(q[d], cache_value(kb + int64_t(idx[k]) * D + d), s);
      p[k] = s * scale;
      mx = std::max(mx, p[k]);
    }
    float sum = 0.f;
    for (int64_t k = 0; k < n[i]; ++k) {
      p[k] = std::exp(p[k] - mx);
      sum += p[k];
    }
    const float inv = 1.f / sum;
    for (int64_t d = 0; d < D; ++d) oi[d] = 0.f;
    for (int64_t k = 0; k < n[i]; ++k)
      for (int64_t d = 0; d < D; ++d) oi[d] = std::fma(p[k], cache_value(vb + int64_t(idx[k]) * D + d), oi[d]);
    for (int64_t d = 0; d < D; ++d) oi[d] *= inv;
  }
}

}  // namespace

#endif  // GPTC_KERNELS_GPTC_NORM_ATTENTION_H_
