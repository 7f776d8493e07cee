// The Linear entry points: linear_block (a block of weight rows against all M input rows: the
// tiles or micro-kernels, then the epilogue: activation, residual) and the dispatch that runs a
// Linear as GEMV (M = 1, gptc_gemv.h) or in blocks (linear_rows, linear_for, linear).
// Part of the one translation unit gptc_ops.cc (included there in order; formats and contract: its head comment).
#ifndef GPTC_KERNELS_GPTC_LINEAR_H_
#define GPTC_KERNELS_GPTC_LINEAR_H_

#include "gptc_gemm512.h"
#include "gptc_gemv.h"
#include "gptc_grouped.h"
#include "gptc_inputs.h"

namespace {

// The inputs of a Linear packed for the block kernels that read them so (M > 1): float inputs in
// pairs of rows (xp: AVX-512 builds), int8 ones + 128 (xu: VNNI builds), few int rows in lanes
// (lanes: VNNI builds; lanes8: AVX2 builds without VNNI-512). Made by each thread that runs blocks,
// into its own scratch, once per Linear call (not for the GEMV). Null where a kernel does not apply.
struct PackedInputs {
  const float* xp = nullptr;
  const uint8_t* xu = nullptr;
  const int32_t* st = nullptr;  // grouped weights: the accumulators' starts (GroupedInputs)
#if defined(GPTC_VNNI512)
  LaneInputs lanes;  // few rows of int inputs against int weights (lanes.x null otherwise)
#elif defined(__AVX2__)
  LaneInputs8 lanes8;  // rows of int inputs against int weights, 8 a panel (lanes8.xs null otherwise)
#endif
};

// Int weights against int inputs of whole 32-code chunks: M <= LANES_MAX rows take the lane
// kernels (VNNI builds; int_block_lanes, gptc_gemm512.h).
inline bool lanes_ok(const LinearWeights& L, const LinearInputs& in, int64_t M) {
#if defined(GPTC_VNNI512)
  return in.xq != nullptr && M <= LANES_MAX && (L.bits == 8 || L.bits == 4) && L.k % 32 == 0 && L.blk % 32 == 0;
#else
  (void)L, (void)in, (void)M;
  return false;
#endif
}

inline PackedInputs pack_inputs(const LinearWeights& L, const LinearInputs& in, int64_t M, Scratch& sc) {
  PackedInputs p;
  if (L.grouped) {  // the stored codes are the kernels' operand: only the starts to make
    p.st = grouped_starts(in.xq, M, L.k, L.blk, grow(sc.gstart, size_t(M * (L.k / L.blk))));
    return p;
  }
#if !defined(GPTC_VNNI512) && defined(__AVX2__)
  if (in.xq != nullptr && M >= LANES8_MIN && (L.bits == 8 || L.bits == 4) && L.k % 32 == 0 && L.blk % 32 == 0) {
    const int64_t panels = (M + 7) / 8, nb = L.k / L.blk;
    int32_t* xs = grow(sc.lane_x, size_t(2 * panels * (L.k / 4) * 8));
    float* s = grow(sc.lane_s, size_t(panels * nb * 8));
    pack_lanes8(in.xq, in.sx, M, L.k, nb, xs, xs + panels * (L.k / 4) * 8, s);
    p.lanes8 = LaneInputs8{xs, xs + panels * (L.k / 4) * 8, s};
  }
#endif
#if defined(GPTC_F512)
  if (in.xq == nullptr) {  // float inputs (float weights, or int ones dequantized)
    float* xp = grow(sc.xp, size_t((M + 1) * L.k));
    pack_pairs_f(in.x, M, L.k, xp);
    p.xp = xp;
  }
#if defined(GPTC_VNNI512)
  if (lanes_ok(L, in, M)) {
    const int P = lane_groups(M);
    const int64_t nb = L.k / L.blk;
    LaneInputs& li = p.lanes;
    int32_t* x = grow(sc.lane_x, size_t(L.k / 4 * 16 / P));
    float* s = grow(sc.lane_s, size_t(nb * 16));
    int32_t* st = grow(sc.lane_start, size_t(nb * 16));
    pack_lanes(in.xq, in.sx, M, L.k, nb, L.blk, L.bits == 4 ? 3 : 7, P, x, s, st);
    li.x = x, li.s = s, li.start = st, li.p = P;
  } else if (in.xq != nullptr) {
    uint8_t* xu = grow(sc.xu, size_t(M * L.k));
    pack_u8(in.xq, M, L.k, xu);
    p.xu = xu;
  }
#endif
#else
  (void)L, (void)in, (void)M, (void)sc;
#endif
  return p;
}

// Weight rows a block of the Linear holds (its outputs a work item computes).
inline int block_rows(const LinearWeights& L) { return L.grouped ? GROUP_ROWS : NBLK; }

// Output rows [n0, n0 + nr) (nr <= block_rows(L)) of y (M, ldy) = x @ W^T + bias for all M input rows,
// then the epilogue on each new value: activation `act` (>= 0), and + res (same layout as y;
// may be y itself: each value is read before it is written, by the thread that writes it).
void linear_block(const LinearWeights& L, const LinearInputs& in, const PackedInputs& pk_in, int64_t M, int64_t n0,
                  int nr, float* y, int64_t ldy, const float* res, int act, Scratch& sc) {
  const int64_t K = L.k;
  const float* bias = L.bias ? L.bias + n0 : nullptr;
  const int W = block_rows(L);  // the tile's row length
  float* t = grow(sc.tile, size_t(M * W));
  // M > 1: the next block's weights (this thread's next, but at the end of a grab of
  // linear_for's dynamic schedule) are prefetched by the AVX2 float and int8 4 x 3 tiles
  // (float_block, int_block; the AVX-512 and lane kernels prefetch rows of their own choosing,
  // the packed int4 tiles none); an int layer's next scales here (AVX2 builds).
  const char* pf = nullptr;
  int64_t pf_bytes = 0;
  if (M > 1 && !L.grouped && n0 + NBLK < L.n) {
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
  // Float rows against all M inputs (AVX-512 builds: the pair micro-kernel, bitwise float_block's values).
  auto floats = [&](const float* w) {
#if defined(GPTC_F512)
    float_block512(in.x, pk_in.xp, M, K, w, nr, t, NBLK, bias, grow(sc.facc, size_t((M + 1) / 2 * NBLK * 16)));
#else
    float_block(in.x, M, K, w, nr, t, NBLK, bias, pf, pf_bytes);
#endif
  };
  if (L.grouped) {
    grouped_block(L, GroupedInputs{in.xq, in.sx, pk_in.st}, M, n0, nr, t, W);
  } else if (L.bits == 32) {
    floats(L.wf + n0 * K);
  } else {
    const int8_t* q[NBLK];
    const float* sw[NBLK];
#if defined(GPTC_VNNI512)
    if (pk_in.lanes.x != nullptr) {  // few rows: the weight rows as stored (lane kernels)
      const int64_t row = L.bits == 4 ? K / 2 : K, nb = K / L.blk;
      for (int n = 0; n < nr; ++n) q[n] = L.wq + (n0 + n) * row, sw[n] = L.scale + (n0 + n) * nb;
      const LaneInputs& li = pk_in.lanes;
      if (li.p == 4)
        L.bits == 4 ? int_block_lanes<4, true>(li, M, nb, L.blk, q, sw, nr, row, t, NBLK, bias)
                    : int_block_lanes<4, false>(li, M, nb, L.blk, q, sw, nr, row, t, NBLK, bias);
      else if (li.p == 2)
        L.bits == 4 ? int_block_lanes<2, true>(li, M, nb, L.blk, q, sw, nr, row, t, NBLK, bias)
                    : int_block_lanes<2, false>(li, M, nb, L.blk, q, sw, nr, row, t, NBLK, bias);
      else
        L.bits == 4 ? int_block_lanes<1, true>(li, M, nb, L.blk, q, sw, nr, row, t, NBLK, bias)
                    : int_block_lanes<1, false>(li, M, nb, L.blk, q, sw, nr, row, t, NBLK, bias);
    } else
#endif
    {
    // AVX2 builds: whole panels of 8 rows (and a last one of 6 or 7) in the lane kernel, the rows
    // left (fewer than 6: most of a panel's lanes would idle) in the tiles.
    const LinearInputs* ip = &in;
    int64_t mr = M;
    float* tr = t;
#if !defined(GPTC_VNNI512) && defined(__AVX2__)
    LinearInputs rest = in;
    if (pk_in.lanes8.xs != nullptr) {
      const int64_t row = L.bits == 4 ? K / 2 : K, nb = K / L.blk;
      const int64_t done = M % 8 >= LANES8_MIN ? M : M / 8 * 8;
      for (int n = 0; n < nr; ++n) q[n] = L.wq + (n0 + n) * row, sw[n] = L.scale + (n0 + n) * nb;
      L.bits == 4 ? int_block_lanes8<true>(pk_in.lanes8, done, K, nb, L.blk, q, sw, nr, t, NBLK, bias)
                  : int_block_lanes8<false>(pk_in.lanes8, done, K, nb, L.blk, q, sw, nr, t, NBLK, bias);
      rest.x = in.x + done * K, rest.xq = in.xq + done * K, rest.sx = in.sx + done * nb;
      ip = &rest, mr = M - done, tr = t + done * NBLK;
    }
#endif
    if (mr > 0) {
    const bool packed = L.bits == 4 && ip->xq != nullptr && packed4_ok(mr, K, L.blk);
    int8_t* ibuf = L.bits == 4 && !packed ? grow(sc.ibuf, size_t(NBLK * K)) : nullptr;  // unpacked int4 rows
    for (int n = 0; n < nr; ++n) {
      q[n] = packed ? L.wq + (n0 + n) * (K / 2) : int_row(L, n0 + n, ibuf ? ibuf + n * K : nullptr);
      sw[n] = L.scale + (n0 + n) * (K / L.blk);
    }
    if (packed) {
      int_block<true>(ip->xq, ip->sx, mr, K, K / L.blk, L.blk, q, sw, nr, tr, NBLK, bias);
    } else if (ip->xq != nullptr) {
#if defined(GPTC_VNNI512)
      if (K % 4 == 0 && L.blk % 4 == 0) {  // whole 4-code groups (vpdpbusd's lanes)
        const int64_t nb = K / L.blk;
        const Packed512 pk{grow(sc.pk_codes, size_t(K * NBLK)), grow(sc.pk_start, size_t(nb * NBLK)),
                           grow(sc.pk_sw, size_t(nb * NBLK))};
        int_block512(ip->xq, ip->sx, mr, K, nb, L.blk, q, sw, nr, tr, NBLK, bias, pk, pk_in.xu);
      } else
#endif
      int_block(ip->xq, ip->sx, mr, K, K / L.blk, L.blk, q, sw, nr, tr, NBLK, bias, pf, pf_bytes);
    } else {
      float* wbuf = grow(sc.wbuf, size_t(NBLK * K));  // the fake-quant weight: codes * block scales
      for (int n = 0; n < nr; ++n)
        for (int64_t j = 0; j < K; ++j) wbuf[n * K + j] = float(q[n][j]) * sw[n][j / L.blk];
      floats(wbuf);
    }
    }
    }
  }
  // The activation elementwise: over the whole tile when its rows are contiguous (nr == NBLK; the
  // same values, a value's activation depending on it alone, without a padded tail per row).
  const bool whole = act >= 0 && nr == W;
  if (whole) activate(t, M * W, act);
#if defined(__AVX2__)
  if (nr == W) {  // whole rows: 8- and 4-lane moves (a memcpy call per row costs more than the copy)
    static_assert(NBLK % 4 == 0 && GROUP_ROWS % 8 == 0, "the row moves below are 8 and 4 values");
    for (int64_t m = 0; m < M; ++m) {
      const float* tm = t + m * W;
      float* ym = y + m * ldy + n0;
      const float* rm = res != nullptr ? res + m * ldy + n0 : nullptr;
      int j = 0;
      for (; j + 8 <= W; j += 8) {
        __m256 a = _mm256_loadu_ps(tm + j);
        if (rm != nullptr) a = _mm256_add_ps(_mm256_loadu_ps(rm + j), a);  // rm + tm, as below
        _mm256_storeu_ps(ym + j, a);
      }
      if (j < W) {
        __m128 b = _mm_loadu_ps(tm + j);
        if (rm != nullptr) b = _mm_add_ps(_mm_loadu_ps(rm + j), b);
        _mm_storeu_ps(ym + j, b);
      }
    }
    return;
  }
#endif
  for (int64_t m = 0; m < M; ++m) {
    float* tm = t + m * W;
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

// Input rows a pass over the weights serves when the inputs are float (AVX-512 builds): the
// rows' inputs and outputs stay in L2 while the weights stream past them (with every row at
// once, the inputs and outputs of a wide float Linear leave the L2 as the weights stream past).
// The int inputs are a quarter of the bytes: all rows at once.
inline int64_t panel_rows(const LinearWeights& L, const LinearInputs& in, int64_t M) {
#if defined(GPTC_F512)
  if (in.xq == nullptr) return std::min<int64_t>(M, 64);
#endif
  (void)L, (void)in;
  return M;
}

// Rows [m0, m0 + ...) of the inputs (an even m0: whole pairs of the packed floats).
inline LinearInputs rows_of(const LinearWeights& L, const LinearInputs& in, int64_t m0) {
  LinearInputs s = in;
  s.x = in.x + m0 * L.k;
  if (in.xq != nullptr) s.xq = in.xq + m0 * L.k, s.sx = in.sx + m0 * (L.k / L.blk);
  return s;
}
inline PackedInputs rows_of(const LinearWeights& L, const PackedInputs& p, int64_t m0) {
  PackedInputs s = p;  // the lane inputs: int inputs are one panel (m0 == 0)
  if (p.xp != nullptr) s.xp = p.xp + (m0 / 2) * (L.k / 8) * 16;
  if (p.xu != nullptr) s.xu = p.xu + m0 * L.k;
  if (p.st != nullptr) s.st = p.st + m0 * (L.k / L.blk);
  return s;
}

// The inputs as linear_rows reads them (none to pack for a GEMV): packed once for all the row
// ranges a thread computes of one Linear (pack_inputs' buffers are the thread's own).
inline PackedInputs rows_inputs(const LinearWeights& L, const LinearInputs& in, int64_t M, Scratch& sc) {
  return gemv_ok(L, in, M) ? PackedInputs{} : pack_inputs(L, in, M, sc);
}

// Rows [r0, r1) of the output in blocks of NBLK from r0, on the calling thread; pk: rows_inputs.
void linear_rows(const LinearWeights& L, const LinearInputs& in, const PackedInputs& pk, int64_t M, int64_t r0,
                 int64_t r1, float* y, int64_t ldy, const float* res, int act, Scratch& sc) {
  if (gemv_ok(L, in, M)) return gemv_rows(L, in, M, r0, r1, y, ldy, res, act, sc);
  const int64_t P = panel_rows(L, in, M);
  for (int64_t m0 = 0; m0 < M; m0 += P) {
    const LinearInputs ip = rows_of(L, in, m0);
    const PackedInputs pp = rows_of(L, pk, m0);
    const int64_t mp = std::min(P, M - m0);
    for (int64_t n0 = r0; n0 < r1; n0 += block_rows(L))
      linear_block(L, ip, pp, mp, n0, int(std::min<int64_t>(block_rows(L), r1 - n0)), y + m0 * ldy, ldy,
                   res ? res + m0 * ldy : nullptr, act, sc);
  }
}

// y (M, N) = epilogue(x (M, K) @ W^T + bias), the blocks shared out among the threads of the
// enclosing parallel region (orphaned worksharing loops, one per panel of input rows, then one
// barrier) as they come for them, `grain` consecutive blocks at a time (about 8 grabs a thread:
// a delayed thread's share goes to the others, as in gemv_for; the next-block prefetch misses
// only at a grab's end), or all on the calling thread outside one.
void linear_for(const LinearWeights& L, const LinearInputs& in, int64_t M, float* y, const float* res, int act) {
  if (gemv_ok(L, in, M)) return gemv_for(L, in, M, y, res, act);
  const int64_t W = block_rows(L), nblocks = (L.n + W - 1) / W;
  const int64_t grain = std::max<int64_t>(1, nblocks / (8 * omp_get_num_threads()));
  Scratch& sc = t_scratch;
  const PackedInputs pk = pack_inputs(L, in, M, sc);  // by every thread, for itself: no barrier
  const int64_t P = panel_rows(L, in, M);
  for (int64_t m0 = 0; m0 < M; m0 += P) {  // panels write their own rows: no barrier between them
    const LinearInputs ip = rows_of(L, in, m0);
    const PackedInputs pp = rows_of(L, pk, m0);
    const int64_t mp = std::min(P, M - m0);
    float* yp = y + m0 * L.n;
    const float* rp = res ? res + m0 * L.n : nullptr;
#pragma omp for schedule(dynamic, grain) nowait
    for (int64_t blk = 0; blk < nblocks; ++blk)
      linear_block(L, ip, pp, mp, blk * W, int(std::min<int64_t>(W, L.n - blk * W)), yp, L.n, rp, act, sc);
  }
#pragma omp barrier
}

}  // namespace

#endif  // GPTC_KERNELS_GPTC_LINEAR_H_
