"""Serving benchmark: `gptc serve` under 1, 4, 16 and 64 concurrent streaming clients, with
continuous batching and, in the same run, the same server with ``--max-batch 1`` as the
baseline; prints one JSON object and a Markdown table.

    OMP_NUM_THREADS=2 python bench/serve.py                      # gpt-bench, 20 s per level
    OMP_NUM_THREADS=2 python bench/serve.py --soak 600 --soak-clients 8   # + a 10-minute soak

Each client is a closed loop (asyncio + aiohttp, whose C parser costs about half of httpx's
CPU per streamed chunk): it sends a streaming request (greedy, or sampled with ``--temperature``
and ``--top-p``), reads it to the end, sends the next. Requests cycle through a fixed mix of
prompt and output lengths (``MIX``; ``min_tokens = max_tokens`` so every request produces
exactly its output length).
A level runs ``--duration`` seconds; then the clients are cancelled (their streams closed,
which the server notices and frees the slots) and the server is idle before the next level.
The clients run on a thread at nice 19 (``CLIENT_NICE``): on a host of a few cores they take the
CPU the server leaves idle and do not preempt its compute threads, as clients on other machines
would not (a starved client sends its next request late and reads its tokens late, so this
lowers the measured throughput and raises the latencies, never the reverse).

Figures: output tokens/s (tokens received by all clients during the level / its duration),
p50/p99 time to first token (request sent -> first token received; requests that never got a
token before the level ended are counted in ``unserved``, not in the percentiles; the p99 also
over the requests after each client's first, which miss the level's opening burst of
``clients`` simultaneous prompts) and
inter-token latency (gaps between a request's tokens), errors (non-200 answers, error events,
transport errors). The soak runs ``--soak-clients`` clients for ``--soak`` seconds against the
batched server after ``--soak-warmup`` seconds of the same load, and reports the server's RSS
(``/proc/PID/status``) then, every 60 s and at the end.

The model is a random-init ``--preset`` exported like bench/decode.py does (``prepare``): the
float32 export, or with ``--format int8`` / ``int4`` its weight-only fused program
(``prepare_fused_int``). In the same run the in-process ``Generator`` runs the same mix one
request after another (``generator``: tokens/s, prefill included, as a 1-client server's), in
``ROUNDS`` turns alternating with the batched server's 1-client level (each side ``--duration``
seconds in all, so that the host's drift falls on both), and ``server_1_client_over_generator``
is what the HTTP server, the engine loop and streaming cost a single client.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from typing import Awaitable, Callable, Optional, TypeVar

import aiohttp
import httpx
import numpy as np

from decode import ROOT, prepare, prepare_fused_int  # bench/decode.py: random-init exports of a preset

MIX = [(16, 32), (64, 64), (128, 32), (32, 128), (256, 16), (48, 96)]  # (prompt tokens, output tokens)
LEVELS = (1, 4, 16, 64)
T = TypeVar("T")
CLIENT_NICE = 19  # the clients' scheduling priority (see the module docstring)
ROUNDS = 4  # turns of Generator / 1-client server


class Stats:
    """What the clients of one level measured."""

    def __init__(self):
        self.tokens = 0
        self.ttft: list[float] = []
        self.ttft_later: list[float] = []  # requests after each client's first (not in the level's opening burst)
        self.itl: list[float] = []
        self.errors = 0
        self.requests = 0
        self.unserved = 0

    def summary(self, seconds: float) -> dict:
        def pct(xs, q):
            return round(float(np.percentile(xs, q)) * 1000, 1) if xs else None

        return {"output_tokens_per_s": round(self.tokens / seconds, 1), "requests_started": self.requests,
                "ttft_p50_ms": pct(self.ttft, 50), "ttft_p99_ms": pct(self.ttft, 99),
                "ttft_p99_later_ms": pct(self.ttft_later, 99),
                "itl_p50_ms": pct(self.itl, 50), "itl_p99_ms": pct(self.itl, 99),
                "errors": self.errors, "unserved": self.unserved}


def start_server(model_dir: str, backend: str, max_batch: int, log_path: str,
                 extra: tuple = ()) -> tuple[subprocess.Popen, str]:
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "gpt_compress", "serve", "--model-dir", model_dir,
                             "--backend", backend, "--port", "0", "--max-batch", str(max_batch),
                             "--max-queue", "256", "--timeout", "0", *extra],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True)
    url = json.loads(proc.stdout.readline())["url"]
    end = time.monotonic() + 600
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited; see {log_path}")
        try:
            if httpx.get(url + "/health").status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError("server not ready")


def rss_mb(pid: int) -> float:
    """Resident MB of process ``pid`` now (``memory.status_bytes``), NaN if it cannot be read."""
    from gpt_compress.memory import status_bytes

    b = status_bytes("VmRSS", pid)
    return float("nan") if b is None else b / 2 ** 20


async def one_request(client: aiohttp.ClientSession, url: str, prompt: list[int], out: int, sampling: dict,
                      stats: Stats, first: bool = True) -> None:
    body = {"prompt": prompt, "max_tokens": out, "min_tokens": out, **sampling, "stream": True}
    t0 = time.perf_counter()
    last = None
    stats.requests += 1
    try:
        async with client.post(url + "/v1/completions", json=body) as r:
            if r.status != 200:
                stats.errors += 1
                await r.read()
                return
            async for line in r.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    stats.errors += 1
                    return
                n = len(event["choices"][0].get("token_ids", [])) if event["choices"] else 0
                if n:
                    now = time.perf_counter()
                    if last is None:
                        stats.ttft.append(now - t0)
                        if not first:
                            stats.ttft_later.append(now - t0)
                    else:
                        stats.itl.append(now - last)
                    last = now
                    stats.tokens += n
    except asyncio.CancelledError:
        if last is None:
            stats.unserved += 1
        raise
    except aiohttp.ClientError:
        stats.errors += 1


async def client_loop(url: str, rng: np.random.Generator, offset: int, vocab: int, sampling: dict,
                      stats: Stats) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as client:
        i = offset
        while True:
            plen, out = MIX[i % len(MIX)]
            i += 1
            await one_request(client, url, rng.integers(0, vocab, plen).tolist(), out, sampling, stats,
                              first=i == offset + 1)


async def run_level(url: str, clients: int, seconds: float, vocab: int, sampling: dict, seed: int = 0,
                    stats: Optional[Stats] = None) -> Stats:
    """``clients`` closed-loop clients for ``seconds``; what they measured (added to ``stats``)."""
    stats = stats if stats is not None else Stats()
    rng = np.random.default_rng(seed)
    tasks = [asyncio.create_task(client_loop(url, rng, c, vocab, sampling, stats)) for c in range(clients)]
    await asyncio.sleep(seconds)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return stats


def as_clients(coro_fn: Callable[..., Awaitable[T]], *args) -> T:
    """``asyncio.run(coro_fn(*args))`` on a thread at nice ``CLIENT_NICE`` (its own: the servers this
    process starts later keep the default priority)."""
    out: list = []

    def body():
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), CLIENT_NICE)
        out.append(asyncio.run(coro_fn(*args)))

    thread = threading.Thread(target=body, name="bench-clients")
    thread.start()
    thread.join()
    if not out:
        raise RuntimeError("the clients' thread failed (see above)")
    return out[0]


async def soak(url: str, pid: int, clients: int, seconds: float, vocab: int,
               sampling: dict) -> tuple[Stats, list[float]]:
    """``run_level`` for ``seconds``, sampling the server's RSS every 60 s."""
    samples: list[float] = []

    async def sample():
        while True:
            await asyncio.sleep(60)
            samples.append(round(rss_mb(pid), 1))

    sampler = asyncio.create_task(sample())
    stats = await run_level(url, clients, seconds, vocab, sampling, seed=7)
    sampler.cancel()
    return stats, samples


def wait_idle(url: str, timeout: float = 120) -> None:
    """Until the server has no running or waiting sequence (cancelled streams have left)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        text = httpx.get(url + "/metrics").text
        values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
                  if line.startswith(("gptc_running_batch_size ", "gptc_queue_depth "))}
        if not any(values.values()):
            return
        time.sleep(0.2)


def generator_rate(gen, seconds: float, vocab: int, sampling: dict, seed: int = 0) -> tuple[int, float]:
    """The in-process ``Generator`` ``gen`` on the mix, one request after another (``sampling``: the
    requests' temperature and top_p), for ``seconds``: (output tokens, wall seconds), prefill
    included, as one closed-loop client of the server sees it."""
    from gpt_compress.serve.request import request_config

    rng = np.random.default_rng(seed)
    tokens, i, t0 = 0, 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        plen, out = MIX[i % len(MIX)]
        i += 1
        cfg = request_config(out, sampling["temperature"], sampling["top_p"], 0, 1.0, i, min_tokens=out)
        res = gen.generate([rng.integers(0, vocab, plen).tolist()], config=cfg)  # the server's config of the request
        tokens += len(res.sequences[0])
    return tokens, time.perf_counter() - t0


def rate(tokens: int, wall: float, **extra) -> dict:
    """The Generator's summary in the results: tokens/s over ``wall`` seconds."""
    return {"output_tokens_per_s": round(tokens / wall, 1), "seconds": round(wall, 1), **extra}


def one_client_and_generator(url: str, gen, seconds: float, vocab: int, sampling: dict) -> tuple[Stats, dict]:
    """The 1-client level and the in-process Generator in ``ROUNDS`` alternating turns of
    ``seconds / ROUNDS`` each: the level's Stats and the Generator's summary."""
    stats, tokens, wall = Stats(), 0, 0.0
    for r in range(ROUNDS):
        n, w = generator_rate(gen, seconds / ROUNDS, vocab, sampling, seed=r)
        tokens, wall = tokens + n, wall + w
        as_clients(run_level, url, 1, seconds / ROUNDS, vocab, sampling, r, stats)
        wait_idle(url)
    return stats, rate(tokens, wall, rounds=ROUNDS)


def table(results: dict) -> str:
    rows = ["| clients | server | tokens/s | TTFT p50 / p99 ms | TTFT p99 after the burst | ITL p50 / p99 ms | errors "
            "| unserved |", "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for level in results["levels"]:
        for name in ("batched", "max_batch_1"):
            r = level[name]
            rows.append(f"| {level['clients']} | {name} | {r['output_tokens_per_s']} | {r['ttft_p50_ms']} / "
                        f"{r['ttft_p99_ms']} | {r['ttft_p99_later_ms']} | {r['itl_p50_ms']} / {r['itl_p99_ms']} | "
                        f"{r['errors']} | {r['unserved']} |")
        rows.append(f"| {level['clients']} | **ratio** | **{level['throughput_ratio']}x** | | | | | |")
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="gpt-bench")
    p.add_argument("--backend", default="paddle", choices=("paddle", "onnx"))
    p.add_argument("--format", default="fp32", choices=("fp32", "int8", "int4"),
                   help="the float32 export, or its weight-only int8/int4 fused program (paddle only)")
    p.add_argument("--kv-cache-dtype", default="float32", choices=("float32", "bfloat16"),
                   help="with --format int8/int4: the fused program's KV cache (gptc export --kv-cache-dtype)")
    p.add_argument("--max-batch", type=int, default=32, help="the batched server's --max-batch")
    p.add_argument("--levels", default=",".join(map(str, LEVELS)), help="concurrent clients per level")
    p.add_argument("--duration", type=float, default=20.0, help="seconds per level and server")
    p.add_argument("--soak", type=float, default=0.0, help="soak seconds against the batched server (0: none)")
    p.add_argument("--soak-clients", type=int, default=8)
    p.add_argument("--soak-warmup", type=float, default=60.0, help="seconds of soak load before the first RSS")
    p.add_argument("--serve-arg", action="append", default=[],
                   help="an extra `gptc serve` argument for both servers (repeat), e.g. -o=Serve.prefill_budget=512")
    p.add_argument("--temperature", type=float, default=0.0, help="the requests' temperature (0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="the requests' top_p (sampling)")
    p.add_argument("--workdir", default=None, help="keep/reuse the checkpoint and export here")
    a = p.parse_args()
    sampling = {"temperature": a.temperature, "top_p": a.top_p}
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise
    from gpt_compress.config import ModelConfig

    vocab = ModelConfig.from_preset(a.preset).vocab_size
    workdir = a.workdir or tempfile.mkdtemp(prefix="bench-serve-")
    os.makedirs(workdir, exist_ok=True)
    ckpt, model_dir = prepare(workdir, a.preset)
    if a.format != "fp32":
        if a.backend != "paddle":
            p.error("--format int8/int4 runs the fused Paddle program: --backend paddle")
        model_dir = prepare_fused_int(workdir, a.preset, ckpt, int(a.format[3:]), model_dir, a.kv_cache_dtype)
        a.serve_arg.append("--no-verify")  # the fused program alone: no checksums file (bench/decode.py)
    elif a.kv_cache_dtype != "float32":
        p.error("--kv-cache-dtype bfloat16 goes with --format int8/int4 (the fused program alone)")
    levels = [int(x) for x in a.levels.split(",")]
    results = {"bench": "serve", "preset": a.preset, "backend": a.backend, "format": a.format,
               "kv_cache_dtype": a.kv_cache_dtype, "mix": MIX, "sampling": sampling,
               "duration_s": a.duration,
               "threads": os.environ.get("OMP_NUM_THREADS", ""), "serve_args": a.serve_arg, "levels": [{"clients": c} for c in levels]}
    from gpt_compress.inference.runner import Generator

    gen = Generator.from_dir(model_dir, backend=a.backend, verify=a.format == "fp32")
    generator_rate(gen, 2.0, vocab, sampling, seed=99)  # warm-up (kernels per shape)
    if 1 not in levels:
        results["generator"] = rate(*generator_rate(gen, a.duration, vocab, sampling))
    servers = {"batched": a.max_batch, "max_batch_1": 1}
    for name, max_batch in servers.items():
        proc, url = start_server(model_dir, a.backend, max_batch, os.path.join(workdir, f"{name}.log"),
                                 tuple(a.serve_arg))
        try:
            as_clients(run_level, url, min(max_batch, 8), 3.0, vocab, sampling, 99)  # warm-up (kernels per shape)
            wait_idle(url)
            for entry in results["levels"]:
                if name == "batched" and entry["clients"] == 1:
                    stats, results["generator"] = one_client_and_generator(url, gen, a.duration, vocab, sampling)
                    print(json.dumps({"generator": results["generator"]}), file=sys.stderr)
                else:
                    stats = as_clients(run_level, url, entry["clients"], a.duration, vocab, sampling)
                entry[name] = stats.summary(a.duration)
                print(json.dumps({"server": name, "clients": entry["clients"], **entry[name]}), file=sys.stderr)
                wait_idle(url)
            if name == "batched" and a.soak > 0:
                as_clients(run_level, url, a.soak_clients, a.soak_warmup, vocab, sampling, 6)  # to a steady state
                wait_idle(url)
                rss0 = rss_mb(proc.pid)
                stats, samples = as_clients(soak, url, proc.pid, a.soak_clients, a.soak, vocab, sampling)
                wait_idle(url)
                rss1 = rss_mb(proc.pid)
                results["soak"] = {"seconds": a.soak, "clients": a.soak_clients, "warmup_s": a.soak_warmup,
                                   **stats.summary(a.soak), "rss_start_mb": round(rss0, 1),
                                   "rss_end_mb": round(rss1, 1), "rss_growth_pct": round(100 * (rss1 - rss0) / rss0, 2),
                                   "rss_every_60s_mb": samples}
        finally:
            proc.terminate()
            proc.wait(60)
    for entry in results["levels"]:
        b, s = entry["batched"]["output_tokens_per_s"], entry["max_batch_1"]["output_tokens_per_s"]
        entry["throughput_ratio"] = round(b / s, 2) if s else None
        if entry["clients"] == 1:
            g = results["generator"]["output_tokens_per_s"]
            results["server_1_client_over_generator"] = round(b / g, 2) if g else None
    print(json.dumps(results))
    print(table(results), file=sys.stderr)


if __name__ == "__main__":
    main()
