"""SIGTERM is Ctrl-C under `gptc`: cluster schedulers stop a job with SIGTERM, and the job should
stop as cleanly as on Ctrl-C (outputs removed or saved, one line saying what was kept).

A leaf module (standard library only).

* ``enable()``: `gptc` calls it before a command runs; from then on SIGTERM raises ``Terminated``
  (a ``KeyboardInterrupt``) in the main thread, so every ``except KeyboardInterrupt`` cleanup
  runs. ``disable()`` puts the previous handler back.
* ``reassert()``: ``import paddle`` installs a C++ SIGTERM handler (glog's) that prints a stack
  and kills the process; code that runs after Paddle is imported (the training loop, output
  writes) calls this to put ours back. It does nothing unless ``enable()`` was called, and
  nothing outside the main thread (only it may set handlers).
* ``deferred()``: a context manager for loops with a consistent point between iterations (an
  optimizer step): the first SIGINT or SIGTERM only records its number (``.signum``), the loop
  stops at its next such point; a second one raises at once.
"""
from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator, Optional


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C raises ``KeyboardInterrupt``."""

    signum = signal.SIGTERM


_enabled = False
_previous = None
_deferrals: list = []  # the handlers of the active ``deferred()`` blocks, innermost last


def _raise_terminated(signum, frame) -> None:
    raise Terminated()


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def enable() -> None:
    """SIGTERM raises ``Terminated`` from now on (main thread only)."""
    global _enabled, _previous
    if not _main_thread():
        return
    if not _enabled:
        _previous = signal.getsignal(signal.SIGTERM)
    _enabled = True
    reassert()


def disable() -> None:
    """Restore the SIGTERM handler ``enable()`` replaced."""
    global _enabled
    if _enabled and _main_thread():
        signal.signal(signal.SIGTERM, _previous if _previous is not None else signal.SIG_DFL)
    _enabled = False


def reassert() -> None:
    """Install our SIGTERM handler again (after ``import paddle`` replaced it) if enabled: the
    innermost ``deferred()`` block's, else ``Terminated``."""
    if _enabled and _main_thread():
        signal.signal(signal.SIGTERM, _deferrals[-1] if _deferrals else _raise_terminated)


def interrupt_signum(exc: BaseException) -> int:
    """The signal an interruption came from: SIGTERM for ``Terminated``, else SIGINT."""
    return int(getattr(exc, "signum", signal.SIGINT))


class Deferral:
    """What ``deferred()`` yields: ``signum`` is the first signal received, or None."""

    def __init__(self) -> None:
        self.signum: Optional[int] = None

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:  # asked twice: stop now
            raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()
        self.signum = signum


@contextlib.contextmanager
def deferred() -> Iterator[Deferral]:
    """SIGINT and SIGTERM recorded, not raised, inside the block (see the module docstring)."""
    d = Deferral()
    if not _main_thread():
        yield d
        return
    sigs = (signal.SIGINT, signal.SIGTERM)
    old = {s: signal.getsignal(s) for s in sigs}
    for s in sigs:
        signal.signal(s, d._handle)
    _deferrals.append(d._handle)
    try:
        yield d
    finally:
        _deferrals.remove(d._handle)
        for s, h in old.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)
