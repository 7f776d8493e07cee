"""Helpers shared by command modules: config loading, seeding, tokenizer lookup."""
from __future__ import annotations

import dataclasses
import json
import os
import random

import numpy as np

from ..cli import add_config_arguments
from ..config import SECTIONS, Config, ConfigError, load_config

__all__ = ["add_config_arguments", "add_training_arguments", "config_from_args", "seed_everything",
           "find_tokenizer", "print_json", "lm_batches", "add_overwrite_argument", "check_output_arg", "Output",
           "claim_outputs"]


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


def generation_config(args) -> Config:
    """``config_from_args`` for a generating command: ``Generation.seed`` unset takes ``Global.seed``."""
    cfg = config_from_args(args)
    if cfg.generation.seed is None:
        cfg.generation.seed = cfg.global_.seed
    return cfg


def training_config(args, required: str, hint: str) -> Config:
    """``config_from_args`` for a training command whose setting ``required`` ("Section.key", the
    data it trains on) must be set: empty, it raises ``ConfigError("... is empty: " + hint)``."""
    cfg = config_from_args(args)
    section, key = required.split(".", 1)
    if not getattr(getattr(cfg, SECTIONS[section]), key):
        raise ConfigError(f"{required} is empty: {hint}")
    return cfg


def seed_everything(seed: int) -> None:
    """Seed Python, numpy and Paddle."""
    import paddle

    random.seed(seed)
    np.random.seed(seed)
    paddle.seed(seed)


def find_tokenizer(*dirs: str):
    """``data.tokenizer.find_tokenizer``, imported when a command asks (the `tokenizers` library
    stays out of commands that never tokenize)."""
    from ..data.tokenizer import find_tokenizer as find

    return find(*dirs)


def _finite(obj):
    """``obj`` with NaN/inf floats as None (JSON has no NaN)."""
    if isinstance(obj, float):
        return obj if obj == obj and abs(obj) != float("inf") else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def print_json(obj) -> None:
    """One JSON line on stdout (machine-readable summary; NaN/inf become null)."""
    print(json.dumps(_finite(obj), sort_keys=True, allow_nan=False), flush=True)


def add_overwrite_argument(parser) -> None:
    """`--overwrite`: replace an existing --output that gpt-compress wrote (never anything else)."""
    parser.add_argument("--overwrite", action="store_true",
                        help="replace --output if it is an earlier gpt-compress output (files and other "
                             "directories are never replaced)")


def add_kv_cache_argument(parser, program: str) -> None:
    """`--kv-cache-dtype`: the KV cache elements of ``program`` (the fused program(s) an export
    writes; ``export.fused.CACHE_DTYPES``)."""
    parser.add_argument("--kv-cache-dtype", choices=("float32", "bfloat16"), default="float32",
                        help=f"{program}'s KV cache: bfloat16 halves its memory and what a decode step reads "
                             "from it (values rounded to nearest even; default float32)")


@dataclasses.dataclass(frozen=True)
class Output:
    """An output path a command writes, as the user named it (``flag``: "--output",
    "Global.output_dir", ...). ``kind`` (``fileio.check_output_path``): "dir" (a directory
    written whole: a new one, or an earlier gpt-compress output with ``overwrite``), "run" (a run
    directory: checkpoints and logs collect in it, a rerun continues it), "file". ``lock``: no
    other gpt-compress process may write it at the same time (``locks``)."""

    flag: str
    path: str
    kind: str = "dir"
    overwrite: bool = False
    lock: bool = True


def claim_outputs(*outputs: Output, inputs: tuple = ()) -> None:
    """Check every output of a command before any work starts, then lock those with ``lock``:
    refused (``OutputError``, nothing touched) when one is an input, lies below a file, is a file
    where a directory is meant (or the reverse), is a foreign or earlier output without
    --overwrite, or another gpt-compress run is writing it (``OutputLocked``, naming its pid).
    The locks last until the command ends (``cli.main``)."""
    from .. import locks
    from ..errors import OutputError
    from ..fileio import check_output_path

    for o in outputs:
        out = os.path.abspath(o.path)
        for src in inputs:
            if src and os.path.abspath(src) == out:
                raise OutputError(f"{o.flag} {o.path} is the input {src}; choose a different directory")
        check_output_path(out, o.kind, o.flag, o.overwrite)
    for o in outputs:
        if o.lock:
            locks.hold(o.path, o.flag)


def check_output_arg(args, *inputs: str) -> None:
    """``claim_outputs`` for the ``--output`` directory of ``args`` (with its ``--overwrite``):
    not one of ``inputs``, a file, a foreign directory, or an earlier output without --overwrite."""
    claim_outputs(Output("--output", args.output, "dir", getattr(args, "overwrite", False)), inputs=inputs)


def claim_run_dir(cfg: Config, *more: Output) -> None:
    """``claim_outputs`` for a training command: ``Global.output_dir`` (a run directory, locked)
    and ``more``. A rank of a launched multi-process job other than 0 checks and locks nothing
    (rank 0 does, for the whole job)."""
    from ..parallel.launch import launched_world

    rank, _ = launched_world()
    if rank == 0:
        claim_outputs(Output("Global.output_dir", cfg.global_.output_dir, "run"), *more)


def fail(message: str, code: int = 1) -> int:
    """Refuse the user's input: raises ``InputError`` (the CLI prints `gptc <command>: error: ...`)."""
    from ..errors import InputError

    raise InputError(message)


def check_text_file(path: str, flag: str) -> None:
    """Refuse a text input given as ``flag``: missing, empty, or not UTF-8 text (checked on its
    first MiB)."""
    from ..errors import InputError

    if not os.path.isfile(path):
        raise InputError(f"{flag} {path}: file not found")
    with open(path, "rb") as f:
        head = f.read(1 << 20)
    if not head.strip():
        raise InputError(f"{flag} {path} is empty")
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:
        if e.start < len(head) - 4:  # not just a character cut at the 1 MiB boundary
            raise InputError(f"{flag} {path} is not UTF-8 text (invalid byte at offset {e.start})") from None
    if b"\x00" in head:
        raise InputError(f"{flag} {path} is not UTF-8 text (it holds NUL bytes)")


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
