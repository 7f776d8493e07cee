"""Tensor-parallel decode on CPU: mp2 fused rank programs (``gptc partition``, two processes of one
thread each) against the single-card fused program (one process, one and two threads).

    OMP_NUM_THREADS=2 python bench/tp_decode.py --workdir output/bench_tp --presets gpt-bench,gpt-345M

Per preset: a randomly initialised checkpoint (``gptc init``; speed does not depend on the
weights), its single-card export and its mp2 partition, kept in ``--workdir`` and reused. Each
measurement is batch-1 greedy decode of ``--new-tokens`` tokens after a ``--prompt``-token
prompt, as prefill then one program run per token (``decode``: the runner all-gathers the mp2
logits every step), best of ``--reps``; peak RSS is each process's own (``ru_maxrss``), per rank
for mp2. Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPTC = os.path.join(os.path.dirname(sys.executable), "gptc")


def _decode_loop(backend, vocab: int, prompt: int, new: int, reps: int) -> float:
    rng = np.random.default_rng(0)
    ids = rng.integers(0, vocab, (1, prompt)).astype(np.int64)
    best = 0.0
    for _ in range(reps):
        mask = np.ones_like(ids)
        t0 = time.perf_counter()
        logits, cache = backend.prefill(ids, mask)
        t1 = time.perf_counter()
        for _ in range(new):
            nxt = np.argmax(logits, axis=-1).reshape(1, 1).astype(np.int64)
            mask = np.concatenate([mask, np.ones((1, 1), np.int64)], 1)
            logits, cache = backend.decode(nxt, mask, cache)
        best = max(best, new / (time.perf_counter() - t1))
        del t0
    return best


def worker(argv) -> None:
    """One measuring process: ``single DIR THREADS OUT`` or (launched) ``tp DIR OUT``."""
    import gpt_compress  # noqa: F401  (before paddle)

    kind, model_dir = argv[0], argv[1]
    prompt, new, reps = int(os.environ["BENCH_PROMPT"]), int(os.environ["BENCH_NEW"]), int(os.environ["BENCH_REPS"])
    if kind == "single":
        from gpt_compress.inference.fused import FusedBackend
        from gpt_compress.inference.manifest import read_manifest

        manifest = read_manifest(model_dir)
        backend = FusedBackend(manifest, threads=int(argv[2]))
        out, vocab = argv[3], manifest.vocab_size
        rank = 0
    else:
        import paddle.distributed as dist

        from gpt_compress.inference.manifest import read_tp_manifest
        from gpt_compress.inference.tensor_parallel import TensorParallelBackend
        from gpt_compress.parallel.fleet import init_mp

        top = read_tp_manifest(model_dir)
        init_mp(int(top["mp_degree"]))
        rank = dist.get_rank()
        backend = TensorParallelBackend(model_dir, rank=rank, fused=True, threads=1)
        out, vocab = f"{argv[2]}.rank{rank}", top["vocab_size"]
    tps = _decode_loop(backend, vocab, prompt, new, reps)
    with open(out, "w", encoding="utf-8") as f:
        json.dump({"tokens_per_s": round(tps, 2), "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                   "rank": rank}, f)


def _run(cmd, env=None):
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    if res.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{res.stdout[-1500:]}\n{res.stderr[-3000:]}")


def prepare(workdir: str, preset: str) -> dict:
    base = os.path.join(workdir, preset)
    dirs = {k: os.path.join(base, k) for k in ("ckpt", "single", "tp2")}
    if not os.path.isdir(dirs["ckpt"]):
        _run([GPTC, "init", "-o", f"Model.preset={preset}", "--output", dirs["ckpt"]])
    if not os.path.isdir(dirs["single"]):
        _run([GPTC, "export", "--model", dirs["ckpt"], "--output", dirs["single"], "--no-validate"])
    if not os.path.isdir(dirs["tp2"]):
        _run([GPTC, "partition", "--model", dirs["ckpt"], "--output", dirs["tp2"], "--mp-degree", "2", "--no-validate"])
    return dirs


def measure(dirs: dict, workdir: str, env: dict) -> dict:
    out = {}
    for threads in (1, 2):
        path = os.path.join(workdir, f"single{threads}.json")
        _run([sys.executable, __file__, "--worker", "single", dirs["single"], str(threads), path],
             {**env, "OMP_NUM_THREADS": str(threads)})
        out[f"single_card_{threads}_threads"] = json.load(open(path))
    path = os.path.join(workdir, "tp.json")
    _run([sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", "2", "--log_dir",
          os.path.join(workdir, "logs"), __file__, "--worker", "tp", dirs["tp2"], path], {**env, "OMP_NUM_THREADS": "1"})
    out["mp2_fused_1_thread_each"] = [json.load(open(f"{path}.rank{r}")) for r in range(2)]
    return out


def main() -> None:
    if "--worker" in sys.argv:
        return worker(sys.argv[sys.argv.index("--worker") + 1:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", default="output/bench_tp")
    ap.add_argument("--presets", default="gpt-bench,gpt-345M")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    env = {**os.environ, "BENCH_PROMPT": str(args.prompt), "BENCH_NEW": str(args.new_tokens),
           "BENCH_REPS": str(args.reps)}
    result = {"bench": "tp_decode", "prompt_tokens": args.prompt, "new_tokens": args.new_tokens, "reps": args.reps,
              "load_avg_start": [round(x, 2) for x in os.getloadavg()], "presets": {}}
    for preset in args.presets.split(","):
        dirs = prepare(os.path.abspath(args.workdir), preset)
        result["presets"][preset] = measure(dirs, os.path.join(os.path.abspath(args.workdir), preset), env)
    result["load_avg_end"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
