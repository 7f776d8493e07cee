"""Request models and response bodies of the OpenAI-compatible API (``/v1/completions``,
``/v1/chat/completions``, vLLM's tokenizer endpoints).

Fields follow OpenAI's legacy completions and chat completions APIs; the extras other OpenAI-compatible servers
(vLLM, llama.cpp) accept are ``top_k``, ``repetition_penalty`` and ``min_tokens`` (pass them
with the ``openai`` client's ``extra_body``). Unknown fields are rejected, so a misspelt
option is an error that names it instead of a silently ignored setting. Each choice also
carries ``token_ids``, the generated ids (EOS included when produced), as an extra field.
"""
from __future__ import annotations

import re
import string
import time
import uuid
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

Text = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
# a string, a list of strings, token ids or a list of token-id lists; none of them empty
Prompt = Union[Text, Annotated[list[Text], Field(min_length=1)], TokenIds,
               Annotated[list[TokenIds], Field(min_length=1)]]
MAX_LOGPROBS = 20  # most alternatives per token a request may ask for (``logprobs``), as vLLM
MAX_SEED = 2**63 - 1  # seeds are int64, as OpenAI's


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a last chunk with the usage counts."""

    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = Field(False, description="add a last chunk with the usage counts")


class CompletionRequest(BaseModel):
    """The body of ``POST /v1/completions``. Strict types (a string is not a number, a
    bool is not an integer), no NaN or infinity and no lone surrogate in a string (pydantic
    refuses them), so that what the schema allows is what the handler takes."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    model: Optional[str] = Field(None, description="must name the served model when given")
    prompt: Prompt = Field(description="a string, a list of strings, token ids or a list of token-id lists")
    max_tokens: Optional[int] = Field(None, ge=0, description="tokens to generate; null: Serve.max_tokens_default; "
                                      "prompt + max_tokens must fit the model's context; 0 (with echo): score "
                                      "the prompt only")
    min_tokens: int = Field(0, ge=0, description="extra: no EOS before this many tokens (<= max_tokens)")
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="0: greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling; 1 disables")
    top_k: int = Field(0, ge=-1, description="extra: keep the k most likely tokens; 0 or -1 disables")
    repetition_penalty: float = Field(1.0, gt=0.0, description="extra: CTRL penalty; 1 disables")
    stop: Optional[Union[Text, Annotated[list[Text], Field(max_length=4)]]] = Field(
        None, description="up to 4 non-empty strings that end the text (not included)")
    seed: Optional[int] = Field(None, ge=0, le=MAX_SEED, description="sampling seed: same seed, same settings -> "
                                "same text; choice j of n uses seed + j")
    n: int = Field(1, ge=1, description="choices per prompt (<= Serve.max_n)")
    echo: bool = Field(False, description="prepend the prompt to the text (with logprobs: and its tokens' "
                       "log-probabilities, the first one null)")
    stream: bool = Field(False, description="server-sent events, ending with `data: [DONE]`")
    stream_options: Optional[StreamOptions] = None
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS, description="top alternatives per token")
    best_of: Optional[int] = Field(None, ge=1, description="candidates per prompt (>= n, <= Serve.max_n, not "
                                   "with stream): the n of highest mean token log-probability are returned")
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="subtracted from the logit of every "
                                    "token already generated")
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="subtracted from a token's logit once "
                                     "per time it was generated")
    logit_bias: Optional[dict[Annotated[str, Field(pattern=r"^[0-9]{1,9}$")],
                              Annotated[float, Field(ge=-100.0, le=100.0)]]] = Field(
        None, max_length=300, description="token id (a string) -> bias in [-100, 100] added to its logit")
    suffix: Optional[str] = Field(None, max_length=0, description="not supported: null or empty")
    user: Optional[str] = Field(None, description="accepted and ignored")

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        return [v] if isinstance(v, str) else list(v or [])

    def unsupported(self) -> Optional[tuple[str, str]]:
        """(field, message) for a combination of fields the request cannot have, else None."""
        if self.max_tokens == 0 and not self.echo:
            return "max_tokens", "max_tokens=0 generates nothing: it needs echo (to score the prompt)"
        if self.best_of is not None and self.best_of < self.n:
            return "best_of", f"best_of={self.best_of} must be >= n={self.n}"
        if self.best_of is not None and self.best_of > self.n and self.stream:
            return "best_of", f"best_of={self.best_of} > n={self.n} cannot stream: it picks whole completions"
        return None

    def token_bias(self) -> dict[int, float]:
        """``logit_bias`` with integer token ids."""
        return {int(k): v for k, v in (self.logit_bias or {}).items()}

    def prompts(self) -> list[Union[str, list[int]]]:
        """The prompts as a list of strings or token-id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [list(p)]
        return list(p)


class ChatMessage(BaseModel):
    """One message of a conversation."""

    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "user", "assistant"]
    content: str
    name: Optional[str] = Field(None, description="accepted and ignored")


class ChatCompletionRequest(BaseModel):
    """The body of ``POST /v1/chat/completions``, for a model that carries a prompt format
    (finetuned with `gptc finetune`): the last message, the user's, becomes the prompt through
    the model's template; the messages before it are not read (the model was finetuned on single
    prompts). Sampling fields as ``CompletionRequest``'s."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    model: Optional[str] = Field(None, description="must name the served model when given")
    messages: list[ChatMessage] = Field(min_length=1, description="the conversation; the last message is the user's")
    max_tokens: Optional[int] = Field(None, ge=1, description="tokens to generate; null: Serve.max_tokens_default")
    max_completion_tokens: Optional[int] = Field(None, ge=1, description="OpenAI's newer name of max_tokens")
    min_tokens: int = Field(0, ge=0, description="extra: no EOS before this many tokens (<= max_tokens)")
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="0: greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling; 1 disables")
    top_k: int = Field(0, ge=-1, description="extra: keep the k most likely tokens; 0 or -1 disables")
    repetition_penalty: float = Field(1.0, gt=0.0, description="extra: CTRL penalty; 1 disables")
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="as in /v1/completions")
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="as in /v1/completions")
    logit_bias: Optional[dict[Annotated[str, Field(pattern=r"^[0-9]{1,9}$")],
                              Annotated[float, Field(ge=-100.0, le=100.0)]]] = Field(
        None, max_length=300, description="token id (a string) -> bias in [-100, 100] added to its logit")
    stop: Optional[Union[Text, Annotated[list[Text], Field(max_length=4)]]] = Field(
        None, description="up to 4 non-empty strings that end the text (not included)")
    seed: Optional[int] = Field(None, ge=0, le=MAX_SEED, description="sampling seed; choice j of n uses seed + j")
    n: int = Field(1, ge=1, description="choices (<= Serve.max_n)")
    stream: bool = Field(False, description="server-sent events of chat.completion.chunk, ending with "
                         "`data: [DONE]`")
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = Field(None, description="accepted and ignored")

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        return [v] if isinstance(v, str) else list(v or [])

    def token_bias(self) -> dict[int, float]:
        """``logit_bias`` with integer token ids."""
        return {int(k): v for k, v in (self.logit_bias or {}).items()}


def chat_prompt(template: str, prompt_tokens: int, messages: list[ChatMessage]) -> tuple[Optional[str], str]:
    """The prompt text of a conversation for a model whose finetuning recorded ``template``
    (``Finetune.prompt_template``, one ``{field}``: the last user message fills it) or only
    ``prompt_tokens`` (the message is the prompt, fixed to that length when encoded). Returns
    (prompt, "") or (None, the reason there is none)."""
    last = messages[-1]
    if last.role != "user":
        return None, f"the last message is the {last.role}'s; it must be the user's (it becomes the prompt)"
    if not template:
        if prompt_tokens:
            return last.content, ""
        return None, ("this model carries no prompt format (finetune it with `gptc finetune`, which records "
                      "Finetune.prompt_template or prompt_tokens); use /v1/completions")
    fields = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
    if len(fields) != 1:
        return None, (f"this model's prompt template {template!r} has {len(fields)} fields; a chat message fills "
                      "one: use /v1/completions")
    return template.format(**{fields.pop(): last.content}), ""


def chat_chunk(cid: str, model: str, choices: list[dict], usage: Optional[dict]) -> dict[str, Any]:
    """A ``chat.completion.chunk`` from completion choices (``index``, ``text``, ``finish_reason``)."""
    body: dict[str, Any] = {"id": cid, "object": "chat.completion.chunk", "created": int(time.time()),
                            "model": model,
                            "choices": [{"index": c["index"], "delta": {"role": "assistant", "content": c["text"]},
                                         "finish_reason": c["finish_reason"]} for c in choices]}
    if usage is not None:
        body["usage"] = usage
    return body


def chat_body(cid: str, model: str, choices: list[dict], usage: Optional[dict]) -> dict[str, Any]:
    """A ``chat.completion`` object from completion choices."""
    return {"id": cid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": c["index"], "message": {"role": "assistant", "content": c["text"]},
                         "finish_reason": c["finish_reason"]} for c in choices], "usage": usage}


class TokenizeRequest(BaseModel):
    """``POST /tokenize`` (vLLM's): the model's tokenizer on ``prompt``; special tokens written
    in the text (``<|endoftext|>``) are their ids, as vLLM's."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: Optional[str] = Field(None, description="must name the served model when given")
    prompt: str = Field(description="the text to tokenize")
    add_special_tokens: bool = Field(True, description="accepted; this tokenizer adds no BOS or EOS")


class TokenizeResponse(BaseModel):
    """The token ids of the prompt."""

    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(BaseModel):
    """``POST /detokenize`` (vLLM's): the text of token ids."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: Optional[str] = Field(None, description="must name the served model when given")
    tokens: list[Annotated[int, Field(ge=0)]] = Field(description="token ids in [0, vocab)")


class DetokenizeResponse(BaseModel):
    """The text of the token ids."""

    prompt: str


class TokenizerInfo(BaseModel):
    """``GET /tokenizer_info`` (vLLM's fields that lm-evaluation-harness reads)."""

    tokenizer_class: str
    eos_token: Optional[str]
    bos_token: Optional[str]
    pad_token: Optional[str]
    model_max_length: int
    vocab_size: int


# Response bodies: documented in the OpenAPI schema (``app.py``), built as plain dicts.
class Usage(BaseModel):
    """Token counts of a request."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class LogprobsBody(BaseModel):
    """OpenAI's ``logprobs`` of one choice: one entry per token (``top_logprobs``: the top
    alternatives and the chosen token, token text -> log-probability)."""

    tokens: list[str]
    token_logprobs: list[Optional[float]]
    top_logprobs: list[Optional[dict[str, float]]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    """One choice (or, streamed, one piece of it)."""

    index: int
    text: str
    logprobs: Optional[LogprobsBody]
    finish_reason: Optional[Literal["stop", "length"]]
    token_ids: list[int] = Field(description="extra: the generated token ids (EOS included when produced)")


class CompletionResponse(BaseModel):
    """A ``text_completion`` object: the whole response, or one server-sent event's chunk."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None


class ChatReply(BaseModel):
    """The assistant's message."""

    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    """One choice of a chat completion."""

    index: int
    message: ChatReply
    finish_reason: Optional[Literal["stop", "length"]]


class ChatCompletionResponse(BaseModel):
    """A ``chat.completion`` object."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    """The served model."""

    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int = Field(description="the model's context in tokens")


class ModelList(BaseModel):
    """``GET /v1/models``."""

    object: Literal["list"]
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    """What went wrong: ``param`` names the request field at fault, when one is."""

    message: str
    type: Literal["invalid_request_error", "server_error"]
    param: Optional[str]
    code: Optional[str]


class ErrorResponse(BaseModel):
    """OpenAI's error object, the body of every 4xx and 5xx answer."""

    error: ErrorDetail


class Health(BaseModel):
    """``GET /health``: 200 ``ok`` once the model serves, else 503 ``loading`` or ``error``."""

    status: Literal["ok", "loading", "error"]
    model: Optional[str] = None
    decoder: Optional[str] = Field(None, description="the batch decoder: SlotDecoder or BatchDecoder")
    message: Optional[str] = Field(None, description="why the model failed to load")


def error_body(message: str, param: Optional[str] = None, kind: str = "invalid_request_error",
               code: Optional[str] = None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


UNION_TAG = re.compile(r"^(constrained-)?(str|int|float|bool)$|^[\w-]+\[.*\]$")  # pydantic's union member names
TYPE_ERRORS = {"string_type", "list_type", "int_type", "float_type", "bool_type", "dict_type", "model_type"}


def _field_path(loc: tuple) -> tuple:
    """A pydantic error location without FastAPI's leading "body" nor union member names."""
    loc = loc[1:] if loc[:1] == ("body",) else loc
    return loc[:1] + tuple(x for x in loc[1:] if not (isinstance(x, str) and UNION_TAG.match(x)))


def validation_message(errors: list[dict]) -> tuple[str, Optional[str]]:
    """One line naming every invalid field of a request body, and the first field's name.
    ``errors``: pydantic's (or FastAPI's, whose locations start with "body") error list."""
    # A union (``prompt``) fails once per member: where a field failed for more than a type
    # mismatch (a lone surrogate, a bound), its type mismatches are left out.
    specific = {_field_path(tuple(e.get("loc", ())))[:1] for e in errors if e.get("type") not in TYPE_ERRORS}
    parts, first = [], None
    for err in errors:
        loc = _field_path(tuple(err.get("loc", ())))
        if err.get("type") == "json_invalid":
            error = (err.get("ctx") or {}).get("error", "invalid JSON")
            return f"malformed JSON body: {error} (at character {loc[0] if loc else '?'})", None
        if not loc:  # the body itself: not an object (or no body)
            return "the body must be a JSON object with the request's fields", None
        if err.get("type") in TYPE_ERRORS and loc[:1] in specific:
            continue
        field = str(loc[0])
        first = first or field
        msg = "unknown field" if err.get("type") == "extra_forbidden" else err.get("msg", "invalid")
        parts.append(f"{'.'.join(str(x) for x in loc)}: {msg}")
    unique = list(dict.fromkeys(parts))
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

    def add(self, token_id: int, logprob: Optional[float], top: Optional[list[tuple[int, float]]]) -> dict:
        """Append one token; returns the object for that token alone (a streamed chunk's).
        ``logprob`` and ``top`` None: a prompt's first token (nothing before it to predict it)."""
        text = self.token_text(token_id)
        alternatives = None
        if top is not None:
            alternatives = {self.token_text(i): lp for i, lp in top}
            alternatives.setdefault(text, logprob)
        one = {"tokens": [text], "token_logprobs": [logprob], "top_logprobs": [alternatives],
               "text_offset": [self.offset]}
        self.offset += len(text)
        for key, values in one.items():
            self.data[key].extend(values)
        return one

    def add_prompt(self, prompt: list[int], logprobs: list[float], top: list[list[tuple[int, float]]]) -> dict:
        """Append the echoed prompt's tokens (the first with null entries); returns their object."""
        start = {key: len(values) for key, values in self.data.items()}
        for i, token_id in enumerate(prompt):
            self.add(token_id, logprobs[i - 1] if i else None, top[i - 1] if i else None)
        return {key: values[start[key]:] for key, values in self.data.items()}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
