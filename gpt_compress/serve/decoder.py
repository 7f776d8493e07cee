"""The interface between the engine (``engine.py``) and a batch decoder: rows keyed by
caller-chosen keys join a running decode batch, step together and leave.

Two decoders implement it: ``BatchDecoder`` (``batch.py``: caches merged through numpy, any
backend) and ``SlotDecoder`` (``slots.py``: one preallocated in-place cache of ``FusedCache``
rows). The backend names the one it supports (``Backend.serve_decoder``); the engine builds it
with ``make_decoder``. A decoder is not thread-safe: one engine loop owns it (and the backend).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Hashable, Optional

import numpy as np


class Decoder(ABC):
    """``prefill`` (or ``prefill_many``) + ``join`` (or ``add``) -> first logits, ``step`` -> next
    logits, ``remove`` drops rows; ``step_many`` + ``keep`` when ``verifies``."""

    # A join copies only the newcomers: the engine need not let arrivals gather before joining.
    cheap_join: bool = False
    # ``prefill_many`` runs several prompts in one backend call (else the engine prefills one by one).
    batches_prefill: bool = False
    # ``step_many`` + ``keep``: speculative decoding's verify step.
    verifies: bool = False
    # Greedy steps one ``step_greedy`` call runs at most (1: no ``step_greedy``).
    greedy_steps: int = 1

    def __init__(self, backend):
        self.backend = backend
        self.keys: list[Hashable] = []

    def __len__(self) -> int:
        return len(self.keys)

    @property
    @abstractmethod
    def width(self) -> int:
        """S: cached columns of the batch (the write column of the next decode step)."""

    @abstractmethod
    def prefill(self, prompt: list[int]) -> tuple[np.ndarray, tuple]:
        """Run ``prompt`` alone (batch 1); returns its logits (V,) and the state ``join`` takes."""

    def prefill_many(self, prompts: list[list[int]]) -> list[tuple[np.ndarray, tuple]]:
        """``[prefill(p) for p in prompts]``, together where the decoder can (``batches_prefill``)."""
        return [self.prefill(p) for p in prompts]

    @abstractmethod
    def join(self, entries: list[tuple[Hashable, tuple]]) -> None:
        """Add prefilled sequences ``[(key, state from prefill), ...]`` as new rows, all or none."""

    def add(self, key: Hashable, prompt: list[int]) -> np.ndarray:
        """Prefill ``prompt`` alone and join the batch as a new row; returns its logits (V,)."""
        logits, state = self.prefill(prompt)
        self.join([(key, state)])
        return logits

    @abstractmethod
    def step(self, tokens: dict[Hashable, int]) -> dict[Hashable, np.ndarray]:
        """Decode one token for every row (``tokens[key]`` its last chosen token); returns each
        row's next logits (V,)."""

    def step_many(self, tokens: dict[Hashable, list[int]]) -> Optional[dict[Hashable, np.ndarray]]:
        """The verify step (only when ``verifies``): each row's last token and drafts in one run;
        returns each row's logits at its fed positions (len, V), or None when there is no room."""
        raise NotImplementedError(f"{type(self).__name__} has no verify step")

    def step_greedy(self, tokens: dict[Hashable, int], steps: int, eos: Optional[int],
                    suppress: int) -> dict[Hashable, np.ndarray]:
        """``steps`` (<= ``greedy_steps``) greedy steps for every row in one call, the argmax made
        where the logits lie (only when ``greedy_steps`` > 1): feeds ``tokens[key]``, then each
        step's token; returns each row's tokens (steps,), 0 after its ``eos``; the first
        ``suppress`` steps never choose ``eos``. The last token is not fed yet (the next call feeds it)."""
        raise NotImplementedError(f"{type(self).__name__} runs one step a call (greedy_steps is 1)")

    def keep(self, kept: dict[Hashable, int]) -> None:
        """After ``step_many``: row ``key`` keeps the first ``kept[key]`` columns it was fed."""
        raise NotImplementedError(f"{type(self).__name__} has no verify step")

    @abstractmethod
    def remove(self, keys) -> None:
        """Drop rows at once (unknown keys are ignored)."""

    def check_joining(self, keys: list[Hashable]) -> None:
        """Reject keys that repeat or are already rows."""
        if len(set(keys)) != len(keys) or set(keys) & set(self.keys):
            raise ValueError(f"duplicate keys in {keys}")


def make_decoder(backend, max_batch: int) -> Decoder:
    """The decoder ``backend`` supports (``Backend.serve_decoder``) for at most ``max_batch`` rows."""
    from .batch import BatchDecoder
    from .lockstep import LockstepDecoder
    from .slots import SlotDecoder

    decoders = {"batch": BatchDecoder, "slots": SlotDecoder, "lockstep": LockstepDecoder}
    if backend.serve_decoder not in decoders:
        raise ValueError(f"{type(backend).__name__} asks for serve decoder {backend.serve_decoder!r}; "
                         f"known: {', '.join(decoders)}")
    return decoders[backend.serve_decoder](backend, max_batch)
