// The decoder's operators and their PD_BUILD_OP registrations: gptc_embed, gptc_layer (the KV
// cache written in place) and gptc_head.
// Part of the one translation unit gptc_ops.cc (included there in order; formats and contract: its head comment).
#ifndef GPTC_KERNELS_GPTC_DECODER_OPS_H_
#define GPTC_KERNELS_GPTC_DECODER_OPS_H_

#include "gptc_gemv.h"
#include "gptc_norm_attention.h"

namespace {

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

#endif  // GPTC_KERNELS_GPTC_DECODER_OPS_H_
