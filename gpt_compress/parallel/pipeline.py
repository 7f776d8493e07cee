"""Pipeline parallelism: fleet's ``PipelineLayer`` built from the one model's own sublayers.

``pipeline_layers(model)`` lists the model as a sequence of stage pieces that *reference* its
sublayers (embeddings, each ``gpt.blocks.i``, ``ln_f``, the head), so no second copy of the
model exists and parameter names stay those of ``model/gpt.py``. The tied token embedding is a
``SharedLayerDesc`` used by the first stage (lookup) and the last (LM head); fleet all-reduces its
gradient between the two. Each stage trains only its own parameters: the others are frozen in
this process (``stop_gradient``) so the optimizer and the clip never see them.

Fleet's 1F1B schedule runs the micro-batches (``PipelineParallel.forward_backward_pipeline``);
the trainer's optimizer, clipping and LR schedule stay the same. With ``mp > 1`` each stage's
layers are fleet's tensor-parallel ones (``fleet.shard_model``) and the last stage's loss is the
vocab-parallel cross-entropy of ``loss.py``. Fleet start-up and its CPU/gloo settings:
``fleet.py``.
"""
from __future__ import annotations

import json
import os
from typing import Iterator

import numpy as np
import paddle
import paddle.nn as nn

from ..checkpoint import assign_weights, load_weights, verify_checksums
from ..config import Config, ConfigError
from ..train.checkpoint import (OPTIMIZER, STATE, load_optimizer, optimizer_tensors, load_training_checkpoint,
                                set_rng_state)
from ..train.loss import masked_mean_ce
from .fleet import init_hybrid, mp_group, shard_model
from .loss import vocab_parallel_cross_entropy
from .plan import check_divisible, shard_weights, tp_split_of


def init_fleet(cfg: Config) -> None:
    """``fleet.init`` for ``cfg``'s dp x pp x mp layout and the pipeline's micro-batching."""
    init_hybrid(cfg, *micro_batches(cfg))


def micro_batches(cfg: Config) -> tuple[int, int]:
    """(samples per pipeline micro-batch, micro-batches per step) for this dp replica."""
    eng, par = cfg.engine, cfg.parallel
    per_replica = eng.global_batch_size // par.data_parallel_size
    acc = par.pp_micro_batches or per_replica // eng.micro_batch_size
    if acc < 1 or per_replica % acc:
        raise ConfigError(f"Parallel.pp_micro_batches {acc} does not divide the {per_replica} samples each "
                          "data-parallel replica takes per step")
    return per_replica // acc, acc


class _Embeddings(nn.Layer):
    """Stage-0 piece after the token lookup: add learned positions, dropout. (B, T, H) -> same."""

    def __init__(self, gpt):
        super().__init__()
        self.wpe, self.drop = gpt.wpe, gpt.drop

    def forward(self, x):
        pos = paddle.arange(0, x.shape[1], dtype="int64").unsqueeze(0)  # (1, T)
        return self.drop(x + self.wpe(pos))


class _StageBlock(nn.Layer):
    """One decoder block, hidden states in and out (no cache)."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        return self.block.forward_train(x)


class _Final(nn.Layer):
    """``ln_f`` (and the untied ``lm_head``): hidden -> normed hidden or logits."""

    def __init__(self, model):
        super().__init__()
        self.ln_f = model.gpt.ln_f
        self.lm_head = getattr(model, "lm_head", None)

    def forward(self, x):
        x = self.ln_f(x)
        return x if self.lm_head is None else self.lm_head(x)


class TokenEmbedding(nn.Layer):
    """The shared piece: ``gpt.wte`` (vocab-parallel under mp), used as lookup table and as tied
    LM head. ``weight`` is the attribute fleet syncs (and all-reduces the gradient of) between the
    first and the last stage."""

    def __init__(self, wte):
        super().__init__()
        self.embedding = wte

    @property
    def weight(self):
        """The (local block of the) token embedding table."""
        return self.embedding.weight


def _lookup(shared, input_ids):
    return shared.embedding(input_ids)  # (B, T) -> (B, T, H)


def tied_head(shared, hidden):
    """The tied LM head on the shared ``TokenEmbedding``: hidden (B, T, H) -> logits (B, T, V [/ mp]);
    under mp the input's gradient is summed over the vocabulary slices."""
    if getattr(shared.embedding, "is_mp", False):
        from paddle.distributed.fleet.layers.mpu import mp_ops

        hidden = mp_ops._c_identity(hidden, group=mp_group())  # its gradient sums over the vocab slices
    return paddle.matmul(hidden, shared.weight, transpose_y=True)  # (B, T, H) -> (B, T, V [/ mp])


def pipeline_layers(model) -> list:
    """The model as an ordered list of pipeline pieces (descriptors for the shared embedding)."""
    from paddle.distributed.fleet.meta_parallel import SharedLayerDesc

    gpt = model.gpt
    tied = model.config.tie_word_embeddings
    pieces = [SharedLayerDesc("wte", TokenEmbedding, _lookup, "weight", gpt.wte), _Embeddings(gpt)]
    pieces += [_StageBlock(b) for b in gpt.blocks]
    pieces.append(_Final(model))
    if tied:
        pieces.append(SharedLayerDesc("wte", TokenEmbedding, tied_head, "weight", gpt.wte))
    return pieces


class Pipeline:
    """pp (x dp) through fleet: same interface as ``plan.AutoParallel`` plus ``forward_backward``."""

    def __init__(self, dims, cfg: Config):
        self.dims, self.cfg = dims, cfg
        self.pipe = None
        self.model = None

    def apply(self, model):
        """Split ``model`` into this rank's stage; returns ``model`` (other stages frozen here)."""
        from paddle.distributed import fleet
        from paddle.distributed.fleet.meta_parallel import PipelineLayer

        par = self.cfg.parallel
        check_divisible(model.config, par)
        if par.mp_degree > 1:
            model = shard_model(model, self.dims.mp_rank, par.mp_degree)
        if model.config.num_layers < par.pp_degree:
            raise ConfigError(f"pp_degree {par.pp_degree} exceeds Model.num_layers {model.config.num_layers}")
        vpp = par.virtual_pp_degree
        # Cut only at block boundaries: the embedding pieces go with the first blocks, ln_f/head with the last.
        seg = "layer:^_StageBlock$"
        layers = PipelineLayer(layers=pipeline_layers(model), num_stages=par.pp_degree,
                               topology=fleet.get_hybrid_communicate_group().topology(),
                               loss_fn=PipelineLoss(par.mp_degree), seg_method=seg,
                               num_virtual_pipeline_stages=vpp if vpp > 1 else None)
        own = {id(p) for p in layers.parameters()}
        for p in model.parameters():
            if id(p) not in own:
                p.stop_gradient = True  # another stage trains it
        self.pipe = fleet.distributed_model(layers)
        self.model = model
        self._layers = layers
        # The tied embedding lives on the first and last stage; count it once in the grad norm.
        self._shared_dup = set()
        if self.dims.pp_rank > 0 and model.config.tie_word_embeddings:
            self._shared_dup = {id(model.gpt.wte.weight)}
        return model

    def prepare_optimizer(self, optimizer):
        """The stage's plain optimizer (it only holds this stage's trainable parameters)."""
        return optimizer

    # ----------------------------------------------------------------------- training
    def forward_backward(self, batches: Iterator[dict], accumulate: int) -> float:
        """Run ``accumulate`` micro-batches through the 1F1B schedule; gradients accumulate in
        the parameters (mean over the micro-batches); returns the mean loss."""
        parts = [next(batches) for _ in range(accumulate)]
        ids = paddle.to_tensor(np.concatenate([b["input_ids"] for b in parts]))
        labels = paddle.to_tensor(np.concatenate([b["labels"] for b in parts]).astype(np.int64))
        loss = self.pipe.forward_backward_pipeline((ids, labels), None)  # no loss scaler (fp32)
        if self.cfg.parallel.dp_degree > 1:
            import paddle.distributed as dist
            from paddle.distributed import fleet
            from paddle.distributed.fleet.utils.hybrid_parallel_util import fused_allreduce_gradients

            hcg = fleet.get_hybrid_communicate_group()
            fused_allreduce_gradients([p for p in self._layers.parameters() if not p.stop_gradient], hcg)
            # The schedule's loss is this replica's; the step's loss is the mean over the replicas.
            loss = loss.clone()
            dist.all_reduce(loss, group=hcg.get_data_parallel_group())
            loss = loss / self.cfg.parallel.dp_degree
        return float(loss.numpy().reshape(-1)[0])

    def _eval(self, ids: np.ndarray, labels: np.ndarray, compute_loss: bool):
        # The whole batch as one pipeline micro-batch (training sets its own micro-batching). The
        # interleaved schedule (vpp) runs only with >= 2 x pp micro-batches: the batch repeated,
        # so the mean loss is the batch's and the first micro-batch's outputs are its logits.
        par = self.cfg.parallel
        reps = 2 * par.pp_degree if par.virtual_pp_degree > 1 else 1
        saved = self.pipe.accumulate_steps, self.pipe.micro_batch_size
        self.pipe.accumulate_steps, self.pipe.micro_batch_size = reps, int(ids.shape[0])
        ids, labels = np.concatenate([ids] * reps), np.concatenate([labels] * reps).astype(np.int64)
        try:
            return self.pipe.eval_batch((paddle.to_tensor(ids), paddle.to_tensor(labels)), compute_loss=compute_loss)
        finally:
            self.pipe.accumulate_steps, self.pipe.micro_batch_size = saved

    @paddle.no_grad()
    def loss_fn(self, model, batch: dict) -> paddle.Tensor:
        """Evaluation loss of one batch through all stages (every rank gets it)."""
        loss = self._eval(batch["input_ids"], batch["labels"], compute_loss=True)
        return paddle.to_tensor(float(np.asarray(loss.numpy()).reshape(-1)[0]))

    @paddle.no_grad()
    def logits(self, input_ids: np.ndarray):
        """Logits (B, T, V) of the last stage as numpy (None on the other stages); under mp the
        last stage's ranks join their vocabulary slices (a collective among them)."""
        out = self._eval(input_ids, np.zeros_like(input_ids), compute_loss=False)
        if self.dims.pp_rank != self.cfg.parallel.pp_degree - 1:
            return None
        first = out[0]
        first = first[0] if isinstance(first, (tuple, list)) else first  # (B, T, V [/ mp])
        if self.cfg.parallel.mp_degree == 1:
            return first.numpy()
        import paddle.distributed as dist

        parts: list = []
        dist.all_gather(parts, first, group=mp_group())
        return np.concatenate([p.numpy() for p in parts], axis=-1)

    @paddle.no_grad()
    def clip_grad_norm_(self, parameters, max_norm: float) -> float:
        """Global-norm clip over all stages and model-parallel blocks (the shared embedding and
        parameters replicated over the mp ranks counted once)."""
        import paddle.distributed as dist
        from paddle.distributed import fleet

        hcg = fleet.get_hybrid_communicate_group()
        grads = [p.grad for p in parameters if p.grad is not None]
        counted = [p for p in parameters if p.grad is not None and id(p) not in self._shared_dup]

        def sq(ps):
            out = paddle.zeros([1], dtype="float32")
            for p in ps:
                out = out + paddle.sum(paddle.square(p.grad.astype("float32")))
            return out

        split = sq([p for p in counted if getattr(p, "is_distributed", False)])
        if self.cfg.parallel.mp_degree > 1:
            dist.all_reduce(split, group=hcg.get_model_parallel_group())
        total = split + sq([p for p in counted if not getattr(p, "is_distributed", False)])
        dist.all_reduce(total, group=hcg.get_pipe_parallel_group())
        norm = paddle.sqrt(total)
        if max_norm > 0:
            scale = max_norm / paddle.maximum(norm, paddle.to_tensor(max_norm, dtype="float32"))
            for g in grads:
                g.multiply_(scale.astype(g.dtype))
        return float(norm.numpy().reshape(-1)[0])

    # -------------------------------------------------------------------- checkpoints
    def _merge(self, local: dict) -> dict:
        """Union over the pipeline stages of ``{name: array}`` (all ranks call; all get it)."""
        import paddle.distributed as dist

        parts = []
        dist.all_gather_object(parts, local)
        merged = {}
        for part in parts:
            for k, v in part.items():
                merged.setdefault(k, v)
        return merged

    def _own_names(self, model) -> set:
        own = {id(p) for p in self._layers.parameters()}
        return {n for n, p in model.named_parameters() if id(p) in own}

    def _whole(self, name: str, t: paddle.Tensor, param_shape) -> np.ndarray:
        """``t`` (a parameter or a moment of ``name``) with its model-parallel blocks joined."""
        split = tp_split_of(name) if self.cfg.parallel.mp_degree > 1 else None
        if split is None or tuple(t.shape) != tuple(param_shape):
            return np.ascontiguousarray(t.numpy())
        import paddle.distributed as dist

        parts: list = []
        dist.all_gather(parts, t.detach(), group=mp_group())
        return np.ascontiguousarray(np.concatenate([x.numpy() for x in parts], axis=split[1]))

    def gather_model(self, model) -> dict:
        """Every parameter's whole value by public name, from the stage (and mp rank) that owns it."""
        own = self._own_names(model)
        return self._merge({n: self._whole(n, v, v.shape) for n, v in sorted(model.state_dict().items()) if n in own})

    def gather_optimizer(self, model, optimizer) -> tuple[dict, dict]:
        """Optimizer moments of all stages, whole, keyed like a single-process checkpoint."""
        shapes = {n: p.shape for n, p in model.named_parameters()}
        tensors, extra = optimizer_tensors(model, optimizer, to_numpy=lambda t: t)
        whole = {k: self._whole(k.split("::", 1)[0], t, shapes[k.split("::", 1)[0]])
                 for k, t in sorted(tensors.items())}
        return self._merge(whole), extra

    def load_training_checkpoint(self, path: str, model, optimizer, scheduler) -> dict:
        """Every stage holds the whole model: load it all (this rank's blocks under mp); the
        stage's optimizer keeps the moments of its own parameters."""
        from safetensors.numpy import load_file

        mp = self.cfg.parallel.mp_degree
        if mp == 1:
            return load_training_checkpoint(path, model, optimizer, scheduler)
        verify_checksums(path)
        weights = load_weights(path)
        rank = self.dims.mp_rank
        assign_weights(model, shard_weights(weights, rank, mp), path)
        moments = {}
        for key, arr in load_file(os.path.join(path, OPTIMIZER)).items():
            name = key.split("::", 1)[0]
            same = name in weights and arr.shape == weights[name].shape
            moments[key] = shard_weights({name: arr}, rank, mp)[name] if same else arr
        with open(os.path.join(path, STATE), encoding="utf-8") as f:
            state = json.load(f)
        load_optimizer(model, optimizer, moments, state["scheduler"])
        scheduler.set_state_dict(state["scheduler"])
        set_rng_state(state["rng"])
        return state


class PipelineLoss(nn.Layer):
    """Last stage: logits (B, T, V [/ mp]) and labels (B, T) -> mean CE over counted positions.
    Under mp the logits are this rank's vocabulary slice (``ParallelCrossEntropy`` has no CPU
    kernel): ``loss.vocab_parallel_cross_entropy`` over the mp group."""

    def __init__(self, mp: int = 1):
        super().__init__()
        self.mp = mp

    def forward(self, logits, labels):
        if self.mp == 1:
            return masked_mean_ce(logits, labels, None)
        return vocab_parallel_cross_entropy(logits, labels, group=mp_group())
