"""`gptc eval`: LAMBADA accuracy or WikiText perplexity of a checkpoint or an exported model,
through the one runner API (dygraph, Paddle Inference or onnxruntime). Writes a JSON result."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
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
    # A `gptc partition` directory: the command launches one process per rank, rank 0 writes here.
    parser.add_argument("--result-file", help=argparse.SUPPRESS)


def run(args) -> int:
    from ..eval.lambada import evaluate_lambada
    from ..eval.wikitext import evaluate_wikitext
    from ..inference.manifest import MANIFEST, SCORE_PROGRAMS, read_manifest
    from ..inference.runner import Generator
    from ..parallel.launch import launched_world

    check_text_file(args.data, "--data")
    ranks = launched_world()[1]
    if args.output and ranks == 1:  # checked now, not after the whole evaluation; a result file there is replaced
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
    mp = _tp_degree(args.model)
    if mp and args.backend not in (None, "paddle"):
        fail(f"--model {args.model} is a tensor-parallel export (`gptc partition`): it runs on Paddle Inference; "
             "drop --backend")
    if mp and ranks == 1:
        return _launch_ranks(args, mp)
    from ..memory import check_fits, model_config_of

    sized = model_config_of(args.model)
    if sized is not None:
        check_fits("eval", sized, batch=args.batch_size, seq=args.seq_len or None, what=args.model)
    backend = args.backend or ("paddle" if os.path.isfile(os.path.join(args.model, MANIFEST)) else "dygraph")
    options = {}
    if backend == "paddle" and not mp:
        programs = read_manifest(args.model).data["programs"]
        if all("paddle" in programs.get(p, {}) for p in SCORE_PROGRAMS):
            # The scoring programs run the head only at the scored rows, with the log-softmax
            # inside; the fused program (the default otherwise) also takes chosen rows, but
            # returns their logits, and its head kernel is made for decode's few rows, not for
            # thousands of scored rows.
            options["fused"] = False
    if mp:  # one launched rank of a partitioned export
        import paddle.distributed as dist

        from ..inference.tensor_parallel import TensorParallelBackend, tp_generator
        from ..parallel.fleet import init_mp

        init_mp(mp)
        gen = tp_generator(args.model, TensorParallelBackend(args.model, rank=dist.get_rank()), args.tokenizer_dir)
        backend, args.no_progress = "paddle-tp", args.no_progress or dist.get_rank() != 0
    else:
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
    if mp:
        out["mp_degree"] = mp
        if launched_world()[0] == 0:
            write_json_atomic(args.result_file, out, sort_keys=False)
        return 0
    return _report(args, out)


def _report(args, out: dict) -> int:
    if args.output:
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)  # claim_outputs: no file above
        write_json_atomic(args.output, out, sort_keys=False)
    print_json(out)
    return 0


def _tp_degree(model_dir: str) -> int:
    """The rank count of a `gptc partition` directory; 0 for anything else."""
    from ..inference.manifest import MANIFEST, TP_FORMAT, read_tp_manifest

    fp = os.path.join(model_dir, MANIFEST)
    try:
        with open(fp, encoding="utf-8") as f:
            tp = json.load(f).get("format") == TP_FORMAT
    except (OSError, ValueError, AttributeError):
        return 0
    return int(read_tp_manifest(model_dir)["mp_degree"]) if tp else 0


def _launch_ranks(args, mp: int) -> int:
    """Evaluate a partitioned export: launch its ``mp`` ranks (each runs this command and its
    rank program in lock-step, ``TensorParallelBackend``); rank 0's result is reported here."""
    from ..parallel.launch import launch_command, log_tail

    with tempfile.TemporaryDirectory(prefix="gptc-eval-tp-") as tmp:
        result, logs = os.path.join(tmp, "result.json"), os.path.join(tmp, "logs")
        res = subprocess.run(launch_command(mp, [*sys.argv[1:], "--result-file", result], log_dir=logs),
                             capture_output=True, text=True)
        if res.returncode or not os.path.isfile(result):
            return fail(f"tensor-parallel evaluation failed (exit {res.returncode}):\n{log_tail(logs)}")
        with open(result, encoding="utf-8") as f:
            return _report(args, json.load(f))
