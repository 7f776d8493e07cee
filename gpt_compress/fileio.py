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
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from typing import Callable, Iterator, Optional

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
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
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


def write_dir_atomic(path: str, fill: Callable[[str], None], checksums: bool = True) -> str:
    """Create directory ``path`` atomically: ``fill(tmpdir)`` writes its files in a temporary
    sibling, ``CHECKSUMS`` is added (unless ``checksums=False``), then the sibling is renamed into
    place, replacing an older ``path``. Returns the absolute path."""
    path = os.path.abspath(os.fspath(path))
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.tmp-", dir=parent)
    try:
        fill(tmp)
        if checksums:
            write_checksums(tmp)
        if os.path.exists(path):
            old = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.old-", dir=parent)
            os.rename(path, os.path.join(old, "x"))
            os.rename(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path
