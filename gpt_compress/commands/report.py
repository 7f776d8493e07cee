"""`gptc report`: a Markdown table and PNG plots from `gptc eval --output` result files and
training logs."""
from __future__ import annotations

import os

from ._common import Output, claim_outputs, fail, print_json


def add_arguments(parser) -> None:
    parser.add_argument("--results", nargs="+", default=[], metavar="JSON",
                        help="result files of `gptc eval --output` (or lists of such objects)")
    parser.add_argument("--train-log", action="append", default=[], metavar="LABEL=PATH",
                        help="a train_log.jsonl to plot, with its legend label (repeatable)")
    parser.add_argument("--name", action="append", default=[], metavar="MODEL_DIR=NAME",
                        help="display name of a model directory (default: its basename)")
    parser.add_argument("--title", default="gpt-compress results")
    parser.add_argument("--output", required=True, help="report directory (report.md, results.json, *.png)")


def _pairs(items, what):
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            raise ValueError(f"{what} must be KEY=VALUE, got {item!r}")
        out[key] = value
    return out


def run(args) -> int:
    from ..eval.report import load_rows, write_report

    claim_outputs(Output("--output", args.output, "run"))  # report.md, results.json, *.png: replaced
    try:
        logs = _pairs(args.train_log, "--train-log")
        names = _pairs(args.name, "--name")
        for path in [*args.results, *logs.values()]:
            if not os.path.isfile(path):
                return fail(f"{path}: no such file")
        rows = load_rows(args.results, names)
        if not rows and not logs:
            return fail("nothing to report: pass --results and/or --train-log")
        files = write_report(args.output, rows, logs or None, title=args.title)
    except ValueError as e:
        return fail(str(e))
    print(open(files["report"], encoding="utf-8").read())
    print_json({"report": files})
    return 0
