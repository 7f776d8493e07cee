"""The slot decoder: continuous batching on the fused Paddle program's in-place KV cache.

``FusedBackend`` (``inference/fused.py``) writes each step's keys/values in place into
preallocated caches (B, H_i, capacity, D) at column S (the attention mask's width minus the
new tokens) and attends only to the columns the mask marks, in column order, with positions
``cumsum(mask) - 1``. So a row computes the same numbers whatever columns it sits in, with
masked columns (padding, gaps) anywhere in it. This class keeps ONE such cache of
``max_batch`` rows (slots), allocated once and grown only when it fills:

* the running rows are slots ``0..n-1`` and share the write column S; a decode step runs the
  backend on views of the first n rows (``Tensor._slice(0, n)`` shares the cache's memory,
  whatever ``FLAGS_use_stride_kernel`` says: ``gptc`` turns strided views off, runtime.py), so
  free slots cost nothing;
* ``prefill_many`` runs the newcomers' prompts together, left-padded batches of similar lengths
  (a row's numbers are those of running it alone, whatever the batch: the kernels' guarantee),
  and ``join`` copies each one's p prompt columns into a free slot's row at [S-p, S): one row
  copied per newcomer, never the batch. A prompt longer than S moves S to p (the other rows get
  masked columns);
* ``remove`` moves the last running row into the freed slot (one row copied);
* when S reaches the capacity, ``_relayout`` packs each row's valid columns to the right of a
  new S (the longest row), dropping padding and gaps, into a new cache that may be larger
  (doubling, at most the model's context plus ``slack``): one copy of the batch, once per many
  steps.

Requires that ``_slice`` gives a view (checked at construction); otherwise every step runs all
slots, the free ones with an all-masked row (the kernel gives such a row zeros: it attends to
nothing), at the cost of computing them.
"""
from __future__ import annotations

import ctypes
from typing import Hashable, Optional

import numpy as np

from ..inference.fused import FusedCache
from .decoder import Decoder

INITIAL_CAPACITY = 256  # columns allocated at first; doubled (to at most context + slack) when full
PAD_WASTE = 1.25  # a prefill batch computes at most this many times its prompts' tokens (padding)


def host_array(t) -> np.ndarray:
    """A numpy array over the memory of a dense float32 or bfloat16 CPU tensor ``t`` (no copy:
    what is written lands in the tensor; bfloat16 as its uint16 bits). Row copies through it cost
    a memmove, where a Paddle eager ``__setitem__`` costs tens of microseconds of dispatch per
    call; the array does not keep ``t`` alive (the caller holds both)."""
    import paddle

    shape = tuple(int(d) for d in t.shape)
    n = int(np.prod(shape))
    element = ctypes.c_uint16 if t.dtype == paddle.bfloat16 else ctypes.c_float
    return np.ctypeslib.as_array((element * n).from_address(t.data_ptr())).reshape(shape)


def prefill_groups(lengths: list[int], waste: float) -> list[list[int]]:
    """Split prompts of ``lengths`` into left-padded prefill batches: by increasing length, a
    prompt joins the current batch while the batch's padded size (rows x longest) stays within
    ``waste`` times its real tokens, else starts the next. Returns lists of indices."""
    groups: list[list[int]] = []
    total = 0
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        n = lengths[i]
        if groups and (len(groups[-1]) + 1) * n <= waste * (total + n):
            groups[-1].append(i)
            total += n
        else:
            groups.append([i])
            total = n
    return groups


class SlotDecoder(Decoder):
    """The ``Decoder`` of one in-place slot cache, over a backend whose ``serve_decoder`` is
    "slots" (``FusedBackend``: ``FusedCache`` caches, ``manifest``, ``on_thread``)."""

    cheap_join = True  # joining copies one row: no need to gather arrivals before a join
    batches_prefill = True  # ``prefill_many``: left-padded batches of similar lengths
    verifies = True  # ``step_many`` + ``keep``

    def __init__(self, backend, max_batch: int, slack: int = 0):
        super().__init__(backend)
        self.max_batch = max_batch
        self.layers = backend.manifest.layers
        context = backend.manifest.max_positions
        self.max_capacity = context + (slack or max(32, context // 4))
        self.relayouts = 0  # how many times the cache was repacked (stats)
        self._fed = (0, 0)  # the last step_many's write column and columns (for keep)
        self.max_rows = 0  # the largest running batch so far (stats)
        self._tensors = backend.on_thread(self._alloc, min(INITIAL_CAPACITY, self.max_capacity))
        # The mask (max_batch, S), rows >= n unused: the first S columns of a buffer as wide as
        # the cache, so that a step opens its column in place (``_widen``).
        self._mask_buf = np.zeros((max_batch, self.capacity), np.int64)
        self._mask = self._mask_buf[:, :0]
        self._hosts = [host_array(t) for t in self._tensors]  # the same memory, for row copies
        self._views = backend.on_thread(self._check_views)
        self.greedy_steps = backend.greedy_steps  # ``decode_greedy_steps`` in one program run
        self._row_views: dict[int, list] = {}  # rows -> views of the first rows of _tensors

    # ------------------------------------------------------------------ state
    @property
    def width(self) -> int:
        """S: the write column of the next decode step."""
        return int(self._mask.shape[1])

    def _widen(self, cols: int) -> None:
        """Open ``cols`` more columns of the mask, masked (the cache has room for them): in
        place, in its buffer, rather than a copy of the whole mask at every step."""
        s = self.width
        if s + cols > self._mask_buf.shape[1]:
            raise ValueError(f"{s + cols} mask columns exceed the slot cache's {self._mask_buf.shape[1]}")
        self._mask = self._mask_buf[:, :s + cols]
        self._mask[:, s:] = 0

    @property
    def capacity(self) -> int:
        return int(self._tensors[0].shape[2])

    def _alloc(self, capacity: int) -> list:
        """A cache of ``capacity`` columns, uninitialized: the fused program reads only a row's
        unmasked columns, and each is written (a prefill's copy, a step's own keys and values)
        before it is unmasked. Zeroing it would write the whole cache at every relayout
        (about 0.75 GB at 32 slots of gpt-bench's 1,280 columns)."""
        import paddle

        return [paddle.empty([self.max_batch, layer["heads"], capacity, layer["head_dim"]],
                             dtype=self.backend.cache_dtype)
                for layer in self.layers for _ in range(2)]

    def _first_rows(self, rows: int) -> list:
        """Views of the first ``rows`` slots of every cache tensor, made once per row count and
        cache. Paddle 3.3.1's eager ``Tensor(DenseTensor)`` constructor, which ``_slice`` calls,
        never frees a Python list it creates, so views made per step grew a server's memory for
        as long as it ran (``docs/PADDLE_CPU.md``); the same views also spare the backend a
        rebinding of its inputs."""
        if rows == self.max_batch:
            return self._tensors
        views = self._row_views.get(rows)
        if views is None:
            views = self._row_views[rows] = self.backend.on_thread(lambda: [t._slice(0, rows) for t in self._tensors])
        return views

    def _check_views(self) -> bool:
        t = self._tensors[0]
        return self.max_batch == 1 or (hasattr(t, "_slice") and t._slice(0, 1).data_ptr() == t.data_ptr())

    # ------------------------------------------------------------------ join
    def prefill(self, prompt: list[int]) -> tuple[np.ndarray, tuple]:
        """Run ``prompt`` alone (batch 1); returns its logits (V,) and the state ``join`` takes."""
        return self.prefill_many([prompt])[0]

    def prefill_many(self, prompts: list[list[int]]) -> list[tuple[np.ndarray, tuple]]:
        """Prefill several prompts together: left-padded batches of similar lengths
        (``prefill_groups`` with ``PAD_WASTE``), one backend call each. A row's numbers do not depend on the other
        rows nor on the batch size (the fused kernels' guarantee, tested), so each prompt gets
        the logits and keys/values of running it alone. Returns ``[(logits (V,), state), ...]``
        in the order of ``prompts``."""
        out: list = [None] * len(prompts)
        for group in prefill_groups([len(p) for p in prompts], PAD_WASTE):
            t = max(len(prompts[i]) for i in group)
            ids = np.zeros((len(group), t), np.int64)
            mask = np.zeros((len(group), t), np.int64)
            for r, i in enumerate(group):
                p = len(prompts[i])
                ids[r, t - p:], mask[r, t - p:] = prompts[i], 1
            logits, cache = self.backend.prefill(ids, mask)
            for r, i in enumerate(group):
                out[i] = (logits[r], (cache, r, len(prompts[i])))
        return out

    def join(self, entries: list[tuple[Hashable, tuple]]) -> None:
        """Put prefilled sequences ``[(key, state from prefill), ...]`` into free slots."""
        self.check_joining([k for k, _ in entries])
        if len(self.keys) + len(entries) > self.max_batch:
            raise ValueError(f"{len(self.keys)} running + {len(entries)} joining > max_batch {self.max_batch}")
        placed = []
        try:
            for key, (cache, row, p) in entries:
                self.backend.on_thread(self._place, cache, row, p)
                self.keys.append(key)
                placed.append(key)
        except Exception:
            self.remove(placed)  # all of them or none: the caller fails the whole join
            raise
        self.max_rows = max(self.max_rows, len(self.keys))

    def _place(self, cache, row: int, p: int) -> None:
        """Copy row ``row`` of a (left-padded) prefill cache, its last ``p`` positions, into slot
        ``len(self.keys)``."""
        if max(self.width, p) + 1 > self.capacity:  # room for the prompt and the next step's column
            self._relayout(p)
        if self.width < p:  # the other rows get masked columns up to p
            self._widen(p - self.width)
        s, slot, t = self.width, len(self.keys), cache.length
        for dst, src in zip(self._hosts, cache.tensors):
            dst[slot, :, s - p:s] = host_array(src)[row, :, t - p:t]
        self._mask[slot] = 0
        self._mask[slot, s - p:] = 1

    # ------------------------------------------------------------------ decode
    def step(self, tokens: dict[Hashable, int]) -> dict[Hashable, np.ndarray]:
        """Decode one token for every row (``tokens[key]`` its last chosen token); returns each
        row's next logits (V,)."""
        s, rows, ids = self._next_column(tokens, 1)
        logits, _ = self.backend.decode(ids, self._mask[:rows], FusedCache(self._first_rows(rows), s))
        return {k: logits[i] for i, k in enumerate(self.keys)}

    def _next_column(self, tokens: dict[Hashable, int], columns: int) -> tuple[int, int, np.ndarray]:
        """Room for ``columns`` more columns (a relayout when the cache lacks it), and the next
        one opened to the running rows with their ``tokens``: (its index S, the rows the program
        runs, ids (rows, 1))."""
        missing = [k for k in self.keys if k not in tokens]
        if missing:
            raise ValueError(f"no token for rows {missing}")
        n = len(self.keys)
        if self.width + columns > self.capacity:
            self.backend.on_thread(self._relayout, 0, columns)
        s = self.width
        rows = n if self._views else self.max_batch
        self._widen(1)
        self._mask[:n, s] = 1
        ids = np.zeros((rows, 1), np.int64)
        ids[:n, 0] = [tokens[k] for k in self.keys]
        return s, rows, ids

    def step_greedy(self, tokens: dict[Hashable, int], steps: int, eos: Optional[int],
                    suppress: int) -> dict[Hashable, np.ndarray]:
        """``steps`` greedy steps in one program run (``decode_greedy_steps``): see ``Decoder``."""
        if not 1 <= steps <= self.greedy_steps:
            raise ValueError(f"steps must be in [1, {self.greedy_steps}], got {steps}")
        s, rows, ids = self._next_column(tokens, steps)
        n = len(self.keys)
        finished = np.arange(rows) >= n  # free slots: their tokens are padding
        out, _ = self.backend.decode_greedy_steps(ids, self._mask[:rows], FusedCache(self._first_rows(rows), s),
                                                  steps, eos, 0, finished, suppress)
        self._widen(steps - 1)
        self._mask[:n, s + 1:] = 1
        return {k: out[i] for i, k in enumerate(self.keys)}

    def step_many(self, tokens: dict[Hashable, list[int]]) -> Optional[dict[Hashable, np.ndarray]]:
        """Speculative decoding's verify step: ``tokens[key]`` is a row's last chosen token and its
        draft tokens, fed in one run (T = the longest list; a shorter row's extra columns are
        masked). Returns each row's logits at its fed positions (len, V), or None when the cache
        has no room for T columns even after a relayout (the caller then runs ``step``). Call
        ``keep`` next."""
        missing = [k for k in self.keys if k not in tokens or not tokens[k]]
        if missing:
            raise ValueError(f"no token for rows {missing}")
        n, t = len(self.keys), max(len(v) for v in tokens.values())
        if self.width + t > self.capacity:
            self.backend.on_thread(self._relayout, 0)
            if self.width + t > self.capacity:
                return None
        s = self.width
        rows = n if self._views else self.max_batch
        self._widen(t)
        ids = np.zeros((rows, t), np.int64)
        for i, k in enumerate(self.keys):
            ids[i, :len(tokens[k])] = tokens[k]
            self._mask[i, s:s + len(tokens[k])] = 1
        logits, _ = self.backend.decode_positions(ids, self._mask[:rows], FusedCache(self._first_rows(rows), s))
        self._fed = (s, t)
        return {k: logits[i, :len(tokens[k])] for i, k in enumerate(self.keys)}

    def keep(self, kept: dict[Hashable, int]) -> None:
        """After ``step_many``: row ``key`` keeps the first ``kept[key]`` columns it was fed (its
        token and the accepted drafts); the others are masked, and the write column moves back
        to just after the furthest kept column (the positions past it are overwritten later)."""
        s, t = self._fed
        for i, k in enumerate(self.keys):
            self._mask[i, s + kept.get(k, t):s + t] = 0
        self._mask = self._mask[:, :s + max(kept.values(), default=t)]

    def drop(self, counts: dict[Hashable, int]) -> None:
        """Mask the last ``counts[key]`` columns each row was fed (a draft model's proposals the
        target rejected, fed over several steps; a relayout in between keeps their order), then
        move the write column back past the trailing columns no row holds any more."""
        for i, k in enumerate(self.keys):
            if counts.get(k, 0) > 0:
                self._mask[i, np.flatnonzero(self._mask[i])[-counts[k]:]] = 0
        live = np.flatnonzero(self._mask[:len(self.keys)].any(axis=0))
        self._mask = self._mask[:, :int(live[-1]) + 1 if live.size else 0]

    # ------------------------------------------------------------------ leave
    def remove(self, keys) -> None:
        """Free the slots of ``keys`` at once (unknown keys are ignored): the last running rows
        move into the freed slots."""
        gone = set(keys) & set(self.keys)
        if not gone:
            return
        self.backend.on_thread(self._remove, gone)

    def _remove(self, gone: set) -> None:
        s = self.width
        for key in gone:
            i, last = self.keys.index(key), len(self.keys) - 1
            if i != last:
                for h in self._hosts:
                    h[i, :, :s] = h[last, :, :s]
                self._mask[i] = self._mask[last]
                self.keys[i] = self.keys[last]
            self._mask[last] = 0
            self.keys.pop()
        if not self.keys:
            self._mask = self._mask[:, :0]

    def _relayout(self, joining: int, steps: int = 1) -> None:
        """Pack every running row's valid columns to the right of S' = the longest row, into a
        cache with room for S' (or a joining prompt of ``joining`` positions) plus ``steps`` steps."""
        n = len(self.keys)
        lengths = self._mask[:n].sum(axis=1)
        width = int(max(lengths.max(initial=0), joining))
        need = width + steps
        capacity = self.capacity
        if need + capacity // 4 > capacity:
            capacity = min(self.max_capacity, max(2 * capacity, need + capacity // 4))
        if need > capacity:
            raise ValueError(f"a row of {need} positions does not fit the slot cache ({capacity} columns)")
        new = self._alloc(capacity)
        hosts = [host_array(t) for t in new]
        buf = np.zeros((self.max_batch, capacity), np.int64)
        mask = buf[:, :width]
        for r in range(n):
            cols = np.flatnonzero(self._mask[r])
            m = len(cols)
            mask[r, width - m:] = 1
            if not m:
                continue
            contiguous = cols[-1] - cols[0] + 1 == m
            for dst, src in zip(hosts, self._hosts):
                dst[r, :, width - m:width] = src[r, :, cols[0]:cols[-1] + 1] if contiguous else src[r][:, cols]
        self._tensors, self._hosts, self._mask_buf, self._mask = new, hosts, buf, mask
        self._row_views = {}
        self.relayouts += 1
