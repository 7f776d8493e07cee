"""How much each attention head and FFN channel matters, and which ones to keep.

Parameter groups (the fused QKV projection is head-major, columns ``[H, 3, D]``):

* head ``h`` of block ``i``: columns ``[h*3D, (h+1)*3D)`` of ``attn.qkv`` (weight and bias) and
  rows ``[h*D, (h+1)*D)`` of ``attn.out.weight``;
* FFN channel ``j``: column ``j`` of ``mlp.fc_in`` (weight and bias) and row ``j`` of
  ``mlp.fc_out.weight``.

Criteria:

* ``magnitude``: the L2 norm of the group's weight entries (no data needed);
* ``taylor``: per calibration batch, ``|sum over the group's output rows of w * dL/dw|``, summed
  over batches. Zeroing those rows (``attn.out`` rows of a head, the ``fc_out`` row of a channel)
  removes the group exactly, so this is the first-order estimate of the loss change the removal
  causes; it equals the gradient of a gate on the head / channel output (Michel et al., 2019;
  Molchanov et al., 2017). The absolute value is taken per batch, before summing, so a group
  whose effect changes sign between batches still counts as important.
"""
from __future__ import annotations

import math
from typing import Callable, Iterable, Optional

import numpy as np

CRITERIA = ("magnitude", "taylor")
SCOPES = ("layer", "global")


def _block_weights(model, i: int) -> dict[str, np.ndarray]:
    p = model.gpt.blocks[i]
    return {"qkv": p.attn.qkv.weight.numpy(), "out": p.attn.out.weight.numpy(),
            "fc_in": p.mlp.fc_in.weight.numpy(), "fc_out": p.mlp.fc_out.weight.numpy()}


def magnitude_scores(model) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(per-layer head scores (H_i,), per-layer FFN channel scores (F_i,)): weight L2 norms."""
    cfg = model.config
    d = cfg.dim_head
    heads, ffn = [], []
    for i in range(cfg.num_layers):
        w = _block_weights(model, i)
        nh = cfg.heads(i)
        qkv = np.square(w["qkv"]).sum(axis=0).reshape(nh, 3 * d).sum(axis=1)  # (H,)
        out = np.square(w["out"]).sum(axis=1).reshape(nh, d).sum(axis=1)  # (H,)
        heads.append(np.sqrt(qkv + out))
        ffn.append(np.sqrt(np.square(w["fc_in"]).sum(axis=0) + np.square(w["fc_out"]).sum(axis=1)))  # (F,)
    return heads, ffn


def taylor_scores(model, batches: Iterable[dict],
                  loss_fn: Optional[Callable] = None) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(head scores, FFN channel scores) by first-order Taylor over calibration ``batches``
    (trainer batch dicts); ``loss_fn(model, batch)`` defaults to the causal-LM loss. The model
    is scored in eval mode (no dropout) and left with no gradients."""
    import paddle

    from ..train.loss import causal_lm_loss

    loss_fn = loss_fn or causal_lm_loss
    cfg = model.config
    d = cfg.dim_head
    heads = [np.zeros(cfg.heads(i)) for i in range(cfg.num_layers)]
    ffn = [np.zeros(cfg.ffn(i)) for i in range(cfg.num_layers)]
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
            model.clear_gradients()
            n += 1
    finally:
        model.clear_gradients()
        if was_training:
            model.train()
    if n == 0:
        raise ValueError("Taylor importance needs at least one calibration batch")
    return heads, ffn


def importance_scores(model, criterion: str, batches: Optional[Iterable[dict]] = None):
    """(head scores, FFN channel scores) by ``criterion`` ("magnitude" or "taylor")."""
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
