"""Which pipeline stages are up to date: one stamp file per finished stage.

A stage is *fresh* when (1) its stamp exists, (2) the stamp's fingerprint equals the one the
stage would have now, and (3) its outputs still pass the stage's own validity check (checksums,
manifests, result files). The fingerprint hashes the stage's settings (its resolved config) and
the run ids of the stages it reads from. Every run of a stage gets a new run id, so when a
stage reruns (its output was deleted, or its settings changed) every stage after it sees a
changed fingerprint and reruns too, while stages before it are left alone.

Stamps live in ``OUT/.stages/NAME.json`` (written atomically, after the outputs), apart from the
outputs, so deleting an output directory is all it takes to redo a stage.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from ..fileio import write_json_atomic


@dataclass
class Stamp:
    """What a finished stage recorded."""

    stage: str
    fingerprint: str
    run_id: str
    outputs: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    finished_at: str = ""


def fingerprint(settings: Any, upstream_run_ids: dict[str, str]) -> str:
    """sha256 of the stage's settings and its inputs' run ids (order-independent JSON)."""
    blob = json.dumps({"settings": settings, "upstream": upstream_run_ids}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


class StampStore:
    """Stamps of one pipeline output directory."""

    def __init__(self, out_dir: str):
        self.dir = os.path.join(out_dir, ".stages")

    def path(self, stage: str) -> str:
        return os.path.join(self.dir, f"{stage}.json")

    def read(self, stage: str) -> Optional[Stamp]:
        """The stamp of ``stage``, or None if it never finished (or the stamp is unreadable)."""
        try:
            with open(self.path(stage), encoding="utf-8") as f:
                return Stamp(**json.load(f))
        except (OSError, ValueError, TypeError):
            return None

    def write(self, stage: str, fp: str, outputs: dict, seconds: float) -> Stamp:
        """Record a finished stage with a new run id."""
        stamp = Stamp(stage=stage, fingerprint=fp, run_id=uuid.uuid4().hex, outputs=outputs,
                      seconds=round(seconds, 2), finished_at=time.strftime("%Y-%m-%dT%H:%M:%S"))
        os.makedirs(self.dir, exist_ok=True)
        write_json_atomic(self.path(stage), stamp.__dict__, sort_keys=False)
        return stamp

    def remove(self, stage: str) -> None:
        """Forget ``stage`` (it will rerun)."""
        try:
            os.remove(self.path(stage))
        except FileNotFoundError:
            pass
