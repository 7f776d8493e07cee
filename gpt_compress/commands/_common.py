"""Helpers shared by command modules: config loading, seeding, tokenizer lookup."""
from __future__ import annotations

import json
import os
import random
import sys

import numpy as np

from ..cli import add_config_arguments
from ..config import Config, load_config

__all__ = ["add_config_arguments", "config_from_args", "seed_everything", "find_tokenizer", "print_json"]


def config_from_args(args) -> Config:
    """Build the run's Config from `-c` and `-o` arguments."""
    return load_config(getattr(args, "config", None), getattr(args, "override", []) or [])


def seed_everything(seed: int) -> None:
    """Seed Python, numpy and Paddle."""
    import paddle

    random.seed(seed)
    np.random.seed(seed)
    paddle.seed(seed)


def find_tokenizer(*dirs: str):
    """The tokenizer stored in the first of ``dirs`` that has one, or None."""
    from ..data.tokenizer import Tokenizer

    for d in dirs:
        if d and os.path.isdir(d) and any(os.path.isfile(os.path.join(d, f))
                                         for f in ("tokenizer.json", "vocab.json", "encoder.json")):
            return Tokenizer.load(d)
    return None


def print_json(obj) -> None:
    """One JSON line on stdout (machine-readable summary)."""
    print(json.dumps(obj, sort_keys=True), flush=True)


def fail(message: str, code: int = 1) -> int:
    """Print a user-facing error and return the exit code."""
    print(f"error: {message}", file=sys.stderr)
    return code
