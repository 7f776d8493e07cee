"""The dygraph backend: runs the Paddle model in eager mode behind the ``Backend`` contract (``base.py``)."""
from __future__ import annotations

import numpy as np
import paddle

from ..model.gpt import label_logprobs
from .base import Backend


class DygraphBackend(Backend):
    """Decode with a ``GPTForCausalLM`` in eager mode; the cache is a list of (k, v) tensors."""

    scores_positions = True  # hidden_states + head_scores: evaluation takes logits only where it scores

    def __init__(self, model):
        self.model = model
        self.model.eval()

    @paddle.no_grad()
    def _step(self, ids, mask, cache):
        hidden, presents = self.model.gpt(paddle.to_tensor(ids), attention_mask=paddle.to_tensor(mask),
                                          past_key_values=cache, use_cache=True)
        logits = self.model.logits(hidden[:, -1])  # only the last position is needed: (B, V)
        return logits.astype("float32").numpy(), presents

    def prefill(self, input_ids: np.ndarray, attention_mask: np.ndarray):
        """Prompt (B, T) -> last logits (B, V), cache."""
        return self._step(input_ids, attention_mask, None)

    def decode(self, input_ids: np.ndarray, attention_mask: np.ndarray, cache):
        """New tokens (B, 1) with the full mask (B, S + 1) -> logits (B, V), cache."""
        return self._step(input_ids, attention_mask, cache)

    def truncate_cache(self, cache, length: int):
        """The cache cut to its first ``length`` positions."""
        return [(k[:, :, :length], v[:, :, :length]) for k, v in cache]

    def reorder_cache(self, cache, rows: np.ndarray):
        """Gather cache rows (beam search)."""
        idx = paddle.to_tensor(np.asarray(rows, dtype=np.int64))
        return [(paddle.index_select(k, idx, axis=0), paddle.index_select(v, idx, axis=0)) for k, v in cache]

    @paddle.no_grad()
    def score(self, input_ids: np.ndarray, attention_mask: np.ndarray | None = None) -> np.ndarray:
        """Full-sequence logits (B, T, V) float32."""
        mask = None if attention_mask is None else paddle.to_tensor(attention_mask)
        return self.model(paddle.to_tensor(input_ids), attention_mask=mask).astype("float32").numpy()

    @paddle.no_grad()
    def hidden_states(self, input_ids: np.ndarray, attention_mask: np.ndarray | None = None) -> np.ndarray:
        """Final hidden states (B, T, hidden) float32."""
        mask = None if attention_mask is None else paddle.to_tensor(attention_mask)
        return self.model.gpt(paddle.to_tensor(input_ids), attention_mask=mask).astype("float32").numpy()

    @paddle.no_grad()
    def head_scores(self, hidden: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """hidden (N, hidden), labels (N,) -> log p(label) (N,) float64, argmax (N,) int64."""
        logits = self.model.logits(paddle.to_tensor(np.ascontiguousarray(hidden, dtype=np.float32)))
        lp, top = label_logprobs(logits.astype("float32"), paddle.to_tensor(np.asarray(labels, dtype=np.int64)))
        return lp.numpy(), top.numpy()
