"""`gptc pipeline`: text -> tokenizer + dataset -> pretrained GPT -> pruned -> distilled -> QAT int8
-> exported (Paddle Inference, ONNX) -> evaluated -> report, as stages that skip finished work.

Each stage writes into its own directory under ``Global.output_dir`` (OUT):

    data/       tokenizer/, corpus_text_document.bin/.idx, heldout.txt (perplexity text)
    pretrain/   `gptc pretrain` run (or the --init_from checkpoint, converted if Hugging Face)
    prune/      `gptc prune` output          distill/  `gptc distill` run (student = prune/)
    qat/        `gptc qat` run; qat/int8 = the int8 export
    quant_NAME/ each ``Pipeline.quant_variants`` entry: a `gptc ptq` or `gptc qat` run and its export
    export/     base/ and compressed/ (`gptc export`); the draft stage records the compressed
                export (qat/int8 with QAT) in base/manifest.json as its speculative draft, with
                the acceptance rate measured on the held-out text; with Pipeline.draft_vocab it
                exports that checkpoint again as draft/, with a draft vocabulary
    eval/       one JSON per artifact: WikiText-style PPL, LAMBADA, decode speed per backend
    report/     report.md, results.json, loss_curves.png, size_vs_quality.png, speed_vs_quality.png

Training, pruning, QAT and export run as `python -m gpt_compress <command>` subprocesses with
a stage config written to ``OUT/<stage>/config.yaml``: exactly what a user would run by hand,
each in a fresh process. Freshness and "rerun what follows" are in ``stamps.py``. A training
stage interrupted midway resumes from its last checkpoint (``Engine.resume=auto``) when rerun
with the same settings; with changed settings its directory is cleared first.

This module lists the stages and runs the data, training and export ones; the evaluation
and report stages are ``evaluation.EvalStages``, the driver ``driver.StageRunner``.
"""
from __future__ import annotations

from ..errors import PipelineError  # noqa: F401  (re-exported)

import json
import os
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from ..config import Config, build_config
from ..fileio import CHECKSUMS, atomic_file, write_text_atomic
from .driver import Stage, StageRunner, gptc, verify_checkpoint, verify_export, write_stage_config  # noqa: F401
from .evaluation import EvalStages
from .stamps import StampStore


# The draft stage's measurement of the acceptance rate (greedy, batch of held-out windows).
DRAFT_K, DRAFT_PROMPTS, DRAFT_NEW_TOKENS = 5, 8, 32

# The config sections that decide each training stage's result; a change elsewhere (say the
# Prune section) does not rerun pretraining.
PRETRAIN_SECTIONS = ("Global", "Model", "Data", "Engine", "Optimizer", "Parallel")
PRUNE_SECTIONS = ("Global", "Data", "Engine", "Prune")
DISTILL_SECTIONS = ("Global", "Data", "Engine", "Optimizer", "Distill")
QAT_SECTIONS = ("Global", "Data", "Engine", "Optimizer", "Quant")


@dataclass
class Pipeline(EvalStages, StageRunner):
    """The stages of one config; ``run()`` brings them up to date."""

    cfg: Config
    progress: bool = False
    out: str = field(init=False)
    stamps: StampStore = field(init=False)

    def __post_init__(self):
        self.out = os.path.abspath(self.cfg.global_.output_dir)
        self.stamps = StampStore(self.out)
        self.p = self.cfg.pipeline

    # -------------------------------------------------------------- helpers
    def path(self, *parts: str) -> str:
        return os.path.join(self.out, *parts)

    def outputs(self, stage: str) -> dict:
        stamp = self.stamps.read(stage)
        if stamp is None:
            raise PipelineError(f"stage {stage!r} has not run; run the pipeline without --stage first")
        return stamp.outputs

    def _progress_flag(self) -> list[str]:
        return [] if self.progress else ["--no-progress"]

    def _data_overrides(self) -> dict[str, Any]:
        data = self.outputs("data")
        return {"Data.data_prefix": [data["data_prefix"]], "Data.tokenizer_dir": data["tokenizer_dir"]}

    def float_model(self) -> str:
        """The last float checkpoint: distilled, else pruned, else the base model."""
        for stage, key in (("distill", "checkpoint"), ("prune", "checkpoint")):
            if getattr(self.p, stage):
                return self.outputs(stage)[key]
        return self.outputs("pretrain")["checkpoint"]

    # --------------------------------------------------------------- stages
    def stages(self) -> list[Stage]:
        p, out = self.p, self.out
        st = [Stage("data", (), {"corpus": [os.path.abspath(c) if c != "stdlib" else c for c in p.corpus],
                                 "corpus_max_bytes": p.corpus_max_bytes, "heldout": p.heldout_fraction,
                                 "tokenizer": p.tokenizer_dir, "init_from": p.init_from,
                                 "vocab_size": self.cfg.model.vocab_size},
                    self._run_data, self._check_data, self.path("data")),
              Stage("pretrain", ("data",), self._pretrain_settings(), self._run_pretrain,
                    lambda o: verify_checkpoint(o["checkpoint"]), self.path("pretrain"), resumable=True),
              Stage("export_base", ("pretrain",), {"formats": p.formats},
                    lambda: self._run_export("pretrain", "base"), lambda o: verify_export(o["export"]),
                    self.path("export", "base"))]
        if p.prune:
            st.append(Stage("prune", ("pretrain", "data"), self._stage_raw("prune", p.prune_overrides, PRUNE_SECTIONS),
                            self._run_prune, lambda o: verify_checkpoint(o["checkpoint"]), self.path("prune")))
        if p.distill:
            # Sequence-level distillation (Distill.generated_windows): the base export writes the windows.
            generated = ("export_base",) if self._distill_generates() else ()
            st.append(Stage("distill", ("pretrain", "prune", "data") + generated,
                            self._stage_raw("distill", p.distill_overrides, DISTILL_SECTIONS),
                            self._run_distill, lambda o: verify_checkpoint(o["checkpoint"]), self.path("distill"),
                            resumable=True))
        last_float = "distill" if p.distill else "prune" if p.prune else "pretrain"
        if p.qat:
            st.append(Stage("qat", (last_float, "data"), {**self._stage_raw("qat", p.qat_overrides, QAT_SECTIONS),
                                                          "formats": p.formats},
                            self._run_qat, lambda o: verify_export(o["export"]), self.path("qat"), resumable=True))
        artifacts = [("base", "export_base")]
        if p.prune:
            st.append(Stage("export_compressed", (last_float,), {"formats": p.formats},
                            lambda: self._run_export(last_float, "compressed"), lambda o: verify_export(o["export"]),
                            self.path("export", "compressed")))
            artifacts.append(("compressed", "export_compressed"))
        if p.qat:
            artifacts.append(("int8", "qat"))
        for v in p.quant_variants:
            src = "pretrain" if v.source == "base" else last_float
            st.append(Stage(f"quant_{v.name}", (src, "data"),
                            {**self._stage_raw(f"quant_{v.name}", v.overrides, QAT_SECTIONS), "command": v.command,
                             "formats": p.formats},
                            (lambda v=v, src=src: self._run_quant(v, src)), lambda o: verify_export(o["export"]),
                            self.path(f"quant_{v.name}"), resumable=v.command == "qat"))
            artifacts.append((v.name, f"quant_{v.name}"))
        if p.prune and p.draft:
            src = "qat" if p.qat else "export_compressed"
            st.append(Stage("draft", ("export_base", src, "data"), {"k": DRAFT_K, "prompts": DRAFT_PROMPTS,
                                                                     "new_tokens": DRAFT_NEW_TOKENS,
                                                                     "draft_vocab": p.draft_vocab},
                            (lambda src=src: self._run_draft(src)),
                            lambda o: [verify_export(o[k]) for k in ("export", "draft")]))
        eval_settings = {k: getattr(p, k) for k in ("eval_wikitext", "eval_input_format", "eval_max_chars",
                                                    "eval_heldout",
                                                    "eval_lambada", "lambada_limit", "eval_seq_len", "formats",
                                                    "speed_prompt_tokens", "speed_new_tokens", "speed_reps")}
        for name, src in artifacts:
            st.append(Stage(f"eval_{name}", (src, "data"), eval_settings,
                            (lambda n=name, s=src: self._run_eval(n, s)), self._check_eval))
        drafted = ("draft",) if p.prune and p.draft else ()
        st.append(Stage("report", tuple(f"eval_{n}" for n, _ in artifacts) + ("pretrain",) + drafted, {},
                        self._run_report, lambda o: self._check_files([o["report"]]), self.path("report")))
        return st

    # data -----------------------------------------------------------------
    def _run_data(self) -> dict:
        from ..data.errors import DataError
        from ..data.preprocess import find_input_files, preprocess
        from ..data.stdlib_corpus import build_stdlib_corpus
        from ..data.tokenizer import Tokenizer

        d = self.path("data")
        os.makedirs(d, exist_ok=True)
        files = []
        for c in self.p.corpus:
            if c == "stdlib":
                files.append(build_stdlib_corpus(os.path.join(d, "stdlib.jsonl"), self.p.corpus_max_bytes)["path"])
            else:
                files.extend(str(f) for f in find_input_files([c]))
        train_files, heldout = self._hold_out(files, d)
        if self.p.tokenizer_dir:
            tok = Tokenizer.load(self.p.tokenizer_dir)
        elif self.p.init_from and os.path.isfile(os.path.join(self.p.init_from, "tokenizer.json")):
            tok = Tokenizer.load(self.p.init_from)
        else:
            tok = Tokenizer.train(_iter_texts(train_files), vocab_size=self.cfg.model.vocab_size)
        tok.save(os.path.join(d, "tokenizer"))
        summary = preprocess(train_files, os.path.join(d, "corpus"), tok, workers=1, progress=False)
        if summary["tokens"] == 0:
            raise DataError(f"the corpus {self.p.corpus} has no text")
        return {"tokenizer_dir": os.path.join(d, "tokenizer"), "data_prefix": os.path.join(d, "corpus_text_document"),
                "heldout": heldout, "documents": summary["documents"], "tokens": summary["tokens"],
                "vocab_size": tok.vocab_size}

    def _hold_out(self, files: list[str], d: str) -> tuple[list[str], Optional[str]]:
        """Move the last ``heldout_fraction`` of each JSONL file's documents to heldout.txt (the
        perplexity text when Pipeline.eval_wikitext is empty)."""
        if self.p.heldout_fraction <= 0:
            return files, None
        train, held = [], []
        for i, f in enumerate(files):
            if not f.endswith((".jsonl", ".json")):
                train.append(f)
                continue
            with open(f, encoding="utf-8") as fh:
                lines = [ln for ln in fh if ln.strip()]
            n = int(len(lines) * self.p.heldout_fraction)
            if n == 0:
                train.append(f)
                continue
            held += [json.loads(ln)["text"] for ln in lines[len(lines) - n:]]
            kept = os.path.join(d, f"train_{i}.jsonl")
            with atomic_file(kept) as fh:
                fh.writelines(lines[: len(lines) - n])
            train.append(kept)
        if not held:
            return files, None
        path = os.path.join(d, "heldout.txt")
        write_text_atomic(path, "\n\n".join(held) + "\n")
        return train, path

    def _check_data(self, o: dict) -> None:
        from ..data.indexed import open_dataset
        from ..data.tokenizer import Tokenizer

        Tokenizer.load(o["tokenizer_dir"])
        if len(open_dataset(o["data_prefix"])) == 0:
            raise PipelineError(f"{o['data_prefix']} is empty")
        self._check_files([o["heldout"]] if o.get("heldout") else [])

    # pretrain ---------------------------------------------------------------
    def _pretrain_settings(self) -> Any:
        if self.p.init_from:
            return {"init_from": os.path.abspath(self.p.init_from)}
        return self._stage_raw("pretrain", self.p.pretrain_overrides, PRETRAIN_SECTIONS)

    def _stage_raw(self, stage: str, overrides: Sequence[str], sections: Sequence[str]) -> dict:
        """The config sections that decide a stage's result (the fingerprinted settings)."""
        raw = self.cfg.to_dict()
        raw.pop("Pipeline", None)
        full = build_config(raw, list(overrides), source=f"Pipeline.{stage}_overrides").to_dict()
        return {"config": {k: full[k] for k in sections}}

    def _run_pretrain(self) -> dict:
        d = self.path("pretrain")
        if self.p.init_from:
            src = os.path.abspath(self.p.init_from)
            if os.path.isfile(os.path.join(src, CHECKSUMS)):
                return {"checkpoint": src, "train_log": None}
            conv = gptc(["convert", "--from-hf", src, "--output", os.path.join(d, "model"), "--overwrite"], "pretrain")
            return {"checkpoint": conv.get("output", os.path.join(d, "model")), "train_log": None}
        conf = os.path.join(d, "config.yaml")
        write_stage_config(self.cfg, self.p.pretrain_overrides,
                           {**self._data_overrides(), "Global.output_dir": d, "Engine.resume": "auto"}, conf)
        res = gptc(["pretrain", "-c", conf, *self._progress_flag()], "pretrain")
        return {"checkpoint": res["checkpoint"], "train_log": os.path.join(d, "train_log.jsonl"), "summary": res}

    # prune / distill / qat --------------------------------------------------------
    def _run_prune(self) -> dict:
        d = self.path("prune")
        conf = os.path.join(d, "config.yaml")
        write_stage_config(self.cfg, self.p.prune_overrides, {**self._data_overrides(), "Global.output_dir": d}, conf)
        res = gptc(["prune", "-c", conf, "--model", self.outputs("pretrain")["checkpoint"],
                    "--output", os.path.join(d, "model"), "--overwrite"], "prune")
        return {"checkpoint": res["output"], "summary": res}

    def _distill_generates(self) -> bool:
        """Whether the distill stage trains on the teacher's continuations (Distill.generated_windows)."""
        raw = self._stage_raw("distill", self.p.distill_overrides, DISTILL_SECTIONS)["config"]
        return bool(raw["Distill"]["generated_windows"])

    def _run_distill(self) -> dict:
        d = self.path("distill")
        conf = os.path.join(d, "config.yaml")
        teacher_export = ({"Distill.teacher_export": self.outputs("export_base")["export"]}
                          if self._distill_generates() and "paddle" in self.p.formats else {})
        write_stage_config(self.cfg, self.p.distill_overrides,
                           {**self._data_overrides(), "Global.output_dir": d, "Engine.resume": "auto",
                            "Engine.init_from": "", "Distill.teacher": self.outputs("pretrain")["checkpoint"],
                            "Distill.student": self.outputs("prune")["checkpoint"], **teacher_export}, conf)
        res = gptc(["distill", "-c", conf, *self._progress_flag()], "distill")
        return {"checkpoint": res["checkpoint"], "train_log": os.path.join(d, "train_log.jsonl"), "summary": res}

    def _run_qat(self) -> dict:
        d = self.path("qat")
        conf = os.path.join(d, "config.yaml")
        write_stage_config(self.cfg, self.p.qat_overrides,
                           {**self._data_overrides(), "Global.output_dir": d, "Engine.resume": "auto",
                            "Engine.init_from": ""}, conf)
        fmt = "all" if len(self.p.formats) == 2 else self.p.formats[0]
        res = gptc(["qat", "-c", conf, "--model", self.float_model(), "--format", fmt, *self._progress_flag()], "qat")
        return {"export": res["int8_export"]["path"], "checkpoint": res.get("quantized_checkpoint"),
                "train_log": os.path.join(d, "train_log.jsonl"), "summary": res}

    def _run_quant(self, v, src_stage: str) -> dict:
        """A ``Pipeline.quant_variants`` entry: `gptc ptq|qat` of ``src_stage``'s checkpoint, exported."""
        d = self.path(f"quant_{v.name}")
        conf = os.path.join(d, "config.yaml")
        write_stage_config(self.cfg, v.overrides, {**self._data_overrides(), "Global.output_dir": d,
                                                   "Engine.resume": "auto", "Engine.init_from": ""}, conf)
        fmt = "all" if len(self.p.formats) == 2 else self.p.formats[0]
        res = gptc([v.command, "-c", conf, "--model", self.outputs(src_stage)["checkpoint"], "--format", fmt,
                    *self._progress_flag()], f"quant_{v.name}")
        return {"export": res["int8_export"]["path"], "checkpoint": res.get("quantized_checkpoint"),
                "summary": res}

    def _run_draft(self, src_stage: str) -> dict:
        """Record ``src_stage``'s export as the speculative draft of the base export (its manifest's
        ``draft``), with the acceptance rate measured on held-out text: ``DRAFT_PROMPTS`` windows,
        ``DRAFT_NEW_TOKENS`` greedy tokens each, ``DRAFT_K`` proposals a step (not adaptive)."""
        import numpy as np

        from ..inference.manifest import read_manifest, record_draft
        from ..inference.runner import measure_draft

        base, draft = self.outputs("export_base")["export"], self.outputs(src_stage)["export"]
        if self.p.draft_vocab:  # the source checkpoint again, its fused program with the draft vocabulary
            draft = self.path("export", "draft")
            res = gptc(["export", "--model", self.outputs(src_stage)["checkpoint"], "--output", draft, "--format",
                        "paddle", "--overwrite", "--draft-vocab", str(self.p.draft_vocab), "--draft-vocab-data",
                        self.outputs("data")["data_prefix"]], "draft")
            draft = res["output"]
        text_path = self.outputs("data").get("heldout") or self._ppl_text
        if not text_path:
            raise PipelineError("the draft stage needs held-out text: set Pipeline.heldout_fraction > 0 "
                                "or Pipeline.eval_wikitext")
        from ..data.tokenizer import Tokenizer

        with open(text_path, encoding="utf-8") as f:
            ids = Tokenizer.load(base).encode(f.read(200_000))
        width = max(1, min(32, read_manifest(base).max_positions - DRAFT_NEW_TOKENS))
        if len(ids) < 2 * width:
            raise PipelineError(f"{text_path} is too short for the draft measurement ({len(ids)} tokens)")
        starts = np.linspace(0, len(ids) - width, DRAFT_PROMPTS).astype(int)
        figures = measure_draft(base, draft, [ids[s:s + width] for s in starts], DRAFT_K, DRAFT_NEW_TOKENS)
        return {"export": base, "draft": draft, "source": src_stage, "draft_vocab": self.p.draft_vocab,
                **record_draft(base, draft, figures)}

    def _run_export(self, src_stage: str, name: str) -> dict:
        out = self.path("export", name)
        fmt = "all" if len(self.p.formats) == 2 else self.p.formats[0]
        res = gptc(["export", "--model", self.outputs(src_stage)["checkpoint"], "--output", out, "--format", fmt,
                    "--overwrite"], f"export_{name}")
        return {"export": res["output"], "checkpoint": self.outputs(src_stage)["checkpoint"], "summary": res}


def _iter_texts(files: Sequence[str]):
    """Document texts of JSONL ("text" key) and plain-text files, for tokenizer training."""
    for f in files:
        with open(f, encoding="utf-8", errors="replace") as fh:
            if f.endswith((".jsonl", ".json")):
                for line in fh:
                    if line.strip():
                        yield json.loads(line)["text"]
            else:
                yield from fh
