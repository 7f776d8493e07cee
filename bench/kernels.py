"""Where a fused decode step's time goes: inside each op section vs Paddle vs Python; one JSON.

    OMP_NUM_THREADS=2 python bench/kernels.py --workdir /tmp/bench-decode      # gpt-bench fp32, int8
    python bench/kernels.py --formats int8,int4 --steps 64

For each weight format a worker process (``--worker``) runs the fused backend on the exports
``bench/decode.py`` writes (reused from ``--workdir``) with ``$GPTC_PROFILE`` set, so the ops
(``kernels/gptc_common.h``) sum the wall time of every section (embed; per layer: ln1, qkv,
attention, out, ln2, fc, proj; head_ln, head_linear) and the gaps from one run's op to the next
run's (``outside_program``: Paddle Inference's run entry/exit, our Python). The program's one
``gptc_generate`` op runs the whole step in one OpenMP region: ``embed`` then includes the op's
checks and setup and the region's fork (thread 0 does not wait for the other threads to wake: a
late one shows in the first layer's qkv), ``ln1`` the layer norm alone, and ``between_ops`` stays
empty; Paddle's per-run cost of the op's inputs is in ``outside_program``.
It reports per batch-1 decode step, in microseconds:

- ``generate_step_us``: ``Generator.generate`` (greedy) wall time per new token, prefill excluded
  (the median over ``--reps`` runs of each run's mean; up to 8 greedy tokens come from one program
  run, ``FusedBackend.greedy_steps``, while ``decode_call_us`` and ``predictor_run_us`` are one
  step a call, so ``python_loop`` below can be negative: generate saves the per-run costs);
- ``decode_call_us``: ``backend.decode`` alone (mask growth by the caller, no argmax);
- ``predictor_run_us``: ``predictor.run()`` with the inputs bound once (the program alone);
- ``ops_us``: each section per step (layers summed), its weights' GB/s next to the machine's
  copy bandwidth (``bandwidth_gbps``, bench/decode.py's 256 MB numpy copy);
- ``overhead_us``: generate - decode (the Python loop: argmax, mask concat), decode - run (the
  worker-thread hop, the inputs copied in, the (B, V) logits copied out), run - ops (Paddle
  Inference), and the op-measured gaps.
Prefill (the prompt) sections are reported under ``prefill_ms``. The ops hand rows to their threads
dynamically, and sections are timed by thread 0: when it arrives late the other thread may have
done a section's work already, so a section's *fastest* call can be near zero; read the means.

``--roofline`` instead times the matrix kernels standalone, on one thread, against the host's own
peak (the ops library's ``gptc_bench_*`` C functions, kernels/gptc_bench.h), in the thread's CPU
time (a call that another process preempts is not charged for the time it waited):

    python bench/kernels.py --roofline                       # gpt-bench and gpt-345M, M = 1..256
    python bench/kernels.py --roofline --presets gpt-bench --ms 1,64 --formats int8

- ``peaks_gmacs``: multiply-adds a second of a tight loop of each instruction the kernels multiply
  with (``vpdpbusd``: 64 a 512-bit instruction, or 32 at 256 bits; ``vfmadd231ps``: 16 or 8;
  ``vpmaddubsw``: 32, the AVX2 int8 path's), the median of ``--peak-reps`` loops;
- ``shapes``: each Linear of a block (qkv, out, fc, proj) at each M, per format: the median of
  many calls' time (7 to 300 calls), its GMAC/s and its ``fraction`` of the peak of the
  instruction its format's GEMM uses (int8/int4: vpdpbusd where the build's GEMM has 512-bit
  VNNI, else vpmaddubsw; fp32: vfmadd231ps), that peak measured alongside: each call is
  followed by a peak loop of its length (``peak_gmacs_alongside``, their median), so on a shared
  machine a neighbour slows both sides of the ratio alike. ``int8`` is the weights as exports
  store them (row groups, kernels/gptc_grouped.h); ``--formats int8_rows`` adds row-major int8.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import decode as bench_decode  # noqa: E402  (bench/decode.py: exports, bandwidth)

LAYER_SECTIONS = ("ln1", "qkv", "attention", "out", "ln2", "fc", "proj")


def linear_bytes(n: int, k: int, bits: int) -> int:
    """Bytes a Linear's weights (N, K) occupy in the fused program (bias excluded)."""
    if bits == 32:
        return 4 * n * k
    return n * k * bits // 8 + 4 * n * (k // 32)


def weight_bytes(cfg, bits: int) -> dict:
    c, out = cfg.hidden_size, {"qkv": 0, "out": 0, "fc": 0, "proj": 0}
    for i in range(cfg.num_layers):
        inner, f = cfg.heads(i) * cfg.dim_head, cfg.ffn(i)
        for k, (n, kk) in {"qkv": (3 * inner, c), "out": (c, inner), "fc": (f, c), "proj": (c, f)}.items():
            out[k] += linear_bytes(n, kk, bits)
    out["head_linear"] = linear_bytes(cfg.vocab_size, c, bits)
    return out


def worker(path: str, prompt: int, new: int, steps: int, reps: int) -> dict:
    from gpt_compress.inference.runner import Generator

    gen = Generator.from_dir(path, backend="paddle", verify=False)
    backend = gen.backend
    rng = np.random.default_rng(0)
    one = [[int(t) for t in rng.integers(0, gen.vocab_size, prompt)]]
    gen.generate(one, max_new_tokens=8, min_new_tokens=8)
    gen_steps = []
    for _ in range(reps):  # generate's time per new token, prefill excluded: a mean over the run, since
        stamps = []         # greedy tokens come several per program run (FusedBackend.greedy_steps)
        gen.generate(one, max_new_tokens=new, min_new_tokens=new, on_tokens=lambda _: stamps.append(time.perf_counter()))
        gen_steps.append((stamps[-1] - stamps[0]) / (len(stamps) - 1) * 1e6)
    ids, mask = np.array(one, np.int64), np.ones((1, prompt), np.int64)
    prefills = []
    for _ in range(10):
        t = time.perf_counter()
        _, cache = backend.prefill(ids, mask)
        prefills.append((time.perf_counter() - t) * 1e3)
    calls = []
    for _ in range(min(steps, new - 1)):
        mask = np.concatenate([mask, np.ones((1, 1), np.int64)], axis=1)
        t = time.perf_counter()
        _, cache = backend.decode(rng.integers(0, gen.vocab_size, (1, 1)).astype(np.int64), mask, cache)
        calls.append((time.perf_counter() - t) * 1e6)
    # The program alone: inputs bound once (the backend's own handles), one position rewritten each run.
    backend.on_thread(backend._run, np.array([[5]], np.int64), mask, np.array([0], np.int64), cache.tensors)
    runs = backend.on_thread(_time_runs, backend._pred, steps)
    out = {"prefill_call_ms": round(statistics.median(prefills), 2), "prefill_call_fastest_ms": round(min(prefills), 2)}
    for name, xs in (("generate_step_us", gen_steps), ("decode_call_us", calls), ("predictor_run_us", runs)):
        out[name] = round(statistics.median(xs), 1)
        out[name.replace("_us", "_fastest_us")] = round(min(xs), 1)
    return out


def _time_runs(pred, steps: int) -> list:
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        pred.run()
        times.append((time.perf_counter() - t) * 1e6)
    return times


def summarize(res: dict, prof: dict, bytes_: dict, gbps: float) -> dict:
    """Per-step section times from the profile sums; overheads; GB/s."""
    dec, pre = prof["decode"], prof["prefill"]
    n_steps = max(dec["head_linear"][1], 1)  # one head call per program run
    ops = {k: round(v[0] / n_steps / 1e3, 1) for k, v in dec.items() if v[1]}
    # The fastest call of each section times its calls per step: the step on a quiet machine.
    least = {k: round(v[2] * v[1] / n_steps / 1e3, 1) for k, v in dec.items() if v[1]}
    inside = sum(v for k, v in ops.items() if k not in ("between_ops", "outside_program"))
    gbs = {k: round(bytes_[k] / (ops[k] * 1e-6) / 1e9, 1) for k in bytes_ if ops.get(k)}
    total_bytes = sum(bytes_.values())
    out = dict(res)
    out.update({
        "ops_us": ops, "ops_total_us": round(inside, 1), "ops_fastest_us": least,
        "ops_fastest_total_us": round(sum(v for k, v in least.items() if k not in ("between_ops", "outside_program")), 1),
        "weights_gbps_fastest": {k: round(bytes_[k] / (least[k] * 1e-6) / 1e9, 1) for k in bytes_ if least.get(k)},
        "weights_gbps": gbs, "bandwidth_gbps": round(gbps, 1),
        "step_weight_mb": round(total_bytes / 2**20, 1),
        "ops_gbps": round(total_bytes / (inside * 1e-6) / 1e9, 1),
        "overhead_us": {"python_loop": round(res["generate_step_us"] - res["decode_call_us"], 1),
                        "decode_wrapper": round(res["decode_call_us"] - res["predictor_run_us"], 1),
                        "predictor_not_ops": round(res["predictor_run_us"] - inside, 1)},
        "overhead_fastest_us": {
            "python_loop": round(res["generate_step_fastest_us"] - res["decode_call_fastest_us"], 1),
            "decode_wrapper": round(res["decode_call_fastest_us"] - res["predictor_run_fastest_us"], 1),
            "predictor_not_ops": round(res["predictor_run_fastest_us"] - sum(
                v for k, v in least.items() if k not in ("between_ops", "outside_program")), 1)},
        "prefill_ms": {k: round(v[0] / max(pre["head_linear"][1], 1) / 1e6, 2) for k, v in pre.items()
                       if v[1] and k != "outside_program"},
        "prefill_fastest_ms": {k: round(v[2] * v[1] / max(pre["head_linear"][1], 1) / 1e6, 2) for k, v in pre.items()
                               if v[1] and k != "outside_program"},
    })
    return out


# Linear shapes of a block (N, K) by name, for hidden size c (FFN 4c, attention inner c).
def block_shapes(c: int) -> dict:
    return {"qkv": (3 * c, c), "out": (c, c), "fc": (4 * c, c), "proj": (c, 4 * c)}


def _peak(lib, kind: int, seconds: float) -> float:
    """GMAC/s of one peak loop of about ``seconds``."""
    iters = max(100, int(seconds * 1e9 / 12 / 16))  # ~16 instructions a ns: about `seconds` on most hosts
    return lib.gptc_bench_peak(kind, iters) / 1e9


def roofline(presets: list, ms: list, formats: list, peak_reps: int) -> dict:
    """Peaks and each block Linear's fraction of its instruction's peak, one thread. Each kernel
    call is followed by a peak loop of about its length, and a shape's fraction is the median of
    the kernel's rate over the median of those loops' rates: a neighbour who slows one part of the
    run slows both sides of the ratio."""
    import ctypes

    from gpt_compress import kernels
    from gpt_compress.config import ModelConfig

    os.environ["GPTC_THREADS"] = "1"
    kernels.load_ops()
    lib = ctypes.CDLL(kernels.library_path())
    lib.gptc_bench_peak.restype = ctypes.c_double
    lib.gptc_bench_peak.argtypes = [ctypes.c_int, ctypes.c_int64]
    lib.gptc_bench_linear_new.restype = ctypes.c_void_p
    lib.gptc_bench_linear_new.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                          ctypes.c_int64, ctypes.c_float]
    lib.gptc_bench_linear_run.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_double)]
    lib.gptc_bench_linear_free.argtypes = [ctypes.c_void_p]
    paths = lib.gptc_bench_paths()
    kinds = {"vpdpbusd": 0, "vfmadd231ps": 1, "vpmaddubsw": 2}
    peaks = {name: round(statistics.median(_peak(lib, kind, 0.05) for _ in range(peak_reps)), 1)
             for name, kind in kinds.items()}
    int_peak = "vpdpbusd" if paths & 1 else "vpmaddubsw"
    rows = []
    for preset in presets:
        c = ModelConfig.from_preset(preset).hidden_size
        for layer, (n, k) in block_shapes(c).items():
            for m in ms:
                for fmt in formats:
                    bits = {"fp32": 32, "int8": 9, "int8_rows": 8, "int4": 4}[fmt]  # int8: row groups
                    h = lib.gptc_bench_linear_new(bits, m, n, k, 32, -1.0 if bits == 32 else 0.0)
                    if not h:
                        continue
                    macs = m * n * k
                    reps = int(min(300, max(7, 0.1 * 30e9 / macs)))  # ~0.1 s at 30 GMAC/s, 7 to 300 calls
                    peak = "vfmadd231ps" if bits == 32 else int_peak
                    one = (ctypes.c_double * 1)()
                    lib.gptc_bench_linear_run(h, 1, one)  # warm-up: scratch grown, weights paged in
                    times, rates = [], []
                    for _ in range(reps):
                        lib.gptc_bench_linear_run(h, 1, one)
                        times.append(one[0])
                        rates.append(_peak(lib, kinds[peak], one[0]))
                    lib.gptc_bench_linear_free(h)
                    t, local = statistics.median(times), statistics.median(rates)
                    gmacs = macs / t / 1e9
                    rows.append({"preset": preset, "layer": layer, "M": m, "N": n, "K": k, "format": fmt,
                                 "median_us": round(t * 1e6, 1), "calls": reps, "gmacs": round(gmacs, 1),
                                 "peak": peak, "peak_gmacs_alongside": round(local, 1),
                                 "fraction": round(gmacs / local, 3)})
                    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return {"bench": "kernels_roofline", "threads": 1, "isa": kernels.isa(), "macros": kernels.isa_macros(),
            "gemm_paths": {"int_vnni512": bool(paths & 1), "float_avx512": bool(paths & 2)},
            "peaks_gmacs": peaks, "load_avg": os.getloadavg(), "shapes": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="gpt-bench")
    p.add_argument("--workdir", default=None, help="exports of bench/decode.py (made if missing)")
    p.add_argument("--formats", default=None,
                   help="fp32, int8, int4 (default fp32,int8; --roofline: all three, and int8_rows on request)")
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--steps", type=int, default=200, help="predictor runs timed")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--roofline", action="store_true", help="standalone one-thread kernels vs the host's peak")
    p.add_argument("--presets", default="gpt-bench,gpt-345M", help="--roofline: model shapes")
    p.add_argument("--ms", default="1,8,16,64,256", help="--roofline: input rows M")
    p.add_argument("--peak-reps", type=int, default=15, help="--roofline: peak loops (median)")
    a = p.parse_args()
    if a.roofline:
        fmts = [f for f in (a.formats or "fp32,int8,int4").split(",") if f]
        print(json.dumps(roofline(a.presets.split(","), [int(m) for m in a.ms.split(",")], fmts, a.peak_reps),
                         indent=1))
        return
    if a.worker:
        print(json.dumps(worker(a.worker, a.prompt, a.new_tokens, a.steps, a.reps)))
        return
    from gpt_compress.config import ModelConfig

    cfg = ModelConfig.from_preset(a.preset)
    workdir = a.workdir or tempfile.mkdtemp(prefix="bench-kernels-")
    ckpt, base = bench_decode.prepare(workdir, a.preset)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    results = {}
    gbps = bench_decode.copy_bandwidth_gbps()
    for fmt in [f for f in (a.formats or "fp32,int8").split(",") if f]:
        bits = {"fp32": 32, "int8": 8, "int4": 4}[fmt]
        path = base if bits == 32 else bench_decode.prepare_fused_int(workdir, a.preset, ckpt, bits, base)
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            prof_path = f.name
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", path, "--prompt", str(a.prompt),
               "--new-tokens", str(a.new_tokens), "--steps", str(a.steps), "--reps", str(a.reps)]
        proc = subprocess.run(cmd, env={**env, "GPTC_PROFILE": prof_path}, capture_output=True, text=True)
        lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
        if proc.returncode or not lines:
            results[fmt] = {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1]}
            continue
        with open(prof_path, encoding="utf-8") as f:
            prof = json.load(f)
        os.unlink(prof_path)
        results[fmt] = summarize(json.loads(lines[-1]), prof, weight_bytes(cfg, bits), gbps)
        print(json.dumps({fmt: results[fmt]}), file=sys.stderr, flush=True)
    print(json.dumps({"bench": "kernels", "preset": a.preset, "threads": int(env["OMP_NUM_THREADS"]),
                      "load_avg": os.getloadavg(), "results": results}, indent=1))


if __name__ == "__main__":
    main()
