"""Helpers shared by command modules: config loading, seeding, tokenizer lookup."""
from __future__ import annotations

import json
import random
import sys

import numpy as np

from ..cli import add_config_arguments
from ..config import Config, load_config
from ..data.tokenizer import find_tokenizer  # noqa: F401  (re-exported for the commands)

__all__ = ["add_config_arguments", "add_training_arguments", "config_from_args", "seed_everything",
           "find_tokenizer", "print_json", "lm_batches"]


def add_training_arguments(parser) -> None:
    """`--resume` and `--no-progress` of the training commands (pretrain, distill)."""
    parser.add_argument("--resume", default=None,
                        help="'auto' (newest valid checkpoint in Global.output_dir) or a checkpoint dir; "
                             "same as -o Engine.resume=...")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (logs still written)")


def config_from_args(args) -> Config:
    """Build the run's Config from `-c` and `-o` arguments (and `--resume`, as Engine.resume)."""
    overrides = list(getattr(args, "override", []) or [])
    if getattr(args, "resume", None):
        overrides.append(f"Engine.resume={args.resume}")
    return load_config(getattr(args, "config", None), overrides)


def seed_everything(seed: int) -> None:
    """Seed Python, numpy and Paddle."""
    import paddle

    random.seed(seed)
    np.random.seed(seed)
    paddle.seed(seed)


def print_json(obj) -> None:
    """One JSON line on stdout (machine-readable summary)."""
    print(json.dumps(obj, sort_keys=True), flush=True)


def fail(message: str, code: int = 1) -> int:
    """Print a user-facing error and return the exit code."""
    print(f"error: {message}", file=sys.stderr)
    return code


def lm_batches(cfg: Config, num_train_samples: int, model_configs=()):
    """(``train_batches(consumed)``, ``eval_batches()`` or None) over ``Data.data_prefix`` as
    `gptc pretrain` reads it: train/valid splits of ``Data.split``, ``Engine.micro_batch_size``
    samples per batch, ``Engine.eval_iters`` validation batches. ``model_configs`` must all fit
    ``Data.seq_length`` positions."""
    import itertools

    from ..config import ConfigError
    from ..data.dataset import SampleIterator, build_datasets

    eng, data = cfg.engine, cfg.data
    if not data.data_prefix:
        raise ConfigError("Data.data_prefix is empty: point it at a preprocessed dataset prefix "
                          "(see `gptc preprocess`)")
    for mc in model_configs:
        if data.seq_length > mc.max_position_embeddings:
            raise ConfigError(f"Data.seq_length {data.seq_length} exceeds the model's max_position_embeddings "
                              f"{mc.max_position_embeddings}; lower Data.seq_length")
    n_eval = eng.eval_iters * eng.micro_batch_size
    train, valid, _ = build_datasets(data.data_prefix, data.split, data.seq_length, (num_train_samples, n_eval, 0),
                                     cfg.global_.seed)

    def train_batches(consumed: int = 0):
        return SampleIterator(train, eng.micro_batch_size, consumed)

    def eval_batches():
        return itertools.islice(SampleIterator(valid, eng.micro_batch_size), eng.eval_iters)

    return train_batches, eval_batches if valid is not None else None
