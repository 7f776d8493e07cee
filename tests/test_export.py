"""Export: dygraph vs Paddle Inference vs onnxruntime parity on a trained (and a pruned) tiny GPT,
one copy of the weights, atomic output, clear errors, no run-time pip installs."""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from _export_helpers import ENV, LOGIT_ATOL, PRUNED_FFN, PRUNED_HEADS, ROOT, model_dirs
from _parity_helpers import BACKENDS, PROMPTS, Recorder, assert_step_parity
from gpt_compress.checkpoint import CheckpointError
from gpt_compress.fileio import sha256_file, write_dir_atomic, write_json_atomic
from gpt_compress.errors import ExportError
from gpt_compress.export import export
from gpt_compress.inference.manifest import ModelDirError, read_manifest
from gpt_compress.inference.runner import Generator

@pytest.fixture(scope="module")
def dirs(tmp_path_factory, shakespeare):
    return model_dirs(tmp_path_factory, shakespeare)


def _generators(dirs, which):
    ckpt = dirs["ckpt"] if which == "export" else dirs["pruned_ckpt"]
    gens = {b: Generator.from_dir(ckpt if b == "dygraph" else dirs[which], backend=b) for b in BACKENDS}
    for g in gens.values():
        g.backend = Recorder(g.backend)
    return gens


@pytest.mark.parametrize("which", ["export", "pruned_export"])
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_parity_prefill_and_32_decode_steps(dirs, which, batch):
    gens = _generators(dirs, which)
    prompts = PROMPTS[:batch]  # batch 3: lengths differ, so rows are left-padded
    outs = {b: g.generate(prompts, max_new_tokens=33) for b, g in gens.items()}
    assert len(gens["dygraph"].backend.logits) == 33  # prefill + 32 decode steps
    for b in ("paddle", "onnx"):
        assert outs[b].sequences == outs["dygraph"].sequences, b
    assert_step_parity(gens, LOGIT_ATOL)


@pytest.mark.parametrize("which", ["export", "pruned_export"])
def test_beam_search_parity(dirs, which):
    gens = _generators(dirs, which)
    outs = {b: g.generate(PROMPTS[:2], max_new_tokens=12, decode_strategy="beam_search", num_beams=4)
            for b, g in gens.items()}
    # A beam's score is its length-normalised sum of at most 12 log-softmax values, each off by at
    # most 2 LOGIT_ATOL (its logit and the log-sum-exp, each within LOGIT_ATOL): at most 24 LOGIT_ATOL.
    for b in ("paddle", "onnx"):
        assert outs[b].sequences == outs["dygraph"].sequences, b
        np.testing.assert_allclose(outs[b].scores, outs["dygraph"].scores, rtol=0, atol=2 * 12 * LOGIT_ATOL)
    assert_step_parity(gens, LOGIT_ATOL)


@pytest.mark.parametrize("which", ["export", "pruned_export"])
def test_forward_scoring_program_matches_dygraph(dirs, which):
    gens = _generators(dirs, which)
    tok = gens["dygraph"].tokenizer
    rows = [tok.encode(p) for p in PROMPTS]
    width = max(map(len, rows))
    ids = np.zeros((len(rows), width), np.int64)
    mask = np.zeros_like(ids)
    for i, r in enumerate(rows):  # right padding, as evaluation batches come
        ids[i, :len(r)], mask[i, :len(r)] = r, 1
    ref = gens["dygraph"].score(ids, mask)
    assert ref.shape == (3, width, 1024)
    for b in ("paddle", "onnx"):
        got = gens[b].score(ids, mask)
        assert got.shape == ref.shape and got.dtype == np.float32
        assert np.max(np.abs(got - ref)[mask > 0]) < LOGIT_ATOL, b
    # No mask at all: a plain causal pass.
    for b in ("paddle", "onnx"):
        assert np.max(np.abs(gens[b].score(ids[:, :8]) - gens["dygraph"].score(ids[:, :8]))) < LOGIT_ATOL


def test_pruned_model_has_per_layer_cache_shapes(dirs):
    m = read_manifest(dirs["pruned_export"])
    assert m.data["model"]["layer_num_heads"] == PRUNED_HEADS
    assert m.data["model"]["layer_ffn_sizes"] == PRUNED_FFN
    assert [layer["heads"] for layer in m.layers] == PRUNED_HEADS
    shapes = {o["name"]: o["shape"] for o in m.program("decode")["outputs"]}
    assert shapes["present_key_0"][1] == 4 and shapes["present_value_1"][1] == 2


def test_directory_layout_and_weights_stored_once(dirs):
    path = dirs["export"]
    m = read_manifest(path)
    files = sorted(os.listdir(path))
    assert files == sorted(["manifest.json", "checksums.json", "prefill.json", "decode.json", "forward.json",
                            "decode_hidden.json", "lm_head.json", "forward_hidden.json", "score_head.json",
                            "fused.json", "fused.pdiparams",
                            "model.pdiparams", "prefill.onnx", "decode.onnx", "forward.onnx", "model.onnx.data",
                            "forward_hidden.onnx", "score_head.onnx", "tokenizer.json", "vocab.json", "merges.txt"])
    cfg = m.data["model"]
    from gpt_compress.config import ModelConfig

    n_bytes = 4 * ModelConfig.from_dict(cfg).num_parameters()
    # One params file per format, each about the size of the fp32 weights (never 2x: the tied
    # embedding is stored once, shared by the three programs).
    assert n_bytes <= os.path.getsize(os.path.join(path, "model.pdiparams")) < 1.05 * n_bytes
    assert n_bytes <= os.path.getsize(os.path.join(path, "model.onnx.data")) < 1.05 * n_bytes + 64 * 4096
    assert n_bytes <= os.path.getsize(os.path.join(path, "fused.pdiparams")) < 1.05 * n_bytes  # fused program
    for prog in ("prefill", "decode", "forward", "forward_hidden", "score_head"):
        assert os.path.getsize(os.path.join(path, f"{prog}.onnx")) < 0.2 * n_bytes
        assert m.program(prog)["paddle"]["params"] == "model.pdiparams"
        assert m.program(prog)["onnx"]["data"] == "model.onnx.data"
    for prog in ("decode_hidden", "lm_head"):  # Paddle's split batch-1 decode: same params file
        assert m.program(prog)["paddle"] == {"model": f"{prog}.json", "params": "model.pdiparams"}
        assert "onnx" not in m.program(prog)
    # Manifest: config, vocab, dtypes, IO names and shapes, versions.
    assert m.data["format_version"] == 1 and m.data["dtype"] == "float32"
    assert m.vocab_size == 1024 and m.data["tokenizer"]
    assert {"paddle", "paddle2onnx", "onnx"} <= set(m.data["versions"])
    assert [i["name"] for i in m.program("decode")["inputs"][:4]] == ["input_ids", "attention_mask",
                                                                         "past_key_0", "past_value_0"]
    import onnx

    for prog in ("prefill", "decode", "forward", "forward_hidden", "score_head"):
        model = onnx.load(os.path.join(path, f"{prog}.onnx"), load_external_data=False)
        spec = m.program(prog)
        assert [i.name for i in model.graph.input] == [i["name"] for i in spec["inputs"]]
        assert [o.name for o in model.graph.output] == [o["name"] for o in spec["outputs"]]
        assert model.opset_import[0].version == 17


def test_export_refuses_config_weight_mismatch_and_leaves_nothing(dirs, tmp_path):
    bad = tmp_path / "bad_ckpt"
    shutil.copytree(dirs["ckpt"], bad)
    meta = json.loads((bad / "config.json").read_text())
    meta["model"]["layer_ffn_sizes"] = [128, 128]  # the weights have 256 columns
    write_json_atomic(str(bad / "config.json"), meta)
    sums = json.loads((bad / "checksums.json").read_text())
    sums["config.json"] = sha256_file(str(bad / "config.json"))
    write_json_atomic(str(bad / "checksums.json"), sums)
    out = tmp_path / "out"
    with pytest.raises(CheckpointError, match="does not match its model config.*fc_in"):
        export(str(bad), str(out))
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["bad_ckpt"]  # no half-written temp directory


def test_failed_export_keeps_previous_directory(dirs, tmp_path, monkeypatch):
    import gpt_compress.export.api as api

    out = tmp_path / "out"
    write_dir_atomic(str(out), lambda d: open(os.path.join(d, "marker"), "w").write("old"))  # an earlier output

    def boom(*a, **k):
        raise ExportError("simulated mismatch")

    monkeypatch.setattr(api, "validate_dir", boom)
    with pytest.raises(ExportError, match="simulated"):
        export(dirs["pruned_ckpt"], str(out), formats=("paddle",), overwrite=True)
    assert (out / "marker").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_onnx_export_installs_nothing(dirs, tmp_path):
    """paddle2onnx's default optimizer path sets POLYGRAPHY_AUTOINSTALL_DEPS and pip-installs;
    ours must leave the environment untouched."""
    def freeze():
        return subprocess.run([sys.executable, "-m", "pip", "freeze", "--all"], capture_output=True, text=True,
                              env=ENV).stdout

    before = freeze()
    export(dirs["pruned_ckpt"], str(tmp_path / "onnx_only"), formats=("onnx",))
    assert "POLYGRAPHY_AUTOINSTALL_DEPS" not in os.environ
    assert freeze() == before
    assert not any(f.endswith((".json", ".pdiparams")) and f not in ("manifest.json", "checksums.json",
                                                                     "tokenizer.json", "vocab.json")
                   for f in os.listdir(tmp_path / "onnx_only"))
    assert read_manifest(str(tmp_path / "onnx_only")).formats == ["onnx"]


def _copy(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


@pytest.mark.parametrize("backend", ["paddle", "onnx"])
def test_missing_or_corrupt_files_are_named(dirs, tmp_path, backend):
    src = dirs["pruned_export"]
    # Missing manifest.
    d = _copy(src, tmp_path / "a")
    os.remove(os.path.join(d, "manifest.json"))
    with pytest.raises(ModelDirError, match=r"manifest\.json not found"):
        Generator.from_dir(d, backend=backend)
    # Corrupt manifest.
    d = _copy(src, tmp_path / "b")
    with open(os.path.join(d, "manifest.json"), "w") as f:
        f.write("{not json")
    with pytest.raises(ModelDirError, match=r"manifest\.json is not valid JSON"):
        Generator.from_dir(d, backend=backend)
    # Exported by a newer gpt-compress.
    d = _copy(src, tmp_path / "c")
    meta = json.loads(open(os.path.join(d, "manifest.json")).read())
    meta["format_version"] = 99
    write_json_atomic(os.path.join(d, "manifest.json"), meta)
    with pytest.raises(ModelDirError, match=r"manifest\.json: export format version 99 is newer"):
        Generator.from_dir(d, backend=backend)
    # Weights: missing, then one flipped byte.
    weights = "fused.pdiparams" if backend == "paddle" else "model.onnx.data"  # what the default backend loads
    d = _copy(src, tmp_path / "d")
    os.remove(os.path.join(d, weights))
    with pytest.raises(ModelDirError, match=rf"{weights} is missing"):
        Generator.from_dir(d, backend=backend)
    d = _copy(src, tmp_path / "e")
    fp = os.path.join(d, weights)
    with open(fp, "r+b") as f:
        f.seek(os.path.getsize(fp) // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(ModelDirError, match=rf"{weights} is corrupt"):
        Generator.from_dir(d, backend=backend)
    # A truncated weights file with verification off still fails with the file's name.
    d = _copy(src, tmp_path / "f")
    fp = os.path.join(d, weights)
    with open(fp, "r+b") as f:
        f.truncate(1000)
    with pytest.raises(ModelDirError, match=weights):
        Generator.from_dir(d, backend=backend, verify=False).generate([[1, 2, 3]], max_new_tokens=2)


def test_format_missing_from_directory_is_explained(dirs, tmp_path):
    d = tmp_path / "onnx_only"
    export(dirs["pruned_ckpt"], str(d), formats=("onnx",), validate=False)
    with pytest.raises(ModelDirError, match="without the 'paddle' format"):
        Generator.from_dir(str(d), backend="paddle")


def test_cli_export_model_entry_point(dirs, tmp_path):
    out = tmp_path / "cli_out"
    proc = subprocess.run([sys.executable, "-m", "gpt_compress", "export", "--model", dirs["pruned_ckpt"],
                           "--output", str(out), "--format", "all"], env=ENV, cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(proc.stdout)  # stdout holds only the JSON summary
    assert summary["formats"] == ["paddle", "onnx"] and "model.onnx.data" in summary["files"]
    # A directory that is not a checkpoint: exit 1 and a message naming the file.
    proc = subprocess.run([sys.executable, "-m", "gpt_compress", "export", "--model", str(tmp_path / "nope"),
                           "--output", str(tmp_path / "x")], env=ENV, cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 1 and "config.json" in proc.stderr


def test_hf_gpt2_checkpoint_exports_and_matches_transformers(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from gpt_compress.checkpoint import save_model
    from gpt_compress.convert.hf_gpt2 import load_hf_gpt2

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=320, n_positions=64, n_embd=48, n_layer=2, n_head=4,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    cfg.initializer_range = 0.2
    hf = transformers.GPT2LMHeadModel(cfg).eval()
    hf.save_pretrained(tmp_path / "hf")
    ckpt = save_model(load_hf_gpt2(str(tmp_path / "hf")), str(tmp_path / "ckpt"))
    out = export(ckpt, str(tmp_path / "exported"), formats=("paddle", "onnx"))
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 320, (2, 10)).astype(np.int64)
    with torch.no_grad():
        ref = hf(torch.tensor(ids)).logits.numpy()
    for b in ("paddle", "onnx"):
        got = Generator.from_dir(out, backend=b).score(ids)
        assert np.max(np.abs(got - ref)) < LOGIT_ATOL, b


@pytest.mark.parametrize("bucket", [8, 64])
def test_batched_decode_with_bucketed_cache_matches_dygraph(dirs, bucket):
    """Batches >= 4 decode on oneDNN with a length-bucketed, in-place cache: parity across
    bucket boundaries (prompt lengths differ, one crosses 64 positions while decoding)."""
    from gpt_compress.inference.predictor import PaddleBackend

    gens = _generators(dirs, "export")
    paddle_backend = PaddleBackend(dirs["export"], cache_bucket=bucket)
    assert paddle_backend._decode_role(4) == "decode_batched" and paddle_backend._bucketed("decode_batched")
    gens["paddle"].backend = Recorder(paddle_backend)
    tok = gens["dygraph"].tokenizer
    long = tok.encode("First Citizen:\nWe are accounted poor citizens, the patricians good. What authority "
                      "surfeits on would relieve us: if they would yield us but the superfluity,")
    assert 40 < len(long) < 64
    prompts = [long, *PROMPTS]
    outs = {b: gens[b].generate(prompts, max_new_tokens=33) for b in BACKENDS}
    for b in ("paddle", "onnx"):
        assert outs[b].sequences == outs["dygraph"].sequences, b
    assert_step_parity(gens, LOGIT_ATOL)


def test_untied_lm_head_exports_with_parity(tmp_path):
    import paddle

    from gpt_compress.checkpoint import save_model
    from gpt_compress.config import ModelConfig
    from gpt_compress.model.gpt import GPTForCausalLM

    paddle.seed(3)
    # vocab 1022: not a multiple of HEAD_BLOCKS, so the split LM head pads its column blocks.
    cfg = ModelConfig.from_preset("gpt-tiny", vocab_size=1022, tie_word_embeddings=False, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0, initializer_range=0.2)
    ckpt = save_model(GPTForCausalLM(cfg), str(tmp_path / "ckpt"))
    out = export(ckpt, str(tmp_path / "exported"), formats=("paddle", "onnx"))  # validates vs dygraph
    # The unfused Paddle programs (the split head); tests/test_fused.py covers the fused one.
    gens = {b: Generator.from_dir(ckpt if b == "dygraph" else out, backend=b, **({"fused": False} if b == "paddle" else {}))
            for b in BACKENDS}
    assert gens["paddle"].backend.split_head
    for g in gens.values():
        g.backend = Recorder(g.backend)
    outs = {b: g.generate([[5, 6, 7], [9]], max_new_tokens=9).sequences for b, g in gens.items()}
    assert outs["paddle"] == outs["dygraph"] and outs["onnx"] == outs["dygraph"]
    assert_step_parity(gens, LOGIT_ATOL)


@pytest.mark.parametrize("batch", [1, 3])
def test_split_lm_head_decode_matches_single_decode_program(dirs, batch):
    """Batch-1..3 decode runs ``decode_hidden`` (1 thread) + ``lm_head`` (all threads, blocked
    columns): the same logits as the single ``decode`` program (within 1e-5) and the same tokens."""
    from gpt_compress.inference.predictor import PaddleBackend

    split, single = PaddleBackend(dirs["export"]), PaddleBackend(dirs["export"], split_head=False)
    assert split.split_head and not single.split_head
    outs, logits = {}, {}
    for name, be in (("split", split), ("single", single)):
        gen = Generator.from_dir(dirs["export"], backend="paddle")
        gen.backend = Recorder(be)
        outs[name] = gen.generate(PROMPTS[:batch], max_new_tokens=17).sequences
        logits[name] = gen.backend.logits
    assert outs["split"] == outs["single"]
    assert {"decode_hidden", "lm_head"} <= set(split._predictors) and "decode" not in split._predictors
    # Each logit is the same K = 64 float32 dot product in both programs: measured bitwise equal
    # (train_tiny seeds 1234, 1, 2; batch 1 and 3). A oneDNN build that blocks the dot's K by the
    # column count sums it in another order: about sqrt(K) u sum |h w| (~20 here), 1e-5 (10 ulps
    # of the largest logit, ~9).
    diffs = [float(np.max(np.abs(a - b))) for a, b in zip(logits["split"], logits["single"])]
    assert max(diffs) < 1e-5, diffs
