// gpt-compress fused CPU operators for Paddle (custom ops, PD_BUILD_OP).
//
// One op makes a whole decode/prefill/scoring program (export/fused.py, kernel version 4):
//   gptc_generate(ids (B,T), mask (B,S+T), rows (n,), control, caches [k_0, v_0, ...], weights
//       [float32 blob, int8 blob, ...] + a layout attribute) -> logits (n,V), tokens: embed, every
//       block and the head in one call (gptc_decoder_stack.h); the new keys/values are written IN
//       PLACE into the preallocated caches (B,H,cap,D) at positions S..S+T-1 (S = mask columns - T):
//       no concat, no copy of the cache per step. Caches are float32 or bfloat16 (rounded to
//       nearest even as written: gptc_norm_attention.h).
// A second op serves evaluation: gptc_head_score (gptc_head_score.h), the LM head's log-probability
// of chosen labels. Programs of older kernel versions are not run: they are exported again.
// Tensor-parallel rank programs (gptc partition) hold gptc_tp_embed, then per block gptc_tp_attention
// and gptc_tp_mlp, then gptc_tp_head, with Paddle's mp_allreduce_sum between them (gptc_tp_ops.h).
//
// Every Linear weight is stored (N, K) (outputs x inputs, K contiguous) in one of the block
// formats of gptc_common.h (weight_format: the numbers, checked against export/fused.py's):
//   float32; int8 codes (N,K) with float scales (N,K/blk); int4 codes stored code+8, packed two
//   per byte (N,K/2): in each run of 32 inputs, byte j holds input j (low nibble) and input j+16
//   (high nibble), so one 16-byte load unpacks into 32 consecutive codes; scales (N,K/blk); int8
//   codes in row groups (int8 inputs only: gptc_grouped.h), the vpdpbusd operand as stored.
// Inputs of an int layer are float (act < 0: weights dequantized on the fly), int8 per token and
// block made on the fly (act == 0: scale max|x|/127, onnxruntime MatMulNBits accuracy_level=4
// and qat.quantize.fake_quant_dynamic) or int8 with one calibrated scale (act > 0: W8A8,
// weights per channel, blk == K). Integer dots accumulate in int32 per block, exactly.
// Threads: OpenMP inside each op, $GPTC_THREADS of them (else omp_get_max_threads()).
// The GIL: each computing op releases it while it runs (gptc_gil.h), so other Python threads of
// the process (a server's HTTP loop) run beside a program that Paddle's binding runs holding it.
// Matrix products run in blocks of weight rows (NBLK: 12 on AVX2, 48 on AVX-512), each read once
// for all M input rows (a GEMM for prefill and batches: 4x3 float and int8 tiles, 2x4 for packed
// int4 on AVX2; on AVX-512 the gptc_gemm512.h micro-kernels, vpdpbusd with VNNI; GEMV for M = 1;
// int8 weights in row groups: groups of 48 rows at every M, gptc_grouped.h).
// Batch invariant: an output's arithmetic never depends on M, the tile, the thread or the other
// rows, and attention runs over each row's unmasked keys in order, so a sequence's logits are
// bitwise the same alone, left-padded in a batch, prefilled at once or token by token
// (tests/test_fused.py). The AVX-512 micro-kernels keep each output's arithmetic (exact int32
// block dots, the 8-lane float order), so the native and avx2 builds ($GPTC_KERNEL_ISA) give
// bitwise the same values (tests/test_kernel_tiles.py); scalar code spells its fmas out
// (std::fma) rather than leave contraction to the compiler, whose vectorized loops differ by ISA.
// Vector paths need AVX2 (+FMA); VNNI dot products (256-bit in the GEMV and AVX2 tiles) compile
// in where the build's -march has them.
//
// The unit is split by concern into headers included here in order (one translation unit, so
// the hot templates and inline functions stay inlinable across them); the loader
// (kernels/__init__.py SOURCES) hashes and snapshots every one of them.
#include "gptc_common.h"
#include "gptc_gil.h"
#include "gptc_tiles.h"
#include "gptc_gemm512.h"
#include "gptc_inputs.h"
#include "gptc_gemv.h"
#include "gptc_grouped.h"
#include "gptc_linear.h"
#include "gptc_norm_attention.h"
#include "gptc_decoder_ops.h"
#include "gptc_decoder_stack.h"
#include "gptc_head_score.h"
#include "gptc_tp_ops.h"
#include "gptc_bench.h"
