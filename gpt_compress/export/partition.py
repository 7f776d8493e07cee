"""Tensor-parallel inference export: one checkpoint -> ``mp_degree`` rank directories.

Each ``rank_{r}/`` is an ordinary exported directory (``prefill``/``decode``/``forward``
programs, ``model.pdiparams``, its own manifest and checksums) holding rank ``r``'s shard of
every weight, split by ``parallel.plan.TP_PLAN`` (the table tensor-parallel training uses):

* column-parallel ``attn.qkv`` / ``mlp.fc_in``: plain ``Linear`` layers with this rank's columns
  (whole heads: the fused QKV is head-major). Their forward needs no communication, so the
  program has no ``c_identity`` (it only matters for the backward pass, and has no CPU kernel).
* row-parallel ``attn.out`` / ``mlp.fc_out``: fleet ``RowParallelLinear`` (``mp_allreduce_sum``).
* vocab-parallel ``gpt.wte``: fleet ``VocabParallelEmbedding`` (``c_embedding`` + all-reduce);
  the tied head multiplies by the same local rows, so each rank outputs its slice of the logits
  (B, V / mp). Gathering them is the runner's job (``inference/tensor_parallel.py``), because
  ``c_concat`` has no CPU kernel either.

So every rank program runs on CPU (gloo) and GPU (NCCL) alike. The collectives in the programs
need a communicator: each process calls ``fleet.init(mp_degree=...)`` before it creates its
predictors (Paddle Inference has no ``DistConfig`` in 3.3.1; without it: "comm_ctx == nullptr").

The export itself must run as ``mp_degree`` processes (tracing the collectives needs the
model-parallel group); ``partition()`` launches them with ``paddle.distributed.launch``.
The top directory has ``manifest.json`` (format ``gpt-compress-tp-inference``) and is written
atomically after every rank's programs reproduced the single-card logits.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from typing import Optional

import numpy as np
import paddle
import paddle.nn as nn

from ..errors import ExportError
from ..fileio import write_dir_atomic
from ..inference.manifest import (MANIFEST, TOKENIZER_FILES, build_manifest, build_tp_manifest, tp_rank_entries,
                                  write_manifest)
from .static import ExportableLM, save_paddle_programs
from .validate import reference, validate_backend


def rank_config(cfg, mp: int):
    """The ``ModelConfig`` of one rank's shard: heads and FFN width divided by ``mp``."""
    from ..config import ModelConfig

    data = cfg.to_dict()
    data["layer_num_heads"] = [cfg.heads(i) // mp for i in range(cfg.num_layers)]
    data["layer_ffn_sizes"] = [cfg.ffn(i) // mp for i in range(cfg.num_layers)]
    data["vocab_size"] = cfg.vocab_size // mp
    return ModelConfig.from_dict(data, source=f"rank shard (mp {mp})")


def shard_weights(weights: dict, rank: int, mp: int) -> dict:
    """Rank ``rank``'s block of every public parameter, following ``TP_PLAN``."""
    from ..parallel.plan import tp_split_of

    out = {}
    for name, arr in weights.items():
        split = tp_split_of(name)
        if split is None:
            out[name] = arr
            continue
        _, axis = split
        n = arr.shape[axis] // mp
        idx = [slice(None)] * arr.ndim
        idx[axis] = slice(rank * n, (rank + 1) * n)
        out[name] = np.ascontiguousarray(arr[tuple(idx)])
    return out


def build_rank_model(cfg, weights: dict, rank: int, mp: int):
    """The one GPT model for rank ``rank``: a shard-sized ``GPTForCausalLM`` whose row-parallel
    layers and embedding are swapped for fleet's communicating layers. Needs ``fleet.init``."""
    import paddle
    from paddle.distributed.fleet.meta_parallel import RowParallelLinear, VocabParallelEmbedding

    from ..checkpoint import assign_weights
    from ..model.gpt import GPTForCausalLM
    from ..parallel.plan import tp_split_of

    local = shard_weights(weights, rank, mp)
    model = GPTForCausalLM(rank_config(cfg, mp))
    model.gpt.wte = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
    for i, block in enumerate(model.gpt.blocks):
        for parent, attr in ((block.attn, "out"), (block.mlp, "fc_out")):
            old = getattr(parent, attr)
            setattr(parent, attr, RowParallelLinear(old.weight.shape[0] * mp, old.weight.shape[1], has_bias=True,
                                                    input_is_parallel=True))
    if not cfg.tie_word_embeddings:
        assert tp_split_of("lm_head.weight") is not None
    assign_weights(model, local, f"rank {rank} shard")
    model.eval()
    paddle.set_grad_enabled(False)
    return model


class TensorParallelLM(ExportableLM):
    """``ExportableLM`` whose logits are this rank's vocabulary slice (B, [T,] V / mp)."""

    def __init__(self, model):
        nn.Layer.__init__(self)  # keep the vocab-parallel embedding (ExportableLM would transpose it)
        self.model = model
        self.tied = model.config.tie_word_embeddings

    def _logits(self, hidden):
        if self.tied:
            return paddle.matmul(hidden, self.model.gpt.wte.weight, transpose_y=True)
        return self.model.lm_head(hidden)


def _init_mp(mp: int) -> None:
    import paddle
    from paddle.distributed import fleet

    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {"dp_degree": 1, "mp_degree": mp, "pp_degree": 1}
    fleet.init(is_collective=True, strategy=strategy)
    tracker = fleet.meta_parallel.get_rng_state_tracker()
    if "model_parallel_rng" not in tracker.states_:
        tracker.add("model_parallel_rng", 1234 + fleet.get_hybrid_communicate_group().get_model_parallel_rank())
    paddle.set_device("gpu" if paddle.is_compiled_with_cuda() else "cpu")


def export_rank(checkpoint: str, output: str, mp: int, validate: bool = True, atol: float = 1e-4) -> Optional[str]:
    """Body of one launched process: write ``output/rank_{r}``; rank 0 then writes the top
    manifest. Returns ``output`` on rank 0, None elsewhere."""
    import paddle.distributed as dist

    from ..checkpoint import load_model, state_dict_numpy

    _init_mp(mp)
    rank = dist.get_rank()
    full = load_model(checkpoint)
    cfg = full.config
    ref = reference(full) if validate else None
    weights = state_dict_numpy(full)
    partial = output.rstrip("/") + ".partial"
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
    dist.barrier()
    model = build_rank_model(cfg, weights, rank, mp)
    rcfg = model.config
    tok = [f for f in TOKENIZER_FILES if os.path.isfile(os.path.join(checkpoint, f))]

    def write(tmp):
        files = {"paddle": save_paddle_programs(model, tmp, wrapper=TensorParallelLM(model))}
        manifest = build_manifest(rcfg, files, ["paddle"], None, os.path.abspath(checkpoint))
        write_manifest(tmp, {**manifest, **tp_rank_entries(cfg, mp, rank)})

    rank_dir = write_dir_atomic(os.path.join(partial, f"rank_{rank}"), write)
    dist.barrier()
    if validate:
        from ..inference.tensor_parallel import TensorParallelBackend

        backend = TensorParallelBackend(partial, rank=rank)
        validate_backend(backend, ref, f"{rank_dir} (tensor parallel, mp {mp})", atol=atol)
    dist.barrier()
    if rank != 0:
        return None
    for name in tok:
        shutil.copyfile(os.path.join(checkpoint, name), os.path.join(partial, name))
    write_manifest(partial, build_tp_manifest(cfg, mp, tok, os.path.abspath(checkpoint)))
    if os.path.exists(output):
        shutil.rmtree(output)
    os.rename(partial, output)
    return output


def partition(checkpoint: str, output: str, mp_degree: int, validate: bool = True,
              log_dir: Optional[str] = None, timeout: float = 1800) -> str:
    """Export ``checkpoint`` into ``mp_degree`` tensor-parallel rank directories under ``output``
    by launching ``mp_degree`` processes with ``paddle.distributed.launch``."""
    from ..checkpoint import read_config
    from ..config import ParallelConfig
    from ..parallel.launch import launch_command
    from ..parallel.plan import check_divisible

    cfg, meta = read_config(checkpoint)
    if meta.get("head", "lm") != "lm":
        raise ExportError(f"{checkpoint} holds a {meta.get('head')!r} model; only language models export")
    check_divisible(cfg, ParallelConfig(mp_degree=mp_degree))
    args = ["partition", "--model", os.path.abspath(checkpoint), "--output",
            os.path.abspath(output), "--mp-degree", str(mp_degree)] + ([] if validate else ["--no-validate"])
    log_dir = log_dir or os.path.abspath(output).rstrip("/") + ".logs"
    cmd = launch_command(mp_degree, args, log_dir=log_dir)
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if res.returncode != 0 or not os.path.isfile(os.path.join(output, MANIFEST)):
        tail = _log_tail(log_dir)
        raise ExportError(f"tensor-parallel export failed (exit {res.returncode}); logs in {log_dir}:\n{tail}")
    return output


def _log_tail(log_dir: str, chars: int = 3000) -> str:
    parts = []
    for name in sorted(os.listdir(log_dir)) if os.path.isdir(log_dir) else []:
        with open(os.path.join(log_dir, name), encoding="utf-8", errors="replace") as f:
            parts.append(f"--- {name}\n{f.read()[-chars:]}")
    return "\n".join(parts)
