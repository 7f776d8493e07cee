"""Data layer: preprocess -> Megatron .bin/.idx -> GPT samples, on real corpora; failure modes; CLI."""
from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import LAMBADA_PASSAGES, ROOT
from gpt_compress.data.dataset import (BlendedDataset, GPTDataset, SampleIterator, build_datasets,
                                       split_documents)
from gpt_compress.data.errors import DataError
from gpt_compress.data.indexed import (IndexedDataset, IndexedDatasetBuilder, NpyDataset, best_dtype,
                                       open_dataset)
from gpt_compress.data.preprocess import preprocess


def _lines_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    return path


def _files_with_prefix(prefix: Path) -> list[str]:
    return sorted(p.name for p in prefix.parent.iterdir() if p.name.startswith(prefix.name))


def _gptc(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpt_compress", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, **kw)


@pytest.fixture(scope="module")
def lambada(shared_data, gpt2_tokenizer, tmp_path_factory):
    """LAMBADA test JSONL preprocessed once: (dataset prefix, expected token ids per document)."""
    src = shared_data / "lambada_test.jsonl"
    texts = [json.loads(line)["text"] for line in src.read_text(encoding="utf-8").splitlines()]
    eod = gpt2_tokenizer.eod_id
    expected = [ids + [eod] for ids in gpt2_tokenizer.encode_batch(texts)]
    out = tmp_path_factory.mktemp("lambada") / "lambada"
    summary = preprocess([src], out, gpt2_tokenizer, progress=False)
    return Path(summary["output_prefix"]), expected, summary


@pytest.fixture(scope="module")
def shakespeare(shared_data, gpt2_tokenizer, tmp_path_factory):
    """tinyshakespeare, one document per blank-line-separated speech."""
    speeches = (shared_data / "corpus" / "tinyshakespeare.txt").read_text(encoding="utf-8").split("\n\n")
    tmp = tmp_path_factory.mktemp("shakespeare")
    summary = preprocess([_lines_jsonl(tmp / "speeches.jsonl", speeches)], tmp / "shk", gpt2_tokenizer,
                         progress=False)
    return Path(summary["output_prefix"])


# ---------------------------------------------------------------------------- preprocess + format
def test_preprocess_round_trip_is_exact(lambada):
    prefix, expected, summary = lambada
    assert prefix.name == "lambada_text_document"
    ds = open_dataset(prefix)
    assert isinstance(ds, IndexedDataset) and ds.dtype == np.uint16
    assert len(ds) == summary["documents"] == len(expected) == LAMBADA_PASSAGES
    assert summary["tokens"] == sum(map(len, expected)) == ds.num_tokens
    assert all(ds[i].tolist() == doc for i, doc in enumerate(expected))
    assert all(doc[-1] == 50256 for doc in expected)
    assert ds.get(7, offset=3, length=5).tolist() == expected[7][3:8]
    assert [a.tolist() for a in ds[10:13]] == expected[10:13]
    for key in ("documents", "tokens", "bytes", "seconds", "skipped_lines", "bad_utf8_lines", "bin_path",
                "idx_path"):
        assert key in summary


def test_idx_header_is_megatron_layout(lambada):
    prefix, expected, _ = lambada
    raw = Path(f"{prefix}.idx").read_bytes()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    version, code, n_seq, n_doc = struct.unpack("<QBQQ", raw[9:34])
    assert (version, code, n_seq, n_doc) == (1, 8, len(expected), len(expected) + 1)  # 8 = uint16
    sizes = np.frombuffer(raw, "<i4", n_seq, 34)
    pointers = np.frombuffer(raw, "<i8", n_seq, 34 + 4 * n_seq)
    doc_idx = np.frombuffer(raw, "<i8", n_doc, 34 + 12 * n_seq)
    assert len(raw) == 34 + 12 * n_seq + 8 * n_doc
    assert sizes.tolist() == [len(d) for d in expected]
    assert pointers[0] == 0 and (np.diff(pointers) == 2 * sizes[:-1]).all()
    assert doc_idx.tolist() == list(range(n_seq + 1))
    assert os.path.getsize(f"{prefix}.bin") == 2 * sum(map(len, expected))
    assert best_dtype(50257) is np.uint16 and best_dtype(65500) is np.int32


def test_workers_give_identical_bytes(lambada, shared_data, gpt2_tokenizer, tmp_path):
    prefix, _, _ = lambada
    summary = preprocess([shared_data / "lambada_test.jsonl"], tmp_path / "w2", gpt2_tokenizer, workers=2,
                         progress=False)
    for ext in (".bin", ".idx"):
        assert Path(summary["output_prefix"] + ext).read_bytes() == Path(f"{prefix}{ext}").read_bytes()


def test_broken_json_line_names_file_and_line(tmp_path, gpt2_tokenizer):
    src = tmp_path / "broken.jsonl"
    src.write_text('{"text": "one"}\n{"text": "two"}\n{"text": "thr\n{"text": "four"}\n', encoding="utf-8")
    with pytest.raises(DataError) as e:
        preprocess([src], tmp_path / "out", gpt2_tokenizer, progress=False)
    assert "broken.jsonl" in str(e.value) and "line 3" in str(e.value)
    assert _files_with_prefix(tmp_path / "out") == []  # temporary files removed, nothing final
    summary = preprocess([src], tmp_path / "out", gpt2_tokenizer, skip_bad_lines=True, progress=False)
    assert summary["skipped_lines"] == 1 and summary["documents"] == 3
    assert "line 3" in summary["skipped_examples"][0]
    assert [gpt2_tokenizer.decode(d[:-1]) for d in open_dataset(summary["output_prefix"])] == \
        ["one", "two", "four"]


def test_missing_key_and_non_object_lines(tmp_path, gpt2_tokenizer):
    src = tmp_path / "keys.jsonl"
    src.write_text('{"text": "a"}\n\n{"body": "b"}\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"keys\.jsonl, line 3: no key 'text'"):
        preprocess([src], tmp_path / "out", gpt2_tokenizer, progress=False)
    src.write_text('{"text": "a"}\n[1, 2]\n', encoding="utf-8")
    with pytest.raises(DataError, match="line 2: expected a JSON object"):
        preprocess([src], tmp_path / "out", gpt2_tokenizer, progress=False)
    summary = preprocess([src], tmp_path / "out", gpt2_tokenizer, json_key="text", skip_bad_lines=True,
                         progress=False)
    assert summary["skipped_lines"] == 1


def test_invalid_utf8_is_replaced_and_counted(tmp_path, gpt2_tokenizer):
    src = tmp_path / "bytes.jsonl"
    src.write_bytes(b'{"text": "caf\xe9 ok"}\n{"text": "fine"}\n')
    summary = preprocess([src], tmp_path / "out", gpt2_tokenizer, progress=False)
    assert summary["bad_utf8_lines"] == 1 and summary["documents"] == 2
    first = open_dataset(summary["output_prefix"])[0]
    assert gpt2_tokenizer.decode(first[:-1]) == "caf\ufffd ok"


def test_empty_input_is_an_error(tmp_path, gpt2_tokenizer):
    src = tmp_path / "empty.jsonl"
    src.write_text('\n{"text": ""}\n', encoding="utf-8")
    with pytest.raises(DataError, match="no documents"):
        preprocess([src], tmp_path / "out", gpt2_tokenizer, progress=False)
    assert _files_with_prefix(tmp_path / "out") == []
    with pytest.raises(DataError, match="does not exist"):
        preprocess([tmp_path / "nope.jsonl"], tmp_path / "out", gpt2_tokenizer, progress=False)


def test_text_files_are_one_document_each(tmp_path, gpt2_tokenizer):
    (tmp_path / "in" / "sub").mkdir(parents=True)
    (tmp_path / "in" / "b.txt").write_text("second file\n\nwith two paragraphs", encoding="utf-8")
    (tmp_path / "in" / "a.txt").write_text("first file", encoding="utf-8")
    (tmp_path / "in" / "sub" / "c.md").write_text("third <|endoftext|> file", encoding="utf-8")
    (tmp_path / "in" / ".hidden").write_text("ignored", encoding="utf-8")
    summary = preprocess([tmp_path / "in"], tmp_path / "out", gpt2_tokenizer, progress=False)
    ds = open_dataset(summary["output_prefix"])
    texts = ["first file", "second file\n\nwith two paragraphs", "third <|endoftext|> file"]
    assert [d.tolist() for d in ds] == [gpt2_tokenizer.encode(t) + [50256] for t in texts]
    # The literal in text stays text: the only EOD ids are the appended ones.
    assert all(d[:-1].tolist().count(50256) == 0 for d in ds)
    no_eod = preprocess([tmp_path / "in"], tmp_path / "raw", gpt2_tokenizer, append_eod=False, progress=False)
    assert [d.tolist() for d in open_dataset(no_eod["output_prefix"])] == [gpt2_tokenizer.encode(t) for t in texts]


def test_killed_preprocess_leaves_no_valid_looking_output(shared_data, tmp_path):
    paragraphs = (shared_data / "corpus" / "janeausten_6novels.txt").read_text(encoding="utf-8").split("\n\n")
    block = "".join(json.dumps({"text": p}) + "\n" for p in paragraphs)
    big = tmp_path / "big.jsonl"
    big.write_text(block * -(-50_000_000 // len(block)), encoding="utf-8")  # ~50 MB: many seconds of work
    out = tmp_path / "killed"
    final = Path(f"{out}_text_document")
    tmp_bin = Path(f"{final}.bin.tmp")
    proc = subprocess.Popen([sys.executable, "-m", "gpt_compress", "preprocess", "--input", str(big),
                             "--output-prefix", str(out), "--tokenizer-dir", str(shared_data / "gpt2_bpe")],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_bin.exists() and tmp_bin.stat().st_size > 0):
            assert proc.poll() is None, "preprocess ended before it could be interrupted"
            assert time.monotonic() < deadline, "preprocess never started writing"
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
        big.unlink()
    assert proc.returncode == -signal.SIGKILL
    assert not Path(f"{final}.bin").exists() and not Path(f"{final}.idx").exists()
    with pytest.raises(DataError, match="no dataset at prefix"):
        open_dataset(final)


@pytest.fixture
def lambada_copy(lambada, tmp_path):
    prefix, _, _ = lambada
    copy = tmp_path / "copy"
    for ext in (".bin", ".idx"):
        shutil.copyfile(f"{prefix}{ext}", f"{copy}{ext}")
    return copy


def test_truncated_idx_is_detected(lambada_copy):
    idx = Path(f"{lambada_copy}.idx")
    idx.write_bytes(idx.read_bytes()[:-10])
    with pytest.raises(DataError, match="truncated") as e:
        open_dataset(lambada_copy)
    assert str(idx) in str(e.value)
    idx.write_bytes(b"MMIDI")
    with pytest.raises(DataError, match="truncated"):
        IndexedDataset(lambada_copy)


def test_bad_magic_is_detected(lambada_copy):
    idx = Path(f"{lambada_copy}.idx")
    idx.write_bytes(b"NOTANIDX!" + idx.read_bytes()[9:])
    with pytest.raises(DataError, match="bad magic") as e:
        open_dataset(lambada_copy)
    assert str(idx) in str(e.value)


def test_truncated_or_missing_bin_is_detected(lambada_copy):
    binp = Path(f"{lambada_copy}.bin")
    binp.write_bytes(binp.read_bytes()[:-2])
    with pytest.raises(DataError, match="incomplete or mismatched") as e:
        open_dataset(lambada_copy)
    assert str(binp) in str(e.value)
    binp.unlink()
    with pytest.raises(DataError, match="not found"):
        open_dataset(str(lambada_copy) + ".idx")


def test_builder_context_manager_cleans_up_on_error(tmp_path):
    with pytest.raises(RuntimeError):
        with IndexedDatasetBuilder(tmp_path / "x", np.uint16) as b:
            b.add_document([1, 2, 3])
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(DataError, match="out of range"):
        with IndexedDatasetBuilder(tmp_path / "y", np.uint16) as b:
            b.add_document([70000])


def test_fleetx_npy_format_reads_the_same(lambada, tmp_path):
    prefix, expected, _ = lambada
    ds = open_dataset(prefix)
    fleetx = tmp_path / "fleetx"
    np.save(f"{fleetx}_ids.npy", np.concatenate([np.asarray(d, np.uint16) for d in expected]))
    np.savez(f"{fleetx}_idx.npz", lens=np.asarray(ds.sizes, np.int32), docs=np.arange(len(ds) + 1))
    other = open_dataset(fleetx)
    assert isinstance(other, NpyDataset) and len(other) == len(ds)
    assert all(other[i].tolist() == doc for i, doc in enumerate(expected))
    assert other.get(7, 3, 5).tolist() == ds.get(7, 3, 5).tolist()
    a, b = GPTDataset(ds, range(100), 50, 64, seed=3), GPTDataset(other, range(100), 50, 64, seed=3)
    assert all((a[i]["input_ids"] == b[i]["input_ids"]).all() for i in range(50))


# ---------------------------------------------------------------------------- GPT samples
def _stream(ds, gpt: GPTDataset) -> np.ndarray:
    return np.concatenate([ds[int(d)] for d in gpt.doc_idx]).astype(np.int64)


def test_samples_cover_the_token_stream_across_documents(lambada):
    ds = open_dataset(lambada[0])
    seq = 128
    gpt = GPTDataset(ds, range(0, 400), None, seq, seed=7)
    stream = _stream(ds, gpt)
    assert len(gpt) == (len(stream) - 1) // seq and gpt.num_epochs == 1
    assert sorted(gpt.shuffle_idx.tolist()) == list(range(len(gpt)))
    for j in range(len(gpt)):  # unshuffled sample j is stream[j*T : j*T + T + 1]
        assert (gpt.tokens(j) == stream[j * seq:j * seq + seq + 1]).all()
    crossing = sum(1 for j in range(len(gpt)) if 50256 in gpt.tokens(j)[:-1])
    assert crossing > len(gpt) // 4  # samples really do span documents
    for i in (0, 1, len(gpt) - 1):
        item = gpt[i]
        assert item["input_ids"].dtype == np.int64 and item["input_ids"].shape == (seq,)
        tokens = gpt.tokens(int(gpt.shuffle_idx[i]))
        assert (item["input_ids"] == tokens[:-1]).all() and (item["labels"] == tokens[1:]).all()


def test_samples_are_deterministic_by_seed(lambada):
    ds = open_dataset(lambada[0])
    a, b, c = (GPTDataset(ds, range(200), 300, 64, seed=s) for s in (1, 1, 2))
    assert (a.doc_idx == b.doc_idx).all() and (a.shuffle_idx == b.shuffle_idx).all()
    assert all((a[i]["input_ids"] == b[i]["input_ids"]).all() for i in range(0, 300, 17))
    assert not (a.doc_idx == c.doc_idx).all() and not (a.shuffle_idx[:300] == c.shuffle_idx[:300]).all()


def test_multi_epoch(lambada):
    ds = open_dataset(lambada[0])
    docs = np.arange(100, 130)
    per_epoch = int(np.asarray(ds.sizes)[docs].sum())
    seq = 32
    gpt = GPTDataset(ds, docs, (3 * per_epoch + per_epoch // 2) // seq, seq, seed=5)
    assert gpt.num_epochs == 4  # three and a half epochs' worth of samples
    blocks = gpt.doc_idx.reshape(gpt.num_epochs, len(docs))
    assert all(sorted(b.tolist()) == docs.tolist() for b in blocks)  # every epoch: each doc once
    assert len({tuple(b) for b in blocks}) == gpt.num_epochs  # each in its own order
    stream = _stream(ds, gpt)
    assert all((gpt.tokens(j) == stream[j * seq:j * seq + seq + 1]).all() for j in range(len(gpt)))
    # The half-used last epoch is shuffled apart: the first samples all come from epochs 1-3.
    before_last = (3 * per_epoch - 1) // seq
    assert sorted(gpt.shuffle_idx[:before_last].tolist()) == list(range(before_last))
    assert len(gpt[len(gpt) - 1]["labels"]) == seq


def test_split_documents_matches_megatron():
    assert split_documents(1000, [949, 50, 1]) == [range(0, 949), range(949, 999), range(999, 1000)]
    assert split_documents(1000, "949,50,1") == split_documents(1000, (949, 50, 1))
    # 10 docs in thirds: rounding gives 3+3+3, and Megatron shifts every boundary by the missing one.
    assert split_documents(10, [1, 1, 1]) == [range(0, 4), range(4, 7), range(7, 10)]
    assert split_documents(17, "98,2") == [range(0, 17), range(17, 17), range(17, 17)]
    assert split_documents(5153, "969, 30, 1")[2].stop == 5153
    with pytest.raises(DataError):
        split_documents(10, "a,b")


class _Fake:
    """A dataset whose sample i is (tag, i)."""

    def __init__(self, tag, n):
        self.tag, self.n = tag, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return (self.tag, i)


def test_blending_follows_weights():
    weights = [0.5, 0.3, 0.2]
    n = 20000
    blend = BlendedDataset([_Fake(k, n) for k in range(3)], [5, 3, 2], n)
    counts = np.bincount(blend.dataset_index, minlength=3)
    # Greedy: at every prefix each dataset is within one sample of its share (so the whole run within 1 / n).
    assert np.abs(counts / n - weights).max() < 1 / n
    taken = np.cumsum(np.eye(3)[blend.dataset_index], axis=0)
    assert np.abs(taken - np.arange(1, n + 1)[:, None] * np.array(weights)).max() < 1.0
    seen = {k: [blend[i][1] for i in range(n) if blend[i][0] == k] for k in range(3)}
    assert all(v == list(range(len(v))) for v in seen.values())  # each source read in order
    again = BlendedDataset([_Fake(k, n) for k in range(3)], ["5", "3", "2"], n)
    assert (again.dataset_index == blend.dataset_index).all()
    with pytest.raises(DataError, match="component 0"):
        BlendedDataset([_Fake(0, 10), _Fake(1, 1000)], [0.5, 0.5], 100)


def test_build_datasets_single_and_blended(lambada, shakespeare):
    prefix = str(lambada[0])
    train, valid, test = build_datasets([prefix], "98,2,0", 64, (500, 40, 0), seed=11)
    assert (len(train), len(valid), test) == (500, 40, None)
    ranges = split_documents(LAMBADA_PASSAGES, "98,2,0")
    assert set(train.documents.tolist()) == set(ranges[0]) and set(valid.documents.tolist()) == set(ranges[1])
    blended, _, _ = build_datasets(["0.3", prefix, 0.7, str(shakespeare)], "98,2,0", 64, (2000, 0, 0), seed=11)
    assert isinstance(blended, BlendedDataset) and len(blended) == 2000
    share = np.bincount(blended.dataset_index, minlength=2) / 2000
    assert abs(share[0] - 0.3) < 1 / 2000 and abs(share[1] - 0.7) < 1 / 2000  # the greedy blend: within a sample
    di, si = int(blended.dataset_index[9]), int(blended.dataset_sample_index[9])
    assert (blended[9]["input_ids"] == blended.datasets[di][si]["input_ids"]).all()
    with pytest.raises(DataError, match="not a weight"):
        build_datasets(["x", prefix, "0.5", prefix], "1,0,0", 64, (10, 0, 0), seed=1)


def test_sample_iterator_resumes_exactly(lambada):
    train, _, _ = build_datasets([str(lambada[0])], "1,0,0", 32, (160, 0, 0), seed=3)
    fresh = SampleIterator(train, batch_size=8)
    assert len(fresh) == 20
    batches = list(fresh)
    assert len(batches) == 20 and fresh.consumed_samples == 160
    assert batches[0]["input_ids"].shape == (8, 32) and batches[0]["labels"].dtype == np.int64
    for k in (0, 1, 7, 19):
        resumed = SampleIterator(train, batch_size=8, consumed_samples=8 * k)
        rest = list(resumed)
        assert len(rest) == 20 - k
        assert all((a[key] == b[key]).all() for a, b in zip(rest, batches[k:]) for key in a)
    it = SampleIterator(train, batch_size=8, consumed_samples=16)
    next(it)
    assert it.consumed_samples == 24
    # Data parallel: the ranks' slices make up the global batch.
    r0 = next(SampleIterator(train, 8, consumed_samples=16, dp_rank=0, dp_size=2))
    r1 = next(SampleIterator(train, 8, consumed_samples=16, dp_rank=1, dp_size=2))
    assert (np.concatenate([r0["input_ids"], r1["input_ids"]]) == batches[2]["input_ids"]).all()


# ---------------------------------------------------------------------------- CLI
def test_cli_preprocess(shared_data, tmp_path):
    lines = (shared_data / "lambada_test.jsonl").read_text(encoding="utf-8").splitlines()[:200]
    src = tmp_path / "part.jsonl"
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    res = _gptc("preprocess", "--input", str(src), "--output-prefix", str(tmp_path / "cli"),
                "--vocab-file", str(shared_data / "whisper_gpt2" / "vocab.json"),
                "--merges-file", str(shared_data / "whisper_gpt2" / "merges.txt"), "--workers", "2")
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary["documents"] == 200
    assert len(open_dataset(tmp_path / "cli_text_document")) == 200


def test_cli_preprocess_error_is_one_line(shared_data, tmp_path):
    src = tmp_path / "bad.jsonl"
    src.write_text('{"text": "a"}\n{"text": "b"}\n{oops\n', encoding="utf-8")
    args = ["preprocess", "--input", str(src), "--output-prefix", str(tmp_path / "o"),
            "--tokenizer-dir", str(shared_data / "gpt2_bpe")]
    res = _gptc(*args)
    assert res.returncode == 1
    assert "bad.jsonl, line 3" in res.stderr and "Traceback" not in res.stderr
    ok = _gptc(*args, "--skip-bad-lines")
    assert ok.returncode == 0 and json.loads(ok.stdout.strip().splitlines()[-1])["skipped_lines"] == 1
