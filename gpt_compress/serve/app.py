"""The FastAPI application: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/health``, ``/metrics`` and
vLLM's ``/tokenize``, ``/detokenize``, ``/tokenizer_info``. Request bodies are the pydantic
models of ``protocol.py``, validated before a handler runs (400 naming the field); the OpenAPI
schema (``openapi.py``) documents every field, status and content type.

The model loads in a background thread after the server starts listening: ``/health``
answers 503 ``{"status": "loading"}`` until the engine runs, then 200. Every endpoint but
``/health`` needs ``Authorization: Bearer <key>`` when an API key is set.

A request becomes one engine ``Request`` per prompt and choice (``n``); their events come
back from the engine thread through ``loop.call_soon_threadsafe`` into an asyncio queue.
A streaming client that disconnects cancels its requests (the engine drops them before its
next step); a non-streaming one is noticed within ``DISCONNECT_POLL`` seconds.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from typing import Callable, Optional

from fastapi import FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException

from ..errors import ConfigError, GptcError, InputError
from ..config import ServeConfig
from ..model.generation import best_candidates, check_logit_bias
from .engine import Engine, EngineStopped, QueueFull
from .request import Failed, Finished, PromptScored, Request, Token, request_config
from .metrics import Metrics
from .openapi import ERRORS, SSE_EVENT, TOKENIZER_ERRORS, describe, errors
from .protocol import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest, CompletionResponse,
                       DetokenizeRequest, DetokenizeResponse, Health, Logprobs, ModelList, TokenizeRequest,
                       TokenizeResponse, TokenizerInfo, chat_body, chat_chunk, chat_prompt, completion_body,
                       completion_id, error_body, usage, validation_message)

log = logging.getLogger("gptc.serve")
DISCONNECT_POLL = 0.5  # seconds between disconnect checks of a non-streaming request


class ApiError(Exception):
    """An error answered as OpenAI's error object with an HTTP status."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers


def _error(status: int, message: str, param: Optional[str] = None, headers=None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    # A message may quote the request (a field name, a model id): lone surrogates escaped, so
    # that the UTF-8 body can always be written.
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    return JSONResponse(error_body(message, param, kind), status_code=status, headers=headers)


class AuthAndCount:
    """The API key check and the request counter, as plain ASGI middleware: the endpoints get the
    server's own ``receive``, so a non-streaming request sees its client's disconnect
    (``request.is_disconnected``). Starlette's ``@app.middleware("http")`` hands them a
    ``receive`` that never reports it, and a request whose client had left ran to its end."""

    def __init__(self, app, state: "State", endpoint: Callable[[str], str]):
        self.app, self.state, self.endpoint = app, state, endpoint

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        requests = self.state.metrics.requests
        if self.state.api_key and path != "/health":
            header = dict(scope.get("headers") or ()).get(b"authorization", b"").decode("latin-1")
            if header != f"Bearer {self.state.api_key}":
                requests.labels(endpoint=self.endpoint(path), status="401").inc()
                response = _error(401, "missing or wrong API key: send 'Authorization: Bearer <key>'")
                return await response(scope, receive, send)

        async def counted(message):
            if message["type"] == "http.response.start" and path.startswith("/v1/"):
                requests.labels(endpoint=self.endpoint(path), status=str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counted)


class State:
    """What the endpoints share: the loaded generator and engine (None while loading)."""

    def __init__(self, cfg: ServeConfig, model_name: str, api_key: str):
        self.cfg, self.model_name, self.api_key = cfg, model_name, api_key
        self.metrics = Metrics()
        self.engine: Optional[Engine] = None
        self.load_error: Optional[str] = None
        self.created = int(time.time())


def create_app(load: Callable[[], object], cfg: ServeConfig, model_name: str, api_key: str = "",
               on_fatal: Optional[Callable[[str], None]] = None) -> FastAPI:
    """The application. ``load()`` returns a ``Generator`` (called on a background thread at
    startup); ``on_fatal(message)`` is called if it fails (the command stops the server)."""
    state = State(cfg, model_name, api_key)

    def loader():
        try:
            gen = load()
            gen.generate([[0]], max_new_tokens=2)  # creates the predictors before the first request
            state.engine = Engine(gen, cfg.max_batch, cfg.max_queue, state.metrics, cfg.step_delay,
                                  cfg.prefill_budget, cfg.admit_wait_steps, cfg.speculative_tokens,
                                  cfg.draft or None, cfg.greedy_run_ms).start()
            log.info("model %s loaded; serving", model_name)
        except Exception as e:  # GptcError for a bad directory, anything else from the backend
            state.load_error = f"{type(e).__name__}: {e}" if not isinstance(e, GptcError) else str(e)
            log.error("could not load the model: %s", state.load_error)
            if on_fatal is not None:
                on_fatal(state.load_error)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        threading.Thread(target=loader, name="gptc-load", daemon=True).start()
        yield
        if state.engine is not None:
            state.engine.stop()

    app = FastAPI(title="gpt-compress", lifespan=lifespan)
    app.state.serve = state

    routes: set = set()  # the served paths; any other path is counted as "unknown", so a client
    # sending random paths cannot grow the metrics' label sets without bound

    def endpoint(path: str) -> str:
        if not routes:
            routes.update(route.path for route in app.routes if isinstance(route, APIRoute))
        return path if path in routes else "unknown"

    app.add_middleware(AuthAndCount, state=state, endpoint=endpoint)

    @app.exception_handler(ApiError)
    async def api_error(request, e: ApiError):
        return _error(e.status, e.message, e.param, e.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request, e: RequestValidationError):
        if isinstance(e.body, bytes) and e.body:  # not parsed: not sent as JSON (FastAPI's strict content type)
            got = request.headers.get("content-type") or "no Content-Type"
            return _error(415, f"send the body as JSON with 'Content-Type: application/json' (got {got})")
        message, field = validation_message(list(e.errors()))
        return _error(400, message, field)

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):  # unknown path (404), wrong method (405)
        return _error(e.status_code, f"{request.method} {request.url.path}: {e.detail}", headers=e.headers)

    @app.get("/health", response_model=None, responses={200: {"model": Health}, 503: {
        "model": Health, "description": "the model is loading, or failed to load"}})
    async def health():
        """Whether the model serves (no API key needed)."""
        if state.engine is not None:
            return {"status": "ok", "model": model_name, "decoder": type(state.engine.batch).__name__}
        if state.load_error is not None:
            return JSONResponse({"status": "error", "message": state.load_error}, status_code=503)
        return JSONResponse({"status": "loading"}, status_code=503)

    @app.get("/metrics", response_class=PlainTextResponse, responses={
        200: {"content": {"text/plain": {"schema": {"type": "string"}}},
              "description": "Prometheus text exposition format"}, **errors(401)})
    async def metrics():
        """The server's Prometheus metrics."""
        return Response(state.metrics.render(), media_type=state.metrics.content_type)

    @app.get("/v1/models", response_model=None, responses={200: {"model": ModelList}, **errors(401, 503)})
    async def models():
        """The served model (OpenAI's list of models)."""
        engine = _engine(state)
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": state.created,
                                            "owned_by": "gpt-compress",
                                            "max_model_len": engine.gen.max_positions}]}

    @app.post("/tokenize", response_model=None, responses={200: {"model": TokenizeResponse}, **TOKENIZER_ERRORS})
    async def tokenize(req: TokenizeRequest):
        """vLLM's tokenizer endpoint: lets clients (lm-evaluation-harness) tokenize remotely."""
        engine = _served(state, req.model)
        ids = _tokenizer(engine).encode(req.prompt, allow_special=True)
        return {"count": len(ids), "max_model_len": engine.gen.max_positions, "tokens": ids}

    @app.post("/detokenize", response_model=None, responses={200: {"model": DetokenizeResponse}, **TOKENIZER_ERRORS})
    async def detokenize(req: DetokenizeRequest):
        """vLLM's detokenizer endpoint: the text of token ids."""
        engine = _served(state, req.model)
        tok = _tokenizer(engine)
        bad = [t for t in req.tokens if t >= engine.gen.vocab_size]
        if bad:
            raise ApiError(400, f"token ids outside the vocabulary [0, {engine.gen.vocab_size}): {bad[:5]}", "tokens")
        return {"prompt": tok.decode(req.tokens)}

    @app.get("/tokenizer_info", response_model=None, responses={200: {"model": TokenizerInfo}, **TOKENIZER_ERRORS})
    async def tokenizer_info():
        """vLLM's tokenizer description (what lm-evaluation-harness's remote tokenizer reads)."""
        engine = _engine(state)
        tok = _tokenizer(engine)
        eod = engine.eos if engine.eos is not None else tok.eod_id  # the end-of-text token lm-eval prefixes
        eos = tok.decode([eod]) if eod is not None else None
        return {"tokenizer_class": "GPT2TokenizerFast", "eos_token": eos, "bos_token": eos, "pad_token": eos,
                "model_max_length": engine.gen.max_positions, "vocab_size": engine.gen.vocab_size}

    @app.post("/v1/completions", response_model=None, responses={
        200: {"model": CompletionResponse, "description": "the completion; with `stream`, server-sent events "
              "of CompletionResponse chunks ending with `data: [DONE]`",
              "content": {"text/event-stream": {"schema": SSE_EVENT}}}, **ERRORS})
    async def completions(req: CompletionRequest, request: HttpRequest):
        """OpenAI's (legacy) completions API."""
        engine = _served(state, req.model)
        bad = req.unsupported()
        if bad is not None:
            raise ApiError(400, bad[1], bad[0])
        candidates = req.best_of or req.n  # choices generated per prompt; the best n are returned
        if candidates > cfg.max_n:
            field = "best_of" if req.best_of else "n"
            raise ApiError(400, f"{field}={candidates} is more than this server allows (Serve.max_n={cfg.max_n})",
                           field)
        _check_bias(engine, req.token_bias())
        prompts = _encode(engine, req, cfg)
        max_tokens = _max_tokens(req, cfg)
        reqs, events = _submit(engine, req, prompts, candidates, max_tokens, cfg,
                               logprobs=req.logprobs if candidates == req.n else (req.logprobs or 0),
                               prompt_logprobs=req.logprobs if req.echo else None)  # echo + logprobs: the prompt's too
        echo = [engine.gen.tokenizer.decode(p) if req.echo and engine.tokenizer is not None else ""
                for p in prompts for _ in range(candidates)]
        prompt_tokens = sum(len(p) for p in prompts)
        logprobs = None if req.logprobs is None else [Logprobs(_token_text(engine)) for _ in reqs]
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(_stream(reqs, events, echo, model_name, prompt_tokens if include_usage else None,
                                             logprobs),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await _collect(request, reqs, events, echo, model_name, prompt_tokens, logprobs,
                              pick=(req.n, candidates) if candidates > req.n else None)

    @app.post("/v1/chat/completions", response_model=None, responses={
        200: {"model": ChatCompletionResponse, "description": "the reply; with `stream`, server-sent events of "
              "ChatCompletionChunk ending with `data: [DONE]`",
              "content": {"text/event-stream": {"schema": SSE_EVENT}}}, **ERRORS})
    async def chat_completions(req: ChatCompletionRequest, request: HttpRequest):
        """OpenAI's chat completions, for a model finetuned with a prompt format: the last user
        message becomes the prompt through the model's template (``chat_prompt``)."""
        engine = _served(state, req.model)
        text, reason = chat_prompt(engine.gen.prompt_template, engine.gen.prompt_tokens, req.messages)
        if text is None:
            raise ApiError(400, reason, "messages")
        if engine.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer: use /v1/completions with token ids", "messages")
        if req.n > cfg.max_n:
            raise ApiError(400, f"n={req.n} is more than this server allows (Serve.max_n={cfg.max_n})", "n")
        _check_bias(engine, req.token_bias())
        max_tokens = req.max_completion_tokens or req.max_tokens or cfg.max_tokens_default
        ids = engine.gen.encode(text)[0]  # fixed to prompt_tokens when the model records them
        _check_prompt(engine, 0, ids, max_tokens, req.min_tokens)
        reqs, events = _submit(engine, req, [ids], req.n, max_tokens, cfg)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(_stream(reqs, events, [""] * len(reqs), model_name,
                                             len(ids) if include_usage else None, body=chat_chunk),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await _collect(request, reqs, events, [""] * len(reqs), model_name, len(ids), body=chat_body)

    app.openapi = lambda: describe(app, state.engine, cfg)
    return app


def _served(state: State, model: Optional[str]) -> Engine:
    """The engine, when ``model`` (a request's field) is None or names the served model."""
    engine = _engine(state)
    if model is not None and model != state.model_name:
        raise ApiError(404, f"model {model!r} is not served here; this server serves {state.model_name!r}", "model")
    return engine


def _tokenizer(engine: Engine):
    if engine.tokenizer is None:
        raise ApiError(400, "this model has no tokenizer: send and read token ids")
    return engine.tokenizer


def _engine(state: State) -> Engine:
    if state.engine is None:
        raise ApiError(503, "the model is still loading" if state.load_error is None
                       else f"the model failed to load: {state.load_error}")
    return state.engine


def _encode(engine: Engine, req: CompletionRequest, cfg: ServeConfig) -> list[list[int]]:
    """Token ids of every prompt, checked against the vocabulary and the context."""
    gen = engine.gen
    prompts = req.prompts()
    if not prompts:
        raise ApiError(400, "prompt is empty", "prompt")
    max_tokens = _max_tokens(req, cfg)
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str) and gen.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer: send the prompt as token ids", "prompt")
        ids = gen.encode(p)[0] if isinstance(p, str) else [int(t) for t in p]  # text: as the model was finetuned
        _check_prompt(engine, i, ids, max_tokens, req.min_tokens)
        out.append(ids)
    return out


def _check_prompt(engine: Engine, i: int, ids: list[int], max_tokens: int, min_tokens: int) -> None:
    """400 for prompt ``i`` when it is empty, outside the vocabulary or too long for the context."""
    gen = engine.gen
    if not ids:
        raise ApiError(400, f"prompt {i} is empty: it needs at least one token", "prompt")
    bad = [t for t in ids if not 0 <= t < gen.vocab_size]
    if bad:
        raise ApiError(400, f"prompt {i} has token ids outside the vocabulary [0, {gen.vocab_size}): "
                       f"{bad[:5]}", "prompt")
    if len(ids) + max_tokens > gen.max_positions:
        raise ApiError(400, f"prompt {i} has {len(ids)} tokens and max_tokens is {max_tokens}: "
                       f"{len(ids) + max_tokens} > the model's context of {gen.max_positions} tokens",
                       "max_tokens")
    if min_tokens > max_tokens:
        raise ApiError(400, f"min_tokens={min_tokens} is more than max_tokens={max_tokens}", "min_tokens")


def _check_bias(engine: Engine, bias: dict[int, float]) -> None:
    try:
        check_logit_bias(bias, engine.gen.vocab_size)
    except InputError as e:
        raise ApiError(400, str(e), "logit_bias") from None


def _submit(engine: Engine, req, prompts: list[list[int]], count: int, max_tokens: int, cfg: ServeConfig,
            logprobs: Optional[int] = None, prompt_logprobs: Optional[int] = None):
    """Queue ``count`` choices of every prompt (choice j seeded ``seed + j``) with ``req``'s
    sampling fields (a completion or chat request); returns the engine requests, in choice
    order, and the queue of their events. 429 when the queue is full, 503 when stopping."""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    reqs = []
    for i, ids in enumerate(prompts):
        for j in range(count):
            seed = None if req.seed is None else req.seed + j
            try:
                gcfg = request_config(max(max_tokens, 1), req.temperature, req.top_p, max(req.top_k, 0),
                                      req.repetition_penalty, seed, req.min_tokens, req.presence_penalty,
                                      req.frequency_penalty, req.token_bias())
            except ConfigError as e:  # what the field constraints let through (e.g. infinity)
                raise ApiError(400, str(e)) from None
            reqs.append(Request(ids, gcfg, emit=_emitter(loop, events, i * count + j), stop=req.stop or [],
                                timeout=cfg.request_timeout, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                                generate=max_tokens > 0))
    try:
        engine.submit_all(reqs)  # every choice or none: they are admitted together
    except QueueFull as e:
        _cancel(reqs)
        raise ApiError(429, f"server busy: {e}; retry later", headers={"Retry-After": "1"}) from None
    except EngineStopped as e:
        _cancel(reqs)
        raise ApiError(503, str(e)) from None
    return reqs, events


def _max_tokens(req: CompletionRequest, cfg: ServeConfig) -> int:
    """Tokens to generate: the request's (0 scores the prompt only), else Serve.max_tokens_default."""
    return req.max_tokens if req.max_tokens is not None else cfg.max_tokens_default


def _token_text(engine: Engine):
    """A token's own text (``token_id:N`` for a model without a tokenizer)."""
    tok = engine.tokenizer
    return (lambda i: tok.decode([i])) if tok is not None else (lambda i: f"token_id:{i}")


def _emitter(loop: asyncio.AbstractEventLoop, events: asyncio.Queue, index: int):
    """``Request.emit`` of choice ``index``: its events into ``events``, one wake-up of the loop
    per hand-over (a greedy run's tokens together)."""
    def put(batch):
        for event in batch:
            events.put_nowait((index, event))

    def emit(batch):
        try:
            loop.call_soon_threadsafe(put, batch)
        except RuntimeError:  # the event loop is closed (server stopped)
            pass
    return emit


def _cancel(reqs) -> None:
    for r in reqs:
        r.cancelled = True


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def _stream(reqs, events: asyncio.Queue, echo, model: str, prompt_tokens: Optional[int], logprobs=None,
                  body=completion_body):
    """Server-sent events: a chunk per token (or per run of tokens: a choice's tokens already
    waiting when one is sent, as a run of greedy steps makes them, share its chunk), one with
    each choice's finish_reason, the usage when ``prompt_tokens`` is given
    (``stream_options.include_usage``), then ``[DONE]``.
    ``logprobs``: a ``Logprobs`` per choice when the request asked for them; ``body`` makes a
    chunk from completion choices (``chat_chunk`` for the chat endpoint)."""
    cid = completion_id()
    open_, completion_tokens = len(reqs), 0
    try:
        for index, text in enumerate(echo):
            if text and reqs[index].prompt_logprobs is None:  # else it comes with its log-probabilities
                yield _sse(body(cid, model, [{"index": index, "text": text, "logprobs": None,
                                              "finish_reason": None}], None))
        held = None  # an event taken from the queue while merging tokens, not yet sent
        while open_:
            if held is not None:
                (index, ev), held = held, None
            else:
                index, ev = await events.get()
            if isinstance(ev, Token) and logprobs is None:  # tokens already queued go in one chunk
                pieces, ids = [ev.text], [ev.token_id]
                while not events.empty():
                    nxt = events.get_nowait()
                    if nxt[0] != index or not isinstance(nxt[1], Token):
                        held = nxt
                        break
                    pieces.append(nxt[1].text)
                    ids.append(nxt[1].token_id)
                yield _sse(body(cid, model, [{"index": index, "text": "".join(pieces), "logprobs": None,
                                              "finish_reason": None, "token_ids": ids}], None))
                continue
            if isinstance(ev, PromptScored):
                lp = logprobs[index].add_prompt(reqs[index].prompt, ev.logprobs, ev.top)
                choice = {"index": index, "text": echo[index], "logprobs": lp, "finish_reason": None,
                          "token_ids": []}
            elif isinstance(ev, Token):
                lp = None if logprobs is None else logprobs[index].add(ev.token_id, ev.logprob, ev.top)
                choice = {"index": index, "text": ev.text, "logprobs": lp, "finish_reason": None,
                          "token_ids": [ev.token_id]}
            elif isinstance(ev, Finished):
                open_ -= 1
                completion_tokens += ev.completion_tokens
                choice = {"index": index, "text": ev.text, "logprobs": None, "finish_reason": ev.reason,
                          "token_ids": []}
            else:
                yield _sse(error_body(ev.message, kind="server_error" if ev.status >= 500 else
                                      "invalid_request_error", code=str(ev.status)))
                break
            yield _sse(body(cid, model, [choice], None))
        else:
            if prompt_tokens is not None:
                yield _sse(body(cid, model, [], usage(prompt_tokens, completion_tokens)))
        yield "data: [DONE]\n\n"
    finally:
        _cancel(reqs)  # client gone (or an error): the engine drops what is still running


async def _collect(request: HttpRequest, reqs, events: asyncio.Queue, echo, model: str, prompt_tokens: int,
                   logprobs=None, pick: Optional[tuple[int, int]] = None, body=completion_body):
    """The whole response once every choice has finished (or the first failure). ``pick``
    (n, best_of): ``reqs`` holds ``best_of`` candidates per prompt, in prompt order, and the n
    best of each (``best_candidates``) are the choices. ``body`` makes the response from the
    choices (``chat_body`` for the chat endpoint)."""
    texts = list(echo)
    token_ids: list[list[int]] = [[] for _ in reqs]
    sums = [0.0] * len(reqs)  # the generated tokens' log-probabilities (best_of)
    reasons: list[Optional[str]] = [None] * len(reqs)
    completion_tokens = 0
    open_ = len(reqs)
    loop = asyncio.get_running_loop()
    check_at = loop.time() + DISCONNECT_POLL
    try:
        while open_:
            # The client is checked every DISCONNECT_POLL seconds whether or not tokens keep coming.
            try:
                index, ev = await asyncio.wait_for(events.get(), max(check_at - loop.time(), 1e-3))
            except asyncio.TimeoutError:
                ev = None
            if loop.time() >= check_at:
                if await request.is_disconnected():
                    return Response(status_code=499)
                check_at = loop.time() + DISCONNECT_POLL
            if isinstance(ev, PromptScored):
                logprobs[index].add_prompt(reqs[index].prompt, ev.logprobs, ev.top)
            elif isinstance(ev, Token):
                texts[index] += ev.text
                token_ids[index].append(ev.token_id)
                sums[index] += ev.logprob or 0.0
                if logprobs is not None:
                    logprobs[index].add(ev.token_id, ev.logprob, ev.top)
            elif isinstance(ev, Finished):
                texts[index] += ev.text
                reasons[index] = ev.reason
                completion_tokens += ev.completion_tokens
                open_ -= 1
            elif isinstance(ev, Failed):
                return _error(ev.status, ev.message)
    finally:
        _cancel(reqs)
    order = list(range(len(reqs)))
    if pick is not None:
        n, group = pick
        order = [start + j for start in range(0, len(reqs), group)
                 for j in best_candidates(sums[start:start + group], [len(t) for t in token_ids[start:start + group]], n)]
    choices = [{"index": k, "text": texts[i], "logprobs": None if logprobs is None else logprobs[i].data,
                "finish_reason": reasons[i], "token_ids": token_ids[i]} for k, i in enumerate(order)]
    return JSONResponse(body(completion_id(), model, choices, usage(prompt_tokens, completion_tokens)))
