"""Config sections of training and decoding: ``Data``, ``Optimizer`` (with its learning-rate
schedule), ``Engine``, ``Generation`` and ``Parallel``. Registered in ``config/__init__.py``;
import them from ``gpt_compress.config``."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from ..errors import ConfigError


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
    presence_penalty: float = 0.0  # OpenAI's: subtracted from the logit of every token generated so far
    frequency_penalty: float = 0.0  # OpenAI's: subtracted once per time a token was generated so far
    logit_bias: dict[int, float] = field(default_factory=dict)  # OpenAI's: token id -> bias added to its logit
    best_of: int = 1  # OpenAI's: greedy/sampling candidates per prompt (seed + j), the best mean logprob kept
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
                  ("presence_penalty", math.isfinite(self.presence_penalty) and abs(self.presence_penalty) <= 2,
                   "in [-2, 2] (0 disables)"),
                  ("frequency_penalty", math.isfinite(self.frequency_penalty) and abs(self.frequency_penalty) <= 2,
                   "in [-2, 2] (0 disables)"),
                  ("logit_bias", all(isinstance(k, int) and k >= 0 and math.isfinite(v) and abs(v) <= 100
                                     for k, v in self.logit_bias.items()),
                   "token id -> bias in [-100, 100]"),
                  ("best_of", self.best_of >= 1, ">= 1 (1 disables)"),
                  ("num_beams", self.num_beams >= 1, ">= 1"),
                  ("length_penalty", math.isfinite(self.length_penalty), "a finite number"),
                  ("seed", self.seed is None or 0 <= self.seed < 2 ** 63, "in [0, 2^63 - 1] (numpy's seeds)")]
        for key, ok, rule in checks:
            if not ok:
                raise ConfigError(f"Generation.{key} must be {rule}, got {getattr(self, key)}")


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
