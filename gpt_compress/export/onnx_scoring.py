"""onnxruntime's form of the ``score_head`` program: one ``LogSoftmax`` instead of the converted
log-sum-exp.

``model.gpt.label_logprobs`` (the Paddle program) takes the row maximum, subtracts it, and sums
the exponentials in float32 blocks and float64 block totals: Paddle's CPU ``log_softmax``
kernel took 40 s on 24 x 50,304 logits, this 0.1 s. Converted to ONNX, the broadcast subtract
alone cost a third of the head's matmul in onnxruntime, whose ``LogSoftmax`` does max, exp-sum
and shift in vectorised passes: on 512 x 50,304 rows (hidden 128, 2 shared cores) the head ran
in ~0.33 s instead of ~0.40 s, within 2e-7 of the float64 numpy reference
(``eval.scoring.label_logprobs``). So the converted graph keeps its head (the matmul, or the
int8 export's ``MatMulNBits``) and its argmax, and ``fuse_log_softmax`` replaces the rest:
``log p(label) = Cast<double>(GatherElements(LogSoftmax(logits), labels))``. Export validation
compares the result with the dygraph model as for every program.
"""
from __future__ import annotations

import numpy as np

from ..errors import ExportError

LABELS = "labels"


def fuse_log_softmax(model) -> None:
    """Rewrite ONNX ``score_head`` ``model`` in place (see the module docstring)."""
    from onnx import TensorProto, helper, numpy_helper

    g = model.graph
    argmax = [n for n in g.node if n.op_type == "ArgMax"]
    if len(argmax) != 1 or len(g.output) != 2 or LABELS not in {i.name for i in g.input}:
        raise ExportError(f"score_head: expected one ArgMax, two outputs and a {LABELS!r} input in the converted "
                          "graph; the scoring program's layout changed")
    logits, logprob = argmax[0].input[0], g.output[0].name
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 17)
    axis = "gptc.axis1"
    if opset >= 13:  # Unsqueeze/Squeeze take their axes as an input
        g.initializer.append(numpy_helper.from_array(np.array([1], np.int64), axis))
        unsqueeze = helper.make_node("Unsqueeze", [LABELS, axis], ["gptc.labels2"])
        squeeze = helper.make_node("Squeeze", ["gptc.picked2", axis], ["gptc.picked"])
    else:
        unsqueeze = helper.make_node("Unsqueeze", [LABELS], ["gptc.labels2"], axes=[1])
        squeeze = helper.make_node("Squeeze", ["gptc.picked2"], ["gptc.picked"], axes=[1])
    tail = [helper.make_node("LogSoftmax", [logits], ["gptc.logp"], axis=-1), unsqueeze,
            helper.make_node("GatherElements", ["gptc.logp", "gptc.labels2"], ["gptc.picked2"], axis=1),
            squeeze, helper.make_node("Cast", ["gptc.picked"], [logprob], to=TensorProto.DOUBLE)]
    nodes = [n for n in g.node if logprob not in n.output] + tail  # still in topological order
    needed, kept = {o.name for o in g.output}, []
    for n in reversed(nodes):  # keep what the outputs depend on
        if any(o in needed for o in n.output):
            kept.append(n)
            needed.update(i for i in n.input if i)
    del g.node[:]
    g.node.extend(reversed(kept))
    for t in [t for t in g.initializer if t.name not in needed]:
        g.initializer.remove(t)


def scoring_transform(name: str, model, base_dir: str = "") -> None:
    """``onnx.convert_programs``' ``transform`` for float exports: ``fuse_log_softmax`` on
    ``score_head``, every other program unchanged."""
    if name == "score_head":
        fuse_log_softmax(model)
