"""Malformed and hostile inputs, one table across every command.

Each case runs ``gptc`` in-process (``cli.main``) in a workspace of tiny fixtures built once
(gpt-tiny checkpoints, a tokenizer, an export, a dataset, forged Hugging Face directories) and
asserts: a non-zero exit, exactly one stderr line ``gptc <command>: ...error: ...`` naming the
input and the problem, no traceback, and no change to any file or directory of the workspace
(its tree is snapshotted before and after). A few subprocess runs check what only a real
process shows (the traceback-free stderr, Ctrl-C).
"""
from __future__ import annotations

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
from pathlib import Path

import numpy as np
import pytest

from _cli_helpers import CORPUS, ENV, gptc, ok, snapshot



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
    ok("export", "--model", ws / "notok", "--output", ws / "export_notok", "--format", "paddle", "--no-validate",
       "--no-fused")
    ok("convert", "--to-hf", ws / "ckpt", "--output", ws / "hf")
    paragraphs = [p.strip() for p in text.split("\n\n") if p.strip()]
    (ws / "austen.jsonl").write_text("".join(json.dumps({"text": p}) + "\n" for p in paragraphs), encoding="utf-8")
    ok("preprocess", "--input", ws / "austen.jsonl", "--output-prefix", ws / "data" / "corpus",
       "--tokenizer-dir", ws / "tok")
    (ws / "notes").mkdir()
    (ws / "notes" / "notes.txt").write_text("precious\n")
    # Run directories holding earlier (or foreign) outputs of finetune and ptq.
    (ws / "ftdone").mkdir()
    (ws / "ftdone" / "finetune_eval.json").write_text("{}\n")
    (ws / "ftmodel").mkdir()
    shutil.copytree(ws / "notok", ws / "ftmodel" / "model")
    shutil.copytree(ws / "notes", ws / "ftforeign" / "model")
    shutil.copytree(ws / "notes", ws / "ptqforeign" / "int8")
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


# The cases: tests/bad_inputs.tsv (id, argv with "{ws}" for the workspace, a regex the one error
# line must match), one a line, grouped by what they try.
ROWS = [tuple(line.split("\t")) for line in (Path(__file__).parent / "bad_inputs.tsv").read_text("utf-8").splitlines()
        if line.strip() and not line.startswith("#")]
# A command that takes token ids takes them from a model without a tokenizer too (`gptc init`
# writes one): every such row runs again on the checkpoint and the export that have none.
TWINS = {"{ws}/ckpt ": "{ws}/notok ", "{ws}/export ": "{ws}/export_notok "}
CASES = ROWS + [(f"{name}[no-tokenizer]", (template + " ").replace(a, b).strip(), needle)
                for name, template, needle in ROWS if "--prompt-ids" in template
                for a, b in TWINS.items() if a in template + " "]


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
    assert sum(c[0].endswith("[no-tokenizer]") for c in CASES) >= 20  # every token-id row, on both kinds


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


@pytest.mark.parametrize("stream", ["--no-stream", None])
def test_token_ids_need_no_tokenizer(ws, stream):
    """`gptc init` writes a checkpoint without a tokenizer: token-id prompts still generate, on the
    checkpoint (dygraph) and on its export, streamed or not, greedy and sampled."""
    for cmd, flag, model in (("generate", "--model", ws / "notok"), ("infer", "--model-dir", ws / "export_notok")):
        for strategy in ("greedy", "sampling"):
            out = ok(cmd, flag, model, "--prompt-ids", "5,6", *([stream] if stream else []),
                     "-o", "Generation.max_new_tokens=3", "-o", f"Generation.decode_strategy={strategy}")
            result = json.loads(out.strip().splitlines()[-1])["results"][0]
            assert result["prompt_tokens"] == 2 and len(result["new_tokens"]) == 3 and "text" not in result


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
    m = re.match(r"gptc pretrain: error: interrupted \(Ctrl-C\) at step (\d+) of 100000: the last checkpoint is "
                 r".*step_0*\1; "
                 r"continue with --resume auto", lines[0])
    assert m, lines[0]
    # Resuming with a smaller global batch than the run used cannot continue its data order (max_steps
    # past the interrupted step: a resume with nothing left to do would exit 0 before any check).
    code, _, err = gptc(*cmd[3:], "--resume", "auto", "-o", f"Engine.max_steps={int(m.group(1)) + 3}",
                        "-o", "Engine.global_batch_size=1",
                        "-o", "Engine.micro_batch_size=1")
    assert code != 0 and "Traceback" not in err and "global_batch_size" in err, err
