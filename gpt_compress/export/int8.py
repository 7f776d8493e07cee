"""Fake-quant model -> int8 programs for Paddle Inference and onnxruntime.

A leaf of the exporter: ``save_int8_programs`` writes the programs, ``quant_info`` the manifest's
additions; ``export/api.py`` chooses this path for a model with quantized layers and builds the
directory (the layout and manifest of a float export: same programs, names and cache shapes), so
``Generator.from_dir(path, backend="paddle"|"onnx")``, ``gptc eval`` and ``gptc infer`` run it
unchanged; the manifest adds ``weight_dtype`` and a ``quant`` entry.

* **Paddle Inference** (``model.pdiparams``): ``qat/deploy.deploy_model`` -- int8 weight buffers
  with float32 scales, dequantized in the graph; W8A8 inputs fake-quantized with round/clip.
  Float32 compute, int8 storage, the fake-quant model's numbers.
* **onnxruntime** (``model.onnx.data``): a float model holding the dequantized weights goes
  through the normal ONNX export; then every quantized weight is found in each graph *by its
  exact bytes* and rewritten:

  - W8A8 ``MatMul(x, W)`` -> ``MatMul(DQ(Q(x, s_x, 128)), DQ(W_code + 128, s_w, 128, axis=1))``:
    the QDQ form onnxruntime fuses into integer kernels (uint8 activations, per-channel weights
    stored as uint8 with zero point 128 so the u8u8 kernel runs: exact on AVX2 without VNNI,
    where the u8s8 one saturates; see ``W8A8_WEIGHT_ZERO_POINT``);
  - weight-only ``MatMul(x, W)`` (block Linears, the LM head) -> ``com.microsoft.MatMulNBits``
    (4 or 8 bits, blocks along K), the decode-path kernel that reads 1/4 (1/8) of the bytes;
  - the tied embedding lookup ``Gather(W^T, ids, axis=1)`` -> ``com.microsoft.GatherBlockQuantized``
    on the same uint8 bytes as the head's MatMulNBits (stored once: ``externalize`` dedups).

  A quantized layer that cannot be found in a graph is an error, never a silent float layer
  (the scoring programs split the model into body and head: there, the two together must hold
  every quantized layer).

Every export is validated: prefill, decode and scoring logits of each backend against the
fake-quant dygraph model, within ``atol`` relative to the logits' magnitude.
"""
from __future__ import annotations

import gc
import os
import shutil
import tempfile
from collections import Counter
from typing import Optional, Sequence

import numpy as np
import paddle.nn as nn

from ..errors import ExportError
from ..inference.manifest import SCORE_PROGRAMS, io_spec
from ..config import W8A8, WEIGHT_ONLY
from ..qat.deploy import Int8TransposedEmbedding, deploy_model, fake_quant_float_model, weight_digest
from .onnx import convert_programs, lazy_source
from .onnx_scoring import scoring_transform
from .static import ExportableLM, free_parameters, program_weights, save_paddle_programs

ORT_DOMAIN = "com.microsoft"
# W8A8 weights are stored as uint8 with zero point 128, so onnxruntime runs its u8u8 integer GEMM.
# Its u8s8 GEMM (int8 weights) is inexact on x86 CPUs without VNNI (AVX2-only, e.g. AMD EPYC Zen 2/3,
# or AVX-512 without VNNI): vpmaddubsw adds pairs of u8*s8 products into int16 with saturation, so a
# pair above 32767 (255 * 127 * 2 = 64770 is possible) is clipped -- logits off by 0.2-0.3 where the
# fake-quant math agrees to 1e-5. u8u8 widens both operands to int16 before vpmaddwd (int32 sums):
# exact on every x86 kernel (AVX2, AVX-512, VNNI) and on ARM. Same codes, same numbers; measured in
# tests/test_quant.py::test_w8a8_qdq_matmul_is_exact. The price: on VNNI CPUs u8s8 would be faster.
W8A8_WEIGHT_ZERO_POINT = 128
W8A8_ATOL = 2e-3  # fake-quant dygraph vs int8 backends, x max(1, max |logit|): see tests/test_quant.py
VALIDATION_HINT = ("An int8 model may legitimately differ where an input lands on a rounding boundary and "
                   "float32 summation order (which differs between runtimes) tips it to the other code; an "
                   "untrained (random-init) model amplifies that to its quantization error. Skip this check "
                   "with --no-validate (validate=False) only for such models.")


class _Int8ExportableLM(ExportableLM):
    """``ExportableLM`` for a deploy model whose tied embedding is already the int8 transposed
    table (``qat.deploy.Int8TransposedEmbedding``): keep it instead of wrapping it again."""

    def __init__(self, model):
        nn.Layer.__init__(self)
        self.model = model
        self.tied = model.config.tie_word_embeddings


# --------------------------------------------------------------------------------------
# ONNX rewriting
# --------------------------------------------------------------------------------------
def nbits_blob(codes_nk: np.ndarray, bits: int, block: int) -> np.ndarray:
    """Signed codes (N, K) -> MatMulNBits' uint8 (N, K/block, block*bits/8): code + 2^(bits-1)
    (the default zero point), 4-bit values packed two per byte, low nibble first."""
    n, k = codes_nk.shape
    u = (codes_nk.astype(np.int16) + 2 ** (bits - 1)).astype(np.uint8).reshape(n, k // block, block)
    if bits == 8:
        return u
    if bits == 4:
        return (u[..., 0::2] | (u[..., 1::2] << 4)).astype(np.uint8)
    raise ExportError(f"weight-only export supports 4 or 8 bits, not {bits}")


def _nk(entry: dict) -> tuple[np.ndarray, np.ndarray]:
    """(codes (N, K), scales (N, K/b)) of a weight-only entry, in MatMulNBits' orientation."""
    codes, scale = entry["codes"], entry["scale"]
    if entry["kind"] == "embedding":  # (V, H/b, b), (V, H/b, 1): rows are the head's outputs
        v = codes.shape[0]
        return codes.reshape(v, -1), scale.reshape(v, -1)
    kb, b, n = codes.shape  # Linear (K/b, b, N), (K/b, 1, N)
    return codes.reshape(kb * b, n).T, scale.reshape(kb, n).T


class _Rewriter:
    """Rewrites one ONNX graph; new initializers are named after the layer."""

    def __init__(self, model, table: list[dict], base_dir: str = "", weights=None):
        from onnx import numpy_helper

        self.model, self.graph = model, model.graph

        def to_array(t):
            source = lazy_source(t)
            return numpy_helper.to_array(t, base_dir) if source is None else weights(source)

        self.to_array = to_array
        self.from_array = numpy_helper.from_array
        self.inits = {t.name: t for t in self.graph.initializer}
        self.index: dict[str, tuple[dict, str]] = {}
        for e in table:
            for how, h in e["digests"].items():
                if h in self.index and self.index[h][0]["name"] != e["name"]:
                    raise ExportError(f"{e['name']} and {self.index[h][0]['name']} have identical weights; "
                                      "their quantized copies cannot be told apart in the ONNX graph")
                self.index[h] = (e, how)
        self._digests: dict[str, Optional[str]] = {}
        self.uses: Counter = Counter()
        self.ops: Counter = Counter()

    def _lookup(self, name: str):
        t = self.inits.get(name)
        if t is None:
            return None
        if name not in self._digests:
            self._digests[name] = weight_digest(self.to_array(t)) if t.data_type == 1 else None  # FLOAT
        return self.index.get(self._digests[name])

    def _const(self, name: str, array: np.ndarray) -> str:
        self.graph.initializer.append(self.from_array(np.ascontiguousarray(array), name))
        return name

    def _qdq_matmul(self, node, e, p):
        from onnx import helper

        if e["act_bits"] != 8:
            raise ExportError(f"{e['name']}: W8A8 export needs 8-bit activations (Quant.activation_bits="
                              f"{e['act_bits']} is for analysis only)")
        n = e["codes"].shape[1]
        sx = self._const(p + "x_scale", np.asarray(e["act_scale"], np.float32))
        zx = self._const(p + "x_zero_point", np.asarray(128, np.uint8))
        # uint8 weights (code + 128, zero point 128), not int8: see W8A8_WEIGHT_ZERO_POINT.
        wq = self._const(p + "weight_uint8", (e["codes"].astype(np.int16) + W8A8_WEIGHT_ZERO_POINT).astype(np.uint8))
        sw = self._const(p + "weight_scale", e["scale"].reshape(n).astype(np.float32))
        zw = self._const(p + "weight_zero_point", np.full(n, W8A8_WEIGHT_ZERO_POINT, np.uint8))
        self.ops["QDQ MatMul"] += 1
        return [helper.make_node("QuantizeLinear", [node.input[0], sx, zx], [p + "x_q"]),
                helper.make_node("DequantizeLinear", [p + "x_q", sx, zx], [p + "x_dq"]),
                helper.make_node("DequantizeLinear", [wq, sw, zw], [p + "w_dq"], axis=1),
                helper.make_node("MatMul", [p + "x_dq", p + "w_dq"], [node.output[0]], name=node.name)]

    def _matmul_nbits(self, node, e, p):
        from onnx import helper

        codes, scales = _nk(e)
        n, k = codes.shape
        b = self._const(p + "B", nbits_blob(codes, e["bits"], e["block"]))
        s = self._const(p + "scales", scales.reshape(-1).astype(np.float32))
        self.ops["MatMulNBits"] += 1
        return [helper.make_node("MatMulNBits", [node.input[0], b, s], [node.output[0]], name=node.name,
                                 domain=ORT_DOMAIN, K=k, N=n, bits=e["bits"], block_size=e["block"],
                                 accuracy_level=4 if e["dynamic_inputs"] else 0)]

    def _gather(self, node, e, p, transposed: bool):
        from onnx import helper

        codes, scales = _nk(e)
        v, h = codes.shape
        data = self._const(p + "B", nbits_blob(codes, e["bits"], e["block"]).reshape(v, -1))  # = the head's bytes
        s = self._const(p + "scales", scales.astype(np.float32))
        nb = scales.shape[1]
        zp = np.full((v, nb), 2 ** (e["bits"] - 1), np.uint8)
        if e["bits"] == 4:  # zero points packed like the data, low nibble first
            zp = np.pad(zp, ((0, 0), (0, nb % 2)))
            zp = (zp[:, 0::2] | (zp[:, 1::2] << 4)).astype(np.uint8)
        z = self._const(p + "zero_points", zp)
        out = p + "rows" if transposed else node.output[0]
        self.ops["GatherBlockQuantized"] += 1
        nodes = [helper.make_node("GatherBlockQuantized", [data, node.input[1], s, z], [out], domain=ORT_DOMAIN,
                                  gather_axis=0, quantize_axis=1, block_size=e["block"], bits=e["bits"])]
        if transposed:  # the export looks columns up in the (H, V) table: (H, n)
            nodes.append(helper.make_node("Transpose", [out], [node.output[0]], perm=[1, 0]))
        return nodes

    def run(self) -> None:
        new = []
        for node in self.graph.node:
            hit = None
            if node.op_type == "MatMul":
                hit = self._lookup(node.input[1])
            elif node.op_type == "Gather":
                hit = self._lookup(node.input[0])
            elif node.op_type == "Gemm" and any(self._lookup(i) for i in node.input[1:2]):
                raise ExportError(f"ONNX node {node.name} is a Gemm on a quantized weight; only MatMul is rewritten")
            if hit is None:
                new.append(node)
                continue
            e, how = hit
            p = f"quant.{e['name']}.{self.uses[e['name']]}."
            self.uses[e["name"]] += 1
            if node.op_type == "Gather":
                axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
                if (how, axis) not in (("t", 1), ("rows", 0)):
                    raise ExportError(f"{e['name']}: unexpected lookup Gather(axis={axis}) of its {how} table")
                new += self._gather(node, e, p, transposed=how == "t")
            elif how == "matmul" and e["mode"] == W8A8:
                new += self._qdq_matmul(node, e, p)
            elif e["mode"] == WEIGHT_ONLY and how in ("matmul", "t"):
                new += self._matmul_nbits(node, e, p)
            else:
                raise ExportError(f"{e['name']}: no int8 form for a MatMul on its {how} weight in mode {e['mode']}")
        del self.graph.node[:]
        self.graph.node.extend(new)
        used = {i for n in self.graph.node for i in n.input} | {o.name for o in self.graph.output}
        for t in [t for t in self.graph.initializer if t.name not in used]:
            self.graph.initializer.remove(t)
        if any(n.domain == ORT_DOMAIN for n in self.graph.node) and \
                not any(o.domain == ORT_DOMAIN for o in self.model.opset_import):
            op = self.model.opset_import.add()
            op.domain, op.version = ORT_DOMAIN, 1


def rewrite_onnx(model, table: list[dict], base_dir: str = "", uses: Optional[Counter] = None,
                 weights=None) -> dict:
    """Rewrite the quantized weights of ONNX ``model`` in place (see the module docstring); raises
    ``ExportError`` naming any quantized layer not found, unless ``uses`` is given: then the
    layers found are added to it (a program holding part of the model). Returns {op: count}.
    ``base_dir``: where external tensors' locations resolve; ``weights``: the values of weights
    attached by reference (``onnx.attach_weights(lazy=True)``)."""
    rw = _Rewriter(model, table, base_dir, weights)
    rw.run()
    if uses is not None:
        uses.update({k: v for k, v in rw.uses.items() if v})
        return dict(rw.ops)
    missing = [e["name"] for e in table if not rw.uses[e["name"]]]
    if missing:
        raise ExportError(f"quantized layer(s) {', '.join(missing)} not found in the ONNX graph "
                          f"{model.graph.name!r}; refusing to export them as float")
    return dict(rw.ops)


def _onnx_programs(qmodel, work: str, out_dir: str, table: list[dict], opset: int, consume: bool = False) -> tuple:
    """Float export of the dequantized weights, rewritten to int8 program by program as it is
    converted (``onnx.convert_programs``' ``transform``), written to ``out_dir``. ``consume``:
    the float model takes ``qmodel``'s weights tensor by tensor (``qmodel`` is unusable after)."""

    cfg = qmodel.config
    pdir = os.path.join(work, "paddle")
    os.makedirs(pdir)
    fmodel = fake_quant_float_model(qmodel, consume=consume)
    wrapper = ExportableLM(fmodel)
    wrapper.shared_params = False  # converted to ONNX only: no float copy of the int8 weights
    pfiles = save_paddle_programs(fmodel, pdir, wrapper=wrapper, split_decode=False, score=True)
    weights = program_weights(fmodel)
    ops, found = {}, Counter()

    def rewrite(name, model, base_dir):
        model.graph.name = name
        # The scoring programs split the model (body / head): each holds part of the quantized
        # layers, together all of them (checked below).
        ops[name] = rewrite_onnx(model, table, base_dir, uses=found if name in SCORE_PROGRAMS else None,
                                 weights=weights)
        scoring_transform(name, model)

    # The weights are attached by reference: the rewrite reads each float weight once for its
    # digest, and only those left float after it are written (none of them held in a graph).
    files = convert_programs(pdir, pfiles, out_dir, io_spec(cfg), opset=opset, tanh_gelu=cfg.hidden_act == "gelu_new",
                             transform=rewrite, weights=weights)
    missing = [e["name"] for e in table if not found[e["name"]]]
    if missing:
        raise ExportError(f"quantized layer(s) {', '.join(missing)} not found in the scoring programs "
                          f"{' + '.join(SCORE_PROGRAMS)}; refusing to export them as float")
    return files, ops


def _scheme(table: list[dict]) -> dict:
    modes = sorted({e["mode"] for e in table})
    bits = sorted({e["bits"] for e in table})
    return {"scheme": "+".join(modes), "weight_bits": bits[0] if len(bits) == 1 else bits,
            "activation_bits": 8 if W8A8 in modes else None,
            "weight_block_size": next((e["block"] for e in table if e["block"]), None),
            "weight_only_inputs": next(("int8 per token and block" if e["dynamic_inputs"] else "float"
                                        for e in table if e["mode"] == WEIGHT_ONLY), None),
            "layers": {e["name"]: e["mode"] for e in table}}


def quant_info(table: list[dict], source: str) -> dict:
    """The manifest's ``quant`` entry (scheme, bits, layers, what each backend runs) and its
    ``weight_dtype``, for quantized layers ``table`` (``qat.deploy.quant_table``)."""
    info = _scheme(table)
    info.update(source_checkpoint=source,
                paddle="int8 weight buffers + float32 scales dequantized in the graph (float32 compute); "
                       "W8A8 inputs fake-quantized with round/clip",
                onnx="W8A8: QuantizeLinear/DequantizeLinear (uint8 inputs, per-channel weights as uint8 codes + 128) "
                     "around MatMul; "
                     "weight-only: com.microsoft MatMulNBits and GatherBlockQuantized")
    bits = info["weight_bits"]
    return {"weight_dtype": f"int{bits}" if isinstance(bits, int) else "int" + "/int".join(map(str, bits)),
            "quant": info}


def save_int8_programs(qmodel, out_dir: str, formats: Sequence[str], table: list[dict], opset: int = 17,
                       free_weights: bool = False) -> tuple:
    """Write the int8 programs of fake-quant ``qmodel`` for ``formats`` into ``out_dir``. Weight-only
    layers with ``dynamic_inputs`` become MatMulNBits with ``accuracy_level=4`` (int8 compute),
    others ``0``. Returns (``{format: {program: {role: file}}}``, ONNX ops per program or None).
    ``free_weights``: release ``qmodel``'s weights as soon as no program needs them (the Paddle
    deploy model holds int8 codes; the ONNX float model takes them over tensor by tensor), so
    that one float copy of the weights is resident at a time; ``qmodel`` is unusable after."""
    files, ops = {}, None
    if "paddle" in formats:
        deploy = deploy_model(qmodel, table)
        if free_weights and "onnx" not in formats:
            free_parameters(qmodel)
        wrapper = _Int8ExportableLM(deploy) if isinstance(deploy.gpt.wte, Int8TransposedEmbedding) else None
        files["paddle"] = save_paddle_programs(deploy, out_dir, wrapper=wrapper, score=True)
        del deploy, wrapper  # before the ONNX path builds its float copy
        gc.collect()
    if "onnx" in formats:
        work = tempfile.mkdtemp(prefix=".onnx-work-", dir=out_dir)
        try:
            files["onnx"], ops = _onnx_programs(qmodel, work, out_dir, table, opset, consume=free_weights)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        gc.collect()
    return files, ops
