"""Paddle Inference over the fused program (``export/fused.py``): the default CPU backend of
``Generator.from_dir(path, backend="paddle")`` when the export has one.

One predictor runs prefill, decode and scoring (one copy of the weights; ``clone()`` shares
it). The KV cache is ours: per layer a key and a value tensor (B, H_i, capacity, D), allocated
at prefill with room for ``reserve`` more positions and grown (one copy, to twice the capacity
up to the model's positions) only when a decode passes the capacity; the ops write each step's
keys/values into it in place. The operator library is loaded before the predictor is created
(``kernels.load_ops``); the ops use OpenMP threads (``threads``; ``DEFAULT_THREADS`` = 0:
$OMP_NUM_THREADS or all cores; one setting per process, passed as $GPTC_THREADS), so none of
``predictor.py``'s per-role thread settings apply.

Threads: unlike the unfused ``PaddleBackend`` (whose oneDNN/MKL kernels keep per-thread
state, so its calls go to one worker thread), a fused predictor runs from any thread with
bitwise the same outputs (``tests/test_fused.py``), so calls run on the caller's thread under
the backend's lock (re-entrant: ``on_thread`` nests). That saves the worker-thread hop, two context
switches per decode step. Each thread that calls owns one libgomp team of ``threads - 1``
helpers for its life; parallel serving still gives each thread its own ``clone()``.

``paddle_backend`` picks this backend or the unfused ``PaddleBackend``: ``fused=None`` (default)
uses the fused program on CPU when the export has one and falls back, with a warning naming
why, when the operators cannot be built here; ``fused=True`` requires it; ``fused=False``
never uses it.
"""
from __future__ import annotations

import os
import threading
import warnings
from dataclasses import dataclass
from typing import Optional, Union

import numpy as np

from ..errors import KernelError
from ..kernels import control as make_control
from ..runtime import GOMP_SPINCOUNT, openmp_spin, restore_math_threads
from .base import Backend, resolve_threads
from .manifest import Manifest, ModelDirError, read_manifest, verify_files

RESERVE = 128  # cache positions allocated beyond the prompt (a growth adds at least this many)
# Greedy tokens a program run may make (``decode_greedy_steps``): a run's fixed cost outside the op
# (Paddle Inference's run, the Python loop; a sizeable part of a small model's step, run
# cache-cold after the weights stream through) is paid once per run. ``generation.stream_tokens``
# and ``gptc serve`` size each run by time (``generation.run_steps``: about 25 ms, 8 to this many
# steps), so a streaming consumer gets the tokens in bursts of about 25 ms.
GREEDY_STEPS = 32
# OpenMP threads of the ops (0: $OMP_NUM_THREADS or all cores), the default. libgomp's threads
# spin only briefly at each barrier (``import gpt_compress`` sets GOMP_SPINCOUNT=2000 unless the
# user did: runtime.openmp_spin): with its default spinning, two threads on a loaded machine make
# a step many times slower than one (a spinning thread waits out a descheduled one). When libgomp
# was loaded before gpt_compress was imported (``import paddle`` first), the setting cannot take
# effect: the default then is one thread, with a warning. On a quiet machine all cores decode
# faster than one (bench/decode.py --fused-threads N compares them).
DEFAULT_THREADS = 0


@dataclass
class FusedCache:
    """[k_0, v_0, k_1, ...] paddle tensors (B, H_i, capacity, D); positions ``< length`` filled."""

    tensors: list
    length: int

    @property
    def capacity(self) -> int:
        return int(self.tensors[0].shape[2])


class FusedBackend(Backend):
    """The ``Backend`` running ``fused.json`` with Paddle Inference on CPU."""

    scores_rows = True  # the head only at the scored positions, float or int8 (``eval/scoring.py``)
    serve_decoder = "slots"  # the in-place cache takes rows in place (``serve/slots.py``)

    def __init__(self, model_dir: Union[str, Manifest], verify: bool = True, threads: int = DEFAULT_THREADS,
                 reserve: int = RESERVE, greedy_steps: int = GREEDY_STEPS):
        from ..kernels import load_ops

        self.manifest = model_dir if isinstance(model_dir, Manifest) else read_manifest(model_dir)
        info = self.manifest.data.get("fused")
        if not info:
            raise ModelDirError(f"{self.manifest.path} has no fused program; re-export it with this "
                                "gpt-compress, or pass fused=False")
        check_kernel_version(self.manifest)
        self.files = {"model": self.manifest.file(info["model"]), "params": self.manifest.file(info["params"])}
        if verify:
            verify_files(self.manifest.path, [info["model"], info["params"]])
        load_ops()  # registers the operators: before the predictor is created
        self.layers = self.manifest.layers
        self.threads, self.reserve = resolve_threads(threads), reserve
        # Greedy steps per program run (``decode_greedy_steps``); a tensor-parallel rank program
        # (``export/fused_tp.py``: collectives between its ops) has no ``control`` input and runs one.
        self.controlled = "control" in info.get("inputs", ("control",))
        self.greedy_steps = max(1, greedy_steps) if self.controlled else 1
        self.draft_vocab = int(info.get("draft_vocab", 0)) if self.controlled else 0
        self.cache_dtype = info.get("cache_dtype", "float32")  # the program's KV cache elements
        if self.threads > 1 and not openmp_spin():
            asked = f"{self.threads} threads as asked" if threads else "1 thread"
            if not threads:
                self.threads = 1
            warnings.warn("libgomp (the fused operators' OpenMP runtime) was loaded before gpt_compress was "
                          "imported (import paddle loads it), so it ignores gpt-compress's GOMP_SPINCOUNT="
                          f"{GOMP_SPINCOUNT} and its threads spin at every barrier: on a busy machine two threads "
                          f"ran 10x slower than one. Running the ops on {asked}; import gpt_compress before "
                          "paddle, or set GOMP_SPINCOUNT or OMP_WAIT_POLICY in the environment, to use all "
                          "threads safely", stacklevel=3)
        # The ops' OpenMP runtime is not Paddle's: they read their thread count from here (one
        # value per process: the last backend created sets it).
        os.environ["GPTC_THREADS"] = str(self.threads)
        self._lock = threading.RLock()
        self._pred = self._create()
        self._io, self._bound = None, []  # the predictor's handles (made on first run); cache tensors bound

    def _create(self):
        from .predictor import ProgramOptions, create_predictor  # plain CPU kernels, no oneDNN

        return create_predictor(self.files, ProgramOptions(threads=self.threads))

    def on_thread(self, fn, *args):
        """Run ``fn(*args)`` on the calling thread, one call of this backend at a time."""
        with self._lock:
            return fn(*args)

    def _init_clone(self, source: "FusedBackend") -> None:
        """Own lock, own predictor (sharing ``source``'s weights), no handles bound yet."""
        self._lock = threading.RLock()
        self._pred = source._pred.clone()
        self._io, self._bound = None, []

    # ------------------------------------------------------------------ cache
    def _alloc(self, batch: int, capacity: int) -> list:
        """Uninitialised: the ops read a cached position only once it is written and unmasked
        (attention walks each row's unmasked keys, all below the mask's width)."""
        import paddle

        return [paddle.empty([batch, layer["heads"], capacity, layer["head_dim"]], dtype=self.cache_dtype)
                for layer in self.layers for _ in range(2)]

    def _capacity(self, needed: int) -> int:
        return min(max(needed, self.manifest.max_positions), needed + self.reserve)

    def _grown(self, capacity: int, needed: int) -> int:
        """A full cache's new capacity: doubled (up to the model's positions), at least
        ``_capacity(needed)``, so a long generation copies its cache a few times, not once
        per ``reserve`` positions (each copy moves every position cached so far)."""
        return max(self._capacity(needed), min(2 * capacity, max(needed, self.manifest.max_positions)))

    # ------------------------------------------------------------------ runs
    def _run(self, ids: np.ndarray, mask: np.ndarray, rows: np.ndarray, caches: list,
             tokens: bool = False, control: Optional[np.ndarray] = None) -> np.ndarray:
        """One program run through the predictor's input/output handles: the three int64 inputs
        copied in, the cache tensors shared (bound again only when they are not the previous
        run's tensors: a decode step binds nothing), the logits copied out. Per batch-1 step
        this saves the three ``paddle.to_tensor`` and most of ``Predictor.run(list)``'s own
        cost (bench/kernels.py's ``decode_wrapper``). ``tokens``: the argmax per row instead of
        the logits (the program's second output: ``np.argmax``'s choice); with ``control``
        (``decode_greedy_steps``) the (n, steps) tokens."""
        if self._io is None:
            names = self._pred.get_input_names()
            self._io = ([self._pred.get_input_handle(n) for n in names],
                        [self._pred.get_output_handle(n) for n in self._pred.get_output_names()])
        inputs, outputs = self._io
        for handle, arr in zip(inputs, (ids, mask, rows)):
            handle.copy_from_cpu(np.ascontiguousarray(arr, dtype=np.int64))
        if self.controlled:  # ``control`` last: one step unless asked for more
            inputs[-1].copy_from_cpu(control if control is not None else make_control(ids.shape[0]))
        bound = self._bound
        if len(bound) != len(caches) or any(a is not b for a, b in zip(bound, caches)):
            for handle, tensor in zip(inputs[3:], caches):
                handle.share_external_data(tensor)
            self._bound = list(caches)  # the predictor's inputs hold these tensors' memory until rebound
        self._pred.run()
        restore_math_threads()  # the run set the process's count to the predictor's (runtime.py)
        if not tokens:
            return outputs[0].copy_to_cpu()
        out = outputs[1].copy_to_cpu()  # (n, steps)
        return out if control is not None else out.reshape(-1)

    def prefill(self, input_ids: np.ndarray, attention_mask: np.ndarray):
        """Prompt (B, T) -> last logits (B, V) float32, cache."""
        return self.on_thread(self._prefill, input_ids, attention_mask)

    def _prefill(self, input_ids, attention_mask):
        b, t = input_ids.shape
        caches = self._alloc(b, self._capacity(t))
        logits = self._run(input_ids, attention_mask, np.arange(b) * t + t - 1, caches)
        return logits, FusedCache(caches, t)

    def decode(self, input_ids: np.ndarray, attention_mask: np.ndarray, cache: FusedCache):
        """New tokens (B, T) with the full mask (B, S + T) -> logits (B, V), the cache (updated in
        place: do not reuse the old one)."""
        return self.on_thread(self._decode, input_ids, attention_mask, cache)

    def decode_greedy(self, input_ids: np.ndarray, attention_mask: np.ndarray, cache: FusedCache):
        """``decode``'s argmax token per row (B,) int64 (``np.argmax``'s choice) and the cache: the
        program's token output when it has one (the logits stay in the predictor), else the
        argmax of the logits."""
        return self.on_thread(self._decode, input_ids, attention_mask, cache, True)

    def decode_greedy_steps(self, input_ids: np.ndarray, attention_mask: np.ndarray, cache: FusedCache,
                            steps: int, eos_token_id: Optional[int], pad_token_id: int, finished: np.ndarray,
                            suppress_eos: int = 0, draft_vocab: bool = False):
        """``steps`` greedy decode steps in one program run (``greedy_steps`` says how many a
        caller should ask for): feeds ``input_ids`` (B, T) with ``attention_mask`` (B, S + T)
        (T > 1: tokens not cached yet, then the step at the last of them), then each step's
        tokens with one more mask column of ones. Returns the tokens (B, steps) int64, each
        ``np.argmax`` of its logits, ``pad_token_id`` for rows ``finished`` (B,) bool before the
        call or by an earlier step's ``eos_token_id`` (as ``generation.stream_tokens`` step by
        step), and the cache, now holding S + T - 1 + steps positions. The first
        ``suppress_eos`` steps never choose ``eos_token_id`` (``min_new_tokens``: its logit taken
        as -inf). ``draft_vocab``: the tokens are the argmax over the program's draft vocabulary
        (``self.draft_vocab`` tokens; only their head rows are computed), the logits kept are -inf
        outside it."""
        if not self.controlled:
            raise ValueError(f"{self.manifest.path}: its fused program runs one step a call (greedy_steps is 1)")
        if draft_vocab and not self.draft_vocab:
            raise ValueError(f"{self.manifest.path}: its fused program has no draft vocabulary")
        control = make_control(len(finished), steps, eos_token_id, pad_token_id, suppress_eos, finished, draft_vocab)
        return self.on_thread(self._decode, input_ids, attention_mask, cache, True, control)

    def decode_positions(self, input_ids: np.ndarray, attention_mask: np.ndarray, cache: FusedCache):
        """New tokens (B, T) with the full mask (B, S + T) -> logits at every new position (B, T, V)
        in one program run (speculative decoding's verify step: the arithmetic of each position is
        bitwise that of feeding them one by one), the cache (updated in place)."""
        return self.on_thread(self._decode, input_ids, attention_mask, cache, False, None, True)

    def decode_positions_greedy(self, input_ids: np.ndarray, attention_mask: np.ndarray, cache: FusedCache):
        """``decode_positions``' argmax at every new position (B, T), from the program's token
        output (the logits stay in the predictor), and the cache."""
        tokens, cache = self.on_thread(self._decode, input_ids, attention_mask, cache, True, None, True)
        return tokens.reshape(input_ids.shape), cache

    def truncate_cache(self, cache: FusedCache, length: int) -> FusedCache:
        """The cache cut to ``length`` positions: only its length changes (the next run overwrites
        the positions past it)."""
        if not 0 < length <= cache.length:
            raise ValueError(f"cannot cut a cache of {cache.length} positions to {length}")
        cache.length = length
        return cache

    def _decode(self, input_ids, attention_mask, cache, tokens: bool = False, control=None, every: bool = False):
        b, t = input_ids.shape
        steps = t - 1 + int(control[0]) if control is not None else t  # positions the cache gains
        if attention_mask.shape[1] != cache.length + t:
            raise ValueError(f"attention_mask has {attention_mask.shape[1]} columns; the cache holds "
                             f"{cache.length} positions + {t} new")
        need = cache.length + steps
        if need > cache.capacity:  # grow (``_grown``): one copy
            grown = self._alloc(b, self._grown(cache.capacity, need))
            for new, old in zip(grown, cache.tensors):
                new[:, :, :cache.length] = old[:, :, :cache.length]
            cache = FusedCache(grown, cache.length)
        rows = np.arange(b * t) if every else np.arange(b) * t + t - 1
        out = self._run(input_ids, attention_mask, rows, cache.tensors, tokens, control)
        cache.length = need
        return (out.reshape(b, t, -1) if every else out), cache

    def reorder_cache(self, cache: FusedCache, rows: np.ndarray) -> FusedCache:
        """Gather cache rows (beam search): new tensors."""
        return self.on_thread(self._reorder, cache, rows)

    def _reorder(self, cache, rows):
        import paddle

        idx = paddle.to_tensor(np.asarray(rows, dtype=np.int64))
        return FusedCache([paddle.index_select(t, idx, axis=0) for t in cache.tensors], cache.length)

    def score(self, input_ids: np.ndarray, attention_mask: Optional[np.ndarray] = None) -> np.ndarray:
        """Full-sequence logits (B, T, V) float32."""
        return self.on_thread(self._score, input_ids, attention_mask)

    def _score(self, input_ids, attention_mask):
        b, t = input_ids.shape
        return self._logits_at(input_ids, attention_mask, np.arange(b * t)).reshape(b, t, -1)

    def logits_at(self, input_ids: np.ndarray, attention_mask: Optional[np.ndarray], rows: np.ndarray) -> np.ndarray:
        """Logits (n, V) float32 at the flat positions ``rows`` (n,) of ``input_ids`` (B, T)
        (``b * T + t``): the body runs on the whole batch, the LM head only at those rows."""
        return self.on_thread(self._logits_at, input_ids, attention_mask, rows)

    def _logits_at(self, input_ids, attention_mask, rows):
        b, t = input_ids.shape
        if attention_mask is None:
            attention_mask = np.ones_like(input_ids)
        return self._run(input_ids, attention_mask, rows, self._alloc(b, t))


def check_kernel_version(manifest: Manifest) -> None:
    """Raise ``ModelDirError`` (one line: what to run) when ``manifest``'s fused program is of
    another kernel version than the operators run (``kernels.KERNEL_VERSION``)."""
    from ..kernels import KERNEL_VERSION

    version = manifest.data.get("fused", {}).get("kernel", {}).get("version")
    if version != KERNEL_VERSION:
        raise ModelDirError(f"{manifest.path}: its fused program is of kernel version {version}, and this "
                            f"gpt-compress runs version {KERNEL_VERSION} only; export it again from its checkpoint "
                            f"(gptc export --model CHECKPOINT --output {manifest.path} --overwrite), or run the "
                            "unfused programs (--no-fused, fused=False)")


def paddle_backend(manifest: Manifest, fused: Optional[bool] = None, verify: bool = True, **options):
    """The Paddle Inference backend for ``manifest``: ``FusedBackend`` or ``PaddleBackend`` (see the
    module docstring). ``options`` go to the chosen backend (``threads`` to the fused one)."""
    device = options.get("device", "cpu")
    has_fused = bool(manifest.data.get("fused")) and device == "cpu"
    if fused is True and not has_fused:
        raise ModelDirError(f"{manifest.path} has no fused CPU program (device={device!r}); re-export it with "
                            "this gpt-compress or pass fused=False")
    if has_fused and fused is not False:
        fused_opts = {k: options[k] for k in ("threads", "reserve", "greedy_steps") if k in options}
        try:
            return FusedBackend(manifest, verify=verify, **fused_opts)
        except KernelError as e:
            if fused:
                raise
            warnings.warn(f"running the unfused Paddle programs: {e}", stacklevel=2)
    from .predictor import PaddleBackend

    options = {k: v for k, v in options.items() if k not in ("threads", "reserve", "greedy_steps")}
    return PaddleBackend(manifest, verify=verify, **options)
