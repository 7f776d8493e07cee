"""`gptc ptq`: post-training quantization of a float checkpoint, then int8 export.

Fake-quantizes the layers chosen by the ``Quant`` section, calibrates the W8A8 input scales on
``Quant.calib_batches`` training batches with ``Quant.observer`` (abs_max, percentile or mse),
saves OUTPUT/quantized, exports OUTPUT/int8 and ends with the loss/perplexity delta of each
against the input model (OUTPUT/quant_report.json). Weight-only models (``Quant.targets=[]
Quant.weight_only=["*"]``) need no calibration.
"""
from __future__ import annotations

from ._quant import add_quant_arguments, calibration_batches, finish, start


def add_arguments(parser) -> None:
    add_quant_arguments(parser)


def run(args) -> int:
    from ..qat.ptq import calibrate, w8a8_layers
    from ..qat.quantize import quantize_model

    job = start(args, "ptq")
    quantize_model(job.model, job.cfg.quant)
    job.report["observer"] = job.cfg.quant.observer
    if w8a8_layers(job.model):
        job.report["act_amax"] = calibrate(job.model, calibration_batches(job.train_batches, job.cfg), job.cfg.quant)
    return finish(job, args)
