"""Fused tensor-parallel rank programs (``gptc partition``: ``export/fused_tp.py``,
``kernels/gptc_tp_ops.h``) against the single-card fused program, on the trained tiny GPT of
tests/_export_helpers.py: float32, weight-only int8 and int4, W8A8, and int8 with a bfloat16 KV
cache, mp2 (two gloo processes, one thread each). Each rank's programs are also validated by the
export itself (``export_rank``)."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from _export_helpers import model_dirs
from _parity_helpers import PROMPTS, left_padded
from gpt_compress.export.validate import BF16_CACHE_ATOL
from gpt_compress.parallel.launch import log_tail

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
# Float32: the same arithmetic but for the order in which the ranks' partial sums of attn.out and
# fc_out are added (and the biases and residuals added into rank 0's share first): a few float32
# ulps of the logits: measured 1.2e-6 at |logit| <= 9.4 (scoring), 9.5e-7 over the decode steps.
F32_ATOL = 1e-5
# Weight-only int8 / int4: the block dots are exact and each block's input scale is the
# single-card one, so only the float order differs as above; a token's int8 input can still land
# on the neighbouring code when float rounding moves it across a rounding edge: measured 7.1e-6
# (int8) and 5.5e-4 (int4, one scoring row) relative to the largest logit.
INT_RTOL = 2e-3
# Int8 with a bfloat16 cache on both sides: a key or value that the float order above moves across
# a bfloat16 rounding edge is stored one bfloat16 step (2^-8 relative, twice the rounding error
# BF16_CACHE_ATOL bounds) from the single card's, so the logits may move by up to twice that
# bound on top of INT_RTOL.
BF16_RTOL = INT_RTOL + 2 * BF16_CACHE_ATOL


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, shakespeare):
    return model_dirs(tmp_path_factory, shakespeare)


@pytest.fixture(scope="module")
def exports(dirs, shakespeare, tmp_path_factory):
    """mode -> (single-card export, mp2 partition) of the trained model, made on first use; a mode
    ending in "-kvbf16": both with a bfloat16 KV cache."""
    from gpt_compress.export.partition import partition

    made, ckpts = {}, {"fp32": dirs["ckpt"]}

    def get(mode):
        if mode not in made:
            base = tmp_path_factory.mktemp(f"tp_{mode}")
            quant, _, kv = mode.partition("-")
            cache = "bfloat16" if kv == "kvbf16" else "float32"
            if quant not in ckpts:
                ckpts[quant] = _quantized_checkpoint(dirs["ckpt"], quant, base / "q", shakespeare[1])
            ckpt = ckpts[quant]
            single = dirs["export"] if mode == "fp32" else _single_card(ckpt, base / "single", cache)
            # The export's own gate (every rank program against dygraph) for float32 and the
            # bfloat16 cache (its tolerance, export.validate.fused_atol); the test compares the rest.
            partition(ckpt, str(base / "tp"), mp_degree=2, validate=mode in ("fp32", "int8-kvbf16"),
                      kv_cache_dtype=cache)
            made[mode] = single, str(base / "tp")
        return made[mode]

    return get


def _quantized_checkpoint(ckpt, mode, out, prefix):
    """Weight-only int8 / int4 (blocks of 32) or PTQ W8A8 blocks (the tied embedding and head
    weight-only int8), as tests/test_fused.py quantizes, saved as a checkpoint."""
    from _parity_helpers import calib_batches

    from gpt_compress.checkpoint import load_model
    from gpt_compress.config import QuantConfig
    from gpt_compress.data.tokenizer import Tokenizer
    from gpt_compress.qat.ptq import calibrate
    from gpt_compress.qat.quantize import quantize_model, save_quantized

    if mode == "w8a8":
        qcfg = QuantConfig(weight_only=["gpt.wte"])
    else:
        qcfg = QuantConfig(targets=[], weight_only=["*"], weight_bits=4 if mode == "int4" else 8)
    model = quantize_model(load_model(ckpt), qcfg)
    if mode == "w8a8":
        calibrate(model, calib_batches(prefix, 2), qcfg)
    model.eval()
    return save_quantized(model, str(out), tokenizer=Tokenizer.load(ckpt))


def _single_card(ckpt, out, cache_dtype="float32"):
    """The single-card export (fused program, KV cache of ``cache_dtype``) of ``ckpt``."""
    from gpt_compress.export import export

    return export(ckpt, str(out), formats=("paddle",), kv_cache_dtype=cache_dtype)


def _run_single(export_dir, inputs):
    from _tp_rank_run import outputs

    from gpt_compress.inference.fused import FusedBackend
    from gpt_compress.inference.manifest import read_manifest

    manifest = read_manifest(export_dir)
    return outputs(FusedBackend(manifest, threads=1), np.load(inputs), manifest.vocab_size, manifest.max_positions)


def _run_ranks(tp_dirs, inputs, tmp_path):
    """The rank programs' outputs for ``inputs``, one launch of two ranks for all ``tp_dirs``."""
    out, logs = str(tmp_path / "tp"), str(tmp_path / "logs")
    cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", "2", "--log_dir", logs,
           os.path.join(ROOT, "tests", "_tp_rank_run.py"), inputs, out, *tp_dirs]
    res = subprocess.run(cmd, env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, f"{res.stderr[-2000:]}\n{log_tail(logs)}"
    runs = []
    for i in range(len(tp_dirs)):
        got = dict(np.load(f"{out}_{i}.npz"))
        with open(f"{out}_{i}.json", encoding="utf-8") as f:
            got.update(json.load(f))
        runs.append(got)
    return runs


@pytest.mark.parametrize("modes", [["fp32"], ["int8", "int4", "w8a8", "int8-kvbf16"]], ids=["fp32", "quantized"])
def test_mp2_fused_rank_programs_match_the_single_card_fused_program(dirs, exports, tmp_path, modes):
    """Prefill + 8 decode steps of a left-padded batch, scoring logits and evaluation log-probs
    within F32_ATOL (float32) / INT_RTOL relative (int8, int4, W8A8) / BF16_RTOL (int8, bfloat16
    cache) of the single-card fused program, the same greedy and beam-search tokens, and caches of
    the export's dtype on both."""
    from gpt_compress.data.tokenizer import Tokenizer

    ids, mask = left_padded(Tokenizer.load(dirs["ckpt"]), PROMPTS)
    feed = np.random.default_rng(0).integers(0, 1024, (len(ids), 8))
    inputs = str(tmp_path / "inputs.npz")
    np.savez(inputs, ids=ids, mask=mask, feed=feed)
    made = [exports(mode) for mode in modes]
    for mode, (_, tp_dir) in zip(modes, made):
        for r in range(2):
            manifest = json.load(open(os.path.join(tp_dir, f"rank_{r}", "manifest.json")))
            assert manifest["fused"]["cache_dtype"] == ("bfloat16" if mode.endswith("-kvbf16") else "float32")
            ops = manifest["fused"]["ops"]
            assert ops["custom_op.gptc_tp_attention_"] == ops["custom_op.gptc_tp_mlp"] == 2, ops
            assert ops["pd_op.mp_allreduce_sum"] == 5, ops  # the embedding's + two a block
    runs = _run_ranks([tp_dir for _, tp_dir in made], inputs, tmp_path)
    for mode, (single, _), got in zip(modes, made, runs):
        want = _run_single(single, inputs)
        for key in ("steps", "score", "logprobs"):
            diff = float(np.abs(got[key] - want[key]).max())
            if mode == "fp32":
                assert diff <= F32_ATOL, (mode, key, diff)
            else:
                rel = diff / float(np.abs(want[key]).max())
                assert rel <= (BF16_RTOL if mode.endswith("-kvbf16") else INT_RTOL), (mode, key, rel)
        assert got["cache_dtype"] == want["cache_dtype"]
        assert want["cache_dtype"] == ("paddle.bfloat16" if mode.endswith("-kvbf16") else "paddle.float32")
        assert np.array_equal(got["hits"], want["hits"]), mode
        assert got["greedy"] == want["greedy"], mode
        assert got["beam"] == want["beam"], mode


@pytest.mark.parametrize("mode", ["fp32", "int8-kvbf16"])
def test_serve_tp2_answers_the_single_card_servers_completion(exports, tmp_path, mode):
    """`gptc serve --tp 2` (the engine on rank 0, rank 1 in lock-step) and `gptc serve` on the
    single-card export complete the same prompts with the same greedy text, one request and
    three at once (a batch that rows join and leave, their caches merged: float32, or bfloat16
    rows as numpy's uint16)."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    from _serve_helpers import Server

    single, tp_dir = exports(mode)
    servers = [Server(single, tmp_path / "single.log"), Server(tp_dir, tmp_path / "tp.log", "--tp", "2")]
    try:
        assert servers[1].info["tp"] == 2
        answers = []
        for s in servers:
            s.ready()

            def complete(prompt, n, url=s.url):
                r = httpx.post(url + "/v1/completions", timeout=120,
                               json={"prompt": prompt, "max_tokens": n, "temperature": 0})
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["text"]

            with ThreadPoolExecutor(3) as pool:
                answers.append([complete("ROMEO:", 24)] + list(pool.map(complete, PROMPTS, [8, 20, 14])))
        assert answers[0] == answers[1] and all(answers[0]), answers
    finally:
        for s in servers:
            s.stop()
    assert servers[1].proc.returncode == 0  # SIGTERM: rank 0 drained, then released rank 1


def test_gptc_eval_on_a_partitioned_export_gives_the_single_card_perplexity(exports, shared_data, tmp_path):
    """`gptc eval` on the mp2 partition (two launched ranks; each rank's vocabulary slice reduced
    to its maximum and sum of exponentials, ``TensorParallelBackend.label_scores``) gives the
    single-card export's WikiText perplexity."""
    from gpt_compress.eval.wikitext import evaluate_wikitext
    from gpt_compress.inference.runner import Generator

    single, tp_dir = exports("fp32")
    wiki = tmp_path / "wiki.raw"
    with open(shared_data / "wikitext-2" / "wiki.test.raw", encoding="utf-8", newline="") as f:
        wiki.write_text("".join(f.readlines()[:40]), encoding="utf-8", newline="")
    out = tmp_path / "tp_wikitext.json"
    res = subprocess.run([sys.executable, "-m", "gpt_compress", "eval", "--model", tp_dir, "--task", "wikitext",
                          "--data", str(wiki), "--seq-len", "64", "--stride", "32", "--no-progress",
                          "--output", str(out)], env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(out.read_text())
    gen = Generator.from_dir(single, backend="paddle")
    want = evaluate_wikitext(gen, gen.tokenizer, str(wiki), "raw", seq_len=64, stride=32, batch_size=8, progress=False)
    assert got["mp_degree"] == 2 and got["num_windows"] == want.num_windows > 1
    # Float32 logits a few ulps apart, then the same log-softmax summed another way: the mean NLL
    # over the windows' tokens keeps that relative size; 1e-5 is far above it.
    assert abs(got["ppl"] - want.ppl) <= 1e-5 * want.ppl, (got["ppl"], want.ppl)
