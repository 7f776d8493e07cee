"""Cross-entropy on logits split along the vocabulary across tensor-parallel ranks: the one
vocab-parallel cross-entropy, used by auto-parallel training (``plan.AutoParallel``) and by
pipeline stages with mp > 1 (``pipeline.PipelineLoss``).

Paddle's ``ParallelCrossEntropy`` (``c_softmax_with_cross_entropy``) has no CPU kernel, so the
math is written with ordinary ops. On auto-parallel tensors the engine turns each reduction
over the split vocabulary axis into a collective; on fleet's local slices (``group`` given) the
same reductions are explicit all-reduces over the model-parallel group. The logits are never
gathered:

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

from ..train.loss import head_weight

IGNORE_INDEX = -100


def vocab_parallel_cross_entropy(logits: paddle.Tensor, labels: paddle.Tensor,
                                 loss_mask: Optional[paddle.Tensor] = None,
                                 target_logits: Optional[paddle.Tensor] = None, group=None) -> paddle.Tensor:
    """Mean CE of ``logits`` (..., V), possibly split on V, against ``labels`` (...) int64;
    positions with label ``-100`` (or ``loss_mask == 0``) do not count. ``target_logits`` (...):
    the logits of the labels when the caller has them cheaply (else picked by a one-hot sum).
    ``group``: fleet's model-parallel group when ``logits`` are this rank's local vocabulary slice
    (rank ``r`` holds ids ``[r * V_local, (r + 1) * V_local)``); None for auto-parallel tensors
    or one process."""
    if group is not None:
        import paddle.distributed as dist
        from paddle.distributed.fleet.layers.mpu import mp_ops  # its all-reduce carries the gradient rule
    vocab = logits.shape[-1]
    logits = logits.reshape([-1, vocab]).astype("float32")  # (N, V)
    labels = labels.reshape([-1])  # (N,)
    valid = (labels != IGNORE_INDEX).astype("float32")
    if loss_mask is not None:
        valid = valid * (loss_mask.reshape([-1]) != 0).astype("float32")
    m = paddle.max(logits.detach(), axis=-1, keepdim=True)  # (N, 1)
    if group is not None:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)  # the global max: a constant
    sumexp = paddle.sum(paddle.exp(logits - m), axis=-1)  # (N,)
    if group is not None:
        sumexp = mp_ops._mp_allreduce(sumexp, group=group)
    lse = paddle.log(sumexp) + m.squeeze(-1)  # (N,)
    if target_logits is None and group is not None:  # the label's logit lives on one rank
        local = labels - group.rank * vocab
        mine = paddle.logical_and(local >= 0, local < vocab).astype("float32")
        picked = paddle.take_along_axis(logits, paddle.clip(local, 0, vocab - 1).unsqueeze(-1), axis=-1).squeeze(-1)
        target_logits = mp_ops._mp_allreduce(picked * mine, group=group)  # (N,)
    elif target_logits is None:
        onehot = F.one_hot(paddle.clip(labels, min=0), vocab).astype("float32")  # (N, V)
        target_logits = paddle.sum(logits * onehot, axis=-1)
    target = target_logits.reshape([-1]).astype("float32")  # (N,)
    return paddle.sum((lse - target) * valid) / paddle.clip(paddle.sum(valid), min=1.0)


def vocab_parallel_lm_loss(model, input_ids: paddle.Tensor, labels: paddle.Tensor,
                           loss_mask: Optional[paddle.Tensor] = None) -> paddle.Tensor:
    """Next-token loss of GPTForCausalLM ``model`` whose head may be vocab-parallel. The label
    logits are ``hidden . W[label]``: a (vocab-parallel) row lookup, O(N x H) instead of a
    one-hot pass over (N, V)."""
    hidden = model.gpt(input_ids)  # (B, T, H)
    weight, vocab_major = head_weight(model)  # (V, H) tied, else (H, V)
    rows = F.embedding(paddle.clip(labels, min=0), weight if vocab_major else weight.T)  # (B, T, H)
    target = paddle.sum(hidden * rows, axis=-1)  # (B, T)
    return vocab_parallel_cross_entropy(model.logits(hidden), labels, loss_mask, target)
