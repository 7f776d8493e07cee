"""Tensor-parallel generation over a ``gptc partition`` directory, one process per rank.

    from gpt_compress.inference.tensor_parallel import generate_tensor_parallel
    tokens = generate_tensor_parallel("tp_export/", [[464, 3290]], max_new_tokens=16)

``generate_tensor_parallel`` (and `gptc infer-tp`) starts ``mp_degree`` processes with
``paddle.distributed.launch`` (each runs ``gptc infer-tp`` in rank mode, ``run_rank``). Every process calls ``fleet.init``
(the programs' all-reduces need the communicator) before creating its Paddle Inference
predictors on its ``rank_{r}/`` directory, then all of them run the same numpy decoding loop
(``model/generation.py``) in lock-step: after each program call the ranks all-gather their
vocabulary slices of the logits, so every rank picks the same next token. Rank 0 writes the
result. ``TensorParallelBackend`` is the ``Backend`` doing that gather. Each rank runs its
fused program (``export/fused_tp.py``, our operators with Paddle's all-reduce between them)
when its directory has one and the operators build here, else its unfused programs. For
evaluation a rank's head holds a vocabulary slice, so its log-sum-exp is not the model's:
``label_scores`` combines the slices' maxima and sums of exponentials across the ranks
(``logits_at`` gathers whole rows, for the server's top-k prompt scores).
"""
from __future__ import annotations

import json
import os
import subprocess
import tempfile
from typing import Optional

import numpy as np

from ..fileio import write_json_atomic
from .base import Backend
from .manifest import MANIFEST, read_tp_manifest


class TensorParallelBackend(Backend):
    """``prefill``/``decode``/``score``/``reorder_cache`` of rank ``rank``'s programs with the
    logits all-gathered along the vocabulary (every rank returns the full logits)."""

    def __init__(self, model_dir: str, rank: int, device: str = "cpu", fused: Optional[bool] = None, **options):
        self.top = read_tp_manifest(model_dir) if os.path.isfile(os.path.join(model_dir, MANIFEST)) else None
        self.local = rank_backend(os.path.join(model_dir, f"rank_{rank}"), device, fused, **options)
        self.fused = type(self.local).__name__ == "FusedBackend"  # the rank's fused program runs
        self.rank = rank

    def _gather(self, local: np.ndarray) -> np.ndarray:
        import paddle
        import paddle.distributed as dist

        parts: list = []
        dist.all_gather(parts, paddle.to_tensor(np.ascontiguousarray(local)))
        return np.concatenate([p.numpy() for p in parts], axis=-1)

    def prefill(self, input_ids, attention_mask):
        """Prompt (B, T) -> full last logits (B, V), this rank's cache."""
        logits, cache = self.local.prefill(input_ids, attention_mask)
        return self._gather(logits), cache

    def decode(self, input_ids, attention_mask, cache):
        """New tokens -> full logits (B, V), grown cache (this rank's heads)."""
        logits, cache = self.local.decode(input_ids, attention_mask, cache)
        return self._gather(logits), cache

    def reorder_cache(self, cache, rows):
        """Gather cache rows (beam search)."""
        return self.local.reorder_cache(cache, rows)

    def truncate_cache(self, cache, length):
        """This rank's cache cut to its first ``length`` positions."""
        return self.local.truncate_cache(cache, length)

    def score(self, input_ids, attention_mask=None):
        """Full-sequence logits (B, T, V), gathered over the ranks."""
        return self._gather(self.local.score(input_ids, attention_mask))

    # Evaluation (``eval/scoring.py``): only the scored rows' vocabulary slices are gathered.
    scores_rows = True

    def _local_rows(self, input_ids, attention_mask, rows) -> np.ndarray:
        """This rank's logits slice (n, V / mp) at the flat positions ``rows``: the fused program
        computes the head only there, the unfused ``forward`` everywhere."""
        rows = np.asarray(rows, dtype=np.int64)
        if self.local.scores_rows:
            return self.local.logits_at(input_ids, attention_mask, rows)
        local = self.local.score(input_ids, attention_mask)
        return local.reshape(-1, local.shape[-1])[rows]

    def logits_at(self, input_ids, attention_mask, rows):
        """Logits (n, V) at the flat positions ``rows`` of ``input_ids`` (B, T): only those rows
        of each rank's slice are all-gathered."""
        return self._gather(self._local_rows(input_ids, attention_mask, rows))

    # Evaluation (``eval/scoring.py``): per scored row, six numbers of each rank's slice cross the
    # ranks, not its logits.
    scores_labels = True

    def label_scores(self, input_ids, attention_mask, rows, labels) -> tuple[np.ndarray, np.ndarray]:
        """(log p(label) float64, argmax int64), each (n,), at the flat positions ``rows`` whose
        next tokens are ``labels`` (n,): the log-softmax over the whole vocabulary from each
        slice's maximum and sum of exponentials (exps in float32, sums in float64, as
        ``scoring.label_logprobs``), the argmax the first of the largest (``np.argmax``)."""
        local = self._local_rows(input_ids, attention_mask, rows)  # (n, V / mp)
        n, width = local.shape
        start = self.rank * width
        labels = np.asarray(labels, dtype=np.int64)
        top = local.max(axis=-1)
        sums = np.exp(local - top[:, None]).sum(axis=-1, dtype=np.float64)
        own = (labels >= start) & (labels < start + width)
        picked = np.where(own, local[np.arange(n), np.clip(labels - start, 0, width - 1)], 0.0)
        stats = np.stack([top.astype(np.float64), sums, picked, own, local.argmax(axis=-1) + start])  # (5, n)
        parts = self._gather(stats[None])[0].reshape(5, -1, n)  # (5, mp, n): rank r's at [:, r]
        tops = parts[0]
        best = tops.max(axis=0)
        lse = best + np.log((parts[1] * np.exp(tops - best)).sum(axis=0))
        label_logit = (parts[2] * parts[3]).sum(axis=0)
        arg = parts[4][tops.argmax(axis=0), np.arange(n)].astype(np.int64)  # the first rank holding the maximum
        return label_logit - lse, arg


def rank_backend(rank_dir: str, device: str = "cpu", fused: Optional[bool] = None, **options):
    """The runner of one rank directory: its fused program (``export/fused_tp.py``) on CPU when it
    has one (``fused=None``: if the operators build here, else the unfused programs with a
    warning; ``True``: required; ``False``: never), else its unfused Paddle programs. The fused
    program's ``threads`` default to an equal share of ``$OMP_NUM_THREADS`` (or of the cores) a rank:
    the launched ranks run side by side."""
    from ..parallel.launch import launched_world
    from ..runtime import math_threads
    from .fused import paddle_backend  # Paddle: only in the rank processes, not the launcher
    from .manifest import Manifest

    if not options.get("threads"):
        options["threads"] = max(1, math_threads() // max(1, launched_world()[1]))

    with open(os.path.join(rank_dir, MANIFEST), encoding="utf-8") as f:
        data = json.load(f)
    if not data.get("formats"):  # a quantized checkpoint's ranks: the fused program only
        if fused is False or device != "cpu":
            raise ValueError(f"{rank_dir} holds only the fused CPU program (a quantized checkpoint)")
        return paddle_backend(Manifest(os.path.abspath(rank_dir), data), fused=True, **options)
    from .manifest import read_manifest

    return paddle_backend(read_manifest(rank_dir), fused=fused, device=device, **options)


def tp_generator(model_dir: str, backend, tokenizer_dir: Optional[str] = None):
    """A ``Generator`` over ``backend`` (a rank's ``TensorParallelBackend``, or ``serve/lockstep.py``'s
    proxy of one) with the partitioned export's vocabulary, context, special tokens and tokenizer."""
    from .runner import Generator

    top = read_tp_manifest(model_dir)
    tokenizer = None
    if tokenizer_dir or top.get("tokenizer"):
        from ..data.tokenizer import Tokenizer

        tokenizer = Tokenizer.load(tokenizer_dir or model_dir)
    return Generator(backend, vocab_size=top["vocab_size"], max_positions=top["max_position_embeddings"],
                     eos_token_id=top["eos_token_id"], pad_token_id=top["pad_token_id"] or 0,
                     tokenizer=tokenizer, name=f"tensor-parallel:{model_dir}")


def run_rank(model_dir: str, request: str, output: str) -> None:
    """Body of one launched rank: ``fleet.init``, predictors on ``rank_{r}/``, generate the
    request (JSON: prompts + generation settings) in lock-step; rank 0 writes ``output``."""
    import paddle.distributed as dist

    from ..config import GenerationConfig
    from ..parallel.fleet import init_mp

    top = read_tp_manifest(model_dir)
    init_mp(int(top["mp_degree"]))
    with open(request, encoding="utf-8") as f:
        req = json.load(f)
    rank = dist.get_rank()
    gen = tp_generator(model_dir, TensorParallelBackend(model_dir, rank=rank))
    out = gen.generate(req["prompts"], config=GenerationConfig(**req["generation"]))
    if rank == 0:
        write_json_atomic(output, {"sequences": out.sequences, "texts": out.texts, "prompt_tokens": out.prompt_tokens,
                                   "seconds": out.seconds, "mp_degree": top["mp_degree"]}, indent=None, sort_keys=False)


def generate_tensor_parallel(model_dir: str, prompts, generation: Optional[dict] = None,
                             log_dir: Optional[str] = None, timeout: float = 1800, **overrides) -> dict:
    """Generate with a tensor-parallel export: launches its ``mp_degree`` ranks and returns rank 0's
    ``{"sequences", "texts", "prompt_tokens", "seconds"}``. ``prompts``: strings (needs the
    tokenizer) or token-id lists; ``generation``/``overrides``: ``GenerationConfig`` fields."""
    from ..parallel.launch import launch_command, log_tail

    top = read_tp_manifest(model_dir)
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], (int, np.integer))):
        prompts = [prompts]
    with tempfile.TemporaryDirectory(prefix="gptc-tp-") as tmp:
        req = os.path.join(tmp, "request.json")
        with open(req, "w", encoding="utf-8") as f:
            json.dump({"prompts": [p if isinstance(p, str) else [int(t) for t in p] for p in prompts],
                       "generation": {**(generation or {}), **overrides}}, f)
        result = os.path.join(tmp, "result.json")
        log_dir = log_dir or os.path.join(tmp, "logs")
        cmd = launch_command(int(top["mp_degree"]), ["infer-tp", "--model-dir", os.path.abspath(model_dir),
                                                     "--request", req, "--output", result], log_dir=log_dir)
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if res.returncode != 0 or not os.path.isfile(result):
            raise RuntimeError(f"tensor-parallel generation failed (exit {res.returncode}):\n{log_tail(log_dir)}")
        with open(result, encoding="utf-8") as f:
            return json.load(f)

