"""`gptc convert`: Hugging Face GPT-2 directory <-> gpt-compress checkpoint (no network)."""
from __future__ import annotations

from ._common import add_overwrite_argument, check_output_arg, find_tokenizer, print_json


def add_arguments(parser) -> None:
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--from-hf", metavar="HF_DIR", help="local Hugging Face GPT-2 directory to import")
    src.add_argument("--to-hf", metavar="CKPT_DIR", help="our checkpoint to write in Hugging Face format")
    parser.add_argument("--output", required=True, help="directory to write")
    add_overwrite_argument(parser)


def run(args) -> int:
    from ..checkpoint import load_model, save_model
    from ..convert.hf_gpt2 import load_hf_gpt2, save_hf_gpt2

    check_output_arg(args, args.from_hf or args.to_hf)
    if args.from_hf:
        model = load_hf_gpt2(args.from_hf)
        path = save_model(model, args.output, tokenizer=find_tokenizer(args.from_hf), overwrite=args.overwrite)
    else:
        model = load_model(args.to_hf)
        path = save_hf_gpt2(model, args.output, tokenizer=find_tokenizer(args.to_hf), overwrite=args.overwrite)
    print_json({"output": path, "parameters": model.config.num_parameters()})
    return 0
