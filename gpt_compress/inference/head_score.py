"""The LM head's scoring in one pass for Paddle Inference exports: ``gptc_head_score``.

Evaluation's head (``score_head``: logits at the scored rows, then log p(label) and argmax) runs
in Paddle's plain CPU kernels at ~4-6 GFLOP/s on gpt-test with vocab 50,304 (its matmul and a
float32 exp over every logit): ~90% of a WikiText evaluation. The custom operator
``gptc_head_score`` (``kernels/gptc_head_score.h``) computes the same two outputs
without materialising the (N, V) logits: packed vocabulary chunks, an AVX2 outer-product tile
and an online log-sum-exp, at onnxruntime's MatMul rate (bench/eval_speed.py).

``head_scorer`` finds the head weight in the ``score_head`` program's parameters (the one float32
(hidden, vocab) tensor) and checks the operator against the program on a probe batch before
using it; an export whose head is anything else (int8, a layout this does not know), or a
machine without a C++ compiler, keeps the program (``None``). Finding the weight loads every
parameter the program reads (all of them: the programs share one params file) once and keeps
only the head, so params files above ``MAX_PARAMS_BYTES`` keep the program too: evaluation of a
large export stays within the memory it needed before (export/ and memory.py's bounds).
"""
from __future__ import annotations

import os
import tempfile
from typing import Optional

import numpy as np

from ..errors import KernelError

MAX_PARAMS_BYTES = 1 << 30  # gpt2-small's 0.5 GB loads once more for a moment; gpt-345M's 1.4 GB does not
PROBE_ROWS = 16
PROBE_RTOL = 1e-5  # the op and the program sum the same logits in different orders (~1e-7 apart)


class HeadScorer:
    """hidden (N, C) float32, labels (N,) -> (log p(label) (N,) float64, argmax (N,) int64)."""

    def __init__(self, ops, weight):
        self._ops, self._weight = ops, weight  # weight: paddle tensor (C, V) float32

    def __call__(self, hidden: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        import paddle

        lp, top = self._ops.gptc_head_score(paddle.to_tensor(np.ascontiguousarray(hidden, dtype=np.float32)),
                                            paddle.to_tensor(np.ascontiguousarray(labels, dtype=np.int64)),
                                            self._weight)
        return lp.numpy(), top.numpy()


def _head_weight(files: dict, hidden: int, vocab: int):
    """The (hidden, vocab) float32 parameter of the ``score_head`` program, or None."""
    import paddle

    with tempfile.TemporaryDirectory(prefix="gptc-head-") as tmp:  # jit.load wants PREFIX.json + PREFIX.pdiparams
        prefix = os.path.join(tmp, "head")
        os.symlink(os.path.abspath(files["model"]), prefix + ".json")
        os.symlink(os.path.abspath(files["params"]), prefix + ".pdiparams")
        layer = paddle.jit.load(prefix)
        found = [t for t in layer.state_dict().values()
                 if list(t.shape) == [hidden, vocab] and t.dtype == paddle.float32]
    return found[0] if len(found) == 1 else None


def head_scorer(files: dict, hidden: int, vocab: int, program) -> Optional[HeadScorer]:
    """A ``HeadScorer`` for the ``score_head`` program in ``files`` ({"model", "params"}), or
    None when it cannot stand in for it. ``program(hidden, labels)`` runs the program (the probe's
    reference)."""
    if os.path.getsize(files["params"]) > MAX_PARAMS_BYTES:
        return None
    try:
        from ..kernels import load_ops

        ops = load_ops()
        weight = _head_weight(files, hidden, vocab) if hasattr(ops, "gptc_head_score") else None
    except (KernelError, OSError, ValueError, RuntimeError):
        return None
    if weight is None:
        return None
    scorer = HeadScorer(ops, weight)
    rng = np.random.default_rng(0)
    probe = rng.standard_normal((PROBE_ROWS, hidden)).astype(np.float32)
    labels = rng.integers(0, vocab, PROBE_ROWS)
    ref_lp, ref_top = program(probe, labels)
    lp, top = scorer(probe, labels)
    logits = np.sort(probe @ weight.numpy(), axis=-1)
    clear = logits[:, -1] - logits[:, -2] > 1e-4 * (1 + np.abs(logits[:, -1]))  # argmax not a near-tie
    if not (np.allclose(lp, ref_lp, rtol=PROBE_RTOL, atol=0) and (top == ref_top)[clear].all()):
        return None
    return scorer
