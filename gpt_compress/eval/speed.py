"""Serving speed of a runner: batch-1 greedy decode tokens/s and prefill latency, measured the way
``bench/decode.py`` does (tokens/s = new tokens over the whole ``generate`` wall time, prefill
included, as transformers' ``model.generate`` is timed), here on a real prompt.

Figures are medians of ``reps`` timed runs after one untimed warm-up run (which also builds
the backend's programs). They are measurements of this machine at this moment: compare
artifacts measured in one session, never against fixed numbers.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import numpy as np


@dataclass
class SpeedResult:
    """Batch-1 greedy figures of one backend."""

    prompt_tokens: int
    new_tokens: int
    reps: int
    decode_tokens_per_s: float  # new tokens / generate() seconds (prefill included)
    prefill_ms: float  # one prefill of the prompt

    def to_dict(self) -> dict:
        return asdict(self)


def measure_speed(gen, prompt_ids, new_tokens: int = 32, reps: int = 3) -> SpeedResult:
    """Time ``gen`` (a ``runner.Generator``) on one prompt: ``reps`` greedy generations of exactly
    ``new_tokens`` tokens and ``reps`` prefills, each after one warm-up."""
    ids = [int(t) for t in prompt_ids]
    if not ids:
        raise ValueError("measure_speed needs a non-empty prompt")
    sampling = dict(decode_strategy="greedy", max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    gen.generate([ids], **sampling)  # warm-up
    gen_s = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = gen.generate([ids], **sampling)
        gen_s.append(time.perf_counter() - t0)
        if len(out.sequences[0]) != new_tokens:
            raise RuntimeError(f"expected {new_tokens} new tokens, got {len(out.sequences[0])}")
    arr = np.asarray([ids], dtype=np.int64)
    mask = np.ones_like(arr)
    gen.backend.prefill(arr, mask)  # warm-up
    pre_s = []
    for _ in range(reps):
        t0 = time.perf_counter()
        gen.backend.prefill(arr, mask)
        pre_s.append(time.perf_counter() - t0)
    return SpeedResult(prompt_tokens=len(ids), new_tokens=new_tokens, reps=reps,
                       decode_tokens_per_s=round(new_tokens / statistics.median(gen_s), 2),
                       prefill_ms=round(1e3 * statistics.median(pre_s), 3))
