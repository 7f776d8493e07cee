"""Success paths of CLI commands and flags that no other test runs, each through `gptc` in a
subprocess on the shared tiny model (tests/_export_helpers.py): `infer --truncate / --no-fused`,
`export --no-fused --opset`, `convert --to-hf` then `--from-hf`, `partition` then `infer-tp`,
`eval --with-items / --stride / --batch-size`, and `Engine.mix_precision` on a CPU."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from _export_helpers import ENV, ROOT, model_dirs

CONTEXT = 128  # gpt-tiny's max_position_embeddings (the shared export)


def gptc(*args, ok: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run([sys.executable, "-m", "gpt_compress", *map(str, args)], cwd=ROOT, env=ENV,
                         capture_output=True, text=True, timeout=600)
    if ok:
        assert res.returncode == 0, res.stderr[-3000:]
    return res


def summary(res) -> dict:
    """The JSON summary a command prints last."""
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, shakespeare):
    return model_dirs(tmp_path_factory, shakespeare)


@pytest.fixture(scope="module")
def single(dirs):
    from gpt_compress.inference.runner import Generator

    return Generator.from_dir(dirs["export"], backend="paddle")


def greedy(gen, ids, n):
    return gen.generate([ids], max_new_tokens=n, min_new_tokens=n, decode_strategy="greedy").sequences[0]


def test_infer_truncate_keeps_the_prompts_end_and_no_fused_gives_the_same_tokens(dirs, single):
    """A prompt longer than the context fails without --truncate (one line naming it) and with it
    generates what its last CONTEXT - max_new_tokens tokens generate; --no-fused (the unfused
    Paddle programs) gives the fused program's greedy tokens."""
    n = 8
    long_ids = (np.arange(200) * 7 % single.vocab_size).tolist()
    ids_arg = ",".join(map(str, long_ids))
    common = ["infer", "--model-dir", dirs["export"], "--prompt-ids", ids_arg, "--no-stream",
              "-o", f"Generation.max_new_tokens={n}", "-o", f"Generation.min_new_tokens={n}",
              "-o", "Generation.decode_strategy=greedy"]
    bad = gptc(*common, ok=False)
    assert bad.returncode != 0 and "200 tokens" in bad.stderr and "Traceback" not in bad.stderr
    want = greedy(single, long_ids[-(CONTEXT - n):], n)
    for flags in (["--truncate"], ["--truncate", "--no-fused"]):
        res = summary(gptc(*common, *flags))["results"][0]
        assert res["new_tokens"] == want and res["prompt_tokens"] == CONTEXT - n, flags


def test_export_no_fused_with_opset_writes_that_opset_and_generates_the_same(dirs, single, tmp_path):
    onnx = pytest.importorskip("onnx")
    from gpt_compress.inference.fused import FusedBackend
    from gpt_compress.inference.runner import Generator

    out = tmp_path / "export"
    gptc("export", "--model", dirs["ckpt"], "--output", out, "--no-fused", "--opset", "16")
    models = sorted(p for p in out.rglob("*.onnx"))
    assert models
    for p in models:
        assert {o.version for o in onnx.load(str(p), load_external_data=False).opset_import if o.domain in ("", "ai.onnx")} == {16}, p
    ids = single.encode("ROMEO:")[0]
    want = greedy(single, ids, 12)
    unfused = Generator.from_dir(str(out), backend="paddle")
    assert not isinstance(unfused.backend, FusedBackend)  # nothing fused was written
    assert greedy(unfused, ids, 12) == want
    assert greedy(Generator.from_dir(str(out), backend="onnx"), ids, 12) == want


def test_convert_to_hf_and_back_from_hf_is_exact(dirs, tmp_path):
    from gpt_compress.checkpoint import load_model

    gptc("convert", "--to-hf", dirs["ckpt"], "--output", tmp_path / "hf")
    res = summary(gptc("convert", "--from-hf", tmp_path / "hf", "--output", tmp_path / "back"))
    assert res["output"] == str(tmp_path / "back")
    a, b = load_model(dirs["ckpt"]), load_model(str(tmp_path / "back"))
    assert dataclasses.replace(b.config, name=a.config.name) == a.config  # the import names it "hf-gpt2"
    sa, sb = a.state_dict(), b.state_dict()
    assert sorted(sa) == sorted(sb)
    for k in sa:  # a float32 copy both ways: bitwise the same
        assert np.array_equal(sa[k].numpy(), sb[k].numpy()), k
    assert (tmp_path / "back" / "tokenizer.json").is_file()  # the tokenizer travels with the weights


def test_partition_then_infer_tp_generates_the_single_card_tokens(dirs, single, tmp_path):
    tp = tmp_path / "tp"
    # A bfloat16 cache is the fused rank programs': refused without them, before any rank starts.
    bad = gptc("partition", "--model", dirs["ckpt"], "--output", tp, "--mp-degree", "2", "--no-fused",
               "--kv-cache-dtype", "bfloat16", ok=False)
    assert bad.returncode == 1 and "without --no-fused" in bad.stderr and "Traceback" not in bad.stderr, bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1 and not tp.exists()
    res = summary(gptc("partition", "--model", dirs["ckpt"], "--output", tp, "--mp-degree", "2", "--no-validate",
                       "--log-dir", tmp_path / "plogs"))
    assert res == {"output": str(tp), "mp_degree": 2, "validated": False}
    assert sorted(os.listdir(tmp_path / "plogs"))  # the launcher's per-rank logs are kept there
    ids = single.encode("To be, or not to be")[0]
    out = summary(gptc("infer-tp", "--model-dir", tp, "--prompt", "ROMEO:", "--prompt-ids", ",".join(map(str, ids)),
                       "--log-dir", tmp_path / "ilogs", "-o", "Generation.max_new_tokens=16",
                       "-o", "Generation.decode_strategy=greedy"))
    want = single.generate(["ROMEO:", ids], max_new_tokens=16, decode_strategy="greedy")
    assert out["sequences"] == want.sequences
    assert sorted(os.listdir(tmp_path / "ilogs"))


def test_eval_with_items_stride_and_batch_size(dirs, shared_data, tmp_path):
    from gpt_compress.eval.lambada import evaluate_lambada
    from gpt_compress.eval.wikitext import evaluate_wikitext
    from gpt_compress.inference.runner import Generator

    gen = Generator.from_dir(dirs["export"], backend="onnx")
    lam = summary(gptc("eval", "--model", dirs["export"], "--backend", "onnx", "--task", "lambada", "--data",
                       shared_data / "lambada_test.jsonl", "--limit", "20", "--with-items", "--no-progress"))
    ref_lam = evaluate_lambada(gen, gen.tokenizer, str(shared_data / "lambada_test.jsonl"), seq_len=gen.max_positions,
                               batch_size=8, limit=20, progress=False)  # the command's default batch
    assert lam["correct"] == ref_lam.correct and len(lam["correct"]) == 20  # per-passage 0/1, in file order
    # sum of 0/1 over n both ways (eval/lambada.py): an integer sum, one division, the same float.
    assert lam["accuracy"] == float(np.mean(lam["correct"]))
    wiki = tmp_path / "wiki.raw"
    with open(shared_data / "wikitext-2" / "wiki.test.raw", encoding="utf-8", newline="") as f:
        wiki.write_text("".join(f.readlines()[:60]), encoding="utf-8", newline="")
    res = summary(gptc("eval", "--model", dirs["export"], "--backend", "onnx", "--task", "wikitext", "--data", wiki,
                       "--seq-len", "64", "--stride", "32", "--batch-size", "3", "--no-progress"))
    ref = evaluate_wikitext(gen, gen.tokenizer, str(wiki), "raw", seq_len=64, stride=32, batch_size=5,
                            progress=False)
    # The same windows scored in batches of 3 and of 5: a row's float32 logits may differ by a few
    # ulps (~1e-7 relative) with the batch shape (GEMM blocking); the mean NLL over ~10^3 tokens
    # averages them and exp keeps the relative error: 1e-5 is ~100x that.
    assert res["num_windows"] == ref.num_windows > 1 and res["stride"] == 32
    assert abs(res["ppl"] - ref.ppl) <= 1e-5 * ref.ppl, (res["ppl"], ref.ppl)


def test_mix_precision_on_cpu_warns_and_trains_exactly_float32(shakespeare, tmp_path):
    """Paddle's AMP does nothing on a CPU (docs/PADDLE_CPU.md): Engine.mix_precision=bf16 and
    fp16 say so and train float32, so their losses equal the float32 run's bitwise (the bound is
    0: the same program on the same data); an unknown value is one line naming the key."""
    tok_dir, prefix = shakespeare

    def pretrain(mp, ok=True):
        return gptc("pretrain", "--no-progress", "-o", "Model.preset=gpt-tiny", "-o", "Data.seq_length=64",
                    "-o", f"Data.data_prefix=[{prefix}]", "-o", f"Data.tokenizer_dir={tok_dir}", "-o", "Data.split=[95,5,0]",
                    "-o", f"Global.output_dir={tmp_path / mp}", "-o", "Engine.max_steps=4",
                    "-o", "Engine.global_batch_size=8", "-o", "Engine.micro_batch_size=8", "-o", "Engine.eval_freq=0",
                    "-o", "Engine.eval_iters=2", "-o", "Engine.save_steps=0", "-o", "Engine.logging_freq=0",
                    "-o", f"Engine.mix_precision={mp}", ok=ok)

    fp32 = pretrain("fp32")
    assert "needs a GPU" not in fp32.stderr
    for mp in ("bf16", "fp16"):
        res = pretrain(mp)
        assert f"Engine.mix_precision={mp} needs a GPU" in res.stderr
        assert summary(res)["last_loss"] == summary(fp32)["last_loss"], mp
        assert summary(res)["valid_loss"] == summary(fp32)["valid_loss"], mp
    bad = pretrain("fp8", ok=False)
    assert bad.returncode != 0 and "Engine.mix_precision" in bad.stderr and "Traceback" not in bad.stderr
