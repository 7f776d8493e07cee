"""Shared by the accuracy tests (test_eval.py, test_finetune.py): the least accuracy on a labelled
dev set that shows a model learnt something, computed from the labels alone."""
from __future__ import annotations

import numpy as np

# Binomial standard deviations above the majority rate. A model that learnt nothing about the
# inputs answers one label (at most the majority rate) or guesses (mean at most the majority
# rate, standard deviation at most sqrt(1/4 / n), the widest, at p = 1/2), and beats the
# majority rate by 3 deviations with probability 0.13% (normal tail; n is hundreds here).
CHANCE_Z = 3.0


def chance_floor(labels, z: float = CHANCE_Z) -> tuple[float, float]:
    """(majority rate, majority rate + z sqrt(1/4 / n)) of ``labels`` (n of them, any hashable)."""
    labels = list(labels)
    majority = max(labels.count(x) for x in set(labels)) / len(labels)
    return majority, majority + z * float(np.sqrt(0.25 / len(labels)))
