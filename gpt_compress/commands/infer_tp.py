"""`gptc infer-tp`: generate with a tensor-parallel export (`gptc partition`), one process per rank."""
from __future__ import annotations

import argparse

from ._common import add_config_arguments, fail, generation_config, print_json
from .generate import parse_prompt_ids


def add_arguments(parser) -> None:
    add_config_arguments(parser)  # Generation.* settings
    parser.add_argument("--model-dir", required=True, help="directory written by `gptc partition`")
    parser.add_argument("--prompt", action="append", default=[], help="prompt text (repeatable)")
    parser.add_argument("--prompt-ids", action="append", default=[],
                        help="prompt as comma-separated token ids (repeatable)")
    parser.add_argument("--log-dir", default=None, help="keep the launcher's per-rank logs here")
    # Set by the launcher-side call (one process per rank); not for users.
    parser.add_argument("--request", help=argparse.SUPPRESS)
    parser.add_argument("--output", help=argparse.SUPPRESS)


def run(args) -> int:
    import dataclasses

    from ..inference.tensor_parallel import generate_tensor_parallel, run_rank
    from ..parallel.launch import launched_world

    if launched_world()[1] > 1:  # one rank, started by generate_tensor_parallel's launch
        run_rank(args.model_dir, args.request, args.output)
        return 0

    cfg = generation_config(args)
    gen = cfg.generation
    prompts = list(args.prompt) + [parse_prompt_ids(p) for p in args.prompt_ids]
    if not prompts:
        return fail("give --prompt or --prompt-ids")
    out = generate_tensor_parallel(args.model_dir, prompts, dataclasses.asdict(gen), log_dir=args.log_dir)
    print_json(out)
    return 0
