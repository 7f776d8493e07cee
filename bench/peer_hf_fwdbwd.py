"""Hugging Face GPT-2 (torch CPU) forward+backward and train-step timing, median of timed steps.

The shared peer script (``../shared/bench/peer_hf.py``) reports full train steps as one mean
over a few steps; ``bench/forward.py`` runs this script in a subprocess to get the peer's
forward+backward alone (no optimizer) and a median train step, measured the same way as ours.
Prints one JSON line.
"""
import argparse
import json
import os
import statistics
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel


def timed(fn, warmup: int, steps: int) -> tuple[float, float]:
    """Median and minimum seconds of ``fn()`` over ``steps`` calls after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), min(times)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--no-train", action="store_true", help="skip the AdamW train-step timing")
    p.add_argument("--no-fwd-bwd", action="store_true", help="skip the forward+backward timing")
    p.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    a = p.parse_args()

    torch.manual_seed(0)
    torch.set_num_threads(a.threads)
    cfg = GPT2Config(vocab_size=a.vocab, n_positions=max(1024, a.seq), n_embd=a.hidden, n_layer=a.layers,
                     n_head=a.heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(cfg)
    x = torch.randint(0, a.vocab, (a.batch, a.seq))

    def fwd_bwd():
        model(input_ids=x, labels=x).loss.backward()
        model.zero_grad(set_to_none=True)

    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def train_step():
        model(input_ids=x, labels=x).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    tokens = a.batch * a.seq
    out = {"peer": "hf-transformers-gpt2-torch-cpu", "torch": torch.__version__, "threads": a.threads}
    if not a.no_fwd_bwd:
        med, best = timed(fwd_bwd, a.warmup, a.steps)
        out.update(fwd_bwd_s=round(med, 3), fwd_bwd_best_s=round(best, 3),
                   fwd_bwd_tokens_per_s=round(tokens / med, 1))
    if not a.no_train:
        med, best = timed(train_step, a.warmup, a.steps)
        out.update(train_step_s=round(med, 3), train_best_s=round(best, 3),
                   train_tokens_per_s=round(tokens / med, 1))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
