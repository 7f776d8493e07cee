"""Decode benchmark: greedy tokens/s and prefill latency for our backends (float32 and
weight-only int8/int4; Paddle Inference fused and unfused, onnxruntime, dygraph) and the Hugging
Face transformers, CTranslate2 and llama.cpp peers, side by side in one run; prints one JSON object.

    OMP_NUM_THREADS=2 python bench/decode.py            # gpt-bench, 64-token prompt, 128 new tokens
    python bench/decode.py --backends paddle,onnx_int8 --no-peer --rounds 1
    python bench/decode.py --peers llamacpp --rounds 1              # only the llama.cpp peer beside ours
    python bench/decode.py --preset gpt-345M --batch 1 --no-positions --int-formats fused ...

Every row reports the peak RSS of its worker process (``peak_rss_mb``, /proc VmHWM): a runner's
whole memory, weights included (``weights_mb``: the weight files its backend loads).

The llama.cpp peer (``peer_llamacpp.py``: llama-cpp-python built from source for this CPU, the same
random GPT-2 converted by llama.cpp's own ``convert_hf_to_gguf.py`` and quantized by its own
quantizer to q8_0 and q4_0) gives batch-1 tokens/s and its first-token time (the prompt's
evaluation and one sampled token) for f32, q8_0 and q4_0; ``make peers`` installs it and unpacks
the converter under ``output/peers`` (or name the script with ``$GPTC_LLAMA_CPP_CONVERT``).
Without it the rows say how to install it.

Exported backends also report a batch-1 decode step with 100 and with 900 tokens in the cache
(``step_ms_at_100/900``; the two caches' steps alternate, so the host's drift weighs on both),
and the fused program a step of ``--batch`` rows at the same two lengths
(``batch8_step_ms_at_100/900``: at 900 the step reads the keys and values of 7,200 positions).

Each backend (and the peer) runs in its own subprocess, one after another, so no two thread
pools compete for the cores. Rounds alternate the order of the backends. Within a round a
figure is the median of ``--reps`` runs; across rounds we report each contender's best round
(max tokens/s, min prefill ms) and list every round: on a shared 2-core machine one busy
neighbour can halve a round, and the best round is the one least disturbed, for every
contender alike. Tokens/s counts the new tokens of ``generate`` over its whole wall time,
prefill included, as the peer's ``model.generate`` does.

The bandwidth limit: a batch-1 decode step must read every weight once (the tied embedding
once, as the LM head), so ``limit = memory bandwidth / weight bytes``, with the bandwidth
measured here as the traffic (read + write) of a 256 MB numpy copy. At batch B the same
weight traffic serves B tokens (the KV cache is small next to the weights at these lengths).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The peers' scripts: ``../shared/bench`` beside the clone, or the directory $GPTC_BENCH_PEERS names.
PEERS = os.environ.get("GPTC_BENCH_PEERS") or os.path.join(ROOT, "..", "shared", "bench")
PEER = os.path.join(PEERS, "peer_hf.py")
# Contenders: name -> (backend, export variant, Generator.from_dir options). "paddle" runs the fused
# program (our CPU operators, the default on CPU); "paddle_unfused" the plain Paddle programs.
CONTENDERS = {
    "dygraph": ("dygraph", "ckpt", {}),
    "paddle": ("paddle", "fp32", {}),
    "paddle_unfused": ("paddle", "fp32", {"fused": False}),
    "onnx": ("onnx", "fp32", {}),
    "paddle_int8": ("paddle", "int8", {}),
    "paddle_int8_kvbf16": ("paddle", "int8_kvbf16", {}),  # the same program, its KV cache bfloat16
    "paddle_int8_unfused": ("paddle", "int8", {"fused": False}),
    "onnx_int8": ("onnx", "int8", {}),
    "paddle_int4": ("paddle", "int4", {}),
    "onnx_int4": ("onnx", "int4", {}),
}
BACKENDS = ("dygraph", "paddle", "paddle_unfused", "onnx", "paddle_int8", "onnx_int8", "paddle_int4", "onnx_int4")
PEER_CT2 = os.path.join(PEERS, "peer_ct2.py")
PEER_LLAMACPP = os.path.join(PEERS, "peer_llamacpp.py")
PEER_NAMES = ("hf", "ct2", "llamacpp")

# The peer at batch > 1 (peer_hf.py measures batch-1 decode only): same model and settings.
PEER_BATCH = r"""
import json, sys, time, torch
from transformers import GPT2Config, GPT2LMHeadModel
layers, hidden, heads, vocab, batch, prompt, new, threads, reps = map(int, sys.argv[1:10])
torch.manual_seed(0); torch.set_num_threads(threads)
cfg = GPT2Config(vocab_size=vocab, n_positions=1024, n_embd=hidden, n_layer=layers, n_head=heads,
                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
model = GPT2LMHeadModel(cfg).eval()
x = torch.randint(0, vocab, (batch, prompt))
runs = []
with torch.no_grad():
    model.generate(x, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    for _ in range(reps):
        t = time.perf_counter()
        model.generate(x, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
        runs.append(batch * new / (time.perf_counter() - t))
print(json.dumps({"batch": batch, "decode_tokens_per_s": sorted(runs)[len(runs) // 2]}))
"""


def copy_bandwidth_gbps(mbytes: int = 256, reps: int = 8) -> float:
    """Memory traffic (bytes read + written) per second of a large numpy copy, best of ``reps``."""
    a = np.ones(mbytes * 2**20 // 4, dtype=np.float32)
    b = np.empty_like(a)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        np.copyto(b, a)
        best = min(best, time.perf_counter() - t)
    return 2 * a.nbytes / best / 1e9


def weight_bytes_per_token(cfg) -> int:
    """fp32 bytes a decode step reads: every block weight, the final LN, and the LM head
    (the tied embedding read once as the head; the embedding rows looked up are negligible)."""
    head = cfg.vocab_size * cfg.hidden_size
    return 4 * (cfg.num_parameters(include_embeddings=False) + head)


# --------------------------------------------------------------------------------------
# Worker: one backend in this process
# --------------------------------------------------------------------------------------
def step_ms_at(gen, positions: tuple = (100, 900), steps: int = 16, batch: int = 1) -> dict:
    """Median decode step time (ms) of ``batch`` rows with each of ``positions`` tokens already
    in the cache, {position: ms}. The positions' steps alternate (one cache each), so a host that
    drifts between the first and the last step weighs on every position alike: the ratio of
    two positions is the figure to read."""
    rng = np.random.default_rng(1)
    state = {}
    for p in positions:
        ids = rng.integers(0, gen.vocab_size, (batch, p)).astype(np.int64)
        mask = np.ones_like(ids)
        _, cache = gen.backend.prefill(ids, mask)
        state[p] = [mask, cache, []]
    for _ in range(steps):
        for p in positions:
            mask, cache, times = state[p]
            mask = np.concatenate([mask, np.ones((batch, 1), np.int64)], axis=1)
            t = time.perf_counter()
            _, cache = gen.backend.decode(rng.integers(0, gen.vocab_size, (batch, 1)).astype(np.int64), mask, cache)
            times.append((time.perf_counter() - t) * 1e3)
            state[p][:2] = mask, cache
    return {p: round(statistics.median(state[p][2]), 2) for p in positions}


def peak_rss_mb() -> float:
    """This process's peak RSS: /proc's VmHWM (of this program only). ``getrusage``'s ru_maxrss
    survives exec, so a worker started by a driver that had exported a model reported the
    driver's peak (every row of a run showed the same figure)."""
    from gpt_compress.memory import status_bytes

    peak = status_bytes("VmHWM")
    if peak is None:  # no /proc
        return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)  # Linux: KiB
    return round(peak / 2 ** 20, 1)


def weights_mb(path: str, backend_class: str) -> float:
    """MB of the weight files the backend reads (the fused program's, the unfused Paddle
    programs', the ONNX external data, or the checkpoint)."""
    names = {"FusedBackend": ("fused.pdiparams",), "PaddleBackend": ("model.pdiparams",),
             "OrtBackend": ("model.onnx.data",)}.get(backend_class)
    files = [os.path.join(path, n) for n in names] if names else [
        os.path.join(path, f) for f in os.listdir(path) if f.endswith((".safetensors", ".pdparams"))
        and not f.startswith("optimizer")]
    return round(sum(os.path.getsize(f) for f in files if os.path.isfile(f)) / 2**20, 1)


def run_worker(name: str, path: str, prompt: int, new: int, batch: int, reps: int, positions: bool = True,
               fused_threads: int = 0) -> dict:
    from gpt_compress.inference.runner import Generator

    backend, _, options = CONTENDERS[name]
    if fused_threads and backend == "paddle" and options.get("fused") is not False:
        options = {**options, "threads": fused_threads}
    gen = Generator.from_dir(path, backend=backend, verify=False, **options)
    rng = np.random.default_rng(0)
    vocab = gen.vocab_size
    one = [[int(t) for t in rng.integers(0, vocab, prompt)]]
    many = [[int(t) for t in rng.integers(0, vocab, prompt)] for _ in range(batch)]
    ids, mask = np.array(one, dtype=np.int64), np.ones((1, prompt), dtype=np.int64)
    gen.generate(one, max_new_tokens=8, min_new_tokens=8)
    if batch > 1:
        gen.generate(many, max_new_tokens=8, min_new_tokens=8)
    prefill = []
    for _ in range(7):
        t = time.perf_counter()
        gen.backend.prefill(ids, mask)
        prefill.append((time.perf_counter() - t) * 1e3)
    b1, bn = [], []
    for _ in range(reps):
        out = gen.generate(one, max_new_tokens=new, min_new_tokens=new)
        assert len(out.sequences[0]) == new
        b1.append(out.tokens_per_s)
        if batch > 1:
            bn.append(gen.generate(many, max_new_tokens=new, min_new_tokens=new).tokens_per_s)
    prefill_ms = statistics.median(prefill)
    tps = statistics.median(b1)
    out = {"prefill_ms": round(prefill_ms, 2), "decode_tokens_per_s": round(tps, 1),
           "decode_step_ms": round((new / tps * 1e3 - prefill_ms) / (new - 1), 2),
           "runs_batch1": [round(x, 1) for x in b1], "backend_class": type(gen.backend).__name__}
    if bn:
        out[f"batch{batch}_decode_tokens_per_s"] = round(statistics.median(bn), 1)
    if positions and backend != "dygraph" and gen.max_positions >= 920:  # a step's cost vs the cache length
        at = step_ms_at(gen)
        out["step_ms_at_100"], out["step_ms_at_900"] = at[100], at[900]
    out["threads"] = getattr(gen.backend, "threads", None)
    out["weights_mb"] = weights_mb(path, out["backend_class"])
    out["peak_rss_mb"] = peak_rss_mb()  # before the batch steps below: the same work for every row
    if positions and batch > 1 and out["backend_class"] == "FusedBackend" and gen.max_positions >= 920:
        at = step_ms_at(gen, batch=batch)  # a step reads batch x 900 cached positions
        out[f"batch{batch}_step_ms_at_100"], out[f"batch{batch}_step_ms_at_900"] = at[100], at[900]
    return out


# --------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------
def _json_line(cmd: list[str], env: dict) -> dict:
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    lines = [x for x in proc.stdout.strip().splitlines() if x.startswith("{")]
    if proc.returncode != 0 or not lines:
        err = proc.stderr.strip().splitlines()
        return {"error": err[-1] if err else f"exit {proc.returncode}, no JSON on stdout"}
    res = json.loads(lines[-1])
    print(json.dumps({"row": cmd[3] if "--worker" in cmd else os.path.basename(cmd[1]), **res}), file=sys.stderr,
          flush=True)  # progress: a run cut short keeps its rows
    return res


def _reusable(out: str) -> bool:
    """An export in ``out`` to reuse: complete, and its fused program (if any) of this kernel
    version (the only one that runs). A stale one is removed."""
    from gpt_compress.inference.manifest import MANIFEST
    from gpt_compress.kernels import KERNEL_VERSION

    path = os.path.join(out, MANIFEST)
    if not os.path.isfile(path):
        return False
    with open(path, encoding="utf-8") as f:
        fused = json.load(f).get("fused")
    if fused is None or fused.get("kernel", {}).get("version") == KERNEL_VERSION:
        return True
    shutil.rmtree(out)
    return False


def prepare_int(workdir: str, preset: str, ckpt: str, bits: int, formats=("paddle", "onnx")) -> str:
    """Weight-only int``bits`` export (every Linear, the tied embedding/head and positions; blocks
    of 32, int8 inputs per token and block) of ``ckpt`` in ``formats``, reused if present (an
    export of other formats than paddle + onnx has them in its directory's name)."""
    from gpt_compress.checkpoint import load_model
    from gpt_compress.export import export_model
    from gpt_compress.config import QuantConfig
    from gpt_compress.qat.quantize import quantize_model

    suffix = "" if sorted(formats) == ["onnx", "paddle"] else "-" + "-".join(formats)
    out = os.path.join(workdir, f"{preset}-int{bits}{suffix}")
    if not _reusable(out):
        qmodel = quantize_model(load_model(ckpt), QuantConfig(targets=[], weight_only=["*"], weight_bits=bits))
        export_model(qmodel, out, formats=tuple(formats), validate=False)  # random init: see int8.py
    return out


def prepare_fused_int(workdir: str, preset: str, ckpt: str, bits: int, base: str, cache_dtype: str = "float32") -> str:
    """The weight-only int``bits`` model as the fused program alone, with ``base``'s (the float
    export's) manifest: for presets whose full int export (unfused programs + ONNX) needs more
    memory than the bench may use (gpt-345M: > 6 GB), and for a program with another KV cache
    dtype (``cache_dtype``). Only the fused Paddle backend runs it."""
    from gpt_compress.checkpoint import load_model
    from gpt_compress.config import QuantConfig
    from gpt_compress.export.fused import save_fused
    from gpt_compress.inference.manifest import MANIFEST
    from gpt_compress.qat.quantize import quantize_model

    out = os.path.join(workdir, f"{preset}-int{bits}-fused" + ("" if cache_dtype == "float32" else f"-kv{cache_dtype}"))
    if not _reusable(out):
        qmodel = quantize_model(load_model(ckpt), QuantConfig(targets=[], weight_only=["*"], weight_bits=bits))
        qmodel.eval()
        os.makedirs(out, exist_ok=True)
        info = save_fused(qmodel, out, cache_dtype=cache_dtype)
        with open(os.path.join(base, MANIFEST), encoding="utf-8") as f:
            manifest = json.load(f)
        manifest.update(fused=info, formats=["paddle"])
        with open(os.path.join(out, MANIFEST), "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=1)
    return out


def run_ct2(cfg, a, threads: int, env: dict) -> dict[str, dict]:
    """CTranslate2 (``peer_ct2.py`` in ``PEERS``) float32 and int8 on the same shape:
    {"ct2_float32": {...}, "ct2_int8": {...}} with batch-1 and batch-N tokens/s."""
    cmd = [sys.executable, PEER_CT2, "--layers", str(cfg.num_layers), "--hidden", str(cfg.hidden_size),
           "--heads", str(cfg.num_attention_heads), "--vocab", str(cfg.vocab_size), "--prompt", str(a.prompt),
           "--new-tokens", str(a.new_tokens), "--batches", f"1,{a.batch}", "--threads", str(threads),
           "--reps", str(a.reps), "--compute-types", "float32,int8"]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    out: dict[str, dict] = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            row = out.setdefault("ct2_" + r["compute_type"], {"peer": r["peer"], "model_mb": r["model_mb"]})
            key = "decode_tokens_per_s" if r["batch"] == 1 else f"batch{a.batch}_decode_tokens_per_s"
            row[key] = r["decode_tokens_per_s"]
    if not out:
        err = proc.stderr.strip().splitlines()
        return {"ct2_float32": {"error": err[-1] if err else f"exit {proc.returncode}"}}
    return out


def llama_cpp_converter() -> str | None:
    """llama.cpp's ``convert_hf_to_gguf.py``: ``$GPTC_LLAMA_CPP_CONVERT``, else the one ``make peers``
    unpacks under ``output/peers``; None if neither exists."""
    named = os.environ.get("GPTC_LLAMA_CPP_CONVERT")
    if named:
        return named if os.path.isfile(named) else None
    import glob

    found = sorted(glob.glob(os.path.join(ROOT, "output", "peers", "llama_cpp_python-*", "vendor", "llama.cpp",
                                          "convert_hf_to_gguf.py")))
    return found[-1] if found else None


def run_llamacpp(cfg, a, threads: int, env: dict) -> dict[str, dict]:
    """llama.cpp (``peer_llamacpp.py`` in ``PEERS``) f32, q8_0 and q4_0 on the same shape:
    {"llamacpp_f32": {...}, ...} with batch-1 tokens/s and the first token's time."""
    convert = llama_cpp_converter()
    probe = subprocess.run([sys.executable, "-c", "import llama_cpp"], env=env, capture_output=True)
    if convert is None or probe.returncode != 0:
        return {"llamacpp_q8_0": {"error": "llama-cpp-python or its converter is missing: run `make peers`"}}
    cmd = [sys.executable, PEER_LLAMACPP, "--layers", str(cfg.num_layers), "--hidden", str(cfg.hidden_size),
           "--heads", str(cfg.num_attention_heads), "--vocab", str(cfg.vocab_size), "--prompt", str(a.prompt),
           "--new-tokens", str(a.new_tokens), "--threads", str(threads), "--reps", str(a.reps),
           "--types", "f32,q8_0,q4_0", "--convert-script", convert]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    out: dict[str, dict] = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            out["llamacpp_" + r["type"]] = {
                "peer": f"llama.cpp {r['version']}", "decode_tokens_per_s": r["tokens_per_s"],
                "first_token_ms": r["first_token_ms"], "model_mb": r["file_mb"],
                **({"greedy_equals_transformers": r["greedy_equals_transformers"]}
                   if r.get("greedy_equals_transformers") is not None else {})}
    if not out:
        err = proc.stderr.strip().splitlines()
        return {"llamacpp_q8_0": {"error": err[-1] if err else f"exit {proc.returncode}"}}
    return out


def prepare(workdir: str, preset: str) -> tuple[str, str]:
    """A random-init checkpoint of ``preset`` and its export (paddle + onnx), reused if present."""
    import paddle

    from gpt_compress.checkpoint import save_model
    from gpt_compress.config import ModelConfig
    from gpt_compress.export import export
    from gpt_compress.model.gpt import GPTForCausalLM

    ckpt, out = os.path.join(workdir, f"{preset}-ckpt"), os.path.join(workdir, f"{preset}-export")
    if not _reusable(out):
        paddle.seed(0)
        cfg = ModelConfig.from_preset(preset, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        save_model(GPTForCausalLM(cfg), ckpt, overwrite=True)  # its own work dir: redo after an interruption
        export(ckpt, out, formats=("paddle", "onnx"), overwrite=True)
    return ckpt, out


# (numerator, denominator, figure): the targets as ratios of one run.
RATIOS = [("paddle_int8", "onnx_int8", "decode_tokens_per_s"), ("paddle_int8", "paddle", "decode_tokens_per_s"),
          ("paddle", "onnx", "decode_tokens_per_s"), ("paddle", "paddle_unfused", "decode_tokens_per_s"),
          ("paddle_int4", "paddle_int8", "decode_tokens_per_s"), ("paddle_int8", "onnx_int8", "BATCH"),
          ("onnx", "paddle", "prefill_ms"), ("onnx_int8", "paddle_int8", "prefill_ms"),
          ("paddle_int8", "llamacpp_q8_0", "decode_tokens_per_s"), ("paddle_int4", "llamacpp_q4_0", "decode_tokens_per_s"),
          ("paddle", "llamacpp_f32", "decode_tokens_per_s"), ("paddle_int8_kvbf16", "paddle_int8", "BATCH"),
          ("paddle_int8_kvbf16", "onnx_int8", "BATCH")]


def ratios(results: dict, key_b: str) -> dict:
    """The ratios of RATIOS whose rows were measured (prefill: onnxruntime's ms over ours, so
    above 1 means ours is faster)."""
    out = {}
    for num, den, key in RATIOS:
        key = key_b if key == "BATCH" else key
        a, b = results.get(num, {}).get(key), results.get(den, {}).get(key)
        if a and b:
            out[f"{num}/{den} {key}"] = round(a / b, 2)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="gpt-bench")
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--reps", type=int, default=3, help="generate() runs per backend and round")
    p.add_argument("--rounds", type=int, default=3, help="passes over all backends, order alternating")
    p.add_argument("--backends", default=",".join(BACKENDS))
    p.add_argument("--no-peer", action="store_true", help="skip the peers (transformers, CTranslate2, llama.cpp)")
    p.add_argument("--peers", default=",".join(PEER_NAMES), help=f"the peers to run, of {', '.join(PEER_NAMES)}")
    p.add_argument("--workdir", default=None, help="keep/reuse the checkpoint and export here")
    p.add_argument("--no-positions", action="store_true", help="skip the steps at 100 / 900 cached tokens")
    p.add_argument("--int-formats", default="paddle,onnx",
                   help="formats of the int exports, or 'fused' (the fused program alone) or 'fused,onnx' "
                        "(the fused program and an ONNX-only export, for onnx_int*): gpt-345M's full int8 "
                        "export needs > 6 GB, the ONNX-only one about 4 GB")
    p.add_argument("--fused-threads", type=int, default=0,
                   help="OpenMP threads of the fused operators (0: the backend's default)")
    p.add_argument("--worker", nargs=2, metavar=("BACKEND", "PATH"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        print(json.dumps(run_worker(a.worker[0], a.worker[1], a.prompt, a.new_tokens, a.batch, a.reps,
                                    positions=not a.no_positions, fused_threads=a.fused_threads)))
        return

    threads = int(os.environ.get("OMP_NUM_THREADS", "2"))
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    from gpt_compress.config import ModelConfig

    cfg = ModelConfig.from_preset(a.preset)
    workdir = a.workdir or tempfile.mkdtemp(prefix="bench-decode-")
    os.makedirs(workdir, exist_ok=True)
    t0 = time.perf_counter()
    ckpt, out = prepare(workdir, a.preset)
    backends = [b for b in a.backends.split(",") if b]
    unknown = [b for b in backends if b not in CONTENDERS]
    if unknown:
        p.error(f"unknown backend(s) {unknown}; choose from {', '.join(CONTENDERS)}")
    paths = {"ckpt": ckpt, "fp32": out}
    int_formats = a.int_formats.split(",")
    for bits in (8, 4):
        users = {CONTENDERS[b][0] for b in backends if CONTENDERS[b][1] == f"int{bits}"}
        if not users:
            continue
        if "fused" not in int_formats:
            paths[f"int{bits}"] = prepare_int(workdir, a.preset, ckpt, bits, int_formats)
            continue
        paths[f"int{bits}"] = prepare_fused_int(workdir, a.preset, ckpt, bits, out)
        if "onnx" in int_formats and "onnx" in users:
            paths[f"int{bits}_onnx"] = prepare_int(workdir, a.preset, ckpt, bits, ("onnx",))
    if any(CONTENDERS[b][1] == "int8_kvbf16" for b in backends):
        paths["int8_kvbf16"] = prepare_fused_int(workdir, a.preset, ckpt, 8, out, cache_dtype="bfloat16")
    export_s = time.perf_counter() - t0

    peers = [] if a.no_peer else [x for x in a.peers.split(",") if x]
    if set(peers) - set(PEER_NAMES):
        p.error(f"unknown peer(s) {sorted(set(peers) - set(PEER_NAMES))}; choose from {', '.join(PEER_NAMES)}")
    names = backends + [f"{x}_peer" for x in peers]
    runs: dict[str, list[dict]] = {n: [] for n in names}
    common = ["--prompt", str(a.prompt), "--new-tokens", str(a.new_tokens), "--batch", str(a.batch),
              "--reps", str(a.reps), "--fused-threads", str(a.fused_threads)] + (["--no-positions"] * a.no_positions)
    peer_args = ["--layers", str(cfg.num_layers), "--hidden", str(cfg.hidden_size),
                 "--heads", str(cfg.num_attention_heads), "--vocab", str(cfg.vocab_size),
                 "--prompt", str(a.prompt), "--new-tokens", str(a.new_tokens), "--threads", str(threads)]
    bandwidth = []
    for r in range(a.rounds):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            if name == "hf_peer":
                res = _json_line([sys.executable, PEER, *peer_args], env)
                res.update({f"batch{a.batch}_decode_tokens_per_s": _json_line(
                    [sys.executable, "-c", PEER_BATCH, str(cfg.num_layers), str(cfg.hidden_size),
                     str(cfg.num_attention_heads), str(cfg.vocab_size), str(a.batch), str(a.prompt),
                     str(a.new_tokens), str(threads), str(a.reps)], env).get("decode_tokens_per_s")})
            elif name in ("ct2_peer", "llamacpp_peer"):
                for row, res in (run_ct2 if name == "ct2_peer" else run_llamacpp)(cfg, a, threads, env).items():
                    runs.setdefault(row, []).append(res)
                continue
            else:
                kind, variant, _ = CONTENDERS[name]
                path = paths.get(f"{variant}_{kind}", paths[variant])
                res = _json_line([sys.executable, os.path.abspath(__file__), "--worker", name, path, *common], env)
            runs[name].append(res)
        bandwidth.append(copy_bandwidth_gbps())

    gbps = max(bandwidth)
    per_token = weight_bytes_per_token(cfg)
    limit = gbps * 1e9 / per_token
    key_b = f"batch{a.batch}_decode_tokens_per_s"
    results = {}
    for name, rs in runs.items():
        if not rs:  # ct2_peer, llamacpp_peer: their rows are ct2_float32, llamacpp_q8_0, ...
            continue
        ok = [x for x in rs if "error" not in x]
        if not ok:
            results[name] = rs[-1]
            continue
        med = {}
        for k in ("decode_tokens_per_s", "prefill_ms", "first_token_ms", key_b, "step_ms_at_100", "step_ms_at_900",
                  f"batch{a.batch}_step_ms_at_100", f"batch{a.batch}_step_ms_at_900", "peak_rss_mb"):
            vals = [x[k] for x in ok if x.get(k) is not None]
            if vals:
                med[k] = round(max(vals) if "tokens_per_s" in k else min(vals), 2)
        for k in ("weights_mb", "threads", "backend_class", "peer", "model_mb", "greedy_equals_transformers"):
            if ok[-1].get(k) is not None:
                med[k] = ok[-1][k]
        if med.get("weights_mb") and med.get("peak_rss_mb"):
            med["rss_over_weights"] = round(med["peak_rss_mb"] / med["weights_mb"], 2)
        if "step_ms_at_900" in med:
            med["step_900_over_100"] = round(med["step_ms_at_900"] / med["step_ms_at_100"], 2)
        if a.batch > 1:
            med[f"rounds_batch{a.batch}"] = [x.get(key_b) for x in ok]
        med["fraction_of_bandwidth_limit"] = round(med["decode_tokens_per_s"] / limit, 3)
        if key_b in med:
            med[f"batch{a.batch}_fraction_of_limit"] = round(med[key_b] / (a.batch * limit), 3)
            # batch-N tokens/s over batch 1's: N when a step of N rows costs what a step of one does
            med[f"batch{a.batch}_over_batch1"] = round(med[key_b] / med["decode_tokens_per_s"], 2)
        med["rounds"] = [x.get("decode_tokens_per_s") for x in ok]
        results[name] = med
    peer = results.get("hf_peer", {})
    for name in backends:
        if peer.get("decode_tokens_per_s") and "decode_tokens_per_s" in results[name]:
            results[name]["vs_peer_batch1"] = round(results[name]["decode_tokens_per_s"] / peer["decode_tokens_per_s"], 2)
            if peer.get(key_b) and key_b in results[name]:
                results[name][f"vs_peer_batch{a.batch}"] = round(results[name][key_b] / peer[key_b], 2)
    print(json.dumps({
        "bench": "decode", "ratios": ratios(results, key_b), "preset": a.preset, "params": cfg.num_parameters(), "threads": threads,
        "prompt_tokens": a.prompt, "new_tokens": a.new_tokens, "batch": a.batch,
        "copy_bandwidth_gbps": round(gbps, 1), "weight_bytes_per_token": per_token,
        "bandwidth_limit_tokens_per_s": round(limit, 1), "export_seconds": round(export_s, 1),
        "results": results,
    }, indent=1))


if __name__ == "__main__":
    main()
