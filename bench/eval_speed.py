"""WikiText evaluation speed: the old full-logits path against ``gptc eval``'s scoring path, in one
process with alternating rounds, and where the new path's time goes.

    OMP_NUM_THREADS=2 python bench/eval_speed.py --model EXPORT --backends onnx,paddle,fused \
        --chars 60000 --strides 0,64 --rounds 2 --output eval_speed.json

"old" is the evaluation before issue 14 (commit 2b2843f): ``score``'s full (B, T, V) logits
(the ``forward`` program) and a numpy log-softmax over every position of every window
(``eval.scoring.label_logprobs`` is that same numpy code), masked afterwards. "new" is
``eval.wikitext.evaluate_wikitext`` as ``gptc eval`` runs it (same batch size). Both tokenize the
same text; their average losses must agree to 1e-6 relative ("rel_diff").

Each round runs old then new for every (backend, stride); the figures are per-round times and
their medians, so a burst of load on this shared machine hits both sides. "breakdown" splits one
extra run of the new path by backend method (``hidden_states`` = the body, ``head_scores`` = head
matmul + log-sum-exp + gathers + argmax, ``logits_at`` + ``numpy`` for the fused program);
"python" is the rest. "gemm" is the head's bare matmul for the same number of rows, in
onnxruntime (a MatMul-only graph, rows per call as the scoring path uses) and numpy, with its
GFLOP/s: the floor of any exact scoring path, which must compute every logit of every scored row;
beside it ``gptc_head_score`` (the Paddle backend's whole head: matmul + log-sum-exp + argmax)
and "square_2048_numpy_gflops" (a 2048^3 GEMM: what the cores give at that moment).
"load" is the 1-minute load average before and after (2 cores: above 2 means contention).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from gpt_compress.eval.scoring import ROWS, label_logprobs  # noqa: E402
from gpt_compress.eval.wikitext import (build_windows, evaluate_wikitext, read_wikitext,  # noqa: E402
                                        write_text_prefix)

WIKI = os.path.join(REPO, "..", "shared", "data", "wikitext-2", "wiki.test.raw")


def old_wikitext(gen, tok, path: str, seq_len: int, stride: int, batch_size: int) -> float:
    """The pre-issue-14 loop: full logits, numpy over every position, then the mask. Returns avg_loss."""
    text, _ = read_wikitext(path, "raw")
    tokens = np.asarray(tok.encode(text), dtype=np.int64)
    windows = list(build_windows(tokens, seq_len, stride, tok.eod_id))
    total = 0.0
    for start in range(0, len(windows), batch_size):
        group = windows[start:start + batch_size]
        ids = np.stack([w[0] for w in group])
        lp, _ = label_logprobs(gen.score(ids), np.stack([w[1] for w in group]))
        total += float(-(lp * np.stack([w[2] for w in group])).sum())
    return total / (len(tokens) - 1)


class Timed:
    """The generator with its scoring methods timed (seconds per method name)."""

    METHODS = ("hidden_states", "head_scores", "logits_at", "score")

    def __init__(self, gen):
        self._gen, self.seconds = gen, {}

    def __getattr__(self, name):
        attr = getattr(self._gen, name)
        if name not in self.METHODS:
            return attr

        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return attr(*args, **kwargs)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t
        return timed


def breakdown(gen, path: str, seq_len: int, stride: int, batch_size: int) -> dict:
    """One new-path run with per-method times; the numpy reduction of ``logits_at`` rows is timed
    by wrapping ``label_logprobs`` where ``score_positions`` looks it up."""
    import gpt_compress.eval.scoring as scoring

    timed, ref = Timed(gen), scoring.label_logprobs
    spent = {"numpy": 0.0}

    def counted(*args):
        t = time.perf_counter()
        try:
            return ref(*args)
        finally:
            spent["numpy"] += time.perf_counter() - t
    scoring.label_logprobs = counted
    try:
        t = time.perf_counter()
        res = evaluate_wikitext(timed, gen.tokenizer, path, "raw", seq_len=seq_len, stride=stride,
                                batch_size=batch_size, progress=False)
        total = time.perf_counter() - t
    finally:
        scoring.label_logprobs = ref
    parts = {**timed.seconds, **({"numpy": spent["numpy"]} if spent["numpy"] else {})}
    parts["python"] = total - sum(parts.values())
    return {"total_s": round(total, 2), "scored_rows": res.num_scored,
            **{k + "_s": round(v, 2) for k, v in parts.items()}}


def gemm(rows: int, hidden: int, vocab: int, per_call: int = ROWS, threads: int = 0) -> dict:
    """Seconds and GFLOP/s of ``rows`` x hidden x vocab as the head's bare matmul (random weights),
    ``per_call`` rows a call: onnxruntime MatMul-only graph, and numpy."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from gpt_compress.inference.ort import session_options

    rng = np.random.default_rng(0)
    w = rng.standard_normal((hidden, vocab), dtype=np.float32)
    x = rng.standard_normal((rows, hidden), dtype=np.float32)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "head",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", hidden])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", vocab])],
                              [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    sess = ort.InferenceSession(model.SerializeToString(), session_options(threads), providers=["CPUExecutionProvider"])
    flop = 2.0 * rows * hidden * vocab
    out = {}
    for name, fn in (("ort", lambda a: sess.run(None, {"x": a})), ("numpy", lambda a: a @ w)):
        fn(x[:per_call])
        t = time.perf_counter()
        for i in range(0, rows, per_call):
            fn(x[i:i + per_call])
        dt = time.perf_counter() - t
        out[name] = {"s": round(dt, 2), "gflops": round(flop / dt / 1e9, 1)}
    try:  # the Paddle backend's head: gptc_head_score (matmul + log-sum-exp + argmax, no logits kept)
        import paddle

        from gpt_compress.kernels import load_ops

        op, wt, labels = load_ops().gptc_head_score, paddle.to_tensor(w), rng.integers(0, vocab, rows)
        t = time.perf_counter()
        for i in range(0, rows, per_call):
            op(paddle.to_tensor(x[i:i + per_call]), paddle.to_tensor(labels[i:i + per_call]), wt)
        dt = time.perf_counter() - t
        out["gptc_head_score"] = {"s": round(dt, 2), "gflops": round(flop / dt / 1e9, 1)}
    except Exception as e:  # no compiler: the figure is left out
        out["gptc_head_score"] = f"unavailable: {e}"
    sq = rng.standard_normal((2048, 2048), dtype=np.float32)  # a square GEMM: the machine's ceiling now
    t = time.perf_counter()
    sq @ sq
    out["square_2048_numpy_gflops"] = round(2 * 2048 ** 3 / (time.perf_counter() - t) / 1e9, 1)
    return out


def load() -> float:
    return round(os.getloadavg()[0], 2)


def open_backend(model: str, name: str):
    from gpt_compress.inference.runner import Generator

    if name == "onnx":
        return Generator.from_dir(model, backend="onnx")
    return Generator.from_dir(model, backend="paddle", fused=name == "fused")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="an export with the scoring programs (and the fused program)")
    p.add_argument("--backends", default="onnx,paddle", help="comma-separated: onnx, paddle (unfused), fused")
    p.add_argument("--data", default=WIKI, help="wiki.test.raw")
    p.add_argument("--chars", type=int, default=60000, help="first N characters of --data (0: all)")
    p.add_argument("--strides", default="0,64", help="comma-separated; 0: stride = window")
    p.add_argument("--seq-len", type=int, default=0, help="default: the model's context")
    p.add_argument("--batch-size", type=int, default=8, help="gptc eval's default")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--no-old", action="store_true", help="only the new path and its breakdown")
    p.add_argument("--output", default=None)
    a = p.parse_args(argv)
    path = write_text_prefix(a.data, a.chars, os.path.join(tempfile.gettempdir(), "gptc_eval_speed_wiki.raw")) \
        if a.chars else a.data
    result = {"model": os.path.abspath(a.model), "chars": a.chars, "batch_size": a.batch_size,
              "threads": os.environ.get("OMP_NUM_THREADS", ""), "load_before": load(), "runs": {}}
    gens = {b: open_backend(a.model, b) for b in a.backends.split(",")}
    seq = a.seq_len or next(iter(gens.values())).max_positions
    strides = [int(s) or seq for s in a.strides.split(",")]
    times: dict = {}
    for _ in range(a.rounds):
        for b, gen in gens.items():
            for stride in strides:
                key = f"{b}/stride{stride}"
                rec = times.setdefault(key, {"old_s": [], "new_s": [], "load": []})
                rec["load"].append(load())
                if not a.no_old:
                    t = time.perf_counter()
                    rec["old_loss"] = old_wikitext(gen, gen.tokenizer, path, seq, stride, a.batch_size)
                    rec["old_s"].append(round(time.perf_counter() - t, 2))
                t = time.perf_counter()
                rec["new_loss"] = evaluate_wikitext(gen, gen.tokenizer, path, "raw", seq_len=seq, stride=stride,
                                                    batch_size=a.batch_size, progress=False).avg_loss
                rec["new_s"].append(round(time.perf_counter() - t, 2))
                print(key, rec, file=sys.stderr, flush=True)
    for key, rec in times.items():
        b, stride = key.split("/stride")
        out = {"new_s": rec["new_s"], "new_median_s": statistics.median(rec["new_s"]), "load": rec["load"]}
        if rec["old_s"]:
            old, new = statistics.median(rec["old_s"]), out["new_median_s"]
            out.update(old_s=rec["old_s"], old_median_s=old, speedup=round(old / new, 2),
                       rel_diff=abs(rec["new_loss"] - rec["old_loss"]) / abs(rec["old_loss"]))
        out["breakdown"] = breakdown(gens[b], path, seq, int(stride), a.batch_size)
        result["runs"][key] = out
    from gpt_compress.inference.manifest import read_manifest

    cfg = read_manifest(a.model).data["model"]
    hidden, vocab = cfg["hidden_size"], cfg["vocab_size"]
    rows = max(r["breakdown"]["scored_rows"] for r in result["runs"].values())
    result["gemm"] = {"rows": rows, "hidden": hidden, "vocab": vocab, "gflop": round(2e-9 * rows * hidden * vocab, 1),
                      **gemm(rows, hidden, vocab)}
    result["load_after"] = load()
    text = json.dumps(result, indent=1)
    if a.output:
        with open(a.output, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
