"""The one export entry: checkpoint (or in-memory model) -> deployable directory.

    from gpt_compress.export import export
    export("ckpt/", "out/", formats=("paddle", "onnx"))        # float, or int8 for a quantized checkpoint
    export("ckpt/", "tp/", mp_degree=2)                        # tensor-parallel rank directories

``export`` chooses the path from what it is given, so callers (``gptc export``, ``gptc qat/ptq``,
the pipeline) never branch on quantisation state:

* float: ``static.save_paddle_programs`` (+ ``onnx.convert_programs``);
* int8, when the model has quantized layers (a ``gptc qat/ptq`` checkpoint):
  ``int8.save_int8_programs`` (the scoring programs included), and the manifest's ``quant`` entry;
* tensor-parallel, ``mp_degree > 1``: ``partition.partition`` (one process per rank): the
  unfused and the fused programs per rank (a quantized checkpoint: the fused ones only);
* single-card Paddle exports also get ``fused.save_fused``'s program (our CPU operators).

Every single-card directory is built the same way inside one atomic directory write: programs,
tokenizer files, the manifest (``inference/manifest.py``), then validation of every format
against the dygraph model (``validate.py``); a directory that fails is never renamed into place.
"""
from __future__ import annotations

import gc
import os
import shutil
import tempfile
from typing import Optional, Sequence

from ..checkpoint import load_model, read_config, read_prompt_template, read_prompt_tokens
from ..data.tokenizer import find_tokenizer
from ..errors import ExportError
from ..fileio import check_output, write_dir_atomic
from ..inference.manifest import build_manifest, io_spec, write_manifest
from ..memory import return_freed_memory
from ..qat.deploy import quant_table
from ..qat.quantize import load_quantized, read_quant_state
from .draft_vocab import draft_vocab as vocabulary_of
from .fused import check_cache_dtype, try_save_fused
from .int8 import VALIDATION_HINT, W8A8_ATOL, quant_info, save_int8_programs
from .onnx import convert_programs
from .onnx_scoring import scoring_transform
from .partition import partition
from .static import free_parameters, program_weights, save_paddle_programs
from .validate import fused_atol, reference, validate_dir

FORMATS = ("paddle", "onnx")
FLOAT_ATOL = 1e-4  # float programs vs dygraph, x max(1, max |logit|)


def _formats(formats: Sequence[str]) -> list[str]:
    out = [f for f in FORMATS if f in formats]
    unknown = [f for f in formats if f not in FORMATS]
    if unknown or not out:
        raise ExportError(f"choose at least one format of: {', '.join(FORMATS)} (got {', '.join(formats) or 'none'})")
    return out


def export(checkpoint: str, output: str, formats: Sequence[str] = ("paddle",), validate: bool = True,
           opset: int = 17, mp_degree: int = 1, log_dir: Optional[str] = None, overwrite: bool = False,
           fused: bool = True, draft_vocab: int = 0, draft_vocab_data: Sequence[str] = (),
           kv_cache_dtype: str = "float32") -> str:
    """Export checkpoint directory ``checkpoint`` to directory ``output`` (written atomically);
    returns ``output``. A quantized checkpoint (``gptc qat/ptq``) exports int8, any other float;
    ``mp_degree > 1`` writes tensor-parallel rank directories (Paddle only). ``formats``:
    "paddle" and/or "onnx"; ``validate``: run every program against dygraph first; ``fused``: with
    "paddle" (single card), also the fused CPU program (``fused.py``). An existing
    ``output`` is replaced only if it is an earlier export and ``overwrite`` is set
    (``fileio.check_output``): checked before any work. ``draft_vocab``: the fused program also
    holds a speculative draft's vocabulary, the ``draft_vocab`` tokens most frequent in the
    documents of ``draft_vocab_data`` (``Data.data_prefix``'s form; ``draft_vocab.py``).
    ``kv_cache_dtype``: the fused program's KV cache elements (``fused.CACHE_DTYPES``; each rank's
    fused program's with ``mp_degree > 1``)."""
    formats = _formats(formats)
    check_cache_dtype(kv_cache_dtype)
    if os.path.abspath(output) == os.path.abspath(checkpoint):
        raise ExportError("the output directory must differ from the checkpoint directory")
    check_output(output, overwrite)
    cfg, meta = read_config(checkpoint)
    if meta.get("head", "lm") != "lm":
        raise ExportError(f"{checkpoint} holds a {meta.get('head')!r} model; only language models "
                          "(head 'lm') export for generation")
    if draft_vocab and (mp_degree > 1 or not fused or "paddle" not in formats):
        raise ExportError("a draft vocabulary lives in the fused program: export the paddle format with it, "
                          "on one card")
    if kv_cache_dtype != "float32" and (not fused or "paddle" not in formats):
        raise ExportError(f"a {kv_cache_dtype} KV cache is the fused program's: export the paddle format with it")
    if mp_degree > 1:
        if formats != ["paddle"]:
            raise ExportError("a tensor-parallel export (mp_degree > 1) is Paddle Inference only")
        return partition(checkpoint, output, mp_degree, validate=validate, log_dir=log_dir, overwrite=overwrite,
                         fused=fused, kv_cache_dtype=kv_cache_dtype)
    return_freed_memory()  # before the model is loaded, so that freeing its weights later returns them
    # load_* verify checksums, parameter names and shapes vs the config.
    ids = (vocabulary_of(draft_vocab_data, draft_vocab, cfg.vocab_size, cfg.eos_token_id) if draft_vocab
           else None)  # counted before the model is loaded: a bad data path costs nothing
    model = load_quantized(checkpoint) if read_quant_state(checkpoint) is not None else load_model(checkpoint)
    return export_model(model, output, formats, tokenizer=find_tokenizer(checkpoint), draft_vocab=ids,
                        source=os.path.abspath(checkpoint), validate=validate, opset=opset, overwrite=overwrite,
                        free_weights=True, fused=fused, prompt_tokens=read_prompt_tokens(checkpoint),
                        prompt_template=read_prompt_template(checkpoint), kv_cache_dtype=kv_cache_dtype)


def export_model(model, output: str, formats: Sequence[str] = ("paddle",), tokenizer=None, source: str = "",
                 validate: bool = True, opset: int = 17, require_quantized: bool = False,
                 overwrite: bool = False, free_weights: bool = False, fused: bool = True,
                 prompt_tokens: int = 0, prompt_template: str = "",
                 draft_vocab: Optional[Sequence[int]] = None, kv_cache_dtype: str = "float32") -> str:
    """Export in-memory ``GPTForCausalLM`` ``model`` to directory ``output`` (atomic): int8 when it
    has quantized layers (``qat.quantize``; W8A8 scales set), else float. ``require_quantized``
    refuses a model without quantized layers. The float path mutates ``model`` (see
    ``static.ExportableLM``): do not train it further. Returns ``output``; an int8 manifest's
    ``quant.validation`` holds the measured max logit differences. ``free_weights``: release the
    model's parameters as soon as the programs no longer need them (it is unusable afterwards):
    float, once its Paddle programs are on disk, so that converting and validating do not hold a
    dygraph copy too; int8, once the deploy model is built or as the ONNX float copy takes them
    over (``int8.save_int8_programs``), so that one float copy is resident at a time. ``prompt_tokens``: the
    checkpoint's fixed prompt length (``checkpoint.read_prompt_tokens``) and ``prompt_template`` its
    prompt template (``checkpoint.read_prompt_template``), kept in the manifest. ``draft_vocab``:
    ascending token ids the fused program also holds as a draft vocabulary (``draft_vocab.py``).
    ``kv_cache_dtype``: its KV cache elements (``fused.CACHE_DTYPES``)."""
    formats = _formats(formats)
    check_output(output, overwrite)
    return_freed_memory()  # each stage frees a copy of the weights: give it back (memory.py)
    model.eval()
    cfg = model.config
    table = quant_table(model)
    if require_quantized and not table:
        raise ExportError("the model has no quantized layer; export it as a float model")
    ref = reference(model) if validate else None  # before the float path mutates the model

    def write(tmp: str) -> None:
        # The fused CPU program (kernels/), from the model before the float path mutates it.
        fused_info = (try_save_fused(model, tmp, draft_vocab, kv_cache_dtype) if fused and "paddle" in formats
                      else None)
        gc.collect()  # the fused layer (its own copy of the weights) is only freed with its cycles
        if table:
            files, ops = save_int8_programs(model, tmp, formats, table, opset, free_weights)
            extra = quant_info(table, source)
            if ops is not None:
                extra["quant"]["onnx_ops"] = ops
        else:
            files, extra = _float_programs(model, tmp, formats, opset, free_weights), {}
        tok_files = [os.path.basename(p) for p in tokenizer.save(tmp)] if tokenizer is not None else None
        manifest = {**build_manifest(cfg, files, formats, tok_files, source, prompt_tokens, prompt_template), **extra}
        if fused_info:
            manifest["fused"] = fused_info
        write_manifest(tmp, manifest)
        if validate and table:
            diffs = validate_dir(tmp, ref, formats, atol=W8A8_ATOL, hint=VALIDATION_HINT)
            manifest["quant"]["validation"] = {"atol_relative": W8A8_ATOL, **diffs}
            if fused_info and kv_cache_dtype != "float32":  # the fused program's: its cache's rounding added
                manifest["quant"]["validation"]["atol_relative_fused"] = fused_atol(W8A8_ATOL, kv_cache_dtype)
            write_manifest(tmp, manifest)
        elif validate:
            validate_dir(tmp, ref, formats, atol=FLOAT_ATOL)

    return write_dir_atomic(output, write, overwrite=overwrite)


def _float_programs(model, out_dir: str, formats: Sequence[str], opset: int, free_weights: bool = False) -> dict:
    """Float programs of ``model`` for ``formats`` in ``out_dir``: ``{format: {program: files}}``."""
    cfg = model.config
    # ONNX is converted from the Paddle programs; without "paddle" they live in scratch.
    pdir = out_dir if "paddle" in formats else tempfile.mkdtemp(prefix=".paddle-", dir=out_dir)
    files = {"paddle": save_paddle_programs(model, pdir, split_decode="paddle" in formats, score=True)}
    if "onnx" in formats:  # weights attached from the model, one tensor at a time
        files["onnx"] = convert_programs(pdir, files["paddle"], out_dir, io_spec(cfg), opset=opset,
                                         tanh_gelu=cfg.hidden_act == "gelu_new", weights=program_weights(model),
                                         transform=scoring_transform, stream=True)  # it only drops the head's tail
    if free_weights:  # the programs read model.pdiparams / model.onnx.data from now on
        free_parameters(model)
    if pdir != out_dir:
        shutil.rmtree(pdir)
    return files
