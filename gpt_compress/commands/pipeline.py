"""`gptc pipeline -c configs/pipeline_*.yaml`: preprocess -> pretrain -> prune + distill -> QAT ->
export -> evaluate -> report. Finished stages are skipped; `--stage NAME` runs one alone."""
from __future__ import annotations

from ._common import Output, add_config_arguments, claim_outputs, config_from_args, fail, print_json


def add_arguments(parser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--stage", action="append", default=None, metavar="NAME",
                        help="run only this stage (repeatable); its inputs must be up to date")
    parser.add_argument("--force", action="append", default=[], metavar="NAME",
                        help="rerun this stage (and so everything after it) even if up to date")
    parser.add_argument("--status", action="store_true", help="show which stages are up to date and exit")
    parser.add_argument("--progress", action="store_true", help="progress bars of the training stages")


def run(args) -> int:
    from ..pipeline import Pipeline, PipelineError

    cfg = config_from_args(args)
    # --status only reads; a run locks the directory (its stages lock their own outputs in it).
    claim_outputs(Output("Global.output_dir", cfg.global_.output_dir, "run", lock=not args.status))
    pipe = Pipeline(cfg, progress=args.progress)
    try:
        if args.status:
            print_json({"output_dir": pipe.out, "stages": pipe.status()})
            return 0
        result = pipe.run(only=args.stage, force=args.force)
    except PipelineError as e:
        return fail(str(e))
    if result["report"]:
        with open(result["report"], encoding="utf-8") as f:
            print(f.read())
    print_json(result)
    return 0
