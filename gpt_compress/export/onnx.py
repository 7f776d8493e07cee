"""Paddle programs -> ONNX (paddle2onnx, opset 17), weights stored once for all programs.

A leaf of the exporter: ``convert_programs`` turns the programs ``export/static.py`` saved into
``.onnx`` files plus one data file; ``export/api.py`` (float) and ``export/int8.py`` call it.

paddle2onnx is called *without* a ``save_file``: it then returns the model bytes and skips its
post-export optimizer. Its default optimizer path (``optimize_tool="polygraphy"``) sets
``POLYGRAPHY_AUTOINSTALL_DEPS=1``, which pip-installs packages at run time (it once upgraded
numpy under a running venv); ``tests/test_export.py`` checks that nothing gets installed.

What we do to paddle2onnx's output, each step a function below:

* ``constants_to_initializers``: paddle2onnx embeds each weight as a ``Constant`` node in
  every program; large ones become initializers, dead ones are dropped.
* ``rename_io``: graph inputs/outputs get the manifest's names (``logits``, ``present_key_0``,
  ...) and named dynamic dimensions (``batch``, ``seq``, ``past``, ...).
* ``fix_tanh_gelu``: paddle2onnx 2.1 exports ``gelu(approximate=True)`` as the exact erf GELU.
* ``drop_output_identities``: no full copy of the KV cache into each output per step.
* ``split_shared_weights``: the tied embedding gets a second *name* for the LM head so
  onnxruntime pre-packs it (same bytes on disk).
* ``externalize``: all weights go to one ``model.onnx.data``, deduplicated by content across
  the three programs; each ``.onnx`` file keeps only its graph (~60 KB for ``gpt-bench``).

Memory: paddle2onnx converts each program's **graph alone** (no params file) and the
parameters are attached from the model (``attach_weights``; paddle2onnx itself holds ~5 copies
of the weights while converting: 6.9 GB RSS for one gpt-345M program). Programs are converted
**one at a time**; each weight goes to the data file **as it is attached** (``DataFile.write``),
so a graph never holds the weights (the int8 export, whose ``transform`` replaces weights,
attaches them in memory and writes the program's survivors after the rewrite). When paddle2onnx
does read a params file past protobuf's 2 GB limit, it writes the weights to the
``external_file`` we give it; ``tensor_bytes`` reads them back one tensor at a time.
"""
from __future__ import annotations

import contextlib
import gc
import hashlib
import math
import os
import sys
from typing import Callable, Optional

import numpy as np

from ..errors import ExportError
from ..inference.manifest import PROGRAMS, SCORE_PROGRAMS

DATA_FILE = "model.onnx.data"
P2O_DATA_FILE = "paddle2onnx.data"  # where paddle2onnx puts a >2 GB program's weights (scratch)
ALIGN = 4096  # page-aligned offsets let onnxruntime map the data file instead of copying it
MIN_EXTERNAL_BYTES = 1024  # smaller tensors (shapes, scalars) stay inside the graph
# Location prefix of a weight attached by reference (``attach_weights(lazy=True)``): its bytes are
# asked of the ``weights`` function when needed (a digest, the data file), never held in the graph.
LAZY = "gptc-weight:"


def _onnx():
    try:
        import onnx
        import paddle2onnx
    except ImportError as e:
        raise ExportError(f"ONNX export needs paddle2onnx and onnx ({e}); "
                          "install them with `pip install -e .[onnx]`") from None
    return onnx, paddle2onnx


@contextlib.contextmanager
def _stdout_to_stderr():
    """paddle2onnx's C++ core prints progress on file descriptor 1; keep stdout for results
    (``gptc export`` and ``bench/decode.py`` print JSON there)."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def paddle_to_onnx(model_file: str, params_file: str, opset: int = 17, external_file: str = ""):
    """One Paddle program -> an in-memory ``onnx.ModelProto`` (nothing installed, nothing optimized
    beyond paddle2onnx's own C++ passes). ``external_file``: where paddle2onnx writes the weights
    when the model is past 2 GB (then its tensors are external, see ``tensor_bytes``)."""
    onnx, paddle2onnx = _onnx()
    from paddle2onnx.utils import logging as p2o_logging

    level = p2o_logging.log_level
    if not os.path.isfile(params_file):  # on purpose (see convert_program): no "will not contain weights"
        p2o_logging.log_level = 0
    try:
        with _stdout_to_stderr():
            # Without its params file the graph reads undefined weights: paddle2onnx's checker would
            # report each (we check the graph once the weights are attached).
            raw = paddle2onnx.export(model_file, params_file, save_file=None, opset_version=opset,
                                     auto_upgrade_opset=False, enable_onnx_checker=os.path.isfile(params_file),
                                     enable_optimize=True, external_file=external_file)
    except Exception as e:  # paddle2onnx logs the real error, then fails on its undefined result
        raise ExportError(f"paddle2onnx could not convert {model_file}: {e}") from None
    finally:
        p2o_logging.log_level = level
    if not raw:
        raise ExportError(f"paddle2onnx returned an empty model for {model_file}")
    model = onnx.load_from_string(raw)
    del raw  # the parsed copy is all we keep (one copy of the weights, not two)
    return model


def _is_external(t) -> bool:
    return t.data_location == 1  # TensorProto.EXTERNAL


def tensor_bytes(t, base_dir: str = "", weights: Optional[Callable] = None):
    """The raw bytes of tensor ``t``: its ``raw_data``, or read from its external file (relative
    locations resolve against ``base_dir``), or, for a weight attached by reference
    (``attach_weights(lazy=True)``), ``weights(name)``'s bytes."""
    if not _is_external(t):
        return t.raw_data
    source = lazy_source(t)
    if source is not None:
        if weights is None:
            raise ExportError(f"tensor {t.name} refers to weight {source!r}, but no weights were given to resolve it")
        return memoryview(np.ascontiguousarray(weights(source))).cast("B")
    info = {e.key: e.value for e in t.external_data}
    path = info["location"] if os.path.isabs(info["location"]) else os.path.join(base_dir, info["location"])
    with open(path, "rb") as f:
        f.seek(int(info.get("offset", 0)))
        return f.read(int(info["length"])) if "length" in info else f.read()


def lazy_source(t) -> Optional[str]:
    """The weight name a tensor attached by reference stands for (``attach_weights(lazy=True)``), else None."""
    if not _is_external(t):
        return None
    location = _location(t)
    return location[len(LAZY):] if location.startswith(LAZY) else None


def _large(t) -> bool:
    return _is_external(t) or len(t.raw_data) >= MIN_EXTERNAL_BYTES


def constants_to_initializers(model) -> None:
    """Replace ``Constant`` nodes holding a tensor of >= MIN_EXTERNAL_BYTES by initializers; drop
    initializers no node reads."""
    graph = model.graph
    keep = []
    for node in graph.node:
        if node.op_type == "Constant" and len(node.attribute) == 1 and node.attribute[0].name == "value" \
                and _large(node.attribute[0].t):
            t = node.attribute[0].t
            t.name = node.output[0]
            graph.initializer.append(t)
        else:
            keep.append(node)
    del graph.node[:]
    graph.node.extend(keep)
    used = {name for node in graph.node for name in node.input} | {o.name for o in graph.output}
    unused = [t for t in graph.initializer if t.name not in used]
    for t in unused:  # paddle2onnx leaves a few dead constants; onnxruntime warns about each
        graph.initializer.remove(t)


def _scalar(graph, name: str):
    """The value of a scalar constant input (initializer or Constant node), else None."""
    from onnx import numpy_helper

    for t in graph.initializer:
        if t.name == name:
            a = numpy_helper.to_array(t)
            return float(a.reshape(-1)[0]) if a.size == 1 else None
    for n in graph.node:
        if n.op_type == "Constant" and n.output[0] == name:
            a = numpy_helper.to_array(n.attribute[0].t)
            return float(a.reshape(-1)[0]) if a.size == 1 else None
    return None


def fix_tanh_gelu(model) -> int:
    """Rewrite erf GELUs as the tanh approximation; returns how many were rewritten.

    paddle2onnx 2.1 ignores ``gelu(approximate=True)`` (our ``gelu_new``, GPT-2's activation)
    and emits the exact ``0.5 * x * (1 + erf(x / sqrt(2)))``: a silent 3e-4 logit error on
    ``gpt-bench``. We match exactly that chain, Div -> Erf -> Add(1) -> Mul(x) -> Mul(0.5), and
    replace it by ``0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))``, the form
    onnxruntime's FastGelu fusion recognises. Export validation then checks parity.
    """
    from onnx import TensorProto, helper

    graph = model.graph
    producer = {o: n for n in graph.node for o in n.output}
    consumers: dict[str, list] = {}
    for n in graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)

    def only_consumer(name, op):
        users = consumers.get(name, [])
        return users[0] if len(users) == 1 and users[0].op_type == op else None

    def other(node, name):
        return node.input[1] if node.input[0] == name else node.input[0]

    consts = {"gelu_tanh.half": 0.5, "gelu_tanh.one": 1.0, "gelu_tanh.three": 3.0,
              "gelu_tanh.coef": 0.044715, "gelu_tanh.scale": math.sqrt(2.0 / math.pi)}
    rewrites = []
    for erf in [n for n in graph.node if n.op_type == "Erf"]:
        div = producer.get(erf.input[0])
        if div is None or div.op_type != "Div" or abs((_scalar(graph, div.input[1]) or 0) - math.sqrt(2)) > 1e-4:
            continue
        x = div.input[0]
        add = only_consumer(erf.output[0], "Add")
        mul = add and only_consumer(add.output[0], "Mul")
        half = mul and only_consumer(mul.output[0], "Mul")
        if not (add and mul and half and _scalar(graph, other(add, erf.output[0])) == 1.0
                and other(mul, add.output[0]) == x and _scalar(graph, other(half, mul.output[0])) == 0.5):
            continue
        rewrites.append((x, [div, erf, add, mul, half]))
    if not rewrites:
        return 0
    for name, value in consts.items():
        graph.initializer.append(helper.make_tensor(name, TensorProto.FLOAT, [], [value]))
    for k, (x, old) in enumerate(rewrites):
        out, p = old[-1].output[0], f"gelu_tanh.{k}."
        new = [helper.make_node("Pow", [x, "gelu_tanh.three"], [p + "cube"]),
               helper.make_node("Mul", [p + "cube", "gelu_tanh.coef"], [p + "cube_c"]),
               helper.make_node("Add", [x, p + "cube_c"], [p + "inner"]),
               helper.make_node("Mul", [p + "inner", "gelu_tanh.scale"], [p + "scaled"]),
               helper.make_node("Tanh", [p + "scaled"], [p + "tanh"]),
               helper.make_node("Add", [p + "tanh", "gelu_tanh.one"], [p + "onep"]),
               helper.make_node("Mul", [x, "gelu_tanh.half"], [p + "halfx"]),
               helper.make_node("Mul", [p + "halfx", p + "onep"], [out])]
        at = list(graph.node).index(old[-1])
        for n in new[::-1]:
            graph.node.insert(at + 1, n)
        for n in old:
            graph.node.remove(n)
    return len(rewrites)


def rename_io(model, io: dict) -> None:
    """Give graph inputs/outputs the manifest's names and named dynamic dimensions."""
    graph = model.graph
    rename = {}
    for values, specs in ((graph.input, io["inputs"]), (graph.output, io["outputs"])):
        if len(values) != len(specs):
            raise ExportError(f"ONNX graph has {len(values)} {'inputs' if values is graph.input else 'outputs'}, "
                              f"the manifest expects {len(specs)}")
        for value, spec in zip(values, specs):
            if value.name != spec["name"]:
                rename[value.name] = spec["name"]
                value.name = spec["name"]
            for dim, want in zip(value.type.tensor_type.shape.dim, spec["shape"]):
                if isinstance(want, str):
                    dim.dim_param = want.replace("+", "_plus_")
    for node in graph.node:
        for seq in (node.input, node.output):
            for i, name in enumerate(seq):
                if name in rename:
                    seq[i] = rename[name]


def drop_output_identities(model) -> int:
    """Let the producer of ``X -> Identity -> graph output`` write the output directly.
    paddle2onnx ends every fetch with an Identity; for the KV cache that is a full copy of
    each layer's cache on every decode step. Returns how many were removed."""
    graph = model.graph
    outputs = {o.name for o in graph.output}
    inputs = {i.name for i in graph.input} | {t.name for t in graph.initializer}
    produced = {o for n in graph.node for o in n.output}
    removed = 0
    for node in list(graph.node):
        if node.op_type != "Identity" or node.output[0] not in outputs:
            continue
        src, dst = node.input[0], node.output[0]
        if src in outputs or src in inputs or src not in produced:
            continue
        graph.node.remove(node)
        for n in graph.node:
            for seq in (n.input, n.output):
                for i, name in enumerate(seq):
                    if name == src:
                        seq[i] = dst
        removed += 1
    return removed


def split_shared_weights(model) -> int:
    """Give each MatMul its own name for a weight other nodes also read (the tied embedding:
    Gather + LM head). onnxruntime only pre-packs a MatMul weight no other node uses, and an
    unpacked LM head is about twice as slow per decode step. Both names keep
    the same bytes, which ``externalize`` stores once. Returns how many were split."""
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    users: dict[str, list] = {}
    for n in graph.node:
        for i in n.input:
            if i in inits:
                users.setdefault(i, []).append(n)
    split = 0
    for name, nodes in users.items():
        if len(nodes) < 2:
            continue
        for k, n in enumerate(x for x in nodes if x.op_type in ("MatMul", "Gemm") and x.input[1] == name):
            copy = graph.initializer.add()
            copy.CopyFrom(inits[name])
            copy.name = f"{name}.for_{n.op_type.lower()}{k}"
            n.input[1] = copy.name
            split += 1
    return split


class DataFile:
    """``DATA_FILE`` in ``out_dir``, written tensor by tensor: ``add(model)`` moves the large
    initializers of one model into it (each distinct tensor once across all models added, at
    page-aligned offsets) and leaves the model holding only references."""

    def __init__(self, out_dir: str):
        self.path = os.path.join(out_dir, DATA_FILE)
        self._f = open(self.path, "wb")
        self._offsets: dict[str, tuple[int, int]] = {}

    def write(self, data, data_type: int) -> tuple[int, int]:
        """Append tensor bytes ``data`` (any buffer) unless the same bytes of ``data_type`` are
        already in the file; returns their (offset, length)."""
        key = hashlib.sha256(data).hexdigest() + f":{data_type}"
        if key not in self._offsets:
            self._f.write(b"\0" * ((-self._f.tell()) % ALIGN))
            self._offsets[key] = (self._f.tell(), memoryview(data).nbytes)
            self._f.write(data)
        return self._offsets[key]

    def add(self, model, base_dir: str = "", weights: Optional[Callable] = None) -> None:
        """Externalize ``model``'s large initializers (external ones are read from ``base_dir``,
        those attached by reference from ``weights``; those already in this file,
        ``attach_weights``', stay as they are)."""
        for t in model.graph.initializer:
            if not _large(t) or (_is_external(t) and _location(t) == DATA_FILE):
                continue
            data = tensor_bytes(t, base_dir, weights)
            offset, length = self.write(data, t.data_type)
            del data
            reference(t, offset, length)

    def flush(self) -> None:
        """Make what was added so far visible to readers of the file."""
        self._f.flush()

    def close(self) -> int:
        """Flush to disk; returns the file size."""
        if not self._f.closed:
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
        return os.path.getsize(self.path)


def _location(t) -> str:
    return {e.key: e.value for e in t.external_data}.get("location", "")


def reference(t, offset: int, length: int) -> None:
    """Make tensor ``t`` point at ``length`` bytes at ``offset`` of ``DATA_FILE`` (no data inside)."""
    t.ClearField("raw_data")
    t.data_location = 1  # TensorProto.EXTERNAL
    del t.external_data[:]
    for k, v in (("location", DATA_FILE), ("offset", str(offset)), ("length", str(length))):
        entry = t.external_data.add()
        entry.key, entry.value = k, v


def externalize(models: dict, out_dir: str) -> int:
    """Move large initializers of all ``models`` into one ``DATA_FILE`` in ``out_dir``, each
    distinct tensor once. Returns the data file size."""
    data = DataFile(out_dir)
    for model in models.values():
        data.add(model)
    return data.close()


def attach_weights(model, weights: Callable[[str], "np.ndarray"], data: Optional[DataFile] = None,
                   lazy: bool = False) -> int:
    """Add an initializer for every tensor the graph reads but nothing defines (the parameters of
    a program converted without its params file), its value ``weights(name)``. With ``data``, each
    large one goes straight to the data file and the graph keeps a reference (the graph never
    holds the weights: one tensor in memory at a time); with ``lazy``, the graph keeps a
    reference to ``weights(name)`` itself (``LAZY``), resolved when the tensor is read
    (``tensor_bytes``, ``DataFile.add``): for a graph rewritten first, whose replaced weights
    are then neither held nor written. Returns how many."""
    from onnx import helper, numpy_helper

    graph = model.graph
    defined = {o for n in graph.node for o in n.output} | {i.name for i in graph.input} | \
        {t.name for t in graph.initializer}
    missing = sorted({i for n in graph.node for i in n.input if i and i not in defined})
    for name in missing:
        value = weights(name)
        if (data is None and not lazy) or value.nbytes < MIN_EXTERNAL_BYTES:
            graph.initializer.append(numpy_helper.from_array(value, name))
            continue
        t = graph.initializer.add()
        t.name, t.data_type = name, helper.np_dtype_to_tensor_dtype(value.dtype)
        t.dims.extend(value.shape)
        if lazy:
            t.data_location = 1  # TensorProto.EXTERNAL
            for k, v in (("location", LAZY + name), ("length", str(value.nbytes))):
                entry = t.external_data.add()
                entry.key, entry.value = k, v
            del value
            continue
        # ONNX stores little-endian, C order: the bytes of a contiguous array on this (x86) machine
        reference(t, *data.write(memoryview(np.ascontiguousarray(value)).cast("B"), t.data_type))
        del value
    return len(missing)


def convert_program(paddle_dir: str, files: dict, io: dict, scratch: str, opset: int = 17,
                    tanh_gelu: bool = False, weights: Optional[Callable] = None, data: Optional[DataFile] = None):
    """One exported Paddle program -> a cleaned-up ``onnx.ModelProto`` (see the module docstring).
    With ``weights`` (parameter name -> array) paddle2onnx converts the graph alone and the
    parameters are attached one by one: paddle2onnx holds ~5 copies of the weights while it
    converts (6.9 GB RSS for one gpt-345M program), the graph alone takes ~0.3 GB. Without,
    past 2 GB the weights come back external, in ``scratch`` (pass it to ``DataFile.add``).
    ``data``: with ``weights``, write them straight into this data file (``attach_weights``);
    without, attach them by reference (``LAZY``, resolved from ``weights``)."""
    params = os.path.join(paddle_dir, files["params"]) if weights is None else os.path.join(scratch, "none.pdiparams")
    model = paddle_to_onnx(os.path.join(paddle_dir, files["model"]), params, opset,
                           external_file=os.path.join(scratch, P2O_DATA_FILE))
    if weights is not None:
        attach_weights(model, weights, data, lazy=data is None)
    constants_to_initializers(model)
    rename_io(model, io)
    if tanh_gelu:
        fix_tanh_gelu(model)
    drop_output_identities(model)
    split_shared_weights(model)
    return model


def convert_programs(paddle_dir: str, paddle_files: dict, out_dir: str, io: dict, opset: int = 17,
                     tanh_gelu: bool = False, transform: Optional[Callable] = None,
                     weights: Optional[Callable] = None, stream: Optional[bool] = None) -> dict:
    """Convert the exported Paddle programs in ``paddle_dir`` to ``{name}.onnx`` files plus one
    shared ``model.onnx.data`` in ``out_dir``, one program at a time (its weights streamed into
    the data file before the next is converted); ``io`` is ``inference.manifest.io_spec(cfg)``;
    ``tanh_gelu``: the model uses ``gelu_new`` (see ``fix_tanh_gelu``); ``transform(name, model,
    base_dir)`` rewrites each converted graph before it is written (the int8 export);
    ``weights``: parameter name -> array, to attach the weights ourselves (``convert_program``);
    ``stream``: write each attached weight to the data file at once (default: without a
    ``transform``; pass True for a transform that only drops or adds small tensors, never one
    that replaces weights, whose float bytes would stay in the file unused); otherwise the
    weights are attached by reference (``attach_weights(lazy=True)``: a ``transform`` reads
    them with ``tensor_bytes(t, base_dir, weights)``) and only those the graph still holds after
    the ``transform`` are written. Returns ``{program: {"model": file, "data": shared data file}}``."""
    import shutil
    import tempfile

    onnx, _ = _onnx()
    data = DataFile(out_dir)
    stream = transform is None if stream is None else stream
    out = {}
    try:
        for name in [p for p in PROGRAMS + SCORE_PROGRAMS if p in paddle_files]:
            scratch = tempfile.mkdtemp(prefix=f".onnx-{name}-", dir=out_dir)
            try:
                model = convert_program(paddle_dir, paddle_files[name], io[name], scratch, opset, tanh_gelu,
                                        weights, data if stream else None)
                if transform is not None:
                    transform(name, model, scratch)
                data.add(model, scratch, weights)
                path = os.path.join(out_dir, f"{name}.onnx")
                onnx.save_model(model, path)
                del model
                gc.collect()
                data.flush()
                try:  # the saved graph: its external data is checked on disk, never loaded
                    onnx.checker.check_model(path)
                except onnx.checker.ValidationError as e:
                    raise ExportError(f"the converted {name} program is not valid ONNX: {e}") from None
                out[name] = {"model": f"{name}.onnx", "data": DATA_FILE}
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
    finally:
        data.close()
    return out
