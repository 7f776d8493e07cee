"""Fake-quant model -> the two float-free-of-guesswork models the int8 exports are built from.

* ``deploy_model``: the Paddle Inference model. Weights are stored as int8 *buffers* with their
  float32 scales and dequantized inside the graph (``cast * scale``); W8A8 inputs are
  fake-quantized in the graph with ``round``/``clip`` (plain float ops). The ``.pdiparams`` file
  is ~4x smaller than fp32 and the numbers are those of the fake-quant model, op for op. It
  does not use Paddle's ``quantize_linear``/``dequantize_linear``: in Paddle 3.3.1 their static
  CPU kernels re-quantize instead of dequantizing (docs/PADDLE_CPU.md), so the compute stays
  float32 (Paddle gains no int8 speed on CPU; onnxruntime is the int8 runtime).
* ``fake_quant_float_model``: a plain float model whose quantized weights hold their dequantized
  values. ``export/int8.py`` converts it to ONNX and rewrites each quantized weight (found by
  its exact bytes) into int8 QDQ / MatMulNBits form.

Both are ordinary ``GPTForCausalLM`` instances with some layers swapped, so the one exporter
(``export/static.py``) saves them.
"""
from __future__ import annotations

import hashlib

import numpy as np
import paddle
import paddle.nn as nn

from ..checkpoint import build_model, check_state_dict
from ..config import W8A8
from ..memory import return_freed_memory
from .quantize import (HeadInputQuant, QuantEmbedding, QuantLinear, fake_quant_act, fake_quant_dynamic,
                       quant_layers)


def _buffer(layer: nn.Layer, name: str, array: np.ndarray) -> None:
    layer.register_buffer(name, paddle.to_tensor(np.ascontiguousarray(array)), persistable=True)


class Int8Linear(nn.Layer):
    """A Linear whose (K, N) weight is stored int8 with per-channel (1, N) or blocked
    (K/b, 1, N) scales, dequantized in the graph; W8A8 inputs fake-quantized with a fixed scale,
    weight-only inputs (``dynamic_inputs``) per token and block."""

    def __init__(self, codes: np.ndarray, scale: np.ndarray, bias, act_scale=None, act_bits: int = 8,
                 dynamic_inputs: bool = False):
        super().__init__()
        self.dynamic_inputs = dynamic_inputs
        self.block = codes.shape[1] if codes.ndim == 3 else 0  # blocked codes are (K/b, b, N)
        self.k, self.n = (codes.shape[0] * codes.shape[1], codes.shape[2]) if self.block else codes.shape
        _buffer(self, "weight_int8", codes.reshape(self.k, self.n).astype(np.int8))
        _buffer(self, "weight_scale", scale.astype(np.float32))
        self.bias = None
        if bias is not None:
            self.bias = self.create_parameter([self.n], dtype="float32", is_bias=True)
            self.bias.set_value(paddle.to_tensor(bias.astype(np.float32)))
        self.act_bits = act_bits
        if act_scale is not None:
            _buffer(self, "act_scale", np.asarray(act_scale, np.float32).reshape([1]))
        else:
            self.act_scale = None

    def dequantized_weight(self) -> paddle.Tensor:
        """(K, N) float32: codes * scales, the fake-quant model's weight bit for bit."""
        w = self.weight_int8.astype("float32")
        if self.block:
            return (w.reshape([self.k // self.block, self.block, self.n]) * self.weight_scale).reshape([self.k, self.n])
        return w * self.weight_scale

    def forward(self, x):
        if self.act_scale is not None:
            x = fake_quant_act(x, self.act_scale, self.act_bits)
        elif self.dynamic_inputs:
            x = fake_quant_dynamic(x, self.block)
        y = paddle.matmul(x, self.dequantized_weight())
        return y + self.bias if self.bias is not None else y


class Int8TransposedEmbedding(nn.Layer):
    """The tied embedding / LM head for ``export.static.ExportableLM``: stored (hidden, vocab)
    int8 with (H/b, 1, V) block scales. ``weight_t`` is the dequantized (H, V) head weight; a
    lookup gathers and dequantizes only the columns it needs."""

    def __init__(self, codes: np.ndarray, scale: np.ndarray):
        super().__init__()
        vocab, nblocks, block = codes.shape  # (V, H/b, b) and scale (V, H/b, 1)
        self.hidden, self.block, self.nblocks, self.vocab = nblocks * block, block, nblocks, vocab
        _buffer(self, "weight_t_int8", codes.reshape(vocab, -1).T.astype(np.int8))  # (H, V)
        _buffer(self, "weight_t_scale", scale.reshape(vocab, nblocks).T.reshape(nblocks, 1, vocab))

    @property
    def weight_t(self) -> paddle.Tensor:
        """(H, V) float32 dequantized head weight."""
        w = self.weight_t_int8.astype("float32").reshape([self.nblocks, self.block, self.vocab])
        return (w * self.weight_t_scale).reshape([self.hidden, self.vocab])

    def forward(self, input_ids):
        """input_ids (B, T) -> (B, T, hidden)."""
        ids = input_ids.reshape([-1])
        cols = paddle.gather(self.weight_t_int8, ids, axis=1).astype("float32")  # (H, n)
        scale = paddle.gather(self.weight_t_scale, ids, axis=2)  # (H/b, 1, n)
        cols = (cols.reshape([self.nblocks, self.block, -1]) * scale).reshape([self.hidden, -1])
        shape = paddle.shape(input_ids)
        return paddle.transpose(cols, [1, 0]).reshape([shape[0], shape[1], self.hidden])


class Int8Embedding(nn.Layer):
    """An untied token embedding stored (V, H) int8 with (V, H/b, 1) block scales."""

    def __init__(self, codes: np.ndarray, scale: np.ndarray):
        super().__init__()
        vocab, self.nblocks, self.block = codes.shape
        self.hidden = self.nblocks * self.block
        _buffer(self, "weight_int8", codes.reshape(vocab, -1).astype(np.int8))
        _buffer(self, "weight_scale", scale.astype(np.float32))

    def forward(self, input_ids):
        rows = paddle.gather(self.weight_int8, input_ids.reshape([-1]), axis=0).astype("float32")  # (n, H)
        scale = paddle.gather(self.weight_scale, input_ids.reshape([-1]), axis=0)  # (n, H/b, 1)
        rows = (rows.reshape([-1, self.nblocks, self.block]) * scale).reshape([-1, self.hidden])
        shape = paddle.shape(input_ids)
        return rows.reshape([shape[0], shape[1], self.hidden])


def _float_copy(qmodel, value=None, skip=(), consume: bool = False):
    """A fresh float model of the same config holding ``qmodel``'s weights, copied tensor by tensor
    (no second copy of the whole model in flight): ``value(key)`` (default: the raw, master
    weight) for every state_dict entry but those in ``skip``, which are never allocated (the
    model is built under ``paddle.LazyGuard``: its random init never runs; the caller replaces
    those layers). ``consume``: free each of ``qmodel``'s tensors once copied (the weights move
    from one model to the other; ``qmodel`` is unusable afterwards)."""
    with paddle.LazyGuard():  # same parameter names as an eager build: the exported files are unchanged
        model = build_model(qmodel.config, "lm")
    src = qmodel.state_dict()
    check_state_dict(model, src, "the fake-quant model")
    for k, v in model.state_dict().items():
        if k in skip:
            continue
        v.set_value(src[k] if value is None else value(k))
        if consume and src[k]._is_initialized():
            src[k]._clear_data()
            # qmodel's weights may sit in the heap (``runtime.tune_cpu``): give each one back now,
            # or the freed chunks stay resident while the copy's tensors are mapped afresh.
            return_freed_memory()
    model.eval()
    return model


def _set(model, name: str, layer: nn.Layer) -> None:
    parent_name, _, attr = name.rpartition(".")
    parent = dict(model.named_sublayers())[parent_name] if parent_name else model
    setattr(parent, attr, layer)


@paddle.no_grad()
def deploy_model(qmodel, table=None):
    """The Paddle Inference form of fake-quant ``qmodel`` (see the module docstring); ``table``:
    its ``quant_table``, whose codes are used instead of quantizing the weights again."""
    layers = quant_layers(qmodel)
    codes_of = {e["name"]: (e["codes"], e["scale"]) for e in table or ()}
    replaced = {f"{name}.{p}" for name in layers for p in ("weight", "bias")}
    model = _float_copy(qmodel, skip=replaced)  # the quantized layers' float weights are never allocated
    tied = qmodel.config.tie_word_embeddings
    for name, layer in layers.items():
        codes, scale = codes_of[name] if name in codes_of else layer.weight_codes()
        if isinstance(layer, QuantEmbedding):
            new = Int8TransposedEmbedding(codes, scale) if tied and name == "gpt.wte" else Int8Embedding(codes, scale)
        else:
            act = layer.act_scale().numpy() if layer.mode == W8A8 else None
            bias = layer.bias.numpy() if layer.bias is not None else None
            new = Int8Linear(codes, scale, bias, act, layer.act_bits, layer.dynamic_inputs and layer.quant_input)
        _set(model, name, new)
    if isinstance(qmodel.gpt.ln_f, HeadInputQuant):  # the head's dynamic input quantization
        model.gpt.ln_f = HeadInputQuant(model.gpt.ln_f, qmodel.gpt.ln_f.block)
    model.eval()
    return model


@paddle.no_grad()
def fake_quant_float_model(qmodel, consume: bool = False):
    """A float model whose quantized weights are replaced by their dequantized values.
    ``consume``: move the weights out of ``qmodel`` tensor by tensor (it is unusable afterwards),
    so that the two models together hold one copy of the weights."""
    layers = quant_layers(qmodel)
    src = qmodel.state_dict()

    def value(key: str):
        name, _, attr = key.rpartition(".")
        return layers[name].weight if attr == "weight" and name in layers else src[key]  # the fake-quantized value

    return _float_copy(qmodel, value, consume=consume)


def weight_digest(a: np.ndarray, rows: int = 1 << 12) -> str:
    """sha256 of float32 array ``a``'s C-order bytes: how the ONNX rewrite finds a weight. A
    non-contiguous 2-D ``a`` (a transpose) is hashed ``rows`` rows at a time, never copied whole."""
    h = hashlib.sha256()
    if a.ndim == 2 and not a.flags.c_contiguous:
        for i in range(0, a.shape[0], rows):
            h.update(memoryview(np.ascontiguousarray(a[i:i + rows], dtype=np.float32)).cast("B"))
    else:
        h.update(memoryview(np.ascontiguousarray(a, dtype=np.float32)).cast("B"))
    return h.hexdigest()


def quant_table(qmodel) -> list[dict]:
    """Per quantized layer, what the ONNX rewrite needs: name, kind, mode, bits, block, the exact
    float32 weight the float export stores, int8 codes and scales, and the input scale."""
    out = []
    for name, layer in quant_layers(qmodel).items():
        codes, scale = layer.weight_codes()
        w = layer.weight.numpy().astype(np.float32, copy=False)
        embedding = isinstance(layer, QuantEmbedding)
        # Digests, not the float weights (a copy of the model held through the whole export).
        digests = {"t": weight_digest(w.T), "rows": weight_digest(w)} if embedding else {"matmul": weight_digest(w)}
        del w
        entry = {"name": name, "kind": "embedding" if embedding else "linear",
                 "mode": layer.mode, "bits": layer.weight_bits, "block": layer.block,
                 "digests": digests, "codes": codes, "scale": scale,
                 "act_scale": None, "act_bits": None, "dynamic_inputs": layer.dynamic_inputs}
        if isinstance(layer, QuantLinear) and layer.mode == W8A8:
            entry["act_scale"] = float(layer.act_scale().numpy()[0])
            entry["act_bits"] = layer.act_bits
        out.append(entry)
    return out
