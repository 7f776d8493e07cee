"""`gptc <command>`: run one gpt-compress command (`gptc <command> --help` for its options).

Each command module in ``gpt_compress.commands`` defines ``add_arguments(parser)`` and
``run(args) -> int | None``; it is imported only when its command runs, so `gptc --help` stays
fast.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import sys

# name -> (module under gpt_compress.commands, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("demo", "run the whole toolkit on a built-in corpus: train, compress, export, evaluate (no downloads)"),
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

# Commands that run for hours on inputs of every size: they keep glibc's own malloc policy
# (``runtime.tune_cpu(malloc=False)``). The heap-only policy that speeds up training never gives
# freed memory back, and a server's ever-changing batch and prompt shapes fragment that heap, so
# its resident size grew for as long as it served.
SERVICE_COMMANDS = frozenset({"serve"})


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """The `-c config.yaml -o Section.key=value` pair every config-driven command takes."""
    parser.add_argument("-c", "--config", default=None, help="YAML config file")
    parser.add_argument("-o", "--override", action="append", default=[], metavar="Section.key=value",
                        help="override a config field (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(
        prog="gptc", description="gpt-compress: pretrain, finetune, compress, export, evaluate and serve GPT "
        "models with PaddlePaddle.", epilog="`gptc <command> --help` shows a command's options.")
    parser.add_argument("-V", "--version", action="version", version=f"gptc (gpt-compress) {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="show the libraries' own messages (Paddle's import-time notices); also GPTC_VERBOSE=1")
    sub = parser.add_subparsers(dest="command", metavar="command")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


# Lines Paddle prints to stderr at `import paddle` (paddle/base/__init__.py, unconditionally when
# OMP_NUM_THREADS > 1, which gptc sets on purpose): advice for Paddle's own data parallelism
# that does not apply to gptc's runs.
_PADDLE_NOISE = ("WARNING: OMP_NUM_THREADS set to ", "PLEASE USE OMP_NUM_THREADS WISELY.")


class _StderrFilter:
    """sys.stderr without Paddle's import-time OMP_NUM_THREADS advice; every other write passes."""

    def __init__(self, stream):
        self._stream = stream
        self._dropped_line = False  # print() writes its newline separately

    def write(self, text: str) -> int:
        if text.startswith(_PADDLE_NOISE):
            self._dropped_line = True
            return len(text)
        if self._dropped_line and text == "\n":
            self._dropped_line = False
            return len(text)
        self._dropped_line = False
        return self._stream.write(text)

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _quiet_paddle() -> None:
    """Keep a command's terminal output its own: hide Paddle's import-time "No ccache found"
    UserWarning, its OMP_NUM_THREADS advice and the "using custom operator only" INFO line of its
    C++ extension loader (logger ``utils.cpp_extension``, which sets its own level to INFO when
    imported, hence a filter rather than a level). ``GPTC_VERBOSE=1`` or ``gptc --verbose
    <command>`` shows them."""
    if os.environ.get("GPTC_VERBOSE", "") not in ("", "0"):
        return
    import warnings

    warnings.filterwarnings("ignore", message="No ccache found", category=UserWarning)
    # Raised while tracing exports to static programs, about a Tensor method gptc does not call.
    warnings.filterwarnings("ignore", message="Tensor do not have 'place' interface", category=UserWarning)
    logging.getLogger("utils.cpp_extension").addFilter(lambda record: record.levelno >= logging.WARNING)
    if not isinstance(sys.stderr, _StderrFilter):
        sys.stderr = _StderrFilter(sys.stderr)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-V", "--version"):
        from . import __version__

        print(f"gptc (gpt-compress) {__version__}")
        sys.exit(0)
    if argv and argv[0] in ("-v", "--verbose"):
        os.environ["GPTC_VERBOSE"] = "1"  # child gptc processes (pipeline stages, ranks) inherit it
        argv = argv[1:]
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
        runtime.tune_cpu(malloc=name not in SERVICE_COMMANDS)
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
