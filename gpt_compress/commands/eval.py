"""`gptc eval`: LAMBADA accuracy or WikiText perplexity of a checkpoint or an exported model,
through the one runner API (dygraph, Paddle Inference or onnxruntime). Writes a JSON result."""
from __future__ import annotations

import os
import time

from ..fileio import write_json_atomic
from ._common import Output, check_text_file, claim_outputs, fail, print_json


def add_arguments(parser) -> None:
    parser.add_argument("--model", required=True, help="checkpoint dir (dygraph) or exported dir (paddle/onnx)")
    parser.add_argument("--backend", default=None, choices=("dygraph", "paddle", "onnx"),
                        help="default: dygraph for a checkpoint, paddle for an exported directory")
    parser.add_argument("--task", required=True, choices=("lambada", "wikitext"))
    parser.add_argument("--data", required=True, help="lambada_test.jsonl, or a WikiText file")
    parser.add_argument("--input-format", default="raw", choices=("raw", "raw-hf-rows", "tokens"),
                        help="WikiText: raw file as one string, Hugging Face rows, or the tokenized "
                             "wiki.*.tokens (detokenized first, as FleetX)")
    parser.add_argument("--seq-len", type=int, default=0, help="window length (default: the model's context)")
    parser.add_argument("--stride", type=int, default=0, help="WikiText overlapping-eval stride (default: seq-len)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--limit", type=int, default=0, help="LAMBADA: only the first N examples")
    parser.add_argument("--tokenizer-dir", default=None, help="default: the model directory's tokenizer")
    parser.add_argument("--output", default=None, help="also write the result JSON here (it is always printed)")
    parser.add_argument("--with-items", action="store_true", help="LAMBADA: include per-example correctness")
    parser.add_argument("--no-progress", action="store_true")


def run(args) -> int:
    from ..eval.lambada import evaluate_lambada
    from ..eval.wikitext import evaluate_wikitext
    from ..inference.manifest import MANIFEST, SCORE_PROGRAMS, read_manifest
    from ..inference.runner import Generator

    check_text_file(args.data, "--data")
    if args.output:  # checked now, not after the whole evaluation; a result file there is replaced
        claim_outputs(Output("--output", args.output, "file", overwrite=True))
    for flag, value, low in (("--batch-size", args.batch_size, 1), ("--seq-len", args.seq_len, 0),
                             ("--stride", args.stride, 0), ("--limit", args.limit, 0)):
        if value < low:
            fail(f"{flag} {value}: must be >= {low}")
    if not os.path.isdir(args.model):
        fail(f"--model {args.model}: directory not found")
    is_export = os.path.isfile(os.path.join(args.model, MANIFEST))
    if args.backend in ("paddle", "onnx") and not is_export:
        fail(f"--model {args.model} is a checkpoint; --backend {args.backend} runs an exported model "
             "(make one with `gptc export`) or use --backend dygraph")
    from ..memory import check_fits, model_config_of

    sized = model_config_of(args.model)
    if sized is not None:
        check_fits("eval", sized, batch=args.batch_size, seq=args.seq_len or None, what=args.model)
    backend = args.backend or ("paddle" if os.path.isfile(os.path.join(args.model, MANIFEST)) else "dygraph")
    options = {}
    if backend == "paddle":
        programs = read_manifest(args.model).data["programs"]
        if all("paddle" in programs.get(p, {}) for p in SCORE_PROGRAMS):
            # The scoring programs run the head only at the scored rows, with the log-softmax
            # inside; the fused program (the default otherwise) also takes chosen rows, but
            # returns their logits, and its head kernel is made for decode's few rows, not for
            # thousands of scored rows.
            options["fused"] = False
    gen = Generator.from_dir(args.model, backend=backend, tokenizer=args.tokenizer_dir, **options)
    if gen.tokenizer is None:
        return fail(f"{args.model} has no tokenizer; pass --tokenizer-dir")
    seq_len = args.seq_len or gen.max_positions
    if seq_len > gen.max_positions:
        fail(f"--seq-len {seq_len} exceeds the model's context of {gen.max_positions} tokens")
    if args.stride > seq_len:
        fail(f"--stride {args.stride} exceeds the window of {seq_len} tokens (--seq-len, default the model's "
             "context); use a stride <= the window")
    t0 = time.perf_counter()
    if args.task == "lambada":
        res = evaluate_lambada(gen, gen.tokenizer, args.data, seq_len=seq_len, batch_size=args.batch_size,
                               limit=args.limit or None, progress=not args.no_progress)
        out = res.to_dict(with_items=args.with_items)
    else:
        res = evaluate_wikitext(gen, gen.tokenizer, args.data, args.input_format, seq_len=seq_len,
                                stride=args.stride or None, batch_size=args.batch_size,
                                progress=not args.no_progress)
        out = res.to_dict()
    out.update(task=args.task, data=os.path.abspath(args.data), model=os.path.abspath(args.model),
               backend=backend, seconds=round(time.perf_counter() - t0, 2))
    if args.output:
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)  # claim_outputs: no file above
        write_json_atomic(args.output, out, sort_keys=False)
    print_json(out)
    return 0
