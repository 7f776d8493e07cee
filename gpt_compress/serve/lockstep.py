"""`gptc serve --tp N`: one engine on rank 0 driving every rank of a partitioned export in lock-step.

Every rank runs its own rank program (``inference/tensor_parallel.py``), and every program run
ends in collectives (the all-reduces in the program, the all-gather of the logits), so all ranks
must make the same calls in the same order. Rank 0 runs the HTTP server and the engine
(``serve/engine.py``) as for one card; the engine's calls that run programs are announced to the
other ranks first (``paddle.distributed.broadcast_object_list`` from rank 0, over gloo), which
replay them on their own copies of the same objects:

* the engine's batch decoder (``LockstepDecoder``: ``prefill``, ``join``, ``step``, ``remove``
  of a ``BatchDecoder`` on every rank; each rank's caches hold its own heads);
* the backend's calls outside it (``LockstepBackend``: ``prefill``/``decode``/``reorder_cache``
  of ``Generator.generate``, the server's warm-up; ``logits_at``/``score`` of prompt scoring),
  caches named by numbers that each follower maps to its own.

A follower (``follow``) loops on the announcements until rank 0 sends ``stop`` (its server
shut down). An announced call that fails on a follower is logged and skipped: rank 0's same call
fails the same way (the same inputs reach the same checks), and its engine fails that request.
"""
from __future__ import annotations

import itertools
import logging
from typing import Any, Hashable, Optional

import numpy as np

from ..inference.base import Backend
from .batch import BatchDecoder
from .decoder import Decoder

log = logging.getLogger("gpt_compress.serve")


def _announce(*message) -> None:
    import paddle.distributed as dist

    dist.broadcast_object_list([message], src=0)


def _receive() -> tuple:
    import paddle.distributed as dist

    box: list = [None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class _Cache:
    """Rank 0's cache of a backend-level call: its own cache and the number the followers know theirs by."""

    def __init__(self, number: int, cache: Any):
        self.number, self.cache = number, cache


class LockstepBackend(Backend):
    """Rank 0's ``Backend``: its ``TensorParallelBackend`` with each call announced first."""

    scores_rows = True
    serve_decoder = "lockstep"  # ``LockstepDecoder``: the engine's decoder calls are announced too

    def __init__(self, local):
        self.local = local
        self._numbers = itertools.count()

    def prefill(self, input_ids, attention_mask):
        """As ``TensorParallelBackend.prefill``; every rank runs it."""
        number = next(self._numbers)
        _announce("prefill", input_ids, attention_mask, number)
        logits, cache = self.local.prefill(input_ids, attention_mask)
        return logits, _Cache(number, cache)

    def decode(self, input_ids, attention_mask, cache: _Cache):
        number = next(self._numbers)
        _announce("decode", input_ids, attention_mask, cache.number, number)
        logits, new = self.local.decode(input_ids, attention_mask, cache.cache)
        return logits, _Cache(number, new)

    def reorder_cache(self, cache: _Cache, rows):
        number = next(self._numbers)
        _announce("reorder_cache", cache.number, rows, number)
        return _Cache(number, self.local.reorder_cache(cache.cache, rows))

    def truncate_cache(self, cache: _Cache, length: int):
        raise NotImplementedError("gptc serve --tp does not roll caches back (no speculative decoding)")

    def score(self, input_ids, attention_mask=None):
        _announce("score", input_ids, attention_mask)
        return self.local.score(input_ids, attention_mask)

    def logits_at(self, input_ids, attention_mask, rows):
        _announce("logits_at", input_ids, attention_mask, rows)
        return self.local.logits_at(input_ids, attention_mask, rows)

    def stop(self) -> None:
        """Release the followers (after the engine stopped)."""
        _announce("stop")


class LockstepDecoder(Decoder):
    """``BatchDecoder``'s interface on rank 0, each call announced to the followers first."""

    def __init__(self, backend: LockstepBackend, max_batch: int = 0):
        self.backend = backend
        self.inner = BatchDecoder(backend.local)
        self._numbers = itertools.count()

    def __len__(self) -> int:
        return len(self.inner)

    @property
    def keys(self) -> list:
        return self.inner.keys

    @property
    def width(self) -> int:
        return self.inner.width

    def prefill(self, prompt: list[int]) -> tuple[np.ndarray, tuple]:
        number = next(self._numbers)
        _announce("d_prefill", list(prompt), number)
        logits, state = self.inner.prefill(prompt)
        return logits, (number, state)

    def join(self, entries: list[tuple[Hashable, tuple]]) -> None:
        _announce("d_join", [(key, number) for key, (number, _) in entries])
        self.inner.join([(key, state) for key, (_, state) in entries])

    def add(self, key: Hashable, prompt: list[int]) -> np.ndarray:
        logits, state = self.prefill(prompt)
        self.join([(key, state)])
        return logits

    def step(self, tokens: dict) -> dict:
        _announce("d_step", dict(tokens))
        return self.inner.step(tokens)

    def remove(self, keys) -> None:
        keys = list(keys)
        _announce("d_remove", keys)
        self.inner.remove(keys)


def follow(local) -> None:
    """A follower rank's loop: replay rank 0's announced calls on ``local`` (this rank's
    ``TensorParallelBackend``) until ``stop``."""
    decoder = BatchDecoder(local)
    caches: dict[int, Any] = {}  # backend-level calls' caches by number
    states: dict[int, tuple] = {}  # prefilled, not yet joined decoder rows by number
    while True:
        name, *args = _receive()
        if name == "stop":
            return
        try:
            if name == "prefill":
                ids, mask, number = args
                caches.clear()  # a new generation: the previous one's caches are done with
                caches[number] = local.prefill(ids, mask)[1]
            elif name == "decode":
                ids, mask, old, number = args
                caches[number] = local.decode(ids, mask, caches.pop(old))[1]
            elif name == "reorder_cache":
                old, rows, number = args
                caches[number] = local.reorder_cache(caches[old], rows)
            elif name in ("score", "logits_at"):
                getattr(local, name)(*args)
            elif name == "d_prefill":
                prompt, number = args
                states[number] = decoder.prefill(prompt)[1]
            elif name == "d_join":
                decoder.join([(key, states.pop(number)) for key, number in args[0] if number in states])
                states.clear()  # rows prefilled but not joined (their requests failed)
            elif name == "d_step":
                decoder.step(args[0])
            elif name == "d_remove":
                decoder.remove(args[0])
            else:
                raise ValueError(f"unknown lock-step call {name!r}")
        except Exception:  # rank 0's same call failed too (see the module docstring)
            log.exception("lock-step call %s failed on this rank", name)


def stop_followers(generator: Optional[Any]) -> None:
    """Send ``stop`` when ``generator``'s backend is a ``LockstepBackend``."""
    backend = getattr(generator, "backend", None)
    if isinstance(backend, LockstepBackend):
        backend.stop()
