"""Structured pruning, ``model -> smaller model``: the one place that slices weights.

``prune_model(model, keep_heads, keep_ffn)`` returns a new model of the same class whose config
lists the per-layer sizes (``Model.layer_num_heads`` / ``Model.layer_ffn_sizes``), so it saves
with ``save_model``, loads with ``load_model`` and exports like any other checkpoint.
``structured_prune(model, PruneConfig, batches)`` scores the groups (``importance.py``) and
keeps the best ones to the configured ratios.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import numpy as np

from ..config import ModelConfig, PruneConfig
from .importance import importance_scores, select_keep


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


def pruned_config(cfg: ModelConfig, keep_heads: Sequence[Sequence[int]],
                  keep_ffn: Sequence[Sequence[int]]) -> ModelConfig:
    """``cfg`` with per-layer head counts and FFN widths after keeping the given groups."""
    return ModelConfig.from_dict({**cfg.to_dict(), "layer_num_heads": [len(k) for k in keep_heads],
                                  "layer_ffn_sizes": [len(k) for k in keep_ffn]}, source="pruned config")


def prune_model(model, keep_heads: Sequence[Sequence[int]], keep_ffn: Sequence[Sequence[int]]):
    """A physically smaller copy of ``model``: block ``i`` keeps attention heads ``keep_heads[i]``
    and FFN channels ``keep_ffn[i]`` (indices into that block's current heads/channels). Every
    other weight is copied unchanged; ``model`` itself is not modified."""
    from ..checkpoint import assign_weights, state_dict_numpy

    cfg = model.config
    heads = _check_keep(keep_heads, [cfg.heads(i) for i in range(cfg.num_layers)], "heads")
    ffn = _check_keep(keep_ffn, [cfg.ffn(i) for i in range(cfg.num_layers)], "ffn")
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
    small = type(model)(pruned_config(cfg, heads, ffn))
    assign_weights(small, w, "pruned weights")
    if not model.training:
        small.eval()
    return small


@dataclass
class PrunePlan:
    """What ``structured_prune`` kept, and the scores it ranked by."""

    keep_heads: list[list[int]]
    keep_ffn: list[list[int]]
    head_scores: list[np.ndarray]
    ffn_scores: list[np.ndarray]

    def summary(self) -> dict:
        """JSON-friendly: kept heads per layer and the resulting sizes."""
        return {"kept_heads": self.keep_heads, "layer_num_heads": [len(k) for k in self.keep_heads],
                "layer_ffn_sizes": [len(k) for k in self.keep_ffn]}


def plan_pruning(model, cfg: PruneConfig, batches: Optional[Iterable[dict]] = None) -> PrunePlan:
    """Score heads and FFN channels by ``cfg.criterion`` and choose what to keep."""
    head_scores, ffn_scores = importance_scores(model, cfg.criterion, batches)
    return PrunePlan(keep_heads=select_keep(head_scores, cfg.head_ratio, cfg.scope, cfg.min_heads),
                     keep_ffn=select_keep(ffn_scores, cfg.ffn_ratio, cfg.scope, cfg.min_ffn),
                     head_scores=head_scores, ffn_scores=ffn_scores)


def structured_prune(model, cfg: PruneConfig, batches: Optional[Iterable[dict]] = None):
    """(pruned model, plan): ``model`` with the least important ``cfg.head_ratio`` of its heads
    and ``cfg.ffn_ratio`` of its FFN channels removed. ``batches`` (trainer batch dicts) are the
    calibration data of the Taylor criterion."""
    plan = plan_pruning(model, cfg, batches)
    return prune_model(model, plan.keep_heads, plan.keep_ffn), plan
