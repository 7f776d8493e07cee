"""Causal-LM loss: a chunked, fused LM head + cross-entropy that never keeps [N, V] logits.

``labels`` are aligned with ``input_ids`` (``labels[b, t]`` is the target of position ``t``;
the dataset does the shift) and ``-100`` marks positions to ignore. The loss is the mean over
positions with ``labels != -100`` (and ``loss_mask != 0`` when given).

The plain head + ``F.cross_entropy`` keeps fp32 softmax of shape [B*T, vocab] (412 MB at
batch 8 x seq 256 x 50304) from forward to backward, next to the logits and their gradient.
``lm_loss`` walks the tokens in chunks of ``chunk`` rows; per chunk it computes the logits and
the fused softmax + cross-entropy, and multiplies the softmax straight into the gradients w.r.t.
the hidden states and the head weight. Only those two gradients ((N, H) and the weight's shape)
live until backward. Positions that do not count are dropped before the head, so they cost no
FLOPs. Without autograd (evaluation) only the loss is computed.

Measured on gpt-bench, batch 8 x seq 256 (``bench/forward.py``): the head is matmul-bound
(3 x 2*N*H*V FLOPs either way), so a train step takes the same time as with the plain loss
(within 1-3%) once the allocator reuses large blocks (``gpt_compress.runtime.tune_cpu``), and up
to ~10% longer without; the peak allocation of forward+backward is 639 MB instead of 1152 MB,
and the saving grows with batch x seq. Equal to the plain loss to ~1e-7 in value and gradients.
"""
from __future__ import annotations

from typing import Optional

import paddle
import paddle.nn.functional as F
from paddle.autograd import PyLayer
# The body of F.softmax_with_cross_entropy without its deprecation warning: one fused kernel that
# returns both the per-row loss and the softmax, which F.cross_entropy computes but drops.
from paddle.nn.functional.loss import base_softmax_with_cross_entropy

IGNORE_INDEX = -100
DEFAULT_CHUNK = 512  # rows per chunk: (512, 50304) fp32 = 103 MB


def head_weight(model) -> tuple[paddle.Tensor, bool]:
    """The LM head weight and whether it is laid out (vocab, hidden) (tied) or (hidden, vocab)."""
    if model.config.tie_word_embeddings:
        return model.gpt.wte.weight, True  # nn.Embedding: (V, H)
    return model.lm_head.weight, False  # nn.Linear: (H, V)


def as_tensor(x) -> paddle.Tensor:
    """``x`` as a Paddle tensor (arrays are copied in; tensors pass through)."""
    return x if isinstance(x, paddle.Tensor) else paddle.to_tensor(x)


def counted_positions(labels: paddle.Tensor, loss_mask: Optional[paddle.Tensor]) -> paddle.Tensor:
    """(N,) bool: positions that enter the mean."""
    valid = labels.reshape([-1]) != IGNORE_INDEX
    if loss_mask is not None:
        valid = paddle.logical_and(valid, loss_mask.reshape([-1]) != 0)
    return valid


def _head_ce(hidden, weight, targets, vocab_major: bool, chunk: int, with_grads: bool):
    """Sum over rows of CE(logits_i, target_i) and, with ``with_grads``, the gradients of that sum
    w.r.t. ``hidden`` and ``weight``. hidden (N, H); weight (V, H) if vocab_major else (H, V);
    targets (N,) in [0, V)."""
    loss = paddle.zeros([], dtype="float32")
    grad_hidden, grad_weight = [], None
    for start in range(0, hidden.shape[0], chunk):
        h = hidden[start:start + chunk]  # (n, H)
        logits = paddle.matmul(h, weight, transpose_y=vocab_major)  # (n, V)
        row_loss, probs = base_softmax_with_cross_entropy(
            logits, targets[start:start + chunk].unsqueeze(-1), return_softmax=True)  # (n, 1), (n, V)
        del logits
        loss = loss + row_loss.sum()
        if not with_grads:
            continue
        # d CE / d logits = softmax - onehot(target): the softmax part here, the one-hot part
        # once after the loop, as a gather / index_add on (N, H) tensors.
        grad_hidden.append(paddle.matmul(probs, weight, transpose_y=not vocab_major))  # (n, H)
        if vocab_major:
            part = paddle.matmul(probs, h, transpose_x=True)  # (V, H)
        else:
            part = paddle.matmul(h, probs, transpose_x=True)  # (H, V)
        del probs
        if grad_weight is None:
            grad_weight = part
        else:
            grad_weight.add_(part)
        del part
    if not with_grads:
        return loss, None, None
    grad_hidden = paddle.concat(grad_hidden, axis=0) if len(grad_hidden) > 1 else grad_hidden[0]
    if vocab_major:
        grad_hidden = grad_hidden - paddle.gather(weight, targets)
        grad_weight.index_add_(targets, 0, -hidden)
    else:
        grad_hidden = grad_hidden - paddle.gather(weight, targets, axis=1).t()
        grad_weight.index_add_(targets, 1, -hidden.t())
    return loss, grad_hidden, grad_weight


class _FusedHeadCrossEntropy(PyLayer):
    """Mean CE of the LM head as one autograd node; the gradients are computed in forward."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, vocab_major: bool, chunk: int):
        loss, grad_hidden, grad_weight = _head_ce(hidden, weight, targets, vocab_major, chunk, True)
        ctx.rows = hidden.shape[0]
        # Paddle requires None for an input that needs no gradient (e.g. a frozen tied embedding).
        ctx.needs = (not hidden.stop_gradient, not weight.stop_gradient)
        ctx.save_for_backward(grad_hidden, grad_weight)
        return loss / ctx.rows

    @staticmethod
    def backward(ctx, grad_loss):
        grads = ctx.saved_tensor()
        scale = grad_loss / ctx.rows
        return tuple(g * scale if need else None for g, need in zip(grads, ctx.needs))


def lm_loss(model, input_ids: paddle.Tensor, labels: paddle.Tensor,
            loss_mask: Optional[paddle.Tensor] = None, chunk: int = DEFAULT_CHUNK) -> paddle.Tensor:
    """Mean next-token cross-entropy of ``model`` (GPTForCausalLM) on (B, T) ids; fused, chunked head."""
    return lm_head_loss(model, model.gpt(input_ids), labels, loss_mask, chunk)


def causal_lm_loss(model, batch: dict) -> paddle.Tensor:
    """The trainer's loss function: ``lm_loss`` on a batch dict of (B, T) arrays or tensors,
    ``input_ids`` and ``labels`` plus an optional ``loss_mask``."""
    mask = batch.get("loss_mask")
    return lm_loss(model, as_tensor(batch["input_ids"]), as_tensor(batch["labels"]).astype("int64"),
                   None if mask is None else as_tensor(mask))


def lm_head_loss(model, hidden: paddle.Tensor, labels: paddle.Tensor,
                 loss_mask: Optional[paddle.Tensor] = None, chunk: int = DEFAULT_CHUNK) -> paddle.Tensor:
    """``lm_loss`` from the final hidden states (B, T, H) of ``model.gpt``."""
    if not paddle.in_dynamic_mode() or hidden.dtype != paddle.float32:
        # PyLayer is eager-only (to_static gets the plain math), and the fused path is fp32-only.
        return masked_mean_ce(model.logits(hidden), labels, loss_mask)
    hidden = hidden.reshape([-1, hidden.shape[-1]])  # (N, H)
    weight, vocab_major = head_weight(model)
    counted = counted_positions(labels, loss_mask)
    keep = paddle.nonzero(counted).reshape([-1])  # (K,)
    if keep.shape[0] == 0:
        return hidden.sum() * 0.0  # nothing counts: loss 0, zero gradients, graph kept
    if keep.shape[0] < counted.shape[0]:
        hidden = paddle.gather(hidden, keep)
    targets = paddle.gather(labels.reshape([-1]), keep)
    if not paddle.is_grad_enabled() or (hidden.stop_gradient and weight.stop_gradient):
        return _head_ce(hidden, weight, targets, vocab_major, chunk, with_grads=False)[0] / keep.shape[0]
    return _FusedHeadCrossEntropy.apply(hidden, weight, targets, vocab_major, chunk)


def lm_loss_reference(model, input_ids: paddle.Tensor, labels: paddle.Tensor,
                      loss_mask: Optional[paddle.Tensor] = None) -> paddle.Tensor:
    """The plain loss ``lm_loss`` must equal: full logits and ``F.cross_entropy``."""
    return masked_mean_ce(model(input_ids), labels, loss_mask)


def masked_mean_ce(logits: paddle.Tensor, labels: paddle.Tensor, loss_mask: Optional[paddle.Tensor]):
    """Mean ``F.cross_entropy`` over counted positions; logits (B, T, V)."""
    logits = logits.reshape([-1, logits.shape[-1]])
    per_token = F.cross_entropy(logits, labels.reshape([-1]), ignore_index=IGNORE_INDEX, reduction="none")
    valid = counted_positions(labels, loss_mask).astype(per_token.dtype)
    return (per_token.reshape([-1]) * valid).sum() / paddle.clip(valid.sum(), min=1.0)
