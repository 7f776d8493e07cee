"""Process layout and start-up: which rank is which, one ``init`` call, launch command lines.

Runs are started by Paddle's own launcher, one process per device (CPU: gloo)::

    python -m paddle.distributed.launch --nproc_per_node 2 $(which gptc) pretrain -c ... \\
        -o Parallel.dp_degree=2
    # several machines: the same command on each, plus --master IP:PORT --nnodes N

Rank order (the same for both engines): ``rank = (data * pp + stage) * mp + mp_rank`` where
``data`` counts dp x sharding replicas. So tensor-parallel ranks are neighbours (one node, fast
links) and data-parallel replicas are the outermost dimension.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Sequence

from ..config import Config, ConfigError, ParallelConfig


@dataclass(frozen=True)
class ParallelDims:
    """This process's place in the layout; passed explicitly to whatever needs it."""

    cfg: ParallelConfig
    rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        """Rank 0 logs and writes checkpoints."""
        return self.rank == 0

    @property
    def mp_rank(self) -> int:
        """Index among the tensor-parallel ranks of this rank's group."""
        return self.rank % self.cfg.mp_degree

    @property
    def pp_rank(self) -> int:
        """Pipeline stage of this rank."""
        return (self.rank // self.cfg.mp_degree) % self.cfg.pp_degree

    @property
    def data_rank(self) -> int:
        """Index among the dp x sharding replicas: which slice of each global batch this rank reads."""
        return self.rank // (self.cfg.mp_degree * self.cfg.pp_degree)


def launched_world() -> tuple[int, int]:
    """(rank, world size) set by ``paddle.distributed.launch`` (0, 1 without it)."""
    return int(os.environ.get("PADDLE_TRAINER_ID", "0")), int(os.environ.get("PADDLE_TRAINERS_NUM", "1"))


def init_distributed(config: Config) -> ParallelDims:
    """Check ``config.parallel`` against the launch and the batch sizes, and start the
    communication backend (gloo on CPU, NCCL on GPU). A single unlaunched process with the
    default layout needs nothing."""
    cfg, device = config.parallel, config.global_.device
    rank, world = launched_world()
    cfg.validate(world)
    if cfg.dp_degree > 1 and cfg.sharding_degree > 1:
        raise ConfigError("Parallel: dp_degree and sharding_degree are both > 1; sharding ranks also split "
                          "the data, so set sharding_degree to their product and dp_degree to 1")
    if cfg.pp_degree > 1 and (cfg.sharding_degree > 1 or cfg.sequence_parallel):
        raise ConfigError(f"Parallel: {cfg.describe()}: pipeline parallelism runs on fleet's PipelineLayer, "
                          "which this version combines with dp and mp only (not sharding or sequence_parallel)")
    if cfg.virtual_pp_degree > 1 and cfg.pp_degree <= 2:
        # fleet's interleaved schedule asserts "virtual pipeline must run under pp degree > 2"
        raise ConfigError("Parallel.virtual_pp_degree > 1 needs Parallel.pp_degree > 2 (fleet's interleaved schedule)")
    check_batch(config)
    dims = ParallelDims(cfg, rank, world)
    if world == 1:
        return dims
    import paddle
    import paddle.distributed as dist

    paddle.set_device("gpu" if device == "gpu" else "cpu")
    if cfg.pp_degree > 1:
        from .pipeline import init_fleet

        init_fleet(config)
    else:
        if device != "gpu":
            from .gloo import isolate_gloo_groups

            isolate_gloo_groups()  # the auto-parallel engine's mp / dp subgroups
        dist.init_parallel_env()
    return dims


def check_batch(config: Config) -> int:
    """Gradient-accumulation steps; ``ConfigError`` unless global = micro x accumulate x dp x sharding."""
    eng, par = config.engine, config.parallel
    per_step = eng.micro_batch_size * par.data_parallel_size
    if eng.global_batch_size % per_step:
        dp = f" x dp {par.dp_degree}" if par.dp_degree > 1 else ""
        sh = f" x sharding {par.sharding_degree}" if par.sharding_degree > 1 else ""
        raise ConfigError(f"Engine.global_batch_size {eng.global_batch_size} must equal Engine.micro_batch_size "
                          f"{eng.micro_batch_size} x accumulate steps{dp}{sh}: it is not a multiple of {per_step}")
    return eng.global_batch_size // per_step


def gptc_executable() -> str:
    """Path of the ``gptc`` console script of this environment (what the launcher starts per rank)."""
    import shutil
    import sys

    here = os.path.join(os.path.dirname(sys.executable), "gptc")
    found = here if os.path.isfile(here) else shutil.which("gptc")
    if not found:
        raise RuntimeError("the gptc console script is not installed (pip install -e .)")
    return found


def launch_command(nproc_per_node: int, gptc_args: Sequence[str], *, nnodes: int = 1,
                   master: Optional[str] = None, devices: Optional[str] = None,
                   log_dir: Optional[str] = None, python: Optional[str] = None) -> list[str]:
    """``python -m paddle.distributed.launch ... gptc <gptc_args>`` for ``nproc_per_node``
    processes per node. The launcher runs an executable or a ``.py`` file per rank; it has no
    ``-m module`` form (``-m gpt_compress`` becomes the script path "gpt_compress"), so each rank
    runs the ``gptc`` console script."""
    import sys

    cmd = [python or sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", str(nproc_per_node)]
    if nnodes > 1:
        if not master:
            raise ValueError("a multi-node launch needs master='IP:PORT' of node 0")
        cmd += ["--nnodes", str(nnodes), "--master", master]
    if devices:
        cmd += ["--devices", devices]
    if log_dir:
        cmd += ["--log_dir", log_dir]
    return cmd + [gptc_executable(), *gptc_args]


def log_tail(log_dir: str, chars: int = 3000) -> str:
    """The last ``chars`` characters of every file in the launcher's ``log_dir`` (for error messages)."""
    parts = []
    for name in sorted(os.listdir(log_dir)) if os.path.isdir(log_dir) else []:
        with open(os.path.join(log_dir, name), encoding="utf-8", errors="replace") as f:
            parts.append(f"--- {name}\n{f.read()[-chars:]}")
    return "\n".join(parts)
