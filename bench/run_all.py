"""Run the benchmarks behind the performance tables and add their results files.

Each result is added as ``bench/results/<host>/<date>_<bench>.json`` and the tables of README.md
and docs/performance.md are regenerated from the newest results.

    OMP_NUM_THREADS=2 python bench/run_all.py                    # the default set: decode (gpt-bench)
    OMP_NUM_THREADS=2 python bench/run_all.py --only all         # train, decode, compress, parallel, speculative, tp_decode
    OMP_NUM_THREADS=2 python bench/run_all.py --only train,decode
    python bench/run_all.py --only ""                             # only regenerate the tables

The default set is what the README's table needs: gpt-bench decode of the fused float32, int8
and int4 programs, the unfused Paddle program and onnxruntime float32/int8/int4, with the
transformers, CTranslate2 and llama.cpp peers (llama.cpp once ``make peers`` has built it), two
rounds. Its exports are kept in ``output/bench_decode`` and reused by the next run (``make bench`` / ``make bench-full`` in the Makefile). The
compression benchmark pretrains and compresses its own model on first use
(``bench/compress.py``), kept in ``output/bench_compress`` and reused afterwards; so does the
speculative one (``bench/speculative.py``: a target and its draft, ``output/bench_speculative``).

Each benchmark runs as its own subprocess, one after another (never two at once: they would
share the cores; each after the first waits, at most 150 s, for the 1-minute load to fall back
under half the cores), and prints one JSON object, written whole with a ``run`` record (host, CPU,
date, command) in front. Nothing is overwritten: a second run on the same day gets the time in
its name (``2026-11-24T1530_decode.json``). A benchmark that fails is reported with its error
(and no file); the others still run. ``bench/results/README.md`` explains the naming.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tables  # noqa: E402  (bench/tables.py, beside this script)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DECODE_345M = ["--preset", "gpt-345M", "--workdir", "output/bench_decode_345M", "--rounds", "1", "--reps", "2",
               "--batch", "1", "--no-positions", "--int-formats", "fused,onnx", "--new-tokens", "32", "--backends",
               "paddle,onnx,paddle_int8,onnx_int8,paddle_int4", "--peers", "llamacpp"]
BENCHES = {  # name -> script and arguments
    "train": ["bench/train.py"],
    "decode": ["bench/decode.py", "--workdir", "output/bench_decode", "--rounds", "2", "--reps", "2", "--backends",
               "paddle,paddle_unfused,onnx,paddle_int8,paddle_int8_kvbf16,onnx_int8,paddle_int4,onnx_int4"],
    "compress": ["bench/compress.py", "--rounds", "1"],
    "parallel": ["bench/parallel.py"],
    "speculative": ["bench/speculative.py"],
    "tp_decode": ["bench/tp_decode.py", "--workdir", "output/bench_tp", "--presets", "gpt-bench,gpt-345M"],
    # gpt-345M batch 1 as users see it (64-token prompt, 32 new tokens, the whole call), and with a
    # 512-token prompt; the fused int programs alone and an ONNX-only int8 export (memory)
    "decode_345M": ["bench/decode.py", *DECODE_345M],
    "decode_345M_512": ["bench/decode.py", *DECODE_345M, "--prompt", "512"],
    "serve": ["bench/serve.py", "--levels", "1,16,64", "--duration", "15", "--workdir", "output/bench_serve"],
    "serve_int8": ["bench/serve.py", "--levels", "1,16,64", "--duration", "15", "--workdir", "output/bench_serve",
                   "--format", "int8"],
    "serve_int8_kvbf16": ["bench/serve.py", "--levels", "1,16,64", "--duration", "15", "--workdir",
                          "output/bench_serve", "--format", "int8", "--kv-cache-dtype", "bfloat16"],
    # requests as an OpenAI client sends them by default: sampled at temperature 1, top_p 1
    "serve_int8_sampled": ["bench/serve.py", "--levels", "1,16,64", "--duration", "15", "--workdir",
                           "output/bench_serve", "--format", "int8", "--temperature", "1"],
    # one-thread GEMM rates of the block Linears at M = 1..256 against the host's measured peaks
    "kernels_roofline": ["bench/kernels.py", "--roofline"],
}
DEFAULT = ("decode",)  # `make bench`; `--only all` (`make bench-full`) runs every one of BENCHES


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


# AMD family (and model range) -> microarchitecture, for the results directory's host name.
AMD_ZEN = {23: ((0, 0x2F, "zen1"), (0x30, 0xFF, "zen2")), 25: ((0, 0x0F, "zen3"), (0x10, 0x1F, "zen4"),
                                                         (0x20, 0x5F, "zen3"), (0x60, 0xFF, "zen4")),
           26: ((0, 0xFF, "zen5"),)}


def _cpuinfo() -> dict:
    info: dict = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for ln in f:
                if ":" in ln:
                    k, v = (x.strip() for x in ln.split(":", 1))
                    info.setdefault(k, v)
    except OSError:
        pass
    return info


def host_name() -> str:
    """A short, stable name for this CPU: ``zen1``..``zen5`` for AMD, ``intel-f6m207`` style otherwise."""
    info = _cpuinfo()
    try:
        family, model = int(info.get("cpu family", "-1")), int(info.get("model", "-1"))
    except ValueError:
        family, model = -1, -1
    if info.get("vendor_id") == "AuthenticAMD":
        for lo, hi, name in AMD_ZEN.get(family, ()):
            if lo <= model <= hi:
                return name
        return f"amd-f{family}m{model}"
    if info.get("vendor_id") == "GenuineIntel":
        return f"intel-f{family}m{model}"
    return re.sub(r"[^a-z0-9]+", "-", (platform.machine() or "unknown").lower())


# CPU flags a reader of a result needs: the fused operators' paths depend on them.
FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16")


def machine() -> dict:
    """The host as a results file records it: short name, CPU (``lscpu``'s model name, family,
    model and the flags of ``FLAGS`` present), cores, threads and Python."""
    info = _cpuinfo()
    flags = set(info.get("flags", "").split())
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    if "avx512_vnni" in flags or "avx_vnni" in flags:
        isa += " + VNNI"
    if "avx512_bf16" in flags:
        isa += " + BF16"
    return {"host": host_name(), "cpu": f"{info.get('model name', platform.processor())}, {isa}, "
                                         f"{os.cpu_count()} cores",
            "cpu_model_name": info.get("model name", platform.processor()), "cpu_family": info.get("cpu family"),
            "cpu_model": info.get("model"), "cpu_flags": [f for f in FLAGS if f in flags], "cores": os.cpu_count(),
            "threads": int(os.environ.get("OMP_NUM_THREADS", "2")), "python": platform.python_version()}


def load_average() -> list[float] | None:
    """The 1, 5 and 15-minute load averages (None where the OS has none)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def settle(cores: int, limit: float = 150.0) -> None:
    """Before a benchmark that follows another: wait (at most ``limit`` seconds) until the
    1-minute load average, which still holds the previous benchmark's threads, is back under half
    the cores, so that the next one starts on a quiet host and its record says so
    (``tables.busy``)."""
    end = time.monotonic() + limit
    while time.monotonic() < end:
        load = load_average()
        if load is None or load[0] <= 0.5 * cores:
            return
        time.sleep(5)


def conditions(start: list[float] | None, end: list[float] | None, cores: int, threads: int) -> str:
    """What the load says about the timings: other work on the host slows every contender of a
    run, unevenly (``tables.busy`` decides)."""
    if not start or not end:
        return "load not recorded"
    busiest = max(start[0], *end[:2])  # the averages tables.busy reads
    if tables.busy(start, end, cores, threads):
        return (f"host shared with other work (load average up to {busiest} on {cores} cores): every figure is "
                "low and the contenders are slowed unequally; a run on idle cores gives the figures to rely on")
    return f"host quiet (load average at most {busiest} on {cores} cores)"


def result_path(root: str, host: str, bench: str, when: time.struct_time) -> str:
    """``bench/results/<host>/<date>_<bench>.json``, with the time in the name if the day's is taken."""
    base = os.path.join(root, "bench", "results", host)
    path = os.path.join(base, f"{time.strftime('%Y-%m-%d', when)}_{bench}.json")
    if os.path.exists(path):
        path = os.path.join(base, f"{time.strftime('%Y-%m-%dT%H%M', when)}_{bench}.json")
    n = 2
    while os.path.exists(path):  # two runs within one minute
        path = os.path.join(base, f"{time.strftime('%Y-%m-%dT%H%M', when)}-{n}_{bench}.json")
        n += 1
    return path


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default=",".join(DEFAULT),
                   help=f"comma-separated subset of {', '.join(BENCHES)}, or 'all' (default: {','.join(DEFAULT)})")
    p.add_argument("--host", default=None, help="results directory name (default: from /proc/cpuinfo)")
    a = p.parse_args(argv)
    names = list(BENCHES) if a.only == "all" else [n for n in a.only.split(",") if n]
    unknown = [n for n in names if n not in BENCHES]
    if unknown:
        p.error(f"unknown benchmark(s) {unknown}; choose from {', '.join(BENCHES)}")
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    info = machine()
    if a.host:
        info["host"] = a.host
    for i, name in enumerate(names):
        if i:
            settle(info["cores"] or 1)
        print(f"[run_all] {name} ...", file=sys.stderr, flush=True)
        when = time.gmtime()
        load_start = load_average()
        out = run_bench(name, [])
        load_end = load_average()
        print(f"[run_all] {name}: {out.get('error', 'ok')} in {out['seconds']} s", file=sys.stderr, flush=True)
        if "error" in out:
            print(out.get("stderr_tail") or out.get("stdout_tail", ""), file=sys.stderr)
            continue
        cmd = " ".join(["OMP_NUM_THREADS=" + os.environ["OMP_NUM_THREADS"], "python", *BENCHES[name]])
        record = {"run": {**info, "date": time.strftime("%Y-%m-%d", when),
                          "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", when), "command": cmd,
                          "load_avg_start": load_start, "load_avg_end": load_end,
                          "conditions": conditions(load_start, load_end, info["cores"] or 1, info["threads"])}, **out}
        path = result_path(ROOT, info["host"], name, when)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(json.dumps(record, indent=1) + "\n")
        os.replace(tmp, path)
        print(f"[run_all] wrote {os.path.relpath(path, ROOT)}", file=sys.stderr, flush=True)
    for page in tables.regenerate(ROOT):
        print(f"[run_all] regenerated {page}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
