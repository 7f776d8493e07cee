"""Speculative decoding over any backend (``inference/base.py``'s ``Backend``): a draft proposes k tokens per sequence, the
target checks them in one multi-token step and keeps what its own decoding would have produced.

- Greedy: a draft token is kept while it equals the target's argmax at its position; the first
  disagreement is replaced by the target's token (or, all kept, the target's next token follows).
  The output is token for token the output without a draft.
- Sampling (temperature, top-k, top-p applied identically to both sides): draft token ``d`` drawn
  from ``q`` is kept with probability ``min(1, p(d) / q(d))``; on rejection the token is drawn
  from ``max(p - q, 0)`` normalised; all kept, one more is drawn from ``p`` (Leviathan et al.
  2023, Chen et al. 2023). The output distribution is exactly the target's. A draft without
  probabilities (``NgramDraft``) is the point mass ``q = onehot(d)``.

Drafts: ``ModelDraft`` (another model with the same tokenizer, any backend; its own cache) or
``NgramDraft`` (prompt lookup: the continuation of the latest earlier occurrence of the longest
suffix of the sequence, up to ``n`` tokens; no model).

The cache layout. Each sequence of the batch is a row of one left-padded (B, W) id/mask layout;
the target's cache holds the first W - 1 columns (the last column holds each row's newest token,
not yet fed). A verify step feeds that column and up to k draft tokens, T = 1 + k columns, with
the backend's ``decode_positions`` (logits at every new position; the fused program runs it as
one step, whose arithmetic is bitwise the token-by-token arithmetic), and
the cache is rolled back by its length (``truncate_cache``, no copy on the fused program) to the
furthest row's last accepted column. Rows that accepted fewer keep their rejected columns as
holes, masked out: positions (the mask's cumulative sum) and attention (over unmasked keys) skip
them, so a row's logits are those of the cache built without speculation. Rows that finish
(EOS, ``max_new_tokens``) feed masked columns from then on.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import numpy as np

from ..config import GenerationConfig
from ..errors import InputError
from .generation import (NEG_INF, GenerationOutput, no_processor, apply_logit_bias, collect_sequences, pad_left,
                         sample_rows, sampling_probs)

DRAFT_TOKENS = 5  # k: draft tokens proposed per verify step (at most; ``AdaptiveK`` lowers it)
NGRAM = 3  # prompt lookup: the longest suffix matched


@dataclass
class SpeculationStats:
    """What speculation did over one generation."""

    proposed: int = 0  # draft tokens checked by the target
    accepted: int = 0  # of those, kept
    target_steps: int = 0  # verify steps (target runs after the prefill)
    draft_steps: int = 0  # draft model runs (prefill excluded); 0 for prompt lookup
    tokens: int = 0  # tokens produced by verify steps, all rows
    row_steps: int = 0  # verify steps x unfinished rows in them

    @property
    def acceptance_rate(self) -> float:
        """Kept / proposed draft tokens (0 when none was proposed)."""
        return self.accepted / self.proposed if self.proposed else 0.0

    def as_dict(self) -> dict:
        """JSON figures; ``tokens_per_target_step``: tokens a sequence gains per verify step (1
        without a draft: the step count's speed-up, before the draft's own cost)."""
        return {"proposed": self.proposed, "accepted": self.accepted,
                "acceptance_rate": round(self.acceptance_rate, 4), "target_steps": self.target_steps,
                "draft_steps": self.draft_steps,
                "tokens_per_target_step": round(self.tokens / max(self.row_steps, 1), 3)}


class AdaptiveK:
    """Draft tokens per verify step: up by one after a step that kept every proposal, down by one
    after one that kept none; when the recent acceptance (a moving average) falls below
    ``floor``, proposing stops for ``pause`` steps (plain decode steps), doubling at each stop."""

    def __init__(self, k: int, adaptive: bool = True, floor: float = 0.2):
        self.k_max, self.k, self.adaptive, self.floor = k, k, adaptive, floor
        self.rate, self.pause, self.skip = 1.0, 0, 0

    def next(self) -> int:
        """k for the next step (0: no proposal)."""
        if self.skip:
            self.skip -= 1
            return 0
        return self.k

    def update(self, proposed: int, accepted: int) -> None:
        """Account one verify step's proposals and kept tokens."""
        if not self.adaptive or proposed == 0:
            return
        self.rate = 0.5 * self.rate + 0.5 * accepted / proposed
        if accepted == proposed:
            self.k = min(self.k + 1, self.k_max)
        elif accepted == 0:
            self.k = max(self.k - 1, 1)
        if self.rate < self.floor:
            self.pause = min(2 * self.pause if self.pause else 4, 64)
            self.skip, self.rate, self.k = self.pause, 2 * self.floor, 1


# --------------------------------------------------------------------------------------
# Drafts
# --------------------------------------------------------------------------------------
class NgramDraft:
    """Prompt lookup: propose the tokens that followed the latest earlier occurrence of the
    sequence's last ``n`` tokens (else of its last n - 1, ... 1); no model, no probabilities.
    A continuation that runs into the sequence's end goes on with its own proposals (a sequence
    that repeats a period of p tokens gets k proposals, not p)."""

    has_probs = False

    def __init__(self, n: int = NGRAM):
        if n < 1:
            raise InputError(f"ngram draft: n must be >= 1, got {n}")
        self.n = n

    def start(self, ids: np.ndarray, mask: np.ndarray) -> None:
        """Nothing to prefill."""

    def rollback(self, length: int) -> None:
        """Nothing cached."""

    def lookup(self, history: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens continuing ``history`` (empty when no suffix occurs earlier)."""
        h = np.asarray(history, dtype=np.int64)
        for size in range(min(self.n, len(h) - 1), 0, -1):
            tail = h[len(h) - size:]
            # Windows starting at 0 .. len - size - 1 (not the suffix itself), latest first.
            windows = np.lib.stride_tricks.sliding_window_view(h[:len(h) - 1], size)
            hits = np.nonzero((windows == tail).all(axis=1))[0]
            if hits.size:
                start = int(hits[-1]) + size
                out = [int(t) for t in h[start:start + k]]
                period = len(h) - start  # the match ends this many tokens before the sequence
                while len(out) < k:
                    out.append(out[len(out) - period])
                return out
        return []

    def propose(self, histories, ids, mask, k, steps, active, pick, suppress=None, eos=None):
        """(drafts (B, k) int64 padded with -1, None): each active row's lookup."""
        drafts = np.full((len(histories), k), -1, dtype=np.int64)
        for b, hist in enumerate(histories):
            if active[b]:
                got = self.lookup(hist, k)
                drafts[b, :len(got)] = got
        return drafts, None


class ModelDraft:
    """Another model (a ``Backend``, same tokenizer) run on the same layout as the target,
    with its own cache, rolled back with the target's."""

    has_probs = True

    def __init__(self, backend):
        self.backend, self.cache, self.length = backend, None, 0

    def start(self, ids: np.ndarray, mask: np.ndarray) -> None:
        """Prefill the prompt layout (B, P)."""
        _, self.cache = self.backend.prefill(ids, mask)
        self.length = ids.shape[1]

    def rollback(self, length: int) -> None:
        """Drop cached columns from ``length`` on."""
        if length < self.length:
            self.cache = self.backend.truncate_cache(self.cache, length)
            self.length = length

    def propose(self, histories, ids, mask, k, steps, active, pick, suppress=None, eos=None):
        """Feed the layout's columns not yet cached, then ``k`` tokens one at a time, each chosen
        by ``pick(logits (B, V), steps (B,))`` -> (tokens (B,), probs (B, V) or None).
        Returns drafts (B, k) and their probabilities (B, k, V) (None for greedy).
        ``suppress`` (greedy only): the first steps that never propose ``eos`` (``min_new_tokens``);
        given, a backend with ``greedy_steps`` > 1 proposes all ``k`` in one ``decode_greedy_steps``
        run."""
        b, width = ids.shape
        if suppress is not None and k > 1 and self.backend.greedy_steps > 1:
            return self._greedy_run(ids, mask, k, active, suppress, eos), None
        drafts, probs = np.zeros((b, k), dtype=np.int64), []
        logits, self.cache = self.backend.decode(ids[:, self.length:], mask, self.cache)
        self.length, col = width, active.astype(np.int64)[:, None]
        for j in range(k):
            drafts[:, j], q = pick(logits, steps + j)
            probs.append(q)
            if j < k - 1:
                mask = np.concatenate([mask, col], axis=1)
                logits, self.cache = self.backend.decode(drafts[:, j:j + 1], mask, self.cache)
                self.length += 1
        return drafts, (np.stack(probs, axis=1) if probs and probs[0] is not None else None)

    def _greedy_run(self, ids, mask, k, active, suppress, eos):
        """``k`` greedy proposals from one program run, which first feeds the columns not cached
        yet, from the backend's draft vocabulary where it has one (``export/draft_vocab.py``).
        Rows already finished, or by a proposed EOS, are fed padding with mask ones there: those
        columns are never kept."""
        width = ids.shape[1]
        drafts, self.cache = self.backend.decode_greedy_steps(ids[:, self.length:], mask, self.cache, k, eos, 0,
                                                              ~active, min(suppress, k),
                                                              draft_vocab=self.backend.draft_vocab > 0)
        self.length = width + k - 1
        return drafts


# --------------------------------------------------------------------------------------
# Acceptance
# --------------------------------------------------------------------------------------
def accept_greedy(target: np.ndarray, drafts: np.ndarray, n: int) -> tuple[int, int]:
    """target: the target's tokens (T,) at the T fed positions, drafts (>= n,): the first ``n``
    proposals -> (kept, next token)."""
    a = 0
    while a < n and drafts[a] == target[a]:
        a += 1
    return a, int(target[a])


def accept_sampled(p: np.ndarray, q: Optional[np.ndarray], drafts: np.ndarray, n: int,
                   rng: np.random.Generator) -> tuple[int, int]:
    """The rejection rule for one row: p (T, V) the target's probabilities at the T fed positions,
    q (>= n, V) the draft's (None: point masses on ``drafts``), the first ``n`` drafts ->
    (kept, next token). Draws: one uniform per checked draft, then one inverse-CDF draw."""
    for j in range(n):
        d = int(drafts[j])
        qd = float(q[j, d]) if q is not None else 1.0
        if rng.random() * qd < p[j, d]:  # u < p(d) / q(d): kept with probability min(1, p/q)
            continue
        if q is not None:
            resid = np.maximum(p[j].astype(np.float64) - q[j], 0.0)
        else:
            resid = p[j].astype(np.float64).copy()
            resid[d] = 0.0
        if not resid.sum() > 0:  # p == q up to rounding: nothing to correct
            resid = p[j].astype(np.float64)
        return j, int(sample_rows(resid[None] / resid.sum(), rng)[0])
    return n, int(sample_rows(p[n:n + 1], rng)[0])


def pick_row(logits: np.ndarray, step: int, cfg: GenerationConfig, eos: Optional[int],
             rng: np.random.Generator) -> tuple[int, Optional[np.ndarray]]:
    """One sequence's draft token from the draft's logits (V,) at generation step ``step``:
    (greedy: the argmax, None; sampling: one draw and the distribution (V,) it came from, the
    rule's ``q``), after the logits processors, as ``speculative_tokens``' drafts."""
    scores = _scores(logits[None], np.array([step]), cfg, eos)
    if cfg.decode_strategy == "greedy":
        return int(np.argmax(scores[0])), None
    probs = sampling_probs(scores, cfg)
    return int(sample_rows(probs, rng)[0]), probs[0]


def verify_row(logits: np.ndarray, drafts: np.ndarray, q: Optional[np.ndarray], n: int, step: int,
               cfg: GenerationConfig, eos: Optional[int], rng: np.random.Generator) -> tuple[int, int]:
    """One sequence's verify: the target's logits (>= n + 1, V) at its fed positions (its newest
    token, then its drafts), the first ``n`` of ``drafts`` (q (>= n, V) their draft probabilities,
    None for point masses), generation step ``step`` of the first position -> (kept, next token):
    greedy ``accept_greedy``, sampling ``accept_sampled``."""
    scores = _scores(logits, step + np.arange(len(logits)), cfg, eos)
    if cfg.decode_strategy == "greedy":
        return accept_greedy(np.argmax(scores, axis=-1), drafts, n)
    return accept_sampled(sampling_probs(scores, cfg), q, drafts, n, rng)


def _scores(logits: np.ndarray, steps: np.ndarray, cfg: GenerationConfig, eos: Optional[int]) -> np.ndarray:
    """The logits processors of ``generation._processed`` row by row: rows (N, V) at generation
    steps (N,) (``logit_bias``; ``min_new_tokens`` keeps EOS out of early steps). The penalties
    that read the tokens so far are refused (``check_config``)."""
    scores = apply_logit_bias(logits.astype(np.float32, copy=True), cfg.logit_bias)
    if eos is not None and cfg.min_new_tokens > 0:
        scores[steps < cfg.min_new_tokens, eos] = NEG_INF
    return scores


def check_config(cfg: GenerationConfig) -> None:
    """Refuse what speculation does not support, with the field named."""
    if cfg.decode_strategy == "beam_search":
        raise InputError("a draft needs decode_strategy greedy or sampling, not beam_search")
    if cfg.repetition_penalty != 1.0:
        raise InputError(f"a draft does not support repetition_penalty={cfg.repetition_penalty}; use 1.0")
    for name, value in (("presence_penalty", cfg.presence_penalty), ("frequency_penalty", cfg.frequency_penalty)):
        if value:
            raise InputError(f"a draft does not support {name}={value}; use 0")
    if cfg.best_of > 1:
        raise InputError(f"a draft does not support best_of={cfg.best_of}; use 1")


# --------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------
def speculative_tokens(backend, draft, prompts: Sequence[Sequence[int]], cfg: GenerationConfig,
                       eos_token_id: Optional[int], pad_token_id: int, k: int = DRAFT_TOKENS,
                       adaptive: bool = True, stats: Optional[SpeculationStats] = None) -> Iterator[np.ndarray]:
    """As ``generation.stream_tokens`` (each step's token per row (B,), ``pad_token_id`` after a
    row's end) with ``draft`` (``NgramDraft`` or ``ModelDraft``) proposing up to ``k`` tokens per
    verify step. A step's tokens are yielded once every unfinished row has produced them."""
    check_config(cfg)
    if k < 0:
        raise InputError(f"draft tokens per step must be >= 0, got {k}")
    stats = stats if stats is not None else SpeculationStats()
    greedy, eos, limit = cfg.decode_strategy == "greedy", eos_token_id, cfg.max_new_tokens
    rng = np.random.default_rng(cfg.seed)
    ids, mask = pad_left(prompts, pad_token_id)
    batch = ids.shape[0]
    histories = [list(map(int, p)) for p in prompts]
    out: list[list[int]] = [[] for _ in range(batch)]
    done = np.zeros(batch, dtype=bool)

    def pick(logits, steps):  # (B, V), (B,) -> tokens (B,), probs (B, V) or None
        scores = _scores(logits, steps, cfg, eos)
        if greedy:
            return np.argmax(scores, axis=-1), None
        probs = sampling_probs(scores, cfg)
        return sample_rows(probs, rng), probs

    def emit(b, tokens):
        for t in tokens:
            out[b].append(int(t))
            histories[b].append(int(t))
            if (eos is not None and t == eos) or len(out[b]) == limit:
                done[b] = True
                return

    logits, cache = backend.prefill(ids, mask)
    draft.start(ids, mask)
    first, _ = pick(logits, np.zeros(batch, dtype=np.int64))
    for b in range(batch):
        emit(b, [first[b]])
    ids = np.concatenate([ids, first[:, None]], axis=1)
    mask = np.concatenate([mask, (~done).astype(np.int64)[:, None]], axis=1)
    yielded, schedule = 0, AdaptiveK(k, adaptive)
    while True:
        ready = min((len(o) for o, d in zip(out, done) if not d), default=max(map(len, out)))
        for s in range(yielded, ready):
            yield np.array([o[s] if s < len(o) else pad_token_id for o in out], dtype=np.int64)
        yielded = ready
        if done.all():
            return
        active = ~done
        width = ids.shape[1]
        steps = np.array([len(o) for o in out], dtype=np.int64)  # generation step of the newest column + 1
        room = np.where(active, limit - steps - 1, 0)  # drafts a row may still keep
        kk = min(schedule.next(), int(room.max()))
        suppress = max(0, cfg.min_new_tokens - int(steps[active].min())) if eos is not None else 0
        drafts, q = (draft.propose(histories, ids, mask, kk, steps, active, pick, suppress if greedy else None, eos)
                     if kk > 0 else (np.zeros((batch, 0), np.int64), None))
        stats.draft_steps += kk if isinstance(draft, ModelDraft) else 0
        counts = np.minimum((drafts >= 0).sum(axis=1) if drafts.size else np.zeros(batch, np.int64), room)
        t = 1 + int(counts.max(initial=0))
        feed = np.concatenate([ids[:, width - 1:], np.where(drafts[:, :t - 1] >= 0, drafts[:, :t - 1],
                                                            pad_token_id)], axis=1)
        vmask = np.concatenate([mask, np.repeat(active.astype(np.int64)[:, None], t - 1, axis=1)], axis=1)
        # Greedy with no processor acting on these positions: the target's tokens suffice.
        plain = greedy and no_processor(cfg, int(steps[active].min()), eos)
        if plain:
            targets, cache = backend.decode_positions_greedy(feed, vmask, cache)  # (B, t)
        else:
            tlogits, cache = backend.decode_positions(feed, vmask, cache)  # (B, t, V)
        stats.target_steps += 1
        stats.row_steps += int(active.sum())
        kept = np.zeros(batch, dtype=np.int64)
        nxt = np.full(batch, pad_token_id, dtype=np.int64)
        for b in np.nonzero(active)[0]:
            kept[b], nxt[b] = (accept_greedy(targets[b], drafts[b], counts[b]) if plain else
                               verify_row(tlogits[b], drafts[b], None if q is None else q[b], counts[b], steps[b],
                                          cfg, eos, rng))
            before = len(out[b])
            emit(b, list(drafts[b, :kept[b]]) + [nxt[b]])
            stats.tokens += len(out[b]) - before
        stats.proposed += int(counts.sum())
        stats.accepted += int(kept.sum())
        schedule.update(int(counts.sum()), int(kept.sum()))
        # The new layout columns: the kept drafts (holes where a row kept fewer), then each row's
        # next token, not yet fed; the caches keep the columns before it.
        top = int(kept[active].max(initial=0))
        cols = np.full((batch, top + 1), pad_token_id, dtype=np.int64)
        cmask = np.zeros((batch, top + 1), dtype=np.int64)
        for b in np.nonzero(active)[0]:
            cols[b, :kept[b]], cmask[b, :kept[b]] = drafts[b, :kept[b]], 1
            cols[b, top], cmask[b, top] = nxt[b], int(not done[b])
        ids, mask = np.concatenate([ids, cols], axis=1), np.concatenate([mask, cmask], axis=1)
        length = ids.shape[1] - 1
        cache = backend.truncate_cache(cache, length)
        draft.rollback(length)


def speculative_generate(backend, draft, prompts: Sequence[Sequence[int]], cfg: GenerationConfig,
                         eos_token_id: Optional[int], pad_token_id: int, k: int = DRAFT_TOKENS,
                         adaptive: bool = True, on_tokens=None) -> tuple[GenerationOutput, SpeculationStats]:
    """``generation.generate`` with a draft: the sequences (EOS included) and the figures."""
    stats = SpeculationStats()
    steps = speculative_tokens(backend, draft, prompts, cfg, eos_token_id, pad_token_id, k, adaptive, stats)
    return GenerationOutput(sequences=collect_sequences(steps, len(prompts), eos_token_id, on_tokens)), stats
