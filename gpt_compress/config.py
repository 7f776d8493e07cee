"""Typed configuration: dataclasses with every default in one place, YAML sections, overrides.

A YAML file has FleetX-style sections (``Global``, ``Model``, ``Data``, ``Engine``,
``Optimizer``, ``Generation``, ...). Each section maps onto one dataclass; YAML and
``-o Section.key=value`` overrides only change fields. Unknown sections or keys are errors
that name the key and suggest the closest valid one. ``Model.preset`` picks a named size
first; explicit ``Model`` keys then override it.
"""
from __future__ import annotations

from .errors import ConfigError  # noqa: F401  (re-exported)

import dataclasses
import math
import difflib
import fnmatch
import os
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

import yaml




# --------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------
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
        return _build(cls, dict(data), f"{source}: Model")

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> "ModelConfig":
        """A named size (see ``PRESETS``) with optional field overrides."""
        if name not in PRESETS:
            raise ConfigError(f"unknown model preset {name!r}{_suggest(name, PRESETS)}; "
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


@dataclass
class DataConfig:
    """Training data: Megatron-style indexed datasets and the tokenizer."""

    data_prefix: list[str] = field(default_factory=list)  # ["PREFIX"] or ["w1", "P1", "w2", "P2"]
    split: list[float] = field(default_factory=lambda: [949.0, 50.0, 1.0])  # train/valid/test
    seq_length: int = 1024  # tokens per training sample
    tokenizer_dir: str = ""  # directory holding tokenizer files; "" uses the checkpoint's
    num_workers: int = 0  # DataLoader worker processes

    def __post_init__(self) -> None:
        if self.seq_length < 1:
            raise ConfigError(f"Data.seq_length must be >= 1, got {self.seq_length}")
        if len(self.split) != 3 or any(not (math.isfinite(x) and x >= 0) for x in self.split) or not sum(self.split):
            raise ConfigError(f"Data.split must be three non-negative weights (train, valid, test), got {self.split}")


@dataclass
class LRConfig:
    """Learning-rate schedule (FleetX CosineAnnealingWithWarmupDecay semantics)."""

    decay_style: str = "cosine"  # "cosine", "linear" or "constant"
    max_lr: float = 3e-4
    min_lr: float = 3e-5
    warmup_rate: float = 0.01  # warmup steps = warmup_rate * decay_steps
    decay_steps: int = 0  # 0: Engine.max_steps

    def __post_init__(self) -> None:
        if self.decay_style not in ("cosine", "linear", "constant"):
            raise ConfigError(f"Optimizer.lr.decay_style must be cosine, linear or constant, got {self.decay_style!r}")
        if not (math.isfinite(self.max_lr) and self.max_lr > 0):
            raise ConfigError(f"Optimizer.lr.max_lr must be > 0, got {self.max_lr}")
        if not (math.isfinite(self.min_lr) and self.min_lr >= 0):
            raise ConfigError(f"Optimizer.lr.min_lr must be >= 0, got {self.min_lr}")
        if not 0 <= self.warmup_rate <= 1:
            raise ConfigError(f"Optimizer.lr.warmup_rate must be in [0, 1], got {self.warmup_rate}")
        if self.decay_steps < 0:
            raise ConfigError(f"Optimizer.lr.decay_steps must be >= 0 (0: Engine.max_steps), got {self.decay_steps}")


@dataclass
class OptimizerConfig:
    """AdamW with decoupled weight decay and global-norm clipping."""

    name: str = "AdamW"
    weight_decay: float = 0.01  # not applied to norms and biases
    beta1: float = 0.9
    beta2: float = 0.95
    epsilon: float = 1e-8
    grad_clip: float = 1.0  # global-norm clip; 0 disables
    lr: LRConfig = field(default_factory=LRConfig)


@dataclass
class EngineConfig:
    """The training loop."""

    max_steps: int = 1000
    global_batch_size: int = 8  # micro_batch_size * accumulate_steps * dp_degree
    micro_batch_size: int = 8
    eval_freq: int = 100  # steps between validation runs; 0 disables
    eval_iters: int = 10  # validation batches per evaluation
    logging_freq: int = 10
    save_steps: int = 500  # 0: only at the end
    keep_checkpoint_max: int = 3
    resume: str = ""  # "", "auto" or a checkpoint directory
    init_from: str = ""  # start from these weights (our checkpoint dir) without its state
    mix_precision: str = "fp32"  # "fp32", "bf16", "fp16" (AMP needs a GPU)
    peak_tflops: float = 0.0  # hardware peak for MFU; 0 estimates nothing
    max_loss_spike: float = 0.0  # stop if loss > spike * running mean; 0 disables (NaN always stops)
    to_static: bool = False  # run the transformer body as a static program (paddle.jit.to_static)

    def __post_init__(self) -> None:
        for key, low in (("max_steps", 1), ("global_batch_size", 1), ("micro_batch_size", 1), ("eval_freq", 0),
                         ("eval_iters", 0), ("logging_freq", 0), ("save_steps", 0), ("keep_checkpoint_max", 0)):
            if getattr(self, key) < low:
                raise ConfigError(f"Engine.{key} must be >= {low}, got {getattr(self, key)}")
        if self.global_batch_size % self.micro_batch_size:
            raise ConfigError(f"Engine.global_batch_size {self.global_batch_size} is not a multiple of "
                              f"Engine.micro_batch_size {self.micro_batch_size}")
        if self.mix_precision not in ("fp32", "bf16", "fp16"):
            raise ConfigError(f"Engine.mix_precision must be fp32, bf16 or fp16, got {self.mix_precision!r}")


@dataclass
class GenerationConfig:
    """Decoding settings shared by every backend."""

    decode_strategy: str = "greedy"  # "greedy", "sampling" or "beam_search"
    max_new_tokens: int = 32
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0  # 0 disables
    top_p: float = 1.0  # 1.0 disables
    repetition_penalty: float = 1.0  # 1.0 disables (CTRL-style, as Hugging Face)
    num_beams: int = 4
    length_penalty: float = 1.0  # beam score = logprob / generated_len ** length_penalty
    early_stopping: bool = False  # beam search: stop when num_beams hypotheses are done
    eos_token_id: Optional[int] = None  # None: the model's
    pad_token_id: Optional[int] = None  # None: the model's
    seed: Optional[int] = None  # sampling seed; None: Global.seed

    def __post_init__(self) -> None:
        if self.decode_strategy not in ("greedy", "sampling", "beam_search"):
            raise ConfigError("Generation.decode_strategy must be greedy, sampling or beam_search, "
                              f"got {self.decode_strategy!r}")
        checks = [("max_new_tokens", self.max_new_tokens >= 1, ">= 1"),
                  ("min_new_tokens", 0 <= self.min_new_tokens <= self.max_new_tokens,
                   f"in [0, max_new_tokens={self.max_new_tokens}]"),
                  ("temperature", math.isfinite(self.temperature) and self.temperature > 0,
                   "> 0 (use decode_strategy=greedy for deterministic output)"),
                  ("top_k", self.top_k >= 0, ">= 0 (0 disables)"),
                  ("top_p", 0 < self.top_p <= 1, "in (0, 1] (1 disables; use greedy for top-1)"),
                  ("repetition_penalty", math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0,
                   "> 0 (1 disables)"),
                  ("num_beams", self.num_beams >= 1, ">= 1"),
                  ("length_penalty", math.isfinite(self.length_penalty), "a finite number")]
        for key, ok, rule in checks:
            if not ok:
                raise ConfigError(f"Generation.{key} must be {rule}, got {getattr(self, key)}")


@dataclass
class PruneConfig:
    """Structured pruning: remove the least important attention heads and FFN channels."""

    head_ratio: float = 0.0  # fraction of attention heads to remove
    ffn_ratio: float = 0.0  # fraction of FFN channels to remove
    criterion: str = "taylor"  # "taylor" (|w * grad| on calibration data) or "magnitude" (weight norms)
    scope: str = "layer"  # "layer": the ratio in every layer; "global": one ranking across layers
    calib_batches: int = 8  # Taylor: micro-batches of training data that score the weights
    min_heads: int = 1  # no layer keeps fewer heads
    min_ffn: int = 1  # no layer keeps fewer FFN channels

    def __post_init__(self) -> None:
        for key in ("head_ratio", "ffn_ratio"):
            if not 0.0 <= getattr(self, key) < 1.0:
                raise ConfigError(f"Prune.{key} must be in [0, 1), got {getattr(self, key)}")
        if self.criterion not in ("taylor", "magnitude"):
            raise ConfigError(f"Prune.criterion must be taylor or magnitude, got {self.criterion!r}")
        if self.scope not in ("layer", "global"):
            raise ConfigError(f"Prune.scope must be layer or global, got {self.scope!r}")
        for key in ("calib_batches", "min_heads", "min_ffn"):
            if getattr(self, key) < 1:
                raise ConfigError(f"Prune.{key} must be >= 1, got {getattr(self, key)}")


@dataclass
class DistillConfig:
    """Knowledge distillation: a teacher's soft targets (and hidden states) train a student."""

    teacher: str = ""  # teacher checkpoint directory
    student: str = ""  # student checkpoint (e.g. `gptc prune` output); "" builds the Model section fresh
    temperature: float = 2.0  # softmax temperature of the KL term, which is scaled by T^2
    alpha: float = 0.5  # weight of the KL term; 1 - alpha weighs the LM cross-entropy
    hidden_mse_weight: float = 0.0  # weight of the hidden-state MSE; 0 disables it
    hidden_layers: list[int] = field(default_factory=list)  # student blocks matched by the MSE; []: all
    layer_map: list[int] = field(default_factory=list)  # teacher block per hidden_layers entry; []: by depth
    projection_batches: int = 4  # widths differ: micro-batches whose teacher-state PCA maps to the student width

    def __post_init__(self) -> None:
        if self.temperature <= 0:
            raise ConfigError(f"Distill.temperature must be > 0, got {self.temperature}")
        if not 0.0 <= self.alpha <= 1.0:
            raise ConfigError(f"Distill.alpha must be in [0, 1], got {self.alpha}")
        if self.hidden_mse_weight < 0:
            raise ConfigError(f"Distill.hidden_mse_weight must be >= 0, got {self.hidden_mse_weight}")
        if self.layer_map and len(self.layer_map) != len(self.hidden_layers):
            raise ConfigError(f"Distill.layer_map has {len(self.layer_map)} entries but hidden_layers has "
                              f"{len(self.hidden_layers)}; give one teacher block per student block")
        if self.projection_batches < 1:
            raise ConfigError(f"Distill.projection_batches must be >= 1, got {self.projection_batches}")


@dataclass
class ParallelConfig:
    """How one run spreads over processes: data, tensor and pipeline parallel, sharding.

    The batch sizes stay in ``Engine``: ``global_batch_size = micro_batch_size x accumulate
    x dp_degree x sharding_degree`` (sharding ranks read different data, like dp ranks).
    ``gpt_compress/parallel/`` applies the layout; ``validate`` checks it against the launch.
    """

    dp_degree: int = 1  # data-parallel replicas (gradients all-reduced)
    mp_degree: int = 1  # tensor (model) parallel ranks: heads, FFN and vocab split across them
    pp_degree: int = 1  # pipeline stages (whole blocks per stage)
    sharding_degree: int = 1  # data-parallel ranks that also shard optimizer state (ZeRO)
    sharding_stage: int = 1  # 1: optimizer state, 2: + gradients, 3: + parameters
    virtual_pp_degree: int = 1  # interleaved pipeline chunks per stage
    sequence_parallel: bool = False  # split LayerNorm/dropout activations along the sequence (mp > 1)
    pp_micro_batches: int = 0  # pipeline micro-batches per step; 0: Engine's accumulation steps

    def __post_init__(self) -> None:
        for key in ("dp_degree", "mp_degree", "pp_degree", "sharding_degree", "virtual_pp_degree"):
            if getattr(self, key) < 1:
                raise ConfigError(f"Parallel.{key} must be >= 1, got {getattr(self, key)}")
        if self.sharding_stage not in (1, 2, 3):
            raise ConfigError(f"Parallel.sharding_stage must be 1, 2 or 3, got {self.sharding_stage}")
        if self.sequence_parallel and self.mp_degree == 1:
            raise ConfigError("Parallel.sequence_parallel needs Parallel.mp_degree > 1")

    @property
    def world_size(self) -> int:
        """Processes this layout needs: dp x sharding x mp x pp."""
        return self.dp_degree * self.sharding_degree * self.mp_degree * self.pp_degree

    @property
    def data_parallel_size(self) -> int:
        """Ranks that read different samples: dp x sharding."""
        return self.dp_degree * self.sharding_degree

    @property
    def enabled(self) -> bool:
        """True when the layout spans more than one process."""
        return self.world_size > 1

    def describe(self) -> str:
        """``dp 2 x mp 2`` style summary of the degrees above 1 (``single process`` if none)."""
        parts = [f"{n} {v}" for n, v in (("dp", self.dp_degree), ("sharding", self.sharding_degree),
                                          ("mp", self.mp_degree), ("pp", self.pp_degree)) if v > 1]
        return " x ".join(parts) or "single process"

    def validate(self, world_size: int) -> None:
        """Raise ``ConfigError`` unless the degrees multiply to the launched ``world_size``."""
        if self.world_size != world_size:
            terms = " x ".join(f"{n} {v}" for n, v in (("dp", self.dp_degree), ("sharding", self.sharding_degree),
                                                        ("mp", self.mp_degree), ("pp", self.pp_degree))
                               if v > 1 or n in ("dp", "mp", "pp"))
            hint = ("launch with python -m paddle.distributed.launch --nproc_per_node "
                    f"{self.world_size}" if world_size == 1 else "change the Parallel degrees or the launch")
            raise ConfigError(f"Parallel: {terms} = {self.world_size} but {world_size} "
                              f"process{'es were' if world_size != 1 else ' was'} launched; {hint}")


@dataclass
class QuantVariant:
    """One more quantized artifact of `gptc pipeline` (beside the QAT one, ``int8``): ``gptc ptq`` or
    ``gptc qat`` of the base model or of the last float model, with its own overrides; exported,
    evaluated and reported like the others."""

    name: str = ""  # the artifact's name: stage quant_<name>, eval/<name>.json
    command: str = "ptq"  # ptq | qat
    source: str = "base"  # base | float (the last float model: distilled, else pruned, else base)
    overrides: list[str] = field(default_factory=list)  # "Section.key=value" for this command only
    label: str = ""  # its row in the report (default: the name)

    def __post_init__(self) -> None:
        if not self.name.replace("-", "_").isidentifier() or self.name in ("base", "compressed", "int8"):
            raise ConfigError(f"quant variant name {self.name!r} must be a word (letters, digits, -, _) "
                              "other than base, compressed and int8")
        if self.command not in ("ptq", "qat"):
            raise ConfigError(f"quant variant {self.name}: command must be ptq or qat, got {self.command!r}")
        if self.source not in ("base", "float"):
            raise ConfigError(f"quant variant {self.name}: source must be base or float, got {self.source!r}")


@dataclass
class PipelineConfig:
    """`gptc pipeline`: text -> pretrained -> pruned + distilled -> QAT int8 -> exported -> evaluated.
    The other sections configure pretraining; each later stage adds its own ``*_overrides``."""

    corpus: list[str] = field(default_factory=lambda: ["stdlib"])  # JSONL/text files or dirs; "stdlib": embedded
    corpus_max_bytes: int = 4_000_000  # size of the embedded standard-library corpus
    heldout_fraction: float = 0.05  # JSONL documents kept out of training as the perplexity text
    tokenizer_dir: str = ""  # an existing tokenizer; "" trains a byte-level BPE of Model.vocab_size
    init_from: str = ""  # start from this checkpoint (ours or a Hugging Face GPT-2 dir) instead of pretraining
    prune: bool = True  # prune heads/FFN channels of the base model (the Prune section, plus prune_overrides)
    distill: bool = True  # distill the base model into the pruned one (needs prune)
    qat: bool = True  # quantization-aware training of the last float model, int8 export
    pretrain_overrides: list[str] = field(default_factory=list)  # "Section.key=value" for pretraining only
    prune_overrides: list[str] = field(default_factory=list)  # ... for `gptc prune`
    distill_overrides: list[str] = field(default_factory=list)  # ... for `gptc distill`
    qat_overrides: list[str] = field(default_factory=list)  # ... for `gptc qat`
    quant_variants: list[QuantVariant] = field(default_factory=list)  # more int8/int4 artifacts (ptq/qat)
    formats: list[str] = field(default_factory=lambda: ["paddle", "onnx"])  # export formats to build and evaluate
    eval_wikitext: str = ""  # perplexity text (WikiText raw/tokens); "" uses the held-out corpus documents
    eval_input_format: str = "raw"  # raw | raw-hf-rows | tokens
    eval_max_chars: int = 0  # score only the first N characters of the perplexity text (0: all)
    eval_heldout: bool = False  # with eval_wikitext: also the held-out documents' perplexity (in-domain)
    eval_lambada: str = ""  # lambada_test.jsonl; "" skips LAMBADA
    lambada_limit: int = 0  # LAMBADA: only the first N examples (0: all)
    eval_seq_len: int = 0  # evaluation window; 0: the model's context
    speed_prompt_tokens: int = 32  # decode speed: prompt length (batch 1, greedy)
    speed_new_tokens: int = 32  # decode speed: generated tokens per run
    speed_reps: int = 3  # decode speed: timed runs (median)

    def __post_init__(self) -> None:
        if not self.corpus and not self.init_from:
            raise ConfigError("Pipeline.corpus is empty: give JSONL/text files, or [stdlib]")
        if not 0.0 <= self.heldout_fraction < 0.5:
            raise ConfigError(f"Pipeline.heldout_fraction must be in [0, 0.5), got {self.heldout_fraction}")
        if self.distill and not self.prune:
            raise ConfigError("Pipeline.distill needs Pipeline.prune (the student is the pruned model)")
        names = [v.name for v in self.quant_variants]
        if len(set(names)) != len(names):
            raise ConfigError(f"Pipeline.quant_variants names must be unique, got {names}")
        bad = [f for f in self.formats if f not in ("paddle", "onnx")]
        if bad or not self.formats:
            raise ConfigError(f"Pipeline.formats must be a non-empty subset of [paddle, onnx], got {self.formats}")
        if self.eval_input_format not in ("raw", "raw-hf-rows", "tokens"):
            raise ConfigError(f"Pipeline.eval_input_format must be raw, raw-hf-rows or tokens, "
                              f"got {self.eval_input_format!r}")
        for key in ("speed_prompt_tokens", "speed_new_tokens", "speed_reps"):
            if getattr(self, key) < 1:
                raise ConfigError(f"Pipeline.{key} must be >= 1, got {getattr(self, key)}")


OBSERVERS = ("abs_max", "percentile", "mse")  # PTQ activation observers
W8A8, WEIGHT_ONLY = "w8a8", "weight_only"  # the two quantized layer modes
QUANT_WEIGHT_BITS = (8, 4)  # weight widths the int8 export writes (export/int8.py)


@dataclass
class QuantConfig:
    """Quantization of a trained model (``gptc qat``, ``gptc ptq``, ``gptc quant-sensitivity``); the
    transforms are in ``gpt_compress/qat/``.

    Each candidate layer ends up in one of three states, decided by name globs (``fnmatch``, so
    ``*`` also crosses dots) over the model's sublayer names (``gpt.blocks.0.attn.qkv``, ...):

    * **W8A8** (``targets`` minus ``skip``): weights int8 per output channel (abs-max), inputs int8
      per tensor with a calibrated (PTQ) or moving-average (QAT) abs-max scale. Only the Linear
      layers of the blocks qualify; the LM head never does (the fused training loss feeds it the
      hidden states directly, so its input could not be fake-quantized consistently).
    * **weight-only** (``weight_only``, checked for layers that are not W8A8): int8 or int4 weights
      in blocks of ``weight_block_size`` inputs. With ``dynamic_inputs`` (default) the inputs are
      quantized on the fly to int8 per token and block (scale ``max|x| / 127``), exactly as
      onnxruntime's fast ``MatMulNBits`` kernels do (``accuracy_level=4``; measured on gpt-bench's
      LM head, batch 1: 1.1 ms for int8 weights vs 4.2 ms float32, while float inputs with int8
      weights take 99 ms); without it inputs stay float. Qualifies: block Linears, an untied
      ``lm_head``, ``gpt.wte`` (the token embedding, which in a tied model is the LM head too) and
      ``gpt.wpe`` (positions).
    * **float**: everything else.
    """

    targets: list[str] = field(default_factory=lambda: ["*"])  # W8A8 candidates (block Linears only)
    skip: list[str] = field(default_factory=lambda: ["gpt.wte", "gpt.wpe", "lm_head"])  # never W8A8
    skip_file: str = ""  # more skip names/globs, one per line (what `gptc quant-sensitivity` writes)
    weight_only: list[str] = field(default_factory=list)  # weight-only layers, e.g. ["gpt.wte"] (tied LM head)
    weight_bits: int = 8  # 8 or 4 (int4: weight-only layers; W8A8 layers then hold 4-bit codes in int8)
    activation_bits: int = 8  # W8A8 inputs; exports need 8, fewer bits are for the sensitivity ranking
    weight_block_size: int = 32  # weight-only: one scale per this many inputs (power of two >= 16)
    dynamic_inputs: bool = True  # weight-only: int8 inputs per token and block, made on the fly (see above)
    moving_rate: float = 0.9  # QAT: moving-average rate of the activation abs-max
    observer: str = "abs_max"  # PTQ activation observer: abs_max, percentile or mse
    percentile: float = 99.99  # observer=percentile: the clipping percentile of |x|
    calib_batches: int = 16  # PTQ / sensitivity: calibration batches of Engine.micro_batch_size
    freeze_embedding: bool = True  # QAT: embeddings are not trained (FleetX freeze_embedding)

    def __post_init__(self) -> None:
        # Checked here, when the config is read, not by the exporter after training.
        if self.weight_bits not in QUANT_WEIGHT_BITS:
            raise ConfigError(f"Quant.weight_bits must be one of {', '.join(map(str, QUANT_WEIGHT_BITS))} (the "
                              f"widths the int8 export writes), got {self.weight_bits}")
        if not 2 <= self.activation_bits <= 8:
            raise ConfigError(f"Quant.activation_bits must be between 2 and 8, got {self.activation_bits}")
        b = self.weight_block_size
        if b < 16 or b & (b - 1):
            raise ConfigError(f"Quant.weight_block_size must be a power of two >= 16 (onnxruntime MatMulNBits), "
                              f"got {b}")
        if self.observer not in OBSERVERS:
            raise ConfigError(f"Quant.observer must be one of {', '.join(OBSERVERS)}, got {self.observer!r}")
        if not 0.0 < self.percentile <= 100.0:
            raise ConfigError(f"Quant.percentile must be in (0, 100], got {self.percentile}")
        if not 0.0 < self.moving_rate < 1.0:
            raise ConfigError(f"Quant.moving_rate must be in (0, 1), got {self.moving_rate}")
        if self.calib_batches < 1:
            raise ConfigError(f"Quant.calib_batches must be >= 1, got {self.calib_batches}")

    def all_skips(self) -> list[str]:
        """``skip`` plus the names in ``skip_file`` (blank lines and ``#`` comments ignored)."""
        if not self.skip_file:
            return list(self.skip)
        if not os.path.isfile(self.skip_file):
            raise ConfigError(f"Quant.skip_file {self.skip_file!r} does not exist (write one with "
                              "`gptc quant-sensitivity`)")
        with open(self.skip_file, encoding="utf-8") as f:
            extra = [ln.split("#", 1)[0].strip() for ln in f]
        return list(self.skip) + [x for x in extra if x]

    def mode_of(self, name: str, kind: str, skips: Optional[list[str]] = None) -> Optional[str]:
        """``W8A8``, ``WEIGHT_ONLY`` or None for layer ``name`` of ``kind`` ("linear", "lm_head" or
        "embedding"); ``skips`` defaults to ``all_skips()``."""
        skips = self.all_skips() if skips is None else skips
        if kind == "linear" and _matches(name, self.targets) and not _matches(name, skips):
            return W8A8
        if _matches(name, self.weight_only):
            return WEIGHT_ONLY
        return None


def _matches(name: str, globs: list[str]) -> bool:
    """Whether ``name`` matches one of the glob patterns."""
    return any(fnmatch.fnmatchcase(name, g) for g in globs)


# The sections of `gptc finetune` and `gptc serve` (gpt_compress/sections.py).
from .sections import FinetuneConfig, ServeConfig  # noqa: E402


@dataclass
class Config:
    """The whole configuration of a run: one dataclass per YAML section."""

    global_: GlobalConfig = field(default_factory=GlobalConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    prune: PruneConfig = field(default_factory=PruneConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    quant: QuantConfig = field(default_factory=QuantConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)

    def to_dict(self) -> dict:
        """Sections keyed by their YAML names."""
        return {sec: dataclasses.asdict(getattr(self, attr)) for sec, attr in SECTIONS.items()}


# YAML section name -> attribute of Config.
SECTIONS: dict[str, str] = {
    "Global": "global_",
    "Model": "model",
    "Data": "data",
    "Engine": "engine",
    "Optimizer": "optimizer",
    "Generation": "generation",
    "Prune": "prune",
    "Distill": "distill",
    "Parallel": "parallel",
    "Quant": "quant",
    "Pipeline": "pipeline",
    "Serve": "serve",
    "Finetune": "finetune",
}


# --------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------
def _suggest(name: str, choices) -> str:
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _strip_optional(tp):
    if typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0], True
    return tp, False


def _coerce(tp, value, where: str):
    """Check/convert ``value`` to type ``tp``; ``where`` names the key for errors."""
    tp, optional = _strip_optional(tp)
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{where} may not be null")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be a mapping, got {value!r}")
        return _build(tp, value, where)
    origin = typing.get_origin(tp)
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where} must be a list, got {value!r}")
        return [_coerce(item_tp, v, f"{where}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where} must be true or false, got {value!r}")
    if tp in (int, float) and isinstance(value, str):
        # YAML 1.1 reads "1e-4" (no dot) as a string; users mean a number.
        try:
            value = float(value) if tp is float or not value.strip().lstrip("+-").isdigit() else int(value)
        except ValueError:
            pass
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{where} must be an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{where} must be a number, got {value!r}")
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{where} must be a string, got {value!r}")
    return value


def _build(cls, data: dict, where: str, origins: Optional[dict] = None):
    """Instantiate dataclass ``cls`` from ``data``, rejecting unknown keys by name. ``origins``
    maps keys set by `-o` to their override text, so an error blames the override, not the file."""
    origins = origins or {}
    source, _, section = where.rpartition(": ")
    source = "" if source == "<defaults>" else source
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    kwargs = {}
    for key, value in data.items():
        at = f"-o {origins[key]}: {section}" if key in origins else where
        if key not in names:
            where_key = f"-o {origins[key]}: unknown key {section}.{key}" if key in origins else \
                f"unknown key {where}.{key}"
            raise ConfigError(f"{where_key}{_suggest(key, names)}; valid keys: {', '.join(names)}")
        kwargs[key] = _coerce(hints[key], value, f"{at}.{key}")
    try:
        return cls(**kwargs)
    except ConfigError as e:
        blamed = [text for key, text in origins.items() if f"{section}.{key} " in f"{e} "]
        raise ConfigError(f"-o {blamed[0]}: {e}" if blamed else f"{source}: {e}" if source else str(e)) from None


def _parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like Section.key=value")
    path, raw = text.split("=", 1)
    keys = path.strip().split(".")
    if len(keys) < 2 or not all(keys):
        raise ConfigError(f"override {text!r} must look like Section.key=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return keys, value


def _merge(dst: dict, src: dict) -> dict:
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _merge(dst[k], v)
        else:
            dst[k] = v
    return dst


def load_yaml(path: str) -> dict:
    """Read a YAML config file into raw sections (``_base_`` files are merged first)."""
    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml.safe_load(f) or {}
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path} is not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections")
    base = raw.pop("_base_", None)
    if base:
        base_path = os.path.join(os.path.dirname(path), base)
        raw = _merge(load_yaml(base_path), raw)
    return raw


def build_config(raw: dict, overrides: list[str] = (), source: str = "<config>") -> Config:
    """Apply ``overrides`` to raw YAML sections and build a checked ``Config``."""
    raw = {k: dict(v) if isinstance(v, dict) else v for k, v in (raw or {}).items()}
    origins: dict[str, dict[str, str]] = {}  # section -> key -> the override that set it
    for text in overrides:
        keys, value = _parse_override(text)
        origins.setdefault(keys[0], {})[keys[1]] = text
        node = raw.setdefault(keys[0], {})
        for k in keys[1:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {text!r}: {k} is not a section")
        node[keys[-1]] = value
    kwargs = {}
    for section, body in raw.items():
        if section not in SECTIONS:
            if section in origins:
                text = next(iter(origins[section].values()))
                raise ConfigError(f"-o {text}: unknown section {section!r}{_suggest(section, SECTIONS)}; "
                                  f"valid sections: {', '.join(SECTIONS)}")
            raise ConfigError(f"unknown section {section!r} in {source}{_suggest(section, SECTIONS)}; "
                              f"valid sections: {', '.join(SECTIONS)}")
        if body is None:
            continue
        if not isinstance(body, dict):
            raise ConfigError(f"section {section} in {source} must be a mapping")
        attr = SECTIONS[section]
        if attr == "model":
            body = dict(body)
            preset = body.pop("preset", None)
            if preset is not None:
                if str(preset) not in PRESETS:
                    raise ConfigError(f"{source}: unknown Model.preset {preset!r}"
                                      f"{_suggest(str(preset), PRESETS)}; choose one of {', '.join(PRESETS)}")
                body = {**PRESETS[str(preset)], "name": str(preset), **body}
        cls = typing.get_type_hints(Config)[attr]
        kwargs[attr] = _build(cls, body, f"{source}: {section}", origins.get(section))
    return Config(**kwargs)


def load_config(path: Optional[str] = None, overrides: list[str] = ()) -> Config:
    """Load ``path`` (optional) and apply ``-o Section.key=value`` overrides."""
    raw = load_yaml(path) if path else {}
    return build_config(raw, overrides, source=path or "<defaults>")
