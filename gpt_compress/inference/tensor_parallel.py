"""Tensor-parallel generation over a ``gptc partition`` directory, one process per rank.

    from gpt_compress.inference.tensor_parallel import generate_tensor_parallel
    tokens = generate_tensor_parallel("tp_export/", [[464, 3290]], max_new_tokens=16)

``generate_tensor_parallel`` (and `gptc infer-tp`) starts ``mp_degree`` processes with
``paddle.distributed.launch`` (each runs ``gptc infer-tp`` in rank mode, ``run_rank``). Every process calls ``fleet.init``
(the programs' all-reduces need the communicator) before creating its Paddle Inference
predictors on its ``rank_{r}/`` directory, then all of them run the same numpy decoding loop
(``model/generation.py``) in lock-step: after each program call the ranks all-gather their
vocabulary slices of the logits, so every rank picks the same next token. Rank 0 writes the
result. ``TensorParallelBackend`` is the ``Backend`` doing that gather; for evaluation it
gathers only the scored rows (``logits_at``; the rank programs are unfused and have no scoring
programs: a rank's head holds a vocabulary slice, so its log-sum-exp is not the model's).
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

    def __init__(self, model_dir: str, rank: int, device: str = "cpu", **options):
        from .predictor import PaddleBackend  # Paddle: only in the rank processes, not the launcher

        self.top = read_tp_manifest(model_dir) if os.path.isfile(os.path.join(model_dir, MANIFEST)) else None
        self.local = PaddleBackend(os.path.join(model_dir, f"rank_{rank}"), device=device, **options)
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

    def logits_at(self, input_ids, attention_mask, rows):
        """Logits (n, V) at the flat positions ``rows`` of ``input_ids`` (B, T): each rank's
        ``forward`` runs on the batch, then only those rows of its slice are all-gathered."""
        local = self.local.score(input_ids, attention_mask)
        return self._gather(local.reshape(-1, local.shape[-1])[np.asarray(rows, dtype=np.int64)])


def run_rank(model_dir: str, request: str, output: str) -> None:
    """Body of one launched rank: ``fleet.init``, predictors on ``rank_{r}/``, generate the
    request (JSON: prompts + generation settings) in lock-step; rank 0 writes ``output``."""
    import paddle.distributed as dist

    from ..config import GenerationConfig
    from ..parallel.fleet import init_mp
    from .runner import Generator

    top = read_tp_manifest(model_dir)
    init_mp(int(top["mp_degree"]))
    with open(request, encoding="utf-8") as f:
        req = json.load(f)
    rank = dist.get_rank()
    backend = TensorParallelBackend(model_dir, rank=rank)
    tokenizer = None
    if top.get("tokenizer"):
        from ..data.tokenizer import Tokenizer

        tokenizer = Tokenizer.load(model_dir)
    gen = Generator(backend, vocab_size=top["vocab_size"], max_positions=top["max_position_embeddings"],
                    eos_token_id=top["eos_token_id"], pad_token_id=top["pad_token_id"] or 0,
                    tokenizer=tokenizer, name=f"tensor-parallel:{model_dir}")
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

