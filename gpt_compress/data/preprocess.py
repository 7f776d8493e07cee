"""Tokenize JSONL or plain-text corpora into a Megatron indexed dataset (``PREFIX_text_document``).

Inputs are files or directories (searched recursively, in sorted order):

* ``*.jsonl``, ``*.json``, ``*.ndjson``: one JSON object per line, the document text under
  ``json_key`` (Megatron ``preprocess_data.py`` / PaddleNLP). Blank lines are ignored.
* anything else: plain UTF-8 text, **one document per file** (Megatron and Hugging Face treat a
  file of running text the same way); split a corpus into files to get several documents, or
  pass ``split_paragraphs`` (``--split-paragraphs``) to make every blank-line-separated block
  of a text file a document. A text file holding NUL bytes is refused (not text).

Each document is encoded with ``<|endoftext|>`` inside the text treated as plain text (see
``tokenizer.py``), gets the EOD id appended when ``append_eod``, and is stored as one sequence.
Documents that encode to no tokens are dropped and counted. Bytes that are not UTF-8 are
replaced (U+FFFD) and the lines that had them are counted. A malformed JSON line or a line
without ``json_key`` raises :class:`DataError` naming file and line, unless ``skip_bad_lines``.
Output goes to temporary names and is renamed only when complete, so an interrupted run
leaves nothing that looks like a dataset.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import re
import sys
import time
from pathlib import Path
from typing import Iterator, Optional, Sequence, Union

import numpy as np
from tqdm import tqdm

from .errors import DataError
from ..fileio import disk_full, is_disk_full
from .indexed import IndexedDatasetBuilder, best_dtype
from .tokenizer import Tokenizer

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
# A chunk is the unit of work sent to a worker: large enough to amortise inter-process
# traffic, small enough to keep the progress bar moving.
CHUNK_RECORDS = 512
CHUNK_BYTES = 2 << 20

PathLike = Union[str, os.PathLike]


def output_prefix_for(output_prefix: PathLike, json_key: str = "text") -> str:
    """Megatron's output naming: ``{output_prefix}_{json_key}_document``."""
    return f"{os.fspath(output_prefix)}_{json_key}_document"


def find_input_files(inputs: Sequence[PathLike]) -> list[Path]:
    """Expand files and directories (recursively, sorted, hidden files skipped) into a file list."""
    files: list[Path] = []
    for item in inputs:
        p = Path(item)
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file()
                           and not any(part.startswith(".") for part in f.relative_to(p).parts))
            if not found:
                raise DataError(f"input directory {p} contains no files")
            files.extend(found)
        elif p.is_file():
            files.append(p)
        else:
            raise DataError(f"input {p} does not exist")
    if not files:
        raise DataError("no input files given")
    return files


def _is_jsonl(path: Path) -> bool:
    return path.suffix.lower() in JSONL_SUFFIXES


def _text_records(path: Path, split_paragraphs: bool) -> Iterator[tuple[int, bytes]]:
    """(1-based first line or 0, raw bytes) of the documents of plain-text file ``path``."""
    raw = path.read_bytes()
    if b"\x00" in raw:
        raise DataError(f"{path} holds NUL bytes: it is not a text file (give JSONL or UTF-8 text)")
    if not split_paragraphs:
        yield 0, raw
        return
    line = 1
    for block in re.split(rb"(\n[ \t\r]*\n)", raw):
        if block.strip() and not re.fullmatch(rb"\n[ \t\r]*\n", block):
            yield line + (len(block) - len(block.lstrip(b"\n"))), block.strip(b"\n")
        line += block.count(b"\n")


def _read_chunks(files: list[Path], split_paragraphs: bool = False) -> Iterator[list[tuple[int, int, bool, bytes]]]:
    """Yield chunks of records ``(file number, 1-based line or 0, is_json, raw bytes)``."""
    chunk, size = [], 0
    for fi, path in enumerate(files):
        if _is_jsonl(path):
            with open(path, "rb") as f:
                for lineno, raw in enumerate(f, start=1):
                    if not raw.strip():
                        continue
                    chunk.append((fi, lineno, True, raw))
                    size += len(raw)
                    if len(chunk) >= CHUNK_RECORDS or size >= CHUNK_BYTES:
                        yield chunk
                        chunk, size = [], 0
        else:
            for lineno, raw in _text_records(path, split_paragraphs):
                chunk.append((fi, lineno, False, raw))
                size += len(raw)
                if len(chunk) >= CHUNK_RECORDS or size >= CHUNK_BYTES:
                    yield chunk
                    chunk, size = [], 0
    if chunk:
        yield chunk


def _decode(raw: bytes) -> tuple[str, int]:
    """UTF-8 text of ``raw`` and the number of lines that needed replacement characters."""
    try:
        return raw.decode("utf-8"), 0
    except UnicodeDecodeError:
        bad = 0
        for line in raw.split(b"\n"):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError:
                bad += 1
        return raw.decode("utf-8", errors="replace"), bad


class _ChunkEncoder:
    """Turns a chunk of raw records into token ids; runs in the main process or in a worker."""

    def __init__(self, tokenizer: Tokenizer, json_key: str, append_eod: bool, dtype):
        self.tokenizer = tokenizer
        self.json_key = json_key
        self.append_eod = append_eod
        self.dtype = np.dtype(dtype)

    def _text_of(self, is_json: bool, raw: bytes) -> tuple[Optional[str], int, Optional[str]]:
        text, bad_utf8 = _decode(raw)
        if not is_json:
            return text, bad_utf8, None
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            return None, bad_utf8, f"malformed JSON ({e.msg} at column {e.colno})"
        if not isinstance(obj, dict):
            return None, bad_utf8, f"expected a JSON object, got {type(obj).__name__}"
        if self.json_key not in obj:
            keys = ", ".join(map(repr, list(obj)[:8])) or "none"
            return None, bad_utf8, f"no key {self.json_key!r} (keys: {keys}); choose it with --json-key"
        value = obj[self.json_key]
        if not isinstance(value, str):
            return None, bad_utf8, f"{self.json_key!r} is a {type(value).__name__}, not a string"
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            # Lone surrogates from JSON "\ud800" escapes: not encodable text.
            value = value.encode("utf-8", errors="replace").decode("utf-8")
            bad_utf8 = max(bad_utf8, 1)
        return value, bad_utf8, None

    def __call__(self, chunk: list[tuple[int, int, bool, bytes]]) -> dict:
        texts, errors, bad_utf8, nbytes = [], [], 0, 0
        for fi, lineno, is_json, raw in chunk:
            nbytes += len(raw)
            text, bad, error = self._text_of(is_json, raw)
            bad_utf8 += bad
            if error is not None:
                errors.append((fi, lineno, error))
            else:
                texts.append(text)
        docs = self.tokenizer.encode_batch(texts) if texts else []
        lengths = [len(d) for d in docs]
        empty = sum(1 for n in lengths if n == 0)
        eod = [self.tokenizer.eod_id] if self.append_eod else []
        kept = [d + eod for d in docs if d]
        flat = np.fromiter((t for d in kept for t in d), dtype=self.dtype,
                           count=sum(len(d) for d in kept))
        return {"ids": flat, "lengths": [len(d) for d in kept], "errors": errors,
                "bad_utf8": bad_utf8, "empty": empty, "bytes": nbytes}


_WORKER: Optional[_ChunkEncoder] = None


def _init_worker(tokenizer_json: str, json_key: str, append_eod: bool, dtype: str) -> None:
    global _WORKER
    # Parallelism comes from the processes; the library's threads would oversubscribe the cores.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER = _ChunkEncoder(Tokenizer.from_json(tokenizer_json), json_key, append_eod, dtype)


def _encode_in_worker(chunk):
    return _WORKER(chunk)


def preprocess(inputs: Sequence[PathLike], output_prefix: PathLike, tokenizer: Tokenizer,
               json_key: str = "text", append_eod: bool = True, workers: int = 1,
               skip_bad_lines: bool = False, log_every: int = 10000,
               progress: Optional[bool] = None, split_paragraphs: bool = False) -> dict:
    """Tokenize ``inputs`` into ``{output_prefix}_{json_key}_document.bin/.idx``; returns a summary.
    ``split_paragraphs``: a plain-text file gives one document per blank-line-separated block."""
    files = find_input_files(inputs)
    prefix = output_prefix_for(output_prefix, json_key)
    dtype = np.dtype(best_dtype(tokenizer.vocab_size))
    total_bytes = sum(f.stat().st_size for f in files)
    stats = {"documents": 0, "tokens": 0, "bytes": 0, "skipped_lines": 0, "bad_utf8_lines": 0,
             "empty_documents": 0}
    skipped_examples: list[str] = []
    start = time.perf_counter()
    bar = tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc="preprocess",
               disable=(not progress) if progress is not None else None, file=sys.stderr)
    next_log = log_every
    pool = None
    made = [d for d in Path(prefix).parents if not d.exists()]  # directories we create: removed on failure
    builder = None
    try:
        with IndexedDatasetBuilder(prefix, dtype) as builder:
            if workers > 1:
                pool = multiprocessing.get_context("spawn").Pool(
                    workers, initializer=_init_worker,
                    initargs=(tokenizer.to_json(), json_key, append_eod, dtype.str))
                results = pool.imap(_encode_in_worker, _read_chunks(files, split_paragraphs), chunksize=1)
            else:
                encoder = _ChunkEncoder(tokenizer, json_key, append_eod, dtype)
                results = map(encoder, _read_chunks(files, split_paragraphs))
            for res in results:
                for fi, lineno, error in res["errors"]:
                    where = f"{files[fi]}, line {lineno}"
                    if not skip_bad_lines:
                        raise DataError(f"{where}: {error}; fix the line or pass --skip-bad-lines")
                    stats["skipped_lines"] += 1
                    if len(skipped_examples) < 5:
                        skipped_examples.append(f"{where}: {error}")
                offset = 0
                for n in res["lengths"]:
                    builder.add_document(res["ids"][offset:offset + n])
                    offset += n
                stats["documents"] += len(res["lengths"])
                stats["tokens"] += int(res["ids"].size)
                stats["bytes"] += res["bytes"]
                stats["bad_utf8_lines"] += res["bad_utf8"]
                stats["empty_documents"] += res["empty"]
                elapsed = max(time.perf_counter() - start, 1e-9)
                bar.update(res["bytes"])
                bar.set_postfix_str(f"{stats['documents'] / elapsed:,.0f} docs/s, "
                                    f"{stats['tokens'] / elapsed:,.0f} tok/s", refresh=False)
                if bar.disable and log_every and stats["documents"] >= next_log:
                    next_log = stats["documents"] + log_every
                    print(f"preprocess: {stats['documents']:,} docs, {stats['tokens']:,} tokens, "
                          f"{stats['documents'] / elapsed:,.0f} docs/s, "
                          f"{stats['tokens'] / elapsed:,.0f} tok/s", file=sys.stderr, flush=True)
            if stats["documents"] == 0:
                raise DataError(f"no documents found in {', '.join(map(str, inputs))} "
                                f"({stats['skipped_lines']} bad lines skipped, "
                                f"{stats['empty_documents']} empty documents); nothing was written")
            bin_path, idx_path = builder.finalize()
    except BaseException as e:
        for d in made:
            try:
                d.rmdir()  # only while empty
            except OSError:
                pass
        if is_disk_full(e):  # the builder removed its temporary files; an earlier dataset is untouched
            written = builder.num_tokens * dtype.itemsize if builder is not None else 0
            raise disk_full(prefix + ".bin", e, written) from None
        raise
    finally:
        bar.close()
        if pool is not None:
            pool.terminate()
            pool.join()
    seconds = time.perf_counter() - start
    return {**stats, "seconds": round(seconds, 3),
            "docs_per_second": round(stats["documents"] / max(seconds, 1e-9), 1),
            "tokens_per_second": round(stats["tokens"] / max(seconds, 1e-9), 1),
            "input_files": len(files), "dtype": dtype.name, "append_eod": append_eod,
            "skipped_examples": skipped_examples, "output_prefix": prefix,
            "bin_path": bin_path, "idx_path": idx_path}
