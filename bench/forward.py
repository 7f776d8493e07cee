"""Training-speed benchmark on CPU: ours (plain loss, fused ``lm_loss``, full AdamW step) vs Hugging Face.

    OMP_NUM_THREADS=2 python bench/forward.py            # gpt-bench, batch 8 x seq 256
    python bench/forward.py --layers 2 --steps 2 --no-peer

Prints one JSON object. Every figure is the median of ``--steps`` timed steps after
``--warmup`` steps; the peer (GPT-2 in transformers on torch) runs in subprocesses in the same
run, because absolute times on these shared machines drift and only side-by-side ratios hold:
``../shared/bench/peer_hf.py`` (its own train-step figure, a mean over its steps) and
``bench/peer_hf_fwdbwd.py`` (forward+backward alone and a median train step, timed like ours).
Medians are the figures; "best_step_s" (and "*_vs_peer_best_steps", fastest step against fastest
step) are the least disturbed steps, for reading a run on a busy machine.

Ours runs with ``gpt_compress.runtime.tune_cpu`` (``--tune``; see that module); "ours_untuned"
is a train step of a subprocess with ``--tune none``, the peer always runs untouched.
"peak_alloc_mb" is Paddle's host-allocator peak above what was allocated before the figure.

Model FLOPs per token follow the PaLM convention: ``6 * N + 12 * L * H * T``, where N counts the
weights used in matmuls (the blocks plus the LM head; the tied token embedding once, as the head;
embedding lookups are free) and ``12 * L * H * T`` is the attention score and value matmuls,
forward and backward, over the full (not causal-halved) T x T. "gflops" is that times tokens/s;
"matmul_ceiling_gflops" is a 2048^3 fp32 GEMM in the same process. "other_cpu_cores" is the CPU
that other processes used while a figure was measured (0 = quiet machine; 1 = one core stolen).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEER = os.path.join(REPO, "..", "shared", "bench", "peer_hf.py")
PEER_FWD_BWD = os.path.join(REPO, "bench", "peer_hf_fwdbwd.py")
FIGURES = ("fwd_bwd_lm_loss", "fwd_bwd_plain", "train_step_lm_loss", "train_step_plain")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="gpt-bench")
    p.add_argument("--layers", type=int, default=None, help="override the preset")
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--heads", type=int, default=None)
    p.add_argument("--vocab", type=int, default=None)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3, help="timed steps per figure (median)")
    p.add_argument("--chunk", type=int, default=None, help="lm_loss rows per chunk (default: its own)")
    p.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS") or 2))
    p.add_argument("--tune", default="mkl,views,malloc",
                   help="gpt_compress.runtime.tune_cpu settings to apply, comma-separated, or 'none': "
                        "mkl (MKL AVX2 path on AMD), views (no strided views), malloc (heap-only malloc)")
    p.add_argument("--no-peer", action="store_true", help="skip the Hugging Face subprocesses")
    p.add_argument("--no-untuned", action="store_true",
                   help="skip the train step with --tune none (a subprocess: what the settings buy)")
    p.add_argument("--figures", default=",".join(FIGURES), help="which of our figures to measure")
    return p.parse_args(argv)


class CpuMeter:
    """CPU cores used by *other* processes while the block runs (from /proc/stat and os.times)."""

    def __enter__(self):
        self._start = self._snap()
        return self

    def __exit__(self, *exc):
        (busy0, own0, t0), (busy1, own1, t1) = self._start, self._snap()
        self.other_cores = round(max(0.0, (busy1 - busy0) - (own1 - own0)) / max(t1 - t0, 1e-9), 2)

    @staticmethod
    def _snap():
        try:
            with open("/proc/stat", encoding="utf-8") as f:
                fields = [int(v) for v in f.readline().split()[1:]]
            busy = (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # minus idle, iowait
        except OSError:
            busy = 0.0
        t = os.times()
        return busy, t.user + t.system + t.children_user + t.children_system, time.monotonic()


def step_times(fn, warmup: int, steps: int) -> list[float]:
    """Seconds of each of ``steps`` calls of ``fn`` after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return times


def median_time(fn, warmup: int, steps: int) -> float:
    """Median seconds per call of ``fn`` over ``steps`` calls after ``warmup`` calls."""
    return statistics.median(step_times(fn, warmup, steps))


def run_json(cmd: list[str], env: dict) -> dict:
    """Run a script that prints one JSON line last; returns it, or the error."""
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        return {"error": f"{os.path.basename(cmd[1])} exited {proc.returncode}: {proc.stderr.strip()[-400:]}"}
    return json.loads(lines[-1])


def main(argv=None):
    a = parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(a.threads)  # read when paddle is imported
    peer_env = dict(os.environ)  # the peer runs without our tuning
    from gpt_compress.runtime import tune_cpu

    tune = set(a.tune.split(",")) - {"none", ""}
    unknown = tune - {"mkl", "views", "malloc"}
    if unknown:
        raise SystemExit(f"--tune: unknown setting(s) {sorted(unknown)}; use mkl, views, malloc or none")
    tuning = tune_cpu(mkl_amd="mkl" in tune, strided_views="views" not in tune, malloc="malloc" in tune)

    import paddle

    from gpt_compress.config import ModelConfig
    from gpt_compress.model.gpt import GPTForCausalLM
    from gpt_compress.train.loss import DEFAULT_CHUNK, lm_loss, lm_loss_reference

    a.chunk = a.chunk or DEFAULT_CHUNK

    overrides = {k: v for k, v in (("num_layers", a.layers), ("hidden_size", a.hidden),
                                   ("num_attention_heads", a.heads), ("vocab_size", a.vocab)) if v}
    cfg = ModelConfig.from_preset(a.preset, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                  **overrides)
    paddle.seed(0)
    model = GPTForCausalLM(cfg)
    ids = paddle.randint(0, cfg.vocab_size, [a.batch, a.seq])
    labels = paddle.randint(0, cfg.vocab_size, [a.batch, a.seq])
    tokens = a.batch * a.seq
    L, H, V, T = cfg.num_layers, cfg.hidden_size, cfg.vocab_size, a.seq
    n_matmul = cfg.num_parameters(include_embeddings=False) + V * H
    flops_per_token = 6 * n_matmul + 12 * L * H * T

    core = paddle.base.core

    def measure(step) -> dict:
        core.host_memory_stat_reset_peak_value("Allocated", 0)
        base = core.host_memory_stat_current_value("Allocated", 0)
        with CpuMeter() as cpu:
            times = step_times(step, a.warmup, a.steps)
        sec = statistics.median(times)
        peak = core.host_memory_stat_peak_value("Allocated", 0) - base
        # best_step_s: the least disturbed step, for comparisons on a shared machine
        return {"step_s": round(sec, 3), "best_step_s": round(min(times), 3),
                "tokens_per_s": round(tokens / sec, 1),
                "gflops": round(flops_per_token * tokens / sec / 1e9, 1),
                "peak_alloc_mb": round(peak / 2**20), "other_cpu_cores": cpu.other_cores}

    def fwd_bwd(loss_fn):
        def step():
            loss_fn(model, ids, labels).backward()
            model.clear_gradients(set_to_zero=False)
        return step

    def fused(m, x, y):
        return lm_loss(m, x, y, chunk=a.chunk)

    opt = paddle.optimizer.AdamW(learning_rate=1e-4, parameters=model.parameters(),
                                 grad_clip=paddle.nn.ClipGradByGlobalNorm(1.0))

    def train(loss_fn):
        def step():
            loss_fn(model, ids, labels).backward()
            opt.step()
            opt.clear_grad(set_to_zero=False)
        return step

    steps = {"fwd_bwd_lm_loss": fwd_bwd(fused), "fwd_bwd_plain": fwd_bwd(lm_loss_reference),
             "train_step_lm_loss": train(fused), "train_step_plain": train(lm_loss_reference)}
    figures = [f for f in a.figures.split(",") if f]
    if set(figures) - set(steps):
        raise SystemExit(f"--figures: unknown {sorted(set(figures) - set(steps))}; choose from {', '.join(steps)}")
    train(fused)()  # allocates AdamW's moments, so no figure's peak allocation includes them
    ours = {f: measure(steps[f]) for f in figures}

    # Matmul ceiling for MFU-style context: a square fp32 GEMM, same threads and settings.
    x = paddle.randn([2048, 2048])
    mm_s = median_time(lambda: paddle.matmul(x, x), 1, 5)
    ceiling = 2 * 2048**3 / mm_s / 1e9

    out = {
        "bench": "forward+backward and train-step tokens/s, CPU fp32",
        "paddle": paddle.__version__, "threads": a.threads, "tuning": tuning,
        "shape": {"preset": a.preset, "layers": L, "hidden": H, "heads": cfg.num_attention_heads, "vocab": V,
                  "batch": a.batch, "seq": T, "chunk": a.chunk},
        "flops": {"params_total": cfg.num_parameters(), "params_in_matmuls": n_matmul,
                  "flops_per_token": flops_per_token, "formula": "6*N_matmul + 12*L*H*T",
                  "matmul_ceiling_gflops": round(ceiling, 1)},
        "ours": ours,
    }
    for k, fig in ours.items():
        fig["fraction_of_ceiling"] = round(fig["gflops"] / ceiling, 3)
    if set(FIGURES) <= set(ours):
        out["lm_loss_over_plain"] = {
            "fwd_bwd_speed": round(ours["fwd_bwd_plain"]["step_s"] / ours["fwd_bwd_lm_loss"]["step_s"], 3),
            "train_speed": round(ours["train_step_plain"]["step_s"] / ours["train_step_lm_loss"]["step_s"], 3),
            "fwd_bwd_peak_alloc_mb_saved": (ours["fwd_bwd_plain"]["peak_alloc_mb"]
                                            - ours["fwd_bwd_lm_loss"]["peak_alloc_mb"])}

    shape = ["--layers", str(L), "--hidden", str(H), "--heads", str(cfg.num_attention_heads),
             "--vocab", str(V), "--batch", str(a.batch), "--seq", str(T), "--threads", str(a.threads)]
    if not a.no_untuned and tune:
        with CpuMeter() as cpu:
            untuned = run_json([sys.executable, os.path.abspath(__file__), "--preset", a.preset, *shape[:-2],
                                "--tune", "none", "--figures", "train_step_plain", "--no-peer", "--no-untuned",
                                "--warmup", "1", "--steps", "2"], peer_env)
        fig = untuned.get("ours", {}).get("train_step_plain", untuned)
        fig.pop("fraction_of_ceiling", None)  # its own ceiling is the untuned GEMM's
        fig["other_cpu_cores"] = cpu.other_cores
        out["ours_untuned"] = {"train_step_plain": fig}
        if "train_step_plain" in ours and "step_s" in fig:
            out["tuning_speedup_train_step_plain"] = round(fig["step_s"] / ours["train_step_plain"]["step_s"], 3)

    if not a.no_peer:
        with CpuMeter() as cpu:  # torch's first steps are slow: 2 warmup steps, as peer_hf.py does
            skip = [f"--no-{kind}" for kind in ("fwd-bwd", "train")
                    if not any(f.startswith(kind.replace("-", "_")) for f in ours)]
            fb = run_json([sys.executable, PEER_FWD_BWD, *shape, "--warmup", str(max(a.warmup, 2)),
                           "--steps", str(a.steps), *skip], peer_env)
        fb["other_cpu_cores"] = cpu.other_cores
        with CpuMeter() as cpu:
            hf = run_json([sys.executable, PEER, *shape, "--steps", str(max(a.steps, 3)),
                           "--prompt", "16", "--new-tokens", "8"], peer_env)
        hf["other_cpu_cores"] = cpu.other_cores
        out["peer"] = {"fwd_bwd": fb, "peer_hf_py": hf}
        ratios = {}
        for k in ours:
            if k.startswith("fwd_bwd") and "fwd_bwd_tokens_per_s" in fb:
                ratios[f"{k}_vs_peer_fwd_bwd"] = round(ours[k]["tokens_per_s"] / fb["fwd_bwd_tokens_per_s"], 3)
            if k.startswith("train_step") and "train_tokens_per_s" in fb:
                ratios[f"{k}_vs_peer_median_step"] = round(ours[k]["tokens_per_s"] / fb["train_tokens_per_s"], 3)
            if k.startswith("train_step") and "train_best_s" in fb:
                ratios[f"{k}_vs_peer_best_steps"] = round(fb["train_best_s"] / ours[k]["best_step_s"], 3)
            if k.startswith("train_step") and "train_tokens_per_s" in hf:
                ratios[f"{k}_vs_peer_hf_py"] = round(ours[k]["tokens_per_s"] / hf["train_tokens_per_s"], 3)
        out["ratios_ours_over_peer"] = ratios
    print(json.dumps(out))


if __name__ == "__main__":
    main()
