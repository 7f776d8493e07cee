"""Shared by the parity tests (test_export.py, test_fused.py, test_quant.py, test_distill.py): the
prompts, a backend proxy that records every step's logits, calibration batches, and the bound
of one int8 input code of the LM head rounding the other way."""
from __future__ import annotations

import numpy as np

from gpt_compress.inference.base import Backend

PROMPTS = ["First Citizen:\nBefore we proceed any further, hear me speak.",
           "ROMEO:\nBut, soft!", "To be, or not to be"]


class Recorder(Backend):
    """A backend proxy that keeps the logits of every prefill/decode step.

    With ``greedy`` and a backend that makes the argmax itself (overrides ``decode_greedy``, the
    fast path greedy generation takes), its ``decode_greedy`` is checked too: each such step runs
    the backend's ``decode`` on a copy of the cache for its logits (recorded), then
    ``decode_greedy`` on the cache itself, and counts the steps whose token is not the argmax of
    those logits in ``greedy_mismatches`` (``greedy_calls`` counts the calls). Otherwise the
    backend is driven through ``decode`` alone (the logits path: ``Backend.decode_greedy``)."""

    def __init__(self, backend, greedy: bool = True):
        self.backend, self.logits = backend, []
        self.greedy_calls = self.greedy_mismatches = 0
        if greedy and type(backend).decode_greedy is not Backend.decode_greedy:
            self.decode_greedy = self._decode_greedy

    def prefill(self, ids, mask):
        logits, cache = self.backend.prefill(ids, mask)
        self.logits.append(logits)
        return logits, cache

    def decode(self, ids, mask, cache):
        logits, cache = self.backend.decode(ids, mask, cache)
        self.logits.append(logits)
        return logits, cache

    def _decode_greedy(self, ids, mask, cache):
        twin = self.backend.reorder_cache(cache, np.arange(ids.shape[0]))
        logits, _ = self.backend.decode(ids, mask, twin)
        self.logits.append(logits)
        tokens, cache = self.backend.decode_greedy(ids, mask, cache)
        self.greedy_calls += 1
        self.greedy_mismatches += int(np.sum(tokens != np.argmax(logits, axis=-1)))
        return tokens, cache

    def reorder_cache(self, cache, rows):
        return self.backend.reorder_cache(cache, rows)

    def truncate_cache(self, cache, length):
        return self.backend.truncate_cache(cache, length)

    def score(self, ids, mask=None):
        return self.backend.score(ids, mask)


def left_padded(tokenizer, prompts):
    """``prompts`` encoded and left-padded: ids (B, T) int64 and mask (B, T) int64."""
    rows = [tokenizer.encode(p) for p in prompts]
    width = max(map(len, rows))
    ids, mask = np.zeros((len(rows), width), np.int64), np.zeros((len(rows), width), np.int64)
    for i, r in enumerate(rows):
        ids[i, width - len(r):], mask[i, width - len(r):] = r, 1
    return ids, mask


def calib_batches(prefix, n, seq=64, batch=8, seed=0):
    """``n`` batches of ``batch`` random ``seq``-token windows of the indexed dataset ``prefix``."""
    from gpt_compress.data.indexed import open_dataset

    data = open_dataset(prefix)
    tokens = np.concatenate([np.asarray(data[i], dtype=np.int64) for i in range(len(data))])
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        starts = rng.integers(0, len(tokens) - seq - 1, batch)
        chunk = np.stack([tokens[s:s + seq + 1] for s in starts])
        out.append({"input_ids": chunk[:, :-1], "labels": chunk[:, 1:]})
    return out


def lm_head_flip_bound(model) -> float:
    """The largest change of any logit when one int8 input code of the LM head lands on the
    other side of a rounding boundary: one quantization step ``s = max|h| / 127`` of the
    final-norm output ``h`` (bounded by ``|gamma| sqrt(H - 1) + |beta|`` per element: a layer
    norm's output has at most sqrt(H - 1) in one feature), times the largest LM-head weight.

    A runtime that sums in another order than the reference sees activations a few float32 ulps
    away from the reference's; a value within those ulps of a rounding boundary (x / s at k + 0.5)
    rounds the other way, so its code, and the logits through it, move by one step."""
    g = model.gpt.ln_f
    gamma, beta = np.abs(g.weight.numpy()), np.abs(g.bias.numpy())
    h_max = float(np.max(gamma * np.sqrt(len(gamma) - 1) + beta))
    head = model.gpt.wte.weight if model.config.tie_word_embeddings else model.lm_head.weight
    w_max = float(np.max(np.abs(head.numpy())))
    return (h_max / 127) * w_max


BACKENDS = ("dygraph", "paddle", "onnx")


def assert_step_parity(gens, atol):
    """``gens`` {backend name: Generator over a ``Recorder``} after the same generation: every
    step's logits of "paddle" and "onnx" within ``atol`` of "dygraph"'s, and every greedy fast
    path step's token the argmax of its logits."""
    ref = gens["dygraph"].backend.logits
    for b in ("paddle", "onnx"):
        got = gens[b].backend
        assert len(got.logits) == len(ref)
        diffs = [float(np.max(np.abs(a - r))) for a, r in zip(got.logits, ref)]
        assert max(diffs) < atol, f"{b}: per-step max abs diff {max(diffs):.3g} (step {int(np.argmax(diffs))})"
        assert got.greedy_mismatches == 0, (b, got.greedy_mismatches, got.greedy_calls)


# An int8 program vs its fake-quant dygraph model, in absolute logits: float32 noise (the same
# math summed in another order: LOGIT_ATOL of the float programs) plus INT8_FLIPS input codes
# rounding the other way (a value within that noise of a rounding boundary), each moving the
# logits by at most ``lm_head_flip_bound``. Every int8 input can flip: weight-only inputs are
# quantized per token and block at run time, W8A8 inputs with their calibrated scale. Measured
# (max |diff| over prefill + 32 decode steps of PROMPTS on the tests/_export_helpers model, in
# flip bounds of 0.029): on the AVX-512 VNNI Xeon host weight-only int8 fused 6e-4, onnxruntime
# 0.22; int4 1e-4 on both; PTQ W8A8 1.5e-4; on the Zen 5 host of issue 30 weight-only int8
# fused about 1.0 (3.3e-3 x max |logit| 9). 4 flips: a 4x margin over the largest seen. A wrong
# scale, a lost block or a missed row moves logits by whole units, far above it.
INT8_FLIPS = 4


def int8_logit_atol(qmodel, float_atol: float) -> float:
    """The absolute logit tolerance of an int8 program of ``qmodel`` vs ``qmodel`` in dygraph."""
    return float_atol + INT8_FLIPS * lm_head_flip_bound(qmodel)
