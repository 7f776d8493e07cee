"""Parameter names are public API (TP plans, quant globs, checkpoints, ONNX): frozen here."""
from gpt_compress.config import ModelConfig
from gpt_compress.model.gpt import GPTForCausalLM, GPTForSequenceClassification

FROZEN_LAYER = [
    "ln_1.weight", "ln_1.bias", "attn.qkv.weight", "attn.qkv.bias", "attn.out.weight", "attn.out.bias",
    "ln_2.weight", "ln_2.bias", "mlp.fc_in.weight", "mlp.fc_in.bias", "mlp.fc_out.weight", "mlp.fc_out.bias",
]


def test_causal_lm_parameter_names_and_shapes():
    cfg = ModelConfig.from_preset("gpt-tiny")  # hidden 64, 4 heads, 2 layers, vocab 1024, 128 positions
    got = {n: tuple(p.shape) for n, p in GPTForCausalLM(cfg).named_parameters()}
    want = {"gpt.wte.weight": (1024, 64), "gpt.wpe.weight": (128, 64)}
    shapes = [(64,), (64,), (64, 192), (192,), (64, 64), (64,), (64,), (64,), (64, 256), (256,), (256, 64), (64,)]
    for i in range(2):
        want.update({f"gpt.blocks.{i}.{n}": s for n, s in zip(FROZEN_LAYER, shapes)})
    want.update({"gpt.ln_f.weight": (64,), "gpt.ln_f.bias": (64,)})
    assert got == want


def test_untied_and_classifier_heads():
    cfg = ModelConfig.from_preset("gpt-tiny", tie_word_embeddings=False, num_labels=3)
    names = dict(GPTForCausalLM(cfg).named_parameters())
    assert tuple(names["lm_head.weight"].shape) == (64, 1024)
    cls = dict(GPTForSequenceClassification(cfg).named_parameters())
    assert tuple(cls["score.weight"].shape) == (64, 3) and "lm_head.weight" not in cls
