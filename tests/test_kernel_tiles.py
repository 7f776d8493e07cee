"""The matrix kernels of the fused ops (kernels/gptc_tiles.h: the GEMM micro-kernels and tiles, their
row and column remainders, K tails) against their one-row paths, run through gptc_generate on
random weights of odd sizes: an output's arithmetic must not depend on M, so a left-padded batch
prefilled at once (on 2 threads), each row prefilled alone and each row fed token by token give
bitwise the same layer outputs, and a head's logits are bitwise the same for one row or many.
A layer case is a one-block program whose embedding table holds the inputs x (one row per
position, no position embedding) and whose head is the identity, so its logits are the final
layer norm of the block's outputs; a head case is a program of no block, so the head reads the
layer norm of x itself. The rows alone are
M = 2, 7, 8, 17 (and 64 rows of a head), every case has N not a multiple of the micro-kernels'
column tiles, and the float cases K tails. The attention cases run rows of up to 130 tokens,
whose prompt queries attend in groups (kernels/gptc_norm_attention.h: attend_rows).

Every case also runs under the other instruction-set build (``GPTC_KERNEL_ISA``, kernels/__init__.py)
in a subprocess: on a host whose native build has wider paths (AVX-512, VNNI) than the avx2 build,
the two builds' outputs are compared (see test_the_avx2_and_native_builds_agree).

The op library is the one tests/test_fused.py builds (cached per machine, source and ISA)."""
import json

import numpy as np
import pytest

from _kernel_helpers import build_pair, compare_builds, other_build_outputs, threads
from gpt_compress.export.fused import FusedLM, pack_int4

HEADS, EPS, GELU_NEW = 2, 1e-5, 2
# rows of the batch (left-padded to 17): M = 85, and 17, 11, 8, 7, 2 alone; 11 and 23 leave 11 rows
# after the AVX-512 float kernel's 12-row tiles (its widest remainder: 6 pairs, the last half empty)
LENGTHS = (17, 11, 8, 7, 2)
HEAD_ROWS = 64           # a head's rows at once (then 23, 17, 13, 11, 8, 7, 6, 5, 3, 2 of them, and each alone)

# name -> (bits, hidden c, head dim d, FFN width f, act)
LAYERS = {
    # float: K = 44, 24, 52 end in a tail of 4; N = 72, 44, 52 are no multiple of the column tiles
    "fp32": (32, 44, 12, 52, -1.0),
    # int8 codes, int8 inputs made per token and block of 32; the FFN's N = 160, qkv's 96
    "int8": (8, 64, 16, 160, 0.0),
    # int4: 2 rows read the packed codes, more unpack them first
    "int4": (4, 64, 16, 160, 0.0),
    # int8 codes against float inputs (dequantized weight tiles: float arithmetic)
    "int8_float_inputs": (8, 64, 16, 96, -1.0),
    # W8A8: one calibrated input scale, weights per channel (blocks of 64, 32, 160 codes)
    "w8a8": (8, 64, 16, 160, 0.05),
    # W8A8 of odd widths: head dim 20, so a head's qkv rows (60) start inside the row groups of
    # 48 (gptc_grouped.h); N = 120, 100 and K = 40, 100 (blocks of whole 4-code steps only)
    "w8a8_odd": (8, 64, 20, 100, 0.05),
    # long rows (LONG_LENGTHS) for the attention of queries in groups (kernels/gptc_norm_attention.h:
    # attend_rows): head dims 64 and 24 (the value sums' last sweep of fewer chunks), float32 and
    # bfloat16 caches
    "attention_d64": (32, 128, 64, 64, -1.0),
    "attention_d24": (32, 48, 24, 64, -1.0),
    "attention_d64_bf16": (32, 128, 64, 64, -1.0),
}
# The queries of one segment length m = ceil(n / 8) are attended together: 130 and 72 end in a
# group of fewer than 8, 64 ends one, 57 starts one; from m = 8 on (n >= 57) a group has passes in
# which every query has all 8 lanes, and each group's last 7 passes have lanes past some query's keys.
LONG_LENGTHS = (130, 72, 64, 57, 9)
ROW_LENGTHS = {name: LONG_LENGTHS for name in LAYERS if name.startswith("attention")}
BF16_CACHE = ("attention_d64_bf16",)
# name -> (bits, K): K = 640 runs the AVX-512 tiles' k range in two chunks (gptc_gemm512.h: 512 codes
# or floats a chunk); K = 4096 (int8) and 8192 (int4) put the weight rows 4 KB apart, which the
# few-row lane kernels take in tiles of 6 rows instead of 12 (gptc_gemm512.h: int_block_lanes)
HEADS_BITS = {"head_fp32": (32, 96), "head_int8": (8, 96), "head_int4": (4, 96), "head_fp32_long_k": (32, 640),
              "head_int8_long_k": (8, 640), "head_int4_long_k": (4, 640), "head_int8_4k_rows": (8, 4096),
              "head_int4_4k_rows": (4, 8192)}
FLOAT_CASES = ("fp32", "int8_float_inputs", "head_fp32", "head_fp32_long_k", "attention_d64", "attention_d24",
               "attention_d64_bf16")  # float dot products (the rest: exact int32 dots)
# int8 weights against int8 inputs are stored in row groups (export/fused.py's group_rows); each
# such case also runs with them row-major (name + ROWS: the lane, block and GEMV kernels)
ROWS = "__rows"
GROUPED_CASES = ("int8", "w8a8", "w8a8_odd", "head_int8", "head_int8_long_k", "head_int8_4k_rows")


def _block(rng, c: int, d: int, f: int, bits: int, act: float) -> dict:
    """One block's weights (``export/fused.py``'s layer spec) for hidden size c, head dim d, FFN
    width f (int weights: scales per block of 32, or per output channel: one block of K, W8A8's)."""
    inner = HEADS * d

    def vec(n, scale=0.1, shift=0.0):
        return (shift + scale * rng.standard_normal(n)).astype(np.float32)

    def linear(n, k):
        if bits == 32:
            w, s = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32), None
        else:
            top = 7 if bits == 4 else 127
            codes = rng.integers(-top, top + 1, (n, k))  # symmetric abs-max codes (qat.quantize)
            s = (rng.uniform(0.5, 1.5, (n, 1 if act > 0 else k // 32)) / (top * np.sqrt(k))).astype(np.float32)
            w = pack_int4(codes) if bits == 4 else codes.astype(np.int8)
        return {"w": w, "s": s, "b": vec(n), "bits": bits, "act": act}

    ln_1 = (vec(c, shift=1.0), vec(c))
    qkv, out = linear(3 * inner, c), linear(c, inner)
    ln_2 = (vec(c, shift=1.0), vec(c))
    return {"heads": HEADS, "ln_1": ln_1, "ln_2": ln_2, "linears": [qkv, out, linear(f, c), linear(c, f)]}


def _program(ops, table: np.ndarray, blocks: list, head: dict, positions: int, group_int8: bool = True):
    """A fused program (``FusedLM``) whose token embeddings are the rows of ``table`` (C columns),
    with a zero position embedding of ``positions`` rows, the final layer norm of unit gain and
    no bias, and ``head`` (a ``fused_weights`` head spec); ``group_int8``: ``FusedLM``'s."""
    c = table.shape[1]

    def table_spec(w):
        return lambda: {"w": w, "s": None, "bits": 32}

    weights = {"wte": table_spec(table.astype(np.float32)), "wpe": table_spec(np.zeros((positions, c), np.float32)),
               "layers": iter(blocks), "head": lambda wte_bits: {"tied": False, **head},
               "ln_f": (np.ones(c, np.float32), np.zeros(c, np.float32)), "eps": EPS, "activation": GELU_NEW,
               "config": None}
    return FusedLM(weights, ops=ops, group_int8=group_int8)


def _run(program, ids, mask, rows, caches) -> np.ndarray:
    """The program's logits (n, V) at the flat ``rows`` of ``ids`` (B, T) with the full ``mask``."""
    import paddle

    return program(paddle.to_tensor(np.asarray(ids, np.int64)), paddle.to_tensor(np.asarray(mask, np.int64)),
                   paddle.to_tensor(np.asarray(rows, np.int64)), caches).numpy()


def assert_layer_case(ops, name: str) -> np.ndarray:
    """The batch's layer outputs, seen through the final layer norm (B, T, C), of case ``name``,
    after asserting each row's are bitwise the same prefilled alone and token by token."""
    import paddle

    grouped = not name.endswith(ROWS)
    name = name.removesuffix(ROWS)
    bits, c, d, f, act = LAYERS[name]
    lengths = ROW_LENGTHS.get(name, LENGTHS)
    rng = np.random.default_rng(bits + c + f)
    block = _block(rng, c, d, f, bits, act)
    t = max(lengths)
    x = rng.standard_normal((len(lengths), t, c)).astype(np.float32)
    ids = np.arange(x.shape[0] * t).reshape(x.shape[0], t)  # position (b, t) embeds as x[b, t]
    program = _program(ops, x.reshape(-1, c), [block], {"w": np.eye(c, dtype=np.float32), "s": None,
                                                        "bits": 32, "act": -1.0}, t, grouped)
    mask = np.zeros((len(lengths), t), np.int64)
    for i, n in enumerate(lengths):
        mask[i, t - n:] = 1
    dtype = "bfloat16" if name in BF16_CACHE else "float32"

    def cache(b, n):
        return [paddle.zeros([b, HEADS, n, d], dtype), paddle.zeros([b, HEADS, n, d], dtype)]

    with threads(2):
        batch = _run(program, ids, mask, np.arange(ids.size), cache(len(lengths), t)).reshape(len(lengths), t, c)
    with threads(1):
        for i, n in enumerate(lengths):
            row = ids[i:i + 1, t - n:]
            alone = _run(program, row, np.ones((1, n), np.int64), np.arange(n), cache(1, n))
            assert np.array_equal(alone, batch[i, t - n:]), f"{name} row {i}: alone vs in the batch"
            # Token by token: each step a one-row call (its keys/values from the earlier steps' cache).
            kv = cache(1, n)
            for j in range(n):
                step = _run(program, row[:, j:j + 1], np.ones((1, j + 1), np.int64), [0], kv)[0]
                assert np.array_equal(step, alone[j]), f"{name} row {i}, token {j}: one-row step vs prefill"
    assert np.isfinite(batch).all() and np.abs(batch).max() > 0.1  # a real output, not zeros
    return batch


def assert_head_case(ops, name: str) -> np.ndarray:
    """The head's logits of 64 rows at once (V = 101: no multiple of any column tile, and the
    one-row GEMV's passes of 4 rows leave one alone; K = 96: int4 reads two 32-code steps a load,
    then one; K = 640: the AVX-512 int tiles run the blocks in two chunks), after asserting that
    23, 17, 13, 11, 8, 7, 6, 5, 3 and 2 of the rows and each row alone give bitwise the same
    logits, and that they are near the float64 product of the dequantized weights."""

    grouped = not name.endswith(ROWS)
    name = name.removesuffix(ROWS)
    bits, c = HEADS_BITS[name]
    rng = np.random.default_rng(bits + c)
    v = 101
    if bits == 32:
        wf = (rng.standard_normal((v, c)) / np.sqrt(c)).astype(np.float32)
        w, scales, deq = wf, np.zeros([1], np.float32), wf.astype(np.float64)
    else:
        top = 7 if bits == 4 else 127
        codes = rng.integers(-top, top + 1, (v, c))
        scales = (rng.uniform(0.5, 1.5, (v, c // 32)) / top).astype(np.float32)
        w = pack_int4(codes) if bits == 4 else codes.astype(np.int8)
        deq = (codes * np.repeat(scales, 32, axis=1)).astype(np.float64)
    x = rng.standard_normal((1, HEAD_ROWS, c)).astype(np.float32)
    program = _program(ops, x[0], [], {"w": w, "s": scales if bits < 32 else None, "bits": bits,
                                       "act": 0.0 if bits < 32 else -1.0}, HEAD_ROWS, grouped)
    ids, mask = np.arange(HEAD_ROWS)[None], np.ones((1, HEAD_ROWS), np.int64)  # position t embeds as x[0, t]

    def head(r):
        return _run(program, ids, mask, r, [])

    with threads(2):
        many = head(range(HEAD_ROWS))
        for m in (23, 17, 13, 11, 8, 7, 6, 5, 3, 2):  # 13, 6: panels of 5 and 6 rows (grouped int8); 8..2: the
            # float GEMV's groups of 4 (AVX-512) or 2 input rows and their tails of 1 to 3
            rows = list(range(HEAD_ROWS - m, HEAD_ROWS))  # the last m rows: other offsets than the batch's
            assert np.array_equal(head(rows), many[rows]), f"{name}: {m} rows vs {HEAD_ROWS}"
        for i in range(HEAD_ROWS):
            assert np.array_equal(head([i])[0], many[i]), f"{name} row {i}: alone vs with the others"
    x64 = x[0].astype(np.float64)
    h = (x64 - x64.mean(-1, keepdims=True)) / np.sqrt(x64.var(-1, keepdims=True) + EPS)
    ref = h @ deq.T
    err, bound = np.abs(many - ref), head_error_bound(x64, h, deq, bits)
    assert (err <= bound).all(), f"{name}: |logit - float64| {err.max():.3g}, {np.max(err / bound):.3g} x its bound"
    return many


U = 2.0 ** -24  # float32 unit roundoff


def _gamma(n: int) -> float:
    """Higham's gamma_n = n u / (1 - n u): the relative error bound of n float32 roundings."""
    return n * U / (1 - n * U)


def head_error_bound(x, h, deq, bits: int) -> np.ndarray:
    """Per logit (rows, V), the most the head's logits can differ from the float64 product of the
    layer-normed rows ``h`` (of inputs ``x`` (rows, K), unit gain, no bias) and the dequantized
    weights ``deq`` (V, K), from the arithmetic alone:

    * the float32 layer norm: the mean and the variance are K-term sums, so each output is off
      by at most gamma_(2K + 8) (|x - mean| + mean|x|) / sigma (a few operations more per element);
    * float weights: a K-term float32 dot, gamma_K sum |h||w|;
    * int weights: each input is rounded to an int8 code of its block of 32 (scale s = max|h| / 127
      of the block), at most s / 2 off, then exact int32 dots, each times its scale product
      (2 roundings), added in block order (K / 32 roundings): gamma_(K / 32 + 2) sum |h||w|.

    A wrong scale, a lost block or a stale row is off by far more (a 1.01 scale on one block of
    64-row heads: about 0.5 x |that block's dot| / (its rounding bound), well above 1)."""
    k = x.shape[-1]
    sigma = np.sqrt(x.var(-1, keepdims=True) + EPS)
    dh = _gamma(2 * k + 8) * (np.abs(x - x.mean(-1, keepdims=True)) + np.abs(x).mean(-1, keepdims=True)) / sigma
    aw = np.abs(deq).T  # (K, V)
    if bits == 32:
        return _gamma(k) * (np.abs(h) @ aw) + dh @ aw
    s = np.repeat(np.abs(h).reshape(len(h), -1, 32).max(-1) / 127, 32, axis=1)  # each input's block scale
    return (s / 2 + dh) @ aw + _gamma(k // 32 + 2) * ((np.abs(h) + s / 2 + dh) @ aw)


def case(ops, name: str) -> np.ndarray:
    return assert_layer_case(ops, name) if name.removesuffix(ROWS) in LAYERS else assert_head_case(ops, name)


CASES = tuple(LAYERS) + tuple(HEADS_BITS) + tuple(n + ROWS for n in GROUPED_CASES)


@pytest.mark.parametrize("name", tuple(LAYERS) + tuple(n + ROWS for n in GROUPED_CASES if n in LAYERS))
def test_a_tokens_layer_output_is_bitwise_the_same_in_any_tile(name):
    from gpt_compress.kernels import load_ops

    assert_layer_case(load_ops(), name)


def test_attention_over_a_mask_with_holes_is_bitwise_the_same_prefilled_and_token_by_token():
    """A row whose mask has holes (masked columns between attended ones): consecutive queries
    then share a key count, and a group of one segment length holds equal ones. Prefilled at once
    (the queries in groups) and fed token by token (each query alone), every position's layer
    output is bitwise the same; the masked columns' keys are never read (NaN there changes nothing)."""
    import paddle
    from gpt_compress.kernels import load_ops

    bits, c, d, f, act = LAYERS["attention_d64"]
    rng = np.random.default_rng(7)
    t = 90
    x = rng.standard_normal((t, c)).astype(np.float32)
    holes = [3, 4, 5, 40, 41, 63, 64, 65, 66, 67, 68, 69, 70, 71, 89]
    x[holes] = np.nan  # a masked column's key and value: NaN (kept out of every sum)
    program = _program(load_ops(), x, [_block(rng, c, d, f, bits, act)],
                       {"w": np.eye(c, dtype=np.float32), "s": None, "bits": 32, "act": -1.0}, t)
    ids, mask = np.arange(t)[None], np.ones((1, t), np.int64)
    mask[0, holes] = 0

    def cache():
        return [paddle.zeros([1, HEADS, t, d]), paddle.zeros([1, HEADS, t, d])]

    kept = np.flatnonzero(mask[0])
    with threads(2):
        at_once = _run(program, ids, mask, kept, cache())
    with threads(1):
        kv = cache()
        steps = [_run(program, ids[:, j:j + 1], mask[:, :j + 1], [0], kv)[0] for j in range(t)]
    assert np.array_equal(np.stack(steps)[kept], at_once)
    assert np.isfinite(at_once).all() and np.abs(at_once).max() > 0.1


@pytest.mark.parametrize("name", tuple(HEADS_BITS) + tuple(n + ROWS for n in GROUPED_CASES if n in HEADS_BITS))
def test_a_heads_logits_are_bitwise_the_same_for_one_row_or_many(name):
    from gpt_compress.kernels import load_ops

    assert_head_case(load_ops(), name)


@pytest.mark.parametrize("name", GROUPED_CASES)
def test_int8_weights_in_row_groups_give_the_row_major_values(name):
    """The grouped kernels (every M, N tails, row ranges starting inside a group) against the
    row-major int8 ones on the same weights and inputs: bitwise equal outputs."""
    from gpt_compress.export.fused import WEIGHT_FORMAT
    from gpt_compress.kernels import load_ops

    ops, rng, grouped = load_ops(), np.random.default_rng(0), WEIGHT_FORMAT["kInt8Grouped"]
    if name in LAYERS:  # the case's weights are stored grouped, and row-major with group_int8=False
        bits, c, d, f, act = LAYERS[name]
        blocks, head = [_block(rng, c, d, f, bits, act)], {"w": np.eye(c, dtype=np.float32), "s": None, "bits": 32,
                                                           "act": -1.0}
        codes = [p.layer_attrs[0][3] for p in (_program(ops, np.eye(c), blocks, head, 1, g) for g in (True, False))]
        assert codes == [[grouped] * 4, [8] * 4], codes
    else:
        c = HEADS_BITS[name][1]
        head = {"w": np.ones((3, c), np.int8), "s": np.ones((3, c // 32), np.float32), "bits": 8, "act": 0.0}
        codes = [_program(ops, np.eye(c), [], head, 1, g).head_code for g in (True, False)]
        assert codes == [grouped, 8], codes
    assert np.array_equal(case(ops, name), case(ops, name + ROWS))


# Run in a subprocess under the other ISA: every case (its invariance assertions included), the
# outputs saved to argv[1] (.npz), the build's vector paths printed as JSON.
OTHER_BUILD = r"""
import json, sys
import numpy as np
sys.path.insert(0, sys.argv[2])
import test_kernel_tiles as t
from gpt_compress import kernels
ops = kernels.load_ops()
np.savez(sys.argv[1], **{name: t.case(ops, name) for name in t.CASES})
print(json.dumps({"isa": kernels.isa(), "macros": kernels.isa_macros(), "library": kernels.library_path()}))
"""


def test_the_avx2_and_native_builds_agree(tmp_path, capsys):
    """On a host whose native build has AVX-512 or VNNI paths, every case above runs under both
    builds (this process's and, in a subprocess, the other), each asserting its own invariance,
    and the outputs are bitwise equal across the builds. Prints both builds' paths and figures."""
    from gpt_compress import kernels

    this, other, macros = build_pair()
    ops = kernels.load_ops()
    ours = {name: case(ops, name) for name in CASES}
    theirs, info = other_build_outputs(tmp_path, other, OTHER_BUILD)
    figures = compare_builds(ours, theirs, FLOAT_CASES)
    with capsys.disabled():
        print(f"\nbuilds: {this} {json.dumps({k for k, v in macros[this].items() if v}, default=sorted)}, "
              f"{other} {json.dumps({k for k, v in info['macros'].items() if v}, default=sorted)}")
        for name, fig in figures.items():
            print(f"  {name:18s} {fig['kind']:5s} max|y| {fig['max_abs']:.4g}  max rel diff {fig['max_rel_diff']:.3g}"
                  f"  bitwise {fig['bitwise']}")
    assert all(f["bitwise"] for f in figures.values()), figures


def test_the_baseline_build_keeps_the_contracts_on_its_scalar_paths(tmp_path):
    """The scalar paths (what a CPU without AVX2 runs; GPTC_KERNEL_ISA=baseline builds them on any
    x86-64 host): every case above, in a subprocess, asserts its own invariance (rows alone, in a
    batch and token by token; a head's rows one or many) and the heads their float64 bound, and the
    integer heads' logits are bitwise this build's: exact int32 dots per block, one fma per block
    in block order, on every path. (Float sums and attention run in another order there.)"""
    from gpt_compress import kernels

    if kernels.isa() == "baseline":
        pytest.skip("this process runs the baseline build itself")
    ops = kernels.load_ops()
    theirs, info = other_build_outputs(tmp_path, "baseline", OTHER_BUILD)
    assert info["isa"] == "baseline" and not any(info["macros"].values()), info["macros"]
    ints = [n for n in CASES if n.startswith("head_") and n.removesuffix(ROWS) not in FLOAT_CASES]
    assert len(ints) == 9, ints  # int8 and int4, 3 widths each; the int8 ones row-major too
    for name in ints:
        assert np.array_equal(case(ops, name), theirs[name]), f"{name}: baseline build vs this one"
    assert set(theirs) == set(CASES)
