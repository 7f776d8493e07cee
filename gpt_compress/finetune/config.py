"""The ``Finetune`` config section (with its ``lora`` subsection). Pure Python, no Paddle, so
``gpt_compress.config`` can register it as a section."""
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
    prompt_field: str = ""  # "": "src", else "src_txt"
    response_field: str = ""  # "": "tgt", else "tgt_txt"; a row without one is continuation text
    text_field: str = ""  # continuation rows: "": "text", else "src_txt" (when no response field exists)
    prompt_template: str = ""  # e.g. "《{title}》{author}\n": the prompt built from the row's fields
    batching: str = "pack"  # "pack": examples packed into full rows, no attention across them; "group": length-grouped padding
    epochs: float = 0.0  # > 0: train this many epochs (sets Engine.max_steps)
    max_train_examples: int = 0  # use only the first N training examples (0: all)
    eval_generate: int = 32  # evaluation examples to generate for (BLEU/chrF/ROUGE-L/exact match); 0: none
    log_generations: int = 3  # generations written to the log (and the summary)
    lora: LoraConfig = field(default_factory=LoraConfig)

    def __post_init__(self) -> None:
        if self.batching not in BATCHING:
            raise ConfigError(f"Finetune.batching must be pack or group, got {self.batching!r}")
        for key in ("epochs", "eval_holdout", "max_train_examples", "eval_generate", "log_generations"):
            if getattr(self, key) < 0:
                raise ConfigError(f"Finetune.{key} must be >= 0, got {getattr(self, key)}")
