"""Shared test fixtures: the real data (../shared/data, else tests/data) and tokenizers built from it."""
from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import numpy as np
import pytest

from gpt_compress import runtime

# The process-wide CPU settings `gptc` applies to every command (runtime.tune_cpu: MKL's kernels,
# which MKL fixes at the process's first matmul; strided views; the allocator; the math library's
# thread count), applied once here, before any Paddle op. A test that calls `gptc` in this process
# then changes none of them, and no test's numbers depend on the tests before it. Paddle is
# imported first (after gpt_compress, which sets libgomp's spin count: runtime.openmp_spin) so
# that tune_cpu sets its flag in Paddle rather than in the environment subprocesses inherit.
import paddle  # noqa: E402,F401

runtime.tune_cpu()


def _reset_process_state() -> None:
    """The settings above and the global random generators (which `gptc` commands seed, and
    tests draw from) as they are at the session's start."""
    runtime.tune_cpu()
    random.seed(0)
    np.random.seed(0)
    paddle.seed(0)


@pytest.fixture(autouse=True)
def process_state():
    """Every test starts from the session's process-wide state, whatever the tests before it did
    (an export's allocator setting, a command's seeds, a predictor's thread count)."""
    _reset_process_state()
    yield
    _reset_process_state()


ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"
TESTS_DATA = ROOT / "tests" / "data"
# The full data sets beside the checkout when present, else the whole files and slices shipped in
# tests/data (tests/data/README.md): every test runs either way. FULL_DATA names the figures that
# depend on the sets' sizes.
FULL_DATA = SHARED_DATA.is_dir()
DATA = SHARED_DATA if FULL_DATA else TESTS_DATA
LAMBADA_PASSAGES = 5153 if FULL_DATA else 500
# WikiText-2 test (raw) in GPT-2 tokens: as Hugging Face rows joined with "\n\n", and the whole
# file as one string (shared/data/README.md; the slice's counted the same way, checked with tiktoken).
WIKITEXT_HF_TOKENS = 287_644 if FULL_DATA else 71_085
WIKITEXT_FILE_TOKENS = 286_221 if FULL_DATA else 70_725

# tiktoken looks its "gpt2" files up under these hashed names (see shared/data/README.md).
TIKTOKEN_GPT2_FILES = {"vocab.bpe": "6d1cbeee0f20b3d9449abfede4726ed8212e3aee",
                       "encoder.json": "6c7ea1a7e38e3a7f062df639a5b80947f075ffe6"}


def wikitext_hf_rows(path: Path) -> list[str]:
    """WikiText rows as Hugging Face `datasets` gives them: lines keep "\\n", blank " \\n" -> ""."""
    with open(path, encoding="utf-8", newline="") as f:
        return ["" if line == " \n" else line for line in f]


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """Directory of the real data: ../shared/data beside the checkout, else tests/data."""
    return DATA


@pytest.fixture(scope="session")
def gpt2_tokenizer(shared_data):
    """The GPT-2 tokenizer from the OpenAI-layout files."""
    from gpt_compress.data.tokenizer import Tokenizer

    return Tokenizer.load(shared_data / "gpt2_bpe")


@pytest.fixture(scope="session")
def tiktoken_gpt2(shared_data, tmp_path_factory):
    """tiktoken's "gpt2" encoding loaded offline from the shared vocabulary files."""
    tiktoken = pytest.importorskip("tiktoken")
    cache = tmp_path_factory.mktemp("tiktoken_cache")
    for name, hashed in TIKTOKEN_GPT2_FILES.items():
        shutil.copyfile(shared_data / "gpt2_bpe" / name, cache / hashed)
    old = os.environ.get("TIKTOKEN_CACHE_DIR")
    os.environ["TIKTOKEN_CACHE_DIR"] = str(cache)
    try:
        return tiktoken.get_encoding("gpt2")
    finally:
        if old is None:
            del os.environ["TIKTOKEN_CACHE_DIR"]
        else:
            os.environ["TIKTOKEN_CACHE_DIR"] = old


@pytest.fixture(scope="session")
def shakespeare(shared_data, tmp_path_factory):
    """tinyshakespeare as a training set: a 1024-token BPE trained on it and its indexed
    dataset, one document per paragraph (blank-line separated). Returns (tokenizer dir, prefix)."""
    import json

    from gpt_compress.data.preprocess import preprocess
    from gpt_compress.data.tokenizer import Tokenizer

    out = tmp_path_factory.mktemp("shakespeare")
    text = (shared_data / "corpus" / "tinyshakespeare.txt").read_text(encoding="utf-8")
    paragraphs = [p.strip() for p in text.split("\n\n") if p.strip()]
    jsonl = out / "shakespeare.jsonl"
    jsonl.write_text("".join(json.dumps({"text": p}) + "\n" for p in paragraphs), encoding="utf-8")
    tok = Tokenizer.train([str(shared_data / "corpus" / "tinyshakespeare.txt")], vocab_size=1024)
    tok.save(out / "tokenizer")
    preprocess([str(jsonl)], str(out / "shakespeare"), tok, progress=False)
    return str(out / "tokenizer"), str(out / "shakespeare_text_document")
