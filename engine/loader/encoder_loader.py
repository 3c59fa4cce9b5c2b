"""BERT-family directories: a sentence-transformers model (config.json, model.safetensors,
tokenizer.json, modules.json, 1_Pooling/config.json, 2_Normalize) or a bare transformers one
(BertModel, BertForSequenceClassification as sentence-transformers' CrossEncoder saves it).

What sentence-transformers reads beside the weights becomes attributes of the model:
``pooling`` (1_Pooling/config.json: "mean" | "cls" | "max"; "cls" for a cross-encoder),
``max_model_len`` (sentence_bert_config.json's max_seq_length, else the positions),
``normalize`` (a Normalize module in modules.json), ``score_activation`` ("sigmoid" | "identity",
a cross-encoder's: sentence-transformers' default is a sigmoid over a single label).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from engine.loader.hf_loader import safetensors_files
from engine.models.bert import ARCHITECTURES, BertConfig, BertModel

POOLING_KEYS = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_lasttoken": "last",
}
ACTIVATIONS = {
    "torch.nn.modules.activation.Sigmoid": "sigmoid",
    "torch.nn.modules.linear.Identity": "identity",
}


def is_encoder_directory(path: str | os.PathLike) -> bool:
    """True for a directory whose config.json names a BERT architecture."""
    config = _read_json(Path(path) / "config.json")
    architectures = config.get("architectures") if isinstance(config, dict) else None
    return isinstance(architectures, list) and bool(architectures) and architectures[0] in ARCHITECTURES


def _read_json(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: cannot read JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return value


def _modules(directory: Path) -> list[dict]:
    path = directory / "modules.json"
    if not path.is_file():
        return []
    try:
        modules = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: cannot read JSON: {exc}") from None
    if not isinstance(modules, list):
        raise ValueError(f"{path}: expected a JSON list of modules")
    return [m for m in modules if isinstance(m, dict)]


def _pooling(directory: Path, modules: list[dict]) -> str:
    for module in modules:
        if str(module.get("type", "")).endswith(".Pooling"):
            path = directory / str(module.get("path", "")) / "config.json"
            config = _read_json(path) or {}
            modes = [mode for key, mode in POOLING_KEYS.items() if config.get(key)]
            if len(modes) != 1:
                raise ValueError(
                    f"{path}: expected exactly one pooling mode of {', '.join(POOLING_KEYS)}, "
                    f"got {modes or 'none'}"
                )
            return modes[0]
    return "cls"  # no Pooling module: a bare BERT, pooled as its pooler reads it


def load_encoder(path: str | os.PathLike, dtype: str = "float32") -> BertModel:
    """dtype: "float32" (the reference's numbers) or "bfloat16" (projections and attention)."""
    import torch
    from safetensors.torch import load_file

    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype: an encoder runs in float32 or bfloat16, got {dtype!r}")

    directory = Path(path)
    config_json = _read_json(directory / "config.json")
    if config_json is None:
        raise ValueError(f"{directory}: no config.json")
    try:
        config = BertConfig.from_hf_dict(config_json)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{directory / 'config.json'}: {exc}") from None
    state_dict = {}
    for file in safetensors_files(directory):
        try:
            state_dict.update(load_file(str(file)))
        except Exception as exc:  # safetensors raises its own error types
            raise ValueError(f"{file}: cannot read safetensors: {exc}") from None
    st_config = _read_json(directory / "sentence_bert_config.json") or {}
    max_len = st_config.get("max_seq_length")
    model = BertModel(
        config, state_dict, max_model_len=max_len if isinstance(max_len, int) and max_len > 0 else None,
        dtype=torch.bfloat16 if dtype == "bfloat16" else torch.float32,
    )
    modules = _modules(directory)
    model.pooling = "cls" if config.num_labels else _pooling(directory, modules)
    model.normalize = any(str(m.get("type", "")).endswith(".Normalize") for m in modules)
    activation = (config_json.get("sentence_transformers") or {}).get("activation_fn")
    if activation is not None and activation not in ACTIVATIONS:
        raise ValueError(
            f"{directory / 'config.json'}: sentence_transformers.activation_fn {activation!r} is not "
            f"supported (expected one of {', '.join(ACTIVATIONS)})"
        )
    model.score_activation = ACTIVATIONS.get(activation) or (
        "sigmoid" if config.num_labels == 1 else "identity"
    )
    return model
