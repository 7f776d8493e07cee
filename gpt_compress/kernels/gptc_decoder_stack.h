// gptc_generate: the whole decoder (embed, every block, final layer norm and LM head) in one
// operator call and one OpenMP parallel region, so a decode step pays Paddle's executor cost (per
// op and per op input: hence the weights in two blobs) once, and the op's threads never leave the
// region between blocks (no fork, no wake-up from libgomp's sleep after GOMP_SPINCOUNT spins). The
// layer machinery is gptc_decoder_ops.h's (embed_rows, layer_step, head_inputs). Outputs: the
// logits (n, V) of the rows asked for, each row's argmax Tokens (n,) int64 (np.argmax's choice:
// row_argmax; greedy decoding fetches only these), and the caches, written in place. A Control
// input runs several greedy decode steps in one call (stack_forward), so a generated token costs
// no Python and no Paddle Inference run of its own.
// Part of the one translation unit gptc_ops.cc (included there in order; formats and contract: its head comment).
#ifndef GPTC_KERNELS_GPTC_DECODER_STACK_H_
#define GPTC_KERNELS_GPTC_DECODER_STACK_H_

#include "gptc_decoder_ops.h"

namespace {

// Activations of the blocks, ping-pong (block i reads act[i % 2], writes act[(i + 1) % 2]): the
// calling thread's, kept across calls as Shared is.
struct StackBuffers {
  std::vector<float> act[2];
  std::vector<float> sub_ctx, sub_x;  // the last block's gathered rows (Subset)
  std::vector<float> draft_logits;    // a draft-vocabulary run's head outputs (n, its rows)
  std::vector<char> need;
};
thread_local StackBuffers t_stack;
// Short inputs (decode steps): every thread's own copy of the embeddings, block 0's input (see
// stack_forward).
thread_local std::vector<float> t_embed;

// gptc_generate's weights: entries of the layout, kStackFixed first, then kPerLayer per block,
// then (a draft's program, optionally) the kDraftPieces of its draft vocabulary: the head's rows
// of those tokens (as the head stores them) and their ids (float32, ascending; exact below 2^24).
enum { kWte, kWteS, kWpe, kWpeS, kLnfW, kLnfB, kHeadW, kHeadS, kStackFixed };
constexpr int kPerLayer = 16;
enum { kDraftW, kDraftS, kDraftIds, kDraftPieces };
constexpr int64_t kControlHeader = 5;  // control: steps, eos, pad, suppress, flags; then a flag per row
constexpr int64_t kFlagDraftVocab = 1;  // control flags: greedy tokens from the draft vocabulary

// The weights packed in blobs (pairs of a float32 and an int8 tensor, one pair per group of
// weights: a few inputs instead of one per weight; Paddle's executor costs about as much per
// input as per op), each weight a piece described by 4 layout numbers: blob (even: float32, odd:
// int8), offset (elements), d0, d1.
std::vector<WeightView> unpack(const std::vector<paddle::Tensor>& blobs, const std::vector<int64_t>& layout) {
  PD_CHECK(blobs.size() % 2 == 0 && layout.size() % 4 == 0,
           "gptc_generate: weights must be pairs of float32 and int8 blobs, 4 layout numbers per piece");
  for (size_t b = 0; b < blobs.size(); ++b)
    PD_CHECK(blobs[b].dtype() == (b % 2 ? paddle::DataType::INT8 : paddle::DataType::FLOAT32),
             "gptc_generate: weight blob ", b, " must be ", b % 2 ? "int8" : "float32");
  std::vector<WeightView> out(layout.size() / 4);
  for (size_t i = 0; i < out.size(); ++i) {
    const int64_t blob = layout[4 * i], off = layout[4 * i + 1], d0 = layout[4 * i + 2], d1 = layout[4 * i + 3];
    PD_CHECK(blob >= 0 && blob < int64_t(blobs.size()) && off >= 0 && d0 >= 0 && d1 >= 0 &&
                 off + d0 * d1 <= blobs[blob].numel(),
             "gptc_generate: weight piece ", i, " lies outside its blob");
    WeightView& v = out[i];
    v.i8 = blob % 2 == 1;
    v.p = v.i8 ? static_cast<const void*>(blobs[blob].data<int8_t>() + off)
               : static_cast<const void*>(blobs[blob].data<float>() + off);
    v.d0 = d0, v.d1 = d1, v.avail = blobs[blob].numel() - off;
  }
  return out;
}

}  // namespace

// ids (B, T), mask (B, S+T), rows (n,), caches [k_0, v_0, k_1, ...] (B, H_i, cap, D) written in
// place, weights [float32 blob, int8 blob, ...] with `layout` (unpack): the pieces wte, wte_s, wpe,
// wpe_s, ln_f_w, ln_f_b, head_w, head_s, then per block its 16 weights in make_layer_weights'
// order (an unused scale: any float piece), then optionally the draft vocabulary's three (kDraftW,
// kDraftS, kDraftIds) -> logits (n, V) of the flat rows of the B*T new
// positions. heads: per block; bits, act: 4 per block (qkv, out, fc, proj).
// control (gptc_generate's Control; null: one step, Tokens (n,)): [steps, eos (-1: none), pad, suppress, flags,
// finished_0, ..., finished_{B-1}]: the tokens of steps j < suppress are never eos (generation's
// min_new_tokens: the argmax with eos's logit taken as -inf, as the Python processor sets it).
// flags & kFlagDraftVocab (a program with a draft vocabulary; decode rows): every step's head
// computes only the draft vocabulary's rows, and its token is the argmax over them (a speculative
// draft's proposals: a fraction of the head's weights read a step); the logits out are those
// rows' values, -inf elsewhere, so the tokens are still the argmax of the logits returned.
// Steps > 1 (greedy decoding, rows = each row's last new position b*T + T - 1) runs that many
// decode steps in this one call: the first feeds the T columns of ids (a draft catching up with
// the tokens it has not cached), each later one the previous step's tokens with one more mask
// column of ones, as generation.stream_tokens would: a row finished before the call or by an
// earlier step's eos gets `pad` (fed and returned); the steps end early once every row is
// finished (the rest `pad`). Tokens are then (B, steps) and the logits the last step's. Each step
// is the one-step call's arithmetic, so the tokens are the ones step-by-step calls would give.
std::vector<paddle::Tensor> stack_forward(const paddle::Tensor& ids, const paddle::Tensor& mask,
                                          const paddle::Tensor& rows, std::vector<paddle::Tensor>& caches,
                                          const std::vector<paddle::Tensor>& blobs, const std::vector<int64_t>& layout,
                                          int wte_bits, int wpe_bits, const std::vector<int>& heads, float eps,
                                          int activation, const std::vector<int>& bits, const std::vector<float>& act,
                                          int head_bits, float head_act, const paddle::Tensor* control) {
  const int64_t B = ids.dims()[0], T = ids.dims()[1], L = mask.dims()[1], n = rows.numel();
  const int64_t layers = int64_t(heads.size());
  const int kind = T > 1;
  op_enter(kind);
  const GilRelease nogil;
  Laps lp(kind);
  PD_CHECK(mask.dims()[0] == B && L >= T, "gptc_generate: mask must be (B, S+T)");
  const int64_t* ctl = nullptr;
  int64_t steps = 1;
  if (control != nullptr) {
    PD_CHECK(control->dtype() == paddle::DataType::INT64 && control->numel() == kControlHeader + B,
             "gptc_generate: control must be int64 [steps, eos, pad, suppress, flags] and one finished flag per row");
    ctl = control->data<int64_t>();
    steps = ctl[0];
    PD_CHECK(steps >= 1, "gptc_generate: steps must be at least 1");
  }
  const std::vector<WeightView> ws = unpack(blobs, layout);
  const int64_t fixed = kStackFixed + kPerLayer * layers;
  const bool has_draft = int64_t(ws.size()) == fixed + kDraftPieces;
  PD_CHECK((int64_t(ws.size()) == fixed || has_draft) && int64_t(caches.size()) == 2 * layers &&
               int64_t(bits.size()) == 4 * layers && int64_t(act.size()) == 4 * layers,
           "gptc_generate: ", layers, " blocks need ", 2 * layers, " caches, ", kStackFixed + kPerLayer * layers,
           " weights and ", 4 * layers, " bits/act entries");
  const Table wte = make_table(ws[kWte], ws[kWteS], wte_bits), wpe = make_table(ws[kWpe], ws[kWpeS], wpe_bits);
  const int64_t C = table_width(ws[kWte], wte_bits), M = B * T;
  PD_CHECK(table_width(ws[kWpe], wpe_bits) == C, "gptc_generate: position table width differs from the token table's");
  PD_CHECK(!ws[kLnfW].i8 && !ws[kLnfB].i8 && ws[kLnfW].d0 * ws[kLnfW].d1 == C && ws[kLnfB].d0 * ws[kLnfB].d1 == C,
           "gptc_generate: final layer norm must be float32 of the hidden size");
  const LinearWeights head = make_linear_weights(ws[kHeadW], ws[kHeadS], nullptr, head_bits, head_act);
  PD_CHECK(head.k == C, "gptc_generate: head weight has ", head.k, " inputs, hidden size is ", C);
  LinearWeights draft;  // the draft vocabulary's head rows, and their ids
  const float* draft_ids = nullptr;
  if (has_draft) {
    draft = make_linear_weights(ws[fixed + kDraftW], ws[fixed + kDraftS], nullptr, head_bits, head_act);
    const WeightView& iv = ws[fixed + kDraftIds];
    PD_CHECK(draft.k == C && draft.blk == head.blk && !iv.i8 && iv.d0 * iv.d1 == draft.n && draft.n > 0,
             "gptc_generate: the draft vocabulary's head rows must be the head's format, one id each");
    draft_ids = iv.f();
  }
  std::vector<LayerWeights> lw(layers);
  std::vector<KvCache> kv(layers);  // each block's key and value cache
  int64_t inner = 0, F = 0, kmax = C;
  for (int64_t i = 0; i < layers; ++i) {
    paddle::Tensor &kc = caches[2 * i], &vc = caches[2 * i + 1];
    kv[i] = check_cache(kc, vc, B, heads[i], L + steps - 1);
    lw[i] = make_layer_weights(&ws[kStackFixed + kPerLayer * i], C, heads[i], kc.dims()[3], bits.data() + 4 * i,
                               act.data() + 4 * i);
    inner = std::max(inner, lw[i].H * lw[i].D), F = std::max(F, lw[i].F), kmax = std::max(kmax, kmax_of(lw[i]));
  }
  const int64_t* r = rows.data<int64_t>();
  for (int64_t i = 0; i < n; ++i) PD_CHECK(r[i] >= 0 && r[i] < M, "gptc_generate: row index out of range");
  // Decode rows (every row's last new position, in order): the control's padding applies.
  bool per_row = n == B;
  for (int64_t i = 0; per_row && i < n; ++i) per_row = r[i] == i * T + T - 1;
  PD_CHECK(steps == 1 || per_row, "gptc_generate: several steps need rows b*T + T - 1 for b = 0..B-1 in order");
  float* a[2] = {grow(t_stack.act[0], size_t(std::max<int64_t>(M * C, 1))),
                 grow(t_stack.act[1], size_t(std::max<int64_t>(M * C, 1)))};
  // Fewer rows asked for than computed (prefill: each sequence's last): the last block computes
  // past its attention only those (Subset), and the head reads its compact output in order.
  bool subset = layers > 0 && n < M;
  Subset sub{};
  if (subset) {
    char* need = grow(t_stack.need, size_t(M));
    std::fill(need, need + M, char(0));
    for (int64_t i = 0; i < n; ++i) need[r[i]] = 1;
    sub = Subset{r, n, need, grow(t_stack.sub_ctx, size_t(n * inner)), grow(t_stack.sub_x, size_t(n * C))};
  }
  auto out = paddle::empty({n, head.n}, paddle::DataType::FLOAT32, ids.place());
  auto tokens = ctl ? paddle::empty({n, steps}, paddle::DataType::INT64, ids.place())
                    : paddle::empty({n}, paddle::DataType::INT64, ids.place());
  std::vector<int64_t> step_tok(ctl ? n : 0), step_ids, step_mask;
  int64_t* tok = ctl ? step_tok.data() : tokens.data<int64_t>();
  std::vector<char> fin(ctl ? B : 0);
  for (int64_t b = 0; ctl && b < B; ++b) fin[b] = ctl[kControlHeader + b] != 0;
  const int64_t eos = ctl ? ctl[1] : -1, pad = ctl ? ctl[2] : 0, suppress = ctl ? ctl[3] : 0;
  const bool use_draft = ctl != nullptr && (ctl[4] & kFlagDraftVocab) != 0;
  PD_CHECK(!use_draft || (has_draft && per_row),
           "gptc_generate: control asks for the draft vocabulary, which needs one (export it with draft_vocab) "
           "and decode rows");
  // The head of each step: the draft vocabulary's rows into dlog (n, draft.n), or all into logits.
  const LinearWeights& hw = use_draft ? draft : head;
  int64_t eos_at = eos;  // eos's row in hw (-1: not there)
  float* dlog = nullptr;
  if (use_draft) {
    bool ok = true;  // whole ids, ascending, within the vocabulary (checked when they are read)
    for (int64_t i = 0; i < draft.n; ++i)
      ok &= draft_ids[i] >= 0.f && draft_ids[i] < float(head.n) && draft_ids[i] == std::floor(draft_ids[i]) &&
            (i == 0 || draft_ids[i] > draft_ids[i - 1]);
    PD_CHECK(ok, "gptc_generate: draft vocabulary ids must ascend within the vocabulary");
    dlog = grow(t_stack.draft_logits, size_t(std::max<int64_t>(n * draft.n, 1)));
    const float* hit = std::lower_bound(draft_ids, draft_ids + draft.n, float(eos));
    eos_at = eos >= 0 && hit != draft_ids + draft.n && *hit == float(eos) ? hit - draft_ids : -1;
  }
  const int64_t* id = ids.data<int64_t>();
  const int64_t* mk = mask.data<int64_t>();
  const float* ln_f_w = ws[kLnfW].f();
  const float* ln_f_b = ws[kLnfB].f();
  float* logits = out.data<float>();
  int64_t Tj = T;  // new positions a row this step: T, then 1
  for (int64_t j = 0; j < steps; ++j) {
    const int64_t Lj = L + j;  // step j: the mask with j columns of ones, the previous tokens
    if (j > 0) {
      step_mask.resize(size_t(B * Lj));
      for (int64_t b = 0; b < B; ++b) {
        std::memcpy(step_mask.data() + b * Lj, mask.data<int64_t>() + b * L, size_t(L) * sizeof(int64_t));
        std::fill(step_mask.data() + b * Lj + L, step_mask.data() + (b + 1) * Lj, int64_t(1));
      }
      mk = step_mask.data(), id = step_ids.data();
      if (Tj > 1) Tj = 1, subset = false, r = nullptr;  // one new position a row: the head reads rows 0..B-1
    }
    const StepContext s = make_step_context(B, Tj, C, mk, Lj, inner, F, kmax, n, eps, activation);
    // Profile laps (thread 0): embed (+ the checks above and the fork), each block's sections
    // (layer_step), head_ln, head_linear; no between_ops.
    // Block 0's input: for short inputs (decode) every thread embeds all rows itself into its own
    // buffer (the same values; a few rows), so no barrier follows the fork and the first thread
    // starts block 0 while the others are still waking (they sleep between program runs); long
    // ones are shared out into act[0] (one barrier). Block i > 0 reads act[i % 2].
#pragma omp parallel num_threads(s.nt)
    {
      const bool lead = omp_get_thread_num() == 0;
      float* x0 = a[0];
      if (s.rows) {
#pragma omp for schedule(static)
        for (int64_t b = 0; b < B; ++b) embed_rows(wte, wpe, C, id, mk, Tj, Lj, b, b + 1, x0);
      } else {
        x0 = grow(t_embed, size_t(std::max<int64_t>(M * C, 1)));
        embed_rows(wte, wpe, C, id, mk, Tj, Lj, 0, B, x0);
      }
      if (lead) lp.lap(kEmbed);
      for (int64_t i = 0; i < layers; ++i)
        layer_step(lw[i], s, i ? a[i % 2] : x0, a[(i + 1) % 2], kv[i], lp, lead,
                   subset && i == layers - 1 ? &sub : nullptr);
      const LinearInputs hin = head_inputs(head, s, layers ? a[layers % 2] : x0, subset ? nullptr : r, n, ln_f_w,
                                           ln_f_b);
      if (lead) lp.lap(kHeadLn);
      float* hl = use_draft ? dlog : logits;
      if (n) linear_for(hw, hin, n, hl, nullptr, -1);
      const bool no_eos = j < suppress && eos_at >= 0 && eos_at < hw.n;
#pragma omp for schedule(static)
      for (int64_t i = 0; i < n; ++i) {  // greedy's token
        float* row = hl + i * hw.n;
        const float keep = no_eos ? row[eos_at] : 0.f;
        if (no_eos) row[eos_at] = -INFINITY;
        const int64_t at = row_argmax(row, hw.n);
        tok[i] = use_draft ? int64_t(draft_ids[at]) : at;
        if (no_eos) row[eos_at] = keep;
      }
      if (lead) lp.lap(kHead);
      trim(t_scratch), trim(t_embed);
    }
    if (ctl == nullptr) break;
    int64_t* all = tokens.data<int64_t>();  // (n, steps): step j's tokens, finished rows padded
    if (!per_row) {  // prefill or scoring rows (one step): the argmax of each
      std::copy(tok, tok + n, all);
      break;
    }
    bool done = true;
    step_ids.resize(size_t(B));
    for (int64_t b = 0; b < B; ++b) {
      int64_t t = tok[b];
      if (fin[b]) t = pad;
      else if (t == eos) fin[b] = 1;
      all[b * steps + j] = step_ids[b] = t;
      done = done && fin[b];
    }
    if (done) {  // every row finished: the remaining steps are padding
      for (int64_t b = 0; b < B; ++b) std::fill(all + b * steps + j + 1, all + (b + 1) * steps, pad);
      break;
    }
  }
  for (int64_t i = 0; use_draft && i < n; ++i) {  // the last step's draft rows, -inf elsewhere
    float* row = logits + i * head.n;
    std::fill(row, row + head.n, -INFINITY);
    for (int64_t t = 0; t < draft.n; ++t) row[int64_t(draft_ids[t])] = dlog[i * draft.n + t];
  }
  trim(t_shared);
  trim(t_stack.act[0]), trim(t_stack.act[1]), trim(t_stack.sub_ctx), trim(t_stack.sub_x), trim(t_stack.draft_logits);
  op_exit(true);
  return {out, tokens};
}

std::vector<paddle::Tensor> GenerateForward(const paddle::Tensor& ids, const paddle::Tensor& mask,
                                            const paddle::Tensor& rows, const paddle::Tensor& control,
                                            std::vector<paddle::Tensor>& caches, const std::vector<paddle::Tensor>& blobs,
                                            const std::vector<int64_t>& layout, int wte_bits, int wpe_bits,
                                            const std::vector<int>& heads, float eps, int activation,
                                            const std::vector<int>& bits, const std::vector<float>& act, int head_bits,
                                            float head_act) {
  return stack_forward(ids, mask, rows, caches, blobs, layout, wte_bits, wpe_bits, heads, eps, activation, bits, act,
                       head_bits, head_act, &control);
}

// The attributes of gptc_generate (stack_forward's, in order).
std::vector<std::string> stack_attrs() {
  return {"layout: std::vector<int64_t>", "wte_bits: int", "wpe_bits: int", "heads: std::vector<int>",
          "eps: float", "activation: int", "bits: std::vector<int>", "act: std::vector<float>", "head_bits: int",
          "head_act: float"};
}

std::vector<std::vector<int64_t>> GenerateShape(const std::vector<int64_t>&, const std::vector<int64_t>&,
                                                const std::vector<int64_t>& rows, const std::vector<int64_t>&,
                                                const std::vector<std::vector<int64_t>>&,
                                                const std::vector<std::vector<int64_t>>&) {
  return {{rows[0], -1}, {rows[0], -1}};  // the steps are a value of Control
}

std::vector<paddle::DataType> GenerateDtype(const paddle::DataType&, const paddle::DataType&, const paddle::DataType&,
                                            const paddle::DataType&, const std::vector<paddle::DataType>&,
                                            const std::vector<paddle::DataType>&) {
  return {paddle::DataType::FLOAT32, paddle::DataType::INT64};
}

// The fused format of kernel version 3: several greedy decode steps in one call (Control).
PD_BUILD_OP(gptc_generate)
    .Inputs({"Ids", "Mask", "Rows", "Control", paddle::Vec("Caches"), paddle::Vec("Weights")})
    .Outputs({"Out", "Tokens", paddle::Vec("CachesOut")})
    .SetInplaceMap({{paddle::Vec("Caches"), paddle::Vec("CachesOut")}})
    .Attrs(stack_attrs())
    .SetKernelFn(PD_KERNEL(GenerateForward))
    .SetInferShapeFn(PD_INFER_SHAPE(GenerateShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(GenerateDtype));

#endif  // GPTC_KERNELS_GPTC_DECODER_STACK_H_
