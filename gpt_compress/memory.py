"""Pre-flight memory check: refuse a command that cannot fit before it starts, not by being killed.

``estimate(command, model, ...)`` gives the peak resident memory a command needs, from the model
config alone (nothing allocated), as a sum of named parts; ``check_fits`` compares it with the
memory this process may still use (``available_bytes``: ``MemAvailable`` of the machine, and the
limit of the memory cgroup it runs in, v1 or v2, whichever is smaller) and raises
``InsufficientMemory`` naming the command, the model, the estimate and what to change.

The multiples of the float32 weight bytes ``W`` come from the peaks ``bench/scale.py``
measured at gpt-345M (README "Scale"), less the ~1 GB of libraries, rounded up:

* ``init``: the model, written tensor by tensor (measured 1.16 W with the libraries at gpt-1.3B;
  1.3 W);
* ``pretrain``: weights, gradients and the two AdamW moments (4 W) and the optimizer's
  temporaries (measured 5.0 W in all) plus activations: with ``Model.recompute`` only each
  block's input is kept, and one block's internals are rebuilt during backward; the
  (micro batch x sequence x vocab) logits, their softmax and gradient come on top;
* ``export``: the largest stage (measured at gpt-345M, each stage's own peak: loading 1.3 W,
  the fused program 2 W (the model and the fused layer's buffers, each built from its source
  tensor in turn; 3.0 W when every fused weight was first copied to numpy), saving the Paddle
  programs 1.3 W, converting to ONNX 1.3 W, validating Paddle Inference 2.3 W (batch-1 decode
  runs two predictors, each loading the whole params file), onnxruntime 2.2 W): 2.6 W (the whole
  command measured 2.71 W with the libraries), or 2.4 W without the fused program (``fused=False``);
* ``ptq``: one float copy of the weights at a time (issue 16; was 3.74 W without the libraries
  at gpt-345M weight-only int8, 5.94 GiB in all, when the int8 export held the fake-quant
  model, the Paddle deploy model's float copy and the ONNX float model with its weights attached
  to each graph): the fake-quant model (1 W) plus the int8 codes of the quant table (0.25 W)
  and, by stage, the fused program's or the Paddle deploy model's int8 buffers (0.25 W), the
  ONNX float model (which takes the fake-quant model's weights tensor by tensor) or the
  transients of the largest weight (the tied embedding's fake quantization, ~3x its size,
  0.2 W at gpt-1.3B); the closing evaluation runs an int8 runtime alone (the fake-quant model
  is freed by then); per stage in ``bench/ptq_phases.py``; measured 1.81 W with the libraries at
  gpt-1.3B weight-only int8 (8.88 GiB, README "Scale" run C), 2.16-2.25 W at gpt-345M: 2.0 W;
* ``eval`` / ``infer``: one runtime's weights (2 W: onnxruntime pre-packs its MatMul weights;
  Paddle Inference holds one copy per program in use) plus one batch of logits (x3 while
  scoring: logits, shifted, exponentiated).

``GPTC_SKIP_MEMORY_CHECK=1`` skips the check (the estimate is deliberately pessimistic).

``status_bytes`` reads a process's resident set and its peak from ``/proc/PID/status`` and
``reset_peak_rss`` restarts the peak: the one reader the benchmarks and tests measure with.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

from .errors import InsufficientMemory

GB = 1 << 30
BASE_BYTES = 1 * GB  # Python, Paddle, onnxruntime and their libraries, before any weight
WEIGHT_MULTIPLE = {"init": 1.3, "pretrain": 5.0, "export": 2.6, "export_unfused": 2.4, "ptq": 2.0, "eval": 2.0,
                   "infer": 2.0}


@dataclass
class Estimate:
    """Estimated peak resident bytes of one command, by part."""

    command: str
    parts: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        """Sum of the parts."""
        return sum(self.parts.values())

    def to_dict(self) -> dict:
        """JSON form (GB, two decimals)."""
        return {"command": self.command, "total_gb": round(self.total / GB, 2),
                "parts_gb": {k: round(v / GB, 2) for k, v in self.parts.items()}}


def weight_bytes(model) -> int:
    """float32 bytes of the parameters of ``model`` (a ``ModelConfig``)."""
    return 4 * model.num_parameters()


def activation_bytes(model, batch: int, seq: int, recompute: str = "none") -> int:
    """Training activations kept for backward (float32). Per block without recompute: Megatron's
    ``s b h (34 + 5 a s / h)`` bytes at 16 bits, doubled for float32; with recompute the block
    inputs (``s b h`` each) plus one block's full set rebuilt during backward."""
    h, a = model.hidden_size, model.num_attention_heads
    per_block = 2 * seq * batch * h * (34 + 5 * a * seq / h)
    if recompute == "none":
        blocks = model.num_layers * per_block
    else:
        blocks = model.num_layers * 4 * seq * batch * h + per_block
    logits = 3 * 4 * batch * seq * model.vocab_size  # logits, softmax and their gradient
    return int(blocks + logits)


def estimate(command: str, model, batch: int = 1, seq: Optional[int] = None, recompute: str = "none") -> Estimate:
    """Peak bytes of ``command`` (a key of ``WEIGHT_MULTIPLE``) for ``model`` (a ``ModelConfig``);
    ``batch``/``seq``: the micro batch and sequence length (training) or the scoring batch."""
    seq = seq or model.max_position_embeddings
    w = weight_bytes(model)
    est = Estimate(command, {"runtime": BASE_BYTES, "weights": int(WEIGHT_MULTIPLE[command] * w)})
    if command == "pretrain":
        est.parts["activations"] = activation_bytes(model, batch, seq, recompute)
    elif command in ("eval", "infer"):
        est.parts["logits"] = 3 * 4 * batch * seq * model.vocab_size
    return est


def _read_int(path: str) -> Optional[int]:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _stat(path: str) -> dict[str, int]:
    out = {}
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(" ")
                if value.strip().isdigit():
                    out[key] = int(value)
    except OSError:
        pass
    return out


def _cgroup_room() -> Optional[int]:
    """Limit minus the memory in use in this process's memory cgroup (v2 or v1), None without a
    limit. In use: anonymous memory plus mapped files; the page cache of files written earlier is
    charged to the cgroup too but is reclaimed under pressure, so it does not count."""
    try:
        with open("/proc/self/cgroup", encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2 unified hierarchy
            base = os.path.join("/sys/fs/cgroup", path.lstrip("/"))
            limit, usage = _read_int(os.path.join(base, "memory.max")), _read_int(os.path.join(base, "memory.current"))
            stat = _stat(os.path.join(base, "memory.stat"))
            used = stat["anon"] + stat.get("file_mapped", 0) if "anon" in stat else usage
        elif "memory" in controllers.split(","):
            base = os.path.join("/sys/fs/cgroup/memory", path.lstrip("/"))
            limit = _read_int(os.path.join(base, "memory.limit_in_bytes"))
            usage = _read_int(os.path.join(base, "memory.usage_in_bytes"))
            stat = _stat(os.path.join(base, "memory.stat"))
            used = stat["total_rss"] + stat.get("total_mapped_file", 0) if "total_rss" in stat else usage
        else:
            continue
        if limit is not None and used is not None and limit < (1 << 60):  # v1 "no limit" is ~2^63
            return max(0, limit - used)
    return None


def status_bytes(key: str = "VmRSS", pid="self") -> Optional[int]:
    """``key`` of ``/proc/PID/status`` in bytes: ``VmRSS`` the resident set now, ``VmHWM`` its
    peak since the process started or ``reset_peak_rss``. None off Linux, for a process gone, or
    a key the kernel does not report."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return None


def reset_peak_rss() -> None:
    """Set this process's ``VmHWM`` to its ``VmRSS`` (``/proc/self/clear_refs``), so a later
    ``status_bytes("VmHWM")`` is the peak of what runs in between. Raises OSError where the kernel
    does not allow it."""
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")


def available_bytes() -> int:
    """Memory this process may still allocate: the machine's ``MemAvailable``, capped by the room
    left in its memory cgroup."""
    avail = None
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    room = _cgroup_room()
    candidates = [x for x in (avail, room) if x is not None]
    return min(candidates) if candidates else 1 << 62


def return_freed_memory() -> bool:
    """Let this process give freed memory back to the OS: large blocks (>= 1 MB) get their own
    mappings again, released on free, and the heap is trimmed now. ``runtime.tune_cpu`` serves
    every block from the heap and keeps what is freed (faster training); an export frees whole
    copies of the weights between stages (the dygraph model, each runtime it validates), and with
    the heap kept they stayed resident: gpt-345M's export peaked at 7.8x its weights, each
    runtime's freed copy unusable by the next (they allocate from different arenas). Returns
    False off glibc."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    m_trim_threshold, m_mmap_threshold, m_mmap_max = -1, -3, -4  # <malloc.h>
    ok = libc.mallopt(m_mmap_max, 65536) and libc.mallopt(m_mmap_threshold, 1 << 20) \
        and libc.mallopt(m_trim_threshold, 32 << 20)
    if hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
    return bool(ok)


def model_config_of(path: str):
    """The ``ModelConfig`` of a checkpoint or exported directory (``config.json`` or
    ``manifest.json``), or None when ``path`` is neither (the command reports that itself)."""
    import json

    from .config import ModelConfig

    if os.path.isfile(os.path.join(path, "config.json")):
        from .checkpoint import read_config

        return read_config(path)[0]
    manifest = os.path.join(path, "manifest.json")
    if os.path.isfile(manifest):
        try:
            with open(manifest, encoding="utf-8") as f:
                return ModelConfig.from_dict(json.load(f)["model"], source=manifest)
        except (ValueError, KeyError, TypeError):
            return None
    return None


def check_fits(command: str, model, batch: int = 1, seq: Optional[int] = None, recompute: str = "none",
               available: Optional[int] = None, what: str = "") -> Estimate:
    """Raise ``InsufficientMemory`` when ``estimate(...)`` exceeds ``available`` (default:
    ``available_bytes()``); returns the estimate otherwise."""
    est = estimate(command, model, batch, seq, recompute)
    if os.environ.get("GPTC_SKIP_MEMORY_CHECK", "0") == "1":
        return est
    room = available_bytes() if available is None else available
    if est.total > room:
        parts = ", ".join(f"{k} {v / GB:.1f}" for k, v in est.parts.items())
        hint = {"pretrain": "lower Engine.micro_batch_size or Data.seq_length, or set Model.recompute=full",
                "eval": "lower --batch-size or --seq-len"}.get(command, "use a machine with more memory")
        if est.parts["weights"] + est.parts["runtime"] > room:  # no batch or recompute setting helps
            hint = "use a machine with more memory" + (", or shard the model and optimizer state over processes "
                                                       "on several machines (Parallel section: on one machine "
                                                       "they share its memory)" if command == "pretrain" else "")
        raise InsufficientMemory(
            f"{command.replace('_unfused', ' (no fused program)')} of {what or getattr(model, 'name', '') or 'this model'} "
            f"({model.num_parameters() / 1e6:.0f}M parameters, {weight_bytes(model) / GB:.2f} GB of float32 weights) "
            f"needs about {est.total / GB:.1f} GB ({parts}) but only {room / GB:.1f} GB is available; "
            f"{hint} (GPTC_SKIP_MEMORY_CHECK=1 runs it anyway)")
    return est
