"""Speculative decoding (model/speculative.py): greedy output token for token the output without a
draft, sampled output with the target's distribution, the cache after rollbacks the cache built
without speculation.

A numpy language model (``TableLM``: logits from the last two unmasked tokens and the position,
honouring the mask as the real backends do) makes the exactness and distribution checks fast;
the real backends (fused Paddle, unfused Paddle, onnxruntime) run on the trained tiny GPT of
tests/_export_helpers.py, with its pruned copy, itself and prompt lookup as drafts."""
from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from gpt_compress.config import GenerationConfig
from gpt_compress.errors import InputError
from gpt_compress.model.generation import sample_rows, sampling_probs, stream_tokens
from gpt_compress.inference.base import Backend
from gpt_compress.model.speculative import (AdaptiveK, ModelDraft, NgramDraft, SpeculationStats, accept_sampled,
                                            speculative_tokens)

from _serve_helpers import run_engine


class TableLM(Backend):
    """A ``Backend`` over a random table: the logits of a position depend on its token, the
    previous unmasked token and its position (count of unmasked columns), so masked holes and
    left padding must be skipped exactly as attention and positions skip them."""

    def __init__(self, vocab: int, seed: int, sharp: float = 3.0):
        rng = np.random.default_rng(seed)
        self.a, self.b = rng.normal(0, sharp, (vocab, vocab)), rng.normal(0, sharp / 2, (vocab, vocab))
        self.c = rng.normal(0, 1.0, (64, vocab))

    def _logits(self, ids, mask, cols):
        out = []
        for b in range(ids.shape[0]):
            real = [int(ids[b, j]) for j in range(ids.shape[1]) if mask[b, j]]
            row = []
            for c in cols:
                n = int(mask[b, :c + 1].sum())
                last = real[n - 1] if n else 0
                prev = real[n - 2] if n > 1 else 0
                row.append(self.a[last] + self.b[prev] + self.c[n % 64])
            out.append(row)
        return np.asarray(out, dtype=np.float32)  # (B, len(cols), V)

    def prefill(self, ids, mask):
        return self._logits(ids, mask, [ids.shape[1] - 1])[:, 0], ids.copy()

    def decode_positions(self, ids, mask, cache):
        assert mask.shape[1] == cache.shape[1] + ids.shape[1]
        full = np.concatenate([cache, ids], axis=1)
        s = cache.shape[1]
        return self._logits(full, mask, range(s, full.shape[1])), full

    def decode(self, ids, mask, cache):
        logits, cache = self.decode_positions(ids, mask, cache)
        return logits[:, -1], cache

    def truncate_cache(self, cache, length):
        assert 0 < length <= cache.shape[1]
        return cache[:, :length]

    def score(self, ids, mask=None):
        return self._logits(ids, np.ones_like(ids) if mask is None else mask, range(ids.shape[1]))

    def reorder_cache(self, cache, rows):
        return cache[rows]


def _cfg(**kw) -> GenerationConfig:
    return GenerationConfig(**{"max_new_tokens": 12, "decode_strategy": "greedy", **kw})


def _plain(backend, prompts, cfg, eos, pad=0):
    return _collect(stream_tokens(backend, prompts, cfg, eos, pad), len(prompts), eos)


def _spec(backend, draft, prompts, cfg, eos, pad=0, k=4, stats=None, adaptive=True):
    return _collect(speculative_tokens(backend, draft, prompts, cfg, eos, pad, k, adaptive, stats), len(prompts), eos)


def _collect(steps, n, eos):
    out, alive = [[] for _ in range(n)], [True] * n
    for step in steps:
        for i, t in enumerate(step):
            if alive[i]:
                out[i].append(int(t))
                alive[i] = eos is None or int(t) != eos
    return out


PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 7], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]]  # left-padded batch of 3


@pytest.mark.parametrize("draft", ["self", "other", "ngram"])
@pytest.mark.parametrize("eos", [None, "inside"])
def test_greedy_with_a_draft_is_token_for_token_greedy_without(draft, eos):
    """Batch of 3 left-padded prompts, k = 4; ``self`` (the target as its own draft: every token
    kept) puts the EOS and ``max_new_tokens`` inside accepted runs."""
    target = TableLM(11, 0)
    cfg = _cfg(max_new_tokens=13)
    ref = _plain(target, PROMPTS, cfg, None)
    eos_id = None
    if eos == "inside":  # a token first produced mid-run by row 0
        eos_id = next(t for j, t in enumerate(ref[0]) if j >= 2 and t not in ref[0][:j] and t not in (0,))
        ref = _plain(target, PROMPTS, cfg, eos_id)
        assert len(ref[0]) < 13 and ref[0][-1] == eos_id
    proposer = {"self": lambda: ModelDraft(target), "other": lambda: ModelDraft(TableLM(11, 5)),
                "ngram": lambda: NgramDraft(2)}[draft]()
    stats = SpeculationStats()
    assert _spec(target, proposer, PROMPTS, cfg, eos_id, stats=stats) == ref
    assert stats.proposed > 0
    if draft == "self":
        assert stats.accepted == stats.proposed  # every run accepted: EOS / the limit fell inside one
        assert stats.target_steps < 13 // 2


@pytest.mark.parametrize("k", [1, 2, 7])
def test_min_new_tokens_and_short_limits_agree(k):
    target = TableLM(9, 3)
    for limit, floor in [(1, 0), (2, 1), (5, 3), (9, 9)]:
        cfg = _cfg(max_new_tokens=limit, min_new_tokens=floor)
        eos = _plain(target, PROMPTS, _cfg(max_new_tokens=limit), None)[1][0]  # row 1's first token
        ref = _plain(target, PROMPTS, cfg, eos)
        for proposer in (ModelDraft(TableLM(9, 4)), ModelDraft(target), NgramDraft()):
            assert _spec(target, proposer, PROMPTS, cfg, eos, k=k) == ref, (limit, floor, proposer)


def test_ngram_lookup_proposes_the_latest_continuation_of_the_longest_suffix():
    ng = NgramDraft(3)
    assert ng.lookup([5, 1, 2, 3, 9, 1, 2, 3, 8, 7, 1, 2, 3], 2) == [8, 7]
    assert ng.lookup([4, 2, 6, 9, 2], 3) == [6, 9, 2]  # only the 1-token suffix occurs earlier
    assert ng.lookup([4, 2, 6, 9, 2], 5) == [6, 9, 2, 6, 9]  # past the end: its own proposals
    assert ng.lookup([8, 7, 7, 7, 7], 4) == [7, 7, 7, 7]  # a run of one token: k proposals, not 1
    assert ng.lookup([1, 2, 3], 4) == []
    with pytest.raises(InputError, match="n must be"):
        NgramDraft(0)


def _reference_rule(p, q, drafts, n, rng):
    """The rejection rule written out plainly (one uniform per draft, then an inverse-CDF draw)."""
    for j in range(n):
        d = drafts[j]
        qd = q[j][d] if q is not None else 1.0
        if rng.random() < p[j][d] / qd:
            continue
        if q is None:
            q_j = np.zeros(p.shape[1])
            q_j[d] = 1.0
        else:
            q_j = q[j]
        r = np.array([max(pi - qi, 0.0) for pi, qi in zip(p[j].astype(np.float64), q_j)])
        if r.sum() <= 0:
            r = p[j].astype(np.float64)
        return j, int(sample_rows((r / r.sum())[None], rng)[0])
    return n, int(sample_rows(p[n][None], rng)[0])


@pytest.mark.parametrize("with_q", [True, False])
def test_seeded_acceptance_equals_the_reference_rule(with_q):
    rng = np.random.default_rng(0)
    for trial in range(300):
        v, n = 6, int(rng.integers(0, 5))
        p = rng.dirichlet(np.ones(v) * 0.5, n + 1).astype(np.float32)
        q = rng.dirichlet(np.ones(v) * 0.5, max(n, 1)).astype(np.float32) if with_q else None
        drafts = (np.array([sample_rows(q[j][None], rng)[0] for j in range(n)]) if with_q
                  else rng.integers(0, v, n))
        got = accept_sampled(p, q, drafts, n, np.random.default_rng(trial))
        assert got == _reference_rule(p, q, drafts, n, np.random.default_rng(trial)), trial


def _target_distribution(target, prompt, cfg, length):
    """Exact probabilities of every continuation of ``length`` tokens under ``cfg``'s warpers."""
    vocab = target.a.shape[0]
    dist = {}
    for seq in itertools.product(range(vocab), repeat=length):
        ids = np.array([prompt + list(seq)])
        logits = target._logits(ids, np.ones_like(ids), range(len(prompt) - 1, ids.shape[1] - 1))[0]
        probs = sampling_probs(logits, cfg)
        dist[seq] = float(np.prod([probs[j, t] for j, t in enumerate(seq)]))
    return dist


@pytest.mark.parametrize("draft,warp", [("other", {}), ("other", {"temperature": 0.7, "top_k": 3}),
                                        ("ngram", {"top_p": 0.9})])
def test_sampling_with_a_draft_has_the_targets_distribution(draft, warp):
    """Chi-square over 3-token continuations (vocabulary 4: 64 outcomes) of 2,500 seeded runs."""
    scipy_stats = pytest.importorskip("scipy.stats")
    target, vocab, n, length = TableLM(4, 11, sharp=1.0), 4, 2500, 3
    prompt = [0, 1, 2, 0, 1, 2, 0, 1]  # quotes itself: prompt lookup proposes
    cfg = _cfg(decode_strategy="sampling", max_new_tokens=length, **warp)
    expected = _target_distribution(target, prompt, cfg, length)
    counts, stats = dict.fromkeys(expected, 0), SpeculationStats()
    for seed in range(n):
        proposer = ModelDraft(TableLM(4, 12, sharp=1.0)) if draft == "other" else NgramDraft()
        seq = _spec(target, proposer, [prompt], dataclasses.replace(cfg, seed=seed), None, k=2, stats=stats)[0]
        counts[tuple(seq)] += 1
    keys = [s for s in expected if expected[s] > 0]
    assert sum(counts[s] for s in counts if expected[s] == 0) == 0  # nothing outside top-k / top-p
    obs = np.array([counts[s] for s in keys], dtype=np.float64)
    exp = np.array([expected[s] for s in keys]) * n
    # Pool the outcomes expected fewer than 5 times (the test's validity condition).
    small = exp < 5
    if small.any():
        obs, exp = np.append(obs[~small], obs[small].sum()), np.append(exp[~small], exp[small].sum())
    p_value = scipy_stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue
    assert p_value > 1e-3, (p_value, stats)
    assert 0 < stats.accepted < stats.proposed  # the rule both kept and rejected


def test_adaptive_k_backs_off_and_pauses():
    k = AdaptiveK(4)
    k.update(4, 4)
    assert k.next() == 4
    k.update(4, 0)
    assert k.next() == 3
    for _ in range(3):
        k.update(3, 0)
    assert k.next() == 0  # paused: plain steps
    fixed = AdaptiveK(4, adaptive=False)
    fixed.update(4, 0)
    assert fixed.next() == 4


def test_bad_settings_are_one_line_errors():
    target = TableLM(5, 0)
    with pytest.raises(InputError, match="repetition_penalty"):
        _spec(target, NgramDraft(), PROMPTS, _cfg(repetition_penalty=1.2), None)
    with pytest.raises(InputError, match="beam_search"):
        _spec(target, NgramDraft(), PROMPTS, _cfg(decode_strategy="beam_search", num_beams=2), None)
    from gpt_compress.config import ConfigError
    from gpt_compress.config import ServeConfig

    with pytest.raises(ConfigError, match="Serve.speculative_tokens must be >= 0"):
        ServeConfig(speculative_tokens=-1)


# --------------------------------------------------------------------------------------
# The real backends: the trained tiny GPT, its pruned copy as the draft
# --------------------------------------------------------------------------------------
BACKENDS = {"fused": ("paddle", {"fused": True}), "unfused": ("paddle", {"fused": False}), "onnx": ("onnx", {})}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, shakespeare):
    from _export_helpers import model_dirs

    return model_dirs(tmp_path_factory, shakespeare)


@pytest.fixture(scope="module")
def generators(dirs):
    from gpt_compress.inference.runner import Generator

    made = {}

    def get(which: str, model: str = "export"):
        if (which, model) not in made:
            kind, opts = BACKENDS[which]
            made[which, model] = Generator.from_dir(dirs[model], backend=kind, **opts)
        return made[which, model]

    return get


def _texts():
    from _parity_helpers import PROMPTS as TEXTS

    return TEXTS


@pytest.mark.parametrize("which", list(BACKENDS))
def test_greedy_with_each_draft_equals_greedy_on_each_backend(generators, which):
    """Batch of 3 left-padded prompts: the pruned export, the model itself (every proposal kept,
    so the EOS and ``max_new_tokens`` fall inside accepted runs) and prompt lookup as drafts."""
    gen = generators(which)
    prompts = gen.encode(_texts())
    ref = gen.generate(prompts, max_new_tokens=20).sequences
    # EOS: a token row 0 first produces at step 5 or later (the reference stops there).
    eos = next(t for j, t in enumerate(ref[0]) if j >= 5 and t not in ref[0][:j])
    ref_eos = gen.generate(prompts, max_new_tokens=20, eos_token_id=eos).sequences
    assert ref_eos[0][-1] == eos and len(ref_eos[0]) < 20
    for draft in (generators(which, "pruned_export"), gen, "ngram"):
        for k in (3, 6):
            out = gen.generate(prompts, max_new_tokens=20, draft=draft, draft_tokens=k)
            assert out.sequences == ref, (draft, k)
            assert out.speculation["proposed"] > 0
            assert gen.generate(prompts, max_new_tokens=20, eos_token_id=eos, draft=draft,
                                draft_tokens=k).sequences == ref_eos, (draft, k)
    itself = gen.generate(prompts, max_new_tokens=20, draft=gen, draft_tokens=6, adaptive=False)
    assert itself.speculation["acceptance_rate"] == 1.0


def test_a_drafts_tokenizer_is_compared_once(dirs, monkeypatch):
    """Serializing a tokenizer to compare it costs tens of ms at a 50k vocabulary: a Generator
    compares a draft's once, not at every ``generate``; a draft with another tokenizer is still
    refused."""
    from gpt_compress.data.tokenizer import Tokenizer
    from gpt_compress.inference.runner import Generator

    gen, draft = (Generator.from_dir(dirs[d], backend="paddle") for d in ("export", "pruned_export"))
    calls = []
    to_json = Tokenizer.to_json
    monkeypatch.setattr(Tokenizer, "to_json", lambda self: calls.append(1) or to_json(self))
    for _ in range(3):
        gen.draft_for(draft)
    assert len(calls) == 2
    other = Generator.from_dir(dirs["pruned_export"], backend="paddle")
    other.tokenizer = Tokenizer.train(iter(["a b c d e f g"]), vocab_size=300)
    other.vocab_size = gen.vocab_size
    with pytest.raises(InputError, match="another tokenizer"):
        gen.draft_for(other)


def test_the_fused_greedy_verify_tokens_are_the_argmax_of_its_logits(generators):
    """``decode_positions_greedy`` on the fused program (its token output, no logits copied out)
    equals ``np.argmax`` of ``decode_positions``' logits at every position of a left-padded batch
    of 3, T = 1 and 5, and leaves the same cache (its positions; past them the memory is unused)."""
    from gpt_compress.model.generation import pad_left

    backend = generators("fused").backend
    ids, mask = pad_left(generators("fused").encode(_texts()), 0)
    rng = np.random.default_rng(0)
    for t in (1, 5):
        new = rng.integers(0, 1024, (3, t))
        full = np.concatenate([mask, np.ones_like(new)], axis=1)
        _, a = backend.prefill(ids, mask)
        logits, a = backend.decode_positions(new, full, a)
        _, b = backend.prefill(ids, mask)
        tokens, b = backend.decode_positions_greedy(new, full, b)
        assert tokens.shape == (3, t) and np.array_equal(tokens, np.argmax(logits, axis=-1))
        n = a.length
        assert n == b.length and all(np.array_equal(x.numpy()[:, :, :n], y.numpy()[:, :, :n])
                                     for x, y in zip(a.tensors, b.tensors))


class _Spy(Backend):
    """A fused backend proxy that keeps a copy of the cache (and the mask over it) each verify step
    starts from."""

    def __init__(self, backend):
        self.backend, self.seen = backend, []

    def prefill(self, ids, mask):
        return self.backend.prefill(ids, mask)

    def decode(self, ids, mask, cache):
        return self.backend.decode(ids, mask, cache)

    def decode_positions(self, ids, mask, cache):
        s = cache.length
        self.seen.append(([t.numpy()[:, :, :s].copy() for t in cache.tensors], mask[:, :s].copy()))
        return self.backend.decode_positions(ids, mask, cache)

    def truncate_cache(self, cache, length):
        return self.backend.truncate_cache(cache, length)

    def reorder_cache(self, cache, rows):
        return self.backend.reorder_cache(cache, rows)

    def score(self, ids, mask=None):
        return self.backend.score(ids, mask)


def test_the_cache_after_rollbacks_is_bitwise_the_cache_built_without_speculation(generators):
    """Fused program: at every verify step, each row's unmasked cache columns (prompt + tokens so
    far; rejected proposals masked or cut) are bitwise the cache of prefilling those tokens."""
    from gpt_compress.model.generation import pad_left
    from gpt_compress.model.speculative import DRAFT_TOKENS

    gen = generators("fused")
    prompts = gen.encode(_texts())
    cfg = _cfg(max_new_tokens=16)
    for draft in (ModelDraft(generators("fused", "pruned_export").backend), NgramDraft()):
        spy, stats = _Spy(gen.backend), SpeculationStats()
        out = _spec(spy, draft, prompts, cfg, None, pad=gen.pad_token_id, k=DRAFT_TOKENS, stats=stats)
        assert 0 < stats.accepted < stats.proposed  # rollbacks happened, holes too (rows differ)
        full = [p + o for p, o in zip(prompts, out)]
        ids, mask = pad_left(full, gen.pad_token_id)
        _, ref = gen.backend.prefill(ids, mask)
        ref = [t.numpy() for t in ref.tensors]
        width = ids.shape[1]
        for tensors, seen_mask in spy.seen:
            for b in range(len(prompts)):
                cols = np.nonzero(seen_mask[b])[0]
                n = len(cols)  # the row's first n real tokens
                start = width - len(full[b])
                for got, want in zip(tensors, ref):
                    assert np.array_equal(got[b][:, cols], want[b][:, start:start + n])


def _gptc(*args):
    import subprocess
    import sys

    from _export_helpers import ENV, ROOT

    return subprocess.run([sys.executable, "-m", "gpt_compress", *args], env=ENV, cwd=ROOT, capture_output=True,
                          text=True)


def test_cli_infer_and_generate_report_the_speculation(dirs):
    import json

    prompt = "ROMEO:\nBut, soft! what light\nROMEO:\nBut, soft!"  # quotes itself: prompt lookup proposes
    proc = _gptc("infer", "--model-dir", dirs["export"], "--prompt", prompt, "--draft", dirs["pruned_export"],
                 "--num-speculative-tokens", "3", "--measure-speedup", "--no-stream",
                 "-o", "Generation.max_new_tokens=12")
    assert proc.returncode == 0, proc.stderr[-2000:]
    spec = json.loads(proc.stdout.strip().splitlines()[-1])["speculation"]
    assert spec["draft"] == dirs["pruned_export"] and spec["same_output"] is True
    assert 0 <= spec["acceptance_rate"] <= 1 and spec["proposed"] > 0 and "speedup" in spec
    proc = _gptc("generate", "--model", dirs["ckpt"], "--prompt", prompt, "--draft", "ngram", "--measure-speedup",
                 "--no-stream", "-o", "Generation.max_new_tokens=8")
    assert proc.returncode == 0, proc.stderr[-2000:]
    spec = json.loads(proc.stdout.strip().splitlines()[-1])["speculation"]
    assert spec["draft"] == "ngram" and spec["same_output"] is True
    for bad, message in [(["--num-speculative-tokens", "0"], "--num-speculative-tokens must be >= 1"),
                         (["--measure-speedup"], "--measure-speedup needs --draft"),
                         (["--draft", "/nonexistent"], "not found: /nonexistent")]:
        proc = _gptc("infer", "--model-dir", dirs["export"], "--prompt", "x", *bad)
        assert proc.returncode == 1 and message in proc.stderr, proc.stderr[-2000:]


def test_the_draft_vocabulary_is_the_most_frequent_tokens_with_eos(shakespeare):
    """``most_frequent``: the highest counts, ties by the lower id, the kept ids (EOS) among them
    even when rare, ascending; ``token_counts`` counts every document of a real indexed dataset."""
    from gpt_compress.data.indexed import open_dataset
    from gpt_compress.errors import DataError, ExportError
    from gpt_compress.export.draft_vocab import most_frequent, token_counts

    counts = np.array([5, 9, 0, 9, 1, 7, 2])
    assert most_frequent(counts, 3).tolist() == [1, 3, 5]
    assert most_frequent(counts, 3, keep=[2]).tolist() == [1, 2, 3]
    assert most_frequent(counts, 7).tolist() == list(range(7))
    for size in (0, 8):
        with pytest.raises(ExportError, match=f"{size} tokens asked"):
            most_frequent(counts, size, keep=[2])
    ds = open_dataset(shakespeare[1])
    got = token_counts([shakespeare[1]], 1024)
    assert got.sum() == ds.num_tokens
    assert np.array_equal(got, np.bincount(np.concatenate([ds.get(i) for i in range(len(ds))]), minlength=1024))
    with pytest.raises(DataError, match="outside 0..9"):
        token_counts([shakespeare[1]], 10)


def test_a_draft_exported_with_a_draft_vocabulary_proposes_from_it_and_greedy_stays_exact(dirs, shakespeare,
                                                                                         tmp_path):
    """``gptc export --draft-vocab 128 --draft-vocab-data PREFIX`` of the pruned checkpoint (the 128
    tokens most frequent in the training data): the manifest records it; as the fused target's
    draft, greedy output (3 left-padded prompts, an EOS inside a run) is greedy without a draft,
    every greedy proposal is one of the 128, and sampling still proposes from the whole vocabulary
    (the logits path). Bad requests are one-line errors that write nothing."""
    import json

    from gpt_compress.export.draft_vocab import draft_vocab
    from gpt_compress.inference.runner import Generator

    out = tmp_path / "draft"
    proc = _gptc("export", "--model", dirs["pruned_ckpt"], "--output", str(out), "--format", "paddle",
                 "--draft-vocab", "128", "--draft-vocab-data", shakespeare[1])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((out / "manifest.json").read_text())["fused"]["draft_vocab"] == 128
    target = Generator.from_dir(dirs["export"], backend="paddle")
    draft = Generator.from_dir(str(out), backend="paddle")
    vocab = draft_vocab([shakespeare[1]], 128, target.vocab_size, draft.eos_token_id)
    proposals = []
    steps = draft.backend.decode_greedy_steps

    def spy(*args, **kw):
        tokens, cache = steps(*args, **kw)
        proposals.append(tokens[~args[6]])  # the rows not finished before the run
        return tokens, cache

    draft.backend.decode_greedy_steps = spy
    prompts = target.encode(_texts())
    ref = target.generate(prompts, max_new_tokens=20).sequences
    eos = next(t for j, t in enumerate(ref[0]) if j >= 5 and t not in ref[0][:j])
    for kw in ({}, {"eos_token_id": eos}):
        got = target.generate(prompts, max_new_tokens=20, draft=draft, draft_tokens=4, **kw)
        assert got.sequences == target.generate(prompts, max_new_tokens=20, **kw).sequences
        assert got.speculation["accepted"] > 0
    assert proposals and all(np.isin(p[p != 0], vocab).all() for p in proposals)
    sampled = target.generate(prompts, max_new_tokens=12, draft=draft, decode_strategy="sampling", seed=1)
    assert sampled.speculation["proposed"] > 0
    for bad, rc, message in [(["--draft-vocab", "64"], 2, "--draft-vocab needs --draft-vocab-data"),
                             (["--draft-vocab", "100000", "--draft-vocab-data", shakespeare[1]], 1,
                              "100000 tokens asked"),
                             (["--draft-vocab", "64", "--draft-vocab-data", str(tmp_path / "none")], 1,
                              "no dataset at prefix"),
                             (["--draft-vocab", "64", "--draft-vocab-data", shakespeare[1], "--format", "onnx"], 1,
                              "a draft vocabulary lives in the fused program")]:
        proc = _gptc("export", "--model", dirs["pruned_ckpt"], "--output", str(tmp_path / "bad"), *bad)
        assert proc.returncode == rc and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert not (tmp_path / "bad").exists()


def test_auto_uses_the_draft_the_manifest_records(dirs, tmp_path):
    import json
    import os
    import shutil

    from gpt_compress.inference.manifest import record_draft
    from gpt_compress.inference.runner import Generator

    base = tmp_path / "base"
    shutil.copytree(dirs["export"], base)
    plain = Generator.from_dir(str(base), backend="paddle")
    with pytest.raises(InputError, match="records no draft"):
        plain.generate([[1, 2, 3]], max_new_tokens=4, draft="auto")
    entry = record_draft(str(base), dirs["pruned_export"], {"acceptance_rate": 0.5, "k": 5})
    assert entry["path"] == os.path.relpath(dirs["pruned_export"], base)
    assert json.loads((base / "manifest.json").read_text())["draft"] == entry
    gen = Generator.from_dir(str(base), backend="paddle")  # checksums verified
    assert gen.recorded_draft == os.path.normpath(dirs["pruned_export"])
    prompts = gen.encode(_texts())
    out = gen.generate(prompts, max_new_tokens=12, draft="auto")
    assert out.sequences == gen.generate(prompts, max_new_tokens=12).sequences and out.speculation["proposed"] > 0
    text = "".join(gen.stream_text(_texts()[1], max_new_tokens=12, draft="auto"))
    assert text == "".join(gen.stream_text(_texts()[1], max_new_tokens=12))


def test_sampling_with_the_model_as_its_own_draft_keeps_every_proposal(generators):
    """p == q bitwise on the fused program (the verify step's rows are the decode steps' numbers),
    so the rule keeps every proposal; a seed gives the same tokens twice."""
    gen = generators("fused")
    prompts = gen.encode(_texts())
    kw = dict(max_new_tokens=16, decode_strategy="sampling", top_k=20, temperature=0.8, seed=3, draft=gen,
              draft_tokens=4, adaptive=False)
    out = gen.generate(prompts, **kw)
    assert out.speculation["acceptance_rate"] == 1.0 and out.speculation["proposed"] > 0
    assert gen.generate(prompts, **kw).sequences == out.sequences
    ngram = gen.generate(prompts, **{**kw, "draft": "ngram"})
    assert [len(s) for s in ngram.sequences] == [16, 16, 16] or gen.eos_token_id is not None


@pytest.mark.parametrize("draft", ["ngram", "model"])
def test_the_server_engine_with_a_draft_gives_each_requests_tokens(generators, dirs, monkeypatch, draft):
    """In-process engine on the fused program, up to 4 draft tokens per request and step (prompt
    lookup, or the pruned export as a draft model with its own slot cache, named by ``auto``: the
    draft the export records): greedy requests (self-quoting prompts of different lengths, an EOS
    mid-run, ``max_tokens`` inside a run) get the tokens of generating each alone without a draft;
    seeded sampled requests next to them (the rejection rule, each with its own generator) get
    exactly what ``Generator.generate`` gives alone with the same draft (whose distribution is the
    target's: the chi-square test above).
    Requests join as slots free up; slot caches of 40 columns at first, so verify steps and the
    draft's multi-step runs meet repacks. The proposals are counted in the metrics."""
    from gpt_compress.serve import slots
    from gpt_compress.serve.engine import Engine
    from gpt_compress.serve.request import Finished, request_config
    from gpt_compress.serve.metrics import Metrics

    monkeypatch.setattr(slots, "INITIAL_CAPACITY", 40)
    gen = generators("fused")
    base = gen.encode(["ROMEO:\nBut, soft! what light through yonder window breaks?\nROMEO:\nBut, soft!",
                       "To be, or not to be, that is the question. To be, or not",
                       "First Citizen:\nBefore we proceed any further, hear me speak."])
    jobs = [(base[0], 24, 0.0), (base[1], 7, 0.0), (base[2], 20, 0.0), (base[0][3:], 16, 0.0), (base[1], 12, 0.8),
            (base[0], 20, 1.0), (base[2][2:], 18, 0.7)]
    cfgs = [request_config(n, temp, 1.0 if i != 6 else 0.9, 0 if i != 5 else 30, 1.0, 5 + i, 0)
            for i, (_, n, temp) in enumerate(jobs)]
    # EOS: a token job 3 first produces at step 4 or later (the engine's EOS for every request).
    ref3 = gen.generate([jobs[3][0]], config=cfgs[3]).sequences[0]
    eos = next(t for j, t in enumerate(ref3) if j >= 4 and t not in ref3[:j])
    source = "auto" if draft == "model" else "ngram"
    monkeypatch.setattr(gen, "recorded_draft", dirs["pruned_export"])  # as `gptc pipeline` records it
    want = [gen.generate([p], config=dataclasses.replace(c, eos_token_id=eos),
                         **({"draft": source, "draft_tokens": 4} if temp else {})).sequences[0]
            for (p, _, temp), c in zip(jobs, cfgs)]
    assert want[3][-1] == eos and len(want[3]) < 16
    metrics = Metrics()
    engine = Engine(gen, max_batch=4, max_queue=8, metrics=metrics, speculative_tokens=4, draft=source)
    engine.eos = eos
    tokens, ends = run_engine(engine, [(prompt, cfg, {}) for (prompt, _, _), cfg in zip(jobs, cfgs)], together=False)
    assert all(isinstance(e, Finished) for e in ends), ends
    assert tokens == want
    assert engine.spec.proposed > 0 and 0 < engine.spec.accepted < engine.spec.proposed  # rows with different acceptance
    assert metrics.draft_tokens._value.get() == engine.spec.proposed and engine.batch.relayouts >= 1
    assert metrics.accepted_tokens._value.get() == engine.spec.accepted
    # The engine sets the gauge to this very quotient (serve/speculation.py): equal, not approximately.
    assert metrics.tokens_per_step._value.get() == engine.spec.produced / engine.spec.steps
    if draft == "model":
        assert engine.spec.drafter.relayouts >= 1 and len(engine.spec.drafter) == 0
