"""GGUF files through the ``gguf`` package: metadata to ModelConfig, weights dequantized
with ``gguf.quants.dequantize``, renamed to Hugging Face names, and llama.cpp's Q/K row
permutation undone (``convert_hf_to_gguf`` permutes q_proj/k_proj rows for the "llama"
architecture so ggml can rotate adjacent pairs; Qwen2 uses NeoX rotation and is stored
unpermuted)."""
from __future__ import annotations

import os
import re
from typing import Any

import numpy as np
import torch

from engine.gguf_file import is_gguf_file
from engine.models.config import ModelConfig

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")


def hf_name(gguf_name: str) -> str | None:
    """GGUF tensor name -> Hugging Face name, None for tensors the model does not use."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_RE.fullmatch(gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
    return None


def unpermute_qk(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's ``permute``: rows per head go from interleaved pairs back to halves.

    w [num_heads * D, ...] (a weight or a bias) -> same shape.
    """
    rows = w.shape[0]
    return (w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:])  # [N, D/2, 2, ...]
            .transpose(1, 2)  # [N, 2, D/2, ...]
            .reshape(w.shape))


def read_metadata(reader, path: str) -> dict[str, Any]:
    """Scalar and string metadata of the model (skips the tokenizer's large arrays)."""
    field = reader.get_field("general.architecture")
    if field is None:
        raise ValueError(f"{path}: GGUF metadata has no general.architecture")
    arch = field.contents()
    metadata = {"general.architecture": arch}
    for name, field in reader.fields.items():
        if name.startswith(arch + "."):
            metadata[name] = field.contents()
    return metadata


def _dequantize(tensor, path: str) -> torch.Tensor:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    qtype = tensor.tensor_type
    shape = tuple(int(n) for n in reversed(tensor.shape))  # ggml lists dims fastest first
    if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F64):
        array = np.asarray(tensor.data, dtype=np.float32)
    else:
        try:
            array = dequantize(tensor.data, qtype)
        except NotImplementedError:
            raise ValueError(
                f"{path}: tensor {tensor.name!r} has quantization type {qtype.name}, "
                "which gguf.quants cannot dequantize") from None
    return torch.from_numpy(np.array(array, dtype=np.float32, copy=True).reshape(shape))


def load_gguf_state_dict(path: str | os.PathLike) -> tuple[ModelConfig, dict[str, torch.Tensor], torch.Tensor | None]:
    """-> (config, state dict with Hugging Face names in float32, rope freq factors or None)."""
    from gguf import GGUFReader

    path = os.fspath(path)
    if not is_gguf_file(path):
        raise ValueError(f"{path}: not a GGUF file (the first bytes are not 'GGUF')")
    try:
        reader = GGUFReader(path)
    except Exception as exc:
        raise ValueError(f"{path}: cannot read GGUF file: {exc}") from exc
    metadata = read_metadata(reader, path)
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ValueError(f"{path}: GGUF file has no token_embd.weight tensor")
    vocab_size = int(tensors["token_embd.weight"].shape[1])
    try:
        config = ModelConfig.from_gguf_metadata(
            metadata,
            vocab_size=vocab_size,
            attention_bias="blk.0.attn_q.bias" in tensors,
            tie_word_embeddings="output.weight" not in tensors,
        )
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    is_permuted = metadata["general.architecture"] == "llama"
    state_dict: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        target = hf_name(name)
        if target is None:
            continue
        weight = _dequantize(tensor, path)
        if is_permuted and ".q_proj." in target:
            weight = unpermute_qk(weight, config.num_heads)
        elif is_permuted and ".k_proj." in target:
            weight = unpermute_qk(weight, config.num_kv_heads)
        state_dict[target] = weight
    freq_factors = _dequantize(tensors["rope_freqs.weight"], path) if "rope_freqs.weight" in tensors else None
    return config, state_dict, freq_factors


def load_gguf(path: str | os.PathLike, dtype: str = "float32", pack_weights: bool = True):
    from engine.models import LlamaModel

    config, state_dict, freq_factors = load_gguf_state_dict(path)
    try:
        return LlamaModel(config, state_dict, dtype=dtype, rope_freq_factors=freq_factors, pack_weights=pack_weights)
    except ValueError as exc:
        raise ValueError(f"{os.fspath(path)}: {exc}") from None
