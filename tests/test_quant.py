"""Quantization on a trained tiny GPT (tests/_export_helpers.py, tinyshakespeare): QAT and PTQ
to int8 exports for onnxruntime and Paddle Inference, weight-only int8/int4, sensitivity ranking.

Perplexities are measured on the first WIKI_CHARS characters of WikiText-2's raw test split
(``wiki.test.raw``, cut at a line end; FleetX windows of 128 tokens), tokenized with the
1024-token BPE of the test model, through the same evaluator as `gptc eval`."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from _export_helpers import ENV, FLOAT_PPL_RTOL, INT8_PPL_RTOL, LOGIT_ATOL, MEAN_SCORE_RTOL, ROOT, model_dirs
from _parity_helpers import PROMPTS, Recorder, calib_batches, int8_logit_atol
from gpt_compress.inference.base import Scorer
from gpt_compress.inference.runner import Generator

WIKI_CHARS = 20000
# int8 WikiText PPL within this many percent of the float model's (W8A8 PTQ with each observer,
# the PTQ CLI, QAT, weight-only int8). Measured |gap| on the tests/_export_helpers model: <= 0.10%
# on the Xeon host (PTQ abs_max -0.05%, percentile 0.08%, mse 0.10%; weight-only int8 0.07%),
# 0.0-0.13% on the earlier hosts; 0.5% is about 4x the largest. The export's own gate is wider.
PPL_MARGIN_PCT = 0.5
# Weight-only int4 (blocks of 32): measured 0.30% (Xeon host), 0.6% (earlier hosts); 3x the largest.
INT4_PPL_MARGIN_PCT = 2.0
# Sensitivity ranking at W8A4 (train_tiny seeds 1234 (the test's model), 1, 2, 3; relative
# WikiText perplexity gaps): all 8 layers quantized 0.119, 0.023, 0.098, 0.061; W8A8 (the setting
# if 4-bit inputs were ignored) |gap| <= 0.00014 here, 0.0013 on earlier hosts. SENS_MIN_GAP
# lies between: 7.7x that W8A8 gap, 2.3x under the smallest W8A4 gap.
SENS_MIN_GAP = 0.01
# Skipping the 2 layers ranked worst leaves 0.092, 0.69, 0.060, 0.050 of the full gap; skipping the
# 2 ranked best (the control) 1.09, 1.08, 1.01, 1.01. A ranking no better than chance leaves on
# average 6/8 = 0.75 of it (2 of 8 layers, gaps adding up): the ranking must beat that, against
# both. (0.5 held for the test's model, but not on seed 1, whose gap spreads over the layers.)
SKIP_MAX_SHARE = 0.75
# model.pdiparams holds each tensor's bytes and a header of a few dozen bytes (~40 tensors, ~2 KB
# of ~190 KB int8): the file ratio is within 3% of the weights' (``_int8_weight_bytes``).
SIZE_RATIO_SLACK = 0.97


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, shakespeare):
    return model_dirs(tmp_path_factory, shakespeare)


@pytest.fixture(scope="module")
def wiki(shared_data, tmp_path_factory):
    """The WikiText-2 test slice, as a file."""
    with open(shared_data / "wikitext-2" / "wiki.test.raw", encoding="utf-8", newline="") as f:
        text = f.read(WIKI_CHARS)
    path = tmp_path_factory.mktemp("wiki") / "wiki_slice.raw"
    path.write_text(text[:text.rfind("\n") + 1], encoding="utf-8")
    return str(path)


def _ppl(backend, tokenizer, wiki):
    from gpt_compress.eval.wikitext import evaluate_wikitext

    return evaluate_wikitext(backend, tokenizer, wiki, "raw", seq_len=128, batch_size=8, progress=False).ppl


def _gptc(*args):
    proc = subprocess.run([sys.executable, "-m", "gpt_compress", *args], env=ENV, cwd=ROOT, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _int8_weight_bytes(ckpt, block=32, weight_only_bits=None) -> tuple[int, int]:
    """(fp32, int8) bytes of the QAT int8 model's weights, from the float checkpoint: every matrix
    one byte a weight, with one fp32 scale per output channel (W8A8 block layers) or per ``block``
    inputs (the weight-only token and position tables); norms and biases stay fp32. gpt-tiny:
    695,296 and 193,024 bytes (3.60x). With ``weight_only_bits``: every matrix weight-only, that
    many bits a weight and a scale per ``block`` (gpt-tiny: 200,704 bytes at 8, 114,688 at 4)."""
    from gpt_compress.checkpoint import load_model

    sd = load_model(ckpt).state_dict()
    fp32, int8 = 0, 0
    for name, v in sd.items():
        fp32 += 4 * v.size
        if len(v.shape) != 2:
            int8 += 4 * v.size
        elif weight_only_bits or name in ("gpt.wte.weight", "gpt.wpe.weight"):
            int8 += v.size * (weight_only_bits or 8) // 8 + 4 * (v.size // block)
        else:
            int8 += v.size + 4 * v.shape[1]
    return fp32, int8


def _onnx_data_tensors(path) -> list[int]:
    """The byte lengths of the distinct tensors that the programs of export ``path`` keep in
    model.onnx.data, in file order, after asserting the file's exact layout: each tensor once
    (however many programs read it), at the first page boundary (``export.onnx.ALIGN``) after the
    one before, and nothing after the last (the padding is all that the file adds)."""
    import glob

    import onnx

    from gpt_compress.export.onnx import ALIGN, DATA_FILE

    seen = set()
    for f in glob.glob(os.path.join(path, "*.onnx")):
        for t in onnx.load(f, load_external_data=False).graph.initializer:
            info = {e.key: e.value for e in t.external_data}
            if t.data_location == onnx.TensorProto.EXTERNAL and info.get("location") == DATA_FILE:
                seen.add((int(info["offset"]), int(info["length"])))
    end = 0
    for offset, length in sorted(seen):
        assert offset == end + (-end) % ALIGN, (path, offset, end)
        end = offset + length
    assert os.path.getsize(os.path.join(path, DATA_FILE)) == end, path
    return [n for _, n in sorted(seen)]


def _parity(qmodel, path, tokenizer, backends=("onnx", "paddle")):
    """Greedy prefill + 32 decode steps and scoring on each backend vs the fake-quant dygraph
    model: identical tokens, every greedy fast-path token the argmax of its step's logits, logits
    within ``int8_logit_atol`` (float32 noise plus a few int8 input codes rounding the other way).
    Returns the max absolute diffs."""
    from gpt_compress.inference.dygraph import DygraphBackend

    ref = Generator(Recorder(DygraphBackend(qmodel)), vocab_size=1024, max_positions=128, eos_token_id=None,
                    pad_token_id=0, tokenizer=tokenizer)
    ref_out = ref.generate(PROMPTS, max_new_tokens=33)
    rows = [tokenizer.encode(p) for p in PROMPTS]
    ids = np.zeros((3, max(map(len, rows))), np.int64)
    mask = np.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, :len(r)], mask[i, :len(r)] = r, 1
    ref_score = ref.score(ids, mask)
    tol = int8_logit_atol(qmodel, LOGIT_ATOL)
    diffs = {}
    for b in backends:
        gen = Generator.from_dir(path, backend=b)
        gen.backend = Recorder(gen.backend)
        out = gen.generate(PROMPTS, max_new_tokens=33)
        assert out.sequences == ref_out.sequences, b
        assert gen.backend.greedy_mismatches == 0, (b, gen.backend.greedy_mismatches)
        step = max(float(np.max(np.abs(a - r))) for a, r in zip(gen.backend.logits, ref.backend.logits))
        score = float(np.max(np.abs(gen.score(ids, mask) - ref_score)[mask > 0]))
        assert step < tol and score < tol, (b, step, score, tol)
        diffs[b] = max(step, score)
    return diffs


class _FullLogits(Scorer):
    """A backend reduced to ``score``: evaluation then reduces full (B, T, V) logits in numpy."""

    def __init__(self, gen):
        self.gen = gen

    def score(self, ids, mask=None):
        return self.gen.score(ids, mask)


def _onnx_op_types(path, program="forward"):
    """Node types of onnxruntime's optimized graph of ``program`` (what it really runs)."""
    import onnx
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opt = os.path.join(os.path.dirname(path), f".{program}.opt.onnx")
    so.optimized_model_filepath = opt
    so.log_severity_level = 3
    ort.InferenceSession(os.path.join(path, f"{program}.onnx"), so, providers=["CPUExecutionProvider"])
    types = [n.op_type for n in onnx.load(opt, load_external_data=False).graph.node]
    return types


# --------------------------------------------------------------------------------------
# 1. QAT from the CLI -> int8 export: perplexity, parity, size, int8 kernels
# --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def qat_run(dirs, shakespeare, wiki, tmp_path_factory):
    tok_dir, prefix = shakespeare
    out = tmp_path_factory.mktemp("qat")
    report = _gptc("qat", "-c", "configs/qat_gpt_tiny_cpu.yaml", "--model", dirs["ckpt"],
                   "-o", f"Data.data_prefix=[{prefix}]", "-o", f"Global.output_dir={out}",
                   "-o", "Engine.max_steps=40", "--eval-wikitext", wiki, "--eval-seq-len", "128", "--no-progress")
    return out, report


def test_qat_int8_export_matches_fake_quant_and_keeps_perplexity(qat_run, dirs, wiki):
    from gpt_compress.qat.quantize import load_quantized, quant_layers

    out, report = qat_run
    qmodel = load_quantized(report["quantized_checkpoint"])
    layers = quant_layers(qmodel)
    assert sum(m.mode == "w8a8" for m in layers.values()) == 8
    assert layers["gpt.wte"].mode == layers["gpt.wpe"].mode == "weight_only"
    path = report["int8_export"]["path"]
    tok = Generator.from_dir(path, backend="onnx").tokenizer
    # Perplexity of the float input, the fake-quant model and both int8 backends on the same slice.
    # QAT also finetunes (40 steps on the training data of a briefly trained model), which can
    # only lower perplexity: the margin is one-sided here; PTQ below checks both sides.
    fp32 = report["input"]["wikitext_ppl"]
    onnx_fp32 = _ppl(Generator.from_dir(dirs["export"], backend="onnx"), tok, wiki)
    assert fp32 == pytest.approx(onnx_fp32, rel=FLOAT_PPL_RTOL)
    for key in ("fake_quant", "int8_onnx", "int8_paddle"):
        assert report[key]["wikitext_ppl_delta_pct"] < PPL_MARGIN_PCT, (key, report[key])
        assert report[key]["wikitext_ppl"] == pytest.approx(report["fake_quant"]["wikitext_ppl"], rel=INT8_PPL_RTOL)
    # Parity with the fake-quant model: tokens identical, logits within int8_logit_atol.
    _parity(qmodel, path, tok)
    # Weights ~4x smaller than the float export of the same model, in both formats. ONNX: the int8
    # programs' tensors in model.onnx.data hold at most one byte a weight plus the scales
    # (``_int8_weight_bytes``, 193,024 bytes; the small tensors stay inside the graphs: 187,392
    # bytes in 17 tensors), and the file adds only their page padding (``_onnx_data_tensors``;
    # 204,800 bytes, 17,408 of them padding; the file ratio is 3.40).
    fp32_bytes, int8_bytes = _int8_weight_bytes(dirs["ckpt"])
    float_tensors, int8_tensors = _onnx_data_tensors(dirs["export"]), _onnx_data_tensors(path)
    assert sum(int8_tensors) <= int8_bytes < sum(float_tensors) <= fp32_bytes, (int8_tensors, float_tensors)
    ratio = os.path.getsize(os.path.join(dirs["export"], "model.pdiparams")) / os.path.getsize(
        os.path.join(path, "model.pdiparams"))
    assert ratio > SIZE_RATIO_SLACK * fp32_bytes / int8_bytes, ratio
    # onnxruntime runs the W8A8 layers on integer kernels: no float MatMul is left but the
    # attention's two per layer; the head/embedding are MatMulNBits/GatherBlockQuantized.
    types = _onnx_op_types(path)
    integer = sum(t in ("MatMulIntegerToFloat", "QLinearMatMul", "MatMulInteger") for t in types)
    assert integer == 8, sorted(set(types))
    assert types.count("MatMulNBits") == 1 and "DequantizeLinear" not in types
    assert types.count("GatherBlockQuantized") == 2  # token and position lookups
    assert types.count("MatMul") + types.count("FusedMatMul") == 4  # q @ k^T, probs @ v per layer


def test_int8_dir_manifest_and_cli_eval_infer(qat_run, wiki):
    from gpt_compress.inference.manifest import read_manifest

    out, report = qat_run
    path = report["int8_export"]["path"]
    m = read_manifest(path)
    assert m.data["weight_dtype"] == "int8" and m.data["dtype"] == "float32"
    assert m.data["quant"]["scheme"] == "w8a8+weight_only" and m.data["quant"]["activation_bits"] == 8
    fused = {"paddle_fused"} if m.data.get("fused") else set()  # the fused CPU program, when it was built
    assert set(m.data["quant"]["validation"]) == {"atol_relative", "paddle", "onnx"} | fused
    res = _gptc("eval", "--model", path, "--backend", "onnx", "--task", "wikitext", "--data", wiki,
                "--seq-len", "128", "--no-progress")
    # The same program on the same text and windows as the QAT command's figure: bitwise (measured).
    assert res["ppl"] == report["int8_onnx"]["wikitext_ppl"]
    # The int8 scoring programs (head only at the scored rows) give the full logits' figures.
    from gpt_compress.eval.wikitext import evaluate_wikitext

    text = os.path.join(os.path.dirname(path), "wiki_head.raw")
    with open(wiki, encoding="utf-8") as f, open(text, "w", encoding="utf-8") as g:
        g.write(f.read(2000))
    for b in ("paddle", "onnx"):
        gen = Generator.from_dir(path, backend=b, fused=False) if b == "paddle" else Generator.from_dir(path, backend=b)
        assert gen.scores_positions, b
        fast = evaluate_wikitext(gen, gen.tokenizer, text, "raw", seq_len=128, stride=64, progress=False)
        full = evaluate_wikitext(_FullLogits(gen), gen.tokenizer, text, "raw", seq_len=128, stride=64, progress=False)
        # Head-only scoring vs full logits (measured 1.4e-9 Paddle, 1.9e-9 onnxruntime).
        assert fast.num_scored == full.num_scored, b
        assert fast.avg_loss == pytest.approx(full.avg_loss, rel=MEAN_SCORE_RTOL), b
    res = _gptc("infer", "--model-dir", path, "--backend", "paddle", "--prompt-ids", "1,2,3",
                "-o", "Generation.max_new_tokens=4")
    assert res["new_tokens"] == 4


def test_gptc_export_of_a_quantized_checkpoint_exports_int8(qat_run, tmp_path):
    """`gptc export` on OUT/quantized must not silently write the fp32 master weights."""
    from gpt_compress.inference.manifest import read_manifest

    _, report = qat_run
    res = _gptc("export", "--model", report["quantized_checkpoint"], "--output", str(tmp_path / "x"),
                "--format", "onnx")
    assert read_manifest(res["output"]).data["weight_dtype"] == "int8"
    ref = os.path.getsize(os.path.join(report["int8_export"]["path"], "model.onnx.data"))
    assert os.path.getsize(os.path.join(res["output"], "model.onnx.data")) == ref


def test_a_quantized_checkpoint_exports_int8_with_a_bfloat16_cache(qat_run, tmp_path):
    """`gptc export --kv-cache-dtype bfloat16` on OUT/quantized: the int8 fused program with a
    bfloat16 cache, validated against the fake-quant model within the int8 tolerance plus the
    cache's rounding (``fused_atol``, recorded in the manifest), and it generates."""
    from gpt_compress.export.int8 import W8A8_ATOL
    from gpt_compress.export.validate import fused_atol
    from gpt_compress.inference.manifest import read_manifest

    _, report = qat_run
    res = _gptc("export", "--model", report["quantized_checkpoint"], "--output", str(tmp_path / "x"),
                "--format", "paddle", "--kv-cache-dtype", "bfloat16")
    data = read_manifest(res["output"]).data
    assert data["weight_dtype"] == "int8" and data["fused"]["cache_dtype"] == "bfloat16"
    assert data["quant"]["validation"]["atol_relative_fused"] == fused_atol(W8A8_ATOL, "bfloat16") > W8A8_ATOL
    out = _gptc("infer", "--model-dir", res["output"], "--backend", "paddle", "--prompt-ids", "1,2,3",
                "-o", "Generation.max_new_tokens=4")
    assert out["new_tokens"] == 4


# --------------------------------------------------------------------------------------
# 2. Sensitivity ranking and its skip list
# --------------------------------------------------------------------------------------
def test_sensitivity_skip_list_reduces_the_ptq_gap(dirs, shakespeare, wiki, tmp_path):
    """The ranking runs at 4-bit inputs (W8A4): at W8A8 PTQ costs this model < 1% perplexity and
    even 4-bit weights < 0.5%, too little to tell layers apart; 4-bit inputs cost ~12%, mostly in
    the FFN output projections (whose GELU outputs have outliers: the layers FleetX skipped on
    GPT-345M). Skipping the 2 layers ranked worst must shrink the W8A4 PTQ perplexity gap, and
    more than skipping the 2 layers ranked best."""
    from gpt_compress.checkpoint import load_model
    from gpt_compress.inference.dygraph import DygraphBackend
    from gpt_compress.config import QuantConfig
    from gpt_compress.qat.ptq import calibrate
    from gpt_compress.qat.quantize import quantize_model
    from gpt_compress.qat.sensitivity import least_sensitive

    tok_dir, prefix = shakespeare
    res = _gptc("quant-sensitivity", "-c", "configs/qat_gpt_tiny_cpu.yaml", "--model", dirs["ckpt"],
                "-o", f"Data.data_prefix=[{prefix}]", "-o", f"Global.output_dir={tmp_path}",
                "-o", "Quant.weight_only=[]", "-o", "Quant.activation_bits=4", "--num-skip", "2", "--no-progress")
    ranking = json.loads((tmp_path / "sensitivity.json").read_text())
    deltas = [r["delta_loss"] for r in ranking["layers"]]
    assert len(deltas) == 8 and deltas == sorted(deltas, reverse=True) and deltas[0] > 0
    skips = [ln for ln in (tmp_path / "skip_list.txt").read_text().splitlines() if not ln.startswith("#")]
    assert skips == res["skip_list"] == [r["layer"] for r in ranking["layers"][:2]]

    tok = Generator.from_dir(dirs["export"], backend="onnx").tokenizer
    calib = calib_batches(prefix, 4)
    base = _ppl(DygraphBackend(load_model(dirs["ckpt"])), tok, wiki)

    def gap(skip):
        model = load_model(dirs["ckpt"])
        qcfg = QuantConfig(targets=["gpt.blocks.*"], skip=list(skip), activation_bits=4, calib_batches=4)
        calibrate(quantize_model(model, qcfg), calib, qcfg)
        model.eval()
        return _ppl(DygraphBackend(model), tok, wiki) / base - 1.0

    full, with_skips, control = gap([]), gap(skips), gap(least_sensitive(ranking, 2))
    assert full > SENS_MIN_GAP, full  # the harsh setting really hurts
    assert with_skips < SKIP_MAX_SHARE * full and with_skips < SKIP_MAX_SHARE * control, (full, with_skips, control)


# --------------------------------------------------------------------------------------
# 3. PTQ: observers, the CLI, both-sided perplexity margin
# --------------------------------------------------------------------------------------
def test_ptq_observers_clip_differently_and_keep_perplexity(dirs, shakespeare, wiki):
    from gpt_compress.checkpoint import load_model
    from gpt_compress.inference.dygraph import DygraphBackend
    from gpt_compress.config import QuantConfig
    from gpt_compress.qat.ptq import calibrate
    from gpt_compress.qat.quantize import quantize_model

    tok = Generator.from_dir(dirs["export"], backend="onnx").tokenizer
    calib = calib_batches(shakespeare[1], 4)
    base = _ppl(DygraphBackend(load_model(dirs["ckpt"])), tok, wiki)
    amax, ppl = {}, {}
    for obs in ("abs_max", "percentile", "mse"):
        model = load_model(dirs["ckpt"])
        qcfg = QuantConfig(targets=["gpt.blocks.*"], observer=obs, percentile=99.9)
        amax[obs] = calibrate(quantize_model(model, qcfg), calib, qcfg)
        model.eval()
        ppl[obs] = _ppl(DygraphBackend(model), tok, wiki)
        assert abs(ppl[obs] / base - 1) * 100 < PPL_MARGIN_PCT, (obs, ppl[obs], base)
    for name, top in amax["abs_max"].items():
        assert 0 < amax["percentile"][name] < top and 0 < amax["mse"][name] <= top, name


def test_ptq_cli_with_skip_list_exports_int8(dirs, shakespeare, wiki, tmp_path):
    from gpt_compress.qat.quantize import load_quantized, quant_layers

    skip = tmp_path / "skip.txt"
    skip.write_text("# keep the last FFN output in float\ngpt.blocks.1.mlp.fc_out\n")
    report = _gptc("ptq", "-c", "configs/qat_gpt_tiny_cpu.yaml", "--model", dirs["ckpt"],
                   "-o", f"Data.data_prefix=[{shakespeare[1]}]", "-o", f"Global.output_dir={tmp_path / 'out'}",
                   "-o", "Quant.observer=mse", "--skip-list", str(skip), "--eval-wikitext", wiki,
                   "--eval-seq-len", "128", "--format", "onnx", "--no-progress")
    assert "gpt.blocks.1.mlp.fc_out" not in report["layers"]  # skipped: stays float
    assert sum(m == "w8a8" for m in report["layers"].values()) == 7
    for key in ("fake_quant", "int8_onnx"):
        assert abs(report[key]["wikitext_ppl_delta_pct"]) < PPL_MARGIN_PCT, (key, report[key])
    qmodel = load_quantized(report["quantized_checkpoint"])
    assert "gpt.blocks.1.mlp.fc_out" not in quant_layers(qmodel)
    _parity(qmodel, report["int8_export"]["path"], Generator.from_dir(dirs["export"], backend="onnx").tokenizer,
            backends=("onnx",))


# --------------------------------------------------------------------------------------
# 4. Weight-only int8 / int4 (the decode path): MatMulNBits on every matrix incl. the LM head
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [8, 4])
def test_weight_only_export_parity_and_size(dirs, wiki, tmp_path, bits):
    from gpt_compress.checkpoint import load_model
    from gpt_compress.data.tokenizer import Tokenizer
    from gpt_compress.export import export_model
    from gpt_compress.export.onnx import ALIGN
    from gpt_compress.inference.dygraph import DygraphBackend
    from gpt_compress.config import QuantConfig
    from gpt_compress.qat.quantize import quant_layers, quantize_model

    tok = Tokenizer.load(dirs["ckpt"])
    model = quantize_model(load_model(dirs["ckpt"]), QuantConfig(targets=[], weight_only=["*"], weight_bits=bits))
    model.eval()
    assert len(quant_layers(model)) == 10  # 8 block Linears + token and position tables
    path = export_model(model, str(tmp_path / f"woq{bits}"), ("paddle", "onnx"), tokenizer=tok)
    # onnxruntime (accuracy_level=4) and the fused ops quantize the inputs themselves: a code may
    # round the other way (int8_logit_atol).
    _parity(model, path, tok)
    # One float32 scale per 32 weights (+12.5% over int8, +25% over int4): ONNX keeps at most
    # ``_int8_weight_bytes`` in its data file (the norms and biases may stay inside the graphs),
    # each tensor at a page boundary (``_onnx_data_tensors``), so the file ratio is at least the
    # fp32 tensors' bytes over those bytes plus a page per tensor. Measured: tensors 196,608 bytes
    # of 200,704 derived (int8), 109,568 of 114,688 (int4); file ratio 3.18 (bound 2.41), 4.93
    # (bound 3.44). Int4 codes stored one a byte (+86,016 bytes) or a scale per 16 weights
    # (+21,504) exceed the derived bytes; the former bounds, ratios 3.0 / 4.5, sat 6% / 9% under
    # the measured file ratios.
    fp32_bytes, woq_bytes = _int8_weight_bytes(dirs["ckpt"], weight_only_bits=bits)
    float_tensors, woq_tensors = _onnx_data_tensors(dirs["export"]), _onnx_data_tensors(path)
    assert sum(woq_tensors) <= woq_bytes, (woq_tensors, woq_bytes)
    onnx_ratio = os.path.getsize(os.path.join(dirs["export"], "model.onnx.data")) / \
        os.path.getsize(os.path.join(path, "model.onnx.data"))
    assert onnx_ratio > sum(float_tensors) / (woq_bytes + len(woq_tensors) * ALIGN), onnx_ratio
    # Paddle has no int4 type: its file keeps 4-bit codes in int8 (the same size as int8), and
    # only a header beside them (SIZE_RATIO_SLACK). Measured 3.45 of 3.46 derived, both widths
    # (bound 3.36; the former 3.0 let a scale per 16 weights, 3.13, pass).
    _, pd_bytes = _int8_weight_bytes(dirs["ckpt"], weight_only_bits=8)
    pd_ratio = os.path.getsize(os.path.join(dirs["export"], "model.pdiparams")) / \
        os.path.getsize(os.path.join(path, "model.pdiparams"))
    assert pd_ratio > SIZE_RATIO_SLACK * fp32_bytes / pd_bytes, pd_ratio
    types = _onnx_op_types(path, "decode")
    assert types.count("MatMulNBits") == 9 and types.count("GatherBlockQuantized") == 2, sorted(set(types))
    gap = _ppl(DygraphBackend(model), tok, wiki) / _ppl(DygraphBackend(load_model(dirs["ckpt"])), tok, wiki) - 1
    assert abs(gap) * 100 < (PPL_MARGIN_PCT if bits == 8 else INT4_PPL_MARGIN_PCT), gap


def test_w8a8_qdq_matmul_is_exact():
    """One rewritten W8A8 MatMul in onnxruntime (fused into MatMulIntegerToFloat) equals the
    fake-quant math to float32 rounding, on inputs where the u8s8 kernel of x86 CPUs without
    VNNI saturates (pairs of 255 x 127 overflow its int16 sums; int8 weights gave 1e2 here)."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper
    from gpt_compress.config import W8A8
    from gpt_compress.export.int8 import rewrite_onnx
    from gpt_compress.qat.deploy import weight_digest

    rng = np.random.default_rng(0)
    k, n, sx = 64, 16, 0.02
    codes = np.tile(np.where(np.arange(n) % 2, -127, 127), (k, 1)).astype(np.int8)
    codes[:, 1] = rng.integers(-127, 128, k)
    scale = ((rng.random(n) + 0.5) / 127).astype(np.float32)
    w = (codes * scale).astype(np.float32)
    x = np.full((4, k), 127 * sx, np.float32)  # input code 255: every pair saturates without the fix
    x[1] = -128 * sx
    x[2:] = rng.standard_normal((2, k)) * 2
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, n])],
                              [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    entry = {"name": "fc", "kind": "linear", "mode": W8A8, "bits": 8, "block": None,
             "digests": {"matmul": weight_digest(w)},
             "codes": codes, "scale": scale.reshape(1, n), "act_scale": sx, "act_bits": 8,
             "dynamic_inputs": False}
    assert rewrite_onnx(model, [entry]) == {"QDQ MatMul": 1}
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    got = sess.run(None, {"x": x})[0]
    xq = np.clip(np.round(x.astype(np.float64) / np.float32(sx)), -128, 127)
    ref = (xq @ codes.astype(np.float64)) * np.float32(sx) * scale
    assert np.abs(ref).max() > 100
    # Integer kernels: an exact int32 dot, then its float conversion and two scale products (3
    # float32 roundings); a float fallback on the dequantized values sums k products in float32.
    # Either is within gamma_(k + 3) sum |x w| (u = 2^-24) of the exact value, per element.
    u = 2.0 ** -24
    bound = (k + 3) * u / (1 - (k + 3) * u) * ((np.abs(xq) * np.float32(sx)) @ (np.abs(codes) * scale))
    assert (np.abs(got - ref) <= bound).all(), (np.max(np.abs(got - ref)), np.max(np.abs(got - ref) / bound))


# --------------------------------------------------------------------------------------
# 5. Checkpoints and config
# --------------------------------------------------------------------------------------
def test_quantized_checkpoint_roundtrip_and_float_fallback(qat_run, dirs):
    import paddle

    from gpt_compress.checkpoint import load_model
    from gpt_compress.qat.quantize import load_any, load_quantized, quant_layers

    out, report = qat_run
    q1, q2 = load_quantized(report["quantized_checkpoint"]), load_any(report["quantized_checkpoint"])
    ids = paddle.to_tensor(np.arange(40, dtype=np.int64).reshape(2, 20))
    np.testing.assert_array_equal(q1(ids).numpy(), q2(ids).numpy())
    # The same directory loads as the float model (its master weights) with the usual loader.
    plain = load_model(report["quantized_checkpoint"])
    assert not quant_layers(plain)
    assert float(paddle.abs(plain(ids) - q1(ids)).max()) > 1e-4  # quantization does change logits
    assert not quant_layers(load_any(dirs["ckpt"]))
    # The dygraph runner (`gptc eval/infer --backend dygraph`) runs a quantized checkpoint quantized.
    gen = Generator.from_dir(report["quantized_checkpoint"], backend="dygraph")
    np.testing.assert_array_equal(gen.score(ids.numpy()), q1(ids).numpy())


def test_quant_config_section(tmp_path):
    from gpt_compress.config import ConfigError, build_config, load_config

    cfg = load_config(os.path.join(ROOT, "configs", "qat_gpt_345M_single_card.yaml"),
                      ["Quant.observer=percentile", "Quant.weight_only=[gpt.wte]"])
    assert cfg.quant.targets == ["gpt.blocks.*"] and cfg.quant.observer == "percentile"
    assert cfg.quant.weight_only == ["gpt.wte"] and cfg.optimizer.lr.max_lr == 5e-6
    for bad, needle in ((["Quant.obsrever=mse"], "did you mean 'observer'"),
                        (["Quant.observer=kl"], "abs_max, percentile, mse"),
                        (["Quant.weight_block_size=24"], "power of two"),
                        (["Quant.weight_bits=1"], "one of 8, 4"),
                        (["Quant.weight_bits=6"], "one of 8, 4")):
        with pytest.raises(ConfigError, match=needle):
            build_config({}, bad)
    with pytest.raises(ConfigError, match="does not exist"):
        build_config({}, [f"Quant.skip_file={tmp_path / 'nope.txt'}"]).quant.all_skips()
