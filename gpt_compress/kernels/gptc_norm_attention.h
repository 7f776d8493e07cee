// Layer norm, the activations (ReLU, exact GELU, gelu_new) and attention of one query over its
// unmasked cache keys.
// Part of the one translation unit gptc_ops.cc (included there in order; formats and contract: its head comment).
#ifndef GPTC_KERNELS_GPTC_NORM_ATTENTION_H_
#define GPTC_KERNELS_GPTC_NORM_ATTENTION_H_

#include "gptc_common.h"

namespace {

void layer_norm(const float* x, int64_t M, int64_t C, const float* w, const float* b, float eps,
                float* y) {
  for (int64_t m = 0; m < M; ++m) {
    const float* xm = x + m * C;
    float mean = 0.f, var = 0.f;
    for (int64_t c = 0; c < C; ++c) mean += xm[c];
    mean /= C;
    for (int64_t c = 0; c < C; ++c) var = std::fma(xm[c] - mean, xm[c] - mean, var);
    const float inv = 1.f / std::sqrt(var / C + eps);
    for (int64_t c = 0; c < C; ++c) y[m * C + c] = std::fma((xm[c] - mean) * inv, w[c], b[c]);
  }
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

// One query against its n keys (rows idx[0..n) of kb/vb, D values each): softmax(q.k * scale) @ v
// into o. Keys are the query's unmasked cache columns in order, so every reduction runs over
// the same values in the same order whatever the padding, batch or prefill/decode split.
// p: scratch of n + 8 floats.
// AVX2: the keys are cut into 8 equal segments (m = ceil(n / 8) keys each) and pass t takes key
// t of each, so the keys and then the values are read as 8 sequential streams (as the GEMV reads
// its weights: 8 streams keep more memory requests in flight than one): p holds pass t's 8
// scores at p[8t..8t+8), a lane per segment; the softmax sum runs lane-wise over the passes, the
// values in pass order.
template <class T>
void attend(const float* qv, const T* kb, const T* vb, const int32_t* idx, int64_t n, int64_t D, float scale,
            float* p, float* o) {
  for (int64_t d = 0; d < D; ++d) o[d] = 0.f;
  if (n == 0) return;  // a padding query: attends to nothing real
#if defined(__AVX2__)
  if (D % 8 == 0) {
    const int64_t m = (n + 7) / 8;  // keys per segment = passes; key of pass t, lane j: j * m + t
    auto key = [&](int64_t t, int j) { return std::min<int64_t>(j * m + t, n - 1); };  // past n: a valid row, masked
    for (int64_t t = 0; t < m; ++t) {  // one fixed reduction tree per key
      __m256 a[8];
      const T* kr[8];
      for (int j = 0; j < 8; ++j) {
        kr[j] = kb + int64_t(idx[key(t, j)]) * D;
        a[j] = _mm256_setzero_ps();
      }
      for (int64_t d = 0; d < D; d += 8) {
        const __m256 qd = _mm256_loadu_ps(qv + d);
        for (int j = 0; j < 8; ++j) a[j] = _mm256_fmadd_ps(qd, cache_load8(kr[j] + d), a[j]);
      }
      const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
      const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
      const __m256 s = _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
      _mm256_storeu_ps(p + 8 * t, _mm256_mul_ps(s, _mm256_set1_ps(scale)));
    }
    // Lanes of pass t holding a key (j * m + t < n): the first lanes.at(t); the others are
    // masked. Counted down as t grows (lane j's last pass is n - 1 - j * m) rather than by an
    // integer division for every pass of every loop.
    struct Lanes {
      int64_t m, n;
      int l;
      int at(int64_t t) {  // t ascending
        while (l > 0 && (l - 1) * m + t >= n) --l;
        return l;
      }
    };
    const int lanes0 = int(std::min<int64_t>(8, (n - 1) / m + 1));
    // The maximum over every lane: a masked lane repeats the last key's score (key() clamps).
    __m256 vmax = _mm256_set1_ps(-INFINITY);
    for (int64_t t = 0; t < m; ++t) vmax = _mm256_max_ps(_mm256_loadu_ps(p + 8 * t), vmax);
    alignas(32) float lane_max[8];
    _mm256_store_ps(lane_max, vmax);
    float mx = -INFINITY;
    for (int j = 0; j < 8; ++j) mx = std::max(mx, lane_max[j]);
    __m256 sum = _mm256_setzero_ps();
    const __m256 vmx = _mm256_set1_ps(mx);
    Lanes lanes{m, n, lanes0};
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
    const float inv = 1.f / hsum(sum);
    for (int64_t d0 = 0; d0 < D; d0 += 64) {  // sum p v in pass order, 8 accumulators of 8 dims
      const int nd = int(std::min<int64_t>(64, D - d0) / 8);
      __m256 acc[8];
      for (int c = 0; c < 8; ++c) acc[c] = _mm256_setzero_ps();
      Lanes pass{m, n, lanes0};
      for (int64_t t = 0; t < m; ++t) {
        for (int j = 0, l = pass.at(t); j < l; ++j) {
          const __m256 w = _mm256_set1_ps(p[8 * t + j]);
          const T* vr = vb + int64_t(idx[j * m + t]) * D + d0;
          for (int c = 0; c < nd; ++c) acc[c] = _mm256_fmadd_ps(w, cache_load8(vr + 8 * c), acc[c]);
        }
      }
      for (int c = 0; c < nd; ++c) _mm256_storeu_ps(o + d0 + 8 * c, _mm256_mul_ps(acc[c], _mm256_set1_ps(inv)));
    }
    return;
  }
#endif
  float mx = -INFINITY;
  for (int64_t i = 0; i < n; ++i) {
    float s = 0.f;
    for (int64_t d = 0; d < D; ++d) s = std::fma(qv[d], cache_value(kb + int64_t(idx[i]) * D + d), s);
    p[i] = s * scale;
    mx = std::max(mx, p[i]);
  }
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    p[i] = std::exp(p[i] - mx);
    sum += p[i];
  }
  const float inv = 1.f / sum;
  for (int64_t i = 0; i < n; ++i)
    for (int64_t d = 0; d < D; ++d) o[d] = std::fma(p[i], cache_value(vb + int64_t(idx[i]) * D + d), o[d]);
  for (int64_t d = 0; d < D; ++d) o[d] *= inv;
}

}  // namespace

#endif  // GPTC_KERNELS_GPTC_NORM_ATTENTION_H_
