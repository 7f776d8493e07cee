"""The evaluation and report stages of `gptc pipeline` (``EvalStages``, a half of
``stages.Pipeline``): every artifact's perplexity, LAMBADA and decode speed on each export
format, then one report across them."""
from __future__ import annotations

import functools
import json
import os
from typing import Optional, Sequence

from ..errors import PipelineError
from ..fileio import write_json_atomic
from .driver import say


class EvalStages:
    """Needs ``p`` (the Pipeline section), ``path()``, ``outputs()``, ``stamps`` and ``stages()``."""

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
            say(f"eval_{name} [{backend}]: " + ", ".join(
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
                cut = [f"{what} -{s[key]}" for what, key in (("heads", "head_ratio"), ("FFN", "ffn_ratio"),
                                                              ("blocks", "layer_ratio"), ("hidden", "hidden_ratio"))
                       if s.get(key)]
                lines.append(f"- prune ({', '.join([str(s.get('criterion'))] + cut)}): "
                             f"{s.get('params_before'):,} -> {s.get('params_after'):,} parameters; "
                             f"validation ppl {s.get('valid_ppl_before')} -> {s.get('valid_ppl_after')}")
            elif stage == "distill":
                gen = s.get("teacher_data")
                on = (f" (on {gen['windows']:,} windows continued by the teacher, {gen['generated_tokens']:,} "
                      "generated tokens)" if gen else "")
                lines.append(f"- distill: {s.get('steps')} steps{on}; student validation ppl "
                             f"{s.get('student_valid_ppl_before')} -> {s.get('student_valid_ppl_after')} "
                             f"(teacher {s.get('teacher_valid_ppl')})")
            else:
                lines.append(f"- qat: {s.get('steps')} steps; int8 export {stamp.outputs.get('export')}")
        draft = self.stamps.read("draft") if self.p.prune and self.p.draft else None
        if draft is not None:
            d = draft.outputs
            vocab = (f", proposing from the {d['draft_vocab']} most frequent training tokens"
                     if d.get("draft_vocab") else "")
            lines.append(f"- speculative draft of the base export: {d.get('draft')} (greedy, k = {d.get('k')}{vocab}): "
                         f"acceptance rate {d.get('acceptance_rate')}, {d.get('tokens_per_target_step')} tokens "
                         f"per target step on {d.get('measured_on')}")
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
