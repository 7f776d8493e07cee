"""Compression benchmark: a gpt-bench pretrained on real text, its compressed variants built with
the `gptc` commands users run, and one table of size, quality and speed, each runtime
(onnxruntime, Paddle Inference) against its own fp32. Prints one JSON object.

    OMP_NUM_THREADS=2 python bench/compress.py --workdir /tmp/compress_wd --markdown table.md
    OMP_NUM_THREADS=2 python bench/compress.py --workdir /tmp/compress_wd --skip-speed       # build + quality
    OMP_NUM_THREADS=2 python bench/compress.py --workdir /tmp/compress_wd --only-speed \
        --bench-lock /tmp/BENCH_LOCK                                                # timing on a quiet machine

Phases (each reuses what an earlier run left in ``--workdir``):

1. **build.** The corpus files (default ``../shared/data/corpus/*.txt``: Jane Austen + tiny
   Shakespeare) are cut into ~4 KB documents (shuffled, so the 2% validation split mixes both)
   and written as JSONL; ``gptc preprocess`` tokenizes them with the GPT-2 BPE
   (``--tokenizer``); ``gptc pretrain -c configs/pretrain_gpt_bench.yaml`` trains gpt-bench
   (6 x 384, 6 heads, vocab 50,304) for ``--pretrain-steps`` steps of batch 8 x seq 256
   (dropout off, LR 1.5e-3 -> 1.5e-4 cosine; 180 steps: ~10 min at 3.1 s/step on 2 quiet cores,
   28 min on cores shared with other jobs; validation perplexity ~337; `gptc` applies
   ``runtime.tune_cpu``, which halves the step time). ``--model CKPT`` skips pretraining. Then, from that checkpoint:
   ``gptc ptq`` (W8A8 block Linears calibrated on 16 batches of the training data, token
   embedding = tied LM head and positions weight-only int8), ``gptc qat`` (same layers,
   ``--qat-steps`` of FleetX-style finetuning: small LR, dropout off, embeddings frozen),
   ``gptc ptq`` weight-only int8 and int4 (every matrix incl. the LM head, blocks of 32),
   ``gptc prune`` (25% of heads and FFN channels per layer, Taylor importance) then
   ``gptc distill`` from the fp32 teacher (``--distill-steps``), and ``gptc qat`` of the
   pruned+distilled model. Every variant is exported by ``gptc export`` (paddle + onnx).
2. **quality.** On onnxruntime, windows of ``--seq-len`` = the training length (positions beyond
   it were never trained), FleetX perplexity protocol: perplexity of the held-out 2% of the
   training documents (in-domain), WikiText-2 perplexity (``wiki.test.raw`` as one string, first
   ``--wikitext-chars`` characters) and LAMBADA strict accuracy (first ``--lambada-limit``
   examples); WikiText-2 on Paddle Inference too for ``--paddle-ppl`` variants (the runtimes
   should agree). Cached in WORKDIR/quality.json per settings. A model trained minutes on
   novels and plays is far from Wikipedia and LAMBADA: the relative deltas are the figures.
3. **speed.** ``bench/decode.py``'s worker per variant x runtime in its own process (prefill of a
   64-token prompt, batch-1 and batch-8 greedy decode of 128 tokens, median of ``--reps``,
   best of ``--rounds`` alternating rounds) and a step worker (fastest single decode step).
   ``--bench-lock FILE`` waits while FILE exists, holds it during the timing and removes it.
   Cached in WORKDIR/speed.json.

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
VARIANTS = {  # name -> table label
    "fp32": "fp32",
    "ptq-w8a8": "PTQ int8 (W8A8, calibrated)",
    "qat-w8a8": "QAT int8 (W8A8)",
    "woq8": "weight-only int8",
    "woq4": "weight-only int4",
    "pruned-distilled": "pruned+distilled (fp32)",
    "pruned-distilled-qat": "pruned+distilled+QAT int8",
}
INT8 = ("ptq-w8a8", "qat-w8a8", "woq8", "pruned-distilled-qat")  # the rows the goals apply to
W8A8_QUANT = ['Quant.targets=["gpt.blocks.*"]', 'Quant.weight_only=["gpt.wte","gpt.wpe"]']
WOQ_QUANT = ["Quant.targets=[]", 'Quant.weight_only=["*"]', "Quant.weight_block_size=32"]
QAT_OPT = ["Optimizer.weight_decay=0.02", "Optimizer.beta2=0.999", "Optimizer.lr.max_lr=2.0e-5",
           "Optimizer.lr.min_lr=2.0e-6", "Optimizer.lr.warmup_rate=0.05"]  # FleetX QAT: small LR, beta2 0.999


def _say(msg: str) -> None:
    print(f"[compress] {msg}", file=sys.stderr, flush=True)


def _write_json(path: str, obj) -> None:
    from gpt_compress.checkpoint import write_json_atomic

    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_json_atomic(path, obj)


def _read_json(path: str):
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


# --------------------------------------------------------------------------------------
# Phase 1: data, pretraining, variants, exports (all through `gptc`)
# --------------------------------------------------------------------------------------
def corpus_jsonl(files: list[str], out: str, chunk_chars: int = 4000) -> int:
    """Cut plain-text files into documents of >= ``chunk_chars`` characters at paragraph breaks,
    shuffle them (seed 0) and write JSONL; returns the document count. (`gptc preprocess` takes
    a text file as one document, which would leave no document for the validation split.)"""
    docs = []
    for path in files:
        with open(path, encoding="utf-8") as f:
            cur = ""
            for para in re.split(r"\n\s*\n", f.read()):
                cur += para + "\n\n"
                if len(cur) >= chunk_chars:
                    docs.append(cur.strip())
                    cur = ""
            if cur.strip():
                docs.append(cur.strip())
    random.Random(0).shuffle(docs)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out + ".tmp", "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
    os.replace(out + ".tmp", out)
    return len(docs)


def step(work: str, name: str, args: list, timings: dict) -> dict:
    """Run ``gptc ARGS`` once: its JSON summary is kept in WORKDIR/NAME/summary.json and reused."""
    from gpt_compress.pipeline.stages import gptc

    done = os.path.join(work, name, "summary.json")
    res = _read_json(done)
    if res is None:
        t0 = time.perf_counter()
        res = gptc([str(x) for x in args], name)
        res["bench_seconds"] = round(time.perf_counter() - t0, 1)
        _write_json(done, res)
    timings[name] = res.get("bench_seconds")
    return res


def _o(overrides: list[str]) -> list[str]:
    return [x for o in overrides for x in ("-o", o)]


def build(a, work: str, timings: dict) -> dict:
    """Every variant's export directory (built if missing)."""
    data_dir = os.path.join(work, "data")
    prefix = os.path.join(data_dir, "corpus_text_document")
    if not os.path.isfile(prefix + ".idx"):
        files = sorted(f for pat in a.corpus for f in glob.glob(pat))
        corpus_jsonl(files, os.path.join(data_dir, "corpus.jsonl"))
    step(work, "data", ["preprocess", "--input", os.path.join(data_dir, "corpus.jsonl"), "--output-prefix",
                        os.path.join(data_dir, "corpus"), "--tokenizer-dir", a.tokenizer], timings)
    data = [f"Data.data_prefix=[{prefix}]", f"Data.tokenizer_dir={a.tokenizer}", "Data.split=[98,2,0]",
            f"Data.seq_length={a.seq_len}"]
    base = ["-c", os.path.join(ROOT, "configs", "pretrain_gpt_bench.yaml")]

    def out(name: str) -> str:
        return os.path.join(work, name)

    def run(name: str, command: str, overrides: list[str], key: str, *extra: str) -> str:
        args = [command, *base, *extra, *_o(data + [f"Global.output_dir={out(name)}", *overrides])]
        return step(work, name, args + ([] if command == "prune" else ["--no-progress"]), timings)[key]

    wanted, ev = set(a.variants), ["Engine.eval_iters=8"]
    qat = ev + W8A8_QUANT + QAT_OPT + [f"Engine.max_steps={a.qat_steps}", "Engine.eval_freq=0", "Engine.save_steps=0",
                                       "Engine.logging_freq=10", "Quant.calib_batches=8"]
    teacher = os.path.abspath(a.model) if a.model else run("pretrain", "pretrain", [
        f"Engine.max_steps={a.pretrain_steps}", "Engine.logging_freq=10", "Engine.eval_freq=60",
        "Engine.eval_iters=8", "Engine.save_steps=60", "Engine.keep_checkpoint_max=1", "Engine.resume=auto",
        "Model.hidden_dropout_prob=0.0", "Model.attention_probs_dropout_prob=0.0", "Optimizer.lr.max_lr=1.5e-3",
        "Optimizer.lr.min_lr=1.5e-4", "Optimizer.lr.warmup_rate=0.05"], "checkpoint")
    ckpts = {"fp32": teacher}
    quant = "quantized_checkpoint"
    if "ptq-w8a8" in wanted:
        calib = ["Quant.calib_batches=16", "Engine.max_steps=16"]  # 16 x 8 training samples
        ckpts["ptq-w8a8"] = run("ptq-w8a8", "ptq", ev + W8A8_QUANT + calib, quant, "--model", teacher,
                                "--format", "none")
    for v, bits in (("woq8", 8), ("woq4", 4)):
        if v in wanted:
            ckpts[v] = run(v, "ptq", ev + WOQ_QUANT + [f"Quant.weight_bits={bits}", "Engine.max_steps=1"], quant,
                           "--model", teacher, "--format", "none")
    if "qat-w8a8" in wanted:
        ckpts["qat-w8a8"] = run("qat-w8a8", "qat", qat, quant, "--model", teacher, "--format", "none")
    if wanted & {"pruned-distilled", "pruned-distilled-qat"}:
        pruned = run("prune", "prune", ev + ["Prune.head_ratio=0.25", "Prune.ffn_ratio=0.25",
                                             "Prune.criterion=taylor", "Prune.calib_batches=8"], "output",
                     "--model", teacher, "--output", out("prune/model"), "--overwrite")
        ckpts["pruned-distilled"] = run("distill", "distill", ev + [
            f"Distill.teacher={teacher}", f"Distill.student={pruned}", "Distill.temperature=2.0",
            "Distill.alpha=0.5", f"Engine.max_steps={a.distill_steps}", "Engine.eval_freq=0",
            "Engine.save_steps=0", "Engine.logging_freq=10", "Optimizer.lr.max_lr=5.0e-4",
            "Optimizer.lr.min_lr=5.0e-5", "Optimizer.lr.warmup_rate=0.05"], "checkpoint")
        if "pruned-distilled-qat" in wanted:
            ckpts["pruned-distilled-qat"] = run("pruned-distilled-qat", "qat", qat, quant,
                                                "--model", ckpts["pruned-distilled"], "--format", "none")
    paths = {}
    for v in a.variants:
        res = step(work, f"exports/{v}", ["export", "--model", ckpts[v], "--output", out(f"exports/{v}/model"),
                                          "--format", "all", "--overwrite"], timings)
        paths[v] = res["output"]
    return paths


def exported_paths(a, work: str) -> dict:
    """The export directories an earlier build left (``--only-speed``)."""
    paths = {}
    for v in a.variants:
        res = _read_json(os.path.join(work, "exports", v, "summary.json"))
        if res is None:
            sys.exit(f"bench/compress.py: {v} was not built in {work}; run without --only-speed first")
        paths[v] = res["output"]
    return paths


# --------------------------------------------------------------------------------------
# Phase 2: quality
# --------------------------------------------------------------------------------------
def wikitext_prefix(src: str, chars: int, work: str) -> str:
    """The first ``chars`` characters of ``src`` cut at a line end (the whole file for 0)."""
    from gpt_compress.eval.wikitext import write_text_prefix

    return write_text_prefix(src, chars, os.path.join(work, "eval", f"wikitext_first_{chars}_chars.txt"))


def heldout_text(work: str) -> str:
    """The validation documents of the training split (``Data.split=[98,2,0]``) as one text file:
    in-domain perplexity, which WikiText (Wikipedia vs novels and plays) is not."""
    from gpt_compress.data.dataset import split_documents

    path = os.path.join(work, "eval", "heldout.txt")
    if not os.path.isfile(path):
        with open(os.path.join(work, "data", "corpus.jsonl"), encoding="utf-8") as f:
            docs = [json.loads(line)["text"] for line in f if line.strip()]
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write("\n\n".join(docs[i] for i in split_documents(len(docs), [98, 2, 0])[1]) + "\n")
    return path


def quality(a, work: str, paths: dict, timings: dict) -> dict:
    """Perplexities and LAMBADA per variant, cached per settings in WORKDIR/quality.json (each
    result is merged into the file as it is made, so runs over different variants can share it)."""
    from gpt_compress.eval.lambada import evaluate_lambada
    from gpt_compress.eval.wikitext import evaluate_wikitext
    from gpt_compress.inference.runner import Generator

    texts = {"wikitext": wikitext_prefix(a.wikitext, a.wikitext_chars, work), "heldout": heldout_text(work)}
    settings = {"wikitext": os.path.abspath(a.wikitext), "wikitext_chars": a.wikitext_chars, "seq_len": a.seq_len,
                "lambada": os.path.abspath(a.lambada), "lambada_limit": a.lambada_limit, "heldout": texts["heldout"]}
    cache_path = os.path.join(work, "quality.json")

    def load() -> dict:
        cache = _read_json(cache_path) or {}
        return cache if cache.get("settings") == settings else {"settings": settings, "results": {}}

    t0 = time.perf_counter()
    for v in a.variants:
        got = load()["results"].get(v, {})
        if got.get("path") != paths[v]:
            got = {"path": paths[v]}
        for backend in ("onnx", "paddle"):
            tasks = ("wikitext", "heldout", "lambada") if backend == "onnx" else ("wikitext",)
            r = got.setdefault(backend, {})
            todo = [t for t in tasks if f"{t}_seconds" not in r]
            if not todo or (backend == "paddle" and v not in a.paddle_ppl):
                continue
            gen = Generator.from_dir(paths[v], backend=backend)
            for task in todo:
                t = time.perf_counter()
                if task == "lambada":
                    lam = evaluate_lambada(gen, gen.tokenizer, a.lambada, seq_len=a.seq_len, batch_size=16,
                                           limit=a.lambada_limit, progress=False)
                    r.update(lambada_accuracy=lam.accuracy, lambada_examples=lam.num_examples,
                             lambada_target_ppl=lam.target_ppl)
                else:
                    w = evaluate_wikitext(gen, gen.tokenizer, texts[task], "raw", seq_len=a.seq_len, batch_size=8,
                                          progress=False)
                    r.update({f"{task}_ppl": w.ppl, f"{task}_tokens": w.num_tokenized_tokens})
                    if task == "wikitext":
                        r["wikitext_adjusted_ppl"] = w.adjusted_ppl
                r[f"{task}_seconds"] = round(time.perf_counter() - t, 1)
                cache = load()
                cache["results"][v] = got
                _write_json(cache_path, cache)
            _say(f"quality {v} [{backend}]: " + ", ".join(f"{k} {r[k]:.4g}" for k in r if isinstance(r[k], float)))
    timings["quality"] = round(time.perf_counter() - t0, 1)
    return load()


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
        row = {"label": VARIANTS[v], "path": paths[v], "weight_bytes": weight_bytes(paths[v])}
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
                     f"protocol: held-out = the 2% validation documents of the training corpus "
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
                   help="data, checkpoints, exports and cached results (reused)")
    p.add_argument("--model", default="", help="float checkpoint to compress instead of pretraining one")
    p.add_argument("--corpus", nargs="+", default=[os.path.join(SHARED, "corpus", "*.txt")])
    p.add_argument("--tokenizer", default=os.path.join(SHARED, "gpt2_bpe"), help="GPT-2 BPE directory")
    p.add_argument("--pretrain-steps", type=int, default=180, help="batch 8 x seq 256 steps (3.1 s each on 2 cores)")
    p.add_argument("--qat-steps", type=int, default=100)
    p.add_argument("--distill-steps", type=int, default=100)
    p.add_argument("--seq-len", type=int, default=256, help="training length, also the evaluation window")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--wikitext", default=os.path.join(SHARED, "wikitext-2", "wiki.test.raw"))
    p.add_argument("--wikitext-chars", type=int, default=200_000, help="evaluate this prefix (0: whole file)")
    p.add_argument("--lambada", default=os.path.join(SHARED, "lambada_test.jsonl"))
    p.add_argument("--lambada-limit", type=int, default=500)
    p.add_argument("--paddle-ppl", default="fp32,ptq-w8a8", help="variants whose PPL is also taken on Paddle")
    p.add_argument("--backends", default="onnx,paddle", help="timed runtimes")
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--skip-speed", action="store_true", help="build and evaluate only")
    p.add_argument("--skip-quality", action="store_true", help="no perplexity / LAMBADA runs (cached ones are shown)")
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
    a.paddle_ppl = [v for v in a.paddle_ppl.split(",") if v]
    work = os.path.abspath(a.workdir)
    os.makedirs(work, exist_ok=True)
    timings: dict = {}
    if a.only_speed:
        paths = exported_paths(a, work)
        qual = _read_json(os.path.join(work, "quality.json"))
    else:
        paths = build(a, work, timings)
        qual = _read_json(os.path.join(work, "quality.json")) if a.skip_quality else quality(a, work, paths, timings)
    spd = None if a.skip_speed else speed(a, work, paths, timings)
    if spd is None:
        spd = _read_json(os.path.join(work, "speed.json"))
    rows = table(a, paths, qual, spd)
    pre = _read_json(os.path.join(work, "pretrain", "summary.json")) if not a.model else None
    report = {"bench": "compress", "workdir": work, "model": a.model or (pre or {}).get("checkpoint"),
              "pretrain": pre, "quality_settings": (qual or {}).get("settings"),
              "speed_settings": {k: x for k, x in (spd or {}).items() if k != "results"}, "results": rows,
              "goals": goals(rows), "seconds": timings}
    if a.markdown:
        with open(a.markdown, "w", encoding="utf-8") as f:
            f.write(markdown(rows, spd, qual))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
