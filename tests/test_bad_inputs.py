"""Malformed and hostile inputs, one table across every command.

Each case runs ``gptc`` in-process (``cli.main``) in a workspace of tiny fixtures built once
(gpt-tiny checkpoints, a tokenizer, an export, a dataset, forged Hugging Face directories) and
asserts: a non-zero exit, exactly one stderr line ``gptc <command>: ...error: ...`` naming the
input and the problem, no traceback, and no change to any file or directory of the workspace
(its tree is snapshotted before and after). A few subprocess runs check what only a real
process shows (the traceback-free stderr, Ctrl-C).
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import numpy as np
import pytest

from gpt_compress.cli import main

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
CORPUS = ROOT.parent / "shared" / "data" / "corpus" / "tinyshakespeare.txt"


def gptc(*argv: str) -> tuple[int, str, str]:
    """Run `gptc argv` in this process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    code = 0
    old = os.environ.get("GPTC_TUNE_CPU")
    os.environ["GPTC_TUNE_CPU"] = "0"  # runtime.tune_cpu changes process-wide settings later tests see
    with redirect_stdout(out), redirect_stderr(err):
        try:
            main([str(a) for a in argv])
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        finally:
            if old is None:
                del os.environ["GPTC_TUNE_CPU"]
            else:
                os.environ["GPTC_TUNE_CPU"] = old
    return code, out.getvalue(), err.getvalue()


def ok(*argv: str) -> str:
    code, out, err = gptc(*argv)
    assert code == 0, f"gptc {' '.join(map(str, argv))} failed ({code}): {err[-2000:]}"
    return out


def snapshot(root: Path) -> dict[str, str]:
    """Every path under ``root`` -> "dir", or the sha256 and mode of the file."""
    snap = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            snap[os.path.relpath(os.path.join(dirpath, d), root)] = "dir"
        for f in filenames:
            fp = os.path.join(dirpath, f)
            if os.path.islink(fp):
                snap[os.path.relpath(fp, root)] = "link:" + os.readlink(fp)
                continue
            with open(fp, "rb") as fh:
                digest = hashlib.sha256(fh.read()).hexdigest()
            snap[os.path.relpath(fp, root)] = f"{digest} {os.stat(fp).st_mode:o}"
    return snap


# --------------------------------------------------------------------------------------
# Forged PyTorch files: a pickle written opcode by opcode through the pure-Python pickler, so
# the test needs no torch and can claim any size/stride/offset.
# --------------------------------------------------------------------------------------
def _global(module: str, name: str):
    return type(name, (), {"__module__": module, "_gptc_global": (module, name)})


class _Pickler(pickle._Pickler):  # noqa: SLF001  (pure-Python pickler: save_global is overridable)
    def __init__(self, fh, storages):
        super().__init__(fh, protocol=2)
        self._storages = storages

    def save_global(self, obj, name=None):
        ref = getattr(obj, "_gptc_global", None)
        if ref is None:
            return super().save_global(obj, name)
        self.write(pickle.GLOBAL + f"{ref[0]}\n{ref[1]}\n".encode())
        self.memoize(obj)

    def persistent_id(self, obj):
        return self._storages.get(id(obj))


class _Storage:
    def __init__(self, key: str, numel: int, kind: str = "FloatStorage"):
        self.pid = ("storage", _global("torch", kind), key, "cpu", numel)


class _Tensor:
    def __init__(self, storage, offset, size, stride):
        self.args = (storage, offset, tuple(size), tuple(stride), False, _OrderedDict())

    def __reduce__(self):
        return _global("torch._utils", "_rebuild_tensor_v2"), self.args


class _OrderedDict:
    def __reduce__(self):
        return _global("collections", "OrderedDict"), ()


class _Evil:
    def __reduce__(self):
        return _global("os", "system"), ("echo pwned",)


def write_torch_bin(path: Path, tensors: dict, records: dict[str, bytes]) -> None:
    """``tensors``: name -> _Tensor (or any object); ``records``: storage key -> raw bytes."""
    storages = {}
    for t in tensors.values():
        if isinstance(t, _Tensor):
            storages[id(t.args[0])] = t.args[0].pid
    buf = io.BytesIO()
    _Pickler(buf, storages).dump(dict(tensors))
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("archive/data.pkl", buf.getvalue())
        for key, raw in records.items():
            zf.writestr(f"archive/data/{key}", raw)


def forge_hf_dir(ws: Path, name: str, tensors: dict, records: dict) -> Path:
    d = ws / name
    d.mkdir()
    shutil.copyfile(ws / "hf" / "config.json", d / "config.json")
    write_torch_bin(d / "pytorch_model.bin", tensors, records)
    return d


# --------------------------------------------------------------------------------------
# The workspace
# --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Path:
    ws = tmp_path_factory.mktemp("bad_inputs")
    text = CORPUS.read_text(encoding="utf-8")[:30000] if CORPUS.is_file() else "the quick brown fox.\n\n" * 500
    (ws / "small.txt").write_text(text, encoding="utf-8")
    ok("train-tokenizer", "--input", ws / "small.txt", "--vocab-size", "300", "--output-dir", ws / "tok")
    tiny = ["-o", "Model.preset=gpt-tiny", "-o", f"Data.tokenizer_dir={ws / 'tok'}"]
    ok("init", *tiny, "--output", ws / "ckpt")
    ok("init", *tiny, "--head", "cls", "--output", ws / "cls")
    ok("init", "-o", "Model.preset=gpt-tiny", "--output", ws / "notok")
    ok("export", "--model", ws / "ckpt", "--output", ws / "export", "--format", "paddle", "--no-validate")
    ok("convert", "--to-hf", ws / "ckpt", "--output", ws / "hf")
    paragraphs = [p.strip() for p in text.split("\n\n") if p.strip()]
    (ws / "austen.jsonl").write_text("".join(json.dumps({"text": p}) + "\n" for p in paragraphs), encoding="utf-8")
    ok("preprocess", "--input", ws / "austen.jsonl", "--output-prefix", ws / "data" / "corpus",
       "--tokenizer-dir", ws / "tok")
    (ws / "notes").mkdir()
    (ws / "notes" / "notes.txt").write_text("precious\n")
    (ws / "bin.dat").write_bytes(bytes(range(256)) * 64)
    (ws / "empty.txt").write_text("")
    (ws / "bad.yaml").write_text("Model: [unclosed\n")
    (ws / "bad_prompts.jsonl").write_text('{"prompt": "ok"}\n{"prompt": 3}\n')
    (ws / "bad_results.json").write_text("{not json")
    (ws / "lambada_bad.jsonl").write_text('{"txt": "no text key"}\n')
    (ws / "wiki.txt").write_text(text[:5000])
    (ws / "glue" / "SST-2").mkdir(parents=True)
    (ws / "glue" / "SST-2" / "train.tsv").write_text("sentence\tlabel\nfine movie\tmaybe\n")
    # An export whose manifest.json is another model's (gpt-test sized), checksums left as they were.
    shutil.copytree(ws / "export", ws / "swapped")
    man = json.loads((ws / "swapped" / "manifest.json").read_text())
    man["vocab_size"], man["max_position_embeddings"] = 4096, 256
    (ws / "swapped" / "manifest.json").write_text(json.dumps(man))
    # Hugging Face directories: a shape mismatch, a truncated safetensors, forged pickles.
    shutil.copytree(ws / "hf", ws / "hf_shape")
    cfg = json.loads((ws / "hf_shape" / "config.json").read_text())
    cfg["n_embd"] = 96
    (ws / "hf_shape" / "config.json").write_text(json.dumps(cfg))
    shutil.copytree(ws / "hf", ws / "hf_trunc")
    with open(ws / "hf_trunc" / "model.safetensors", "r+b") as f:
        f.truncate(5000)
    four = np.arange(4, dtype=np.float32).tobytes()
    s = _Storage("0", 4)
    forge_hf_dir(ws, "hf_oob", {"transformer.wpe.weight": _Tensor(s, 0, (128, 64), (64, 1))}, {"0": four})
    s = _Storage("0", 4)
    forge_hf_dir(ws, "hf_offset", {"transformer.wpe.weight": _Tensor(s, 3, (2,), (1,))}, {"0": four})
    s = _Storage("0", 1 << 20)
    forge_hf_dir(ws, "hf_record", {"transformer.wpe.weight": _Tensor(s, 0, (4,), (1,))}, {"0": four})
    s = _Storage("0", 4)
    forge_hf_dir(ws, "hf_stride", {"transformer.wpe.weight": _Tensor(s, 0, (2, 2), (-1, 1))}, {"0": four})
    forge_hf_dir(ws, "hf_evil", {"x": _Evil()}, {})
    (ws / "hf_legacy").mkdir()
    shutil.copyfile(ws / "hf" / "config.json", ws / "hf_legacy" / "config.json")
    (ws / "hf_legacy" / "pytorch_model.bin").write_bytes(b"\x80\x02}q\x00.")
    return ws


# (id, argv; "{ws}" is the workspace, needle: a regex the one error line must match)
CASES = [
    # data loss: --output never replaces a file, a foreign directory or the current directory
    ("export-into-foreign-dir", "export --model {ws}/ckpt --output {ws}/notes", r"notes is a non-empty directory"),
    ("export-over-data-file", "export --model {ws}/ckpt --output {ws}/austen.jsonl", r"austen.jsonl is an existing file"),
    ("export-over-own-no-overwrite", "export --model {ws}/ckpt --output {ws}/export", r"export already holds .*--overwrite"),
    ("export-overwrite-foreign", "export --model {ws}/ckpt --output {ws}/notes --overwrite", r"notes is a non-empty directory"),
    ("export-onto-input", "export --model {ws}/ckpt --output {ws}/ckpt", r"is the input"),
    ("export-cls-model", "export --model {ws}/cls --output {ws}/new_export", r"cls.*only language models"),
    ("export-missing-model", "export --model {ws}/nope --output {ws}/new_export", r"nope"),
    ("convert-to-hf-cwd", "convert --to-hf {ws}/ckpt --output .", r"current directory"),
    ("convert-to-hf-foreign", "convert --to-hf {ws}/ckpt --output {ws}/notes", r"notes is a non-empty directory"),
    ("convert-from-hf-over-file", "convert --from-hf {ws}/hf --output {ws}/austen.jsonl", r"austen.jsonl is an existing file"),
    ("convert-over-own-no-overwrite", "convert --from-hf {ws}/hf --output {ws}/ckpt", r"ckpt already holds .*--overwrite"),
    ("prune-into-foreign-dir", "prune --model {ws}/ckpt --output {ws}/notes", r"notes is a non-empty directory"),
    ("prune-over-file", "prune --model {ws}/ckpt --output {ws}/small.txt", r"small.txt is an existing file"),
    ("partition-into-foreign-dir", "partition --model {ws}/ckpt --output {ws}/notes --mp-degree 2", r"notes is a non-empty"),
    ("init-over-file", "init -o Model.preset=gpt-tiny --output {ws}/small.txt", r"small.txt is an existing file"),
    # finetune and serve
    ("finetune-missing-model", "finetune --model {ws}/nope -o Finetune.train_file={ws}/austen.jsonl -o Global.output_dir={ws}/ft",
     r"model directory not found: .*nope"),
    ("finetune-no-train-file", "finetune --model {ws}/ckpt -o Global.output_dir={ws}/ft", r"Finetune.train_file is empty"),
    ("finetune-bad-batching", "finetune --model {ws}/ckpt -o Finetune.batching=zip", r"Finetune.batching must be pack or group"),
    ("serve-missing-dir", "serve --model-dir {ws}/nope", r"model directory not found: .*nope"),
    ("serve-checkpoint-not-export", "serve --model-dir {ws}/ckpt", r"ckpt is not an exported gpt-compress model"),
    ("serve-port-out-of-range", "serve --model-dir {ws}/export --port 70000", r"Serve.port must be in \[0, 65535\], got 70000"),
    ("serve-zero-batch", "serve --model-dir {ws}/export --max-batch 0", r"Serve.max_batch must be >= 1, got 0"),
    # forged / corrupt model files
    ("hf-bin-out-of-bounds", "convert --from-hf {ws}/hf_oob --output {ws}/new_ckpt", r"pytorch_model.bin.*storage holds 4"),
    ("hf-bin-offset-past-end", "convert --from-hf {ws}/hf_offset --output {ws}/new_ckpt", r"pytorch_model.bin.*reaches element 4"),
    ("hf-bin-record-size", "convert --from-hf {ws}/hf_record --output {ws}/new_ckpt", r"pytorch_model.bin.*holds 16 bytes"),
    ("hf-bin-negative-stride", "convert --from-hf {ws}/hf_stride --output {ws}/new_ckpt", r"pytorch_model.bin.*negative"),
    ("hf-bin-code-execution", "convert --from-hf {ws}/hf_evil --output {ws}/new_ckpt", r"refusing to unpickle os.system"),
    ("hf-bin-legacy", "convert --from-hf {ws}/hf_legacy --output {ws}/new_ckpt", r"pytorch_model.bin is a legacy"),
    ("hf-shape-mismatch", "convert --from-hf {ws}/hf_shape --output {ws}/new_ckpt", r"hf_shape"),
    ("hf-truncated-safetensors", "convert --from-hf {ws}/hf_trunc --output {ws}/new_ckpt", r"model.safetensors is not a readable"),
    ("hf-missing-dir", "convert --from-hf {ws}/nope --output {ws}/new_ckpt", r"not found: .*nope"),
    ("infer-swapped-manifest", "infer --model-dir {ws}/swapped --prompt-ids 1,2", r"manifest.json is corrupt"),
    ("infer-on-checkpoint", "infer --model-dir {ws}/ckpt --prompt-ids 1,2", r"ckpt.*training checkpoint"),
    ("infer-missing-dir", "infer --model-dir {ws}/nope --prompt-ids 1,2", r"nope"),
    ("infer-bad-prompt-ids", "infer --model-dir {ws}/export --prompt-ids 1,abc", r"'abc' is not an integer"),
    ("infer-ids-out-of-vocab", "infer --model-dir {ws}/export --prompt-ids 5000", r"outside the vocabulary"),
    ("infer-beams-60000", "infer --model-dir {ws}/export --prompt-ids 1,2 -o Generation.decode_strategy=beam_search "
                          "-o Generation.num_beams=60000", r"num_beams=60000"),
    # generate: every setting a user can get wrong
    ("generate-bad-prompt-ids", "generate --model {ws}/ckpt --prompt-ids 1,abc", r"--prompt-ids '1,abc': 'abc'"),
    ("generate-max-new-0", "generate --model {ws}/ckpt --prompt-ids 1 -o Generation.max_new_tokens=0", r"Generation.max_new_tokens"),
    ("generate-max-new-neg", "generate --model {ws}/ckpt --prompt-ids 1 -o Generation.max_new_tokens=-3", r"Generation.max_new_tokens"),
    ("generate-temperature-0", "generate --model {ws}/ckpt --prompt-ids 1 -o Generation.decode_strategy=sampling "
                               "-o Generation.temperature=0", r"Generation.temperature"),
    ("generate-beams-0", "generate --model {ws}/ckpt --prompt-ids 1 -o Generation.decode_strategy=beam_search "
                         "-o Generation.num_beams=0", r"Generation.num_beams"),
    ("generate-beams-60000", "generate --model {ws}/ckpt --prompt-ids 1 -o Generation.decode_strategy=beam_search "
                             "-o Generation.num_beams=60000", r"num_beams=60000 exceeds the model's vocabulary"),
    ("generate-repetition-0", "generate --model {ws}/ckpt --prompt-ids 1 -o Generation.repetition_penalty=0",
     r"Generation.repetition_penalty"),
    ("generate-top-p-1.5", "generate --model {ws}/ckpt --prompt-ids 1 -o Generation.top_p=1.5", r"Generation.top_p"),
    ("generate-top-p-0", "generate --model {ws}/ckpt --prompt-ids 1 -o Generation.top_p=0", r"Generation.top_p"),
    ("generate-top-k-neg", "generate --model {ws}/ckpt --prompt-ids 1 -o Generation.top_k=-5", r"Generation.top_k"),
    ("generate-min-gt-max", "generate --model {ws}/ckpt --prompt-ids 1 -o Generation.min_new_tokens=99", r"Generation.min_new_tokens"),
    ("generate-strategy-typo", "generate --model {ws}/ckpt --prompt-ids 1 -o Generation.decode_strategy=beam",
     r"Generation.decode_strategy"),
    ("generate-bad-jsonl", "generate --model {ws}/ckpt --input-file {ws}/bad_prompts.jsonl", r"bad_prompts.jsonl:2"),
    ("generate-missing-jsonl", "generate --model {ws}/ckpt --input-file {ws}/nope.jsonl", r"nope.jsonl"),
    ("generate-binary-jsonl", "generate --model {ws}/ckpt --input-file {ws}/bin.dat", r"bin.dat"),
    ("generate-cls-model", "generate --model {ws}/cls --prompt-ids 1,2", r"cls holds a sequence classifier"),
    ("generate-missing-model", "generate --model {ws}/nope --prompt-ids 1", r"nope"),
    ("generate-ids-out-of-vocab", "generate --model {ws}/ckpt --prompt-ids 1,99999", r"token ids must be in"),
    ("generate-too-long", "generate --model {ws}/ckpt --prompt-ids 1 -o Generation.max_new_tokens=1000", r"context of 128"),
    ("generate-text-no-tokenizer", "generate --model {ws}/notok --prompt hello", r"notok has no tokenizer"),
    ("generate-no-prompt", "generate --model {ws}/ckpt", r"give --prompt"),
    # eval
    ("eval-stride-over-context", "eval --model {ws}/ckpt --task wikitext --data {ws}/wiki.txt --stride 512", r"stride 512"),
    ("eval-seq-len-over-context", "eval --model {ws}/ckpt --task wikitext --data {ws}/wiki.txt --seq-len 1024", r"seq-len 1024"),
    ("eval-onnx-on-checkpoint", "eval --model {ws}/ckpt --backend onnx --task wikitext --data {ws}/wiki.txt", r"ckpt"),
    ("eval-missing-data", "eval --model {ws}/ckpt --task wikitext --data {ws}/nope.txt", r"nope.txt"),
    ("eval-bad-lambada", "eval --model {ws}/ckpt --task lambada --data {ws}/lambada_bad.jsonl", r"lambada_bad.jsonl:1"),
    ("eval-missing-model", "eval --model {ws}/nope --task wikitext --data {ws}/wiki.txt", r"nope"),
    ("eval-batch-size-0", "eval --model {ws}/ckpt --task wikitext --data {ws}/wiki.txt --batch-size 0", r"--batch-size"),
    ("eval-binary-data", "eval --model {ws}/ckpt --task wikitext --data {ws}/bin.dat", r"bin.dat"),
    # config files and overrides
    ("init-unknown-preset", "init -o Model.preset=gpt-nope --output {ws}/new_ckpt", r"gpt-nope"),
    ("init-override-section-typo", "init -o Modle.preset=gpt-tiny --output {ws}/new_ckpt", r"-o Modle.preset=gpt-tiny"),
    ("init-override-key-typo", "init -o Model.hidden_sise=64 --output {ws}/new_ckpt", r"-o Model.hidden_sise=64"),
    ("init-override-bad-type", "init -o Model.num_layers=two --output {ws}/new_ckpt", r"Model.num_layers"),
    ("init-override-no-equals", "init -o Model.num_layers --output {ws}/new_ckpt", r"Model.num_layers"),
    ("init-missing-config", "init -c {ws}/nope.yaml --output {ws}/new_ckpt", r"nope.yaml"),
    ("init-bad-yaml", "init -c {ws}/bad.yaml --output {ws}/new_ckpt", r"bad.yaml is not valid YAML"),
    # training settings
    ("pretrain-micro-batch-0", "pretrain -o Engine.micro_batch_size=0 -o Data.data_prefix={ws}/data/corpus_text_document "
                               "-o Global.output_dir={ws}/run", r"Engine.micro_batch_size"),
    ("pretrain-max-lr-neg", "pretrain -o Optimizer.lr.max_lr=-1 -o Data.data_prefix={ws}/data/corpus_text_document "
                            "-o Global.output_dir={ws}/run", r"max_lr"),
    ("pretrain-max-steps-0", "pretrain -o Engine.max_steps=0 -o Data.data_prefix={ws}/data/corpus_text_document "
                             "-o Global.output_dir={ws}/run", r"Engine.max_steps"),
    ("pretrain-max-steps-neg", "pretrain -o Engine.max_steps=-5 -o Data.data_prefix={ws}/data/corpus_text_document "
                               "-o Global.output_dir={ws}/run", r"Engine.max_steps"),
    ("pretrain-batch-not-multiple", "pretrain -o Engine.global_batch_size=6 -o Engine.micro_batch_size=4 "
                                    "-o Data.data_prefix={ws}/data/corpus_text_document", r"global_batch_size 6"),
    ("pretrain-missing-data", "pretrain -o Model.preset=gpt-tiny -o Data.seq_length=64 -o Data.data_prefix={ws}/nope "
                              "-o Global.output_dir={ws}/run", r"nope"),
    ("pretrain-no-data", "pretrain -o Model.preset=gpt-tiny", r"Data.data_prefix is empty"),
    ("pretrain-seq-over-context", "pretrain -o Model.preset=gpt-tiny -o Data.seq_length=512 "
                                  "-o Data.data_prefix={ws}/data/corpus_text_document -o Global.output_dir={ws}/run",
     r"seq_length 512"),
    ("pretrain-split-negative", "pretrain -o Data.split=[1,-1,0] -o Data.data_prefix={ws}/data/corpus_text_document",
     r"Data.split"),
    ("finetune-missing-model", "finetune-glue --task SST-2 --data-dir {ws}/glue --model {ws}/does/not/exist",
     r"does/not/exist.*not found"),
    ("finetune-bad-label", "finetune-glue --task SST-2 --data-dir {ws}/glue/SST-2 --model {ws}/ckpt "
                           "-o Global.output_dir={ws}/run", r"train.tsv:2"),
    ("distill-no-teacher", "distill -o Data.data_prefix={ws}/data/corpus_text_document", r"Distill"),
    ("prune-bad-ratio", "prune --model {ws}/ckpt --output {ws}/new_ckpt -o Prune.head_ratio=1.5", r"Prune.head_ratio"),
    ("qat-missing-model", "qat --model {ws}/nope -o Global.output_dir={ws}/run", r"nope"),
    ("ptq-missing-model", "ptq --model {ws}/nope -o Global.output_dir={ws}/run", r"nope"),
    # data tools
    ("train-tokenizer-empty", "train-tokenizer --input {ws}/empty.txt --vocab-size 300 --output-dir {ws}/newtok",
     r"empty.txt is empty"),
    ("train-tokenizer-binary", "train-tokenizer --input {ws}/bin.dat --vocab-size 300 --output-dir {ws}/newtok",
     r"bin.dat is not UTF-8 text"),
    ("train-tokenizer-missing", "train-tokenizer --input {ws}/nope.txt --vocab-size 300 --output-dir {ws}/newtok", r"nope.txt"),
    ("train-tokenizer-vocab-tiny", "train-tokenizer --input {ws}/small.txt --vocab-size 5 --output-dir {ws}/newtok",
     r"--vocab-size 5"),
    ("train-tokenizer-over-file", "train-tokenizer --input {ws}/small.txt --vocab-size 300 --output-dir {ws}/small.txt",
     r"small.txt"),
    ("preprocess-missing-input", "preprocess --input {ws}/nope.jsonl --output-prefix {ws}/newdata/x --tokenizer-dir {ws}/tok",
     r"nope.jsonl"),
    ("preprocess-workers-0", "preprocess --input {ws}/austen.jsonl --output-prefix {ws}/newdata/x --tokenizer-dir {ws}/tok "
                             "--workers 0", r"--workers"),
    ("preprocess-binary", "preprocess --input {ws}/bin.dat --output-prefix {ws}/newdata/x --tokenizer-dir {ws}/tok", r"bin.dat"),
    ("preprocess-missing-tokenizer", "preprocess --input {ws}/austen.jsonl --output-prefix {ws}/newdata/x "
                                     "--tokenizer-dir {ws}/nope", r"nope"),
    ("report-bad-json", "report --results {ws}/bad_results.json --output {ws}/newreport", r"bad_results.json"),
    ("report-missing-json", "report --results {ws}/nope.json --output {ws}/newreport", r"nope.json"),
    ("report-output-is-file", "report --results {ws}/bad_results.json --output {ws}/small.txt", r"small.txt"),
    ("pipeline-no-corpus", "pipeline -o Pipeline.corpus=[] -o Global.output_dir={ws}/run", r"Pipeline.corpus"),
    ("pipeline-unknown-stage", "pipeline -o Pipeline.corpus=[{ws}/austen.jsonl] -o Global.output_dir={ws}/run "
                               "--stage nope", r"'nope'"),
]


def _argv(template: str, ws: Path) -> list[str]:
    return [a.replace("{ws}", str(ws)) for a in template.split()]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_refused_cleanly(ws, case, monkeypatch):
    name, template, needle = case
    monkeypatch.chdir(ws)
    before = snapshot(ws)
    argv = _argv(template, ws)
    code, _, err = gptc(*argv)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code != 0, f"{name}: exit 0; stderr: {err[-1000:]}"
    assert "Traceback" not in err, err
    assert len(lines) == 1, f"{name}: expected one stderr line, got:\n{err[-3000:]}"
    assert lines[0].startswith(f"gptc {argv[0]}: ") and "error" in lines[0], lines[0]
    assert re.search(needle, lines[0]), f"{name}: {needle!r} not in {lines[0]!r}"
    assert snapshot(ws) == before, f"{name} changed the workspace"


def test_table_covers_every_command():
    from gpt_compress.cli import COMMANDS

    tried = {c[1].split()[0] for c in CASES}
    # demo runs an embedded default (no user input to get wrong); infer-tp needs a partition.
    assert set(COMMANDS) - tried <= {"demo", "infer-tp", "quant-sensitivity"}, set(COMMANDS) - tried
    assert len(CASES) >= 60


# --------------------------------------------------------------------------------------
# The output guard, file modes, stale temporary directories
# --------------------------------------------------------------------------------------
def test_overwrite_replaces_only_our_own_output(ws, tmp_path):
    out = tmp_path / "ckpt"
    args = ("init", "-o", "Model.preset=gpt-tiny", "-o", "Global.seed=3", "--output", out)
    ok(*args)
    old = (out / "model.safetensors").read_bytes()
    ok(*args[:-2], "-o", "Global.seed=4", "--output", out, "--overwrite")
    assert (out / "model.safetensors").read_bytes() != old
    umask = os.umask(0o022)
    os.umask(umask)
    assert os.stat(out).st_mode & 0o777 == 0o777 & ~umask  # not mkdtemp's 0700
    assert os.stat(out / "model.safetensors").st_mode & 0o777 == 0o666 & ~umask  # not 0600
    (out / "notes.txt").write_text("mine")  # now it holds a file we did not write
    before = snapshot(tmp_path)
    code, _, err = gptc(*args, "--overwrite")
    assert code != 0 and "non-empty directory gpt-compress did not write" in err
    assert snapshot(tmp_path) == before


def test_interrupted_writes_leave_no_hidden_directories_behind(tmp_path):
    from gpt_compress.checkpoint import write_checkpoint_dir

    dead = tmp_path / ".out.tmp-999999999-abc"  # a pid that cannot exist
    legacy = tmp_path / ".out.tmp-k2j3h4"  # older layout without a pid: removed once an hour old
    live = tmp_path / f".out.tmp-{os.getpid()}-zzz"  # a write in progress: kept
    other = tmp_path / ".notes.tmp-999999999-abc"  # another output's: not ours to judge here
    for d in (dead, legacy, live, other):
        d.mkdir()
        (d / "x").write_text("partial")
    os.utime(legacy, (time.time() - 7200, time.time() - 7200))

    def boom(tmp):
        (Path(tmp) / "a").write_text("half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_checkpoint_dir(str(tmp_path / "out"), boom)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, other.name])


# --------------------------------------------------------------------------------------
# Generation limits, JSON output, streaming token-id prompts
# --------------------------------------------------------------------------------------
def test_beam_search_memory_estimate_refuses_before_allocating():
    from gpt_compress.config import ConfigError, GenerationConfig
    from gpt_compress.model.generation import check_beam_budget

    cache = [(np.zeros((1, 12, 2, 64), np.float32),) * 2 for _ in range(12)]  # GPT-2 small, 2 tokens
    big = GenerationConfig(decode_strategy="beam_search", num_beams=40000, max_new_tokens=100)
    with pytest.raises(ConfigError, match=r"Generation.num_beams=40000 .* GiB"):
        check_beam_budget(big, 1, 2, 50257, cache)
    check_beam_budget(GenerationConfig(decode_strategy="beam_search", num_beams=8), 1, 2, 50257, cache)


def test_summaries_are_valid_json_without_nan(capsys):
    from gpt_compress.commands._common import print_json

    print_json({"last_loss": float("nan"), "x": [float("inf"), 1.5]})
    assert json.loads(capsys.readouterr().out) == {"last_loss": None, "x": [None, 1.5]}


def test_generate_streams_a_token_id_prompt(ws):
    out = ok("generate", "--model", ws / "ckpt", "--prompt-ids", "5,6", "-o", "Generation.max_new_tokens=3")
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["results"][0]["prompt_tokens"] == 2 and len(summary["results"][0]["new_tokens"]) == 3


# --------------------------------------------------------------------------------------
# Forged pickles: a valid strided view still loads exactly
# --------------------------------------------------------------------------------------
def test_torch_bin_bounds_check_keeps_valid_views(tmp_path):
    from gpt_compress.convert.torch_bin import load_torch_bin

    data = np.arange(12, dtype=np.float32)
    s = _Storage("0", 12)
    write_torch_bin(tmp_path / "ok.bin", {"t": _Tensor(s, 2, (3, 2), (1, 3)), "u": _Tensor(s, 11, (), ())},
                    {"0": data.tobytes()})
    got = load_torch_bin(str(tmp_path / "ok.bin"))
    np.testing.assert_array_equal(got["t"], np.lib.stride_tricks.as_strided(data[2:], (3, 2), (4, 12)))
    assert got["u"] == 11.0


# --------------------------------------------------------------------------------------
# Data: GLUE files without a header, text files split into documents, report sizes
# --------------------------------------------------------------------------------------
def test_glue_tsv_without_header_keeps_its_first_row(tmp_path):
    from gpt_compress.data.glue import read_tsv, task_spec

    spec = task_spec("SST-2")
    (tmp_path / "with.tsv").write_text("sentence\tlabel\ngood\t1\nbad\t0\n")
    (tmp_path / "without.tsv").write_text("good\t1\nbad\t0\n")
    assert [e.texts for e in read_tsv(str(tmp_path / "with.tsv"), spec)] == [("good",), ("bad",)]
    assert [e.texts for e in read_tsv(str(tmp_path / "without.tsv"), spec)] == [("good",), ("bad",)]


def test_preprocess_splits_a_text_file_on_blank_lines(ws, tmp_path):
    from gpt_compress.data.indexed import open_dataset

    (tmp_path / "book.txt").write_text("First para\nstill first.\n\n\nSecond.\n  \nThird\n")
    ok("preprocess", "--input", tmp_path / "book.txt", "--output-prefix", tmp_path / "one", "--tokenizer-dir", ws / "tok")
    ok("preprocess", "--input", tmp_path / "book.txt", "--output-prefix", tmp_path / "many",
       "--tokenizer-dir", ws / "tok", "--split-paragraphs")
    assert len(open_dataset(str(tmp_path / "one_text_document")).sizes) == 1
    assert len(open_dataset(str(tmp_path / "many_text_document")).sizes) == 3


def test_report_weight_size_leaves_out_optimizer_state(tmp_path):
    from gpt_compress.eval.report import weight_size_mb

    (tmp_path / "model.safetensors").write_bytes(b"\0" * (1 << 20))
    (tmp_path / "optimizer.safetensors").write_bytes(b"\0" * (2 << 20))
    assert weight_size_mb(str(tmp_path), "dygraph") == 1.0


# --------------------------------------------------------------------------------------
# Real processes: stderr has no traceback and no Paddle warning; Ctrl-C says how to resume
# --------------------------------------------------------------------------------------
def test_real_process_prints_one_line_and_version(ws, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "gpt_compress", "export", "--model", str(ws / "ckpt"),
                           "--output", str(ws / "notes")], capture_output=True, text=True, env=ENV, cwd=tmp_path)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()], proc.stderr  # no ccache warning either
    assert proc.stderr.startswith("gptc export: error: --output ")
    proc = subprocess.run([sys.executable, "-m", "gpt_compress", "--version"], capture_output=True, text=True, env=ENV)
    assert proc.returncode == 0 and re.fullmatch(r"gptc \(gpt-compress\) \d+\.\d+\.\d+\n", proc.stdout)


def test_ctrl_c_during_pretrain_says_what_was_saved_and_how_to_resume(ws, tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "gpt_compress", "pretrain", "--no-progress", "-o", "Model.preset=gpt-tiny",
           "-o", f"Data.data_prefix={ws / 'data' / 'corpus_text_document'}", "-o", "Data.seq_length=32",
           "-o", f"Data.tokenizer_dir={ws / 'tok'}", "-o", f"Global.output_dir={out}", "-o", "Engine.max_steps=100000",
           "-o", "Engine.global_batch_size=2", "-o", "Engine.micro_batch_size=2", "-o", "Engine.save_steps=2",
           "-o", "Engine.eval_freq=0", "-o", "Engine.logging_freq=0", "-o", "Engine.eval_iters=0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    deadline = time.monotonic() + 300
    while not (out / "checkpoints").is_dir() or not any(
            (p / "checksums.json").is_file() for p in (out / "checkpoints").iterdir()):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("{")]
    assert proc.returncode == 130, err
    assert len(lines) == 1 and "Traceback" not in err, err
    m = re.match(r"gptc pretrain: error: interrupted at step (\d+) of 100000: the last checkpoint is .*step_\d+; "
                 r"continue with --resume auto", lines[0])
    assert m, lines[0]
    # Resuming with a smaller global batch than the run used cannot continue its data order (max_steps
    # past the interrupted step: a resume with nothing left to do would exit 0 before any check).
    code, _, err = gptc(*cmd[3:], "--resume", "auto", "-o", f"Engine.max_steps={int(m.group(1)) + 3}",
                        "-o", "Engine.global_batch_size=1",
                        "-o", "Engine.micro_batch_size=1")
    assert code != 0 and "Traceback" not in err and "global_batch_size" in err, err
