"""Checkpoint -> deployable directory: ``prefill``/``decode``/``forward`` static programs (and,
for Paddle Inference, ``decode`` split into ``decode_hidden`` + ``lm_head``: ``SPLIT_PROGRAMS``).

The three programs are ``paddle.jit.to_static`` methods of one wrapper around the one model
(``ExportableLM``), saved by one ``paddle.jit.save``: they share parameter names, so a single
``model.pdiparams`` serves all three (Paddle writes one identical copy per method; we keep one
and check the others were byte-identical). See ``inference/manifest.py`` for the layout.

Why the wrapper stores the tied embedding transposed, (hidden, vocab): the LM head is a
``(B, hidden) @ (hidden, vocab)`` GEMV that dominates decode (77 MB of the 121 MB of ``gpt-bench``
weights). With the embedding's natural (vocab, hidden) layout the head is a ``transpose_y``
matmul, which MKL runs at 8.3 ms for batch 1 on this machine instead of 3.4 ms (and the ONNX
export used to store the weight twice, once per orientation). The token lookup becomes a
column gather, ``gather(W_t, ids, axis=1)``: free for decode, ~14 ms for 2048 tokens.
"""
from __future__ import annotations

from ..errors import ExportError  # noqa: F401  (re-exported)

import hashlib
import os
import shutil
import tempfile
from typing import Optional, Sequence

import numpy as np
import paddle
import paddle.nn as nn
from paddle.static import InputSpec

from ..checkpoint import CheckpointError, load_model, read_config, write_checkpoint_dir, write_json_atomic
from ..config import ModelConfig
from ..inference.manifest import FORMAT, FORMAT_VERSION, MANIFEST, PROGRAMS, SPLIT_PROGRAMS

PARAMS = "model.pdiparams"
# Column blocks of the split ``lm_head`` (``SPLIT_PROGRAMS``: Paddle's batch-1 decode runs the head,
# a GEMV over 64% of gpt-bench's weights, on all threads and the ~250 small ops of the body on one;
# see inference/predictor.py).
HEAD_BLOCKS = 4
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "merges.txt")




class TransposedEmbedding(nn.Layer):
    """Token embedding stored (hidden, vocab), the orientation a GEMV LM head wants."""

    def __init__(self, weight: paddle.Tensor):
        super().__init__()
        vocab, hidden = weight.shape
        self.hidden = hidden
        self.weight_t = self.create_parameter([hidden, vocab], dtype=weight.dtype)
        self.weight_t.set_value(paddle.transpose(weight, [1, 0]))

    def forward(self, input_ids):
        """input_ids (B, T) -> (B, T, hidden)."""
        cols = paddle.gather(self.weight_t, input_ids.reshape([-1]), axis=1)  # (hidden, B*T)
        shape = paddle.shape(input_ids)
        return paddle.transpose(cols, [1, 0]).reshape([shape[0], shape[1], self.hidden])


class ExportableLM(nn.Layer):
    """The three inference entry points around one ``GPTForCausalLM`` (mutated in place: with
    tied embeddings its ``gpt.wte`` becomes a ``TransposedEmbedding``; the math is unchanged)."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.tied = model.config.tie_word_embeddings
        if self.tied:
            model.gpt.wte = TransposedEmbedding(model.gpt.wte.weight)

    def _logits(self, hidden):
        if self.tied:
            return paddle.matmul(hidden, self.model.gpt.wte.weight_t)
        return self.model.lm_head(hidden)

    def _step(self, input_ids, attention_mask, past):
        hidden, presents = self.model.gpt(input_ids, attention_mask=attention_mask, past_key_values=past,
                                          use_cache=True)
        out = [self._logits(hidden[:, -1])]  # only the last position is sampled from: (B, V)
        for k, v in presents:
            out += [k, v]
        return out

    def head_weight(self):
        """The LM head as a (hidden, vocab) parameter, or None when ``_logits`` is not a plain
        matmul with one (int8 and tensor-parallel exports): then no split decode is exported."""
        if type(self)._logits is not ExportableLM._logits:
            return None
        if self.tied:
            wte = self.model.gpt.wte
            return wte.weight_t if isinstance(wte, TransposedEmbedding) else None
        head = self.model.lm_head
        return head.weight if type(head) is nn.Linear and head.bias is None else None

    def decode_hidden(self, input_ids, attention_mask, past):
        """``decode`` without its LM head: [last hidden state (B, hidden), k_0, v_0, ...]."""
        hidden, presents = self.model.gpt(input_ids, attention_mask=attention_mask, past_key_values=past,
                                          use_cache=True)
        out = [hidden[:, -1]]
        for k, v in presents:
            out += [k, v]
        return out

    def lm_head(self, hidden):
        """hidden (B, hidden) -> logits (B, V) as ``HEAD_BLOCKS`` batched GEMVs over column blocks of
        the head weight. The blocked (K, hidden, V/K) copy is computed from the parameter alone, so
        Paddle Inference's constant folding makes it once at load time; MKL then spreads the K
        GEMVs of one batched matmul over its threads, which it does not do for a single
        (1, hidden) x (hidden, V) product (see the module docstring)."""
        head = self.head_weight()
        k, (h, v) = HEAD_BLOCKS, head.shape
        n = -(-v // k)
        w = paddle.concat([head, paddle.zeros([h, n * k - v], dtype=head.dtype)], axis=1) if n * k != v else head
        blocks = paddle.transpose(w.reshape([h, k, n]), [1, 0, 2])  # (K, hidden, n)
        # Read every other parameter too (a folded-away zero) so that this program's parameter
        # file is the shared model.pdiparams: Paddle loads a combined file whole, in order.
        others = [t for t in list(self.parameters()) + [b for b in self.buffers() if b.persistable]
                  if t is not head]
        if others:
            blocks = blocks + 0.0 * paddle.add_n([t.reshape([-1])[:1].astype(head.dtype).sum() for t in others])
        x = paddle.expand(hidden.unsqueeze(0), [k, -1, h])  # (K, B, hidden)
        y = paddle.transpose(paddle.matmul(x, blocks), [1, 0, 2])  # (B, K, n)
        return y.reshape([-1, k * n])[:, :v]

    def forward(self, input_ids, attention_mask):
        """Scoring: (B, T) ids and mask -> logits (B, T, V)."""
        return self._logits(self.model.gpt(input_ids, attention_mask=attention_mask))

    def prefill(self, input_ids, attention_mask):
        """Prompt (B, T) -> [last logits (B, V), k_0, v_0, k_1, ...], each cache (B, H_i, T, D)."""
        return self._step(input_ids, attention_mask, None)

    def decode(self, input_ids, attention_mask, past):
        """New tokens (B, T), mask (B, S+T), past [(k_i, v_i)] -> [logits (B, V), k_0, v_0, ...]."""
        return self._step(input_ids, attention_mask, past)


def io_spec(cfg: ModelConfig) -> dict[str, dict]:
    """Input/output names, dtypes and shapes (symbolic dims as strings) of each program."""
    cache_in, cache_out, past_out = [], [], []
    for i in range(cfg.num_layers):
        h, d = cfg.heads(i), cfg.dim_head
        for kind in ("key", "value"):
            cache_in.append({"name": f"past_{kind}_{i}", "dtype": "float32", "shape": ["batch", h, "past", d]})
            cache_out.append({"name": f"present_{kind}_{i}", "dtype": "float32", "shape": ["batch", h, "seq", d]})
            past_out.append({"name": f"present_{kind}_{i}", "dtype": "float32",
                             "shape": ["batch", h, "past+seq", d]})
    ids = {"name": "input_ids", "dtype": "int64", "shape": ["batch", "seq"]}
    mask = {"name": "attention_mask", "dtype": "int64", "shape": ["batch", "seq"]}
    full_mask = {"name": "attention_mask", "dtype": "int64", "shape": ["batch", "past+seq"]}
    last = {"name": "logits", "dtype": "float32", "shape": ["batch", "vocab"]}
    hidden = {"name": "hidden", "dtype": "float32", "shape": ["batch", cfg.hidden_size]}
    return {
        "prefill": {"inputs": [ids, mask], "outputs": [last] + cache_out},
        "decode": {"inputs": [ids, full_mask] + cache_in, "outputs": [last] + past_out},
        "decode_hidden": {"inputs": [ids, full_mask] + cache_in, "outputs": [hidden] + past_out},
        "lm_head": {"inputs": [hidden], "outputs": [last]},
        "forward": {"inputs": [ids, mask],
                    "outputs": [{"name": "logits", "dtype": "float32", "shape": ["batch", "seq", "vocab"]}]},
    }


def _input_specs(cfg: ModelConfig):
    ids = InputSpec([None, None], "int64", "input_ids")
    mask = InputSpec([None, None], "int64", "attention_mask")
    past = [(InputSpec([None, cfg.heads(i), None, cfg.dim_head], "float32", f"past_key_{i}"),
             InputSpec([None, cfg.heads(i), None, cfg.dim_head], "float32", f"past_value_{i}"))
            for i in range(cfg.num_layers)]
    return {"forward": [ids, mask], "prefill": [ids, mask], "decode": [ids, mask, past],
            "decode_hidden": [ids, mask, past], "lm_head": [InputSpec([None, cfg.hidden_size], "float32", "hidden")]}


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def save_paddle_programs(model, out_dir: str, wrapper: Optional[nn.Layer] = None,
                         split_decode: bool = True) -> dict[str, dict[str, str]]:
    """``paddle.jit.save`` the three programs of ``model`` into ``out_dir`` with one shared
    params file. Returns ``{program: {"model": file, "params": file}}`` (names relative to out_dir).
    ``model`` is mutated (see ``ExportableLM``); pass a model you will not train further.
    ``wrapper``: an ``ExportableLM`` subclass instance around ``model`` (tensor-parallel shards).
    ``split_decode``: also save ``SPLIT_PROGRAMS`` (Paddle Inference's batch-1 decode path) when
    the wrapper's head is a plain matmul."""
    model.eval()
    wrapper = wrapper or ExportableLM(model)
    specs = _input_specs(model.config)
    names = list(PROGRAMS) + (list(SPLIT_PROGRAMS) if split_decode and wrapper.head_weight() is not None else [])
    for name in names:
        setattr(wrapper, name, paddle.jit.to_static(getattr(wrapper, name), input_spec=specs[name], full_graph=True))
    scratch = tempfile.mkdtemp(prefix=".jit-", dir=out_dir)
    try:
        paddle.jit.save(wrapper, os.path.join(scratch, "model"), combine_params=True)
        # jit.save names the methods model.json (forward), model.prefill.json, model.decode.json, ...
        stems = {name: "model" if name == "forward" else f"model.{name}" for name in names}
        shared = os.path.join(scratch, "model.pdiparams")
        digest = _sha256(shared)
        files = {}
        for name, stem in stems.items():
            src = os.path.join(scratch, stem + ".json")
            if not os.path.isfile(src):
                raise ExportError(f"paddle.jit.save did not write {stem}.json for the {name} program")
            os.replace(src, os.path.join(out_dir, f"{name}.json"))
            params = os.path.join(scratch, stem + ".pdiparams")
            if stem != "model" and os.path.isfile(params) and _sha256(params) != digest:
                # Never seen: every program reads the same parameters. Keep the copy rather than guess.
                os.replace(params, os.path.join(out_dir, f"{name}.pdiparams"))
                files[name] = {"model": f"{name}.json", "params": f"{name}.pdiparams"}
            else:
                files[name] = {"model": f"{name}.json", "params": PARAMS}
        os.replace(shared, os.path.join(out_dir, PARAMS))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return files


def _reference(model, seed: int = 0):
    """Dygraph logits for a small left-padded batch: (ids, mask, full logits (B,T,V),
    next ids, decode logits (B,V)) used to validate the export."""
    cfg = model.config
    rng = np.random.default_rng(seed)
    t = min(8, cfg.max_position_embeddings - 1)
    ids = rng.integers(0, cfg.vocab_size, size=(2, t)).astype(np.int64)
    mask = np.ones_like(ids)
    mask[1, : t // 2] = 0  # second row left-padded
    nxt = rng.integers(0, cfg.vocab_size, size=(2, 1)).astype(np.int64)
    with paddle.no_grad():
        full = model(paddle.to_tensor(ids), attention_mask=paddle.to_tensor(mask)).numpy()
        ids2, mask2 = np.concatenate([ids, nxt], 1), np.concatenate([mask, np.ones_like(nxt)], 1)
        step = model(paddle.to_tensor(ids2), attention_mask=paddle.to_tensor(mask2)).numpy()[:, -1]
    return ids, mask, full, nxt, step


def validate_backend(backend, ref, where: str, atol: float = 1e-4) -> float:
    """Compare a runner's prefill/decode/score with dygraph ``ref``; raise ``ExportError`` beyond
    ``atol`` (relative to the logits' magnitude). Returns the max abs diff."""
    ids, mask, full, nxt, step = ref
    logits, cache = backend.prefill(ids, mask)
    got = [(logits, full[:, -1]), (backend.score(ids, mask), full)]
    logits, _ = backend.decode(nxt, np.concatenate([mask, np.ones_like(nxt)], 1), cache)
    got.append((logits, step))
    # Padded query rows attend to nothing real; their logits are meaningless, compare real rows.
    diffs = [float(np.max(np.abs(np.where(mask[..., None] > 0, a - b, 0) if a.ndim == 3 else a - b)))
             for a, b in got]
    scale = max(1.0, float(np.max(np.abs(full))))
    if max(diffs) > atol * scale:
        raise ExportError(f"{where}: exported logits differ from dygraph by {max(diffs):.3g} "
                          f"(prefill, score, decode: {', '.join(f'{d:.3g}' for d in diffs)}; "
                          f"tolerance {atol * scale:.3g})")
    return max(diffs)


def _versions() -> dict[str, Optional[str]]:
    from .. import __version__

    out = {"gpt_compress": __version__, "paddle": paddle.__version__}
    for mod in ("paddle2onnx", "onnx", "onnxruntime"):
        try:
            out[mod] = __import__(mod).__version__
        except ImportError:
            out[mod] = None
    return out


def build_manifest(cfg: ModelConfig, files: dict[str, dict[str, dict[str, str]]], formats: Sequence[str],
                   tokenizer: Optional[list[str]], source: str) -> dict:
    """The ``manifest.json`` content (see ``inference/manifest.py``)."""
    spec = io_spec(cfg)
    programs = {name: {**spec[name], **{fmt: files[fmt][name] for fmt in formats}} for name in PROGRAMS}
    if "paddle" in formats:  # the split decode, when saved (Paddle only)
        programs.update({name: {**spec[name], "paddle": files["paddle"][name]}
                         for name in SPLIT_PROGRAMS if name in files["paddle"]})
    for name in programs:
        if "paddle" in programs[name]:
            # Paddle names its outputs fetch_name_N in order; the runner maps them by position.
            programs[name]["paddle_output_names"] = [f"fetch_name_{i}" for i in range(len(programs[name]["outputs"]))]
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "formats": list(formats),
        "model": cfg.to_dict(),
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "eos_token_id": cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id,
        "dtype": "float32",
        "cache": {"layout": "per-layer (key, value), each (batch, heads_i, seq, head_dim)",
                  "layers": [{"heads": cfg.heads(i), "head_dim": cfg.dim_head} for i in range(cfg.num_layers)]},
        "programs": programs,
        "tokenizer": tokenizer,
        "versions": _versions(),
        "source_checkpoint": source,
    }


def export(checkpoint: str, output: str, formats: Sequence[str] = ("paddle",), validate: bool = True,
           opset: int = 17, fused: bool = True) -> str:
    """Export checkpoint directory ``checkpoint`` to model directory ``output`` (written atomically:
    built in a temporary sibling, then renamed). ``formats``: "paddle" and/or "onnx". ``fused``:
    with "paddle", also the fused CPU program (``export/fused.py``)."""
    formats = [f for f in ("paddle", "onnx") if f in formats]
    if not formats:
        raise ExportError("choose at least one format: paddle, onnx")
    _, meta = read_config(checkpoint)
    if meta.get("head", "lm") != "lm":
        raise ExportError(f"{checkpoint} holds a {meta.get('head')!r} model; only language models "
                          "(head 'lm') export for generation")
    model = load_model(checkpoint)  # verifies checksums, parameter names and shapes vs the config
    cfg = model.config
    ref = _reference(model) if validate else None
    tokenizer_src = [f for f in TOKENIZER_FILES if os.path.isfile(os.path.join(checkpoint, f))]

    def write(tmp: str) -> None:
        files = {}
        fused_info = None
        if fused and "paddle" in formats:  # before save_paddle_programs, which mutates the model
            from .fused import try_save_fused

            fused_info = try_save_fused(model, tmp)
        # ONNX is converted from the Paddle programs; without --format paddle they live in scratch.
        pdir = tmp if "paddle" in formats else tempfile.mkdtemp(prefix=".paddle-", dir=tmp)
        files["paddle"] = save_paddle_programs(model, pdir, split_decode="paddle" in formats)
        if "onnx" in formats:
            from .onnx import convert_programs

            files["onnx"] = convert_programs(pdir, files["paddle"], tmp, io_spec(cfg), opset=opset,
                                             tanh_gelu=cfg.hidden_act == "gelu_new")
        if pdir != tmp:
            shutil.rmtree(pdir)
        tok_files = None
        if tokenizer_src:
            from ..data.tokenizer import Tokenizer

            tok_files = [os.path.basename(p) for p in Tokenizer.load(checkpoint).save(tmp)]
        manifest = build_manifest(cfg, files, formats, tok_files, os.path.abspath(checkpoint))
        if fused_info:
            manifest["fused"] = fused_info
        write_json_atomic(os.path.join(tmp, MANIFEST), manifest)
        if validate:
            validate_dir(tmp, ref, formats)

    return write_checkpoint_dir(output, write)


def validate_dir(path: str, ref, formats: Sequence[str]) -> dict[str, float]:
    """Run each exported format on the reference batch; raise ``ExportError`` on mismatch."""
    from ..inference.manifest import read_manifest

    manifest = read_manifest(path)
    out = {}
    for fmt in formats:
        if fmt == "paddle":
            from ..inference.predictor import PaddleBackend as Backend
        else:
            from ..inference.ort import OrtBackend as Backend
        out[fmt] = validate_backend(Backend(manifest, verify=False), ref, f"{path} ({fmt})")
    if "paddle" in formats and manifest.data.get("fused"):
        from ..inference.fused import FusedBackend

        out["fused"] = validate_backend(FusedBackend(manifest, verify=False), ref, f"{path} (paddle fused)")
    return out
