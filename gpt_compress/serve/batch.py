"""The batch decoder: sequences of different lengths join and leave one running decode batch.

Continuous batching on the exported ``prefill``/``decode`` programs as they are: the KV cache
of the batch is one set of (B, H_i, S, D) tensors, **left-padded**, with an attention mask
(B, S) that marks each row's real positions. The programs take the mask as it is: attention
skips masked keys and positions are ``cumsum(mask) - 1``, so a row padded with empty slots at
its left (or anywhere) computes exactly what it computes alone, up to float rounding of the
batched kernels.

* ``add``: the new sequence is prefilled **alone** (batch 1, as ``Generator.generate`` does for
  one prompt), then its cache is merged into the batch's: the shorter side is left-padded with
  masked zeros to the common length and the rows are concatenated.
* ``step``: one ``decode`` call for every row (each row's next token, the mask grown by one).
* ``remove``: the rows are dropped (``reorder_cache`` with the kept rows) at once; masked columns
  that no row uses any more are trimmed away at the next merge.

Merging goes through numpy (``_to_arrays``/``_from_arrays`` know each backend's cache type), so
it costs a copy of the batch's cache per join; steps never copy it. A preallocated in-place
cache with one slot per sequence (issue 15) can replace this class behind the same three
methods.
"""
from __future__ import annotations

from typing import Any, Hashable, Optional

import numpy as np


def _to_arrays(cache: Any) -> list[np.ndarray]:
    """A backend's cache as numpy [k_0, v_0, k_1, ...], each (B, H_i, S, D), S the filled length."""
    if hasattr(cache, "tensors") and hasattr(cache, "length"):  # Paddle Inference (maybe bucketed)
        return [t[:, :, :cache.length].numpy() for t in cache.tensors]
    if isinstance(cache, list) and cache and isinstance(cache[0], tuple):  # dygraph: [(k, v), ...]
        return [t.numpy() for kv in cache for t in kv]
    return [v.numpy() for v in cache]  # onnxruntime OrtValues


def _from_arrays(arrays: list[np.ndarray], like: Any) -> Any:
    """Numpy cache arrays back into the type of ``like`` (a cache of the same backend)."""
    if hasattr(like, "tensors") and hasattr(like, "length"):
        import paddle

        return type(like)([paddle.to_tensor(a) for a in arrays], int(arrays[0].shape[2]))
    if isinstance(like, list) and like and isinstance(like[0], tuple):
        import paddle

        return [(paddle.to_tensor(arrays[i]), paddle.to_tensor(arrays[i + 1])) for i in range(0, len(arrays), 2)]
    import onnxruntime as ort

    return [ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(a)) for a in arrays]


def _left_pad(arrays: list[np.ndarray], mask: np.ndarray, width: int) -> tuple[list[np.ndarray], np.ndarray]:
    """Pad cache arrays (axis 2) and mask (axis 1) on the left to ``width`` with masked zeros."""
    extra = width - mask.shape[1]
    if extra <= 0:
        return arrays, mask
    arrays = [np.concatenate([np.zeros(a.shape[:2] + (extra,) + a.shape[3:], a.dtype), a], axis=2) for a in arrays]
    return arrays, np.concatenate([np.zeros((mask.shape[0], extra), mask.dtype), mask], axis=1)


class BatchDecoder:
    """Rows keyed by caller-chosen keys; ``add`` -> first logits, ``step`` -> next logits,
    ``remove`` drops rows. Not thread-safe: one engine loop owns it (and the backend)."""

    def __init__(self, backend, pad_token_id: int = 0):
        self.backend = backend
        self.pad_token_id = pad_token_id
        # Paddle tensors must be touched on the backend's own worker thread (predictor.py).
        self._on_backend = getattr(backend, "_call", lambda fn, *args: fn(*args))
        self.keys: list[Hashable] = []
        self._cache: Any = None
        self._mask: Optional[np.ndarray] = None  # (B, S) int64: 1 where a row has a real position

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def width(self) -> int:
        """S: cached positions of the batch (its longest row plus padding not yet trimmed)."""
        return 0 if self._mask is None else int(self._mask.shape[1])

    def add(self, key: Hashable, prompt: list[int]) -> np.ndarray:
        """Prefill ``prompt`` alone and join the batch as a new row; returns its logits (V,)."""
        if key in self.keys:
            raise ValueError(f"key {key!r} is already in the batch")
        ids = np.asarray([prompt], dtype=np.int64)
        mask = np.ones_like(ids)
        logits, cache = self.backend.prefill(ids, mask)
        if not self.keys:
            self._cache, self._mask = cache, mask
        else:
            self._cache, self._mask = self._on_backend(self._merge, cache, mask)
        self.keys.append(key)
        return logits[0]

    def _merge(self, cache: Any, mask: np.ndarray) -> tuple[Any, np.ndarray]:
        """The batch's cache and mask with one more row (``cache``, ``mask`` of one sequence)."""
        old, new = _to_arrays(self._cache), _to_arrays(cache)
        old_mask = self._mask
        used = np.flatnonzero(old_mask.any(axis=0))  # trim columns no row uses any more
        first = int(used[0]) if used.size else old_mask.shape[1]
        old, old_mask = [a[:, :, first:] for a in old], old_mask[:, first:]
        width = max(old_mask.shape[1], mask.shape[1])
        old, old_mask = _left_pad(old, old_mask, width)
        new, mask = _left_pad(new, mask, width)
        merged = _from_arrays([np.concatenate([a, b], axis=0) for a, b in zip(old, new)], cache)
        return merged, np.concatenate([old_mask, mask], axis=0)

    def step(self, tokens: dict[Hashable, int]) -> dict[Hashable, np.ndarray]:
        """Decode one token for every row (``tokens[key]`` its last chosen token); returns each
        row's next logits (V,)."""
        missing = [k for k in self.keys if k not in tokens]
        if missing:
            raise ValueError(f"no token for rows {missing}")
        ids = np.asarray([[tokens[k]] for k in self.keys], dtype=np.int64)
        self._mask = np.concatenate([self._mask, np.ones((len(self.keys), 1), np.int64)], axis=1)
        logits, self._cache = self.backend.decode(ids, self._mask, self._cache)
        return {k: logits[i] for i, k in enumerate(self.keys)}

    def remove(self, keys) -> None:
        """Drop rows at once (unknown keys are ignored)."""
        keys = set(keys)
        keep = [i for i, k in enumerate(self.keys) if k not in keys]
        if len(keep) == len(self.keys):
            return
        self.keys = [self.keys[i] for i in keep]
        if not keep:
            self._cache = self._mask = None
            return
        self._cache = self.backend.reorder_cache(self._cache, np.asarray(keep, dtype=np.int64))
        self._mask = self._mask[keep]
