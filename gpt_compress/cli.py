"""`gptc <command>`: a table from command names to modules in ``gpt_compress.commands``.

Each command module defines ``add_arguments(parser)`` and ``run(args) -> int | None``; it is
imported only when its command runs, so `gptc --help` stays fast.
"""
from __future__ import annotations

import argparse
import importlib
import signal
import sys

# name -> (module under gpt_compress.commands, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("demo", "run the main job on an embedded default (no downloads)"),
    "init": ("init", "build a model from a config/preset and save a checkpoint"),
    "generate": ("generate", "generate text from a checkpoint"),
    "convert": ("convert", "convert between Hugging Face GPT-2 and gpt-compress checkpoints"),
    "train-tokenizer": ("train_tokenizer", "train a byte-level BPE tokenizer on your corpus"),
    "preprocess": ("preprocess", "tokenize JSONL/text into a Megatron mmap indexed dataset"),
    "pretrain": ("pretrain", "pretrain (or continue training) a GPT model"),
    "finetune": ("finetune", "finetune for generation on JSONL prompt/response or text (full or LoRA)"),
    "finetune-glue": ("finetune_glue", "finetune a sequence-classification head on a GLUE task"),
    "eval": ("eval", "evaluate a model: LAMBADA accuracy or WikiText perplexity, on any backend"),
    "qat": ("qat", "quantization-aware training (fake-quant W8A8 finetuning), then int8 export"),
    "ptq": ("ptq", "post-training quantization (calibrated W8A8 or weight-only int8/int4), then int8 export"),
    "quant-sensitivity": ("quant_sensitivity", "rank layers by their quantization loss; write a skip list"),
    "export": ("export", "export a checkpoint to a static inference model (Paddle Inference / ONNX)"),
    "infer": ("infer", "generate with an exported model (Paddle Inference, onnxruntime or dygraph)"),
    "serve": ("serve", "serve an exported model over an OpenAI-compatible HTTP API (continuous batching)"),
    "partition": ("partition", "export a checkpoint as tensor-parallel rank programs (mp_degree directories)"),
    "infer-tp": ("infer_tp", "generate with a tensor-parallel export, one process per rank"),
    "prune": ("prune", "remove the least important attention heads and FFN channels (smaller checkpoint)"),
    "distill": ("distill", "train a student (e.g. a pruned model) on a teacher's outputs"),
    "report": ("report", "Markdown table and PNG plots from eval results and training logs"),
    "pipeline": ("pipeline", "text -> pretrain -> prune + distill -> QAT -> export -> evaluate -> report"),
}


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """The `-c config.yaml -o Section.key=value` pair every config-driven command takes."""
    parser.add_argument("-c", "--config", default=None, help="YAML config file")
    parser.add_argument("-o", "--override", action="append", default=[], metavar="Section.key=value",
                        help="override a config field (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(prog="gptc", description=__doc__.splitlines()[0])
    parser.add_argument("-V", "--version", action="version", version=f"gptc (gpt-compress) {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="command")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def _quiet_paddle() -> None:
    """Hide Paddle's import-time "No ccache found" UserWarning (about compiling C++ extensions,
    which gptc never does) from users."""
    import warnings

    warnings.filterwarnings("ignore", message="No ccache found", category=UserWarning)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-V", "--version"):
        from . import __version__

        print(f"gptc (gpt-compress) {__version__}")
        sys.exit(0)
    _quiet_paddle()
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        parser = build_parser()
        if argv and argv[0] not in ("-h", "--help"):
            import difflib

            close = difflib.get_close_matches(argv[0], list(COMMANDS), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            parser.error(f"unknown command {argv[0]!r}{hint}; choose from {', '.join(COMMANDS)}")
        parser.print_help()
        sys.exit(0 if argv else 2)
    name = argv[0]
    module = importlib.import_module(f"gpt_compress.commands.{COMMANDS[name][0]}")
    parser = argparse.ArgumentParser(prog=f"gptc {name}", description=COMMANDS[name][1])
    module.add_arguments(parser)
    args = parser.parse_args(argv[1:])
    from . import runtime

    if runtime.enabled():  # before any matmul: see runtime.py (GPTC_TUNE_CPU=0 turns it off)
        runtime.tune_cpu()
    from . import locks, signals
    from .errors import ConfigError, GptcError

    signals.enable()  # SIGTERM (a scheduler stopping the job) is handled as Ctrl-C
    try:
        code = module.run(args)
    except GptcError as e:
        kind = "config error" if isinstance(e, ConfigError) else "error"
        message = " ".join(str(e).split())  # one line, whatever the message holds
        print(f"gptc {name}: {kind}: {message}", file=sys.stderr)
        sys.exit(e.exit_code)
    except KeyboardInterrupt as e:
        signum = signals.interrupt_signum(e)
        how = "SIGTERM" if signum == signal.SIGTERM else "Ctrl-C"
        print(f"gptc {name}: interrupted ({how}); outputs are written atomically, so nothing "
              "half-written was left", file=sys.stderr)
        sys.exit(128 + signum)
    finally:
        locks.release_all()
        signals.disable()
    sys.exit(code or 0)


def export_model_main() -> None:
    """`export_model ...` == `gptc export ...`."""
    main(["export", *sys.argv[1:]])
