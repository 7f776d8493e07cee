"""`gptc pretrain`: pretrain (or continue training) a GPT on Megatron indexed datasets."""
from __future__ import annotations

import itertools
import math

from ._common import (add_config_arguments, add_training_arguments, claim_run_dir, fail, find_tokenizer, print_json,
                      seed_everything, training_config)


def add_arguments(parser) -> None:
    add_config_arguments(parser)
    add_training_arguments(parser)


def run(args) -> int:
    from ..checkpoint import build_model, load_model
    from ..config import ConfigError
    from ..data.dataset import SampleIterator, build_datasets
    from ..parallel import build_parallel, init_distributed
    from ..train.loss import causal_lm_loss
    from ..train.trainer import TrainingDiverged, evaluate, fit

    cfg = training_config(args, "Data.data_prefix", "point it at a preprocessed dataset prefix (see `gptc preprocess`)")
    eng, data = cfg.engine, cfg.data
    claim_run_dir(cfg)
    from ..memory import check_fits, model_config_of

    sized = (eng.init_from and model_config_of(eng.init_from)) or cfg.model
    check_fits("pretrain", sized, batch=eng.micro_batch_size, seq=data.seq_length, recompute=cfg.model.recompute)
    dims = init_distributed(cfg)  # checks Parallel against the launch; gloo/NCCL when launched
    seed_everything(cfg.global_.seed)
    tokenizer = find_tokenizer(data.tokenizer_dir)
    if eng.init_from:
        model = load_model(eng.init_from)
        cfg.model = model.config
    else:
        model = build_model(cfg.model, "lm")
    if data.seq_length > cfg.model.max_position_embeddings:
        raise ConfigError(f"Data.seq_length {data.seq_length} exceeds Model.max_position_embeddings "
                          f"{cfg.model.max_position_embeddings}")
    if tokenizer is not None and tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"the tokenizer has {tokenizer.vocab_size} tokens but Model.vocab_size is "
                          f"{cfg.model.vocab_size}")
    # Every data-parallel rank reads its slice of each (micro x replicas)-sample batch, so a
    # parallel run sees the same samples in the same order as one process.
    replicas = cfg.parallel.data_parallel_size
    micro = eng.micro_batch_size * replicas
    n_eval = eng.eval_iters * micro
    train, valid, _ = build_datasets(data.data_prefix, data.split, data.seq_length,
                                        (eng.max_steps * eng.global_batch_size, n_eval, 0), cfg.global_.seed)

    def train_batches(consumed):
        return SampleIterator(train, micro, consumed, dims.data_rank, replicas)

    def eval_batches():
        return itertools.islice(SampleIterator(valid, micro, 0, dims.data_rank, replicas),
                                eng.eval_iters) if valid else []

    parallel = build_parallel(dims, cfg)
    loss_fn = causal_lm_loss
    if parallel is not None:
        model = parallel.apply(model)
        loss_fn = parallel.loss_fn
    try:
        result = fit(model, loss_fn, train_batches, cfg, eval_batches=eval_batches if valid else None,
                     tokenizer=tokenizer, samples_per_micro_batch=micro, show_progress=not args.no_progress,
                     parallel=parallel)
    except TrainingDiverged as e:
        return fail(str(e))
    summary = {"steps": result.steps, "last_loss": result.last_loss, "tokens_per_s": round(result.tokens_per_s, 1),
               "checkpoint": result.checkpoint}
    if valid is not None:
        val = evaluate(model, loss_fn, eval_batches())
        summary.update(valid_loss=round(val, 5), valid_ppl=round(math.exp(min(val, 50)), 3))
    if dims.is_main:
        print_json(summary)
    return 0
