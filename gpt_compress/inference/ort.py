"""onnxruntime backend: the ``Backend`` (``base.py``) over the ONNX programs of an export.

IO binding keeps the KV cache inside onnxruntime: each step's ``present_*`` outputs are
``OrtValue``s bound as the next step's ``past_*`` inputs, never copied through numpy; only the
(B, V) logits are read back. Sessions are created on first use and share the thread settings.

Thread safety: ``InferenceSession.run`` is thread-safe, but an IO binding is per call, so
concurrent calls on one backend are fine for ``score`` and for separate generations as long as
each has its own cache (the binding is created per call). ``runner.Generator`` still serialises
calls, because two parallel decodes on 2 cores only fight over them.
"""
from __future__ import annotations

import os
from typing import Optional, Union

import numpy as np
import onnxruntime as ort

from .base import Backend
from .manifest import SCORE_PROGRAMS, Manifest, ModelDirError, read_manifest, verify_files

GRAPH_OPT = {"disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
             "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
             "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
             "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL}


def session_options(threads: int = 0, graph_opt: str = "all") -> ort.SessionOptions:
    """Session options: ``threads`` intra-op threads (0: $OMP_NUM_THREADS or cores), one
    inter-op thread (the graph is a chain), the given graph optimisation level."""
    so = ort.SessionOptions()
    if threads <= 0:
        env = os.environ.get("OMP_NUM_THREADS", "")
        threads = int(env) if env.isdigit() and int(env) > 0 else (os.cpu_count() or 1)
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = GRAPH_OPT[graph_opt]
    so.log_severity_level = 3  # paddle2onnx leaves dead constants that ORT warns about at load
    return so


class OrtBackend(Backend):
    """Runs the exported ONNX programs with onnxruntime. The cache is the list of present
    ``OrtValue``s [k_0, v_0, k_1, ...], each (B, H_i, S, D)."""

    def __init__(self, model_dir: Union[str, Manifest], threads: int = 0, graph_opt: str = "all",
                 providers: Optional[list] = None, verify: bool = True):
        self.manifest = model_dir if isinstance(model_dir, Manifest) else read_manifest(model_dir)
        programs = self.manifest.data["programs"]
        # Exports from before the scoring programs score through ``forward``.
        self.scores_positions = all("onnx" in programs.get(p, {}) for p in SCORE_PROGRAMS)
        names = ("prefill", "decode", "forward") + (SCORE_PROGRAMS if self.scores_positions else ())
        self._files = {name: self.manifest.files("onnx", name) for name in names}
        if verify:
            names = sorted({os.path.basename(p) for f in self._files.values() for p in f.values()})
            verify_files(self.manifest.path, names)
        self.options = session_options(threads, graph_opt)
        self.providers = providers or ["CPUExecutionProvider"]
        self._sessions: dict[str, ort.InferenceSession] = {}
        self._n_layers = len(self.manifest.layers)

    def session(self, name: str) -> ort.InferenceSession:
        """The session of program ``name`` (created on first use)."""
        if name not in self._sessions:
            try:
                self._sessions[name] = ort.InferenceSession(self._files[name]["model"], self.options,
                                                            providers=self.providers)
            except Exception as e:  # onnxruntime raises its own Fail/InvalidGraph types
                files = self._files[name]
                raise ModelDirError(f"onnxruntime could not load {files['model']} (weights in {files['data']}): "
                                    f"{e}") from None
        return self._sessions[name]

    def release(self) -> None:
        """Drop the sessions (and the weights they hold); they are re-created on next use."""
        self._sessions.clear()

    def _run(self, name: str, arrays: dict[str, np.ndarray], values: dict[str, ort.OrtValue] = None):
        sess = self.session(name)
        binding = sess.io_binding()
        for k, a in arrays.items():
            dtype = np.float32 if a.dtype == np.float32 else np.int64  # hidden states, else ids / masks / labels
            binding.bind_cpu_input(k, np.ascontiguousarray(a, dtype=dtype))
        for k, v in (values or {}).items():
            binding.bind_ortvalue_input(k, v)
        for out in self.manifest.program(name)["outputs"]:
            binding.bind_output(out["name"], "cpu")
        sess.run_with_iobinding(binding)
        return binding.get_outputs()

    def prefill(self, input_ids: np.ndarray, attention_mask: np.ndarray):
        """Prompt (B, T) -> last logits (B, V) float32, cache."""
        outs = self._run("prefill", {"input_ids": input_ids, "attention_mask": attention_mask})
        return outs[0].numpy(), list(outs[1:])

    def decode(self, input_ids: np.ndarray, attention_mask: np.ndarray, cache):
        """New tokens (B, T) with the full mask (B, S + T) -> logits (B, V), grown cache."""
        past = {}
        for i in range(self._n_layers):
            past[f"past_key_{i}"], past[f"past_value_{i}"] = cache[2 * i], cache[2 * i + 1]
        outs = self._run("decode", {"input_ids": input_ids, "attention_mask": attention_mask}, past)
        return outs[0].numpy(), list(outs[1:])

    def truncate_cache(self, cache, length: int):
        """The cache cut to its first ``length`` positions (copied through numpy)."""
        if not 0 < length <= int(cache[0].shape()[2]):
            raise ValueError(f"cannot cut a cache of {cache[0].shape()[2]} positions to {length}")
        return [ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(v.numpy()[:, :, :length])) for v in cache]

    def reorder_cache(self, cache, rows: np.ndarray):
        """Gather cache rows (beam search); goes through numpy."""
        rows = np.asarray(rows, dtype=np.int64)
        return [ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(v.numpy()[rows])) for v in cache]

    def score(self, input_ids: np.ndarray, attention_mask: Optional[np.ndarray] = None,
              program: str = "forward") -> np.ndarray:
        """Full-sequence logits (B, T, V) float32 from the ``forward`` program (``program``: another
        whole-sequence program, ``forward_hidden``)."""
        if attention_mask is None:
            attention_mask = np.ones_like(input_ids)
        return self._run(program, {"input_ids": input_ids, "attention_mask": attention_mask})[0].numpy()

    def hidden_states(self, input_ids: np.ndarray, attention_mask: Optional[np.ndarray] = None) -> np.ndarray:
        """Final hidden states (B, T, hidden) float32 from ``forward_hidden`` (``scores_positions``)."""
        return self.score(input_ids, attention_mask, "forward_hidden")

    def head_scores(self, hidden: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """hidden (N, hidden) float32, labels (N,) -> log p(label) (N,) float64, argmax (N,) int64
        from ``score_head``: logits exist only for these N rows, inside onnxruntime."""
        outs = self._run("score_head", {"hidden": hidden, "labels": labels})
        return outs[0].numpy(), outs[1].numpy()
