"""gpt_compress.fileio: atomic file and directory writes leave the old content on failure."""
import json
import os

import pytest

from gpt_compress.fileio import CHECKSUMS, atomic_file, sha256_file, write_dir_atomic, write_json_atomic


def test_atomic_file_keeps_the_old_content_when_the_writer_fails(tmp_path):
    path = tmp_path / "result.json"
    write_json_atomic(str(path), {"b": 1, "a": 2})
    assert path.read_text(encoding="utf-8").index('"a"') < path.read_text(encoding="utf-8").index('"b"')
    with pytest.raises(ZeroDivisionError):
        with atomic_file(str(path)) as f:
            f.write("half a file")
            1 / 0
    assert json.loads(path.read_text(encoding="utf-8")) == {"a": 2, "b": 1}
    assert os.listdir(tmp_path) == ["result.json"]  # no temporary file left behind


def test_write_dir_atomic_adds_checksums_and_replaces_only_on_success(tmp_path):
    out = tmp_path / "model"

    def fill(text):
        return lambda d: open(os.path.join(d, "weights.bin"), "w").write(text)

    write_dir_atomic(str(out), fill("one"))
    sums = json.loads((out / CHECKSUMS).read_text())
    assert sums == {"weights.bin": sha256_file(str(out / "weights.bin"))}

    def broken(d):
        fill("two")(d)
        raise RuntimeError("export failed")

    with pytest.raises(RuntimeError):
        write_dir_atomic(str(out), broken, overwrite=True)
    assert (out / "weights.bin").read_text() == "one"
    write_dir_atomic(str(out), fill("three"), overwrite=True)
    assert (out / "weights.bin").read_text() == "three"
    assert sorted(os.listdir(tmp_path)) == ["model"]


@pytest.mark.parametrize("bad", [-1, "24", 2.0, True])
def test_prompt_tokens_is_checked_alike_in_a_checkpoint_and_an_export(tmp_path, bad):
    """``prompt_tokens`` of a checkpoint's config.json and of an export's manifest.json: one
    check (``fileio.json_count``), one message naming the file, the value and what to do; a bool
    is no count (``True`` passed as 1 before)."""
    from gpt_compress import checkpoint
    from gpt_compress.config import ModelConfig
    from gpt_compress.errors import CheckpointError, ModelDirError
    from gpt_compress.inference.manifest import MANIFEST, Manifest

    meta = {"format": checkpoint.FORMAT, "format_version": checkpoint.FORMAT_VERSION,
            "model": ModelConfig.from_preset("gpt-tiny").to_dict()}
    write_json_atomic(str(tmp_path / checkpoint.CONFIG), meta)
    assert checkpoint.read_prompt_tokens(str(tmp_path)) == 0 == Manifest(str(tmp_path), {}).prompt_tokens
    write_json_atomic(str(tmp_path / checkpoint.CONFIG), {**meta, "prompt_tokens": 24})
    assert checkpoint.read_prompt_tokens(str(tmp_path)) == 24 == Manifest(str(tmp_path), {"prompt_tokens": 24}).prompt_tokens

    write_json_atomic(str(tmp_path / checkpoint.CONFIG), {**meta, "prompt_tokens": bad})
    with pytest.raises(CheckpointError) as e:
        checkpoint.read_prompt_tokens(str(tmp_path))
    assert str(e.value) == (f"{tmp_path / checkpoint.CONFIG}: prompt_tokens {bad!r} is not a non-negative integer; "
                            "set it to the Finetune.prompt_tokens the model was finetuned with, or remove it")
    with pytest.raises(ModelDirError) as e:
        Manifest(str(tmp_path), {"prompt_tokens": bad}).prompt_tokens
    assert str(e.value) == f"{tmp_path / MANIFEST}: prompt_tokens {bad!r} is not a non-negative integer; re-export the model"
