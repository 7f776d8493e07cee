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
#include <omp.h>

#include <algorithm>
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
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 32 int8 x 32 int8 -> 8 int32 partial sums: |x| as unsigned times w with x's sign, exact
// (maddubs pairs stay below 2 * 128 * 127 < 2^15). VNNI does it in one instruction.
inline __m256i dot32_i8(const int8_t* a, const int8_t* b) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a));
  const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b));
  const __m256i ax = _mm256_sign_epi8(x, x), sw = _mm256_sign_epi8(w, x);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), ax, sw);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), ax, sw);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(ax, sw), _mm256_set1_epi16(1));
#endif
}
#endif

// R float dot products of one weight row with R input rows (rows ldx apart).
template <int R>
inline void dot_rows(const float* x, int64_t ldx, const float* w, int64_t K, float* out) {
  int64_t k = 0;
#if defined(__AVX2__)
  __m256 a0[R], a1[R];
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm256_setzero_ps();
  for (; k + 16 <= K; k += 16) {
    const __m256 w0 = _mm256_loadu_ps(w + k), w1 = _mm256_loadu_ps(w + k + 8);
    for (int r = 0; r < R; ++r) {
      a0[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * ldx + k), w0, a0[r]);
      a1[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * ldx + k + 8), w1, a1[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum(_mm256_add_ps(a0[r], a1[r]));
#else
  for (int r = 0; r < R; ++r) out[r] = 0.f;
#endif
  for (int r = 0; r < R; ++r) {
    float s = 0.f;
    for (int64_t kk = k; kk < K; ++kk) s += x[r * ldx + kk] * w[kk];
    out[r] += s;
  }
}

// One int8 weight row against one int8 input row, both K long: the sum over blocks of
// dot * (input scale * weight scale); the dots are exact int32.
inline float int_dot_row(const int8_t* xq, const float* sx, const int8_t* q, const float* sw, int64_t K,
                         int64_t blk) {
#if defined(__AVX2__)
  if (K % 32 == 0 && blk % 32 == 0) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t c = 0; c < K; c += 32) {
      const int64_t b = c / blk;
      acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot32_i8(xq + c, q + c)), _mm256_set1_ps(sx[b] * sw[b]), acc);
    }
    return hsum(acc);
  }
#endif
  float acc = 0.f;
  for (int64_t b = 0; b < K / blk; ++b) {
    int32_t s = 0;
    for (int64_t j = b * blk; j < (b + 1) * blk; ++j) s += int32_t(int16_t(xq[j]) * int16_t(q[j]));
    acc += float(s) * (sx[b] * sw[b]);
  }
  return acc;
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

// y (M, N) = x (M, K) @ W^T + bias.
void linear(const Lin& L, const float* x, int64_t M, float* y) {
  const int64_t N = L.n, K = L.k;
  if (L.bits == 32 || L.act < 0.f) {
#pragma omp parallel num_threads(nthreads())
    {
      std::vector<float> wbuf(L.bits == 32 ? 0 : K);
      std::vector<int8_t> ibuf(L.bits == 4 ? K : 0);
#pragma omp for schedule(static)
      for (int64_t n = 0; n < N; ++n) {
        const float* w = L.wf ? L.wf + n * K : nullptr;
        if (!w) {  // dequantize the row: codes * block scales (the fake-quant weight)
          const int8_t* q = int_row(L, n, ibuf.data());
          const float* sc = L.scale + n * (K / L.blk);
          for (int64_t j = 0; j < K; ++j) wbuf[j] = float(q[j]) * sc[j / L.blk];
          w = wbuf.data();
        }
        const float b = L.bias ? L.bias[n] : 0.f;
        int64_t m = 0;
        float o[4];
        for (; m + 4 <= M; m += 4) {
          dot_rows<4>(x + m * K, K, w, K, o);
          for (int r = 0; r < 4; ++r) y[(m + r) * N + n] = o[r] + b;
        }
        for (; m < M; ++m) {
          dot_rows<1>(x + m * K, K, w, K, o);
          y[m * N + n] = o[0] + b;
        }
      }
    }
    return;
  }
  // Integer path: quantize the inputs once, (M, K) int8 codes and (M, K/blk) scales.
  const int64_t nb = K / L.blk;
  std::vector<int8_t> xq(M * K);
  std::vector<float> sx(M * nb);
#pragma omp parallel for schedule(static) num_threads(nthreads()) if (M > 1)
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + m * K + b * L.blk;
      float s = L.act;
      if (s == 0.f) {
        float amax = 0.f;
        for (int64_t j = 0; j < L.blk; ++j) amax = std::max(amax, std::fabs(xb[j]));
        s = std::max(amax, 1e-30f) / 127.0f;
      }
      sx[m * nb + b] = s;
      for (int64_t j = 0; j < L.blk; ++j) {
        float q = std::round(xb[j] / s);
        xq[m * K + b * L.blk + j] = int8_t(std::min(127.f, std::max(-128.f, q)));
      }
    }
  }
#pragma omp parallel num_threads(nthreads())
  {
    std::vector<int8_t> ibuf(L.bits == 4 ? K : 0);
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      const int8_t* q = int_row(L, n, ibuf.data());
      const float* sw = L.scale + n * nb;
      const float b = L.bias ? L.bias[n] : 0.f;
      for (int64_t m = 0; m < M; ++m)
        y[m * N + n] = int_dot_row(xq.data() + m * K, sx.data() + m * nb, q, sw, K, L.blk) + b;
    }
  }
}

void layer_norm(const float* x, int64_t M, int64_t C, const float* w, const float* b, float eps,
                float* y) {
#pragma omp parallel for schedule(static) num_threads(nthreads()) if (M > 1)
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

void activate(float* h, int64_t n, int act) {
#pragma omp parallel for schedule(static) num_threads(nthreads()) if (n > 4096)
  for (int64_t i = 0; i < n; ++i) {
    const float v = h[i];
    if (act == 0)
      h[i] = v > 0.f ? v : 0.f;
    else if (act == 1)
      h[i] = 0.5f * v * (1.f + std::erf(v * 0.70710678118654752f));
    else
      h[i] = 0.5f * v * (1.f + std::tanh(0.79788456080286536f * (v + 0.044715f * v * v * v)));
  }
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
  std::vector<float> h(M * C), q(M * 3 * inner), ctx(M * inner), f(M * F);

  layer_norm(xd, M, C, ln1_w.data<float>(), ln1_b.data<float>(), eps, h.data());
  linear(qkv, h.data(), M, q.data());
  // New keys/values into the cache at positions S..S+T-1; qkv columns are head-major (H, 3, D).
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t hh = 0; hh < H; ++hh) {
        const float* src = q.data() + (b * T + t) * 3 * inner + hh * 3 * D;
        const int64_t dst = ((b * H + hh) * cap + S + t) * D;
        std::memcpy(K_ + dst, src + D, D * sizeof(float));
        std::memcpy(V_ + dst, src + 2 * D, D * sizeof(float));
      }
  const float scale = 1.f / std::sqrt(float(D));
  const int nt = nthreads();
  std::vector<std::vector<float>> pbuf(nt, std::vector<float>(L));
#pragma omp parallel for collapse(3) schedule(dynamic) num_threads(nt)
  for (int64_t b = 0; b < B; ++b)
    for (int64_t hh = 0; hh < H; ++hh)
      for (int64_t t = 0; t < T; ++t) {
        float* p = pbuf[omp_get_thread_num()].data();
        const float* qv = q.data() + (b * T + t) * 3 * inner + hh * 3 * D;
        const float* kb = K_ + (b * H + hh) * cap * D;
        const float* vb = V_ + (b * H + hh) * cap * D;
        const int64_t last = S + t;  // causal: keys 0..last, those with mask 1
        float mx = -INFINITY;
        for (int64_t j = 0; j <= last; ++j) {
          if (!mk[b * L + j]) continue;
          float s;
          dot_rows<1>(qv, 0, kb + j * D, D, &s);
          p[j] = s * scale;
          mx = std::max(mx, p[j]);
        }
        float* o = ctx.data() + (b * T + t) * inner + hh * D;
        for (int64_t d = 0; d < D; ++d) o[d] = 0.f;
        if (mx == -INFINITY) continue;  // a padding query: attends to nothing real
        float sum = 0.f;
        for (int64_t j = 0; j <= last; ++j) {
          if (!mk[b * L + j]) continue;
          p[j] = std::exp(p[j] - mx);
          sum += p[j];
        }
        const float inv = 1.f / sum;
        for (int64_t j = 0; j <= last; ++j) {
          if (!mk[b * L + j]) continue;
          const float w = p[j] * inv;
          for (int64_t d = 0; d < D; ++d) o[d] += w * vb[j * D + d];
        }
      }
  linear(out, ctx.data(), M, yd);
  for (int64_t i = 0; i < M * C; ++i) yd[i] += xd[i];  // residual 1
  layer_norm(yd, M, C, ln2_w.data<float>(), ln2_b.data<float>(), eps, h.data());
  linear(fc, h.data(), M, f.data());
  activate(f.data(), M * F, activation);
  linear(proj, f.data(), M, h.data());
  for (int64_t i = 0; i < M * C; ++i) yd[i] += h[i];  // residual 2
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
  const Lin head = make_lin(w, s, nullptr, bits, act);
  PD_CHECK(head.k == C, "gptc_head: weight has ", head.k, " inputs, hidden size is ", C);
  std::vector<float> sel(n * C), h(n * C);
  const int64_t* r = rows.data<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    PD_CHECK(r[i] >= 0 && r[i] < total, "gptc_head: row index out of range");
    std::memcpy(sel.data() + i * C, x.data<float>() + r[i] * C, C * sizeof(float));
  }
  layer_norm(sel.data(), n, C, ln_w.data<float>(), ln_b.data<float>(), eps, h.data());
  auto out = paddle::empty({n, head.n}, paddle::DataType::FLOAT32, x.place());
  linear(head, h.data(), n, out.data<float>());
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
