"""Cross-entropy on logits split along the vocabulary across tensor-parallel ranks.

Paddle's ``ParallelCrossEntropy`` (``c_softmax_with_cross_entropy``) has no CPU kernel, so the
math is written with ordinary ops on auto-parallel tensors; the engine turns each reduction
over the split vocabulary axis into a collective and the logits are never gathered:

    m      = max_v logits                      (all-reduce max; a constant for the gradient)
    lse    = m + log sum_v exp(logits - m)     (all-reduce sum)
    target = hidden . W[label]                 (vocab-parallel row lookup: all-reduce of (N, H))
    loss   = mean over counted positions of (lse - target)

On a single process the same function is exact softmax cross-entropy.
"""
from __future__ import annotations

from typing import Optional

import paddle
import paddle.nn.functional as F

IGNORE_INDEX = -100


def vocab_parallel_cross_entropy(logits: paddle.Tensor, labels: paddle.Tensor,
                                 loss_mask: Optional[paddle.Tensor] = None,
                                 target_logits: Optional[paddle.Tensor] = None) -> paddle.Tensor:
    """Mean CE of ``logits`` (..., V), possibly split on V, against ``labels`` (...) int64;
    positions with label ``-100`` (or ``loss_mask == 0``) do not count. ``target_logits`` (...):
    the logits of the labels when the caller has them cheaply (else picked by a one-hot sum)."""
    vocab = logits.shape[-1]
    logits = logits.reshape([-1, vocab]).astype("float32")  # (N, V)
    labels = labels.reshape([-1])  # (N,)
    valid = (labels != IGNORE_INDEX).astype("float32")
    if loss_mask is not None:
        valid = valid * (loss_mask.reshape([-1]) != 0).astype("float32")
    m = paddle.max(logits.detach(), axis=-1, keepdim=True)  # (N, 1)
    lse = paddle.log(paddle.sum(paddle.exp(logits - m), axis=-1)) + m.squeeze(-1)  # (N,)
    if target_logits is None:
        onehot = F.one_hot(paddle.clip(labels, min=0), vocab).astype("float32")  # (N, V)
        target_logits = paddle.sum(logits * onehot, axis=-1)
    target = target_logits.reshape([-1]).astype("float32")  # (N,)
    return paddle.sum((lse - target) * valid) / paddle.clip(paddle.sum(valid), min=1.0)


def vocab_parallel_lm_loss(model, input_ids: paddle.Tensor, labels: paddle.Tensor,
                           loss_mask: Optional[paddle.Tensor] = None) -> paddle.Tensor:
    """Next-token loss of GPTForCausalLM ``model`` whose head may be vocab-parallel. The label
    logits are ``hidden . W[label]``: a (vocab-parallel) row lookup, O(N x H) instead of a
    one-hot pass over (N, V)."""
    from ..train.loss import head_weight

    hidden = model.gpt(input_ids)  # (B, T, H)
    weight, vocab_major = head_weight(model)  # (V, H) tied, else (H, V)
    rows = F.embedding(paddle.clip(labels, min=0), weight if vocab_major else weight.T)  # (B, T, H)
    target = paddle.sum(hidden * rows, axis=-1)  # (B, T)
    return vocab_parallel_cross_entropy(model.logits(hidden), labels, loss_mask, target)
