"""`gptc finetune-glue`: finetune a pretrained GPT's classification head on a GLUE task."""
from __future__ import annotations

import os

import numpy as np

from ..fileio import write_json_atomic
from ._common import Output, add_config_arguments, claim_run_dir, config_from_args, fail, find_tokenizer, print_json, seed_everything


def add_arguments(parser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--task", required=True, help="CoLA, SST-2, MRPC, STS-B, QQP, MNLI, QNLI, RTE or WNLI")
    parser.add_argument("--data-dir", required=True, help="directory with the task's train.tsv / dev.tsv")
    parser.add_argument("--model", required=True, help="pretrained checkpoint directory")
    parser.add_argument("--max-len", type=int, default=128, help="tokens per example (pair truncated)")
    parser.add_argument("--epochs", type=float, default=0.0,
                        help="train this many epochs (overrides Engine.max_steps when > 0)")
    parser.add_argument("--max-train-examples", type=int, default=0, help="use only the first N training rows")
    parser.add_argument("--skip-bad-lines", action="store_true", help="skip malformed TSV rows instead of failing")
    parser.add_argument("--no-progress", action="store_true")


def run(args) -> int:
    from ..checkpoint import load_model
    from ..data.glue import EpochBatches, collate, encode_example, read_task, task_spec
    from ..eval.glue import GlueResult, classification_loss, compute_metrics, predict
    from ..train.trainer import fit

    cfg = config_from_args(args)
    spec = task_spec(args.task)
    regression = spec.labels is None
    claim_run_dir(cfg, Output("Global.output_dir", os.path.join(cfg.global_.output_dir, f"glue_{spec.name}.json"),
                              "file", overwrite=True, lock=False))
    seed_everything(cfg.global_.seed)
    if not os.path.isdir(args.model):
        from ..checkpoint import CheckpointError

        raise CheckpointError(f"--model {args.model}: checkpoint directory not found")
    tok = find_tokenizer(cfg.data.tokenizer_dir, args.model)
    if tok is None:
        return fail(f"{args.model} has no tokenizer; set Data.tokenizer_dir")
    model = load_model(args.model, head="cls")
    if model.config.num_labels != (1 if regression else len(spec.labels)):
        # Rebuild the head for this task's label count, keeping the pretrained trunk.
        from dataclasses import replace

        from ..checkpoint import assign_weights, build_model, state_dict_numpy

        trunk = state_dict_numpy(model)
        model = build_model(replace(model.config, num_labels=1 if regression else len(spec.labels)), "cls")
        trunk["score.weight"] = model.score.weight.numpy()
        assign_weights(model, trunk, args.model)
    cfg.model = model.config  # the architecture comes from the checkpoint
    max_len = min(args.max_len, model.config.max_position_embeddings)

    train = read_task(args.data_dir, spec.name, "train", args.skip_bad_lines)
    if args.max_train_examples:
        train = train[: args.max_train_examples]
    enc = [encode_example(tok, ex, max_len) for ex in train]
    eng = cfg.engine
    if args.epochs > 0:
        eng.max_steps = max(1, int(args.epochs * len(train) / eng.global_batch_size))
    cfg.data.seq_length = max_len

    def train_batches(consumed):
        return EpochBatches(enc, [ex.label for ex in train], eng.micro_batch_size, tok.pad_id, regression,
                            cfg.global_.seed, consumed)

    result = fit(model, classification_loss, train_batches, cfg, tokenizer=tok,
                 show_progress=not args.no_progress)
    results = []
    for dev_file in spec.dev_files:
        dev = read_task(args.data_dir, spec.name, dev_file, args.skip_bad_lines)
        denc = [encode_example(tok, ex, max_len) for ex in dev]
        bs = eng.micro_batch_size
        batches = (collate(denc[i:i + bs], [ex.label for ex in dev[i:i + bs]], tok.pad_id, regression)
                   for i in range(0, len(dev), bs))
        pred = predict(model, batches)
        gold = np.asarray([ex.label for ex in dev])
        if not regression:
            gold = gold.astype(np.int64)
        metrics = compute_metrics(spec.metrics, pred, gold)
        results.append(GlueResult(spec.name, dev_file, len(dev), metrics, result.steps, result.checkpoint).__dict__)
    out = os.path.join(cfg.global_.output_dir, f"glue_{spec.name}.json")
    os.makedirs(cfg.global_.output_dir, exist_ok=True)
    write_json_atomic(out, results, sort_keys=False)
    print_json({"results": results, "output": out})
    return 0
