"""The GEMM tiles of the fused layer op (kernels/gptc_tiles.h: 4x3 float and int8 tiles with their
2- and 1-row remainders, weight blocks of 12 rows and their partial last block, K tails) against
its one-row path, called directly on random weights of odd sizes: an output's arithmetic must not
depend on M, so a left-padded batch prefilled at once (on 2 threads), each row prefilled alone
and each row fed token by token give bitwise the same layer outputs.

The op library is the one tests/test_fused.py builds (cached per machine and source)."""
import numpy as np
import paddle
import pytest

from gpt_compress.export.fused import pack_int4

HEADS, EPS, GELU_NEW = 2, 1e-5, 2
LENGTHS = (7, 5, 2)  # rows of the batch (left-padded to 7): M = 21, and 7, 5, 2 alone


def _weights(rng, c: int, d: int, f: int, bits: int, channel: bool = False) -> list:
    """The 16 weight inputs of gptc_layer for hidden size c, head dim d, FFN width f (int weights:
    scales per block of 32, or per output channel: one block of K, W8A8's)."""
    inner = HEADS * d

    def vec(n, scale=0.1, shift=0.0):
        return paddle.to_tensor((shift + scale * rng.standard_normal(n)).astype(np.float32))

    def linear(n, k):
        if bits == 32:
            w, s = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32), np.zeros([1], np.float32)
        else:
            top = 7 if bits == 4 else 127
            codes = rng.integers(-top, top + 1, (n, k))  # symmetric abs-max codes (qat.quantize)
            s = (rng.uniform(0.5, 1.5, (n, 1 if channel else k // 32)) / (top * np.sqrt(k))).astype(np.float32)
            w = pack_int4(codes) if bits == 4 else codes.astype(np.int8)
        return [paddle.to_tensor(w), paddle.to_tensor(s), vec(n)]

    return ([vec(c, shift=1.0), vec(c)] + linear(3 * inner, c) + linear(c, inner)
            + [vec(c, shift=1.0), vec(c)] + linear(f, c) + linear(c, f))


def _layer(ops, weights, x, mask, d, bits, act):
    """gptc_layer on x (B, T, C) with the full mask (B, L): outputs (B, T, C); fresh caches."""
    b, t, _ = x.shape
    kc = paddle.zeros([b, HEADS, mask.shape[1], d])
    vc = paddle.zeros([b, HEADS, mask.shape[1], d])
    out = ops.gptc_layer(paddle.to_tensor(x), paddle.to_tensor(mask), kc, vc, *weights, HEADS, EPS, GELU_NEW,
                         [bits] * 4, [act] * 4)
    return (out[0] if isinstance(out, (list, tuple)) else out).numpy()


@pytest.mark.parametrize("bits,c,d,f,act", [
    (32, 44, 12, 52, -1.0),  # float: K = 44, 24, 52 end in a tail of 4; out's N = 44 a partial block
    (8, 64, 16, 96, 0.0),    # int8 codes, int8 inputs made per token and block of 32
    (4, 64, 16, 96, 0.0),    # int4: 2 rows read the packed codes, more unpack them first
    (8, 64, 16, 96, -1.0),   # int8 codes against float inputs (dequantized weight tiles)
    (8, 64, 16, 96, 0.05),   # W8A8: one calibrated input scale, weights per channel (blocks of 64, 32, 96 codes)
])
def test_a_tokens_layer_output_is_bitwise_the_same_in_any_tile(monkeypatch, bits, c, d, f, act):
    from gpt_compress.kernels import load_ops

    ops = load_ops()
    rng = np.random.default_rng(bits + c)
    weights = _weights(rng, c, d, f, bits, channel=act > 0)
    t = max(LENGTHS)
    x = rng.standard_normal((len(LENGTHS), t, c)).astype(np.float32)
    mask = np.zeros((len(LENGTHS), t), np.int64)
    for i, n in enumerate(LENGTHS):
        mask[i, t - n:] = 1
    monkeypatch.setenv("GPTC_THREADS", "2")
    batch = _layer(ops, weights, x, mask, d, bits, act)
    monkeypatch.setenv("GPTC_THREADS", "1")
    for i, n in enumerate(LENGTHS):
        row = x[i:i + 1, t - n:]
        alone = _layer(ops, weights, row, np.ones((1, n), np.int64), d, bits, act)[0]
        assert np.array_equal(alone, batch[i, t - n:]), f"row {i}: alone vs in the batch"
        # Token by token: each step a one-row call (its keys/values from the earlier steps' cache).
        kc, vc = paddle.zeros([1, HEADS, n, d]), paddle.zeros([1, HEADS, n, d])
        for j in range(n):
            out = ops.gptc_layer(paddle.to_tensor(row[:, j:j + 1]), paddle.to_tensor(np.ones((1, j + 1), np.int64)),
                                 kc, vc, *weights, HEADS, EPS, GELU_NEW, [bits] * 4, [act] * 4)
            step = (out[0] if isinstance(out, (list, tuple)) else out).numpy()[0, 0]
            assert np.array_equal(step, alone[j]), f"row {i}, token {j}: one-row step vs prefill"
    assert np.isfinite(batch).all() and np.abs(batch).max() > 0.1  # a real output, not zeros


@pytest.mark.parametrize("bits", [8, 4])
def test_an_int_heads_logits_are_bitwise_the_same_for_one_row_or_many(monkeypatch, bits):
    """gptc_head, int8/int4 codes with an odd vocabulary (V = 101: the one-row GEMV's passes of 4
    rows leave one alone) and K = 96 (int4 reads two 32-code steps a load, then one): every row's
    logits alone (the GEMV) and nine rows at once (the tiles) are bitwise equal, and near the
    float64 product of the dequantized weights."""
    from gpt_compress.kernels import load_ops

    ops = load_ops()
    rng = np.random.default_rng(bits)
    v, c, rows = 101, 96, 9
    top = 7 if bits == 4 else 127
    codes = rng.integers(-top, top + 1, (v, c))
    scales = (rng.uniform(0.5, 1.5, (v, c // 32)) / top).astype(np.float32)
    w = paddle.to_tensor(pack_int4(codes) if bits == 4 else codes.astype(np.int8))
    x = rng.standard_normal((1, rows, c)).astype(np.float32)
    ln = [paddle.ones([c]), paddle.zeros([c])]

    def head(r):
        out = ops.gptc_head(paddle.to_tensor(x), paddle.to_tensor(np.asarray(r, np.int64)), *ln, w,
                            paddle.to_tensor(scales), EPS, bits, 0.0)
        return (out[0] if isinstance(out, (list, tuple)) else out).numpy()

    monkeypatch.setenv("GPTC_THREADS", "2")
    many = head(range(rows))
    for i in range(rows):
        assert np.array_equal(head([i])[0], many[i]), f"row {i}: alone vs with the others"
    h = (x[0] - x[0].mean(-1, keepdims=True)) / np.sqrt(x[0].var(-1, keepdims=True) + EPS)
    ref = h.astype(np.float64) @ (codes * np.repeat(scales, 32, axis=1)).T.astype(np.float64)
    assert np.abs(many - ref).max() < 0.02 * np.abs(ref).max()  # int8 inputs: ~1% of the largest logit
