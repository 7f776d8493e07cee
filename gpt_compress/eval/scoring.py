"""Log-probabilities of chosen tokens from any backend, computing logits only where they are scored.

Three paths, best first:

* ``scores_positions`` (float and int8 exports with the scoring programs, dygraph): the body
  runs on the whole batch (``hidden_states``), the LM head only at the chosen positions
  (``head_scores``, ``ROWS`` rows a call) and returns one log-probability and argmax per row:
  the log-softmax is taken inside the program, no (N, V) logits leave it (Paddle Inference runs
  it as the ``gptc_head_score`` operator, ``inference/head_score.py``, which never makes them).
* ``scores_rows`` (the fused Paddle program, ``inference/fused.py``, which also runs int8 and
  exports without the scoring programs): one call per group of sequences gives logits (n, V)
  at the chosen flat rows only; they are reduced here (``label_logprobs``).
* ``scores_labels`` (tensor-parallel exports, ``inference/tensor_parallel.py``): each rank
  reduces its vocabulary slice of the logits at the chosen rows to its maximum, sum of
  exponentials, the label's logit and its argmax, and only those cross the ranks.
* otherwise (older exports, a transformers model in the tests) ``score``'s full
  (B, T, V) logits, reduced at the chosen rows only. ``label_logprobs`` is also the reference
  the fast paths are tested against.
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
    if backend.scores_positions:
        hidden = backend.hidden_states(input_ids, attention_mask)[b, t]  # (N, hidden)
        for i in range(0, len(y), rows):
            lp, top = backend.head_scores(hidden[i:i + rows], y[i:i + rows])
            lps.append(np.asarray(lp, dtype=np.float64))
            hits.append(np.asarray(top) == y[i:i + rows])
    elif backend.scores_labels:  # tensor parallel: a few numbers a row cross the ranks
        done = 0
        for seqs in _groups(select.sum(axis=1), rows):
            sub = np.nonzero(select[seqs])
            flat = sub[0] * select.shape[1] + sub[1]
            mask = None if attention_mask is None else attention_mask[seqs]
            lp, top = backend.label_scores(np.asarray(input_ids)[seqs], mask, flat, y[done:done + len(flat)])
            lps.append(lp)
            hits.append(top == y[done:done + len(flat)])
            done += len(flat)
    else:
        for logits, part in _logit_rows(backend, input_ids, select, attention_mask, rows):
            lp, hit = label_logprobs(logits, y[part])
            lps.append(lp)
            hits.append(hit)
    return np.concatenate(lps), np.concatenate(hits)


def _logit_rows(backend, input_ids, select: np.ndarray, attention_mask, rows: int):
    """Logits at the positions ``select`` marks, in row-major order: yields ``(logits (n, V),
    slice of those positions)``, at most about ``rows`` rows at a time (``logits_at`` when the
    backend has it, else ``score``'s full logits, cut at the chosen rows)."""
    done = 0
    if backend.scores_rows:
        for seqs in _groups(select.sum(axis=1), rows):  # sequences whose rows fit one call
            sub = np.nonzero(select[seqs])
            flat = sub[0] * select.shape[1] + sub[1]
            mask = None if attention_mask is None else attention_mask[seqs]
            logits = backend.logits_at(np.asarray(input_ids)[seqs], mask, flat)  # (n, V)
            yield logits, slice(done, done + len(flat))
            done += len(flat)
        return
    b, t = np.nonzero(select)
    logits = backend.score(input_ids, attention_mask)  # (B, T, V) float32
    for i in range(0, len(b), rows):
        yield logits[b[i:i + rows], t[i:i + rows]], slice(i, i + rows)


def top_logprobs(backend, input_ids: np.ndarray, labels: np.ndarray, select: np.ndarray, k: int,
                 attention_mask: np.ndarray | None = None,
                 rows: int = ROWS) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """At the positions ``select`` (B, T) marks, in row-major order: log p(label) (N,) float64,
    the ``k`` most likely tokens (N, k) int64 (most likely first) and their log-probabilities
    (N, k) float64. With ``k`` <= 1 on a backend with ``head_scores`` no logits leave it: one call
    gives each label's log-probability and the argmax, a second one the argmax's
    log-probability (only where it is not the label)."""
    select = np.asarray(select, dtype=bool)
    labels = np.asarray(labels, dtype=np.int64)
    b, t = np.nonzero(select)
    y = labels[b, t]
    n = len(y)
    lp, ids, top = np.zeros(n), np.zeros((n, k), np.int64), np.zeros((n, k))
    if not n:
        return lp, ids, top
    if k <= 1 and backend.scores_positions:
        hidden = backend.hidden_states(input_ids, attention_mask)[b, t]  # (N, hidden)
        best = np.zeros(n, np.int64)
        for i in range(0, n, rows):
            part, got = backend.head_scores(hidden[i:i + rows], y[i:i + rows])
            lp[i:i + rows], best[i:i + rows] = part, got
        if k:
            ids[:, 0], top[:, 0] = best, lp
            other = np.flatnonzero(best != y)
            for i in range(0, len(other), rows):
                rows_i = other[i:i + rows]
                top[rows_i, 0] = backend.head_scores(hidden[rows_i], best[rows_i])[0]
        return lp, ids, top
    for logits, part in _logit_rows(backend, input_ids, select, attention_mask, rows):
        logits = logits.astype(np.float64)
        logits -= logits.max(axis=-1, keepdims=True)
        logits -= np.log(np.exp(logits).sum(axis=-1, keepdims=True))  # log-softmax, in place
        lp[part] = np.take_along_axis(logits, y[part, None], axis=-1)[:, 0]
        if k:
            best = np.argpartition(-logits, k - 1, axis=-1)[:, :k]
            best_lp = np.take_along_axis(logits, best, axis=-1)
            order = np.argsort(-best_lp, axis=-1, kind="stable")
            ids[part] = np.take_along_axis(best, order, axis=-1)
            top[part] = np.take_along_axis(best_lp, order, axis=-1)
    return lp, ids, top


def _groups(counts: np.ndarray, rows: int):
    """Consecutive slices of sequences holding at most ``rows`` chosen rows each (a sequence with
    more is a group of its own); sequences without chosen rows are left out."""
    start, total = None, 0
    for i, n in enumerate(counts):
        if start is not None and total + n > rows:
            yield slice(start, i)
            start, total = None, 0
        if n and start is None:
            start = i
        total += n if start is not None else 0
    if start is not None:
        yield slice(start, len(counts))


def token_logprobs(backend, input_ids: np.ndarray, labels: np.ndarray,
                   attention_mask: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(log p(label | prefix) float64, argmax == label) at every position, each (B, T)."""
    lp, hit = score_positions(backend, input_ids, labels, np.ones(np.shape(input_ids), bool), attention_mask)
    return lp.reshape(np.shape(input_ids)), hit.reshape(np.shape(input_ids))
