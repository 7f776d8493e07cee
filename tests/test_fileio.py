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
