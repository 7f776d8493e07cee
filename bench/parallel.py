"""Parallel training on CPU, gpt-bench (batch 8 x seq 256, fp32, AdamW), through the real CLI:

* tokens/s of dp2 (2 gloo processes x 1 thread) against 1 process x 2 threads on the same
  global batch (``gptc pretrain`` under ``paddle.distributed.launch``; median of the logged
  steps after the first two);
* mp2 tokens/s and the share of an mp2 step spent in communication, from the Paddle profiler's
  host trace (every all-reduce / all-gather / reshard / send / recv event, summed per rank).

    python bench/parallel.py [--steps 8] [--workdir /tmp/gptc_bench_parallel]

Prints one JSON object. Data: tinyshakespeare tokenized with the GPT-2 BPE from ../shared/data.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.path.join(os.path.dirname(ROOT), "shared", "data")
GPTC = os.path.join(os.path.dirname(sys.executable), "gptc")
COMM_WORDS = ("allreduce", "all_reduce", "allgather", "all_gather", "reshard", "broadcast", "send", "recv",
              "reduce_scatter", "alltoall", "barrier", "gloo")


def prepare_data(workdir: str) -> tuple[str, str]:
    """(tokenizer dir, dataset prefix): tinyshakespeare in GPT-2 BPE, built once."""
    prefix = os.path.join(workdir, "shakespeare")
    tok_dir = os.path.join(SHARED, "gpt2_bpe")
    if not os.path.isfile(prefix + "_text_document.idx"):
        from gpt_compress.data.preprocess import preprocess
        from gpt_compress.data.tokenizer import Tokenizer

        text = open(os.path.join(SHARED, "corpus", "tinyshakespeare.txt"), encoding="utf-8").read()
        jsonl = os.path.join(workdir, "shakespeare.jsonl")
        with open(jsonl, "w", encoding="utf-8") as f:
            for para in (p.strip() for p in text.split("\n\n")):
                if para:
                    f.write(json.dumps({"text": para}) + "\n")
        preprocess([jsonl], prefix, Tokenizer.load(tok_dir), progress=False)
    return tok_dir, prefix + "_text_document"


def overrides(tok_dir, prefix, out, steps, micro, parallel=()):
    o = {"Model.preset": "gpt-bench", "Model.hidden_dropout_prob": 0.0, "Model.attention_probs_dropout_prob": 0.0,
         "Data.seq_length": 256, "Data.data_prefix": f"[{prefix}]", "Data.tokenizer_dir": tok_dir,
         "Data.split": "[100,0,0]", "Global.output_dir": out, "Engine.max_steps": steps,
         "Engine.global_batch_size": 8, "Engine.micro_batch_size": micro, "Engine.eval_freq": 0,
         "Engine.eval_iters": 0, "Engine.save_steps": 0, "Engine.keep_checkpoint_max": 1, "Engine.logging_freq": 0}
    return [x for k, v in o.items() for x in ("-o", f"{k}={v}")] + [x for p in parallel for x in ("-o", p)]


def tokens_per_s(out: str) -> float:
    recs = [json.loads(x) for x in open(os.path.join(out, "train_log.jsonl")) if '"loss"' in x]
    tps = sorted(r["tokens_per_s"] for r in recs[2:])  # the first steps include warm-up work
    return tps[len(tps) // 2]


def run_single(args, tok_dir, prefix, threads: int) -> float:
    out = os.path.join(args.workdir, f"single_{threads}t")
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    subprocess.run([sys.executable, "-m", "gpt_compress", "pretrain", "--no-progress",
                    *overrides(tok_dir, prefix, out, args.steps, 8)], env=env, check=True, capture_output=True)
    return tokens_per_s(out)


def run_launched(args, name, tok_dir, prefix, micro, parallel, script=None, extra=()) -> str:
    out = os.path.join(args.workdir, name)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    target = [script, *extra] if script else [GPTC, "pretrain", "--no-progress"]
    cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", "2", "--log_dir",
           os.path.join(out, "logs"), *target, *overrides(tok_dir, prefix, out, args.steps, micro, parallel)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(f"{name} failed:\n{res.stderr[-2000:]}")
    return out


# ------------------------------------------------------------------ mp2 profile worker
def profile_worker(argv) -> None:
    """One rank: build the pretrain run as `gptc pretrain` does, then profile train steps."""
    import numpy as np
    import paddle
    import paddle.profiler as profiler

    from gpt_compress.checkpoint import build_model
    from gpt_compress.config import load_config
    from gpt_compress.data.dataset import SampleIterator, build_datasets
    from gpt_compress.parallel import build_parallel, init_distributed
    from gpt_compress.train.optim import build_optimizer, build_scheduler, clip_grad_norm_

    ov = [a for a in argv if a != "-o"]
    cfg = load_config(None, ov)
    dims = init_distributed(cfg)
    paddle.seed(cfg.global_.seed)
    model = build_model(cfg.model, "lm")
    par = build_parallel(dims, cfg)
    model = par.apply(model)
    sched = build_scheduler(cfg.optimizer, cfg.engine.max_steps)
    opt = par.prepare_optimizer(build_optimizer(model, cfg.optimizer, sched))
    params = [p for p in model.parameters() if not p.stop_gradient]
    train, _, _ = build_datasets(cfg.data.data_prefix, cfg.data.split, cfg.data.seq_length,
                                 (cfg.engine.max_steps * 8, 0, 0), cfg.global_.seed)
    batches = SampleIterator(train, 8)
    out = cfg.global_.output_dir
    trace_dir = os.path.join(out, f"trace_{dims.rank}")
    warm, active = 2, max(cfg.engine.max_steps - 2, 2)
    prof = profiler.Profiler(targets=[profiler.ProfilerTarget.CPU], scheduler=(warm, warm + active),
                             on_trace_ready=profiler.export_chrome_tracing(trace_dir), timer_only=False)
    times = []
    prof.start()
    for step in range(warm + active):
        t0 = time.perf_counter()
        loss = par.loss_fn(model, next(batches))
        loss.backward()
        clip_grad_norm_(params, 1.0)
        opt.step()
        opt.clear_grad()
        float(loss)
        if step >= warm:
            times.append(time.perf_counter() - t0)
        prof.step()
    prof.stop()
    names = {}
    for fp in glob.glob(os.path.join(trace_dir, "*.json")):
        with open(fp) as f:
            events = json.load(f).get("traceEvents", [])
        for ev in events:
            name = re.sub(r"\[.*?\]", "", str(ev.get("name", "")))  # "SameNdMeshReshard[12.3 ms]"
            if ev.get("ph") == "X" and any(w in name.lower() for w in COMM_WORDS):
                names[name] = names.get(name, 0.0) + ev.get("dur", 0) / 1e6
    # Auto-parallel runs every collective inside a reshard function (SameNdMeshReshard, ...): count
    # those, not the collectives nested in them; without any reshard event, count the collectives.
    # (the kernels' events are one word, e.g. SameNdMeshReshard; "reshard dygraph" wraps them)
    outer = {n: v for n, v in names.items() if "reshard" in n.lower() and " " not in n and "node" not in n.lower()}
    comm = sum(outer.values()) if outer else sum(names.values())
    step_total = float(np.sum(times))
    result = {"rank": dims.rank, "steps": len(times), "step_s": float(np.median(times)),
              "comm_s_total": comm, "comm_share": comm / step_total if step_total else None,
              "events_s": {k: round(v, 4) for k, v in sorted(names.items(), key=lambda kv: -kv[1])[:8]}}
    with open(os.path.join(out, f"profile_{dims.rank}.json"), "w") as f:
        json.dump(result, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--workdir", default="/tmp/gptc_bench_parallel")
    args = parser.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    tok_dir, prefix = prepare_data(args.workdir)
    result = {"model": "gpt-bench", "batch": 8, "seq": 256, "dtype": "fp32", "steps": args.steps,
              "cpu_count": os.cpu_count()}
    result["single_2threads_tokens_per_s"] = run_single(args, tok_dir, prefix, 2)
    dp = run_launched(args, "dp2", tok_dir, prefix, 4, ["Parallel.dp_degree=2"])
    result["dp2_1thread_each_tokens_per_s"] = tokens_per_s(dp)
    result["dp2_vs_single_2threads"] = round(result["dp2_1thread_each_tokens_per_s"]
                                             / result["single_2threads_tokens_per_s"], 3)
    mp = run_launched(args, "mp2", tok_dir, prefix, 8, ["Parallel.mp_degree=2"])
    result["mp2_1thread_each_tokens_per_s"] = tokens_per_s(mp)
    prof = run_launched(args, "mp2_profile", tok_dir, prefix, 8, ["Parallel.mp_degree=2"],
                        script=os.path.abspath(__file__), extra=["--profile-worker"])
    ranks = [json.load(open(fp)) for fp in sorted(glob.glob(os.path.join(prof, "profile_*.json")))]
    result["mp2_profiled_step_s"] = [round(r["step_s"], 4) for r in ranks]
    result["mp2_comm_share_of_step"] = [round(r["comm_share"], 4) for r in ranks]
    result["mp2_comm_events_s_rank0"] = ranks[0]["events_s"] if ranks else {}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    if "--profile-worker" in sys.argv:
        profile_worker([a for a in sys.argv[1:] if a != "--profile-worker"])
    else:
        main()
