"""The fused program of one tensor-parallel rank (``gptc partition``): ``rank_{r}/fused.json`` +
``fused.pdiparams``, our CPU operators (``kernels/gptc_tp_ops.h``) with Paddle's model-parallel
all-reduce between them::

    fused(input_ids (B,T), attention_mask (B,S+T), rows (n,), cache_key_0, cache_value_0, ...)
        -> logits (n, V / mp): this rank's vocabulary slice at the flat rows ``rows``

    x = all_reduce(gptc_tp_embed(ids))            # this rank's token rows (+ positions on rank 0)
    per block: x = all_reduce(gptc_tp_attention(x))  # the rank's heads; attn.out partial sums
               x = all_reduce(gptc_tp_mlp(x))        # the rank's FFN channels; fc_out partial sums
    logits = gptc_tp_head(x, rows)                # the rank's vocabulary rows

The inputs and the in-place caches ``(B, H_i / mp, capacity, D)`` are the single-card fused
program's (``export/fused.py``), so ``inference/fused.py``'s ``FusedBackend`` runs a rank program
unchanged; the runner (``inference/tensor_parallel.py``) gathers the logits' slices.

Why Paddle's ``mp_allreduce_sum`` ops in the program: a Paddle Inference predictor on CPU runs
them over gloo once the process called ``fleet.init`` (the unfused rank programs rely on it),
so one ``Predictor.run`` is a whole step. The alternatives cost more: the runner all-reducing
between per-half programs pays a predictor run and a Python round trip per half-block; an op
calling a collective itself would need Paddle's communicator from C++, which the custom-op API
(``paddle/extension.h``) does not expose.

Weights are the single-card fused program's (``fused.fused_weights``: float32, weight-only
int8/int4, W8A8) cut as ``parallel.plan.TP_PLAN`` cuts the model: ``attn.qkv`` and ``mlp.fc_in``
by output rows (whole heads: QKV is head-major), ``attn.out`` and ``mlp.fc_out`` by input
columns (integer codes by whole blocks of their scales, so each block's int8 dot and input scale
stay the single-card ones; their bias on rank 0 only), the embedding and the head by vocabulary
rows. Only the order in which partial sums are added differs from the single-card program.
"""
from __future__ import annotations

import os

import numpy as np
import paddle
import paddle.nn as nn

from ..errors import ExportError
from .fused import (FUSED_MODEL, FUSED_PARAMS, LINEARS, WeightPacker, check_cache_dtype, count_ops, fused_weights,
                    input_spec, save_program)

ROW_PARALLEL = ("attn.out", "mlp.fc_out")


def _rows(a, rank: int, mp: int):
    n = a.shape[0] // mp
    return np.ascontiguousarray(a[rank * n:(rank + 1) * n])


def _column_split(spec: dict, rank: int, mp: int) -> dict:
    """A row-parallel Linear's inputs ``[rank * K/mp, (rank+1) * K/mp)``; its bias on rank 0 only."""
    w, s, bits = spec["w"], spec["s"], spec["bits"]
    k = w.shape[1] * (2 if bits == 4 else 1)
    kl = k // mp
    if bits == 4 and kl % 32:
        raise ExportError(f"{spec['name']}: int4 weights need {mp} slices of a multiple of 32 inputs, not {kl}")
    cols = slice(rank * kl // (2 if bits == 4 else 1), (rank + 1) * kl // (2 if bits == 4 else 1))
    out = {**spec, "w": np.ascontiguousarray(w[:, cols])}
    if s is not None and s.shape[1] > 1:  # block scales: the rank's inputs must be whole blocks
        blk = k // s.shape[1]
        if kl % blk:
            raise ExportError(f"{spec['name']}: {mp} ranks would cut its blocks of {blk} inputs ({kl} a rank)")
        out["s"] = np.ascontiguousarray(s[:, rank * (kl // blk):(rank + 1) * (kl // blk)])
    b = spec["b"] if spec["b"] is not None else np.zeros([w.shape[0]], np.float32)
    out["b"] = b if rank == 0 else np.zeros_like(b)
    return out


def _row_split(spec: dict, rank: int, mp: int) -> dict:
    """A column-parallel Linear's (or a table's) output rows of this rank."""
    out = {**spec, "w": _rows(spec["w"], rank, mp)}
    if spec.get("s") is not None:
        out["s"] = _rows(spec["s"], rank, mp)
    if spec.get("b") is not None:
        out["b"] = _rows(spec["b"], rank, mp)
    return out


class FusedRankLM(nn.Layer):
    """Rank ``rank`` of ``mp``'s fused program as a Layer (see the module docstring); ``ring_id``:
    the model-parallel group's id (``parallel.fleet.mp_group().id``), traced into the all-reduces."""

    def __init__(self, weights: dict, rank: int, mp: int, ring_id: int, ops=None):
        super().__init__()
        from ..kernels import load_ops

        self.ops = ops or load_ops()
        cfg = weights["config"]
        self.cfg, self.rank, self.mp, self.ring_id = cfg, rank, mp, ring_id
        self.eps, self.activation = weights["eps"], weights["activation"]
        self.vocab, self.vocab_start = cfg.vocab_size, rank * cfg.vocab_size // mp
        packer = WeightPacker()
        wte, wpe = _row_split(weights["wte"](), rank, mp), weights["wpe"]()
        head = weights["head"](wte["bits"])
        tied = head["tied"]
        head = {**wte, "act": head["act"]} if tied else _row_split(head, rank, mp)
        none = packer.add(np.zeros([1], np.float32))

        def table(spec, act):  # (pieces, the op's format code): a tied head's table as the head reads it
            w, s, code = packer.add_weight(spec["w"], spec.get("s"), spec["bits"], act, none)
            return [w, s], code

        wte_pieces, self.wte_code = table(wte, float(head["act"]) if tied else -1.0)
        wpe_pieces, _ = table(wpe, -1.0)
        embed = wte_pieces + wpe_pieces
        ln_f = [packer.add(weights["ln_f"][0]), packer.add(weights["ln_f"][1])]
        if tied:  # the embedding's rows
            head_pieces, self.head_code = embed[:2], self.wte_code
        else:
            head_pieces, self.head_code = table(head, float(head["act"]))
        self.embed_layout, self.head_layout = packer.layout_of(embed), packer.layout_of(ln_f + head_pieces)
        self.wte_bits, self.wpe_bits, self.head_bits, self.head_act = wte["bits"], wpe["bits"], head["bits"], float(head["act"])
        packer.close()
        self.block_layouts, self.block_attrs = [], []
        for i, lay in enumerate(weights["layers"]):
            lins = [(_column_split if name in ROW_PARALLEL else _row_split)(spec, rank, mp)
                    for name, spec in zip(LINEARS, lay["linears"])]
            pieces, codes = [packer.add(lay["ln_1"][0]), packer.add(lay["ln_1"][1])], []
            none = packer.add(np.zeros([1], np.float32))
            for j, lin in enumerate(lins):
                w, s, code = packer.add_weight(lin["w"], lin["s"], lin["bits"], float(lin["act"]), none)
                codes.append(code)
                pieces += [w, s, packer.add(lin["b"] if lin["b"] is not None else np.zeros([lin["w"].shape[0]], np.float32))]
                if j == 1:
                    pieces += [packer.add(lay["ln_2"][0]), packer.add(lay["ln_2"][1])]
            # Each block's pieces live in its own blob pair: the layout's blob numbers count from 0.
            first = len(packer.blobs)
            layout = packer.layout_of(pieces)
            layout = [x - first if k % 4 == 0 else x for k, x in enumerate(layout)]
            packer.close()
            self.block_layouts.append(layout)
            self.block_attrs.append((lay["heads"] // mp, [lin["bits"] for lin in lins],
                                     [float(lin["act"]) for lin in lins], codes))
        self.blobs = []
        for i, blob in enumerate(packer.blobs):
            self.register_buffer(f"weights_{i}", blob, persistable=True)
            self.blobs.append(getattr(self, f"weights_{i}"))

    def _all_reduce(self, x):
        return paddle._C_ops.mp_allreduce_sum(x, self.ring_id)

    def forward(self, input_ids, attention_mask, rows, caches):
        """ids (B,T), mask (B,S+T), rows (n,), caches [k_0, v_0, ...] (B,H_i/mp,cap,D) -> this
        rank's logits (n, V/mp); the caches are written in place."""
        outer = self.blobs[:2]
        first = self.rank == 0
        x = self.ops.gptc_tp_embed(input_ids, attention_mask, outer, self.embed_layout, self.wte_code,
                                   self.wpe_bits, self.vocab_start, self.vocab, int(first))
        x = self._all_reduce(x)
        for i, (layout, (heads, _, act, codes)) in enumerate(zip(self.block_layouts, self.block_attrs)):
            blobs = self.blobs[2 + 2 * i:4 + 2 * i]
            out = self.ops.gptc_tp_attention(x, attention_mask, [caches[2 * i], caches[2 * i + 1]], blobs, layout,
                                             heads, self.eps, codes, act, int(first))
            x = self._all_reduce(out[0] if isinstance(out, (list, tuple)) else out)
            x = self._all_reduce(self.ops.gptc_tp_mlp(x, attention_mask, blobs, layout, heads, self.cfg.dim_head,
                                                      self.eps, self.activation, codes, act, int(first)))
        return self.ops.gptc_tp_head(x, rows, outer, self.head_layout, self.eps, self.head_code, self.head_act)


def save_fused_rank(layer: FusedRankLM, out_dir: str, cache_dtype: str = "float32") -> dict:
    """Write ``layer``'s program (``fused.json`` + ``fused.pdiparams``) into ``out_dir``, its KV
    caches of ``cache_dtype`` (``fused.CACHE_DTYPES``); returns the rank manifest's ``fused``
    entry. Runs in a launched rank process after ``fleet.init``."""
    from ..kernels import KERNEL_VERSION, kernel_info
    from ..parallel.plan import rank_config

    layer.eval()
    rcfg = rank_config(layer.cfg, layer.mp)
    save_program(layer, input_spec(rcfg, control=False, cache_dtype=check_cache_dtype(cache_dtype)), out_dir)
    return {"model": FUSED_MODEL, "params": FUSED_PARAMS, "kernel": {**kernel_info(), "version": KERNEL_VERSION},
            "ops": count_ops(os.path.join(out_dir, FUSED_MODEL)),
            "weights": {"linear_bits": sorted({b for a in layer.block_attrs for b in a[1]}),
                        "head_bits": layer.head_bits},
            "outputs": ["logits"],
            "tensor_parallel": {"rank": layer.rank, "mp_degree": layer.mp, "vocab_start": layer.vocab_start},
            "inputs": ["input_ids", "attention_mask", "rows"]
                      + [f"cache_{k}_{i}" for i in range(rcfg.num_layers) for k in ("key", "value")],
            "cache": f"(batch, heads_i / mp_degree, capacity, head_dim) {cache_dtype}, preallocated by the caller, "
                     "written in place",
            "cache_dtype": cache_dtype}
