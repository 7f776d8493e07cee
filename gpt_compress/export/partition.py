"""Tensor-parallel inference export: one checkpoint -> ``mp_degree`` rank directories.

This module only writes rank exports; the sharding is ``parallel/``'s (``fleet.shard_model``
with ``inference=True``, the layer swap pipeline training uses too) and the manifests are
``inference/manifest.py``'s. Each ``rank_{r}/`` is an ordinary exported directory (``prefill``/``decode``/``forward``
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
import warnings
from typing import Optional

import paddle
import paddle.distributed as dist
import paddle.nn as nn

from ..checkpoint import load_model, read_config
from ..config import ParallelConfig
from ..errors import ExportError, KernelError
from ..fileio import check_output, write_checksums, write_dir_atomic
from ..inference.manifest import (MANIFEST, TOKENIZER_FILES, build_manifest, build_tp_manifest, tp_rank_entries,
                                  write_manifest)
from ..inference.tensor_parallel import TensorParallelBackend
from ..parallel.fleet import init_mp, shard_model
from ..parallel.launch import launch_command, log_tail
from ..parallel.plan import check_divisible, rank_config
from .fused import check_cache_dtype, fused_weights
from .static import ExportableLM, save_paddle_programs
from .validate import fused_atol, reference, validate_backend


# The fused int8/int4 rank programs vs the fake-quant dygraph model, relative to the logits'
# magnitude: the kernels' int8 inputs are made per token and block as the fake quantization
# makes them, but a value near a rounding edge can land on the other code (float32 rounding
# of the inputs); the parity tests bound them closer.
QUANT_ATOL = 5e-2


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


def export_rank(checkpoint: str, output: str, mp: int, validate: bool = True, atol: float = 1e-4,
                fused: bool = True, kv_cache_dtype: str = "float32") -> Optional[str]:
    """Body of one launched process: write ``output/rank_{r}``; rank 0 then writes the top
    manifest. Returns ``output`` on rank 0, None elsewhere. A quantized checkpoint (``gptc ptq``
    / ``qat``) gets the fused rank programs only (they compute on the integer codes).
    ``kv_cache_dtype``: the fused rank programs' KV cache elements (``fused.CACHE_DTYPES``)."""
    from ..qat.quantize import load_quantized, read_quant_state
    from .fused_tp import FusedRankLM, save_fused_rank

    init_mp(mp)
    rank = dist.get_rank()
    quantized = read_quant_state(checkpoint) is not None
    model = load_quantized(checkpoint) if quantized else load_model(checkpoint)
    cfg = model.config
    ref = reference(model) if validate else None
    fused_layer = None
    if fused or quantized:  # from the whole model, before shard_model swaps its layers
        from ..parallel.fleet import mp_group

        try:
            fused_layer = FusedRankLM(fused_weights(model), rank, mp, mp_group().id)
        except KernelError as e:  # no compiler here: the unfused rank programs run everywhere
            if quantized:
                raise ExportError(f"a quantized checkpoint partitions into fused rank programs only: {e}") from None
            warnings.warn(f"no fused rank programs exported: {e}", stacklevel=2)
    has_fused = fused_layer is not None
    partial = output.rstrip("/") + ".partial"
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
    dist.barrier()
    paddle.set_grad_enabled(False)
    if not quantized:
        model = shard_model(model, rank, mp, inference=True)
        model.eval()
    rcfg = rank_config(cfg, mp)  # the shard's (heads, FFN and vocabulary / mp)
    tok = [f for f in TOKENIZER_FILES if os.path.isfile(os.path.join(checkpoint, f))]

    def write(tmp):
        formats = [] if quantized else ["paddle"]
        files = {"paddle": {} if quantized else save_paddle_programs(model, tmp, wrapper=TensorParallelLM(model))}
        manifest = build_manifest(rcfg, files, formats, None, os.path.abspath(checkpoint))
        if fused_layer is not None:
            manifest["fused"] = save_fused_rank(fused_layer, tmp, kv_cache_dtype)
        write_manifest(tmp, {**manifest, **tp_rank_entries(cfg, mp, rank)})

    rank_dir = write_dir_atomic(os.path.join(partial, f"rank_{rank}"), write)
    del fused_layer
    dist.barrier()
    if validate:  # every program of the rank: the unfused ones, then the fused one
        for use_fused in ([] if quantized else [False]) + ([True] if has_fused else []):
            backend = TensorParallelBackend(partial, rank=rank, fused=use_fused)
            what = "fused" if use_fused else "unfused"
            tol = QUANT_ATOL if quantized else atol
            validate_backend(backend, ref, f"{rank_dir} (tensor parallel, mp {mp}, {what})",
                             atol=fused_atol(tol, kv_cache_dtype) if use_fused else tol)
            del backend
    dist.barrier()
    if rank != 0:
        return None
    for name in tok:
        shutil.copyfile(os.path.join(checkpoint, name), os.path.join(partial, name))
    write_manifest(partial, build_tp_manifest(cfg, mp, tok, os.path.abspath(checkpoint)))
    write_checksums(partial)  # marks the directory as ours (fileio.is_own_output) for --overwrite
    if os.path.exists(output):
        check_output(output, overwrite=True)  # partition() checked --overwrite; never a foreign directory
        shutil.rmtree(output)
    os.rename(partial, output)
    return output


def partition(checkpoint: str, output: str, mp_degree: int, validate: bool = True,
              log_dir: Optional[str] = None, timeout: float = 1800, overwrite: bool = False,
              fused: bool = True, kv_cache_dtype: str = "float32") -> str:
    """Export ``checkpoint`` into ``mp_degree`` tensor-parallel rank directories under ``output``
    by launching ``mp_degree`` processes with ``paddle.distributed.launch``; ``fused``: each rank
    also gets its fused program (``fused_tp.py``; always for a quantized checkpoint), whose KV
    cache holds ``kv_cache_dtype`` elements (``fused.CACHE_DTYPES``)."""
    check_cache_dtype(kv_cache_dtype)
    if kv_cache_dtype != "float32" and not fused:
        raise ExportError(f"a {kv_cache_dtype} KV cache is the fused rank programs': partition without --no-fused")
    check_output(output, overwrite)
    cfg, meta = read_config(checkpoint)
    if meta.get("head", "lm") != "lm":
        raise ExportError(f"{checkpoint} holds a {meta.get('head')!r} model; only language models export")
    check_divisible(cfg, ParallelConfig(mp_degree=mp_degree))
    args = ["partition", "--model", os.path.abspath(checkpoint), "--output",
            os.path.abspath(output), "--mp-degree", str(mp_degree)] + ([] if validate else ["--no-validate"])
    args += ([] if fused else ["--no-fused"]) + ["--kv-cache-dtype", kv_cache_dtype]
    log_dir = log_dir or os.path.abspath(output).rstrip("/") + ".logs"
    cmd = launch_command(mp_degree, args, log_dir=log_dir)
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if res.returncode != 0 or not os.path.isfile(os.path.join(output, MANIFEST)):
        tail = log_tail(log_dir)
        raise ExportError(f"tensor-parallel export failed (exit {res.returncode}); logs in {log_dir}:\n{tail}")
    return output
