"""Fleet's tensor-parallel layers on the one model, and the fleet start-up they need (CPU/gloo included).

Two places run fleet's collective layers: pipeline stages with ``mp > 1`` (training,
``parallel/pipeline.py``) and tensor-parallel inference exports (``export/partition.py``, run
by ``inference/tensor_parallel.py``). Both use this module:

* ``init_fleet(cfg)`` / ``init_mp(mp)``: ``fleet.init`` with a hybrid topology, the
  model-parallel RNG, and on CPU the gloo workarounds below.
* ``shard_model(model, rank, mp)``: the one plan-driven layer swap. Every sublayer that
  ``plan.TP_PLAN`` names is replaced by fleet's layer of its kind holding this rank's block of
  the weights (``plan.shard_weights``); parameter names stay the model's, shapes become local.
  ``inference=True`` keeps column-parallel layers as plain ``Linear``s: their forward needs no
  communication, and fleet's ``ColumnParallelLinear`` puts a ``c_identity`` op in exported
  programs, which has no CPU kernel.

gloo workarounds (checked with Paddle 3.3.1): every subgroup rendezvous on a TCP store of its own
(``gloo.isolate_gloo_groups``: Paddle's second, unprefixed rendezvous of a gloo group reads other
groups' addresses, so fleet's hybrid groups on four processes fail to connect), with pp > 2 the
pipeline's point-to-point operations on two-process groups (``gloo.pair_groups``: gloo's
per-group operation tags drift apart between neighbours), ``pp_configs.use_batch_p2p_comm=False`` (gloo
refuses "send with sync_op and use_calc_stream"), ``ParallelEnv._device_id`` (``PipelineLayer``
reads it even on CPU), and fleet's ``_mp_allreduce`` / ``_c_identity`` routed through ordinary
``paddle.distributed.all_reduce`` (gloo refuses "all_reduce with ... use_calc_stream").
"""
from __future__ import annotations

import re

import paddle
import paddle.nn as nn

from ..checkpoint import assign_weights, state_dict_numpy
from ..config import Config
from .gloo import isolate_gloo_groups, pair_groups
from .plan import TP_PLAN, rank_config, shard_weights


def _init(hybrid: dict, strategy_extra: dict, rng_seed: int, mp: int, route: bool) -> None:
    import paddle.distributed as dist
    from paddle.distributed import fleet

    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = hybrid
    for key, value in strategy_extra.items():
        setattr(strategy, key, value)
    if not paddle.is_compiled_with_cuda():
        isolate_gloo_groups()
        if not hasattr(dist.ParallelEnv, "_device_id"):
            dist.ParallelEnv._device_id = 0  # PipelineLayer reads it; a CPU process has no device id
    fleet.init(is_collective=True, strategy=strategy)
    if not paddle.is_compiled_with_cuda() and hybrid["pp_degree"] > 2:
        pair_groups(fleet.get_hybrid_communicate_group().topology().get_comm_list("pipe"))
    if mp > 1:
        tracker = fleet.meta_parallel.get_rng_state_tracker()
        if "model_parallel_rng" not in tracker.states_:
            tracker.add("model_parallel_rng", rng_seed + fleet.get_hybrid_communicate_group().get_model_parallel_rank())
        if route and not paddle.is_compiled_with_cuda():
            route_mp_collectives_through_gloo()


def init_hybrid(cfg: Config, micro_batch_size: int, accumulate_steps: int) -> None:
    """``fleet.init`` with ``cfg.parallel``'s dp x pp x mp hybrid topology and the pipeline's
    micro-batching (training; on CPU the mp collectives go through gloo with autograd)."""
    par = cfg.parallel
    hybrid = {"dp_degree": par.dp_degree, "mp_degree": par.mp_degree, "pp_degree": par.pp_degree,
              "sharding_degree": 1, "pp_configs": {"use_batch_p2p_comm": paddle.is_compiled_with_cuda()}}
    _init(hybrid, {"pipeline_configs": {"accumulate_steps": accumulate_steps, "micro_batch_size": micro_batch_size}},
          cfg.global_.seed + 1, par.mp_degree, route=True)


def init_mp(mp: int, seed: int = 1234) -> None:
    """``fleet.init`` of ``mp`` model-parallel ranks alone (tensor-parallel export and inference:
    the static programs keep fleet's own collectives); selects the GPU when this build has one."""
    _init({"dp_degree": 1, "mp_degree": mp, "pp_degree": 1}, {}, seed, mp, route=False)
    paddle.set_device("gpu" if paddle.is_compiled_with_cuda() else "cpu")


class _AllReduce(paddle.autograd.PyLayer):
    """Sum over the model-parallel group; the gradient passes through (the sum is replicated)."""

    @staticmethod
    def forward(ctx, x, group):
        import paddle.distributed as dist

        y = x.clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, dy):
        return dy


class _Identity(paddle.autograd.PyLayer):
    """Identity whose gradient is summed over the model-parallel group (input of a column split)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.clone()

    @staticmethod
    def backward(ctx, dy):
        import paddle.distributed as dist

        g = dy.clone()
        dist.all_reduce(g, group=ctx.group)
        return g


def route_mp_collectives_through_gloo() -> None:
    """gloo refuses fleet's model-parallel all-reduce ("ProcessGroupGLOO does not support
    all_reduce with ... use_calc_stream"): run fleet's ``_mp_allreduce`` / ``_c_identity`` as
    ordinary ``paddle.distributed.all_reduce`` calls with the same autograd rules."""
    from paddle.distributed.fleet.layers.mpu import mp_ops

    def mp_allreduce(tensor, op=None, group=None, use_calc_stream=True, use_model_parallel=True,
                     skip_c_identity_dynamic=False):
        return _AllReduce.apply(tensor, group)

    def c_identity(tensor, group=None, skip_c_identity_dynamic=False):
        return _Identity.apply(tensor, group)

    mp_ops._mp_allreduce, mp_ops._c_identity = mp_allreduce, c_identity


def mp_group():
    """The model-parallel communication group of this process (after ``fleet.init``)."""
    from paddle.distributed import fleet

    return fleet.get_hybrid_communicate_group().get_model_parallel_group()


def _tp_layer(kind: str, layer: nn.Layer, mp: int, inference: bool) -> nn.Layer:
    """Fleet's (global-shape) tensor-parallel layer replacing ``layer`` for plan kind ``kind``."""
    from paddle.distributed.fleet.meta_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

    if kind == "vocab":  # Embedding (V, H): rows split
        return VocabParallelEmbedding(*layer.weight.shape)
    k, n = layer.weight.shape  # Linear (in, out)
    has_bias = layer.bias is not None
    if kind == "row":
        return RowParallelLinear(k, n, has_bias=has_bias, input_is_parallel=True)
    if inference:  # "column" / "vocab_head": this rank's columns, no collective in the forward
        return nn.Linear(k, n // mp, bias_attr=None if has_bias else False)
    return ColumnParallelLinear(k, n, has_bias=has_bias, gather_output=False)


def shard_model(model, rank: int, mp: int, inference: bool = False):
    """Swap ``TP_PLAN``'s sublayers of the one model (in place) for fleet's tensor-parallel layers
    holding rank ``rank``'s blocks of its current weights; attention keeps ``heads / mp`` heads.
    With ``inference`` (see the module docstring) ``model.config`` becomes the rank's
    ``plan.rank_config`` (what its exported programs take and return). Needs ``fleet.init``."""
    local = shard_weights(state_dict_numpy(model), rank, mp)
    for name, layer in list(model.named_sublayers()):
        kind = next((k for pattern, k in TP_PLAN.items() if re.fullmatch(pattern, name)), None)
        if kind is None:
            continue
        parent, _, attr = name.rpartition(".")
        setattr(model.get_sublayer(parent) if parent else model, attr, _tp_layer(kind, layer, mp, inference))
    for block in model.gpt.blocks:
        block.attn.num_heads //= mp
    assign_weights(model, local, f"model-parallel rank {rank} of {mp}")
    if inference:
        model.config = rank_config(model.config, mp)
    return model
