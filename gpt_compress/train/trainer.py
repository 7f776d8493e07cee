"""The one training loop: ``fit(model, loss_fn, batches, cfg)``.

Variants (pretraining, GLUE finetuning, QAT, distillation) differ only by ``loss_fn`` or by a
model transform applied before ``fit``. The loop does gradient accumulation, global-norm
clipping, the LR schedule, periodic evaluation, logging (console progress bar, JSONL file,
VisualDL when installed), atomic checkpoints and exact resume.
"""
from __future__ import annotations

from ..errors import DataError, Interrupted, TrainingDiverged  # noqa: F401  (TrainingDiverged re-exported)

import contextlib
import json
import math
import os
import signal
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Optional

import numpy as np
import paddle
from tqdm import tqdm

from .. import signals
from ..config import Config, ConfigError, ModelConfig
from ..fileio import atomic_file
from .checkpoint import find_resume_checkpoint, load_training_checkpoint, save_training_checkpoint
from .optim import build_optimizer, build_scheduler, clip_grad_norm_

Batch = dict  # name -> numpy array, e.g. {"input_ids": (B, T), "labels": (B, T)}
LossFn = Callable[[paddle.nn.Layer, Batch], paddle.Tensor]




def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6 * matmul parameters (incl. LM head) + attention scores
    (12 * layers * heads * head_dim * seq_len for forward + backward), as in PaLM's MFU."""
    n = cfg.num_parameters(include_embeddings=False) + cfg.vocab_size * cfg.hidden_size
    attn = sum(12 * cfg.heads(i) * cfg.dim_head * seq_len for i in range(cfg.num_layers))
    return 6.0 * n + attn


@dataclass
class FitResult:
    """What a finished ``fit`` reports."""

    steps: int
    consumed_samples: int
    last_loss: float
    last_eval_loss: Optional[float]
    tokens_per_s: float
    checkpoint: Optional[str]


class _Logger:
    """JSONL log (always), console progress bar, VisualDL (when installed)."""

    def __init__(self, output_dir: str, resume_step: int, total: int, show: bool, enabled: bool = True):
        self.file, self.vdl = None, None
        self.bar = tqdm(total=total, initial=resume_step, desc="train", disable=not (show and enabled),
                        dynamic_ncols=True)
        if not enabled:  # a non-zero rank of a parallel run: rank 0 logs
            return
        os.makedirs(output_dir, exist_ok=True)
        self.path = os.path.join(output_dir, "train_log.jsonl")
        if os.path.exists(self.path):
            # Drop records of steps that the resumed run will redo (written after the checkpoint).
            with open(self.path, encoding="utf-8") as f:
                keep = [ln for ln in f if ln.strip() and json.loads(ln).get("step", 0) <= resume_step]
            with atomic_file(self.path) as f:
                f.writelines(keep)
        self.file = open(self.path, "a", encoding="utf-8")
        try:
            from visualdl import LogWriter

            self.vdl = LogWriter(logdir=os.path.join(output_dir, "visualdl"))
        except ImportError:
            pass

    def log(self, record: dict, echo: bool = False) -> None:
        if self.file is None:
            return
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.vdl is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)) and v is not None:
                    self.vdl.add_scalar(f"train/{k}", v, record["step"])
        if echo:
            msg = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in record.items())
            self.bar.write(msg)

    def close(self) -> None:
        self.bar.close()
        if self.file is not None:
            self.file.close()
        if self.vdl is not None:
            self.vdl.close()


def _amp_settings(mix_precision: str):
    """(autocast dtype or None, GradScaler or None). Paddle's AMP only acts on GPU/XPU; on CPU
    it silently does nothing, so say so and train in fp32 instead of pretending."""
    if mix_precision == "fp32":
        return None, None
    if mix_precision not in ("bf16", "fp16"):
        raise ConfigError(f"Engine.mix_precision must be fp32, bf16 or fp16, got {mix_precision!r}")
    if paddle.device.get_device().startswith("cpu"):
        warnings.warn(f"Engine.mix_precision={mix_precision} needs a GPU (Paddle AMP is a no-op on CPU); "
                      "training in fp32")
        return None, None
    if mix_precision == "fp16":  # GPU only: not exercised on the CPU test machines
        return "float16", paddle.amp.GradScaler(init_loss_scaling=2.0 ** 15)
    return "bfloat16", None


@paddle.no_grad()
def evaluate(model, loss_fn: LossFn, batches: Iterable[Batch]) -> float:
    """Mean loss over ``batches`` in eval mode."""
    was_training = model.training
    model.eval()
    losses = [float(loss_fn(model, b)) for b in batches]
    if was_training:
        model.train()
    return float(np.mean(losses)) if losses else float("nan")


def compile_body(model, parallel=None) -> None:
    """``Engine.to_static``: run the transformer body (``model.gpt``) as a static program
    (``paddle.jit.to_static``, in place: same parameters, names and checkpoints). The loss head
    stays eager: the fused chunked LM loss is a PyLayer, which static graphs do not take."""
    if parallel is not None:
        raise ConfigError("Engine.to_static is for single-process training; Paddle's static "
                          "distributed path (dist.to_static) does not run on CPU/gloo")
    if model.config.recompute != "none":
        raise ConfigError("Engine.to_static and Model.recompute cannot be combined: recompute is a "
                          "PyLayer, which static graphs do not take")
    if not isinstance(getattr(model, "gpt", None), paddle.nn.Layer):
        raise ConfigError("Engine.to_static needs a model with a `gpt` body")
    paddle.jit.to_static(model.gpt, full_graph=True)


class _Stopped(Exception):
    """The loop stopped at a step boundary on a deferred signal (``signals.deferred``)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _next_batch(batches, step: int, consumed: int):
    try:
        return next(batches)
    except StopIteration:
        raise DataError(f"the training data ran out at step {step + 1} after {consumed} samples; a resumed run "
                        "must keep Engine.global_batch_size and Engine.max_steps of the run it continues") from None


def fit(model, loss_fn: LossFn, train_batches: Callable[[int], Iterator[Batch]], cfg: Config,
        eval_batches: Optional[Callable[[], Iterable[Batch]]] = None, tokenizer=None,
        samples_per_micro_batch: Optional[int] = None, tokens_per_sample: Optional[int] = None,
        show_progress: bool = True, parallel=None) -> FitResult:
    """Train ``model`` for ``cfg.engine.max_steps`` optimizer steps.

    ``train_batches(consumed_samples)`` yields micro-batches starting at that sample position
    (so resume restores one integer); ``eval_batches()`` yields the validation batches.
    ``parallel`` (``gpt_compress.parallel.build_parallel``) is set when ``model`` is spread over
    several processes: it wraps the optimizer, may run the micro-batches itself (pipeline),
    clips across ranks and gathers checkpoints; only its rank 0 logs and writes.
    """
    eng = cfg.engine
    micro = samples_per_micro_batch or eng.micro_batch_size
    if eng.global_batch_size % micro:
        raise ConfigError(f"Engine.global_batch_size {eng.global_batch_size} is not a multiple of "
                          f"Engine.micro_batch_size {micro}")
    accumulate = eng.global_batch_size // micro
    amp_dtype, scaler = _amp_settings(eng.mix_precision)
    seq = tokens_per_sample or cfg.data.seq_length
    out = cfg.global_.output_dir
    scheduler = build_scheduler(cfg.optimizer, eng.max_steps)
    optimizer = build_optimizer(model, cfg.optimizer, scheduler)
    if parallel is not None:
        optimizer = parallel.prepare_optimizer(optimizer)
    main = parallel is None or parallel.dims.is_main
    clip = getattr(parallel, "clip_grad_norm_", clip_grad_norm_)
    params = [p for p in model.parameters() if not p.stop_gradient]

    step, consumed = 0, 0
    resume = None
    if eng.resume == "auto":
        resume = find_resume_checkpoint(out)
    elif eng.resume:
        resume = eng.resume
    if resume:
        state = load_training_checkpoint(resume, model, optimizer, scheduler, parallel=parallel)
        step, consumed = state["step"], state["consumed_samples"]
    run_config = cfg.to_dict()
    logger = _Logger(out, step, eng.max_steps, show_progress, enabled=main)
    if resume:
        logger.log({"step": step, "event": "resumed", "checkpoint": resume}, echo=True)

    fpt = flops_per_token(model.config, seq)
    batches = train_batches(consumed)
    if eng.to_static:
        compile_body(model, parallel)
    model.train()
    ema, last_loss, last_eval, ckpt, tps_hist = None, float("nan"), None, resume, []
    tokens_per_step = eng.global_batch_size * seq
    signals.reassert()  # after `import paddle`, which installs its own SIGTERM handler
    # Alone, a first Ctrl-C or SIGTERM stops the loop after the step in progress, which is then
    # saved (a signal mid-step would leave the weights half-updated); a second stops at once.
    # Ranks of a parallel job keep the immediate stop: they would have to agree on the step.
    stop = signals.deferred() if parallel is None else contextlib.nullcontext(signals.Deferral())
    try:
        with stop as pending:
            while step < eng.max_steps:
                t0 = time.perf_counter()
                lr = scheduler.get_lr()
                total = 0.0
                if hasattr(parallel, "forward_backward"):  # pipeline: its schedule runs the micro-batches
                    total = parallel.forward_backward(batches, accumulate)
                for _ in range(0 if hasattr(parallel, "forward_backward") else accumulate):
                    with paddle.amp.auto_cast(enable=amp_dtype is not None, dtype=amp_dtype or "float16", level="O1"):
                        loss = loss_fn(model, _next_batch(batches, step, consumed)) / accumulate
                    (scaler.scale(loss) if scaler else loss).backward()
                    total += float(loss)
                if scaler:
                    scaler.unscale_(optimizer)
                grad_norm = clip(params, cfg.optimizer.grad_clip)
                if not math.isfinite(total) or not math.isfinite(grad_norm):
                    raise TrainingDiverged(f"loss is {total} (grad norm {grad_norm}) at step {step + 1}; stopped "
                                           f"before updating the weights. Last good checkpoint: {ckpt or 'none'}")
                if eng.max_loss_spike > 0 and ema is not None and step > 10 and total > eng.max_loss_spike * ema:
                    raise TrainingDiverged(f"loss spiked to {total:.4f} (> {eng.max_loss_spike} x running mean "
                                           f"{ema:.4f}) at step {step + 1}. Last good checkpoint: {ckpt or 'none'}")
                if scaler:
                    scaler.step(optimizer)
                    scaler.update()
                else:
                    optimizer.step()
                optimizer.clear_grad(set_to_zero=False)
                scheduler.step()
                step += 1
                consumed += eng.global_batch_size
                ema = total if ema is None else 0.9 * ema + 0.1 * total
                last_loss = total
                dt = time.perf_counter() - t0
                tps = tokens_per_step / dt
                tps_hist.append(tps)
                record = {"step": step, "loss": round(total, 6), "lr": lr, "grad_norm": round(grad_norm, 6),
                          "tokens_per_s": round(tps, 1), "step_time_s": round(dt, 4), "consumed_samples": consumed,
                          "mfu": round(fpt * tps / (eng.peak_tflops * 1e12), 5) if eng.peak_tflops > 0 else None}
                logger.bar.update(1)
                logger.bar.set_postfix(loss=f"{total:.4f}", lr=f"{lr:.2e}", tok_s=f"{tps:.0f}")
                logger.log(record, echo=eng.logging_freq > 0 and step % eng.logging_freq == 0)
                if eval_batches is not None and eng.eval_freq > 0 and (step % eng.eval_freq == 0
                                                                       or step == eng.max_steps):
                    last_eval = evaluate(model, loss_fn, eval_batches())
                    logger.log({"step": step, "eval_loss": round(last_eval, 6),
                                "eval_ppl": round(math.exp(min(last_eval, 50.0)), 4)}, echo=True)
                if (eng.save_steps > 0 and step % eng.save_steps == 0) or step == eng.max_steps or pending.signum:
                    ckpt = save_training_checkpoint(out, step, model, optimizer, scheduler, consumed, run_config,
                                                    tokenizer, keep=eng.keep_checkpoint_max, parallel=parallel)
                if pending.signum:
                    raise _Stopped(pending.signum)
    except (KeyboardInterrupt, _Stopped) as e:
        signum = e.signum if isinstance(e, _Stopped) else signals.interrupt_signum(e)
        saved = (f"the last checkpoint is {ckpt}; continue with --resume auto (-o Engine.resume=auto; "
                 "same config and output_dir)"
                 if ckpt else "no checkpoint was saved yet (Engine.save_steps sets how often)")
        how = "SIGTERM" if signum == signal.SIGTERM else "Ctrl-C"
        raise Interrupted(f"interrupted ({how}) at step {step} of {eng.max_steps}: {saved}", signum) from None
    finally:
        logger.close()
    skip = min(len(tps_hist) - 1, 2)  # the first steps include warm-up work
    return FitResult(steps=step, consumed_samples=consumed, last_loss=last_loss, last_eval_loss=last_eval,
                     tokens_per_s=float(np.median(tps_hist[skip:])) if tps_hist else 0.0, checkpoint=ckpt)
