// The decoder's layer machinery that gptc_generate (gptc_decoder_stack.h) and the tensor-parallel
// ops (gptc_tp_ops.h) run: the embedding tables (embed_rows), one block's weights and per-call
// state (LayerWeights, StepContext), one block with its KV cache written in place (layer_step) and
// the head's inputs (head_inputs). No operator is registered here.
// Part of the one translation unit gptc_ops.cc (included there in order; formats and contract: its head comment).
#ifndef GPTC_KERNELS_GPTC_DECODER_OPS_H_
#define GPTC_KERNELS_GPTC_DECODER_OPS_H_

#include "gptc_linear.h"
#include "gptc_norm_attention.h"

namespace {

// The hidden size of an embedding table's rows (int4: two codes a byte).
inline int64_t table_width(const WeightView& w, int bits) { return bits == 4 ? w.d1 * 2 : w.d1; }

// ---------------------------------------------------------------------------------- embed
// An embedding table as embed_rows reads it: float32 (rows, C), or int codes with block scales
// (rows, nb); int4 packed as the Linear weights (weight_format, gptc_common.h).
struct Table {
  const float* wf = nullptr;
  const int8_t* wq = nullptr;
  const float* s = nullptr;
  int64_t rows = 0, nb = 0;
  int bits = 32;
  bool grouped = false;  // int8 codes and scales in row groups (a tied head's, gptc_grouped.h)
};

Table make_table(const WeightView& w, const WeightView& s, int bits) {
  Table t;
  t.bits = bits;
  t.rows = w.d0;
  if (bits == 32) {
    PD_CHECK(!w.i8, "gptc: float embedding expected");
    t.wf = w.f();
  } else {
    PD_CHECK(w.i8 && !s.i8 && s.d0 == w.d0, "gptc: int8 embedding codes and float scales expected");
    t.wq = w.q();
    t.s = s.f();
    t.nb = s.d1;
    if (bits == weight_format::kInt8Grouped) {
      PD_CHECK(w.d1 % 4 == 0 && t.nb > 0 && w.d1 % t.nb == 0 && grouped_fits(w, s),
               "gptc: int8 embedding in row groups: bad shape");
      t.grouped = true, t.bits = weight_format::kInt8Bits;
    }
  }
  return t;
}

// Row r of table w (C values) into dst (float, or int8/int4 codes times their block scales);
// added to dst with `add`.
void table_row(const Table& w, int64_t r, int64_t C, float* dst, bool add) {
  if (w.bits == 32) {
    const float* src = w.wf + r * C;
    for (int64_t c = 0; c < C; ++c) dst[c] = add ? dst[c] + src[c] : src[c];
    return;
  }
  // Value c's block c / blk is counted along (kb), not divided out per value: a division by the
  // run-time blk for each value cost more than the rest of the row's arithmetic.
  const int64_t blk = C / w.nb;
  if (w.grouped) {  // row r's codes and scales where the groups hold them (gptc_grouped.h's layout)
    const int64_t g = r / GROUP_ROWS, i = r % GROUP_ROWS;
    const int8_t* q = w.wq + g * GROUP_ROWS * C + 4 * i;
    const float* sg = w.s + g * GROUP_ROWS * w.nb + i;
    for (int64_t c = 0, kb = 0, end = blk; c < C; ++c) {
      if (c == end) ++kb, end += blk;
      const float v = float(int8_t(uint8_t(q[(c >> 2) * 4 * GROUP_ROWS + (c & 3)]) ^ 0x80)) * sg[kb * GROUP_ROWS];
      dst[c] = add ? dst[c] + v : v;
    }
    return;
  }
  const float* sc = w.s + r * w.nb;
  const int8_t* q8 = w.wq + r * (w.bits == 4 ? C / 2 : C);
  for (int64_t c = 0, kb = 0, end = blk; c < C; ++c) {
    if (c == end) ++kb, end += blk;
    const uint8_t byte = uint8_t(q8[(c >> 5) * 16 + (c & 15)]);  // int4: weight_format's runs
    const int q = w.bits == 8 ? int(q8[c]) : ((c & 31) < 16 ? int(byte & 0xF) : int(byte >> 4)) - 8;
    const float v = float(q) * sc[kb];
    dst[c] = add ? dst[c] + v : v;
  }
}

// Batch rows [b0, b1) of y (B, T, C): the token embedding plus the position embedding of the
// last T mask columns (position = cumsum(mask) - 1, clipped at 0), ids and positions clipped to
// the tables. A row depends on its own ids and mask alone.
void embed_rows(const Table& wte, const Table& wpe, int64_t C, const int64_t* id, const int64_t* mk, int64_t T,
                int64_t L, int64_t b0, int64_t b1, float* y) {
  for (int64_t b = b0; b < b1; ++b) {
    int64_t pos = 0;
    for (int64_t j = 0; j < L - T; ++j) pos += mk[b * L + j];
    for (int64_t t = 0; t < T; ++t) {
      pos += mk[b * L + L - T + t];
      const int64_t p = std::min(std::max<int64_t>(pos - 1, 0), wpe.rows - 1);
      const int64_t tok = std::min(std::max<int64_t>(id[b * T + t], 0), wte.rows - 1);
      float* dst = y + (b * T + t) * C;
      table_row(wte, tok, C, dst, false);
      table_row(wpe, p, C, dst, true);
    }
  }
}

// ---------------------------------------------------------------------------------- layer
// One decoder block's weights (make_layer_weights) and what every block of one call shares (a StepContext).
struct LayerWeights {
  LinearWeights qkv, out, fc, proj;
  const float *ln1_w, *ln1_b, *ln2_w, *ln2_b;
  int64_t H, D, F;
};

// w: the block's 16 weights in this order: ln1_w, ln1_b, qkv_w, qkv_s, qkv_b, out_w, out_s, out_b,
// ln2_w, ln2_b, fc_w, fc_s, fc_b, proj_w, proj_s, proj_b (a float weight's scale: any float piece);
// bits, act: 4 each (qkv, out, fc, proj).
LayerWeights make_layer_weights(const WeightView* w, int64_t C, int64_t heads, int64_t head_dim, const int* bits,
                                const float* act) {
  LayerWeights l;
  for (int j : {0, 1, 4, 7, 8, 9, 12, 15})
    PD_CHECK(!w[j].i8 && w[j].d0 * w[j].d1 >= (j == 4 || j == 7 || j == 12 || j == 15 ? 1 : C),
             "gptc: layer norm weights and biases must be float32");
  l.ln1_w = w[0].f(), l.ln1_b = w[1].f();
  l.qkv = make_linear_weights(w[2], w[3], w[4].f(), bits[0], act[0]);
  l.out = make_linear_weights(w[5], w[6], w[7].f(), bits[1], act[1]);
  l.ln2_w = w[8].f(), l.ln2_b = w[9].f();
  l.fc = make_linear_weights(w[10], w[11], w[12].f(), bits[2], act[2]);
  l.proj = make_linear_weights(w[13], w[14], w[15].f(), bits[3], act[3]);
  l.H = heads, l.D = head_dim, l.F = l.fc.n;
  const int64_t inner = heads * head_dim;
  PD_CHECK(l.qkv.n == 3 * inner && l.qkv.k == C && l.out.k == inner && l.out.n == C && l.fc.k == C &&
               l.proj.k == l.F && l.proj.n == C,
           "gptc: weight shapes do not match the cache/hidden sizes");
  for (int j : {4, 7, 12, 15})
    PD_CHECK(w[j].d0 * w[j].d1 == (j == 4 ? l.qkv.n : j == 12 ? l.F : C), "gptc: bias size mismatch");
  return l;
}

// Rows from which a call's layer norms and int8 inputs are made once, shared (StepContext::rows).
constexpr int64_t kSharedRows = 16;

struct StepContext {
  int64_t B, T, C, L, S, M;
  const int32_t* keys;   // (B, L): each row's unmasked cache columns, in order
  const int64_t* nkeys;  // (B, T): how many of them a query at column S+t attends to
  float *q, *ctx, *f;    // shared: qkv outputs, attention outputs, MLP hidden (the largest block's size)
  bool rows;             // prepare_rows (long inputs) into the shared hs, xqs, sxs
  float* hs;
  int8_t* xqs;
  float* sxs;
  int nt;
  float eps;
  int activation;
};

// Shared buffers of a call whose widest block has these sizes (grown on the calling thread,
// before the parallel region); keys and nkeys of the mask. head_rows: the rows the head takes
// (head_inputs shares its buffers out from kSharedRows rows on, as the blocks do).
StepContext make_step_context(int64_t B, int64_t T, int64_t C, const int64_t* mk, int64_t L, int64_t inner, int64_t F,
                              int64_t kmax, int64_t head_rows, float eps, int activation) {
  Shared& sh = t_shared;  // this thread's: the op's threads share them during the call
  StepContext s;
  s.B = B, s.T = T, s.C = C, s.L = L, s.S = L - T, s.M = B * T;
  s.eps = eps, s.activation = activation, s.nt = nthreads();
  s.q = grow(sh.q, size_t(s.M * 3 * inner));
  s.ctx = grow(sh.ctx, size_t(s.M * inner));
  s.f = grow(sh.f, size_t(s.M * F));
  int32_t* keys = grow(sh.keys, size_t(B * L));
  int64_t* nkeys = grow(sh.nkeys, size_t(B * T));
  for (int64_t b = 0; b < B; ++b) {
    int64_t n = 0;
    for (int64_t j = 0; j < L; ++j) {
      if (mk[b * L + j]) keys[b * L + n++] = int32_t(j);
      if (j >= s.S) nkeys[b * T + j - s.S] = n;
    }
  }
  s.keys = keys, s.nkeys = nkeys;
  // Long inputs (prefill): the layer norms and int8 inputs made once, in shared buffers
  // (prepare_rows), at the cost of up to 4 more barriers a layer; shorter ones (decode steps of
  // batches) are cheaper made by every thread. The threshold is an estimate: a barrier against
  // 16 rows' norms and quantizations.
  s.rows = s.M >= kSharedRows;
  s.hs = nullptr, s.xqs = nullptr, s.sxs = nullptr;
  const int64_t n = std::max(s.rows ? s.M : 0, head_rows >= kSharedRows ? head_rows : 0);
  if (n) {
    s.hs = grow(sh.rows_h, size_t(n * C));
    s.xqs = grow(sh.rows_xq, size_t(n * kmax));
    s.sxs = grow(sh.rows_sx, size_t(n * kmax));  // K / blk scales a row, at most K
  }
  return s;
}

inline int64_t kmax_of(const LayerWeights& l) { return std::max({l.qkv.k, l.out.k, l.fc.k, l.proj.k}); }

// One block, x (M, C) -> y (M, C), its new keys/values written into K_, V_ (B, H, cap, D) at
// S..S+T-1; called by every thread of a parallel region (no barrier at its start: y and the
// shared buffers must not be read by anything else still running).
// Every thread computes the layer norms and input quantizations itself (the same values: cheap,
// and no thread waits for another) unless s.rows; the barriers are the ends of the worksharing
// loops whose outputs the next step reads whole. Profile laps (thread 0, after each barrier):
// ln1; qkv (+ cache writes and attention when by_head); attention; out (+ residual); ln2; fc
// (+ activation); proj (+ residual).
// The rows of a block's output that are needed (the last block: the head reads only the rows
// asked for): attention runs only for the queries `need` marks, and the output projection, MLP
// and residuals only for rows[0..n), gathered in that order (ctx, x: n rows each); y then holds
// those n rows, compact. The keys/values of every row are still written. Each kept row's values
// are the full block's (an output's arithmetic never depends on M).
struct Subset {
  const int64_t* rows;
  int64_t n;
  const char* need;  // (M): 1 for the rows above
  float *ctx, *x;
};

// A block's key and value caches (B, H, cap, D): float32 or bfloat16 elements (bf16).
struct KvCache {
  void *k, *v;
  int64_t cap;
  bool bf16;
};

// Row b's head hh (H heads of D; its qkv outputs head-major (H, 3, D) in s.q): the keys and
// values of its T new positions into the cache (K_, V_: (B, H, cap, D)) at S..S+T-1, then the
// attention of each of its queries that `need` marks (null: all) into s.ctx, consecutive queries
// of one segment length together (attend_rows). The queries read the keys and values back from
// the cache, their own included, so a bfloat16 cache rounds them alike for every query, in every
// batch and prefill/decode split.
template <class E>
inline void attend_head_in(const StepContext& s, int64_t H, int64_t D, E* K_, E* V_, int64_t cap, const char* need,
                           int64_t b, int64_t hh, Scratch& sc) {
  const int64_t T = s.T, L = s.L, S = s.S, inner = H * D;
  const float scale = 1.f / std::sqrt(float(D));
  for (int64_t t = 0; t < T; ++t) {
    const float* src = s.q + (b * T + t) * 3 * inner + hh * 3 * D;
    const int64_t dst = ((b * H + hh) * cap + S + t) * D;
    cache_write(K_ + dst, src + D, D);
    cache_write(V_ + dst, src + 2 * D, D);
  }
  const int64_t* nk = s.nkeys + b * T;
  auto query = [&](int64_t t) { return need == nullptr || need[b * T + t]; };
  NextKv next;  // a decode step: the next row's keys and values of this head
  if (T == 1 && b + 1 < s.B && s.nkeys[b + 1] > 0) {
    const int32_t* kn = s.keys + (b + 1) * L;
    const int64_t first = kn[0], last = kn[s.nkeys[b + 1] - 1], at = ((b + 1) * H + hh) * cap + first;
    next = {reinterpret_cast<const char*>(K_ + at * D), reinterpret_cast<const char*>(V_ + at * D),
            (last - first + 1) * D * int64_t(sizeof(E))};
  }
  float* p = nullptr;
  for (int64_t t = 0; t < T;) {
    if (!query(t) || nk[t] == 0) {  // not asked for, or a padding query: attends to nothing real
      if (query(t)) std::memset(s.ctx + (b * T + t) * inner + hh * D, 0, D * sizeof(float));
      ++t;
      continue;
    }
    const float* qv[8];
    float* os[8];
    int64_t n[8];
    int g = 0;  // the queries from t on of the same m = ceil(n / 8), up to 8
    for (; g < 8 && t + g < T && query(t + g) && (nk[t + g] + 7) / 8 == (nk[t] + 7) / 8; ++g) {
      qv[g] = s.q + (b * T + t + g) * 3 * inner + hh * 3 * D;
      os[g] = s.ctx + (b * T + t + g) * inner + hh * D;
      n[g] = nk[t + g];
    }
    if (p == nullptr) p = grow(sc.p, size_t(8 * (L + 8)));
    attend_rows(qv, n, g, K_ + (b * H + hh) * cap * D, V_ + (b * H + hh) * cap * D, s.keys + b * L, D, scale, p, os,
                next);
    t += g;
  }
}

inline void attend_head(const StepContext& s, int64_t H, int64_t D, const KvCache& kv, const char* need, int64_t b,
                        int64_t hh, Scratch& sc) {
  if (kv.bf16)
    attend_head_in(s, H, D, static_cast<bf16_t*>(kv.k), static_cast<bf16_t*>(kv.v), kv.cap, need, b, hh, sc);
  else
    attend_head_in(s, H, D, static_cast<float*>(kv.k), static_cast<float*>(kv.v), kv.cap, need, b, hh, sc);
}

void layer_step(const LayerWeights& w, const StepContext& s, const float* xd, float* yd, const KvCache& kv, Laps& lp,
                bool lead, const Subset* sub = nullptr) {
  Scratch& sc = t_scratch;
  const int64_t B = s.B, C = s.C, M = s.M, H = w.H, D = w.D, inner = H * D;
  const LinearWeights &qkv = w.qkv, &out = w.out, &fc = w.fc, &proj = w.proj;
  const bool rows = s.rows;
  const float eps = s.eps;
  float *q = s.q, *ctx = s.ctx, *f = s.f;
  // Head hh's qkv outputs are the rows [hh * 3D, (hh + 1) * 3D) (head-major (H, 3, D)): with
  // enough heads per thread one work item computes them, writes the new keys/values into the
  // cache and runs the head's attention, with no barrier between the three.
  const bool by_head = H % s.nt == 0 || H >= 3 * s.nt;
  const char* need = sub ? sub->need : nullptr;
  float* h = rows ? s.hs : grow(sc.h, size_t(M * std::max(C, int64_t(1))));
  if (!rows) layer_norm(xd, M, C, w.ln1_w, w.ln1_b, eps, h);
  const LinearInputs in1 = rows ? prepare_rows(qkv, xd, M, w.ln1_w, w.ln1_b, eps, h, s.xqs, s.sxs)
                      : prepare_inputs(qkv, h, M, sc);
  if (lead) lp.lap(kLn1);
  if (by_head) {
    const PackedInputs pk = rows_inputs(qkv, in1, M, sc);  // by every thread, for itself: no barrier
#pragma omp for schedule(dynamic)
    for (int64_t hh = 0; hh < H; ++hh) {
      linear_rows(qkv, in1, pk, M, hh * 3 * D, (hh + 1) * 3 * D, q, 3 * inner, nullptr, -1, sc);
      for (int64_t b = 0; b < B; ++b) attend_head(s, H, D, kv, need, b, hh, sc);
    }
    if (lead) lp.lap(kQkv);
  } else {
    linear_for(qkv, in1, M, q, nullptr, -1);
    if (lead) lp.lap(kQkv);
#pragma omp for collapse(2) schedule(dynamic)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t hh = 0; hh < H; ++hh) attend_head(s, H, D, kv, need, b, hh, sc);
    if (lead) lp.lap(kAttn);
  }
  int64_t m = M;  // the rows that go on: all, or the subset's, gathered
  bool shared = rows;
  const float *x2 = xd, *c2 = ctx;
  if (sub != nullptr) {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < sub->n; ++i) {
      std::memcpy(sub->ctx + i * inner, ctx + sub->rows[i] * inner, inner * sizeof(float));
      std::memcpy(sub->x + i * C, xd + sub->rows[i] * C, C * sizeof(float));
    }
    m = sub->n, shared = m >= kSharedRows, x2 = sub->x, c2 = sub->ctx;
    if (!shared) h = grow(sc.h, size_t(m * std::max(C, int64_t(1))));
  }
  const LinearInputs in_out = shared ? prepare_rows(out, c2, m, nullptr, nullptr, eps, nullptr, s.xqs, s.sxs)
                           : prepare_inputs(out, c2, m, sc);
  linear_for(out, in_out, m, yd, x2, -1);  // y = x + attention
  if (lead) lp.lap(kOut);
  if (!shared) layer_norm(yd, m, C, w.ln2_w, w.ln2_b, eps, h);
  const LinearInputs in2 = shared ? prepare_rows(fc, yd, m, w.ln2_w, w.ln2_b, eps, h, s.xqs, s.sxs)
                        : prepare_inputs(fc, h, m, sc);
  if (lead) lp.lap(kLn2);
  linear_for(fc, in2, m, f, nullptr, s.activation);
  if (lead) lp.lap(kFc);
  const LinearInputs in_proj = shared ? prepare_rows(proj, f, m, nullptr, nullptr, eps, nullptr, s.xqs, s.sxs)
                            : prepare_inputs(proj, f, m, sc);
  linear_for(proj, in_proj, m, yd, yd, -1);  // y += mlp
  if (lead) lp.lap(kProj);
}

// A block's caches checked (B, H, >= positions, D; float32 or bfloat16, both alike) and viewed.
KvCache check_cache(paddle::Tensor& kc, paddle::Tensor& vc, int64_t B, int64_t H, int64_t positions) {
  PD_CHECK(kc.dims().size() == 4 && kc.dims()[0] == B && kc.dims()[1] == H && vc.dims() == kc.dims(),
           "gptc: cache must be (B, heads, capacity, head_dim)");
  PD_CHECK(kc.dims()[2] >= positions, "gptc: cache capacity ", kc.dims()[2], " < ", positions, " positions");
  const bool bf16 = kc.dtype() == paddle::DataType::BFLOAT16;
  PD_CHECK((bf16 || kc.dtype() == paddle::DataType::FLOAT32) && vc.dtype() == kc.dtype(),
           "gptc: the key and value caches must both be float32 or both bfloat16");
  auto data = [bf16](paddle::Tensor& t) -> void* {
    return bf16 ? static_cast<void*>(t.data<paddle::bfloat16>()) : static_cast<void*>(t.data<float>());
  };
  return KvCache{data(kc), data(vc), kc.dims()[2], bf16};
}

// ---------------------------------------------------------------------------------- head
// The head's inputs for logits at the flat rows r[0..n) of x (M, C): each row's final layer norm
// (and int8 codes), inside a parallel region: made by every thread into its scratch for few
// rows, shared out (s.hs, s.xqs, s.sxs: the loop's end is a barrier) for 16 and more.
LinearInputs head_inputs(const LinearWeights& head, const StepContext& s, const float* x, const int64_t* r, int64_t n,
                         const float* ln_w, const float* ln_b) {
  const int64_t C = s.C;
  auto row = [&](int64_t i) { return x + (r ? r[i] : i) * C; };  // r null: rows 0..n-1 (a compact x)
  if (n < kSharedRows) {
    Scratch& sc = t_scratch;
    float* h = grow(sc.h, size_t(std::max<int64_t>(n * C, 1)));
    layer_norm_rows(row, n, C, ln_w, ln_b, s.eps, h);
    return prepare_inputs(head, h, n, sc);
  }
  const bool integer = is_integer(head);
  const int64_t nb = integer ? C / head.blk : 0;
  for_row_runs(n, [&](int64_t i0, int64_t rows) {
    layer_norm_rows([&](int64_t i) { return row(i0 + i); }, rows, C, ln_w, ln_b, s.eps, s.hs + i0 * C);
    if (integer) quantize_inputs(head, s.hs + i0 * C, rows, s.xqs + i0 * C, s.sxs + i0 * nb);
  });
  LinearInputs in{s.hs};
  if (integer) in.xq = s.xqs, in.sx = s.sxs;
  return in;
}

}  // namespace

#endif  // GPTC_KERNELS_GPTC_DECODER_OPS_H_
