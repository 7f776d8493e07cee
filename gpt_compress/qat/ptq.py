"""Post-training quantization: calibrate the W8A8 input scales of a fake-quant model.

``calibrate(model, batches, qcfg)`` runs the *float* model (quantization switched off) over the
calibration batches and observes the input of every W8A8 layer, then fixes each layer's clip
value ``amax`` (the input scale is ``amax / 127``):

* ``abs_max``: the largest ``|x|`` seen;
* ``percentile``: the ``Quant.percentile`` percentile of ``|x|`` (outliers are clipped);
* ``mse``: the clip value minimising the expected squared quantization error (rounding noise
  ``s^2 / 12`` below the clip value, ``(|x| - amax)^2`` above), searched over the histogram.

The last two need a histogram of ``|x|`` over ``[0, max]``, so they take a second pass over
the same batches (the first finds ``max``). Weights need no calibration (abs-max, see
``quantize.py``).
"""
from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np
import paddle

from ..config import W8A8, QuantConfig
from .quantize import QuantLinear, qmax, quant_layers

BINS = 2048


class Observer:
    """``|x|`` statistics of one layer's inputs: the max, then (second pass) a histogram."""

    def __init__(self):
        self.amax = 0.0
        self.hist = None  # (BINS,) counts over [0, amax] once the second pass starts

    def update(self, x: paddle.Tensor) -> None:
        a = np.abs(x.numpy().astype(np.float32, copy=False)).reshape(-1)
        if self.hist is None:
            self.amax = max(self.amax, float(a.max(initial=0.0)))
        else:
            self.hist += np.histogram(a, bins=BINS, range=(0.0, self.amax))[0]

    def start_histogram(self) -> None:
        self.hist = np.zeros(BINS, dtype=np.float64)

    def threshold(self, method: str, bits: int, percentile: float = 99.99) -> float:
        """The clip value ``amax`` chosen by ``method``."""
        if method == "abs_max" or self.amax == 0.0:
            return self.amax
        edges = np.linspace(0.0, self.amax, BINS + 1)
        total = self.hist.sum()
        if method == "percentile":
            cdf = np.cumsum(self.hist) / total
            i = int(np.searchsorted(cdf, percentile / 100.0))
            return float(edges[min(i + 1, BINS)])
        # mse: every bin's upper edge is a candidate clip value.
        centers = (edges[:-1] + edges[1:]) / 2  # (BINS,)
        cand = edges[1:][:, None]  # (BINS, 1)
        step = cand / qmax(bits)
        err = np.where(centers[None, :] <= cand, step ** 2 / 12.0, (centers[None, :] - cand) ** 2)
        cost = err @ self.hist  # (BINS,)
        return float(edges[1:][int(np.argmin(cost))])


def w8a8_layers(model) -> dict[str, QuantLinear]:
    """The W8A8 layers of a fake-quant model (the ones with input scales)."""
    return {n: m for n, m in quant_layers(model).items() if isinstance(m, QuantLinear) and m.mode == W8A8}


@paddle.no_grad()
def _run(model, batches: Sequence[dict]) -> None:
    for b in batches:
        ids = b["input_ids"]
        model.gpt(ids if isinstance(ids, paddle.Tensor) else paddle.to_tensor(ids))


def observe(model, batches: Sequence[dict], histogram: bool) -> dict[str, Observer]:
    """Run the float model over ``batches`` (quantization off) and return an ``Observer`` per W8A8
    layer; with ``histogram`` a second pass fills the histograms."""
    layers = quant_layers(model)
    targets = w8a8_layers(model)
    was_training = model.training
    model.eval()
    saved = {n: m.enabled for n, m in layers.items()}
    obs = {n: Observer() for n in targets}
    try:
        for n, m in layers.items():
            m.enabled = False
        for n, m in targets.items():
            m.observer = obs[n]
        _run(model, batches)
        if histogram:
            for o in obs.values():
                o.start_histogram()
            _run(model, batches)
    finally:
        for n, m in layers.items():
            m.enabled, m.observer = saved[n], None
        if was_training:
            model.train()
    return obs


def calibrate(model, batches: Iterable[dict], qcfg: QuantConfig) -> dict[str, float]:
    """Fix the input clip value of every W8A8 layer of ``model`` from ``batches`` with
    ``qcfg.observer``; returns ``{layer: amax}``."""
    batches = list(batches)
    if not batches:
        raise ValueError("calibration needs at least one batch")
    obs = observe(model, batches, histogram=qcfg.observer != "abs_max")
    out = {}
    for name, layer in w8a8_layers(model).items():
        out[name] = obs[name].threshold(qcfg.observer, layer.act_bits, qcfg.percentile)
        layer.set_act_amax(out[name])
    return out
