"""Hybrid parallelism for the one model: dp / mp / sharding (auto-parallel) and pp (fleet).

    dims = init_distributed(cfg)           # validates cfg.parallel against the launch
    par = build_parallel(dims, cfg)        # None for one process
    model = par.apply(model)               # before the optimizer is built
    fit(model, par.loss_fn, batches, cfg, parallel=par)

``plan.py``: ``TP_PLAN`` (which sublayer splits how), the shard math, the auto-parallel engine;
``fleet.py``: fleet start-up and the one tensor-parallel layer swap (pipeline stages with mp,
tensor-parallel inference exports); ``pipeline.py``: pp; ``loss.py``: vocab-parallel
cross-entropy; ``launch.py``: process layout and launch command lines. Nothing here imports
``export/``, ``inference/`` or ``commands/``.
"""
from __future__ import annotations

from .launch import ParallelDims, init_distributed, launch_command  # noqa: F401


def build_parallel(dims: ParallelDims, cfg):
    """The engine for ``dims``: ``Pipeline`` when pp > 1, ``AutoParallel`` for dp/mp/sharding,
    None for a single process."""
    if dims.world_size == 1:
        return None
    if dims.cfg.pp_degree > 1:
        from .pipeline import Pipeline

        return Pipeline(dims, cfg)
    from .plan import AutoParallel

    return AutoParallel(dims)
