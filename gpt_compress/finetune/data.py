"""Finetuning data: JSONL rows -> token examples with a response-only loss -> batches.

**Rows.** One JSON object a line. A prompt/response row has a prompt field (``src``, else
ModelScope's ``src_txt``; or ``Finetune.prompt_template`` formatted with the row's fields, e.g.
``"《{title}》{author}\\n"``) and a response field (``tgt``, else ``tgt_txt``); names are
configurable. A row with no response field is continuation text (``text``, else ``src_txt``).
A row that is not a JSON object, lacks a field or has an empty response is a ``DataError``
naming ``file:line``.

**Examples.** ``tokens = prompt + response + [EOD]``; the loss covers the response tokens and
the EOD (a model learns to stop), never the prompt. Continuation text is
``[EOD] + text + [EOD]`` with the loss on everything after the leading EOD.

**Truncation rule** (``max_tokens = seq_length + 1`` tokens give ``seq_length`` positions):
a prompt/response example longer than that keeps its response (+EOD) whole when the prompt
can still keep ``min(len(prompt), max_tokens // 2)`` tokens; otherwise the response is cut at
its end (losing its EOD) to leave the prompt that many. The prompt is cut at its start (the
response follows the prompt's end). Continuation text is not truncated but split into pieces
of ``max_tokens`` tokens that share one token, so every token is a target exactly once.
``TruncationStats`` counts every case; `gptc finetune` reports it.

**Fixed-length prompts** (``Finetune.prompt_tokens`` = N > 0, ``fixed_prompt``): every prompt is
left-filled with EOD tokens (or cut at its start) to exactly N tokens, in training and in
generation alike, so every response starts at position N. A GPT with learned absolute position
embeddings then sees a response's structure at fixed positions; a small one learns, e.g., the
5- or 7-character lines of Tang verse from that, where with prompts of varying length it would
have to count characters from the last line end, which it does not learn in a short finetune
(README "Finetuning for generation"). The finetuned checkpoint records N (``config.json``
``prompt_tokens``; its export's manifest too), and every text prompt given to it (`gptc generate`,
`gptc infer`, ``Generator``, `gptc serve`) goes through ``encode_prompts`` (``data/tokenizer.py``) with N; token-id
prompts are used as given.

**Batches.** ``pack``: examples (in a seeded order) are packed first-fit into rows of
``seq_length`` positions; ``segment_ids`` keep each example's attention inside itself and
``position_ids`` restart at 0 per example, so a packed row computes exactly what the examples
would alone. ``group``: examples sorted by length within seeded windows of 64 batches, one
right-padded micro-batch each. Either way the micro-batches are fixed once and visited in a
per-epoch seeded order, so ``consumed_samples`` resumes the exact position.
"""
from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence

import numpy as np

from ..data.tokenizer import fixed_prompt
from ..errors import ConfigError, DataError
from ..config import FinetuneConfig

IGNORE_INDEX = -100
PROMPT_FIELDS, RESPONSE_FIELDS, TEXT_FIELDS = ("src", "src_txt"), ("tgt", "tgt_txt"), ("text", "src_txt")


@dataclass
class Row:
    """One JSONL row: prompt and response text (prompt None: continuation text), and where it is."""

    prompt: Optional[str]
    response: str
    where: str  # "file:line"


@dataclass
class Example:
    """Token ids and the index of the first token that is a training target."""

    tokens: list[int]
    first_target: int
    where: str = ""

    @property
    def positions(self) -> int:
        """Input positions the example occupies (``len(tokens) - 1``)."""
        return len(self.tokens) - 1


@dataclass
class TruncationStats:
    """What the truncation rule did (see the module docstring)."""

    examples: int = 0  # examples produced
    truncated_prompts: int = 0  # prompts cut at the start
    truncated_responses: int = 0  # responses cut at the end (EOD lost)
    dropped_prompt_tokens: int = 0
    dropped_response_tokens: int = 0
    split_texts: int = 0  # continuation texts split into several pieces
    extra_pieces: int = 0  # pieces beyond the first of split texts


def _pick(row: dict, configured: str, defaults: Sequence[str]) -> Optional[str]:
    """The field name to read: the configured one if given, else the first default present."""
    if configured:
        return configured if configured in row else None
    return next((f for f in defaults if f in row), None)


def read_rows(path: str, cfg: FinetuneConfig) -> list[Row]:
    """Rows of a JSONL file; malformed rows raise ``DataError`` with ``path:line``."""
    if not os.path.isfile(path):
        raise DataError(f"finetuning data {path} not found")
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{n}"
            try:
                obj = json.loads(line)
            except ValueError as e:
                raise DataError(f"{where}: not valid JSON ({e})") from None
            if not isinstance(obj, dict):
                raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
            rows.append(_row(obj, cfg, where))
    if not rows:
        raise DataError(f"{path}: no rows")
    return rows


def hold_out(rows: Sequence[Row], n: int, shuffle_seed: int = -1) -> tuple[list[Row], list[Row]]:
    """(training rows, the last ``n`` rows held out for evaluation); with ``shuffle_seed`` >= 0 the
    rows are shuffled first (``random.Random(seed).shuffle``), so that a file ordered by kind (the
    Tang poems are sorted by form) does not hold out a single kind."""
    if n >= len(rows):
        raise ConfigError(f"Finetune.eval_holdout {n} leaves no training rows of {len(rows)}")
    rows = list(rows)
    if shuffle_seed >= 0:
        random.Random(shuffle_seed).shuffle(rows)
    return rows[:-n], rows[-n:]


def _text(obj: dict, key: str, where: str) -> str:
    val = obj[key]
    if not isinstance(val, str):
        raise DataError(f"{where}: field {key!r} must be a string, got {type(val).__name__}")
    return val


def _row(obj: dict, cfg: FinetuneConfig, where: str) -> Row:
    fields = ", ".join(sorted(obj)) or "none"
    resp_key = _pick(obj, cfg.response_field, RESPONSE_FIELDS)
    if resp_key is None and (cfg.response_field or cfg.prompt_template or cfg.prompt_field):
        want = cfg.response_field or "/".join(RESPONSE_FIELDS)
        raise DataError(f"{where}: no response field {want!r} (fields: {fields}); set Finetune.response_field")
    if resp_key is None:  # continuation text
        key = _pick(obj, cfg.text_field, TEXT_FIELDS)
        if key is None:
            raise DataError(f"{where}: no prompt/response ({'/'.join(PROMPT_FIELDS)} + {'/'.join(RESPONSE_FIELDS)}) "
                            f"or text ({cfg.text_field or '/'.join(TEXT_FIELDS)}) field (fields: {fields}); "
                            "set Finetune.prompt_field/response_field or text_field")
        text = _text(obj, key, where)
        if not text.strip():
            raise DataError(f"{where}: field {key!r} is empty")
        return Row(None, text, where)
    response = _text(obj, resp_key, where)
    if not response.strip():
        raise DataError(f"{where}: response field {resp_key!r} is empty")
    if cfg.prompt_template:
        try:
            prompt = cfg.prompt_template.format(**obj)
        except KeyError as e:
            raise DataError(f"{where}: Finetune.prompt_template needs field {e.args[0]!r} "
                            f"(fields: {fields})") from None
        except (AttributeError, IndexError, TypeError, ValueError) as e:
            raise DataError(f"{where}: Finetune.prompt_template {cfg.prompt_template!r} does not apply to "
                            f"this row ({e})") from None
    else:
        key = _pick(obj, cfg.prompt_field, PROMPT_FIELDS)
        if key is None:
            want = cfg.prompt_field or "/".join(PROMPT_FIELDS)
            raise DataError(f"{where}: no prompt field {want!r} (fields: {fields}); set Finetune.prompt_field "
                            "or Finetune.prompt_template")
        prompt = _text(obj, key, where)
    if not prompt:
        raise DataError(f"{where}: the prompt is empty")
    return Row(prompt, response, where)


def encode_rows(tokenizer, rows: Sequence[Row], seq_length: int,
                prompt_tokens: int = 0) -> tuple[list[Example], TruncationStats]:
    """Examples of at most ``seq_length + 1`` tokens under the truncation rule, and its counts;
    ``prompt_tokens`` > 0 fixes every prompt's length first (``fixed_prompt``; a cut counts as a
    truncated prompt)."""
    eod, max_tokens = tokenizer.eod_id, seq_length + 1
    if prompt_tokens > max_tokens // 2:
        raise ConfigError(f"Finetune.prompt_tokens {prompt_tokens} must be at most half of Data.seq_length + 1 "
                          f"({max_tokens // 2})")
    stats, out = TruncationStats(), []
    prompts = tokenizer.encode_batch([r.prompt or "" for r in rows])
    responses = tokenizer.encode_batch([r.response for r in rows])
    for row, p, r in zip(rows, prompts, responses):
        r = r + [eod]
        if row.prompt is None:  # continuation: pieces sharing one token
            toks = [eod] + r
            pieces = [toks[i:i + max_tokens] for i in range(0, max(len(toks) - 1, 1), max_tokens - 1)]
            if len(pieces) > 1:
                stats.split_texts += 1
                stats.extra_pieces += len(pieces) - 1
            out += [Example(piece, 1, row.where) for piece in pieces if len(piece) > 1]
            continue
        if not p:
            raise DataError(f"{row.where}: the prompt encodes to no tokens")
        if prompt_tokens:
            if len(p) > prompt_tokens:
                stats.truncated_prompts += 1
                stats.dropped_prompt_tokens += len(p) - prompt_tokens
            p = fixed_prompt(p, prompt_tokens, eod)
        if len(p) + len(r) > max_tokens:
            keep_p = max(max_tokens - len(r), min(len(p), max_tokens // 2))
            keep_r = max_tokens - keep_p
            if keep_p < len(p):
                stats.truncated_prompts += 1
                stats.dropped_prompt_tokens += len(p) - keep_p
                p = p[len(p) - keep_p:]
            if keep_r < len(r):
                stats.truncated_responses += 1
                stats.dropped_response_tokens += len(r) - keep_r
                r = r[:keep_r]
        out.append(Example(p + r, len(p), row.where))
    stats.examples = len(out)
    return out, stats


def example_arrays(ex: Example) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, labels) int64 of length ``ex.positions``; labels are IGNORE_INDEX on the prompt."""
    toks = np.asarray(ex.tokens, dtype=np.int64)
    labels = toks[1:].copy()
    labels[: max(ex.first_target - 1, 0)] = IGNORE_INDEX
    return toks[:-1], labels


def collate_packed(rows: Sequence[Sequence[Example]], seq_length: int, pad_id: int) -> dict:
    """Packed rows -> input_ids, labels, position_ids, segment_ids (B, seq_length) int64.
    Segments count from 1; the padded tail is segment 0 with no targets."""
    b = len(rows)
    ids = np.full((b, seq_length), pad_id, dtype=np.int64)
    labels = np.full((b, seq_length), IGNORE_INDEX, dtype=np.int64)
    pos = np.zeros((b, seq_length), dtype=np.int64)
    seg = np.zeros((b, seq_length), dtype=np.int64)
    for i, row in enumerate(rows):
        at = 0
        for s, ex in enumerate(row, 1):
            x, y = example_arrays(ex)
            n = len(x)
            ids[i, at:at + n], labels[i, at:at + n] = x, y
            pos[i, at:at + n], seg[i, at:at + n] = np.arange(n), s
            at += n
    return {"input_ids": ids, "labels": labels, "position_ids": pos, "segment_ids": seg}


def collate_padded(examples: Sequence[Example], pad_id: int) -> dict:
    """Right-padded input_ids, labels and attention_mask (B, longest) int64."""
    width = max(ex.positions for ex in examples)
    b = len(examples)
    ids = np.full((b, width), pad_id, dtype=np.int64)
    labels = np.full((b, width), IGNORE_INDEX, dtype=np.int64)
    mask = np.zeros((b, width), dtype=np.int64)
    for i, ex in enumerate(examples):
        x, y = example_arrays(ex)
        ids[i, :len(x)], labels[i, :len(x)], mask[i, :len(x)] = x, y, 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def pack(examples: Sequence[Example], seq_length: int, order: Sequence[int]) -> list[list[Example]]:
    """First-fit packing of ``examples`` (visited in ``order``) into rows of ``seq_length`` positions."""
    rows: list[list[Example]] = []
    room: list[int] = []
    for i in order:
        ex = examples[int(i)]
        k = next((j for j, r in enumerate(room) if r >= ex.positions), None)
        if k is None:
            rows.append([ex])
            room.append(seq_length - ex.positions)
        else:
            rows[k].append(ex)
            room[k] -= ex.positions
    return rows


@dataclass
class BatchPlan:
    """Fixed micro-batches (lists of packed rows or of examples) and how to collate them."""

    batches: list = field(default_factory=list)  # pack: lists of rows; group: lists of examples
    mode: str = "pack"
    seq_length: int = 0
    pad_id: int = 0
    units: int = 0  # rows (pack) or examples (group): what one "sample" of Engine's batch sizes is

    def collate(self, batch) -> dict:
        """The arrays of one planned micro-batch."""
        if self.mode == "pack":
            return collate_packed(batch, self.seq_length, self.pad_id)
        return collate_padded(batch, self.pad_id)

    @property
    def real_tokens(self) -> int:
        """Non-padding positions over all batches."""
        return sum(ex.positions for b in self.batches for ex in (
            [e for row in b for e in row] if self.mode == "pack" else b))


def plan_batches(examples: Sequence[Example], mode: str, micro: int, seq_length: int, pad_id: int,
                 seed: int, shuffle: bool = True) -> BatchPlan:
    """Micro-batches of ``micro`` units (packed rows or length-grouped examples)."""
    if not examples:
        raise DataError("no finetuning examples")
    order = np.random.RandomState(seed).permutation(len(examples)) if shuffle else np.arange(len(examples))
    if mode == "pack":
        units = pack(examples, seq_length, order)
    else:
        window = 64 * micro
        units = []
        for start in range(0, len(order), window):
            chunk = [examples[int(i)] for i in order[start:start + window]]
            units += sorted(chunk, key=lambda e: e.positions) if shuffle else chunk
    batches = [units[i:i + micro] for i in range(0, len(units), micro)]
    return BatchPlan(batches, mode, seq_length, pad_id, len(units))


class PlanIterator:
    """Micro-batches of a ``BatchPlan`` over epochs from sample ``consumed``: epoch e visits the
    batches in permutation ``seed + e``; the micro-batch index is ``consumed // micro``."""

    def __init__(self, plan: BatchPlan, micro: int, seed: int, consumed: int = 0):
        self.plan, self.micro, self.seed = plan, micro, seed
        self.index = consumed // micro
        self._epoch, self._perm = -1, None

    def __iter__(self) -> Iterator[dict]:
        return self

    def __next__(self) -> dict:
        epoch, pos = divmod(self.index, len(self.plan.batches))
        if epoch != self._epoch:
            self._perm = np.random.RandomState(self.seed + epoch).permutation(len(self.plan.batches))
            self._epoch = epoch
        self.index += 1
        return self.plan.collate(self.plan.batches[int(self._perm[pos])])
