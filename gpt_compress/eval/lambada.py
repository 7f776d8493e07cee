"""LAMBADA last-word cloze accuracy (FleetX/Megatron ``Lambada_Eval_Dataset``, strict).

For each line of the OpenAI ``lambada_test.jsonl``: ``last_word = text.split()[-1]``, context =
the text before the last occurrence of that word (stripped), target = the tokens of
``" " + last_word``. An example is correct only if the greedy prediction equals the target
token at every target position. Also reported: FleetX's non-strict variant (only the last BPE
token of the whole text is the target), lm-evaluation-harness's split (``text.rsplit(" ", 1)``)
and the target perplexity (exp of the mean NLL of the target tokens).
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field

import numpy as np
from tqdm import tqdm

from ..errors import DataError, InputError  # noqa: F401
from .scoring import token_logprobs


def read_lambada(path: str, limit: int | None = None) -> list[str]:
    """Texts of a LAMBADA JSONL file; a bad line is reported with file and line number."""
    texts = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                text = json.loads(line)["text"]
            except (ValueError, KeyError, TypeError) as e:
                raise DataError(f"{path}:{n}: expected a JSON object with a \"text\" string ({e})") from None
            if not isinstance(text, str) or not text.split():
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


def _score_examples(backend, examples, pad_id, batch_size, progress, desc):
    """Per example: (all target tokens greedy-correct, sum NLL of target, n target tokens)."""
    order = sorted(range(len(examples)), key=lambda i: len(examples[i][0]) + len(examples[i][1]))
    results = [None] * len(examples)
    for start in tqdm(range(0, len(order), batch_size), desc=desc, disable=not progress):
        idx = order[start:start + batch_size]
        seqs = [examples[i][0] + examples[i][1] for i in idx]
        width = max(len(s) for s in seqs) - 1
        ids = np.full((len(idx), width), pad_id, dtype=np.int64)
        labels = np.full((len(idx), width), pad_id, dtype=np.int64)
        for r, s in enumerate(seqs):
            ids[r, : len(s) - 1] = s[:-1]
            labels[r, : len(s) - 1] = s[1:]
        # Right padding needs no mask: causal attention never lets a position see later pads.
        lp, hit = token_logprobs(backend, ids, labels)
        for r, i in enumerate(idx):
            n_ctx, n_tgt = len(examples[i][0]), len(examples[i][1])
            sl = slice(n_ctx - 1, n_ctx - 1 + n_tgt)  # positions predicting the target tokens
            results[i] = (bool(hit[r, sl].all()), float(-lp[r, sl].sum()), n_tgt)
    return results


def evaluate_lambada(backend, tokenizer, path: str, seq_len: int = 1024, batch_size: int = 16,
                     limit: int | None = None, progress: bool = True) -> LambadaResult:
    """LAMBADA accuracy of ``backend`` (see module docstring)."""
    texts = read_lambada(path, limit)
    pad = tokenizer.eod_id
    strict, truncated = _encode_examples(tokenizer, texts, split_strict, seq_len)
    res = _score_examples(backend, strict, pad, batch_size, progress, "lambada")
    harness, _ = _encode_examples(tokenizer, texts, split_harness, seq_len)
    same = [h == s for h, s in zip(harness, strict)]
    # The harness split differs from the strict one only on a few texts: score just those.
    diff = [i for i, s in enumerate(same) if not s]
    res_h = list(res)
    for i, r in zip(diff, _score_examples(backend, [harness[i] for i in diff], pad, batch_size, False, "")):
        res_h[i] = r
    # Non-strict: the whole text's last BPE token is the only target.
    nonstrict = []
    for t in texts:
        ids = tokenizer.encode(t)[-(seq_len + 1):]
        nonstrict.append((ids[:-1], ids[-1:]))
    res_n = _score_examples(backend, nonstrict, pad, batch_size, False, "")
    nll = sum(r[1] for r in res)
    ntok = sum(r[2] for r in res)
    n = len(texts)
    return LambadaResult(
        protocol="FleetX/Megatron Lambada_Eval_Dataset strict: context = text before the last occurrence of "
                 "text.split()[-1], target = encode(' ' + last_word); correct iff greedy argmax matches every "
                 "target token",
        num_examples=n, seq_len=seq_len, accuracy=sum(r[0] for r in res) / n,
        accuracy_nonstrict=sum(r[0] for r in res_n) / n, accuracy_harness=sum(r[0] for r in res_h) / n,
        target_ppl=math.exp(nll / ntok), truncated_contexts=truncated, correct=[int(r[0]) for r in res])
