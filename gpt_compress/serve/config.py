"""The ``Serve`` section of the YAML config: how `gptc serve` listens, batches and limits.

Pure Python (no FastAPI, no Paddle), so ``config.py`` can import it like the other sections."""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError


@dataclass
class ServeConfig:
    """`gptc serve` settings; command-line flags override them."""

    backend: str = "paddle"  # "paddle" (Paddle Inference) or "onnx" (onnxruntime)
    host: str = "127.0.0.1"  # loopback by default: put a proxy in front to expose it
    port: int = 8000
    model_name: str = ""  # the id /v1/models reports and requests may name; "": the directory's name
    max_batch: int = 16  # sequences decoded together (continuous batching); 1 serves one at a time
    max_queue: int = 64  # requests waiting for a batch slot; more get 429 with Retry-After
    prefill_budget: int = 256  # prompt tokens prefilled between two decode steps (at least one request)
    admit_wait_steps: int = 4  # decode steps a lone arrival may wait for others to join a large batch with it
    request_timeout: float = 300.0  # seconds a request may take (queued + generating); 0: no limit
    max_tokens_default: int = 16  # max_tokens of a request that gives none (as OpenAI)
    max_n: int = 8  # most choices (n) per prompt
    api_key_env: str = "GPTC_API_KEY"  # environment variable holding the API key ("" or unset: no key)
    grace_period: float = 30.0  # seconds SIGTERM waits for in-flight requests before exiting
    threads: int = 0  # CPU threads of every program (0: the backend's measured defaults)
    step_delay: float = 0.0  # seconds slept after each decode step: keeps requests in flight in tests/demos

    def __post_init__(self) -> None:
        if self.backend not in ("paddle", "onnx"):
            raise ConfigError(f"Serve.backend must be paddle or onnx, got {self.backend!r}")
        for key in ("max_batch", "max_n", "max_tokens_default", "prefill_budget"):
            if getattr(self, key) < 1:
                raise ConfigError(f"Serve.{key} must be >= 1, got {getattr(self, key)}")
        for key in ("max_queue", "admit_wait_steps"):
            if getattr(self, key) < 0:
                raise ConfigError(f"Serve.{key} must be >= 0, got {getattr(self, key)}")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"Serve.port must be in [0, 65535], got {self.port}")
        for key in ("request_timeout", "grace_period", "step_delay"):
            if getattr(self, key) < 0:
                raise ConfigError(f"Serve.{key} must be >= 0, got {getattr(self, key)}")
