"""Where a gpt-bench train step goes: each part timed alone (forward+backward) with the step's shapes.

    OMP_NUM_THREADS=2 python bench/step_breakdown.py [--tune none] [--batch 8 --seq 256]

Prints one JSON object: median seconds per part and per full step; ``parts_sum_s`` vs
``train_step_s`` shows how much the split misses (Python/autograd overhead between parts). The
attention and MLP parts include their LayerNorm and residual add; "matmul_ideal_s" is what their
matmul FLOPs would take at the measured GEMM ceiling, to separate slow matmuls from slow glue.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from forward import median_time  # noqa: E402  (bench/ is not a package)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="gpt-bench")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--tune", default="mkl,views,malloc", help="as in bench/forward.py")
    a = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    from gpt_compress.runtime import tune_cpu

    tune = set(a.tune.split(",")) - {"none", ""}
    tuning = tune_cpu(mkl_amd="mkl" in tune, strided_views="views" not in tune, malloc="malloc" in tune)

    import paddle
    import paddle.nn.functional as F

    from gpt_compress.config import ModelConfig
    from gpt_compress.model.gpt import GPTForCausalLM
    from gpt_compress.train.loss import lm_head_loss, lm_loss

    cfg = ModelConfig.from_preset(a.preset, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    paddle.seed(0)
    model = GPTForCausalLM(cfg)
    B, T, H, V, L = a.batch, a.seq, cfg.hidden_size, cfg.vocab_size, cfg.num_layers
    ids = paddle.randint(0, V, [B, T])
    labels = paddle.randint(0, V, [B, T])
    x = paddle.randn([B, T, H])
    x.stop_gradient = False
    block = model.gpt.blocks[0]

    def fb(fn):
        def step():
            fn().sum().backward()
            model.clear_gradients(set_to_zero=False)
            x.clear_gradient()
        return lambda: median_time(step, 1, a.steps)

    def embedding():
        pos = paddle.arange(T, dtype="int64").unsqueeze(0)
        return model.gpt.wte(ids) + model.gpt.wpe(pos)

    hidden = paddle.randn([B, T, H])
    hidden.stop_gradient = False

    def head_plain():
        logits = model.logits(hidden).reshape([-1, V])
        return F.cross_entropy(logits, labels.reshape([-1]))

    opt = paddle.optimizer.AdamW(learning_rate=1e-4, parameters=model.parameters(),
                                 grad_clip=paddle.nn.ClipGradByGlobalNorm(1.0))

    def optimizer_step():
        for prm in model.parameters():  # gradients as after a backward
            prm.grad = paddle.ones_like(prm) * 1e-3
        t = time.perf_counter()
        opt.step()
        opt.clear_grad(set_to_zero=False)
        return time.perf_counter() - t

    def train_step():
        lm_loss(model, ids, labels).backward()
        opt.step()
        opt.clear_grad(set_to_zero=False)

    sq = paddle.randn([2048, 2048])
    ceiling = 2 * 2048**3 / median_time(lambda: paddle.matmul(sq, sq), 1, 5)
    n = B * T
    attn_flops = 3 * (2 * n * H * 3 * H + 2 * n * H * H + 2 * 2 * B * T * T * H)  # qkv, out, QK^T + PV
    mlp_flops = 3 * (2 * 2 * n * H * cfg.ffn_size)
    head_flops = 3 * 2 * n * H * V

    parts = {
        "embedding": fb(embedding)(),
        "attention_per_layer": fb(lambda: block._attn(x, None) + x)(),
        "mlp_per_layer": fb(lambda: block.mlp(block.ln_2(x)) + x)(),
        "ln_f": fb(lambda: model.gpt.ln_f(x))(),
        "head_plain_ce": median_time(lambda: head_plain().backward(), 1, a.steps),
        "head_lm_loss": median_time(lambda: lm_head_loss(model, hidden, labels).backward(), 1, a.steps),
        "optimizer_adamw_clip": statistics.median(optimizer_step() for _ in range(a.steps + 1)),
    }
    model.clear_gradients(set_to_zero=False)
    step_s = median_time(train_step, 1, a.steps)
    parts_sum = (parts["embedding"] + L * (parts["attention_per_layer"] + parts["mlp_per_layer"]) + parts["ln_f"]
                 + parts["head_lm_loss"] + parts["optimizer_adamw_clip"])
    out = {
        "tuning": tuning, "shape": {"batch": B, "seq": T, "layers": L, "hidden": H, "vocab": V},
        "gemm_ceiling_gflops": round(ceiling / 1e9, 1),
        "seconds": {k: round(v, 4) for k, v in parts.items()},
        "all_layers_s": {"attention": round(L * parts["attention_per_layer"], 3),
                         "mlp": round(L * parts["mlp_per_layer"], 3)},
        "matmul_ideal_s": {"attention_per_layer": round(attn_flops / ceiling, 4),
                           "mlp_per_layer": round(mlp_flops / ceiling, 4), "head": round(head_flops / ceiling, 3)},
        "parts_sum_s": round(parts_sum, 3), "train_step_s": round(step_s, 3),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
