"""Training checkpoints: model + optimizer + LR schedule + RNG + data position + config.

Each checkpoint is ``OUTPUT/checkpoints/step_XXXXXXXX/`` written atomically with checksums
(``fileio.write_dir_atomic``): ``model.safetensors`` and ``config.json`` (loadable by
``load_model`` as is), ``optimizer.safetensors`` (moments keyed by public parameter names, so
they survive a rebuild in another process), ``trainer_state.json`` (step, scheduler, RNG
states, consumed samples, run config) and the tokenizer files. Keep-last-k; ``resume auto``
takes the newest checkpoint that verifies and skips corrupt ones with a warning.
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
import warnings
from typing import Optional

import numpy as np
import paddle

from ..checkpoint import (CheckpointError, FORMAT, FORMAT_VERSION, WEIGHTS, CONFIG, assign_weights,
                          load_weights, tensor_bytes, verify_checksums, write_weights)
from ..fileio import write_dir_atomic, write_json_atomic

OPTIMIZER = "optimizer.safetensors"
STATE = "trainer_state.json"
_STEP_DIR = re.compile(r"^step_(\d{8})$")


def rng_state() -> dict:
    """Python, numpy and Paddle RNG states as JSON-safe values."""
    np_state = np.random.get_state()
    return {
        "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "paddle": [list(_jsonable(s.__getstate__())) for s in paddle.get_rng_state()],
    }


def _jsonable(x):
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def set_rng_state(state: dict) -> None:
    """Restore what ``rng_state`` captured."""
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    nps = state["numpy"]
    np.random.set_state((nps[0], np.array(nps[1], dtype=np.uint32), nps[2], nps[3], nps[4]))
    gens = []
    cls = type(paddle.get_rng_state()[0])
    for s in state["paddle"]:
        g = cls.__new__(cls)
        g.__setstate__(tuple(tuple(v) if isinstance(v, list) else v for v in s))
        gens.append(g)
    paddle.set_rng_state(gens)


def optimizer_tensors(model, optimizer, to_numpy=None) -> tuple[dict, dict]:
    """Optimizer state keyed by public parameter names: (tensors, json extras). ``to_numpy``
    turns a state tensor into its whole value (a gather for distributed tensors); by default the
    Paddle tensors themselves (``write_weights`` writes them without a copy)."""
    to_numpy = to_numpy or (lambda t: t)
    internal = {p.name: n for n, p in model.named_parameters()}
    by_len = sorted(internal, key=len, reverse=True)
    tensors, extra = {}, {}
    for key, val in optimizer.state_dict().items():
        if isinstance(val, paddle.Tensor):
            owner = next((i for i in by_len if key.startswith(i + "_")), None)
            if owner is None:
                raise CheckpointError(f"optimizer state {key!r} belongs to no model parameter")
            tensors[internal[owner] + "::" + key[len(owner) + 1:]] = to_numpy(val)
        elif key != "LR_Scheduler":
            extra[key] = val
    return tensors, extra


def load_optimizer(model, optimizer, tensors: dict, scheduler_state: dict) -> None:
    """Set ``optimizer``'s state from ``optimizer_tensors``' tensors (keyed by public names) and the scheduler."""
    public = {n: p.name for n, p in model.named_parameters()}
    sd = {"LR_Scheduler": dict(scheduler_state)}  # paddle requires it when lr is a scheduler
    for key, arr in tensors.items():
        name, acc = key.split("::", 1)
        if name not in public:
            raise CheckpointError(f"optimizer state for unknown parameter {name!r}")
        sd[f"{public[name]}_{acc}"] = paddle.to_tensor(arr)
    optimizer.set_state_dict(sd)


def save_training_checkpoint(output_dir: str, step: int, model, optimizer, scheduler, consumed_samples: int,
                             run_config: dict, tokenizer=None, keep: int = 3, extra: Optional[dict] = None,
                             parallel=None) -> str:
    """Write ``output_dir/checkpoints/step_{step}`` atomically and prune to the newest ``keep``.
    Under ``parallel`` every rank takes part in gathering the whole tensors (the files have the
    single-process layout) and rank 0 writes them. One process writes the weights and the
    optimizer state from the training tensors themselves: no second copy in memory."""
    root = os.path.join(output_dir, "checkpoints")
    if parallel is None:
        weights = model.state_dict()
        opt_tensors, opt_extra = optimizer_tensors(model, optimizer)
    else:
        weights = parallel.gather_model(model)
        opt_tensors, opt_extra = parallel.gather_optimizer(model, optimizer)
        if not parallel.dims.is_main:
            return os.path.join(os.path.abspath(root), f"step_{step:08d}")
    head = "cls" if type(model).__name__ == "GPTForSequenceClassification" else "lm"
    state = {"step": step, "consumed_samples": consumed_samples, "scheduler": scheduler.state_dict(),
             "optimizer_extra": opt_extra, "rng": rng_state(), "run_config": run_config, **(extra or {})}

    def write(tmp):
        write_weights(weights, os.path.join(tmp, WEIGHTS), metadata={"format": FORMAT})
        write_weights(opt_tensors, os.path.join(tmp, OPTIMIZER))
        write_json_atomic(os.path.join(tmp, CONFIG), {"format": FORMAT, "format_version": FORMAT_VERSION,
                                                      "head": head, "model": model.config.to_dict()})
        write_json_atomic(os.path.join(tmp, STATE), state)
        if tokenizer is not None:
            tokenizer.save(tmp)

    path = write_dir_atomic(os.path.join(root, f"step_{step:08d}"), write, overwrite=True,
                            needed=tensor_bytes(weights) + tensor_bytes(opt_tensors))
    for old in list_checkpoints(output_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return path


def list_checkpoints(output_dir: str) -> list[str]:
    """Checkpoint directories under ``output_dir``, oldest first."""
    root = os.path.join(output_dir, "checkpoints")
    if not os.path.isdir(root):
        return []
    return [os.path.join(root, d) for d in sorted(os.listdir(root)) if _STEP_DIR.match(d)]


def find_resume_checkpoint(output_dir: str) -> Optional[str]:
    """Newest checkpoint that verifies; corrupt ones are skipped with a warning."""
    for path in reversed(list_checkpoints(output_dir)):
        try:
            verify_checksums(path)
            return path
        except CheckpointError as e:
            warnings.warn(f"skipping corrupt checkpoint: {e}")
    return None


def load_training_checkpoint(path: str, model, optimizer, scheduler, parallel=None) -> dict:
    """Restore model, optimizer, scheduler and RNG from ``path``; returns the trainer state."""
    from safetensors.numpy import load_file

    if parallel is not None:
        return parallel.load_training_checkpoint(path, model, optimizer, scheduler)
    verify_checksums(path)
    assign_weights(model, load_weights(path), os.path.join(path, WEIGHTS))
    with open(os.path.join(path, STATE), encoding="utf-8") as f:
        state = json.load(f)
    load_optimizer(model, optimizer, load_file(os.path.join(path, OPTIMIZER)), state["scheduler"])
    scheduler.set_state_dict(state["scheduler"])
    set_rng_state(state["rng"])
    return state
