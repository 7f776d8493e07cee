"""Structured pruning of attention heads and FFN channels (``model -> smaller model``)."""
from .importance import importance_scores, magnitude_scores, select_keep, taylor_scores
from .structured import PrunePlan, plan_pruning, prune_model, pruned_config, structured_prune

__all__ = ["PrunePlan", "importance_scores", "magnitude_scores", "plan_pruning", "prune_model", "pruned_config",
           "select_keep", "structured_prune", "taylor_scores"]
