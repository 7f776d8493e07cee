"""THE GPT model: pre-LN decoder with learned positions, fused QKV, GELU MLP, tied LM head.

Nothing here knows about parallelism, quantization or pruning: those are transforms applied
from outside by parameter name (see ``parameter_names`` and ``tests/test_param_names.py``).

Fused QKV columns are laid out head-major, ``[heads, 3, head_dim]`` (Megatron's layout), so a
column split of ``attn.qkv`` gives every tensor-parallel rank whole heads, and pruning a head
removes one contiguous block of ``3 * head_dim`` columns. Hugging Face GPT-2 stores
``[3, heads, head_dim]``; ``convert/hf_gpt2.py`` permutes between the two.
"""
from __future__ import annotations

import math
from typing import Optional

import paddle
import paddle.nn as nn
import paddle.nn.functional as F

from ..config import ModelConfig

# A layer's cache: (key, value), each (B, heads, S, head_dim).
LayerCache = tuple[paddle.Tensor, paddle.Tensor]


def _normal(std: float) -> paddle.ParamAttr:
    return paddle.ParamAttr(initializer=nn.initializer.Normal(mean=0.0, std=std))


def _zeros() -> paddle.ParamAttr:
    return paddle.ParamAttr(initializer=nn.initializer.Constant(0.0))


def attention_bias(attention_mask: Optional[paddle.Tensor], q_len, k_len, dtype) -> paddle.Tensor:
    """Additive attention bias (B or 1, 1, q_len, k_len): causal plus key padding.

    Queries are the last ``q_len`` of ``k_len`` positions (earlier ones are in the KV cache).
    ``attention_mask`` is (B, k_len) with 1 for real tokens and 0 for padding.
    """
    q_pos = paddle.arange(k_len - q_len, k_len, dtype="int64").unsqueeze(1)  # (q, 1)
    k_pos = paddle.arange(0, k_len, dtype="int64").unsqueeze(0)  # (1, k)
    allowed = (k_pos <= q_pos).unsqueeze(0).unsqueeze(0)  # (1, 1, q, k)
    if attention_mask is not None:
        keep = attention_mask.astype("bool").unsqueeze(1).unsqueeze(1)  # (B, 1, 1, k)
        allowed = paddle.logical_and(allowed, keep)
    # A finite minimum keeps fully masked rows (left-padding queries) free of NaN.
    neg = paddle.full([1], float(paddle.finfo(dtype).min), dtype=dtype)
    return paddle.where(allowed, paddle.zeros([1], dtype=dtype), neg)


def segment_attention_bias(segment_ids: paddle.Tensor, dtype) -> paddle.Tensor:
    """Additive bias (B, 1, T, T) for packed rows: causal, and a query sees only keys of its own
    segment (``segment_ids`` (B, T), one id per packed example), so examples never attend
    across their boundaries."""
    t = paddle.shape(segment_ids)[1]
    pos = paddle.arange(0, t, dtype="int64")
    causal = (pos.unsqueeze(0) <= pos.unsqueeze(1)).unsqueeze(0)  # (1, q, k)
    same = segment_ids.unsqueeze(2) == segment_ids.unsqueeze(1)  # (B, q, k)
    allowed = paddle.logical_and(causal, same).unsqueeze(1)  # (B, 1, q, k)
    neg = paddle.full([1], float(paddle.finfo(dtype).min), dtype=dtype)
    return paddle.where(allowed, paddle.zeros([1], dtype=dtype), neg)


def position_ids_from_mask(attention_mask: paddle.Tensor, q_len) -> paddle.Tensor:
    """Positions that skip left padding: cumsum(mask) - 1, last ``q_len`` columns."""
    pos = paddle.cumsum(attention_mask.astype("int64"), axis=-1) - 1
    pos = paddle.clip(pos, min=0)
    return pos[:, -q_len:] if q_len is not None else pos


class GPTAttention(nn.Layer):
    """Causal multi-head self-attention with a fused, head-major QKV projection."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.num_heads = cfg.heads(layer_idx)
        self.head_dim = cfg.dim_head
        self.use_sdpa = cfg.use_sdpa
        self.recompute_core = cfg.recompute == "core_attn"
        self.attn_dropout = cfg.attention_probs_dropout_prob
        inner = self.num_heads * self.head_dim
        out_std = cfg.initializer_range / (math.sqrt(2 * cfg.num_layers) if cfg.scaled_output_init else 1.0)
        self.qkv = nn.Linear(cfg.hidden_size, 3 * inner, weight_attr=_normal(cfg.initializer_range),
                             bias_attr=_zeros())
        self.out = nn.Linear(inner, cfg.hidden_size, weight_attr=_normal(out_std), bias_attr=_zeros())

    def _core(self, q, k, v, bias):
        # q: (B, H, T, D); k, v: (B, H, S, D); bias: (B|1, 1, T, S)
        scores = paddle.matmul(q, k, transpose_y=True) * (1.0 / math.sqrt(self.head_dim)) + bias
        probs = F.softmax(scores.astype("float32"), axis=-1).astype(q.dtype)
        if self.attn_dropout and self.training:
            probs = F.dropout(probs, self.attn_dropout)
        return paddle.matmul(probs, v)  # (B, H, T, D)

    def forward(self, x, bias=None, past: Optional[LayerCache] = None, use_cache: bool = False):
        """x: (B, T, hidden). Returns (B, T, hidden) and, with ``use_cache``, the new cache."""
        qkv = self.qkv(x).reshape([0, 0, self.num_heads, 3, self.head_dim])  # (B, T, H, 3, D)
        q, k, v = qkv[:, :, :, 0], qkv[:, :, :, 1], qkv[:, :, :, 2]  # (B, T, H, D) each
        if bias is None and past is None and not use_cache and self.use_sdpa:
            # Plain causal pass (training / scoring without padding): paddle's fused SDPA.
            dropout = self.attn_dropout if self.training else 0.0
            ctx = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True,
                                                 training=self.training)  # (B, T, H, D)
            present = None
        else:
            q, k, v = (t.transpose([0, 2, 1, 3]) for t in (q, k, v))  # (B, H, T, D)
            if past is not None:
                k = paddle.concat([past[0], k], axis=2)
                v = paddle.concat([past[1], v], axis=2)
            present = (k, v) if use_cache else None
            if bias is None:
                bias = attention_bias(None, paddle.shape(q)[2], paddle.shape(k)[2], q.dtype)
            if self.recompute_core and self.training:
                from paddle.distributed.fleet.utils import recompute

                ctx = recompute(self._core, q, k, v, bias)
            else:
                ctx = self._core(q, k, v, bias)
            ctx = ctx.transpose([0, 2, 1, 3])  # (B, T, H, D)
        out = self.out(ctx.reshape([0, 0, self.num_heads * self.head_dim]))
        return out, present


class GPTMLP(nn.Layer):
    """Position-wise feed-forward: fc_in -> GELU -> fc_out."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        width = cfg.ffn(layer_idx)
        out_std = cfg.initializer_range / (math.sqrt(2 * cfg.num_layers) if cfg.scaled_output_init else 1.0)
        self.fc_in = nn.Linear(cfg.hidden_size, width, weight_attr=_normal(cfg.initializer_range),
                               bias_attr=_zeros())
        self.fc_out = nn.Linear(width, cfg.hidden_size, weight_attr=_normal(out_std), bias_attr=_zeros())
        self.act = cfg.hidden_act

    def forward(self, x):
        h = self.fc_in(x)
        if self.act == "gelu_new":
            h = F.gelu(h, approximate=True)
        elif self.act == "gelu":
            h = F.gelu(h)
        else:
            h = F.relu(h)
        return self.fc_out(h)


class GPTBlock(nn.Layer):
    """Pre-LN transformer block: x + attn(ln_1(x)); x + mlp(ln_2(x))."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.hidden_size, epsilon=cfg.layer_norm_epsilon)
        self.attn = GPTAttention(cfg, layer_idx)
        self.ln_2 = nn.LayerNorm(cfg.hidden_size, epsilon=cfg.layer_norm_epsilon)
        self.mlp = GPTMLP(cfg, layer_idx)
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)
        self.recompute_attn = cfg.recompute == "full_attn"

    def _attn(self, x, bias):
        return self.attn(self.ln_1(x), bias)[0]

    def forward_train(self, x, bias=None):
        """Hidden states only (no cache): the function full recompute replays."""
        return self(x, bias)[0]

    def forward(self, x, bias=None, past: Optional[LayerCache] = None, use_cache: bool = False):
        if self.recompute_attn and self.training and not use_cache:
            from paddle.distributed.fleet.utils import recompute

            a, present = recompute(self._attn, x, bias), None
        else:
            a, present = self.attn(self.ln_1(x), bias, past, use_cache)
        x = x + self.dropout(a)
        x = x + self.dropout(self.mlp(self.ln_2(x)))
        return x, present


class GPTModel(nn.Layer):
    """Embeddings, the decoder blocks and the final LayerNorm; returns hidden states."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.hidden_size, weight_attr=_normal(cfg.initializer_range))
        self.wpe = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size,
                                weight_attr=_normal(cfg.initializer_range))
        self.drop = nn.Dropout(cfg.hidden_dropout_prob)
        self.blocks = nn.LayerList([GPTBlock(cfg, i) for i in range(cfg.num_layers)])
        self.ln_f = nn.LayerNorm(cfg.hidden_size, epsilon=cfg.layer_norm_epsilon)

    def forward(self, input_ids, attention_mask=None, position_ids=None,
                past_key_values: Optional[list[LayerCache]] = None, use_cache: bool = False,
                segment_ids=None):
        """input_ids (B, T) -> hidden (B, T, hidden) [, new per-layer caches].

        ``attention_mask`` (B, past + T) marks real tokens with 1; left padding is supported.
        ``segment_ids`` (B, T) (training on packed rows, no cache) restricts attention to each
        token's own segment; pass the per-segment ``position_ids`` with it.
        """
        q_len = paddle.shape(input_ids)[1]
        past_len = paddle.shape(past_key_values[0][0])[2] if past_key_values else 0
        if position_ids is None:
            if attention_mask is not None:
                position_ids = position_ids_from_mask(attention_mask, q_len)
            else:
                position_ids = paddle.arange(past_len, past_len + q_len, dtype="int64").unsqueeze(0)
        x = self.drop(self.wte(input_ids) + self.wpe(position_ids))
        bias = None
        if segment_ids is not None:
            bias = segment_attention_bias(segment_ids, x.dtype)
        elif attention_mask is not None or past_key_values or use_cache:
            bias = attention_bias(attention_mask, q_len, past_len + q_len, x.dtype)
        presents = []
        full_recompute = self.config.recompute == "full" and self.training and not use_cache
        for i, block in enumerate(self.blocks):
            past = past_key_values[i] if past_key_values else None
            if full_recompute:
                from paddle.distributed.fleet.utils import recompute

                x, present = recompute(block.forward_train, x, bias), None
            else:
                x, present = block(x, bias, past, use_cache)
            presents.append(present)
        x = self.ln_f(x)
        return (x, presents) if use_cache else x


class GPTForCausalLM(nn.Layer):
    """GPT with a language-modelling head (tied to ``gpt.wte`` unless configured otherwise)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.gpt = GPTModel(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, weight_attr=_normal(cfg.initializer_range),
                                     bias_attr=False)

    def logits(self, hidden):
        """hidden (..., hidden) -> logits (..., vocab)."""
        if self.config.tie_word_embeddings:
            return paddle.matmul(hidden, self.gpt.wte.weight, transpose_y=True)
        return self.lm_head(hidden)

    def forward(self, input_ids, attention_mask=None, position_ids=None,
                past_key_values: Optional[list[LayerCache]] = None, use_cache: bool = False):
        """input_ids (B, T) -> logits (B, T, vocab) [, new per-layer caches]."""
        out = self.gpt(input_ids, attention_mask, position_ids, past_key_values, use_cache)
        if use_cache:
            return self.logits(out[0]), out[1]
        return self.logits(out)


def label_logprobs(logits, labels, block: int = 64):
    """Scoring without a log-softmax: logits (N, V) float32, labels (N,) int64 ->
    [log p(label) (N,) float64, argmax (N,) int64].

    One log-sum-exp per row: ``exp(logits - max)`` in float32, summed in blocks of ``block``
    in float32 and the block sums in float64 (within ~1e-7 of ``eval.scoring.label_logprobs``,
    the numpy reference, which sums every term in float64; a float64 cast of all V terms cost
    more than the head's matmul in onnxruntime). The label's logit is read by a flat gather
    (``take_along_axis`` exports as a copy of the logits). Exported as the ``score_head``
    program and run by the dygraph backend.

    Not ``F.log_softmax``: onnxruntime's LogSoftmax was ~20% faster than this on 512 x 50,304
    rows, but Paddle's CPU log_softmax kernel took 40 s on 24 x 50,304 (0.06 s for
    ``paddle.logsumexp``, 0.1 s for this), and both runtimes run the same program."""
    v = logits.shape[-1]
    rows = paddle.shape(logits)[0]
    top = paddle.max(logits, axis=-1, keepdim=True)
    e = paddle.exp(logits - top)
    block = min(block, v)
    if v % block:  # zeros up to a whole number of blocks (exp of nothing)
        e = paddle.concat([e, paddle.tile(paddle.zeros_like(e[:, :1]), [1, block - v % block])], axis=1)
    partial = e.reshape([0, -1, block]).sum(axis=-1)  # (N, ceil(V / block))
    lse = paddle.log(partial.astype("float64").sum(axis=-1)) + top.squeeze(-1).astype("float64")
    flat = paddle.arange(rows, dtype="int64") * v + labels
    picked = paddle.gather(logits.reshape([-1]), flat)
    return [picked.astype("float64") - lse, paddle.argmax(logits, axis=-1)]


class GPTForSequenceClassification(nn.Layer):
    """GPT with a classification/regression head on the last non-pad token (GLUE)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.gpt = GPTModel(cfg)
        self.score = nn.Linear(cfg.hidden_size, cfg.num_labels, weight_attr=_normal(cfg.initializer_range),
                               bias_attr=False)

    def forward(self, input_ids, attention_mask=None):
        """input_ids (B, T), right-padded; attention_mask (B, T) -> logits (B, num_labels)."""
        hidden = self.gpt(input_ids, attention_mask)  # (B, T, hidden)
        if attention_mask is None:
            last = paddle.full([paddle.shape(input_ids)[0]], paddle.shape(input_ids)[1] - 1, dtype="int64")
        else:
            last = attention_mask.astype("int64").sum(axis=-1) - 1
        batch = paddle.arange(paddle.shape(input_ids)[0], dtype="int64")
        pooled = hidden[batch, last]  # (B, hidden)
        return self.score(pooled)


def parameter_names(cfg: ModelConfig, head: str = "lm") -> list[str]:
    """The public parameter names of a model built from ``cfg`` (frozen by a test)."""
    names = ["gpt.wte.weight", "gpt.wpe.weight"]
    for i in range(cfg.num_layers):
        p = f"gpt.blocks.{i}."
        for sub in ("ln_1", "attn.qkv", "attn.out", "ln_2", "mlp.fc_in", "mlp.fc_out"):
            names += [p + sub + ".weight", p + sub + ".bias"]
    names += ["gpt.ln_f.weight", "gpt.ln_f.bias"]
    if head == "lm" and not cfg.tie_word_embeddings:
        names.append("lm_head.weight")
    if head == "cls":
        names.append("score.weight")
    return names
