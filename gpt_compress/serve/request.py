"""A request to the engine (``engine.py``) and the events it emits back: ``Token`` per generated
token, ``PromptScored`` first when the prompt's log-probabilities were asked for, then exactly one
``Finished`` or ``Failed``. ``request_config`` makes the ``GenerationConfig`` of an OpenAI-style
request."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

from ..config import GenerationConfig
from ..model.speculative import AdaptiveK
from .text import GeneratedText


@dataclass
class Token:
    """A new token; ``text`` is the piece of text it completes (may be "" while held back).
    With ``Request.logprobs`` set: the token's log-probability and the ``top`` alternatives
    [(token id, log-probability), ...] (most likely first), from the model's raw distribution."""

    token_id: int
    text: str
    logprob: Optional[float] = None
    top: Optional[list[tuple[int, float]]] = None


@dataclass
class PromptScored:
    """The prompt's own log-probabilities (``Request.prompt_logprobs``): for each prompt token
    after the first, its log-probability given the tokens before it and the ``top``
    alternatives [(token id, log-probability), ...] (most likely first). Comes before any Token."""

    logprobs: list[float]
    top: list[list[tuple[int, float]]]


@dataclass
class Finished:
    """The request ended normally; ``reason`` is "stop" (EOS or a stop string) or "length"."""

    reason: str
    text: str  # text not yet sent in a Token event (the tail held back for stop strings)
    completion_tokens: int


@dataclass
class Failed:
    """The request failed: ``status`` is the HTTP status to report (500, 503, 504)."""

    status: int
    message: str


@dataclass
class Request:
    """One sequence to generate. ``cfg`` holds max_new_tokens, strategy and sampling settings."""

    prompt: list[int]
    cfg: GenerationConfig
    emit: Callable[[list], None]  # its new events, in order, on the engine thread (``Engine._flush``)
    stop: list[str] = field(default_factory=list)
    timeout: float = 0.0  # seconds from submission; 0: none
    logprobs: Optional[int] = None  # report this many top alternatives (and the token's logprob) per token
    prompt_logprobs: Optional[int] = None  # first score the prompt: a PromptScored event with this many alternatives
    generate: bool = True  # False: score the prompt only (``max_tokens`` 0), then finish
    cancelled: bool = False  # set by the caller (any thread): the engine drops it before the next step
    # engine state
    id: int = 0
    submitted: float = 0.0
    submitted_step: int = 0  # the engine's decode step count at submission
    tokens: list[int] = field(default_factory=list)
    logits: Optional[np.ndarray] = None
    seen: Optional[np.ndarray] = None
    counts: Optional[np.ndarray] = None  # (1, V) times each token was generated (OpenAI's penalties)
    rng: Optional[np.random.Generator] = None
    shown: int = 0  # characters of the decoded text already emitted
    text: Optional[GeneratedText] = None  # its tokens' text, decoded as they come
    last_token_at: float = 0.0
    ended: bool = False  # its Finished or Failed event was emitted
    outbox: list = field(default_factory=list)  # events not handed to ``emit`` yet (``Engine._flush``)
    schedule: Optional[AdaptiveK] = None  # draft tokens per step, when the request is speculated
    drafted: int = 0  # its tokens (prompt + generated) in the draft model's slot cache


def request_config(max_tokens: int, temperature: float, top_p: float, top_k: int, repetition_penalty: float,
                   seed: Optional[int], min_tokens: int = 0, presence_penalty: float = 0.0,
                   frequency_penalty: float = 0.0, logit_bias: Optional[dict[int, float]] = None) -> GenerationConfig:
    """The GenerationConfig of an OpenAI-style request: temperature 0 is greedy, else sampling."""
    return dataclasses.replace(
        GenerationConfig(), decode_strategy="greedy" if temperature == 0 else "sampling",
        max_new_tokens=max_tokens, min_new_tokens=min_tokens, temperature=temperature if temperature > 0 else 1.0,
        top_p=top_p, top_k=top_k, repetition_penalty=repetition_penalty, seed=seed,
        presence_penalty=presence_penalty, frequency_penalty=frequency_penalty, logit_bias=dict(logit_bias or {}))
