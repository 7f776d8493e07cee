"""The finetuning loss (response tokens only) and its evaluation: response-token perplexity,
generation scored with sacrebleu (BLEU, chrF), rouge-score (ROUGE-L F1) and exact match, and for
Chinese verse the share of generated lines in the regulated form (``poem_form``)."""
from __future__ import annotations

import math
import re
from typing import Iterable, Sequence

import numpy as np
import paddle

from ..errors import ConfigError
from ..train.loss import IGNORE_INDEX, as_tensor, lm_head_loss

_CJK_RANGES = "\u3000-\u303f\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uff00-\uffef"
_CJK = re.compile(f"[{_CJK_RANGES}]")
_CJK_TOKENS = re.compile(f"[{_CJK_RANGES}]|[^\\s{_CJK_RANGES}]+")  # one CJK character, or a run of others


def finetune_loss(model, batch: dict) -> paddle.Tensor:
    """Mean cross-entropy over the batch's target tokens (labels != -100): the trainer's loss.
    Packed batches carry ``segment_ids`` + ``position_ids``, padded ones ``attention_mask``."""
    opt = {k: as_tensor(batch[k]) for k in ("attention_mask", "position_ids", "segment_ids") if k in batch}
    hidden = model.gpt(as_tensor(batch["input_ids"]), **opt)
    return lm_head_loss(model, hidden, as_tensor(batch["labels"]).astype("int64"))


@paddle.no_grad()
def response_perplexity(model, batches: Iterable[dict]) -> dict:
    """Token-weighted mean loss over every target token of ``batches``, its perplexity and count."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for b in batches:
        n = int((np.asarray(b["labels"]) != IGNORE_INDEX).sum())
        if n:
            total += float(finetune_loss(model, b)) * n
            count += n
    if was_training:
        model.train()
    loss = total / max(count, 1)
    return {"loss": loss, "ppl": math.exp(min(loss, 50.0)), "tokens": count}


def generate_texts(model, tokenizer, prompts: Sequence[Sequence[int]], gen_cfg, batch_size: int = 16) -> list[str]:
    """Decode each prompt with ``gen_cfg`` (dygraph backend); the new text without its EOD."""
    from ..inference.dygraph import DygraphBackend
    from ..model.generation import generate

    was_training = model.training
    backend = DygraphBackend(model)
    eos = gen_cfg.eos_token_id if gen_cfg.eos_token_id is not None else tokenizer.eod_id
    pad = gen_cfg.pad_token_id if gen_cfg.pad_token_id is not None else tokenizer.pad_id
    limit = model.config.max_position_embeddings - gen_cfg.max_new_tokens
    texts = []
    for i in range(0, len(prompts), batch_size):
        chunk = [list(p)[-limit:] for p in prompts[i:i + batch_size]]
        out = generate(backend, chunk, gen_cfg, eos, pad)
        texts += [tokenizer.decode([t for t in s if t != eos]) for s in out.sequences]
    if was_training:
        model.train()
    return texts


_CLAUSE = re.compile(r"[^，。！？；、：,.!?;:]*[，。！？；、：,.!?;:]")
_HANZI = re.compile("[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]")
FORM_LENGTHS, FORM_ENDS = (5, 7), "，。"


def clause_in_form(clause: str) -> bool:
    """``clause`` (whitespace ignored) is 5 or 7 Chinese characters and then ``，`` or ``。``."""
    body = "".join(clause.split())
    return (len(body) - 1 in FORM_LENGTHS and body[-1] in FORM_ENDS
            and all(_HANZI.fullmatch(c) for c in body[:-1]))


def poem_form(texts: Sequence[str]) -> dict:
    """How well generated poems keep the form of Tang regulated verse: lines of 5 or 7 characters,
    each ending in ``，`` or ``。``. A text is cut into clauses at every punctuation mark (Chinese
    or ASCII); its unterminated tail counts as a clause only when it already holds more than 7
    characters (a generation cut by ``max_new_tokens`` is not penalised for its last, unfinished
    line, but a run-on without punctuation is). ``form_rate``: in-form clauses / clauses, 0-100;
    ``poems_in_form``: texts with at least two clauses, all in form, 0-100."""
    in_form = total = whole = 0
    for text in texts:
        clauses = _CLAUSE.findall(text)
        tail = "".join(text[sum(map(len, clauses)):].split()) if clauses else "".join(text.split())
        ok = [clause_in_form(c) for c in clauses] + ([False] if len(tail) > max(FORM_LENGTHS) else [])
        in_form, total = in_form + sum(ok), total + len(ok)
        whole += len(ok) >= 2 and all(ok)
    return {"form_rate": round(100.0 * in_form / max(total, 1), 4), "clauses": total,
            "poems_in_form": round(100.0 * whole / max(len(texts), 1), 4)}


class _CharTokenizer:
    """rouge-score tokenizer for text with CJK characters: each CJK character is a token, other
    runs (split on whitespace) are lower-cased words; rouge-score's default drops every
    non-ASCII character."""

    def tokenize(self, text: str) -> list[str]:
        return [t if _CJK.fullmatch(t) else t.lower() for t in _CJK_TOKENS.findall(text)]


def score_generations(hyps: Sequence[str], refs: Sequence[str]) -> dict:
    """Corpus BLEU and chrF (sacrebleu; tokenize "zh" when the references hold CJK text), mean
    ROUGE-L F1 (rouge-score) and exact match (after stripping whitespace), each 0-100. CJK
    references add ``form`` (``poem_form`` of the generations) and ``reference_form`` (of the
    references: the rate the data itself has)."""
    try:
        import sacrebleu
        from rouge_score import rouge_scorer
    except ImportError as e:
        raise ConfigError(f"generation scores need sacrebleu and rouge-score ({e}); "
                          "pip install 'gpt-compress[finetune]', or set Finetune.eval_generate=0") from None

    hyps = [h.strip() for h in hyps]
    refs = [r.strip() for r in refs]
    cjk = any(_CJK.search(r) for r in refs)
    bleu = sacrebleu.corpus_bleu(hyps, [refs], tokenize="zh" if cjk else "13a")
    chrf = sacrebleu.corpus_chrf(hyps, [refs])
    scorer = rouge_scorer.RougeScorer(["rougeL"], tokenizer=_CharTokenizer() if cjk else None)
    rouge = [scorer.score(r, h)["rougeL"].fmeasure for h, r in zip(hyps, refs)]
    return {"bleu": round(bleu.score, 4), "chrf": round(chrf.score, 4),
            "rouge_l": round(100.0 * float(np.mean(rouge)), 4),
            "exact_match": round(100.0 * float(np.mean([h == r for h, r in zip(hyps, refs)])), 4),
            "samples": len(hyps), **({"form": poem_form(hyps), "reference_form": poem_form(refs)} if cjk else {})}
