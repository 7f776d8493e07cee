// The tensor-parallel rank program's operators (export/fused_tp.py): one rank's share of the
// decoder between the model-parallel all-reduces that Paddle's own mp_allreduce_sum ops make in
// the program:
//   gptc_tp_embed(ids, mask, weights) -> x (B*T, C): the token rows of this rank's vocabulary
//       slice (zeros for the others), + the position rows on rank 0 only (`position`), so the
//       all-reduced sum is wte + wpe bitwise (one non-zero term of each, x + 0 exact).
//   gptc_tp_attention(x, mask, caches [k, v], weights) -> y (B*T, C): layer norm, the rank's heads
//       of QKV (whole heads: head-major columns), their keys/values written in place into the
//       rank's cache (B, H/mp, cap, D), attention, and this rank's rows of attn.out's weight as a
//       partial sum; rank 0 (`residual`) adds x and the bias (zeros on the other ranks).
//   gptc_tp_mlp(x, mask, weights) -> y: layer norm 2, the rank's fc_in columns + activation, the
//       matching fc_out inputs as a partial sum; rank 0 adds x and the bias.
//   gptc_tp_head(x, rows, weights) -> logits (n, V/mp) of the rows asked for: the final layer
//       norm and this rank's vocabulary rows of the head (the runner gathers the slices).
// The arithmetic is the single-card block's (the same layer_norm, attend, prepare_inputs /
// prepare_rows and linear_for calls), split where Megatron splits it; only the order of the
// partial sums' additions differs (float32 rounding; integer block dots stay exact when the
// rank's inputs are whole blocks, which the export checks). Weights packed as gptc_generate's
// (a float32 and an int8 blob, 4 layout numbers a piece, unpack()): a block's 16 pieces in
// make_layer_weights' order for both of its halves; wte, wte_s, wpe, wpe_s for the embedding;
// ln_f_w, ln_f_b, head_w, head_s for the head.
// Part of the one translation unit gptc_ops.cc (included there in order; formats and contract: its head comment).
#ifndef GPTC_KERNELS_GPTC_TP_OPS_H_
#define GPTC_KERNELS_GPTC_TP_OPS_H_

#include "gptc_decoder_stack.h"

namespace {

// A block's 16 pieces (make_layer_weights' order) and its caches' shape checked: the rank's LayerWeights.
LayerWeights tp_layer(const std::vector<WeightView>& ws, int64_t C, int64_t heads, int64_t head_dim,
                      const std::vector<int>& bits, const std::vector<float>& act) {
  PD_CHECK(ws.size() == size_t(kPerLayer) && bits.size() == 4 && act.size() == 4,
           "gptc_tp: a block needs 16 weight pieces and 4 bits/act entries");
  return make_layer_weights(ws.data(), C, heads, head_dim, bits.data(), act.data());
}

// The attention half of layer_step for x (M, C) -> y: the same calls up to attn.out, whose
// output is this rank's partial sum (+ x when `residual`).
void tp_attention_step(const LayerWeights& w, const StepContext& s, const float* xd, float* yd, const KvCache& kv,
                       bool residual) {
  Scratch& sc = t_scratch;
  const int64_t B = s.B, C = s.C, M = s.M, H = w.H, D = w.D;
  const LinearWeights &qkv = w.qkv, &out = w.out;
  float *q = s.q, *ctx = s.ctx;
  float* h = s.rows ? s.hs : grow(sc.h, size_t(M * std::max(C, int64_t(1))));
  if (!s.rows) layer_norm(xd, M, C, w.ln1_w, w.ln1_b, s.eps, h);
  const LinearInputs in1 = s.rows ? prepare_rows(qkv, xd, M, w.ln1_w, w.ln1_b, s.eps, h, s.xqs, s.sxs)
                        : prepare_inputs(qkv, h, M, sc);
  linear_for(qkv, in1, M, q, nullptr, -1);
#pragma omp for collapse(2) schedule(dynamic)
  for (int64_t b = 0; b < B; ++b)
    for (int64_t hh = 0; hh < H; ++hh) attend_head(s, H, D, kv, nullptr, b, hh, sc);
  const LinearInputs in_out = s.rows ? prepare_rows(out, ctx, M, nullptr, nullptr, s.eps, nullptr, s.xqs, s.sxs)
                           : prepare_inputs(out, ctx, M, sc);
  linear_for(out, in_out, M, yd, residual ? xd : nullptr, -1);
}

// The MLP half of layer_step: y = [x +] this rank's fc_out partial sum of act(fc_in(ln2(x))).
void tp_mlp_step(const LayerWeights& w, const StepContext& s, const float* xd, float* yd, bool residual) {
  Scratch& sc = t_scratch;
  const int64_t M = s.M, C = s.C;
  float* h = s.rows ? s.hs : grow(sc.h, size_t(M * std::max(C, int64_t(1))));
  if (!s.rows) layer_norm(xd, M, C, w.ln2_w, w.ln2_b, s.eps, h);
  const LinearInputs in2 = s.rows ? prepare_rows(w.fc, xd, M, w.ln2_w, w.ln2_b, s.eps, h, s.xqs, s.sxs)
                        : prepare_inputs(w.fc, h, M, sc);
  linear_for(w.fc, in2, M, s.f, nullptr, s.activation);
  const LinearInputs in_proj = s.rows ? prepare_rows(w.proj, s.f, M, nullptr, nullptr, s.eps, nullptr, s.xqs, s.sxs)
                            : prepare_inputs(w.proj, s.f, M, sc);
  linear_for(w.proj, in_proj, M, yd, residual ? xd : nullptr, -1);
}

}  // namespace

std::vector<paddle::Tensor> TpEmbedForward(const paddle::Tensor& ids, const paddle::Tensor& mask,
                                           const std::vector<paddle::Tensor>& blobs, const std::vector<int64_t>& layout,
                                           int wte_bits, int wpe_bits, int64_t vocab_start, int64_t vocab_size,
                                           int position) {
  const int64_t B = ids.dims()[0], T = ids.dims()[1], L = mask.dims()[1];
  PD_CHECK(mask.dims()[0] == B && L >= T, "gptc_tp_embed: mask must be (B, S+T)");
  const std::vector<WeightView> ws = unpack(blobs, layout);
  PD_CHECK(ws.size() == 4, "gptc_tp_embed: weights are wte, wte_s, wpe, wpe_s");
  const Table wte = make_table(ws[0], ws[1], wte_bits), wpe = make_table(ws[2], ws[3], wpe_bits);
  const int64_t C = table_width(ws[0], wte_bits);
  PD_CHECK(table_width(ws[2], wpe_bits) == C, "gptc_tp_embed: position table width differs from the token table's");
  auto out = paddle::empty({B * T, C}, paddle::DataType::FLOAT32, ids.place());
  const int64_t* id = ids.data<int64_t>();
  const int64_t* mk = mask.data<int64_t>();
  float* y = out.data<float>();
  for (int64_t b = 0; b < B; ++b) {
    int64_t pos = 0;
    for (int64_t j = 0; j < L - T; ++j) pos += mk[b * L + j];
    for (int64_t t = 0; t < T; ++t) {
      pos += mk[b * L + L - T + t];
      // The single-card clip to the whole vocabulary, then this rank's slice of it.
      const int64_t tok = std::min(std::max<int64_t>(id[b * T + t], 0), vocab_size - 1) - vocab_start;
      float* dst = y + (b * T + t) * C;
      if (tok >= 0 && tok < wte.rows) table_row(wte, tok, C, dst, false);
      else std::fill(dst, dst + C, 0.f);
      if (position) table_row(wpe, std::min(std::max<int64_t>(pos - 1, 0), wpe.rows - 1), C, dst, true);
    }
  }
  return {out};
}

std::vector<paddle::Tensor> TpAttentionForward(const paddle::Tensor& x, const paddle::Tensor& mask,
                                               std::vector<paddle::Tensor>& caches,
                                               const std::vector<paddle::Tensor>& blobs,
                                               const std::vector<int64_t>& layout, int heads, float eps,
                                               const std::vector<int>& bits, const std::vector<float>& act,
                                               int residual) {
  const int64_t B = mask.dims()[0], L = mask.dims()[1], C = x.dims()[1], T = B ? x.dims()[0] / B : 0;
  PD_CHECK(caches.size() == 2 && B * T == x.dims()[0] && L >= T, "gptc_tp_attention: x (B*T, C), mask (B, S+T), "
           "caches [key, value]");
  op_enter(T > 1);
  const GilRelease nogil;
  Laps lp(T > 1);
  const KvCache kv = check_cache(caches[0], caches[1], B, heads, L);
  const LayerWeights w = tp_layer(unpack(blobs, layout), C, heads, caches[0].dims()[3], bits, act);
  const StepContext s = make_step_context(B, T, C, mask.data<int64_t>(), L, w.H * w.D, w.F, kmax_of(w), 0, eps, 0);
  auto y = paddle::empty({B * T, C}, paddle::DataType::FLOAT32, x.place());
#pragma omp parallel num_threads(s.nt)
  {
    tp_attention_step(w, s, x.data<float>(), y.data<float>(), kv, residual != 0);
    trim(t_scratch);
  }
  trim(t_shared);
  lp.lap(kAttn);
  op_exit(false);
  return {y};
}

std::vector<paddle::Tensor> TpMlpForward(const paddle::Tensor& x, const paddle::Tensor& mask,
                                         const std::vector<paddle::Tensor>& blobs, const std::vector<int64_t>& layout,
                                         int heads, int head_dim, float eps, int activation,
                                         const std::vector<int>& bits, const std::vector<float>& act, int residual) {
  const int64_t B = mask.dims()[0], L = mask.dims()[1], C = x.dims()[1], T = B ? x.dims()[0] / B : 0;
  PD_CHECK(B * T == x.dims()[0] && L >= T, "gptc_tp_mlp: x (B*T, C), mask (B, S+T)");
  op_enter(T > 1);
  const GilRelease nogil;
  Laps lp(T > 1);
  const LayerWeights w = tp_layer(unpack(blobs, layout), C, heads, head_dim, bits, act);
  const StepContext s = make_step_context(B, T, C, mask.data<int64_t>(), L, w.H * w.D, w.F, kmax_of(w), 0, eps,
                                          activation);
  auto y = paddle::empty({B * T, C}, paddle::DataType::FLOAT32, x.place());
#pragma omp parallel num_threads(s.nt)
  {
    tp_mlp_step(w, s, x.data<float>(), y.data<float>(), residual != 0);
    trim(t_scratch);
  }
  trim(t_shared);
  lp.lap(kFc);
  op_exit(false);
  return {y};
}

std::vector<paddle::Tensor> TpHeadForward(const paddle::Tensor& x, const paddle::Tensor& rows,
                                          const std::vector<paddle::Tensor>& blobs, const std::vector<int64_t>& layout,
                                          float eps, int head_bits, float head_act) {
  const int64_t M = x.dims()[0], C = x.dims()[1], n = rows.numel();
  op_enter(n > 1);
  const GilRelease nogil;
  Laps lp(n > 1);
  const std::vector<WeightView> ws = unpack(blobs, layout);
  PD_CHECK(ws.size() == 4 && !ws[0].i8 && !ws[1].i8 && ws[0].d0 * ws[0].d1 == C && ws[1].d0 * ws[1].d1 == C,
           "gptc_tp_head: weights are the final layer norm (float32, hidden size), head_w, head_s");
  const LinearWeights head = make_linear_weights(ws[2], ws[3], nullptr, head_bits, head_act);
  PD_CHECK(head.k == C, "gptc_tp_head: head weight has ", head.k, " inputs, hidden size is ", C);
  const int64_t* r = rows.data<int64_t>();
  for (int64_t i = 0; i < n; ++i) PD_CHECK(r[i] >= 0 && r[i] < M, "gptc_tp_head: row index out of range");
  // head_inputs' StepContext: the hidden size, eps and (16 rows and more) the shared row buffers.
  StepContext s{};
  s.C = C, s.eps = eps, s.nt = nthreads();
  if (n >= kSharedRows) {
    s.hs = grow(t_shared.rows_h, size_t(n * C));
    s.xqs = grow(t_shared.rows_xq, size_t(n * C));
    s.sxs = grow(t_shared.rows_sx, size_t(n * C));
  }
  auto out = paddle::empty({n, head.n}, paddle::DataType::FLOAT32, x.place());
  float* logits = out.data<float>();
#pragma omp parallel num_threads(s.nt)
  {
    const LinearInputs hin = head_inputs(head, s, x.data<float>(), r, n, ws[0].f(), ws[1].f());
    if (n) linear_for(head, hin, n, logits, nullptr, -1);
    trim(t_scratch);
  }
  trim(t_shared);
  lp.lap(kHead);
  op_exit(true);
  return {out};
}

std::vector<std::vector<int64_t>> TpEmbedShape(const std::vector<int64_t>& ids, const std::vector<int64_t>&,
                                               const std::vector<std::vector<int64_t>>&) {
  return {{-1, -1}};  // (B*T, C): the hidden size is in the layout
}
std::vector<paddle::DataType> TpEmbedDtype(const paddle::DataType&, const paddle::DataType&,
                                           const std::vector<paddle::DataType>&) {
  return {paddle::DataType::FLOAT32};
}

PD_BUILD_OP(gptc_tp_embed)
    .Inputs({"Ids", "Mask", paddle::Vec("Weights")})
    .Outputs({"Out"})
    .Attrs({"layout: std::vector<int64_t>", "wte_bits: int", "wpe_bits: int", "vocab_start: int64_t",
            "vocab_size: int64_t", "position: int"})
    .SetKernelFn(PD_KERNEL(TpEmbedForward))
    .SetInferShapeFn(PD_INFER_SHAPE(TpEmbedShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(TpEmbedDtype));

std::vector<std::vector<int64_t>> TpAttentionShape(const std::vector<int64_t>& x, const std::vector<int64_t>&,
                                                   const std::vector<std::vector<int64_t>>&,
                                                   const std::vector<std::vector<int64_t>>&) {
  return {x};
}
std::vector<paddle::DataType> TpAttentionDtype(const paddle::DataType&, const paddle::DataType&,
                                               const std::vector<paddle::DataType>&,
                                               const std::vector<paddle::DataType>&) {
  return {paddle::DataType::FLOAT32};
}

PD_BUILD_OP(gptc_tp_attention)
    .Inputs({"X", "Mask", paddle::Vec("Caches"), paddle::Vec("Weights")})
    .Outputs({"Out", paddle::Vec("CachesOut")})
    .SetInplaceMap({{paddle::Vec("Caches"), paddle::Vec("CachesOut")}})
    .Attrs({"layout: std::vector<int64_t>", "heads: int", "eps: float", "bits: std::vector<int>",
            "act: std::vector<float>", "residual: int"})
    .SetKernelFn(PD_KERNEL(TpAttentionForward))
    .SetInferShapeFn(PD_INFER_SHAPE(TpAttentionShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(TpAttentionDtype));

std::vector<std::vector<int64_t>> TpMlpShape(const std::vector<int64_t>& x, const std::vector<int64_t>&,
                                             const std::vector<std::vector<int64_t>>&) {
  return {x};
}
std::vector<paddle::DataType> TpMlpDtype(const paddle::DataType&, const paddle::DataType&,
                                         const std::vector<paddle::DataType>&) {
  return {paddle::DataType::FLOAT32};
}

PD_BUILD_OP(gptc_tp_mlp)
    .Inputs({"X", "Mask", paddle::Vec("Weights")})
    .Outputs({"Out"})
    .Attrs({"layout: std::vector<int64_t>", "heads: int", "head_dim: int", "eps: float", "activation: int",
            "bits: std::vector<int>", "act: std::vector<float>", "residual: int"})
    .SetKernelFn(PD_KERNEL(TpMlpForward))
    .SetInferShapeFn(PD_INFER_SHAPE(TpMlpShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(TpMlpDtype));

std::vector<std::vector<int64_t>> TpHeadShape(const std::vector<int64_t>&, const std::vector<int64_t>& rows,
                                              const std::vector<std::vector<int64_t>>&) {
  return {{rows[0], -1}};
}
std::vector<paddle::DataType> TpHeadDtype(const paddle::DataType&, const paddle::DataType&,
                                          const std::vector<paddle::DataType>&) {
  return {paddle::DataType::FLOAT32};
}

PD_BUILD_OP(gptc_tp_head)
    .Inputs({"X", "Rows", paddle::Vec("Weights")})
    .Outputs({"Out"})
    .Attrs({"layout: std::vector<int64_t>", "eps: float", "head_bits: int", "head_act: float"})
    .SetKernelFn(PD_KERNEL(TpHeadForward))
    .SetInferShapeFn(PD_INFER_SHAPE(TpHeadShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(TpHeadDtype));

#endif  // GPTC_KERNELS_GPTC_TP_OPS_H_
