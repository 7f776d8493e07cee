"""`gptc serve`: an OpenAI-compatible HTTP server with continuous batching.

``engine.py`` (the one loop that owns the backend and schedules requests), ``decoder.py`` (the
interface of a batch decoder: sequences join and leave a running decode batch), ``batch.py``
(the decoder that merges caches, any backend) and ``slots.py`` (the decoder of the fused
program's in-place slot cache), ``protocol.py`` (request/response models), ``openapi.py`` (the
schema), ``metrics.py`` (Prometheus), ``app.py`` (the FastAPI application). The ``Serve``
config section is ``config/``'s, pure Python; this package's ``__init__`` imports nothing, so
reading the config stays free of FastAPI and Paddle.
"""
