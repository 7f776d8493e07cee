"""The batch decoder: sequences of different lengths join and leave one running decode batch.

Continuous batching on the exported ``prefill``/``decode`` programs as they are: the KV cache
of the batch is one set of (B, H_i, S, D) tensors, **left-padded**, with an attention mask
(B, S) that marks each row's real positions. The programs take the mask as it is: attention
skips masked keys and positions are ``cumsum(mask) - 1``, so a row padded with empty slots at
its left (or anywhere) computes exactly what it computes alone, up to float rounding of the
batched kernels.

* ``prefill`` + ``join`` (or ``add``, both at once): a new sequence is prefilled **alone**
  (batch 1, as ``Generator.generate`` does for one prompt), then the caches of all sequences
  joining at this step are merged into the batch's in one go: every part is left-padded with
  masked zeros to the common length and the rows are concatenated.
* ``step``: one ``decode`` call for every row (each row's next token, the mask grown by one).
* ``remove``: the rows are dropped (``reorder_cache`` with the kept rows) at once; masked columns
  that no row uses any more are trimmed away at the next merge.

Merging goes through numpy (``_to_arrays``/``_from_arrays`` know each backend's cache type), so
it costs a few copies of the batch's cache per step at which sequences join; steps without a
join never copy it here. The fused Paddle program's in-place cache takes ``SlotDecoder``
(``slots.py``) instead, behind the same interface (``decoder.py``).
"""
from __future__ import annotations

from typing import Any, Hashable, Optional

import numpy as np

from .decoder import Decoder


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


class BatchDecoder(Decoder):
    """The ``Decoder`` of merged left-padded caches, for any backend (``max_batch`` is not needed:
    the batch grows as rows join)."""

    def __init__(self, backend, max_batch: Optional[int] = None):
        super().__init__(backend)
        self._cache: Any = None
        self._mask: Optional[np.ndarray] = None  # (B, S) int64: 1 where a row has a real position

    @property
    def width(self) -> int:
        """S: cached positions of the batch (its longest row plus padding not yet trimmed)."""
        return 0 if self._mask is None else int(self._mask.shape[1])

    def prefill(self, prompt: list[int]) -> tuple[np.ndarray, tuple]:
        """Run ``prompt`` alone (batch 1, as ``Generator.generate`` does for one prompt);
        returns its logits (V,) and the state ``join`` takes."""
        ids = np.asarray([prompt], dtype=np.int64)
        mask = np.ones_like(ids)
        logits, cache = self.backend.prefill(ids, mask)
        return logits[0], (cache, mask)

    def join(self, entries: list[tuple[Hashable, tuple]]) -> None:
        """Add prefilled sequences ``[(key, state from prefill), ...]`` as new rows, with one
        merge of the caches for all of them."""
        keys = [k for k, _ in entries]
        self.check_joining(keys)
        if not entries:
            return
        states = [st for _, st in entries]
        if not self.keys and len(states) == 1:
            self._cache, self._mask = states[0]
        else:
            if self.keys:
                states = [(self._cache, self._mask)] + states
            # Paddle tensors are touched on the backend's thread (``Backend.on_thread``).
            self._cache, self._mask = self.backend.on_thread(self._merge, states)
        self.keys.extend(keys)

    def _merge(self, states: list[tuple[Any, np.ndarray]]) -> tuple[Any, np.ndarray]:
        """One cache and mask from several ``(cache, mask)``: columns no row uses are trimmed,
        every part is right-aligned (left-padded with masked zeros) to the longest; each part is
        read once and written once into the merged arrays."""
        parts = []
        for cache, mask in states:
            used = np.flatnonzero(mask.any(axis=0))
            first = int(used[0]) if used.size else mask.shape[1]
            parts.append((_to_arrays(cache), first, mask[:, first:]))
        width = max(m.shape[1] for _, _, m in parts)
        rows = sum(m.shape[0] for _, _, m in parts)
        merged = [np.zeros((rows,) + a.shape[1:2] + (width,) + a.shape[3:], a.dtype) for a in parts[0][0]]
        out_mask = np.zeros((rows, width), np.int64)
        r = 0
        for arrays, first, mask in parts:
            b, w = mask.shape
            for dst, src in zip(merged, arrays):
                dst[r:r + b, :, width - w:] = src[:, :, first:]
            out_mask[r:r + b, width - w:] = mask
            r += b
        return _from_arrays(merged, states[-1][0]), out_mask

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
