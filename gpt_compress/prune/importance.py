"""How much each attention head, FFN channel, block and hidden channel matters, and which ones
to keep.

Parameter groups (the fused QKV projection is head-major, columns ``[H, 3, D]``):

* head ``h`` of block ``i``: columns ``[h*3D, (h+1)*3D)`` of ``attn.qkv`` (weight and bias) and
  rows ``[h*D, (h+1)*D)`` of ``attn.out.weight``;
* FFN channel ``j``: column ``j`` of ``mlp.fc_in`` (weight and bias) and row ``j`` of
  ``mlp.fc_out.weight``;
* block ``i`` (depth pruning): what it adds to the residual stream, ``attn.out`` and
  ``mlp.fc_out`` (weights and biases); zeroing them makes the block the identity;
* hidden channel ``c`` (width pruning, as Minitron prunes embedding channels): the entries of
  every parameter along its hidden axis (``hidden_axis``): the embeddings' column ``c``, every
  LayerNorm's ``c``, the rows of the Linears that read the stream, the columns and biases of
  those that write it.

Criteria:

* ``magnitude``: the L2 norm of the group's weight entries (no data needed; for a block, of
  ``attn.out`` and ``mlp.fc_out``'s weights);
* ``taylor``: per calibration batch, ``|sum over the group's output rows of w * dL/dw|``, summed
  over batches. Zeroing those rows (``attn.out`` rows of a head, the ``fc_out`` row of a channel)
  removes the group exactly, so this is the first-order estimate of the loss change the removal
  causes; it equals the gradient of a gate on the head / channel output (Michel et al., 2019;
  Molchanov et al., 2017). The absolute value is taken per batch, before summing, so a group
  whose effect changes sign between batches still counts as important. Blocks and hidden
  channels take ``|sum of w * dL/dw|`` over all of the group's entries (group Taylor, Molchanov
  et al., 2019): for a block this is again the exact first-order effect of removing it; a hidden
  channel's removal also changes the LayerNorms' statistics, so there it is an estimate, which
  the distillation that follows width pruning repairs.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import numpy as np

CRITERIA = ("magnitude", "taylor")
SCOPES = ("layer", "global")

# Parameter name -> the axis that runs over the hidden (residual-stream) channels. Linear
# weights are [in, out]: readers of the stream have it on axis 0, writers on axis 1.
_HIDDEN_AXES = ((r"gpt\.(wte|wpe)\.weight", 1), (r"gpt\.blocks\.\d+\.ln_[12]\.(weight|bias)", 0),
                (r"gpt\.ln_f\.(weight|bias)", 0), (r"gpt\.blocks\.\d+\.(attn\.qkv|mlp\.fc_in)\.weight", 0),
                (r"gpt\.blocks\.\d+\.(attn\.out|mlp\.fc_out)\.weight", 1),
                (r"gpt\.blocks\.\d+\.(attn\.out|mlp\.fc_out)\.bias", 0), (r"(lm_head|score)\.weight", 0))


def hidden_axis(name: str) -> Optional[int]:
    """The axis of parameter ``name`` that runs over the hidden channels; None if it has none."""
    for pattern, axis in _HIDDEN_AXES:
        if re.fullmatch(pattern, name):
            return axis
    return None


def _hidden_sum(values, axis: int):
    """Per hidden channel: ``values`` summed over every other axis (numpy or paddle)."""
    if values.ndim == 1:
        return values
    return values.sum(axis=1 - axis)


@dataclass
class Scores:
    """Importance per group: heads and FFN channels per block, blocks, hidden channels."""

    heads: list[np.ndarray]
    ffn: list[np.ndarray]
    layers: np.ndarray
    hidden: np.ndarray


def _block_weights(model, i: int) -> dict[str, np.ndarray]:
    p = model.gpt.blocks[i]
    return {"qkv": p.attn.qkv.weight.numpy(), "out": p.attn.out.weight.numpy(),
            "fc_in": p.mlp.fc_in.weight.numpy(), "fc_out": p.mlp.fc_out.weight.numpy()}


def magnitude_scores(model) -> Scores:
    """Weight L2 norms of every group (no data)."""
    cfg = model.config
    d = cfg.dim_head
    heads, ffn, layers = [], [], []
    for i in range(cfg.num_layers):
        w = _block_weights(model, i)
        nh = cfg.heads(i)
        qkv = np.square(w["qkv"]).sum(axis=0).reshape(nh, 3 * d).sum(axis=1)  # (H,)
        out = np.square(w["out"]).sum(axis=1).reshape(nh, d).sum(axis=1)  # (H,)
        heads.append(np.sqrt(qkv + out))
        ffn.append(np.sqrt(np.square(w["fc_in"]).sum(axis=0) + np.square(w["fc_out"]).sum(axis=1)))  # (F,)
        layers.append(np.sqrt(np.square(w["out"]).sum() + np.square(w["fc_out"]).sum()))
    hidden = np.zeros(cfg.hidden_size)
    for name, p in model.named_parameters():
        axis = hidden_axis(name)
        if axis is not None:
            hidden += _hidden_sum(np.square(p.numpy().astype(np.float64)), axis)
    return Scores(heads, ffn, np.asarray(layers, dtype=np.float64), np.sqrt(hidden))


def taylor_scores(model, batches: Iterable[dict], loss_fn: Optional[Callable] = None) -> Scores:
    """Every group's score by first-order Taylor over calibration ``batches`` (trainer batch
    dicts); ``loss_fn(model, batch)`` defaults to the causal-LM loss. The model is scored in eval
    mode (no dropout) and left with no gradients."""
    import paddle

    from ..train.loss import causal_lm_loss

    loss_fn = loss_fn or causal_lm_loss
    cfg = model.config
    d = cfg.dim_head
    heads = [np.zeros(cfg.heads(i)) for i in range(cfg.num_layers)]
    ffn = [np.zeros(cfg.ffn(i)) for i in range(cfg.num_layers)]
    layers, hidden = np.zeros(cfg.num_layers), np.zeros(cfg.hidden_size)
    axes = [(p, hidden_axis(name)) for name, p in model.named_parameters()]
    was_training = model.training
    model.eval()
    model.clear_gradients()
    n = 0
    try:
        for batch in batches:
            with paddle.enable_grad():
                loss_fn(model, batch).backward()
            for i, block in enumerate(model.gpt.blocks):
                out, fc_out = block.attn.out.weight, block.mlp.fc_out.weight
                wg = (out * out.grad).sum(axis=1).reshape([cfg.heads(i), d]).sum(axis=1)  # (H,)
                heads[i] += np.abs(wg.numpy().astype(np.float64))
                ffn[i] += np.abs((fc_out * fc_out.grad).sum(axis=1).numpy().astype(np.float64))  # (F,)
                writes = (block.attn.out.weight, block.attn.out.bias, fc_out, block.mlp.fc_out.bias)
                layers[i] += abs(float(sum((w * w.grad).sum() for w in writes)))
            channel = sum(_hidden_sum(p * p.grad, axis) for p, axis in axes if axis is not None and p.grad is not None)
            hidden += np.abs(channel.numpy().astype(np.float64))
            model.clear_gradients()
            n += 1
    finally:
        model.clear_gradients()
        if was_training:
            model.train()
    if n == 0:
        raise ValueError("Taylor importance needs at least one calibration batch")
    return Scores(heads, ffn, layers, hidden)


def importance_scores(model, criterion: str, batches: Optional[Iterable[dict]] = None) -> Scores:
    """Every group's score by ``criterion`` ("magnitude" or "taylor")."""
    if criterion == "magnitude":
        return magnitude_scores(model)
    if criterion == "taylor":
        if batches is None:
            raise ValueError("the taylor criterion needs calibration batches")
        return taylor_scores(model, batches)
    raise ValueError(f"unknown importance criterion {criterion!r}; choose one of {', '.join(CRITERIA)}")


def _round(x: float) -> int:
    """Half-up rounding (Python's round() goes half-to-even)."""
    return int(math.floor(x + 0.5))


def select_keep(scores: list[np.ndarray], ratio: float, scope: str = "layer",
                minimum: int = 1) -> list[list[int]]:
    """Indices to keep per layer after dropping the lowest-scoring ``ratio`` of the groups.

    ``scope="layer"`` drops ``round(ratio * n_i)`` groups of each layer; ``scope="global"`` drops
    ``round(ratio * sum n_i)`` groups ranked across all layers (scores must then be comparable,
    as Taylor scores are). No layer keeps fewer than ``minimum`` groups. Ties break towards the
    lower layer and index, so the result is a pure function of the scores.
    """
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"pruning ratio must be in [0, 1), got {ratio}")
    if scope not in SCOPES:
        raise ValueError(f"unknown pruning scope {scope!r}; choose one of {', '.join(SCOPES)}")
    for i, s in enumerate(scores):
        if not np.all(np.isfinite(s)):
            raise ValueError(f"importance scores of layer {i} are not finite")
    sizes = [len(s) for s in scores]
    floor = [min(max(minimum, 1), n) for n in sizes]
    dropped: list[set[int]] = [set() for _ in scores]
    if scope == "layer":
        for i, s in enumerate(scores):
            order = np.lexsort((np.arange(len(s)), s))  # ascending score, then index
            dropped[i] = set(order[:min(_round(ratio * len(s)), len(s) - floor[i])].tolist())
    else:
        budget = _round(ratio * sum(sizes))
        ranked = sorted((float(v), i, j) for i, s in enumerate(scores) for j, v in enumerate(s))
        left = list(sizes)
        for _, i, j in ranked:
            if budget == 0:
                break
            if left[i] > floor[i]:
                dropped[i].add(j)
                left[i] -= 1
                budget -= 1
    return [[j for j in range(n) if j not in dropped[i]] for i, n in enumerate(sizes)]
