"""The model families as data: each architecture's tensor names (Hugging Face and GGUF) and
the config.json / GGUF metadata keys of its structure (norms, windows, soft-caps, experts).

A layer's weights are named by role (``q``, ``post_attn_norm``, ``expert_gate``, ...); a family
maps each role it has to its Hugging Face name under ``model.layers.{i}.`` (``{j}``: the expert).
The GGUF loader maps llama.cpp's names (``blk.{i}.attn_q.weight``, as convert_hf_to_gguf.py writes
them) to roles and so to the family's Hugging Face names: the model reads one naming.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

# ---- Hugging Face names of a layer's roles, per family ----

_LLAMA = {
    "attn_norm": "input_layernorm.weight",
    "q": "self_attn.q_proj.weight", "k": "self_attn.k_proj.weight", "v": "self_attn.v_proj.weight",
    "q_bias": "self_attn.q_proj.bias", "k_bias": "self_attn.k_proj.bias", "v_bias": "self_attn.v_proj.bias",
    "o": "self_attn.o_proj.weight", "o_bias": "self_attn.o_proj.bias",
    "ffn_norm": "post_attention_layernorm.weight",
    "gate": "mlp.gate_proj.weight", "up": "mlp.up_proj.weight", "down": "mlp.down_proj.weight",
}
_QK_NORMS = {"q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight"}
_GEMMA = {**_LLAMA, "post_attn_norm": "post_attention_layernorm.weight",
          "ffn_norm": "pre_feedforward_layernorm.weight",
          "post_ffn_norm": "post_feedforward_layernorm.weight"}
_OLMO2 = {**{k: v for k, v in _LLAMA.items() if k not in ("attn_norm", "ffn_norm")}, **_QK_NORMS,
          "post_attn_norm": "post_attention_layernorm.weight",
          "post_ffn_norm": "post_feedforward_layernorm.weight"}
_PHI3 = {**{k: v for k, v in _LLAMA.items() if k not in ("q", "k", "v", "gate", "up")},
         "qkv": "self_attn.qkv_proj.weight", "gate_up": "mlp.gate_up_proj.weight"}
_QWEN3MOE = {**_LLAMA, **_QK_NORMS, "router": "mlp.gate.weight",
             "expert_gate": "mlp.experts.{j}.gate_proj.weight", "expert_up": "mlp.experts.{j}.up_proj.weight",
             "expert_down": "mlp.experts.{j}.down_proj.weight"}
_MIXTRAL = {**_LLAMA, "router": "block_sparse_moe.gate.weight",
            "expert_gate": "block_sparse_moe.experts.{j}.w1.weight",
            "expert_up": "block_sparse_moe.experts.{j}.w3.weight",
            "expert_down": "block_sparse_moe.experts.{j}.w2.weight"}

HF_LAYER_NAMES: dict[str, dict[str, str]] = {
    "llama": _LLAMA, "qwen2": _LLAMA, "mistral": _LLAMA, "granite": _LLAMA,
    "qwen3": {**_LLAMA, **_QK_NORMS},
    "gemma2": _GEMMA, "gemma3": {**_GEMMA, **_QK_NORMS},
    "olmo2": _OLMO2, "phi3": _PHI3, "qwen3moe": _QWEN3MOE, "mixtral": _MIXTRAL,
}
# Families whose Hugging Face RMSNorm weights are stored as w - 1 (Gemma's x * (1 + w));
# llama.cpp's converter adds the 1 when it writes the GGUF.
HF_NORM_OFFSET = {"gemma2": 1.0, "gemma3": 1.0}

# ---- GGUF (llama.cpp) names -> roles ----

GGUF_LAYER_ROLES = {
    "attn_norm.weight": "attn_norm",
    "attn_q.weight": "q", "attn_k.weight": "k", "attn_v.weight": "v", "attn_qkv.weight": "qkv",
    "attn_q.bias": "q_bias", "attn_k.bias": "k_bias", "attn_v.bias": "v_bias",
    "attn_output.weight": "o", "attn_output.bias": "o_bias",
    "attn_q_norm.weight": "q_norm", "attn_k_norm.weight": "k_norm",
    "post_attention_norm.weight": "post_attn_norm",
    "ffn_norm.weight": "ffn_norm", "post_ffw_norm.weight": "post_ffn_norm",
    "ffn_gate.weight": "gate", "ffn_up.weight": "up", "ffn_down.weight": "down",
    "ffn_gate_inp.weight": "router",
    # [num_experts, rows, cols] tensors: one HF name per expert (engine.loader.gguf_loader)
    "ffn_gate_exps.weight": "expert_gate", "ffn_up_exps.weight": "expert_up",
    "ffn_down_exps.weight": "expert_down",
}
# A family's own reading of a GGUF name (Phi-3's ffn_up holds gate and up).
GGUF_ROLE_OVERRIDES = {"phi3": {"ffn_up.weight": "gate_up"}}
# GGUF general.architecture -> ours ("llama" with experts is Mixtral: gguf_extras renames it).
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
                      "gemma3": "gemma3", "granite": "granite", "olmo2": "olmo2", "phi3": "phi3",
                      "qwen3moe": "qwen3moe"}
# GGUF files that store q/k rows permuted for ggml's adjacent-pair rotation (undone at load).
GGUF_PERMUTED_QK = ("llama", "granite")


def hf_layer_name(architecture: str, role: str, layer: int, expert: int | None = None) -> str | None:
    """The Hugging Face name of a role of layer `layer` (None: the family has no such role)."""
    name = HF_LAYER_NAMES[architecture].get(role)
    if name is None:
        return None
    return f"model.layers.{layer}." + (name if expert is None else name.format(j=expert))


# ---- config.json -> ModelConfig fields beyond the Llama ones ----

def _rope_params(config_json: dict, layer_type: str | None = None) -> dict:
    params = config_json.get("rope_parameters") or {}
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        return params[layer_type]
    return params


def _layer_types(config_json: dict) -> tuple[str, ...] | None:
    types = config_json.get("layer_types")
    if not types:
        return None
    names = {"sliding_attention": "sliding", "full_attention": "full"}
    return tuple(names.get(t, t) for t in types)


def _hf_gemma(config_json: dict, fields: dict) -> dict:
    get = config_json.get
    out = dict(hidden_act="gelu_tanh", post_norms=True, embedding_scale=math.sqrt(fields["hidden_size"]),
               attention_scale=float(get("query_pre_attn_scalar") or fields["head_dim"]) ** -0.5,
               attn_logit_softcap=get("attn_logit_softcapping"),
               final_logit_softcap=get("final_logit_softcapping"),
               tie_word_embeddings=bool(get("tie_word_embeddings", True)),
               sliding_window=get("sliding_window"), rms_norm_eps=float(get("rms_norm_eps", 1e-6)))
    pattern = get("sliding_window_pattern") or get("_sliding_window_pattern")
    out["layer_types"] = _layer_types(config_json) or _gemma_layer_types(
        fields["architecture"], fields["num_layers"], pattern)
    if fields["architecture"] == "gemma3":
        out["qk_norm"] = "head"
        full = _rope_params(config_json, "full_attention")
        local = _rope_params(config_json, "sliding_attention")
        out["rope_theta"] = float(full.get("rope_theta") or get("rope_theta") or 1e6)
        out["rope_local_theta"] = float(local.get("rope_theta") or get("rope_local_base_freq") or 10000.0)
        scaling = get("rope_scaling") or (full if full.get("rope_type", "default") != "default" else None)
        if scaling is not None:
            scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
        out["rope_scaling"] = scaling
    return out


def _gemma_layer_types(architecture: str, num_layers: int, pattern: int | None) -> tuple[str, ...]:
    """llama.cpp's pattern: Gemma 2 alternates (even layers sliding), Gemma 3 has one full layer in 6."""
    pattern = pattern or (2 if architecture == "gemma2" else 6)
    return tuple("full" if (i + 1) % pattern == 0 else "sliding" for i in range(num_layers))


def _hf_granite(config_json: dict, fields: dict) -> dict:
    get = config_json.get
    return dict(embedding_scale=float(get("embedding_multiplier", 1.0)),
                residual_scale=float(get("residual_multiplier", 1.0)),
                attention_scale=float(get("attention_multiplier", fields["head_dim"] ** -0.5)),
                logit_scale=1.0 / float(get("logits_scaling", 1.0)))


def _hf_phi3(config_json: dict, fields: dict) -> dict:
    get = config_json.get
    rope = _rope_params(config_json)
    factor = rope.get("partial_rotary_factor", get("partial_rotary_factor", 1.0))
    out = dict(rotary_dim=int(fields["head_dim"] * factor), sliding_window=get("sliding_window"))
    scaling = fields["rope_scaling"]
    if scaling is not None and (scaling.get("type") or scaling.get("rope_type")) in ("longrope", "su"):
        dropped = ("rope_theta", "partial_rotary_factor", "type")
        scaling = {k: v for k, v in scaling.items() if k not in dropped}
        scaling["rope_type"] = "longrope"
        scaling.setdefault("original_max_position_embeddings",
                           get("original_max_position_embeddings") or fields["max_position_embeddings"])
        out["rope_scaling"] = scaling
    return out


def _hf_moe(config_json: dict, fields: dict) -> dict:
    get = config_json.get
    num_experts = int(get("num_experts") or get("num_local_experts") or 0)
    if fields["architecture"] == "mixtral":
        return dict(num_experts=num_experts, num_experts_per_tok=int(get("num_experts_per_tok", 2)),
                    moe_intermediate_size=fields["intermediate_size"], norm_topk_prob=True)
    step = int(get("decoder_sparse_step", 1) or 1)
    only_dense = set(get("mlp_only_layers") or ())
    dense = tuple(i for i in range(fields["num_layers"]) if i in only_dense or (i + 1) % step != 0)
    return dict(qk_norm="head", num_experts=num_experts,
                num_experts_per_tok=int(get("num_experts_per_tok", 8)),
                moe_intermediate_size=int(get("moe_intermediate_size", 0)),
                norm_topk_prob=bool(get("norm_topk_prob", False)), dense_layers=dense)


_HF_EXTRAS: dict[str, Callable[[dict, dict], dict]] = {
    "qwen3": lambda config_json, fields: dict(qk_norm="head"),
    "gemma2": _hf_gemma, "gemma3": _hf_gemma, "granite": _hf_granite,
    "olmo2": lambda config_json, fields: dict(qk_norm="all", pre_norms=False, post_norms=True),
    "phi3": _hf_phi3, "qwen3moe": _hf_moe, "mixtral": _hf_moe,
}


def hf_extras(architecture: str, config_json: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    """The family's ModelConfig fields from its config.json (fields: the Llama ones read so far)."""
    extras = _HF_EXTRAS.get(architecture)
    return {} if extras is None else extras(config_json, fields)


# ---- GGUF metadata -> ModelConfig fields beyond the Llama ones ----

def _gguf_gemma(arch: str, key: Callable, fields: dict) -> dict:
    num_layers, E = fields["num_layers"], fields["hidden_size"]
    # llama.cpp: 1/sqrt(head_dim), except the 27B models' 1/sqrt(E / H) (46 and 62 layers)
    is_27b = num_layers == (46 if arch == "gemma2" else 62)
    scalar = E / fields["num_heads"] if is_27b else fields["head_dim"]
    out = dict(hidden_act="gelu_tanh", post_norms=True, embedding_scale=math.sqrt(E),
               attention_scale=scalar ** -0.5,
               attn_logit_softcap=key("attn_logit_softcapping", required=False),
               final_logit_softcap=key("final_logit_softcapping", required=False),
               layer_types=_gemma_layer_types(arch, num_layers, None) if fields["sliding_window"] else None)
    if arch == "gemma3":
        out.update(qk_norm="head", rope_local_theta=10000.0)  # llama.cpp's fixed base of the sliding layers
    return out


def _gguf_phi3(arch: str, key: Callable, fields: dict) -> dict:
    # rope.dimension_count is the rotated part; the head is E / H (the converter writes no key_length)
    head_dim = int(key("attention.key_length", fields["hidden_size"] // fields["num_heads"]))
    out = {"head_dim": head_dim, "rotary_dim": int(key("rope.dimension_count", head_dim))}
    original = key("rope.scaling.original_context_length", required=False)
    if key("rope.scaling.attn_factor", required=False) is not None:  # LongRoPE: factors are tensors
        # (rope_factors_long/short.weight, which engine.loader.gguf_loader.read_config reads)
        out["rope_scaling"] = {"rope_type": "longrope", "original_max_position_embeddings": int(original),
                               "short_factor": None, "long_factor": None}
        attn_factor = key("rope.scaling.attn_factor", required=False)
        if attn_factor is not None:
            out["rope_scaling"]["attention_factor"] = float(attn_factor)
    return out


def _gguf_moe(arch: str, key: Callable, fields: dict) -> dict:
    num_experts = int(key("expert_count", 0))
    if not num_experts:
        return {}
    out = dict(num_experts=num_experts, num_experts_per_tok=int(key("expert_used_count")),
               moe_intermediate_size=int(key("expert_feed_forward_length", fields["intermediate_size"])))
    if arch == "llama":
        out.update(architecture="mixtral", norm_topk_prob=True)
    else:
        out.update(qk_norm="head", norm_topk_prob=bool(key("expert_weights_norm", True)))  # llama.cpp: always
    return out


def _gguf_granite(arch: str, key: Callable, fields: dict) -> dict:
    return dict(embedding_scale=float(key("embedding_scale", 1.0)),
                residual_scale=float(key("residual_scale", 1.0)),
                attention_scale=float(key("attention.scale", fields["head_dim"] ** -0.5)),
                logit_scale=1.0 / float(key("logit_scale", 1.0)))


_GGUF_EXTRAS: dict[str, Callable[[str, Callable, dict], dict]] = {
    "qwen3": lambda arch, key, fields: dict(qk_norm="head"),
    "gemma2": _gguf_gemma, "gemma3": _gguf_gemma, "granite": _gguf_granite,
    "olmo2": lambda arch, key, fields: dict(qk_norm="all", pre_norms=False, post_norms=True),
    "phi3": _gguf_phi3, "qwen3moe": _gguf_moe, "llama": _gguf_moe,
}


def gguf_extras(arch: str, key: Callable, fields: dict[str, Any]) -> dict[str, Any]:
    """The family's ModelConfig fields from GGUF metadata; key(name, default=None, required=True)
    reads ``{arch}.{name}``."""
    extras = _GGUF_EXTRAS.get(arch)
    return {} if extras is None else extras(arch, key, fields)
