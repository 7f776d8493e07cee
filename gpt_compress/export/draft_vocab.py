"""A speculative draft's vocabulary: the tokens its fused program proposes from.

A small draft spends most of a greedy step in its LM head: at gpt-tiny's width (64) the
50,304-row head is 3.2 MB of int8 codes a step, against about 0.1 MB for its blocks, and it
competes with the target's weights for the cache. Text uses few of the vocabulary's tokens most
of the time, so a draft that proposes only the ``size`` most frequent tokens of the training
data loses little acceptance and reads a fraction of the head (frequency-ranked drafting, as in
FR-Spec, Zhao et al. 2025). The target verifies every proposal, so the output never depends on
the vocabulary: a token outside it is one the draft cannot propose (the target supplies it).

The exporter stores the head rows of these tokens a second time in the fused program
(``fused.FusedLM``'s ``draft_vocab``); ``FusedBackend.decode_greedy_steps(draft_vocab=True)``
(a ``ModelDraft``'s greedy proposals) runs on them. Every other use of the export (its logits,
sampling, scoring, the unfused and onnxruntime programs) keeps the whole vocabulary.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

from ..data.dataset import parse_blend
from ..data.indexed import open_dataset
from ..errors import ExportError


def token_counts(data_prefix: Sequence[str], vocab_size: int) -> np.ndarray:
    """How often each id occurs in the documents of ``data_prefix`` (``Data.data_prefix``'s form:
    one prefix or weight/prefix pairs; each prefix counted whole): (vocab_size,) int64."""
    counts = np.zeros(vocab_size, np.int64)
    for prefix in parse_blend(data_prefix)[0]:
        counts += open_dataset(prefix).token_counts(vocab_size)
    return counts


def most_frequent(counts: np.ndarray, size: int, keep: Iterable[int] = ()) -> np.ndarray:
    """The ``size`` ids of the highest ``counts`` (ties: the lower id), with every id of ``keep``
    (EOS) among them, ascending."""
    counts = np.asarray(counts)
    vocab = len(counts)
    keep = sorted({int(k) for k in keep if 0 <= int(k) < vocab})
    if not len(keep) <= size <= vocab:
        raise ExportError(f"draft vocabulary: {size} tokens asked; it must be between {max(len(keep), 1)} "
                          f"and the vocabulary's {vocab}")
    order = np.lexsort((np.arange(vocab), -counts))  # most frequent first, ties by id
    rest = order[~np.isin(order, keep)][:size - len(keep)]
    return np.sort(np.concatenate([np.asarray(keep, np.int64), rest.astype(np.int64)]))


def draft_vocab(data_prefix: Sequence[str], size: int, vocab_size: int, eos_token_id: int) -> np.ndarray:
    """The ``size`` tokens most frequent in ``data_prefix``'s documents, EOS among them, ascending."""
    if not data_prefix:
        raise ExportError("draft vocabulary: name the training data to count tokens in")
    return most_frequent(token_counts(data_prefix, vocab_size), size, keep=(eos_token_id,))
