"""`gptc quant-sensitivity`: rank layers by the validation loss their quantization costs alone,
and write the skip list that `gptc qat` / `gptc ptq` accept (``--skip-list`` or
``-o Quant.skip_file=...``).

Every layer the ``Quant`` section selects (W8A8 and weight-only) is tried alone, W8A8 inputs
calibrated with ``Quant.observer`` on ``Quant.calib_batches`` training batches; the loss is the
mean over ``Engine.eval_iters`` validation batches. A model too robust at 8 bits to rank its
layers can be ranked at fewer, e.g. ``-o Quant.weight_bits=4``. Writes OUTPUT/sensitivity.json
(ranked) and OUTPUT/skip_list.txt.
"""
from __future__ import annotations

import math
import os

from ._common import claim_run_dir, config_from_args, fail, print_json, seed_everything
from ._quant import add_quant_arguments, calibration_batches, prepare


def add_arguments(parser) -> None:
    add_quant_arguments(parser, export=False)
    parser.add_argument("--num-skip", type=int, default=None,
                        help="skip the N most sensitive layers (default: 10%% of them, at least 1)")
    parser.add_argument("--max-delta-pct", type=float, default=None,
                        help="also skip every layer whose perplexity cost exceeds this many percent")


def run(args) -> int:
    import json

    from ..qat.sensitivity import write_skip_file
    from ..qat.ptq import calibrate, w8a8_layers
    from ..qat.quantize import quantize_model
    from ..qat.sensitivity import analyze, skip_list
    from ..train.loss import causal_lm_loss
    from ..train.trainer import evaluate

    cfg = config_from_args(args)
    claim_run_dir(cfg)
    seed_everything(cfg.global_.seed)
    src, model, _, train_batches, eval_batches = prepare(args, cfg)
    if eval_batches is None:
        return fail("sensitivity needs validation data: give Data.split a validation share, e.g. [98, 2, 0]")
    valid = list(eval_batches())
    model.eval()
    quantize_model(model, cfg.quant)
    if w8a8_layers(model):
        calibrate(model, calibration_batches(train_batches, cfg), cfg.quant)
    ranking = analyze(model, lambda: evaluate(model, causal_lm_loss, valid),
                      progress=None if args.no_progress else lambda m: print(m, flush=True))
    num = args.num_skip
    if num is None and args.max_delta_pct is None:
        num = max(1, math.ceil(0.1 * len(ranking["layers"])))
    skips = skip_list(ranking, num, args.max_delta_pct)
    out = cfg.global_.output_dir
    os.makedirs(out, exist_ok=True)
    skip_path = write_skip_file(os.path.join(out, "skip_list.txt"), skips,
                                header=f"gptc quant-sensitivity of {os.path.abspath(src)}: the {len(skips)} "
                                       f"most sensitive layers\n(use with --skip-list or -o Quant.skip_file=...)")
    result = {"command": "quant-sensitivity", "input_checkpoint": os.path.abspath(src), **ranking,
              "skip_list": skips, "skip_file": skip_path, "valid_batches": len(valid),
              "quant": {"weight_bits": cfg.quant.weight_bits, "activation_bits": cfg.quant.activation_bits,
                        "observer": cfg.quant.observer, "calib_batches": cfg.quant.calib_batches}}
    with open(os.path.join(out, "sensitivity.json"), "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    print_json({k: result[k] for k in ("float_loss", "all_quantized_loss", "skip_list", "skip_file")})
    return 0
