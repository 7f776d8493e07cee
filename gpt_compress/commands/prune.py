"""`gptc prune`: remove the least important attention heads, FFN channels, blocks and hidden
channels of a checkpoint and save the physically smaller model; reports parameter counts and
validation loss/perplexity before and after."""
from __future__ import annotations

import dataclasses
import itertools
import math
import os
import time

from ._common import add_config_arguments, add_overwrite_argument, check_output_arg, config_from_args, find_tokenizer, lm_batches, print_json, seed_everything


def add_arguments(parser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--model", required=True, help="checkpoint directory to prune")
    parser.add_argument("--output", required=True, help="directory for the pruned checkpoint")
    add_overwrite_argument(parser)


def _ppl(loss):
    return None if loss is None else round(math.exp(min(loss, 50.0)), 4)


def run(args) -> int:
    from ..checkpoint import load_model, save_model
    from ..config import ConfigError
    from ..prune import structured_prune
    from ..train.loss import causal_lm_loss
    from ..train.trainer import evaluate

    cfg = config_from_args(args)
    pc = cfg.prune
    check_output_arg(args, args.model)
    if pc.criterion == "taylor" and not cfg.data.data_prefix:
        raise ConfigError("Prune.criterion=taylor scores the weights on calibration data: set Data.data_prefix "
                          "(a preprocessed dataset), or use -o Prune.criterion=magnitude")
    seed_everything(cfg.global_.seed)
    model = load_model(args.model)
    tokenizer = find_tokenizer(cfg.data.tokenizer_dir, args.model)
    calib, eval_batches = None, None
    if cfg.data.data_prefix:
        train_batches, eval_batches = lm_batches(cfg, pc.calib_batches * cfg.engine.micro_batch_size, [model.config])
        if pc.criterion == "taylor":
            calib = itertools.islice(train_batches(0), pc.calib_batches)
    before = evaluate(model, causal_lm_loss, eval_batches()) if eval_batches else None
    t0 = time.perf_counter()
    pruned, plan = structured_prune(model, pc, calib)
    seconds = time.perf_counter() - t0
    after = evaluate(pruned, causal_lm_loss, eval_batches()) if eval_batches else None
    path = save_model(pruned, args.output, tokenizer=tokenizer,
                      extra={"pruned_from": os.path.abspath(args.model), "prune": dataclasses.asdict(pc),
                             "kept_heads": plan.summary()["kept_heads"]}, overwrite=args.overwrite)
    n_before, n_after = model.config.num_parameters(), pruned.config.num_parameters()
    print_json({"output": path, "criterion": pc.criterion, "scope": pc.scope, "head_ratio": pc.head_ratio,
                "ffn_ratio": pc.ffn_ratio, "layer_ratio": pc.layer_ratio, "hidden_ratio": pc.hidden_ratio,
                **plan.summary(), "params_before": n_before, "params_after": n_after,
                "params_kept": round(n_after / n_before, 4), "seconds": round(seconds, 2),
                "valid_loss_before": None if before is None else round(before, 5), "valid_ppl_before": _ppl(before),
                "valid_loss_after": None if after is None else round(after, 5), "valid_ppl_after": _ppl(after),
                "valid_ppl_delta": None if before is None else round(_ppl(after) - _ppl(before), 4)})
    return 0
