"""`gptc train-tokenizer`: train a GPT-2-style byte-level BPE on your text files."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from ..data.errors import DataError
from ._common import check_text_file


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `gptc train-tokenizer`."""
    parser.add_argument("--input", nargs="+", required=True, metavar="FILE",
                        help="plain text files to learn merges from")
    parser.add_argument("--vocab-size", type=int, required=True,
                        help="final vocabulary size, 256 byte tokens and <|endoftext|> included")
    parser.add_argument("--output-dir", required=True,
                        help="writes tokenizer.json, vocab.json and merges.txt here")
    parser.add_argument("--min-frequency", type=int, default=2,
                        help="a pair must occur this often to be merged")


def run(args: argparse.Namespace) -> int:
    """Train, save, and print a JSON summary."""
    from ..fileio import check_output
    from ..data.tokenizer import Tokenizer

    for p in args.input:
        check_text_file(p, "--input")
    if os.path.exists(args.output_dir) and not os.path.isdir(args.output_dir):
        check_output(args.output_dir, flag="--output-dir")
    if args.vocab_size < 257:
        raise DataError(f"--vocab-size {args.vocab_size} is too small: a byte-level BPE needs at least 257 "
                        "tokens (256 bytes + <|endoftext|>)")
    start = time.perf_counter()
    tok = Tokenizer.train([os.path.abspath(p) for p in args.input], args.vocab_size,
                          min_frequency=args.min_frequency, show_progress=sys.stderr.isatty())
    paths = tok.save(args.output_dir)
    print(json.dumps({"vocab_size": tok.vocab_size, "eod_id": tok.eod_id,
                      "seconds": round(time.perf_counter() - start, 3),
                      "files": [str(p) for p in paths]}), flush=True)
    return 0
