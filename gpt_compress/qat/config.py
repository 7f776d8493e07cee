"""The ``Quant`` config section: which layers are quantized, how, and with how many bits.

Pure Python (no Paddle), so ``gpt_compress.config`` can register it as a section.

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
from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass, field
from typing import Optional

OBSERVERS = ("abs_max", "percentile", "mse")
W8A8, WEIGHT_ONLY = "w8a8", "weight_only"


@dataclass
class QuantConfig:
    """Quantization of a trained model (``gptc qat``, ``gptc ptq``, ``gptc quant-sensitivity``)."""

    targets: list[str] = field(default_factory=lambda: ["*"])  # W8A8 candidates (block Linears only)
    skip: list[str] = field(default_factory=lambda: ["gpt.wte", "gpt.wpe", "lm_head"])  # never W8A8
    skip_file: str = ""  # more skip names/globs, one per line (what `gptc quant-sensitivity` writes)
    weight_only: list[str] = field(default_factory=list)  # weight-only layers, e.g. ["gpt.wte"] (tied LM head)
    weight_bits: int = 8  # 8, or 2-7 (4 for int4 weight-only export; lower only for analysis)
    activation_bits: int = 8  # W8A8 inputs; exports need 8, fewer bits are for the sensitivity ranking
    weight_block_size: int = 32  # weight-only: one scale per this many inputs (power of two >= 16)
    dynamic_inputs: bool = True  # weight-only: int8 inputs per token and block, made on the fly (see above)
    moving_rate: float = 0.9  # QAT: moving-average rate of the activation abs-max
    observer: str = "abs_max"  # PTQ activation observer: abs_max, percentile or mse
    percentile: float = 99.99  # observer=percentile: the clipping percentile of |x|
    calib_batches: int = 16  # PTQ / sensitivity: calibration batches of Engine.micro_batch_size
    freeze_embedding: bool = True  # QAT: embeddings are not trained (FleetX freeze_embedding)

    def __post_init__(self) -> None:
        from ..config import ConfigError

        for key in ("weight_bits", "activation_bits"):
            if not 2 <= getattr(self, key) <= 8:
                raise ConfigError(f"Quant.{key} must be between 2 and 8, got {getattr(self, key)}")
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
        from ..config import ConfigError

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
    return any(fnmatch.fnmatchcase(name, g) for g in globs)


def write_skip_file(path: str, names: list[str], header: str = "") -> str:
    """Write ``names`` one per line (what ``Quant.skip_file`` reads); returns ``path``."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for line in header.splitlines():
            f.write(f"# {line}\n")
        for n in names:
            f.write(n + "\n")
    return path
