"""Faults a long job meets, each asserting that nothing is lost: a device that fills mid-write
(checkpoint save, export, preprocess, LoRA adapter save), two runs on one output (a lock naming
its holder; a stale lock of a dead process taken over), and SIGTERM from a scheduler (handled as
Ctrl-C: pretrain and finetune save a checkpoint and name it, exit 143; an export leaves nothing).

The full device is a small tmpfs the test mounts when it runs as root (as here and in CI), with
a filler file leaving less free space than the write needs; otherwise ``RLIMIT_FSIZE`` (with
SIGXFSZ ignored, so the write fails with EFBIG instead of killing the process).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _cli_helpers import CORPUS, ENV, gptc, ok, snapshot

WAIT = 300  # seconds any one wait for a subprocess may take before the test fails


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A tokenizer, a gpt-tiny checkpoint (with it) and a small preprocessed dataset."""
    d = tmp_path_factory.mktemp("faults")
    text = CORPUS.read_text(encoding="utf-8")[:20000] if CORPUS.is_file() else "the quick brown fox.\n\n" * 400
    (d / "small.txt").write_text(text, encoding="utf-8")
    paragraphs = [p.strip() for p in text.split("\n\n") if p.strip()]
    (d / "docs.jsonl").write_text("".join(json.dumps({"text": p}) + "\n" for p in paragraphs), encoding="utf-8")
    (d / "sft.jsonl").write_text("".join(json.dumps({"src": p[:40], "tgt": p[40:120] or "x"}) + "\n"
                                         for p in paragraphs), encoding="utf-8")
    ok("train-tokenizer", "--input", d / "small.txt", "--vocab-size", "300", "--output-dir", d / "tok")
    ok("init", "-o", "Model.preset=gpt-tiny", "-o", f"Data.tokenizer_dir={d / 'tok'}", "--output", d / "ckpt")
    ok("preprocess", "--input", d / "docs.jsonl", "--output-prefix", d / "data" / "corpus", "--tokenizer-dir", d / "tok")
    return d


def pretrain_args(base: Path, out: Path, steps: int, save: int = 2) -> list[str]:
    return ["pretrain", "--no-progress", "-o", "Model.preset=gpt-tiny", "-o", f"Data.tokenizer_dir={base / 'tok'}",
            "-o", f"Data.data_prefix={base / 'data' / 'corpus_text_document'}", "-o", "Data.seq_length=32",
            "-o", f"Global.output_dir={out}", "-o", f"Engine.max_steps={steps}", "-o", "Engine.global_batch_size=2",
            "-o", "Engine.micro_batch_size=2", "-o", f"Engine.save_steps={save}", "-o", "Engine.eval_freq=0",
            "-o", "Engine.logging_freq=0", "-o", "Engine.eval_iters=0", "-o", "Engine.keep_checkpoint_max=10"]


def cli(*argv, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpt_compress", *map(str, argv)], capture_output=True, text=True,
                          env=ENV, timeout=WAIT, **kw)


def one_error_line(stderr: str, command: str) -> str:
    """The one `gptc COMMAND: error: ...` line, the last of ``stderr`` (progress lines and Paddle's
    own warnings may come before it)."""
    lines = [ln for ln in stderr.splitlines() if ln.startswith("gptc ")]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr[-3000:]
    assert lines[0].startswith(f"gptc {command}: error: ") and stderr.rstrip().endswith(lines[0]), stderr[-3000:]
    return lines[0]


# --------------------------------------------------------------------------------------
# A full device
# --------------------------------------------------------------------------------------
class SmallDevice:
    """A directory on a device with ``free`` bytes left, or (not root) a file size limit."""

    def __init__(self, root: Path):
        self.root = root
        self.tmpfs = False
        self.limit = None
        root.mkdir()
        if os.geteuid() == 0 and shutil.which("mount"):
            r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(root)], capture_output=True)
            self.tmpfs = r.returncode == 0

    def fill(self, free: int) -> None:
        """Leave about ``free`` bytes writable (tmpfs: a filler file; else RLIMIT_FSIZE)."""
        if self.tmpfs:
            left = shutil.disk_usage(self.root).free - free
            with open(self.root / "filler", "wb") as f:
                f.truncate(0)
                f.write(b"\0" * max(left, 0))
        else:
            self.limit = free

    def free_space(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.root / "filler").unlink()
        self.limit = None

    def preexec(self):
        limit = self.limit

        def apply():
            if limit is not None:
                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
                resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        return apply

    @contextlib.contextmanager
    def limited(self):
        """The limit in this process (the tmpfs needs nothing)."""
        if self.limit is None:
            yield
            return
        old = resource.getrlimit(resource.RLIMIT_FSIZE)
        old_sig = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (self.limit, old[1]))
        try:
            yield
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, old)
            signal.signal(signal.SIGXFSZ, old_sig)

    def close(self) -> None:
        if self.tmpfs:
            subprocess.run(["umount", str(self.root)], check=False)


@pytest.fixture
def device(tmp_path):
    dev = SmallDevice(tmp_path / "dev")
    yield dev
    dev.close()


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def no_temporaries(root: Path) -> None:
    left = [str(p) for p in root.rglob("*") if re.search(r"\.tmp|\.old-|\.lock$", p.name)]
    assert not left, left


DISK_FULL = r"writing (\S+) failed, (no space left on the device|the file size limit was reached): it needs "


def test_checkpoint_save_on_full_disk_keeps_the_last_one_and_resume_continues(base, device):
    out = device.root / "run"
    ok(*pretrain_args(base, out, 2))
    step2 = out / "checkpoints" / "step_00000002"
    before = snapshot(step2)
    device.fill(dir_bytes(step2) // 2)  # half a checkpoint: the next save fills the device mid-write
    proc = cli(*pretrain_args(base, out, 4), "--resume", "auto", preexec_fn=device.preexec())
    assert proc.returncode == 1, proc.stderr[-3000:]
    line = one_error_line(proc.stderr, "pretrain")
    m = re.search(DISK_FULL + r"about (\d+\.\d) (KiB|MiB)", line)
    assert m and m.group(1).endswith("step_00000004"), line
    assert "previous content is intact" in line or "nothing was left there" in line
    assert snapshot(step2) == before and not (out / "checkpoints" / "step_00000004").exists()
    no_temporaries(out)
    from gpt_compress.checkpoint import load_model
    load_model(str(step2))  # verifies every checksum
    device.free_space()
    proc = cli(*pretrain_args(base, out, 4), "--resume", "auto")
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = [json.loads(ln) for ln in (out / "train_log.jsonl").read_text().splitlines()]
    resumed = [r for r in log if r.get("event") == "resumed"]
    assert resumed[-1]["step"] == 2 and resumed[-1]["checkpoint"].endswith("step_00000002")
    assert json.loads(proc.stdout.strip().splitlines()[-1])["steps"] == 4
    load_model(str(out / "checkpoints" / "step_00000004"))


def test_export_on_full_disk_keeps_the_previous_export(base, device):
    out = device.root / "export"
    args = ("export", "--model", base / "ckpt", "--output", out, "--format", "paddle", "--no-validate", "--no-fused")
    ok(*args)
    before = snapshot(out)
    device.fill(dir_bytes(out) // 3)
    proc = cli(*args, "--overwrite", preexec_fn=device.preexec())
    assert proc.returncode == 1, proc.stderr[-3000:]
    line = one_error_line(proc.stderr, "export")
    assert re.search(DISK_FULL + r"more than the \d+\.\d (KiB|MiB) written", line) and str(out) in line, line
    assert "previous content is intact" in line
    assert snapshot(out) == before
    no_temporaries(device.root)
    from gpt_compress.inference.manifest import read_manifest, verify_files
    read_manifest(str(out))
    verify_files(str(out))


def test_preprocess_on_full_disk_keeps_the_previous_dataset(base, device):
    prefix = device.root / "data" / "corpus"
    ok("preprocess", "--input", base / "docs.jsonl", "--output-prefix", prefix, "--tokenizer-dir", base / "tok")
    before = snapshot(device.root / "data")
    size = (device.root / "data" / "corpus_text_document.bin").stat().st_size
    big = device.root.parent / "big.jsonl"
    big.write_text((base / "docs.jsonl").read_text() * 8)
    device.fill(size // 2)
    proc = cli("preprocess", "--input", big, "--output-prefix", prefix, "--tokenizer-dir", base / "tok",
               preexec_fn=device.preexec())
    assert proc.returncode == 1, proc.stderr[-3000:]
    line = one_error_line(proc.stderr, "preprocess")
    assert re.search(DISK_FULL, line) and "corpus_text_document.bin" in line, line
    assert snapshot(device.root / "data") == before
    from gpt_compress.data.indexed import open_dataset
    assert len(open_dataset(str(prefix) + "_text_document").sizes) > 0


def test_adapter_save_on_full_disk_keeps_the_previous_adapter(base, device):
    from gpt_compress.checkpoint import load_model
    from gpt_compress.errors import DiskFullError
    from gpt_compress.finetune.lora import adapter_state, apply_lora, load_adapters, save_adapters
    from gpt_compress.config import LoraConfig

    model = apply_lora(load_model(str(base / "ckpt")), LoraConfig(enabled=True, rank=4, targets=["*"]))
    path = device.root / "lora_adapter"
    save_adapters(model, str(path))
    before = snapshot(path)
    first = adapter_state(model)
    device.fill((path / "adapter.safetensors").stat().st_size // 2)
    with device.limited(), pytest.raises(DiskFullError) as e:
        save_adapters(model, str(path), overwrite=True)
    assert str(path) in str(e.value) and "it needs about" in str(e.value) and "\n" not in str(e.value)
    assert snapshot(path) == before
    no_temporaries(device.root)
    device.free_space()
    again = load_adapters(load_model(str(base / "ckpt")), str(path))  # checks the checksums
    for k, v in adapter_state(again).items():
        assert (v == first[k]).all()


# --------------------------------------------------------------------------------------
# Two runs on one output
# --------------------------------------------------------------------------------------
def test_a_held_output_is_refused_naming_the_holder_and_taken_over_once_it_dies(base, tmp_path):
    out = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from gpt_compress import locks; "
                               f"locks.hold({str(out)!r}); print('held', flush=True); time.sleep({WAIT})"],
                              stdout=subprocess.PIPE, text=True, env=ENV)
    try:
        assert holder.stdout.readline().strip() == "held"
        before = snapshot(tmp_path)
        for argv in (("export", "--model", base / "ckpt", "--output", out, "--no-validate"),
                     pretrain_args(base, out, 2), ("init", "-o", "Model.preset=gpt-tiny", "--output", out)):
            code, _, err = gptc(*argv)
            assert code == 1 and f"{out} is being written by another gpt-compress run (pid {holder.pid}: " in err, err
        assert snapshot(tmp_path) == before
    finally:
        holder.kill()  # SIGKILL: its lock file stays behind, naming a dead process
        holder.wait(timeout=WAIT)
    assert (tmp_path / ".run.lock").read_text().startswith(f"pid {holder.pid}: ")
    ok("init", "-o", "Model.preset=gpt-tiny", "--output", out)  # the stale lock is taken over
    from gpt_compress.checkpoint import load_model
    load_model(str(out))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_two_exports_at_once_one_proceeds_one_is_refused(base, tmp_path):
    out = tmp_path / "export"
    args = [sys.executable, "-m", "gpt_compress", "export", "--model", str(base / "ckpt"), "--output", str(out),
            "--format", "paddle", "--no-fused"]
    first = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    lock = tmp_path / ".export.lock"
    deadline = time.monotonic() + WAIT
    while not (lock.is_file() and lock.read_text().startswith(f"pid {first.pid}")):
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()
        time.sleep(0.05)
    second = cli("export", "--model", base / "ckpt", "--output", out, "--format", "paddle", "--no-fused")
    line = one_error_line(second.stderr, "export")
    assert second.returncode == 1 and f"is being written by another gpt-compress run (pid {first.pid}: " in line
    _, err = first.communicate(timeout=WAIT)
    assert first.returncode == 0, err
    from gpt_compress.inference.manifest import read_manifest, verify_files
    read_manifest(str(out))
    verify_files(str(out))  # the one export, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # lock file gone


# --------------------------------------------------------------------------------------
# SIGTERM is Ctrl-C
# --------------------------------------------------------------------------------------
def _wait_for(proc, ready, what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not ready():
        assert proc.poll() is None, f"exited before {what}: {proc.communicate()}"
        assert time.monotonic() < deadline, f"no {what} after {WAIT} s"
        time.sleep(0.05)


def _checkpoints(out: Path) -> list[Path]:
    root = out / "checkpoints"
    return sorted(p for p in root.iterdir() if (p / "checksums.json").is_file()) if root.is_dir() else []


@pytest.mark.parametrize("command", ["pretrain", "finetune"])
def test_sigterm_saves_a_checkpoint_and_names_it(base, tmp_path, command):
    out = tmp_path / "run"
    if command == "pretrain":
        args = pretrain_args(base, out, 100000, save=3)
    else:
        args = ["finetune", "--no-progress", "--model", str(base / "ckpt"), "-o", f"Finetune.train_file={base / 'sft.jsonl'}",
                "-o", "Data.seq_length=64", "-o", f"Global.output_dir={out}", "-o", "Engine.max_steps=100000",
                "-o", "Engine.global_batch_size=2", "-o", "Engine.micro_batch_size=2", "-o", "Engine.save_steps=3",
                "-o", "Engine.eval_freq=0", "-o", "Engine.logging_freq=0", "-o", "Engine.eval_iters=0"]
    proc = subprocess.Popen([sys.executable, "-m", "gpt_compress", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV)
    _wait_for(proc, lambda: bool(_checkpoints(out)), "checkpoint")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=WAIT)
    assert proc.returncode == 143, err[-3000:]
    line = one_error_line(err, command)
    m = re.search(r"interrupted \(SIGTERM\) at step (\d+) of 100000: the last checkpoint is (\S+step_(\d+)); "
                  r"continue with --resume auto", line)
    assert m, line
    assert int(m.group(1)) == int(m.group(3)) and Path(m.group(2)) == _checkpoints(out)[-1]  # this step, saved
    from gpt_compress.checkpoint import load_model
    load_model(m.group(2))
    no_temporaries(tmp_path)


def test_sigterm_stops_an_export_leaving_nothing(base, tmp_path):
    out = tmp_path / "export"
    proc = subprocess.Popen([sys.executable, "-m", "gpt_compress", "export", "--model", str(base / "ckpt"),
                             "--output", str(out), "--format", "all", "--no-fused"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    _wait_for(proc, lambda: any(p.name.startswith(".export.tmp-") for p in tmp_path.iterdir()), "temporary output")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=WAIT)
    assert proc.returncode == 143, err[-3000:]
    lines = [ln for ln in err.splitlines() if ln.startswith("gptc ")]  # Paddle may have warned before
    assert lines == ["gptc export: interrupted (SIGTERM); outputs are written atomically, so nothing half-written "
                     "was left"] and "Traceback" not in err, err[-3000:]
    assert list(tmp_path.iterdir()) == []
