"""Model hyper-parameters: one dataclass, validated on construction, built from a
Hugging Face ``config.json`` dict or from GGUF metadata."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ARCHITECTURES = ("llama", "qwen2", "mistral")
ROPE_SCALING_TYPES = ("linear", "llama3", "yarn")

# Hugging Face "architectures" entries and model_type values we can run.
_HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "MistralForCausalLM": "mistral",
}


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

    def __post_init__(self):
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"architecture: unsupported {self.architecture!r}, expected one of {ARCHITECTURES}")
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

    @classmethod
    def from_hf_dict(cls, config_json: dict[str, Any]) -> ModelConfig:
        """From the dict of a Hugging Face ``config.json``."""
        architecture = _hf_architecture(config_json)
        get = config_json.get
        num_heads = get("num_attention_heads")
        hidden_size = get("hidden_size")
        head_dim = get("head_dim") or (hidden_size // num_heads if hidden_size and num_heads else None)
        sliding_window = get("sliding_window")
        if architecture == "qwen2" and not get("use_sliding_window", False):
            sliding_window = None
        if architecture == "llama":
            sliding_window = None
        return cls(
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

    def to_hf_dict(self) -> dict[str, Any]:
        """The ``config.json`` dict transformers would read back into the same model."""
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
        arch = metadata.get("general.architecture")
        if arch not in ("llama", "qwen2"):
            raise ValueError(
                f"general.architecture: unsupported GGUF architecture {arch!r}, expected 'llama' or 'qwen2'")

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
        return cls(
            architecture=arch,
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


def _hf_architecture(config_json: dict[str, Any]) -> str:
    for name in config_json.get("architectures") or ():
        if name in _HF_ARCHITECTURES:
            return _HF_ARCHITECTURES[name]
    model_type = config_json.get("model_type")
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
    factor = scaling.get("factor")
    if not isinstance(factor, (int, float)) or factor <= 0:
        raise ValueError(f"rope_scaling.factor: must be a positive number, got {factor!r}")
    if rope_type == "llama3":
        for name in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if name not in scaling:
                raise ValueError(f"rope_scaling.{name}: required for rope_type 'llama3'")
    return scaling
