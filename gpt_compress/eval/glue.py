"""GLUE: metrics (accuracy, F1, Matthews correlation, Pearson/Spearman) and finetuning of
the sequence-classification head with the one trainer."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


def accuracy(pred: np.ndarray, gold: np.ndarray) -> float:
    """Fraction of exact matches."""
    return float((pred == gold).mean())


def f1(pred: np.ndarray, gold: np.ndarray) -> float:
    """F1 of the positive class (label 1)."""
    tp = float(((pred == 1) & (gold == 1)).sum())
    fp = float(((pred == 1) & (gold == 0)).sum())
    fn = float(((pred == 0) & (gold == 1)).sum())
    return 2 * tp / (2 * tp + fp + fn) if tp else 0.0


def matthews(pred: np.ndarray, gold: np.ndarray) -> float:
    """Matthews correlation coefficient of binary predictions."""
    tp = float(((pred == 1) & (gold == 1)).sum())
    tn = float(((pred == 0) & (gold == 0)).sum())
    fp = float(((pred == 1) & (gold == 0)).sum())
    fn = float(((pred == 0) & (gold == 1)).sum())
    den = math.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
    return (tp * tn - fp * fn) / den if den else 0.0


def pearson(x: np.ndarray, y: np.ndarray) -> float:
    """Pearson correlation."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    x, y = x - x.mean(), y - y.mean()
    den = math.sqrt(float((x * x).sum() * (y * y).sum()))
    return float((x * y).sum() / den) if den else 0.0


def _ranks(x: np.ndarray) -> np.ndarray:
    """Ranks with ties averaged (1-based)."""
    x = np.asarray(x)
    order = np.argsort(x, kind="stable")
    ranks = np.empty(len(x), dtype=np.float64)
    sorted_x = x[order]
    i = 0
    while i < len(x):
        j = i
        while j + 1 < len(x) and sorted_x[j + 1] == sorted_x[i]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2.0 + 1.0
        i = j + 1
    return ranks


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    """Spearman rank correlation (Pearson of tie-averaged ranks)."""
    return pearson(_ranks(x), _ranks(y))


METRICS = {"accuracy": accuracy, "f1": f1, "mcc": matthews, "pearson": pearson, "spearman": spearman}


def compute_metrics(names, pred: np.ndarray, gold: np.ndarray) -> dict:
    """The named metrics of ``pred`` against ``gold``."""
    return {n: METRICS[n](pred, gold) for n in names}


@dataclass
class GlueResult:
    """Dev metrics of a finetuned model."""

    task: str
    dev_file: str
    num_dev: int
    metrics: dict
    train_steps: int
    checkpoint: str


def predict(model, batches) -> np.ndarray:
    """Class indices (or regression scores) of a classifier over ``batches``."""
    import paddle

    model.eval()
    out = []
    with paddle.no_grad():
        for b in batches:
            logits = model(paddle.to_tensor(b["input_ids"]), attention_mask=paddle.to_tensor(b["attention_mask"]))
            logits = logits.numpy()
            out.append(logits[:, 0] if logits.shape[1] == 1 else logits.argmax(axis=-1))
    return np.concatenate(out)


def classification_loss(model, batch):
    """Cross-entropy over classes, or MSE for a single regression output (STS-B)."""
    import paddle
    import paddle.nn.functional as F

    logits = model(paddle.to_tensor(batch["input_ids"]), attention_mask=paddle.to_tensor(batch["attention_mask"]))
    labels = paddle.to_tensor(batch["labels"])
    if logits.shape[1] == 1:
        return F.mse_loss(logits[:, 0], labels)
    return F.cross_entropy(logits, labels)
