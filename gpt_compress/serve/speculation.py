"""Speculative decoding in the server (``engine.py`` owns one ``Speculation`` when it speculates).

Each request without a penalty that reads the tokens so far and without logprobs gets an
``AdaptiveK`` schedule: up to ``tokens`` draft tokens per step, fewer or none for a while when
they are rejected. The drafts come from prompt lookup (``NgramDraft``) or from a draft model
with a slot cache of its own (``SlotDecoder``, rows joined and left with the target's). The
engine feeds every row its token and drafts in one verify step (``SlotDecoder.step_many``);
``verify`` then keeps, per request, what ``model/speculative.py``'s ``verify_row`` accepts
(greedy: its own choices; sampling: the rejection rule with its own generator), takes the tokens
through the engine, and rolls both slot caches back.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Optional

import numpy as np

from ..model.generation import uses_history
from ..model.speculative import AdaptiveK, NgramDraft, pick_row, verify_row
from .slots import SlotDecoder

log = logging.getLogger("gpt_compress.serve")


def draft_decoder(gen, draft, max_batch: int) -> SlotDecoder:
    """The draft model's slot decoder: ``draft`` as ``Generator.draft_for`` takes it ("auto", a
    model directory or a Generator; same vocabulary and tokenizer as ``gen``)."""
    backend = gen.draft_for(draft).backend
    if backend.serve_decoder != "slots":
        raise ValueError(f"the draft {draft} does not run on the fused Paddle program, which the server's "
                         "draft models need (its slot cache)")
    if backend.manifest.max_positions < gen.max_positions:
        raise ValueError(f"the draft {draft} has a context of {backend.manifest.max_positions} positions, the "
                         f"model {gen.max_positions}: a draft needs at least the model's")
    return SlotDecoder(backend, max_batch)


class Speculation:
    """Proposals, acceptance and rollback for the engine's running requests (keyed by request id)."""

    def __init__(self, gen, tokens: int, draft, max_batch: int, eos: Optional[int], metrics=None):
        self.tokens = tokens  # draft tokens a request gets per step, at most
        self.eos, self.metrics = eos, metrics
        self.ngram = NgramDraft()
        self.drafter = draft_decoder(gen, draft, max_batch) if draft not in (None, "", "ngram") else None
        self._round: tuple[int, dict[int, int]] = (0, {})  # the draft model's last run (``_drafts``)
        self._q: dict[int, np.ndarray] = {}  # sampled requests' draft probabilities (k, V) this step
        self.proposed = self.accepted = 0  # draft tokens checked / kept (stats)
        self.steps = self.produced = 0  # request steps that checked drafts / tokens they produced

    def schedule(self, req) -> Optional[AdaptiveK]:
        """``req``'s draft-count schedule, or None when it is not speculated."""
        if uses_history(req.cfg) or req.logprobs is not None:
            return None
        return AdaptiveK(self.tokens)

    # ------------------------------------------------------------------ rows
    def join(self, reqs: list) -> None:
        """Prefill the speculated newcomers' prompts on the draft model and give them its slots."""
        if self.drafter is None or not reqs:
            return
        states = self.drafter.prefill_many([req.prompt for req in reqs])
        self.drafter.join([(req.id, state) for req, (_, state) in zip(reqs, states)])
        for req in reqs:
            req.drafted = len(req.prompt)

    def leave(self, rids) -> None:
        if self.drafter is not None:
            self.drafter.remove(rids)

    def clear(self) -> None:
        """Forget every row (the engine failed all of them)."""
        self._round, self._q = (0, {}), {}
        if self.drafter is not None:
            self.drafter.remove(list(self.drafter.keys))

    # ------------------------------------------------------------------ a step
    def proposals(self, running: dict) -> dict[int, list[int]]:
        """Each speculated request's draft tokens for this step: up to its ``AdaptiveK`` count
        (asked once per step, as ``speculative_tokens`` does), never past ``max_tokens``; from
        prompt lookup or the draft model (``_drafts``)."""
        want = {}
        for rid, req in running.items():
            if req.schedule is not None:
                k = min(req.schedule.next(), req.cfg.max_new_tokens - len(req.tokens) - 1)
                if k > 0:
                    want[rid] = k
        if self.drafter is not None:
            return self._drafts(running, want) if want else {}
        out = {}
        for rid, k in want.items():
            req = running[rid]
            got = self.ngram.lookup(req.prompt + req.tokens, k)
            if got:
                out[rid] = got
        return out

    def _drafts(self, running: dict, want: dict[int, int]) -> dict[int, list[int]]:
        """The draft model proposes ``want[rid]`` tokens per request: one ``step_many`` feeds every
        draft row the tokens its cache lacks (the newest, and the last accepted draft when all were
        kept), then max(want) - 1 one-token steps feed each row its previous proposal (a row that
        proposes fewer, or none, its last token: those columns are dropped after the verify).
        Sampled requests draw from the draft's distribution with their own generator, kept in
        ``_q`` for the rejection rule."""
        t0 = time.perf_counter()
        reqs = {rid: running[rid] for rid in self.drafter.keys}
        rows = self.drafter.step_many({rid: (r.prompt + r.tokens)[r.drafted:] for rid, r in reqs.items()})
        if rows is None:  # no room in the draft's cache: no proposals this step
            return {}
        for r in reqs.values():
            r.drafted = len(r.prompt) + len(r.tokens)
        last = {rid: x[-1] for rid, x in rows.items()}
        steps = max(want.values())
        drafts: dict[int, list[int]] = {rid: [] for rid in want}
        probs: dict[int, list] = {rid: [] for rid in want}
        for j in range(steps):
            for rid, k in want.items():
                if j < k:
                    req = reqs[rid]
                    tok, q = pick_row(last[rid], len(req.tokens) + j, req.cfg, self.eos, req.rng)
                    drafts[rid].append(tok)
                    probs[rid].append(q)
            if j < steps - 1:
                feed = {rid: drafts[rid][j] if j < want.get(rid, 0) else r.tokens[-1] for rid, r in reqs.items()}
                last = self.drafter.step(feed)
        self._round = (steps - 1, {rid: min(k, steps - 1) for rid, k in want.items()})
        self._q = {rid: np.stack(q) for rid, q in probs.items() if q[0] is not None}
        if self.metrics is not None:
            self.metrics.draft_seconds.inc(time.perf_counter() - t0)
        return drafts

    def rollback(self, running: dict, accepted: dict[int, int]) -> None:
        """After a verify step (or instead of one: ``accepted`` empty): each draft row keeps the
        proposals it fed that were accepted (``accepted[rid]`` drafts kept), the other columns of
        the last ``_drafts`` run dropped."""
        fed, own = self._round
        self._round, self._q = (0, {}), {}
        if self.drafter is None or not fed:
            return
        keep = {rid: min(accepted.get(rid, 0), n) for rid, n in own.items()}
        self.drafter.drop({rid: fed - keep.get(rid, 0) for rid in self.drafter.keys})
        for rid, n in keep.items():
            if rid in running:
                running[rid].drafted += n

    def verify(self, running: dict, batch, logits: dict[int, np.ndarray], drafts: dict[int, list[int]],
               take: Callable, fail: Callable) -> list[int]:
        """Each request with drafts keeps them by ``verify_row`` and takes its next token through
        ``take(req, tok) -> finished`` (EOS, stop strings and ``max_tokens`` end it inside a run;
        an exception fails it alone through ``fail(req, e)``); the others get their next logits.
        The slot caches roll back (``batch.keep``, the draft's ``drop``); returns the requests
        that finished."""
        done, kept, accepted = [], {}, {}
        for rid, req in list(running.items()):
            rows, fed = logits[rid], drafts.get(rid, [])
            if not fed:
                kept[rid], req.logits = 1, rows[0]
                continue
            before, finished = len(req.tokens), False
            try:
                a, nxt = verify_row(rows, np.asarray(fed), self._q.get(rid), len(fed), before, req.cfg, self.eos,
                                    req.rng)
                for tok in fed[:a] + [nxt]:
                    finished = take(req, int(tok))
                    if finished:
                        break
            except Exception as e:
                log.exception("request %d failed", rid)
                fail(req, e)
                a, finished = 0, True
            req.schedule.update(len(fed), a)
            kept[rid], accepted[rid] = 1 + a, a
            self.proposed, self.accepted = self.proposed + len(fed), self.accepted + a
            self.steps, self.produced = self.steps + 1, self.produced + len(req.tokens) - before
            if finished:
                done.append(rid)
        batch.keep(kept)
        self.rollback(running, accepted)
        if self.metrics is not None and accepted:
            m = self.metrics
            m.draft_tokens.inc(sum(len(drafts[rid]) for rid in accepted))
            m.accepted_tokens.inc(sum(accepted.values()))
            m.spec_steps.inc(len(accepted))
            m.acceptance_rate.set(self.accepted / max(self.proposed, 1))
            m.tokens_per_step.set(self.produced / max(self.steps, 1))
        return done
