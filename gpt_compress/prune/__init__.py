"""Structured pruning of attention heads, FFN channels, blocks and hidden channels
(``model -> smaller model``)."""
from .importance import Scores, hidden_axis, importance_scores, magnitude_scores, select_keep, taylor_scores
from .structured import PrunePlan, plan_pruning, prune_model, pruned_config, structured_prune

__all__ = ["PrunePlan", "Scores", "hidden_axis", "importance_scores", "magnitude_scores", "plan_pruning", "prune_model",
           "pruned_config", "select_keep", "structured_prune", "taylor_scores"]
