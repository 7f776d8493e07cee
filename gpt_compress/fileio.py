"""File I/O every layer shares: sha256 of a file, atomic file writes, atomic directory writes.

A leaf module (standard library only, nothing from the package), so the serving side
(``inference/``) can check an export's checksums without importing the training stack, and
every writer of a result, stamp, config or model directory replaces its target in one rename:
a reader sees the old file or the new one, never half of one.

* ``atomic_file(path)``: a context manager yielding a file object on a temporary sibling,
  flushed, fsync'd and renamed over ``path`` on success, removed on error.
* ``write_text_atomic`` / ``write_json_atomic``: one-call forms of it.
* ``write_dir_atomic(path, fill)``: ``fill(tmpdir)`` writes the files, ``checksums.json``
  (sha256 of every file, ``CHECKSUMS``) is added, then the directory is renamed into place.
* ``check_output_path(path, kind, ...)``: the same for every kind of output a command names: a
  directory it writes whole (``check_output``), a run directory (checkpoints and logs collect in
  it), a file; no path below an existing file.
* A device that fills while ``write_dir_atomic`` or ``atomic_file`` writes raises
  ``DiskFullError`` (one line: the path, the space needed, the space free); the temporary is
  removed and the previous content of the path is intact.
* ``check_output(path, overwrite)``: the output guard. An existing ``path`` is replaced only if
  it is a directory gpt-compress wrote (``is_own_output``: its ``checksums.json`` lists every
  file in it) and ``overwrite`` is set; a file, a symlink, the current directory or a foreign
  non-empty directory is never touched (``OutputError``, from the leaf ``errors.py``).

Written files and directories get the modes the umask gives (not mkstemp's 0600/0700), and
``.NAME.tmp-PID-*`` siblings left by an interrupted write are removed by the next write of
``NAME`` once their process is gone.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from typing import Callable, Iterator, Optional

from .errors import CheckpointError, DataError, DiskFullError, OutputError

CHECKSUMS = "checksums.json"
CHUNK = 1 << 22  # 4 MiB reads: hashing a 500 MB weight file stays in bounded memory


def sha256_file(path: str, chunk: int = CHUNK) -> str:
    """Hex sha256 of a file, streamed."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk), b""):
            h.update(block)
    return h.hexdigest()


@contextlib.contextmanager
def atomic_file(path: str, mode: str = "w", encoding: Optional[str] = "utf-8",
                newline: Optional[str] = None) -> Iterator:
    """Open a temporary sibling of ``path`` for writing; on a clean exit it is fsync'd and renamed
    over ``path``, on an exception removed (``path`` keeps its old content)."""
    path = os.fspath(path)
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.tmp-", dir=d)
    try:
        binary = "b" in mode
        with os.fdopen(fd, mode, encoding=None if binary else encoding, newline=None if binary else newline) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        normal_mode(tmp)
        os.replace(tmp, path)
    except BaseException as e:
        written = _size(tmp)
        with contextlib.suppress(OSError):
            os.remove(tmp)
        if is_disk_full(e):
            raise disk_full(path, e, written) from None
        raise


def write_text_atomic(path: str, text: str, newline: Optional[str] = None) -> None:
    """Write ``text`` to ``path`` through a temporary file + rename."""
    with atomic_file(path, newline=newline) as f:
        f.write(text)


def write_json_atomic(path: str, obj, indent: Optional[int] = 2, sort_keys: bool = True) -> None:
    """Write JSON to ``path`` through a temporary file + rename."""
    with atomic_file(path) as f:
        json.dump(obj, f, indent=indent, sort_keys=sort_keys)


def write_checksums(path: str) -> dict[str, str]:
    """Write ``CHECKSUMS`` (sha256 of every file directly in directory ``path``); returns it."""
    sums = {name: sha256_file(os.path.join(path, name))
            for name in sorted(os.listdir(path)) if name != CHECKSUMS and os.path.isfile(os.path.join(path, name))}
    write_json_atomic(os.path.join(path, CHECKSUMS), sums)
    return sums


def read_json(path: str, error: type = ValueError, missing: str = "", hint: str = ""):
    """The JSON value in file ``path``. A missing file raises ``error(missing)`` (default: "PATH
    not found"); an unreadable one or invalid JSON ``error("PATH is not valid JSON: why" + hint)``."""
    if not os.path.isfile(path):
        raise error(missing or f"{path} not found")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:  # UnicodeDecodeError is a ValueError
        raise error(f"{path} is not valid JSON: {e}{hint}") from None


def jsonl_strings(path: str, key: str) -> Iterator[tuple[int, str]]:
    """(line number, the ``key`` string) of every non-blank line of the JSONL file ``path``; a
    line that is not a JSON object with a ``key`` string raises ``DataError`` naming file and line."""
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)[key]
                if not isinstance(value, str):
                    raise TypeError(f"\"{key}\" is a {type(value).__name__}")
            except (ValueError, KeyError, TypeError) as e:
                raise DataError(f"{path}:{n}: expected a JSON object with a \"{key}\" string ({e})") from None
            yield n, value


def json_count(data: dict, key: str, path: str, error: type = ValueError, hint: str = "") -> int:
    """``data[key]`` of the JSON file ``path`` as a count: 0 when absent; anything but a
    non-negative integer (a bool included) raises ``error("PATH: KEY VALUE is not ..." + hint)``."""
    n = data.get(key, 0)
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise error(f"{path}: {key} {n!r} is not a non-negative integer{hint}")
    return n


def verify_checksums(path: str) -> None:
    """Raise ``CheckpointError`` if any file listed in checksums.json is missing or altered."""
    sums = read_json(os.path.join(path, CHECKSUMS), CheckpointError,
                     missing=f"{path}: no {CHECKSUMS}; not a complete gpt-compress checkpoint")
    for name, digest in sums.items():
        fp = os.path.join(path, name)
        if not os.path.isfile(fp):
            raise CheckpointError(f"{fp} is missing (listed in {CHECKSUMS})")
        if sha256_file(fp) != digest:
            raise CheckpointError(f"{fp} is corrupt: sha256 does not match {CHECKSUMS}")


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def normal_mode(path: str) -> None:
    """Give ``path`` the mode the umask gives what the user creates (mkstemp/mkdtemp and
    safetensors create 0600/0700)."""
    os.chmod(path, (0o777 if os.path.isdir(path) else 0o666) & ~_umask())


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


def is_disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` says the device (or the file size limit) ran out: ENOSPC, EDQUOT, EFBIG, or
    a library's error carrying the same text (Paddle reports C++ stream failures that way)."""
    if isinstance(exc, DiskFullError):  # a file inside the output (its message names the inner path)
        return True
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return True
    text = str(exc)
    return "No space left on device" in text or "File too large" in text or "Disk quota exceeded" in text


def _size(path: str) -> int:
    """Bytes in file or directory ``path`` (0 if it is gone)."""
    if os.path.isfile(path):
        return os.path.getsize(path)
    total = 0
    for root, _, files in os.walk(path):
        for n in files:
            with contextlib.suppress(OSError):
                total += os.path.getsize(os.path.join(root, n))
    return total


def _mb(n: float) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 1024:.1f} KiB"


def disk_full(path: str, exc: BaseException, written: int, needed: int = 0) -> DiskFullError:
    """The one-line ``DiskFullError`` for output ``path``: what it needs (``needed`` bytes when
    known, else more than the ``written`` bytes that fit), what is free, what was kept."""
    parent = os.path.dirname(os.path.abspath(path))
    try:
        free = _mb(shutil.disk_usage(parent).free)
    except OSError:
        free = "unknown"
    efbig = getattr(exc, "errno", None) == errno.EFBIG or "file size limit" in str(exc) or "File too large" in str(exc)
    why = "the file size limit was reached" if efbig else "no space left on the device"
    need = f"it needs about {_mb(needed)}" if needed > written else f"it needs more than the {_mb(written)} written"
    kept = "its previous content is intact" if os.path.lexists(path) else "nothing was left there"
    return DiskFullError(f"writing {path} failed, {why}: {need} ({free} free); the partial output was "
                         f"removed and {kept}. Free space (or choose another directory) and run again")


def nearest_existing(path: str) -> str:
    """``path`` or its closest ancestor that exists."""
    path = os.path.abspath(os.fspath(path))
    while not os.path.lexists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def check_output_path(path: str, kind: str, flag: str, overwrite: bool = False) -> None:
    """Raise ``OutputError`` unless output ``path`` of ``kind`` may be written; ``flag`` names it
    for the user. Kinds: ``"dir"`` (a directory written whole: ``check_output``), ``"run"`` (a
    run directory, which may exist and fill up: not a file), ``"file"`` (not a directory; an
    existing file only with ``overwrite``). No kind may lie below an existing file."""
    path = os.path.abspath(os.fspath(path))
    above = nearest_existing(os.path.dirname(path))
    if not os.path.isdir(above):
        raise OutputError(f"{flag} {path}: {above} is a file, not a directory; choose another path")
    if kind == "dir":
        check_output(path, overwrite, flag)
    elif kind == "run":
        if os.path.lexists(path) and not os.path.isdir(path):
            raise OutputError(f"{flag} {path} is an existing file; it must name a directory (a new one, or "
                              "this run's earlier output)")
    elif kind == "file":
        if os.path.isdir(path):
            raise OutputError(f"{flag} {path} is an existing directory; it must name a file")
        if os.path.lexists(path) and not overwrite:
            raise OutputError(f"{flag} {path} already exists; refusing to replace it (pass --overwrite, or "
                              "choose a new name)")
    else:
        raise ValueError(f"unknown output kind {kind!r}")


def check_output(path: str, overwrite: bool = False, flag: str = "--output") -> None:
    """Raise ``OutputError`` unless directory ``path`` may be written: it does not exist, is an
    empty directory, or is a gpt-compress output (``is_own_output``) and ``overwrite`` is set."""
    path = os.path.abspath(os.fspath(path))
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
    except (PermissionError, OverflowError):
        return True
    return True


def clean_stale_temps(path: str, max_age: float = 3600.0) -> list[str]:
    """Remove ``.NAME.tmp-*``/``.NAME.old-*`` sibling directories of ``path`` left by an
    interrupted write: those naming a process that is gone, or (no pid in the name: older
    layout) older than ``max_age`` seconds. Returns what was removed."""
    parent, base = os.path.split(os.path.abspath(os.fspath(path)))
    removed = []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    for n in names:
        m = _TMP_RE.match(n)
        fp = os.path.join(parent, n)
        if not m or m.group("name") != base or os.path.islink(fp) or not os.path.isdir(fp):
            continue
        pid = m.group("pid")
        try:
            stale = (not _pid_alive(int(pid))) if pid else time.time() - os.path.getmtime(fp) > max_age
        except OSError:
            continue
        if stale:
            shutil.rmtree(fp, ignore_errors=True)
            removed.append(fp)
    return removed


def write_dir_atomic(path: str, fill: Callable[[str], None], checksums: bool = True, overwrite: bool = False,
                     needed: int = 0) -> str:
    """Create directory ``path`` atomically: ``fill(tmpdir)`` writes its files in a temporary
    sibling, ``CHECKSUMS`` is added (unless ``checksums=False``), then the sibling is renamed into
    place. An existing ``path`` is replaced only as ``check_output`` allows (checked before
    ``fill`` and again before the rename). A full device raises ``DiskFullError`` (``needed``:
    the bytes ``fill`` writes, when the caller knows them). SIGTERM while writing stops it like
    Ctrl-C (``signals``). Returns the absolute path."""
    from . import signals

    signals.reassert()
    path = os.path.abspath(os.fspath(path))
    check_output(path, overwrite)
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    clean_stale_temps(path)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.tmp-{os.getpid()}-", dir=parent)
    try:
        fill(tmp)
        for root, dirs, files in os.walk(tmp):
            for n in dirs + files:
                normal_mode(os.path.join(root, n))
        normal_mode(tmp)
        if checksums:
            write_checksums(tmp)
        check_output(path, overwrite)  # again: something may have appeared there meanwhile
        if os.path.exists(path):
            old = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.old-{os.getpid()}-", dir=parent)
            os.rename(path, os.path.join(old, "x"))
            os.rename(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, path)
    except BaseException as e:
        written = _size(tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        if is_disk_full(e):
            raise disk_full(path, e, written, needed) from None
        raise
    return path
