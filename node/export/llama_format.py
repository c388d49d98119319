"""murmur's model as `transformers`' Llama: parameter names both ways, config.json, generation_config.json.

murmur's Transformer is a Llama in all but names: RMSNorm before attention and MLP, rotary
embeddings in the half-split layout (x1, x2) -> (x1 c - x2 s, x2 c + x1 s), which is exactly what
`transformers`' rotate_half computes, so q and k projections go over unpermuted (Meta's original
checkpoints use the interleaved layout and need a permutation; ours do not), SwiGLU MLP, no biases,
tied or untied output head. tests/test_export.py checks the logits agree to 1e-4.
"""

from __future__ import annotations

import re
from typing import Any

from murmur.protocol.model_shape import ModelConfig

_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.wq.weight": "self_attn.q_proj.weight",
    "attn.wk.weight": "self_attn.k_proj.weight",
    "attn.wv.weight": "self_attn.v_proj.weight",
    "attn.wo.weight": "self_attn.o_proj.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.w_gate.weight": "mlp.gate_proj.weight",
    "mlp.w_up.weight": "mlp.up_proj.weight",
    "mlp.w_down.weight": "mlp.down_proj.weight",
}
_TOP = {
    "embed.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}
_BLOCK_BACK = {v: k for k, v in _BLOCK.items()}
_TOP_BACK = {v: k for k, v in _TOP.items()}


def to_llama_name(name: str) -> str:
    if name in _TOP:
        return _TOP[name]
    m = re.fullmatch(r"blocks\.(\d+)\.(.+)", name)
    if m is None or m.group(2) not in _BLOCK:
        raise KeyError(f"no Llama name for murmur parameter {name!r}")
    return f"model.layers.{m.group(1)}.{_BLOCK[m.group(2)]}"


def from_llama_name(name: str) -> str:
    if name in _TOP_BACK:
        return _TOP_BACK[name]
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    if m is None or m.group(2) not in _BLOCK_BACK:
        raise KeyError(f"no murmur parameter for Llama name {name!r}")
    return f"blocks.{m.group(1)}.{_BLOCK_BACK[m.group(2)]}"


def llama_config(cfg: ModelConfig, *, dtype: str, eos_token_id: int) -> dict[str, Any]:
    """config.json for LlamaForCausalLM. rope_theta is written both ways: as `rope_parameters`
    (transformers >= 5) and as the top-level key older releases and other loaders (llama.cpp's
    converter, vLLM) read."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.hidden_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": 0.02,
        "bos_token_id": eos_token_id,  # murmur has no BOS: documents are separated by the EOT token alone
        "eos_token_id": eos_token_id,
        "torch_dtype": dtype,
        "dtype": dtype,
        "use_cache": True,
    }


def generation_config(*, eos_token_id: int) -> dict[str, Any]:
    return {
        "bos_token_id": eos_token_id,
        "eos_token_id": eos_token_id,
        "do_sample": True,
        "temperature": 0.8,
        "top_k": 50,
    }


def model_config_from_llama(c: dict[str, Any]) -> ModelConfig:
    """The inverse of `llama_config` (an export read back for `murmur eval`/`generate`)."""
    rope = c.get("rope_parameters") or {}
    return ModelConfig(
        dim=int(c["hidden_size"]),
        n_layers=int(c["num_hidden_layers"]),
        n_heads=int(c["num_attention_heads"]),
        n_kv_heads=int(c.get("num_key_value_heads") or c["num_attention_heads"]),
        hidden_dim=int(c["intermediate_size"]),
        vocab_size=int(c["vocab_size"]),
        seq_len=int(c["max_position_embeddings"]),
        norm_eps=float(c["rms_norm_eps"]),
        rope_theta=float(rope.get("rope_theta", c.get("rope_theta", 10000.0))),
        tie_embeddings=bool(c.get("tie_word_embeddings", True)),
    )
