"""Every benchmark in one go: training, decode, compression and parallel training, each with its
peer and the machine's limits, written to ``bench/results.json`` and ``bench/results.md``.

    OMP_NUM_THREADS=2 python bench/run_all.py                 # all four
    OMP_NUM_THREADS=2 python bench/run_all.py --only train,decode   # ~12 min on 2 cores

The compression benchmark pretrains and compresses its own model on first use (about an hour
on 2 cores; ``bench/compress.py``), kept in ``output/bench_compress`` and reused afterwards.

Each benchmark runs as its own subprocess, one after another (never two at once: they would
share the cores), and prints one JSON object, kept whole under its name in results.json.
results.md pulls out the headline figures: ours against the Hugging Face transformers peer
(same run), against the machine's limits (GEMM ceiling for training, weight bytes / memory
bandwidth for decode), int8 against fp32 on the same runtime, dp2 against one process.
A benchmark that fails is recorded with its error and the others still run.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

from gpt_compress.fileio import write_text_atomic

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHES = {  # name -> script and arguments
    "train": ["bench/train.py"],
    "decode": ["bench/decode.py", "--rounds", "2"],
    "compress": ["bench/compress.py", "--rounds", "1"],
    "parallel": ["bench/parallel.py"],
}


def run_bench(name: str, extra: list[str]) -> dict:
    """Run one benchmark; its JSON (the last JSON object on stdout), or an error record."""
    cmd = [sys.executable, os.path.join(ROOT, BENCHES[name][0]), *BENCHES[name][1:], *extra]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    seconds = round(time.perf_counter() - t0, 1)
    if proc.returncode != 0:
        return {"error": f"exit {proc.returncode}", "stderr_tail": proc.stderr[-2000:], "seconds": seconds}
    text = proc.stdout.strip()
    start = text.rfind("\n{")  # the object may be pretty-printed over many lines
    for candidate in (text, text[start + 1:] if start >= 0 else ""):
        try:
            out = json.loads(candidate)
            out["seconds"] = seconds
            return out
        except json.JSONDecodeError:
            continue
    return {"error": "no JSON on stdout", "stdout_tail": text[-2000:], "seconds": seconds}


def _get(d: dict, *keys, default=None):
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return default
        d = d[k]
    return d


def _fmt(v, spec="{:.3g}") -> str:
    if v is None:
        return "-"
    if isinstance(v, list):
        return ", ".join(_fmt(x, spec) for x in v)
    return spec.format(v) if isinstance(v, (int, float)) else str(v)


def markdown(results: dict) -> str:
    """Headline figures of each benchmark as Markdown tables."""
    out = [f"# Benchmarks ({results['machine']['date']}, {results['machine']['cpu']}, "
           f"{results['machine']['threads']} threads)", ""]
    tr = results.get("train")
    if tr and "error" not in tr:
        out += ["## Training (gpt-bench, batch 8 x 256, fp32 AdamW step)", "",
                "| | tokens/s | GFLOP/s | of GEMM ceiling | vs HF peer (same run) |", "|---|---:|---:|---:|---:|"]
        ceiling = _get(tr, "flops", "matmul_ceiling_gflops")
        for k, v in tr.get("ours", {}).items():
            out.append(f"| ours {k} | {_fmt(v.get('tokens_per_s'), '{:.1f}')} | {_fmt(v.get('gflops'), '{:.1f}')} | "
                       f"{_fmt(v.get('fraction_of_ceiling'), '{:.2f}')} | "
                       f"{_fmt(_get(tr, 'ratios_ours_over_peer', f'{k}_vs_peer_median_step'), '{:.2f}x')} |")
        peer = _get(tr, "peer", "fwd_bwd", "train_tokens_per_s")
        out += [f"| HF transformers (torch CPU) | {_fmt(peer, '{:.1f}')} | | | 1 |", "",
                f"GEMM ceiling measured in the same process: {_fmt(ceiling, '{:.1f}')} GFLOP/s.", ""]
    de = results.get("decode")
    if de and "error" not in de:
        out += [f"## Decode (gpt-bench, {de.get('prompt_tokens')}-token prompt, {de.get('new_tokens')} new tokens, greedy)",
                "", f"Limit: {de.get('weight_bytes_per_token', 0) / 1e6:.0f} MB of weights per token at "
                f"{de.get('copy_bandwidth_gbps')} GB/s copy bandwidth = {de.get('bandwidth_limit_tokens_per_s')} "
                f"tokens/s at batch 1.", "",
                f"| backend | batch 1 tok/s | vs peer | of limit | prefill ms | batch {de.get('batch')} tok/s | vs peer |",
                "|---|---:|---:|---:|---:|---:|---:|"]
        b = de.get("batch")
        for name, r in de.get("results", {}).items():
            out.append(f"| {name} | {_fmt(r.get('decode_tokens_per_s'), '{:.1f}')} | {_fmt(r.get('vs_peer_batch1'), '{:.2f}x')} | "
                       f"{_fmt(r.get('fraction_of_bandwidth_limit'), '{:.2f}')} | {_fmt(r.get('prefill_ms'), '{:.1f}')} | "
                       f"{_fmt(r.get(f'batch{b}_decode_tokens_per_s'), '{:.0f}')} | {_fmt(r.get('vs_peer_batch8'), '{:.2f}x')} |")
        out.append("")
    co = results.get("compress")
    if co and "error" not in co:
        out += ["## Compression (each runtime against its own fp32)", "", "```json",
                json.dumps({k: v for k, v in co.items() if k not in ("model",)}, indent=1)[:6000], "```", ""]
    pa = results.get("parallel")
    if pa and "error" not in pa:
        out += ["## Parallel training (gpt-bench, gloo on CPU)", "", "| layout | tokens/s |", "|---|---:|",
                f"| 1 process x 2 threads | {_fmt(pa.get('single_2threads_tokens_per_s'), '{:.1f}')} |",
                f"| dp2 (2 processes x 1 thread) | {_fmt(pa.get('dp2_1thread_each_tokens_per_s'), '{:.1f}')} "
                f"({_fmt(pa.get('dp2_vs_single_2threads'), '{:.2f}x')}) |",
                f"| mp2 (2 processes x 1 thread) | {_fmt(pa.get('mp2_1thread_each_tokens_per_s'), '{:.1f}')} |", "",
                f"mp2 communication share of a step (per rank): {_fmt(pa.get('mp2_comm_share_of_step'), '{:.1%}')}", ""]
    for name, r in results.items():
        if isinstance(r, dict) and "error" in r:
            out += [f"## {name}: FAILED ({r['error']})", "", "```", (r.get("stderr_tail") or r.get("stdout_tail", ""))[-1500:],
                    "```", ""]
    return "\n".join(out)


def machine() -> dict:
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "threads": int(os.environ.get("OMP_NUM_THREADS", "2")),
            "date": time.strftime("%Y-%m-%d"), "python": platform.python_version()}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default=",".join(BENCHES), help="comma-separated subset of " + ", ".join(BENCHES))
    p.add_argument("--output", default=os.path.join(ROOT, "bench", "results.json"))
    a = p.parse_args(argv)
    names = [n for n in a.only.split(",") if n]
    unknown = [n for n in names if n not in BENCHES]
    if unknown:
        p.error(f"unknown benchmark(s) {unknown}; choose from {', '.join(BENCHES)}")
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    results: dict = {"machine": machine()}
    for name in names:
        print(f"[run_all] {name} ...", file=sys.stderr, flush=True)
        results[name] = run_bench(name, [])
        print(f"[run_all] {name}: {results[name].get('error', 'ok')} in {results[name]['seconds']} s",
              file=sys.stderr, flush=True)
    md = markdown(results)
    for path, text in ((a.output, json.dumps(results, indent=1)), (os.path.splitext(a.output)[0] + ".md", md)):
        write_text_atomic(path, text + "\n")
    print(md)


if __name__ == "__main__":
    main()
