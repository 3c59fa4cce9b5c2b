"""BERT-family encoders: a sentence-transformers directory (config.json, model.safetensors,
tokenizer.json, modules.json, 1_Pooling/config.json, 2_Normalize), a bare transformers one
(BertModel, BertForSequenceClassification as sentence-transformers' CrossEncoder saves it), or
a GGUF file of architecture ``bert`` as llama.cpp's convert_hf_to_gguf.py writes it (its tensor
names mapped back to Hugging Face's, GGUF_NAMES; its pooling from ``bert.pooling_type``).

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


GGUF_ARCHITECTURES = ("bert",)
GGUF_POOLING = {1: "mean", 2: "cls", 3: "last"}  # llama.cpp's enum llama_pooling_type
GGUF_NAMES = {  # llama.cpp's tensor names -> Hugging Face's (per layer: blk.{i}. -> encoder.layer.{i}.)
    "token_embd.weight": "embeddings.word_embeddings.weight",
    "position_embd.weight": "embeddings.position_embeddings.weight",
    "token_types.weight": "embeddings.token_type_embeddings.weight",
    "token_embd_norm.weight": "embeddings.LayerNorm.weight",
    "token_embd_norm.bias": "embeddings.LayerNorm.bias",
}
GGUF_LAYER_NAMES = {
    "attn_q": "attention.self.query",
    "attn_k": "attention.self.key",
    "attn_v": "attention.self.value",
    "attn_output": "attention.output.dense",
    "attn_output_norm": "attention.output.LayerNorm",
    "ffn_up": "intermediate.dense",
    "ffn_down": "output.dense",
    "layer_output_norm": "output.LayerNorm",
}


def is_encoder_path(path: str | os.PathLike) -> bool:
    """An encoder directory, or a GGUF file whose general.architecture is a BERT encoder."""
    from engine.gguf_file import is_gguf_file, read_gguf_metadata

    path = Path(path)
    if path.is_dir():
        return is_encoder_directory(path)
    if not is_gguf_file(path):
        return False
    try:
        architecture = read_gguf_metadata(path, with_vocabulary=False).get("general.architecture")
    except ValueError:
        return False  # the start-up check names what is wrong with the file
    return architecture in GGUF_ARCHITECTURES


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


def load_encoder_gguf(path: str | os.PathLike, dtype: str = "float32") -> BertModel:
    """A ``bert`` GGUF (float32, float16 or bfloat16 tensors): BertModel with the file's pooling;
    ``max_model_len`` is the file's context length (sentence-transformers' max_seq_length is not
    stored in it)."""
    import numpy as np
    import torch

    from engine.gguf_file import GGUFFile, ModelFileError

    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype: an encoder runs in float32 or bfloat16, got {dtype!r}")
    path = os.fspath(path)
    with GGUFFile(path) as gguf:
        meta = gguf.metadata
        arch = meta.get("general.architecture")
        if arch not in GGUF_ARCHITECTURES:
            raise ModelFileError(f"{path}: general.architecture {arch!r} is not a BERT encoder", path)

        def key(name: str, default=None):
            value = meta.get(f"{arch}.{name}", default)
            if value is None:
                raise ModelFileError(f"{path}: the header has no {arch}.{name}", path)
            return value

        if meta.get(f"{arch}.attention.causal", False):
            raise ModelFileError(f"{path}: {arch}.attention.causal is true; a BERT encoder is bidirectional", path)
        tokens = meta.get("tokenizer.ggml.tokens") or []
        if f"{arch}.classifier.output_labels" in meta or "cls.output.weight" in gguf.tensors:
            raise ModelFileError(f"{path}: a cross-encoder GGUF is not supported yet (use its directory)", path)
        config = BertConfig.from_hf_dict({
            "vocab_size": len(tokens) or int(key("vocab_size")),
            "hidden_size": int(key("embedding_length")),
            "num_hidden_layers": int(key("block_count")),
            "num_attention_heads": int(key("attention.head_count")),
            "intermediate_size": int(key("feed_forward_length")),
            "max_position_embeddings": int(key("context_length")),
            "type_vocab_size": int(meta.get("tokenizer.ggml.token_type_count", 2)),
            "layer_norm_eps": float(key("attention.layer_norm_epsilon")),
            "hidden_act": "gelu",
        })
        state_dict = {}
        for name in gguf.tensors:
            block, _, rest = name.partition(".")
            if name in GGUF_NAMES:
                hf_name = GGUF_NAMES[name]
            elif block == "blk" and rest.partition(".")[2].rpartition(".")[0] in GGUF_LAYER_NAMES:
                index, _, tail = rest.partition(".")
                role, _, kind = tail.rpartition(".")
                hf_name = f"encoder.layer.{index}.{GGUF_LAYER_NAMES[role]}.{kind}"
            else:
                continue  # (no pooler: llama.cpp's converter drops it)
            array = gguf.array(name)
            if array.dtype == np.uint16:  # bfloat16 stored as its bits
                tensor = torch.from_numpy(array.astype(np.int32) << 16).view(torch.float32)
            else:
                tensor = torch.from_numpy(array.astype(np.float32))
            state_dict[hf_name] = tensor
        pooling_type = int(meta.get(f"{arch}.pooling_type", 2))
        if pooling_type not in GGUF_POOLING:
            raise ModelFileError(
                f"{path}: {arch}.pooling_type {pooling_type} is not one of "
                f"{', '.join(f'{k} ({v})' for k, v in GGUF_POOLING.items())}", path)
        try:
            model = BertModel(config, state_dict, dtype=torch.bfloat16 if dtype == "bfloat16" else torch.float32)
        except ValueError as exc:
            raise ModelFileError(f"{path}: {exc}", path) from None
    model.pooling = GGUF_POOLING[pooling_type]
    model.normalize = True  # llama.cpp's embeddings are L2-normalised by default
    model.score_activation = "identity"
    return model
