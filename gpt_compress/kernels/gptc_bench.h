// Standalone timing of the matrix kernels for bench/kernels.py (--roofline), as plain C functions
// it calls through ctypes on the loaded library: the host's peak rate of each instruction the
// kernels multiply with (a tight loop of independent chains), and one Linear (M, N, K) of the
// fused ops' own code on the calling thread, repeated; times are the thread's CPU time.
// Part of the one translation unit gptc_ops.cc (included there in order; formats and contract: its head comment).
#ifndef GPTC_KERNELS_GPTC_BENCH_H_
#define GPTC_KERNELS_GPTC_BENCH_H_

#include <time.h>

#include <random>

#include "gptc_linear.h"

namespace {

// The calling thread's CPU time: on a shared machine a call long enough to be preempted is not
// charged for the time another process ran.
inline double now_s() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return double(t.tv_sec) + 1e-9 * double(t.tv_nsec);
}

#if defined(__AVX2__)
// 12 independent chains, 12 instructions an iteration (enough chains to cover the latency of
// every unit that runs them); the results are used (an empty volatile asm), so the loop stays.
template <class V, class Op>
double peak_loop(int64_t iters, V init, V a, V b, Op op) {
  V acc[12];  // every loop over it unrolled: the accumulators stay in registers
  GPTC_UNROLL for (int i = 0; i < 12; ++i) acc[i] = init;
  const double t0 = now_s();
  for (int64_t it = 0; it < iters; ++it) {
    GPTC_UNROLL for (int i = 0; i < 12; ++i) {
      acc[i] = op(acc[i], a, b);
      GPTC_PIN(acc[i]);
    }
  }
  const double t = now_s() - t0;
  GPTC_UNROLL for (int i = 0; i < 12; ++i) __asm__ volatile("" : : "x"(acc[i]));  // the chains' results are used
  return t;
}
#endif

}  // namespace

extern "C" {

// Which multiply instruction the build's kernels use: 1 if the int GEMM is vpdpbusd on 512-bit
// registers, the float GEMM vfmadd231ps on 512-bit ones (2), else the AVX2 forms (0).
int gptc_bench_paths() {
  int p = 0;
#if defined(GPTC_VNNI512)
  p |= 1;
#endif
#if defined(GPTC_F512)
  p |= 2;
#endif
  return p;
}

// Multiply-adds a second of `kind` on this thread over `iters` iterations of 12 instructions:
// 0: vpdpbusd (512-bit: 64 int8 multiply-adds each; 256-bit where only AVX-VNNI or AVX512VL
// VNNI), 1: vfmadd231ps (512-bit: 16; else 256-bit: 8), 2: vpmaddubsw (256-bit: 32, the AVX2 int8
// path, before its vpmaddwd). -1 when the build lacks the instruction.
double gptc_bench_peak(int kind, int64_t iters) {
#if defined(__AVX2__)
  if (kind == 0) {
#if defined(GPTC_VNNI512)
    const double t = peak_loop<__m512i>(iters, _mm512_set1_epi32(1), _mm512_set1_epi8(3), _mm512_set1_epi8(5),
                                        [](__m512i c, __m512i a, __m512i b) { return _mm512_dpbusd_epi32(c, a, b); });
    return 64.0 * 12 * iters / t;
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__) || defined(__AVXVNNI__)
    const double t = peak_loop<__m256i>(iters, _mm256_set1_epi32(1), _mm256_set1_epi8(3), _mm256_set1_epi8(5),
                                        [](__m256i c, __m256i a, __m256i b) { return _mm256_add_epi32(c, dot32_u8(a, b)); });
    return 32.0 * 12 * iters / t;
#else
    return -1;
#endif
  }
  if (kind == 1) {
#if defined(GPTC_F512)
    const double t = peak_loop<__m512>(iters, _mm512_set1_ps(1.f), _mm512_set1_ps(0.999f), _mm512_set1_ps(1e-3f),
                                       [](__m512 c, __m512 a, __m512 b) { return _mm512_fmadd_ps(c, a, b); });
    return 16.0 * 12 * iters / t;
#else
    const double t = peak_loop<__m256>(iters, _mm256_set1_ps(1.f), _mm256_set1_ps(0.999f), _mm256_set1_ps(1e-3f),
                                       [](__m256 c, __m256 a, __m256 b) { return _mm256_fmadd_ps(c, a, b); });
    return 8.0 * 12 * iters / t;
#endif
  }
  if (kind == 2) {  // maddubs fed its own int16 result as bytes (the op the AVX2 path issues per 32 codes)
    const double t = peak_loop<__m256i>(iters, _mm256_set1_epi8(1), _mm256_set1_epi8(1), _mm256_set1_epi8(0),
                                        [](__m256i c, __m256i a, __m256i) { return _mm256_maddubs_epi16(c, a); });
    return 32.0 * 12 * iters / t;
  }
#endif
  (void)iters;
  return -1;
}

// A Linear of the fused ops (y (M, N) = x (M, K) @ W^T + bias) on random weights and inputs:
// bits 32 float, 8 int8 codes, 4 packed int4, weight_format::kInt8Grouped int8 in row groups; int blocks of blk codes; act as LinearWeights::act (0: inputs
// quantized per token and block). Null for shapes the formats do not allow.
namespace {
struct BenchLinear {
  LinearWeights L;
  int64_t M;
  std::vector<float> x, wf, scale, bias, y;
  std::vector<int8_t> wq;
};
}  // namespace

void* gptc_bench_linear_new(int bits, int64_t M, int64_t N, int64_t K, int64_t blk, float act) {
  const bool grouped = bits == weight_format::kInt8Grouped;
  if (M < 1 || N < 1 || K < 1 || (bits != 32 && (blk < 1 || K % blk)) || (bits == 4 && K % 32) ||
      (grouped && (act < 0.f || K % 4 || blk % 4)))
    return nullptr;
  auto* b = new BenchLinear;
  std::mt19937 gen(1234);
  std::normal_distribution<float> normal(0.f, 1.f);
  b->M = M;
  b->x.resize(M * K), b->bias.resize(N), b->y.resize(M * N);
  for (auto& v : b->x) v = normal(gen);
  for (auto& v : b->bias) v = 0.1f * normal(gen);
  LinearWeights& L = b->L;
  L.n = N, L.k = K, L.bits = bits, L.act = act, L.bias = b->bias.data();
  if (bits == 32) {
    b->wf.resize(N * K);
    for (auto& v : b->wf) v = normal(gen) / std::sqrt(float(K));
    L.wf = b->wf.data();
  } else {
    std::uniform_int_distribution<int> code(bits == 4 ? 0 : -127, bits == 4 ? 255 : 127);
    const int64_t rows = grouped ? (N + GROUP_ROWS - 1) / GROUP_ROWS * GROUP_ROWS : N;  // groups: codes + 128
    b->wq.resize(bits == 4 ? N * K / 2 : rows * K);
    for (auto& v : b->wq) v = int8_t(code(gen) ^ (grouped ? 0x80 : 0));
    b->scale.resize(rows * (K / blk));
    for (auto& v : b->scale) v = 1e-3f * (1.f + 0.1f * normal(gen));
    L.wq = b->wq.data(), L.scale = b->scale.data(), L.blk = blk;
    if (grouped) L.bits = weight_format::kInt8Bits, L.grouped = true;
  }
  return b;
}

// Seconds of each of `reps` calls (input quantization included) on the calling thread alone.
void gptc_bench_linear_run(void* h, int reps, double* times) {
  auto* b = static_cast<BenchLinear*>(h);
  for (int r = 0; r < reps; ++r) {
    const double t0 = now_s();
    const LinearInputs in = prepare_inputs(b->L, b->x.data(), b->M, t_scratch);
    linear_for(b->L, in, b->M, b->y.data(), nullptr, -1);  // outside a parallel region: this thread alone
    times[r] = now_s() - t0;
  }
}

void gptc_bench_linear_free(void* h) { delete static_cast<BenchLinear*>(h); }

}  // extern "C"

#endif  // GPTC_KERNELS_GPTC_BENCH_H_
