"""`gptc partition`: export a checkpoint as tensor-parallel rank programs (one directory per rank)."""
from __future__ import annotations

from ._common import Output, add_kv_cache_argument, add_overwrite_argument, claim_outputs, print_json


def add_arguments(parser) -> None:
    parser.add_argument("--model", required=True, help="checkpoint directory (gptc pretrain / convert output)")
    parser.add_argument("--output", required=True, help="directory to write (rank_0/, rank_1/, ..., manifest.json)")
    parser.add_argument("--mp-degree", type=int, required=True, help="tensor-parallel ranks (divides heads, FFN, vocab)")
    parser.add_argument("--no-validate", action="store_true",
                        help="skip running every rank program against the single-card logits")
    parser.add_argument("--no-fused", action="store_true",
                        help="float checkpoints: only the unfused rank programs (no fused CPU program per rank)")
    add_kv_cache_argument(parser, "each fused rank program")
    parser.add_argument("--log-dir", default=None, help="launcher logs (default: OUTPUT.logs)")
    add_overwrite_argument(parser)


def run(args) -> int:
    from ..export.partition import export_rank, partition
    from ..parallel.launch import launched_world

    _, world = launched_world()
    if world == 1:  # started by the user: launch one process per rank, which land in the branch below
        claim_outputs(Output("--output", args.output, "dir", args.overwrite),
                      Output("--log-dir", args.log_dir or args.output.rstrip("/") + ".logs", "run", lock=False),
                      inputs=(args.model,))
        out = partition(args.model, args.output, args.mp_degree, validate=not args.no_validate, log_dir=args.log_dir,
                        overwrite=args.overwrite, fused=not args.no_fused, kv_cache_dtype=args.kv_cache_dtype)
        print_json({"output": out, "mp_degree": args.mp_degree, "validated": not args.no_validate})
        return 0
    if world != args.mp_degree:
        from ..config import ConfigError

        raise ConfigError(f"--mp-degree {args.mp_degree} but {world} processes were launched")
    export_rank(args.model, args.output, args.mp_degree, validate=not args.no_validate, fused=not args.no_fused,
                kv_cache_dtype=args.kv_cache_dtype)
    return 0
