"""Hugging Face model directories: config.json plus *.safetensors (one file, or shards
listed by model.safetensors.index.json)."""
from __future__ import annotations

import os
from pathlib import Path

import torch

from engine.errors import ModelFileError
from engine.loader.validate import check_hf_directory, safetensors_files
from engine.models.config import ModelConfig
from engine.models.families import HF_NORM_OFFSET
from engine.models.quant import Int4Weight, Int8Weight, Weight


def read_config(directory: Path) -> ModelConfig:
    """config.json's ModelConfig, checked against the safetensors headers (engine.loader.validate)."""
    return check_hf_directory(directory)


def load_hf_state_dict(path: str | os.PathLike) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from safetensors import safe_open

    directory = Path(path)
    config = read_config(directory)
    state_dict: dict[str, torch.Tensor] = {}
    for file in safetensors_files(directory):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    state_dict[name] = f.get_tensor(name)
        except Exception as exc:  # safetensors raises its own error types
            raise ModelFileError(f"{file}: cannot read safetensors: {exc}", str(file)) from None
    return config, state_dict


def family_state_dict(config: ModelConfig, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The file's tensors as the model reads them: Gemma's norm weights w - 1 -> w (its RMSNorm is
    x * (1 + w); llama.cpp's converter adds the 1 when it writes the GGUF)."""
    offset = HF_NORM_OFFSET.get(config.architecture)
    if offset:
        state_dict = {name: t + offset if name.endswith("norm.weight") else t
                      for name, t in state_dict.items()}
    return state_dict


def quantize_int4(state_dict: dict[str, torch.Tensor]) -> dict[str, Weight]:
    """quantization="int4" for a dense checkpoint: projections -> int4 groups of 32, the
    embedding and head -> per-row int8 ("auto" keeps a dense checkpoint dense)."""
    out: dict[str, Weight] = {}
    for name, tensor in state_dict.items():
        if tensor.ndim != 2:
            out[name] = tensor
        elif name.startswith("model.layers."):
            out[name] = Int4Weight.from_dense(tensor)
        else:
            out[name] = Int8Weight.from_dense(tensor)
    return out


def load_hf(path: str | os.PathLike, dtype: str = "float32", quantization: str = "auto", pack_weights: bool = True,
            dense_above_rows: int | None = None, activations: str = "int16"):
    from engine.loader.gguf_loader import kv_cache_dtype
    from engine.models import LlamaModel

    config, state_dict = load_hf_state_dict(path)
    state_dict = family_state_dict(config, state_dict)
    if quantization == "int4":
        state_dict = quantize_int4(state_dict)
    try:
        return LlamaModel(config, state_dict, dtype=dtype, pack_weights=pack_weights,
                          dense_above_rows=dense_above_rows, kv_cache_dtype=kv_cache_dtype(dtype, quantization),
                          activations=activations)
    except ModelFileError:
        raise
    except ValueError as exc:
        raise ModelFileError(f"{os.fspath(path)}: {exc}", os.fspath(path)) from None
