"""`gptc preprocess`: tokenize JSONL/text files into a Megatron ``PREFIX_text_document.bin/.idx``."""
from __future__ import annotations

import argparse
import json
import sys

from ..data.errors import DataError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `gptc preprocess`."""
    parser.add_argument("--input", nargs="+", required=True, metavar="PATH",
                        help="JSONL files (*.jsonl, *.json, *.ndjson: one object per line), plain text "
                             "files (one document per file) or directories of them")
    parser.add_argument("--output-prefix", required=True,
                        help="writes {prefix}_{json_key}_document.bin/.idx")
    tok = parser.add_argument_group("tokenizer (one of)")
    tok.add_argument("--tokenizer-dir", help="directory with tokenizer.json, vocab.json + merges.txt, "
                                             "or encoder.json + vocab.bpe")
    tok.add_argument("--vocab-file", help="vocab.json (Hugging Face) or encoder.json (OpenAI)")
    tok.add_argument("--merges-file", help="merges.txt (Hugging Face) or vocab.bpe (OpenAI)")
    parser.add_argument("--json-key", default="text", help="key of the document text in each JSON line")
    parser.add_argument("--append-eod", action=argparse.BooleanOptionalAction, default=True,
                        help="append <|endoftext|> to every document")
    parser.add_argument("--split-paragraphs", action="store_true",
                        help="plain-text inputs: one document per blank-line-separated block "
                             "(default: one document per file)")
    parser.add_argument("--workers", type=int, default=1,
                        help="processes; 1 still encodes on all cores through the tokenizer's threads")
    parser.add_argument("--skip-bad-lines", action="store_true",
                        help="skip (and count) malformed JSON lines and lines without --json-key")
    parser.add_argument("--log-every", type=int, default=10000,
                        help="log a line every N documents when no progress bar is shown")


def load_tokenizer(args: argparse.Namespace):
    """The tokenizer named by --tokenizer-dir or --vocab-file/--merges-file."""
    from ..data.tokenizer import Tokenizer

    if args.tokenizer_dir and (args.vocab_file or args.merges_file):
        raise DataError("give either --tokenizer-dir or --vocab-file/--merges-file, not both")
    if args.tokenizer_dir:
        return Tokenizer.load(args.tokenizer_dir)
    if args.vocab_file and args.merges_file:
        return Tokenizer.from_files(args.vocab_file, args.merges_file)
    raise DataError("no tokenizer: pass --tokenizer-dir DIR, or both --vocab-file and --merges-file")


def run(args: argparse.Namespace) -> int:
    """Run preprocessing and print the summary as one JSON line."""
    from ..data.preprocess import preprocess

    if args.workers < 1:
        raise DataError(f"--workers {args.workers}: must be at least 1")
    try:
        summary = preprocess(args.input, args.output_prefix, load_tokenizer(args), json_key=args.json_key,
                             append_eod=args.append_eod, workers=args.workers,
                             skip_bad_lines=args.skip_bad_lines, log_every=args.log_every,
                             split_paragraphs=args.split_paragraphs)
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM (signals.Terminated)
        from ..signals import interrupt_signum

        print("gptc preprocess: interrupted; no output was written", file=sys.stderr)
        return 128 + interrupt_signum(e)
    if summary["skipped_lines"]:
        print(f"gptc preprocess: skipped {summary['skipped_lines']} bad line(s), e.g. "
              f"{summary['skipped_examples'][0]}", file=sys.stderr)
    if summary["bad_utf8_lines"]:
        print(f"gptc preprocess: {summary['bad_utf8_lines']} line(s) had bytes that are not UTF-8; "
              "they were replaced by U+FFFD", file=sys.stderr)
    print(json.dumps(summary), flush=True)
    return 0
