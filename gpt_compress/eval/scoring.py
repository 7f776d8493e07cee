"""Log-probabilities of chosen tokens from any backend, computing logits only where they are scored.

A backend with ``scores_positions`` (float exports with the scoring programs, dygraph) runs the
body for the whole batch (``hidden_states``) and the LM head only at the chosen positions
(``head_scores``, ``ROWS`` rows a call): one log-sum-exp per scored position, no (B, T, V)
logits and no log-softmax. Any other backend (older exports, int8, tensor-parallel, a
transformers model in the tests) gives full logits through ``score``; then only the chosen rows
are reduced, here in numpy (``label_logprobs``, also the reference the fast path is tested
against).
"""
from __future__ import annotations

import numpy as np

ROWS = 512  # head rows per call: logits of at most ROWS x vocab exist at a time (~100 MB at 50k)


def label_logprobs(logits: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """logits (..., V) float32, labels (...) -> (log p(label) float64, argmax == label), each (...).

    One log-sum-exp per row: ``exp(logits - max)`` in float32 summed in float64 (relative error
    ~1e-7, far inside the 1e-4 cross-backend tolerance); only the per-row results are widened."""
    top = logits.max(axis=-1, keepdims=True)
    lse = np.log(np.exp(logits - top).sum(axis=-1, dtype=np.float64)) + top[..., 0]
    picked = np.take_along_axis(logits, labels[..., None], axis=-1)[..., 0].astype(np.float64)
    return picked - lse, logits.argmax(axis=-1) == labels


def score_positions(backend, input_ids: np.ndarray, labels: np.ndarray, select: np.ndarray,
                    attention_mask: np.ndarray | None = None, rows: int = ROWS) -> tuple[np.ndarray, np.ndarray]:
    """(log p(label) float64, argmax == label) at the positions where ``select`` (B, T) is true,
    in row-major order, each (N,). ``labels`` (B, T) holds the token each position predicts."""
    select = np.asarray(select, dtype=bool)
    labels = np.asarray(labels, dtype=np.int64)
    b, t = np.nonzero(select)
    y = labels[b, t]
    if not len(y):
        return np.zeros(0, np.float64), np.zeros(0, bool)
    lps, hits = [], []
    if getattr(backend, "scores_positions", False):
        hidden = backend.hidden_states(input_ids, attention_mask)[b, t]  # (N, hidden)
        for i in range(0, len(y), rows):
            lp, top = backend.head_scores(hidden[i:i + rows], y[i:i + rows])
            lps.append(np.asarray(lp, dtype=np.float64))
            hits.append(np.asarray(top) == y[i:i + rows])
    else:
        logits = backend.score(input_ids, attention_mask)  # (B, T, V) float32
        for i in range(0, len(y), rows):
            lp, hit = label_logprobs(logits[b[i:i + rows], t[i:i + rows]], y[i:i + rows])
            lps.append(lp)
            hits.append(hit)
    return np.concatenate(lps), np.concatenate(hits)


def token_logprobs(backend, input_ids: np.ndarray, labels: np.ndarray,
                   attention_mask: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(log p(label | prefix) float64, argmax == label) at every position, each (B, T)."""
    lp, hit = score_positions(backend, input_ids, labels, np.ones(np.shape(input_ids), bool), attention_mask)
    return lp.reshape(np.shape(input_ids)), hit.reshape(np.shape(input_ids))
