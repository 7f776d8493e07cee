"""GPT pretraining samples over indexed datasets, with Megatron GPTDataset semantics.

A split's documents are repeated for as many epochs as ``num_samples`` needs, each epoch in
its own seeded order (``doc_idx``). The resulting token stream is cut into samples of
``seq_length + 1`` tokens that cross document boundaries; consecutive samples share one
token, so every token is a label exactly once (``sample_idx``). Samples are then visited in a
seeded random order (``shuffle_idx``); as in Megatron, a final epoch used for less than 80%
is shuffled separately so its partial coverage does not mix into earlier epochs.

Unlike Megatron, which shuffles the concatenation of all epochs at once, each epoch is
permuted on its own: epoch ``e``'s order depends only on ``seed`` and ``e``. Index arrays
are built in memory with vectorised numpy (well under a second per million samples), so no
cache files are written.
"""
from __future__ import annotations

import math
import os
from typing import Iterator, Optional, Sequence, Union

import numpy as np

from .errors import DataError
from .indexed import open_dataset

# Megatron: shuffle the last epoch separately when less than this fraction of it is used.
SEPARATE_LAST_EPOCH_BELOW = 0.80


def split_documents(num_docs: int, split: Union[str, Sequence[float]] = (949, 50, 1)) -> list[range]:
    """Train/valid/test document ranges, as Megatron's ``get_train_valid_test_split_``."""
    if isinstance(split, str):
        sep = "," if "," in split else "/"
        try:
            split = [float(s) for s in split.split(sep)]
        except ValueError:
            raise DataError(f"split {split!r} is not a list of numbers like '949,50,1'") from None
    weights = [float(s) for s in split][:3]
    weights += [0.0] * (3 - len(weights))
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise DataError(f"split {split!r} must be non-negative numbers with a positive sum")
    total = sum(weights)
    bounds = [0]
    for w in weights:
        bounds.append(bounds[-1] + int(round(w / total * num_docs)))
    # Megatron shifts every boundary but the first by the rounding excess, fixing the end.
    diff = bounds[-1] - num_docs
    bounds = [bounds[0]] + [max(b - diff, 0) for b in bounds[1:]]
    return [range(bounds[i], bounds[i + 1]) for i in range(3)]


class GPTDataset:
    """``num_samples`` samples of ``seq_length`` input/label tokens from ``documents`` of ``indexed``."""

    def __init__(self, indexed, documents: Sequence[int], num_samples: Optional[int], seq_length: int,
                 seed: int = 1234, shuffle: bool = True, name: str = "train"):
        self.indexed = indexed
        self.documents = np.asarray(documents, dtype=np.int64)
        self.seq_length = int(seq_length)
        self.seed = seed
        self.name = name
        where = f"{name} split of {getattr(indexed, 'path', indexed)}"
        if len(self.documents) == 0:
            n_docs = len(getattr(indexed, "sizes", ()))
            hint = (" (a plain-text file is one document: preprocess it with `gptc preprocess --split-paragraphs` "
                    "to make each blank-line-separated block a document, or give several files)"
                    if n_docs < 20 else "")
            raise DataError(f"the {where} has no documents of the {n_docs} in the dataset; change Data.split or "
                            f"add data{hint}")
        if self.seq_length < 1:
            raise DataError(f"seq_length must be positive, got {seq_length}")
        tokens_per_epoch = int(np.asarray(indexed.sizes)[self.documents].sum(dtype=np.int64))
        if tokens_per_epoch < 2:
            raise DataError(f"the {where} has {tokens_per_epoch} tokens; a sample needs at least 2")
        if num_samples is None:
            num_samples = (tokens_per_epoch - 1) // self.seq_length
        if num_samples < 1:
            raise DataError(f"the {where} gives no sample of {self.seq_length + 1} tokens from "
                            f"{tokens_per_epoch} tokens; lower Data.seq_length or add data")
        self.num_samples = int(num_samples)
        # Enough epochs that (epochs * tokens - 1) // seq_length >= num_samples.
        self.num_epochs = max(1, math.ceil((self.num_samples * self.seq_length + 1) / tokens_per_epoch))
        self.tokens_per_epoch = tokens_per_epoch
        rng = np.random.RandomState(seed)
        self.doc_idx = self._build_doc_idx(rng, shuffle)
        self.sample_idx = self._build_sample_idx()
        self.shuffle_idx = self._build_shuffle_idx(rng, shuffle)

    def _build_doc_idx(self, rng: np.random.RandomState, shuffle: bool) -> np.ndarray:
        """(epochs * docs,) document ids in visiting order, each epoch permuted separately."""
        epochs = [rng.permutation(self.documents) if shuffle else self.documents
                  for _ in range(self.num_epochs)]
        return np.concatenate(epochs).astype(np.int64)

    def _build_sample_idx(self) -> np.ndarray:
        """(total_samples + 1, 2): position in doc_idx and token offset where each sample starts."""
        sizes = np.asarray(self.indexed.sizes)[self.doc_idx].astype(np.int64)
        ends = np.cumsum(sizes)
        total = (int(ends[-1]) - 1) // self.seq_length
        starts = np.arange(total + 1, dtype=np.int64) * self.seq_length
        # side="right" skips empty documents: the first document whose end lies past the start.
        pos = np.searchsorted(ends, starts, side="right")
        offsets = starts - (ends[pos] - sizes[pos])
        return np.stack([pos, offsets], axis=1)

    def _build_shuffle_idx(self, rng: np.random.RandomState, shuffle: bool) -> np.ndarray:
        """Sample visiting order; the tail of a little-used last epoch is shuffled on its own."""
        total = len(self.sample_idx) - 1
        if not shuffle:
            return np.arange(total, dtype=np.int64)
        first = total
        if self.num_epochs > 1:
            before_last = ((self.num_epochs - 1) * self.tokens_per_epoch - 1) // self.seq_length
            per_epoch = (self.tokens_per_epoch - 1) // self.seq_length
            if self.num_samples - before_last < int(SEPARATE_LAST_EPOCH_BELOW * per_epoch):
                first = before_last
        head = rng.permutation(first)
        tail = first + rng.permutation(total - first)
        return np.concatenate([head, tail]).astype(np.int64)

    def __len__(self) -> int:
        return self.num_samples

    def tokens(self, sample: int) -> np.ndarray:
        """The ``seq_length + 1`` tokens of unshuffled sample ``sample`` (int64)."""
        pos, offset = (int(v) for v in self.sample_idx[sample])
        need, parts = self.seq_length + 1, []
        while need > 0:
            doc = int(self.doc_idx[pos])
            take = min(need, int(self.indexed.sizes[doc]) - offset)
            if take > 0:
                parts.append(self.indexed.get(doc, offset, take))
                need -= take
            pos, offset = pos + 1, 0
        return np.concatenate(parts).astype(np.int64)

    def __getitem__(self, i: int) -> dict:
        """Sample ``i`` in shuffled order: ``input_ids`` and next-token ``labels``, int64[seq_length]."""
        if not -self.num_samples <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range for the {self.name} dataset ({self.num_samples})")
        tokens = self.tokens(int(self.shuffle_idx[i % self.num_samples]))
        return {"input_ids": tokens[:-1], "labels": tokens[1:]}


class BlendedDataset:
    """Mix datasets by weight with Megatron's greedy rule: take from the one lagging its share most."""

    def __init__(self, datasets: Sequence, weights: Sequence[float], num_samples: int):
        if len(datasets) != len(weights) or not datasets:
            raise DataError(f"need one weight per dataset, got {len(weights)} weights for "
                            f"{len(datasets)} datasets")
        w = np.asarray([float(x) for x in weights], dtype=np.float64)
        if (w < 0).any() or w.sum() <= 0:
            raise DataError(f"blend weights must be non-negative with a positive sum, got {list(weights)}")
        self.datasets = list(datasets)
        self.weights = w / w.sum()
        self.num_samples = int(num_samples)
        self.dataset_index, self.dataset_sample_index = self._build(self.weights, self.num_samples)
        counts = np.bincount(self.dataset_index, minlength=len(datasets))
        for k, (ds, n) in enumerate(zip(self.datasets, counts)):
            if n > len(ds):
                raise DataError(f"blend component {k} has {len(ds)} samples but the blend takes {n}; "
                                "build it with more samples")

    @staticmethod
    def _build(weights: np.ndarray, num_samples: int) -> tuple[np.ndarray, np.ndarray]:
        taken = [0] * len(weights)
        wl = weights.tolist()
        which = np.empty(num_samples, dtype=np.int16)
        nth = np.empty(num_samples, dtype=np.int64)
        for s in range(num_samples):
            # Megatron uses max(s, 1) so the first pick already follows the weights.
            target = max(s, 1)
            best, best_err = 0, wl[0] * target - taken[0]
            for k in range(1, len(wl)):
                err = wl[k] * target - taken[k]
                if err > best_err:
                    best, best_err = k, err
            which[s] = best
            nth[s] = taken[best]
            taken[best] += 1
        return which, nth

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> dict:
        """Sample ``i``: the ``dataset_sample_index[i]``-th sample of dataset ``dataset_index[i]``."""
        return self.datasets[int(self.dataset_index[i])][int(self.dataset_sample_index[i])]


def parse_blend(data_prefix: Sequence) -> tuple[list[str], Optional[list[float]]]:
    """``["P"]`` or ``["w1", "P1", "w2", "P2", ...]`` -> (prefixes, weights or None)."""
    items = [os.fspath(x) if isinstance(x, os.PathLike) else x for x in data_prefix]
    if len(items) == 1:
        return [str(items[0])], None
    if len(items) % 2:
        raise DataError(f"data_prefix {items!r}: expected one prefix or weight/prefix pairs")
    prefixes, weights = [], []
    for w, p in zip(items[0::2], items[1::2]):
        try:
            weights.append(float(w))
        except (TypeError, ValueError):
            raise DataError(f"data_prefix: {w!r} (before {p!r}) is not a weight; write "
                            "[weight1, prefix1, weight2, prefix2, ...]") from None
        prefixes.append(str(p))
    return prefixes, weights


def build_datasets(data_prefix: Sequence, split: Union[str, Sequence[float]], seq_length: int,
                   num_samples: Sequence[int], seed: int = 1234) -> tuple:
    """(train, valid, test) datasets; a split with 0 samples requested is ``None``."""
    prefixes, weights = parse_blend(data_prefix)
    names = ("train", "valid", "test")
    indexed = [open_dataset(p) for p in prefixes]

    def single(ds, k: int, n: int) -> GPTDataset:
        docs = split_documents(len(ds), split)[k]
        return GPTDataset(ds, np.arange(docs.start, docs.stop), n, seq_length, seed, name=names[k])

    out = []
    for k, n in enumerate(num_samples):
        if not n:
            out.append(None)
        elif weights is None:
            out.append(single(indexed[0], k, int(n)))
        else:
            norm = np.asarray(weights) / sum(weights)
            # Megatron's 0.5% margin: the greedy blend may take slightly more than w * n.
            parts = [single(ds, k, int(math.ceil(n * w * 1.005))) for ds, w in zip(indexed, norm)]
            out.append(BlendedDataset(parts, norm, int(n)))
    return tuple(out)


class SampleIterator:
    """Batches ``{"input_ids", "labels"}`` (int64[B, T]) in order from sample ``consumed_samples``.

    ``consumed_samples`` counts the samples of every batch handed out so far (all data-parallel
    ranks together); saving it and passing it back resumes the exact data position. With
    ``dp_size > 1`` each rank gets its slice of every global batch.
    """

    def __init__(self, dataset, batch_size: int, consumed_samples: int = 0, dp_rank: int = 0,
                 dp_size: int = 1, drop_last: bool = True):
        if batch_size % dp_size:
            raise ValueError(f"global batch_size {batch_size} is not divisible by dp_size {dp_size}")
        self.dataset = dataset
        self.batch_size = batch_size
        self.consumed_samples = int(consumed_samples)
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.drop_last = drop_last

    def __iter__(self) -> Iterator[dict]:
        return self

    def __len__(self) -> int:
        left = max(len(self.dataset) - self.consumed_samples, 0)
        return left // self.batch_size if self.drop_last else -(-left // self.batch_size)

    def __next__(self) -> dict:
        start = self.consumed_samples
        stop = min(start + self.batch_size, len(self.dataset))
        if stop <= start or (self.drop_last and stop - start < self.batch_size):
            raise StopIteration
        per_rank = (stop - start) // self.dp_size
        lo = start + self.dp_rank * per_rank
        samples = [self.dataset[i] for i in range(lo, lo + per_rank)]
        self.consumed_samples = stop
        return {key: np.stack([s[key] for s in samples]) for key in ("input_ids", "labels")}
