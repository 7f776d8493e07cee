"""Export validation: the exported programs must reproduce the dygraph model's logits.

``reference(model)`` runs the dygraph model once on a small left-padded batch (before the export
mutates it); ``validate_backend`` compares any runner's prefill, decode and scoring logits with
that reference, ``validate_dir`` does so for every format of an export directory (and the fused
Paddle program when there is one). The float,
int8 and tensor-parallel exports all go through ``validate_backend``, inside their atomic write:
a directory that fails is never renamed into place.
"""
from __future__ import annotations

import gc
from typing import Sequence

import numpy as np
import paddle

from ..errors import ExportError
from ..inference.manifest import read_manifest


def _backend(fmt: str):
    # Both imported when an export is validated, not with this module: onnxruntime is optional
    # (the `onnx` extra), and loading Paddle Inference before ``reference`` runs changes the
    # dygraph reference's float rounding (seen as different int8 validation differences).
    if fmt == "paddle":
        from ..inference.predictor import PaddleBackend

        return PaddleBackend
    from ..inference.ort import OrtBackend

    return OrtBackend


def reference(model, seed: int = 0):
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


def _detached(cache):
    """onnxruntime's present ``OrtValue``s keep the session that made them (and its weights) alive:
    copy them so that ``release`` frees it before the next program loads (one runtime at a time)."""
    if isinstance(cache, list) and cache and type(cache[0]).__name__ == "OrtValue":
        import onnxruntime as ort

        return [ort.OrtValue.ortvalue_from_numpy(v.numpy()) for v in cache]
    return cache


def validate_backend(backend, ref, where: str, atol: float = 1e-4) -> float:
    """Compare a runner's prefill/decode/score with dygraph ``ref``; raise ``ExportError`` beyond
    ``atol`` (relative to the logits' magnitude). Returns the max abs diff."""
    ids, mask, full, nxt, step = ref
    # One program's runtime at a time: each predictor/session holds its own copy of the weights.
    release = backend.release
    logits, cache = backend.prefill(ids, mask)
    cache = _detached(cache)
    release()
    got = [(logits, full[:, -1]), (backend.score(ids, mask), full)]
    release()
    logits, _ = backend.decode(nxt, np.concatenate([mask, np.ones_like(nxt)], 1), cache)
    release()
    got.append((logits, step))
    if backend.scores_positions:  # the scoring programs, at the real positions
        real, labels = mask > 0, np.roll(ids, -1, axis=1)
        hidden = backend.hidden_states(ids, mask)[real]
        release()
        lp, _ = backend.head_scores(hidden, labels[real])
        release()
        top = full.max(axis=-1, keepdims=True)
        ref_lp = np.take_along_axis(full, labels[..., None], -1)[..., 0] - top[..., 0] - np.log(
            np.exp(full - top).sum(-1, dtype=np.float64))
        got.append((lp, ref_lp[real]))
    if backend.scores_rows:  # the fused program's head at chosen rows only
        got.append((backend.logits_at(ids, mask, np.flatnonzero(mask)), full[mask > 0]))
    # Padded query rows attend to nothing real; their logits are meaningless, compare real rows.
    diffs = [float(np.max(np.abs(np.where(mask[..., None] > 0, a - b, 0) if a.ndim == 3 else a - b)))
             for a, b in got]
    scale = max(1.0, float(np.max(np.abs(full))))
    if max(diffs) > atol * scale:
        raise ExportError(f"{where}: exported logits differ from dygraph by {max(diffs):.3g} "
                          f"(prefill, score, decode[, scoring log-probabilities or rows' logits]: "
                          f"{', '.join(f'{d:.3g}' for d in diffs)}; "
                          f"tolerance {atol * scale:.3g})")
    return max(diffs)


# A bfloat16 KV cache (``fused.CACHE_DTYPES``) holds every key and value to 8 significant bits,
# a relative error of at most u = 2^-9 each; attention averages the values and exponentiates the
# scores, so the logits move by up to about u relative to their magnitude (measured against the
# float32 cache: 0.9 u on a random-init gpt-bench, 0.14 u on the tests' trained model). Its
# fused program is checked at 4 u more than the export's own tolerance.
BF16_CACHE_ATOL = 4 * 2.0 ** -9


def fused_atol(atol: float, cache_dtype: str) -> float:
    """The fused program's relative tolerance: ``atol``, plus ``BF16_CACHE_ATOL`` for a bfloat16 cache."""
    return atol + BF16_CACHE_ATOL if cache_dtype == "bfloat16" else atol


def validate_dir(path: str, ref, formats: Sequence[str], atol: float = 1e-4, hint: str = "") -> dict[str, float]:
    """Run each exported format of directory ``path`` on the reference batch; returns the max abs
    logit difference per format, raises ``ExportError`` (with ``hint`` appended) on mismatch."""
    manifest = read_manifest(path)
    out = {}
    for fmt in formats:
        backend = _backend(fmt)(manifest, verify=False)
        try:
            out[fmt] = validate_backend(backend, ref, f"{path} ({fmt})", atol=atol)
        except ExportError as e:
            if not hint:
                raise
            raise ExportError(f"{e}. {hint}") from None
        finally:
            del backend  # one runtime at a time
            gc.collect()
    if "paddle" in formats and manifest.data.get("fused"):
        from ..inference.fused import FusedBackend

        backend = FusedBackend(manifest, verify=False)
        try:
            out["paddle_fused"] = validate_backend(backend, ref, f"{path} (paddle, fused)",
                                                   atol=fused_atol(atol, backend.cache_dtype))
        except ExportError as e:
            raise ExportError(f"{e}. {hint}" if hint else str(e)) from None
    return out
