"""Compression benchmark: a gpt-bench pretrained on real text, its compressed variants, and one
table of size, quality and speed, each runtime (onnxruntime, Paddle Inference) against its own
fp32. Prints one JSON object.

    OMP_NUM_THREADS=2 python bench/compress.py --workdir /tmp/compress_wd --markdown table.md
    OMP_NUM_THREADS=2 python bench/compress.py --workdir /tmp/compress_wd --skip-speed       # build + quality
    OMP_NUM_THREADS=2 python bench/compress.py --workdir /tmp/compress_wd --only-speed \
        --bench-lock /tmp/BENCH_LOCK                                                # timing on a quiet machine
    python bench/compress.py -o Model.preset=gpt-tiny -o Engine.max_steps=20 ...     # any config override

Building and evaluating is ``gptc pipeline -c configs/pipeline_compress_bench.yaml`` (see that file
for the recipe: pretraining, prune + distill, QAT, PTQ W8A8, weight-only int8/int4, exports,
WikiText-2 / held-out perplexity and LAMBADA on every runtime); it skips what is up to date in
WORKDIR/pipeline. This script only writes the pipeline's input (the corpus files, default
``../shared/data/corpus/*.txt``, cut into ~4 KB shuffled documents as JSONL, so the held-out 2%
mixes both), times, and tabulates:

1. **pipeline.** ``gptc pipeline`` with the config and ``-o`` overrides; its stage times are kept.
2. **speed.** ``bench/decode.py``'s worker per variant x runtime in its own process (prefill of a
   64-token prompt, batch-1 and batch-8 greedy decode of 128 tokens, median of ``--reps``,
   best of ``--rounds`` alternating rounds) and a step worker (fastest single decode step).
   ``--bench-lock FILE`` waits while FILE exists, holds it during the timing and removes it.
   Cached in WORKDIR/speed.json.
3. **table.** The pipeline's evaluation results (WORKDIR/pipeline/eval/*.json) and the timings,
   one row per variant. A model trained minutes on novels and plays is far from Wikipedia and
   LAMBADA: the relative deltas are the figures.

The JSON holds every figure and the issue's goals per int8 variant and runtime: decode >= 1.5x
fp32, WikiText PPL within 2% of fp32, weight file >= 4x smaller.
"""
from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import random
import re
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DECODE = os.path.join(ROOT, "bench", "decode.py")
SHARED = os.path.join(os.path.dirname(ROOT), "shared", "data")
CONFIG = os.path.join(ROOT, "configs", "pipeline_compress_bench.yaml")
VARIANTS = {  # name -> (pipeline artifact, table label); the quant_variants keep their names
    "fp32": ("base", "fp32"),
    "ptq-w8a8": ("ptq-w8a8", "PTQ int8 (W8A8, calibrated)"),
    "qat-w8a8": ("qat-w8a8", "QAT int8 (W8A8)"),
    "woq8": ("woq8", "weight-only int8"),
    "woq4": ("woq4", "weight-only int4"),
    "pruned-distilled": ("compressed", "pruned+distilled (fp32)"),
    "pruned-distilled-qat": ("int8", "pruned+distilled+QAT int8"),
}
INT8 = ("ptq-w8a8", "qat-w8a8", "woq8", "pruned-distilled-qat")  # the rows the goals apply to


def _say(msg: str) -> None:
    print(f"[compress] {msg}", file=sys.stderr, flush=True)


def _write_json(path: str, obj) -> None:
    from gpt_compress.fileio import write_json_atomic

    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_json_atomic(path, obj)


def _read_json(path: str):
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


# --------------------------------------------------------------------------------------
# Phase 1: the pipeline (its input, its run, its results)
# --------------------------------------------------------------------------------------
def corpus_jsonl(files: list[str], out: str, chunk_chars: int = 4000, unwrap: bool = False) -> int:
    """Cut plain-text files into documents of >= ``chunk_chars`` characters at paragraph breaks,
    shuffle them (seed 0) and write JSONL; returns the document count. (A text file is one
    document to the pipeline, which would leave none to hold out.) ``unwrap``: a paragraph's
    hard-wrapped lines joined by spaces, so line breaks are not the text's most frequent token."""
    docs = []
    for path in files:
        with open(path, encoding="utf-8") as f:
            cur = ""
            for para in re.split(r"\n\s*\n", f.read()):
                if unwrap:
                    para = " ".join(line.strip() for line in para.splitlines() if line.strip())
                cur += para + "\n\n"
                if len(cur) >= chunk_chars:
                    docs.append(cur.strip())
                    cur = ""
            if cur.strip():
                docs.append(cur.strip())
    random.Random(0).shuffle(docs)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    from gpt_compress.fileio import write_text_atomic

    write_text_atomic(out, "".join(json.dumps({"text": d}) + "\n" for d in docs))
    return len(docs)


def pipeline_overrides(a, work: str) -> list[str]:
    """The config overrides: the workdir's corpus and output, the shared data, then ``-o``."""
    corpus = os.path.join(work, "corpus.jsonl")
    if not os.path.isfile(corpus):
        corpus_jsonl(sorted(f for pat in a.corpus for f in glob.glob(pat)), corpus)
    return [f"Global.output_dir={os.path.join(work, 'pipeline')}", f"Pipeline.corpus=[{corpus}]",
            f"Pipeline.tokenizer_dir={os.path.join(SHARED, 'gpt2_bpe')}",
            f"Pipeline.eval_wikitext={os.path.join(SHARED, 'wikitext-2', 'wiki.test.raw')}",
            f"Pipeline.eval_lambada={os.path.join(SHARED, 'lambada_test.jsonl')}", *a.override]


def run_pipeline(a, overrides: list[str], timings: dict) -> dict:
    """``gptc pipeline`` (up-to-date stages are skipped); its summary."""
    from gpt_compress.pipeline.stages import gptc

    t0 = time.perf_counter()
    res = gptc(["pipeline", "-c", a.config, *[x for o in overrides for x in ("-o", o)]], "pipeline")
    timings["pipeline"] = round(time.perf_counter() - t0, 1)
    timings["stages"] = {k: v.get("seconds") for k, v in res.get("stages", {}).items()}
    return res


def pipeline_results(a, overrides: list[str]) -> tuple[dict, dict]:
    """(variant -> export dir, quality) from the pipeline's stamps and eval/*.json: per variant and
    runtime the perplexities, LAMBADA and evaluation seconds, named as the table reads them."""
    from gpt_compress.config import build_config, load_yaml
    from gpt_compress.pipeline import Pipeline, PipelineError

    cfg = build_config(load_yaml(a.config), overrides, source=a.config)
    pipe, p = Pipeline(cfg), cfg.pipeline
    artifacts = {"base": "export_base", "compressed": "export_compressed", "int8": "qat",
                 **{v.name: f"quant_{v.name}" for v in p.quant_variants}}
    paths, results = {}, {}
    for v in a.variants:
        art = VARIANTS[v][0]
        try:
            paths[v] = pipe.outputs(artifacts[art])["export"]
            evals = _read_json(pipe.outputs(f"eval_{art}")["result"])
        except (KeyError, PipelineError) as e:
            sys.exit(f"bench/compress.py: the pipeline has no {art!r} artifact for {v} ({e}); "
                     "run without --only-speed, or drop it from --variants")
        got = results.setdefault(v, {"path": paths[v]})
        for r in evals:
            c = got.setdefault(r["backend"], {})
            if r["task"] in ("wikitext", "heldout"):
                c.update({f"{r['task']}_ppl": r["ppl"], f"{r['task']}_tokens": r["num_tokenized_tokens"]})
                if r["task"] == "wikitext":
                    c["wikitext_adjusted_ppl"] = r["adjusted_ppl"]
            elif r["task"] == "lambada":
                c.update(lambada_accuracy=r["accuracy"], lambada_examples=r["num_examples"],
                         lambada_target_ppl=r["target_ppl"])
    settings = {"config": os.path.abspath(a.config), "overrides": overrides, "wikitext": p.eval_wikitext,
                "wikitext_chars": p.eval_max_chars, "seq_len": p.eval_seq_len, "lambada": p.eval_lambada,
                "lambada_limit": p.lambada_limit}
    return paths, {"settings": settings, "results": results}


# --------------------------------------------------------------------------------------
# Phase 3: speed
# --------------------------------------------------------------------------------------
def decode_run(backend: str, path: str, a, env) -> dict:
    cmd = [sys.executable, DECODE, "--worker", backend, path, "--prompt", str(a.prompt), "--new-tokens",
           str(a.new_tokens), "--batch", str(a.batch), "--reps", str(a.reps)]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def step_worker(backend: str, path: str, prompt: int, steps: int = 64, reps: int = 3) -> dict:
    """Batch-1 decode step latency taken one step at a time: the minimum over ``reps x steps``
    steps is the cost undisturbed by neighbours (a shared 2-core machine halves whole runs)."""
    from gpt_compress.inference.runner import Generator

    be = Generator.from_dir(path, backend=backend, verify=False).backend
    ids = np.random.default_rng(0).integers(0, be.manifest.vocab_size, (1, prompt)).astype(np.int64)
    mask, times, pre = np.ones_like(ids), [], []
    for _ in range(reps):
        t = time.perf_counter()
        logits, cache = be.prefill(ids, mask)
        pre.append(time.perf_counter() - t)
        m = mask
        for _ in range(steps):
            nxt = np.array([[int(logits[0].argmax())]], np.int64)
            m = np.concatenate([m, np.ones((1, 1), np.int64)], 1)
            t = time.perf_counter()
            logits, cache = be.decode(nxt, m, cache)
            times.append(time.perf_counter() - t)
    return {"step_ms_min": round(min(times) * 1e3, 3), "step_ms_median": round(float(np.median(times)) * 1e3, 3),
            "prefill_ms_min": round(min(pre) * 1e3, 2)}


@contextlib.contextmanager
def bench_lock(path: str):
    """Wait while ``path`` exists, then hold it (containing this process id) until the block ends."""
    if not path:
        yield False
        return
    waited = time.perf_counter()
    while True:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            break
        except FileExistsError:
            time.sleep(15)
    os.write(fd, f"bench/compress.py pid {os.getpid()}\n".encode())
    os.close(fd)
    _say(f"holding {path} (waited {time.perf_counter() - waited:.0f} s)")
    try:
        yield True
    finally:
        os.remove(path)


def speed(a, work: str, paths: dict, timings: dict) -> dict:
    """Decode/prefill timings per variant x runtime (WORKDIR/speed.json)."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    runs = {(v, b): [] for v in a.variants for b in a.backends}
    with bench_lock(a.bench_lock) as locked:
        t0 = time.perf_counter()
        load = os.getloadavg()[0]
        for r in range(a.rounds):  # alternate the order: a busy neighbour should not favour one variant
            for key in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
                res = decode_run(key[1], paths[key[0]], a, env)
                proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--step-worker", key[1],
                                       paths[key[0]], "--prompt", str(a.prompt)], env=env, cwd=ROOT,
                                      capture_output=True, text=True)
                if proc.returncode == 0:
                    res.update(json.loads(proc.stdout.strip().splitlines()[-1]))
                runs[key].append(res)
                _say(f"speed {key[0]} [{key[1]}] round {r}: " + json.dumps(res))
        timings["speed"] = round(time.perf_counter() - t0, 1)
    key_b = f"batch{a.batch}_decode_tokens_per_s"
    out = {"threads": int(env["OMP_NUM_THREADS"]), "prompt_tokens": a.prompt, "new_tokens": a.new_tokens,
           "batch": a.batch, "reps": a.reps, "rounds": a.rounds, "lock": a.bench_lock if locked else None,
           "loadavg_1min_at_start": round(load, 2), "results": {}}
    for (v, b), rs in runs.items():
        ok = [x for x in rs if "error" not in x]
        out["results"].setdefault(v, {})[b] = rs[-1] if not ok else {
            "decode_tokens_per_s": max(x["decode_tokens_per_s"] for x in ok),
            "batch_decode_tokens_per_s": max(x[key_b] for x in ok), "prefill_ms": min(x["prefill_ms"] for x in ok),
            "rounds": [x["decode_tokens_per_s"] for x in ok],
            "step_ms_min": min((x["step_ms_min"] for x in ok if "step_ms_min" in x), default=None)}
    _write_json(os.path.join(work, "speed.json"), out)
    return out


# --------------------------------------------------------------------------------------
# Table
# --------------------------------------------------------------------------------------
def weight_bytes(path: str) -> dict:
    names = {"onnx": "model.onnx.data", "paddle": "model.pdiparams"}
    return {b: os.path.getsize(os.path.join(path, f)) for b, f in names.items()
            if os.path.isfile(os.path.join(path, f))}


def table(a, paths: dict, qual: dict, spd: dict) -> dict:
    """One row per variant with every figure, each runtime's ratios to its own fp32."""
    rows = {}
    for v in a.variants:
        q = (qual or {}).get("results", {}).get(v, {})
        s = (spd or {}).get("results", {}).get(v, {})
        row = {"label": VARIANTS[v][1], "path": paths[v], "weight_bytes": weight_bytes(paths[v])}
        for b in ("onnx", "paddle"):
            row[b] = {**{k: x for k, x in q.get(b, {}).items()}, **s.get(b, {})}
        rows[v] = row
    base = rows.get("fp32")
    if base:
        for v, row in rows.items():
            for b in ("onnx", "paddle"):
                cur, ref = row[b], base[b]
                if b in row["weight_bytes"] and b in base["weight_bytes"]:
                    cur["size_vs_fp32"] = round(base["weight_bytes"][b] / row["weight_bytes"][b], 2)
                for task in ("wikitext", "heldout"):
                    if f"{task}_ppl" in cur and f"{task}_ppl" in ref:
                        cur[f"{task}_ppl_delta_pct"] = round(100 * (cur[f"{task}_ppl"] / ref[f"{task}_ppl"] - 1), 2)
                if "decode_tokens_per_s" in cur and "decode_tokens_per_s" in ref:
                    cur["decode_vs_fp32"] = round(cur["decode_tokens_per_s"] / ref["decode_tokens_per_s"], 2)
                    cur["batch_vs_fp32"] = round(cur["batch_decode_tokens_per_s"] / ref["batch_decode_tokens_per_s"], 2)
                    cur["prefill_vs_fp32"] = round(ref["prefill_ms"] / cur["prefill_ms"], 2)
                    if ref.get("step_ms_min") and cur.get("step_ms_min"):
                        cur["step_min_vs_fp32"] = round(ref["step_ms_min"] / cur["step_ms_min"], 2)
            if "wikitext_ppl" in row["paddle"] and "wikitext_ppl" in row["onnx"]:  # one export, two runtimes
                row["ppl_paddle_vs_onnx_rel"] = abs(row["paddle"]["wikitext_ppl"] / row["onnx"]["wikitext_ppl"] - 1)
    return rows


def goals(rows: dict) -> dict:
    """The issue's targets per int8 variant and runtime: True / False / None (not measured)."""
    out = {}
    for v in INT8:
        if v not in rows:
            continue
        for b in ("onnx", "paddle"):
            c = rows[v][b]
            d = {t: rows[v]["onnx"].get(f"{t}_ppl_delta_pct") for t in ("wikitext", "heldout")}  # same file
            out[f"{v}/{b}"] = {
                "decode_1.5x": None if "decode_vs_fp32" not in c else c["decode_vs_fp32"] >= 1.5,
                **{f"{t}_ppl_within_2pct": None if x is None else abs(x) <= 2.0 for t, x in d.items()},
                "weights_4x_smaller": None if "size_vs_fp32" not in c else c["size_vs_fp32"] >= 4.0}
    return out


def markdown(rows: dict, spd: dict, qual: dict) -> str:
    def f(x, fmt="{:.1f}"):
        return "-" if x is None else fmt.format(x)

    def ratio(c, k):
        return f" ({c[k]:.2f}x)" if k in c else ""

    qs = (qual or {}).get("settings", {})
    head = ("| variant | ONNX data MB | pdiparams MB | held-out PPL | WikiText-2 PPL | LAMBADA acc |"
            " ORT prefill ms | ORT b1 tok/s | ORT b8 tok/s | Paddle prefill ms | Paddle b1 tok/s | Paddle b8 tok/s |")
    lines = [head, "|---|" + "---:|" * 11]

    def ppl(c, task):
        if f"{task}_ppl" not in c:
            return "-"
        d = c.get(f"{task}_ppl_delta_pct")
        base = c is rows.get("fp32", {}).get("onnx")
        return f"{c[f'{task}_ppl']:.1f}" + ("" if d is None or base else f" ({d:+.2f}%)")

    for v, r in rows.items():
        o, p = r["onnx"], r["paddle"]
        wb = r["weight_bytes"]
        cells = [r["label"], f(wb.get("onnx", 0) / 1e6) + ratio(o, "size_vs_fp32"),
                 f(wb.get("paddle", 0) / 1e6) + ratio(p, "size_vs_fp32"), ppl(o, "heldout"), ppl(o, "wikitext"),
                 f(o.get("lambada_accuracy"), "{:.3f}")]
        for c in (o, p):
            cells += [f(c.get("prefill_ms"), "{:.1f}") + ratio(c, "prefill_vs_fp32"),
                      f(c.get("decode_tokens_per_s")) + ratio(c, "decode_vs_fp32"),
                      f(c.get("batch_decode_tokens_per_s"), "{:.0f}") + ratio(c, "batch_vs_fp32")]
        lines.append("| " + " | ".join(cells) + " |")
    notes = []
    if qs:
        q0 = next(iter((qual or {}).get("results", {}).values()), {}).get("onnx", {})
        notes.append(f"Quality on onnxruntime, windows of {qs['seq_len']} tokens (the training length), FleetX "
                     f"protocol: held-out = the corpus documents the pipeline kept out of training "
                     f"({q0.get('heldout_tokens', 0):,} GPT-2 tokens); WikiText-2 `wiki.test.raw`, first "
                     f"{qs['wikitext_chars']:,} characters ({q0.get('wikitext_tokens', 0):,} tokens); LAMBADA strict "
                     f"accuracy on the first {qs['lambada_limit']} examples.")
        checks = [f"{v} {r['ppl_paddle_vs_onnx_rel']:.1e}" for v, r in rows.items() if "ppl_paddle_vs_onnx_rel" in r]
        if checks:
            notes.append("Paddle Inference vs onnxruntime perplexity (relative difference): " + ", ".join(checks) + ".")
    if spd:
        notes.append(f"Speed: {spd['prompt_tokens']}-token prompt, {spd['new_tokens']} new greedy tokens, "
                     f"batch 1 and {spd['batch']}, OMP_NUM_THREADS={spd['threads']}, best of {spd['rounds']} rounds "
                     f"(median of {spd['reps']} each); "
                     + ("timed holding " + spd["lock"] if spd.get("lock") else "no bench lock held")
                     + f", 1-min load average at start {spd['loadavg_1min_at_start']}. Ratios: each runtime "
                       "against its own fp32.")
    return "\n".join(lines) + "\n\n" + "\n".join(notes) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", default=os.path.join(ROOT, "output", "bench_compress"),
                   help="corpus, the pipeline's output and cached timings (reused)")
    p.add_argument("--config", default=CONFIG, help="the gptc pipeline config")
    p.add_argument("-o", "--override", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="config override for the pipeline (repeatable)")
    p.add_argument("--corpus", nargs="+", default=[os.path.join(SHARED, "corpus", "*.txt")])
    p.add_argument("--variants", default=",".join(VARIANTS), help="rows of the table (and timed)")
    p.add_argument("--backends", default="onnx,paddle", help="timed runtimes")
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--skip-speed", action="store_true", help="build and evaluate only")
    p.add_argument("--only-speed", action="store_true", help="time the exports an earlier run built")
    p.add_argument("--bench-lock", default="", help="wait for this file to vanish, hold it while timing")
    p.add_argument("--markdown", default="", help="also write the table here")
    p.add_argument("--step-worker", nargs=2, metavar=("BACKEND", "PATH"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.step_worker:
        print(json.dumps(step_worker(a.step_worker[0], a.step_worker[1], a.prompt)))
        return
    a.variants = [v for v in a.variants.split(",") if v]
    unknown = [v for v in a.variants if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    a.backends = [b for b in a.backends.split(",") if b]
    work = os.path.abspath(a.workdir)
    os.makedirs(work, exist_ok=True)
    timings: dict = {}
    overrides = pipeline_overrides(a, work)
    if not a.only_speed:
        run_pipeline(a, overrides, timings)
    paths, qual = pipeline_results(a, overrides)
    spd = None if a.skip_speed else speed(a, work, paths, timings)
    if spd is None:
        spd = _read_json(os.path.join(work, "speed.json"))
    rows = table(a, paths, qual, spd)
    report = {"bench": "compress", "workdir": work, "quality_settings": qual["settings"],
              "speed_settings": {k: x for k, x in (spd or {}).items() if k != "results"}, "results": rows,
              "goals": goals(rows), "seconds": timings}
    if a.markdown:
        with open(a.markdown, "w", encoding="utf-8") as f:
            f.write(markdown(rows, spd, qual))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
