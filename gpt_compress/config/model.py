"""Config sections of the model and the run: ``Global`` and ``Model`` (with the named sizes,
``PRESETS``). Registered in ``config/__init__.py``; import them from ``gpt_compress.config``."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from .parse import build_section, suggest
from ..errors import ConfigError


@dataclass
class GlobalConfig:
    """Run-wide settings."""

    seed: int = 1234  # seeds Python, numpy and Paddle
    device: str = "cpu"  # "cpu" or "gpu"
    output_dir: str = "output"  # where a command writes its results
    num_threads: int = 0  # CPU math threads; 0 keeps OMP_NUM_THREADS


@dataclass
class ModelConfig:
    """Shape and behaviour of the one GPT model (pre-LN decoder, learned positions)."""

    name: str = "custom"  # preset this config came from, informational
    vocab_size: int = 50304  # padded to a multiple of 64 like Megatron/FleetX
    hidden_size: int = 768
    num_layers: int = 12
    num_attention_heads: int = 12  # heads of an unpruned layer
    head_dim: Optional[int] = None  # None: hidden_size // num_attention_heads
    ffn_hidden_size: Optional[int] = None  # None: 4 * hidden_size
    layer_num_heads: Optional[list[int]] = None  # per-layer heads (structured pruning)
    layer_ffn_sizes: Optional[list[int]] = None  # per-layer FFN width (structured pruning)
    max_position_embeddings: int = 1024
    hidden_act: str = "gelu_new"  # "gelu_new" (tanh approx., GPT-2), "gelu" (erf) or "relu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    layer_norm_epsilon: float = 1e-5
    initializer_range: float = 0.02
    scaled_output_init: bool = True  # std / sqrt(2 * num_layers) on residual projections
    tie_word_embeddings: bool = True  # LM head shares the token embedding
    recompute: str = "none"  # "none", "full", "full_attn" or "core_attn"
    use_sdpa: bool = True  # paddle's scaled_dot_product_attention for unmasked causal passes
    eos_token_id: int = 50256
    pad_token_id: int = 50256
    num_labels: int = 2  # sequence-classification head size (1 = regression)

    def __post_init__(self) -> None:
        if self.hidden_act not in ("gelu_new", "gelu", "relu"):
            raise ConfigError(f"Model.hidden_act must be gelu_new, gelu or relu, got {self.hidden_act!r}")
        if self.recompute not in ("none", "full", "full_attn", "core_attn"):
            raise ConfigError(
                f"Model.recompute must be none, full, full_attn or core_attn, got {self.recompute!r}")
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"Model.hidden_size {self.hidden_size} is not divisible by "
                f"num_attention_heads {self.num_attention_heads}; set Model.head_dim explicitly")
        for key in ("layer_num_heads", "layer_ffn_sizes"):
            val = getattr(self, key)
            if val is not None and len(val) != self.num_layers:
                raise ConfigError(f"Model.{key} has {len(val)} entries but num_layers is {self.num_layers}")
            if val is not None and min(val) < 1:
                raise ConfigError(f"Model.{key} entries must be >= 1, got {val}")

    # Derived sizes -------------------------------------------------------------------
    @property
    def dim_head(self) -> int:
        """Width of one attention head."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def ffn_size(self) -> int:
        """FFN width of an unpruned layer."""
        return self.ffn_hidden_size or 4 * self.hidden_size

    def heads(self, layer: int) -> int:
        """Number of attention heads of layer ``layer``."""
        return self.layer_num_heads[layer] if self.layer_num_heads else self.num_attention_heads

    def ffn(self, layer: int) -> int:
        """FFN width of layer ``layer``."""
        return self.layer_ffn_sizes[layer] if self.layer_ffn_sizes else self.ffn_size

    def num_parameters(self, include_embeddings: bool = True) -> int:
        """Exact parameter count, computed without allocating anything."""
        h, d = self.hidden_size, self.dim_head
        total = 2 * h  # ln_f
        for i in range(self.num_layers):
            nh, f = self.heads(i), self.ffn(i)
            total += 4 * h  # ln_1, ln_2
            total += h * 3 * nh * d + 3 * nh * d  # qkv
            total += nh * d * h + h  # attention output projection
            total += h * f + f + f * h + h  # MLP
        if include_embeddings:
            total += (self.vocab_size + self.max_position_embeddings) * h
            if not self.tie_word_embeddings:
                total += self.vocab_size * h
        return total

    def to_dict(self) -> dict:
        """Plain dict (JSON/YAML friendly)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict, source: str = "<dict>") -> "ModelConfig":
        """Build from a plain dict, rejecting unknown keys by name."""
        return build_section(cls, dict(data), f"{source}: Model")

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> "ModelConfig":
        """A named size (see ``PRESETS``) with optional field overrides."""
        if name not in PRESETS:
            raise ConfigError(f"unknown model preset {name!r}{suggest(name, PRESETS)}; "
                              f"choose one of {', '.join(PRESETS)}")
        return cls.from_dict({**PRESETS[name], "name": name, **overrides}, source=f"preset {name}")


# Sizes users know. GPT-3 family as in the GPT-3 paper (Table 2.1) and ModelScope's table;
# vocab padded to 50304 as Megatron/FleetX do. gpt2-small keeps GPT-2's real vocabulary.
PRESETS: dict[str, dict] = {
    "gpt-tiny": dict(vocab_size=1024, hidden_size=64, num_layers=2, num_attention_heads=4,
                     max_position_embeddings=128),
    "gpt-test": dict(vocab_size=4096, hidden_size=128, num_layers=4, num_attention_heads=4,
                     max_position_embeddings=256),
    "gpt-bench": dict(vocab_size=50304, hidden_size=384, num_layers=6, num_attention_heads=6,
                      max_position_embeddings=1024),
    "gpt2-small": dict(vocab_size=50257, hidden_size=768, num_layers=12, num_attention_heads=12,
                       max_position_embeddings=1024),
    "gpt-345M": dict(vocab_size=50304, hidden_size=1024, num_layers=24, num_attention_heads=16,
                     max_position_embeddings=1024),
    "gpt-1.3B": dict(vocab_size=50304, hidden_size=2048, num_layers=24, num_attention_heads=16,
                     max_position_embeddings=2048),
    "gpt-2.7B": dict(vocab_size=50304, hidden_size=2560, num_layers=32, num_attention_heads=32,
                     max_position_embeddings=2048),
    "gpt-6.7B": dict(vocab_size=50304, hidden_size=4096, num_layers=32, num_attention_heads=32,
                     max_position_embeddings=2048),
    "gpt-13B": dict(vocab_size=50304, hidden_size=5120, num_layers=40, num_attention_heads=40,
                    max_position_embeddings=2048),
    "gpt-175B": dict(vocab_size=50304, hidden_size=12288, num_layers=96, num_attention_heads=96,
                     max_position_embeddings=2048),
}
