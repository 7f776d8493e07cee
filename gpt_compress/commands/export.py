"""`gptc export` / `export_model`: checkpoint -> inference directory (Paddle Inference and/or ONNX;
int8 for a quantized checkpoint: ``export.export`` chooses)."""
from __future__ import annotations

import os
import time

from ..errors import ConfigError
from ._common import add_kv_cache_argument, add_overwrite_argument, check_output_arg, print_json


def add_arguments(parser) -> None:
    parser.add_argument("--model", "--checkpoint", dest="model", required=True,
                        help="checkpoint directory (ours, or one converted from Hugging Face GPT-2)")
    parser.add_argument("--output", required=True, help="directory to write (a new one; an earlier export only with --overwrite)")
    add_overwrite_argument(parser)
    parser.add_argument("--format", choices=("paddle", "onnx", "all"), default="all",
                        help="paddle: Paddle Inference programs; onnx: onnxruntime; all: both (default)")
    parser.add_argument("--opset", type=int, default=17, help="ONNX opset (default 17)")
    parser.add_argument("--no-fused", action="store_true",
                        help="paddle: skip the fused CPU program (fused.json, our C++ operators built at first use)")
    parser.add_argument("--no-validate", action="store_true",
                        help="skip running the exported programs against dygraph on a small batch")
    parser.add_argument("--draft-vocab", type=int, default=0, metavar="N",
                        help="for a speculative draft: its fused program also proposes from the N tokens most "
                             "frequent in --draft-vocab-data, reading only their head rows a step")
    parser.add_argument("--draft-vocab-data", nargs="+", default=[], metavar="PREFIX",
                        help="training data to count tokens in (Data.data_prefix's form)")
    add_kv_cache_argument(parser, "the fused program")


def run(args) -> int:
    from ..export import export
    from ..memory import check_fits, model_config_of

    model = model_config_of(args.model)
    if model is not None:
        fused = not args.no_fused and args.format != "onnx"
        check_fits("export" if fused else "export_unfused", model, what=args.model)
    formats = ("paddle", "onnx") if args.format == "all" else (args.format,)
    if args.draft_vocab and not args.draft_vocab_data:
        raise ConfigError("--draft-vocab needs --draft-vocab-data: the data to count tokens in")
    check_output_arg(args, args.model)
    t0 = time.perf_counter()
    path = export(args.model, args.output, formats=formats, validate=not args.no_validate, opset=args.opset,
                  overwrite=args.overwrite, fused=not args.no_fused, draft_vocab=args.draft_vocab,
                  draft_vocab_data=args.draft_vocab_data, kv_cache_dtype=args.kv_cache_dtype)
    sizes = {f: os.path.getsize(os.path.join(path, f)) for f in sorted(os.listdir(path))}
    print_json({"output": path, "formats": list(formats), "seconds": round(time.perf_counter() - t0, 1),
                "files": sizes, "total_bytes": sum(sizes.values())})
    return 0
