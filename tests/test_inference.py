"""The runner API: Generator over dygraph / Paddle Inference / onnxruntime, streaming, scoring,
bad input, threads, a fresh serving process without the training stack, `gptc infer`."""
import json
import subprocess
import sys
import threading

import numpy as np
import pytest

from _export_helpers import ENV, LOGIT_ATOL, ROOT, model_dirs
from gpt_compress.inference.manifest import InputError
from gpt_compress.inference.runner import Generator

BACKENDS = ("dygraph", "paddle", "onnx")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, shakespeare):
    return model_dirs(tmp_path_factory, shakespeare)


@pytest.fixture(scope="module")
def gens(dirs):
    return {b: Generator.from_dir(dirs["ckpt"] if b == "dygraph" else dirs["export"], backend=b) for b in BACKENDS}


def test_string_prompts_sampling_and_penalties_agree_across_backends(gens):
    kw = dict(max_new_tokens=20, decode_strategy="sampling", top_k=20, top_p=0.9, temperature=0.8,
              repetition_penalty=1.3, seed=7)
    outs = {b: g.generate(["KING HENRY:", "O Romeo,"], **kw) for b, g in gens.items()}
    for b in ("paddle", "onnx"):
        assert outs[b].sequences == outs["dygraph"].sequences, b
        assert outs[b].texts == outs["dygraph"].texts
    assert all(len(s) == 20 for s in outs["dygraph"].sequences)
    # Prompt lengths are reported as encoded (no timing is checked here: speed lives in bench/).
    assert outs["paddle"].prompt_tokens == [len(p) for p in gens["paddle"].encode(["KING HENRY:", "O Romeo,"])] \
        and min(outs["paddle"].prompt_tokens) > 0


@pytest.mark.parametrize("backend", ["paddle", "onnx"])
def test_streaming_iterator_callback_and_text(gens, backend):
    g = gens[backend]
    full = g.generate("ROMEO:", max_new_tokens=16)
    steps = [int(s[0]) for s in g.stream("ROMEO:", max_new_tokens=16)]
    assert steps == full.sequences[0]
    seen = []
    g.generate("ROMEO:", max_new_tokens=16, on_tokens=lambda s: seen.append(int(s[0])))
    assert seen == full.sequences[0]
    assert "".join(g.stream_text("ROMEO:", max_new_tokens=16)) == full.texts[0]
    # An abandoned stream releases the lock when closed.
    it = g.stream("ROMEO:", max_new_tokens=16)
    next(it)
    it.close()
    assert g.generate("ROMEO:", max_new_tokens=2).sequences[0] == full.sequences[0][:2]


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_input_is_rejected_clearly(gens, backend):
    g = gens[backend]
    with pytest.raises(InputError, match="prompt 1 is empty"):
        g.generate([[5, 6], []], max_new_tokens=4)
    with pytest.raises(InputError, match="prompt 0 is empty"):
        g.generate("", max_new_tokens=4)
    with pytest.raises(InputError, match=r"outside the vocabulary \[0, 1024\): \[5000\]"):
        g.generate([[1, 5000, 2]], max_new_tokens=4)
    with pytest.raises(InputError, match="at most 120 fit the context of 128"):
        g.generate([list(range(1, 126))], max_new_tokens=8)
    with pytest.raises(InputError, match="beam search does not stream"):
        g.stream([[1, 2]], decode_strategy="beam_search")
    with pytest.raises(TypeError, match="unknown sampling option.*topk"):
        g.generate([[1, 2]], topk=3)
    with pytest.raises(InputError, match="outside the vocabulary"):
        g.score(np.array([[1, 2048]]))
    # Truncation keeps the end of the prompt, exactly as if the user had cut it.
    long = [int(x) for x in np.random.default_rng(0).integers(1, 1000, 125)]
    cut = g.generate([long], max_new_tokens=8, truncate=True)
    assert cut.prompt_tokens == [120]
    assert cut.sequences == g.generate([long[-120:]], max_new_tokens=8).sequences


def test_score_matches_across_backends_with_left_padding(gens):
    tok = gens["dygraph"].tokenizer
    rows = [tok.encode(t) for t in ("Now is the winter of our discontent", "Friends,")]
    width = max(map(len, rows))
    ids = np.zeros((2, width), np.int64)
    mask = np.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r):], mask[i, width - len(r):] = r, 1
    ref = gens["dygraph"].score(ids, mask)
    for b in ("paddle", "onnx"):
        assert np.max(np.abs(gens[b].score(ids, mask) - ref)[mask > 0]) < LOGIT_ATOL


@pytest.mark.parametrize("backend", ["paddle", "onnx"])
def test_concurrent_calls_are_serialised_and_correct(gens, backend):
    g = gens[backend]
    prompts = [[3, 4, 5], [10, 11], [100, 200, 300, 400], [7]]
    expected = [g.generate([p], max_new_tokens=10).sequences[0] for p in prompts]
    results, errors = {}, []

    def work(i):
        try:
            results[i] = g.generate([prompts[i % 4]], max_new_tokens=10).sequences[0]
            g.score(np.array([prompts[i % 4]]))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert all(results[i] == expected[i % 4] for i in range(8))


def test_paddle_backend_clone_shares_weights_and_runs(gens):
    from gpt_compress.inference.fused import FusedBackend
    from gpt_compress.inference.predictor import PaddleBackend

    b = gens["paddle"].backend
    assert isinstance(b, (FusedBackend, PaddleBackend))
    twin = Generator(b.clone(), vocab_size=1024, max_positions=128, eos_token_id=None, pad_token_id=0)
    assert twin.generate([[1, 2, 3]], max_new_tokens=5).sequences == \
        gens["paddle"].generate([[1, 2, 3]], max_new_tokens=5).sequences


SERVE = r"""
import json, sys
from gpt_compress.inference.runner import Generator
out = {}
for backend in ("paddle", "onnx"):
    g = Generator.from_dir(sys.argv[1], backend=backend)
    out[backend] = g.generate(["ROMEO:", "To be"], max_new_tokens=12).sequences
    out[backend + "_beam"] = g.generate(["ROMEO:"], max_new_tokens=6, decode_strategy="beam_search").sequences
forbidden = [m for m in sys.modules if m.startswith(("gpt_compress.train", "gpt_compress.model.gpt",
             "gpt_compress.data.dataset", "gpt_compress.export", "gpt_compress.checkpoint"))]
out["forbidden"] = forbidden
out["torch"] = "torch" in sys.modules
print(json.dumps(out))
"""


def test_exported_dir_serves_in_a_fresh_process_without_training_code(dirs, gens, tmp_path):
    # A copy in a fresh place: the directory must be self-contained.
    import shutil

    served = shutil.copytree(dirs["export"], tmp_path / "served")
    proc = subprocess.run([sys.executable, "-c", SERVE, str(served)], env=ENV, cwd=str(tmp_path),
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["forbidden"] == [] and not out["torch"]
    ref = gens["dygraph"].generate(["ROMEO:", "To be"], max_new_tokens=12).sequences
    ref_beam = gens["dygraph"].generate(["ROMEO:"], max_new_tokens=6, decode_strategy="beam_search").sequences
    for b in ("paddle", "onnx"):
        assert out[b] == ref and out[b + "_beam"] == ref_beam


def _infer(*args):
    return subprocess.run([sys.executable, "-m", "gpt_compress", "infer", *args], env=ENV, cwd=ROOT,
                          capture_output=True, text=True)


def test_cli_infer(dirs, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "ROMEO:"}\n{"prompt": "JULIET:"}\n')
    proc = _infer("--model-dir", dirs["export"], "--backend", "onnx", "--input-file", str(prompts),
                  "-o", "Generation.max_new_tokens=8")
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    # tokens_per_s is reported, not timed here (speed lives in bench/)
    assert summary["backend"] == "onnx" and summary["new_tokens"] == 16 and "tokens_per_s" in summary
    assert [r["prompt_tokens"] > 0 for r in summary["results"]] == [True, True]
    # Streaming a single prompt, Paddle backend, beam search via -o.
    proc = _infer("--model-dir", dirs["export"], "--prompt", "ROMEO:", "-o", "Generation.max_new_tokens=8")
    assert proc.returncode == 0 and proc.stdout.startswith("ROMEO:"), proc.stderr[-2000:]
    proc = _infer("--model-dir", dirs["export"], "--prompt-ids", "1,2,3", "-o", "Generation.max_new_tokens=4",
                  "-o", "Generation.decode_strategy=beam_search")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "score" in json.loads(proc.stdout.strip().splitlines()[-1])["results"][0]
    # Errors: an unknown token id, a training checkpoint given to the paddle backend.
    proc = _infer("--model-dir", dirs["export"], "--prompt-ids", "1,99999")
    assert proc.returncode == 1 and "outside the vocabulary" in proc.stderr
    proc = _infer("--model-dir", dirs["ckpt"], "--prompt", "x")
    assert proc.returncode == 1 and "manifest.json not found" in proc.stderr and "gptc export" in proc.stderr


@pytest.mark.gpu
def test_paddle_gpu_backend_matches_cpu(dirs):
    from gpt_compress.inference.predictor import gpu_available

    if not gpu_available():
        pytest.skip("no GPU: the GPU path of the Paddle Inference runner is unverifiable here")
    cpu = Generator.from_dir(dirs["export"], backend="paddle")
    gpu = Generator.from_dir(dirs["export"], backend="paddle", device="gpu")
    assert gpu.generate(["ROMEO:"], max_new_tokens=16).sequences == cpu.generate(["ROMEO:"], max_new_tokens=16).sequences


def test_min_new_tokens_with_an_eos_outside_the_vocabulary(gens):
    # gpt-tiny keeps GPT-2's eos id 50256 with a 1024-token vocabulary: never producible.
    assert gens["onnx"].eos_token_id == 50256
    out = gens["onnx"].generate([[1, 2, 3]], max_new_tokens=5, min_new_tokens=5)
    assert len(out.sequences[0]) == 5


@pytest.mark.parametrize("backend", ["paddle", "onnx"])
@pytest.mark.parametrize("batch", [1, 4])
def test_repeated_generations_on_one_backend_are_identical(dirs, gens, backend, batch):
    """Regression: Paddle's run(list) returns tensors aliasing the predictor's variables; a
    second generation once overwrote its own cache and diverged from the 4th token on."""
    g = Generator.from_dir(dirs["export"], backend=backend)
    prompts = [[3, 4, 5], [10, 11], [100, 200, 300, 400], [7]][:batch]
    ref = gens["dygraph"].generate(prompts, max_new_tokens=12).sequences
    assert [g.generate(prompts, max_new_tokens=12).sequences for _ in range(3)] == [ref] * 3
