"""Structured pruning, ``model -> smaller model``: the one place that slices weights.

``prune_model(model, keep_heads, keep_ffn, keep_layers, keep_hidden)`` returns a new model of the
same class whose config lists the per-layer sizes (``Model.layer_num_heads`` /
``Model.layer_ffn_sizes``), its depth and width (``num_layers``, ``hidden_size``, with
``head_dim`` kept), so it saves with ``save_model``, loads with ``load_model`` and exports like
any other checkpoint. ``structured_prune(model, PruneConfig, batches)`` scores the groups
(``importance.py``) and keeps the best ones to the configured ratios: heads and FFN channels
within blocks, whole blocks (depth) and hidden channels (width), the last two as Minitron
(Muralidharan et al., 2024) prunes a model before distilling it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import numpy as np

from ..config import ModelConfig, PruneConfig
from .importance import Scores, hidden_axis, importance_scores, select_keep


def _check_keep(keep: Sequence[Sequence[int]], sizes: list[int], what: str) -> list[np.ndarray]:
    if len(keep) != len(sizes):
        raise ValueError(f"keep_{what} has {len(keep)} entries but the model has {len(sizes)} layers")
    out = []
    for i, (k, n) in enumerate(zip(keep, sizes)):
        idx = np.asarray(sorted(int(j) for j in k), dtype=np.int64)
        if len(idx) == 0:
            raise ValueError(f"layer {i} would keep no {what}; keep at least one")
        if len(np.unique(idx)) != len(idx) or idx[0] < 0 or idx[-1] >= n:
            raise ValueError(f"keep_{what}[{i}] must be distinct indices in [0, {n}), got {list(k)}")
        out.append(idx)
    return out


def pruned_config(cfg: ModelConfig, keep_heads: Sequence[Sequence[int]], keep_ffn: Sequence[Sequence[int]],
                  keep_layers: Optional[Sequence[int]] = None, hidden_size: Optional[int] = None) -> ModelConfig:
    """``cfg`` with per-layer head counts and FFN widths after keeping the given groups, only the
    blocks ``keep_layers`` (default all) and ``hidden_size`` hidden channels (default all)."""
    layers = list(range(cfg.num_layers)) if keep_layers is None else list(keep_layers)
    width = {} if hidden_size in (None, cfg.hidden_size) else {"hidden_size": hidden_size, "head_dim": cfg.dim_head}
    return ModelConfig.from_dict({**cfg.to_dict(), **width, "num_layers": len(layers),
                                  "layer_num_heads": [len(keep_heads[i]) for i in layers],
                                  "layer_ffn_sizes": [len(keep_ffn[i]) for i in layers]}, source="pruned config")


def prune_model(model, keep_heads: Sequence[Sequence[int]], keep_ffn: Sequence[Sequence[int]],
                keep_layers: Optional[Sequence[int]] = None, keep_hidden: Optional[Sequence[int]] = None):
    """A physically smaller copy of ``model``: block ``i`` keeps attention heads ``keep_heads[i]``
    and FFN channels ``keep_ffn[i]`` (indices into that block's current heads/channels); only the
    blocks ``keep_layers`` remain (default all; renumbered in order) and only the hidden channels
    ``keep_hidden`` (default all) of every embedding, LayerNorm and Linear that reads or writes
    the residual stream. Every other weight is copied unchanged; ``model`` itself is not
    modified."""
    from ..checkpoint import assign_weights, state_dict_numpy

    cfg = model.config
    heads = _check_keep(keep_heads, [cfg.heads(i) for i in range(cfg.num_layers)], "heads")
    ffn = _check_keep(keep_ffn, [cfg.ffn(i) for i in range(cfg.num_layers)], "ffn")
    layers = list(range(cfg.num_layers)) if keep_layers is None else \
        _check_keep([keep_layers], [cfg.num_layers], "layers")[0].tolist()
    hidden = None if keep_hidden is None else _check_keep([keep_hidden], [cfg.hidden_size], "hidden")[0]
    d = cfg.dim_head
    w = state_dict_numpy(model)
    for i in range(cfg.num_layers):
        p = f"gpt.blocks.{i}."
        cols = (heads[i][:, None] * 3 * d + np.arange(3 * d)).reshape(-1)  # qkv columns, head-major [H, 3, D]
        rows = (heads[i][:, None] * d + np.arange(d)).reshape(-1)  # attn.out rows [H, D]
        w[p + "attn.qkv.weight"] = w[p + "attn.qkv.weight"][:, cols]
        w[p + "attn.qkv.bias"] = w[p + "attn.qkv.bias"][cols]
        w[p + "attn.out.weight"] = w[p + "attn.out.weight"][rows]
        w[p + "mlp.fc_in.weight"] = w[p + "mlp.fc_in.weight"][:, ffn[i]]
        w[p + "mlp.fc_in.bias"] = w[p + "mlp.fc_in.bias"][ffn[i]]
        w[p + "mlp.fc_out.weight"] = w[p + "mlp.fc_out.weight"][ffn[i]]
    if hidden is not None:
        for name in w:
            axis = hidden_axis(name)
            if axis is not None:
                w[name] = np.take(w[name], hidden, axis=axis)
    w = _renumber_blocks(w, layers)
    small = type(model)(pruned_config(cfg, heads, ffn, layers, None if hidden is None else len(hidden)))
    assign_weights(small, w, "pruned weights")
    if not model.training:
        small.eval()
    return small


def _renumber_blocks(w: dict, layers: list[int]) -> dict:
    """``w`` with only blocks ``layers``, numbered 0, 1, ... in their order."""
    new = {old: j for j, old in enumerate(layers)}
    out = {}
    for name, value in w.items():
        parts = name.split(".")
        if name.startswith("gpt.blocks."):
            old = int(parts[2])
            if old not in new:
                continue
            name = ".".join(parts[:2] + [str(new[old])] + parts[3:])
        out[name] = value
    return out


@dataclass
class PrunePlan:
    """What ``structured_prune`` kept, and the scores it ranked by."""

    keep_heads: list[list[int]]  # per block of the model, the dropped blocks included
    keep_ffn: list[list[int]]
    keep_layers: list[int]
    keep_hidden: list[int]
    scores: Scores

    def summary(self) -> dict:
        """JSON-friendly: kept blocks and heads, and the resulting sizes."""
        return {"kept_layers": self.keep_layers, "kept_heads": [self.keep_heads[i] for i in self.keep_layers],
                "num_layers": len(self.keep_layers), "hidden_size": len(self.keep_hidden),
                "layer_num_heads": [len(self.keep_heads[i]) for i in self.keep_layers],
                "layer_ffn_sizes": [len(self.keep_ffn[i]) for i in self.keep_layers]}


def plan_pruning(model, cfg: PruneConfig, batches: Optional[Iterable[dict]] = None) -> PrunePlan:
    """Score every group by ``cfg.criterion`` and choose what to keep."""
    scores = importance_scores(model, cfg.criterion, batches)
    return PrunePlan(keep_heads=select_keep(scores.heads, cfg.head_ratio, cfg.scope, cfg.min_heads),
                     keep_ffn=select_keep(scores.ffn, cfg.ffn_ratio, cfg.scope, cfg.min_ffn),
                     keep_layers=select_keep([scores.layers], cfg.layer_ratio)[0],
                     keep_hidden=select_keep([scores.hidden], cfg.hidden_ratio)[0], scores=scores)


def structured_prune(model, cfg: PruneConfig, batches: Optional[Iterable[dict]] = None):
    """(pruned model, plan): ``model`` with the least important ``cfg.head_ratio`` of its heads,
    ``cfg.ffn_ratio`` of its FFN channels, ``cfg.layer_ratio`` of its blocks and
    ``cfg.hidden_ratio`` of its hidden channels removed. ``batches`` (trainer batch dicts) are the
    calibration data of the Taylor criterion."""
    plan = plan_pruning(model, cfg, batches)
    narrow = plan.keep_hidden if len(plan.keep_hidden) < model.config.hidden_size else None
    return prune_model(model, plan.keep_heads, plan.keep_ffn, plan.keep_layers, narrow), plan
