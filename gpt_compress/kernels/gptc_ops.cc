// gpt-compress fused CPU operators for Paddle (custom ops, PD_BUILD_OP).
//
// Three ops make a whole decode/prefill/scoring program (export/fused.py):
//   gptc_embed(ids (B,T), mask (B,S+T), wte, wte_scale, wpe, wpe_scale) -> x (B,T,C)
//   gptc_layer(x, mask, k_cache, v_cache, 16 weights) -> y (B,T,C); the new keys/values are
//       written IN PLACE into the preallocated caches (B,H,cap,D) at positions S..S+T-1
//       (S = mask columns - T): no concat, no copy of the cache per step.
//   gptc_head(x (B,T,C), rows (n,), ln_w, ln_b, w, w_scale) -> logits (n,V) of the flat rows.
//
// Every Linear weight is stored (N, K) (outputs x inputs, K contiguous) in one of:
//   float32; int8 codes (N,K) with float scales (N,K/blk); int4 codes stored code+8, packed two
//   per byte (N,K/2): in each run of 32 inputs, byte j holds input j (low nibble) and input j+16
//   (high nibble), so one 16-byte load unpacks into 32 consecutive codes; scales (N,K/blk).
// Inputs of an int layer are float (act < 0: weights dequantized on the fly), int8 per token and
// block made on the fly (act == 0: scale max|x|/127, onnxruntime MatMulNBits accuracy_level=4
// and qat.quantize.fake_quant_dynamic) or int8 with one calibrated scale (act > 0: W8A8,
// weights per channel, blk == K). Integer dots accumulate in int32 per block, exactly.
// Threads: OpenMP inside each op, $GPTC_THREADS of them (else omp_get_max_threads()).
// Matrix products run in blocks of 12 weight rows, each read once for all M input rows (a GEMM
// for prefill and batches: 4x3 float and int8 tiles, 2x4 for packed int4; GEMV for M = 1). Batch invariant:
// an output's arithmetic never depends on M, the tile, the thread or the other rows, and
// attention runs over each row's unmasked keys in order, so a sequence's logits are bitwise the
// same alone, left-padded in a batch, prefilled at once or token by token (tests/test_fused.py).
// Vector paths are AVX2 (+FMA); VNNI dot products compile in where -march=native has them
// (not verified on the AVX2-only machines this was developed on).
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

namespace {

// ---------------------------------------------------------------------------- profile
// $GPTC_PROFILE=<path> (read once, at load): every op section's wall time and count is summed
// (decode calls with T == 1 and prefill/scoring calls apart), with the fastest call of each, and
// written to <path> as JSON ({kind: {section: [ns, calls, least ns]}}) when the process exits
// (bench/kernels.py; one predictor running at a time: the sums are not synchronized). Unset: one
// predictable branch per section.
enum Sec { kEmbed, kLn1, kQkv, kAttn, kOut, kLn2, kFc, kProj, kHeadLn, kHead, kGap, kOutside, kNumSec };
const char* const kSecNames[kNumSec] = {"embed", "ln1", "qkv", "attention", "out", "ln2", "fc", "proj",
                                         "head_ln", "head_linear", "between_ops", "outside_program"};
struct Profile {
  const char* path = std::getenv("GPTC_PROFILE");
  double ns[2][kNumSec] = {};
  int64_t calls[2][kNumSec] = {};
  double least[2][kNumSec] = {};  // the fastest call of each section (the least disturbed one)
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
        for (int i = 0; i < kNumSec; ++i)
          std::fprintf(f, "%s\"%s\": [%.0f, %lld, %.0f]", i ? ", " : "", kSecNames[i], ns[t][i],
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

struct Lin {
  const float* wf = nullptr;    // float32 (N, K)
  const int8_t* wq = nullptr;   // int8 (N, K) or int4 packed (N, K/2)
  const float* scale = nullptr; // (N, K/blk)
  const float* bias = nullptr;  // (N) or null
  int64_t n = 0, k = 0, blk = 0;
  int bits = 32;
  float act = -1.f;
};

Lin make_lin(const paddle::Tensor& w, const paddle::Tensor& s, const paddle::Tensor* b, int bits,
             float act) {
  Lin L;
  L.bits = bits;
  L.act = act;
  L.n = w.shape()[0];
  if (bits == 32) {
    PD_CHECK(w.dtype() == paddle::DataType::FLOAT32, "gptc: float weight expected");
    L.wf = w.data<float>();
    L.k = w.shape()[1];
  } else {
    PD_CHECK(w.dtype() == paddle::DataType::INT8, "gptc: int8 weight codes expected");
    PD_CHECK(bits == 8 || bits == 4, "gptc: weights must be 32, 8 or 4 bits");
    L.wq = w.data<int8_t>();
    L.k = bits == 4 ? w.shape()[1] * 2 : w.shape()[1];
    L.scale = s.data<float>();
    L.blk = L.k / s.shape()[1];
    PD_CHECK(bits == 8 || L.k % 32 == 0, "gptc: int4 weights need a multiple of 32 inputs");
    PD_CHECK(s.shape()[0] == L.n && L.blk * s.shape()[1] == L.k, "gptc: weight scale shape mismatch");
  }
  if (b != nullptr) L.bias = b->data<float>();
  return L;
}

#if defined(__AVX2__)
// The one horizontal sum every output of the float kernels goes through (a fixed tree).
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 32 int8 x 32 int8 -> 8 int32 partial sums: |x| as unsigned times w with x's sign, exact
// (maddubs pairs stay below 2 * 128 * 127 < 2^15). VNNI does it in one instruction (compiled in
// by -march=native where the CPU has it; unverified on the AVX2-only machines of this repo).
inline __m256i dot32_i8(__m256i ax, __m256i x, __m256i w) {
  const __m256i sw = _mm256_sign_epi8(w, x);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), ax, sw);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), ax, sw);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(ax, sw), _mm256_set1_epi16(1));
#endif
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

void activate(float* h, int64_t n, int act);

// Scratch of one thread, kept across calls (libgomp's threads persist): no allocation per call
// once grown. The op's calling thread also keeps the buffers its threads share (Shared).
struct Scratch {
  std::vector<float> h, sx, wbuf, tile, p;
  std::vector<int8_t> xq, ibuf;
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
  trim(s.h), trim(s.sx), trim(s.wbuf), trim(s.tile), trim(s.p), trim(s.xq), trim(s.ibuf);
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

// Output rows [n0, n0 + nr) (nr <= NBLK) of y (M, ldy) = x @ W^T + bias for all M input rows,
// then the epilogue on each new value: activation `act` (>= 0), and + res (same layout as y;
// may be y itself: each value is read before it is written, by the thread that writes it).
void linear_block(const Lin& L, const In& in, int64_t M, int64_t n0, int nr, float* y, int64_t ldy,
                  const float* res, int act, Scratch& sc) {
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
  if (L.bits == 32) {
    fblock(in.x, M, K, L.wf + n0 * K, nr, t, NBLK, bias, pf, pf_bytes);
  } else {
    const int8_t* q[NBLK];
    const float* sw[NBLK];
    const bool packed = L.bits == 4 && in.xq != nullptr && packed4_ok(M, K, L.blk);
    int8_t* ibuf = L.bits == 4 && !packed ? grow(sc.ibuf, size_t(NBLK * K)) : nullptr;  // unpacked int4 rows
    for (int n = 0; n < nr; ++n) {
      q[n] = packed ? L.wq + (n0 + n) * (K / 2) : int_row(L, n0 + n, ibuf ? ibuf + n * K : nullptr);
      sw[n] = L.scale + (n0 + n) * (K / L.blk);
    }
    if (packed) {
      iblock<true>(in.xq, in.sx, M, K, K / L.blk, L.blk, q, sw, nr, t, NBLK, bias);
    } else if (in.xq != nullptr) {
      iblock(in.xq, in.sx, M, K, K / L.blk, L.blk, q, sw, nr, t, NBLK, bias, pf, pf_bytes);
    } else {
      float* wbuf = grow(sc.wbuf, size_t(NBLK * K));  // the fake-quant weight: codes * block scales
      for (int n = 0; n < nr; ++n)
        for (int64_t j = 0; j < K; ++j) wbuf[n * K + j] = float(q[n][j]) * sw[n][j / L.blk];
      fblock(in.x, M, K, wbuf, nr, t, NBLK, bias, pf, pf_bytes);
    }
  }
  // The activation elementwise: over the whole tile when its rows are contiguous (nr == NBLK; the
  // same values, a value's activation depending on it alone, without a padded tail per row).
  const bool whole = act >= 0 && nr == NBLK;
  if (whole) activate(t, M * NBLK, act);
#if defined(__AVX2__)
  if (nr == NBLK) {  // 12 values a row: one 8- and one 4-lane move (a memcpy call each cost ~1 ms a prefill)
    static_assert(NBLK == 12, "the row moves below are 8 + 4 values");
    for (int64_t m = 0; m < M; ++m) {
      const float* tm = t + m * NBLK;
      float* ym = y + m * ldy + n0;
      __m256 a = _mm256_loadu_ps(tm);
      __m128 b = _mm_loadu_ps(tm + 8);
      if (res != nullptr) {  // rm + tm, as below
        const float* rm = res + m * ldy + n0;
        a = _mm256_add_ps(_mm256_loadu_ps(rm), a);
        b = _mm_add_ps(_mm_loadu_ps(rm + 8), b);
      }
      _mm256_storeu_ps(ym, a);
      _mm_storeu_ps(ym + 8, b);
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
constexpr int GEMV_PREFETCH = 6144;  // bytes ahead in a row's stream (the hardware prefetchers lag)

inline bool gemv_ok(const Lin& L, const In& in) {
#if defined(__AVX2__)
  return L.bits == 32 || (in.xq != nullptr && L.k % 32 == 0 && L.blk % 32 == 0);
#else
  return false;
#endif
}

#if defined(__AVX2__)
// NR float weight rows (K apart) against x: y[n] = x . w_n + bias[n]. Every 64 bytes of each row
// a prefetch GEMV_PREFETCH bytes ahead (the rows of later passes).
template <int NR>
inline void fgemv_tile(const float* x, const float* w, int64_t K, float* y, const float* bias) {
  __m256 acc[NR];
  GPTC_UNROLL for (int n = 0; n < NR; ++n) acc[n] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    const __m256 xv = _mm256_loadu_ps(x + k);
    if (!(k & 15)) {
      GPTC_UNROLL for (int n = 0; n < NR; ++n)
        _mm_prefetch(reinterpret_cast<const char*>(w + n * K + k) + GEMV_PREFETCH, _MM_HINT_T0);
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
#pragma omp for schedule(dynamic, grain)
  for (int64_t c = 0; c < chunks; ++c)
    gemv_rows(L, in, c * GEMV_ROWS, std::min(L.n, (c + 1) * GEMV_ROWS), y, res, act, sc);
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

void layer_norm(const float* x, int64_t M, int64_t C, const float* w, const float* b, float eps,
                float* y) {
  for (int64_t m = 0; m < M; ++m) {
    const float* xm = x + m * C;
    float mean = 0.f, var = 0.f;
    for (int64_t c = 0; c < C; ++c) mean += xm[c];
    mean /= C;
    for (int64_t c = 0; c < C; ++c) var += (xm[c] - mean) * (xm[c] - mean);
    const float inv = 1.f / std::sqrt(var / C + eps);
    for (int64_t c = 0; c < C; ++c) y[m * C + c] = (xm[c] - mean) * inv * w[c] + b[c];
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

// One query against its n keys (rows idx[0..n) of kb/vb, D floats each): softmax(q.k * scale) @ v
// into o. Keys are the query's unmasked cache columns in order, so every reduction runs over
// the same values in the same order whatever the padding, batch or prefill/decode split.
// p: scratch of n + 8 floats.
void attend(const float* qv, const float* kb, const float* vb, const int32_t* idx, int64_t n, int64_t D,
            float scale, float* p, float* o) {
  for (int64_t d = 0; d < D; ++d) o[d] = 0.f;
  if (n == 0) return;  // a padding query: attends to nothing real
#if defined(__AVX2__)
  if (D % 8 == 0) {
    for (int64_t i = 0; i < n; i += 8) {  // 8 keys per pass, one fixed reduction tree per key
      __m256 a[8];
      const float* kr[8];
      for (int j = 0; j < 8; ++j) {
        kr[j] = kb + int64_t(idx[std::min<int64_t>(i + j, n - 1)]) * D;
        a[j] = _mm256_setzero_ps();
      }
      for (int64_t d = 0; d < D; d += 8) {
        const __m256 qd = _mm256_loadu_ps(qv + d);
        for (int j = 0; j < 8; ++j) a[j] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(kr[j] + d), a[j]);
      }
      const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
      const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
      const __m256 s = _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
      _mm256_storeu_ps(p + i, _mm256_mul_ps(s, _mm256_set1_ps(scale)));
    }
    float mx = -INFINITY;
    for (int64_t i = 0; i < n; ++i) mx = std::max(mx, p[i]);
    __m256 sum = _mm256_setzero_ps();
    const __m256 vmx = _mm256_set1_ps(mx);
    for (int64_t i = 0; i < n; i += 8) {
      __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + i), vmx));
      if (i + 8 > n) {  // zero the lanes past the last key
        alignas(32) float keep[8];
        for (int j = 0; j < 8; ++j) keep[j] = i + j < n ? 1.f : 0.f;
        e = _mm256_mul_ps(e, _mm256_load_ps(keep));
      }
      _mm256_storeu_ps(p + i, e);
      sum = _mm256_add_ps(sum, e);
    }
    const float inv = 1.f / hsum(sum);
    for (int64_t d0 = 0; d0 < D; d0 += 64) {  // sum_i p_i v_i, 8 accumulators of 8 dims
      const int nd = int(std::min<int64_t>(64, D - d0) / 8);
      __m256 acc[8];
      for (int c = 0; c < 8; ++c) acc[c] = _mm256_setzero_ps();
      for (int64_t i = 0; i < n; ++i) {
        const __m256 w = _mm256_set1_ps(p[i]);
        const float* vr = vb + int64_t(idx[i]) * D + d0;
        for (int c = 0; c < nd; ++c) acc[c] = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr + 8 * c), acc[c]);
      }
      for (int c = 0; c < nd; ++c) _mm256_storeu_ps(o + d0 + 8 * c, _mm256_mul_ps(acc[c], _mm256_set1_ps(inv)));
    }
    return;
  }
#endif
  float mx = -INFINITY;
  for (int64_t i = 0; i < n; ++i) {
    float s = 0.f;
    for (int64_t d = 0; d < D; ++d) s = std::fma(qv[d], kb[int64_t(idx[i]) * D + d], s);
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
    for (int64_t d = 0; d < D; ++d) o[d] = std::fma(p[i], vb[int64_t(idx[i]) * D + d], o[d]);
  for (int64_t d = 0; d < D; ++d) o[d] *= inv;
}

int64_t cols(const paddle::Tensor& t) { return t.shape()[t.shape().size() - 1]; }

}  // namespace

// ---------------------------------------------------------------------------------- embed
std::vector<paddle::Tensor> EmbedForward(const paddle::Tensor& ids, const paddle::Tensor& mask,
                                         const paddle::Tensor& wte, const paddle::Tensor& wte_s,
                                         const paddle::Tensor& wpe, const paddle::Tensor& wpe_s,
                                         int wte_bits, int wpe_bits) {
  const int64_t B = ids.shape()[0], T = ids.shape()[1], L = mask.shape()[1];
  PD_CHECK(mask.shape()[0] == B && L >= T, "gptc_embed: mask must be (B, S+T)");
  op_enter(T > 1);
  Laps lp(T > 1);
  const int64_t C = wte_bits == 4 ? cols(wte) * 2 : cols(wte);
  auto out = paddle::empty({B, T, C}, paddle::DataType::FLOAT32, ids.place());
  float* y = out.data<float>();
  const int64_t* id = ids.data<int64_t>();
  const int64_t* mk = mask.data<int64_t>();
  const int64_t V = wte.shape()[0], P = wpe.shape()[0];
  auto row = [&](const paddle::Tensor& w, const paddle::Tensor& s, int bits, int64_t r, float* dst,
                 bool add) {
    if (bits == 32) {
      const float* src = w.data<float>() + r * C;
      for (int64_t c = 0; c < C; ++c) dst[c] = add ? dst[c] + src[c] : src[c];
      return;
    }
    const int64_t nb = cols(s), blk = C / nb;
    const float* sc = s.data<float>() + r * nb;
    const int8_t* q8 = w.data<int8_t>() + r * (bits == 4 ? C / 2 : C);
    for (int64_t c = 0; c < C; ++c) {
      const uint8_t byte = uint8_t(q8[c / 32 * 16 + c % 16]);  // int4: see the format above
      const int q = bits == 8 ? int(q8[c]) : (c % 32 < 16 ? int(byte & 0xF) : int(byte >> 4)) - 8;
      const float v = float(q) * sc[c / blk];
      dst[c] = add ? dst[c] + v : v;
    }
  };
  for (int64_t b = 0; b < B; ++b) {
    int64_t pos = 0;  // cumsum(mask) - 1, clipped at 0, for the last T columns
    for (int64_t j = 0; j < L - T; ++j) pos += mk[b * L + j];
    for (int64_t t = 0; t < T; ++t) {
      pos += mk[b * L + L - T + t];
      const int64_t p = std::min(std::max<int64_t>(pos - 1, 0), P - 1);
      const int64_t tok = std::min(std::max<int64_t>(id[b * T + t], 0), V - 1);
      float* dst = y + (b * T + t) * C;
      row(wte, wte_s, wte_bits, tok, dst, false);
      row(wpe, wpe_s, wpe_bits, p, dst, true);
    }
  }
  lp.lap(kEmbed);
  op_exit(false);
  return {out};
}

std::vector<std::vector<int64_t>> EmbedShape(const std::vector<int64_t>& ids, const std::vector<int64_t>& mask,
                                             const std::vector<int64_t>& wte, const std::vector<int64_t>& wte_s,
                                             const std::vector<int64_t>& wpe, const std::vector<int64_t>& wpe_s) {
  return {{ids[0], ids[1], -1}};  // hidden size depends on the weight format
}

std::vector<paddle::DataType> EmbedDtype(const paddle::DataType&, const paddle::DataType&, const paddle::DataType&,
                                         const paddle::DataType&, const paddle::DataType&,
                                         const paddle::DataType&) {
  return {paddle::DataType::FLOAT32};
}

PD_BUILD_OP(gptc_embed)
    .Inputs({"Ids", "Mask", "Wte", "WteScale", "Wpe", "WpeScale"})
    .Outputs({"Out"})
    .Attrs({"wte_bits: int", "wpe_bits: int"})
    .SetKernelFn(PD_KERNEL(EmbedForward))
    .SetInferShapeFn(PD_INFER_SHAPE(EmbedShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(EmbedDtype));

// ---------------------------------------------------------------------------------- layer
std::vector<paddle::Tensor> LayerForward(
    const paddle::Tensor& x, const paddle::Tensor& mask, paddle::Tensor& kc, paddle::Tensor& vc,
    const paddle::Tensor& ln1_w, const paddle::Tensor& ln1_b, const paddle::Tensor& qkv_w,
    const paddle::Tensor& qkv_s, const paddle::Tensor& qkv_b, const paddle::Tensor& out_w,
    const paddle::Tensor& out_s, const paddle::Tensor& out_b, const paddle::Tensor& ln2_w,
    const paddle::Tensor& ln2_b, const paddle::Tensor& fc_w, const paddle::Tensor& fc_s,
    const paddle::Tensor& fc_b, const paddle::Tensor& proj_w, const paddle::Tensor& proj_s,
    const paddle::Tensor& proj_b, int num_heads, float eps, int activation, const std::vector<int>& bits,
    const std::vector<float>& act) {
  PD_CHECK(bits.size() == 4 && act.size() == 4, "gptc_layer: bits and act need 4 entries");
  const int64_t B = x.shape()[0], T = x.shape()[1], C = x.shape()[2], L = mask.shape()[1];
  op_enter(T > 1);
  Laps lp(T > 1);
  const int64_t S = L - T, H = num_heads, cap = kc.shape()[2], D = kc.shape()[3], M = B * T;
  PD_CHECK(kc.shape()[0] == B && kc.shape()[1] == H && vc.shape() == kc.shape(),
           "gptc_layer: cache must be (B, heads, capacity, head_dim)");
  PD_CHECK(S >= 0 && S + T <= cap, "gptc_layer: cache capacity ", cap, " < ", S + T, " positions");
  const Lin qkv = make_lin(qkv_w, qkv_s, &qkv_b, bits[0], act[0]);
  const Lin out = make_lin(out_w, out_s, &out_b, bits[1], act[1]);
  const Lin fc = make_lin(fc_w, fc_s, &fc_b, bits[2], act[2]);
  const Lin proj = make_lin(proj_w, proj_s, &proj_b, bits[3], act[3]);
  const int64_t inner = H * D, F = fc.n;
  PD_CHECK(qkv.n == 3 * inner && qkv.k == C && out.k == inner && fc.k == C && proj.k == F,
           "gptc_layer: weight shapes do not match the cache/hidden sizes");

  auto y = paddle::empty({B, T, C}, paddle::DataType::FLOAT32, x.place());
  const float* xd = x.data<float>();
  float* yd = y.data<float>();
  const int64_t* mk = mask.data<int64_t>();
  float* K_ = kc.data<float>();
  float* V_ = vc.data<float>();
  Shared& sh = t_shared;  // this thread's: the op's threads share them during the call
  float* q = grow(sh.q, size_t(M * 3 * inner));
  float* ctx = grow(sh.ctx, size_t(M * inner));
  float* f = grow(sh.f, size_t(M * F));
  // Each row's unmasked cache columns, in order: a query at column S+t attends to those <= S+t.
  int32_t* keys = grow(sh.keys, size_t(B * L));
  int64_t* nkeys = grow(sh.nkeys, size_t(B * T));
  for (int64_t b = 0; b < B; ++b) {
    int64_t n = 0;
    for (int64_t j = 0; j < L; ++j) {
      if (mk[b * L + j]) keys[b * L + n++] = int32_t(j);
      if (j >= S) nkeys[b * T + j - S] = n;
    }
  }
  const float scale = 1.f / std::sqrt(float(D));
  const int nt = nthreads();
  // Long inputs (prefill): the layer norms and int8 inputs made once, in shared buffers
  // (prepare_rows), at the cost of up to 4 more barriers a layer; shorter ones (decode steps of
  // batches) are cheaper made by every thread. The threshold is an estimate (a barrier ~ a few
  // us vs 16 rows' norms and quantizations); not measured, the machine was contended.
  const bool rows = M >= 16;
  float* hs = nullptr;
  int8_t* xqs = nullptr;
  float* sxs = nullptr;
  if (rows) {
    int64_t kmax = 0;
    for (const Lin* L : {&qkv, &out, &fc, &proj}) kmax = std::max(kmax, L->k);
    hs = grow(sh.rows_h, size_t(M * C));
    xqs = grow(sh.rows_xq, size_t(M * kmax));
    sxs = grow(sh.rows_sx, size_t(M * kmax));  // K / blk scales a row, at most K
  }
  // Head hh's qkv outputs are the rows [hh * 3D, (hh + 1) * 3D) (head-major (H, 3, D)): with
  // enough heads per thread one work item computes them, writes the new keys/values into the
  // cache and runs the head's attention, with no barrier between the three.
  const bool by_head = H % nt == 0 || H >= 3 * nt;
  // Everything new keys/values and attention of the (b, hh) rows: keys/values of the T new
  // positions into the cache at S..S+T-1, then each query's attention.
  auto attend_head = [&](int64_t b, int64_t hh, Scratch& sc) {
    float* p = grow(sc.p, size_t(L + 8));
    for (int64_t t = 0; t < T; ++t) {
      const float* src = q + (b * T + t) * 3 * inner + hh * 3 * D;
      const int64_t dst = ((b * H + hh) * cap + S + t) * D;
      std::memcpy(K_ + dst, src + D, D * sizeof(float));
      std::memcpy(V_ + dst, src + 2 * D, D * sizeof(float));
    }
    for (int64_t t = 0; t < T; ++t)
      attend(q + (b * T + t) * 3 * inner + hh * 3 * D, K_ + (b * H + hh) * cap * D, V_ + (b * H + hh) * cap * D,
             keys + b * L, nkeys[b * T + t], D, scale, p, ctx + (b * T + t) * inner + hh * D);
  };
  // One parallel region for the layer: every thread computes the layer norms and input
  // quantizations itself (the same values: cheap, and no thread waits for another); the
  // barriers are the ends of the worksharing loops whose outputs the next step reads whole.
  // Profile laps (thread 0, after each barrier): ln1 = fork + ln1; qkv = qkv (+ cache writes
  // and attention when by_head); attention; out (+ residual); ln2; fc (+ activation); proj
  // (+ residual).
#pragma omp parallel num_threads(nt)
  {
    Scratch& sc = t_scratch;
    const bool lead = omp_get_thread_num() == 0;
    float* h = rows ? hs : grow(sc.h, size_t(M * std::max(C, int64_t(1))));
    if (!rows) layer_norm(xd, M, C, ln1_w.data<float>(), ln1_b.data<float>(), eps, h);
    const In in1 = rows ? prepare_rows(qkv, xd, M, ln1_w.data<float>(), ln1_b.data<float>(), eps, h, xqs, sxs)
                        : prepare_inputs(qkv, h, M, sc);
    if (lead) lp.lap(kLn1);
    if (by_head) {
#pragma omp for schedule(dynamic)
      for (int64_t hh = 0; hh < H; ++hh) {
        linear_rows(qkv, in1, M, hh * 3 * D, (hh + 1) * 3 * D, q, 3 * inner, nullptr, -1, sc);
        for (int64_t b = 0; b < B; ++b) attend_head(b, hh, sc);
      }
      if (lead) lp.lap(kQkv);
    } else {
      linear_for(qkv, in1, M, q, nullptr, -1);
      if (lead) lp.lap(kQkv);
#pragma omp for collapse(2) schedule(dynamic)
      for (int64_t b = 0; b < B; ++b)
        for (int64_t hh = 0; hh < H; ++hh) attend_head(b, hh, sc);
      if (lead) lp.lap(kAttn);
    }
    const In in_out = rows ? prepare_rows(out, ctx, M, nullptr, nullptr, eps, nullptr, xqs, sxs)
                           : prepare_inputs(out, ctx, M, sc);
    linear_for(out, in_out, M, yd, xd, -1);  // y = x + attention
    if (lead) lp.lap(kOut);
    if (!rows) layer_norm(yd, M, C, ln2_w.data<float>(), ln2_b.data<float>(), eps, h);
    const In in2 = rows ? prepare_rows(fc, yd, M, ln2_w.data<float>(), ln2_b.data<float>(), eps, h, xqs, sxs)
                        : prepare_inputs(fc, h, M, sc);
    if (lead) lp.lap(kLn2);
    linear_for(fc, in2, M, f, nullptr, activation);
    if (lead) lp.lap(kFc);
    const In in_proj = rows ? prepare_rows(proj, f, M, nullptr, nullptr, eps, nullptr, xqs, sxs)
                            : prepare_inputs(proj, f, M, sc);
    linear_for(proj, in_proj, M, yd, yd, -1);  // y += mlp
    if (lead) lp.lap(kProj);
    trim(sc);
  }
  trim(sh);
  op_exit(false);
  return {y};
}

std::vector<std::vector<int64_t>> LayerShape(
    const std::vector<int64_t>& x, const std::vector<int64_t>&, const std::vector<int64_t>&,
    const std::vector<int64_t>&, const std::vector<int64_t>&, const std::vector<int64_t>&,
    const std::vector<int64_t>&, const std::vector<int64_t>&, const std::vector<int64_t>&,
    const std::vector<int64_t>&, const std::vector<int64_t>&, const std::vector<int64_t>&,
    const std::vector<int64_t>&, const std::vector<int64_t>&, const std::vector<int64_t>&,
    const std::vector<int64_t>&, const std::vector<int64_t>&, const std::vector<int64_t>&,
    const std::vector<int64_t>&, const std::vector<int64_t>&) {
  return {x};
}

std::vector<paddle::DataType> LayerDtype(
    const paddle::DataType& x, const paddle::DataType&, const paddle::DataType&, const paddle::DataType&,
    const paddle::DataType&, const paddle::DataType&, const paddle::DataType&, const paddle::DataType&,
    const paddle::DataType&, const paddle::DataType&, const paddle::DataType&, const paddle::DataType&,
    const paddle::DataType&, const paddle::DataType&, const paddle::DataType&, const paddle::DataType&,
    const paddle::DataType&, const paddle::DataType&, const paddle::DataType&, const paddle::DataType&) {
  return {x};
}

PD_BUILD_OP(gptc_layer)
    .Inputs({"X", "Mask", "KCache", "VCache", "Ln1W", "Ln1B", "QkvW", "QkvS", "QkvB", "OutW", "OutS", "OutB",
             "Ln2W", "Ln2B", "FcW", "FcS", "FcB", "ProjW", "ProjS", "ProjB"})
    .Outputs({"Out", "KCacheOut", "VCacheOut"})
    .SetInplaceMap({{"KCache", "KCacheOut"}, {"VCache", "VCacheOut"}})
    .Attrs({"num_heads: int", "eps: float", "activation: int", "bits: std::vector<int>",
            "act: std::vector<float>"})
    .SetKernelFn(PD_KERNEL(LayerForward))
    .SetInferShapeFn(PD_INFER_SHAPE(LayerShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(LayerDtype));

// ---------------------------------------------------------------------------------- head
std::vector<paddle::Tensor> HeadForward(const paddle::Tensor& x, const paddle::Tensor& rows,
                                        const paddle::Tensor& ln_w, const paddle::Tensor& ln_b,
                                        const paddle::Tensor& w, const paddle::Tensor& s, float eps, int bits,
                                        float act) {
  const int64_t C = x.shape()[x.shape().size() - 1], total = x.numel() / C, n = rows.numel();
  const int kind = x.shape().size() == 3 && x.shape()[1] > 1;
  op_enter(kind);
  Laps lp(kind);
  const Lin head = make_lin(w, s, nullptr, bits, act);
  PD_CHECK(head.k == C, "gptc_head: weight has ", head.k, " inputs, hidden size is ", C);
  float* sel = grow(t_shared.sel, size_t(n * C));
  float* h = grow(t_shared.h, size_t(n * C));
  const int64_t* r = rows.data<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    PD_CHECK(r[i] >= 0 && r[i] < total, "gptc_head: row index out of range");
    std::memcpy(sel + i * C, x.data<float>() + r[i] * C, C * sizeof(float));
  }
  layer_norm(sel, n, C, ln_w.data<float>(), ln_b.data<float>(), eps, h);
  lp.lap(kHeadLn);
  auto out = paddle::empty({n, head.n}, paddle::DataType::FLOAT32, x.place());
  linear(head, h, n, out.data<float>());
  trim(t_shared);
  trim(t_scratch);  // the other threads' scratch of the head is one tile each
  lp.lap(kHead);
  op_exit(true);
  return {out};
}

std::vector<std::vector<int64_t>> HeadShape(const std::vector<int64_t>&, const std::vector<int64_t>& rows,
                                            const std::vector<int64_t>&, const std::vector<int64_t>&,
                                            const std::vector<int64_t>& w, const std::vector<int64_t>&) {
  return {{rows[0], w[0]}};
}

std::vector<paddle::DataType> HeadDtype(const paddle::DataType& x, const paddle::DataType&, const paddle::DataType&,
                                        const paddle::DataType&, const paddle::DataType&, const paddle::DataType&) {
  return {paddle::DataType::FLOAT32};
}

PD_BUILD_OP(gptc_head)
    .Inputs({"X", "Rows", "LnW", "LnB", "W", "WScale"})
    .Outputs({"Out"})
    .Attrs({"eps: float", "bits: int", "act: float"})
    .SetKernelFn(PD_KERNEL(HeadForward))
    .SetInferShapeFn(PD_INFER_SHAPE(HeadShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(HeadDtype));


// ============================================================================ head scoring
// Evaluation (issue 14; eval/scoring.py, inference/head_score.py). Separate from the ops above:
//   gptc_head_score(h (N,C) float32 final hidden states, labels (N,) int64, w (C,V) float32 head
//       weight, inputs x vocabulary) -> log p(label) (N,) float64, argmax (N,) int64
// Never materialises the (N,V) logits: each thread takes vocabulary chunks of HS_VB columns,
// packs the chunk's weights (C x HS_VB, L2-resident), computes 6-row x 16-column logit tiles
// (outer-product AVX2 kernel: 12 accumulators, one broadcast per row and two loads per k) into a
// 6 x HS_VB buffer (L1), and folds each row into a running maximum, first argmax, the label's
// logit and an online log-sum-exp (exp8 lanes summed in float32 per chunk, chunk sums rescaled
// and added in float64). Threads' partial results merge per row (largest maximum, lowest index
// on ties, sums rescaled to it). Within ~1e-7 of the float64 numpy reference
// (eval.scoring.label_logprobs) on the same logits.
namespace {

constexpr int64_t HS_VB = 256;  // vocabulary columns per chunk (a multiple of 16)
constexpr int HS_MR = 6;        // rows per tile

struct HsState {
  std::vector<float> m, picked;
  std::vector<double> s;
  std::vector<int64_t> am;
  explicit HsState(int64_t n)
      : m(n, -INFINITY), picked(n, NAN), s(n, 0.0), am(n, -1) {}
};

// MR rows of h (C apart) x the 16 columns of packed panel b (C x 16) -> t (MR rows, HS_VB apart).
template <int MR>
inline void hs_tile(const float* h, int64_t C, const float* b, float* t) {
#if defined(__AVX2__)
  __m256 acc[MR][2];
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < C; ++k) {
    const __m256 b0 = _mm256_loadu_ps(b + k * 16), b1 = _mm256_loadu_ps(b + k * 16 + 8);
    for (int r = 0; r < MR; ++r) {
      const __m256 a = _mm256_broadcast_ss(h + r * C + k);
      acc[r][0] = _mm256_fmadd_ps(a, b0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(a, b1, acc[r][1]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    _mm256_storeu_ps(t + r * HS_VB, acc[r][0]);
    _mm256_storeu_ps(t + r * HS_VB + 8, acc[r][1]);
  }
#else
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < 16; ++j) {
      float a = 0.f;
      for (int64_t k = 0; k < C; ++k) a = std::fma(h[r * C + k], b[k * 16 + j], a);
      t[r * HS_VB + j] = a;
    }
#endif
}

template <int MR>
inline void hs_rows(const float* h, int64_t C, const float* pack, int64_t panels, float* t) {
  for (int64_t p = 0; p < panels; ++p) hs_tile<MR>(h, C, pack + p * C * 16, t + p * 16);
}

// Fold one row's chunk x[0..nv) (vocabulary v0..) into the running state of row i.
inline void hs_fold(const float* x, int64_t nv, int64_t v0, int64_t label, HsState& st, int64_t i) {
  float cm = -INFINITY;
  int64_t j = 0;
#if defined(__AVX2__)
  __m256 mv = _mm256_set1_ps(-INFINITY);
  for (; j + 8 <= nv; j += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(x + j));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, mv);
  for (float l : lanes) cm = std::max(cm, l);
#endif
  for (; j < nv; ++j) cm = std::max(cm, x[j]);
  if (cm > st.m[i]) {  // a new maximum: its first index; earlier chunks keep ties
    int64_t first = 0;
    while (first + 1 < nv && x[first] != cm) ++first;
    st.am[i] = v0 + first;
    st.s[i] = st.m[i] == -INFINITY ? 0.0 : st.s[i] * std::exp(double(st.m[i]) - double(cm));
    st.m[i] = cm;
  }
  const float m = st.m[i];
  float sum = 0.f;
  j = 0;
#if defined(__AVX2__)
  __m256 acc = _mm256_setzero_ps();
  const __m256 mm = _mm256_set1_ps(m);
  for (; j + 8 <= nv; j += 8) acc = _mm256_add_ps(acc, exp8(_mm256_sub_ps(_mm256_loadu_ps(x + j), mm)));
  sum = hsum(acc);
#endif
  for (; j < nv; ++j) sum += std::exp(x[j] - m);
  st.s[i] += double(sum);
  if (label >= v0 && label < v0 + nv) st.picked[i] = x[label - v0];
}

}  // namespace

std::vector<paddle::Tensor> HeadScoreForward(const paddle::Tensor& h, const paddle::Tensor& labels,
                                             const paddle::Tensor& w) {
  PD_CHECK(h.dtype() == paddle::DataType::FLOAT32 && w.dtype() == paddle::DataType::FLOAT32,
           "gptc_head_score: float32 hidden states and head weight expected");
  PD_CHECK(h.shape().size() == 2 && w.shape().size() == 2, "gptc_head_score: h (N,C) and w (C,V) expected");
  const int64_t N = h.shape()[0], C = h.shape()[1], V = w.shape()[1];
  PD_CHECK(w.shape()[0] == C, "gptc_head_score: weight has ", w.shape()[0], " inputs, hidden size is ", C);
  PD_CHECK(labels.numel() == N, "gptc_head_score: one label per row expected");
  const float* hp = h.data<float>();
  const float* wp = w.data<float>();
  const int64_t* lp = labels.data<int64_t>();
  for (int64_t i = 0; i < N; ++i) PD_CHECK(lp[i] >= 0 && lp[i] < V, "gptc_head_score: label out of range");
  const int64_t chunks = (V + HS_VB - 1) / HS_VB;
  const int nt = int(std::max<int64_t>(1, std::min<int64_t>(nthreads(), chunks)));
  std::vector<HsState> states;
  states.reserve(nt);
  for (int t = 0; t < nt; ++t) states.emplace_back(N);
#pragma omp parallel num_threads(nt)
  {
    HsState& st = states[omp_get_thread_num()];
    std::vector<float> pack(C * HS_VB), tile(HS_MR * HS_VB);
#pragma omp for schedule(static)
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t v0 = c * HS_VB, nv = std::min(HS_VB, V - v0), panels = (nv + 15) / 16;
      for (int64_t p = 0; p < panels; ++p)  // panel p: C rows of 16 columns (zeros past V)
        for (int64_t k = 0; k < C; ++k) {
          float* dst = pack.data() + (p * C + k) * 16;
          const int64_t col = v0 + p * 16, n = std::min<int64_t>(16, V - col);
          std::memcpy(dst, wp + k * V + col, n * sizeof(float));
          std::fill(dst + n, dst + 16, 0.f);
        }
      for (int64_t i = 0; i < N; i += HS_MR) {
        const int64_t mr = std::min<int64_t>(HS_MR, N - i);
        const float* hi = hp + i * C;
        switch (mr) {
          case 6: hs_rows<6>(hi, C, pack.data(), panels, tile.data()); break;
          case 5: hs_rows<5>(hi, C, pack.data(), panels, tile.data()); break;
          case 4: hs_rows<4>(hi, C, pack.data(), panels, tile.data()); break;
          case 3: hs_rows<3>(hi, C, pack.data(), panels, tile.data()); break;
          case 2: hs_rows<2>(hi, C, pack.data(), panels, tile.data()); break;
          default: hs_rows<1>(hi, C, pack.data(), panels, tile.data()); break;
        }
        for (int64_t r = 0; r < mr; ++r) hs_fold(tile.data() + r * HS_VB, nv, v0, lp[i + r], st, i + r);
      }
    }
  }
  auto logprob = paddle::empty({N}, paddle::DataType::FLOAT64, h.place());
  auto argmax = paddle::empty({N}, paddle::DataType::INT64, h.place());
  double* out = logprob.data<double>();
  int64_t* am = argmax.data<int64_t>();
  for (int64_t i = 0; i < N; ++i) {
    float m = -INFINITY;
    int64_t best = -1;
    double picked = 0.0;
    for (const HsState& st : states) {
      if (st.m[i] > m || (st.m[i] == m && st.am[i] >= 0 && (best < 0 || st.am[i] < best))) {
        m = st.m[i];
        best = st.am[i];
      }
      if (!std::isnan(st.picked[i])) picked = st.picked[i];
    }
    double s = 0.0;
    for (const HsState& st : states)
      if (st.m[i] != -INFINITY) s += st.s[i] * std::exp(double(st.m[i]) - double(m));
    out[i] = picked - (double(m) + std::log(s));
    am[i] = best;
  }
  return {logprob, argmax};
}

std::vector<std::vector<int64_t>> HeadScoreShape(const std::vector<int64_t>& h, const std::vector<int64_t>&,
                                                 const std::vector<int64_t>&) {
  return {{h[0]}, {h[0]}};
}

std::vector<paddle::DataType> HeadScoreDtype(const paddle::DataType&, const paddle::DataType&,
                                             const paddle::DataType&) {
  return {paddle::DataType::FLOAT64, paddle::DataType::INT64};
}

PD_BUILD_OP(gptc_head_score)
    .Inputs({"H", "Labels", "W"})
    .Outputs({"LogProb", "ArgMax"})
    .SetKernelFn(PD_KERNEL(HeadScoreForward))
    .SetInferShapeFn(PD_INFER_SHAPE(HeadScoreShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(HeadScoreDtype));
