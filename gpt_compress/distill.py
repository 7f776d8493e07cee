"""Knowledge distillation as a loss for the one training loop:

    fit(student, DistillLoss(teacher, temperature=2.0, alpha=0.5), train_batches, cfg)

Per position the LM loss counts (``labels != -100`` and ``loss_mask != 0``):

    alpha * T^2 * KL(softmax(z_t / T) || softmax(z_s / T)) + (1 - alpha) * CE(z_s, label)

averaged over those positions, plus ``hidden_mse_weight`` times the mean over matched blocks of
``MSE(h_s, h_t @ P)``. ``T^2`` keeps the soft-target gradient on the scale of the hard-target
one (Hinton et al., 2015). Block ``i`` of the student is matched to teacher block
``round((i + 1) * L_t / L_s) - 1`` unless a map is given (depths may differ). ``P`` is the
identity when the widths agree; for a narrower student it projects onto the top principal
directions of the teacher's states on a few batches. The projection is fixed, not learned: the
trainer optimises and checkpoints the student's parameters only, so a fixed map keeps
checkpoints loadable by ``load_model`` and resume exact.

Memory: as in ``train/loss.py``, both LM heads run in chunks of rows inside one autograd node
that computes its gradients in forward, so neither model's (N, vocab) logits outlive a chunk.
The teacher runs in eval mode, frozen, under ``no_grad``. Block outputs are read with forward
hooks; the model code is untouched.
"""
from __future__ import annotations

import contextlib
import math
from typing import Iterable, Optional, Sequence

import numpy as np
import paddle
import paddle.nn.functional as F
from paddle.autograd import PyLayer
from paddle.nn.functional.loss import base_softmax_with_cross_entropy

from .config import DistillConfig, ModelConfig
from .train.loss import as_tensor, causal_lm_loss, counted_positions, head_weight

DEFAULT_CHUNK = 256  # rows per chunk: about five live (256, vocab) fp32 tensors


@contextlib.contextmanager
def capture_blocks(model, blocks: Sequence[int]):
    """Within the block, ``got[i]`` is the output (B, T, hidden) of ``model.gpt.blocks[i]``."""
    got: dict[int, paddle.Tensor] = {}

    def hook(i):
        def store(layer, inputs, outputs):
            got[i] = outputs[0]
        return store

    handles = [model.gpt.blocks[i].register_forward_post_hook(hook(i)) for i in sorted(set(blocks))]
    try:
        yield got
    finally:
        for h in handles:
            h.remove()


def uniform_layer_map(student_layers: int, teacher_layers: int, blocks: Sequence[int]) -> list[int]:
    """Teacher block for each student block in ``blocks``: the same relative depth."""
    return [int(math.floor((i + 1) * teacher_layers / student_layers + 0.5)) - 1 for i in blocks]


@paddle.no_grad()
def pca_projections(teacher, blocks: Sequence[int], width: int, batches: Iterable[dict]) -> dict[int, paddle.Tensor]:
    """Per teacher block, a (teacher hidden, ``width``) matrix with orthonormal columns: the top
    principal directions of that block's output states over ``batches``."""
    states: dict[int, list[np.ndarray]] = {b: [] for b in blocks}
    for batch in batches:
        with capture_blocks(teacher, blocks) as got:
            teacher.gpt(as_tensor(batch["input_ids"]))
        for b in blocks:
            states[b].append(got[b].reshape([-1, got[b].shape[-1]]).numpy().astype(np.float64))
    out = {}
    for b in blocks:
        x = np.concatenate(states[b]) if states[b] else np.zeros((0, 0))
        if x.shape[0] < width:
            raise ValueError(f"the projection of teacher block {b} needs at least {width} token states, "
                             f"got {x.shape[0]}; give more projection batches")
        _, _, vt = np.linalg.svd(x - x.mean(axis=0), full_matrices=False)  # vt (hidden, hidden)
        out[b] = paddle.to_tensor(np.ascontiguousarray(vt[:width].T), dtype="float32")
    return out


def _softmax_lse(z):
    """(softmax(z), logsumexp(z)) over the last axis; z (n, V) -> (n, V), (n, 1).

    Paddle 3.3.1's CPU ``F.log_softmax`` is quadratic in V (28 ms for (256, 1024), 118 s for
    (256, 50304)); ``F.softmax`` is one fast kernel. At the arg-max, softmax = exp(max - lse),
    so lse = max - log(max softmax), and max softmax >= 1 / V never underflows."""
    q = F.softmax(z, axis=-1)
    return q, z.max(axis=-1, keepdim=True) - paddle.log(q.max(axis=-1, keepdim=True))


def _kd_chunks(hidden, weight, vocab_major, t_hidden, t_weight, t_vocab_major, targets, T: float, alpha: float,
               chunk: int, with_grads: bool):
    """Sum over rows of alpha T^2 KL + (1 - alpha) CE and, with ``with_grads``, its gradients
    w.r.t. ``hidden`` (N, H) and the student head ``weight`` ((V, H) if vocab_major else (H, V))."""
    total = paddle.zeros([], dtype="float32")
    grad_hidden, grad_weight = [], None
    for start in range(0, hidden.shape[0], chunk):
        h, tgt = hidden[start:start + chunk], targets[start:start + chunk]
        z_s = paddle.matmul(h, weight, transpose_y=vocab_major)  # (n, V)
        y_t = paddle.matmul(t_hidden[start:start + chunk], t_weight, transpose_y=t_vocab_major) * (1.0 / T)
        y_s = z_s * (1.0 / T)
        q_t, lse_t = _softmax_lse(y_t)
        q_s, lse_s = _softmax_lse(y_s)
        # KL(q_t || q_s) = sum_v q_t (y_t - y_s) - lse_t + lse_s, since sum_v q_t = 1.
        kl = (q_t * (y_t - y_s)).sum() + (lse_s - lse_t).sum()
        del y_t, y_s, lse_t, lse_s
        ce, p_s = base_softmax_with_cross_entropy(z_s, tgt.unsqueeze(-1), return_softmax=True)  # (n, 1), (n, V)
        del z_s
        total = total + alpha * T * T * kl + (1.0 - alpha) * ce.sum()
        if not with_grads:
            continue
        # d/dz_s: T^2 KL -> T (q_s - q_t); CE -> p_s - onehot(target).
        dz = (q_s - q_t) * (alpha * T) + (p_s - F.one_hot(tgt, p_s.shape[-1])) * (1.0 - alpha)
        del q_s, q_t, p_s
        grad_hidden.append(paddle.matmul(dz, weight, transpose_y=not vocab_major))  # (n, H)
        part = paddle.matmul(dz, h, transpose_x=True) if vocab_major else paddle.matmul(h, dz, transpose_x=True)
        if grad_weight is None:
            grad_weight = part
        else:
            grad_weight.add_(part)
        del dz, part
    if not with_grads:
        return total, None, None
    return total, paddle.concat(grad_hidden, axis=0) if len(grad_hidden) > 1 else grad_hidden[0], grad_weight


class _FusedDistillHead(PyLayer):
    """Mean distillation loss of the LM heads as one autograd node (gradients computed in forward)."""

    @staticmethod
    def forward(ctx, hidden, weight, t_hidden, t_weight, targets, vocab_major, t_vocab_major, T, alpha, chunk):
        loss, grad_hidden, grad_weight = _kd_chunks(hidden, weight, vocab_major, t_hidden, t_weight, t_vocab_major,
                                                    targets, T, alpha, chunk, True)
        ctx.rows = hidden.shape[0]
        ctx.save_for_backward(grad_hidden, grad_weight)
        return loss / ctx.rows

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight = ctx.saved_tensor()
        scale = grad_loss / ctx.rows
        return grad_hidden * scale, grad_weight * scale


def kd_logits_reference(z_s, z_t, labels, loss_mask, T: float, alpha: float):
    """The plain (full-logits, autograd) loss the fused head must equal; z_s, z_t (B, T, V)."""
    v = z_s.shape[-1]
    y_s, y_t = z_s.reshape([-1, v]) / T, z_t.reshape([-1, v]) / T
    log_qt = y_t - paddle.logsumexp(y_t, axis=-1, keepdim=True)  # not F.log_softmax: see _softmax_lse
    kl = (paddle.exp(log_qt) * (log_qt - y_s + paddle.logsumexp(y_s, axis=-1, keepdim=True))).sum(axis=-1)
    ce = F.cross_entropy(z_s.reshape([-1, v]), labels.reshape([-1]).clip(min=0), reduction="none").reshape([-1])
    valid = counted_positions(labels, loss_mask).astype(kl.dtype)
    return ((alpha * T * T * kl + (1.0 - alpha) * ce) * valid).sum() / paddle.clip(valid.sum(), min=1.0)


def kd_logits_loss(student, hidden, teacher, t_hidden, labels, loss_mask=None, T: float = 2.0, alpha: float = 0.5,
                   chunk: int = DEFAULT_CHUNK):
    """The logit part of the distillation loss from final hidden states (B, T, H_s) / (B, T, H_t)."""
    if not paddle.in_dynamic_mode() or hidden.dtype != paddle.float32:
        # PyLayer is eager-only and the fused path is fp32-only: plain math.
        return kd_logits_reference(student.logits(hidden), teacher.logits(t_hidden), labels, loss_mask, T, alpha)
    hidden = hidden.reshape([-1, hidden.shape[-1]])  # (N, H_s)
    t_hidden = t_hidden.reshape([-1, t_hidden.shape[-1]])  # (N, H_t)
    counted = counted_positions(labels, loss_mask)
    keep = paddle.nonzero(counted).reshape([-1])  # (K,)
    if keep.shape[0] == 0:
        return hidden.sum() * 0.0
    if keep.shape[0] < counted.shape[0]:
        hidden, t_hidden = paddle.gather(hidden, keep), paddle.gather(t_hidden, keep)
    targets = paddle.gather(labels.reshape([-1]), keep)
    weight, vocab_major = head_weight(student)
    t_weight, t_vocab_major = head_weight(teacher)
    t_weight = t_weight.detach()
    if not paddle.is_grad_enabled() or (hidden.stop_gradient and weight.stop_gradient):
        loss = _kd_chunks(hidden, weight, vocab_major, t_hidden, t_weight, t_vocab_major, targets, T, alpha, chunk,
                          with_grads=False)[0]
        return loss / keep.shape[0]
    return _FusedDistillHead.apply(hidden, weight, t_hidden, t_weight, targets, vocab_major, t_vocab_major,
                                   float(T), float(alpha), chunk)


class DistillLoss:
    """``loss_fn(student, batch)`` for ``train.trainer.fit``: distillation from ``teacher``.

    In training mode it returns the distillation objective; in eval mode (the trainer's periodic
    validation) the student's own LM loss, so logged ``eval_loss``/``eval_ppl`` stay perplexities
    comparable with the teacher's. ``objective`` always computes the distillation loss.
    """

    def __init__(self, teacher, temperature: float = 2.0, alpha: float = 0.5, hidden_mse_weight: float = 0.0,
                 hidden_layers: Sequence[int] = (), layer_map: Sequence[int] = (),
                 student_config: Optional[ModelConfig] = None, projection_batches: Optional[Iterable[dict]] = None,
                 chunk: int = DEFAULT_CHUNK):
        if temperature <= 0 or not 0.0 <= alpha <= 1.0 or hidden_mse_weight < 0:
            raise ValueError(f"need temperature > 0, 0 <= alpha <= 1, hidden_mse_weight >= 0; got "
                             f"{temperature}, {alpha}, {hidden_mse_weight}")
        teacher.eval()
        for p in teacher.parameters():
            p.stop_gradient = True
        self.teacher = teacher
        self.temperature, self.alpha, self.hidden_mse_weight = float(temperature), float(alpha), float(hidden_mse_weight)
        self.hidden_layers, self.layer_map = list(hidden_layers), list(layer_map)
        self.chunk = chunk
        self.pairs: Optional[list[tuple[int, int]]] = None  # (student block, teacher block), set by _resolve
        self.projections: dict[int, paddle.Tensor] = {}  # teacher block -> (H_t, H_s) when widths differ
        if student_config is not None:
            self._resolve(student_config, projection_batches)

    @classmethod
    def from_config(cls, teacher, cfg: DistillConfig, student_config: Optional[ModelConfig] = None,
                    projection_batches: Optional[Iterable[dict]] = None) -> "DistillLoss":
        """From the ``Distill`` config section."""
        return cls(teacher, cfg.temperature, cfg.alpha, cfg.hidden_mse_weight, cfg.hidden_layers, cfg.layer_map,
                   student_config, projection_batches)

    def _resolve(self, scfg: ModelConfig, projection_batches: Optional[Iterable[dict]]) -> None:
        tcfg = self.teacher.config
        if scfg.vocab_size != tcfg.vocab_size:
            raise ValueError(f"student vocab_size {scfg.vocab_size} differs from the teacher's {tcfg.vocab_size}; "
                             "distillation compares their next-token distributions, so they must share a vocabulary")
        if self.hidden_mse_weight == 0:
            self.pairs = []
            return
        blocks = self.hidden_layers or list(range(scfg.num_layers))
        if self.layer_map and len(self.layer_map) != len(blocks):
            raise ValueError(f"layer_map has {len(self.layer_map)} entries for {len(blocks)} student blocks")
        mapped = self.layer_map or uniform_layer_map(scfg.num_layers, tcfg.num_layers, blocks)
        for s, t in zip(blocks, mapped):
            if not (0 <= s < scfg.num_layers and 0 <= t < tcfg.num_layers):
                raise ValueError(f"block pair (student {s}, teacher {t}) is out of range: the student has "
                                 f"{scfg.num_layers} blocks, the teacher {tcfg.num_layers}")
        self.pairs = list(zip(blocks, mapped))
        if scfg.hidden_size > tcfg.hidden_size:
            raise ValueError(f"hidden-state MSE needs a student no wider than its teacher ({scfg.hidden_size} > "
                             f"{tcfg.hidden_size}); set the hidden-state weight to 0")
        if scfg.hidden_size < tcfg.hidden_size:
            if projection_batches is None:
                raise ValueError(f"student width {scfg.hidden_size} differs from the teacher's {tcfg.hidden_size}: "
                                 "pass student_config and projection_batches to fit the projection")
            self.projections = pca_projections(self.teacher, sorted(set(mapped)), scfg.hidden_size,
                                               projection_batches)

    def __call__(self, student, batch: dict) -> paddle.Tensor:
        if not student.training:
            return causal_lm_loss(student, batch)
        return self.objective(student, batch)

    def objective(self, student, batch: dict) -> paddle.Tensor:
        """The distillation loss of ``student`` on a trainer batch (``input_ids``, ``labels``, [``loss_mask``])."""
        if self.pairs is None:
            self._resolve(student.config, None)
        ids = as_tensor(batch["input_ids"])
        labels = as_tensor(batch["labels"]).astype("int64")
        mask = batch.get("loss_mask")
        mask = None if mask is None else as_tensor(mask)
        with capture_blocks(student, [s for s, _ in self.pairs]) as s_states:
            hidden = student.gpt(ids)  # (B, T, H_s)
        with paddle.no_grad(), capture_blocks(self.teacher, [t for _, t in self.pairs]) as t_states:
            t_hidden = self.teacher.gpt(ids)  # (B, T, H_t)
        loss = kd_logits_loss(student, hidden, self.teacher, t_hidden, labels, mask, self.temperature, self.alpha,
                              self.chunk)
        if self.pairs:
            valid = counted_positions(labels, mask).astype("float32").reshape([-1, 1])  # (N, 1)
            count = paddle.clip(valid.sum(), min=1.0)
            mse = 0.0
            for s, t in self.pairs:
                h_s = s_states[s].reshape([-1, s_states[s].shape[-1]])  # (N, H_s)
                h_t = t_states[t].reshape([-1, t_states[t].shape[-1]])  # (N, H_t)
                if t in self.projections:
                    h_t = paddle.matmul(h_t, self.projections[t])  # (N, H_s)
                mse = mse + (paddle.square(h_s - h_t) * valid).sum() / (count * h_s.shape[-1])
            loss = loss + self.hidden_mse_weight * mse / len(self.pairs)
        return loss
