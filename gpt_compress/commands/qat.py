"""`gptc qat`: quantization-aware training of a float checkpoint, then int8 export.

Fake-quantizes the layers chosen by the ``Quant`` section (W8A8 block Linears by default),
initialises the input scales on ``Quant.calib_batches`` batches, finetunes with the normal
trainer (FleetX recipe: small LR, dropout off, embeddings frozen), saves the quantized
checkpoint to OUTPUT/quantized, exports OUTPUT/int8 (Paddle Inference + onnxruntime) and ends
with the loss/perplexity delta of each against the input model (OUTPUT/quant_report.json).
"""
from __future__ import annotations

from ._common import fail
from ._quant import add_quant_arguments, calibration_batches, finish, start


def add_arguments(parser) -> None:
    add_quant_arguments(parser)


def run(args) -> int:
    from ..qat.ptq import calibrate
    from ..qat.quantize import freeze_embeddings, quantize_model
    from ..train.loss import causal_lm_loss
    from ..train.trainer import TrainingDiverged, fit

    job = start(args, "qat", dropout_off=True)
    model, cfg = job.model, job.cfg
    quantize_model(model, cfg.quant)
    if cfg.quant.freeze_embedding:
        freeze_embeddings(model)
    calibrate(model, calibration_batches(job.train_batches, cfg), cfg.quant)  # starting input scales
    try:
        result = fit(model, causal_lm_loss, job.train_batches, cfg, eval_batches=job.eval_batches,
                     tokenizer=job.tokenizer, show_progress=not args.no_progress)
    except TrainingDiverged as e:
        return fail(str(e))
    job.report.update(steps=result.steps, last_train_loss=result.last_loss)
    return finish(job, args, extra={"qat_steps": result.steps})
