"""Shared by test_bad_inputs.py and test_faults.py: `gptc` run in this process (exit code and
output captured), and a snapshot of a directory tree to assert that a failed command changed
nothing."""
from __future__ import annotations

import hashlib
import io
import os
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

from gpt_compress.cli import main

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
CORPUS = ROOT.parent / "shared" / "data" / "corpus" / "tinyshakespeare.txt"


def gptc(*argv: str) -> tuple[int, str, str]:
    """Run `gptc argv` in this process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    code = 0
    old = os.environ.get("GPTC_TUNE_CPU")
    os.environ["GPTC_TUNE_CPU"] = "0"  # runtime.tune_cpu changes process-wide settings later tests see
    with redirect_stdout(out), redirect_stderr(err):
        try:
            main([str(a) for a in argv])
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        finally:
            if old is None:
                del os.environ["GPTC_TUNE_CPU"]
            else:
                os.environ["GPTC_TUNE_CPU"] = old
    return code, out.getvalue(), err.getvalue()


def ok(*argv: str) -> str:
    code, out, err = gptc(*argv)
    assert code == 0, f"gptc {' '.join(map(str, argv))} failed ({code}): {err[-2000:]}"
    return out


def snapshot(root: Path) -> dict[str, str]:
    """Every path under ``root`` -> "dir", or the sha256 and mode of the file."""
    snap = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            snap[os.path.relpath(os.path.join(dirpath, d), root)] = "dir"
        for f in filenames:
            fp = os.path.join(dirpath, f)
            if os.path.islink(fp):
                snap[os.path.relpath(fp, root)] = "link:" + os.readlink(fp)
                continue
            with open(fp, "rb") as fh:
                digest = hashlib.sha256(fh.read()).hexdigest()
            snap[os.path.relpath(fp, root)] = f"{digest} {os.stat(fp).st_mode:o}"
    return snap
