"""Hugging Face model directories: config.json plus *.safetensors (one file, or shards
listed by model.safetensors.index.json)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from engine.models.config import ModelConfig
from engine.models.quant import Int4Weight, Int8Weight, Weight

INDEX_FILE = "model.safetensors.index.json"


def read_config(directory: Path) -> ModelConfig:
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{directory}: not a Hugging Face model directory (no config.json)")
    try:
        config_json = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{config_path}: cannot read JSON: {exc}") from None
    if not isinstance(config_json, dict):
        raise ValueError(f"{config_path}: expected a JSON object")
    try:
        return ModelConfig.from_hf_dict(config_json)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{config_path}: {exc}") from None


def safetensors_files(directory: Path) -> list[Path]:
    index_path = directory / INDEX_FILE
    if index_path.is_file():
        weight_map = json.loads(index_path.read_text(encoding="utf-8")).get("weight_map") or {}
        files = [directory / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index_path}: lists shard files that do not exist: {missing}")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{directory}: no *.safetensors weights (only safetensors checkpoints are supported)")
    return files


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
            raise ValueError(f"{file}: cannot read safetensors: {exc}") from None
    return config, state_dict


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
            dense_above_rows: int | None = None):
    from engine.loader.gguf_loader import kv_cache_dtype
    from engine.models import LlamaModel

    config, state_dict = load_hf_state_dict(path)
    if quantization == "int4":
        state_dict = quantize_int4(state_dict)
    try:
        return LlamaModel(config, state_dict, dtype=dtype, pack_weights=pack_weights,
                          dense_above_rows=dense_above_rows, kv_cache_dtype=kv_cache_dtype(dtype, quantization))
    except ValueError as exc:
        raise ValueError(f"{os.fspath(path)}: {exc}") from None
