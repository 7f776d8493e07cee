"""What `gptc qat`, `gptc ptq` and `gptc quant-sensitivity` share: arguments, loading the input
checkpoint, calibration batches, and the closing evaluation (input model vs quantized model vs
its int8 exports) written as JSON."""
from __future__ import annotations

import dataclasses
import itertools
import math
import os
import tempfile
from typing import Optional

import numpy as np

from ..fileio import write_json_atomic
from ._common import (Output, add_config_arguments, claim_run_dir, config_from_args, find_tokenizer, lm_batches,
                      print_json, seed_everything)


def add_quant_arguments(parser, export: bool = True) -> None:
    """Arguments of the three quantization commands."""
    add_config_arguments(parser)
    parser.add_argument("--model", default=None,
                        help="float checkpoint to quantize (default: Engine.init_from)")
    parser.add_argument("--skip-list", default=None,
                        help="file of layer names to keep out of W8A8 (same as -o Quant.skip_file=...)")
    parser.add_argument("--eval-wikitext", default=None,
                        help="WikiText file (e.g. wiki.test.raw) for the closing perplexity delta")
    parser.add_argument("--eval-input-format", default="raw", choices=("raw", "raw-hf-rows", "tokens"))
    parser.add_argument("--eval-max-chars", type=int, default=0,
                        help="score only the first N characters of the WikiText file (0: all)")
    parser.add_argument("--eval-seq-len", type=int, default=0, help="WikiText window (default: the context)")
    if export:
        parser.add_argument("--format", choices=("paddle", "onnx", "all", "none"), default="all",
                            help="int8 export formats written to OUTPUT/int8 (default all)")
        parser.add_argument("--no-validate", action="store_true",
                            help="do not check the exports against the fake-quant model (untrained models)")
    parser.add_argument("--no-progress", action="store_true")


def prepare(args, cfg):
    """(float model, tokenizer, train_batches, eval_batches) for a quantization command; the
    model config of the run becomes the checkpoint's."""
    from ..checkpoint import load_model
    from ..config import ConfigError

    src = args.model or cfg.engine.init_from
    if not src:
        raise ConfigError("give the checkpoint to quantize with --model (or Engine.init_from)")
    if args.skip_list:
        cfg.quant.skip_file = args.skip_list
    cfg.quant.all_skips()  # a missing skip file fails now, before any work
    from ..memory import check_fits, model_config_of

    sized = model_config_of(src)
    if sized is not None:
        check_fits("ptq", sized, what=src)
    model = load_model(src)
    from ..qat.quantize import checked_plan

    checked_plan(model, cfg.quant)  # a selection that quantizes nothing is refused before any work
    cfg.model = model.config
    tokenizer = find_tokenizer(cfg.data.tokenizer_dir, src)
    train, valid = lm_batches(cfg, cfg.engine.max_steps * cfg.engine.global_batch_size, [model.config])
    return src, model, tokenizer, train, valid


@dataclasses.dataclass
class QuantRun:
    """A quantization command in progress: its config, input model, data and report so far."""

    cfg: object
    src: str
    model: object
    tokenizer: object
    train_batches: object
    eval_batches: object
    evaluator: "Evaluator"
    report: dict


def start(args, command: str, dropout_off: bool = False) -> QuantRun:
    """Load config, checkpoint and data, and evaluate the input model (the baseline of every delta)."""
    cfg = config_from_args(args)
    out = cfg.global_.output_dir
    # This run's own earlier outputs are replaced; a file or a foreign directory there is refused
    # now, not after calibration or training.
    claim_run_dir(cfg, Output("Global.output_dir", os.path.join(out, "quantized"), "dir", True, lock=False),
                  Output("Global.output_dir", os.path.join(out, "int8"), "dir", True, lock=False),
                  Output("Global.output_dir", os.path.join(out, "quant_report.json"), "file", True, lock=False))
    seed_everything(cfg.global_.seed)
    src, model, tokenizer, train, valid = prepare(args, cfg)
    if dropout_off:
        model = without_dropout(model)
        cfg.model = model.config
    evaluator = Evaluator(args, valid, tokenizer, model.config.max_position_embeddings)
    report = {"command": command, "input_checkpoint": os.path.abspath(src), "input": evaluator.model(model)}
    return QuantRun(cfg, src, model, tokenizer, train, valid, evaluator, report)


def finish(run: QuantRun, args, extra: Optional[dict] = None) -> int:
    """Save OUTPUT/quantized, evaluate the fake-quant model, export OUTPUT/int8, evaluate that,
    write OUTPUT/quant_report.json and print it."""
    from ..qat.quantize import quant_layers, save_quantized

    model, report = run.model, run.report
    model.eval()
    path = save_quantized(model, os.path.join(run.cfg.global_.output_dir, "quantized"), tokenizer=run.tokenizer,
                          extra={"source_checkpoint": os.path.abspath(run.src), **(extra or {})},
                          overwrite=True)  # this run's own artifact in Global.output_dir
    report.update(quantized_checkpoint=path, layers={n: m.mode for n, m in quant_layers(model).items()})
    report["fake_quant"] = run.evaluator.model(model)
    report["fake_quant"].update(deltas(report["input"], report["fake_quant"]))
    print_json(export_and_report(model, args, run.cfg, run.src, run.tokenizer, run.evaluator, report))
    return 0


def calibration_batches(train_batches, cfg) -> list[dict]:
    """The first ``Quant.calib_batches`` training micro-batches."""
    return list(itertools.islice(train_batches(0), cfg.quant.calib_batches))


def without_dropout(model):
    """A copy of ``model`` with dropout off (FleetX QAT recipe: finetune without dropout)."""
    from ..checkpoint import assign_weights, build_model, state_dict_numpy

    cfg = dataclasses.replace(model.config, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    out = build_model(cfg, "lm")
    assign_weights(out, state_dict_numpy(model), "the input checkpoint")
    return out


def _wikitext_path(args, work: str) -> Optional[str]:
    from ..eval.wikitext import write_text_prefix

    if not args.eval_wikitext:
        return None
    return write_text_prefix(args.eval_wikitext, args.eval_max_chars, os.path.join(work, "wikitext_slice.txt"))


def backend_loss(backend, batches) -> float:
    """Mean next-token cross-entropy of a runner backend (``score``) over LM batches."""
    from ..eval.scoring import token_logprobs

    total, n = 0.0, 0
    for b in batches:
        lp, _ = token_logprobs(backend, np.asarray(b["input_ids"]), np.asarray(b["labels"]))
        total, n = total - float(lp.sum()), n + lp.size
    return total / max(n, 1)


class Evaluator:
    """Validation loss and (optional) WikiText perplexity of dygraph models and exported dirs,
    on the same data for every model, so the deltas compare like with like."""

    def __init__(self, args, eval_batches, tokenizer, max_positions: int):
        self.args, self.tokenizer = args, tokenizer
        self.batches = list(eval_batches()) if eval_batches is not None else []
        self.work = tempfile.mkdtemp(prefix="gptc-quant-eval-")
        self.wikitext = _wikitext_path(args, self.work)
        if self.wikitext and tokenizer is None:
            from ..config import ConfigError

            raise ConfigError("--eval-wikitext needs a tokenizer (Data.tokenizer_dir or the checkpoint's)")
        self.seq_len = args.eval_seq_len or max_positions

    def _wikitext(self, backend) -> dict:
        from ..eval.wikitext import evaluate_wikitext

        r = evaluate_wikitext(backend, self.tokenizer, self.wikitext, self.args.eval_input_format,
                              seq_len=self.seq_len, batch_size=4, progress=False)
        return {"wikitext_ppl": r.ppl, "wikitext_adjusted_ppl": r.adjusted_ppl, "wikitext_tokens": r.num_tokenized_tokens}

    def model(self, model) -> dict:
        """Figures of a dygraph (float or fake-quant) model."""
        from ..inference.dygraph import DygraphBackend
        from ..train.loss import causal_lm_loss
        from ..train.trainer import evaluate

        out = {}
        if self.batches:
            loss = evaluate(model, causal_lm_loss, self.batches)
            out.update(valid_loss=loss, valid_ppl=math.exp(min(loss, 50.0)))
        if self.wikitext:
            model.eval()
            out.update(self._wikitext(DygraphBackend(model)))
        return out

    def exported(self, path: str, backend: str) -> dict:
        """Figures of an exported directory on ``backend`` ("paddle" or "onnx")."""
        from ..inference.runner import Generator

        gen = Generator.from_dir(path, backend=backend)
        out = {}
        if self.batches:
            loss = backend_loss(gen, self.batches)
            out.update(valid_loss=loss, valid_ppl=math.exp(min(loss, 50.0)))
        if self.wikitext:
            out.update(self._wikitext(gen))
        return out

    def close(self) -> None:
        """Remove the WikiText slice."""
        import shutil

        shutil.rmtree(self.work, ignore_errors=True)

    def protocol(self) -> dict:
        """How the figures were measured (stated in every report)."""
        return {"valid_batches": len(self.batches),
                "wikitext": os.path.abspath(self.args.eval_wikitext) if self.wikitext else None,
                "wikitext_max_chars": self.args.eval_max_chars or None,
                "wikitext_input_format": self.args.eval_input_format if self.wikitext else None,
                "wikitext_seq_len": self.seq_len if self.wikitext else None}


def deltas(base: dict, other: dict) -> dict:
    """Relative change (%) of every perplexity of ``other`` vs ``base`` and the loss difference."""
    out = {}
    for key in ("valid_ppl", "wikitext_ppl"):
        if key in base and key in other:
            out[key + "_delta_pct"] = 100.0 * (other[key] / base[key] - 1.0)
    if "valid_loss" in base and "valid_loss" in other:
        out["valid_loss_delta"] = other["valid_loss"] - base["valid_loss"]
    return out


def file_bytes(path: str, names) -> int:
    return sum(os.path.getsize(os.path.join(path, n)) for n in names if os.path.isfile(os.path.join(path, n)))


def export_and_report(qmodel, args, cfg, src: str, tokenizer, evaluator: Evaluator, report: dict) -> dict:
    """Export ``qmodel`` to OUTPUT/int8 (unless --format none), evaluate each backend there,
    and write OUTPUT/quant_report.json; returns the report. The export takes ``qmodel``'s weights
    (``export_model(free_weights=True)``): only its config is usable afterwards, and the
    evaluation of each backend runs without a dygraph copy of the model."""
    from ..export import export_model
    from ..inference.manifest import read_manifest

    out_dir = cfg.global_.output_dir
    if args.format != "none":
        formats = ("paddle", "onnx") if args.format == "all" else (args.format,)
        path = export_model(qmodel, os.path.join(out_dir, "int8"), formats, tokenizer=tokenizer,
                            source=os.path.abspath(src), validate=not args.no_validate, require_quantized=True,
                            overwrite=True, free_weights=True)  # this run's own artifact
        quant = read_manifest(path).data["quant"]
        report["int8_export"] = {"path": path, "validation": quant.get("validation"),
                                 "onnx_ops": quant.get("onnx_ops"),
                                 "paddle_params_bytes": file_bytes(path, ["model.pdiparams"]),
                                 "onnx_data_bytes": file_bytes(path, ["model.onnx.data"]),
                                 "float32_weight_bytes": 4 * qmodel.config.num_parameters()}
        for fmt in formats:
            res = evaluator.exported(path, fmt)
            res.update(deltas(report["input"], res))
            report[f"int8_{fmt}"] = res
    report["protocol"] = evaluator.protocol()
    evaluator.close()
    os.makedirs(out_dir, exist_ok=True)
    write_json_atomic(os.path.join(out_dir, "quant_report.json"), report, sort_keys=False)
    return report
