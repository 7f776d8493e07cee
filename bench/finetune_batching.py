"""Finetuning batches: packing (segment mask) vs length-grouped padding, same examples, same model.
Prints one JSON object: training steps (forward + backward) per second and *real* (non-padding)
target-bearing tokens per second of each mode, measured in one run, alternating the modes.

    OMP_NUM_THREADS=2 python bench/finetune_batching.py --rows 4000 --preset gpt-tiny --seq 128 --micro 16

Data: SST-2 training rows as "Sentence: ...\\nSentiment:" -> " positive"/" negative" (short
examples, the case packing is for), tokenized with the GPT-2 BPE from ``../shared/data``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=os.path.join(ROOT, "..", "shared", "data"))
    ap.add_argument("--rows", type=int, default=4000)
    ap.add_argument("--preset", default="gpt-tiny")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--micro", type=int, default=16)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per mode and round")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    import paddle

    from gpt_compress.checkpoint import build_model
    from gpt_compress.config import ModelConfig
    from gpt_compress.data.glue import read_task
    from gpt_compress.data.tokenizer import Tokenizer
    from gpt_compress.finetune.data import Row, encode_rows, plan_batches
    from gpt_compress.finetune.metrics import finetune_loss

    tok = Tokenizer.load(os.path.join(args.data, "gpt2_bpe"))
    ex = read_task(os.path.join(args.data, "glue", "SST-2"), "SST-2", "train")[: args.rows]
    rows = [Row(f"Sentence: {e.texts[0].strip()}\nSentiment:", [" negative", " positive"][int(e.label)], "")
            for e in ex]
    examples, _ = encode_rows(tok, rows, args.seq)
    paddle.seed(0)
    model = build_model(ModelConfig.from_preset(args.preset, vocab_size=50304, hidden_dropout_prob=0.0,
                                                attention_probs_dropout_prob=0.0), "lm")
    model.train()
    opt = paddle.optimizer.AdamW(1e-4, parameters=model.parameters())
    plans = {m: plan_batches(examples, m, args.micro, args.seq, tok.pad_id, seed=0) for m in ("pack", "group")}
    res = {m: {"seconds": 0.0, "steps": 0, "real_tokens": 0, "padded_tokens": 0} for m in plans}
    for r in range(args.rounds + 1):  # round 0 warms up both
        for mode, plan in plans.items():
            batches = [plan.collate(b) for b in plan.batches[r * args.steps:(r + 1) * args.steps]]
            t0 = time.perf_counter()
            for b in batches:
                finetune_loss(model, b).backward()
                opt.step()
                opt.clear_grad()
            dt = time.perf_counter() - t0
            if r == 0:
                continue
            rec = res[mode]
            rec["seconds"] += dt
            rec["steps"] += len(batches)
            rec["real_tokens"] += sum(int((b["labels"] != -100).sum()) for b in batches)
            rec["padded_tokens"] += sum(int(b["input_ids"].size) for b in batches)
    out = {"preset": args.preset, "seq": args.seq, "micro": args.micro, "examples": len(examples),
           "omp_threads": os.environ.get("OMP_NUM_THREADS")}
    for mode, rec in res.items():
        out[mode] = {"batches_per_epoch": len(plans[mode].batches),
                     "target_tokens_per_s": round(rec["real_tokens"] / rec["seconds"], 1),
                     "step_s": round(rec["seconds"] / rec["steps"], 4),
                     "fill": round(plans[mode].real_tokens / sum(
                         int(plans[mode].collate(b)["input_ids"].size) for b in plans[mode].batches), 3)}
        out[mode]["epoch_s_est"] = round(out[mode]["step_s"] * out[mode]["batches_per_epoch"], 1)
    out["pack_over_group_epoch_speedup"] = round(out["group"]["epoch_s_est"] / out["pack"]["epoch_s_est"], 3)
    json.dump(out, sys.stdout)
    print()


if __name__ == "__main__":
    main()
