"""GLUE readers for the nine tasks' TSV layouts, GPT input encoding and batching.

Two file layouts are read, told apart by the header line:

* the official GLUE distribution (``train.tsv``, ``dev.tsv``; ``dev_matched.tsv`` /
  ``dev_mismatched.tsv`` for MNLI), columns by position (``TaskSpec``);
* the Hugging Face ``glue`` export (``datasets`` ``to_csv``/``to_pandas``, tab- or
  comma-separated): a header naming the columns (``sentence1 sentence2 label idx`` for RTE),
  integer labels indexing the ``glue`` dataset's label names (``HF_LAYOUTS``), mapped here to
  this module's label order (for MNLI the two orders differ).

A row with the wrong number of columns or an unknown label is a ``DataError`` naming the file
and line and both layouts.
"""
from __future__ import annotations

import csv
import os
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import numpy as np

from .errors import DataError


@dataclass(frozen=True)
class TaskSpec:
    """Where a task's fields are in its TSV rows."""

    name: str
    text_cols: tuple  # one or two column indices
    label_col: Optional[int]  # -1 means the last column
    labels: Optional[tuple]  # None: regression
    has_header: bool
    num_cols: Optional[int]  # exact column count (None: at least max index + 1)
    metrics: tuple
    dev_files: tuple = ("dev.tsv",)


TASKS: dict[str, TaskSpec] = {
    "CoLA": TaskSpec("CoLA", (3,), 1, ("0", "1"), False, 4, ("mcc",)),
    "SST-2": TaskSpec("SST-2", (0,), 1, ("0", "1"), True, 2, ("accuracy",)),
    "MRPC": TaskSpec("MRPC", (3, 4), 0, ("0", "1"), True, 5, ("accuracy", "f1")),
    "STS-B": TaskSpec("STS-B", (7, 8), -1, None, True, 10, ("pearson", "spearman")),
    "QQP": TaskSpec("QQP", (3, 4), 5, ("0", "1"), True, 6, ("accuracy", "f1")),
    "MNLI": TaskSpec("MNLI", (8, 9), -1, ("contradiction", "entailment", "neutral"), True, None, ("accuracy",),
                     ("dev_matched.tsv", "dev_mismatched.tsv")),
    "QNLI": TaskSpec("QNLI", (1, 2), 3, ("entailment", "not_entailment"), True, 4, ("accuracy",)),
    "RTE": TaskSpec("RTE", (1, 2), 3, ("entailment", "not_entailment"), True, 4, ("accuracy",)),
    "WNLI": TaskSpec("WNLI", (1, 2), 3, ("0", "1"), True, 4, ("accuracy",)),
}


# Hugging Face `glue` export: (text columns, label names in the order of the integer labels).
HF_LAYOUTS: dict[str, tuple] = {
    "CoLA": (("sentence",), ("0", "1")),  # unacceptable, acceptable
    "SST-2": (("sentence",), ("0", "1")),  # negative, positive
    "MRPC": (("sentence1", "sentence2"), ("0", "1")),  # not_equivalent, equivalent
    "STS-B": (("sentence1", "sentence2"), None),
    "QQP": (("question1", "question2"), ("0", "1")),  # not_duplicate, duplicate
    "MNLI": (("premise", "hypothesis"), ("entailment", "neutral", "contradiction")),
    "QNLI": (("question", "sentence"), ("entailment", "not_entailment")),
    "RTE": (("sentence1", "sentence2"), ("entailment", "not_entailment")),
    "WNLI": (("sentence1", "sentence2"), ("0", "1")),  # not_entailment, entailment
}


def _layouts(spec: "TaskSpec") -> str:
    """Both accepted layouts of ``spec``'s files, for error messages."""
    cols = spec.num_cols or f"at least {max(spec.text_cols + ((spec.label_col or 0),)) + 1}"
    orig = (f"original GLUE: {cols} tab-separated columns, text in column(s) "
            f"{', '.join(str(c + 1) for c in spec.text_cols)}, label "
            f"{'last' if spec.label_col == -1 else spec.label_col + 1} in {{{', '.join(spec.labels or ('a score',))}}}"
            f"{', a header line' if spec.has_header else ', no header'}")
    texts, names = HF_LAYOUTS[spec.name]
    hf = f"Hugging Face glue export: a header with {', '.join(texts)}, label (0-{len(names) - 1 if names else 'score'})"
    return f"expected the {orig}; or the {hf}"


def _hf_columns(header: list[str], spec: "TaskSpec") -> Optional[tuple]:
    """(text column indices, label column index) if ``header`` is a Hugging Face export header."""
    names = [h.strip() for h in header]
    texts, _ = HF_LAYOUTS[spec.name]
    if "label" in names and all(t in names for t in texts):
        return tuple(names.index(t) for t in texts), names.index("label")
    return None


def _read_hf(path: str, spec: "TaskSpec", delimiter: str, skip_bad_lines: bool) -> list:
    """Examples of a Hugging Face export file (header already recognised)."""
    texts, names = HF_LAYOUTS[spec.name]
    out = []
    with open(path, encoding="utf-8", newline="") as f:
        reader = csv.reader(f, delimiter=delimiter) if delimiter == "," else \
            csv.reader(f, delimiter=delimiter, quoting=csv.QUOTE_NONE)
        header = next(reader)
        text_cols, label_col = _hf_columns(header, spec)
        for n, row in enumerate(reader, 2):
            if not row or (len(row) == 1 and not row[0].strip()):
                continue
            bad, label = None, None
            if len(row) != len(header):
                bad = f"expected {len(header)} columns as the header ({', '.join(header)}), got {len(row)}"
            else:
                raw = row[label_col].strip()
                try:
                    value = float(raw)
                except ValueError:
                    value = None
                if names is None and value is not None:
                    label = value
                elif names is not None and value is not None and value.is_integer() and 0 <= value < len(names):
                    label = float(spec.labels.index(names[int(value)]))
                else:
                    bad = f"label {raw!r} is not {'a number' if names is None else f'0-{len(names) - 1}'}" + (
                        " (-1 marks the unlabelled test split)" if raw == "-1" else "")
            if bad:
                if skip_bad_lines:
                    continue
                raise DataError(f"{path}:{n}: {bad} (GLUE {spec.name}, Hugging Face layout)")
            out.append(Example(tuple(row[c] for c in text_cols), label))
    if not out:
        raise DataError(f"{path}: no examples")
    return out


def task_spec(name: str) -> TaskSpec:
    """The spec of GLUE task ``name`` (case-insensitive)."""
    for k, v in TASKS.items():
        if k.lower() == name.lower():
            return v
    raise DataError(f"unknown GLUE task {name!r}; choose one of {', '.join(TASKS)}")


@dataclass
class Example:
    """One GLUE example: one or two texts and a label index (or float score)."""

    texts: tuple
    label: float


def _is_data_row(row: list[str], spec: TaskSpec, need: int) -> bool:
    """Whether a first row is an example (its label parses) rather than the header."""
    if len(row) < need:
        return False
    raw = row[spec.label_col].strip()
    if spec.labels is not None:
        return raw in spec.labels
    try:
        float(raw)
    except ValueError:
        return False
    return True


def read_tsv(path: str, spec: TaskSpec, skip_bad_lines: bool = False) -> list[Example]:
    """Examples of one TSV file; bad rows raise ``DataError`` with file and line (or are skipped)."""
    if not os.path.isfile(path):
        raise DataError(f"{path} not found (GLUE {spec.name})")
    need = spec.num_cols or (max(spec.text_cols + ((spec.label_col or 0),)) + 1)
    with open(path, encoding="utf-8", newline="") as f:
        first = f.readline().rstrip("\r\n")
    delimiter = "\t" if "\t" in first or "," not in first else ","
    header = next(csv.reader([first], delimiter=delimiter), [])
    hf = _hf_columns(header, spec)
    # The original SST-2 / RTE headers also name their columns; they are read by position when
    # the column count and label position are the original ones.
    original = (delimiter == "\t" and spec.has_header and len(header) == spec.num_cols
                and hf is not None and hf[1] == spec.label_col % len(header))
    if hf is not None and not original:
        return _read_hf(path, spec, delimiter, skip_bad_lines)
    out = []
    with open(path, encoding="utf-8", newline="") as f:
        # GLUE TSVs are not CSV-quoted: quotes are literal characters.
        for n, row in enumerate(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE), 1):
            if n == 1 and spec.has_header and not _is_data_row(row, spec, need):
                continue  # the header (a file saved without one keeps its first example)
            if not row or (len(row) == 1 and not row[0].strip()):
                continue
            bad = None
            if (spec.num_cols and len(row) != spec.num_cols) or len(row) < need:
                bad = f"expected {spec.num_cols or f'at least {need}'} tab-separated columns, got {len(row)}"
            else:
                raw = row[spec.label_col].strip()
                if spec.labels is None:
                    try:
                        label = float(raw)
                    except ValueError:
                        bad = f"score {raw!r} is not a number"
                elif raw in spec.labels:
                    label = float(spec.labels.index(raw))
                else:
                    bad = f"label {raw!r} is not one of {', '.join(spec.labels)}"
            if bad:
                if skip_bad_lines:
                    continue
                raise DataError(f"{path}:{n}: {bad} (GLUE {spec.name}: {_layouts(spec)})")
            out.append(Example(tuple(row[c] for c in spec.text_cols), label))
    if not out:
        raise DataError(f"{path}: no examples")
    return out


def read_task(data_dir: str, task: str, split: str = "train", skip_bad_lines: bool = False) -> list[Example]:
    """``split`` is "train", "dev" (MNLI: matched) or a file name such as "dev_mismatched.tsv"."""
    spec = task_spec(task)
    name = {"train": "train.tsv", "dev": spec.dev_files[0]}.get(split, split)
    return read_tsv(os.path.join(data_dir, name), spec, skip_bad_lines)


def encode_example(tokenizer, ex: Example, max_len: int) -> list[int]:
    """``text1 <eod> [text2 <eod>]``, the longer text truncated first; the classifier pools the
    final ``<eod>`` (the last non-pad token)."""
    eod = tokenizer.eod_id
    parts = [tokenizer.encode(t.strip()) for t in ex.texts]
    budget = max_len - len(parts)
    while sum(len(p) for p in parts) > budget:
        longest = max(range(len(parts)), key=lambda i: len(parts[i]))
        parts[longest] = parts[longest][:-1]
    ids = []
    for p in parts:
        ids += p + [eod]
    return ids


def collate(seqs: Sequence[list[int]], labels: Sequence[float], pad_id: int, regression: bool) -> dict:
    """Right-padded ids (B, T), attention mask (B, T) and labels (B,)."""
    width = max(len(s) for s in seqs)
    ids = np.full((len(seqs), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(seqs), width), dtype=np.int64)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], mask[i, : len(s)] = s, 1
    lab = np.asarray(labels, dtype=np.float32 if regression else np.int64)
    return {"input_ids": ids, "attention_mask": mask, "labels": lab}


class EpochBatches:
    """Shuffled batches over epochs from sample ``consumed``; epoch e uses permutation seed+e,
    so restoring ``consumed`` resumes the exact order."""

    def __init__(self, encoded: list[list[int]], labels: list[float], batch_size: int, pad_id: int,
                 regression: bool, seed: int, consumed: int = 0):
        self.encoded, self.labels = encoded, labels
        self.batch_size, self.pad_id, self.regression, self.seed = batch_size, pad_id, regression, seed
        self.consumed = consumed
        self._perm_epoch, self._perm = -1, None

    def _index(self, k: int) -> int:
        epoch, pos = divmod(k, len(self.encoded))
        if epoch != self._perm_epoch:
            self._perm = np.random.RandomState(self.seed + epoch).permutation(len(self.encoded))
            self._perm_epoch = epoch
        return int(self._perm[pos])

    def __iter__(self) -> Iterator[dict]:
        return self

    def __next__(self) -> dict:
        idx = [self._index(k) for k in range(self.consumed, self.consumed + self.batch_size)]
        self.consumed += self.batch_size
        return collate([self.encoded[i] for i in idx], [self.labels[i] for i in idx], self.pad_id, self.regression)
