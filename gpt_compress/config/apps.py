"""Config sections of the application commands: ``Finetune`` (with its ``lora`` subsection) and
``Serve``. Pure Python (no Paddle, no FastAPI): the packages that use them (finetune/, serve/)
import them from ``gpt_compress.config``, which imports none of those packages."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import ConfigError

BATCHING = ("pack", "group")


@dataclass
class LoraConfig:
    """LoRA adapters (``W x + (alpha / rank) * B A x``) on the Linear layers chosen by name globs."""

    enabled: bool = False  # train adapters only (the base weights stay frozen)
    rank: int = 8  # inner dimension r of each adapter
    alpha: float = 16.0  # the adapter's output is scaled by alpha / rank
    dropout: float = 0.0  # dropout on the adapter's input while training
    targets: list[str] = field(default_factory=lambda: ["gpt.blocks.*"])  # Linear layers (fnmatch globs)
    skip: list[str] = field(default_factory=list)  # never adapted, even when a target matches

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ConfigError(f"Finetune.lora.rank must be >= 1, got {self.rank}")
        if self.alpha <= 0:
            raise ConfigError(f"Finetune.lora.alpha must be > 0, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"Finetune.lora.dropout must be in [0, 1), got {self.dropout}")


@dataclass
class FinetuneConfig:
    """`gptc finetune`: JSONL prompt/response (or text-only) data, loss on the response tokens."""

    train_file: str = ""  # JSONL, one object a line
    eval_file: str = ""  # JSONL in the same layout; "" evaluates nothing (unless eval_holdout)
    eval_holdout: int = 0  # with no eval_file: the last N rows of train_file are held out for evaluation
    eval_shuffle_seed: int = -1  # >= 0: shuffle train_file's rows with this seed before holding out (sorted files)
    prompt_field: str = ""  # "": "src", else "src_txt"
    response_field: str = ""  # "": "tgt", else "tgt_txt"; a row without one is continuation text
    text_field: str = ""  # continuation rows: "": "text", else "src_txt" (when no response field exists)
    prompt_template: str = ""  # e.g. "《{title}》{author}\n": the prompt built from the row's fields
    prompt_tokens: int = 0  # > 0: prompts left-filled with EOD (or cut at the start) to this many tokens (finetune/data.py)
    batching: str = "pack"  # "pack": examples packed into full rows, no attention across them; "group": length-grouped padding
    epochs: float = 0.0  # > 0: train this many epochs (sets Engine.max_steps)
    max_train_examples: int = 0  # use only the first N training examples (0: all)
    eval_generate: int = 32  # evaluation examples to generate for (BLEU/chrF/ROUGE-L/exact match); 0: none
    log_generations: int = 3  # generations written to the log (and the summary)
    lora: LoraConfig = field(default_factory=LoraConfig)

    def __post_init__(self) -> None:
        if self.batching not in BATCHING:
            raise ConfigError(f"Finetune.batching must be pack or group, got {self.batching!r}")
        for key in ("epochs", "eval_holdout", "max_train_examples", "eval_generate", "log_generations", "prompt_tokens"):
            if getattr(self, key) < 0:
                raise ConfigError(f"Finetune.{key} must be >= 0, got {getattr(self, key)}")
        _check_template(self.prompt_template)


def _check_template(template: str) -> None:
    """Refuse a ``Finetune.prompt_template`` that ``str.format(**row)`` cannot apply: a brace left
    open or unmatched (``{title``), or a field without a name (``{}``, ``{0}``)."""
    import string

    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    except ValueError as e:
        raise ConfigError(f"Finetune.prompt_template {template!r} is not a valid template ({e}); write fields "
                          "as {name} and a literal brace as {{ or }}") from None
    for f in fields:
        if not f or f.isdigit():
            raise ConfigError(f"Finetune.prompt_template {template!r}: every field needs the name of a row "
                              f"field, like {{title}}, not {{{f}}}")


@dataclass
class ServeConfig:
    """`gptc serve` settings; command-line flags override them."""

    backend: str = "paddle"  # "paddle" (Paddle Inference) or "onnx" (onnxruntime)
    host: str = "127.0.0.1"  # loopback by default: put a proxy in front to expose it
    port: int = 8000
    model_name: str = ""  # the id /v1/models reports and requests may name; "": the directory's name
    max_batch: int = 16  # sequences decoded together (continuous batching); 1 serves one at a time
    max_queue: int = 64  # requests waiting for a batch slot; more get 429 with Retry-After
    prefill_budget: int = 256  # prompt tokens prefilled between two decode steps (at least one request; no limit when none runs)
    admit_wait_steps: int = 4  # steps a lone arrival may wait for others (serve/batch.py: onnx, unfused)
    speculative_tokens: int = 0  # draft tokens a request gets per step, at most (fused program); 0: 5 with a draft, else off
    draft: str = ""  # speculative decoding: "ngram" (prompt lookup), "auto" (the export's recorded draft) or an export dir
    request_timeout: float = 300.0  # seconds a request may take (queued + generating); 0: no limit
    max_tokens_default: int = 16  # max_tokens of a request that gives none (as OpenAI)
    max_n: int = 8  # most choices (n) per prompt
    api_key_env: str = "GPTC_API_KEY"  # environment variable holding the API key ("" or unset: no key)
    grace_period: float = 30.0  # seconds SIGTERM waits for in-flight requests before exiting
    threads: int = 0  # CPU threads of every program (0: the backend's measured defaults)
    greedy_run_ms: float = 25.0  # a run of greedy steps in one program call lasts about this long (8 to 32 steps)
    step_delay: float = 0.0  # seconds slept after each decode step: keeps requests in flight in tests/demos

    def __post_init__(self) -> None:
        if self.backend not in ("paddle", "onnx"):
            raise ConfigError(f"Serve.backend must be paddle or onnx, got {self.backend!r}")
        for key in ("max_batch", "max_n", "max_tokens_default", "prefill_budget"):
            if getattr(self, key) < 1:
                raise ConfigError(f"Serve.{key} must be >= 1, got {getattr(self, key)}")
        for key in ("max_queue", "admit_wait_steps", "speculative_tokens"):
            if getattr(self, key) < 0:
                raise ConfigError(f"Serve.{key} must be >= 0, got {getattr(self, key)}")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"Serve.port must be in [0, 65535], got {self.port}")
        for key in ("request_timeout", "grace_period", "step_delay", "greedy_run_ms"):
            if getattr(self, key) < 0:
                raise ConfigError(f"Serve.{key} must be >= 0, got {getattr(self, key)}")
