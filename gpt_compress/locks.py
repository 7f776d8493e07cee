"""One writer per output: an advisory ``fcntl.flock`` lock on a lock file beside the output.

A leaf module (standard library only). ``hold(path, flag)`` takes ``.NAME.lock`` in the parent
of output ``path`` (an output directory is replaced by a rename, so its lock cannot live in it),
writes the holder's pid and command line into it and keeps it until ``release_all()`` (`gptc`
calls it when the command ends) or the process ends: the kernel drops the locks of a process
that dies, so a lock file left by a killed run names a dead pid and is simply taken over. A
second process asking for a held output is refused at once with ``OutputLocked`` naming the
holder. The file is unlinked while still locked and a taker checks that the file it locked is
still the one at the path, so no two processes ever both hold a lock.
"""
from __future__ import annotations

import fcntl
import os
import sys

from .errors import OutputLocked

_held: dict[str, tuple[int, str, list[str]]] = {}  # output path -> (fd, lock file, directories made)


def lock_path(path: str) -> str:
    """The lock file of output ``path``: ``.NAME.lock`` beside it."""
    parent, base = os.path.split(os.path.abspath(os.fspath(path)).rstrip(os.sep))
    return os.path.join(parent, f".{base}.lock")


def _read(fd: int) -> str:
    try:
        return os.pread(fd, 4096, 0).decode("utf-8", "replace").strip()
    except OSError:
        return ""


def hold(path: str, flag: str = "--output") -> str:
    """Lock output ``path`` for this process (again: a no-op); returns the lock file."""
    path = os.path.abspath(os.fspath(path)).rstrip(os.sep)
    if path in _held:
        return _held[path][1]
    lp = lock_path(path)
    parent = os.path.dirname(lp)
    made = []
    d = parent
    while not os.path.lexists(d):
        made.append(d)
        d = os.path.dirname(d)
    os.makedirs(parent, exist_ok=True)
    while True:
        fd = os.open(lp, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read(fd) or "a process that has not written its pid yet"
            os.close(fd)
            _remove_empty(made)
            raise OutputLocked(f"{flag} {path} is being written by another gpt-compress run ({holder}); "
                               f"wait for it to end or choose another output (lock file {lp})") from None
        try:  # the previous holder may have unlinked the file between our open and flock
            same = os.stat(lp).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()}: {' '.join(sys.argv)[:500]}\n".encode(), 0)
    _held[path] = (fd, lp, made)
    return lp


def _remove_empty(dirs: list[str]) -> None:
    for d in dirs:  # deepest first
        try:
            os.rmdir(d)
        except OSError:
            break


def release(path: str) -> None:
    """Unlock output ``path`` and remove its lock file (and the directories ``hold`` made for it,
    while empty)."""
    path = os.path.abspath(os.fspath(path)).rstrip(os.sep)
    fd, lp, made = _held.pop(path)
    try:
        os.unlink(lp)
    except OSError:
        pass
    os.close(fd)
    _remove_empty(made)


def release_all() -> None:
    """Release every lock this process holds."""
    for path in list(_held):
        release(path)


def held() -> list[str]:
    """The outputs this process holds."""
    return list(_held)
