"""`gptc serve`: an OpenAI-compatible HTTP server with continuous batching.

``config.py`` (the ``Serve`` section, pure Python), ``batch.py`` (the batch decoder: sequences
join and leave a running decode batch), ``engine.py`` (the one loop that owns the backend and
schedules requests), ``protocol.py`` (request/response models), ``metrics.py`` (Prometheus),
``app.py`` (the FastAPI application). This package's ``__init__`` imports nothing, so reading
the config stays free of FastAPI and Paddle.
"""
