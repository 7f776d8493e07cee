"""The server's OpenAPI schema (``GET /openapi.json``): FastAPI's, from the request and response
models of ``protocol.py``, with what FastAPI cannot know.

* Every status the server answers, with OpenAI's error object as the body (``ERRORS``); FastAPI's
  own 422 is gone (a request that fails validation gets 400).
* Once the model is loaded, the bounds that depend on it: token ids in ``[0, vocab)``,
  ``max_tokens`` and ``min_tokens`` below the context, ``n`` up to ``Serve.max_n``. A request
  the schema allows can still get a 400 when its prompt's tokens plus ``max_tokens`` exceed
  the context (JSON Schema cannot relate two fields).

So a fuzzer or a generated client learns from the schema what the handler accepts.
"""
from __future__ import annotations

from typing import Optional

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from .protocol import ErrorResponse

STATUS = {
    400: "the request is invalid: the message names the field and the problem",
    401: "missing or wrong API key (when the server has one): send 'Authorization: Bearer <key>'",
    404: "the request names a model this server does not serve",
    415: "the body was not sent as JSON (Content-Type: application/json)",
    429: "the waiting queue is full: retry after Retry-After seconds",
    500: "the request failed inside the engine (the server goes on serving others)",
    503: "the model is still loading, failed to load, or the server is shutting down",
    504: "the request ran past the server's timeout (--timeout)",
}


SSE_EVENT = {  # one server-sent event of a streamed answer
    "type": "object", "required": ["data"],
    "properties": {"data": {"type": "string", "description": "a CompletionResponse chunk as JSON, an ErrorResponse "
                            "(the request failed while streaming), or `[DONE]` (the last event)"}}}


def errors(*statuses: int) -> dict:
    """FastAPI ``responses`` entries for these statuses, each with the error body's schema."""
    out = {}
    for status in statuses:
        out[status] = {"description": STATUS[status], "content": {"application/json": {"schema": {
            "$ref": "#/components/schemas/ErrorResponse"}}}}  # JSON whatever the route's own type
        if status == 429:
            out[status]["headers"] = {"Retry-After": {"description": "seconds to wait",
                                                      "schema": {"type": "integer"}}}
    return out


# A generating endpoint answers all of these; 499 is logged when a client leaves before its
# non-streamed answer (nobody receives it).
ERRORS = {**errors(400, 401, 404, 415, 429, 500, 503, 504),
          499: {"description": "the client closed the connection before the answer (logged only)"}}
TOKENIZER_ERRORS = errors(400, 401, 404, 415, 503)


def describe(app: FastAPI, engine, cfg) -> dict:
    """The schema, with the loaded model's bounds once ``engine`` is not None (cached per state)."""
    key = engine is not None
    cached: Optional[tuple] = getattr(app.state, "openapi", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    schema = get_openapi(title=app.title, version="1", routes=app.routes,
                         description="OpenAI-compatible API of `gptc serve`")
    for path in schema["paths"].values():
        for op in path.values():
            op.get("responses", {}).pop("422", None)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    error = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
    components.update(error.pop("$defs", {}))
    components["ErrorResponse"] = error
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    if engine is not None:
        _bound(components, engine.gen.vocab_size, engine.gen.max_positions, cfg.max_n)
    app.state.openapi = (key, schema)
    return schema


def _bound(components: dict, vocab: int, context: int, max_n: int) -> None:
    """Put the model's limits into the request schemas (see the module docstring)."""
    for name, ids in (("CompletionRequest", "prompt"), ("DetokenizeRequest", "tokens"),
                      ("ChatCompletionRequest", None)):
        props = components.get(name, {}).get("properties", {})
        for node in _walk(props.get(ids, {})):
            if node.get("type") == "integer":
                node["maximum"] = vocab - 1
        for field in ("max_tokens", "min_tokens", "max_completion_tokens"):
            for node in _walk(props.get(field, {})):
                if node.get("type") == "integer":
                    node["maximum"] = context - 1
        for field in ("n", "best_of"):
            for node in _walk(props.get(field, {})):
                if node.get("type") == "integer":
                    node["maximum"] = max_n


def _walk(node):
    """Every schema node under ``node`` (anyOf branches, array items), ``node`` included."""
    yield node
    for sub in node.get("anyOf", []):
        yield from _walk(sub)
    if isinstance(node.get("items"), dict):
        yield from _walk(node["items"])
