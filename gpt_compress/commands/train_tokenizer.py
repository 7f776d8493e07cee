"""`gptc train-tokenizer`: train a GPT-2-style byte-level BPE on your text files."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from ..data.errors import DataError
from ._common import Output, add_overwrite_argument, check_text_file, claim_outputs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `gptc train-tokenizer`."""
    parser.add_argument("--input", nargs="+", required=True, metavar="FILE",
                        help="plain text files, or .jsonl files (one JSON object a line) whose --jsonl-key "
                             "field is the text, to learn merges from")
    parser.add_argument("--jsonl-key", default="text", help="the text field of .jsonl inputs")
    parser.add_argument("--vocab-size", type=int, required=True,
                        help="final vocabulary size, 256 byte tokens and <|endoftext|> included")
    parser.add_argument("--output-dir", required=True,
                        help="writes tokenizer.json, vocab.json and merges.txt here (a new directory; an earlier "
                             "tokenizer of train-tokenizer only with --overwrite)")
    add_overwrite_argument(parser)
    parser.add_argument("--min-frequency", type=int, default=2,
                        help="a pair must occur this often to be merged")
    parser.add_argument("--split-cjk", action="store_true",
                        help="make each CJK character its own pre-token: merges stay within one "
                             "character's bytes, so a Chinese token is one character (for Chinese "
                             "text; give a vocabulary that holds its common characters, e.g. 8192)")


def _texts(paths, key: str):
    """The texts of the inputs: a .jsonl file's ``key`` fields, any other file's whole text."""
    for path in paths:
        with open(path, encoding="utf-8") as f:
            if not path.endswith(".jsonl"):
                yield f.read()
                continue
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    text = json.loads(line)[key]
                except (ValueError, KeyError, TypeError):
                    raise DataError(f"{path}:{n}: not a JSON object with a {key!r} field (--jsonl-key)") from None
                yield text


def run(args: argparse.Namespace) -> int:
    """Train, save, and print a JSON summary."""
    from ..data.tokenizer import Tokenizer
    from ..fileio import CHECKSUMS, write_dir_atomic

    for p in args.input:
        check_text_file(p, "--input")
    claim_outputs(Output("--output-dir", args.output_dir, "dir", args.overwrite))
    if args.vocab_size < 257:
        raise DataError(f"--vocab-size {args.vocab_size} is too small: a byte-level BPE needs at least 257 "
                        "tokens (256 bytes + <|endoftext|>)")
    start = time.perf_counter()
    paths = [os.path.abspath(p) for p in args.input]
    source = _texts(paths, args.jsonl_key) if any(p.endswith(".jsonl") for p in paths) else paths
    tok = Tokenizer.train(source, args.vocab_size,
                          min_frequency=args.min_frequency, show_progress=sys.stderr.isatty(),
                          split_cjk=args.split_cjk)
    out = write_dir_atomic(args.output_dir, tok.save, overwrite=args.overwrite)
    paths = sorted(os.path.join(out, n) for n in os.listdir(out) if n != CHECKSUMS)
    print(json.dumps({"vocab_size": tok.vocab_size, "eod_id": tok.eod_id,
                      "seconds": round(time.perf_counter() - start, 3),
                      "files": [str(p) for p in paths]}), flush=True)
    return 0
