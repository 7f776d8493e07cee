"""`gptc finetune`: finetune a GPT for generation on JSONL prompt/response or continuation text.

The ``Finetune`` section says what to read (``gpt_compress/finetune/data.py`` has the row
layouts, the loss mask and the truncation rule) and whether to train LoRA adapters; training
is the one ``fit`` loop (``Engine``: steps, checkpoints, ``--resume auto``, logs). Evaluation:
response-token perplexity of ``Finetune.eval_file`` before training, every ``Engine.eval_freq``
steps (``Engine.eval_iters`` batches) and after; then generation (``Generation`` section) on its
first ``Finetune.eval_generate`` prompts, scored with BLEU/chrF/ROUGE-L/exact match (Chinese
references: also the verse form rate, ``finetune/metrics.py:poem_form``), a few generations written to ``train_log.jsonl``. Writes ``OUTPUT/model`` (a plain checkpoint; with
LoRA the adapters merged in; ``prompt_tokens`` recorded in its config.json), ``OUTPUT/lora_adapter`` (LoRA only) and ``OUTPUT/finetune_eval.json``.
"""
from __future__ import annotations

import itertools
import json
import math
import os
import sys

from ._common import (Output, add_config_arguments, add_overwrite_argument, add_training_arguments, claim_run_dir,
                      print_json, seed_everything, training_config)


def add_arguments(parser) -> None:
    add_config_arguments(parser)
    add_training_arguments(parser)
    parser.add_argument("--model", required=True,
                        help="pretrained gpt-compress checkpoint or Hugging Face GPT-2 directory")
    add_overwrite_argument(parser)  # model/, lora_adapter/ and finetune_eval.json of an earlier run


def load_base(path: str):
    """Our checkpoint (config.json says so) or a Hugging Face GPT-2 directory, as an LM."""
    from ..checkpoint import CONFIG, FORMAT, load_model
    from ..convert.hf_gpt2 import load_hf_gpt2

    try:
        with open(os.path.join(path, CONFIG), encoding="utf-8") as f:
            ours = json.load(f).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        ours = False
    return load_model(path, head="lm") if ours else load_hf_gpt2(path)


def run(args) -> int:
    from ..checkpoint import save_model
    from ..fileio import write_json_atomic
    from ..errors import ConfigError, DataError
    from ..data.tokenizer import encode_prompts
    from ..finetune.data import PlanIterator, encode_rows, hold_out, plan_batches, read_rows
    from ..finetune.lora import apply_lora, merge_lora, save_adapters
    from ..finetune.metrics import finetune_loss, generate_texts, response_perplexity, score_generations
    from ..train.trainer import fit
    from ._common import find_tokenizer

    cfg = training_config(args, "Finetune.train_file", "point it at a JSONL file of prompt/response (src/tgt) or text rows")
    fc, eng = cfg.finetune, cfg.engine
    out = cfg.global_.output_dir
    claim_run_dir(cfg, *(Output("Global.output_dir", os.path.join(out, name), kind, args.overwrite, lock=False)
                         for name, kind in (("model", "dir"), ("lora_adapter", "dir"), ("finetune_eval.json", "file"))))
    seed = cfg.global_.seed
    seed_everything(seed)
    model = load_base(args.model)
    tok = find_tokenizer(cfg.data.tokenizer_dir, args.model)
    if tok is None:
        raise DataError(f"{args.model} has no tokenizer files; set Data.tokenizer_dir")
    if tok.vocab_size > model.config.vocab_size:
        raise ConfigError(f"the tokenizer has {tok.vocab_size} tokens but the model only {model.config.vocab_size}")
    if model.config.eos_token_id != tok.eod_id:
        # Finetuning ends every response with the tokenizer's end-of-document token, so that is
        # where generation must stop (e.g. GPT-2's 50256 on a model with its own small vocabulary).
        print(f"finetune: eos_token_id/pad_token_id {model.config.eos_token_id}/{model.config.pad_token_id} -> "
              f"{tok.eod_id}/{tok.pad_id} (the tokenizer's end of document)", file=sys.stderr)
        model.config.eos_token_id, model.config.pad_token_id = tok.eod_id, tok.pad_id
    cfg.model = model.config
    seq = min(cfg.data.seq_length, model.config.max_position_embeddings)
    cfg.data.seq_length = seq
    micro = eng.micro_batch_size

    rows = read_rows(fc.train_file, fc)
    eval_rows = read_rows(fc.eval_file, fc) if fc.eval_file else []
    if fc.eval_holdout and not fc.eval_file:
        rows, eval_rows = hold_out(rows, fc.eval_holdout, fc.eval_shuffle_seed)
    if fc.max_train_examples:
        rows = rows[: fc.max_train_examples]
    train_ex, stats = encode_rows(tok, rows, seq, fc.prompt_tokens)
    plan = plan_batches(train_ex, fc.batching, micro, seq, tok.pad_id, seed)
    if fc.epochs > 0:
        eng.max_steps = max(1, math.ceil(fc.epochs * plan.units / eng.global_batch_size))
    eval_plan = None
    if eval_rows:
        eval_plan = plan_batches(encode_rows(tok, eval_rows, seq, fc.prompt_tokens)[0], fc.batching, micro, seq,
                                 tok.pad_id, seed, shuffle=False)

    def eval_all():
        return (eval_plan.collate(b) for b in eval_plan.batches)

    summary = {"train_examples": len(train_ex), "train_rows": len(rows), "units": plan.units,
               "batching": fc.batching, "seq_length": seq, "truncation": stats.__dict__}
    print(f"finetune: {len(rows)} rows -> {len(train_ex)} examples, {plan.units} "
          f"{'packed rows' if fc.batching == 'pack' else 'examples'}; truncation {stats.__dict__}", file=sys.stderr)
    if eval_plan is not None:
        summary["eval_before"] = response_perplexity(model, eval_all())
    if fc.lora.enabled:
        apply_lora(model, fc.lora)
        summary["trainable_parameters"] = sum(int(p.size) for p in model.parameters() if not p.stop_gradient)
    result = fit(model, finetune_loss, lambda consumed: PlanIterator(plan, micro, seed, consumed), cfg,
                 eval_batches=(lambda: itertools.islice(eval_all(), eng.eval_iters)) if eval_plan else None,
                 tokenizer=tok, samples_per_micro_batch=micro, tokens_per_sample=seq,
                 show_progress=not args.no_progress)
    summary.update(steps=result.steps, last_loss=result.last_loss, checkpoint=result.checkpoint,
                   tokens_per_s=round(result.tokens_per_s, 1))
    if fc.lora.enabled:
        summary["adapter"] = save_adapters(model, os.path.join(out, "lora_adapter"), base=os.path.abspath(args.model),
                                           overwrite=args.overwrite)
        merge_lora(model)
    # The prompt formatting travels with the model: text prompts get it at generation (finetune/data.py).
    prompt_format = {k: v for k, v in (("prompt_tokens", fc.prompt_tokens), ("prompt_template", fc.prompt_template))
                     if v}
    summary["model"] = save_model(model, os.path.join(out, "model"), tokenizer=tok, extra=prompt_format or None,
                                  overwrite=args.overwrite)
    if eval_plan is not None:
        summary["eval_after"] = response_perplexity(model, eval_all())
        summary["generation"] = _generation_eval(model, tok, cfg, eval_rows, result.steps, out,
                                                 generate_texts, score_generations, encode_prompts)
        write_json_atomic(os.path.join(out, "finetune_eval.json"), summary)
    print_json(summary)
    return 0


def _generation_eval(model, tok, cfg, eval_rows, step, out, generate_texts, score_generations, encode_prompts):
    """Generate for the first ``Finetune.eval_generate`` prompt rows; scores + a few samples
    (also appended to ``train_log.jsonl``)."""
    fc = cfg.finetune
    rows = [r for r in eval_rows if r.prompt is not None][: fc.eval_generate]
    if not rows:
        return None
    prompts = encode_prompts(tok, [r.prompt for r in rows], fc.prompt_tokens)
    hyps = generate_texts(model, tok, prompts, cfg.generation, batch_size=64)
    scores = score_generations(hyps, [r.response for r in rows])
    samples = [{"prompt": r.prompt, "output": h, "reference": r.response}
               for r, h in zip(rows[: fc.log_generations], hyps)]
    with open(os.path.join(out, "train_log.jsonl"), "a", encoding="utf-8") as f:
        f.write(json.dumps({"step": step, "event": "eval_generation", **scores}, ensure_ascii=False) + "\n")
        for s in samples:
            f.write(json.dumps({"step": step, "event": "generation", **s}, ensure_ascii=False) + "\n")
    for s in samples:
        print(f"generation: {s['prompt']!r} -> {s['output']!r} (reference {s['reference']!r})", file=sys.stderr)
    return {**scores, "examples": samples, "hypotheses": hyps}
