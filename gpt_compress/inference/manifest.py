"""The exported model directory's format: its manifest (writer and reader), file checks, errors.

The one definition of what an export directory holds: ``export/`` builds manifests with
``build_manifest`` / ``build_tp_manifest`` and writes them with ``write_manifest``; every runner
reads them with ``read_manifest`` / ``read_tp_manifest``. Importing it needs neither Paddle nor
onnxruntime nor the model code, so a serving process stays free of the training stack.

An export directory holds::

    manifest.json      what is in the directory (this module's ``MANIFEST``)
    checksums.json     sha256 of every file (written by ``fileio.write_dir_atomic``)
    prefill.json, decode.json, forward.json, model.pdiparams   Paddle Inference (--format paddle)
    decode_hidden.json, lm_head.json                            (Paddle, same model.pdiparams)
    prefill.onnx, decode.onnx, forward.onnx, model.onnx.data   onnxruntime (--format onnx)
    tokenizer.json, vocab.json, merges.txt                      when the checkpoint had a tokenizer

A model finetuned with fixed-length prompts (``Finetune.prompt_tokens``) records that length as
``prompt_tokens``: runners fix text prompts to it (``data/tokenizer.py:encode_prompts``).

Programs (all batch- and length-dynamic; ``S`` is the cached length, ``T`` the new tokens):

* ``prefill(input_ids (B,T), attention_mask (B,T)) -> logits (B,V), present_key_i/value_i (B,H_i,T,D)``
* ``decode(input_ids (B,T), attention_mask (B,S+T), past_key_i/value_i (B,H_i,S,D))
  -> logits (B,V), present_key_i/value_i (B,H_i,S+T,D)``; ``logits`` are those of the last position
* ``forward(input_ids (B,T), attention_mask (B,T)) -> logits (B,T,V)`` for scoring
* Paddle only, optional (fp32 heads): ``decode_hidden`` (``decode`` with the last hidden state
  (B,hidden) in place of the logits) and ``lm_head(hidden (B,hidden)) -> logits (B,V)``, which
  Paddle Inference runs with different thread counts for batch-1 decode (``predictor.py``)
* Optional, float and int8 exports (``SCORE_PROGRAMS``): ``forward_hidden(input_ids, attention_mask)
  -> hidden (B,T,hidden)`` and ``score_head(hidden (N,hidden), labels (N,)) -> logprob (N,) float64,
  argmax (N,) int64``: evaluation takes logits only where it scores. Without them (exports from
  before, tensor-parallel ones) it uses the fused program's chosen rows or ``forward``
  (``eval/scoring.py``); the format version is unchanged because readers of either age ignore or
  do without them.

``H_i`` may differ per layer (structurally pruned models).

A tensor-parallel export (``gptc partition``) is a directory of such directories, ``rank_0/`` ...
``rank_{mp-1}/`` (each rank's programs output its vocabulary slice of the logits), plus a top
``manifest.json`` of format ``TP_FORMAT`` naming them.
"""
from __future__ import annotations

from ..errors import ModelDirError, InputError  # noqa: F401  (re-exported)

import json
import os
from dataclasses import dataclass
from typing import Optional, Sequence

from ..fileio import CHECKSUMS, json_count, read_json, sha256_file, write_json_atomic

FORMAT = "gpt-compress-inference"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
PROGRAMS = ("prefill", "decode", "forward")
# Optional Paddle-only programs: ``decode`` as its body and its LM head (see the list above).
SPLIT_PROGRAMS = ("decode_hidden", "lm_head")
# Optional scoring programs (every format; float and int8 exports from this version on): evaluation runs
# the body, then the head only at the positions it scores (see the list above).
SCORE_PROGRAMS = ("forward_hidden", "score_head")
BACKENDS = ("paddle", "onnx")
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "merges.txt")
TP_FORMAT = "gpt-compress-tp-inference"
TP_FORMAT_VERSION = 1




@dataclass(frozen=True)
class Manifest:
    """The parsed ``manifest.json`` of an exported model directory."""

    path: str  # the model directory
    data: dict

    @property
    def vocab_size(self) -> int:
        """Rows of the logits."""
        return int(self.data["vocab_size"])

    @property
    def max_positions(self) -> int:
        """Context length: prompt + new tokens must fit."""
        return int(self.data["max_position_embeddings"])

    @property
    def eos_token_id(self) -> Optional[int]:
        return self.data.get("eos_token_id")

    @property
    def pad_token_id(self) -> int:
        return int(self.data.get("pad_token_id") or 0)

    @property
    def prompt_tokens(self) -> int:
        """Length text prompts are fixed to (``data/tokenizer.py:encode_prompts``); 0: as encoded."""
        return json_count(self.data, "prompt_tokens", os.path.join(self.path, MANIFEST), ModelDirError,
                          "; re-export the model")

    @property
    def prompt_template(self) -> str:
        """The template the model's finetuning prompts were made from (``Finetune.prompt_template``); "": none."""
        template = self.data.get("prompt_template", "")
        if not isinstance(template, str):
            raise ModelDirError(f"{os.path.join(self.path, MANIFEST)}: prompt_template must be a string; re-export "
                                "the model")
        return template

    @property
    def layers(self) -> list[dict]:
        """Per-layer cache shapes: ``[{"heads": H_i, "head_dim": D}, ...]``."""
        return self.data["cache"]["layers"]

    @property
    def formats(self) -> list[str]:
        """Backends present in the directory ("paddle", "onnx")."""
        return list(self.data["formats"])

    def program(self, name: str) -> dict:
        """The manifest entry of program ``name`` (inputs, outputs, files per backend)."""
        return self.data["programs"][name]

    def file(self, name: str) -> str:
        """Absolute path of ``name`` inside the model directory; raises naming it if missing."""
        fp = os.path.join(self.path, name)
        if not os.path.isfile(fp):
            raise ModelDirError(f"{fp} is missing (listed in {os.path.join(self.path, MANIFEST)}); "
                                "re-export the model")
        return fp

    def files(self, backend: str, program: str) -> dict[str, str]:
        """Absolute paths of the files ``backend`` needs for ``program``."""
        if backend not in self.formats:
            raise ModelDirError(f"{self.path} was exported without the {backend!r} format "
                                f"(it has: {', '.join(self.formats)}); re-export with --format {backend} or all")
        return {k: self.file(v) for k, v in self.program(program)[backend].items()}


def verify_files(path: str, names: Optional[list[str]] = None) -> None:
    """Check sizes/sha256 of ``names`` (default: all; ``manifest.json`` always) against ``checksums.json``;
    the error names the file."""
    sums_path = os.path.join(path, CHECKSUMS)
    try:
        with open(sums_path, encoding="utf-8") as f:
            sums = json.load(f)
    except FileNotFoundError:
        raise ModelDirError(f"{sums_path} is missing: {path} is not a complete export") from None
    except ValueError as e:
        raise ModelDirError(f"{sums_path} is not valid JSON ({e}); re-export the model") from None
    if names is not None and MANIFEST not in names:
        names = [MANIFEST, *names]  # the manifest says what the files are: another model's must not pass
    for name in names if names is not None else sorted(sums):
        fp = os.path.join(path, name)
        if name not in sums:
            raise ModelDirError(f"{fp} is not listed in {sums_path}; re-export the model")
        if not os.path.isfile(fp):
            raise ModelDirError(f"{fp} is missing (listed in {sums_path}); re-export the model")
        if sha256_file(fp) != sums[name]:
            raise ModelDirError(f"{fp} is corrupt: its sha256 does not match {sums_path}; re-export the model")


def read_manifest(path: str) -> Manifest:
    """Parse and check ``manifest.json``: format name and version, required keys."""
    path = os.path.abspath(os.fspath(path))
    if not os.path.isdir(path):
        raise ModelDirError(f"model directory not found: {path}")
    fp = os.path.join(path, MANIFEST)
    if not os.path.isfile(fp):
        hint = (" (it looks like a training checkpoint: export it with `gptc export` or use backend='dygraph')"
                if os.path.isfile(os.path.join(path, "config.json")) else "")
        raise ModelDirError(f"{fp} not found: {path} is not an exported gpt-compress model{hint}")
    data = _load_json(fp)
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        got = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise ModelDirError(f"{fp}: format {got!r} is not {FORMAT!r}")
    version = data.get("format_version")
    if not isinstance(version, int):
        raise ModelDirError(f"{fp}: format_version is missing or not an integer")
    if version > FORMAT_VERSION:
        raise ModelDirError(f"{fp}: export format version {version} is newer than this gpt-compress "
                            f"understands ({FORMAT_VERSION}); upgrade gpt-compress or re-export")
    missing = [k for k in ("vocab_size", "max_position_embeddings", "cache", "programs", "formats") if k not in data]
    missing += [f"programs.{p}" for p in PROGRAMS if p not in data.get("programs", {})]
    if missing:
        raise ModelDirError(f"{fp} lacks {', '.join(missing)}; re-export the model")
    return Manifest(path=path, data=data)


def io_spec(cfg) -> dict[str, dict]:
    """Input/output names, dtypes and shapes (symbolic dims as strings) of each program of a
    ``ModelConfig`` ``cfg``."""
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
        "forward_hidden": {"inputs": [ids, mask], "outputs": [
            {"name": "hidden", "dtype": "float32", "shape": ["batch", "seq", cfg.hidden_size]}]},
        "score_head": {"inputs": [{"name": "hidden", "dtype": "float32", "shape": ["rows", cfg.hidden_size]},
                                  {"name": "labels", "dtype": "int64", "shape": ["rows"]}],
                       "outputs": [{"name": "logprob", "dtype": "float64", "shape": ["rows"]},
                                   {"name": "argmax", "dtype": "int64", "shape": ["rows"]}]},
    }


def _versions() -> dict[str, Optional[str]]:
    """Versions of the exporting stack (recorded, never checked)."""
    from .. import __version__

    out = {"gpt_compress": __version__}
    for mod in ("paddle", "paddle2onnx", "onnx", "onnxruntime"):
        try:  # optional dependencies: an export without ONNX has no paddle2onnx to report
            out[mod] = __import__(mod).__version__
        except ImportError:
            out[mod] = None
    return out


def build_manifest(cfg, files: dict[str, dict[str, dict[str, str]]], formats: Sequence[str],
                   tokenizer: Optional[list[str]], source: str, prompt_tokens: int = 0,
                   prompt_template: str = "") -> dict:
    """The ``manifest.json`` content for ``ModelConfig`` ``cfg``; ``files``: ``{format: {program:
    {role: file}}}`` as the exporters return them; ``tokenizer``: the tokenizer files written;
    ``prompt_tokens`` and ``prompt_template``: the checkpoint's (``Manifest.prompt_tokens``,
    ``Manifest.prompt_template``), recorded when set."""
    spec = io_spec(cfg)
    programs = {name: {**spec[name], **{fmt: files[fmt][name] for fmt in formats}} for name in PROGRAMS}
    # The scoring programs, when every format has them (tensor-parallel rank exports do not).
    programs.update({name: {**spec[name], **{fmt: files[fmt][name] for fmt in formats}}
                     for name in SCORE_PROGRAMS if all(name in files[fmt] for fmt in formats)})
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
        **({"prompt_tokens": prompt_tokens} if prompt_tokens else {}),
        **({"prompt_template": prompt_template} if prompt_template else {}),
    }


def write_manifest(path: str, manifest: dict) -> None:
    """Write ``manifest`` as directory ``path``'s ``MANIFEST`` (atomically)."""
    write_json_atomic(os.path.join(path, MANIFEST), manifest)


def record_draft(path: str, draft: str, figures: dict) -> dict:
    """Record the export ``draft`` as the speculative draft of the export ``path``: its manifest's
    ``draft`` (the path relative to ``path`` and ``figures``, e.g. the measured acceptance rate)
    and the manifest's entry in ``CHECKSUMS``. Returns the entry."""
    verify_files(path, [MANIFEST])
    data = read_manifest(path).data
    data["draft"] = {"path": os.path.relpath(os.path.abspath(draft), os.path.abspath(path)), **figures}
    write_manifest(path, data)
    sums_path = os.path.join(path, CHECKSUMS)
    if os.path.isfile(sums_path):
        sums = read_json(sums_path, ModelDirError)
        sums[MANIFEST] = sha256_file(os.path.join(path, MANIFEST))
        write_json_atomic(sums_path, sums)
    return data["draft"]


def tp_rank_entries(cfg, mp: int, rank: int) -> dict:
    """What a rank directory's manifest adds for rank ``rank`` of ``mp``: the full model's
    vocabulary and special tokens, and which vocabulary slice its logits are."""
    return {"vocab_size": cfg.vocab_size, "eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id,
            "tensor_parallel": {"mp_degree": mp, "rank": rank, "logits": "vocabulary slice",
                                "vocab_start": rank * cfg.vocab_size // mp,
                                "vocab_end": (rank + 1) * cfg.vocab_size // mp}}


def build_tp_manifest(cfg, mp: int, tokenizer: Optional[list[str]], source: str) -> dict:
    """The top ``manifest.json`` of a tensor-parallel export of ``ModelConfig`` ``cfg``."""
    return {"format": TP_FORMAT, "format_version": TP_FORMAT_VERSION, "mp_degree": mp,
            "ranks": [f"rank_{r}" for r in range(mp)], "vocab_size": cfg.vocab_size,
            "max_position_embeddings": cfg.max_position_embeddings, "eos_token_id": cfg.eos_token_id,
            "pad_token_id": cfg.pad_token_id, "tokenizer": tokenizer or None, "model": cfg.to_dict(),
            "source_checkpoint": source}


def _load_json(fp: str):
    return read_json(fp, ModelDirError, hint="; re-export the model")


def read_tp_manifest(path: str) -> dict:
    """The top manifest of a tensor-parallel export directory (``gptc partition``)."""
    fp = os.path.join(path, MANIFEST)
    if not os.path.isfile(fp):
        raise ModelDirError(f"{fp} not found: {path} is not a tensor-parallel export (make one with `gptc partition`)")
    data = _load_json(fp)
    if not isinstance(data, dict) or data.get("format") != TP_FORMAT:
        got = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise ModelDirError(f"{fp}: format {got!r} is not {TP_FORMAT!r} (make one with `gptc partition`)")
    if data.get("format_version", 0) > TP_FORMAT_VERSION:
        raise ModelDirError(f"{fp}: export format version {data['format_version']} is newer than this gpt-compress "
                            f"understands ({TP_FORMAT_VERSION}); upgrade gpt-compress or re-export")
    return data


def check_prompts(prompts: list[list[int]], vocab_size: int, max_positions: int, max_new_tokens: int,
                  truncate: bool = False) -> list[list[int]]:
    """Validate token-id prompts; with ``truncate`` keep the last tokens that fit the context."""
    if not prompts:
        raise InputError("no prompts given")
    room = max_positions - max_new_tokens
    if room < 1:
        raise InputError(f"max_new_tokens={max_new_tokens} leaves no room for a prompt in the "
                         f"model's context of {max_positions} tokens")
    out = []
    for i, p in enumerate(prompts):
        p = [int(t) for t in p]
        if not p:
            raise InputError(f"prompt {i} is empty: every prompt needs at least one token")
        bad = [t for t in p if t < 0 or t >= vocab_size]
        if bad:
            raise InputError(f"prompt {i} has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
        if len(p) > room:
            if not truncate:
                raise InputError(f"prompt {i} has {len(p)} tokens; with max_new_tokens={max_new_tokens} "
                                 f"at most {room} fit the context of {max_positions}. Shorten it, lower "
                                 "max_new_tokens, or pass truncate=True (--truncate) to keep its last tokens")
            p = p[-room:]
        out.append(p)
    return out
