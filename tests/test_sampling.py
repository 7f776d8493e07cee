"""The sampler of model/generation.py: the inverse CDF draws the token the exact cumulative mass
names, a row draws the same token alone or in a batch, and the batched chooser of the serving
engine (``next_tokens_each``) chooses what ``next_tokens`` chooses for each row alone."""
import dataclasses
import math

import numpy as np
import pytest

from gpt_compress.config import GenerationConfig
from gpt_compress.model.generation import (CDF_BLOCK, RowDecoding, _softmax, apply_top_k, inverse_cdf, next_tokens,
                                           next_tokens_each)

V = 50304  # GPT-2's padded vocabulary: 196 blocks and a tail of 128


def _probs(rows: int, vocab: int, seed: int, top_k: int = 0) -> np.ndarray:
    x = (np.random.default_rng(seed).standard_normal((rows, vocab)) * 3).astype(np.float32)
    return _softmax(apply_top_k(x, top_k) if top_k else x)


@pytest.mark.parametrize("vocab,top_k", [(V, 0), (V, 40), (7, 0), (CDF_BLOCK, 0), (CDF_BLOCK + 1, 2), (1000, 0)])
def test_the_drawn_token_is_where_the_exact_cumulative_mass_reaches_the_draw(vocab, top_k):
    """Row i's token j satisfies C[j-1] < r * C[V-1] <= C[j] for the exact prefix sums C of its
    float32 probabilities (math.fsum), up to the rounding of float64 sums of at most V terms,
    ``V * 2**-53`` of the total each; that bound is 1e-11 of the total, and a wrong token moves a
    boundary by its probability (at least 1e-8 of the total here), so an off-by-one in either
    level fails. The token always has a positive probability (top-k zeros never drawn)."""
    p = _probs(8, vocab, seed=vocab + top_k, top_k=top_k)
    rng = np.random.default_rng(0)
    for _ in range(6):
        r = rng.random(8)
        got = inverse_cdf(p, r)
        for i, j in enumerate(got):
            row = p[i].astype(np.float64)
            assert row[j] > 0
            total = math.fsum(row)
            slack = 2 * vocab * 2.0 ** -53 * total
            below, upto = math.fsum(row[:j]), math.fsum(row[:j + 1])
            u = r[i] * total
            assert below - slack < u <= upto + slack, (i, j)


def test_a_row_draws_the_same_token_alone_and_in_a_batch():
    p = _probs(16, V, seed=3)
    r = np.random.default_rng(1).random(16)
    batch = inverse_cdf(p, r)
    assert [inverse_cdf(p[i:i + 1], r[i:i + 1])[0] for i in range(16)] == batch.tolist()


def test_the_extreme_draws_land_on_the_first_and_last_possible_tokens():
    """A draw of 0 takes the first token with positive probability, the largest draw below 1 the
    last: never a token top-k filtered out, at either end."""
    p = _probs(4, V, seed=5, top_k=3)
    first = [int(np.flatnonzero(row)[0]) for row in p]
    last = [int(np.flatnonzero(row)[-1]) for row in p]
    assert inverse_cdf(p, np.zeros(4)).tolist() == first
    assert inverse_cdf(p, np.full(4, 1 - 2.0 ** -53)).tolist() == last


def test_choosing_rows_together_equals_choosing_each_alone():
    """Rows of different settings (greedy, two sharing a temperature and top-p, top-k, a
    repetition penalty, a logit bias, EOS held back by min_new_tokens; rows differing from the
    shared one in top-p, top-k or temperature alone; a sampled one with the greedy row's
    settings), chosen in one call, get the tokens ``next_tokens`` gives each alone, and their
    generators advance alike; over 20 draws, so that a row warped with another row's setting is
    drawn differently at least once."""
    base = GenerationConfig(decode_strategy="sampling", temperature=0.8, top_p=0.9, max_new_tokens=16)
    cfgs = [GenerationConfig(decode_strategy="greedy", max_new_tokens=16), base, base,
            dataclasses.replace(base, top_k=20, top_p=1.0), dataclasses.replace(base, repetition_penalty=1.3),
            dataclasses.replace(base, logit_bias={7: 5.0}), dataclasses.replace(base, min_new_tokens=8),
            dataclasses.replace(base, top_p=0.3), dataclasses.replace(base, top_k=2),
            dataclasses.replace(base, temperature=3.0), dataclasses.replace(base, temperature=1.0, top_p=1.0)]
    eos = 7
    for trial in range(20):
        logits = (np.random.default_rng(trial).standard_normal((len(cfgs), 512)) * 4).astype(np.float32)
        step = trial % 10
        rows, alone = [], []
        for i, cfg in enumerate(cfgs):
            seen = np.zeros((1, 512), bool)
            seen[0, :50] = True
            counts = np.zeros((1, 0), np.int32)
            rows.append(RowDecoding(cfg, step, seen, counts, np.random.default_rng([trial, i])))
            alone.append(int(next_tokens(logits[i:i + 1], seen, step, cfg, eos, np.random.default_rng([trial, i]),
                                         counts)[0]))
        assert next_tokens_each(logits, rows, eos).tolist() == alone
        for i, row in enumerate(rows):  # each generator drew one number (greedy: none)
            ref = np.random.default_rng([trial, i])
            if cfgs[i].decode_strategy != "greedy":
                ref.random()
            assert row.rng.random() == ref.random()
