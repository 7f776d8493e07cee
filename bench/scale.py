"""Every command at the sizes users train (gpt-345M, gpt-1.3B): wall time and peak RSS of each.

For each preset, in order, each a ``gptc`` child process measured alone (wall time, and the peak
resident set size of that process from ``/usr/bin/time``: a fresh process, so the figure holds
nothing of this script's memory, which ``ru_maxrss`` of a forked child can), next to the float32
weight bytes:

1. ``init``: random-init checkpoint;
2. ``pretrain``: one step, ``Model.recompute=full``, micro batch 1, sequence 1024 (the step, the
   model build and the closing checkpoint save);
3. ``export``: ``--format all`` (Paddle Inference with the fused program + ONNX, all validated
   against dygraph);
4. ``ptq``: weight-only int8 (``Quant.targets=[] Quant.weight_only=["*"]``, blocks of 32; no
   calibration), its int8 export in both formats (``--no-validate``: a random-init model's int8
   logits legitimately miss the parity gate, see ``export/int8.py``) and the closing evaluation
   on 1 batch of each backend; ``ptq_int4`` the same at 4 bits, ``ptq_w8a8`` W8A8 (calibrated on
   ``Quant.calib_batches`` batches) -- not in the default steps;
5. ``eval``: WikiText-2 test perplexity over 50 windows of 1024 tokens (a prefix of
   ``wiki.test.raw``), onnxruntime, batch 1;
6. ``decode``: 64 prompt tokens + 64 greedy new tokens with ``gptc infer``, once per runtime
   (fused Paddle and onnxruntime) on the float export, and (``*_int8``) on the ``ptq`` int8 one.

Prints one JSON document (also written to ``--output``). Run the whole script inside a memory
cgroup on a shared machine (children inherit it), one preset at a time if memory is tight:

    bash -c 'echo $$ > /sys/fs/cgroup/memory/big/cgroup.procs; exec python bench/scale.py --work /tmp/scale'

A command refused by the pre-flight memory check (``gpt_compress/memory.py``) or killed is
recorded with its exit code and the last line of its stderr; the later commands of that preset
that need its output are skipped.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.path.join(os.path.dirname(ROOT), "shared", "data")
PRESETS = ("gpt-345M", "gpt-1.3B")
STEPS = ("init", "pretrain", "export", "decode_onnx", "decode_paddle", "ptq", "decode_onnx_int8",
         "decode_paddle_int8", "ptq_int4", "ptq_w8a8", "eval")  # run in this order (the long eval last)
DEFAULT_STEPS = tuple(s for s in STEPS if s not in ("ptq_int4", "ptq_w8a8"))
TIME = "/usr/bin/time"


def run_child(args: list[str], log: str) -> dict:
    """Run ``python -m gpt_compress *args``; wall seconds, peak RSS (GiB, ``/usr/bin/time``'s
    maximum resident set size of that process), exit code, its JSON result (last stdout line) or
    the last stderr line."""
    t0 = time.perf_counter()
    with open(log + ".out", "w") as out, open(log + ".err", "w") as err:
        code = subprocess.call([TIME, "-f", "%M", "-o", log + ".time", sys.executable, "-m", "gpt_compress", *args],
                               stdout=out, stderr=err, env={**os.environ, "PYTHONPATH": ROOT})
    with open(log + ".time", encoding="utf-8") as f:
        kb = [int(x) for x in f.read().split() if x.isdigit()]
    res = {"seconds": round(time.perf_counter() - t0, 1), "peak_rss_gb": round(kb[-1] / 2 ** 20, 2) if kb else None,
           "exit_code": code}
    lines = [x for x in open(log + ".out").read().splitlines() if x.strip()]
    if res["exit_code"] == 0:
        try:
            res["result"] = json.loads(lines[-1]) if lines else None
        except ValueError:
            res["result"] = lines[-1][:300] if lines else None
    else:
        errs = [x for x in open(log + ".err").read().splitlines() if x.strip()]
        res["error"] = errs[-1][:500] if errs else None
    return res


def wikitext_prefix(path: str, tokenizer_dir: str, tokens: int, out: str) -> str:
    """Write the shortest prefix of WikiText file ``path`` (whole lines) holding ``tokens`` tokens."""
    sys.path.insert(0, ROOT)
    from gpt_compress.data.tokenizer import Tokenizer

    tok = Tokenizer.load(tokenizer_dir)
    with open(path, encoding="utf-8", newline="") as f:
        lines = f.readlines()
    lo, hi = 1, len(lines)
    while lo < hi:  # smallest line count whose text has >= tokens tokens
        mid = (lo + hi) // 2
        if len(tok.encode("".join(lines[:mid]))) >= tokens:
            hi = mid
        else:
            lo = mid + 1
    with open(out, "w", encoding="utf-8", newline="") as f:
        f.write("".join(lines[:lo]))
    return out


def corpus(work: str, tokenizer_dir: str) -> str:
    """tinyshakespeare tokenized with the GPT-2 BPE (the pretrain/ptq data); returns the prefix."""
    prefix = os.path.join(work, "data", "corpus_text_document")
    if os.path.isfile(prefix + ".idx"):
        return prefix
    os.makedirs(os.path.dirname(prefix), exist_ok=True)
    text = open(os.path.join(SHARED, "corpus", "tinyshakespeare.txt"), encoding="utf-8").read()
    jsonl = os.path.join(work, "data", "corpus.jsonl")
    with open(jsonl, "w", encoding="utf-8") as f:
        for i in range(0, len(text), 4000):
            f.write(json.dumps({"text": text[i:i + 4000]}) + "\n")
    res = run_child(["preprocess", "--input", jsonl, "--output-prefix", os.path.join(work, "data", "corpus"),
                     "--tokenizer-dir", tokenizer_dir, "--workers", "1"], os.path.join(work, "data", "preprocess"))
    if res["exit_code"] != 0:
        raise SystemExit(f"preprocess failed: {res.get('error')}")
    return prefix


def bench_preset(preset: str, work: str, a, data_prefix: str, wiki: str, save=lambda: None) -> dict:
    """Every step for one preset; returns {"weight_bytes", "parameters", step: measurement}, calling
    ``save`` after each step (the dict so far is the returned one)."""
    sys.path.insert(0, ROOT)
    from gpt_compress.config import ModelConfig

    cfg = ModelConfig.from_preset(preset)
    d = os.path.join(work, preset)
    os.makedirs(d, exist_ok=True)
    ckpt, exp = os.path.join(d, "ckpt"), os.path.join(d, "export")
    data = ["-o", f"Data.data_prefix=[{data_prefix}]", "-o", f"Data.tokenizer_dir={a.tokenizer}",
            "-o", "Data.split=[98,2,0]"]
    prompt = ",".join(str(i) for i in range(1000, 1064))  # 64 prompt tokens
    decode = ["-o", "Generation.max_new_tokens=64", "-o", "Generation.min_new_tokens=64", "--no-stream"]

    def ptq(name: str, *quant: str) -> list[str]:
        return ["ptq", "--model", ckpt, *data, "-o", "Data.seq_length=256", "-o", "Engine.micro_batch_size=1",
                "-o", "Engine.global_batch_size=1", "-o", "Engine.max_steps=1", "-o", "Engine.eval_iters=1",
                *[x for q in quant for x in ("-o", q)], "-o", f"Global.output_dir={os.path.join(d, name)}",
                "--no-progress", "--no-validate"]  # random init: int8 parity is checked on trained models (tests)

    weight_only = ("Quant.targets=[]", 'Quant.weight_only=["*"]', "Quant.weight_block_size=32")
    int8 = os.path.join(d, "ptq", "int8")
    steps = {
        "init": ["init", "-o", f"Model.preset={preset}", "-o", f"Data.tokenizer_dir={a.tokenizer}",
                 "--output", ckpt],
        "pretrain": ["pretrain", "-o", f"Model.preset={preset}", "-o", "Model.recompute=full", *data,
                     "-o", "Data.seq_length=1024", "-o", "Engine.micro_batch_size=1",
                     "-o", "Engine.global_batch_size=1", "-o", "Engine.max_steps=1", "-o", "Engine.eval_freq=0",
                     "-o", "Engine.eval_iters=1", "-o", "Engine.logging_freq=1",
                     "-o", f"Global.output_dir={os.path.join(d, 'pretrain')}", "--no-progress"],
        "export": ["export", "--model", ckpt, "--output", exp, "--format", "all"],
        "ptq": ptq("ptq", *weight_only, "Quant.weight_bits=8"),
        "ptq_int4": ptq("ptq_int4", *weight_only, "Quant.weight_bits=4"),
        "ptq_w8a8": ptq("ptq_w8a8", "Quant.calib_batches=4"),
        "eval": ["eval", "--model", exp, "--backend", "onnx", "--task", "wikitext", "--data", wiki,
                 "--seq-len", "1024", "--batch-size", "1", "--no-progress"],
        "decode_onnx": ["infer", "--model-dir", exp, "--backend", "onnx", "--prompt-ids", prompt, *decode],
        "decode_paddle": ["infer", "--model-dir", exp, "--backend", "paddle", "--prompt-ids", prompt, *decode],
        "decode_onnx_int8": ["infer", "--model-dir", int8, "--backend", "onnx", "--prompt-ids", prompt, *decode],
        "decode_paddle_int8": ["infer", "--model-dir", int8, "--backend", "paddle", "--prompt-ids", prompt, *decode],
    }
    needs = {"pretrain": None, "export": "init", "ptq": "init", "ptq_int4": "init", "ptq_w8a8": "init",
             "eval": "export", "decode_onnx": "export", "decode_paddle": "export", "decode_onnx_int8": "ptq",
             "decode_paddle_int8": "ptq"}
    out = {"parameters": cfg.num_parameters(), "weight_bytes": 4 * cfg.num_parameters()}
    save(out)
    for name in STEPS:
        if name not in a.steps:
            continue
        dep = needs.get(name)
        if dep and (out.get(dep, {}).get("exit_code", 0) != 0 or "skipped" in out.get(dep, {})):
            out[name] = {"skipped": f"{dep} failed"}
            continue
        res = run_child(steps[name], os.path.join(d, name))
        if res["peak_rss_gb"] is not None:
            res["peak_rss_x_weights"] = round(res["peak_rss_gb"] * 2 ** 30 / out["weight_bytes"], 2)
        out[name] = res
        save(out)
        print(json.dumps({preset: {name: {k: v for k, v in res.items() if k != "result"}}}), file=sys.stderr,
              flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", required=True, help="scratch directory (checkpoints and exports: ~30 GB for both)")
    p.add_argument("--presets", nargs="+", default=list(PRESETS))
    p.add_argument("--steps", nargs="+", default=list(DEFAULT_STEPS), choices=STEPS)
    p.add_argument("--tokenizer", default=os.path.join(SHARED, "gpt2_bpe"))
    p.add_argument("--wikitext", default=os.path.join(SHARED, "wikitext-2", "wiki.test.raw"))
    p.add_argument("--windows", type=int, default=50, help="WikiText windows of 1024 tokens")
    p.add_argument("--output", default=None, help="also write the JSON here")
    a = p.parse_args()
    os.makedirs(a.work, exist_ok=True)
    data_prefix = corpus(a.work, a.tokenizer)
    wiki = wikitext_prefix(a.wikitext, a.tokenizer, a.windows * 1024 + 1, os.path.join(a.work, "wikitext_prefix.raw"))
    result = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                          "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "load_average_start": os.getloadavg(),
                          "note": "shared machine: other jobs ran at the same time (contended timings)"},
              "presets": {}}

    def save(preset: str, rows: dict) -> None:  # after every step: a run cut short keeps what it measured
        result["presets"][preset] = rows
        result["machine"]["load_average_end"] = os.getloadavg()
        if a.output:
            with open(a.output, "w", encoding="utf-8") as f:
                json.dump(result, f, indent=1)

    for preset in a.presets:
        bench_preset(preset, a.work, a, data_prefix, wiki, lambda rows, p=preset: save(p, rows))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
