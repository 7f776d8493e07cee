"""LAMBADA last-word cloze accuracy (FleetX/Megatron ``Lambada_Eval_Dataset``, strict).

For each line of the OpenAI ``lambada_test.jsonl``: ``last_word = text.split()[-1]``, context =
the text before the last occurrence of that word (stripped), target = the tokens of
``" " + last_word``. An example is correct only if the greedy prediction equals the target
token at every target position. Also reported: FleetX's non-strict variant (only the last BPE
token of the whole text is the target), lm-evaluation-harness's split (``text.rsplit(" ", 1)``)
with its perplexity (exp of the mean per-example NLL of the continuation) and the target
perplexity (exp of the mean NLL of the strict target tokens).

All three are scored in one pass: every target ends its token sequence and the splits mostly
give the same sequence, so each distinct sequence runs once and the LM head is applied only at
the positions of its longest target (``scoring.score_positions``).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np
from tqdm import tqdm

from ..errors import DataError, InputError  # noqa: F401
from ..fileio import jsonl_strings
from .scoring import score_positions


def read_lambada(path: str, limit: int | None = None) -> list[str]:
    """Texts of a LAMBADA JSONL file; a bad line is reported with file and line number."""
    texts = []
    for n, text in jsonl_strings(path, "text"):
        if not text.split():
            raise DataError(f"{path}:{n}: empty \"text\"")
        texts.append(text)
        if limit and len(texts) >= limit:
            break
    if not texts:
        raise DataError(f"{path}: no examples")
    return texts


def split_strict(text: str) -> tuple[str, str]:
    """FleetX: (context, " " + last word) with the context cut at the word's last occurrence."""
    last = text.split()[-1]
    return text[: text.rfind(last)].strip(), " " + last


def split_harness(text: str) -> tuple[str, str]:
    """lm-evaluation-harness lambada_openai: ``text.rsplit(" ", 1)``."""
    context, last = text.rsplit(" ", 1)
    return context, " " + last


@dataclass
class LambadaResult:
    """Accuracies, target perplexity, per-example correctness and the protocol."""

    protocol: str
    num_examples: int
    seq_len: int
    accuracy: float  # strict, FleetX
    accuracy_nonstrict: float  # FleetX strict=False: last BPE token of the text
    accuracy_harness: float  # lm-evaluation-harness split
    target_ppl: float  # exp(mean NLL of strict target tokens)
    harness_ppl: float  # lm-evaluation-harness's perplexity: exp(mean per-example NLL of its continuation)
    truncated_contexts: int
    correct: list = field(default_factory=list)  # strict, per example (0/1)

    def to_dict(self, with_items: bool = False) -> dict:
        d = asdict(self)
        if not with_items:
            d.pop("correct")
        return d


def _encode_examples(tokenizer, texts, splitter, seq_len):
    out, truncated = [], 0
    for t in texts:
        context, target = splitter(t)
        c, g = tokenizer.encode(context), tokenizer.encode(target)
        if len(c) + len(g) > seq_len + 1:
            # Only happens when the model's window is shorter than LAMBADA passages (tiny models):
            # keep the end of the context, which is what the cloze depends on.
            c = c[len(c) + len(g) - seq_len - 1:]
            truncated += 1
        out.append((c, g))
    return out, truncated


def _score_sequences(backend, seqs, suffix, pad_id, batch_size, progress):
    """Per token sequence: (log p, greedy hit) of its last ``suffix[i]`` tokens, each given the
    tokens before it; logits are taken at those positions only (``scoring.score_positions``)."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    results = [None] * len(seqs)
    for start in tqdm(range(0, len(order), batch_size), desc="lambada", disable=not progress):
        idx = order[start:start + batch_size]
        width = max(len(seqs[i]) for i in idx) - 1
        ids = np.full((len(idx), width), pad_id, dtype=np.int64)
        labels = np.full((len(idx), width), pad_id, dtype=np.int64)
        select = np.zeros((len(idx), width), dtype=bool)
        for r, i in enumerate(idx):
            s = seqs[i]
            ids[r, : len(s) - 1] = s[:-1]
            labels[r, : len(s) - 1] = s[1:]
            select[r, len(s) - 1 - suffix[i]: len(s) - 1] = True  # positions predicting the suffix
        # Right padding needs no mask: causal attention never lets a position see later pads.
        lp, hit = score_positions(backend, ids, labels, select)
        off = 0
        for i in idx:  # score_positions returns row-major order: each row's positions in turn
            results[i] = (lp[off:off + suffix[i]], hit[off:off + suffix[i]])
            off += suffix[i]
    return results


def evaluate_lambada(backend, tokenizer, path: str, seq_len: int = 1024, batch_size: int = 16,
                     limit: int | None = None, progress: bool = True) -> LambadaResult:
    """LAMBADA accuracy of ``backend`` (see module docstring)."""
    texts = read_lambada(path, limit)
    strict, truncated = _encode_examples(tokenizer, texts, split_strict, seq_len)
    harness, _ = _encode_examples(tokenizer, texts, split_harness, seq_len)
    # Non-strict: the whole text's last BPE token is the only target.
    nonstrict = [(ids[:-1], ids[-1:]) for ids in (tokenizer.encode(t)[-(seq_len + 1):] for t in texts)]
    # One pass for the three protocols: each target is the end of its token sequence, and the
    # splits mostly give the same sequence, so every distinct sequence is run once and scores
    # the longest target that ends it.
    index: dict[tuple, int] = {}
    seqs, suffix = [], []

    def request(context, target):
        key = tuple(context) + tuple(target)
        j = index.setdefault(key, len(seqs))
        if j == len(seqs):
            seqs.append(key)
            suffix.append(0)
        suffix[j] = min(max(suffix[j], len(target)), len(key) - 1)
        return j, len(target)

    requests = {name: [request(c, g) for c, g in examples]
                for name, examples in (("strict", strict), ("harness", harness), ("nonstrict", nonstrict))}
    scored = _score_sequences(backend, seqs, suffix, tokenizer.eod_id, batch_size, progress)

    def outcome(j, n):
        """(all target tokens greedy-correct, sum NLL of target, n target tokens)."""
        lp, hit = scored[j]
        k = max(len(lp) - n, 0)  # n > len(lp) only for a text of one token
        return bool(hit[k:].all()), float(-lp[k:].sum()), n

    res, res_h, res_n = ([outcome(j, n) for j, n in requests[k]] for k in ("strict", "harness", "nonstrict"))
    nll = sum(r[1] for r in res)
    ntok = sum(r[2] for r in res)
    n = len(texts)
    return LambadaResult(
        protocol="FleetX/Megatron Lambada_Eval_Dataset strict: context = text before the last occurrence of "
                 "text.split()[-1], target = encode(' ' + last_word); correct iff greedy argmax matches every "
                 "target token",
        num_examples=n, seq_len=seq_len, accuracy=sum(r[0] for r in res) / n,
        accuracy_nonstrict=sum(r[0] for r in res_n) / n, accuracy_harness=sum(r[0] for r in res_h) / n,
        target_ppl=math.exp(nll / ntok), harness_ppl=math.exp(sum(r[1] for r in res_h) / n),
        truncated_contexts=truncated, correct=[int(r[0]) for r in res])
