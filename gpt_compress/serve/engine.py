"""The engine: one loop, on its own thread, owns the backend and schedules every request.

Iteration-level scheduling (Orca, vLLM): between two decode steps the loop

1. drops requests that were cancelled (client gone) or ran past their deadline,
2. admits waiting requests (in arrival order) while the batch has room and, when sequences
   are running, the iteration's prompt tokens stay within ``prefill_budget`` (at least one
   request; so that running sequences are not stalled by a burst of arrivals; with nothing
   running, no one waits on them and all that fit are admitted): on the fused program they are
   prefilled together (``SlotDecoder.prefill_many``: left-padded batches of similar lengths;
   alone, one by one, if that fails or on the other backends), then they join the running
   batch together (``decoder.py``: ``SlotDecoder`` on the fused Paddle program copies each newcomer into a free
   slot of a preallocated cache; ``BatchDecoder`` on the other backends merges caches); their
   first tokens are chosen at once. With ``BatchDecoder``, while a large batch runs, a lone
   arrival waits up to ``admit_wait_steps`` steps for others (until a quarter of the running
   count is waiting), because every join copies the batch's cache,
3. chooses every running request's next token from its logits with the decoding code of
   ``model/generation.py`` (``next_tokens_each``: greedy, sampling, top-k/top-p, repetition
   penalty; the requests that sample alike are warped and drawn together, each with its own
   seeded generator, so a seeded request samples what ``Generator.generate`` samples for it
   alone),
4. removes finished requests (EOS, ``max_tokens``, a stop string) from the batch at once,
5. runs one ``decode`` step for the rest; with speculative decoding, a verify step instead
   (``SlotDecoder.step_many``) that feeds each speculated request its token and draft tokens
   (prompt lookup, or a draft model with a slot cache of its own; ``speculation.py``), after
   which each keeps what ``model/speculative.py``'s ``verify_row`` accepts (greedy: its own
   choices; sampling: the rejection rule with its own generator) and the caches roll back.
   When every running request is plain greedy (no penalty, bias, log-probabilities or
   speculation), the step runs as ``step_greedy`` instead: the argmax is made where the logits
   lie and no logits leave the program; while no request can be admitted (none waits, or the
   batch is full) several steps run in that one call (vLLM's multi-step scheduling), about
   ``greedy_run`` seconds of them at the latest run's pace (``_run_steps``: from
   ``generation.MIN_RUN_STEPS`` up to the decoder's ``greedy_steps``), never past the nearest
   ``max_tokens``. Their tokens are then taken one by one as in 3-4, so a request's tokens,
   events and stop strings are those of single steps.

Events go back to the caller through ``Request.emit`` (called on the engine thread; the HTTP
layer forwards them into its event loop), exactly one ``Finished`` or ``Failed`` per request.
A request's events are gathered and handed over together (``_flush``): once before the decode
step (first tokens, finished requests) and once after it, so a greedy run's tokens cost the
caller one hand-over, not one per token.
An exception while prefilling, setting up or sampling one request fails that request only (its
row never joins, or leaves, the batch); one in the batched decode step fails the requests of
that step (it cannot be attributed to one of them) and the loop goes on serving with an empty
batch.
"""
from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from typing import Callable, Optional

import numpy as np

from ..eval.scoring import top_logprobs
from ..model.generation import RowDecoding, next_tokens_each, run_steps, uses_history
from ..model.speculative import DRAFT_TOKENS
from .decoder import make_decoder
from .request import Failed, Finished, PromptScored, Request, Token
from .speculation import Speculation
from .text import GeneratedText

log = logging.getLogger("gptc.serve")


class QueueFull(Exception):
    """The waiting queue is full (HTTP 429)."""


class EngineStopped(Exception):
    """The engine no longer accepts requests (shutting down; HTTP 503)."""


class Engine:
    """Continuous batching over a ``Generator``'s backend (see the module docstring)."""

    def __init__(self, generator, max_batch: int = 16, max_queue: int = 64, metrics=None,
                 step_delay: float = 0.0, prefill_budget: int = 256, admit_wait_steps: int = 4,
                 speculative_tokens: int = 0, draft=None, greedy_run_ms: float = 25.0):
        self.gen = generator
        self.tokenizer = generator.tokenizer
        vocab = generator.vocab_size
        eos = generator.eos_token_id
        self.eos = eos if eos is not None and 0 <= eos < vocab else None  # as Generator._prepare
        self.max_batch, self.max_queue = max_batch, max_queue
        self.metrics = metrics
        self.step_delay = step_delay
        self.greedy_run = greedy_run_ms / 1000  # seconds a greedy run lasts, about (``_run_steps``)
        self._step_s = 0.0  # seconds a step of the latest greedy run took (0: none ran yet)
        self.prefill_budget = prefill_budget
        self.admit_wait_steps = admit_wait_steps
        self.batch = make_decoder(generator.backend, max_batch)
        # Speculative decoding (``speculation.py``): up to this many draft tokens per request and
        # step, checked in one verify step (``SlotDecoder.step_many``); 0: off. ``draft``: "ngram"
        # (prompt lookup; the default) or, for ``Generator.draft_for``, "auto", a model directory
        # or a Generator: a draft model with a slot cache of its own.
        tokens = speculative_tokens or (DRAFT_TOKENS if draft else 0)
        if tokens and not self.batch.verifies:
            raise ValueError("speculative decoding in the server needs the fused Paddle program (backend paddle)")
        self.spec = Speculation(generator, tokens, draft, max_batch, self.eos, metrics) if tokens else None
        self._pending: collections.deque[Request] = collections.deque()
        self._running: dict[int, Request] = {}
        self._cond = threading.Condition()
        self._ids = itertools.count(1)
        self._stopping = False
        self._unsent: list[Request] = []  # requests with events in their outbox
        self._thread = threading.Thread(target=self._loop, name="gptc-engine", daemon=True)
        self.steps = 0

    # ------------------------------------------------------------------ control
    def start(self) -> "Engine":
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the loop; requests still waiting or running fail with 503."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout)

    def submit(self, req: Request) -> Request:
        """Queue a request (any thread). Raises QueueFull or EngineStopped."""
        self.submit_all([req])
        return req

    def submit_all(self, reqs: list[Request]) -> None:
        """Queue requests at once (any thread): the engine sees all of them or none (the choices
        of one HTTP request). Raises QueueFull (when not all fit) or EngineStopped."""
        with self._cond:
            if self._stopping:
                raise EngineStopped("the server is shutting down")
            free = self.max_batch - len(self._running)
            if len(self._pending) + len(reqs) > self.max_queue + max(free, 0):
                raise QueueFull(f"{len(self._pending)} requests are waiting (Serve.max_queue={self.max_queue})")
            now = time.monotonic()
            for req in reqs:
                req.id, req.submitted, req.submitted_step = next(self._ids), now, self.steps
                self._pending.append(req)
            self._cond.notify_all()
        self._gauges()

    @property
    def queue_depth(self) -> int:
        return len(self._pending)

    @property
    def running(self) -> int:
        return len(self._running)

    # ------------------------------------------------------------------ the loop
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not self._pending and not self._running:
                    self._cond.wait()
                if self._stopping:
                    break
            try:
                self._iteration()
            except Exception as e:  # a bug of the loop itself: fail what is running, keep serving
                log.exception("engine step failed")
                self._fail_all(500, f"internal error: {type(e).__name__}: {e}")
            self._flush()
        self._fail_all(503, "the server shut down before this request finished")
        with self._cond:
            pending, self._pending = list(self._pending), collections.deque()
        for req in pending:
            self._send(req, Failed(503, "the server shut down before this request started"))
        self._flush()

    def _iteration(self) -> None:
        now = time.monotonic()
        self._drop_expired(now)
        self._admit()
        self._leave(self._choose_all([req for req in self._running.values() if req.logits is not None]))
        self._flush()  # first tokens and finished requests go out before the step
        if self._running:
            tokens = {rid: req.tokens[-1] for rid, req in self._running.items()}
            if self.metrics is not None:
                self.metrics.batch_size.observe(len(tokens))
            run = self._greedy_run()
            try:
                if run is not None:
                    start = time.perf_counter()
                    out = self.batch.step_greedy(tokens, *run)
                    self._step_s = (time.perf_counter() - start) / run[0]
                else:
                    drafts = self.spec.proposals(self._running) if self.spec is not None else {}
                    logits = (self.batch.step_many({rid: [tok] + drafts.get(rid, []) for rid, tok in tokens.items()})
                              if drafts else None)
                    if logits is None:
                        if self.spec is not None:  # no room for the verify step: nothing was checked
                            self.spec.rollback(self._running, {})
                        drafts, logits = {}, self.batch.step(tokens)
            except Exception as e:
                log.exception("decode step failed")
                self._fail_all(500, f"decode step failed: {type(e).__name__}: {e}")
                return
            if run is not None:
                self.steps += run[0]
                self._leave(self._take_run(out))
            elif drafts:
                self.steps += 1
                self._leave(self.spec.verify(self._running, self.batch, logits, drafts,
                                             lambda req, tok: self._take(req, tok, None), self._fail))
            else:
                self.steps += 1
                for rid, row in logits.items():
                    self._running[rid].logits = row
            if self.step_delay:
                time.sleep(self.step_delay)
        self._gauges()

    def _greedy_run(self) -> Optional[tuple[int, Optional[int], int]]:
        """(steps, eos, suppress) for ``step_greedy`` when every running request is plain greedy,
        else None: the argmax is made in the program (no logits copied out, no argmax of each
        row in numpy). Several steps only while no request can be admitted (none waits, or the
        batch is full); else one, so that the waiting are admitted at the next step. The run
        stops at the nearest ``max_tokens``, and ``min_tokens`` must hold EOS back for the same
        first steps of every row (the program's one ``suppress`` count)."""
        if self.batch.greedy_steps < 2 or self.spec is not None:
            return None
        admissible = self._pending and len(self._running) < self.max_batch
        steps, holds = 1 if admissible else self._run_steps(), set()
        for req in self._running.values():
            cfg = req.cfg
            if cfg.decode_strategy != "greedy" or uses_history(cfg) or cfg.logit_bias or req.logprobs is not None:
                return None
            done = len(req.tokens)  # generated so far; the run makes tokens done + 0, 1, ...
            steps = min(steps, cfg.max_new_tokens - done)
            holds.add(max(0, cfg.min_new_tokens - done))
        if self.eos is None:
            return steps, None, 0
        steps = min([steps] + [h for h in holds if h > 0])  # each row's hold is 0 or covers the run
        if len({min(h, steps) for h in holds}) > 1:
            return None
        return steps, self.eos, min(max(holds), steps)

    def _run_steps(self) -> int:
        """Steps of a run while nothing can be admitted (``generation.run_steps``): ``greedy_run``
        seconds at the latest run's pace per step, within [``generation.MIN_RUN_STEPS``, the
        decoder's ``greedy_steps``]. A run's fixed cost (the program call, the Python around it,
        one hand-over of its tokens to the HTTP loop) is paid once per run, and a request arriving
        meanwhile waits at most one run."""
        return run_steps(self._step_s, self.batch.greedy_steps, self.greedy_run)

    def _take_run(self, out: dict) -> list[int]:
        """Take each row's tokens of a ``step_greedy`` run in order, up to its end; the rows that
        finished."""
        done = []
        for rid, toks in out.items():
            req = self._running[rid]
            if any(self._guarded(req, self._take, req, int(tok), None) for tok in toks):
                done.append(rid)
        return done

    def _guarded(self, req: Request, fn: Callable[..., bool], *args) -> bool:
        """``fn(*args)`` for ``req`` (True when it finished); an exception fails ``req`` alone
        (True: it leaves the batch)."""
        try:
            return fn(*args)
        except Exception as e:
            log.exception("request %d failed", req.id)
            self._fail(req, e)
            return True

    def _drop_expired(self, now: float) -> None:
        gone = []
        for rid, req in self._running.items():
            if req.cancelled:
                gone.append(rid)
                self._count("cancelled")
            elif req.timeout and now - req.submitted > req.timeout:
                self._finish(req, Failed(504, f"request timed out after {req.timeout:g} s"))
                gone.append(rid)
        self._leave(gone)
        with self._cond:
            keep = collections.deque()
            for req in self._pending:
                if req.cancelled:
                    self._count("cancelled")
                elif req.timeout and now - req.submitted > req.timeout:
                    self._finish(req, Failed(504, f"request timed out after {req.timeout:g} s while queued"))
                else:
                    keep.append(req)
            self._pending = keep

    def _admit(self) -> None:
        """Take waiting requests while the batch has room and, if sequences are running (they
        wait for these prefills), this iteration's prompt tokens stay within ``prefill_budget``
        (at least one request); with nothing running, as many as the batch has room for. Prefill
        them together (``_prefill``), then join them together."""
        with self._cond:
            if (not self.batch.cheap_join and self._running and self._pending
                    and len(self._pending) < max(1, len(self._running) // 4)
                    and self.steps - self._pending[0].submitted_step < self.admit_wait_steps):
                return  # a join copies the batch's cache: let a few arrivals gather (a few steps at most)
            taken: list[Request] = []
            budget = self.prefill_budget if self._running else float("inf")
            while (self._pending and len(self._running) + len(taken) < self.max_batch
                   and (not taken or len(self._pending[0].prompt) <= budget)):
                taken.append(self._pending.popleft())
                budget -= len(taken[-1].prompt)
        taken = self._score_prompts(taken)
        try:
            joining = [(req, state) for req, state in self._prefill(taken) if self._ready(req)]
            if joining:
                self.batch.join([(req.id, state) for req, state in joining])
                if self.spec is not None:
                    self.spec.join([req for req, _ in joining if req.schedule is not None])
        except Exception as e:
            log.exception("admitting %d requests failed", len(taken))
            self._leave([req.id for req in taken])
            for req in taken:
                self._finish(req, Failed(500, f"admission failed: {type(e).__name__}: {e}"))
            return
        for req, _ in joining:  # nothing here can raise: a joined row always has its request
            self._running[req.id] = req
            if self.metrics is not None:
                self.metrics.prompt_tokens.inc(len(req.prompt))

    def _score_prompts(self, reqs: list[Request]) -> list[Request]:
        """Emit the prompt log-probabilities of the requests that asked for them, all of them
        scored in one batch (right-padded: causal attention never lets a position see the
        padding after it; ``eval/scoring.py``'s ``top_logprobs``: logits only at the prompts'
        rows). Requests that only score finish here; returns those still to generate."""
        scoring = [r for r in reqs if r.prompt_logprobs is not None and len(r.prompt) > 1]
        if scoring:
            try:
                width = max(len(r.prompt) for r in scoring)
                ids = np.zeros((len(scoring), width), np.int64)
                select = np.zeros((len(scoring), width), bool)
                for i, r in enumerate(scoring):
                    ids[i, :len(r.prompt)] = r.prompt
                    select[i, :len(r.prompt) - 1] = True  # the positions predicting tokens 1..T-1
                labels = np.roll(ids, -1, axis=1)
                lp, top_ids, top_lp = top_logprobs(self.gen.backend, ids, labels, select,
                                                   max(r.prompt_logprobs for r in scoring))
            except Exception as e:
                log.exception("scoring %d prompts failed", len(scoring))
                for r in scoring:
                    self._finish(r, Failed(500, f"scoring the prompt failed: {type(e).__name__}: {e}"))
                return [r for r in reqs if not r.ended]
            at = 0
            for r in scoring:
                n, k = len(r.prompt) - 1, r.prompt_logprobs
                scored = PromptScored([float(x) for x in lp[at:at + n]],
                                      [[(int(i), float(v)) for i, v in zip(top_ids[j, :k], top_lp[j, :k])]
                                       for j in range(at, at + n)])
                self._send(r, scored)
                at += n
        for r in reqs:
            if r.prompt_logprobs is not None and len(r.prompt) == 1:
                self._send(r, PromptScored([], []))
            if not r.generate:
                self._finish(r, Finished("length", "", 0))
        return [r for r in reqs if r.generate and not r.ended]

    def _ready(self, req: Request) -> bool:
        """Set up ``req``'s sampling state before it joins the batch; False (and the request
        failed alone) if that raises, so that no row joins without its request."""
        try:
            req.rng = np.random.default_rng(req.cfg.seed)
            req.text = GeneratedText(self.tokenizer)
            req.seen = np.zeros((1, req.logits.shape[-1]), dtype=bool)
            req.counts = np.zeros((1, req.logits.shape[-1] if uses_history(req.cfg) else 0), dtype=np.int32)
            if req.cfg.repetition_penalty != 1.0:
                req.seen[0, req.prompt] = True
            if self.spec is not None:
                req.schedule = self.spec.schedule(req)
        except Exception as e:
            log.exception("request %d failed", req.id)
            self._fail(req, e)
            return False
        return True

    def _prefill(self, reqs: list[Request]) -> list[tuple[Request, tuple]]:
        """Prefill ``reqs`` (setting their first logits); returns ``[(req, join state), ...]``.
        Together in one call when the decoder can (``SlotDecoder.prefill_many``); if that fails,
        or the decoder cannot, one by one, so that a failing prompt fails only its request."""
        if len(reqs) > 1 and self.batch.batches_prefill:
            try:
                results = self.batch.prefill_many([req.prompt for req in reqs])
            except Exception:
                log.exception("batched prefill of %d requests failed: prefilling them one by one", len(reqs))
            else:
                for req, (logits, _) in zip(reqs, results):
                    req.logits = logits
                return [(req, state) for req, (_, state) in zip(reqs, results)]
        joining = []
        for req in reqs:
            try:
                req.logits, state = self.batch.prefill(req.prompt)
            except Exception as e:
                log.exception("prefill of request %d failed", req.id)
                self._finish(req, Failed(500, f"prefill failed: {type(e).__name__}: {e}"))
                continue
            joining.append((req, state))
        return joining

    def _choose_all(self, reqs: list[Request]) -> list[int]:
        """Pick, record and emit the next token of each of ``reqs`` from its logits, all of them
        together (``next_tokens_each``: the rows that sample alike are warped and drawn at once);
        returns the ids of those that finished. Should choosing them together fail, each is
        chosen alone, so that an exception fails its request only."""
        if not reqs:
            return []
        try:
            tokens = next_tokens_each([req.logits for req in reqs], [_decoding(req) for req in reqs], self.eos)
        except Exception:  # it put the generators back: chosen alone, each draws the same numbers
            log.exception("choosing the tokens of %d requests together failed: choosing them one by one", len(reqs))
            return [req.id for req in reqs if self._guarded(req, self._choose, req, None)]
        return [req.id for req, tok in zip(reqs, tokens) if self._guarded(req, self._choose, req, int(tok))]

    def _choose(self, req: Request, tok: Optional[int]) -> bool:
        """Record and emit ``tok`` (None: pick it now, alone) as the next token of ``req``, whose
        logits it was chosen from; True when it has finished."""
        logprobs = _log_softmax(req.logits) if req.logprobs is not None else None
        if tok is None:
            tok = int(next_tokens_each([req.logits], [_decoding(req)], self.eos)[0])
        req.logits = None
        return self._take(req, tok, logprobs)

    def _take(self, req: Request, tok: int, logprobs: Optional[np.ndarray]) -> bool:
        """Record and emit ``tok`` as ``req``'s next token; True when it has finished."""
        step = len(req.tokens)
        req.seen[0, tok] = True
        if req.counts.size:
            req.counts[0, tok] += 1
        req.tokens.append(tok)
        now = time.monotonic()
        if self.metrics is not None:
            self.metrics.generation_tokens.inc()
            if step == 0:
                self.metrics.ttft.observe(now - req.submitted)
            else:
                self.metrics.itl.observe(now - req.last_token_at)
        req.last_token_at = now
        scores = {} if logprobs is None else _top(logprobs, tok, req.logprobs)
        if self.eos is not None and tok == self.eos:
            self._send(req, Token(tok, "", **scores))
            self._finish(req, Finished("stop", self._rest(req, len(req.tokens) - 1), len(req.tokens)))
            return True
        piece, stopped = self._text(req)
        self._send(req, Token(tok, piece, **scores))
        if stopped:
            self._finish(req, Finished("stop", "", len(req.tokens)))
            return True
        if len(req.tokens) >= req.cfg.max_new_tokens:
            self._finish(req, Finished("length", self._rest(req, len(req.tokens)), len(req.tokens)))
            return True
        return False

    # ------------------------------------------------------------------ text and stop strings

    def _text(self, req: Request) -> tuple[str, bool]:
        """The text piece to emit now, and whether a stop string ended the request. Text that
        ends inside a multi-byte character, or could be the start of a stop string, is held."""
        text = req.text.text(req.tokens)
        hits = [i for i in (text.find(s, max(0, req.shown - len(s))) for s in req.stop) if i >= 0]
        if hits:
            end = min(hits)
            piece = text[req.shown:max(end, req.shown)]
            req.shown = max(end, req.shown)
            return piece, True
        if text.endswith("\ufffd"):
            return "", False
        hold = max((k for s in req.stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        end = max(len(text) - hold, req.shown)
        piece, req.shown = text[req.shown:end], end
        return piece, False

    def _rest(self, req: Request, upto: int) -> str:
        """The text of ``req``'s first ``upto`` tokens not emitted yet (all of it is then shown)."""
        text = req.text.text(req.tokens, upto)
        rest = text[req.shown:]
        req.shown = len(text)
        return rest

    # ------------------------------------------------------------------ bookkeeping
    def _finish(self, req: Request, event) -> None:
        """Emit ``req``'s last event (once: a request already ended is left alone)."""
        if req.ended:
            return
        req.ended = True
        self._count("ok" if isinstance(event, Finished) else f"error_{event.status}")
        self._send(req, event)

    def _send(self, req: Request, event) -> None:
        """Queue ``event`` for ``req`` (handed over at the next ``_flush``)."""
        if not req.outbox:
            self._unsent.append(req)
        req.outbox.append(event)

    def _flush(self) -> None:
        """Hand every request its queued events in one ``emit`` call. A caller whose ``emit``
        raises is gone: its request is cancelled (dropped before the next step)."""
        unsent, self._unsent = self._unsent, []
        for req in unsent:
            events, req.outbox = req.outbox, []
            try:
                req.emit(events)
            except Exception:
                log.exception("handing events to request %d failed", req.id)
                req.cancelled = True

    def _fail(self, req: Request, e: Exception) -> None:
        """End ``req`` alone with a 500 naming the exception (its row leaves with the finished)."""
        self._finish(req, Failed(500, f"request failed: {type(e).__name__}: {e}"))

    def _leave(self, rids) -> None:
        if not rids:
            return
        self.batch.remove(rids)
        if self.spec is not None:
            self.spec.leave(rids)
        for rid in rids:
            self._running.pop(rid, None)

    def _fail_all(self, status: int, message: str) -> None:
        """Fail every running request and empty the batch (rows of no running request too)."""
        reqs = list(self._running.values())
        self._running.clear()
        self.batch.remove(list(self.batch.keys))
        if self.spec is not None:
            self.spec.clear()
        for req in reqs:
            self._finish(req, Failed(status, message))

    def _count(self, status: str) -> None:
        if self.metrics is not None:
            self.metrics.engine_requests.labels(status=status).inc()

    def _gauges(self) -> None:
        if self.metrics is not None:
            self.metrics.queue_depth.set(len(self._pending))
            self.metrics.running.set(len(self._running))


def _decoding(req: Request) -> RowDecoding:
    """What choosing ``req``'s next token reads of it."""
    return RowDecoding(req.cfg, len(req.tokens), req.seen, req.counts, req.rng)


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x -= x.max()
    return x - np.log(np.exp(x).sum())


def _top(logprobs: np.ndarray, tok: int, k: int) -> dict:
    """Token's logprob and the k most likely tokens (Token's ``logprob``/``top`` fields)."""
    top = np.argpartition(-logprobs, k - 1)[:k] if k else np.zeros(0, np.int64)
    top = top[np.argsort(-logprobs[top], kind="stable")]
    return {"logprob": float(logprobs[tok]), "top": [(int(i), float(logprobs[i])) for i in top]}
