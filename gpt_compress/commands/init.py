"""`gptc init`: build a randomly initialised model from a config/preset and save it."""
from __future__ import annotations

from ._common import add_config_arguments, add_overwrite_argument, check_output_arg, config_from_args, find_tokenizer, print_json, seed_everything


def add_arguments(parser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--output", required=True, help="checkpoint directory to write")
    parser.add_argument("--head", choices=("lm", "cls"), default="lm", help="LM or sequence-classification head")
    add_overwrite_argument(parser)


def run(args) -> int:
    from ..checkpoint import build_model, save_model

    from ..memory import check_fits

    cfg = config_from_args(args)
    check_output_arg(args)
    check_fits("init", cfg.model)
    seed_everything(cfg.global_.seed)
    model = build_model(cfg.model, args.head)
    tok = find_tokenizer(cfg.data.tokenizer_dir)
    path = save_model(model, args.output, tokenizer=tok, overwrite=args.overwrite)
    print_json({"checkpoint": path, "preset": cfg.model.name, "parameters": cfg.model.num_parameters()})
    return 0
