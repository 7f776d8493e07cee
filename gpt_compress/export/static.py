"""Model -> Paddle Inference programs: ``prefill``/``decode``/``forward`` (and, for Paddle
Inference, ``decode`` split into ``decode_hidden`` + ``lm_head``: ``SPLIT_PROGRAMS``; for
evaluation, ``forward_hidden`` + ``score_head``: ``SCORE_PROGRAMS``, the body on the window and
the head with its log-softmax only at the scored rows, ``model.gpt.label_logprobs``).

A leaf of the exporter: ``save_paddle_programs`` writes the programs into a directory and
returns their file names; ``export/api.py`` builds the directory around them (manifest,
tokenizer, validation) and ``export/onnx.py`` converts them.

The three programs are ``paddle.jit.to_static`` methods of one wrapper around the one model
(``ExportableLM``), saved by one ``paddle.jit.save``: they share parameter names, so a single
``model.pdiparams`` serves all three (Paddle writes one identical copy per method; we keep one
and check the others were byte-identical). See ``inference/manifest.py`` for the layout.

Why the wrapper stores the tied embedding transposed, (hidden, vocab): the LM head is a
``(B, hidden) @ (hidden, vocab)`` GEMV that dominates decode (77 MB of the 121 MB of ``gpt-bench``
weights). With the embedding's natural (vocab, hidden) layout the head is a ``transpose_y``
matmul, which MKL runs at less than half the speed of the plain one at batch 1 (and the ONNX
export used to store the weight twice, once per orientation). The token lookup becomes a
column gather, ``gather(W_t, ids, axis=1)``: free for decode, a strided read for long prompts.
"""
from __future__ import annotations

import gc
import os
import shutil
import tempfile
from typing import Optional

import paddle
import paddle.nn as nn
from paddle.static import InputSpec

from ..config import ModelConfig
from ..errors import ExportError
from ..fileio import sha256_file
from ..memory import return_freed_memory
from ..inference.manifest import PROGRAMS, SCORE_PROGRAMS, SPLIT_PROGRAMS
from ..model.gpt import label_logprobs

PARAMS = "model.pdiparams"
# Column blocks of the split ``lm_head`` (``SPLIT_PROGRAMS``: Paddle's batch-1 decode runs the head,
# a GEMV over 64% of gpt-bench's weights, on all threads and the ~250 small ops of the body on one;
# see inference/predictor.py).
HEAD_BLOCKS = 4


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

    # Programs that use a part of the weights (``lm_head``, ``score_head``) also read every other
    # parameter (``_reads_all_parameters``) so that Paddle Inference loads the one shared params
    # file. False for programs only converted to ONNX (the int8 export's float pass), where those
    # reads would keep float copies of weights stored as int8.
    shared_params = True

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

    def _reads_all_parameters(self, x, used):
        """``x`` plus a zero read from every parameter other than ``used`` (folded away at load) so
        that a program using only the head has the shared model.pdiparams as its parameter file:
        Paddle loads a combined file whole, in order."""
        if not self.shared_params:
            return x
        others = [t for t in list(self.parameters()) + [b for b in self.buffers() if b.persistable]
                  if t is not used]
        if others:
            x = x + 0.0 * paddle.add_n([t.reshape([-1])[:1].astype(x.dtype).sum() for t in others])
        return x

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
        blocks = self._reads_all_parameters(paddle.transpose(w.reshape([h, k, n]), [1, 0, 2]), head)  # (K, hidden, n)
        x = paddle.expand(hidden.unsqueeze(0), [k, -1, h])  # (K, B, hidden)
        y = paddle.transpose(paddle.matmul(x, blocks), [1, 0, 2])  # (B, K, n)
        return y.reshape([-1, k * n])[:, :v]

    def forward(self, input_ids, attention_mask):
        """Scoring: (B, T) ids and mask -> logits (B, T, V)."""
        return self._logits(self.model.gpt(input_ids, attention_mask=attention_mask))

    def forward_hidden(self, input_ids, attention_mask):
        """Scoring, body only: (B, T) ids and mask -> final hidden states (B, T, hidden)."""
        return self.model.gpt(input_ids, attention_mask=attention_mask)

    def score_head(self, hidden, labels):
        """Scoring, head only, at the scored positions: hidden (N, hidden), labels (N,) ->
        [log p(label) (N,) float64, argmax (N,) int64] (``model.gpt.label_logprobs``)."""
        hidden = self._reads_all_parameters(hidden, self.head_weight())  # (N, hidden): the zero costs nothing
        return label_logprobs(self._logits(hidden), labels)

    def prefill(self, input_ids, attention_mask):
        """Prompt (B, T) -> [last logits (B, V), k_0, v_0, k_1, ...], each cache (B, H_i, T, D)."""
        return self._step(input_ids, attention_mask, None)

    def decode(self, input_ids, attention_mask, past):
        """New tokens (B, T), mask (B, S+T), past [(k_i, v_i)] -> [logits (B, V), k_0, v_0, ...]."""
        return self._step(input_ids, attention_mask, past)


def _input_specs(cfg: ModelConfig):
    ids = InputSpec([None, None], "int64", "input_ids")
    mask = InputSpec([None, None], "int64", "attention_mask")
    past = [(InputSpec([None, cfg.heads(i), None, cfg.dim_head], "float32", f"past_key_{i}"),
             InputSpec([None, cfg.heads(i), None, cfg.dim_head], "float32", f"past_value_{i}"))
            for i in range(cfg.num_layers)]
    return {"forward": [ids, mask], "prefill": [ids, mask], "decode": [ids, mask, past],
            "decode_hidden": [ids, mask, past], "lm_head": [InputSpec([None, cfg.hidden_size], "float32", "hidden")],
            "forward_hidden": [ids, mask],
            "score_head": [InputSpec([None, cfg.hidden_size], "float32", "hidden"),
                           InputSpec([None], "int64", "labels")]}


def save_paddle_programs(model, out_dir: str, wrapper: Optional[nn.Layer] = None,
                         split_decode: bool = True, score: bool = False) -> dict[str, dict[str, str]]:
    """``paddle.jit.save`` the three programs of ``model`` into ``out_dir`` with one shared
    params file. Returns ``{program: {"model": file, "params": file}}`` (names relative to out_dir).
    ``model`` is mutated (see ``ExportableLM``); pass a model you will not train further.
    ``wrapper``: an ``ExportableLM`` subclass instance around ``model`` (tensor-parallel shards).
    ``split_decode``: also save ``SPLIT_PROGRAMS`` (Paddle Inference's batch-1 decode path) when
    the wrapper's head is a plain matmul. ``score``: also save ``SCORE_PROGRAMS`` (evaluation
    computes logits only at the positions it scores)."""
    model.eval()
    wrapper = wrapper or ExportableLM(model)
    specs = _input_specs(model.config)
    names = list(PROGRAMS) + (list(SPLIT_PROGRAMS) if split_decode and wrapper.head_weight() is not None else [])
    names += list(SCORE_PROGRAMS) if score else []
    for name in names:
        setattr(wrapper, name, paddle.jit.to_static(getattr(wrapper, name), input_spec=specs[name], full_graph=True))
    scratch = tempfile.mkdtemp(prefix=".jit-", dir=out_dir)
    try:
        paddle.jit.save(wrapper, os.path.join(scratch, "model"), combine_params=True)
        # jit.save names the methods model.json (forward), model.prefill.json, model.decode.json, ...
        stems = {name: "model" if name == "forward" else f"model.{name}" for name in names}
        shared = os.path.join(scratch, "model.pdiparams")
        digest = sha256_file(shared)
        files = {}
        for name, stem in stems.items():
            src = os.path.join(scratch, stem + ".json")
            if not os.path.isfile(src):
                raise ExportError(f"paddle.jit.save did not write {stem}.json for the {name} program")
            os.replace(src, os.path.join(out_dir, f"{name}.json"))
            params = os.path.join(scratch, stem + ".pdiparams")
            if stem != "model" and os.path.isfile(params) and sha256_file(params) != digest:
                # Never seen: every program reads the same parameters. Keep the copy rather than guess.
                os.replace(params, os.path.join(out_dir, f"{name}.pdiparams"))
                files[name] = {"model": f"{name}.json", "params": f"{name}.pdiparams"}
            else:
                files[name] = {"model": f"{name}.json", "params": PARAMS}
        os.replace(shared, os.path.join(out_dir, PARAMS))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return files


def free_parameters(model) -> None:
    """Release every parameter and persistable buffer of ``model`` (unusable afterwards)."""
    for t in list(model.parameters()) + [b for b in model.buffers() if b.persistable]:
        if t._is_initialized():
            t._clear_data()
    gc.collect()
    return_freed_memory()  # the freed chunks in the heap too (``memory.return_freed_memory``)


def program_weights(model):
    """Parameter name as the saved programs read it -> its value (numpy), for converting the
    programs to ONNX without paddle2onnx loading the params file (``onnx.convert_program``).
    Call after ``save_paddle_programs(model, ...)``: the names are those of the mutated model."""
    tensors = {t.name: t for t in list(model.parameters()) + [b for b in model.buffers() if b.persistable]}

    def get(name: str):
        if name not in tensors:
            raise ExportError(f"the exported program reads {name!r}, which is no parameter of the model")
        return tensors[name].numpy()

    return get
