"""How `gptc pipeline` runs its stages: the ``Stage`` record, ``StageRunner`` (bring stages up to
date in order, skip fresh ones, resume interrupted ones; freshness lives in ``stamps.py``) and
the helpers a stage's work uses: ``gptc`` (one `python -m gpt_compress` subprocess), stage
config files and output checks. The stage list itself is ``stages.Pipeline``."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import yaml

from ..config import Config, build_config
from ..errors import PipelineError
from ..fileio import atomic_file
from .stamps import fingerprint


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


def say(msg: str) -> None:
    """One progress line of the pipeline on stderr."""
    print(f"[pipeline] {msg}", file=sys.stderr, flush=True)


def gptc(args: Sequence[str], stage: str) -> dict:
    """Run ``python -m gpt_compress ARGS``; stream its stderr, return the JSON of its last stdout
    line. A failure raises ``PipelineError`` with the command and the tail of its output."""
    cmd = [sys.executable, "-m", "gpt_compress", *map(str, args)]
    say(f"{stage}: {' '.join(cmd[2:])}")
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


class StageRunner:
    """The driver half of ``Pipeline``: needs ``stages()`` and ``stamps`` (a ``StampStore``)."""

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
                say(f"{s.name}: up to date, skipped")
                run_ids[s.name] = self.stamps.read(s.name).run_id
                summary[s.name] = {"ran": False}
                continue
            say(f"{s.name}: running ({why})")
            self._prepare_work_dir(s, fp)
            t0 = time.perf_counter()
            outputs = s.run()
            s.check(outputs)
            stamp = self.stamps.write(s.name, fp, outputs, time.perf_counter() - t0)
            self._clear_started(s)
            run_ids[s.name] = stamp.run_id
            summary[s.name] = {"ran": True, "seconds": stamp.seconds}
            say(f"{s.name}: done in {stamp.seconds:.1f} s")
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
