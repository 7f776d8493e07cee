"""`gptc distill`: train a student (e.g. a `gptc prune` output) on a teacher's soft targets with the
normal trainer (checkpoints, resume, logs); reports validation loss/perplexity of the teacher and
of the student before and after."""
from __future__ import annotations

import dataclasses
import itertools
import math
import os
import time

from ._common import (add_config_arguments, add_training_arguments, claim_run_dir, config_from_args, fail,
                      find_tokenizer, lm_batches, print_json, seed_everything)


def add_arguments(parser) -> None:
    add_config_arguments(parser)
    add_training_arguments(parser)
    parser.add_argument("--draft-for", default=None, metavar="EXPORT",
                        help="export the distilled student (Global.output_dir/draft_export) and record it in "
                             "EXPORT's manifest as its speculative draft, with the acceptance rate measured on "
                             "validation windows (gptc infer --draft auto)")
    parser.add_argument("--draft-vocab", type=int, default=0, metavar="N",
                        help="with --draft-for: the draft export proposes from the N tokens most frequent in "
                             "Data.data_prefix (gptc export --draft-vocab)")


def _ppl(loss: float) -> float:
    return round(math.exp(min(loss, 50.0)), 4)


def run(args) -> int:
    from ..checkpoint import build_model, load_model
    from ..config import ConfigError
    from ..distill import DistillLoss
    from ..train.loss import causal_lm_loss
    from ..train.trainer import TrainingDiverged, evaluate, fit

    cfg = config_from_args(args)
    dc, eng = cfg.distill, cfg.engine
    if not dc.teacher:
        raise ConfigError("Distill.teacher is empty: pass the teacher checkpoint, -o Distill.teacher=DIR")
    if args.draft_vocab < 0 or (args.draft_vocab and not args.draft_for):
        raise ConfigError("--draft-vocab needs --draft-for (it shapes the draft export) and a size >= 1")
    if args.draft_for:
        from ..inference.manifest import read_manifest

        read_manifest(args.draft_for)  # a wrong directory fails before the training
    claim_run_dir(cfg)
    seed_everything(cfg.global_.seed)
    teacher = load_model(dc.teacher)
    student = load_model(dc.student) if dc.student else build_model(cfg.model, "lm")
    cfg.model = student.config
    tokenizer = find_tokenizer(cfg.data.tokenizer_dir, dc.student, dc.teacher)
    teacher_data = _teacher_data(cfg, teacher.config.vocab_size) if dc.generated_windows else None
    models = [student.config, teacher.config]
    train_batches = lm_batches(_training_data(cfg, teacher_data), eng.max_steps * eng.global_batch_size, models)[0]
    eval_batches = lm_batches(cfg, 0, models)[1]  # validation on Data.data_prefix alone
    needs_projection = dc.hidden_mse_weight > 0 and student.config.hidden_size != teacher.config.hidden_size
    try:
        loss_fn = DistillLoss.from_config(
            teacher, dc, student.config,
            itertools.islice(train_batches(0), dc.projection_batches) if needs_projection else None)
    except ValueError as e:
        raise ConfigError(f"Distill: {e}") from None
    summary = {"teacher": dc.teacher, "student": dc.student or f"fresh {cfg.model.name}",
               "params_teacher": teacher.config.num_parameters(), "params_student": student.config.num_parameters()}
    if teacher_data is not None:
        summary["teacher_data"] = teacher_data
    if eval_batches:
        t_loss, s_loss = evaluate(teacher, causal_lm_loss, eval_batches()), evaluate(student, causal_lm_loss,
                                                                                    eval_batches())
        summary.update(teacher_valid_loss=round(t_loss, 5), teacher_valid_ppl=_ppl(t_loss),
                       student_valid_loss_before=round(s_loss, 5), student_valid_ppl_before=_ppl(s_loss))
    try:
        result = fit(student, loss_fn, train_batches, cfg, eval_batches=eval_batches, tokenizer=tokenizer,
                     show_progress=not args.no_progress)
    except TrainingDiverged as e:
        return fail(str(e))
    summary.update(steps=result.steps, last_loss=result.last_loss, tokens_per_s=round(result.tokens_per_s, 1),
                   checkpoint=result.checkpoint)
    if eval_batches:
        after = evaluate(student, causal_lm_loss, eval_batches())
        gap = summary["student_valid_ppl_before"] - summary["teacher_valid_ppl"]
        summary.update(student_valid_loss_after=round(after, 5), student_valid_ppl_after=_ppl(after),
                       ppl_gap_recovered=round((summary["student_valid_ppl_before"] - _ppl(after)) / gap, 4)
                       if gap > 0 else None)
    if args.draft_for:
        summary["draft"] = _record_draft(args.draft_for, result.checkpoint, cfg, eval_batches or train_batches,
                                         args.draft_vocab)
    print_json(summary)
    return 0


def _teacher_data(cfg, vocab_size: int) -> dict:
    """The teacher's continuations of training windows (``distill_data.teacher_continuations``)
    in Global.output_dir/teacher_data, generated by ``Distill.teacher_export`` (or, slower, the
    teacher checkpoint on the dygraph backend); reused when already written with these settings."""
    from ..config import ConfigError
    from ..distill_data import teacher_continuations
    from ..inference.runner import Generator

    dc, seq = cfg.distill, cfg.data.seq_length
    prompt = dc.generated_prompt_tokens or seq // 2
    new = dc.generated_new_tokens or seq - prompt
    if prompt + new > seq or new < 1:
        raise ConfigError(f"Distill.generated_prompt_tokens {prompt} + generated_new_tokens {new} must be at most "
                          f"Data.seq_length {seq}, with at least one new token")
    if len(cfg.data.data_prefix) != 1:
        raise ConfigError("Distill.generated_windows takes its prompts from one dataset: give Data.data_prefix "
                          "as a single prefix")
    source = dc.teacher_export or dc.teacher
    gen = Generator.from_dir(source, backend="paddle" if dc.teacher_export else "dygraph")
    if gen.vocab_size != vocab_size:
        raise ConfigError(f"Distill.teacher_export {source} has a vocabulary of {gen.vocab_size}, the teacher "
                          f"{vocab_size}: export the teacher checkpoint itself")
    t0 = time.perf_counter()
    out = teacher_continuations(gen, cfg.data.data_prefix[0], cfg.data.split,
                                os.path.join(cfg.global_.output_dir, "teacher_data", "teacher"), dc.generated_windows,
                                prompt, new, cfg.global_.seed)
    return {**out, "generator": source, "seconds": round(time.perf_counter() - t0, 1)}


def _training_data(cfg, teacher_data):
    """``cfg`` as the training samples read it: Data.data_prefix, or with ``teacher_data`` a blend
    of its windows (Distill.generated_weight of the samples) and Data.data_prefix; no validation."""
    data = cfg.data
    if teacher_data is not None:
        weight = cfg.distill.generated_weight
        blend = [str(weight), teacher_data["data_prefix"]]
        if weight < 1.0:
            blend += [str(1.0 - weight), *data.data_prefix]
        data = dataclasses.replace(data, data_prefix=blend)
    return dataclasses.replace(cfg, data=data, engine=dataclasses.replace(cfg.engine, eval_iters=0))


def _record_draft(base: str, checkpoint: str, cfg, batches, draft_vocab: int = 0) -> dict:
    """Export ``checkpoint`` beside the run (with a draft vocabulary of ``draft_vocab`` tokens of
    ``Data.data_prefix``, if given) and record it as ``base``'s draft (``measure_draft`` over 8
    windows of the first 32 tokens of ``batches``' sequences)."""
    from ..export import export
    from ..inference.manifest import record_draft
    from ..inference.runner import measure_draft

    out = export(checkpoint, os.path.join(cfg.global_.output_dir, "draft_export"), formats=("paddle",),
                 overwrite=True, draft_vocab=draft_vocab, draft_vocab_data=cfg.data.data_prefix)
    rows = [list(map(int, r[:32])) for batch in itertools.islice(batches(), 8) for r in batch["input_ids"]][:8]
    return {"export": out, **record_draft(base, out, measure_draft(base, out, rows))}
