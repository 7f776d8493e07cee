"""Config sections of compression: ``Prune``, ``Distill``, ``Quant`` (with the layer modes
and the weight widths the int8 export writes) and ``Pipeline`` (with its quantized
variants). Registered in ``config/__init__.py``; import them from ``gpt_compress.config``."""
from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass, field
from typing import Optional

from ..errors import ConfigError


@dataclass
class PruneConfig:
    """Structured pruning: remove the least important attention heads, FFN channels, blocks
    (depth) and hidden channels (width)."""

    head_ratio: float = 0.0  # fraction of attention heads to remove
    ffn_ratio: float = 0.0  # fraction of FFN channels to remove
    layer_ratio: float = 0.0  # fraction of the transformer blocks to remove (depth)
    hidden_ratio: float = 0.0  # fraction of the hidden (embedding) channels to remove (width)
    criterion: str = "taylor"  # "taylor" (|w * grad| on calibration data) or "magnitude" (weight norms)
    scope: str = "layer"  # "layer": the ratio in every layer; "global": one ranking across layers
    calib_batches: int = 8  # Taylor: micro-batches of training data that score the weights
    min_heads: int = 1  # no layer keeps fewer heads
    min_ffn: int = 1  # no layer keeps fewer FFN channels

    def __post_init__(self) -> None:
        for key in ("head_ratio", "ffn_ratio", "layer_ratio", "hidden_ratio"):
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
    # Sequence-level distillation (distill_data.py): windows of real text continued by the teacher's
    # greedy tokens, written once into the run directory and trained on beside the real text.
    generated_windows: int = 0  # windows the teacher continues; 0: real text only
    generated_prompt_tokens: int = 0  # real tokens a window starts with; 0: half of Data.seq_length
    generated_new_tokens: int = 0  # the teacher's tokens after them; 0: the rest of Data.seq_length
    generated_weight: float = 1.0  # share of the training samples drawn from the generated windows
    teacher_export: str = ""  # an export of the teacher that generates them; "": the teacher checkpoint (slower)

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
        if min(self.generated_windows, self.generated_prompt_tokens, self.generated_new_tokens) < 0:
            raise ConfigError("Distill.generated_windows, generated_prompt_tokens and generated_new_tokens must be "
                              f">= 0, got {self.generated_windows}, {self.generated_prompt_tokens}, "
                              f"{self.generated_new_tokens}")
        if not 0.0 < self.generated_weight <= 1.0:
            raise ConfigError(f"Distill.generated_weight must be in (0, 1], got {self.generated_weight}")


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
    draft: bool = True  # with prune: the compressed export (int8 with qat) becomes the base export's draft
    draft_vocab: int = 0  # > 0: the draft is exported again proposing from the N most frequent training tokens

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
        if self.draft_vocab < 0:
            raise ConfigError(f"Pipeline.draft_vocab must be >= 0 (0: the whole vocabulary), got {self.draft_vocab}")
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
        if kind == "linear" and matches_any(name, self.targets) and not matches_any(name, skips):
            return W8A8
        if matches_any(name, self.weight_only):
            return WEIGHT_ONLY
        return None


def matches_any(name: str, globs) -> bool:
    """Whether ``name`` matches one of the glob patterns."""
    return any(fnmatch.fnmatchcase(name, g) for g in globs)
