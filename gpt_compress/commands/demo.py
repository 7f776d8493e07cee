"""`gptc demo`: the main job on an embedded default, with no download.

Builds an English corpus from the Python standard library's docstrings, trains a byte-level
BPE tokenizer on it, preprocesses it into a Megatron indexed dataset, pretrains a small GPT
for a few minutes on the CPU (the loss falls), reports validation perplexity before and
after, and generates a completion.
"""
from __future__ import annotations

import math
import os
import time

from ._common import print_json

# The embedded default run (YAML sections, as a config file would have them).
DEMO_CONFIG = {
    "Global": {"seed": 1234},
    "Model": {"preset": "gpt-test", "vocab_size": 4096, "hidden_size": 192, "num_layers": 4,
              "num_attention_heads": 6, "max_position_embeddings": 256,
              "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0},
    "Data": {"seq_length": 128, "split": [95, 5, 0]},
    "Engine": {"max_steps": 300, "global_batch_size": 16, "micro_batch_size": 16, "eval_freq": 100,
               "eval_iters": 8, "logging_freq": 50, "save_steps": 200, "keep_checkpoint_max": 1},
    "Optimizer": {"weight_decay": 0.01, "grad_clip": 1.0,
                  "lr": {"decay_style": "cosine", "max_lr": 2e-3, "min_lr": 2e-4, "warmup_rate": 0.05}},
}
PROMPT = "Return a new list containing"


def add_arguments(parser) -> None:
    parser.add_argument("--output-dir", default="demo_out", help="where everything is written")
    parser.add_argument("--steps", type=int, default=DEMO_CONFIG["Engine"]["max_steps"],
                        help="pretraining steps (about 0.7 s each on 2 idle cores)")
    parser.add_argument("-o", "--override", action="append", default=[], metavar="Section.key=value",
                        help="override a field of the embedded demo config")


def _say(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


def run(args) -> int:
    from ..checkpoint import load_model
    from ..config import build_config
    from ..data.dataset import SampleIterator, build_datasets
    from ..data.preprocess import preprocess
    from ..data.stdlib_corpus import build_stdlib_corpus
    from ..data.tokenizer import Tokenizer
    from ..inference.dygraph import DygraphBackend
    from ..model.generation import generate
    from ..train.loss import causal_lm_loss
    from ..train.trainer import evaluate, fit
    from ..checkpoint import build_model
    from ..config import GenerationConfig
    from ._common import seed_everything

    t_start = time.perf_counter()
    out = os.path.abspath(args.output_dir)
    os.makedirs(out, exist_ok=True)

    _say("1/6 building a corpus from the Python standard library's docstrings (no download)")
    corpus = build_stdlib_corpus(os.path.join(out, "corpus.jsonl"))
    _say(f"    {corpus['documents']} documents, {corpus['bytes'] / 1e6:.1f} MB -> {corpus['path']}")

    _say("2/6 training a byte-level BPE tokenizer (vocab 4096)")
    tok_dir = os.path.join(out, "tokenizer")
    tok = Tokenizer.train([corpus["path"]], vocab_size=DEMO_CONFIG["Model"]["vocab_size"])
    tok.save(tok_dir)

    _say("3/6 preprocessing into a Megatron mmap indexed dataset")
    summary = preprocess([corpus["path"]], os.path.join(out, "data", "corpus"), tok, workers=1, progress=False)
    _say(f"    {summary['documents']} documents, {summary['tokens']} tokens")
    prefix = os.path.join(out, "data", "corpus_text_document")

    raw = {k: dict(v) for k, v in DEMO_CONFIG.items()}
    raw["Global"]["output_dir"] = os.path.join(out, "train")
    raw["Data"].update(data_prefix=[prefix], tokenizer_dir=tok_dir)
    raw["Engine"]["max_steps"] = args.steps
    cfg = build_config(raw, args.override, source="embedded demo config")
    seed_everything(cfg.global_.seed)
    eng = cfg.engine
    n_eval = eng.eval_iters * eng.micro_batch_size
    train, valid, _ = build_datasets(cfg.data.data_prefix, cfg.data.split, cfg.data.seq_length,
                                     (eng.max_steps * eng.global_batch_size, n_eval, 0), cfg.global_.seed)

    def eval_batches():
        return list(SampleIterator(valid, eng.micro_batch_size))[: eng.eval_iters]

    model = build_model(cfg.model, "lm")
    untrained = evaluate(model, causal_lm_loss, eval_batches())
    _say(f"4/6 pretraining a {cfg.model.num_parameters() / 1e6:.1f}M-parameter GPT for {eng.max_steps} steps "
         f"(batch {eng.global_batch_size} x {cfg.data.seq_length} tokens); untrained validation loss "
         f"{untrained:.3f} (ppl {math.exp(untrained):.0f})")
    result = fit(model, causal_lm_loss, lambda c: SampleIterator(train, eng.micro_batch_size, c), cfg,
                 eval_batches=eval_batches, tokenizer=tok)

    _say("5/6 validation perplexity")
    trained_model = load_model(result.checkpoint)
    val = evaluate(trained_model, causal_lm_loss, eval_batches())
    _say(f"    validation loss {untrained:.3f} -> {val:.3f}; perplexity {math.exp(untrained):.0f} -> {math.exp(val):.1f}")

    _say(f"6/6 greedy completion (repetition penalty 1.3) of {PROMPT!r}")
    gen = generate(DygraphBackend(trained_model), [tok.encode(PROMPT)], GenerationConfig(max_new_tokens=40, repetition_penalty=1.3),
                   tok.eod_id, tok.pad_id)
    completion = tok.decode(gen.sequences[0])
    print(PROMPT + completion, flush=True)
    seconds = time.perf_counter() - t_start
    _say(f"done in {seconds / 60:.1f} min; checkpoint: {result.checkpoint}")
    print_json({"untrained_valid_loss": round(untrained, 4), "valid_loss": round(val, 4),
                "valid_ppl": round(math.exp(val), 2), "train_tokens_per_s": round(result.tokens_per_s, 1),
                "checkpoint": result.checkpoint, "seconds": round(seconds, 1), "completion": completion})
    return 0
