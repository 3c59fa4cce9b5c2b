"""Model hyper-parameters: one dataclass, validated on construction, built from a
Hugging Face ``config.json`` dict or from GGUF metadata."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ARCHITECTURES = ("llama", "qwen2", "mistral", "qwen3", "gemma2", "gemma3", "granite", "olmo2", "phi3",
                 "qwen3moe", "mixtral")
ROPE_SCALING_TYPES = ("linear", "llama3", "yarn", "longrope")
QK_NORMS = ("head", "all")
HIDDEN_ACTS = ("silu", "gelu_tanh")
LAYER_TYPES = ("full", "sliding")

# Hugging Face "architectures" entries and model_type values we can run.
_HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "MistralForCausalLM": "mistral",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "GraniteForCausalLM": "granite",
    "Olmo2ForCausalLM": "olmo2",
    "Phi3ForCausalLM": "phi3",
    "Qwen3MoeForCausalLM": "qwen3moe",
    "MixtralForCausalLM": "mixtral",
}
_HF_MODEL_TYPES = {"gemma3_text": "gemma3", "qwen3_moe": "qwen3moe"}


@dataclass
class ModelConfig:
    architecture: str  # "llama" | "qwen2" | "mistral"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": "linear" | "llama3" | "yarn", "factor": ..., ...}
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    sliding_window: int | None = None  # Mistral / Qwen2: attend to at most this many keys
    # The families' structure (engine.models.families reads it from config.json or GGUF metadata):
    layer_types: tuple[str, ...] | None = None  # "full" | "sliding" per layer (Gemma); None: sliding_window
    rope_local_theta: float | None = None  # RoPE base of the sliding layers (Gemma 3); None: rope_theta
    rotary_dim: int | None = None  # dims of each head that RoPE rotates (Phi partial rotary); None: head_dim
    qk_norm: str | None = None  # RMSNorm of q and k before RoPE: "head" (Qwen3, Gemma 3), "all" (OLMo 2)
    pre_norms: bool = True  # RMSNorm before attention and FFN (OLMo 2: none)
    post_norms: bool = False  # RMSNorm of the attention and FFN outputs (Gemma 2/3, OLMo 2)
    hidden_act: str = "silu"  # "silu" (SwiGLU) | "gelu_tanh" (Gemma's GeGLU)
    embedding_scale: float = 1.0  # embeddings times this (Gemma: sqrt(E); Granite: embedding_multiplier)
    residual_scale: float = 1.0  # each block's output times this (Granite: residual_multiplier)
    attention_scale: float | None = None  # softmax scale; None: 1 / sqrt(head_dim)
    logit_scale: float = 1.0  # logits times this (Granite: 1 / logits_scaling)
    attn_logit_softcap: float | None = None  # Gemma 2: scores -> cap * tanh(scores / cap)
    final_logit_softcap: float | None = None  # Gemma 2: the same on the logits
    num_experts: int = 0  # mixture of experts (Qwen3-MoE, Mixtral): experts per MoE layer
    num_experts_per_tok: int = 0  # top-k
    moe_intermediate_size: int = 0  # each expert's FFN width
    norm_topk_prob: bool = True  # renormalise the top-k router probabilities
    dense_layers: tuple[int, ...] = ()  # layers of an MoE model with a dense FFN

    def __post_init__(self):
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"architecture: unsupported {self.architecture!r}, expected one of {ARCHITECTURES}")
        if self.layer_types is not None:
            self.layer_types = tuple(self.layer_types)
            if len(self.layer_types) != self.num_layers or not set(self.layer_types) <= set(LAYER_TYPES):
                raise ValueError(f"layer_types: expected {self.num_layers} of {LAYER_TYPES}, "
                                 f"got {self.layer_types!r}")
            if "sliding" in self.layer_types and not self.sliding_window:
                raise ValueError("layer_types: sliding layers need a sliding_window")
        self.dense_layers = tuple(self.dense_layers)
        if self.qk_norm not in (None, *QK_NORMS):
            raise ValueError(f"qk_norm: unsupported {self.qk_norm!r}, expected None or one of {QK_NORMS}")
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"hidden_act: unsupported {self.hidden_act!r}, expected one of {HIDDEN_ACTS}")
        rotary_dim = self.rotary_dim
        if rotary_dim is not None and not (0 < rotary_dim <= self.head_dim and rotary_dim % 2 == 0):
            raise ValueError(f"rotary_dim: must be even and in 1..{self.head_dim}, got {self.rotary_dim!r}")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok: must be in 1..{self.num_experts}, "
                             f"got {self.num_experts_per_tok}")
        if self.num_experts and self.moe_intermediate_size <= 0:
            raise ValueError(f"moe_intermediate_size: must be > 0, got {self.moe_intermediate_size}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name}: must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(f"num_kv_heads: {self.num_kv_heads} does not divide num_heads {self.num_heads}")
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim: must be even for RoPE, got {self.head_dim}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps: must be > 0, got {self.rms_norm_eps!r}")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta: must be > 0, got {self.rope_theta!r}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window: must be a positive int or None, got {self.sliding_window!r}")
        self.rope_scaling = _normalize_rope_scaling(self.rope_scaling)

    def layer_window(self, i: int) -> int | None:
        """The sliding window of layer i (None: full attention)."""
        if self.layer_types is None or self.layer_types[i] == "sliding":
            return self.sliding_window
        return None

    def is_moe_layer(self, i: int) -> bool:
        return self.num_experts > 0 and i not in self.dense_layers

    @classmethod
    def from_hf_dict(cls, config_json: dict[str, Any]) -> ModelConfig:
        """From the dict of a Hugging Face ``config.json``."""
        from engine.models.families import hf_extras

        architecture = _hf_architecture(config_json)
        get = config_json.get
        num_heads = get("num_attention_heads")
        hidden_size = get("hidden_size")
        head_dim = get("head_dim") or (hidden_size // num_heads if hidden_size and num_heads else None)
        sliding_window = get("sliding_window")
        if architecture == "qwen2" and not get("use_sliding_window", False):
            sliding_window = None
        no_window = ("llama", "qwen3", "granite", "olmo2", "qwen3moe")  # unless use_sliding_window says so
        if architecture in no_window and not get("use_sliding_window"):
            sliding_window = None
        fields = dict(
            architecture=architecture,
            vocab_size=get("vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=get("intermediate_size"),
            num_layers=get("num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(get("rms_norm_eps", 1e-6 if architecture == "qwen2" else 1e-5)),
            rope_theta=float(get("rope_theta") or (get("rope_parameters") or {}).get("rope_theta", 10000.0)),
            rope_scaling=get("rope_scaling") or _rope_parameters_scaling(get("rope_parameters")),
            max_position_embeddings=get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            attention_bias=True if architecture == "qwen2" else bool(get("attention_bias", False)),
            sliding_window=sliding_window,
        )
        fields.update(hf_extras(architecture, config_json, fields))
        return cls(**fields)

    def to_hf_dict(self) -> dict[str, Any]:
        """The ``config.json`` dict transformers would read back into the same model (the Llama-like
        architectures; the other families' structure has no writer here)."""
        if self.architecture not in ("llama", "qwen2", "mistral"):
            raise ValueError(f"to_hf_dict: not written for architecture {self.architecture!r}")
        hf_arch = {v: k for k, v in _HF_ARCHITECTURES.items()}[self.architecture]
        out = {
            "architectures": [hf_arch],
            "model_type": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
        }
        if self.architecture == "llama":
            out["attention_bias"] = self.attention_bias
        if self.architecture != "llama":
            out["sliding_window"] = self.sliding_window
            out["use_sliding_window"] = self.sliding_window is not None
        return out

    @classmethod
    def from_gguf_metadata(cls, metadata: dict[str, Any], *, vocab_size: int | None = None,
                           attention_bias: bool = False, tie_word_embeddings: bool = False) -> ModelConfig:
        """From GGUF key/value metadata (``general.architecture`` and ``{arch}.*`` keys).

        Mistral GGUFs say "llama". Facts only the tensors know (vocab size when the
        metadata lacks it, q/k/v bias, a missing output.weight) come as arguments.
        """
        from engine.models.families import GGUF_ARCHITECTURES, gguf_extras

        arch = metadata.get("general.architecture")
        if arch not in GGUF_ARCHITECTURES:
            raise ValueError(f"general.architecture: unsupported GGUF architecture {arch!r}, "
                             f"expected one of {tuple(GGUF_ARCHITECTURES)}")

        def key(name, default=None, required=True):
            value = metadata.get(f"{arch}.{name}", default)
            if value is None and required:
                raise ValueError(f"GGUF metadata lacks {arch}.{name}")
            return value

        hidden_size = int(key("embedding_length"))
        num_heads = int(key("attention.head_count"))
        head_dim = key("attention.key_length", required=False) or key("rope.dimension_count", required=False)
        head_dim = int(head_dim) if head_dim else hidden_size // num_heads
        scaling_type = key("rope.scaling.type", required=False)
        rope_scaling = None
        if scaling_type not in (None, "none"):
            rope_scaling = {"rope_type": scaling_type}
            factor = key("rope.scaling.factor", required=False)
            if factor is not None:
                rope_scaling["factor"] = float(factor)
            original = key("rope.scaling.original_context_length", required=False)
            if original is not None:
                rope_scaling["original_max_position_embeddings"] = int(original)
        elif key("rope.scale_linear", required=False):
            rope_scaling = {"rope_type": "linear", "factor": float(key("rope.scale_linear"))}
        window = key("attention.sliding_window", required=False)
        fields = dict(
            architecture=GGUF_ARCHITECTURES[arch],
            vocab_size=int(key("vocab_size", vocab_size)),
            hidden_size=hidden_size,
            intermediate_size=int(key("feed_forward_length")),
            num_layers=int(key("block_count")),
            num_heads=num_heads,
            num_kv_heads=int(key("attention.head_count_kv", num_heads)),
            head_dim=head_dim,
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(key("context_length", 2048)),
            tie_word_embeddings=tie_word_embeddings,
            attention_bias=attention_bias,
            sliding_window=int(window) if window else None,
        )
        fields.update(gguf_extras(arch, key, fields))
        return cls(**fields)


def _hf_architecture(config_json: dict[str, Any]) -> str:
    for name in config_json.get("architectures") or ():
        if name in _HF_ARCHITECTURES:
            return _HF_ARCHITECTURES[name]
    model_type = config_json.get("model_type")
    model_type = _HF_MODEL_TYPES.get(model_type, model_type)
    if model_type in ARCHITECTURES:
        return model_type
    names = config_json.get("architectures") or model_type
    raise ValueError(f"architectures: unsupported model {names!r}, expected one of {sorted(_HF_ARCHITECTURES)}")


def _rope_parameters_scaling(rope_parameters: dict | None) -> dict | None:
    """transformers >= 5 writes ``rope_parameters`` (theta and scaling in one dict)."""
    if not rope_parameters or rope_parameters.get("rope_type", "default") == "default":
        return None
    return {k: v for k, v in rope_parameters.items() if k != "rope_theta"}


def _normalize_rope_scaling(rope_scaling: dict | None) -> dict | None:
    if rope_scaling is None:
        return None
    if not isinstance(rope_scaling, dict):
        raise ValueError(f"rope_scaling: must be a dict or None, got {rope_scaling!r}")
    scaling = dict(rope_scaling)
    rope_type = scaling.pop("type", None) or scaling.get("rope_type")
    if rope_type in (None, "default"):
        return None
    if rope_type not in ROPE_SCALING_TYPES:
        raise ValueError(f"rope_scaling: unsupported rope_type {rope_type!r}, expected one of {ROPE_SCALING_TYPES}")
    scaling["rope_type"] = rope_type
    if rope_type == "longrope":  # (Phi-3) factor: max / original positions when absent
        for name in ("short_factor", "long_factor", "original_max_position_embeddings"):
            if name not in scaling:
                raise ValueError(f"rope_scaling.{name}: required for rope_type 'longrope'")
        return scaling
    factor = scaling.get("factor")
    if not isinstance(factor, (int, float)) or factor <= 0:
        raise ValueError(f"rope_scaling.factor: must be a positive number, got {factor!r}")
    if rope_type == "llama3":
        for name in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if name not in scaling:
                raise ValueError(f"rope_scaling.{name}: required for rope_type 'llama3'")
    return scaling
