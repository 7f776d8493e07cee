"""Decoding strategies at the numpy level, shared by every backend (dygraph, Paddle
Inference, onnxruntime).

A backend only runs the network; every function here takes a ``backend`` that implements the
contract of ``inference/base.py`` (``Backend``: ``prefill``, ``decode``, ``reorder_cache``,
``decode_greedy``, ``greedy_steps`` and ``decode_greedy_steps``; declared there because the core
cannot import ``inference/``). Prompts of different lengths are left-padded; the attention mask
carries the padding so positions and attention skip it.

Semantics follow Hugging Face ``generate``: logits processors (repetition penalty, OpenAI's
presence and frequency penalties over the generated tokens, OpenAI's ``logit_bias``,
min-new-tokens) then warpers (temperature, top-k, top-p) for sampling; beam search keeps
``2 * num_beams`` candidates per step, lets only the best ``num_beams`` finish, scores a
finished hypothesis as ``sum logprob / generated_len ** length_penalty`` and stops a prompt
when no running beam can beat its worst finished one.
"""
from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Optional, Sequence

import numpy as np

from ..config import ConfigError, GenerationConfig
from ..errors import InputError

NEG_INF = -np.inf


@dataclass
class GenerationOutput:
    """Generated token ids per prompt (new tokens only; ends with EOS if one was produced)."""

    sequences: list[list[int]]
    scores: Optional[list[float]] = None  # beam search: length-normalised score of each best beam


def pad_left(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Left-pad prompts into ids (B, T) int64 and attention mask (B, T) int64."""
    if not prompts:
        raise InputError("no prompts given")
    if any(len(p) == 0 for p in prompts):
        raise InputError("empty prompt: every prompt needs at least one token")
    width = max(len(p) for p in prompts)
    ids = np.full((len(prompts), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(prompts), width), dtype=np.int64)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = p
        mask[i, width - len(p):] = 1
    return ids, mask


# --------------------------------------------------------------------------------------
# Logits processors (rows of a (N, V) float32 array)
# --------------------------------------------------------------------------------------
def apply_repetition_penalty(scores: np.ndarray, seen: np.ndarray, penalty: float) -> np.ndarray:
    """CTRL penalty on tokens already in each row: negative scores * p, positive / p.
    ``seen`` is a (N, V) bool array of tokens present in the prompt or output (not padding)."""
    if penalty == 1.0:
        return scores
    penalised = np.where(scores < 0, scores * penalty, scores / penalty)
    return np.where(seen, penalised, scores)


def apply_openai_penalties(scores: np.ndarray, counts: np.ndarray, presence: float, frequency: float) -> np.ndarray:
    """OpenAI's penalties: ``counts`` (N, V) is how many times each row generated each token;
    a token's score loses ``frequency`` per occurrence and ``presence`` once if it occurred."""
    if not presence and not frequency:
        return scores
    return scores - (counts * frequency + (counts > 0) * presence).astype(scores.dtype)


def apply_logit_bias(scores: np.ndarray, bias: dict[int, float]) -> np.ndarray:
    """OpenAI's ``logit_bias``: token id -> a value added to that token's score in every row."""
    if not bias:
        return scores
    ids = np.fromiter(bias.keys(), np.int64, len(bias))
    out = scores.copy()
    out[:, ids] += np.fromiter(bias.values(), np.float32, len(bias))
    return out


def check_logit_bias(bias: dict[int, float], vocab_size: int) -> None:
    """InputError when ``bias`` names a token id outside the vocabulary."""
    outside = sorted(k for k in bias if not 0 <= k < vocab_size)
    if outside:
        raise InputError(f"logit_bias has token ids outside the vocabulary [0, {vocab_size}): {outside[:5]}")


def uses_history(cfg: GenerationConfig) -> bool:
    """A penalty reads the tokens so far (``seen`` for the repetition penalty, which includes the
    prompt; ``counts`` of the generated tokens for OpenAI's)."""
    return cfg.repetition_penalty != 1.0 or bool(cfg.presence_penalty) or bool(cfg.frequency_penalty)


def apply_top_k(scores: np.ndarray, k: int) -> np.ndarray:
    """Keep the ``k`` largest scores per row (ties at the k-th value kept, as HF)."""
    if k <= 0 or k >= scores.shape[-1]:
        return scores
    kth = np.partition(scores, -k, axis=-1)[:, -k][:, None]
    return np.where(scores < kth, NEG_INF, scores)


TOP_P_BINS = 1024  # apply_top_p's buckets of a row's score range


def apply_top_p(scores: np.ndarray, p: float) -> np.ndarray:
    """Nucleus filtering: keep the smallest set of tokens whose probability reaches ``p``.

    HF's rule: in ascending (stable) order a token goes while the probability at or below it is
    at most ``1 - p``; the most likely token stays. Without sorting the row (a stable sort of a
    50k vocabulary costs several decode steps): the scores fall into ``TOP_P_BINS`` buckets of
    their range (in score order, ties together), the buckets' masses are summed, and only the
    bucket where the mass from below passes ``1 - p`` is sorted. Probabilities are float64, so a
    float32 cumulative sum (HF's) can decide a token within its rounding of ``1 - p`` otherwise."""
    if p >= 1.0:
        return scores
    out = np.full_like(scores, NEG_INF)
    for row, s in zip(out, scores):
        top = float(np.max(s))
        probs = _softmax(s.astype(np.float64))
        live = np.isfinite(s)
        low = float(np.min(s[live]))
        span = top - low
        bins = np.zeros(len(s), dtype=np.int64)
        if span > 0:
            bins[live] = np.minimum(((s[live] - low) * ((TOP_P_BINS - 1) / span)).astype(np.int64), TOP_P_BINS - 1)
        below = np.cumsum(np.bincount(bins, weights=probs, minlength=TOP_P_BINS))
        cut = int(np.searchsorted(below, 1.0 - p, side="right"))  # buckets before it go whole
        members = np.flatnonzero(bins == cut)
        order = members[np.argsort(s[members], kind="stable")]  # ascending, ties by index
        cum = (below[cut - 1] if cut else 0.0) + np.cumsum(probs[order])
        stay = np.concatenate([order[cum > 1.0 - p], np.flatnonzero(bins > cut)])
        if not len(stay):  # rounding: the most likely token stays
            stay = order[-1:]
        row[stay] = s[stay]
    return out


def _softmax(x: np.ndarray) -> np.ndarray:
    e = x - np.max(x, axis=-1, keepdims=True)
    np.exp(e, out=e)  # in place: the same values, one temporary the size of x instead of three
    e /= np.sum(e, axis=-1, keepdims=True)
    return e


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - np.max(x, axis=-1, keepdims=True)
    return x - np.log(np.sum(np.exp(x), axis=-1, keepdims=True))


def sample_rows(probs: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One draw per row by inverse CDF (deterministic for a seeded generator)."""
    return inverse_cdf(probs, rng.random(probs.shape[0]))


CDF_BLOCK = 256  # inverse_cdf's blocks of a row


def inverse_cdf(probs: np.ndarray, r: np.ndarray) -> np.ndarray:
    """Row i's token at the fraction ``r[i]`` (in [0, 1)) of its mass ``probs[i]`` (N, V), in
    token order: the first token with positive probability whose cumulative mass reaches
    ``r[i]`` times the row's total. In two levels, so that no row is summed one element after
    another (a sequential float64 sum of a 50k vocabulary costs more than the rest of sampling):
    the masses of blocks of ``CDF_BLOCK`` tokens (numpy's pairwise sums in float64) and their
    running sum find the block, then the running sum of that block alone finds the token. Each
    row's arithmetic is its own, so a row draws the same token alone or in any batch; the
    chosen token never has probability 0 (where the two levels' roundings disagree, within the
    rounding of a float64 sum, the block's last token with positive probability)."""
    n, v = probs.shape
    p = probs.astype(np.float64)
    full = v - v % CDF_BLOCK
    sums = p[:, :full].reshape(n, full // CDF_BLOCK, CDF_BLOCK).sum(axis=-1)
    if full < v:
        sums = np.concatenate([sums, p[:, full:].sum(axis=-1, keepdims=True)], axis=1)
    cum = np.cumsum(sums, axis=-1)
    # tiny: a draw of exactly 0 still lands on a token with positive probability
    u = np.maximum(np.asarray(r, np.float64) * cum[:, -1], np.finfo(np.float64).tiny)
    blk = np.minimum((cum < u[:, None]).sum(axis=-1), cum.shape[1] - 1)
    rows = np.arange(n)
    cols = blk[:, None] * CDF_BLOCK + np.arange(CDF_BLOCK)
    inside = cols < v
    block = np.where(inside, p[rows[:, None], np.minimum(cols, v - 1)], 0.0)
    below = np.where(blk > 0, cum[rows, blk - 1], 0.0)
    within = below[:, None] + np.cumsum(block, axis=-1)
    positive = block > 0
    j = (within < u[:, None]).sum(axis=-1)  # the first position whose running mass reaches u
    at_or_after = positive & (np.arange(CDF_BLOCK) >= j[:, None])
    last = CDF_BLOCK - 1 - np.argmax(positive[:, ::-1], axis=-1)
    j = np.where(at_or_after.any(axis=-1), np.argmax(at_or_after, axis=-1), last)
    return blk * CDF_BLOCK + j


# --------------------------------------------------------------------------------------
# Greedy / sampling
# --------------------------------------------------------------------------------------
def no_processor(cfg: GenerationConfig, step: int, eos) -> bool:
    """No logits processor changes the scores at ``step`` (no penalty nor bias, past ``min_new_tokens``)."""
    return not uses_history(cfg) and not cfg.logit_bias and (step >= cfg.min_new_tokens or eos is None)


def _processed(logits, seen, step, cfg, eos, counts=None):
    """The scores after the processors: a new float32 array, or ``logits`` itself when no processor
    applies (greedy with no penalty after ``min_new_tokens``: the per-step copy is skipped).
    ``counts`` (N, V): tokens generated so far per row (needed by OpenAI's penalties)."""
    if no_processor(cfg, step, eos) and logits.dtype == np.float32:
        return logits
    scores = logits.astype(np.float32, copy=True)
    scores = apply_repetition_penalty(scores, seen, cfg.repetition_penalty)
    if cfg.presence_penalty or cfg.frequency_penalty:
        scores = apply_openai_penalties(scores, counts, cfg.presence_penalty, cfg.frequency_penalty)
    scores = apply_logit_bias(scores, cfg.logit_bias)
    if step < cfg.min_new_tokens and eos is not None:
        scores[:, eos] = NEG_INF
    return scores


def _plain_greedy(cfg: GenerationConfig, step: int, eos) -> bool:
    """Greedy with no processor at ``step``: the token is the argmax of the raw logits."""
    return cfg.decode_strategy == "greedy" and no_processor(cfg, step, eos)


def next_tokens(logits: np.ndarray, seen: np.ndarray, step: int, cfg: GenerationConfig,
                eos_token_id: Optional[int], rng: np.random.Generator,
                counts: Optional[np.ndarray] = None) -> np.ndarray:
    """The token (B,) chosen from each row of ``logits`` (B, V) at generation step ``step``
    (greedy or sampling, after the logits processors); ``seen`` (B, V) marks tokens already in
    each row (repetition penalty), ``counts`` (B, V) how many times each row generated each token
    (presence and frequency penalties). Sampling draws one number per row from ``rng``."""
    scores = _processed(logits, seen, step, cfg, eos_token_id, counts)
    if cfg.decode_strategy == "greedy":
        return np.argmax(scores, axis=-1)
    return sample_rows(sampling_probs(scores, cfg), rng)


@dataclass
class RowDecoding:
    """One row's decoding state for ``next_tokens_each``: its settings, the step it is at, the
    tokens it has seen (1, V) and generated (``counts`` (1, V)), and its own generator."""

    cfg: GenerationConfig
    step: int
    seen: np.ndarray
    counts: np.ndarray
    rng: np.random.Generator


# Rows next_tokens_each warps in one call: the temporaries of 8 rows of a 50k vocabulary are
# served from glibc's heap; those of 16 made it map fresh pages, and fault them in, on every call.
CHOOSE_ROWS = 8


def next_tokens_each(logits: Sequence[np.ndarray], rows: Sequence[RowDecoding],
                     eos_token_id: Optional[int]) -> np.ndarray:
    """Each row's token (N,) as ``next_tokens`` chooses it alone: row i's logits (V,) are
    ``logits[i]``, its state ``rows[i]``. The rows that decode alike (the same strategy,
    temperature, top-k and top-p) are warped and drawn together, up to ``CHOOSE_ROWS`` at a time,
    each with one number from its own generator: the per-row arithmetic of ``next_tokens``, so a
    seeded row draws what it would alone, at a fraction of the cost of one call per row. If it
    raises, every generator is back where it was (rows warped before the failing one had drawn),
    so the rows can be chosen again, one by one, and draw the same numbers."""
    out = np.empty(len(rows), np.int64)
    groups: dict[tuple, list[int]] = {}
    for i, row in enumerate(rows):
        cfg = row.cfg
        groups.setdefault((cfg.decode_strategy, cfg.temperature, cfg.top_k, cfg.top_p), []).append(i)
    drawing = [(row.rng, row.rng.bit_generator.state) for row in rows if row.cfg.decode_strategy != "greedy"]
    try:
        for alike in groups.values():
            cfg = rows[alike[0]].cfg
            for at in range(0, len(alike), CHOOSE_ROWS):
                members = alike[at:at + CHOOSE_ROWS]
                scores = np.concatenate([_processed(logits[i][None], rows[i].seen, rows[i].step, rows[i].cfg,
                                                    eos_token_id, rows[i].counts) for i in members])
                if cfg.decode_strategy == "greedy":
                    out[members] = np.argmax(scores, axis=-1)
                else:
                    draws = np.array([rows[i].rng.random() for i in members])
                    out[members] = inverse_cdf(sampling_probs(scores, cfg), draws)
    except BaseException:
        for rng, state in drawing:
            rng.bit_generator.state = state
        raise
    return out


def sampling_probs(scores: np.ndarray, cfg: GenerationConfig) -> np.ndarray:
    """The sampling distribution (N, V) of processed ``scores`` (N, V): temperature, top-k, top-p,
    softmax (``next_tokens``'s warpers; speculative decoding applies them to both models)."""
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        scaled = scores / cfg.temperature
    # A temperature so small that a row overflows (inf, or NaN where it rounds to 0 in float32)
    # gets its limit, greedy: its top scores alone, equally likely.
    bad = ~np.isfinite(np.max(scaled, axis=-1))
    if bad.any():
        top = scores[bad]
        scaled[bad] = np.where(top == np.max(top, axis=-1, keepdims=True), 0.0, NEG_INF)
    scores = apply_top_p(apply_top_k(scaled, cfg.top_k), cfg.top_p)
    return _softmax(scores)


# A run of greedy steps in one backend call (``decode_greedy_steps``) lasts about GREEDY_RUN_S at
# the latest run's pace per step, and takes at least MIN_RUN_STEPS (the first run, before a step
# was timed, and a slow model's runs), never more than the backend's ``greedy_steps``: the run's
# fixed cost (the program call, the Python around it) is paid once per run, and a consumer of the
# stream gets a run's tokens at once. ``gptc serve``'s engine sizes its runs the same way.
GREEDY_RUN_S = 0.025
MIN_RUN_STEPS = 8


def run_steps(step_s: float, most: int, run_s: float = GREEDY_RUN_S) -> int:
    """Steps of the next greedy run: ``run_s`` seconds at ``step_s`` a step (0: none timed yet),
    within [``MIN_RUN_STEPS``, ``most``] (``most`` alone when it is smaller)."""
    least = min(MIN_RUN_STEPS, most)
    if step_s <= 0:
        return least
    return max(least, min(most, int(run_s / step_s)))


def stream_tokens(backend, prompts: Sequence[Sequence[int]], cfg: GenerationConfig,
                  eos_token_id: Optional[int], pad_token_id: int,
                  logprobs: Optional[list] = None) -> Iterator[np.ndarray]:
    """Greedy or sampling decode; yields the new token of every row at each step (B,).
    Finished rows (after EOS) yield ``pad_token_id``. ``logprobs``: when given, each step
    appends the chosen tokens' log-probabilities (B,) under the model's raw distribution (every
    step then takes the logits out of the backend)."""
    if cfg.decode_strategy == "beam_search":
        raise ValueError("beam search does not stream; call generate()")
    ids, mask = pad_left(prompts, pad_token_id)
    batch, vocab = ids.shape[0], None
    rng = np.random.default_rng(cfg.seed)
    logits, cache = backend.prefill(ids, mask)
    vocab = logits.shape[-1]
    penalty = uses_history(cfg)  # only the penalties read ``seen`` and ``counts``
    seen = np.zeros((batch, vocab if penalty else 0), dtype=bool)
    counts = np.zeros((batch, vocab if penalty else 0), dtype=np.int32)
    if penalty:
        rows, cols = np.nonzero(mask)
        seen[rows, ids[rows, cols]] = True
    unfinished = np.ones(batch, dtype=bool)
    greedy = backend.decode_greedy  # the argmax made by the backend (no logits copied out)
    chunk = backend.greedy_steps  # greedy steps the backend runs in one call, at most
    if logprobs is not None:
        greedy, chunk = None, 1
    step_s = 0.0  # seconds a step of the latest greedy run took (run_steps)
    ahead: list = []  # tokens such a call made that are still to be yielded, in order
    for step in range(cfg.max_new_tokens):
        if ahead:
            nxt = ahead.pop(0)
        else:
            nxt = next_tokens(logits, seen, step, cfg, eos_token_id, rng, counts) if logits is not None else argmax
        nxt = np.where(unfinished, nxt, pad_token_id).astype(np.int64)
        if logprobs is not None:
            logprobs.append(np.take_along_axis(_log_softmax(logits.astype(np.float64)), nxt[:, None], axis=-1)[:, 0])
        if penalty:
            seen[np.arange(batch), nxt] |= unfinished
            counts[np.arange(batch), nxt] += unfinished
        yield nxt
        if eos_token_id is not None:
            unfinished &= nxt != eos_token_id
        if not unfinished.any() or step == cfg.max_new_tokens - 1:
            return
        if ahead:  # already fed to the cache by the call that made them
            continue
        mask = np.concatenate([mask, np.ones((batch, 1), dtype=np.int64)], axis=1)
        steps = min(run_steps(step_s, chunk), cfg.max_new_tokens - step - 1)
        if steps > 1 and cfg.decode_strategy == "greedy" and not penalty and not cfg.logit_bias:
            suppress = min(steps, max(0, cfg.min_new_tokens - step - 1)) if eos_token_id is not None else 0
            start = time.perf_counter()
            tokens, cache = backend.decode_greedy_steps(nxt[:, None], mask, cache, steps, eos_token_id,
                                                        pad_token_id, ~unfinished, suppress)
            step_s = (time.perf_counter() - start) / steps
            mask = np.concatenate([mask, np.ones((batch, steps - 1), dtype=np.int64)], axis=1)
            ahead, logits = list(tokens.T), None
        elif greedy is not None and _plain_greedy(cfg, step + 1, eos_token_id):
            (argmax, cache), logits = greedy(nxt[:, None], mask, cache), None
        else:
            logits, cache = backend.decode(nxt[:, None], mask, cache)


def best_of(backend, prompts: Sequence[Sequence[int]], cfg: GenerationConfig,
            eos_token_id: Optional[int], pad_token_id: int) -> GenerationOutput:
    """OpenAI's ``best_of`` (``cfg.best_of`` candidates, n = 1): candidate j decodes every prompt
    with seed ``seed + j`` (as `gptc serve` seeds choice j); each prompt keeps the candidate of
    highest mean token log-probability (``best_candidates``)."""
    runs = []
    for j in range(cfg.best_of):
        seed = None if cfg.seed is None else cfg.seed + j
        one = dataclasses.replace(cfg, best_of=1, seed=seed)
        steps: list = []
        seqs: list[list[int]] = [[] for _ in prompts]
        alive = [True] * len(prompts)
        sums = np.zeros(len(prompts))
        for tokens in stream_tokens(backend, prompts, one, eos_token_id, pad_token_id, steps):
            lps = steps.pop()  # this step's log-probabilities, appended before the tokens are yielded
            for i, t in enumerate(tokens):
                if alive[i]:
                    seqs[i].append(int(t))
                    sums[i] += lps[i]
                    alive[i] = eos_token_id is None or int(t) != eos_token_id
        runs.append((seqs, sums))
    out = []
    for i in range(len(prompts)):
        best = best_candidates([s[i] for _, s in runs], [len(q[i]) for q, _ in runs], 1)[0]
        out.append(runs[best][0][i])
    return GenerationOutput(sequences=out)


def best_candidates(logprob_sums: Sequence[float], lengths: Sequence[int], n: int) -> list[int]:
    """OpenAI's ``best_of``: the indices of the ``n`` candidates of highest log-probability per
    token (``logprob_sums[i] / lengths[i]``, under the model's raw distribution), best first;
    ties keep the candidates' order."""
    mean = [s / max(k, 1) for s, k in zip(logprob_sums, lengths)]
    return sorted(range(len(mean)), key=lambda i: -mean[i])[:n]


# --------------------------------------------------------------------------------------
# Beam search
# --------------------------------------------------------------------------------------
def beam_search(backend, prompts: Sequence[Sequence[int]], cfg: GenerationConfig,
                eos_token_id: Optional[int], pad_token_id: int) -> GenerationOutput:
    """Hugging Face-compatible beam search; returns the best hypothesis per prompt."""
    nb, lp = cfg.num_beams, cfg.length_penalty
    ids, mask = pad_left(prompts, pad_token_id)
    batch = ids.shape[0]
    logits, cache = backend.prefill(ids, mask)  # one prefill per prompt, then copy rows
    check_beam_budget(cfg, batch, ids.shape[1], logits.shape[-1], cache)
    rows = np.repeat(np.arange(batch), nb)
    cache = backend.reorder_cache(cache, rows)
    logits, mask = logits[rows], mask[rows]
    vocab = logits.shape[-1]
    seen = np.zeros((batch * nb, vocab), dtype=bool)
    counts = np.zeros((batch * nb, vocab if uses_history(cfg) else 0), dtype=np.int32)
    if cfg.repetition_penalty != 1.0:
        r, c = np.nonzero(mask)
        seen[r, ids[rows][r, c]] = True
    running_scores = np.tile(np.array([0.0] + [-1e9] * (nb - 1)), (batch, 1))  # (B, nb)
    running_tokens = np.zeros((batch, nb, 0), dtype=np.int64)
    finished: list[list[tuple[float, list[int]]]] = [[] for _ in range(batch)]
    done = np.zeros(batch, dtype=bool)
    keep = 2 * nb if eos_token_id is not None else nb
    for step in range(cfg.max_new_tokens):
        gen_len = step + 1
        logp = _log_softmax(logits.astype(np.float32))
        logp = _processed(logp, seen, step, cfg, eos_token_id, counts)
        total = (logp.reshape(batch, nb, vocab) + running_scores[:, :, None]).reshape(batch, nb * vocab)
        top = np.argsort(-total, axis=-1, kind="stable")[:, :keep]  # (B, keep)
        top_scores = np.take_along_axis(total, top, axis=-1)
        top_beam, top_tok = top // vocab, top % vocab
        last = step == cfg.max_new_tokens - 1
        new_scores = np.full((batch, nb), -1e9)
        new_src = np.zeros((batch, nb), dtype=np.int64)
        new_tok = np.full((batch, nb), pad_token_id, dtype=np.int64)
        for b in range(batch):
            hyps, n = finished[b], 0
            for j in range(keep):
                score, src, tok = top_scores[b, j], top_beam[b, j], top_tok[b, j]
                ends = last or (eos_token_id is not None and tok == eos_token_id)
                if ends:
                    # Only the best num_beams candidates may finish (HF's top_num_beam_mask).
                    if j < nb and not done[b] and score > -1e8:
                        seq = list(running_tokens[b, src]) + [int(tok)]
                        hyps.append((score / gen_len ** lp, seq))
                        hyps.sort(key=lambda h: -h[0])
                        del hyps[nb:]
                    continue
                if n < nb:
                    new_scores[b, n], new_src[b, n], new_tok[b, n] = score, src, tok
                    n += 1
            if len(hyps) == nb and not done[b]:
                if cfg.early_stopping:
                    done[b] = True
                else:
                    # No running beam can beat the worst finished one (HF's default heuristic).
                    done[b] = new_scores[b, 0] / gen_len ** lp <= hyps[-1][0]
        if last or done.all():
            break
        src_rows = (np.arange(batch)[:, None] * nb + new_src).reshape(-1)
        running_tokens = np.concatenate([running_tokens[np.arange(batch)[:, None], new_src],
                                         new_tok[:, :, None]], axis=2)
        running_scores = new_scores
        seen = seen[src_rows]
        seen[np.arange(batch * nb), new_tok.reshape(-1)] = True
        if counts.size:
            counts = counts[src_rows]
            counts[np.arange(batch * nb), new_tok.reshape(-1)] += 1
        cache = backend.reorder_cache(cache, src_rows)
        mask = np.concatenate([mask[src_rows], np.ones((batch * nb, 1), dtype=np.int64)], axis=1)
        logits, cache = backend.decode(new_tok.reshape(-1, 1), mask, cache)
    best = [finished[b][0] for b in range(batch)]
    return GenerationOutput(sequences=[[int(t) for t in s] for _, s in best], scores=[float(s) for s, _ in best])


def _nbytes(obj) -> int:
    """Bytes held by a (nested list/tuple of) numpy arrays or tensors."""
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(o) for o in obj)
    if isinstance(obj, dict):
        return sum(_nbytes(o) for o in obj.values())
    shape = getattr(obj, "shape", None)
    try:
        shape = shape() if callable(shape) else shape  # onnxruntime's OrtValue.shape() is a method
        return int(np.prod(shape)) * 4 if shape is not None else 0
    except (TypeError, ValueError):
        return 0  # a cache type we cannot size: the vocabulary term of the estimate still applies


def memory_limit() -> int:
    """Bytes beam search may plan to use: half the machine's RAM, at most 8 GiB."""
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        ram = 16 << 30
    return min(ram // 2, 8 << 30)


def check_beam_budget(cfg: GenerationConfig, batch: int, prompt_len: int, vocab: int, cache) -> None:
    """Refuse a beam search that cannot fit: more beams than vocabulary entries, or an estimated
    peak (per row: scores over the vocabulary + the KV cache at full length) over ``memory_limit``."""
    nb = cfg.num_beams
    if nb > vocab:
        raise ConfigError(f"Generation.num_beams={nb} exceeds the model's vocabulary of {vocab} tokens")
    rows = batch * nb
    per_token = _nbytes(cache) / max(batch * prompt_len, 1)
    need = rows * (vocab * 25 + 2 * per_token * (prompt_len + cfg.max_new_tokens))
    limit = memory_limit()
    if need > limit:
        raise ConfigError(f"Generation.num_beams={nb} x {batch} prompt(s) x {prompt_len + cfg.max_new_tokens} "
                          f"tokens needs about {need / 2**30:.1f} GiB, over the {limit / 2**30:.1f} GiB allowed; "
                          "lower Generation.num_beams or Generation.max_new_tokens")


def generate(backend, prompts: Sequence[Sequence[int]], cfg: GenerationConfig,
             eos_token_id: Optional[int], pad_token_id: int,
             on_tokens: Optional[Callable[[np.ndarray], None]] = None) -> GenerationOutput:
    """Decode ``prompts`` (lists of token ids) with ``cfg``; ``on_tokens`` receives each step's
    new tokens (B,) as they are produced (greedy/sampling)."""
    cfg.__post_init__()  # fields may have been set after construction: check them again
    if cfg.decode_strategy == "beam_search":
        return beam_search(backend, prompts, cfg, eos_token_id, pad_token_id)
    if cfg.best_of > 1:
        return best_of(backend, prompts, cfg, eos_token_id, pad_token_id)
    steps = stream_tokens(backend, prompts, cfg, eos_token_id, pad_token_id)
    return GenerationOutput(sequences=collect_sequences(steps, len(prompts), eos_token_id, on_tokens))


def collect_sequences(steps: Iterable[np.ndarray], batch: int, eos_token_id: Optional[int],
                      on_tokens: Optional[Callable[[np.ndarray], None]] = None) -> list[list[int]]:
    """Each row's tokens from an iterator of per-step tokens (B,) (``stream_tokens`` and the
    like), up to and including its EOS; ``on_tokens(step)`` sees every step as it comes."""
    out: list[list[int]] = [[] for _ in range(batch)]
    alive = [True] * batch
    for step in steps:
        if on_tokens is not None:
            on_tokens(step)
        for i, t in enumerate(step):
            if alive[i]:
                out[i].append(int(t))
                alive[i] = eos_token_id is None or int(t) != eos_token_id
    return out
