"""Shared by test_export.py and test_inference.py: a tiny GPT trained on tinyshakespeare, a
structurally pruned copy of it, and their exports. Built once per pytest session (cached under
the session's base temp dir, so both test files reuse them)."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
PRUNED_HEADS = [4, 2]  # layer 1 keeps heads 1 and 3 of 4
PRUNED_FFN = [256, 96]
# Float programs (Paddle Inference fused and unfused, onnxruntime) vs dygraph, absolute logits: the
# same float32 math summed in another order. Each dot product on a logit's path (6 a layer, K <= 256,
# then the head's K = 64) is off by about sqrt(K) u of its absolute sum (u = 2^-24), which comes to
# a few ulps of the largest logit. Measured (max |diff| over prefill + 32 decode steps of PROMPTS
# and scoring, train_tiny seeds 1234, 1, 2, dense and pruned, each runtime): 1.9e-6 .. 3.8e-6 at
# |logit| <= 9.8 (float32 ulp 9.5e-7 there), 4 ulps at most. 2e-5 is 5x the largest, 21 ulps.
# The export's own gate (export/validate.py) is relative and wider. A wrong position, mask or
# scale moves logits by 1e-2 and more (tests/mutations.py).
LOGIT_ATOL = 2e-5
# A model's perplexity on two runtimes (or a runtime and dygraph), relative. Each token's NLL is
# a logit minus a log-sum-exp, each within LOGIT_ATOL of dygraph's, so two runtimes' NLLs, and
# their mean, agree within 2 x 2 LOGIT_ATOL, the perplexities within exp(4 LOGIT_ATOL) - 1 = 8e-5.
# Measured: fp32 <= 1.3e-8 (tests/test_pipeline.py, Global.seed 1234, 1-5; tests/test_quant.py
# 6.5e-9): errors of either sign average out over the text's tokens.
FLOAT_PPL_RTOL = 4 * LOGIT_ATOL
# int8 adds inputs whose code rounds the other way in one program (tests/_parity_helpers.py), a
# rare, host-dependent event: measured <= 1.7e-6 (pipeline, those seeds), 3.8e-6 (tests/test_quant.py,
# int8 onnxruntime / Paddle vs fake-quant); 2e-5 more, 5x the largest. A wrong scale or a lost
# block moves logits by whole units, the perplexity by far more than 1e-4.
INT8_PPL_RTOL = FLOAT_PPL_RTOL + 2e-5
# A mean over scored tokens (avg_loss, target perplexity), head-only scoring (or the fallback
# program) vs full logits, relative. Each token's log p is within 2 LOGIT_ATOL (its logit and
# the log-sum-exp, each within LOGIT_ATOL), which bounds a loss near 6.3 to 6e-6 relative; errors
# of either sign average out over the ~2,000 scored tokens. Measured (the tests/_export_helpers
# model; tests/test_eval.py dygraph, Paddle, onnxruntime): avg_loss <= 1.6e-9, LAMBADA target
# perplexity <= 3.0e-8; tests/test_quant.py int8 programs 1.9e-9.
# 1e-6 is 33x the largest and under the per-token bound; one token lost or scored twice moves
# these by 1e-4 and more.
MEAN_SCORE_RTOL = 1e-6


def train_tiny(tok_dir: str, prefix: str, out: Path, steps: int = 200, seed: int = 1234) -> str:
    """Train a gpt-tiny for ``steps`` AdamW steps on random 64-token windows of the shakespeare
    fixture (initialization and windows drawn from ``seed``) and save it with its tokenizer;
    returns the checkpoint directory.

    A plain loop on purpose: these tests are about export and inference, and must not break
    while the training stack (``train/``) is being changed. A trained model matters here: its
    peaked next-token distributions make greedy/beam choices real decisions, not float noise."""
    import paddle
    import paddle.nn.functional as F

    from gpt_compress.checkpoint import save_model
    from gpt_compress.config import ModelConfig
    from gpt_compress.data.indexed import open_dataset
    from gpt_compress.data.tokenizer import Tokenizer
    from gpt_compress.model.gpt import GPTForCausalLM

    paddle.seed(seed)
    rng = np.random.default_rng(seed)
    data = open_dataset(prefix)
    tokens = np.concatenate([np.asarray(data[i], dtype=np.int64) for i in range(len(data))])
    cfg = ModelConfig.from_preset("gpt-tiny", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = GPTForCausalLM(cfg)
    opt = paddle.optimizer.AdamW(learning_rate=3e-3, parameters=model.parameters(), weight_decay=0.01)
    model.train()
    for _ in range(steps):
        starts = rng.integers(0, len(tokens) - 65, 8)
        batch = paddle.to_tensor(np.stack([tokens[s:s + 65] for s in starts]))
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape([-1, cfg.vocab_size]), batch[:, 1:].reshape([-1]))
        loss.backward()
        opt.step()
        opt.clear_grad()
    model.eval()
    return save_model(model, str(out), tokenizer=Tokenizer.load(tok_dir), extra={"train_loss": float(loss)})


def prune_checkpoint(src: str, dst: str) -> str:
    """A structurally pruned copy of ``src`` made by ``gpt_compress.prune.prune_model``: layer 1
    keeps heads 1 and 3 of its 4, the FFNs keep their first ``PRUNED_FFN`` channels (weights
    sliced, so the model stays a trained one)."""
    from gpt_compress.checkpoint import load_model, save_model
    from gpt_compress.data.tokenizer import Tokenizer
    from gpt_compress.prune import prune_model

    model = load_model(src)
    keep_heads = [list(range(model.config.heads(0))), [1, 3]]
    keep_ffn = [list(range(n)) for n in PRUNED_FFN]
    pruned = prune_model(model, keep_heads, keep_ffn)
    assert [len(k) for k in keep_heads] == PRUNED_HEADS
    return save_model(pruned, dst, tokenizer=Tokenizer.load(src))


def model_dirs(tmp_path_factory, shakespeare) -> dict[str, str]:
    """{"ckpt", "export", "pruned_ckpt", "pruned_export"}; built on first call in a session."""
    from gpt_compress.export import export

    base = tmp_path_factory.getbasetemp() / "gptc_export_models"
    dirs = {"ckpt": base / "ckpt_link", "export": base / "export", "pruned_ckpt": base / "pruned_ckpt",
            "pruned_export": base / "pruned_export"}
    done = base / "DONE"
    if not done.exists():
        base.mkdir(exist_ok=True)
        tok_dir, prefix = shakespeare
        ckpt = train_tiny(tok_dir, prefix, base / "ckpt")
        dirs["ckpt"].write_text(ckpt)
        export(ckpt, str(dirs["export"]), formats=("paddle", "onnx"))
        prune_checkpoint(ckpt, str(dirs["pruned_ckpt"]))
        export(str(dirs["pruned_ckpt"]), str(dirs["pruned_export"]), formats=("paddle", "onnx"))
        done.write_text("ok")
    out = {k: str(v) for k, v in dirs.items()}
    out["ckpt"] = dirs["ckpt"].read_text()
    return out
