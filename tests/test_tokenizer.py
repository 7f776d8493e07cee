"""Tokenizer: exact GPT-2 ids against tiktoken on real text, both vocabulary layouts, save/load, training."""
from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

from conftest import ROOT, WIKITEXT_FILE_TOKENS, WIKITEXT_HF_TOKENS, wikitext_hf_rows
from gpt_compress.data import tokenizer as tokenizer_module
from gpt_compress.data.errors import DataError
from gpt_compress.data.tokenizer import Tokenizer



@pytest.fixture(scope="module")
def wikitext_text(shared_data) -> str:
    return "\n\n".join(wikitext_hf_rows(shared_data / "wikitext-2" / "wiki.test.raw"))


def test_wikitext_ids_equal_tiktoken(gpt2_tokenizer, tiktoken_gpt2, wikitext_text):
    ids = gpt2_tokenizer.encode(wikitext_text)
    assert len(ids) == WIKITEXT_HF_TOKENS
    assert ids == tiktoken_gpt2.encode(wikitext_text)
    assert gpt2_tokenizer.decode(ids) == wikitext_text


def test_whole_file_ids_equal_tiktoken(gpt2_tokenizer, tiktoken_gpt2, shared_data):
    text = (shared_data / "wikitext-2" / "wiki.test.raw").read_text(encoding="utf-8")
    ids = gpt2_tokenizer.encode(text)
    assert len(ids) == WIKITEXT_FILE_TOKENS
    assert ids == tiktoken_gpt2.encode(text)


def test_gpt2_special_ids(gpt2_tokenizer):
    assert gpt2_tokenizer.vocab_size == 50257
    assert gpt2_tokenizer.eod_id == gpt2_tokenizer.pad_id == 50256
    assert gpt2_tokenizer.decode([gpt2_tokenizer.eod_id]) == "<|endoftext|>"


def test_openai_and_hf_layouts_give_identical_ids(shared_data, gpt2_tokenizer, wikitext_text):
    # gpt2_tokenizer is Tokenizer.load() of the OpenAI directory; load() of the HF one must agree.
    hf = Tokenizer.from_files(shared_data / "whisper_gpt2" / "vocab.json",
                              shared_data / "whisper_gpt2" / "merges.txt")
    openai = Tokenizer.from_openai_files(shared_data / "gpt2_bpe" / "encoder.json",
                                         shared_data / "gpt2_bpe" / "vocab.bpe")
    assert hf.encode(wikitext_text) == gpt2_tokenizer.encode(wikitext_text)
    part = wikitext_text[:50000]
    assert openai.encode(part) == Tokenizer.load(shared_data / "whisper_gpt2").encode(part) == hf.encode(part)
    for tok in (hf, openai):
        assert (tok.vocab_size, tok.eod_id) == (50257, 50256)


def test_pieces_encoded_apart_match_whole_text(gpt2_tokenizer, tiktoken_gpt2, monkeypatch):
    # Long texts are cut at pre-token boundaries and encoded in parallel; with tiny pieces
    # every cut rule is exercised on awkward whitespace, contractions and non-ASCII text.
    monkeypatch.setattr(tokenizer_module, "_PIECE_CHARS", 4)
    alphabet = ["a", "Zq", " ", "  ", "\n", "\n\n", "\t", "\r\n", "\x1c", "\xa0", "\u3000", "'s", "'",
                "1", "22", "!?", ".", "é", "日本", "\U0001F600", "<|endoftext|>"]
    rng = random.Random(0)
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40))) for _ in range(1500)]
    expected = [tiktoken_gpt2.encode(t, disallowed_special=()) for t in texts]
    assert [gpt2_tokenizer.encode(t) for t in texts] == expected
    assert gpt2_tokenizer.encode_batch(texts) == expected
    assert all(gpt2_tokenizer.decode(ids) == t for ids, t in zip(expected, texts))


def test_endoftext_in_text_is_plain_unless_allowed(gpt2_tokenizer, tiktoken_gpt2):
    text = "end of one<|endoftext|>start of two"
    plain = gpt2_tokenizer.encode(text)
    assert plain == tiktoken_gpt2.encode(text, disallowed_special=())
    assert gpt2_tokenizer.eod_id not in plain
    special = gpt2_tokenizer.encode(text, allow_special=True)
    assert special == tiktoken_gpt2.encode(text, allowed_special="all")
    assert special.count(gpt2_tokenizer.eod_id) == 1
    assert gpt2_tokenizer.encode_batch([text], allow_special=True) == [special]
    assert gpt2_tokenizer.decode(plain) == gpt2_tokenizer.decode(special) == text


def test_save_load_round_trip(gpt2_tokenizer, shared_data, tmp_path, wikitext_text):
    paths = gpt2_tokenizer.save(tmp_path / "tok")
    assert sorted(p.name for p in paths) == ["merges.txt", "tokenizer.json", "vocab.json"]
    assert sorted(p.name for p in (tmp_path / "tok").iterdir()) == ["merges.txt", "tokenizer.json", "vocab.json"]
    sample = wikitext_text[:20000]
    expected = gpt2_tokenizer.encode(sample)
    assert Tokenizer.load(tmp_path / "tok").encode(sample) == expected
    # The Hugging Face pair alone (what GPT2Tokenizer reads) gives the same ids.
    hf_pair = Tokenizer.from_files(tmp_path / "tok" / "vocab.json", tmp_path / "tok" / "merges.txt")
    assert hf_pair.encode(sample) == expected
    original = (shared_data / "gpt2_bpe" / "vocab.bpe").read_text(encoding="utf-8").split("\n")[1:]
    written = (tmp_path / "tok" / "merges.txt").read_text(encoding="utf-8").split("\n")
    assert written[0].startswith("#version") and written[1:] == original


def test_load_errors_name_the_directory_and_files(tmp_path):
    with pytest.raises(DataError) as e:
        Tokenizer.load(tmp_path)
    assert str(tmp_path) in str(e.value)
    for name in ("tokenizer.json", "vocab.json", "merges.txt", "encoder.json", "vocab.bpe"):
        assert name in str(e.value)


def test_bad_merges_line_is_reported(shared_data, tmp_path):
    merges = tmp_path / "merges.txt"
    merges.write_text("#version: 0.2\nĠ t\nthis line is bad\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"merges\.txt, line 3"):
        Tokenizer.from_files(shared_data / "whisper_gpt2" / "vocab.json", merges)


def test_train_small_tokenizer(shared_data, tmp_path):
    corpus = shared_data / "corpus" / "tinyshakespeare.txt"
    tok = Tokenizer.train([corpus], vocab_size=2000)
    assert tok.vocab_size == 2000
    assert tok.decode([tok.eod_id]) == "<|endoftext|>"
    text = corpus.read_text(encoding="utf-8")[:50000]
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert len(ids) < len(text.encode("utf-8")) / 2  # merges were learned
    unseen = "Ünïcode naïveté — 日本語 🙂 <|endoftext|>"
    assert tok.decode(tok.encode(unseen)) == unseen  # byte-level: nothing is out of vocabulary
    tok.save(tmp_path / "trained")
    assert Tokenizer.load(tmp_path / "trained").encode(text) == ids
    pair = Tokenizer.from_files(tmp_path / "trained" / "vocab.json", tmp_path / "trained" / "merges.txt")
    assert pair.encode(text) == ids and pair.eod_id == tok.eod_id


def test_train_from_iterator():
    texts = ["the quick brown fox jumps over the lazy dog"] * 50
    tok = Tokenizer.train(iter(texts), vocab_size=300, min_frequency=2)
    assert tok.vocab_size <= 300
    assert tok.decode(tok.encode(texts[0])) == texts[0]
    with pytest.raises(DataError, match="too small"):
        Tokenizer.train(iter(texts), vocab_size=100)


def test_cli_train_tokenizer(shared_data, tmp_path):
    out = tmp_path / "tok"
    res = subprocess.run([sys.executable, "-m", "gpt_compress", "train-tokenizer",
                          "--input", str(shared_data / "corpus" / "tinyshakespeare.txt"),
                          "--vocab-size", "1000", "--output-dir", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary["vocab_size"] == 1000
    tok = Tokenizer.load(out)
    assert tok.vocab_size == 1000 and tok.decode(tok.encode("To be, or not to be")) == "To be, or not to be"
    missing = subprocess.run([sys.executable, "-m", "gpt_compress", "train-tokenizer", "--input",
                              str(tmp_path / "nope.txt"), "--vocab-size", "1000", "--output-dir", str(out)],
                             cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert missing.returncode == 1 and "nope.txt" in missing.stderr and "Traceback" not in missing.stderr
