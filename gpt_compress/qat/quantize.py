"""Fake quantization as a ``model -> model`` transform, chosen by layer name (``QuantConfig``).

``quantize_model(model, qcfg)`` swaps the chosen ``nn.Linear`` layers (and the token embedding,
which a tied model also uses as its LM head) for fake-quant layers that compute exactly what the
int8 exports compute (``export/int8.py``):

* weights: symmetric abs-max, ``q = round(w / s)`` with ``s = max|w| / (2^(b-1) - 1)`` per output
  channel (W8A8) or per block of ``weight_block_size`` inputs (weight-only);
* W8A8 inputs: per tensor, ``clip(round(x / s), -2^(b-1), 2^(b-1) - 1) * s``, the saturation range of
  ONNX ``QuantizeLinear`` int8; ``s = amax / (2^(b-1) - 1)`` where ``amax`` is a moving average of
  the batch abs-max while training (QAT, bias-corrected like Paddle's moving-average abs-max
  quanter) and fixed in eval mode or after calibration (PTQ, ``ptq.py``);
* gradients: straight-through (``x + (q - x).detach()``).

The swapped layers keep the *parameter names*: the raw float weight stays registered as
``weight`` (state_dict, optimizer, checkpoints see the usual names), while attribute access
``layer.weight`` returns the fake-quantized weight. So every consumer of ``.weight`` -- the layer's
own forward, the tied LM head (``GPTForCausalLM.logits``), the fused training loss
(``train/loss.py`` reads ``gpt.wte.weight`` / ``lm_head.weight``) -- sees the quantized weight
without knowing about quantization.

Why not ``paddle.quantization`` (QAT/PTQ/QuantConfig): in Paddle 3.3.1 its only quanter is
``FakeQuanterWithAbsMaxObserver`` (one moving-average scale per tensor: no per-channel or
block-wise weights), ``QAT.convert`` fails ("Can't constructs a 'paddle.Tensor' with data type
<class 'NoneType'>", ``zero_points()`` is None), and its exported ``dequantize_linear`` computes
wrong values on CPU (docs/PADDLE_CPU.md). We also need per-layer bit widths (the sensitivity
ranking runs at 4 bits), the tied embedding/head, onnxruntime's rounding and saturation, and
scales we can read back to build the int8 models. The layers here are ~200 lines, checked
against both int8 runtimes value by value (tests/test_quant.py).
"""
from __future__ import annotations

import dataclasses
import fnmatch
import json
import os
from typing import Optional

import numpy as np
import paddle
import paddle.nn as nn
import paddle.nn.functional as F

from ..checkpoint import CONFIG, CheckpointError, load_model, save_model
from ..config import W8A8, WEIGHT_ONLY, ConfigError, QuantConfig


def qmax(bits: int) -> int:
    """Largest symmetric code: 127 for 8 bits, 7 for 4."""
    return 2 ** (bits - 1) - 1


def fake_quant_act(x: paddle.Tensor, scale: paddle.Tensor, bits: int) -> paddle.Tensor:
    """``clip(round(x / scale), -2^(b-1), 2^(b-1) - 1) * scale`` with a straight-through gradient."""
    q = paddle.clip(paddle.round(x / scale), -qmax(bits) - 1, qmax(bits)) * scale
    return x + (q - x).detach()


def fake_quant_dynamic(x: paddle.Tensor, block: int) -> paddle.Tensor:
    """Int8 fake quantization of each token's features in blocks of ``block``, scale
    ``max|x| / 127`` per block, made from the values themselves (straight-through gradient): the
    input quantization of onnxruntime's MatMulNBits ``accuracy_level=4`` kernels (checked to
    1e-6 against them)."""
    k = x.shape[-1]
    xb = x.reshape([-1, k // block, block])
    scale = paddle.clip(paddle.max(paddle.abs(xb), axis=-1, keepdim=True), min=1e-30) / 127.0
    q = (paddle.clip(paddle.round(xb / scale), -128, 127) * scale).reshape(paddle.shape(x))
    return x + (q - x).detach()


def quantize_weight(w: paddle.Tensor, bits: int, block: int, k_axis: int):
    """Symmetric abs-max codes of a 2-D weight along its input axis ``k_axis`` (0 for a Linear's
    (K, N) weight, 1 for the (V, H) embedding used as the tied head's (N, K)).

    ``block == 0``: one scale per output channel; else one per ``block`` consecutive inputs.
    Returns ``(codes, scale)`` as float tensors shaped so that ``codes * scale`` broadcasts:
    (K, N) * (1, N), or blocked (K/b, b, N) * (K/b, 1, N) / (V, H/b, b) * (V, H/b, 1)."""
    if block:
        k = w.shape[k_axis]
        if k % block:
            raise ConfigError(f"Quant.weight_block_size {block} does not divide the layer's {k} inputs")
        shape = list(w.shape[:k_axis]) + [k // block, block] + list(w.shape[k_axis + 1:])
        w = w.reshape(shape)
        red = k_axis + 1
    else:
        red = k_axis
    amax = paddle.max(paddle.abs(w), axis=red, keepdim=True)
    scale = paddle.clip(amax, min=1e-8) / float(qmax(bits))
    return paddle.round(w / scale), scale


def fake_quant_weight(w: paddle.Tensor, bits: int, block: int, k_axis: int) -> paddle.Tensor:
    """``w`` with its values replaced by their dequantized codes (straight-through gradient).
    Each weight-sized temporary is dropped as soon as the next is made (at most two alive at a
    time besides ``w``: the tied embedding's are the largest of an export or an evaluation)."""
    codes, scale = quantize_weight(w, bits, block, k_axis)
    q = (codes * scale).reshape(w.shape)
    del codes
    d = (q - w).detach()
    del q
    return w + d


class _FakeQuantWeight(nn.Layer):
    """Base: the raw parameter registered as ``weight``; reading ``.weight`` gives it fake-quantized.

    ``enabled`` switches quantization off (calibration, sensitivity analysis); ``observer``, when
    set, sees every input first (``ptq.calibrate``)."""

    K_AXIS = 0

    def _init_quant(self, weight, name: str, mode: str, qcfg: QuantConfig):
        self.weight = weight
        self.name, self.mode = name, mode
        self.weight_bits = qcfg.weight_bits
        self.block = qcfg.weight_block_size if mode == WEIGHT_ONLY else 0
        self.dynamic_inputs = mode == WEIGHT_ONLY and qcfg.dynamic_inputs
        self.enabled = True
        self.observer = None

    def _get_weight(self):
        p = self._parameters.get("weight")
        if p is None:
            raise AttributeError("weight")
        if not self.enabled:
            return p
        return fake_quant_weight(p, self.weight_bits, self.block, self.K_AXIS)

    def _set_weight(self, value):  # nn.Layer.__setattr__ routes through a property's setter first
        self._parameters["weight"] = value

    weight = property(_get_weight, _set_weight)

    @property
    def raw_weight(self) -> paddle.Tensor:
        """The float parameter itself."""
        return self._parameters["weight"]

    @paddle.no_grad()
    def weight_codes(self) -> tuple[np.ndarray, np.ndarray]:
        """(int8 codes, float32 scales) of the current weight, shaped as ``quantize_weight`` returns."""
        codes, scale = quantize_weight(self.raw_weight, self.weight_bits, self.block, self.K_AXIS)
        return codes.numpy().astype(np.int8), scale.numpy().astype(np.float32)


class QuantLinear(_FakeQuantWeight):
    """``nn.Linear`` with fake-quantized weights and, in W8A8 mode, fake-quantized inputs (static
    scale); weight-only with ``dynamic_inputs``: inputs quantized per token and block."""

    def __init__(self, linear: nn.Linear, name: str, mode: str, qcfg: QuantConfig):
        super().__init__()
        self._init_quant(linear.weight, name, mode, qcfg)
        self.bias = linear.bias
        # An LM head's input is quantized by the final LayerNorm (``HeadInputQuant``): the fused
        # training loss reads ``lm_head.weight`` directly and never calls this forward.
        self.quant_input = name != "lm_head"
        self.act_bits = qcfg.activation_bits
        self.moving_rate = qcfg.moving_rate
        # amax of the inputs: a bias-corrected moving average (accum / state) while training.
        self.register_buffer("act_amax", paddle.zeros([1], dtype="float32"), persistable=False)
        self.register_buffer("_ema_accum", paddle.zeros([1], dtype="float32"), persistable=False)
        self.register_buffer("_ema_state", paddle.zeros([1], dtype="float32"), persistable=False)
        self.act_ready = False  # set once amax has a value (first training step or calibration)

    def set_act_amax(self, amax: float) -> None:
        """Fix the input clip value (calibration, loading); the moving average restarts from it."""
        self.act_amax.set_value(paddle.to_tensor([amax], dtype="float32"))
        self._ema_accum.set_value(paddle.to_tensor([amax], dtype="float32"))
        self._ema_state.set_value(paddle.ones([1], dtype="float32"))
        self.act_ready = True

    def act_scale(self) -> paddle.Tensor:
        """(1,) float32: ``amax / (2^(b-1) - 1)``, the scale the exports use."""
        return paddle.clip(self.act_amax, min=1e-8) / float(qmax(self.act_bits))

    @paddle.no_grad()
    def _track(self, x) -> None:
        cur = paddle.max(paddle.abs(x)).reshape([1]).astype("float32")
        r = self.moving_rate
        self._ema_accum.set_value(r * self._ema_accum + cur)
        self._ema_state.set_value(r * self._ema_state + 1.0)
        self.act_amax.set_value(self._ema_accum / self._ema_state)
        self.act_ready = True

    def forward(self, x):
        if self.observer is not None:
            self.observer.update(x)
        if self.enabled and self.mode == W8A8:
            if self.training:
                self._track(x)
            elif not self.act_ready:
                raise RuntimeError(f"{self.name}: W8A8 input scale was never set; calibrate (PTQ) or "
                                   "train (QAT) before evaluating")
            x = fake_quant_act(x, self.act_scale(), self.act_bits)
        elif self.enabled and self.dynamic_inputs and self.quant_input:
            x = fake_quant_dynamic(x, self.block)
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        bits = f"w{self.weight_bits}" + (f"a{self.act_bits}" if self.mode == W8A8 else f" block={self.block}")
        return f"{self.name}, {self.mode}, {bits}, enabled={self.enabled}"


class QuantEmbedding(_FakeQuantWeight):
    """Token (or position) embedding with weight-only fake quantization, blocks along the hidden
    axis: for the token table these are the per-row blocks of the tied LM head (whose (V, H)
    weight is used as ``h @ W^T``)."""

    K_AXIS = 1

    def __init__(self, emb: nn.Embedding, name: str, qcfg: QuantConfig):
        super().__init__()
        self._init_quant(emb.weight, name, WEIGHT_ONLY, qcfg)

    def forward(self, input_ids):
        if self.observer is not None:
            self.observer.update(input_ids)
        return F.embedding(input_ids, self.weight)

    def extra_repr(self) -> str:
        return f"{self.name}, weight_only, w{self.weight_bits} block={self.block}, enabled={self.enabled}"


class HeadInputQuant(nn.Layer):
    """The final LayerNorm, whose output is the LM head's input, followed by the head's dynamic
    input quantization (weight-only head with ``dynamic_inputs``). Keeps the parameter names
    ``gpt.ln_f.weight`` / ``.bias``. ``head`` (a fake-quant layer, not registered as a sublayer)
    switches it off with its ``enabled``; None: always on (the int8 Paddle model)."""

    def __init__(self, ln: nn.LayerNorm, block: int, head=None):
        super().__init__()
        self.weight, self.bias = ln.weight, ln.bias
        self.epsilon, self.normalized_shape = ln._epsilon, ln._normalized_shape
        self.block = block
        self._head = [head]  # a list: a Layer attribute would become a sublayer

    def forward(self, x):
        y = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.epsilon)
        head = self._head[0]
        if head is None or head.enabled:
            y = fake_quant_dynamic(y, self.block)
        return y


QUANT_LAYERS = (QuantLinear, QuantEmbedding)


def _kind(name: str, layer) -> Optional[str]:
    if isinstance(layer, nn.Linear):
        return "linear" if name.startswith("gpt.") else "lm_head"  # lm_head, or a classifier's score
    if isinstance(layer, nn.Embedding) and name in ("gpt.wte", "gpt.wpe"):
        return "embedding"
    return None


def quant_plan(model, qcfg: QuantConfig) -> dict[str, str]:
    """{layer name: W8A8 or WEIGHT_ONLY} of the layers ``qcfg`` selects in ``model``."""
    skips = qcfg.all_skips()
    plan = {}
    for name, layer in model.named_sublayers():
        kind = _kind(name, layer)
        mode = qcfg.mode_of(name, kind, skips) if kind else None
        if mode is not None:
            plan[name] = mode
    return plan


def apply_plan(model, plan: dict[str, str], qcfg: QuantConfig):
    """Swap every layer of ``plan`` for its fake-quant version, in place; returns ``model``."""
    subs = dict(model.named_sublayers())
    for name, mode in plan.items():
        if name not in subs:
            raise ConfigError(f"quantized layer {name!r} does not exist in this model")
        layer = subs[name]
        if isinstance(layer, QUANT_LAYERS):
            raise ConfigError(f"{name} is already quantized")
        kind = _kind(name, layer)
        if kind is None or (mode == W8A8 and kind != "linear"):
            raise ConfigError(f"{name} ({type(layer).__name__}) cannot be quantized as {mode}")
        parent_name, _, attr = name.rpartition(".")
        parent = subs[parent_name] if parent_name else model
        new = QuantEmbedding(layer, name, qcfg) if kind == "embedding" else QuantLinear(layer, name, mode, qcfg)
        setattr(parent, attr, new)
        if new.dynamic_inputs and _is_head(model, name):
            model.gpt.ln_f = HeadInputQuant(model.gpt.ln_f, new.block, head=new)
    model.quant_config = qcfg
    return model


def _is_head(model, name: str) -> bool:
    """``name`` is the LM head: ``lm_head``, or ``gpt.wte`` of a tied model."""
    return name == "lm_head" or (name == "gpt.wte" and getattr(model.config, "tie_word_embeddings", False)
                                 and hasattr(model, "logits"))


def quantize_model(model, qcfg: QuantConfig):
    """``model -> model``: fake-quantize the layers ``qcfg`` selects (in place; names unchanged)."""
    return apply_plan(model, checked_plan(model, qcfg), qcfg)


def checked_plan(model, qcfg: QuantConfig) -> dict[str, str]:
    """``quant_plan``, refused (``ConfigError``) when it selects nothing or a ``weight_only``
    pattern selects no layer; the quantization commands call it before any work."""
    plan = quant_plan(model, qcfg)
    if not plan:
        raise ConfigError("Quant.targets / Quant.weight_only select no layer of this model "
                          f"(targets={qcfg.targets}, skip={qcfg.all_skips()}, weight_only={qcfg.weight_only})")
    for glob in qcfg.weight_only:  # a pattern that selects nothing is a typo, as for Finetune.lora.targets
        if not any(mode == WEIGHT_ONLY and fnmatch.fnmatchcase(name, glob) for name, mode in plan.items()):
            raise ConfigError(f"Quant.weight_only pattern {glob!r} selects no layer of this model (weight-only "
                              "layers: block Linears not already W8A8 under Quant.targets, an untied lm_head, "
                              "gpt.wte, gpt.wpe)")
    return plan


def quant_layers(model) -> dict[str, _FakeQuantWeight]:
    """{name: fake-quant layer} of ``model``, in model order."""
    return {name: layer for name, layer in model.named_sublayers() if isinstance(layer, QUANT_LAYERS)}


def freeze_embeddings(model) -> None:
    """Do not train the token and position embeddings (FleetX ``freeze_embedding``). With tied
    weights this freezes the LM head too."""
    for p in (model.gpt.wte.raw_weight if isinstance(model.gpt.wte, QuantEmbedding) else model.gpt.wte.weight,
              model.gpt.wpe.weight):
        p.stop_gradient = True


# --------------------------------------------------------------------------------------
# Quantized checkpoints: the usual checkpoint (fp32 master weights under their public names,
# loadable by checkpoint.load_model as the float model) + a "quant" entry in config.json.
# --------------------------------------------------------------------------------------
def quant_state(model) -> dict:
    """JSON-safe description of the quantization of ``model``: config, per-layer mode and scales."""
    layers = {}
    for name, layer in quant_layers(model).items():
        entry = {"mode": layer.mode, "weight_bits": layer.weight_bits, "block": layer.block,
                 "dynamic_inputs": layer.dynamic_inputs}
        if isinstance(layer, QuantLinear) and layer.mode == W8A8:
            entry.update(act_bits=layer.act_bits, act_amax=float(layer.act_amax.numpy()[0]) if layer.act_ready else None)
        layers[name] = entry
    return {"config": dataclasses.asdict(model.quant_config), "layers": layers}


def save_quantized(model, path: str, tokenizer=None, extra: Optional[dict] = None, overwrite: bool = False) -> str:
    """A checkpoint directory of a fake-quant model (see above); returns its path."""
    return save_model(model, path, tokenizer=tokenizer, extra={"quant": quant_state(model), **(extra or {})},
                      overwrite=overwrite)


def read_quant_state(path: str) -> Optional[dict]:
    """The "quant" entry of a checkpoint's config.json, or None for a float checkpoint."""
    fp = os.path.join(path, CONFIG)
    if not os.path.isfile(fp):
        return None
    with open(fp, encoding="utf-8") as f:
        return json.load(f).get("quant")


def load_quantized(path: str, verify: bool = True):
    """Rebuild the fake-quant model saved by ``save_quantized`` (eval mode, scales restored)."""
    state = read_quant_state(path)
    if state is None:
        raise CheckpointError(f"{path} is a float checkpoint (config.json has no 'quant' entry)")
    model = load_model(path, verify=verify)
    qcfg = QuantConfig(**{**state["config"], "skip_file": ""})
    apply_plan(model, {n: e["mode"] for n, e in state["layers"].items()}, qcfg)
    layers = quant_layers(model)
    for name, entry in state["layers"].items():
        layer = layers[name]
        layer.weight_bits, layer.block = entry["weight_bits"], entry["block"]
        if entry.get("act_amax") is not None:
            layer.act_bits = entry["act_bits"]
            layer.set_act_amax(entry["act_amax"])
    model.eval()
    return model


def load_any(path: str, verify: bool = True):
    """A checkpoint as its model: fake-quant if it was saved quantized, else float."""
    return load_quantized(path, verify) if read_quant_state(path) else load_model(path, verify=verify)
