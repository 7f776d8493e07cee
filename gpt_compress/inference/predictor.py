"""Paddle Inference backend: the ``Backend`` (``base.py``) over an exported model directory.

Predictors are created on first use (a generation-only server never loads ``forward``), one
per *role*, each with its own ``ProgramOptions``:

==================  ==========  =====================================================
role                program     default on CPU (chosen by ``bench/decode.py``)
==================  ==========  =====================================================
``prefill``         prefill     oneDNN, all threads
``decode``          decode      batches < ``batched_from``: plain MKL, **1 thread**; replaced by
                                the next two when the export has them (``split_head``):
``decode_hidden``   ..._hidden  the same body without its LM head: plain MKL, **1 thread**
``lm_head``         lm_head     the LM head alone: plain MKL, all threads
``decode_batched``  decode      batches >= ``batched_from``: oneDNN, all threads
``forward``         forward     oneDNN, all threads
==================  ==========  =====================================================

Why: a batch-1 step is ~250 small ops around GEMVs that stream the weights. MKL's GEMV is
near memory speed on one core, while a second thread costs a fork/join and cache traffic per
op; oneDNN is slower than MKL on (1, K) x (K, N). But one core cannot read memory at the
machine's full rate, and the LM head is most of ``gpt-bench``'s weights: MKL does not spread a
single (1, K) x (K, N) product over threads, while the exported ``lm_head`` program's batched
form (K column blocks, one batched matmul) does. So the head gets its own predictor with all
threads and the body keeps one.
From a few rows on, MKL's small-M GEMM is slower than oneDNN's, so batched decode uses oneDNN,
whose per-shape kernel rebuilds the bucketed cache avoids (see below).

Inputs and outputs are ``paddle.Tensor``s passed to ``Predictor.run(list)``: no numpy round
trip for the KV cache. But the returned tensors share memory with the predictor's own
variables, which its next run overwrites in place once they are large enough (a second
generation then read a cache being written: wrong tokens from the 4th step on). So cache
outputs we keep are cloned, once per step, or, on the bucketed path,
only the new positions are copied into our own buffers. The (B, V) logits go to numpy.

Threads: a Paddle predictor keeps per-thread state (oneDNN kernel caches, the math library's
thread count); run from a thread other than the one that first ran it, it failed with
``RuntimeError: std::exception`` and gave slightly different logits. So every call of a
``PaddleBackend`` (from any thread) is executed by the backend's own single worker thread,
which also serialises them. For parallel serving give each thread its own backend from
``clone()`` (``Predictor.clone()`` shares the weights).
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional, Union

import numpy as np

from ..runtime import cpu_flags, prefer_mkl_avx2, restore_math_threads

prefer_mkl_avx2()  # before Paddle's first matmul (MKL reads it once): AVX2 kernels on AMD CPUs

import paddle  # noqa: E402
import paddle.inference as pi  # noqa: E402

from .base import Backend, resolve_threads  # noqa: E402
from .manifest import SCORE_PROGRAMS, SPLIT_PROGRAMS, Manifest, ModelDirError, read_manifest, verify_files  # noqa: E402

ROLES = {"prefill": "prefill", "decode": "decode", "decode_batched": "decode", "forward": "forward",
         "decode_hidden": "decode_hidden", "lm_head": "lm_head", "forward_hidden": "forward_hidden",
         "score_head": "score_head"}


@dataclass
class ProgramOptions:
    """Configuration of one predictor."""

    threads: int = 0  # CPU math threads; 0: $OMP_NUM_THREADS, else the number of cores
    onednn: bool = False  # oneDNN (MKL-DNN) kernels on CPU
    onednn_cache: int = 32  # oneDNN primitive cache capacity (distinct input shapes kept)
    ir_optim: bool = True  # Paddle's graph optimisation passes
    passes: tuple[str, ...] = ()  # extra PIR passes on top of Paddle's CPU list (e.g. "add_norm_fuse_pass")


def default_options(device: str = "cpu") -> dict[str, ProgramOptions]:
    """Options per role (see the module docstring for the measurements behind them)."""
    if device == "gpu":
        return {role: ProgramOptions() for role in ROLES}
    # Residual add + layer norm fused into one op: about 5% of a batch-1 step, logits within 3e-6.
    # Its CPU kernel (FusedLayerNormAvxKernel) uses AVX-512 unchecked: SIGILL on AVX2-only CPUs.
    fused = ("add_norm_fuse_pass",) if "avx512f" in cpu_flags() else ()
    return {"prefill": ProgramOptions(onednn=True), "decode": ProgramOptions(threads=1, passes=fused),
            "decode_batched": ProgramOptions(onednn=True), "forward": ProgramOptions(onednn=True),
            "decode_hidden": ProgramOptions(threads=1, passes=fused), "lm_head": ProgramOptions(),
            "forward_hidden": ProgramOptions(onednn=True), "score_head": ProgramOptions()}


def gpu_available() -> bool:
    """True when this Paddle build has CUDA and sees a device."""
    return paddle.device.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0


def make_config(files: dict[str, str], opts: ProgramOptions, device: str = "cpu", gpu_id: int = 0) -> pi.Config:
    """A ``paddle.inference.Config`` for one program."""
    config = pi.Config(files["model"], files["params"])
    config.disable_glog_info()
    config.switch_ir_optim(opts.ir_optim)
    if device == "gpu":
        # Written for GPU, unverifiable on the CPU-only development machines: ir_optim keeps
        # Paddle's GPU pass list, which fuses matmul+bias(+act) epilogues and layer norms.
        if not gpu_available():
            raise RuntimeError("device='gpu' but this Paddle build has no CUDA or sees no GPU")
        config.enable_use_gpu(256, gpu_id)
    else:
        config.disable_gpu()
        config.set_cpu_math_library_num_threads(resolve_threads(opts.threads))
        if opts.passes and opts.ir_optim:
            config.enable_custom_passes(list(opts.passes), False)  # False: Paddle's own passes run too
        if opts.onednn:
            config.enable_onednn()
            config.set_onednn_cache_capacity(opts.onednn_cache)
        else:
            config.disable_onednn()
    return config


def create_predictor(files: dict[str, str], opts: ProgramOptions, device: str = "cpu", gpu_id: int = 0) -> pi.Predictor:
    """A predictor of one program (``make_config``); a program Paddle Inference cannot load (or
    set up on ``device``) raises ``ModelDirError`` naming its files. Also the fused backend's."""
    try:
        return pi.create_predictor(make_config(files, opts, device, gpu_id))
    except (RuntimeError, ValueError, OSError) as e:
        raise ModelDirError(f"Paddle Inference could not load {files['model']} with {files['params']}: {e}") from None


@dataclass
class PaddleCache:
    """KV cache: [k_0, v_0, k_1, ...], each (B, H_i, C, D), of which positions ``< length`` are
    filled. ``C == length`` unless bucketed (see ``PaddleBackend``)."""

    tensors: list
    length: int


class PaddleBackend(Backend):
    """Runs the exported ``prefill``/``decode``/``forward`` programs with Paddle Inference.

    When decode runs on oneDNN the cache is *bucketed*: kept in buffers whose length grows in
    steps of ``cache_bucket`` positions, empty slots masked out, new keys/values written in
    place. oneDNN builds its kernels per input shape; with the cache length growing every step
    the rebuilds made batch-8 decode 3-4x slower, with buckets they happen once per bucket."""

    def __init__(self, model_dir: Union[str, Manifest], device: str = "cpu", gpu_id: int = 0,
                 options: Optional[dict[str, ProgramOptions]] = None, verify: bool = True,
                 batched_from: int = 4, cache_bucket: int = 64, split_head: bool = True):
        self.manifest = model_dir if isinstance(model_dir, Manifest) else read_manifest(model_dir)
        self.device, self.gpu_id = device, gpu_id
        unknown = set(options or {}) - set(ROLES)
        if unknown:
            raise ValueError(f"unknown predictor role(s) {sorted(unknown)}; roles: {', '.join(ROLES)}")
        self.options = {**default_options(device), **(options or {})}
        self.batched_from, self.cache_bucket = batched_from, cache_bucket
        programs = ["prefill", "decode", "forward"]
        # Exports from before the split (or int8 / tensor-parallel ones) lack these programs.
        self.split_head = split_head and device != "gpu" and all(p in self.manifest.data["programs"] for p in SPLIT_PROGRAMS)
        programs += list(SPLIT_PROGRAMS) if self.split_head else []
        # Exports from before the scoring programs (and tensor-parallel ranks) score through ``forward``.
        self.scores_positions = all("paddle" in self.manifest.data["programs"].get(p, {}) for p in SCORE_PROGRAMS)
        programs += list(SCORE_PROGRAMS) if self.scores_positions else []
        self._files = {name: self.manifest.files("paddle", name) for name in programs}
        if verify:
            names = sorted({os.path.basename(p) for f in self._files.values() for p in f.values()})
            verify_files(self.manifest.path, names)
        self._predictors: dict[str, pi.Predictor] = {}
        self._scorer = None  # inference/head_score.py's op for score_head once checked (False: not usable)
        self._place = paddle.CUDAPlace(gpu_id) if device == "gpu" else paddle.CPUPlace()
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="paddle-predictor")

    def on_thread(self, fn, *args):
        """Run ``fn(*args)`` on this backend's worker thread (see the module docstring)."""
        return self._worker.submit(fn, *args).result()

    def _init_clone(self, source: "PaddleBackend") -> None:
        """Own worker thread; predictors that share ``source``'s weights."""
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="paddle-predictor")
        self._predictors = {k: p.clone() for k, p in source._predictors.items()}

    def predictor(self, role: str) -> pi.Predictor:
        """The predictor of ``role`` (a key of ``ROLES``), created on first use (by the worker)."""
        return self.on_thread(self._predictor, role)

    def _predictor(self, role: str) -> pi.Predictor:
        if role not in self._predictors:
            self._predictors[role] = create_predictor(self._files[ROLES[role]], self.options[role], self.device,
                                                      self.gpu_id)
        return self._predictors[role]

    def release(self) -> None:
        """Drop the predictors (each holds its own copy of the weights); re-created on next use."""
        self.on_thread(self._predictors.clear)
        self._scorer = None

    def _run(self, role: str, feeds: dict[str, paddle.Tensor]) -> list[paddle.Tensor]:
        pred = self._predictor(role)
        outs = pred.run([feeds[n] for n in pred.get_input_names()])
        restore_math_threads()  # the run set the process's count to the predictor's (runtime.py)
        order = {n: i for i, n in enumerate(pred.get_output_names())}
        return [outs[order[n]] for n in self.manifest.program(ROLES[role])["paddle_output_names"]]

    def _tensor(self, a: np.ndarray) -> paddle.Tensor:
        return paddle.to_tensor(np.ascontiguousarray(a, dtype=np.int64), place=self._place)

    def _decode_role(self, batch: int) -> str:
        return "decode_batched" if batch >= self.batched_from else "decode"

    def _bucketed(self, role: str) -> bool:
        return self.cache_bucket > 0 and self.device != "gpu" and self.options[role].onednn

    def prefill(self, input_ids: np.ndarray, attention_mask: np.ndarray):
        """Prompt (B, T) -> last logits (B, V) float32, cache."""
        return self.on_thread(self._prefill, input_ids, attention_mask)

    def decode(self, input_ids: np.ndarray, attention_mask: np.ndarray, cache: PaddleCache):
        """New tokens (B, T) with the full mask (B, S + T) -> logits (B, V), grown cache.
        A bucketed cache is updated in place: do not reuse ``cache`` after this call."""
        return self.on_thread(self._decode, input_ids, attention_mask, cache)

    def truncate_cache(self, cache: PaddleCache, length: int) -> PaddleCache:
        """The cache cut to ``length`` positions (no copy: ``decode`` reads the first ``length``)."""
        if not 0 < length <= cache.length:
            raise ValueError(f"cannot cut a cache of {cache.length} positions to {length}")
        return PaddleCache(cache.tensors, length)

    def reorder_cache(self, cache: PaddleCache, rows: np.ndarray) -> PaddleCache:
        """Gather cache rows (beam search)."""
        return self.on_thread(self._reorder_cache, cache, rows)

    def score(self, input_ids: np.ndarray, attention_mask: Optional[np.ndarray] = None) -> np.ndarray:
        """Full-sequence logits (B, T, V) float32 from the ``forward`` program."""
        return self.on_thread(self._score, input_ids, attention_mask)

    def hidden_states(self, input_ids: np.ndarray, attention_mask: Optional[np.ndarray] = None) -> np.ndarray:
        """Final hidden states (B, T, hidden) float32 from ``forward_hidden`` (``scores_positions``)."""
        return self.on_thread(self._score, input_ids, attention_mask, "forward_hidden")

    def head_scores(self, hidden: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """hidden (N, hidden) float32, labels (N,) -> log p(label) (N,) float64, argmax (N,) int64
        from ``score_head``: logits exist only for these N rows."""
        return self.on_thread(self._head_scores, hidden, labels)

    def _prefill(self, input_ids, attention_mask):
        outs = self._run("prefill", {"input_ids": self._tensor(input_ids),
                                     "attention_mask": self._tensor(attention_mask)})
        return outs[0].numpy(), PaddleCache([t.clone() for t in outs[1:]], int(input_ids.shape[1]))

    @paddle.no_grad()
    def _decode(self, input_ids, attention_mask, cache):
        batch, new = input_ids.shape
        s, tensors = cache.length, cache.tensors
        cap = int(tensors[0].shape[2])
        mask = np.asarray(attention_mask, dtype=np.int64)
        role = self._decode_role(batch)
        bucketed = self._bucketed(role)
        if bucketed:
            if s + new > cap:  # next bucket: copy into a larger zero-filled buffer
                grown = -(-(s + new) // self.cache_bucket) * self.cache_bucket
                tensors = [paddle.concat([t[:, :, :s], paddle.zeros([t.shape[0], t.shape[1], grown - s, t.shape[3]],
                                                                    dtype=t.dtype)], axis=2) for t in tensors]
                cap = grown
            # Empty slots are masked out; the new tokens' positions (cumsum of the mask) skip them.
            mask = np.concatenate([mask[:, :s], np.zeros((batch, cap - s), np.int64), mask[:, s:]], axis=1)
        elif cap != s:
            tensors = [t[:, :, :s] for t in tensors]
        feeds = {"input_ids": self._tensor(input_ids), "attention_mask": self._tensor(mask)}
        for i in range(len(self.manifest.layers)):
            feeds[f"past_key_{i}"], feeds[f"past_value_{i}"] = tensors[2 * i], tensors[2 * i + 1]
        if role == "decode" and self.split_head:
            outs = self._run("decode_hidden", feeds)
            outs[0] = self._run("lm_head", {"hidden": outs[0]})[0]
        else:
            outs = self._run(role, feeds)
        if not bucketed:
            return outs[0].numpy(), PaddleCache([t.clone() for t in outs[1:]], s + new)
        for t, present in zip(tensors, outs[1:]):  # (B, H, cap + new, D) -> slots s .. s + new
            t[:, :, s:s + new] = present[:, :, cap:cap + new]
        return outs[0].numpy(), PaddleCache(tensors, s + new)

    def _reorder_cache(self, cache, rows):
        idx = paddle.to_tensor(np.asarray(rows, dtype=np.int64), place=self._place)
        return PaddleCache([paddle.index_select(t, idx, axis=0) for t in cache.tensors], cache.length)

    def _score(self, input_ids, attention_mask, role: str = "forward"):
        """A whole-sequence program: ``forward`` (logits) or ``forward_hidden`` (hidden states)."""
        if attention_mask is None:
            attention_mask = np.ones_like(input_ids)
        outs = self._run(role, {"input_ids": self._tensor(input_ids), "attention_mask": self._tensor(attention_mask)})
        return outs[0].numpy()

    def _head_scores(self, hidden, labels):
        hidden_size = self.manifest.data.get("model", {}).get("hidden_size")
        if self._scorer is None:
            from .head_score import head_scorer

            self._scorer = self.device == "cpu" and bool(hidden_size) and head_scorer(
                self._files["score_head"], hidden_size, self.manifest.vocab_size, self._head_program) or False
        if self._scorer:
            return self._scorer(hidden, labels)
        return self._head_program(hidden, labels)

    def _head_program(self, hidden, labels):
        hidden = paddle.to_tensor(np.ascontiguousarray(hidden, dtype=np.float32), place=self._place)
        outs = self._run("score_head", {"hidden": hidden, "labels": self._tensor(labels)})
        return outs[0].numpy(), outs[1].numpy()
