"""lm_loss (chunked, fused LM head + cross-entropy) equals the plain logits + F.cross_entropy loss."""
import numpy as np
import paddle
import pytest

from _grad_helpers import assert_grads_close
from gpt_compress.config import ModelConfig
from gpt_compress.model.gpt import GPTForCausalLM
from gpt_compress.train.loss import IGNORE_INDEX, causal_lm_loss, lm_loss, lm_loss_reference

# The mean loss, fp32, same math summed in a different order (chunks): measured <= 1.4e-7 relative
# (2 x 2 x 2 cases x seeds 0-3; 0 or 1 ulp of a loss near 7); 1e-6 is 7x that.
LOSS_RTOL = 1e-6


def _loss_and_grads(model, fn, *args, **kwargs):
    model.clear_gradients()
    loss = fn(model, *args, **kwargs)
    loss.backward()
    grads = {n: p.grad.numpy().copy() for n, p in model.named_parameters() if p.grad is not None}
    return float(loss), grads


def _batch(vocab, batch=2, seq=40, seed=0):
    rng = np.random.default_rng(seed)
    ids = paddle.to_tensor(rng.integers(0, vocab, (batch, seq)), dtype="int64")
    labels = rng.integers(0, vocab, (batch, seq))
    labels[0, :7] = IGNORE_INDEX  # e.g. prompt tokens
    labels[1, -3:] = IGNORE_INDEX  # e.g. padding
    mask = (rng.random((batch, seq)) > 0.25).astype("int64")
    return ids, paddle.to_tensor(labels, dtype="int64"), paddle.to_tensor(mask)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("use_mask", [False, True])
@pytest.mark.parametrize("chunk", [16, 128])  # 16: several chunks and a ragged last one (80 rows)
def test_lm_loss_matches_reference(tied, use_mask, chunk):
    paddle.seed(0)
    cfg = ModelConfig.from_preset("gpt-tiny", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                  tie_word_embeddings=tied)
    model = GPTForCausalLM(cfg)
    ids, labels, mask = _batch(cfg.vocab_size)
    mask = mask if use_mask else None
    ref_loss, ref_grads = _loss_and_grads(model, lm_loss_reference, ids, labels, mask)
    loss, grads = _loss_and_grads(model, lm_loss, ids, labels, mask, chunk=chunk)

    assert abs(loss - ref_loss) <= LOSS_RTOL * abs(ref_loss)
    assert_grads_close(grads, ref_grads)  # every parameter gets a gradient, incl. the head


def test_lm_loss_scales_with_upstream_gradient_and_ignores_all_masked():
    paddle.seed(0)
    cfg = ModelConfig.from_preset("gpt-tiny", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = GPTForCausalLM(cfg)
    ids, labels, _ = _batch(cfg.vocab_size, seed=1)
    _, ref_grads = _loss_and_grads(model, lambda *a: 0.5 * lm_loss_reference(*a), ids, labels)
    _, grads = _loss_and_grads(model, lambda *a: 0.5 * lm_loss(*a, chunk=32), ids, labels)
    assert_grads_close(grads, ref_grads)

    none = paddle.full_like(labels, IGNORE_INDEX)
    assert float(lm_loss_reference(model, ids, none)) == 0.0
    loss, grads = _loss_and_grads(model, lm_loss, ids, none)
    assert loss == 0.0 and all(not g.any() for g in grads.values())


def test_lm_loss_without_autograd_matches_reference():
    paddle.seed(0)
    cfg = ModelConfig.from_preset("gpt-tiny", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = GPTForCausalLM(cfg)
    ids, labels, mask = _batch(cfg.vocab_size, seed=2)
    with paddle.no_grad():
        loss = float(lm_loss(model, ids, labels, mask, chunk=16))
        ref = float(lm_loss_reference(model, ids, labels, mask))
    assert abs(loss - ref) <= LOSS_RTOL * abs(ref)


def test_causal_lm_loss_takes_a_trainer_batch():
    paddle.seed(0)
    cfg = ModelConfig.from_preset("gpt-tiny", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = GPTForCausalLM(cfg)
    ids, labels, mask = _batch(cfg.vocab_size, seed=3)
    batch = {"input_ids": ids.numpy(), "labels": labels.numpy().astype("int32"), "loss_mask": mask.numpy()}
    # The same lm_loss call on the same values: bitwise.
    assert float(causal_lm_loss(model, batch)) == float(lm_loss(model, ids, labels, mask))
