"""Model checkpoints: a directory with ``model.safetensors``, ``config.json`` and checksums.

Written atomically (a temporary sibling directory renamed into place), verified on load
(sha256 of every file, parameter names and shapes against the config). Never pickle.
Training state (optimizer, RNG, data position) is layered on top by ``train/checkpoint.py``.
"""
from __future__ import annotations

from .errors import CheckpointError  # noqa: F401  (re-exported)

import json
import os
from typing import Optional

import numpy as np

from .config import ConfigError, ModelConfig
# Re-exported: older call sites write checkpoints and exports through these names.
from .fileio import CHECKSUMS, sha256_file, verify_checksums, write_json_atomic  # noqa: F401
from .fileio import json_count, read_json, write_dir_atomic
from .fileio import write_dir_atomic as write_checkpoint_dir  # noqa: F401

FORMAT = "gpt-compress-checkpoint"
FORMAT_VERSION = 1
WEIGHTS = "model.safetensors"
CONFIG = "config.json"


def read_config(path: str) -> tuple[ModelConfig, dict]:
    """The ``ModelConfig`` and the metadata stored in a checkpoint directory."""
    cfg_path = os.path.join(path, CONFIG)
    meta = read_json(cfg_path, CheckpointError,
                     missing=f"{cfg_path} not found: {path} is not a gpt-compress checkpoint")
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{cfg_path}: format {meta.get('format')!r} is not {FORMAT!r}")
    if meta.get("format_version", 0) > FORMAT_VERSION:
        raise CheckpointError(f"{cfg_path}: format version {meta['format_version']} is newer than this "
                              f"gpt-compress understands ({FORMAT_VERSION}); upgrade gpt-compress")
    try:
        cfg = ModelConfig.from_dict(meta["model"], source=cfg_path)
    except (ConfigError, KeyError) as e:
        raise CheckpointError(f"{cfg_path}: bad model config: {e}") from None
    return cfg, meta


def read_prompt_tokens(path: str) -> int:
    """``prompt_tokens`` recorded in checkpoint ``path`` (``gptc finetune`` with
    ``Finetune.prompt_tokens``: text prompts are fixed to that many tokens,
    ``data/tokenizer.py:encode_prompts``); 0 when none is recorded."""
    return json_count(read_config(path)[1], "prompt_tokens", os.path.join(path, CONFIG), CheckpointError,
                      "; set it to the Finetune.prompt_tokens the model was finetuned with, or remove it")


def read_prompt_template(path: str) -> str:
    """``prompt_template`` recorded in checkpoint ``path`` (``gptc finetune`` with
    ``Finetune.prompt_template``: the text its prompts were made from, ``{field}`` placeholders
    and all); "" when none is recorded."""
    template = read_config(path)[1].get("prompt_template", "")
    if not isinstance(template, str):
        raise CheckpointError(f"{os.path.join(path, CONFIG)}: prompt_template must be a string, got "
                              f"{type(template).__name__}")
    return template


def state_dict_numpy(model) -> dict[str, np.ndarray]:
    """Parameters (and persistable buffers) as numpy arrays, by public name."""
    return {k: np.ascontiguousarray(v.numpy()) for k, v in model.state_dict().items()}


def _host_array(t) -> np.ndarray:
    """A Paddle tensor's value as numpy: a view of its memory for a CPU tensor (DLPack: no copy),
    else ``t.numpy()`` (device tensors, dtypes numpy lacks)."""
    try:
        return np.from_dlpack(t.detach())  # detach: a view of the same memory, without autograd
    except (BufferError, TypeError, RuntimeError, ValueError):
        return t.numpy()


def tensor_bytes(tensors: dict) -> int:
    """Bytes the values of Paddle tensors (or arrays) ``tensors`` take in a safetensors file."""
    return sum(int(np.prod([int(d) for d in t.shape], dtype=np.int64)) * t.element_size()
               if not isinstance(t, np.ndarray) else int(t.nbytes) for t in tensors.values())


def write_weights(tensors: dict, path: str, metadata: Optional[dict] = None) -> None:
    """Write Paddle tensors (or arrays) ``tensors`` to safetensors file ``path`` one tensor at a
    time (``safetensors.numpy.save_file`` needs them all as numpy at once: a second copy of the
    weights), a CPU tensor straight from its memory (``_host_array``). Keys in sorted order, the
    header padded to 8 bytes, as safetensors writes it."""
    codes = {v.name: k for k, v in _DTYPES.items()}
    header, offset = {}, 0
    for k in sorted(tensors):
        t = tensors[k]
        name = t.dtype.name if isinstance(t, np.ndarray) else str(t.dtype).replace("paddle.", "")
        if name not in codes:
            raise CheckpointError(f"cannot store {k} of dtype {name} (supported: {', '.join(codes)})")
        shape = [int(d) for d in t.shape]
        size = int(np.prod(shape, dtype=np.int64)) * _DTYPES[codes[name]].itemsize
        header[k] = {"dtype": codes[name], "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(np.uint64(len(raw)).astype("<u8").tobytes() + raw)
        for k in sorted(tensors):
            t = tensors[k]
            a = np.ascontiguousarray(t if isinstance(t, np.ndarray) else _host_array(t), dtype=_DTYPES[header[k]["dtype"]])
            f.write(memoryview(a).cast("B"))  # little-endian, C order: safetensors' layout
            del a


def save_model(model, path: str, tokenizer=None, extra: Optional[dict] = None, overwrite: bool = False) -> str:
    """Save weights + config (+ tokenizer files) to checkpoint directory ``path`` (an existing
    one is replaced only with ``overwrite``: see ``fileio.check_output``)."""
    head = "cls" if type(model).__name__ == "GPTForSequenceClassification" else "lm"

    def write(tmp):
        write_weights(model.state_dict(), os.path.join(tmp, WEIGHTS), metadata={"format": FORMAT})
        meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "head": head,
                "model": model.config.to_dict(), **(extra or {})}
        write_json_atomic(os.path.join(tmp, CONFIG), meta)
        if tokenizer is not None:
            tokenizer.save(tmp)

    return write_dir_atomic(path, write, overwrite=overwrite, needed=tensor_bytes(model.state_dict()))


def load_weights(path: str) -> dict[str, np.ndarray]:
    """Read ``model.safetensors`` of a checkpoint directory (or a .safetensors file)."""
    from safetensors.numpy import load_file

    fp = path if path.endswith(".safetensors") else os.path.join(path, WEIGHTS)
    if not os.path.isfile(fp):
        raise CheckpointError(f"{fp} not found")
    try:
        return load_file(fp)
    except Exception as e:  # safetensors raises its own error types for bad headers
        raise CheckpointError(f"{fp} is not a readable safetensors file: {e}") from None


def check_state_dict(model, weights: dict[str, np.ndarray], source: str) -> None:
    """Raise ``CheckpointError`` naming every missing/unexpected key and shape mismatch."""
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    bad = [f"{k}: checkpoint {tuple(weights[k].shape)} vs model {expected[k]}"
           for k in expected if k in weights and tuple(weights[k].shape) != expected[k]]
    if missing or unexpected or bad:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} parameters ({', '.join(missing[:5])}"
                         f"{', ...' if len(missing) > 5 else ''})")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)} parameters ({', '.join(unexpected[:5])}"
                         f"{', ...' if len(unexpected) > 5 else ''})")
        if bad:
            parts.append("shape mismatch: " + "; ".join(bad[:5]) + ("; ..." if len(bad) > 5 else ""))
        raise CheckpointError(f"{source} does not match its model config: " + "; ".join(parts))


def assign_weights(model, weights: dict[str, np.ndarray], source: str) -> None:
    """Check then copy numpy ``weights`` into ``model`` in place."""
    import paddle

    check_state_dict(model, weights, source)
    sd = model.state_dict()
    for k, v in sd.items():
        v.set_value(paddle.to_tensor(weights[k], dtype=v.dtype))


def build_model(cfg: ModelConfig, head: str = "lm"):
    """Instantiate the model class for ``head`` ("lm" or "cls")."""
    from .model.gpt import GPTForCausalLM, GPTForSequenceClassification

    if head == "cls":
        return GPTForSequenceClassification(cfg)
    if head == "lm":
        return GPTForCausalLM(cfg)
    raise CheckpointError(f"unknown model head {head!r}")


def load_model(path: str, head: Optional[str] = None, verify: bool = True):
    """Load a checkpoint directory into a fresh model (eval mode); checks checksums,
    names and shapes. ``head`` overrides the stored head (e.g. "cls" on an LM checkpoint
    builds a classifier whose ``score`` stays freshly initialised)."""
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint directory not found: {path}")
    if verify:
        verify_checksums(path)
    cfg, meta = read_config(path)
    stored = meta.get("head", "lm")
    model = build_model(cfg, head or stored)
    if head == "cls" and stored == "lm":
        weights = load_weights(path)
        weights = {k: v for k, v in weights.items() if k != "lm_head.weight"}
        weights["score.weight"] = model.score.weight.numpy()
        assign_weights(model, weights, os.path.join(path, WEIGHTS))
    else:
        stream_weights(model, os.path.join(path, WEIGHTS))
    model.eval()
    return model


_DTYPES = {code: np.dtype(name) for code, name in (("F64", "<f8"), ("F32", "<f4"), ("F16", "<f2"), ("I64", "<i8"),
                                                    ("I32", "<i4"), ("I16", "<i2"), ("I8", "i1"), ("U8", "u1"),
                                                    ("BOOL", "?"))}


def stream_weights(model, fp: str) -> None:
    """Check then copy the tensors of safetensors file ``fp`` into ``model`` one at a time, read
    with plain file reads: the model plus one tensor in memory. Loading the whole file (or
    reading it through a memory map, whose pages count as resident until it is closed) held a
    second copy: ``gptc export`` of gpt-345M peaked at 3x its weight bytes while loading."""
    import types

    import paddle

    if not os.path.isfile(fp):
        raise CheckpointError(f"{fp} not found")
    with open(fp, "rb") as f:
        try:
            (n,) = np.frombuffer(f.read(8), "<u8")
            header = json.loads(f.read(int(n)))
            header.pop("__metadata__", None)
            for k, info in header.items():
                if info["dtype"] not in _DTYPES:
                    raise ValueError(f"{k}: dtype {info['dtype']} is not supported here")
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{fp} is not a readable safetensors file: {e}") from None
        base = 8 + int(n)
        check_state_dict(model, {k: types.SimpleNamespace(shape=tuple(v["shape"])) for k, v in header.items()}, fp)
        for k, v in model.state_dict().items():
            info = header[k]
            begin, end = info["data_offsets"]
            f.seek(base + begin)
            a = np.frombuffer(f.read(end - begin), _DTYPES[info["dtype"]]).reshape(info["shape"])
            v.set_value(paddle.to_tensor(a, dtype=v.dtype))
            del a
