"""`gptc demo`: the whole toolkit on an embedded default, with no download.

Runs `gptc pipeline` with ``DEMO_CONFIG`` (the same run as configs/pipeline_tiny_cpu.yaml): an
English corpus from the Python standard library's docstrings, a byte-level BPE tokenizer
trained on it, a Megatron indexed dataset, a small GPT pretrained on the CPU, pruned by 25% of
its heads and FFN channels and distilled from the unpruned model, quantization-aware trained
to int8, exported for Paddle Inference and onnxruntime, every artifact evaluated (held-out
perplexity, decode speed, size), and a report with a table and plots. Then a completion from
the int8 model. Rerunning skips finished stages.
"""
from __future__ import annotations

import os

from ._common import fail, print_json

# The embedded default run, as YAML sections (tests check it equals configs/pipeline_tiny_cpu.yaml).
DEMO_CONFIG = {
    "Global": {"seed": 1234, "output_dir": "demo_out"},
    "Model": {"preset": "gpt-test", "vocab_size": 4096, "hidden_size": 192, "num_layers": 4,
              "num_attention_heads": 6, "max_position_embeddings": 256,
              "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0},
    "Data": {"seq_length": 128, "split": [95, 5, 0]},
    "Engine": {"max_steps": 200, "global_batch_size": 16, "micro_batch_size": 16, "eval_freq": 100,
               "eval_iters": 8, "logging_freq": 50, "save_steps": 100, "keep_checkpoint_max": 1},
    "Optimizer": {"weight_decay": 0.01, "grad_clip": 1.0,
                  "lr": {"decay_style": "cosine", "max_lr": 2e-3, "min_lr": 2e-4, "warmup_rate": 0.05}},
    "Prune": {"head_ratio": 0.25, "ffn_ratio": 0.25, "criterion": "taylor", "calib_batches": 8},
    "Distill": {"temperature": 2.0, "alpha": 0.5},
    "Quant": {"targets": ["gpt.blocks.*"], "weight_only": ["gpt.wte", "gpt.wpe"], "calib_batches": 4},
    "Pipeline": {"corpus": ["stdlib"], "corpus_max_bytes": 4_000_000, "heldout_fraction": 0.05,
                 "distill_overrides": ["Engine.max_steps=50", "Optimizer.lr.max_lr=1.0e-3",
                                       "Optimizer.lr.min_lr=1.0e-4"],
                 "qat_overrides": ["Engine.max_steps=20", "Engine.eval_freq=0", "Optimizer.lr.max_lr=2.0e-4",
                                   "Optimizer.lr.min_lr=2.0e-5"],
                 "speed_prompt_tokens": 32, "speed_new_tokens": 64},
}
PROMPT = "Return a new list containing"


def add_arguments(parser) -> None:
    parser.add_argument("--output-dir", default="demo_out", help="where everything is written")
    parser.add_argument("-o", "--override", action="append", default=[], metavar="Section.key=value",
                        help="override a field of the embedded demo config")
    parser.add_argument("--progress", action="store_true", help="progress bars of the training stages")


def run(args) -> int:
    from ..config import build_config
    from ..inference.runner import Generator
    from ..pipeline import Pipeline, PipelineError

    cfg = build_config(DEMO_CONFIG, [f"Global.output_dir={os.path.abspath(args.output_dir)}", *args.override],
                       source="embedded demo config")
    pipe = Pipeline(cfg, progress=args.progress)
    try:
        result = pipe.run()
    except PipelineError as e:
        return fail(str(e))
    with open(result["report"], encoding="utf-8") as f:
        print(f.read())
    int8 = pipe.outputs("qat")["export"] if cfg.pipeline.qat else pipe.outputs("export_base")["export"]
    gen = Generator.from_dir(int8, backend="onnx" if "onnx" in cfg.pipeline.formats else "paddle")
    out = gen.generate(PROMPT, max_new_tokens=40, repetition_penalty=1.3)
    completion = out.texts[0]
    print(f"greedy completion by {int8} (repetition penalty 1.3):\n{PROMPT}{completion}\n", flush=True)
    if "paddle" in cfg.pipeline.formats:
        _print_fused_row(int8, gen)
    print(f"report: {result['report']}", flush=True)
    print_json({**result, "completion": completion})
    return 0


def _print_fused_row(model_dir: str, other) -> None:
    """The int8 model on Paddle Inference's fused CPU operators (the report's paddle rows run
    them too) next to ``other``'s backend: one line of decode speed."""
    from ..eval.speed import measure_speed
    from ..inference.fused import FusedBackend
    from ..inference.runner import Generator

    fused = Generator.from_dir(model_dir, backend="paddle")
    ids = (other.tokenizer.encode(PROMPT) if other.tokenizer else [1, 2, 3, 4, 5, 6]) * 4
    rows = [("fused int8 (Paddle Inference, gpt-compress CPU operators)" if isinstance(fused.backend, FusedBackend)
             else "int8 (Paddle Inference, unfused: the operators could not be built)", fused)]
    if other.backend is not fused.backend and type(other.backend).__name__ != type(fused.backend).__name__:
        rows.append((f"int8 ({type(other.backend).__name__})", other))
    cells = []
    for label, g in rows:
        s = measure_speed(g, ids, 64, 2).to_dict()
        cells.append(f"{label}: {s['decode_tokens_per_s']} tok/s, prefill {s['prefill_ms']} ms")
    print(" | ".join(cells) + "\n", flush=True)

