"""Token datasets on disk: Megatron-LM's mmap ``PREFIX.bin`` + ``PREFIX.idx``, and FleetX's npy pair.

Megatron ``.idx`` layout (little-endian), checked against megatron/core/datasets/indexed_dataset.py::

    b"MMIDIDX\\x00\\x00"   9-byte magic
    u64 version = 1
    u8  dtype code          (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16)
    u64 S                   number of sequences
    u64 D                   number of document-index entries (= documents + 1)
    int32[S]                tokens per sequence
    int64[S]                byte offset of each sequence in .bin
    int64[D]                document index: sequence number where each document starts, then S

``.bin`` is the token ids of all sequences back to back. Here one document is one sequence.
FleetX/PaddleNLP writes ``PREFIX_ids.npy`` (all ids) + ``PREFIX_idx.npz`` (``lens`` per sequence,
``docs`` like the document index); :class:`NpyDataset` reads it with the same interface and
:func:`open_dataset` picks whichever format is present.
"""
from __future__ import annotations

import os
import struct
from array import array
from pathlib import Path
from typing import Iterable, Optional, Union

import numpy as np

from .errors import DataError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_BYTES = len(MAGIC) + 8 + 1 + 8 + 8  # 34
DTYPE_CODES: dict[int, type] = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64,
                                6: np.float64, 7: np.float32, 8: np.uint16}
CODE_OF_DTYPE = {np.dtype(v): k for k, v in DTYPE_CODES.items()}

PathLike = Union[str, os.PathLike]


def best_dtype(vocab_size: int) -> type:
    """Megatron's choice of token dtype: uint16 when ``vocab_size < 65500``, else int32."""
    return np.uint16 if vocab_size < 65500 else np.int32


def _strip_suffix(prefix: PathLike) -> str:
    prefix = os.fspath(prefix)
    for suffix in (".bin", ".idx"):
        if prefix.endswith(suffix):
            return prefix[: -len(suffix)]
    return prefix


def _fsync_close(f) -> None:
    f.flush()
    os.fsync(f.fileno())
    f.close()


class IndexedDatasetBuilder:
    """Write ``PREFIX.bin`` + ``PREFIX.idx`` under temporary names; :meth:`finalize` renames them.

    ``.bin`` is renamed first and ``.idx`` last, after any old ``.idx`` was removed, so an
    ``.idx`` under the final name always belongs to a complete ``.bin``. Use it as a context
    manager to delete the temporary files when an exception escapes.
    """

    def __init__(self, prefix: PathLike, dtype=np.uint16):
        self.prefix = _strip_suffix(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODE_OF_DTYPE:
            raise ValueError(f"dtype {self.dtype} has no Megatron code; use one of "
                             f"{sorted(str(np.dtype(d)) for d in DTYPE_CODES.values())}")
        self.bin_path = self.prefix + ".bin"
        self.idx_path = self.prefix + ".idx"
        # Fixed temporary names: a rerun after a crash overwrites the leftovers.
        self._bin_tmp = self.bin_path + ".tmp"
        self._idx_tmp = self.idx_path + ".tmp"
        Path(self.bin_path).parent.mkdir(parents=True, exist_ok=True)
        self._bin = open(self._bin_tmp, "wb")
        self._sizes = array("i")
        self._limits = (np.iinfo(self.dtype).min, np.iinfo(self.dtype).max) if self.dtype.kind in "iu" else None
        self.num_tokens = 0
        self._done = False

    def __len__(self) -> int:
        return len(self._sizes)

    def add_document(self, token_ids: Iterable[int]) -> None:
        """Append one document (stored as one sequence)."""
        ids = np.asarray(token_ids)
        if ids.ndim != 1:
            raise ValueError(f"a document must be a 1-D sequence of ids, got shape {ids.shape}")
        if self._limits is not None and ids.size and (ids.min() < self._limits[0] or ids.max() > self._limits[1]):
            raise DataError(f"token id out of range for {self.dtype} (ids {ids.min()}..{ids.max()}); "
                            "use dtype=int32 for vocabularies of 65,500 tokens or more")
        self._bin.write(ids.astype(self.dtype, copy=False).tobytes(order="C"))
        self._sizes.append(ids.size)
        self.num_tokens += ids.size

    def finalize(self) -> tuple[str, str]:
        """Write the index and move both files to their final names; returns (bin, idx) paths."""
        _fsync_close(self._bin)
        sizes = np.frombuffer(self._sizes, dtype=np.int32) if len(self._sizes) else np.zeros(0, np.int32)
        pointers = np.zeros(len(sizes), dtype=np.int64)
        if len(sizes) > 1:
            np.cumsum(sizes[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        doc_idx = np.arange(len(sizes) + 1, dtype=np.int64)
        with open(self._idx_tmp, "wb") as f:
            f.write(MAGIC)
            f.write(struct.pack("<Q", VERSION))
            f.write(struct.pack("<B", CODE_OF_DTYPE[self.dtype]))
            f.write(struct.pack("<Q", len(sizes)))
            f.write(struct.pack("<Q", len(doc_idx)))
            f.write(sizes.astype("<i4").tobytes())
            f.write(pointers.astype("<i8").tobytes())
            f.write(doc_idx.astype("<i8").tobytes())
            f.flush()
            os.fsync(f.fileno())
        if os.path.exists(self.idx_path):
            os.unlink(self.idx_path)
        os.replace(self._bin_tmp, self.bin_path)
        os.replace(self._idx_tmp, self.idx_path)
        self._done = True
        return self.bin_path, self.idx_path

    def abort(self) -> None:
        """Close and delete the temporary files (the final names are never touched)."""
        if not self._bin.closed:
            try:
                self._bin.close()
            except OSError:  # its buffer could not be flushed (a full device): the file goes anyway
                pass
        for p in (self._bin_tmp, self._idx_tmp):
            if os.path.exists(p):
                os.unlink(p)
        self._done = True

    def __enter__(self) -> "IndexedDatasetBuilder":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None or not self._done:
            self.abort()


class _TokenSequences:
    """Shared reading logic over ``_tokens`` (flat ids), ``sizes`` and ``_starts`` (in tokens)."""

    _tokens: np.ndarray
    sizes: np.ndarray
    doc_idx: np.ndarray
    _starts: np.ndarray
    path: str

    def __len__(self) -> int:
        return len(self.sizes)

    @property
    def dtype(self) -> np.dtype:
        """Token dtype on disk."""
        return self._tokens.dtype

    @property
    def num_tokens(self) -> int:
        """Total number of tokens."""
        return int(self.sizes.sum(dtype=np.int64))

    def token_counts(self, vocab_size: int, chunk: int = 1 << 22) -> np.ndarray:
        """How often each id occurs over every sequence: (vocab_size,) int64, ``chunk`` tokens
        counted at a time. An id outside [0, vocab_size) raises ``DataError``."""
        counts = np.zeros(vocab_size, np.int64)
        parts, held = [], 0

        def flush():
            ids = np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)
            if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
                raise DataError(f"{self.path} holds token ids outside 0..{vocab_size - 1} (another tokenizer's?)")
            counts[:] += np.bincount(ids, minlength=vocab_size)
            parts.clear()

        for i in range(len(self)):
            parts.append(self.get(i))
            held += int(self.sizes[i])
            if held >= chunk:
                flush()
                held = 0
        flush()
        return counts

    def _check(self, idx: int) -> int:
        n = len(self)
        if not -n <= idx < n:
            raise IndexError(f"sequence {idx} out of range for {self.path} ({n} sequences)")
        return idx + n if idx < 0 else idx

    def __getitem__(self, idx):
        """Ids of sequence ``idx`` (read-only view), or a list of them for a contiguous slice."""
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise ValueError("slices of an indexed dataset must be contiguous")
            return [self.get(i) for i in range(start, stop)]
        return self.get(int(idx))

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        """Ids ``[offset, offset + length)`` of sequence ``idx`` (to its end when length is None)."""
        idx = self._check(int(idx))
        size = int(self.sizes[idx])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"tokens [{offset}, {offset + length}) out of range for sequence {idx} "
                             f"of {self.path} ({size} tokens)")
        start = int(self._starts[idx]) + offset
        return self._tokens[start:start + length]


class IndexedDataset(_TokenSequences):
    """Read a Megatron ``PREFIX.bin`` + ``PREFIX.idx`` pair through np.memmap."""

    def __init__(self, prefix: PathLike):
        self.prefix = _strip_suffix(prefix)
        self.path = self.idx_path = self.prefix + ".idx"
        self.bin_path = self.prefix + ".bin"
        for p in (self.idx_path, self.bin_path):
            if not os.path.isfile(p):
                raise DataError(f"{p} not found; is {self.prefix!r} the prefix of a dataset written by "
                                "`gptc preprocess` (it names files PREFIX_text_document.bin/.idx)?")
        idx_size = os.path.getsize(self.idx_path)
        with open(self.idx_path, "rb") as f:
            header = f.read(HEADER_BYTES)
        if not (MAGIC.startswith(header) if len(header) < len(MAGIC) else header.startswith(MAGIC)):
            raise DataError(f"{self.idx_path}: not a Megatron index file (bad magic "
                            f"{header[:len(MAGIC)]!r}, expected {MAGIC!r})")
        if len(header) < HEADER_BYTES:
            raise DataError(f"{self.idx_path}: truncated ({idx_size} bytes, the header alone is "
                            f"{HEADER_BYTES}); rerun preprocessing")
        version, code, n_seq, n_doc = struct.unpack("<QBQQ", header[len(MAGIC):])
        if version != VERSION:
            raise DataError(f"{self.idx_path}: index version {version}, only version {VERSION} is supported")
        if code not in DTYPE_CODES:
            raise DataError(f"{self.idx_path}: unknown dtype code {code} (known: {sorted(DTYPE_CODES)})")
        expected = HEADER_BYTES + n_seq * (4 + 8) + n_doc * 8
        # Megatron's multimodal variant appends one int8 mode per sequence; the modes are ignored.
        if idx_size not in (expected, expected + n_seq):
            state = "truncated" if idx_size < expected else "longer than its header says"
            raise DataError(f"{self.idx_path}: {state} ({idx_size} bytes, header implies {expected} "
                            f"for {n_seq} sequences and {n_doc} document entries); rerun preprocessing")
        index = np.memmap(self.idx_path, mode="r", dtype=np.uint8)
        off = HEADER_BYTES
        self.sizes = index[off:off + 4 * n_seq].view("<i4")
        off += 4 * n_seq
        self.pointers = index[off:off + 8 * n_seq].view("<i8")
        off += 8 * n_seq
        self.doc_idx = index[off:off + 8 * n_doc].view("<i8")
        if n_doc == 0 or self.doc_idx[0] != 0 or self.doc_idx[-1] != n_seq:
            raise DataError(f"{self.idx_path}: corrupt document index (must run from 0 to {n_seq})")
        dtype = np.dtype(DTYPE_CODES[code])
        bin_size = os.path.getsize(self.bin_path)
        need = int(self.pointers[-1]) + int(self.sizes[-1]) * dtype.itemsize if n_seq else 0
        if bin_size != need:
            raise DataError(f"{self.bin_path}: {bin_size} bytes but {self.idx_path} describes {need}; "
                            "the pair is incomplete or mismatched, rerun preprocessing")
        if bin_size == 0:
            self._tokens = np.zeros(0, dtype=dtype)
        else:
            self._tokens = np.memmap(self.bin_path, mode="r", dtype=dtype)
        # Pointers are bytes; sequences are contiguous, so token starts follow from them.
        self._starts = self.pointers // dtype.itemsize

    def __getstate__(self) -> dict:
        # Reopen by path in a worker process instead of pickling the mapped arrays.
        return {"prefix": self.prefix}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["prefix"])

    @staticmethod
    def exists(prefix: PathLike) -> bool:
        """True when both ``PREFIX.idx`` and ``PREFIX.bin`` exist."""
        p = _strip_suffix(prefix)
        return os.path.isfile(p + ".idx") and os.path.isfile(p + ".bin")

    def __repr__(self) -> str:
        return f"IndexedDataset({self.prefix!r}, sequences={len(self)}, dtype={self.dtype})"


class NpyDataset(_TokenSequences):
    """Read FleetX/PaddleNLP's ``PREFIX_ids.npy`` + ``PREFIX_idx.npz`` (``lens``, ``docs``)."""

    def __init__(self, prefix: PathLike):
        self.prefix = os.fspath(prefix)
        self.path = self.ids_path = self.prefix + "_ids.npy"
        self.idx_path = self.prefix + "_idx.npz"
        for p in (self.ids_path, self.idx_path):
            if not os.path.isfile(p):
                raise DataError(f"{p} not found")
        try:
            self._tokens = np.load(self.ids_path, mmap_mode="r")
            with np.load(self.idx_path) as idx:
                if "lens" not in idx:
                    raise DataError(f"{self.idx_path}: no 'lens' array (found {sorted(idx.files)})")
                self.sizes = np.asarray(idx["lens"], dtype=np.int32)
                docs = idx["docs"] if "docs" in idx else np.arange(len(self.sizes) + 1)
                self.doc_idx = np.asarray(docs, dtype=np.int64)
        except (ValueError, OSError, EOFError) as e:
            raise DataError(f"cannot read {self.prefix}_ids.npy/_idx.npz: {e}") from None
        if self._tokens.ndim != 1 or int(self.sizes.sum(dtype=np.int64)) != len(self._tokens):
            raise DataError(f"{self.ids_path}: holds {self._tokens.size} ids but {self.idx_path} 'lens' "
                            f"sum to {int(self.sizes.sum(dtype=np.int64))}")
        self._starts = np.zeros(len(self.sizes), dtype=np.int64)
        if len(self.sizes) > 1:
            np.cumsum(self.sizes[:-1], dtype=np.int64, out=self._starts[1:])

    @staticmethod
    def exists(prefix: PathLike) -> bool:
        """True when both ``PREFIX_ids.npy`` and ``PREFIX_idx.npz`` exist."""
        p = os.fspath(prefix)
        return os.path.isfile(p + "_ids.npy") and os.path.isfile(p + "_idx.npz")

    def __repr__(self) -> str:
        return f"NpyDataset({self.prefix!r}, sequences={len(self)}, dtype={self.dtype})"


def open_dataset(prefix: PathLike) -> _TokenSequences:
    """Open ``PREFIX.bin/.idx`` (Megatron) or ``PREFIX_ids.npy/_idx.npz`` (FleetX), whichever exists."""
    p = _strip_suffix(prefix)
    if os.path.isfile(p + ".idx"):
        return IndexedDataset(p)
    if NpyDataset.exists(p):
        return NpyDataset(p)
    raise DataError(f"no dataset at prefix {p!r}: looked for {p}.idx + {p}.bin (Megatron) and "
                    f"{p}_ids.npy + {p}_idx.npz (FleetX); note `gptc preprocess --output-prefix X` "
                    "writes X_text_document.bin/.idx")
