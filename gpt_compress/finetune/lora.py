"""LoRA as a ``model -> model`` transform chosen by name globs (like ``qat/quantize.py``).

``apply_lora(model, LoraConfig(targets=["gpt.blocks.*"]))`` swaps the chosen ``nn.Linear``
layers for ``LoRALinear``: the frozen base weight and bias stay registered under their public
names (``gpt.blocks.0.attn.qkv.weight``), and two adapter matrices are added beside them,
``...qkv.lora_A`` (in, r) and ``...qkv.lora_B`` (r, out), so that the layer computes
``x W + b + (alpha / r) * dropout(x) A B``. ``A`` starts random (Kaiming-uniform, as in the LoRA
paper's reference code), ``B`` at zero: the transformed model starts equal to the base model.
An ``nn.Embedding`` chosen by the globs (``gpt.wte``, which a tied model also uses as its LM
head) becomes a ``LoRAEmbedding``: ``weight`` (V, H) reads as ``W + (alpha / r) A B`` with ``A``
(V, r) at zero and ``B`` (r, H) random (as PEFT's embedding adapters), so both the token lookup
and the tied head (``model.gpt.wte.weight``) see the adapted table.
Every parameter that is not an adapter gets ``stop_gradient = True``, so the trainer's optimizer
(which takes the trainable parameters only) updates the adapters alone.

``save_adapters`` writes only the adapter tensors (``adapter.safetensors``) and the settings
(``adapter_config.json``); ``load_adapters`` puts them back on a transformed base model.
``merge_lora`` folds ``(alpha / r) A B`` into ``W`` and puts plain ``nn.Linear`` layers back: the
result has exactly the base model's parameter names, so it saves, exports and serves like any
checkpoint.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os

import numpy as np
import paddle
import paddle.nn as nn
import paddle.nn.functional as F

from ..errors import CheckpointError, ConfigError
from ..config import LoraConfig, matches_any

ADAPTER_WEIGHTS = "adapter.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


class LoRALinear(nn.Layer):
    """``nn.Linear`` (frozen) plus a rank-``r`` update ``(alpha / r) * dropout(x) @ A @ B``."""

    def __init__(self, linear: nn.Linear, cfg: LoraConfig):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias  # (in, out), (out,): names unchanged
        d_in, d_out = linear.weight.shape
        bound = 1.0 / math.sqrt(d_in)  # kaiming_uniform_(a=sqrt(5)) on (r, in), as the reference code
        self.lora_A = self.create_parameter(
            [d_in, cfg.rank], attr=paddle.ParamAttr(initializer=nn.initializer.Uniform(-bound, bound)))
        self.lora_B = self.create_parameter(
            [cfg.rank, d_out], attr=paddle.ParamAttr(initializer=nn.initializer.Constant(0.0)))
        self.scaling = cfg.alpha / cfg.rank
        self.dropout = cfg.dropout

    def forward(self, x):
        base = F.linear(x, self.weight, self.bias)
        h = F.dropout(x, self.dropout, training=self.training) if self.dropout else x
        return base + paddle.matmul(paddle.matmul(h, self.lora_A), self.lora_B) * self.scaling

    def merged_weight(self) -> paddle.Tensor:
        """``W + (alpha / r) A B`` (in, out)."""
        return self.weight + paddle.matmul(self.lora_A, self.lora_B) * self.scaling


class LoRAEmbedding(nn.Layer):
    """``nn.Embedding`` (frozen table ``W`` (V, H)) plus a rank-``r`` update: ``weight`` is
    ``W + (alpha / r) A B`` (computed, differentiable in ``A`` and ``B``), for the lookup and for
    every reader of ``.weight`` (the tied LM head). ``dropout`` does not apply to a lookup."""

    def __init__(self, embedding: nn.Embedding, cfg: LoraConfig):
        super().__init__()
        self._parameters["weight"] = embedding.weight  # public name unchanged; read through the property
        self._padding_idx = getattr(embedding, "_padding_idx", None)
        vocab, hidden = embedding.weight.shape
        self.lora_A = self.create_parameter(
            [vocab, cfg.rank], attr=paddle.ParamAttr(initializer=nn.initializer.Constant(0.0)))
        self.lora_B = self.create_parameter(
            [cfg.rank, hidden], attr=paddle.ParamAttr(initializer=nn.initializer.Normal(0.0, 1.0)))
        self.scaling = cfg.alpha / cfg.rank

    @property
    def weight(self) -> paddle.Tensor:
        return self.merged_weight()

    def forward(self, ids):
        return F.embedding(ids, self.weight, padding_idx=self._padding_idx)

    def merged_weight(self) -> paddle.Tensor:
        """``W + (alpha / r) A B`` (V, H)."""
        return self._parameters["weight"] + paddle.matmul(self.lora_A, self.lora_B) * self.scaling


def lora_plan(model, cfg: LoraConfig) -> list[str]:
    """Names of the ``nn.Linear`` and ``nn.Embedding`` layers ``cfg`` selects."""
    return [name for name, layer in model.named_sublayers()
            if isinstance(layer, (nn.Linear, nn.Embedding)) and matches_any(name, cfg.targets)
            and not matches_any(name, cfg.skip)]


def lora_layers(model) -> dict[str, nn.Layer]:
    """{name: LoRALinear or LoRAEmbedding} of ``model``, in model order."""
    return {name: layer for name, layer in model.named_sublayers()
            if isinstance(layer, (LoRALinear, LoRAEmbedding))}


def apply_lora(model, cfg: LoraConfig):
    """``model -> model``: adapters on the chosen Linears and Embeddings (in place); everything else frozen."""
    names = lora_plan(model, cfg)
    if not names:
        raise ConfigError(f"Finetune.lora.targets {cfg.targets} (skip {cfg.skip}) select no Linear or "
                          "Embedding layer; names look like gpt.blocks.0.attn.qkv, gpt.blocks.0.mlp.fc_in, gpt.wte")
    if lora_layers(model):
        raise ConfigError("the model already has LoRA adapters")
    subs = dict(model.named_sublayers())
    for p in model.parameters():
        p.stop_gradient = True
    for name in names:
        parent_name, _, attr = name.rpartition(".")
        wrap = LoRAEmbedding if isinstance(subs[name], nn.Embedding) else LoRALinear
        setattr(subs[parent_name] if parent_name else model, attr, wrap(subs[name], cfg))
    model.lora_config = cfg
    return model


def adapter_state(model) -> dict[str, np.ndarray]:
    """The adapter tensors by public name (``gpt.blocks.0.attn.qkv.lora_A``, ...)."""
    return {k: np.ascontiguousarray(v.numpy()) for k, v in model.state_dict().items()
            if k.endswith(".lora_A") or k.endswith(".lora_B")}


def save_adapters(model, path: str, base: str = "", overwrite: bool = False) -> str:
    """Write ``adapter.safetensors`` + ``adapter_config.json`` (settings, base checkpoint) to ``path``
    (an earlier adapter directory there is replaced only with ``overwrite``)."""
    from safetensors.numpy import save_file

    from ..fileio import write_dir_atomic, write_json_atomic

    tensors = adapter_state(model)
    if not tensors:
        raise ConfigError("the model has no LoRA adapters to save")
    meta = {"lora": dataclasses.asdict(model.lora_config), "base_model": base, "layers": list(lora_layers(model))}

    def write(tmp):
        save_file(tensors, os.path.join(tmp, ADAPTER_WEIGHTS))
        write_json_atomic(os.path.join(tmp, ADAPTER_CONFIG), meta)

    needed = sum(int(t.nbytes) for t in tensors.values())
    return write_dir_atomic(path, write, overwrite=overwrite, needed=needed)


def load_adapters(model, path: str):
    """Apply the adapters saved in ``path`` to base ``model`` (transform + weights); returns it."""
    from safetensors.numpy import load_file

    from ..fileio import verify_checksums

    verify_checksums(path)
    with open(os.path.join(path, ADAPTER_CONFIG), encoding="utf-8") as f:
        meta = json.load(f)
    apply_lora(model, LoraConfig(**meta["lora"]))
    tensors = load_file(os.path.join(path, ADAPTER_WEIGHTS))
    sd = model.state_dict()
    want = set(adapter_state(model))
    if set(tensors) != want:
        raise CheckpointError(f"{path}: adapters {sorted(set(tensors) ^ want)[:4]} do not match the model's layers")
    for k, v in tensors.items():
        sd[k].set_value(paddle.to_tensor(v))
    return model


@paddle.no_grad()
def merge_lora(model):
    """``model -> model``: fold every adapter into its base weight and restore plain ``nn.Linear``
    layers (parameter names as before ``apply_lora``); all parameters trainable again."""
    subs = dict(model.named_sublayers())
    for name, layer in lora_layers(model).items():
        weight = layer.merged_weight()
        parent_name, _, attr = name.rpartition(".")
        if isinstance(layer, LoRAEmbedding):
            table = layer._parameters["weight"]
            table.set_value(weight)
            plain = nn.Embedding(weight.shape[0], weight.shape[1], padding_idx=layer._padding_idx)
            plain.weight = table
            setattr(subs[parent_name] if parent_name else model, attr, plain)
            continue
        linear = nn.Linear(weight.shape[0], weight.shape[1], bias_attr=None if layer.bias is not None else False)
        linear.weight = layer.weight
        linear.weight.set_value(weight)
        if layer.bias is not None:
            linear.bias = layer.bias
        setattr(subs[parent_name] if parent_name else model, attr, linear)
    for p in model.parameters():
        p.stop_gradient = False
    if hasattr(model, "lora_config"):
        del model.lora_config
    return model
