"""Evaluation: cross-checked against transformers, equal across backends, real data end to end,
GLUE SST-2 finetuning above chance."""
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from _export_helpers import LOGIT_ATOL, MEAN_SCORE_RTOL, model_dirs
from _stats_helpers import chance_floor
from conftest import FULL_DATA, LAMBADA_PASSAGES
from gpt_compress.data.glue import read_task
from gpt_compress.eval.lambada import evaluate_lambada
from gpt_compress.eval.wikitext import build_windows, evaluate_wikitext, read_wikitext
from gpt_compress.inference.base import Scorer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REL = 1e-4  # relative tolerance the issue sets for perplexities across implementations
SEQ = 128  # the tiny model's context


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, shakespeare):
    return model_dirs(tmp_path_factory, shakespeare)


@pytest.fixture(scope="module")
def wiki_part(shared_data, tmp_path_factory):
    """The first 600 lines of WikiText-2 test (raw): enough windows for cross-checks, quick."""
    path = tmp_path_factory.mktemp("wiki") / "wiki.part.raw"
    with open(shared_data / "wikitext-2" / "wiki.test.raw", encoding="utf-8", newline="") as f:
        path.write_text("".join(f.readlines()[:600]), encoding="utf-8", newline="")
    return str(path)


class HFBackend(Scorer):
    """transformers GPT2LMHeadModel behind the evaluators' ``Scorer`` interface."""

    def __init__(self, path):
        import transformers

        self.model = transformers.GPT2LMHeadModel.from_pretrained(path).eval()

    def score(self, ids, mask=None):
        import torch

        with torch.no_grad():
            return self.model(torch.tensor(ids)).logits.numpy()


@pytest.fixture(scope="module")
def hf(dirs, tmp_path_factory):
    """transformers' GPT-2 on the trained checkpoint: the peer of the tests that compare with it."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from gpt_compress.checkpoint import load_model
    from gpt_compress.convert.hf_gpt2 import save_hf_gpt2

    out = save_hf_gpt2(load_model(dirs["ckpt"]), str(tmp_path_factory.mktemp("hf") / "model"))
    return HFBackend(out)


@pytest.fixture(scope="module")
def gens(dirs):
    from gpt_compress.inference.runner import Generator

    return {"dygraph": Generator.from_dir(dirs["ckpt"], backend="dygraph"),
            # The unfused programs: the scoring programs are theirs (test_fused.py covers the fused one).
            "paddle": Generator.from_dir(dirs["export"], backend="paddle", fused=False),
            "onnx": Generator.from_dir(dirs["export"], backend="onnx")}


def test_wikitext_ppl_equals_transformers(gens, hf, wiki_part):
    import torch  # present: the hf fixture skips without it

    tok = gens["dygraph"].tokenizer
    ours = evaluate_wikitext(gens["dygraph"], tok, wiki_part, "raw", seq_len=SEQ, stride=64, progress=False)
    peer = evaluate_wikitext(hf, tok, wiki_part, "raw", seq_len=SEQ, stride=64, progress=False)
    assert abs(ours.ppl - peer.ppl) / peer.ppl < REL
    # And with torch's own cross-entropy on transformers' logits over the same windows.
    text, _ = read_wikitext(wiki_part, "raw")
    tokens = np.asarray(tok.encode(text), dtype=np.int64)
    total = 0.0
    for inputs, labels, mask in build_windows(tokens, SEQ, 64, tok.eod_id):
        with torch.no_grad():
            logits = hf.model(torch.tensor(inputs)[None]).logits[0].double()
        target = torch.tensor(np.where(mask > 0, labels, -100))
        total += float(torch.nn.functional.cross_entropy(logits, target, ignore_index=-100, reduction="sum"))
    hf_ppl = math.exp(total / (len(tokens) - 1))
    assert ours.num_windows > 20
    assert abs(ours.ppl - hf_ppl) / hf_ppl < REL, (ours.ppl, hf_ppl)


def test_lambada_items_equal_transformers(gens, hf, shared_data):
    tok = gens["dygraph"].tokenizer
    path = str(shared_data / "lambada_test.jsonl")
    ours = evaluate_lambada(gens["dygraph"], tok, path, seq_len=SEQ, limit=200, progress=False)
    peer = evaluate_lambada(hf, tok, path, seq_len=SEQ, limit=200, progress=False)
    assert ours.correct == peer.correct
    assert abs(ours.target_ppl - peer.target_ppl) / peer.target_ppl < REL
    assert abs(ours.harness_ppl - peer.harness_ppl) / peer.harness_ppl < REL


@pytest.mark.parametrize("backend", ["paddle", "onnx"])
def test_same_numbers_on_every_backend(gens, backend, wiki_part, shared_data):
    tok = gens["dygraph"].tokenizer
    ref_w = evaluate_wikitext(gens["dygraph"], tok, wiki_part, "raw", seq_len=SEQ, progress=False)
    got_w = evaluate_wikitext(gens[backend], tok, wiki_part, "raw", seq_len=SEQ, progress=False)
    assert abs(got_w.ppl - ref_w.ppl) / ref_w.ppl < REL
    path = str(shared_data / "lambada_test.jsonl")
    ref_l = evaluate_lambada(gens["dygraph"], tok, path, seq_len=SEQ, limit=200, progress=False)
    got_l = evaluate_lambada(gens[backend], tok, path, seq_len=SEQ, limit=200, progress=False)
    assert got_l.correct == ref_l.correct
    assert abs(got_l.target_ppl - ref_l.target_ppl) / ref_l.target_ppl < REL


class FullLogits(Scorer):
    """A backend reduced to ``score``: evaluation then reduces full (B, T, V) logits in numpy,
    the reference the position-only path must equal."""

    def __init__(self, gen):
        self.gen = gen

    def score(self, ids, mask=None):
        return self.gen.score(ids, mask)


def _rel(a, b):
    return abs(a - b) / abs(b)


@pytest.mark.parametrize("backend", ["dygraph", "paddle", "onnx"])
def test_fast_scoring_equals_full_logits_reference(gens, backend, wiki_part, shared_data, tmp_path):
    """Logits only at the scored positions (body, then the head at those rows, log-sum-exp in
    the graph), one LAMBADA pass for every protocol: the same figures as full logits to 1e-6."""
    from gpt_compress.eval.scoring import label_logprobs, score_positions

    gen, tok = gens[backend], gens["dygraph"].tokenizer
    assert gen.scores_positions  # a float export carries the scoring programs
    ids = np.asarray([tok.encode(open(wiki_part, encoding="utf-8").read(4000))[:2 * SEQ]]).reshape(2, SEQ)
    logits = gen.score(ids)
    labels = np.roll(ids, -1, axis=1)
    labels[:, ::2] = logits.argmax(axis=-1)[:, ::2]  # greedy hits at every other position
    select = np.zeros(ids.shape, bool)
    select[0, 5:9], select[1, 100:] = True, True
    lp, hit = score_positions(gen, ids, labels, select, rows=8)  # several head calls
    ref_lp, ref_hit = label_logprobs(logits, labels)
    # Log p from the head-only programs vs from the full logits: within 2 LOGIT_ATOL (its logit and
    # the log-sum-exp, each within LOGIT_ATOL), as tests/test_export.py scores. Measured <= 8.5e-7
    # at |lp| >= 0.9, 47x under it (rtol 1e-6, the former bound, was 2.8x the largest relative
    # difference, 3.5e-7).
    np.testing.assert_allclose(lp, ref_lp[select], rtol=0, atol=2 * LOGIT_ATOL)
    assert (hit == ref_hit[select]).all() and 0 < hit.sum() < hit.size
    if backend == "paddle":  # the head runs as the gptc_head_score operator (inference/head_score.py)
        assert gen.backend._scorer
    ref = FullLogits(gen)
    text = tmp_path / "wiki.raw"  # ~2,000 tokens: ~40 overlapping windows
    text.write_text(open(wiki_part, encoding="utf-8").read(8000), encoding="utf-8")
    fast_w = evaluate_wikitext(gen, tok, str(text), "raw", seq_len=SEQ, stride=48, batch_size=8, progress=False)
    ref_w = evaluate_wikitext(ref, tok, str(text), "raw", seq_len=SEQ, stride=48, batch_size=8, progress=False)
    assert fast_w.num_windows > 20 and fast_w.num_scored == ref_w.num_scored
    assert _rel(fast_w.avg_loss, ref_w.avg_loss) < MEAN_SCORE_RTOL
    # A short window truncates contexts, so the strict and non-strict sequences differ.
    path = str(shared_data / "lambada_test.jsonl")
    fast_l = evaluate_lambada(gen, tok, path, seq_len=64, limit=40, progress=False)
    ref_l = evaluate_lambada(ref, tok, path, seq_len=64, limit=40, progress=False)
    assert fast_l.truncated_contexts > 0 and fast_l.correct == ref_l.correct
    for key in ("accuracy", "accuracy_nonstrict", "accuracy_harness"):
        assert getattr(fast_l, key) == getattr(ref_l, key), key
    assert _rel(fast_l.target_ppl, ref_l.target_ppl) < MEAN_SCORE_RTOL


def test_head_score_op_equals_numpy_reference():
    """gptc_head_score (the Paddle backend's scoring head): a vocabulary that is not a whole
    number of chunks or tiles, rows not a whole number of tiles, labels at both ends, a tied
    maximum (the first index wins, as numpy's argmax)."""
    import paddle

    from gpt_compress.eval.scoring import label_logprobs
    from gpt_compress.kernels import load_ops

    rng = np.random.default_rng(0)
    c, v, n = 40, 1000, 13
    w = (rng.standard_normal((c, v)) * 0.5).astype(np.float32)
    w[:, 700] = w[:, 300] = w[:, 300] * 8  # columns 300 and 700 equal, large: a tie for row 0's maximum
    h = rng.standard_normal((n, c)).astype(np.float32)
    h[0] = w[:, 300] / np.linalg.norm(w[:, 300])
    labels = rng.integers(0, v, n)
    labels[:3] = [0, v - 1, 300]
    lp, top = load_ops().gptc_head_score(paddle.to_tensor(h), paddle.to_tensor(labels), paddle.to_tensor(w))
    logits = h @ w
    ref_lp, _ = label_logprobs(logits, labels)
    # float32 logits, K = 40 dots summed in another order than numpy's, then the same log-softmax:
    # measured 5.9e-9 relative (8.9e-8 absolute at |lp| >= 0.69); 1e-6 is 170x that, under the
    # worst case (2 gamma_40 sum |h w|, ~5e-6 of sum |h w|). A wrong column, label or missing max
    # shift moves log p by 1e-3 and more.
    np.testing.assert_allclose(lp.numpy(), ref_lp, rtol=1e-6)
    assert top.numpy()[0] == 300 and (top.numpy() == logits.argmax(axis=-1)).all()


def test_head_weight_is_read_alone_from_the_combined_params_file(tmp_path):
    """``head_score._head_weight`` reads the (hidden, vocab) float32 head out of a combined params
    file written by Paddle's ``save_combine`` (what ``jit.save`` runs; a 4 MB body before the head,
    an int64 buffer after) by walking the tensors' headers: the same values, and of the 4.2 MB it
    reads under 0.5 MB (``rchar`` of /proc/self/io; ``jit.load`` read all of it). A file cut short
    gives None. A real export's head: ``test_fast_scoring_equals_full_logits_reference[paddle]``."""
    import paddle
    from paddle.base import core

    from gpt_compress.inference.head_score import _head_weight

    io = "/proc/self/io"
    if not os.path.exists(io):
        pytest.skip("no /proc/self/io")
    paddle.seed(0)
    tensors = {"a_body": paddle.randn([1024, 1024]), "head": paddle.randn([16, 40]), "z_steps": paddle.arange(3)}
    params = str(tmp_path / "model.pdiparams")
    core.save_combine_func([t.value().get_tensor() for t in tensors.values()], list(tensors), params, True, False, False)

    def rchar() -> int:
        with open(io, encoding="ascii") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))

    before = rchar()
    w = _head_weight(params, 16, 40)
    read = rchar() - before
    np.testing.assert_array_equal(w, tensors["head"].numpy())
    assert os.path.getsize(params) > 4 << 20 and read < 1 << 19, read
    assert _head_weight(params, 40, 16) is None  # no such tensor
    cut = tmp_path / "cut.pdiparams"
    cut.write_bytes(open(params, "rb").read()[:-10])
    assert _head_weight(str(cut), 16, 40) is None


def test_chosen_rows_path_equals_full_logits_reference(dirs, gens, wiki_part):
    """A backend with ``logits_at`` (the fused Paddle program, which also runs int8 and older
    exports; tensor-parallel ranks) computes logits only at the chosen rows, a call holding the
    rows of consecutive sequences up to ``rows``: the same numbers as its full logits."""
    from gpt_compress.eval.scoring import _groups, label_logprobs, score_positions
    from gpt_compress.inference.runner import Generator

    assert [(g.start, g.stop) for g in _groups(np.array([3, 0, 2, 5, 0, 1]), 5)] == [(0, 3), (3, 5), (5, 6)]
    gen, tok = Generator.from_dir(dirs["export"], backend="paddle", fused=True), gens["dygraph"].tokenizer
    assert gen.scores_rows and not gen.scores_positions
    ids = np.asarray(tok.encode(open(wiki_part, encoding="utf-8").read(4000))[:3 * 40]).reshape(3, 40)
    logits = gen.score(ids)
    labels = np.roll(ids, -1, axis=1)
    labels[:, ::3] = logits.argmax(axis=-1)[:, ::3]  # greedy hits at every third position
    select = np.zeros(ids.shape, bool)
    select[0, 30:], select[2, :12] = True, True  # the middle sequence scores nothing
    lp, hit = score_positions(gen, ids, labels, select, rows=8)  # calls: rows 0, then 2 (12 > 8)
    ref_lp, ref_hit = label_logprobs(logits, labels)
    # The fused program's logits of a row are bitwise the same whatever rows share its batch
    # (tests/test_fused.py, batch invariance), and label_logprobs is the same code: bitwise
    # (measured 0.0).
    np.testing.assert_array_equal(lp, ref_lp[select])
    assert (hit == ref_hit[select]).all() and 0 < hit.sum() < hit.size


def test_exports_without_scoring_programs_still_evaluate(dirs, gens, tmp_path, shared_data):
    """An export from before the scoring programs (manifest without them) falls back to the
    ``forward`` program's full logits, with the same figures."""
    import shutil

    from gpt_compress.inference.runner import Generator

    old = tmp_path / "old_export"
    shutil.copytree(dirs["export"], old)
    manifest = json.loads((old / "manifest.json").read_text())
    for name in ("forward_hidden", "score_head"):
        del manifest["programs"][name]
    (old / "manifest.json").write_text(json.dumps(manifest))
    path = str(shared_data / "lambada_test.jsonl")
    for backend in ("paddle", "onnx"):
        gen = Generator.from_dir(str(old), backend=backend, verify=False)
        assert not gen.scores_positions
        got = evaluate_lambada(gen, gen.tokenizer, path, seq_len=SEQ, limit=40, progress=False)
        ref = evaluate_lambada(gens[backend], gen.tokenizer, path, seq_len=SEQ, limit=40, progress=False)
        assert got.correct == ref.correct and _rel(got.target_ppl, ref.target_ppl) < MEAN_SCORE_RTOL


def test_trained_model_beats_untrained_on_real_data(shared_data, dirs, tmp_path):
    """WikiText-2 test and the LAMBADA passages (the full sets, or tests/data's slices: about a
    quarter of WikiText-2, 500 passages), trained vs untrained, both through
    the fused Paddle Inference programs (their scoring equals the unfused programs' and dygraph's:
    the tests above and test_fused.py; dygraph took 100 of this test's 133 s)."""
    from gpt_compress.checkpoint import build_model, load_model, save_model
    from gpt_compress.export import export
    from gpt_compress.inference.fused import FusedBackend
    from gpt_compress.inference.runner import Generator

    cfg = load_model(dirs["ckpt"]).config
    import paddle

    paddle.seed(0)
    untrained_dir = save_model(build_model(cfg), str(tmp_path / "untrained"))
    trained = Generator.from_dir(dirs["export"], backend="paddle")
    untrained = Generator.from_dir(export(untrained_dir, str(tmp_path / "untrained_export")), backend="paddle",
                                   tokenizer=trained.tokenizer)
    assert isinstance(trained.backend, FusedBackend) and isinstance(untrained.backend, FusedBackend)
    tok = trained.tokenizer
    wiki = str(shared_data / "wikitext-2" / "wiki.test.raw")
    w_t = evaluate_wikitext(trained, tok, wiki, "raw", seq_len=SEQ, batch_size=32, progress=False)
    w_u = evaluate_wikitext(untrained, tok, wiki, "raw", seq_len=SEQ, batch_size=32, progress=False)
    lam = str(shared_data / "lambada_test.jsonl")
    l_t = evaluate_lambada(trained, tok, lam, seq_len=SEQ, batch_size=64, progress=False)
    l_u = evaluate_lambada(untrained, tok, lam, seq_len=SEQ, batch_size=64, progress=False)
    # The 1,024-token BPE takes ~4.3 characters a token: 1.29 M characters -> > 300,000 tokens,
    # the slice's 314,000 -> > 70,000.
    assert w_t.num_tokenized_tokens > (300_000 if FULL_DATA else 70_000) and l_t.num_examples == LAMBADA_PASSAGES
    # Stated margins: an untrained model is near uniform (ppl ~ vocab 1024); a Shakespeare model
    # trained 200 steps reaches wikitext ppl ~3x lower and LAMBADA target ppl ~3x lower.
    assert w_t.ppl < 0.5 * w_u.ppl, (w_t.ppl, w_u.ppl)
    # LAMBADA's strict accuracy is 0 for both models at this size (a 1024-token Shakespeare BPE
    # rarely spells a LAMBADA target in one word's tokens), so comparing it cannot fail; the
    # target perplexity above is the check that is above chance and fails on a broken model.
    assert l_t.target_ppl < 0.5 * l_u.target_ppl, (l_t.target_ppl, l_u.target_ppl)


def test_cli_eval_writes_result_with_protocol(dirs, shared_data, tmp_path):
    out = tmp_path / "res.json"
    res = subprocess.run([sys.executable, "-m", "gpt_compress", "eval", "--model", dirs["export"], "--backend",
                          "onnx", "--task", "lambada", "--data", str(shared_data / "lambada_test.jsonl"),
                          "--limit", "50", "--output", str(out), "--no-progress"],
                         capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["num_examples"] == 50 and "Lambada_Eval_Dataset" in data["protocol"] and data["backend"] == "onnx"
    assert 0.0 <= data["accuracy"] <= 1.0 and data["target_ppl"] > 1.0


def test_glue_sst2_finetune_beats_chance(dirs, shared_data, tmp_path):
    """A Shakespeare-pretrained tiny GPT finetuned on 16k SST-2 sentences for one epoch."""
    res = subprocess.run(
        [sys.executable, "-m", "gpt_compress", "finetune-glue", "--task", "SST-2",
         "--data-dir", str(shared_data / "glue" / "SST-2"), "--model", dirs["ckpt"], "--epochs", "1",
         "--max-train-examples", "16000", "--max-len", "64", "--no-progress",
         "-o", "Engine.global_batch_size=32", "-o", "Engine.micro_batch_size=32", "-o", "Engine.eval_freq=0",
         "-o", "Engine.save_steps=0", "-o", "Optimizer.lr.max_lr=1e-3", "-o", "Optimizer.lr.min_lr=1e-5",
         "-o", "Optimizer.lr.warmup_rate=0.05", "-o", f"Global.output_dir={tmp_path}"],
        capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    result = json.loads(res.stdout.strip().splitlines()[-1])["results"][0]
    assert result["num_dev"] == 872
    # Above chance (``chance_floor``): the majority class is 444/872 = 0.509, the floor 0.560.
    majority, floor = chance_floor(e.label for e in read_task(str(shared_data / "glue" / "SST-2"), "SST-2", "dev"))
    assert result["metrics"]["accuracy"] > floor, (result, majority, floor)


def _png_size(path):
    """(width, height) of a PNG, read from its IHDR chunk; fails on anything else."""
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR", path
    return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")


def test_report_tables_and_plots_real_results(dirs, wiki_part, shared_data, tmp_path):
    """`gptc eval --output` results of a dense and a pruned model on two backends, through `gptc
    report`: one row per model x backend with both tasks merged, sizes from the weight files,
    and a size-vs-quality PNG."""
    results = []
    for model, backend in ((dirs["ckpt"], "dygraph"), (dirs["export"], "onnx"), (dirs["pruned_export"], "paddle")):
        for task, data, extra in (("wikitext", wiki_part, ["--input-format", "raw"]),
                                  ("lambada", str(shared_data / "lambada_test.jsonl"), ["--limit", "40"])):
            out = tmp_path / f"{os.path.basename(model)}-{backend}-{task}.json"
            res = subprocess.run([sys.executable, "-m", "gpt_compress", "eval", "--model", model, "--backend", backend,
                                  "--task", task, "--data", data, *extra, "--output", str(out), "--no-progress"],
                                 capture_output=True, text=True, cwd=ROOT)
            assert res.returncode == 0, res.stderr[-2000:]
            results.append(json.loads(out.read_text()))
    paths = []
    for i, r in enumerate(results):
        (tmp_path / f"r{i}.json").write_text(json.dumps(r))
        paths.append(str(tmp_path / f"r{i}.json"))
    report_dir = tmp_path / "report"
    res = subprocess.run([sys.executable, "-m", "gpt_compress", "report", "--results", *paths,
                          "--name", f"{dirs['pruned_export']}=pruned", "--output", str(report_dir)],
                         capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    md = (report_dir / "report.md").read_text()
    table = [ln for ln in md.splitlines() if ln.startswith("| ")]
    assert len(table) == 1 + 3, md  # header + one row per model x backend
    rows = json.loads((report_dir / "results.json").read_text())
    by = {(r["name"], r["backend"]): r for r in rows}
    dense, pruned = by[(os.path.basename(dirs["ckpt"]), "dygraph")], by[("pruned", "paddle")]
    for r, src in zip(rows, results[::2]):
        assert r["wikitext_ppl"] == src["ppl"] and r["lambada_acc"] is not None
    # Dense weights: the safetensors file; pruned: fewer parameters in its .pdiparams.
    # The report rounds the file's MiB to 3 places (eval/report.py weight_size_mb): the same value.
    assert dense["size_mb"] == round(os.path.getsize(os.path.join(dirs["ckpt"], "model.safetensors")) / 2**20, 3)
    assert pruned["size_mb"] < by[(os.path.basename(dirs["export"]), "onnx")]["size_mb"]
    assert f"{dense['wikitext_ppl']:.3f}" in md
    w, h = _png_size(report_dir / "size_vs_quality.png")
    assert w > 300 and h > 200 and os.path.getsize(report_dir / "size_vs_quality.png") > 10_000


def test_report_rejects_bad_inputs(tmp_path):
    from gpt_compress.eval.report import load_rows, markdown_table, read_train_log

    bad = tmp_path / "log.jsonl"
    bad.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": \n')
    with pytest.raises(ValueError, match=r"log\.jsonl:2: malformed JSON"):
        read_train_log(str(bad))
    (tmp_path / "r.json").write_text(json.dumps({"task": "wikitext", "ppl": 3.0}))
    with pytest.raises(ValueError, match="without 'model'/'backend'"):
        load_rows([str(tmp_path / "r.json")])
    with pytest.raises(ValueError, match="unknown report column"):
        markdown_table([], ["name", "speed"])
