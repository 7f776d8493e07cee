"""`gptc pipeline`: text -> tokenizer + dataset -> pretrained GPT -> pruned -> distilled -> QAT int8
-> exported (Paddle Inference, ONNX) -> evaluated -> report, as stages that skip finished work.

Each stage writes into its own directory under ``Global.output_dir`` (OUT):

    data/       tokenizer/, corpus_text_document.bin/.idx, heldout.txt (perplexity text)
    pretrain/   `gptc pretrain` run (or the --init_from checkpoint, converted if Hugging Face)
    prune/      `gptc prune` output          distill/  `gptc distill` run (student = prune/)
    qat/        `gptc qat` run; qat/int8 = the int8 export
    quant_NAME/ each ``Pipeline.quant_variants`` entry: a `gptc ptq` or `gptc qat` run and its export
    export/     base/ and compressed/ (`gptc export`)
    eval/       one JSON per artifact: WikiText-style PPL, LAMBADA, decode speed per backend
    report/     report.md, results.json, loss_curves.png, size_vs_quality.png, speed_vs_quality.png

Training, pruning, QAT and export run as `python -m gpt_compress <command>` subprocesses with
a stage config written to ``OUT/<stage>/config.yaml``: exactly what a user would run by hand,
each in a fresh process. Freshness and "rerun what follows" are in ``stamps.py``. A training
stage interrupted midway resumes from its last checkpoint (``Engine.resume=auto``) when rerun
with the same settings; with changed settings its directory is cleared first.
"""
from __future__ import annotations

from ..errors import PipelineError  # noqa: F401  (re-exported)

import functools
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import yaml

from ..config import Config, build_config
from ..fileio import CHECKSUMS, atomic_file, write_json_atomic, write_text_atomic
from .stamps import StampStore, fingerprint


# The config sections that decide each training stage's result; a change elsewhere (say the
# Prune section) does not rerun pretraining.
PRETRAIN_SECTIONS = ("Global", "Model", "Data", "Engine", "Optimizer", "Parallel")
PRUNE_SECTIONS = ("Global", "Data", "Engine", "Prune")
DISTILL_SECTIONS = ("Global", "Data", "Engine", "Optimizer", "Distill")
QAT_SECTIONS = ("Global", "Data", "Engine", "Optimizer", "Quant")




@dataclass
class Stage:
    """One step: ``run()`` does the work and returns its outputs (JSON-able); ``check(outputs)``
    raises if they are missing or corrupt; ``settings`` decide the result (hashed)."""

    name: str
    deps: tuple[str, ...]
    settings: Any
    run: Callable[[], dict]
    check: Callable[[dict], None]
    work_dir: Optional[str] = None  # cleared before a run with new settings
    resumable: bool = False  # an interrupted run with the same settings continues in work_dir


def _say(msg: str) -> None:
    print(f"[pipeline] {msg}", file=sys.stderr, flush=True)


def gptc(args: Sequence[str], stage: str) -> dict:
    """Run ``python -m gpt_compress ARGS``; stream its stderr, return the JSON of its last stdout
    line. A failure raises ``PipelineError`` with the command and the tail of its output."""
    cmd = [sys.executable, "-m", "gpt_compress", *map(str, args)]
    _say(f"{stage}: {' '.join(cmd[2:])}")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    tail: deque[str] = deque(maxlen=40)

    def relay():
        for line in proc.stderr:
            tail.append(line)
            sys.stderr.write(line)
            sys.stderr.flush()

    t = threading.Thread(target=relay, daemon=True)
    t.start()
    stdout = proc.stdout.read()
    proc.wait()
    t.join()
    if proc.returncode != 0:
        raise PipelineError(f"stage {stage!r} failed (exit {proc.returncode}): {' '.join(cmd)}\n"
                            + "".join(tail)[-3000:])
    lines = [ln for ln in stdout.splitlines() if ln.strip().startswith("{")]
    if not lines:
        raise PipelineError(f"stage {stage!r}: {' '.join(cmd)} printed no JSON summary")
    return json.loads(lines[-1])


def write_stage_config(cfg: Config, overrides: Sequence[str], forced: dict[str, Any], path: str) -> dict:
    """The run's config with a stage's ``overrides`` and ``forced`` fields ("Section.key" ->
    value), written as YAML (without the Pipeline section); returns the written dict."""
    raw = cfg.to_dict()
    raw.pop("Pipeline", None)
    stage_cfg = build_config(raw, list(overrides), source=f"{path} overrides")
    raw = stage_cfg.to_dict()
    raw.pop("Pipeline", None)
    for dotted, value in forced.items():
        section, key = dotted.split(".", 1)
        raw[section][key] = value
    build_config(raw, [], source=path)  # the forced values are checked too
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with atomic_file(path) as f:
        yaml.safe_dump(raw, f, sort_keys=False)
    return raw


def verify_checkpoint(path: str) -> None:
    """A saved model directory whose checksums hold."""
    from ..checkpoint import read_config, verify_checksums

    if not path or not os.path.isdir(path):
        raise PipelineError(f"checkpoint {path} is missing")
    verify_checksums(path)
    read_config(path)


def verify_export(path: str) -> None:
    """An exported inference directory with a readable manifest and intact files."""
    from ..inference.manifest import MANIFEST, read_manifest, verify_files

    if not path or not os.path.isfile(os.path.join(path, MANIFEST)):
        raise PipelineError(f"exported model {path} is missing")
    read_manifest(path)
    verify_files(path)


@dataclass
class Pipeline:
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
                    lambda o: verify_checkpoint(o["checkpoint"]), self.path("pretrain"), resumable=True)]
        if p.prune:
            st.append(Stage("prune", ("pretrain", "data"), self._stage_raw("prune", p.prune_overrides, PRUNE_SECTIONS),
                            self._run_prune, lambda o: verify_checkpoint(o["checkpoint"]), self.path("prune")))
        if p.distill:
            st.append(Stage("distill", ("pretrain", "prune", "data"),
                            self._stage_raw("distill", p.distill_overrides, DISTILL_SECTIONS),
                            self._run_distill, lambda o: verify_checkpoint(o["checkpoint"]), self.path("distill"),
                            resumable=True))
        last_float = "distill" if p.distill else "prune" if p.prune else "pretrain"
        if p.qat:
            st.append(Stage("qat", (last_float, "data"), {**self._stage_raw("qat", p.qat_overrides, QAT_SECTIONS),
                                                          "formats": p.formats},
                            self._run_qat, lambda o: verify_export(o["export"]), self.path("qat"), resumable=True))
        st.append(Stage("export_base", ("pretrain",), {"formats": p.formats},
                        lambda: self._run_export("pretrain", "base"), lambda o: verify_export(o["export"]),
                        self.path("export", "base")))
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
        eval_settings = {k: getattr(p, k) for k in ("eval_wikitext", "eval_input_format", "eval_max_chars",
                                                    "eval_heldout",
                                                    "eval_lambada", "lambada_limit", "eval_seq_len", "formats",
                                                    "speed_prompt_tokens", "speed_new_tokens", "speed_reps")}
        for name, src in artifacts:
            st.append(Stage(f"eval_{name}", (src, "data"), eval_settings,
                            (lambda n=name, s=src: self._run_eval(n, s)), self._check_eval))
        st.append(Stage("report", tuple(f"eval_{n}" for n, _ in artifacts) + ("pretrain",), {},
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

    def _run_distill(self) -> dict:
        d = self.path("distill")
        conf = os.path.join(d, "config.yaml")
        write_stage_config(self.cfg, self.p.distill_overrides,
                           {**self._data_overrides(), "Global.output_dir": d, "Engine.resume": "auto",
                            "Engine.init_from": "", "Distill.teacher": self.outputs("pretrain")["checkpoint"],
                            "Distill.student": self.outputs("prune")["checkpoint"]}, conf)
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

    def _run_export(self, src_stage: str, name: str) -> dict:
        out = self.path("export", name)
        fmt = "all" if len(self.p.formats) == 2 else self.p.formats[0]
        res = gptc(["export", "--model", self.outputs(src_stage)["checkpoint"], "--output", out, "--format", fmt,
                    "--overwrite"], f"export_{name}")
        return {"export": res["output"], "checkpoint": self.outputs(src_stage)["checkpoint"], "summary": res}

    # evaluation and report ----------------------------------------------------------
    @functools.cached_property
    def _ppl_text(self) -> Optional[str]:
        """The perplexity text (sliced to ``eval_max_chars`` once per pipeline run)."""
        from ..eval.wikitext import write_text_prefix

        src = self.p.eval_wikitext or self.outputs("data").get("heldout")
        return write_text_prefix(src, self.p.eval_max_chars, self.path("eval", "ppl_text.txt")) if src else src

    @functools.cached_property
    def _heldout_text(self) -> Optional[str]:
        """The held-out corpus documents (``Pipeline.eval_heldout``), sliced like the perplexity text."""
        from ..eval.wikitext import write_text_prefix

        src = self.outputs("data").get("heldout")
        return write_text_prefix(src, self.p.eval_max_chars, self.path("eval", "heldout_text.txt")) if src else src

    def _run_eval(self, name: str, src_stage: str) -> dict:
        from ..eval.lambada import evaluate_lambada
        from ..eval.speed import measure_speed
        from ..eval.wikitext import evaluate_wikitext
        from ..inference.runner import Generator

        model_dir = self.outputs(src_stage)["export"]
        text = self._ppl_text
        fmt = self.p.eval_input_format if self.p.eval_wikitext else "raw"
        results = []
        for backend in self.p.formats:
            gen = Generator.from_dir(model_dir, backend=backend, tokenizer=self.outputs("data")["tokenizer_dir"])
            seq = self.p.eval_seq_len or gen.max_positions
            base = {"model": model_dir, "backend": backend, "artifact": name}
            if text:
                r = evaluate_wikitext(gen, gen.tokenizer, text, fmt, seq_len=seq, batch_size=8, progress=False)
                results.append({**base, "task": "wikitext", "data": text, **r.to_dict()})
            heldout = self._heldout_text if self.p.eval_heldout and self.p.eval_wikitext else None
            if heldout:
                r = evaluate_wikitext(gen, gen.tokenizer, heldout, "raw", seq_len=seq, batch_size=8, progress=False)
                results.append({**base, "task": "heldout", "data": heldout, **r.to_dict()})
            if self.p.eval_lambada:
                r = evaluate_lambada(gen, gen.tokenizer, self.p.eval_lambada, seq_len=seq, batch_size=16,
                                     limit=self.p.lambada_limit or None, progress=False)
                results.append({**base, "task": "lambada", "data": self.p.eval_lambada, **r.to_dict()})
            prompt = self._speed_prompt(gen)
            s = measure_speed(gen, prompt, self.p.speed_new_tokens, self.p.speed_reps)
            results.append({**base, "task": "speed", **s.to_dict()})
            _say(f"eval_{name} [{backend}]: " + ", ".join(
                f"{r['task']} " + (f"ppl {r['ppl']:.3f}" if r["task"] in ("wikitext", "heldout") else
                                   f"acc {r['accuracy']:.4f}" if r["task"] == "lambada" else
                                   f"{r['decode_tokens_per_s']} tok/s, prefill {r['prefill_ms']} ms")
                for r in results if r["backend"] == backend))
        path = self.path("eval", f"{name}.json")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_json_atomic(path, results, sort_keys=False)
        return {"result": path}

    def _speed_prompt(self, gen) -> list[int]:
        """The first ``speed_prompt_tokens`` tokens of the perplexity text (or of the corpus)."""
        text = self._ppl_text
        if text:
            with open(text, encoding="utf-8") as f:
                ids = gen.tokenizer.encode(f.read(20_000))
        else:
            from ..data.indexed import open_dataset

            ids = list(open_dataset(self.outputs("data")["data_prefix"])[0])
        n = min(self.p.speed_prompt_tokens, gen.max_positions - self.p.speed_new_tokens)
        return [int(t) for t in ids[:n]]

    def _check_eval(self, o: dict) -> None:
        with open(o["result"], encoding="utf-8") as f:
            results = json.load(f)
        if {r["backend"] for r in results} != set(self.p.formats):
            raise PipelineError(f"{o['result']} lacks a backend")

    def _run_report(self) -> dict:
        from ..eval.report import load_rows, write_report

        evals = [s for s in self.stamps_names() if s.startswith("eval_")]
        names, paths = {}, []
        labels = {"base": "base (fp32)", "compressed": "pruned+distilled (fp32)" if self.p.distill else "pruned (fp32)",
                  "int8": "QAT int8", **{v.name: v.label or v.name for v in self.p.quant_variants}}
        for s in evals:
            o = self.outputs(s)
            paths.append(o["result"])
            with open(o["result"], encoding="utf-8") as f:
                for r in json.load(f):
                    names[r["model"]] = labels.get(r["artifact"], r["artifact"])
        rows = load_rows(paths, names)
        logs = {}
        for stage, label in (("pretrain", "pretrain"), ("distill", "distill"), ("qat", "QAT")):
            stamp = self.stamps.read(stage)
            log = stamp.outputs.get("train_log") if stamp else None
            if log and os.path.isfile(log):
                logs[label] = log
        files = write_report(self.path("report"), rows, logs or None, title="gpt-compress pipeline report",
                             notes=self._notes())
        return {"report": files["report"], "files": files}

    def stamps_names(self) -> list[str]:
        return [s.name for s in self.stages() if self.stamps.read(s.name) is not None]

    def _notes(self) -> str:
        lines = []
        pre = self.stamps.read("pretrain").outputs.get("summary") or {}
        if pre:
            lines.append(f"- pretrain: {pre.get('steps')} steps, {pre.get('tokens_per_s')} tokens/s, "
                         f"validation ppl {pre.get('valid_ppl')}")
        for stage in ("prune", "distill", "qat"):
            stamp = self.stamps.read(stage) if getattr(self.p, stage) else None
            if stamp is None:
                continue
            s = stamp.outputs.get("summary", {})
            if stage == "prune":
                lines.append(f"- prune ({s.get('criterion')}, heads -{s.get('head_ratio')}, FFN -{s.get('ffn_ratio')}): "
                             f"{s.get('params_before'):,} -> {s.get('params_after'):,} parameters; "
                             f"validation ppl {s.get('valid_ppl_before')} -> {s.get('valid_ppl_after')}")
            elif stage == "distill":
                lines.append(f"- distill: {s.get('steps')} steps; student validation ppl "
                             f"{s.get('student_valid_ppl_before')} -> {s.get('student_valid_ppl_after')} "
                             f"(teacher {s.get('teacher_valid_ppl')})")
            else:
                lines.append(f"- qat: {s.get('steps')} steps; int8 export {stamp.outputs.get('export')}")
        text = self._ppl_text
        lines.append(f"- perplexity text: {text or 'none'}; LAMBADA: {self.p.eval_lambada or 'not evaluated'}; "
                     f"speed: batch 1, greedy, {self.p.speed_prompt_tokens}-token prompt, "
                     f"{self.p.speed_new_tokens} new tokens, median of {self.p.speed_reps}")
        stamps = [self.stamps.read(s.name) for s in self.stages() if s.name != "report"]
        lines.append("- stage times (s): " + ", ".join(f"{t.stage} {t.seconds}" for t in stamps if t))
        return "\n".join(lines)

    @staticmethod
    def _check_files(paths: Sequence[str]) -> None:
        for p in paths:
            if not p or not os.path.isfile(p) or os.path.getsize(p) == 0:
                raise PipelineError(f"{p} is missing or empty")

    # ---------------------------------------------------------------- driver
    def status(self) -> list[dict]:
        """Each stage: fresh or why it would run."""
        out, run_ids = [], {}
        for s in self.stages():
            fp = fingerprint(s.settings, {d: run_ids.get(d, "") for d in s.deps})
            state, why = self._freshness(s, fp)
            stamp = self.stamps.read(s.name)
            run_ids[s.name] = stamp.run_id if (state and stamp) else "pending"
            out.append({"stage": s.name, "fresh": state, "why": why})
        return out

    def _freshness(self, s: Stage, fp: str) -> tuple[bool, str]:
        stamp = self.stamps.read(s.name)
        if stamp is None:
            return False, "never finished"
        if stamp.fingerprint != fp:
            return False, "settings or inputs changed"
        try:
            s.check(stamp.outputs)
        except Exception as e:  # noqa: BLE001 - any failure of the check means "redo"
            return False, f"output invalid: {str(e).splitlines()[0][:200]}"
        return True, "up to date"

    def run(self, only: Optional[Sequence[str]] = None, force: Sequence[str] = ()) -> dict:
        """Bring every stage (or only the ``only`` ones, whose inputs must be fresh) up to date."""
        stages = self.stages()
        known = [s.name for s in stages]
        for n in [*(only or []), *force]:
            if n not in known:
                raise PipelineError(f"unknown stage {n!r}; stages of this config: {', '.join(known)}")
        run_ids: dict[str, str] = {}
        summary = {}
        t_all = time.perf_counter()
        needed = None  # --stage X: X and what it reads; later (or unrelated) stale stages do not matter
        if only is not None:
            by_name = {s.name: s for s in stages}
            needed, todo = set(), list(only)
            while todo:
                n = todo.pop()
                if n not in needed:
                    needed.add(n)
                    todo.extend(by_name[n].deps)
        for s in stages:
            if needed is not None and s.name not in needed:
                summary[s.name] = {"ran": False}
                continue
            fp = fingerprint(s.settings, {d: run_ids.get(d, "") for d in s.deps})
            fresh, why = self._freshness(s, fp)
            if s.name in force:
                fresh, why = False, "forced"
            selected = only is None or s.name in only
            if fresh or not selected:
                if not fresh:
                    raise PipelineError(f"stage {s.name!r} is not up to date ({why}); run it first "
                                        f"(--stage {s.name}) or run the whole pipeline")
                _say(f"{s.name}: up to date, skipped")
                run_ids[s.name] = self.stamps.read(s.name).run_id
                summary[s.name] = {"ran": False}
                continue
            _say(f"{s.name}: running ({why})")
            self._prepare_work_dir(s, fp)
            t0 = time.perf_counter()
            outputs = s.run()
            s.check(outputs)
            stamp = self.stamps.write(s.name, fp, outputs, time.perf_counter() - t0)
            self._clear_started(s)
            run_ids[s.name] = stamp.run_id
            summary[s.name] = {"ran": True, "seconds": stamp.seconds}
            _say(f"{s.name}: done in {stamp.seconds:.1f} s")
        return {"output_dir": self.out, "stages": summary, "seconds": round(time.perf_counter() - t_all, 1),
                "report": self.stamps.read("report").outputs["report"] if self.stamps.read("report") else None}

    def _prepare_work_dir(self, s: Stage, fp: str) -> None:
        """Keep the work dir of an interrupted resumable run with the same settings; else clear it."""
        self.stamps.remove(s.name)
        if not s.work_dir:
            return
        started = os.path.join(self.stamps.dir, f"{s.name}.started")
        same = False
        if s.resumable and os.path.isfile(started):
            with open(started, encoding="utf-8") as f:
                same = f.read().strip() == fp
        if not same and os.path.isdir(s.work_dir):
            shutil.rmtree(s.work_dir)
        os.makedirs(self.stamps.dir, exist_ok=True)
        with open(started, "w", encoding="utf-8") as f:
            f.write(fp)

    def _clear_started(self, s: Stage) -> None:
        try:
            os.remove(os.path.join(self.stamps.dir, f"{s.name}.started"))
        except FileNotFoundError:
            pass


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
