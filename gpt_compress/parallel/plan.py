"""Data, tensor and sharded-data parallelism applied to the one model by a plan of parameter names.

The model (``model/gpt.py``) knows nothing about parallelism. ``TP_PLAN`` names its sublayers
by regular expression and says how each one's weights split across the ``mp`` ranks; Paddle's
auto-parallel engine (``dist.parallelize`` with ``ColWiseParallel``/``RowWiseParallel``, then
``dist.shard_optimizer`` with ``ShardingStage1/2/3``) turns the parameters into distributed
tensors on a ``[dp, mp]`` process mesh and inserts the communication. Every op keeps the
*global* view, so the model's own ``forward`` (reshapes with the full head count included) runs
unchanged:

* ``attn.qkv`` is column-parallel. Its columns are head-major ``[heads, 3, head_dim]``, so a
  contiguous split hands each rank whole heads with their q, k and v, and the reshape to
  ``(B, T, heads, 3, D)`` keeps the split on the head axis through attention (no gather).
* ``attn.out`` and ``mlp.fc_out`` are row-parallel (their partial sums are all-reduced);
  ``mlp.fc_in`` is column-parallel.
* ``gpt.wte`` is vocab-parallel (rows split); the tied LM head reuses it, so the logits come out
  split along the vocabulary and ``vocab_parallel_cross_entropy`` never gathers them.

Pipeline parallelism uses fleet's ``PipelineLayer`` instead (``parallel/pipeline.py``): auto-parallel
pipelining crashes on CPU (``docs/PADDLE_CPU.md``). Pipeline stages with ``mp > 1`` and
tensor-parallel inference exports use fleet's layers, swapped in by ``fleet.shard_model`` from
the same ``TP_PLAN``, with each rank's block of the weights cut by ``shard_weights`` and its
shard's config given by ``rank_config``.
"""
from __future__ import annotations

import json
import os
import re
from typing import Optional

import numpy as np
import paddle

from ..checkpoint import WEIGHTS, check_state_dict, load_weights, verify_checksums
from ..config import ConfigError, ModelConfig, ParallelConfig
from ..train.checkpoint import OPTIMIZER, STATE, optimizer_tensors, set_rng_state
from .loss import vocab_parallel_lm_loss

# Tensor-parallel plan: regex fully matching a ``named_sublayers()`` name of GPTForCausalLM -> split.
#   "column": Linear weight (in, out) split on out (and its bias);  "row": split on in (bias kept whole)
#   "vocab":  Embedding weight (vocab, hidden) split on vocab;       "vocab_head": Linear (hidden, vocab) on vocab
TP_PLAN: dict[str, str] = {
    r"gpt\.wte": "vocab",
    r"lm_head": "vocab_head",
    r"gpt\.blocks\.\d+\.attn\.qkv": "column",
    r"gpt\.blocks\.\d+\.attn\.out": "row",
    r"gpt\.blocks\.\d+\.mlp\.fc_in": "column",
    r"gpt\.blocks\.\d+\.mlp\.fc_out": "row",
}


def tp_split_of(param_name: str) -> Optional[tuple[str, int]]:
    """(kind, axis) along which the public parameter ``param_name`` is split under tensor
    parallelism, or None when it is replicated. Axis refers to the stored array."""
    layer, _, attr = param_name.rpartition(".")
    for pattern, kind in TP_PLAN.items():
        if re.fullmatch(pattern, layer):
            if kind in ("column", "vocab_head"):
                return kind, (1 if attr == "weight" else 0)
            if kind == "row":
                return (kind, 0) if attr == "weight" else None
            return kind, 0  # vocab embedding rows
    return None


def shard_weights(weights: dict[str, np.ndarray], rank: int, mp: int) -> dict[str, np.ndarray]:
    """Rank ``rank``'s block of every public parameter in ``weights``, following ``TP_PLAN``."""
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


def rank_config(cfg: ModelConfig, mp: int) -> ModelConfig:
    """The ``ModelConfig`` of one rank's shard: heads, FFN width and vocabulary divided by ``mp``."""
    data = cfg.to_dict()
    data["layer_num_heads"] = [cfg.heads(i) // mp for i in range(cfg.num_layers)]
    data["layer_ffn_sizes"] = [cfg.ffn(i) // mp for i in range(cfg.num_layers)]
    data["vocab_size"] = cfg.vocab_size // mp
    return ModelConfig.from_dict(data, source=f"rank shard (mp {mp})")


def check_divisible(model_cfg: ModelConfig, par: ParallelConfig) -> None:
    """Raise ``ConfigError`` when the model does not split evenly over the layout."""
    mp, pp = par.mp_degree, par.pp_degree
    if mp > 1:
        for i in range(model_cfg.num_layers):
            if model_cfg.heads(i) % mp:
                raise ConfigError(f"Parallel.mp_degree {mp} does not divide the {model_cfg.heads(i)} attention "
                                  f"heads of layer {i}")
            if model_cfg.ffn(i) % mp:
                raise ConfigError(f"Parallel.mp_degree {mp} does not divide the FFN width {model_cfg.ffn(i)} "
                                  f"of layer {i}")
        if model_cfg.vocab_size % mp:
            raise ConfigError(f"Parallel.mp_degree {mp} does not divide Model.vocab_size {model_cfg.vocab_size}")
    if pp > 1 and model_cfg.num_layers % (pp * par.virtual_pp_degree):
        raise ConfigError(f"Model.num_layers {model_cfg.num_layers} is not divisible by pp_degree {pp} x "
                          f"virtual_pp_degree {par.virtual_pp_degree}")


def _paddle_plan(has_lm_head: bool, sequence_parallel: bool) -> dict:
    import paddle.distributed as dist

    factory = {"column": dist.ColWiseParallel, "row": dist.RowWiseParallel,
               "vocab": dist.RowWiseParallel,  # on an Embedding: rows (the vocabulary) split
               "vocab_head": dist.ColWiseParallel}
    plan = {}
    for pattern, kind in TP_PLAN.items():
        if pattern == "lm_head" and not has_lm_head:
            continue
        plan[pattern] = factory[kind]()
    if sequence_parallel:
        # Activations between the blocks' attention/MLP are split along the sequence (LayerNorm,
        # dropout and residual adds on T/mp rows); attention and MLP gather them back.
        plan[r"gpt\.drop"] = dist.SequenceParallelBegin()
        plan[r"gpt\.blocks\.\d+\.attn"] = dist.SequenceParallelDisable()
        plan[r"gpt\.blocks\.\d+\.mlp"] = dist.SequenceParallelDisable()
        plan[r"gpt\.ln_f"] = dist.SequenceParallelEnd()
    return plan


class AutoParallel:
    """dp / mp / sharding on a ``[dp, mp]`` mesh through Paddle's auto-parallel engine.

    Build with ``AutoParallel(dims)``, then ``model = ap.apply(model)`` once, before the
    optimizer exists; ``fit`` calls ``prepare_optimizer``. Batches handed to ``loss_fn`` are
    this rank's slice of the global micro-batch (numpy); they become distributed tensors
    sharded along the batch on ``dp``.
    """

    def __init__(self, dims):
        import paddle.distributed as dist

        self.dims = dims
        cfg = dims.cfg
        data = cfg.data_parallel_size
        ids = np.arange(dims.world_size).reshape(data, cfg.mp_degree).tolist()
        self.mesh = dist.ProcessMesh(ids, dim_names=["dp", "mp"])
        self.model = None

    # ---------------------------------------------------------------- model and optimizer
    def apply(self, model):
        """Turn ``model``'s parameters into distributed tensors following ``TP_PLAN``."""
        import paddle.distributed as dist

        cfg = self.dims.cfg
        check_divisible(model.config, cfg)
        config = {"dp_config": {"sharding_level": 0}}
        if cfg.mp_degree > 1:
            config["mp_config"] = {"parallelize_plan": _paddle_plan(hasattr(model, "lm_head"),
                                                                    cfg.sequence_parallel)}
        model, _ = dist.parallelize(model, None, self.mesh, config)
        self.model = model
        return model

    def prepare_optimizer(self, optimizer):
        """Shard the optimizer state (and gradients / parameters) for ``sharding_degree > 1``."""
        import paddle.distributed as dist

        cfg = self.dims.cfg
        if cfg.sharding_degree == 1:
            return dist.shard_optimizer(optimizer, None)
        # gloo has no reduce_scatter kernel ("Unimplemented cpu kernel for CReduceScatterOp"):
        # resolve pending gradient sums by all-reduce first; the stage then keeps only its shard.
        if not paddle.is_compiled_with_cuda():
            for p in self.model.parameters():
                if not p.stop_gradient:
                    p.register_hook(_allreduce_partial)
        stage = {1: dist.ShardingStage1, 2: dist.ShardingStage2, 3: dist.ShardingStage3}[cfg.sharding_stage]
        return dist.shard_optimizer(optimizer, stage("dp", self.mesh))

    # ------------------------------------------------------------------------- data
    def to_dist(self, local: np.ndarray) -> paddle.Tensor:
        """This rank's (b, T) slice -> a global (b * dp, T) tensor sharded along the batch on dp."""
        import paddle.distributed as dist
        from paddle.distributed.auto_parallel.api import dtensor_from_local

        t = paddle.to_tensor(np.ascontiguousarray(local))
        return dtensor_from_local(t, self.mesh, [dist.Shard(0), dist.Replicate()])

    def replicate(self, t: paddle.Tensor) -> paddle.Tensor:
        """``t`` made whole on every rank (sums and pending reductions resolved)."""
        import paddle.distributed as dist

        return dist.reshard(t, self.mesh, [dist.Replicate(), dist.Replicate()])

    def loss_fn(self, model, batch: dict) -> paddle.Tensor:
        """Mean next-token cross-entropy over the global micro-batch, replicated on every rank."""
        mask = batch.get("loss_mask")
        loss = vocab_parallel_lm_loss(model, self.to_dist(batch["input_ids"]),
                                      self.to_dist(batch["labels"].astype(np.int64)),
                                      None if mask is None else self.to_dist(mask))
        return self.replicate(loss)

    # ------------------------------------------------------------------- checkpoints
    def gather_numpy(self, t: paddle.Tensor) -> np.ndarray:
        """The whole value of a (possibly distributed) tensor; collective: every rank calls it."""
        import paddle.distributed as dist

        if t.is_dist():
            t = dist.unshard_dtensor(t)
        return np.ascontiguousarray(t.numpy())

    def gather_model(self, model) -> dict:
        """Every parameter's whole value by public name (collective; rank 0 writes them)."""
        return {k: self.gather_numpy(v) for k, v in model.state_dict().items()}

    def gather_optimizer(self, model, optimizer) -> tuple[dict, dict]:
        """Optimizer moments gathered to whole tensors, keyed like a single-process checkpoint."""
        return optimizer_tensors(model, optimizer, self.gather_numpy)

    def load_training_checkpoint(self, path: str, model, optimizer, scheduler) -> dict:
        """Resume: every rank reads the single-process-layout checkpoint and keeps its blocks of the
        weights and optimizer moments; scheduler, RNG and data position as in one process."""
        from safetensors.numpy import load_file

        verify_checksums(path)
        weights = load_weights(path)
        check_state_dict(model, weights, os.path.join(path, WEIGHTS))
        # The sharded optimizer creates (and shards) its moments on request, by a zero-gradient
        # step that may move the weights: assign the weights after it.
        states = optimizer.state_dict()
        for name, t in model.state_dict().items():
            _assign_local(t, weights[name], self.dims.rank)
        internal = {n: p.name for n, p in model.named_parameters()}
        saved = {f"{internal[key.split('::', 1)[0]]}_{key.split('::', 1)[1]}": arr
                 for key, arr in load_file(os.path.join(path, OPTIMIZER)).items()}
        missing = [k for k, t in states.items() if isinstance(t, paddle.Tensor) and k not in saved]
        if missing:
            raise ConfigError(f"{path}: optimizer state lacks {missing[:3]}; was it written by another optimizer?")
        for key, t in states.items():
            if isinstance(t, paddle.Tensor):
                _assign_local(t, saved[key], self.dims.rank)
        with open(os.path.join(path, STATE), encoding="utf-8") as f:
            state = json.load(f)
        scheduler.set_state_dict(state["scheduler"])
        set_rng_state(state["rng"])
        return state


def _assign_local(t: paddle.Tensor, full: np.ndarray, rank: int) -> None:
    """Write this rank's block of ``full`` into (distributed) tensor ``t`` in place."""
    part = local_slice(np.asarray(full), t, rank)
    target = t._local_value() if t.is_dist() else t
    if tuple(target.shape) != part.shape:
        raise ConfigError(f"cannot place a {full.shape} checkpoint tensor into {tuple(t.shape)} "
                          f"(local {tuple(target.shape)}, {t.placements if t.is_dist() else 'dense'})")
    target.set_value(paddle.to_tensor(part, dtype=target.dtype))


def _allreduce_partial(grad):
    """Gradient hook: turn a pending (Partial) sum into a replicated value by all-reduce."""
    import paddle.distributed as dist

    if grad.is_dist() and any(p.is_partial() for p in grad.placements):
        return dist.reshard(grad, grad.process_mesh, [dist.Replicate() if p.is_partial() else p
                                                      for p in grad.placements])
    return grad


def local_slice(full: np.ndarray, like, rank: int) -> np.ndarray:
    """The block of ``full`` (a tensor's global value) that ``rank`` holds for dist tensor ``like``."""
    if not like.is_dist():
        return full
    mesh = like.process_mesh
    coords = np.argwhere(np.asarray(mesh.process_ids).reshape(mesh.shape) == rank)
    if len(coords) == 0:
        return full[:0]
    coord = coords[0]
    out = full
    for mesh_dim, placement in enumerate(like.placements):
        if placement.is_shard():
            axis = placement.get_dim()
            n = mesh.shape[mesh_dim]
            size = -(-out.shape[axis] // n)
            idx = [slice(None)] * out.ndim
            idx[axis] = slice(coord[mesh_dim] * size, (coord[mesh_dim] + 1) * size)
            out = out[tuple(idx)]
    return np.ascontiguousarray(out)
