"""The fused Paddle program: one ``fused.json`` + ``fused.pdiparams`` per export, running
gpt-compress's own CPU operators (``kernels/gptc_ops.cc`` + headers) for prefill, decode and scoring.

One program serves all three (so a runner holds one copy of the weights)::

    fused(input_ids (B,T), attention_mask (B,S+T), rows (n,), cache_key_0, cache_value_0, ...)
        -> logits (n, V) of the flat positions ``rows`` of the (B*T) new tokens

It is one ``gptc_generate`` op (kernel version 4, ``kernels.KERNEL_VERSION``: the one format the
ops run; an export of an older version is refused with the command that writes it again): embed,
every block and the LM head in one call (Paddle's executor cost per op, paid once a call; the
op's threads stay in one parallel region). A last input, ``control`` (int64 ``[steps, eos, pad,
suppress, flags, finished_0, ...]``), lets one call run several greedy decode steps, each feeding
the previous step's tokens (``FusedBackend.decode_greedy_steps``): a generated token then costs no
Python and no predictor run of its own. A speculative draft's program may also hold a **draft
vocabulary** (``FusedLM``'s ``draft_vocab``, ``export/draft_vocab.py``): its greedy steps, when the
control's flags ask, compute only the head rows of those tokens. Each block writes its new keys/values **in place** into
the caller's preallocated caches ``(B, H_i, capacity, D)`` at positions ``S..S+T-1`` (``S`` =
mask columns - T), of float32 or, exported with ``cache_dtype="bfloat16"``, bfloat16 (rounded to
nearest even as written; ``CACHE_DTYPES``): the op declares the caches as an inplace vector output, and Paddle Inference
shares the fed tensors' memory, so nothing is concatenated or copied per step (checked by
``tests/test_fused.py``). Prefill is the same call with ``S = 0``; scoring asks for every row.

Weights are stored (N, K) per Linear in the format the model was quantized to
(``qat.quantize``): float32; weight-only int8 / int4 (blocks of ``weight_block_size``, int4
packed as ``WEIGHT_FORMAT`` says; int8 with int8 inputs in row groups, ``group_rows``), inputs quantized per token and block
on the fly as the fake-quant model does (``dynamic_inputs``) or kept float; W8A8 (per-channel
int8 weights, the calibrated per-tensor input scale). The tied embedding and the LM head share
one tensor. Tensor-parallel exports (``gptc partition``) get a fused program per rank from
``fused_tp.py``, built from the same weights.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import warnings
from typing import Optional

import numpy as np
import paddle
import paddle.nn as nn
from paddle.static import InputSpec

from ..errors import ExportError, KernelError

FUSED_MODEL, FUSED_PARAMS = "fused.json", "fused.pdiparams"
# The weight block formats, as the kernels define them (kernels/gptc_common.h, namespace
# weight_format: tests/test_kernel_sources.py checks that the two agree).
WEIGHT_FORMAT = {
    "kFloatBits": 32,  # float32 values
    "kInt8Bits": 8,  # one signed code a byte (codes of 2..8 bits are stored so)
    "kInt4Bits": 4,  # two codes a byte, packed in runs
    "kInt4Run": 32,  # inputs of one packed run
    "kInt4RunBytes": 16,  # its bytes: byte j holds input j (low nibble), j + 16 (high)
    "kInt4HighInput": 16,  # the input a byte's high nibble holds, past the low one's
    "kInt4Offset": 8,  # a code w is stored as w + 8 (0..15)
    # int8 codes + 128 in groups of kGroupRows rows, 4 inputs a row a step, scales in the same
    # groups (kernels/gptc_grouped.h); a format code, not a bit width (the op's bits attributes carry it)
    "kInt8Grouped": 9,
    "kGroupRows": 48,
}
ACTIVATIONS = {"relu": 0, "gelu": 1, "gelu_new": 2}
LINEARS = ("attn.qkv", "attn.out", "mlp.fc_in", "mlp.fc_out")


def pack_int4(codes: np.ndarray) -> np.ndarray:
    """Signed codes (N, K) in [-8, 7] -> (N, K/2) int8 bytes holding code + 8: in each run of 32
    inputs, byte j holds input j (low nibble) and input j + 16 (high nibble), the layout one
    16-byte load unpacks (``WEIGHT_FORMAT``)."""
    run, high, offset = WEIGHT_FORMAT["kInt4Run"], WEIGHT_FORMAT["kInt4HighInput"], WEIGHT_FORMAT["kInt4Offset"]
    n, k = codes.shape
    if k % run:
        raise ExportError(f"int4 fused weights need a multiple of {run} inputs, got {k}")
    u = (codes.astype(np.int16) + offset).astype(np.uint8).reshape(n, k // run, run)
    return (u[..., :high] | (u[..., high:] << 4)).astype(np.uint8).reshape(n, k // 2).view(np.int8)


def groupable(w: np.ndarray, s: Optional[np.ndarray], bits: int, act: float) -> bool:
    """Whether an int weight is stored in row groups: int8 codes against int8 inputs (``act`` >= 0),
    in blocks of whole 4-code steps (the grouped kernels' unit)."""
    if bits != WEIGHT_FORMAT["kInt8Bits"] or act < 0 or s is None:
        return False
    k = w.shape[1]
    return k % 4 == 0 and s.shape[1] > 0 and k % s.shape[1] == 0 and (k // s.shape[1]) % 4 == 0


def group_rows(codes: np.ndarray, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Int8 codes (N, K) and scales (N, nb) -> the row-group storage (``WEIGHT_FORMAT``'s
    kInt8Grouped, kernels/gptc_grouped.h): groups of 48 rows (the last padded with zero codes and
    scales); group g, step j holds rows 48g..48g+47's codes of inputs 4j..4j+3 (+ 128), 4 bytes a
    row; group g, block b the 48 rows' scales. Flat arrays (their pieces declare (N, K), (N, nb))."""
    rows = WEIGHT_FORMAT["kGroupRows"]
    n, k = codes.shape
    nb = scales.shape[1]
    g = -(-n // rows)
    c = np.zeros((g * rows, k), np.int8)
    c[:n] = codes
    u = (c.view(np.uint8) ^ np.uint8(0x80)).reshape(g, rows, k // 4, 4).transpose(0, 2, 1, 3)
    sc = np.zeros((g * rows, nb), np.float32)
    sc[:n] = scales
    return (np.ascontiguousarray(u).reshape(-1).view(np.int8),
            np.ascontiguousarray(sc.reshape(g, rows, nb).transpose(0, 2, 1)).reshape(-1))


def _packed(codes_nk: np.ndarray, scales_nb: np.ndarray, bits: int):
    """(weight array, scale array, op bits) for int codes (N, K) and scales (N, K/blk)."""
    if bits == 4:
        return pack_int4(codes_nk), scales_nb.astype(np.float32), 4
    # Codes of 2..8 bits all fit int8 and compute as int8 (only 4 bits is packed).
    return codes_nk.astype(np.int8), scales_nb.astype(np.float32), 8


def linear_spec(layer, name: str) -> dict:
    """One Linear as the op stores it: weight (N, K), scales, bias, bits, input mode ``act``
    (-1 float inputs, 0 dynamic int8 per token and block, > 0 the W8A8 input scale)."""
    from ..config import W8A8
    from ..qat.quantize import QuantLinear

    bias = layer.bias.numpy().astype(np.float32) if layer.bias is not None else None
    if isinstance(layer, QuantLinear):
        codes, scale = layer.weight_codes()
        if layer.mode == W8A8:  # (K, N) codes, (1, N) scales
            w, s, bits = _packed(np.ascontiguousarray(codes.T), scale.reshape(-1, 1), layer.weight_bits)
            act = float(layer.act_scale().numpy()[0])
        else:  # (K/b, b, N) codes, (K/b, 1, N) scales
            kb, b, n = codes.shape
            w, s, bits = _packed(np.ascontiguousarray(codes.reshape(kb * b, n).T),
                                 np.ascontiguousarray(scale.reshape(kb, n).T), layer.weight_bits)
            act = 0.0 if (layer.dynamic_inputs and layer.quant_input) else -1.0
        return {"name": name, "w": w, "s": s, "b": bias, "bits": bits, "act": act}
    if not isinstance(layer, nn.Linear):
        raise ExportError(f"{name}: a {type(layer).__name__} has no fused form")
    return {"name": name, "w": np.ascontiguousarray(layer.weight.numpy().T, dtype=np.float32), "s": None,
            "b": bias, "bits": 32, "act": -1.0}


def embedding_spec(layer, name: str) -> dict:
    """A (rows, hidden) table: float32, or int codes (rows, hidden) with block scales."""
    from ..qat.quantize import QuantEmbedding

    if isinstance(layer, QuantEmbedding):
        codes, scale = layer.weight_codes()  # (V, H/b, b), (V, H/b, 1)
        v = codes.shape[0]
        w, s, bits = _packed(codes.reshape(v, -1), scale.reshape(v, -1), layer.weight_bits)
        return {"name": name, "w": w, "s": s, "bits": bits}
    if not isinstance(layer, nn.Embedding):
        raise ExportError(f"{name}: a {type(layer).__name__} has no fused form")
    return {"name": name, "w": layer.weight.numpy().astype(np.float32, copy=False), "s": None, "bits": 32}


def check_draft_vocab(ids, vocab_size: int) -> np.ndarray:
    """A draft vocabulary as the op takes it: int64 ids, ascending, unique, within the vocabulary
    (and below 2^24, stored exactly as float32)."""
    ids = np.asarray(ids)
    if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise ExportError("draft vocabulary: a non-empty list of token ids is needed")
    if ids[0] < 0 or ids[-1] >= vocab_size or np.any(np.diff(ids) <= 0):
        raise ExportError(f"draft vocabulary: ids must ascend, unique, within the vocabulary (0..{vocab_size - 1})")
    if vocab_size > 1 << 24:
        raise ExportError(f"draft vocabulary: a vocabulary of {vocab_size} tokens is past float32's exact ids")
    return ids.astype(np.int64)


def fused_weights(model) -> dict:
    """Everything the fused program stores, read (not mutated) from a float ``GPTForCausalLM``
    or its fake-quant form (``qat.quantize``). The arrays are built lazily, one tensor's worth
    at a time: ``layers`` is a generator of per-block specs and ``wte``, ``wpe``, ``head`` are
    zero-argument callables returning theirs, so ``FusedLM`` turns each into its buffer and drops
    the array before the next is built (the stage holds the model plus one copy of the weights)."""
    from ..qat.quantize import HeadInputQuant

    cfg = model.config
    if cfg.hidden_act not in ACTIVATIONS:
        raise ExportError(f"hidden_act {cfg.hidden_act!r} has no fused kernel ({', '.join(ACTIVATIONS)})")
    g = model.gpt

    def layers():
        for i, block in enumerate(g.blocks):
            subs = dict(block.named_sublayers())
            yield {"heads": cfg.heads(i),
                   "ln_1": (block.ln_1.weight.numpy(), block.ln_1.bias.numpy()),
                   "ln_2": (block.ln_2.weight.numpy(), block.ln_2.bias.numpy()),
                   "linears": [linear_spec(subs[n], f"gpt.blocks.{i}.{n}") for n in LINEARS]}

    head_act = 0.0 if isinstance(g.ln_f, HeadInputQuant) else -1.0
    tied = bool(cfg.tie_word_embeddings)

    def head(wte_bits: int) -> dict:
        if tied:
            return {"tied": True, "bits": wte_bits, "act": head_act if wte_bits != 32 else -1.0}
        spec = linear_spec(model.lm_head, "lm_head")
        if spec["bits"] != 32:
            spec["act"] = head_act
        return {"tied": False, **spec}

    return {"wte": lambda: embedding_spec(g.wte, "gpt.wte"), "wpe": lambda: embedding_spec(g.wpe, "gpt.wpe"),
            "layers": layers(), "head": head, "tied": tied, "tied_head_act": head_act if tied else -1.0,
            "ln_f": (g.ln_f.weight.numpy(), g.ln_f.bias.numpy()), "eps": float(cfg.layer_norm_epsilon),
            "activation": ACTIVATIONS[cfg.hidden_act], "config": cfg}


class WeightPacker:
    """The weights of a ``gptc_generate`` program packed into blobs, a float32 and an int8 one per
    group (the embeddings, each block; the last with the final norm and head): a few op inputs instead of one
    per weight (Paddle's executor costs about as much per input as per op). Each piece starts on a
    64-byte boundary; ``layout_of`` gives the op's 4 numbers per piece (blob, offset in elements,
    rows, columns). A piece becomes a Paddle tensor at once (its array is dropped, as the
    per-layer buffers are), and a group's pieces are concatenated when it closes: the build holds
    about one copy of the weights plus one group's."""

    def __init__(self):
        self.entries: list = []
        self.blobs: list = []
        self.group: list = []  # (kind, offset, flat tensor) of the open group
        self.size = [0, 0]

    def add(self, array: np.ndarray, shape: Optional[tuple] = None) -> int:
        """A piece of ``array`` (its layout says ``shape``, else the array's: a grouped weight's
        pieces declare (N, K) and (N, nb) over their padded groups)."""
        a = np.ascontiguousarray(array)
        kind = 1 if a.dtype == np.int8 else 0
        a = a if kind else a.astype(np.float32, copy=False)
        unit = 64 if kind else 16  # elements per 64 bytes
        off = -(-self.size[kind] // unit) * unit
        self.group.append((kind, off, paddle.to_tensor(a.reshape(-1))))
        self.size[kind] = off + a.size
        shape = a.shape if shape is None else shape
        rows = int(shape[0]) if len(shape) else 1
        self.entries.append([len(self.blobs) + kind, off, rows, int(np.prod(shape[1:], dtype=np.int64))])
        return len(self.entries) - 1

    def add_weight(self, w: np.ndarray, s: Optional[np.ndarray], bits: int, act: float, none: int,
                   group: bool = True) -> tuple:
        """A weight and its scales (``none``: the piece standing for no scales) as the op reads them:
        (weight piece, scale piece, the op's format code), int8 in row groups where ``groupable``
        (unless ``group`` is false: row-major, the format the kernels also take)."""
        if group and groupable(w, s, bits, act):
            gw, gs = group_rows(w, s)
            return self.add(gw, w.shape), self.add(gs, s.shape), WEIGHT_FORMAT["kInt8Grouped"]
        return self.add(w), self.add(s) if s is not None else none, bits

    def close(self) -> None:
        """The open group's two blobs (zeros between pieces)."""
        if not self.group:
            return
        for kind, dtype in ((0, "float32"), (1, "int8")):
            parts, end = [], 0
            for k, off, t in self.group:
                if k == kind:
                    if off > end:
                        parts.append(paddle.zeros([off - end], dtype))
                    parts.append(t)
                    end = off + int(t.shape[0])
            self.blobs.append(paddle.concat(parts) if parts else paddle.zeros([64], dtype))
        self.group, self.size = [], [0, 0]

    def layout_of(self, pieces: list) -> list:
        return [int(x) for i in pieces for x in self.entries[i]]


class FusedLM(nn.Layer):
    """The fused program as a Layer (runs eagerly too): weights packed in blobs in the op formats
    (persistable buffers), ``forward`` = one ``gptc_generate`` call (see the module docstring).
    ``tokens=True`` (the saved program): ``forward`` returns the logits and each row's argmax
    int64 ((n, steps)), so greedy decoding fetches the tokens, not the (n, V) logits.
    ``group_int8=False`` stores int8 weights row-major instead of in row groups (the same values:
    the kernels' other int8 paths, which tests compare). ``draft_vocab`` (ascending token ids):
    the head's rows of those tokens are stored again, so that a speculative draft's greedy steps
    compute only them (``kernels.control(draft_vocab=True)``; ``draft_vocab.py``)."""

    def __init__(self, weights: dict, ops=None, tokens: bool = False, group_int8: bool = True,
                 draft_vocab: Optional[np.ndarray] = None):
        super().__init__()
        from ..kernels import load_ops

        self.ops = ops or load_ops()
        self.tokens, self._group = tokens, group_int8
        self.cfg = weights["config"]
        self.eps, self.activation = weights["eps"], weights["activation"]
        self._packer = WeightPacker()
        self._none = self._packer.add(np.zeros([1], np.float32))
        # Each spec's arrays are dropped once copied into their pieces (``fused_weights``).
        # A tied head's table is stored as the head reads it (grouped when its inputs are int8).
        wte = weights["wte"]()
        ids = None if draft_vocab is None else check_draft_vocab(draft_vocab, wte["w"].shape[0])
        draft_rows = None  # a tied head's draft rows, taken before the table's array is dropped
        if ids is not None and weights["tied"]:
            draft_rows = (wte["w"][ids], None if wte["s"] is None else wte["s"][ids])
        self.wte, self.wte_s, self.wte_bits, self.wte_code = self._table(wte, weights.get("tied_head_act", -1.0))
        del wte
        self.wpe, self.wpe_s, self.wpe_bits, _ = self._table(weights["wpe"](), -1.0)
        self.layer_args, self.layer_attrs = [], []
        for lay in weights["layers"]:
            self._packer.close()  # the previous group (the embeddings, or block i - 1)
            args, codes = [self._packer.add(lay["ln_1"][0]), self._packer.add(lay["ln_1"][1])], []
            for j, lin in enumerate(lay["linears"]):
                pieces, code = self._linear(lin)
                args += pieces
                codes.append(code)
                if j == 1:
                    args += [self._packer.add(lay["ln_2"][0]), self._packer.add(lay["ln_2"][1])]
            self.layer_args.append(args)
            self.layer_attrs.append((lay["heads"], [lin["bits"] for lin in lay["linears"]],
                                     [float(lin["act"]) for lin in lay["linears"]], codes))
        self.ln_f = (self._packer.add(weights["ln_f"][0]), self._packer.add(weights["ln_f"][1]))
        head = weights["head"](self.wte_bits)
        if head["tied"]:
            self.head_w, self.head_s, self.head_code = self.wte, self.wte_s, self.wte_code
        else:
            self.head_w, self.head_s, self.head_code = self._packer.add_weight(
                head["w"], head["s"], head["bits"], float(head["act"]), self._none, self._group)
            if ids is not None:
                draft_rows = (head["w"][ids], None if head["s"] is None else head["s"][ids])
        self.head_bits, self.head_act = head["bits"], float(head["act"])
        # The op's pieces (gptc_decoder_stack.h): the fixed eight, then each block's 16, then the
        # draft vocabulary's three (its head rows as the head stores them, its ids).
        pieces = [self.wte, self.wte_s, self.wpe, self.wpe_s, *self.ln_f, self.head_w, self.head_s]
        pieces += [w for args in self.layer_args for w in args]
        self.draft_vocab = 0 if ids is None else len(ids)
        if ids is not None:
            dw, ds, code = self._packer.add_weight(draft_rows[0], draft_rows[1], self.head_bits, self.head_act,
                                                   self._none, self._group)
            if code != self.head_code:
                raise ExportError("the draft vocabulary's head rows are stored unlike the head's")
            pieces += [dw, ds, self._packer.add(ids.astype(np.float32))]
        self.layout = self._packer.layout_of(pieces)
        self._packer.close()
        self.blobs = []
        for i, blob in enumerate(self._packer.blobs):
            self.register_buffer(f"weights_{i}", blob, persistable=True)
            self.blobs.append(getattr(self, f"weights_{i}"))
        self._packer = None

    def _table(self, spec: dict, act: float):
        w, s, code = self._packer.add_weight(spec["w"], spec["s"], spec["bits"], act, self._none, self._group)
        return w, s, spec["bits"], code

    def _linear(self, spec: dict) -> tuple:
        w, s, code = self._packer.add_weight(spec["w"], spec["s"], spec["bits"], float(spec["act"]), self._none,
                                             self._group)
        b = spec["b"] if spec["b"] is not None else np.zeros([spec["w"].shape[0]], np.float32)
        return [w, s, self._packer.add(b)], code

    def forward(self, input_ids, attention_mask, rows, caches, control=None):
        """ids (B,T), mask (B,S+T), rows (n,), caches [k_0, v_0, ...] (B,H_i,cap,D) -> logits (n,V)
        (and their argmax with ``tokens``); the caches are written in place. ``control`` (None:
        one step): int64 [steps, eos (-1: none), pad, steps without eos, finished per row]."""
        attrs = (self.blobs, self.layout, self.wte_code, self.wpe_bits, [a[0] for a in self.layer_attrs],
                 self.eps, self.activation, [c for a in self.layer_attrs for c in a[3]],
                 [x for a in self.layer_attrs for x in a[2]], self.head_code, self.head_act)
        if control is None:
            from ..kernels import control as make_control

            control = paddle.to_tensor(make_control(input_ids.shape[0]))
        out = self.ops.gptc_generate(input_ids, attention_mask, rows, control, list(caches), *attrs)
        return (out[0], out[1]) if self.tokens else out[0]


CACHE_DTYPES = ("float32", "bfloat16")  # the fused programs' KV cache elements (gptc_decoder_ops.h)


def input_spec(cfg, control: bool = True, cache_dtype: str = "float32") -> list:
    """The saved program's inputs: ids, mask, rows, the caches (a list, of ``cache_dtype``) and
    ``control`` (not in the tensor-parallel rank programs, which run one step a call: ``fused_tp.py``)."""
    caches = []
    for i in range(cfg.num_layers):
        for kind in ("key", "value"):
            caches.append(InputSpec([None, cfg.heads(i), None, cfg.dim_head], cache_dtype, f"cache_{kind}_{i}"))
    return [InputSpec([None, None], "int64", "input_ids"), InputSpec([None, None], "int64", "attention_mask"),
            InputSpec([None], "int64", "rows"), caches] + ([InputSpec([None], "int64", "control")] if control else [])


def count_ops(program_json: str) -> dict[str, int]:
    """Operations of a saved PIR program by name (parameters counted as "parameter"), e.g.
    ``{"custom_op.gptc_generate_": 1, "pd_op.data": 8, ...}``."""
    import json
    from collections import Counter

    with open(program_json, encoding="utf-8") as f:
        ops = json.load(f)["program"]["regions"][0]["blocks"][0]["ops"]
    dialects = {"0": "builtin", "1": "pd_op", "3": "custom_op"}
    names = Counter()
    for op in ops:
        name = op["#"]
        if name == "p":
            names["parameter"] += 1
            continue
        dialect, _, rest = name.partition(".")
        names[f"{dialects.get(dialect, dialect)}.{rest}" if rest else name] += 1
    return dict(names)


def save_program(layer, spec: list, out_dir: str) -> None:
    """``layer`` traced with ``spec`` (``to_static``) and saved as ``out_dir``'s ``fused.json`` +
    ``fused.pdiparams`` (through a scratch directory: never half a program under those names)."""
    static = paddle.jit.to_static(layer, input_spec=spec, full_graph=True)
    scratch = tempfile.mkdtemp(prefix=".fused-", dir=out_dir)
    try:
        paddle.jit.save(static, os.path.join(scratch, "fused"))
        for src, dst in (("fused.json", FUSED_MODEL), ("fused.pdiparams", FUSED_PARAMS)):
            if not os.path.isfile(os.path.join(scratch, src)):
                raise ExportError(f"paddle.jit.save did not write {src} for the fused program")
            os.replace(os.path.join(scratch, src), os.path.join(out_dir, dst))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def check_cache_dtype(cache_dtype: str) -> str:
    if cache_dtype not in CACHE_DTYPES:
        raise ExportError(f"the KV cache dtype must be one of {', '.join(CACHE_DTYPES)}, got {cache_dtype!r}")
    return cache_dtype


def save_fused(model, out_dir: str, draft_vocab: Optional[np.ndarray] = None, cache_dtype: str = "float32") -> dict:
    """Write ``fused.json`` + ``fused.pdiparams`` for float or fake-quant ``model`` into ``out_dir``
    (``model`` is not mutated) in the current kernel version, with ``draft_vocab`` (``FusedLM``)
    if given, its KV caches of ``cache_dtype`` (``CACHE_DTYPES``: bfloat16 halves the cache's
    memory and the bytes a decode step reads from it). Returns the manifest's ``fused`` entry.
    Raises ``KernelError`` when the operators cannot be built, ``ExportError`` for a model with
    no fused form."""
    from ..kernels import kernel_info

    cfg = model.config
    check_cache_dtype(cache_dtype)
    layer = FusedLM(fused_weights(model), tokens=True, draft_vocab=draft_vocab)
    layer.eval()
    save_program(layer, input_spec(cfg, cache_dtype=cache_dtype), out_dir)
    return {"model": FUSED_MODEL, "params": FUSED_PARAMS, "kernel": kernel_info(),
            "ops": count_ops(os.path.join(out_dir, FUSED_MODEL)),
            "weights": {"linear_bits": sorted({b for a in layer.layer_attrs for b in a[1]}),
                        "head_bits": layer.head_bits},
            "outputs": ["logits", "tokens"],
            "inputs": ["input_ids", "attention_mask", "rows"]
                      + [f"cache_{k}_{i}" for i in range(cfg.num_layers) for k in ("key", "value")] + ["control"],
            "cache": f"(batch, heads_i, capacity, head_dim) {cache_dtype}, preallocated by the caller, written in place",
            "cache_dtype": cache_dtype,
            **({"draft_vocab": layer.draft_vocab} if layer.draft_vocab else {})}


def try_save_fused(model, out_dir: str, draft_vocab: Optional[np.ndarray] = None,
                   cache_dtype: str = "float32") -> Optional[dict]:
    """``save_fused``, or None with a warning when the operators cannot be built here (the
    unfused programs are exported regardless and run everywhere)."""
    try:
        return save_fused(model, out_dir, draft_vocab, cache_dtype)
    except KernelError as e:
        warnings.warn(f"no fused program exported: {e}", stacklevel=2)
        return None
