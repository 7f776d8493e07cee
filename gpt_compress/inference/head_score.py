"""The LM head's scoring in one pass for Paddle Inference exports: ``gptc_head_score``.

Evaluation's head (``score_head``: logits at the scored rows, then log p(label) and argmax) runs
in Paddle's plain CPU kernels at ~4-6 GFLOP/s on gpt-test with vocab 50,304 (its matmul and a
float32 exp over every logit): ~90% of a WikiText evaluation. The custom operator
``gptc_head_score`` (``kernels/gptc_head_score.h``) computes the same two outputs
without materialising the (N, V) logits: packed vocabulary chunks, an AVX2 outer-product tile
and an online log-sum-exp, at onnxruntime's MatMul rate (bench/eval_speed.py).

``head_scorer`` finds the head weight in the ``score_head`` program's parameters (the one float32
(hidden, vocab) tensor) and checks the operator against the program on a probe batch before
using it; an export whose head is anything else (int8, a layout this does not know), or a
machine without a C++ compiler, keeps the program (``None``). The programs share one params
file, which Paddle only loads whole (``load_combine`` refuses a part of it, and ``jit.load``
would hold every weight once more); ``_head_weight`` reads the head alone: it walks the
tensors' headers (``phi::SerializeToStream``: uint32 version, uint64 LoD levels, uint32 version,
int32 size of a ``TensorDesc`` protobuf parsed with Paddle's own class, the data) and reads the
data of the one match. Anything unexpected in the file gives ``None`` (the program), and the
probe would catch a wrong read. The scorer's cost is one copy of the head (0.15 W at gpt-345M).
"""
from __future__ import annotations

import os
import struct
from typing import Optional

import numpy as np

from ..errors import KernelError

PROBE_ROWS = 16
PROBE_RTOL = 1e-5  # the op and the program sum the same logits in different orders (~1e-7 apart)


class HeadScorer:
    """hidden (N, C) float32, labels (N,) -> (log p(label) (N,) float64, argmax (N,) int64)."""

    def __init__(self, ops, weight):
        self._ops, self._weight = ops, weight  # weight: paddle tensor (C, V) float32

    def __call__(self, hidden: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        import paddle

        lp, top = self._ops.gptc_head_score(paddle.to_tensor(np.ascontiguousarray(hidden, dtype=np.float32)),
                                            paddle.to_tensor(np.ascontiguousarray(labels, dtype=np.int64)),
                                            self._weight)
        return lp.numpy(), top.numpy()


def _exact(f, n: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise ValueError(f"{f.name} ends inside a tensor header")
    return data


def _head_weight(params: str, hidden: int, vocab: int) -> Optional[np.ndarray]:
    """The one (hidden, vocab) float32 tensor of the combined params file ``params``, read alone
    (the others are skipped by their headers), or None (none, several, or a header not understood)."""
    from google.protobuf.message import DecodeError
    from paddle.base.proto.framework_pb2 import VarType

    itemsize = {VarType.BOOL: 1, VarType.UINT8: 1, VarType.INT8: 1, VarType.INT16: 2, VarType.FP16: 2,
                VarType.BF16: 2, VarType.INT32: 4, VarType.FP32: 4, VarType.INT64: 8, VarType.FP64: 8,
                VarType.COMPLEX64: 8, VarType.COMPLEX128: 16}
    found = []
    with open(params, "rb") as f:
        end = os.fstat(f.fileno()).st_size
        while f.tell() < end:
            version, lod_levels = struct.unpack("<IQ", _exact(f, 12))
            if version != 0:
                return None
            for _ in range(lod_levels):  # parameters have none
                f.seek(struct.unpack("<Q", _exact(f, 8))[0], os.SEEK_CUR)
            version, desc_size = struct.unpack("<Ii", _exact(f, 8))
            desc = VarType.TensorDesc()
            try:
                desc.ParseFromString(_exact(f, desc_size))
            except DecodeError:
                return None
            if version != 0 or desc.data_type not in itemsize:
                return None
            if desc.data_type == VarType.FP32 and list(desc.dims) == [hidden, vocab]:
                found.append(f.tell())
            f.seek(int(np.prod(desc.dims, dtype=np.int64)) * itemsize[desc.data_type], os.SEEK_CUR)
        if f.tell() != end or len(found) != 1:
            return None
    return np.fromfile(params, np.float32, count=hidden * vocab, offset=found[0]).reshape(hidden, vocab)


def head_scorer(files: dict, hidden: int, vocab: int, program) -> Optional[HeadScorer]:
    """A ``HeadScorer`` for the ``score_head`` program in ``files`` ({"model", "params"}), or
    None when it cannot stand in for it. ``program(hidden, labels)`` runs the program (the probe's
    reference)."""
    try:
        from ..kernels import load_ops

        ops = load_ops()
        weight = _head_weight(files["params"], hidden, vocab)
    except (KernelError, OSError, ValueError, RuntimeError):
        return None
    if weight is None:
        return None
    import paddle

    scorer = HeadScorer(ops, paddle.to_tensor(weight))
    rng = np.random.default_rng(0)
    probe = rng.standard_normal((PROBE_ROWS, hidden)).astype(np.float32)
    labels = rng.integers(0, vocab, PROBE_ROWS)
    ref_lp, ref_top = program(probe, labels)
    lp, top = scorer(probe, labels)
    logits = np.sort(probe @ weight, axis=-1)
    clear = logits[:, -1] - logits[:, -2] > 1e-4 * (1 + np.abs(logits[:, -1]))  # argmax not a near-tie
    if not (np.allclose(lp, ref_lp, rtol=PROBE_RTOL, atol=0) and (top == ref_top)[clear].all()):
        return None
    return scorer
