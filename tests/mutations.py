"""Mutation check: small deliberate defects, each applied alone to a scratch copy of the
repository, must each make the tests named for it fail.

    python tests/mutations.py            # every mutation
    python tests/mutations.py stop-ignored causal-mask-peeks-ahead   # some of them

Each copy holds the files git tracks (and untracked ones it does not ignore) with one defect
applied; the tests run there (``PYTHONPATH`` set to the copy) with the kernels built into
``$GPTC_KERNEL_CACHE`` (default /tmp/gptc-mutation-kernels, so a mutated kernel never lands in the
shared cache). Prints one line a mutation (which tests failed, the first assertion message) and
exits 1 if any defect went unnoticed. Not collected by pytest (no ``test_`` prefix); the
repository itself is never modified.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Mutation:
    name: str
    path: str  # file the defect goes in, relative to the repository root
    edits: list[tuple[str, str]]  # (text found exactly once, its replacement)
    tests: list[str]  # pytest node ids expected to catch it
    what: str


MUTATIONS = [
    Mutation("int8-gemv-block-scale", "gpt_compress/kernels/gptc_gemv.h",
             [("    const __m128 p = NR == 4 ? _mm_loadu_ps(prod + 4 * b) : _mm_set_ss(sx[b] * sw[b]);\n",
               "    __m128 p = NR == 4 ? _mm_loadu_ps(prod + 4 * b) : _mm_set_ss(sx[b] * sw[b]);\n"
               "    if (b == 0) p = _mm_mul_ps(p, _mm_set1_ps(1.01f));\n")],
             ["tests/test_kernel_tiles.py"],
             "the int8/int4 GEMV (batch-1 decode) multiplies the first block's scale by 1.01"),
    Mutation("fused-kv-cache-off-by-one", "gpt_compress/kernels/gptc_decoder_ops.h",
             [("    const int64_t dst = ((b * H + hh) * cap + S + t) * D;\n",
               "    const int64_t dst = ((b * H + hh) * cap + S + t - (S > 0)) * D;\n")],
             ["tests/test_kernel_tiles.py",
              "tests/test_fused.py::test_fused_ops_eagerly_match_dygraph_on_a_left_padded_batch"],
             "the fused layer writes a decode step's key/value one cache slot early"),
    Mutation("model-kv-position-off-by-one", "gpt_compress/model/gpt.py",
             [("                position_ids = position_ids_from_mask(attention_mask, q_len)\n",
               "                position_ids = position_ids_from_mask(attention_mask, q_len) + (1 if past_key_values else 0)\n")],
             ["tests/test_hf_parity.py"],
             "the model gives a token after the KV cache the position one past its own"),
    Mutation("residual-dropped", "gpt_compress/model/gpt.py",
             [("        self.attn = GPTAttention(cfg, layer_idx)\n",
               "        self.attn = GPTAttention(cfg, layer_idx)\n        self.layer_idx = layer_idx\n"),
              ("        x = x + self.dropout(a)\n", "        x = (0 if self.layer_idx == 1 else x) + self.dropout(a)\n")],
             ["tests/test_hf_parity.py",
              "tests/test_fused.py::test_fused_ops_eagerly_match_dygraph_on_a_left_padded_batch"],
             "layer 1 drops the residual around its attention"),
    Mutation("causal-mask-peeks-ahead", "gpt_compress/model/gpt.py",
             [("    allowed = (k_pos <= q_pos).unsqueeze(0).unsqueeze(0)  # (1, 1, q, k)\n",
               "    allowed = (k_pos <= q_pos + 1).unsqueeze(0).unsqueeze(0)  # (1, 1, q, k)\n")],
             ["tests/test_hf_parity.py"],
             "the attention bias lets each query see the next position"),
    Mutation("stop-ignored", "gpt_compress/serve/app.py",
             [("stop=req.stop or []", "stop=[]")],
             ["tests/test_serve.py::test_openai_client_plain_and_streamed_equal_generator"],
             "gptc serve drops a request's stop strings"),
]


def _copy(dst: Path) -> None:
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                           capture_output=True).stdout.decode().split("\0")
    for f in filter(None, files):
        src = ROOT / f
        if src.is_file():
            (dst / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / f)


def apply(m: Mutation, root: Path) -> int:
    """Apply ``m`` under ``root``; returns the line of its first edit."""
    path = root / m.path
    text = path.read_text(encoding="utf-8")
    line = 0
    for old, new in m.edits:
        assert text.count(old) == 1, f"{m.name}: {old!r} occurs {text.count(old)} times in {m.path}"
        line = line or text[:text.index(old)].count("\n") + 1
        text = text.replace(old, new)
    path.write_text(text, encoding="utf-8")
    return line


def run(m: Mutation, keep: bool = False) -> dict:
    """Apply ``m`` to a scratch copy and run its tests: {"line", "failed": [ids], "message", "rc"}."""
    scratch = Path(tempfile.mkdtemp(prefix=f"gptc-mut-{m.name}-"))
    try:
        _copy(scratch)
        line = apply(m, scratch)
        env = {**os.environ, "PYTHONPATH": str(scratch), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"),
               "GPTC_KERNEL_CACHE": os.environ.get("GPTC_KERNEL_CACHE", "/tmp/gptc-mutation-kernels")}
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", *m.tests],
                              cwd=scratch, env=env, capture_output=True, text=True)
        out = proc.stdout + proc.stderr
        failed = re.findall(r"^FAILED (\S+)", out, re.M) + re.findall(r"^ERROR (\S+)", out, re.M)
        message = next((x[1:].strip() for x in out.splitlines() if x.startswith("E ")), "")
        return {"line": line, "failed": failed, "message": message[:160], "rc": proc.returncode, "log": out}
    finally:
        if not keep:
            shutil.rmtree(scratch, ignore_errors=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", help="mutations to run (default: all): " + ", ".join(m.name for m in MUTATIONS))
    ap.add_argument("--log-dir", help="write each run's pytest output here")
    args = ap.parse_args(argv)
    chosen = [m for m in MUTATIONS if not args.names or m.name in args.names]
    missed = []
    for m in chosen:
        r = run(m)
        if args.log_dir:
            os.makedirs(args.log_dir, exist_ok=True)
            Path(args.log_dir, m.name + ".log").write_text(r["log"], encoding="utf-8")
        caught = r["rc"] == 1 and r["failed"]
        if not caught:
            missed.append(m.name)
        print(f"{m.name} | {m.path}:{r['line']} | {'; '.join(r['failed']) or 'NOTHING FAILED (rc %d)' % r['rc']} | "
              f"{r['message']}", flush=True)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
