"""Hugging Face GPT-2 <-> gpt-compress: one key-mapping table, QKV column permutation.

Reads a local Hugging Face GPT-2 directory (``config.json`` + ``model.safetensors``, or a
zip-format ``pytorch_model.bin`` read without executing pickle) and writes ours back in that
format. Both sides store Linear weights as (in, out) (HF's Conv1D), so only the fused QKV
columns need reordering: HF ``[3, heads, head_dim]`` vs ours head-major ``[heads, 3, head_dim]``.
"""
from __future__ import annotations

import json
import os
import re

import numpy as np

from ..checkpoint import CheckpointError, assign_weights, build_model, state_dict_numpy
from ..fileio import write_dir_atomic, write_json_atomic
from ..config import ModelConfig

# ours (per layer, "{i}") -> HF name under "transformer."
LAYER_MAP = {
    "ln_1.weight": "ln_1.weight", "ln_1.bias": "ln_1.bias",
    "attn.qkv.weight": "attn.c_attn.weight", "attn.qkv.bias": "attn.c_attn.bias",
    "attn.out.weight": "attn.c_proj.weight", "attn.out.bias": "attn.c_proj.bias",
    "ln_2.weight": "ln_2.weight", "ln_2.bias": "ln_2.bias",
    "mlp.fc_in.weight": "mlp.c_fc.weight", "mlp.fc_in.bias": "mlp.c_fc.bias",
    "mlp.fc_out.weight": "mlp.c_proj.weight", "mlp.fc_out.bias": "mlp.c_proj.bias",
}
GLOBAL_MAP = {
    "gpt.wte.weight": "wte.weight", "gpt.wpe.weight": "wpe.weight",
    "gpt.ln_f.weight": "ln_f.weight", "gpt.ln_f.bias": "ln_f.bias",
}
_ACT = {"gelu_new": "gelu_new", "gelu_pytorch_tanh": "gelu_new", "gelu": "gelu", "relu": "relu"}


def qkv_hf_to_ours(w: np.ndarray, heads: int, head_dim: int) -> np.ndarray:
    """Permute fused-QKV columns (last axis) from [3, H, D] to [H, 3, D]."""
    lead = w.shape[:-1]
    return w.reshape(*lead, 3, heads, head_dim).swapaxes(-3, -2).reshape(*lead, 3 * heads * head_dim)


def qkv_ours_to_hf(w: np.ndarray, heads: int, head_dim: int) -> np.ndarray:
    """Permute fused-QKV columns (last axis) from [H, 3, D] to [3, H, D]."""
    lead = w.shape[:-1]
    return w.reshape(*lead, heads, 3, head_dim).swapaxes(-3, -2).reshape(*lead, 3 * heads * head_dim)


def config_from_hf(hf: dict) -> ModelConfig:
    """Our ModelConfig from a Hugging Face GPT2Config dict; unsupported options are errors."""
    if hf.get("model_type", "gpt2") != "gpt2":
        raise CheckpointError(f"model_type {hf.get('model_type')!r} is not gpt2")
    for key in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        if hf.get(key):
            raise CheckpointError(f"Hugging Face option {key}=true is not supported")
    if hf.get("scale_attn_weights", True) is False:
        raise CheckpointError("Hugging Face option scale_attn_weights=false is not supported")
    act = hf.get("activation_function", "gelu_new")
    if act not in _ACT:
        raise CheckpointError(f"activation_function {act!r} is not supported")
    return ModelConfig(
        name="hf-gpt2", vocab_size=hf["vocab_size"], hidden_size=hf["n_embd"], num_layers=hf["n_layer"],
        num_attention_heads=hf["n_head"], ffn_hidden_size=hf.get("n_inner") or None,
        max_position_embeddings=hf["n_positions"], hidden_act=_ACT[act],
        hidden_dropout_prob=hf.get("resid_pdrop", 0.1), attention_probs_dropout_prob=hf.get("attn_pdrop", 0.1),
        layer_norm_epsilon=hf.get("layer_norm_epsilon", 1e-5), initializer_range=hf.get("initializer_range", 0.02),
        tie_word_embeddings=hf.get("tie_word_embeddings", True),
        eos_token_id=hf.get("eos_token_id", 50256) or 50256,
        pad_token_id=hf.get("pad_token_id") or hf.get("eos_token_id", 50256) or 50256)


def config_to_hf(cfg: ModelConfig) -> dict:
    """A Hugging Face GPT2Config dict for ``cfg``; pruned (uneven) layers cannot be expressed."""
    if cfg.layer_num_heads or cfg.layer_ffn_sizes or cfg.dim_head * cfg.num_attention_heads != cfg.hidden_size:
        raise CheckpointError("this model has per-layer head/FFN sizes or a custom head_dim (pruned); "
                              "Hugging Face GPT2Config cannot express it")
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": cfg.vocab_size, "n_positions": cfg.max_position_embeddings, "n_embd": cfg.hidden_size,
        "n_layer": cfg.num_layers, "n_head": cfg.num_attention_heads,
        "n_inner": None if cfg.ffn_size == 4 * cfg.hidden_size else cfg.ffn_size,
        "activation_function": cfg.hidden_act, "resid_pdrop": cfg.hidden_dropout_prob,
        "embd_pdrop": cfg.hidden_dropout_prob, "attn_pdrop": cfg.attention_probs_dropout_prob,
        "layer_norm_epsilon": cfg.layer_norm_epsilon, "initializer_range": cfg.initializer_range,
        "bos_token_id": cfg.eos_token_id, "eos_token_id": cfg.eos_token_id,
        "tie_word_embeddings": cfg.tie_word_embeddings, "scale_attn_weights": True,
        "summary_type": "cls_index", "summary_use_proj": True, "summary_activation": None,
        "summary_proj_to_labels": True, "summary_first_dropout": 0.1, "use_cache": True,
    }


def read_hf_weights(hf_dir: str) -> dict[str, np.ndarray]:
    """HF GPT-2 tensors by their name without the ``transformer.`` prefix."""
    st = os.path.join(hf_dir, "model.safetensors")
    binf = os.path.join(hf_dir, "pytorch_model.bin")
    if os.path.isfile(st):
        from safetensors.numpy import load_file

        try:
            raw = load_file(st)
        except Exception as e:  # safetensors raises its own error types for bad/truncated files
            raise CheckpointError(f"{st} is not a readable safetensors file: {e}") from None
    elif os.path.isfile(binf):
        from .torch_bin import load_torch_bin

        raw = load_torch_bin(binf)
    else:
        raise CheckpointError(f"{hf_dir}: neither model.safetensors nor pytorch_model.bin found")
    out = {}
    for k, v in raw.items():
        k = k[len("transformer."):] if k.startswith("transformer.") else k
        if re.search(r"(^|\.)attn\.(bias|masked_bias)$", k):  # causal-mask buffers of old HF versions
            continue
        out[k] = v.astype(np.float32) if v.dtype in (np.float16, np.float64) else v
    return out


def hf_to_ours(hf: dict[str, np.ndarray], cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Map HF tensor names/layouts to ours."""
    def take(name):
        if name not in hf:
            raise CheckpointError(f"Hugging Face weights lack {name!r}")
        return hf[name]

    out = {ours: take(theirs) for ours, theirs in GLOBAL_MAP.items()}
    for i in range(cfg.num_layers):
        for ours, theirs in LAYER_MAP.items():
            w = take(f"h.{i}.{theirs}")
            if ours.startswith("attn.qkv"):
                w = qkv_hf_to_ours(w, cfg.heads(i), cfg.dim_head)
            out[f"gpt.blocks.{i}.{ours}"] = w
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = take("lm_head.weight").T  # torch Linear (out, in) -> ours (in, out)
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def ours_to_hf(ours: dict[str, np.ndarray], cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Map our tensors to HF names (with ``transformer.`` prefix) and layouts."""
    out = {f"transformer.{theirs}": ours[o] for o, theirs in GLOBAL_MAP.items()}
    for i in range(cfg.num_layers):
        for o, theirs in LAYER_MAP.items():
            w = ours[f"gpt.blocks.{i}.{o}"]
            if o.startswith("attn.qkv"):
                w = qkv_ours_to_hf(w, cfg.heads(i), cfg.dim_head)
            out[f"transformer.h.{i}.{theirs}"] = w
    out["lm_head.weight"] = (ours["gpt.wte.weight"] if cfg.tie_word_embeddings
                             else ours["lm_head.weight"].T)
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def load_hf_gpt2(hf_dir: str):
    """Build our ``GPTForCausalLM`` from a local Hugging Face GPT-2 directory."""
    if not os.path.isdir(hf_dir):
        raise CheckpointError(f"model directory not found: {hf_dir}")
    cfg_path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(cfg_path):
        raise CheckpointError(f"{cfg_path} not found: not a Hugging Face model directory")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            cfg = config_from_hf(json.load(f))
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{cfg_path} is not a usable GPT-2 config ({type(e).__name__}: {e})") from None
    model = build_model(cfg, "lm")
    weights = read_hf_weights(hf_dir)
    try:
        ours = hf_to_ours(weights, cfg)
    except KeyError as e:
        raise CheckpointError(f"{hf_dir}: weight {e} is missing for the architecture in its config.json") from None
    except ValueError as e:
        raise CheckpointError(f"{hf_dir}: the weights do not match the shapes its config.json implies ({e})") from None
    assign_weights(model, ours, hf_dir)
    model.eval()
    return model


def save_hf_gpt2(model, out_dir: str, tokenizer=None, overwrite: bool = False) -> str:
    """Write ``model`` as a Hugging Face GPT-2 directory (config.json + model.safetensors)."""
    from safetensors.numpy import save_file

    cfg = model.config
    hf_cfg = config_to_hf(cfg)
    tensors = ours_to_hf(state_dict_numpy(model), cfg)
    if cfg.tie_word_embeddings:  # HF re-ties on load; storing it twice would be a shared tensor
        tensors.pop("lm_head.weight")

    def write(tmp):
        save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        write_json_atomic(os.path.join(tmp, "config.json"), hf_cfg)
        if tokenizer is not None:
            tokenizer.save(tmp)

    return write_dir_atomic(out_dir, write, overwrite=overwrite)
