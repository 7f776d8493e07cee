"""Sequence-level distillation data: training windows whose continuation the teacher writes.

A draft for speculative decoding is scored by how often it picks the target's next token on the
target's own output, not on human text. Distilling on windows that start with real text and go
on as the teacher's greedy continuation (sequence-level knowledge distillation, Kim & Rush 2016;
DistillSpec, Zhou et al. 2023, for speculative drafts) trains the student where it is used: the
teacher's soft targets are then taken on the contexts the target produces at inference.

    teacher_continuations(generator, "data/corpus_text_document", split, "run/teacher_data/teacher",
                          windows=4096, prompt_tokens=64, new_tokens=64, seed=1234)

writes the indexed dataset ``run/teacher_data/teacher_text_document.{bin,idx}``: one document per
window, its prompt (``prompt_tokens`` consecutive tokens of a training-split document, each window
of the split equally likely) followed by the teacher's greedy tokens (fewer than ``new_tokens``
when it ends the text). The draws depend on ``seed`` alone, and greedy decoding is deterministic,
so a rerun writes the same documents; a finished dataset whose recorded settings match is reused
(``teacher_text_document.settings.json`` beside it, written last).
"""
from __future__ import annotations

import os
from typing import Any, Sequence

import numpy as np

from .data.dataset import split_documents
from .data.errors import DataError
from .data.indexed import IndexedDatasetBuilder, best_dtype, open_dataset
from .fileio import read_json, write_json_atomic

SUFFIX = "_text_document"
BATCH = 8  # prompts generated at once


def teacher_continuations(generator, data_prefix: str, split: Sequence[float], out_prefix: str, windows: int,
                          prompt_tokens: int, new_tokens: int, seed: int) -> dict[str, Any]:
    """Write (or reuse) the dataset ``out_prefix + SUFFIX``; returns {"data_prefix", "windows",
    "tokens", "generated_tokens", "reused"}. ``generator``: a ``Generator`` of the teacher."""
    settings = {"data_prefix": os.path.abspath(data_prefix), "split": [float(s) for s in split],
                "windows": int(windows), "prompt_tokens": int(prompt_tokens), "new_tokens": int(new_tokens),
                "seed": int(seed)}
    prefix = out_prefix + SUFFIX
    record = prefix + ".settings.json"
    if os.path.isfile(record) and os.path.isfile(prefix + ".idx"):
        done = read_json(record)
        if done.get("settings") == settings:
            return {**done["result"], "reused": True}
    prompts = sample_windows(data_prefix, split, windows, prompt_tokens, seed)
    tokens = generated = 0
    with IndexedDatasetBuilder(prefix, dtype=best_dtype(generator.vocab_size)) as out:
        for start in range(0, len(prompts), BATCH):
            batch = prompts[start:start + BATCH]
            result = generator.generate(batch, max_new_tokens=new_tokens, decode_strategy="greedy")
            for prompt, cont in zip(batch, result.sequences):
                out.add_document(list(prompt) + list(cont))
                tokens += len(prompt) + len(cont)
                generated += len(cont)
        out.finalize()
    result = {"data_prefix": prefix, "windows": len(prompts), "tokens": tokens, "generated_tokens": generated}
    write_json_atomic(record, {"settings": settings, "result": result}, sort_keys=False)
    return {**result, "reused": False}


def sample_windows(data_prefix: str, split: Sequence[float], windows: int, prompt_tokens: int,
                   seed: int) -> list[list[int]]:
    """``windows`` prompts of ``prompt_tokens`` consecutive tokens from the training split of the
    dataset at ``data_prefix``: a document with probability proportional to its windows, then a
    start uniformly among them."""
    if windows < 1 or prompt_tokens < 1:
        raise DataError(f"need at least one window of at least one token, got {windows} x {prompt_tokens}")
    ds = open_dataset(data_prefix)
    train = split_documents(len(ds), split)[0]
    docs = np.arange(train.start, train.stop)
    starts = np.maximum(np.asarray(ds.sizes, dtype=np.int64)[docs] - prompt_tokens + 1, 0).astype(np.float64)
    if starts.sum() == 0:
        raise DataError(f"{data_prefix}: no training document holds {prompt_tokens} tokens")
    rng = np.random.default_rng(seed)
    picks = rng.choice(len(docs), size=windows, p=starts / starts.sum())
    offsets = (rng.random(windows) * starts[picks]).astype(np.int64)
    return [[int(t) for t in ds.get(int(docs[i]), int(o), prompt_tokens)] for i, o in zip(picks, offsets)]
