// Common definitions of the fused CPU operators: the includes, the profiler ($GPTC_PROFILE), the
// thread count ($GPTC_THREADS), a Linear's weights (LinearWeights), the weight formats and views
// (weight_format, WeightView), the AVX2 vector helpers (hsum, the int8 dot products, int4
// unpacking, exp8) and a row's argmax.
// Part of the one translation unit gptc_ops.cc (included there in order; formats and contract: its head comment).
#ifndef GPTC_KERNELS_GPTC_COMMON_H_
#define GPTC_KERNELS_GPTC_COMMON_H_

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "paddle/extension.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

// The AVX-512 GEMM micro-kernels (gptc_gemm512.h): float where the build has AVX-512 F/BW/VL, int
// where it also has AVX-512 VNNI.
#if defined(__AVX2__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define GPTC_F512 1
#if defined(__AVX512VNNI__)
#define GPTC_VNNI512 1
#endif
#endif

namespace {

// ---------------------------------------------------------------------------- profile
// $GPTC_PROFILE=<path> (read once, at load): every op section's wall time and count is summed
// (decode calls with T == 1 and prefill/scoring calls apart), with the fastest call of each, and
// written to <path> as JSON ({kind: {section: [ns, calls, least ns]}}) when the process exits
// (bench/kernels.py; one predictor running at a time: the sums are not synchronized). Unset: one
// predictable branch per section.
enum ProfileSection { kEmbed, kLn1, kQkv, kAttn, kOut, kLn2, kFc, kProj, kHeadLn, kHead, kGap, kOutside, kNumSections };
const char* const kSectionNames[kNumSections] = {"embed", "ln1", "qkv", "attention", "out", "ln2", "fc", "proj",
                                         "head_ln", "head_linear", "between_ops", "outside_program"};
struct Profile {
  const char* path = std::getenv("GPTC_PROFILE");
  double ns[2][kNumSections] = {};
  int64_t calls[2][kNumSections] = {};
  double least[2][kNumSections] = {};  // the fastest call of each section (the least disturbed one)
  void add(int kind, int sec, double t) {
    ns[kind][sec] += t;
    least[kind][sec] = calls[kind][sec]++ ? std::min(least[kind][sec], t) : t;
  }
  std::chrono::steady_clock::time_point last_end{};  // end of the previous op (gaps between ops)
  bool head_ended = false;                             // the previous op was a head: a new program run
  ~Profile() {
    if (path == nullptr || !*path) return;
    if (FILE* f = std::fopen(path, "w")) {
      std::fprintf(f, "{");
      for (int t = 0; t < 2; ++t) {
        std::fprintf(f, "%s\"%s\": {", t ? ", " : "", t ? "prefill" : "decode");
        for (int i = 0; i < kNumSections; ++i)
          std::fprintf(f, "%s\"%s\": [%.0f, %lld, %.0f]", i ? ", " : "", kSectionNames[i], ns[t][i],
                       (long long)calls[t][i], least[t][i]);
        std::fprintf(f, "}");
      }
      std::fprintf(f, "}\n");
      std::fclose(f);
    }
  }
};
Profile g_prof;

// Section timer of one op call: lap(sec) adds the time since the previous lap (or the op's
// entry) to sec. Also records the gap since the previous op ended (op_enter/op_exit).
struct Laps {
  int kind;
  std::chrono::steady_clock::time_point t;
  explicit Laps(int kind_) : kind(kind_) {
    if (g_prof.path) t = std::chrono::steady_clock::now();
  }
  void lap(int sec) {
    if (!g_prof.path) return;
    const auto now = std::chrono::steady_clock::now();
    g_prof.add(kind, sec, std::chrono::duration<double, std::nano>(now - t).count());
    t = now;
  }
};

// At an op's entry/exit: the time since the previous op ended (Paddle between ops, or outside
// the program between runs when the previous op was the head).
inline void op_enter(int kind) {
  if (!g_prof.path) return;
  const auto now = std::chrono::steady_clock::now();
  if (g_prof.last_end.time_since_epoch().count()) {
    const int sec = g_prof.head_ended ? kOutside : kGap;
    g_prof.add(kind, sec, std::chrono::duration<double, std::nano>(now - g_prof.last_end).count());
  }
}
inline void op_exit(bool head) {
  if (!g_prof.path) return;
  g_prof.last_end = std::chrono::steady_clock::now();
  g_prof.head_ended = head;
}

// Read per region (cheap): a backend sets it for the process (inference/fused.py).
inline int nthreads() {
  const char* e = std::getenv("GPTC_THREADS");
  const int n = e ? std::atoi(e) : 0;
  return n > 0 ? n : omp_get_max_threads();
}

// A Linear's weights as the kernels see them (y = x @ W^T + bias, W (N, K)): float32 (bits 32) or
// int codes (bits 8 or 4, weight_format below) with float scales per block of blk inputs. act: the
// int layer's inputs, < 0 float (the weights dequantized), 0 int8 quantized per token and block,
// > 0 int8 with that one calibrated scale (gptc_ops.cc's head comment).
struct LinearWeights {
  const float* wf = nullptr;    // float32 (N, K)
  const int8_t* wq = nullptr;   // int8 (N, K) or int4 packed (N, K/2)
  const float* scale = nullptr; // (N, K/blk)
  const float* bias = nullptr;  // (N) or null
  int64_t n = 0, k = 0, blk = 0;
  int bits = 32;
  float act = -1.f;
  bool grouped = false;  // int8 codes and scales in row groups (weight_format::kInt8Grouped, gptc_grouped.h)
};

// ---------------------------------------------------------------------------- weight formats
// The weight block formats, defined here once for the kernels and once in Python
// (export/fused.py's WEIGHT_FORMAT, which writes them; tests/test_kernel_sources.py checks that
// the two agree). A Linear weight is (N, K), K contiguous; an int weight has float scales
// (N, K / blk), one per block of blk inputs (blk = K / the scales' columns).
namespace weight_format {
constexpr int kFloatBits = 32;       // float32 values
constexpr int kInt8Bits = 8;         // one signed code a byte (codes of 2..8 bits are stored so)
constexpr int kInt4Bits = 4;         // two codes a byte, packed in runs
constexpr int kInt4Run = 32;         // inputs of one packed run
constexpr int kInt4RunBytes = 16;    // its bytes: byte j holds input j (low nibble), j + 16 (high)
constexpr int kInt4HighInput = 16;   // the input a byte's high nibble holds, past the low one's
constexpr int kInt4Offset = 8;       // a code w is stored as w + 8 (0..15)
// Int8 codes + 128 in groups of kGroupRows rows, 4 inputs of each row a step (gptc_grouped.h),
// scales in the same groups; a format code, not a bit width (the op's bits attributes carry it).
constexpr int kInt8Grouped = 9;
constexpr int kGroupRows = 48;
static_assert(kInt4RunBytes * 8 == kInt4Run * kInt4Bits, "a run's bytes hold its codes exactly");
static_assert(kInt4HighInput == kInt4RunBytes, "byte j holds inputs j and j + 16: one 16-byte load unpacks 32");
static_assert(kInt4Offset == 1 << (kInt4Bits - 1), "signed codes -8..7 stored unsigned 0..15");
static_assert(kInt4Run % 8 == 0 && kInt8Bits == 8, "runs of whole 8-lane vectors, int8 codes one a byte");
}  // namespace weight_format

// A weight as the kernels see it: (d0, d1) values at p (d1 = 1 for a vector), float32 or int8;
// a tensor's own memory (weight_view()) or a piece of a packed weights blob (gptc_decoder_stack.h).
struct WeightView {
  const void* p = nullptr;
  int64_t d0 = 0, d1 = 1;
  int64_t avail = 0;  // elements from p to the end of its memory (a grouped weight's padded rows lie past d0)
  bool i8 = false;
  const float* f() const { return static_cast<const float*>(p); }
  const int8_t* q() const { return static_cast<const int8_t*>(p); }
};

WeightView weight_view(const paddle::Tensor& t) {
  WeightView v;
  const auto& d = t.dims();
  v.i8 = t.dtype() == paddle::DataType::INT8;
  PD_CHECK(v.i8 || t.dtype() == paddle::DataType::FLOAT32, "gptc: weights must be float32 or int8");
  v.p = v.i8 ? static_cast<const void*>(t.data<int8_t>()) : static_cast<const void*>(t.data<float>());
  v.d0 = d.size() ? d[0] : 1;
  v.d1 = d.size() > 1 ? d[d.size() - 1] : 1;
  v.avail = t.numel();
  return v;
}

// Whether int8 codes w (N, K) and scales s (N, nb) in row groups (weight_format::kInt8Grouped)
// lie in their memory: N rounded up to whole groups of each.
inline bool grouped_fits(const WeightView& w, const WeightView& s) {
  const int64_t rows = (w.d0 + weight_format::kGroupRows - 1) / weight_format::kGroupRows * weight_format::kGroupRows;
  return s.d0 == w.d0 && rows * w.d1 <= w.avail && rows * s.d1 <= s.avail;
}

LinearWeights make_linear_weights(const WeightView& w, const WeightView& s, const float* bias, int bits, float act) {
  LinearWeights L;
  L.bits = bits;
  L.act = act;
  L.n = w.d0;
  if (bits == weight_format::kFloatBits) {
    PD_CHECK(!w.i8, "gptc: float weight expected");
    L.wf = w.f();
    L.k = w.d1;
  } else {
    PD_CHECK(w.i8, "gptc: int8 weight codes expected");
    PD_CHECK(bits == weight_format::kInt8Bits || bits == weight_format::kInt4Bits ||
                 bits == weight_format::kInt8Grouped,
             "gptc: weights must be 32, 8 or 4 bits (or int8 in row groups)");
    if (bits == weight_format::kInt8Grouped) L.grouped = true, L.bits = bits = weight_format::kInt8Bits;
    PD_CHECK(!s.i8 && s.d1 > 0, "gptc: float weight scales expected");
    L.wq = w.q();
    L.k = bits == weight_format::kInt4Bits ? w.d1 * (8 / weight_format::kInt4Bits) : w.d1;
    L.scale = s.f();
    L.blk = L.k / s.d1;
    PD_CHECK(bits == weight_format::kInt8Bits || L.k % weight_format::kInt4Run == 0,
             "gptc: int4 weights need a multiple of 32 inputs");
    PD_CHECK(s.d0 == L.n && L.blk * s.d1 == L.k, "gptc: weight scale shape mismatch");
    if (L.grouped) {
      PD_CHECK(act >= 0.f && L.k % 4 == 0 && L.blk % 4 == 0,
               "gptc: int8 weights in row groups need int8 inputs and blocks of whole 4-code steps");
      PD_CHECK(grouped_fits(w, s), "gptc: int8 weights in row groups lie outside their blob");
    }
  }
  L.bias = bias;
  return L;
}

LinearWeights make_linear_weights(const paddle::Tensor& w, const paddle::Tensor& s, const paddle::Tensor* b, int bits,
                                  float act) {
  return make_linear_weights(weight_view(w), weight_view(s), b != nullptr ? b->data<float>() : nullptr, bits, act);
}

#if defined(__AVX2__)
// The one horizontal sum every output of the float kernels goes through (a fixed tree).
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 32 uint8 x 32 int8 -> 8 int32 partial sums (lane l: bytes 4l..4l+3), exact while maddubs's
// pairs stay below 2^15. VNNI (AVX512-VL VNNI or AVX-VNNI builds) does it in one instruction.
inline __m256i dot32_u8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// Two 32-byte dots of unsigned 4-bit codes (u0, u1 < 16) with int8 s0, s1, summed: 8 int32 lanes
// (lane l: bytes 4l..4l+3 of both), exact: without VNNI the two maddubs' int16 pairs are added
// before one madd (|pair| <= 2 * 15 * 128, so the sum stays below 2^15).
inline __m256i dot2_u4(__m256i u0, __m256i s0, __m256i u1, __m256i s1) {
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
  return _mm256_add_epi32(dot32_u8(u0, s0), dot32_u8(u1, s1));
#else
  return _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(u0, s0), _mm256_maddubs_epi16(u1, s1)),
                           _mm256_set1_epi16(1));
#endif
}

// 32 int8 x 32 int8 -> 8 int32 partial sums: |x| as unsigned times w with x's sign, exact
// (maddubs pairs stay below 2 * 128 * 127 < 2^15).
inline __m256i dot32_i8(__m256i ax, __m256i x, __m256i w) { return dot32_u8(ax, _mm256_sign_epi8(w, x)); }

// The 32 packed int4 codes of one 32-input run at p (16 bytes: byte j holds input j in its low
// nibble, input j + 16 in its high one) as unsigned bytes c = w + 8 (0..15), in input order.
inline __m256i unpack_u4(const int8_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), _mm256_set1_epi8(0x0F));
}
// The same 32 codes signed (w = c - 8, -8..7).
inline __m256i unpack_i4(const int8_t* p) {
  return _mm256_sub_epi8(unpack_u4(p), _mm256_set1_epi8(weight_format::kInt4Offset));
}

// The total of a dot's 8 int32 lanes, and of four dots (lane j: d_j's), exact in any order.
inline int32_t total(__m256i d) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(d), _mm256_extracti128_si256(d, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}
// hadd4: lane j of each 128-bit half holds that half's total of d_j (totals4 adds the halves).
inline __m256i hadd4(__m256i d0, __m256i d1, __m256i d2, __m256i d3) {
  return _mm256_hadd_epi32(_mm256_hadd_epi32(d0, d1), _mm256_hadd_epi32(d2, d3));
}
inline __m128i totals4(__m256i d0, __m256i d1, __m256i d2, __m256i d3) {
  const __m256i h = hadd4(d0, d1, d2, d3);
  return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

// exp of 8 lanes (Cephes' polynomial, ~1 ulp); every lane independent of the others, so a
// value's exp never depends on where it sits in a buffer.
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
#endif

// np.argmax of a row of n floats: the first NaN if there is one, else the first maximum (values
// compare as numpy compares them: -0 == +0). Greedy decoding's token (the decoder op's Tokens).
inline int64_t row_argmax(const float* v, int64_t n) {
  float m = -INFINITY;
  bool nan = false;
  int64_t i = 0;
#if defined(__AVX2__)
  if (n >= 8) {
    __m256 mv = _mm256_set1_ps(-INFINITY), un = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
      const __m256 x = _mm256_loadu_ps(v + i);
      un = _mm256_or_ps(un, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
      mv = _mm256_max_ps(x, mv);  // a NaN x leaves mv (max_ps returns its second operand)
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, mv);
    for (float l : lanes) m = std::max(m, l);
    nan = _mm256_movemask_ps(un) != 0;
  }
#endif
  for (; i < n; ++i) {
    if (v[i] != v[i]) nan = true;
    else if (v[i] > m) m = v[i];
  }
  for (i = 0; i < n; ++i)
    if (nan ? v[i] != v[i] : v[i] == m) return i;
  return 0;  // n == 0
}

}  // namespace

#endif  // GPTC_KERNELS_GPTC_COMMON_H_
