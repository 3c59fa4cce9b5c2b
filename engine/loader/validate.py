"""Model files checked against the model's own shapes before any tensor is used.

A file downloaded from anywhere sizes what the loader allocates, so nothing here trusts it:
the metadata becomes a ModelConfig (its integers inside engine.models.config.BOUNDS), then every
tensor the architecture needs must be present with the shape that config implies (TENSOR_TABLES,
one table per architecture: a family adds its rows), in a type the loader converts. Safetensors
headers are read here too (our own reader: offsets inside the file, byte counts matching shapes),
so config.json is checked against them before the safetensors library maps anything.

Every failure is a ModelFileError (a ValueError) whose message starts with the file and names
the tensor or key at fault and what the metadata implies. Reading costs milliseconds (headers only).
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from engine.errors import ModelFileError
from engine.gguf_file import GGUFFile
from engine.models.config import ModelConfig

__all__ = [
    "GGUF_WEIGHT_TYPES",
    "TENSOR_TABLES",
    "TensorSpec",
    "check_gguf",
    "check_hf_directory",
    "check_tensor_shapes",
    "gguf_config",
    "hf_config",
    "read_safetensors_header",
    "safetensors_files",
]


@dataclass(frozen=True)
class TensorSpec:
    """One tensor an architecture reads. name: its Hugging Face name, "{i}" standing for each
    layer. shape: numpy order, each dim a ModelConfig field or a product ("num_heads * head_dim").
    required: "always", "optional" (checked when present), or a ModelConfig bool field that makes
    it required ("attention_bias"; "!tie_word_embeddings" for its negation)."""

    name: str
    shape: tuple[str, ...]
    required: str = "always"


_Q_ROWS, _KV_ROWS = "num_heads * head_dim", "num_kv_heads * head_dim"
DECODER_TENSORS = (
    TensorSpec("model.embed_tokens.weight", ("vocab_size", "hidden_size")),
    TensorSpec("lm_head.weight", ("vocab_size", "hidden_size"), "!tie_word_embeddings"),
    TensorSpec("model.norm.weight", ("hidden_size",)),
    TensorSpec("model.layers.{i}.input_layernorm.weight", ("hidden_size",)),
    TensorSpec("model.layers.{i}.self_attn.q_proj.weight", (_Q_ROWS, "hidden_size")),
    TensorSpec("model.layers.{i}.self_attn.k_proj.weight", (_KV_ROWS, "hidden_size")),
    TensorSpec("model.layers.{i}.self_attn.v_proj.weight", (_KV_ROWS, "hidden_size")),
    TensorSpec("model.layers.{i}.self_attn.q_proj.bias", (_Q_ROWS,), "attention_bias"),
    TensorSpec("model.layers.{i}.self_attn.k_proj.bias", (_KV_ROWS,), "attention_bias"),
    TensorSpec("model.layers.{i}.self_attn.v_proj.bias", (_KV_ROWS,), "attention_bias"),
    TensorSpec("model.layers.{i}.self_attn.o_proj.weight", ("hidden_size", _Q_ROWS)),
    TensorSpec("model.layers.{i}.self_attn.o_proj.bias", ("hidden_size",), "optional"),
    TensorSpec("model.layers.{i}.post_attention_layernorm.weight", ("hidden_size",)),
    TensorSpec("model.layers.{i}.mlp.gate_proj.weight", ("intermediate_size", "hidden_size")),
    TensorSpec("model.layers.{i}.mlp.up_proj.weight", ("intermediate_size", "hidden_size")),
    TensorSpec("model.layers.{i}.mlp.down_proj.weight", ("hidden_size", "intermediate_size")),
)
# OLMo 2 has no pre-norms (its post-norms are checked when present); Phi-3's fused qkv_proj and
# gate_up_proj are sized by the loader's split (their rows are sums of fields).
_OLMO2_TENSORS = tuple(t for t in DECODER_TENSORS if "input_layernorm" not in t.name)
_PHI3_TENSORS = tuple(t for t in DECODER_TENSORS
                      if not any(p in t.name for p in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")))
# ModelConfig.architecture -> the tensors it reads. New families add a row (or a table of their own).
# A mixture-of-experts config (num_experts > 0) drops the dense mlp rows: its experts are sized by
# the MoE loader.
TENSOR_TABLES: dict[str, tuple[TensorSpec, ...]] = {
    "llama": DECODER_TENSORS,
    "qwen2": DECODER_TENSORS,
    "mistral": DECODER_TENSORS,
    "qwen3": DECODER_TENSORS,
    "qwen3moe": DECODER_TENSORS,
    "mixtral": DECODER_TENSORS,
    "granite": DECODER_TENSORS,
    "gemma2": DECODER_TENSORS,
    "gemma3": DECODER_TENSORS,
    "olmo2": _OLMO2_TENSORS,
    "phi3": _PHI3_TENSORS,
}

# ModelConfig field -> the GGUF key (after "{arch}.") it comes from, to name keys in errors.
GGUF_KEYS = {
    "vocab_size": "vocab_size",
    "hidden_size": "embedding_length",
    "intermediate_size": "feed_forward_length",
    "num_layers": "block_count",
    "num_heads": "attention.head_count",
    "num_kv_heads": "attention.head_count_kv",
    "head_dim": "attention.key_length or rope.dimension_count",
    "max_position_embeddings": "context_length",
    "rms_norm_eps": "attention.layer_norm_rms_epsilon",
    "rope_theta": "rope.freq_base",
    "sliding_window": "attention.sliding_window",
    "rope_scaling": "rope.scaling.factor",
    "num_experts": "expert_count",
    "num_experts_per_tok": "expert_used_count",
}
# ggml types the GGUF loader converts (engine.loader.repack: its own and gguf.quants'); the rest
# (Q8_1, Q8_K, the integer types, F64, ...) are refused before any conversion starts.
GGUF_WEIGHT_TYPES = frozenset(
    {0, 1, 2, 3, 6, 7, 8, 10, 11, 12, 13, 14, 16, 17, 18, 19, 20, 21, 22, 23, 29, 30, 34, 35, 39}
)


def ggml_type_name(ggml_type: int) -> str:
    """ "Q4_1 (3)" for a type gguf knows, the number otherwise."""
    try:
        from gguf.constants import GGMLQuantizationType

        return f"{GGMLQuantizationType(ggml_type).name} ({ggml_type})"
    except (ImportError, ValueError):
        return str(ggml_type)


def _dim(config: ModelConfig, expr: str) -> int:
    return math.prod(getattr(config, name.strip()) for name in expr.split("*"))


def _is_required(config: ModelConfig, required: str) -> bool:
    if required in ("always", "optional"):
        return required == "always"
    if required.startswith("!"):
        return not getattr(config, required[1:])
    return bool(getattr(config, required))


def _describe(config: ModelConfig, spec: TensorSpec, field_name: Callable[[str], str]) -> str:
    parts = []
    for expr in spec.shape:
        names = [n.strip() for n in expr.split("*")]
        parts.append(" x ".join(f"{field_name(n)} = {getattr(config, n)}" for n in names))
    return "; ".join(parts)


def check_tensor_shapes(
    config: ModelConfig,
    shapes: Mapping[str, tuple[int, ...]],
    path: str,
    file_name: Callable[[str], str] = repr,
    field_name: Callable[[str], str] = str,
) -> None:
    """Every tensor of config's architecture in `shapes` (Hugging Face name -> shape) with the
    shape config implies. file_name / field_name: how the file spells a tensor / a config field."""
    table = TENSOR_TABLES.get(config.architecture)
    if table is None:
        raise ModelFileError(f"{path}: no tensor table for architecture {config.architecture!r}", path)
    if config.num_experts:
        table = tuple(spec for spec in table if ".mlp." not in spec.name)
    for spec in table:
        expected = tuple(_dim(config, d) for d in spec.shape)
        names = (
            [spec.name.format(i=i) for i in range(config.num_layers)] if "{i}" in spec.name else [spec.name]
        )
        for name in names:
            shape = shapes.get(name)
            if shape is None:
                if _is_required(config, spec.required):
                    raise ModelFileError(
                        f"{path}: tensor {file_name(name)} is missing: the {config.architecture} "
                        f"architecture needs it with shape {list(expected)} "
                        f"({_describe(config, spec, field_name)})",
                        path,
                    )
                continue
            if tuple(shape) != expected:
                raise ModelFileError(
                    f"{path}: tensor {file_name(name)} has shape {list(shape)}, but the metadata implies "
                    f"{list(expected)} ({_describe(config, spec, field_name)})",
                    path,
                )


# ---------------------------------------------------------------- GGUF


def gguf_config(gguf: GGUFFile) -> ModelConfig:
    """The GGUF file's ModelConfig (bounds checked), errors naming the key."""
    path, metadata, tensors = gguf.path, gguf.metadata, gguf.tensors
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str):
        raise ModelFileError(f"{path}: GGUF metadata has no general.architecture", path)
    if "token_embd.weight" not in tensors:
        raise ModelFileError(f"{path}: GGUF file has no token_embd.weight tensor", path)
    embd = tensors["token_embd.weight"]
    if len(embd.dims) != 2:
        raise ModelFileError(
            f"{path}: tensor 'token_embd.weight' has {len(embd.dims)} dims, expected 2", path
        )
    try:
        return ModelConfig.from_gguf_metadata(
            metadata,
            vocab_size=int(embd.dims[1]),
            attention_bias="blk.0.attn_q.bias" in tensors,
            tie_word_embeddings="output.weight" not in tensors,
        )
    except (ValueError, TypeError, OverflowError) as exc:
        detail = str(exc)
        field = detail.split(":", 1)[0]
        if field in GGUF_KEYS:
            keys = " or ".join(f"{arch}.{key}" for key in GGUF_KEYS[field].split(" or "))
            detail += f" (GGUF key {keys})"
        raise ModelFileError(f"{path}: {detail}", path) from None


def check_gguf(
    gguf: GGUFFile,
    hf_names: Callable[[str, object, ModelConfig], list[tuple[str, int | None]]],
    gguf_name: Callable[[str, str], str],
) -> ModelConfig:
    """-> the file's ModelConfig once its tensors match it (shapes, types, rope_freqs). hf_names:
    the loader's family-aware renaming (engine.loader.gguf_loader.hf_names: GGUF name, its info and
    the config -> [(Hugging Face name, expert index or None)]); gguf_name its inverse (name,
    architecture), naming missing tensors in errors. Expert tensors ([X, rows, cols])
    are type-checked here and sized by the MoE loader."""
    config = gguf_config(gguf)
    path, arch = gguf.path, gguf.metadata["general.architecture"]
    shapes, gguf_names = {}, {}
    for name, info in gguf.tensors.items():
        pairs = hf_names(name, info, config)
        if not pairs:
            continue
        for hf, expert in pairs:
            if expert is None:
                shapes[hf] = info.shape
                gguf_names[hf] = name
        if info.ggml_type not in GGUF_WEIGHT_TYPES:
            raise ModelFileError(
                f"{path}: tensor {name!r} has ggml type {ggml_type_name(info.ggml_type)}, which "
                "the loader cannot convert",
                path,
            )

    def file_name(hf: str) -> str:
        return repr(gguf_names.get(hf) or gguf_name(hf, config.architecture))

    def field_name(field: str) -> str:
        if field not in GGUF_KEYS:
            return field
        return " or ".join(f"{arch}.{key}" for key in GGUF_KEYS[field].split(" or "))

    check_tensor_shapes(config, shapes, path, file_name=file_name, field_name=field_name)
    freqs = gguf.tensors.get("rope_freqs.weight")
    if freqs is not None and (
        freqs.shape != (config.head_dim // 2,) or freqs.ggml_type not in GGUF_WEIGHT_TYPES
    ):
        raise ModelFileError(
            f"{path}: tensor 'rope_freqs.weight' has shape {list(freqs.shape)} (ggml type "
            f"{ggml_type_name(freqs.ggml_type)}), but the metadata implies [{config.head_dim // 2}] "
            f"(head_dim / 2)",
            path,
        )
    return config


# ---------------------------------------------------------------- Hugging Face directories

# safetensors dtype -> bytes per element.
_SAFETENSORS_ITEMSIZE = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}
MAX_SAFETENSORS_HEADER = 100 << 20  # the safetensors library's own limit


def read_safetensors_header(file: str | os.PathLike) -> dict[str, tuple[str, tuple[int, ...]]]:
    """-> name -> (dtype, shape), once every entry's byte range lies inside the file and holds
    exactly its shape's bytes. ModelFileError names the file and the entry otherwise."""
    path = os.fspath(file)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ModelFileError(f"{path}: truncated safetensors file ({size} bytes, no header)", path)
        (num_header,) = struct.unpack("<Q", head)
        if num_header > min(size - 8, MAX_SAFETENSORS_HEADER):
            raise ModelFileError(
                f"{path}: corrupt safetensors file: its header claims {num_header} bytes, "
                f"the file has {size}",
                path,
            )
        raw = f.read(num_header)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ModelFileError(f"{path}: corrupt safetensors header (not JSON: {exc})", path) from None
    if not isinstance(header, dict):
        raise ModelFileError(f"{path}: corrupt safetensors header (not a JSON object)", path)
    num_data = size - 8 - num_header
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        where = f"{path}: safetensors entry {name!r}"
        if not isinstance(entry, dict):
            raise ModelFileError(f"{where} is not an object", path)
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in _SAFETENSORS_ITEMSIZE:
            raise ModelFileError(f"{where}: unknown dtype {dtype!r}", path)
        if not isinstance(shape, list) or not all(type(d) is int and 0 <= d < 1 << 40 for d in shape):
            raise ModelFileError(f"{where}: shape {shape!r} is not a list of sizes", path)
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(type(o) is int for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]
        ):
            raise ModelFileError(f"{where}: data_offsets {offsets!r} is not [begin, end]", path)
        if offsets[1] > num_data:
            raise ModelFileError(
                f"{where}: data_offsets {offsets} overrun the file's {num_data} data bytes "
                "(truncated or corrupt)",
                path,
            )
        num_bytes = math.prod(shape) * _SAFETENSORS_ITEMSIZE[dtype]
        if offsets[1] - offsets[0] != num_bytes:
            raise ModelFileError(
                f"{where}: shape {shape} in {dtype} needs {num_bytes} bytes, its data_offsets "
                f"span {offsets[1] - offsets[0]}",
                path,
            )
        out[name] = (dtype, tuple(shape))
    return out


INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(directory: Path) -> list[Path]:
    """The directory's weight files: the shards model.safetensors.index.json lists, or *.safetensors."""
    index_path = directory / INDEX_FILE
    if index_path.is_file():
        try:
            index = json.loads(index_path.read_text(encoding="utf-8"))
            weight_map = index.get("weight_map") or {}
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, AttributeError, TypeError) as exc:
            raise ModelFileError(f"{index_path}: not a safetensors index ({exc})", str(index_path)) from None
        if not all(isinstance(n, str) and n and Path(n).name == n for n in names):
            raise ModelFileError(
                f"{index_path}: weight_map names files outside the directory", str(index_path)
            )
        files = [directory / name for name in names]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ModelFileError(
                f"{index_path}: lists shard files that do not exist: {missing}", str(index_path)
            )
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelFileError(
            f"{directory}: no *.safetensors weights (only safetensors checkpoints are supported)",
            str(directory),
        )
    return files


def hf_config(directory: str | os.PathLike) -> ModelConfig:
    """config.json -> ModelConfig (bounds checked); ModelFileError names config.json."""
    config_path = Path(directory) / "config.json"
    if not config_path.is_file():
        raise ModelFileError(
            f"{directory}: not a Hugging Face model directory (no config.json)", str(directory)
        )
    try:
        config_json = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelFileError(f"{config_path}: cannot read JSON: {exc}", str(config_path)) from None
    if not isinstance(config_json, dict):
        raise ModelFileError(f"{config_path}: expected a JSON object", str(config_path))
    try:
        return ModelConfig.from_hf_dict(config_json)
    except (ValueError, TypeError, OverflowError, AttributeError) as exc:
        raise ModelFileError(f"{config_path}: {exc}", str(config_path)) from None


def check_hf_directory(directory: str | os.PathLike) -> ModelConfig:
    """-> config.json's ModelConfig once every safetensors header is sound and holds the tensors
    config.json implies."""
    config = hf_config(directory)
    shapes: dict[str, tuple[int, ...]] = {}
    owner: dict[str, str] = {}
    for file in safetensors_files(Path(directory)):
        for name, (_, shape) in read_safetensors_header(file).items():
            shapes[name] = shape
            owner[name] = str(file)
    where = str(Path(directory) / "config.json")
    check_tensor_shapes(
        config, shapes, where, file_name=lambda n: f"{n!r} (in {owner.get(n, '*.safetensors')})"
    )
    return config
