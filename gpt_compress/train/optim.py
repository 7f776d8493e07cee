"""AdamW with decoupled weight decay (none on norms/biases), LR schedules, global-norm clipping."""
from __future__ import annotations

import math

import paddle

from ..config import ConfigError, OptimizerConfig


class WarmupDecayLR(paddle.optimizer.lr.LRScheduler):
    """Linear warmup to ``max_lr`` then cosine/linear decay to ``min_lr`` at ``decay_steps``;
    ``min_lr`` after that (FleetX ``CosineAnnealingWithWarmupDecay`` semantics)."""

    def __init__(self, max_lr: float, min_lr: float, warmup_steps: int, decay_steps: int,
                 decay_style: str = "cosine", last_epoch: int = -1):
        if decay_style not in ("cosine", "linear", "constant"):
            raise ConfigError(f"Optimizer.lr.decay_style must be cosine, linear or constant, got {decay_style!r}")
        self.max_lr, self.min_lr = float(max_lr), float(min_lr)
        self.warmup_steps, self.decay_steps, self.decay_style = int(warmup_steps), int(decay_steps), decay_style
        super().__init__(learning_rate=max_lr, last_epoch=last_epoch)

    def get_lr(self) -> float:
        step = self.last_epoch
        if self.warmup_steps > 0 and step <= self.warmup_steps:
            return self.max_lr * step / self.warmup_steps
        if self.decay_style == "constant":
            return self.max_lr
        if step > self.decay_steps:
            return self.min_lr
        ratio = (step - self.warmup_steps) / max(1, self.decay_steps - self.warmup_steps)
        if self.decay_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        else:
            coeff = 1.0 - ratio
        return self.min_lr + coeff * (self.max_lr - self.min_lr)


def no_decay(name: str) -> bool:
    """Biases and LayerNorm parameters are not weight-decayed (Megatron/FleetX)."""
    return name.endswith(".bias") or ".ln_" in name or name.startswith("ln_") or ".ln_f." in name


def build_scheduler(cfg: OptimizerConfig, max_steps: int) -> WarmupDecayLR:
    """The LR schedule for ``max_steps`` optimizer steps."""
    decay_steps = cfg.lr.decay_steps or max_steps
    return WarmupDecayLR(cfg.lr.max_lr, cfg.lr.min_lr, int(cfg.lr.warmup_rate * decay_steps), decay_steps,
                         cfg.lr.decay_style)


def build_optimizer(model, cfg: OptimizerConfig, scheduler) -> paddle.optimizer.Optimizer:
    """AdamW over ``model``'s trainable parameters; clipping is done by ``clip_grad_norm_``."""
    if cfg.name.lower() != "adamw":
        raise ConfigError(f"Optimizer.name {cfg.name!r} is not supported (AdamW)")
    params = [p for p in model.parameters() if not p.stop_gradient]
    decayed = {p.name for n, p in model.named_parameters() if not p.stop_gradient and not no_decay(n)}
    return paddle.optimizer.AdamW(
        learning_rate=scheduler, beta1=cfg.beta1, beta2=cfg.beta2, epsilon=cfg.epsilon, parameters=params,
        weight_decay=cfg.weight_decay, apply_decay_param_fun=lambda internal: internal in decayed)


@paddle.no_grad()
def clip_grad_norm_(parameters, max_norm: float) -> float:
    """Scale gradients in place so their global L2 norm is at most ``max_norm`` (0: no clip);
    returns the norm before clipping. Same scale as ``paddle.nn.ClipGradByGlobalNorm``."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return 0.0
    sq = paddle.add_n([paddle.sum(paddle.square(g.astype("float32"))) for g in grads])
    norm = paddle.sqrt(sq)
    if max_norm > 0:
        scale = max_norm / paddle.maximum(norm, paddle.to_tensor(max_norm, dtype="float32"))
        for g in grads:
            g.multiply_(scale.astype(g.dtype))
    return float(norm)
