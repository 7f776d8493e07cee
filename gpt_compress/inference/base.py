"""The backend contract: what every backend of ``inference/`` provides to generation
(``model/generation.py``, ``model/speculative.py``), evaluation (``eval/scoring.py``), export
validation (``export/validate.py``) and the server (``serve/``).

A backend runs the network on numpy arrays and keeps a KV cache whose type is its own. Prompts
of different lengths are left-padded; the attention mask (B, S) carries the padding, so
positions (``cumsum(mask) - 1``) and attention skip it. ``Backend`` declares every capability
once: the methods generation cannot do without are abstract (``prefill``, ``decode``,
``reorder_cache``, ``truncate_cache``: speculative decoding rolls a cache back; ``score``, from
``Scorer``, the part evaluation reads); every other one has a default here that a backend
overrides when it does better (``decode_greedy``: the argmax without handing the logits out) or
that says what the backend lacks (``logits_at`` without ``scores_rows``). Callers read the
class attributes (``greedy_steps``, ``scores_positions``, ``scores_rows``, ``serve_decoder``)
instead of probing for methods.

The core (``model/``) cannot import this module (``tests/test_layering.py``): its decoding loops
take any object with these methods, and every backend that reaches them derives from
``Backend``.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable, Optional, TypeVar

import numpy as np

from ..runtime import math_threads

T = TypeVar("T")


def resolve_threads(n: int) -> int:
    """A thread setting: ``n`` when positive, else the process's math threads ($OMP_NUM_THREADS
    or all cores)."""
    return n if n > 0 else math_threads()


def decode_each(decode: Callable, input_ids: np.ndarray, attention_mask: np.ndarray, cache) -> tuple[np.ndarray, Any]:
    """``decode_positions`` through a one-new-token ``decode``: one call per column (the unfused
    Paddle programs, onnxruntime and dygraph return only the last position's logits)."""
    s = attention_mask.shape[1] - input_ids.shape[1]
    out = []
    for t in range(input_ids.shape[1]):
        logits, cache = decode(input_ids[:, t:t + 1], attention_mask[:, :s + t + 1], cache)
        out.append(logits)
    return np.stack(out, axis=1), cache


class Scorer(ABC):
    """What evaluation (``eval/scoring.py``) reads from a model: ``score``, and the faster paths
    a model declares (``scores_positions``, ``scores_rows``). Every ``Backend`` is one; a model
    that only scores (a peer in the tests) derives from this alone."""

    # ``hidden_states`` + ``head_scores``: evaluation takes the LM head only at scored positions.
    scores_positions: bool = False
    # ``logits_at``: the body on the whole batch, the LM head only at chosen flat rows.
    scores_rows: bool = False
    # ``label_scores``: the log-probability and argmax at chosen rows, reduced where the logits lie.
    scores_labels: bool = False

    @abstractmethod
    def score(self, input_ids: np.ndarray, attention_mask: Optional[np.ndarray] = None) -> np.ndarray:
        """Full-sequence logits (B, T, V) float32."""

    def hidden_states(self, input_ids: np.ndarray, attention_mask: Optional[np.ndarray] = None) -> np.ndarray:
        """Final hidden states (B, T, hidden) float32 (only with ``scores_positions``)."""
        raise NotImplementedError(f"{type(self).__name__} has no hidden states program (scores_positions)")

    def head_scores(self, hidden: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """hidden (N, hidden) float32, labels (N,) -> log p(label) (N,) float64 and the argmax
        (N,) int64 (only with ``scores_positions``): logits exist only for these N rows."""
        raise NotImplementedError(f"{type(self).__name__} has no scoring head program (scores_positions)")

    def logits_at(self, input_ids: np.ndarray, attention_mask: Optional[np.ndarray], rows: np.ndarray) -> np.ndarray:
        """Logits (n, V) float32 at the flat positions ``rows`` (n,) of ``input_ids`` (B, T)
        (``b * T + t``; only with ``scores_rows``)."""
        raise NotImplementedError(f"{type(self).__name__} cannot run the LM head at chosen rows (scores_rows)")

    def label_scores(self, input_ids: np.ndarray, attention_mask: Optional[np.ndarray], rows: np.ndarray,
                     labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """log p(label) (n,) float64 and the argmax (n,) int64 at the flat positions ``rows`` whose
        next tokens are ``labels`` (only with ``scores_labels``: a model whose logits are split
        across processes reduces them to these numbers without gathering them)."""
        raise NotImplementedError(f"{type(self).__name__} has no label scores (scores_labels)")


class Backend(Scorer):
    """One model behind the decoding, scoring and serving loops (all arrays numpy)."""

    # Greedy steps one ``decode_greedy_steps`` call runs (1: the backend runs one a call, and
    # ``decode_greedy_steps`` is not offered).
    greedy_steps: int = 1
    # Tokens of the draft vocabulary ``decode_greedy_steps(draft_vocab=True)`` proposes from (0:
    # none; ``export/draft_vocab.py``).
    draft_vocab: int = 0
    # The server's decoder for this backend (``serve/decoder.py``'s ``make_decoder``): "batch" merges
    # caches through numpy (``serve/batch.py``); "slots" keeps one in-place cache of ``FusedCache``
    # rows (``serve/slots.py``: needs ``manifest`` and ``on_thread``).
    serve_decoder: str = "batch"

    # ------------------------------------------------------------------ decoding
    @abstractmethod
    def prefill(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> tuple[np.ndarray, Any]:
        """Prompt ids (B, T) and mask (B, T) -> last-position logits (B, V) float32, the cache."""

    @abstractmethod
    def decode(self, input_ids: np.ndarray, attention_mask: np.ndarray, cache: Any) -> tuple[np.ndarray, Any]:
        """New tokens (B, T >= 1) with the full mask (B, S + T) -> the last new position's logits
        (B, V), the cache holding S + T positions (the old one may be updated in place: do not
        reuse it)."""

    @abstractmethod
    def reorder_cache(self, cache: Any, rows: np.ndarray) -> Any:
        """The cache's rows ``rows`` (selected or repeated: beam search, a server batch)."""

    @abstractmethod
    def truncate_cache(self, cache: Any, length: int) -> Any:
        """The cache cut to its first ``length`` positions (rejected draft positions dropped)."""

    def decode_greedy(self, input_ids: np.ndarray, attention_mask: np.ndarray, cache: Any) -> tuple[np.ndarray, Any]:
        """``decode``'s argmax token per row (B,) int64 (``np.argmax``'s choice: the first maximum,
        or the first NaN) and the cache. Greedy decoding calls it on the steps no logits processor
        changes; a backend that makes the argmax itself keeps the logits to itself."""
        logits, cache = self.decode(input_ids, attention_mask, cache)
        return np.argmax(logits, axis=-1), cache

    def decode_greedy_steps(self, input_ids: np.ndarray, attention_mask: np.ndarray, cache: Any, steps: int,
                            eos_token_id: Optional[int], pad_token_id: int, finished: np.ndarray,
                            suppress_eos: int = 0, draft_vocab: bool = False) -> tuple[np.ndarray, Any]:
        """``steps`` greedy steps in one call (only when ``greedy_steps`` > 1): feeds ``input_ids``
        (B, T) with ``attention_mask`` (B, S + T) (the step at each row's last new token), then
        each step's tokens. Returns the tokens (B, steps) int64, ``pad_token_id`` for rows
        ``finished`` (B,) bool before the call or by an earlier step's ``eos_token_id``, and the
        cache holding S + T - 1 + steps positions; the first ``suppress_eos`` steps never choose
        ``eos_token_id`` (``min_new_tokens``). ``draft_vocab`` (when the backend has one): each
        token is the argmax over the draft vocabulary's tokens only (a draft's proposals)."""
        raise ValueError(f"{type(self).__name__} runs one greedy step a call (greedy_steps is 1)")

    def decode_positions(self, input_ids: np.ndarray, attention_mask: np.ndarray, cache: Any) -> tuple[np.ndarray, Any]:
        """New tokens (B, T) with the full mask (B, S + T) -> logits at every new position
        (B, T, V) float32 and the cache holding S + T positions (speculative decoding's verify
        step); by default one ``decode`` per position."""
        return decode_each(self.decode, input_ids, attention_mask, cache)

    def decode_positions_greedy(self, input_ids: np.ndarray, attention_mask: np.ndarray,
                                cache: Any) -> tuple[np.ndarray, Any]:
        """``decode_positions``' argmax at every new position (B, T) int64 (``np.argmax``'s choice)
        and the cache: a greedy verify step that no logits processor changes; a backend that makes
        the argmax itself keeps the logits to itself."""
        logits, cache = self.decode_positions(input_ids, attention_mask, cache)
        return np.argmax(logits, axis=-1), cache

    # ------------------------------------------------------------------ resources and threads
    def release(self) -> None:
        """Drop what holds a copy of the weights (predictors, sessions); re-created on next use."""

    def on_thread(self, fn: Callable[..., T], *args) -> T:
        """Run ``fn(*args)`` where this backend's runtime may be touched: its own worker thread,
        or the caller's under its lock. Callers that read or write the backend's cache tensors
        themselves (``serve/``) go through here."""
        return fn(*args)

    def clone(self) -> "Backend":
        """An independent backend (own thread or lock, own runtime handles) sharing this one's
        weights: a copy of the attributes, then ``_init_clone`` gives it its own handles."""
        other = object.__new__(type(self))
        other.__dict__.update(self.__dict__)
        self.on_thread(other._init_clone, self)
        return other

    def _init_clone(self, source: "Backend") -> None:
        """Give a fresh copy of ``source``'s attributes its own handles (run on ``source``'s thread)."""
        raise NotImplementedError(f"{type(self).__name__} cannot be cloned")
