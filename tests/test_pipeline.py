"""`gptc pipeline` end to end on a tiny config: every stage runs and the report holds every
artifact's figures; a second run skips everything; deleting one stage's output reruns only that
stage and what depends on it."""
import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import yaml

from _export_helpers import FLOAT_PPL_RTOL, INT8_PPL_RTOL

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALL = {"data", "pretrain", "prune", "distill", "qat", "export_base", "export_compressed", "draft",
       "eval_base", "eval_compressed", "eval_int8", "report"}
# Bytes an int8 export saves per quantized weight (every matrix: the block linears and the
# weight-only embeddings) over the fp32 export of the same model, weight and graph files together:
# 3, less the fp32 per-channel scales and the dequantize nodes. Measured 2.92 (Paddle) and 2.77
# (ONNX) on the pruned model (114,688 quantized weights), the same for every seed (sizes depend
# only on shapes). Weights stored fp16 save at most 2 bytes, fp32 none; 2.25 lies between.
INT8_MIN_SAVED_BYTES = 2.25


def _png_size(path):
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR", path
    return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")


def _matrix_elements(path):
    """Elements of the 2-D tensors in a safetensors file, read from its JSON header."""
    with open(path, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    return sum(math.prod(t["shape"]) for k, t in header.items() if k != "__metadata__" and len(t["shape"]) == 2)


def _run(config, *extra):
    res = subprocess.run([sys.executable, "-m", "gpt_compress", "pipeline", "-c", str(config), *extra],
                         capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads(res.stdout.strip().splitlines()[-1]), res.stderr


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory, shared_data):
    """configs/pipeline_tiny_cpu.yaml shrunk: a 2-layer model, seconds per stage."""
    with open(os.path.join(ROOT, "configs", "pipeline_tiny_cpu.yaml"), encoding="utf-8") as f:
        raw = yaml.safe_load(f)
    out = tmp_path_factory.mktemp("pipe")
    raw["Global"]["output_dir"] = str(out / "run")
    raw["Model"].update(vocab_size=512, hidden_size=64, num_layers=2, num_attention_heads=4,
                        max_position_embeddings=128)
    raw["Data"]["seq_length"] = 64
    raw["Engine"].update(max_steps=20, global_batch_size=8, micro_batch_size=8, eval_freq=10, eval_iters=2,
                         save_steps=10)
    raw["Prune"]["calib_batches"] = 2
    raw["Quant"]["calib_batches"] = 2
    raw["Pipeline"].update(corpus_max_bytes=150_000, distill_overrides=["Engine.max_steps=5"],
                           qat_overrides=["Engine.max_steps=5", "Engine.eval_freq=0"], eval_max_chars=6000,
                           eval_lambada=str(shared_data / "lambada_test.jsonl"), lambada_limit=20,
                           speed_prompt_tokens=16, speed_new_tokens=8, speed_reps=1)
    path = out / "pipeline.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path, out / "run"


def test_pipeline_runs_skips_and_reruns_what_follows(tiny_config):
    config, out = tiny_config
    first, _ = _run(config)
    assert {s for s, r in first["stages"].items() if r["ran"]} == ALL

    # The report: one row per artifact x backend, every figure present, plots are real images.
    rows = json.loads((out / "report" / "results.json").read_text())
    assert {(r["name"], r["backend"]) for r in rows} == {
        (n, b) for n in ("base (fp32)", "pruned+distilled (fp32)", "QAT int8") for b in ("paddle", "onnx")}
    for r in rows:
        for key in ("size_mb", "wikitext_ppl", "decode_tokens_per_s", "prefill_ms"):  # measured: never 0
            assert r[key] is not None and r[key] > 0, (r, key)
        assert r["lambada_acc"] is not None and 0 <= r["lambada_acc"] <= 1, r
        assert 1.0 < r["wikitext_ppl"] < 512  # a trained model beats uniform over the 512-token vocabulary
    by = {(r["name"], r["backend"]): r for r in rows}
    quantized = _matrix_elements(next((out / "distill" / "checkpoints").glob("step_*")) / "model.safetensors")
    for b in ("paddle", "onnx"):
        # Pruned is smaller; QAT int8 (of the pruned+distilled model) saves INT8_MIN_SAVED_BYTES
        # per quantized weight over that model's fp32 files.
        assert by[("pruned+distilled (fp32)", b)]["size_mb"] < by[("base (fp32)", b)]["size_mb"]
        saved = (by[("pruned+distilled (fp32)", b)]["size_mb"] - by[("QAT int8", b)]["size_mb"]) * 2**20
        assert saved > INT8_MIN_SAVED_BYTES * quantized, (b, saved / quantized)
    for name in ("base (fp32)", "pruned+distilled (fp32)", "QAT int8"):
        p, o = by[(name, "paddle")]["wikitext_ppl"], by[(name, "onnx")]["wikitext_ppl"]
        assert abs(p - o) / p < (INT8_PPL_RTOL if "int8" in name else FLOAT_PPL_RTOL), (name, p, o)
    md = (out / "report" / "report.md").read_text()
    assert md.count("| QAT int8 |") == 2 and "prune (taylor" in md
    # The int8 export is the base export's speculative draft, with its measured acceptance.
    draft = json.loads((out / "export" / "base" / "manifest.json").read_text())["draft"]
    assert (out / "export" / "base" / draft["path"]).resolve() == (out / "qat" / "int8").resolve(), draft
    assert 0 <= draft["acceptance_rate"] <= 1 and draft["k"] == 5
    assert f"acceptance rate {draft['acceptance_rate']}" in md
    for png in ("loss_curves.png", "size_vs_quality.png", "speed_vs_quality.png"):
        w, h = _png_size(out / "report" / png)
        assert w > 300 and h > 200 and os.path.getsize(out / "report" / png) > 10_000, png

    # Second run: nothing to do.
    second, log = _run(config)
    assert not any(r["ran"] for r in second["stages"].values()), second
    assert log.count("up to date, skipped") == len(ALL)

    # Delete one stage's output: that stage and what reads it rerun, nothing else.
    shutil.rmtree(out / "export" / "compressed")
    status, _ = _run(config, "--status")
    stale = {s["stage"] for s in status["stages"] if not s["fresh"]}
    assert stale == {"export_compressed", "eval_compressed", "report"}
    third, _ = _run(config)
    assert {s for s, r in third["stages"].items() if r["ran"]} == {"export_compressed", "eval_compressed", "report"}

    # A draft vocabulary: only the draft stage (and the report) reruns; it exports the QAT
    # checkpoint again as export/draft, with the 64 most frequent tokens, and records that.
    fourth, _ = _run(config, "-o", "Pipeline.draft_vocab=64")
    assert {s for s, r in fourth["stages"].items() if r["ran"]} == {"draft", "report"}
    draft = json.loads((out / "export" / "base" / "manifest.json").read_text())["draft"]
    assert (out / "export" / "base" / draft["path"]).resolve() == (out / "export" / "draft").resolve(), draft
    assert json.loads((out / "export" / "draft" / "manifest.json").read_text())["fused"]["draft_vocab"] == 64
    assert 0 <= draft["acceptance_rate"] <= 1
    md = (out / "report" / "report.md").read_text()
    assert f"proposing from the 64 most frequent training tokens): acceptance rate {draft['acceptance_rate']}" in md


def test_pipeline_config_errors_are_named(tmp_path):
    res = subprocess.run([sys.executable, "-m", "gpt_compress", "pipeline", "-o", "Pipeline.distill=true",
                          "-o", "Pipeline.prune=false", "--status"], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 2 and "Pipeline.distill needs Pipeline.prune" in res.stderr
    res = subprocess.run([sys.executable, "-m", "gpt_compress", "pipeline", "-o", f"Global.output_dir={tmp_path}",
                          "--stage", "nope"], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 1 and "unknown stage 'nope'" in res.stderr
    res = subprocess.run([sys.executable, "-m", "gpt_compress", "pipeline", "-o", f"Global.output_dir={tmp_path}",
                          "--stage", "prune"], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 1 and "stage 'data' is not up to date" in res.stderr


def test_stage_option_ignores_stale_later_stages_but_not_stale_inputs(tmp_path, monkeypatch):
    """`--stage b` runs b when its inputs are fresh, whatever the state of stages after it."""
    from gpt_compress.config import load_config
    from gpt_compress.errors import PipelineError
    from gpt_compress.pipeline import Pipeline
    from gpt_compress.pipeline.stages import Stage

    pipe = Pipeline(load_config(None, [f"Global.output_dir={tmp_path}"]))
    ran, settings = [], {"a": 1, "b": 1, "c": 1}

    monkeypatch.setattr(pipe, "stages", lambda: [Stage(name, deps, settings[name],
                                                       (lambda n=name: ran.append(n) or {}), lambda out: None)
                                                 for name, deps in (("a", ()), ("b", ("a",)), ("c", ("b",)))])
    pipe.run()
    assert ran == ["a", "b", "c"]
    settings["c"] = 2  # the last stage is stale now
    ran.clear()
    pipe.run(only=["b"], force=["b"])
    assert ran == ["b"]
    settings["a"] = 2  # an input of b is stale: b must not run on it
    with pytest.raises(PipelineError, match="stage 'a' is not up to date"):
        pipe.run(only=["b"])


def test_quant_variants_add_stages_and_the_bench_config_reads(tmp_path):
    """configs/pipeline_compress_bench.yaml (bench/compress.py's recipe): each quant variant is a
    `quant_NAME` stage from its source and an `eval_NAME` stage, before the report."""
    res = subprocess.run([sys.executable, "-m", "gpt_compress", "pipeline", "-c",
                          os.path.join(ROOT, "configs", "pipeline_compress_bench.yaml"),
                          "-o", f"Global.output_dir={tmp_path}", "--status"], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    stages = [s["stage"] for s in json.loads(res.stdout.strip().splitlines()[-1])["stages"]]
    variants = ("ptq-w8a8", "qat-w8a8", "woq8", "woq4")
    assert set(stages) == ALL | {f"quant_{v}" for v in variants} | {f"eval_{v}" for v in variants}
    assert stages[-1] == "report" and all(stages.index(f"quant_{v}") < stages.index(f"eval_{v}") for v in variants)


def test_a_distill_on_teacher_continuations_follows_the_base_export(tmp_path):
    """``Distill.generated_windows`` (configs/pipeline_speculative_bench.yaml): the base export
    writes the distillation windows, so export_base runs before distill and distill depends on
    it; without generated windows distill does not wait for it."""
    from gpt_compress.config import load_config
    from gpt_compress.pipeline.stages import Pipeline

    conf = os.path.join(ROOT, "configs", "pipeline_speculative_bench.yaml")
    for windows in (4096, 0):
        cfg = load_config(conf, [f"Global.output_dir={tmp_path}",
                                 f"Pipeline.distill_overrides=[Distill.generated_windows={windows}]"])
        stages = Pipeline(cfg).stages()
        names = [s.name for s in stages]
        distill = stages[names.index("distill")]
        assert names.index("export_base") < names.index("distill")
        assert ("export_base" in distill.deps) == bool(windows), (windows, distill.deps)
