"""One runner API over every backend: ``Generator.from_dir(path, backend=...)``.

    gen = Generator.from_dir("export/", backend="onnx")        # or "paddle"; "dygraph" takes a checkpoint
    out = gen.generate(["To be, or not", "ROMEO:"], max_new_tokens=32, decode_strategy="sampling", top_p=0.9)
    for piece in gen.stream_text("ROMEO:", max_new_tokens=32):  # text as it is produced
        print(piece, end="", flush=True)
    logits = gen.score(input_ids, attention_mask)               # (B, T, V) for evaluation
    if gen.scores_positions:                                    # logits only where they are scored:
        hidden = gen.hidden_states(input_ids, attention_mask)   # (B, T, hidden), then for chosen rows
        logprob, argmax = gen.head_scores(hidden[sel], labels[sel])  # (N,) each
    if gen.scores_rows:                                         # the fused program: head at flat rows
        logits = gen.logits_at(input_ids, attention_mask, rows) # (n, V)
    out = gen.generate(prompts, draft="ngram")                  # speculative: "ngram", "auto", a dir

Decoding itself (greedy, sampling, top-k/top-p, repetition penalty, beam search) is
``model/generation.py``, shared by all backends; a backend only runs the network.

Importing this module loads neither the model code nor the training stack: the "paddle"
backend imports ``paddle.inference``, the "onnx" backend only onnxruntime.

Thread safety: one ``Generator`` may be called from several threads; calls are **serialised**
by a lock (a streaming iterator holds it until it is exhausted or closed), because a Paddle
predictor must not run two requests at once and two parallel decodes on a 2-core machine only
slow each other. For parallel serving build one Generator per thread (``PaddleBackend.clone()``
shares weights).
"""
from __future__ import annotations

import dataclasses
import os
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import numpy as np

from ..config import GenerationConfig
from ..data.tokenizer import encode_prompts
from ..model.generation import beam_search, best_of, check_logit_bias, collect_sequences, stream_tokens
from ..model.speculative import (DRAFT_TOKENS, ModelDraft, NgramDraft, SpeculationStats, check_config,
                                 speculative_tokens)
from .manifest import InputError, ModelDirError, check_prompts, read_manifest

Prompt = Union[str, Sequence[int]]
BACKENDS = ("paddle", "onnx", "dygraph")


@dataclass
class Generated:
    """Result of ``Generator.generate``: new tokens per prompt (EOS included if produced)."""

    sequences: list[list[int]]
    texts: Optional[list[str]]  # decoded new tokens, when the model has a tokenizer
    prompt_tokens: list[int]  # prompt lengths after encoding (and truncation)
    scores: Optional[list[float]]  # beam search: length-normalised log-probability of each result
    seconds: float
    speculation: Optional[dict] = None  # with a draft: ``SpeculationStats.as_dict()``

    @property
    def tokens_per_s(self) -> float:
        """New tokens of all prompts per second of wall time (prefill included)."""
        return sum(len(s) for s in self.sequences) / max(self.seconds, 1e-9)


def special_ids(cfg: GenerationConfig, eos: Optional[int], pad: int, vocab_size: int) -> tuple[Optional[int], int]:
    """(EOS, pad) ids to decode with: ``cfg``'s when set, else the model's ``eos``/``pad``, kept
    inside the vocabulary."""
    eos = cfg.eos_token_id if cfg.eos_token_id is not None else eos
    if eos is not None and not 0 <= eos < vocab_size:
        eos = None  # e.g. GPT-2's 50256 on a small-vocabulary model: it can never be produced
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else pad
    if not 0 <= pad < vocab_size:
        # Padding is masked out, but the embedding lookup still reads it: keep it in range.
        pad = eos if eos is not None else 0
    return eos, pad


def _load_tokenizer(path: str):
    from ..data.tokenizer import Tokenizer

    return Tokenizer.load(path)


class Generator:
    """Generation and scoring over one ``Backend`` (``base.py``)."""

    def __init__(self, backend, *, vocab_size: int, max_positions: int, eos_token_id: Optional[int],
                 pad_token_id: int, tokenizer=None, name: str = "", prompt_tokens: int = 0,
                 prompt_template: str = "", recorded_draft: Optional[str] = None):
        self.backend = backend
        # > 0: the model was finetuned with prompts fixed to this many tokens; text prompts get the same.
        self.prompt_tokens = prompt_tokens
        # The template its finetuning prompts were made from (Finetune.prompt_template); "": none recorded.
        self.prompt_template = prompt_template
        self.vocab_size, self.max_positions = vocab_size, max_positions
        self.eos_token_id, self.pad_token_id = eos_token_id, pad_token_id
        self.tokenizer = tokenizer
        self.name = name
        self.kind = name.partition(":")[0]  # the backend name of ``from_dir``, else ""
        self.recorded_draft = recorded_draft  # the draft an export's manifest names (``draft="auto"``)
        self._lock = threading.Lock()
        self._drafts: dict = {}  # draft path -> its Generator (``draft_for``)
        self._same_tokenizer: weakref.WeakSet = weakref.WeakSet()  # drafts whose tokenizer was compared

    @classmethod
    def from_dir(cls, path: str, backend: str = "paddle", tokenizer=None, verify: bool = True,
                 **options: Any) -> "Generator":
        """Load an exported directory ("paddle", "onnx") or a checkpoint directory ("dygraph").
        ``options`` go to the backend (e.g. ``threads`` for onnx, ``options``/``device`` for paddle;
        ``fused=False`` runs the unfused Paddle programs, see ``inference/fused.py``).
        ``tokenizer``: a Tokenizer, a directory holding one, or None for the model directory's."""
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
        path = os.fspath(path)
        if backend == "dygraph":
            from ..checkpoint import read_prompt_template, read_prompt_tokens
            from ..qat.quantize import load_any
            from .dygraph import DygraphBackend

            model = load_any(path, verify=verify)  # a quantized checkpoint runs as its fake-quant model
            cfg = model.config
            runner = DygraphBackend(model)
            info = dict(vocab_size=cfg.vocab_size, max_positions=cfg.max_position_embeddings,
                        eos_token_id=cfg.eos_token_id, pad_token_id=cfg.pad_token_id,
                        prompt_tokens=read_prompt_tokens(path), prompt_template=read_prompt_template(path))
            has_tok = os.path.isfile(os.path.join(path, "tokenizer.json"))
        else:
            manifest = read_manifest(path)
            if backend == "paddle":
                from .fused import paddle_backend  # the fused CPU program when the export has one

                runner = paddle_backend(manifest, verify=verify, **options)
            else:
                from .ort import OrtBackend

                runner = OrtBackend(manifest, verify=verify, **options)
            info = dict(vocab_size=manifest.vocab_size, max_positions=manifest.max_positions,
                        eos_token_id=manifest.eos_token_id, pad_token_id=manifest.pad_token_id,
                        prompt_tokens=manifest.prompt_tokens, prompt_template=manifest.prompt_template)
            has_tok = bool(manifest.data.get("tokenizer"))
            recorded = manifest.data.get("draft", {}).get("path")  # `gptc pipeline`'s draft stage
            info["recorded_draft"] = os.path.normpath(os.path.join(path, recorded)) if recorded else None
        if isinstance(tokenizer, (str, os.PathLike)):
            tokenizer = _load_tokenizer(tokenizer)
        elif tokenizer is None and has_tok:
            tokenizer = _load_tokenizer(path)
        return cls(runner, tokenizer=tokenizer, name=f"{backend}:{path}", **info)

    # ------------------------------------------------------------------ inputs
    def encode(self, prompts: Union[Prompt, Sequence[Prompt]]) -> list[list[int]]:
        """Token ids of one prompt or a list of prompts (strings need the tokenizer). A string is
        fixed to ``prompt_tokens`` tokens when the model records them (``encode_prompts``, as in
        its finetuning); token ids are used as given."""
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple, np.ndarray)) and len(prompts) > 0
                                        and isinstance(prompts[0], (int, np.integer))):
            prompts = [prompts]
        texts = [p for p in prompts if isinstance(p, str)]
        if texts and self.tokenizer is None:
            raise InputError(f"{self.name} has no tokenizer: pass token-id lists or a tokenizer")
        encoded = iter(encode_prompts(self.tokenizer, texts, self.prompt_tokens) if texts else [])
        return [[int(t) for t in (next(encoded) if isinstance(p, str) else p)] for p in prompts]

    def _config(self, config: Optional[GenerationConfig], sampling: dict) -> GenerationConfig:
        cfg = dataclasses.replace(config) if config is not None else GenerationConfig()
        names = {f.name for f in dataclasses.fields(GenerationConfig)}
        unknown = sorted(set(sampling) - names)
        if unknown:
            raise TypeError(f"unknown sampling option(s) {', '.join(unknown)}; valid: {', '.join(sorted(names))}")
        cfg = dataclasses.replace(cfg, **sampling)
        if cfg.max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be >= 1, got {cfg.max_new_tokens}")
        if cfg.decode_strategy == "beam_search" and cfg.num_beams < 1:
            raise InputError(f"num_beams must be >= 1, got {cfg.num_beams}")
        check_logit_bias(cfg.logit_bias, self.vocab_size)
        return cfg

    def _prepare(self, prompts, config, sampling, truncate):
        cfg = self._config(config, sampling)
        ids = check_prompts(self.encode(prompts), self.vocab_size, self.max_positions, cfg.max_new_tokens, truncate)
        eos, pad = special_ids(cfg, self.eos_token_id, self.pad_token_id, self.vocab_size)
        return cfg, ids, eos, pad

    # ------------------------------------------------------------------ speculative decoding
    def draft_for(self, draft: Union[str, "Generator"]):
        """The speculative draft named by ``draft``: ``"ngram"`` (prompt lookup), ``"auto"`` (the
        draft the export's manifest records: `gptc pipeline`), the path of an export or checkpoint
        with the same tokenizer (loaded once, on this generator's backend), or a ``Generator``."""
        if isinstance(draft, str) and draft == "ngram":
            return NgramDraft()
        if isinstance(draft, str) and draft == "auto":
            if not self.recorded_draft:
                raise InputError(f"{self.name} records no draft (gptc pipeline's draft stage writes one); "
                                 "pass a model directory or 'ngram'")
            draft = self.recorded_draft
        if isinstance(draft, (str, os.PathLike)):
            path = os.fspath(draft)
            if path not in self._drafts:
                if not os.path.isdir(path):
                    raise InputError(f"draft {path!r} is neither 'ngram' nor a model directory")
                self._drafts[path] = Generator.from_dir(path, backend=self.kind or "paddle")
            draft = self._drafts[path]
        if not isinstance(draft, Generator):
            raise InputError(f"draft must be 'ngram', a model directory or a Generator, got {type(draft).__name__}")
        if draft.vocab_size != self.vocab_size:
            raise InputError(f"draft {draft.name} has a vocabulary of {draft.vocab_size} tokens, the model "
                             f"{self.vocab_size}: a draft needs the same tokenizer")
        if draft not in self._same_tokenizer:  # once per draft: serializing a 50k vocabulary takes ~40 ms
            if (draft.tokenizer is not None and self.tokenizer is not None
                    and draft.tokenizer.to_json() != self.tokenizer.to_json()):
                raise InputError(f"draft {draft.name} has another tokenizer than {self.name}")
            self._same_tokenizer.add(draft)
        return ModelDraft(draft.backend)

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: Union[Prompt, Sequence[Prompt]], *, config: Optional[GenerationConfig] = None,
                 truncate: bool = False, on_tokens: Optional[Callable[[np.ndarray], None]] = None,
                 draft: Union[str, "Generator", None] = None, draft_tokens: int = DRAFT_TOKENS,
                 adaptive: bool = True, **sampling: Any) -> Generated:
        """Generate for one prompt or a batch (strings or token-id lists, any lengths).
        ``sampling``: ``GenerationConfig`` fields (decode_strategy, max_new_tokens, temperature,
        top_k, top_p, repetition_penalty, presence_penalty, frequency_penalty, logit_bias,
        num_beams, length_penalty, seed, ...).
        ``on_tokens(step_tokens (B,))`` is called as tokens are produced (not for beam search nor
        ``best_of``).
        ``truncate`` keeps the end of a prompt too long for the context instead of raising.
        ``draft`` (``draft_for``): speculative decoding, up to ``draft_tokens`` proposals per
        target step (``adaptive``: fewer while they are rejected); greedy output is the same token
        for token, sampled output has the same distribution (``model/speculative.py``)."""
        cfg, ids, eos, pad = self._prepare(prompts, config, sampling, truncate)
        proposer = self.draft_for(draft) if draft is not None else None
        if proposer is not None:
            check_config(cfg)  # before any work: beam search, best_of and the history penalties are refused
        stats = SpeculationStats()
        with self._lock:
            t0 = time.perf_counter()
            if cfg.decode_strategy == "beam_search" and proposer is None:
                out = beam_search(self.backend, ids, cfg, eos, pad)
                seqs, scores = out.sequences, out.scores
            elif cfg.best_of > 1:
                seqs, scores = best_of(self.backend, ids, cfg, eos, pad).sequences, None
            else:
                steps = (stream_tokens(self.backend, ids, cfg, eos, pad) if proposer is None else
                         speculative_tokens(self.backend, proposer, ids, cfg, eos, pad, draft_tokens, adaptive, stats))
                seqs, scores = collect_sequences(steps, len(ids), eos, on_tokens), None
            seconds = time.perf_counter() - t0
        texts = [self.tokenizer.decode(s) for s in seqs] if self.tokenizer is not None else None
        return Generated(sequences=seqs, texts=texts, prompt_tokens=[len(p) for p in ids], scores=scores,
                         seconds=seconds, speculation=stats.as_dict() if proposer is not None else None)

    def stream(self, prompts: Union[Prompt, Sequence[Prompt]], *, config: Optional[GenerationConfig] = None,
               truncate: bool = False, draft: Union[str, "Generator", None] = None,
               draft_tokens: int = DRAFT_TOKENS, adaptive: bool = True, **sampling: Any) -> Iterator[np.ndarray]:
        """Iterator over each step's new tokens (B,) as they are produced (greedy/sampling);
        rows that already finished yield the pad id. Inputs are checked now; the iterator holds
        the lock from its first step until it is exhausted or closed. ``draft``: as ``generate``
        (a step's tokens come once every unfinished row has them)."""
        cfg, ids, eos, pad = self._prepare(prompts, config, sampling, truncate)
        if cfg.decode_strategy == "beam_search" or cfg.best_of > 1:
            what = "beam search" if cfg.decode_strategy == "beam_search" else "best_of"
            raise InputError(f"{what} does not stream; call generate()")
        proposer = self.draft_for(draft) if draft is not None else None
        return self._locked_stream(ids, cfg, eos, pad, proposer, draft_tokens, adaptive)

    def _locked_stream(self, ids, cfg, eos, pad, proposer=None, k: int = DRAFT_TOKENS,
                       adaptive: bool = True) -> Iterator[np.ndarray]:
        with self._lock:
            if proposer is None:
                yield from stream_tokens(self.backend, ids, cfg, eos, pad)
            else:
                yield from speculative_tokens(self.backend, proposer, ids, cfg, eos, pad, k, adaptive)

    def stream_text(self, prompt: Prompt, **kwargs: Any) -> Iterator[str]:
        """Iterator over decoded text pieces of one prompt's continuation (needs the tokenizer).
        A piece is held back while it ends inside a multi-byte character."""
        if self.tokenizer is None:
            raise InputError(f"{self.name} has no tokenizer; use stream() for token ids")
        steps = self.stream([prompt] if isinstance(prompt, str) else [list(prompt)], **kwargs)
        return self._text_pieces(steps)

    def _text_pieces(self, steps: Iterator[np.ndarray]) -> Iterator[str]:
        tokens: list[int] = []
        shown = ""
        try:
            for step in steps:
                tokens.append(int(step[0]))
                if self.eos_token_id is not None and tokens[-1] == self.eos_token_id:
                    break
                text = self.tokenizer.decode(tokens)
                if text.endswith("\ufffd"):
                    continue
                yield text[len(shown):]
                shown = text
        finally:
            steps.close()  # releases the lock now, not at garbage collection

    # ------------------------------------------------------------------ scoring
    def score(self, input_ids: np.ndarray, attention_mask: Optional[np.ndarray] = None) -> np.ndarray:
        """Logits (B, T, V) float32 for every position of ``input_ids`` (B, T); ``attention_mask``
        marks real tokens (left or right padding)."""
        input_ids, attention_mask = self._check_scoring(input_ids, attention_mask)
        with self._lock:
            return self.backend.score(input_ids, attention_mask)

    @property
    def scores_positions(self) -> bool:
        """True when the backend has ``hidden_states`` + ``head_scores`` (float and int8 exports
        with the scoring programs, and dygraph); else evaluation takes ``logits_at`` (``scores_rows``)
        or ``score``'s full logits (``eval/scoring.py``)."""
        return bool(self.backend.scores_positions)

    def hidden_states(self, input_ids: np.ndarray, attention_mask: Optional[np.ndarray] = None) -> np.ndarray:
        """Final hidden states (B, T, hidden) float32 (needs ``scores_positions``)."""
        input_ids, attention_mask = self._check_scoring(input_ids, attention_mask)
        with self._lock:
            return self.backend.hidden_states(input_ids, attention_mask)

    def head_scores(self, hidden: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The LM head at N chosen positions: hidden (N, hidden), labels (N,) -> log p(label) (N,)
        float64 and the argmax token (N,) int64; the (N, V) logits never leave the backend."""
        hidden = np.ascontiguousarray(hidden, dtype=np.float32)
        labels = np.asarray(labels, dtype=np.int64)
        if hidden.ndim != 2 or labels.shape != hidden.shape[:1]:
            raise InputError(f"head_scores wants hidden (N, hidden) and labels (N,), got {hidden.shape} "
                             f"and {labels.shape}")
        if labels.size and (labels.min() < 0 or labels.max() >= self.vocab_size):
            raise InputError(f"labels has token ids outside the vocabulary [0, {self.vocab_size})")
        with self._lock:
            return self.backend.head_scores(hidden, labels)

    @property
    def scores_rows(self) -> bool:
        """True when the backend has ``logits_at`` (the fused Paddle program, float or int8): the
        body runs on the batch and the LM head only at chosen rows, in one call."""
        return bool(self.backend.scores_rows)

    def logits_at(self, input_ids: np.ndarray, attention_mask: Optional[np.ndarray], rows: np.ndarray) -> np.ndarray:
        """Logits (n, V) float32 at the flat positions ``rows`` (``b * T + t``) of ``input_ids``
        (B, T) (needs ``scores_rows``)."""
        input_ids, attention_mask = self._check_scoring(input_ids, attention_mask)
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        if rows.size and (rows.min() < 0 or rows.max() >= input_ids.size):
            raise InputError(f"rows must index the {input_ids.size} positions of input_ids")
        with self._lock:
            return self.backend.logits_at(input_ids, attention_mask, rows)

    @property
    def scores_labels(self) -> bool:
        """True when the backend reduces its logits to each scored row's log-probability and
        argmax where they lie (``label_scores``: tensor-parallel exports, whose ranks hold
        vocabulary slices)."""
        return bool(self.backend.scores_labels)

    def label_scores(self, input_ids: np.ndarray, attention_mask: Optional[np.ndarray], rows: np.ndarray,
                     labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """log p(label) (n,) float64 and the argmax (n,) int64 at the flat positions ``rows`` of
        ``input_ids`` whose next tokens are ``labels`` (needs ``scores_labels``)."""
        input_ids, attention_mask = self._check_scoring(input_ids, attention_mask)
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        if rows.size and (rows.min() < 0 or rows.max() >= input_ids.size):
            raise InputError(f"rows must index the {input_ids.size} positions of input_ids")
        with self._lock:
            return self.backend.label_scores(input_ids, attention_mask, rows, np.asarray(labels, dtype=np.int64))

    def _check_scoring(self, input_ids, attention_mask):
        input_ids = np.asarray(input_ids, dtype=np.int64)
        if input_ids.ndim != 2 or input_ids.size == 0:
            raise InputError(f"input_ids must be a non-empty (batch, seq) array, got shape {input_ids.shape}")
        if input_ids.shape[1] > self.max_positions:
            raise InputError(f"input_ids has {input_ids.shape[1]} positions; the model's context is "
                             f"{self.max_positions}")
        if input_ids.min() < 0 or input_ids.max() >= self.vocab_size:
            raise InputError(f"input_ids has token ids outside the vocabulary [0, {self.vocab_size})")
        if attention_mask is not None:
            attention_mask = np.asarray(attention_mask, dtype=np.int64)
            if attention_mask.shape != input_ids.shape:
                raise InputError(f"attention_mask shape {attention_mask.shape} != input_ids shape {input_ids.shape}")
        return input_ids, attention_mask


def measure_draft(base: str, draft: str, prompts: Sequence[Sequence[int]], k: int = DRAFT_TOKENS,
                  new_tokens: int = 32) -> dict:
    """The export ``draft`` as the speculative draft of the export ``base`` (Paddle, greedy, ``k``
    proposals a step, not adaptive) over ``prompts``: the figures ``record_draft`` keeps."""
    gen = Generator.from_dir(base, backend="paddle")
    new_tokens = max(1, min(new_tokens, gen.max_positions - max(len(p) for p in prompts)))
    out = gen.generate(list(prompts), max_new_tokens=new_tokens, draft=Generator.from_dir(draft, backend="paddle"),
                       draft_tokens=k, adaptive=False)
    spec = out.speculation
    return {"acceptance_rate": spec["acceptance_rate"], "tokens_per_target_step": spec["tokens_per_target_step"],
            "k": k, "measured_on": f"{len(prompts)} held-out windows of up to {max(len(p) for p in prompts)} tokens, "
                                   f"{new_tokens} greedy tokens each"}


__all__ = ["Generator", "Generated", "InputError", "ModelDirError", "BACKENDS"]
