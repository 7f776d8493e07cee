"""Request models and response bodies of the OpenAI-compatible API (``/v1/completions``).

Fields follow OpenAI's legacy completions API; the extras other OpenAI-compatible servers
(vLLM, llama.cpp) accept are ``top_k``, ``repetition_penalty`` and ``min_tokens`` (pass them
with the ``openai`` client's ``extra_body``). Unknown fields are rejected, so a misspelt
option is an error that names it instead of a silently ignored setting. Each choice also
carries ``token_ids``, the generated ids (EOS included when produced), as an extra field.
"""
from __future__ import annotations

import time
import uuid
from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError, field_validator

Prompt = Union[str, list[str], list[int], list[list[int]]]
MAX_LOGPROBS = 20  # most alternatives per token a request may ask for (``logprobs``), as vLLM


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a last chunk with the usage counts."""

    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False


class CompletionRequest(BaseModel):
    """The body of ``POST /v1/completions``."""

    model_config = ConfigDict(extra="forbid")

    model: Optional[str] = None  # must name the served model when given
    prompt: Prompt  # a string, a list of strings, token ids or a list of token-id lists
    max_tokens: Optional[int] = Field(None, ge=1)  # None: Serve.max_tokens_default
    min_tokens: int = Field(0, ge=0)  # extra: no EOS before this many tokens
    temperature: float = Field(1.0, ge=0.0, le=2.0)  # 0: greedy
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)  # extra: 0 or -1 disables
    repetition_penalty: float = Field(1.0, gt=0.0)  # extra: CTRL penalty, 1 disables
    stop: Optional[Union[str, list[str]]] = None  # up to 4 strings that end the text (not included)
    seed: Optional[int] = None  # sampling seed: same seed, same settings -> same text
    n: int = Field(1, ge=1)  # choices per prompt
    echo: StrictBool = False  # prepend the prompt to the text
    stream: StrictBool = False  # server-sent events, ending with `data: [DONE]`
    stream_options: Optional[StreamOptions] = None
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)  # top alternatives per generated token
    best_of: Optional[int] = None  # only n (or null)
    presence_penalty: float = 0.0  # not supported: must be 0
    frequency_penalty: float = 0.0  # not supported: must be 0
    logit_bias: Optional[dict[str, float]] = None  # not supported: must be null or empty
    suffix: Optional[str] = None  # not supported: must be null
    user: Optional[str] = None  # accepted and ignored

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > 4:
            raise ValueError(f"at most 4 stop strings, got {len(stops)}")
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        return stops

    def unsupported(self) -> Optional[tuple[str, str]]:
        """(field, message) for a set option this server does not implement, else None."""
        if self.logprobs is not None and self.echo:
            return "logprobs", "logprobs of the echoed prompt are not supported: use logprobs without echo"
        if self.best_of is not None and self.best_of != self.n:
            return "best_of", f"best_of={self.best_of} is not supported (only best_of == n)"
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) != 0:
                return name, f"{name} is not supported; use repetition_penalty"
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported"
        if self.suffix:
            return "suffix", "suffix is not supported"
        return None

    def prompts(self) -> list[Union[str, list[int]]]:
        """The prompts as a list of strings or token-id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [list(p)]
        return list(p)


def error_body(message: str, param: Optional[str] = None, kind: str = "invalid_request_error",
               code: Optional[str] = None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def validation_message(e: ValidationError) -> tuple[str, Optional[str]]:
    """One line naming every invalid field, and the first field's name."""
    parts, first = [], None
    for err in e.errors():
        loc = ".".join(str(x) for x in err.get("loc", ()))
        field = str(err["loc"][0]) if err.get("loc") else "body"
        first = first or field
        msg = err.get("msg", "invalid")
        if err.get("type") == "extra_forbidden":
            msg = "unknown field"
        parts.append(f"{loc or field}: {msg}")
    seen, unique = set(), []
    for p in parts:
        if p not in seen:
            seen.add(p)
            unique.append(p)
    return "invalid request: " + "; ".join(unique[:6]), first


def completion_id() -> str:
    return f"cmpl-{uuid.uuid4().hex[:24]}"


def completion_body(cid: str, model: str, choices: list[dict], usage: Optional[dict]) -> dict[str, Any]:
    """A ``text_completion`` object (a whole response, or one streamed chunk)."""
    body: dict[str, Any] = {"id": cid, "object": "text_completion", "created": int(time.time()),
                            "model": model, "choices": choices}
    if usage is not None:
        body["usage"] = usage
    return body


class Logprobs:
    """OpenAI's ``logprobs`` object of one choice (``tokens``, ``token_logprobs``,
    ``top_logprobs``, ``text_offset``), built token by token. ``token_text(id)`` is a token's
    own text; offsets count from ``offset`` (the echoed prompt's length). Each top dict also
    holds the chosen token, as OpenAI's do (so up to ``logprobs + 1`` entries)."""

    def __init__(self, token_text, offset: int = 0):
        self.token_text, self.offset = token_text, offset
        self.data: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

    def add(self, token_id: int, logprob: float, top: list[tuple[int, float]]) -> dict:
        """Append one token; returns the object for that token alone (a streamed chunk's)."""
        text = self.token_text(token_id)
        alternatives = {self.token_text(i): lp for i, lp in top}
        alternatives.setdefault(text, logprob)
        one = {"tokens": [text], "token_logprobs": [logprob], "top_logprobs": [alternatives],
               "text_offset": [self.offset]}
        self.offset += len(text)
        for key, values in one.items():
            self.data[key].extend(values)
        return one


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
