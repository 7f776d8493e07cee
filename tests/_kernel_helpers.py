"""Shared by test_kernel_tiles.py and test_fused.py: the fused ops' thread count, the other
instruction-set build (``GPTC_KERNEL_ISA``) run in a subprocess and compared bitwise with this
process's, and the fused model's batch-invariant logits."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from _parity_helpers import PROMPTS, left_padded


@contextlib.contextmanager
def threads(n: int):
    """The fused ops' OpenMP thread count (``$GPTC_THREADS``) set to ``n`` inside the block."""
    old = os.environ.get("GPTC_THREADS")
    os.environ["GPTC_THREADS"] = str(n)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("GPTC_THREADS", None)
        else:
            os.environ["GPTC_THREADS"] = old


def other_build_outputs(tmp_path: Path, isa: str, script: str) -> tuple:
    """(outputs {case: array}, build info) of ``script`` run under GPTC_KERNEL_ISA=``isa``: the
    script gets the .npz path to write as argv[1] and this folder (tests/, to import helpers
    from) as argv[2], and prints its build info as JSON on its last line."""
    env = {**os.environ, "GPTC_KERNEL_ISA": isa, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    out = tmp_path / f"{isa}.npz"
    proc = subprocess.run([sys.executable, "-c", script, str(out), str(Path(__file__).parent)], env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    with np.load(out) as f:
        return {k: f[k] for k in f.files}, info


def build_pair():
    """(this process's ISA, the other one), or a skip naming why the other build adds nothing here."""
    from gpt_compress import kernels

    this = kernels.isa()
    other = "avx2" if this == "native" else "native"
    problem = kernels.isa_problem("avx2")
    if problem:
        pytest.skip(f"no avx2 build on this host: {problem}")
    macros = {isa: _macros(isa) for isa in (this, other)}
    if macros[this] == macros[other]:
        have = ", ".join(k for k, v in macros[this].items() if v) or "none"
        pytest.skip(f"this host's native build has no vector path beyond the avx2 build's (both: {have}): "
                    "one build covers them")
    return this, other, macros


def _macros(isa: str) -> dict:
    from gpt_compress import kernels

    old = os.environ.get("GPTC_KERNEL_ISA")
    os.environ["GPTC_KERNEL_ISA"] = isa
    try:
        return kernels.isa_macros()
    finally:
        if old is None:
            os.environ.pop("GPTC_KERNEL_ISA")
        else:
            os.environ["GPTC_KERNEL_ISA"] = old


def compare_builds(ours: dict, theirs: dict, float_cases) -> dict:
    """Per case: the largest difference between the builds relative to the output's largest value.
    Integer dots are exact int32 sums per block, each added by one fma per block in block order,
    and the float micro-kernels keep the 8-lane accumulation order of the AVX2 tiles (an AVX-512
    register holds two rows' 8 lanes, not 16 k positions): every case is asserted bitwise equal."""
    figures = {}
    for name, a in ours.items():
        b = theirs[name]
        assert a.shape == b.shape, name
        rel = float(np.max(np.abs(a.astype(np.float64) - b))) / max(float(np.max(np.abs(a))), 1e-30)
        figures[name] = {"kind": "float" if name in float_cases else "int", "max_abs": float(np.max(np.abs(a))),
                         "max_rel_diff": rel, "bitwise": bool(np.array_equal(a, b))}
    return figures


def assert_batch_invariant_logits(ckpt: str, mode: str, group_int8: bool = True,
                                  cache_dtype: str = "float32") -> np.ndarray:
    """The logits (B, positions, V) of PROMPTS (left-padded) + 3 steps on the fused model of ``ckpt``
    (``mode``: fp32, or weight-only int8 / int4; ``group_int8``: ``FusedLM``'s; KV caches of
    ``cache_dtype``) on 2 threads, after asserting each row's are bitwise the same run alone (1
    thread) and, for one row, fed token by token."""
    import paddle

    from gpt_compress.checkpoint import load_model
    from gpt_compress.config import QuantConfig
    from gpt_compress.data.tokenizer import Tokenizer
    from gpt_compress.export.fused import FusedLM, fused_weights
    from gpt_compress.qat.quantize import quantize_model

    model = load_model(ckpt)
    if mode != "fp32":  # int4: one or two rows read the packed weights, more unpack them first
        model = quantize_model(model, QuantConfig(targets=[], weight_only=["*"], weight_bits=int(mode[3:])))
    model.eval()
    fused, cfg = FusedLM(fused_weights(model), group_int8=group_int8), model.config
    ids, mask = left_padded(Tokenizer.load(ckpt), PROMPTS)
    steps = np.random.default_rng(0).integers(0, cfg.vocab_size, (len(PROMPTS), 3))

    def run(ids, mask, new, chunks):
        """Feed ids (B, T) + new (B, 3) in chunks of ``chunks`` columns: logits (B, positions, V)."""
        b, t = ids.shape
        ids, mask = np.concatenate([ids, new], 1), np.concatenate([mask, np.ones_like(new)], 1)
        caches = [paddle.zeros([b, cfg.heads(i), ids.shape[1], cfg.dim_head], dtype=cache_dtype)
                  for i in range(cfg.num_layers) for _ in "kv"]
        out, s = [], 0
        for n in chunks:
            with paddle.no_grad():
                got = fused(paddle.to_tensor(ids[:, s:s + n]), paddle.to_tensor(mask[:, :s + n]),
                            paddle.to_tensor(np.arange(b * n)), caches).numpy()
            out.append(got.reshape(b, n, -1))
            s += n
        return np.concatenate(out, 1)

    t = ids.shape[1]
    with threads(2):
        batch = run(ids, mask, steps, [t, 1, 1, 1])
    with threads(1):
        for i in range(len(PROMPTS)):
            n = int(mask[i].sum())
            alone = run(ids[i:i + 1, t - n:], mask[i:i + 1, t - n:], steps[i:i + 1], [n, 1, 1, 1])[0]
            assert np.array_equal(alone, batch[i, t - n:]), f"{mode} row {i}: batch vs alone"
            if i == 1:  # the prompt token by token: every position's logits as from the prefill
                assert np.array_equal(run(ids[i:i + 1, t - n:], mask[i:i + 1, t - n:], steps[i:i + 1],
                                          [1] * (n + 3))[0], alone), f"{mode} row {i}: token by token"
    return batch
