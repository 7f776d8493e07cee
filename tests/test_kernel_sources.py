"""The fused operators' C++ is one translation unit in several files (kernels/gptc_ops.cc and the
headers it #includes): the cache key, the snapshot the build compiles and the manifests'
``source_sha256`` must cover every one of them, or an edit to a header would load a stale library.
No build: the key is computed from the source bytes (tests/test_fused.py builds the library)."""
import fnmatch
import os
import re
import shutil
import tomllib
from pathlib import Path

from gpt_compress import kernels

INCLUDE = re.compile(rb'^\s*#\s*include\s+"([^"]+)"', re.M)


def test_changing_any_source_file_changes_the_cache_key_and_source_sha256(tmp_path, monkeypatch):
    """One byte appended to any one file of SOURCES (a comment: the code is the same) gives a new
    cache directory and a new manifest ``source_sha256``; the unchanged files give the old ones."""
    sources = kernels.read_sources()
    key, sha = kernels.cache_key(sources), kernels.kernel_info()["source_sha256"]
    assert kernels.cache_key(dict(sources)) == key and sha == kernels.sources_sha256(sources)[:16]
    copy = tmp_path / "kernels"
    shutil.copytree(kernels.DIR, copy, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    monkeypatch.setattr(kernels, "DIR", str(copy))
    keys, shas = {key}, {sha}
    for name in kernels.SOURCES:
        edited = {**sources, name: sources[name] + b"\n//\n"}
        keys.add(kernels.cache_key(edited))
        (copy / name).write_bytes(edited[name])  # the same edit on disk: what load_ops and exports read
        assert kernels.read_sources() == edited and kernels.cache_key() == kernels.cache_key(edited)
        shas.add(kernels.kernel_info()["source_sha256"])
        (copy / name).write_bytes(sources[name])
    assert len(keys) == len(shas) == 1 + len(kernels.SOURCES)


def test_sources_are_every_file_of_the_unit_and_installed():
    """SOURCES names every .cc/.h file beside the loader (a new header must be listed, so it is
    hashed and snapshotted); the unit's quoted #includes name only them (the snapshot holds
    every file the build reads from this package) and reach every header; pyproject's package
    data installs them all."""
    on_disk = {f for f in os.listdir(kernels.DIR) if f.endswith((".cc", ".h"))}
    assert set(kernels.SOURCES) == on_disk and kernels.SOURCES[0] == "gptc_ops.cc"
    sources = kernels.read_sources()
    included = {m.decode() for text in sources.values() for m in INCLUDE.findall(text)} - {"paddle/extension.h"}
    assert included == set(kernels.SOURCES[1:])
    with open(Path(__file__).resolve().parents[1] / "pyproject.toml", "rb") as f:
        globs = tomllib.load(f)["tool"]["setuptools"]["package-data"]["gpt_compress.kernels"]
    assert all(any(fnmatch.fnmatch(name, g) for g in globs) for name in kernels.SOURCES), globs


def test_the_snapshot_holds_every_source_beside_the_unit(tmp_path):
    """The build compiles the copies in the keyed directory: all of SOURCES, the hashed bytes."""
    sources = kernels.read_sources()
    unit = kernels._snapshot_sources(str(tmp_path), sources)
    assert unit == str(tmp_path / "gptc_ops.cc")
    assert {f.name: f.read_bytes() for f in tmp_path.iterdir()} == sources


def test_the_isa_choice_is_part_of_the_cache_key_and_a_bad_one_is_named(monkeypatch):
    """$GPTC_KERNEL_ISA (native, avx2, baseline) picks the build's instruction-set flags, which the
    cache key covers (each ISA its own library); any other value is a one-line KernelError naming it."""
    import pytest

    from gpt_compress.errors import KernelError

    keys = {}
    for isa in ("native", "avx2", "baseline"):
        monkeypatch.setenv("GPTC_KERNEL_ISA", isa)
        assert kernels.isa() == isa and kernels.cflags()[-len(kernels.ISA_FLAGS[isa]):] == kernels.ISA_FLAGS[isa]
        keys[isa] = kernels.cache_key()
    assert len(set(keys.values())) == 3
    monkeypatch.delenv("GPTC_KERNEL_ISA")
    assert kernels.isa() == "native" and kernels.cache_key() == keys["native"]
    monkeypatch.setenv("GPTC_KERNEL_ISA", "avx512")
    with pytest.raises(KernelError) as e:
        kernels.cache_key()
    assert "GPTC_KERNEL_ISA='avx512'" in str(e.value) and "native, avx2, baseline" in str(e.value)
    assert "\n" not in str(e.value)


def test_the_weight_formats_are_the_same_numbers_in_cpp_and_python():
    """The weight block formats are defined twice, once per language: gptc_common.h's
    ``weight_format`` constants (the kernels read the weights so) and export/fused.py's
    ``WEIGHT_FORMAT`` (the export writes them so); every constant of one is the other's."""
    import numpy as np

    from gpt_compress.export.fused import WEIGHT_FORMAT, pack_int4

    text = (Path(kernels.DIR) / "gptc_common.h").read_text(encoding="utf-8")
    block = re.search(r"namespace weight_format \{(.*?)\}  // namespace weight_format", text, re.S)
    assert block, "gptc_common.h has no weight_format namespace"
    cpp = {name: int(value) for name, value in re.findall(r"constexpr int (k\w+) = (\d+);", block.group(1))}
    assert cpp == WEIGHT_FORMAT
    # pack_int4 writes that format: input j of a run in byte j's low nibble, j + 16 in its high one.
    codes = np.arange(-8, 8).repeat(4).reshape(2, 32)  # two rows of one run each
    packed = pack_int4(codes).view(np.uint8).astype(np.int64)
    assert packed.shape == (2, WEIGHT_FORMAT["kInt4RunBytes"])
    low, high = packed & 0xF, packed >> 4
    assert (low - WEIGHT_FORMAT["kInt4Offset"] == codes[:, :16]).all()
    assert (high - WEIGHT_FORMAT["kInt4Offset"] == codes[:, WEIGHT_FORMAT["kInt4HighInput"]:]).all()


def test_the_control_layout_is_the_same_in_cpp_and_python():
    """gptc_generate's control input: the header the op reads (kControlHeader words before the
    per-row flags) and its draft-vocabulary flag are what ``kernels.control`` writes."""
    text = kernels.read_sources()["gptc_decoder_stack.h"].decode()
    header = int(re.search(r"constexpr int64_t kControlHeader = (\d+);", text).group(1))
    flag = int(re.search(r"constexpr int64_t kFlagDraftVocab = (\d+);", text).group(1))
    plain, flagged = kernels.control(3, 4, eos=9, pad=7, suppress=2, finished=[0, 1, 0]), \
        kernels.control(3, 4, finished=[0, 1, 0], draft_vocab=True)
    assert len(plain) == header + 3 and list(plain[header:]) == [0, 1, 0]
    assert list(plain[:header]) == [4, 9, 7, 2, 0] and flagged[header - 1] == flag == kernels.CONTROL_DRAFT_VOCAB
