// The evaluation operator gptc_head_score: log p(label) and argmax over the vocabulary without
// materialising the logits.
// Part of the one translation unit gptc_ops.cc (included there in order; formats and contract: its head comment).
#ifndef GPTC_KERNELS_GPTC_HEAD_SCORE_H_
#define GPTC_KERNELS_GPTC_HEAD_SCORE_H_

#include "gptc_common.h"

// ============================================================================ head scoring
// Evaluation (issue 14; eval/scoring.py, inference/head_score.py). Separate from the decoder ops:
//   gptc_head_score(h (N,C) float32 final hidden states, labels (N,) int64, w (C,V) float32 head
//       weight, inputs x vocabulary) -> log p(label) (N,) float64, argmax (N,) int64
// Never materialises the (N,V) logits: each thread takes vocabulary chunks of HEAD_SCORE_COLS columns,
// packs the chunk's weights (C x HEAD_SCORE_COLS, L2-resident), computes 6-row x 16-column logit tiles
// (outer-product AVX2 kernel: 12 accumulators, one broadcast per row and two loads per k) into a
// 6 x HEAD_SCORE_COLS buffer (L1), and folds each row into a running maximum, first argmax, the label's
// logit and an online log-sum-exp (exp8 lanes summed in float32 per chunk, chunk sums rescaled
// and added in float64). Threads' partial results merge per row (largest maximum, lowest index
// on ties, sums rescaled to it). Within ~1e-7 of the float64 numpy reference
// (eval.scoring.label_logprobs) on the same logits.
namespace {

constexpr int64_t HEAD_SCORE_COLS = 256;  // vocabulary columns per chunk (a multiple of 16)
constexpr int HEAD_SCORE_ROWS = 6;        // rows per tile

struct HeadScoreState {
  std::vector<float> m, picked;
  std::vector<double> s;
  std::vector<int64_t> am;
  explicit HeadScoreState(int64_t n)
      : m(n, -INFINITY), picked(n, NAN), s(n, 0.0), am(n, -1) {}
};

// MR rows of h (C apart) x the 16 columns of packed panel b (C x 16) -> t (MR rows, HEAD_SCORE_COLS apart).
template <int MR>
inline void head_score_tile(const float* h, int64_t C, const float* b, float* t) {
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
    _mm256_storeu_ps(t + r * HEAD_SCORE_COLS, acc[r][0]);
    _mm256_storeu_ps(t + r * HEAD_SCORE_COLS + 8, acc[r][1]);
  }
#else
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < 16; ++j) {
      float a = 0.f;
      for (int64_t k = 0; k < C; ++k) a = std::fma(h[r * C + k], b[k * 16 + j], a);
      t[r * HEAD_SCORE_COLS + j] = a;
    }
#endif
}

template <int MR>
inline void head_score_rows(const float* h, int64_t C, const float* pack, int64_t panels, float* t) {
  for (int64_t p = 0; p < panels; ++p) head_score_tile<MR>(h, C, pack + p * C * 16, t + p * 16);
}

// Fold one row's chunk x[0..nv) (vocabulary v0..) into the running state of row i.
inline void head_score_fold(const float* x, int64_t nv, int64_t v0, int64_t label, HeadScoreState& st, int64_t i) {
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
  const GilRelease nogil;
  const int64_t chunks = (V + HEAD_SCORE_COLS - 1) / HEAD_SCORE_COLS;
  const int nt = int(std::max<int64_t>(1, std::min<int64_t>(nthreads(), chunks)));
  std::vector<HeadScoreState> states;
  states.reserve(nt);
  for (int t = 0; t < nt; ++t) states.emplace_back(N);
#pragma omp parallel num_threads(nt)
  {
    HeadScoreState& st = states[omp_get_thread_num()];
    std::vector<float> pack(C * HEAD_SCORE_COLS), tile(HEAD_SCORE_ROWS * HEAD_SCORE_COLS);
#pragma omp for schedule(static)
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t v0 = c * HEAD_SCORE_COLS, nv = std::min(HEAD_SCORE_COLS, V - v0), panels = (nv + 15) / 16;
      for (int64_t p = 0; p < panels; ++p)  // panel p: C rows of 16 columns (zeros past V)
        for (int64_t k = 0; k < C; ++k) {
          float* dst = pack.data() + (p * C + k) * 16;
          const int64_t col = v0 + p * 16, n = std::min<int64_t>(16, V - col);
          std::memcpy(dst, wp + k * V + col, n * sizeof(float));
          std::fill(dst + n, dst + 16, 0.f);
        }
      for (int64_t i = 0; i < N; i += HEAD_SCORE_ROWS) {
        const int64_t mr = std::min<int64_t>(HEAD_SCORE_ROWS, N - i);
        const float* hi = hp + i * C;
        switch (mr) {
          case 6: head_score_rows<6>(hi, C, pack.data(), panels, tile.data()); break;
          case 5: head_score_rows<5>(hi, C, pack.data(), panels, tile.data()); break;
          case 4: head_score_rows<4>(hi, C, pack.data(), panels, tile.data()); break;
          case 3: head_score_rows<3>(hi, C, pack.data(), panels, tile.data()); break;
          case 2: head_score_rows<2>(hi, C, pack.data(), panels, tile.data()); break;
          default: head_score_rows<1>(hi, C, pack.data(), panels, tile.data()); break;
        }
        for (int64_t r = 0; r < mr; ++r)
          head_score_fold(tile.data() + r * HEAD_SCORE_COLS, nv, v0, lp[i + r], st, i + r);
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
    for (const HeadScoreState& st : states) {
      if (st.m[i] > m || (st.m[i] == m && st.am[i] >= 0 && (best < 0 || st.am[i] < best))) {
        m = st.m[i];
        best = st.am[i];
      }
      if (!std::isnan(st.picked[i])) picked = st.picked[i];
    }
    double s = 0.0;
    for (const HeadScoreState& st : states)
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

#endif  // GPTC_KERNELS_GPTC_HEAD_SCORE_H_
