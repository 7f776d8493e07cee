"""Quantization sensitivity: quantize one layer at a time, rank layers by the loss they cost.

FleetX found by hand that skipping a few FFN output projections of GPT-345M recovered LAMBADA
from 41.58% to 44.94% after QAT; ``analyze`` does that search automatically. The model is a
fake-quant model whose W8A8 layers are already calibrated (``ptq.calibrate``); every layer is
switched off except the one under test, the validation loss is measured, and the layers are
ranked by ``delta_loss`` (quantized minus float). ``skip_list`` turns the ranking into the names
``Quant.skip_file`` accepts.
"""
from __future__ import annotations

import math
import os
from typing import Callable, Iterable, Optional

from ..fileio import write_text_atomic
from .quantize import quant_layers


def analyze(model, eval_loss: Callable[[], float], progress: Optional[Callable[[str], None]] = None) -> dict:
    """Rank the fake-quant layers of ``model`` by the validation loss each costs alone.

    ``eval_loss()`` returns the model's mean validation loss in its current state. Returns
    ``{"float_loss", "all_quantized_loss", "layers": [{"layer", "mode", "loss", "delta_loss",
    "ppl", "delta_ppl_pct"}, ...]}`` sorted by ``delta_loss``, largest first."""
    layers = quant_layers(model)
    saved = {n: m.enabled for n, m in layers.items()}
    try:
        for m in layers.values():
            m.enabled = False
        base = float(eval_loss())
        rows = []
        for name, layer in layers.items():
            layer.enabled = True
            loss = float(eval_loss())
            layer.enabled = False
            rows.append({"layer": name, "mode": layer.mode, "loss": loss, "delta_loss": loss - base,
                         "ppl": math.exp(min(loss, 50.0)),
                         "delta_ppl_pct": 100.0 * (math.exp(min(loss - base, 50.0)) - 1.0)})
            if progress:
                progress(f"{name}: loss {loss:.5f} ({loss - base:+.5f})")
        for m in layers.values():
            m.enabled = True
        everything = float(eval_loss())
    finally:
        for n, m in layers.items():
            m.enabled = saved[n]
    rows.sort(key=lambda r: r["delta_loss"], reverse=True)
    for rank, r in enumerate(rows, 1):
        r["rank"] = rank
    return {"float_loss": base, "float_ppl": math.exp(min(base, 50.0)), "all_quantized_loss": everything,
            "all_quantized_ppl": math.exp(min(everything, 50.0)), "layers": rows}


def skip_list(ranking: dict, num_skip: Optional[int] = None, max_delta_pct: Optional[float] = None) -> list[str]:
    """Layers to keep in float: the ``num_skip`` most sensitive, and/or every layer whose
    perplexity cost exceeds ``max_delta_pct`` percent. Layers that *gain* are never skipped."""
    rows = [r for r in ranking["layers"] if r["delta_loss"] > 0]
    chosen = []
    if num_skip is not None:
        chosen += [r["layer"] for r in rows[:num_skip]]
    if max_delta_pct is not None:
        chosen += [r["layer"] for r in rows if r["delta_ppl_pct"] > max_delta_pct and r["layer"] not in chosen]
    return chosen


def least_sensitive(ranking: dict, n: int) -> Iterable[str]:
    """The ``n`` layers that cost least (a control for the skip list: skipping these instead
    should help less)."""
    return [r["layer"] for r in ranking["layers"][::-1][:n]]


def write_skip_file(path: str, names: list[str], header: str = "") -> str:
    """Write ``names`` one per line (what ``Quant.skip_file`` reads); returns ``path``."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_text_atomic(path, "".join(f"# {line}\n" for line in header.splitlines()) + "".join(n + "\n" for n in names))
    return path
