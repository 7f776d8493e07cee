"""Model checkpoints: a directory with ``model.safetensors``, ``config.json`` and checksums.

Written atomically (a temporary sibling directory renamed into place), verified on load
(sha256 of every file, parameter names and shapes against the config). Never pickle.
Training state (optimizer, RNG, data position) is layered on top by ``train/checkpoint.py``.
"""
from __future__ import annotations

from .errors import CheckpointError, OutputError  # noqa: F401  (re-exported)

import hashlib
import json
import os
import shutil
import re
import tempfile
import time
from typing import Callable, Optional

import numpy as np

from .config import ConfigError, ModelConfig

FORMAT = "gpt-compress-checkpoint"
FORMAT_VERSION = 1
WEIGHTS = "model.safetensors"
CONFIG = "config.json"
CHECKSUMS = "checksums.json"




def sha256_file(path: str, chunk: int = 1 << 22) -> str:
    """Hex sha256 of a file, streamed."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk), b""):
            h.update(block)
    return h.hexdigest()


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _normal_mode(path: str, directory: bool) -> None:
    """mkstemp/mkdtemp create 0600/0700: give the file or directory the mode the umask gives
    anything else the user creates."""
    os.chmod(path, (0o777 if directory else 0o666) & ~_umask())


def write_json_atomic(path: str, obj) -> None:
    """Write JSON to ``path`` through a temp file + rename."""
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=d)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    _normal_mode(tmp, directory=False)
    os.replace(tmp, path)


def is_own_output(path: str) -> bool:
    """True if directory ``path`` is one gpt-compress wrote and nobody added to: its
    ``checksums.json`` lists every file in it (subdirectories must be such outputs too)."""
    try:
        with open(os.path.join(path, CHECKSUMS), encoding="utf-8") as f:
            sums = json.load(f)
        entries = list(os.scandir(path))
    except (OSError, ValueError):
        return False
    if not isinstance(sums, dict) or not all(isinstance(v, str) and re.fullmatch(r"[0-9a-f]{64}", v)
                                             for v in sums.values()):
        return False
    for e in entries:
        if e.name == CHECKSUMS:
            continue
        if e.is_symlink():
            return False
        if e.is_dir() and not is_own_output(e.path):
            return False
        if not e.is_dir() and e.name not in sums:
            return False
    return True


def check_output(path: str, overwrite: bool = False, flag: str = "--output") -> None:
    """Raise ``OutputError`` unless directory ``path`` may be written: it does not exist, is an
    empty directory, or is a gpt-compress output (``is_own_output``) and ``overwrite`` is set.
    Files, symlinks and foreign non-empty directories are never replaced."""
    path = os.path.abspath(path)
    if not os.path.lexists(path):
        return
    if os.path.islink(path) or not os.path.isdir(path):
        raise OutputError(f"{flag} {path} is an existing file; refusing to replace it with a directory "
                          "(choose a new directory name)")
    cwd = os.path.abspath(os.getcwd())
    if cwd == path or cwd.startswith(path.rstrip(os.sep) + os.sep):
        raise OutputError(f"{flag} {path} is the current directory or contains it; choose a new directory name")
    if not os.listdir(path):
        return
    if not is_own_output(path):
        raise OutputError(f"{flag} {path} is a non-empty directory gpt-compress did not write (or files were "
                          "added to it); refusing to replace it: choose a new or empty directory")
    if not overwrite:
        raise OutputError(f"{flag} {path} already holds a gpt-compress output; pass --overwrite to replace it")


_TMP_RE = re.compile(r"\.(?P<name>.+)\.(?:tmp|old)-(?:(?P<pid>\d+)-)?[^/]*$")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale_temps(path: str, max_age: float = 3600.0) -> list[str]:
    """Remove ``.NAME.tmp-*``/``.NAME.old-*`` siblings of ``path`` left by an interrupted write:
    those naming a process that is gone, or (older layout without a pid) older than ``max_age`` s."""
    parent, base = os.path.split(os.path.abspath(path))
    removed = []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    for n in names:
        m = _TMP_RE.match(n)
        if not m or m.group("name") != base:
            continue
        fp = os.path.join(parent, n)
        pid = m.group("pid")
        try:
            stale = (not _pid_alive(int(pid))) if pid else time.time() - os.path.getmtime(fp) > max_age
        except OSError:
            continue
        if stale and os.path.isdir(fp) and not os.path.islink(fp):
            shutil.rmtree(fp, ignore_errors=True)
            removed.append(fp)
    return removed


def write_checkpoint_dir(path: str, write_files: Callable[[str], None], overwrite: bool = False) -> str:
    """Create directory ``path`` atomically: ``write_files(tmpdir)`` fills it, checksums are
    added, then it is renamed into place. An existing ``path`` is replaced only if it is a
    gpt-compress output and ``overwrite`` is set (``check_output``); otherwise ``OutputError``
    is raised before anything is written."""
    path = os.path.abspath(path)
    check_output(path, overwrite)
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    clean_stale_temps(path)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.tmp-{os.getpid()}-", dir=parent)
    _normal_mode(tmp, directory=True)
    try:
        write_files(tmp)
        for root, dirs, files in os.walk(tmp):  # safetensors and mkstemp write 0600
            for n in dirs:
                _normal_mode(os.path.join(root, n), directory=True)
            for n in files:
                _normal_mode(os.path.join(root, n), directory=False)
        sums = {name: sha256_file(os.path.join(tmp, name))
                for name in sorted(os.listdir(tmp)) if os.path.isfile(os.path.join(tmp, name))}
        write_json_atomic(os.path.join(tmp, CHECKSUMS), sums)
        check_output(path, overwrite)  # again: something may have appeared there meanwhile
        if os.path.exists(path):
            old = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.old-{os.getpid()}-", dir=parent)
            os.rename(path, os.path.join(old, "x"))
            os.rename(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def verify_checksums(path: str) -> None:
    """Raise ``CheckpointError`` if any file listed in checksums.json is missing or altered."""
    sums_path = os.path.join(path, CHECKSUMS)
    if not os.path.isfile(sums_path):
        raise CheckpointError(f"{path}: no {CHECKSUMS}; not a complete gpt-compress checkpoint")
    try:
        with open(sums_path, encoding="utf-8") as f:
            sums = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{sums_path} is unreadable: {e}") from None
    for name, digest in sums.items():
        fp = os.path.join(path, name)
        if not os.path.isfile(fp):
            raise CheckpointError(f"{fp} is missing (listed in {CHECKSUMS})")
        if sha256_file(fp) != digest:
            raise CheckpointError(f"{fp} is corrupt: sha256 does not match {CHECKSUMS}")


def read_config(path: str) -> tuple[ModelConfig, dict]:
    """The ``ModelConfig`` and the metadata stored in a checkpoint directory."""
    cfg_path = os.path.join(path, CONFIG)
    if not os.path.isfile(cfg_path):
        raise CheckpointError(f"{cfg_path} not found: {path} is not a gpt-compress checkpoint")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            meta = json.load(f)
    except ValueError as e:
        raise CheckpointError(f"{cfg_path} is not valid JSON: {e}") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{cfg_path}: format {meta.get('format')!r} is not {FORMAT!r}")
    if meta.get("format_version", 0) > FORMAT_VERSION:
        raise CheckpointError(f"{cfg_path}: format version {meta['format_version']} is newer than this "
                              f"gpt-compress understands ({FORMAT_VERSION}); upgrade gpt-compress")
    try:
        cfg = ModelConfig.from_dict(meta["model"], source=cfg_path)
    except (ConfigError, KeyError) as e:
        raise CheckpointError(f"{cfg_path}: bad model config: {e}") from None
    return cfg, meta


def state_dict_numpy(model) -> dict[str, np.ndarray]:
    """Parameters (and persistable buffers) as numpy arrays, by public name."""
    return {k: np.ascontiguousarray(v.numpy()) for k, v in model.state_dict().items()}


def save_model(model, path: str, tokenizer=None, extra: Optional[dict] = None, overwrite: bool = False) -> str:
    """Save weights + config (+ tokenizer files) to checkpoint directory ``path`` (an existing
    one is replaced only with ``overwrite``: see ``check_output``)."""
    from safetensors.numpy import save_file

    head = "cls" if type(model).__name__ == "GPTForSequenceClassification" else "lm"
    tensors = state_dict_numpy(model)

    def write(tmp):
        save_file(tensors, os.path.join(tmp, WEIGHTS), metadata={"format": FORMAT})
        meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "head": head,
                "model": model.config.to_dict(), **(extra or {})}
        write_json_atomic(os.path.join(tmp, CONFIG), meta)
        if tokenizer is not None:
            tokenizer.save(tmp)

    return write_checkpoint_dir(path, write, overwrite=overwrite)


def load_weights(path: str) -> dict[str, np.ndarray]:
    """Read ``model.safetensors`` of a checkpoint directory (or a .safetensors file)."""
    from safetensors.numpy import load_file

    fp = path if path.endswith(".safetensors") else os.path.join(path, WEIGHTS)
    if not os.path.isfile(fp):
        raise CheckpointError(f"{fp} not found")
    try:
        return load_file(fp)
    except Exception as e:  # safetensors raises its own error types for bad headers
        raise CheckpointError(f"{fp} is not a readable safetensors file: {e}") from None


def check_state_dict(model, weights: dict[str, np.ndarray], source: str) -> None:
    """Raise ``CheckpointError`` naming every missing/unexpected key and shape mismatch."""
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    bad = [f"{k}: checkpoint {tuple(weights[k].shape)} vs model {expected[k]}"
           for k in expected if k in weights and tuple(weights[k].shape) != expected[k]]
    if missing or unexpected or bad:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} parameters ({', '.join(missing[:5])}"
                         f"{', ...' if len(missing) > 5 else ''})")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)} parameters ({', '.join(unexpected[:5])}"
                         f"{', ...' if len(unexpected) > 5 else ''})")
        if bad:
            parts.append("shape mismatch: " + "; ".join(bad[:5]) + ("; ..." if len(bad) > 5 else ""))
        raise CheckpointError(f"{source} does not match its model config: " + "; ".join(parts))


def assign_weights(model, weights: dict[str, np.ndarray], source: str) -> None:
    """Check then copy numpy ``weights`` into ``model`` in place."""
    import paddle

    check_state_dict(model, weights, source)
    sd = model.state_dict()
    for k, v in sd.items():
        v.set_value(paddle.to_tensor(weights[k], dtype=v.dtype))


def build_model(cfg: ModelConfig, head: str = "lm"):
    """Instantiate the model class for ``head`` ("lm" or "cls")."""
    from .model.gpt import GPTForCausalLM, GPTForSequenceClassification

    if head == "cls":
        return GPTForSequenceClassification(cfg)
    if head == "lm":
        return GPTForCausalLM(cfg)
    raise CheckpointError(f"unknown model head {head!r}")


def load_model(path: str, head: Optional[str] = None, verify: bool = True):
    """Load a checkpoint directory into a fresh model (eval mode); checks checksums,
    names and shapes. ``head`` overrides the stored head (e.g. "cls" on an LM checkpoint
    builds a classifier whose ``score`` stays freshly initialised)."""
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint directory not found: {path}")
    if verify:
        verify_checksums(path)
    cfg, meta = read_config(path)
    stored = meta.get("head", "lm")
    model = build_model(cfg, head or stored)
    weights = load_weights(path)
    if head == "cls" and stored == "lm":
        weights = {k: v for k, v in weights.items() if k != "lm_head.weight"}
        weights["score.weight"] = model.score.weight.numpy()
    assign_weights(model, weights, os.path.join(path, WEIGHTS))
    model.eval()
    return model
