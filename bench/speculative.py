"""Speculative decoding benchmark: acceptance rate and batch-1 speed-up of prompt lookup
(``ngram``) and of a pruned draft over plain greedy decoding on the fused Paddle program, a
gpt-345M row, and the cost of a verify step of T new rows against a one-row step; prints one
JSON object.

    OMP_NUM_THREADS=2 python bench/speculative.py             # about 10 minutes on 2 cores
    python bench/speculative.py --verify-preset "" --big-preset "" --reps 1   # the trained model only

The models: a gpt-tiny trained ``--train-steps`` steps on tinyshakespeare (a 1024-token BPE) and
its structurally pruned copy (tests/_export_helpers.py's recipe) as the draft, both exported.
Prompt sets: ``quote``, paragraphs from the end of the corpus followed by a blank line and their
own first 8 tokens (48 + 8 tokens; the continuation can quote the context: what prompt lookup is for),
``extract``, extraction-style prompts (the paragraph's first lines, up to 44 tokens, a request to
repeat its second line and that line's first 4 tokens: the answer is in the context), and
``plain``, the first 16 tokens of those paragraphs. Each prompt is generated alone (batch 1),
with and without the draft, the two alternating, ``--reps`` times; a figure is the median, the
speed-up the summed plain seconds over the summed speculative seconds. ``same_output`` checks
that greedy output is unchanged.

The ``--big-preset`` row (gpt-345M): a random-init export, in a process of its own (its peak RSS
is the runner's: /proc VmHWM), greedy with and without prompt lookup on repetitive prompts
(``--big-prompts`` random sequences of 16 tokens, each repeated 4 times), ``--big-new-tokens``
new tokens, and its verify cost.

The verify cost: the median time of a ``decode_positions`` call feeding T = 1 .. k + 1 rows onto
a 128-token cache, batch 1, on the trained model and on a random-init ``--verify-preset``
(gpt-bench: 121 MB of float32 weights, so a step reads far more weights than activations).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))  # the tiny-model recipe of the tests


def data_dir() -> str:
    shared = os.path.join(ROOT, "..", "shared", "data")
    return shared if os.path.isdir(shared) else os.path.join(ROOT, "tests", "data")


def prepare(work: str, steps: int) -> tuple[str, str, str]:
    """(target export, draft export, corpus text): trained once into ``work``, reused after."""
    from _export_helpers import prune_checkpoint, train_tiny

    from gpt_compress.data.preprocess import preprocess
    from gpt_compress.data.tokenizer import Tokenizer
    from gpt_compress.export import export

    corpus = os.path.join(data_dir(), "corpus", "tinyshakespeare.txt")
    text = open(corpus, encoding="utf-8").read()
    target, draft = os.path.join(work, "target"), os.path.join(work, "draft")
    if os.path.isfile(os.path.join(draft, "manifest.json")):
        return target, draft, text
    paragraphs = [p.strip() for p in text.split("\n\n") if p.strip()]
    jsonl = os.path.join(work, "corpus.jsonl")
    with open(jsonl, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": p}) + "\n" for p in paragraphs[:-40])  # the last 40: prompts
    tok = Tokenizer.train([corpus], vocab_size=1024)
    tok.save(os.path.join(work, "tokenizer"))
    preprocess([jsonl], os.path.join(work, "data"), tok, progress=False)
    from pathlib import Path

    ckpt = train_tiny(os.path.join(work, "tokenizer"), os.path.join(work, "data_text_document"),
                      Path(work) / "ckpt", steps=steps)
    prune_checkpoint(ckpt, os.path.join(work, "pruned"))
    export(ckpt, target, formats=("paddle",))
    export(os.path.join(work, "pruned"), draft, formats=("paddle",))
    return target, draft, text


def prompt_sets(gen, text: str, n: int) -> dict[str, list[list[int]]]:
    """``quote`` and ``plain`` prompts from the last ``n`` long paragraphs of the corpus."""
    paragraphs = [p.strip() for p in text.split("\n\n") if len(p.strip()) > 300][-n:]
    quote, plain = [], []
    for p in paragraphs:
        ids = gen.encode(p)[0][:48]  # + 8 quoted + 64 new: within gpt-tiny's 128 positions
        quote.append(ids + gen.encode("\n\n")[0] + ids[:8])
        plain.append(ids[:16])
    extract = []
    for p in paragraphs:
        lines = [ln for ln in p.split("\n") if ln.strip()]
        if len(lines) < 3:
            continue
        passage, second = gen.encode("\n".join(lines[:4]))[0][:44], gen.encode(lines[1])[0]
        extract.append(passage + gen.encode("\n\nRepeat the second line:\n")[0] + second[:4])
    return {"quote": quote, "extract": extract, "plain": plain}


def measure(gen, prompts, draft, k: int, new: int, reps: int) -> dict:
    """Batch-1 greedy with and without ``draft`` on each prompt."""
    plain_s, spec_s, same = [], [], True
    proposed = accepted = steps = tokens = 0
    for ids in prompts:
        tp, ts = [], []
        for _ in range(reps):
            ref = gen.generate([ids], max_new_tokens=new)
            out = gen.generate([ids], max_new_tokens=new, draft=draft, draft_tokens=k)
            tp.append(ref.seconds)
            ts.append(out.seconds)
            same &= out.sequences == ref.sequences
        plain_s.append(statistics.median(tp))
        spec_s.append(statistics.median(ts))
        s = out.speculation
        proposed, accepted = proposed + s["proposed"], accepted + s["accepted"]
        steps, tokens = steps + s["target_steps"], tokens + len(out.sequences[0])
    return {"acceptance_rate": round(accepted / max(proposed, 1), 3),
            "tokens_per_target_step": round((tokens - len(prompts)) / max(steps, 1), 2),
            "plain_tokens_per_s": round(len(prompts) * new / sum(plain_s), 1),
            "speculative_tokens_per_s": round(tokens / sum(spec_s), 1),
            "speedup": round(sum(plain_s) / sum(spec_s), 2), "same_output": bool(same)}


def verify_cost(backend, vocab: int, k: int, reps: int = 15, cached: int = 128) -> dict:
    """Median ms of a batch-1 ``decode_positions`` of T = 1 .. k + 1 rows onto ``cached`` positions,
    and each over the one-row step."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, vocab, (1, cached)).astype(np.int64)
    _, cache = backend.prefill(ids, np.ones_like(ids))
    times: dict[int, list] = {t: [] for t in range(1, k + 2)}
    for _ in range(reps):
        for t in times:  # interleaved: drift weighs on every T alike
            new = rng.integers(0, vocab, (1, t)).astype(np.int64)
            mask = np.ones((1, cached + t), np.int64)
            t0 = time.perf_counter()
            _, cache = backend.decode_positions(new, mask, cache)
            times[t].append((time.perf_counter() - t0) * 1e3)
            cache = backend.truncate_cache(cache, cached)
    ms = {t: statistics.median(v) for t, v in times.items()}
    return {"ms": {str(t): round(v, 3) for t, v in ms.items()},
            "over_one_row": {str(t): round(v / ms[1], 2) for t, v in ms.items()}}


def random_export(work: str, preset: str) -> str:
    """A random-init ``preset`` exported (paddle), reused if present."""
    import paddle

    from gpt_compress.checkpoint import save_model
    from gpt_compress.config import ModelConfig
    from gpt_compress.export import export
    from gpt_compress.model.gpt import GPTForCausalLM

    out = os.path.join(work, f"{preset}-export")
    if not os.path.isfile(os.path.join(out, "manifest.json")):
        paddle.seed(0)
        cfg = ModelConfig.from_preset(preset, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        ckpt = save_model(GPTForCausalLM(cfg), os.path.join(work, f"{preset}-ckpt"), overwrite=True)
        export(ckpt, out, formats=("paddle",), overwrite=True)
    return out


def peak_rss_mb() -> float:
    """This process's peak RSS in MB (/proc's VmHWM)."""
    from gpt_compress.memory import status_bytes

    peak = status_bytes("VmHWM")
    return round(peak / 2 ** 20, 1) if peak is not None else 0.0


def big_row(export_dir: str, prompts: int, new: int, k: int, reps: int) -> dict:
    """The ``--big-preset`` row, run in its own process (``--big-worker``): prompt lookup on
    repetitive prompts, the verify cost, the runner's peak RSS and weight size."""
    from gpt_compress.inference.runner import Generator

    gen = Generator.from_dir(export_dir, backend="paddle", fused=True)
    rng = np.random.default_rng(0)
    sets = [list(map(int, np.tile(rng.integers(0, gen.vocab_size, 16), 4))) for _ in range(prompts)]
    gen.generate(sets[0], max_new_tokens=4)  # warm-up
    row = measure(gen, sets, "ngram", k, new, reps)
    row["verify_cost"] = verify_cost(gen.backend, gen.vocab_size, k, reps=5, cached=64)
    weights = os.path.join(export_dir, "fused.pdiparams")
    row["weights_mb"] = round(os.path.getsize(weights) / 2 ** 20, 1) if os.path.isfile(weights) else None
    row["peak_rss_mb"] = peak_rss_mb()
    return row


def run_big(a) -> dict:
    """Export the random-init ``--big-preset`` in a child process (reused after), then measure it
    in another, so the peak RSS is the runner's alone."""
    import subprocess

    export_dir = os.path.join(a.work, f"{a.big_preset}-export")
    for args in (["--big-export"], ["--big-worker", export_dir]):
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--work", a.work, "--big-preset",
                               a.big_preset, "--big-prompts", str(a.big_prompts), "--big-new-tokens",
                               str(a.big_new_tokens), "-k", str(a.k), "--reps", "1", *args],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            return {"error": f"exit {proc.returncode}", "stderr_tail": proc.stderr[-1500:]}
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    row.update(preset=a.big_preset, prompts=a.big_prompts, new_tokens=a.big_new_tokens,
               prompt="random 16 tokens x 4")
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "gptc_bench_speculative"),
                   help="models are built here once and reused")
    p.add_argument("--train-steps", type=int, default=400)
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("-k", type=int, default=5, help="draft tokens per step")
    p.add_argument("--verify-preset", default="gpt-bench", help="random-init preset for the verify cost ('': skip)")
    p.add_argument("--big-preset", default="gpt-345M", help="random-init preset of the big row ('': skip)")
    p.add_argument("--big-prompts", type=int, default=3)
    p.add_argument("--big-new-tokens", type=int, default=48)
    p.add_argument("--big-export", action="store_true", help=argparse.SUPPRESS)  # run_big's child: export
    p.add_argument("--big-worker", default="", help=argparse.SUPPRESS)  # run_big's child: measure
    a = p.parse_args()
    os.makedirs(a.work, exist_ok=True)
    import gpt_compress  # noqa: F401  (before paddle: the operators' OpenMP settings)
    from gpt_compress.inference.runner import Generator

    if a.big_export:
        random_export(a.work, a.big_preset)
        return
    if a.big_worker:
        print(json.dumps(big_row(a.big_worker, a.big_prompts, a.big_new_tokens, a.k, a.reps)))
        return

    target, draft_dir, text = prepare(a.work, a.train_steps)
    gen = Generator.from_dir(target, backend="paddle", fused=True)
    draft = Generator.from_dir(draft_dir, backend="paddle", fused=True)
    sets = prompt_sets(gen, text, a.prompts)
    results = {}
    for name, ids in sets.items():
        gen.generate(ids[0], max_new_tokens=8)  # warm-up: predictor handles, caches
        results[f"ngram/{name}"] = measure(gen, ids, "ngram", a.k, a.new_tokens, a.reps)
        results[f"pruned_draft/{name}"] = measure(gen, ids, draft, a.k, a.new_tokens, a.reps)
    out = {"bench": "speculative", "threads": os.environ.get("OMP_NUM_THREADS", ""), "k": a.k,
           "new_tokens": a.new_tokens, "prompts": a.prompts, "results": results,
           "verify_cost": {"gpt-tiny (trained)": verify_cost(gen.backend, gen.vocab_size, a.k)}}
    if a.verify_preset:
        big = Generator.from_dir(random_export(a.work, a.verify_preset), backend="paddle", fused=True)
        out["verify_cost"][a.verify_preset] = verify_cost(big.backend, big.vocab_size, a.k)
    if a.big_preset:
        out["results"][f"{a.big_preset}/ngram/repetitive"] = run_big(a)
    print(json.dumps(out, sort_keys=True))


if __name__ == "__main__":
    main()
