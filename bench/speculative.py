"""Speculative decoding benchmark: acceptance rate and batch-1 speed-up of a draft model made by
the pipeline and of prompt lookup (``ngram``) over plain greedy decoding on the fused Paddle
program, float32 and int8 targets, a gpt-345M row, and the cost of a verify step of T new rows
against a one-row step; prints one JSON object.

    OMP_NUM_THREADS=2 python bench/speculative.py        # the pipeline ~45 minutes once (2 cores), then ~10
    python bench/speculative.py --big-preset "" --reps 1  # the trained models only

The models: ``gptc pipeline -c configs/pipeline_speculative_bench.yaml`` in ``--work`` (reused
when up to date): a gpt-bench target pretrained on Jane Austen + tiny Shakespeare (GPT-2 BPE),
its weight-only int8 (``woq8``), and the draft the pipeline makes and records in the target's
manifest: the target pruned to gpt-tiny's size in depth and width (2 of 6 blocks, 64 of 384
hidden channels), distilled from it (most samples training windows the target itself continued:
``Distill.generated_windows``), QAT int8, its greedy proposals from the 8192 most frequent
training tokens (``Pipeline.draft_vocab``). Both targets use that one draft.

Prompt sets, from the pipeline's held-out documents (never trained on): ``heldout``, the
first 48 tokens of a paragraph (the draft's job: continue the text as the target would);
``quote``, the paragraph's first 48 tokens, a blank line and its own first 8 tokens (the
continuation can quote the context: what prompt lookup is for); ``extract``, extraction-style
prompts (the paragraph's first sentences, up to 44 tokens, a request to repeat its second
sentence and that sentence's first 4 tokens). The corpus's paragraphs are unwrapped (their
lines joined), so line breaks are not the text's most frequent token. Each prompt is generated
alone (batch 1), with and without the draft, the two alternating, ``--reps`` times; a figure is
the median, the speed-up the summed plain seconds over the summed speculative seconds.
``same_output`` checks that greedy output is unchanged. ``heldout/kN`` (``--also-k``): the held-out
rows with at most N draft tokens a step (a verify step of T = N + 1 rows; its cost against one
row is the ``verify_cost`` table). ``heldout_sampled``: the same with sampling (temperature 0.7,
top-p 0.95, a seed per prompt; the rejection rule keeps the target's distribution), where the
target's greedy loops, which a draft predicts well, are broken up.

The ``--big-preset`` row (gpt-345M): a random-init export, in a process of its own (its peak RSS
is the runner's: /proc VmHWM), greedy with and without prompt lookup on repetitive prompts
(``--big-prompts`` random sequences of 16 tokens, each repeated 4 times), ``--big-new-tokens``
new tokens, and its verify cost.

The verify cost: the median time of a ``decode_positions`` call feeding T = 1 .. k + 1 rows onto
a 64-token cache, batch 1, on each target and on the draft.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.path.join(os.path.dirname(ROOT), "shared", "data")
CONFIG = os.path.join(ROOT, "configs", "pipeline_speculative_bench.yaml")


def prepare(work: str, overrides: list[str]) -> dict:
    """``gptc pipeline`` of CONFIG in ``work`` (up-to-date stages skipped): {"float32", "int8",
    "draft", "heldout"} paths and the pipeline's draft record."""
    import glob

    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from compress import corpus_jsonl

    from gpt_compress.pipeline.stages import gptc
    from gpt_compress.pipeline.stamps import StampStore

    corpus = os.path.join(work, "corpus.jsonl")
    if not os.path.isfile(corpus):
        corpus_jsonl(sorted(glob.glob(os.path.join(SHARED, "corpus", "*.txt"))), corpus, unwrap=True)
    pipe = os.path.join(work, "pipeline")
    args = [f"Global.output_dir={pipe}", f"Pipeline.corpus=[{corpus}]",
            f"Pipeline.tokenizer_dir={os.path.join(SHARED, 'gpt2_bpe')}", *overrides]
    t0 = time.perf_counter()
    res = gptc(["pipeline", "-c", CONFIG, *[x for o in args for x in ("-o", o)]], "pipeline")
    stamps = StampStore(pipe)
    draft = stamps.read("draft").outputs
    return {"float32": draft["export"], "int8": stamps.read("quant_woq8").outputs["export"], "draft": draft["draft"],
            "draft_record": {k: draft.get(k) for k in ("acceptance_rate", "tokens_per_target_step", "k",
                                                       "measured_on")},
            "heldout": stamps.read("data").outputs["heldout"], "pipeline_seconds": round(time.perf_counter() - t0, 1),
            "stages": {k: v.get("seconds") for k, v in res.get("stages", {}).items()}}


def prompt_sets(gen, text: str, n: int) -> dict[str, list[list[int]]]:
    """``heldout``, ``quote`` and ``extract`` prompts from ``n`` long paragraphs spread over the
    held-out ``text``."""
    paragraphs = [p.strip() for p in text.split("\n\n") if len(p.strip()) > 300]
    paragraphs = paragraphs[::max(1, len(paragraphs) // n)][:n]
    heldout, quote, extract = [], [], []
    for p in paragraphs:
        ids = gen.encode(p)[0][:48]  # + 8 quoted + 64 new: within the 128 positions trained
        heldout.append(ids)
        quote.append(ids + gen.encode("\n\n")[0] + ids[:8])
        sentences = [x for x in re.split(r"(?<=[.!?;:])\s+", p) if x.strip()]
        if len(sentences) >= 3:
            passage, second = gen.encode(" ".join(sentences[:4]))[0][:44], gen.encode(" " + sentences[1])[0]
            extract.append(passage + gen.encode("\n\nRepeat the second sentence:\n")[0] + second[:4])
    return {"heldout": heldout, "quote": quote, "extract": extract}


SAMPLING = dict(decode_strategy="sampling", temperature=0.7, top_p=0.95)  # the sampled rows' settings


def measure(gen, prompts, draft, k: int, new: int, reps: int, sampling: bool = False) -> dict:
    """Batch-1 greedy (``sampling``: SAMPLING, seeded per prompt) with and without ``draft`` on
    each prompt; ``same_output`` is null for sampling (the rule keeps the distribution, not the
    draws)."""
    plain_s, spec_s, same = [], [], True
    proposed = accepted = steps = tokens = plain_tokens = 0
    for i, ids in enumerate(prompts):
        tp, ts = [], []
        opts = {**SAMPLING, "seed": i} if sampling else {}
        for _ in range(reps):
            ref = gen.generate([ids], max_new_tokens=new, **opts)
            out = gen.generate([ids], max_new_tokens=new, draft=draft, draft_tokens=k, **opts)
            tp.append(ref.seconds)
            ts.append(out.seconds)
            same &= out.sequences == ref.sequences
        plain_s.append(statistics.median(tp))
        spec_s.append(statistics.median(ts))
        s = out.speculation
        proposed, accepted = proposed + s["proposed"], accepted + s["accepted"]
        steps, tokens = steps + s["target_steps"], tokens + len(out.sequences[0])
        plain_tokens += len(ref.sequences[0])
    return {"acceptance_rate": round(accepted / max(proposed, 1), 3),
            "tokens_per_target_step": round((tokens - len(prompts)) / max(steps, 1), 2),
            "new_tokens": tokens, "plain_tokens_per_s": round(plain_tokens / sum(plain_s), 1),
            "speculative_tokens_per_s": round(tokens / sum(spec_s), 1),
            "speedup": round(sum(plain_s) / sum(spec_s), 2), "same_output": None if sampling else bool(same)}


def verify_cost(backend, vocab: int, k: int, reps: int = 15, cached: int = 64) -> dict:
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
    p.add_argument("--work", default=os.path.join(ROOT, "output", "bench_speculative"),
                   help="the pipeline runs here once; up-to-date stages are reused")
    p.add_argument("-o", "--override", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="a config override of the pipeline (repeatable)")
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("-k", type=int, default=6, help="draft tokens per step")
    p.add_argument("--also-k", type=lambda v: [int(x) for x in v.split(",") if x], default=[3, 5],
                   help="more draft lengths for the held-out rows (comma-separated; '' for none)")
    p.add_argument("--big-preset", default="gpt-345M", help="random-init preset of the big row ('': skip)")
    p.add_argument("--big-prompts", type=int, default=3)
    p.add_argument("--big-new-tokens", type=int, default=48)
    p.add_argument("--big-export", action="store_true", help=argparse.SUPPRESS)  # run_big's child: export
    p.add_argument("--big-worker", default="", help=argparse.SUPPRESS)  # run_big's child: measure
    a = p.parse_args()
    os.makedirs(a.work, exist_ok=True)
    a.work = os.path.realpath(a.work)  # the pipeline's stamps hold its paths: the same through a link
    import gpt_compress  # noqa: F401  (before paddle: the operators' OpenMP settings)
    from gpt_compress.inference.runner import Generator

    if a.big_export:
        random_export(a.work, a.big_preset)
        return
    if a.big_worker:
        print(json.dumps(big_row(a.big_worker, a.big_prompts, a.big_new_tokens, a.k, a.reps)))
        return

    models = prepare(a.work, a.override)
    draft = Generator.from_dir(models["draft"], backend="paddle", fused=True)
    with open(models["heldout"], encoding="utf-8") as f:
        text = f.read()
    results, costs = {}, {"draft": verify_cost(draft.backend, draft.vocab_size, a.k)}
    for target in ("float32", "int8"):
        gen = Generator.from_dir(models[target], backend="paddle", fused=True)
        sets = prompt_sets(gen, text, a.prompts)
        gen.generate(sets["heldout"][0], max_new_tokens=8, draft=draft)  # warm-up: predictor handles, caches
        for name, ids in sets.items():
            results[f"{target}/draft/{name}"] = measure(gen, ids, draft, a.k, a.new_tokens, a.reps)
            results[f"{target}/ngram/{name}"] = measure(gen, ids, "ngram", a.k, a.new_tokens, a.reps)
        for k in a.also_k:  # the held-out rows at other draft lengths (a verify step's cost depends on T = k + 1)
            results[f"{target}/draft/heldout/k{k}"] = measure(gen, sets["heldout"], draft, k, a.new_tokens, a.reps)
        results[f"{target}/draft/heldout_sampled"] = measure(gen, sets["heldout"], draft, a.k, a.new_tokens, a.reps,
                                                             sampling=True)
        costs[target] = verify_cost(gen.backend, gen.vocab_size, a.k)
    out = {"bench": "speculative", "threads": os.environ.get("OMP_NUM_THREADS", ""), "k": a.k,
           "new_tokens": a.new_tokens, "prompts": a.prompts, "models": models, "results": results,
           "verify_cost": costs}
    if a.big_preset:
        out["results"][f"{a.big_preset}/ngram/repetitive"] = run_big(a)
    print(json.dumps(out, sort_keys=True))


if __name__ == "__main__":
    main()
