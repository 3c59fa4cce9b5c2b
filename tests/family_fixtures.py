"""Helpers of the model-family tests: small random transformers checkpoints saved with a real
tokenizer, llama.cpp's own convert_hf_to_gguf.py (from the pinned llama-cpp-python sdist) to
write them as GGUF, and our logits over a whole prompt and one decode step at a time."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch
from tokenizer_fixtures import TESTDATA, default_model_path

from engine.batch import single_sequence_batch

SDIST = TESTDATA / "sdist" / "llama_cpp_python-0.3.36.tar.gz"
CONVERTER_MEMBERS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
TEXT = ("The quick brown fox jumps over the lazy dog. A model family is proven against its reference "
        "implementation: whole prompts and one decode step at a time, past the sliding window, in float32. "
        "Numbers 12345 and symbols {}[]() round out the prompt. Every layer's norms, scales and windows "
        "count; the experts of a mixture are routed per token, and the cache keeps what attention reads.")
NUM_DECODE = 64
BLOCK_SIZE = 4
TOLERANCE = 1e-3  # max |dlogit| relative to the reference's logit range


def write_tokenizer(directory: Path) -> int:
    """SmolLM2's tokenizer (from the default model's GGUF, as our loader reads it) saved the way
    transformers saves one; -> its vocabulary size."""
    from transformers import PreTrainedTokenizerFast

    from engine.tokenizer import load_tokenizer

    tok = load_tokenizer(default_model_path())
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(tok.backend.to_str(), encoding="utf-8")
    fast = PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"), bos_token=tok.bos_token,
                                   eos_token=tok.eos_token)
    fast.save_pretrained(directory)
    return fast.backend_tokenizer.get_vocab_size(with_added_tokens=True)


def prompt_ids(directory: Path, num_tokens: int) -> list[int]:
    from engine.tokenizer import load_tokenizer

    ids = load_tokenizer(directory).encode(TEXT, add_special_tokens=False)
    assert len(ids) >= num_tokens, len(ids)
    return ids[:num_tokens]


def randomize(model, seed: int, scale: float = 0.05):
    """Every parameter moved off its initializer (norms off 1 or 0, biases off 0)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return model.eval().float()


def save_checkpoint(model, directory: Path) -> Path:
    write_tokenizer(directory)
    if model.config.model_type == "phi3":  # as Phi-4-mini ships it (llama.cpp's converter reads the class)
        config_path = directory / "tokenizer_config.json"
        config = json.loads(config_path.read_text())
        config_path.write_text(json.dumps({**config, "tokenizer_class": "GPT2Tokenizer"}))
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def reference_logits(model, ids: list[int]) -> torch.Tensor:
    """transformers' logits [T, V] of one forward over the whole sequence."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def prompt_logits(ours, ids: list[int]) -> torch.Tensor:
    num_blocks = -(-len(ids) // BLOCK_SIZE)
    cache = ours.make_kv_cache(num_blocks, BLOCK_SIZE)
    return ours.forward(single_sequence_batch(ids, 0, list(range(num_blocks)), BLOCK_SIZE, "all"), cache)


def decode_logits(ours, ids: list[int], num_prompt: int, seed: int = 0) -> torch.Tensor:
    """A prompt of num_prompt tokens, then one token per step through a shuffled block table ->
    the logits [T, V] of every position."""
    num_blocks = -(-len(ids) // BLOCK_SIZE)
    table = random.Random(seed).sample(range(2 * num_blocks), num_blocks)
    cache = ours.make_kv_cache(2 * num_blocks, BLOCK_SIZE)
    pieces = [ours.forward(single_sequence_batch(ids[:num_prompt], 0, table, BLOCK_SIZE, "all"), cache)]
    for pos in range(num_prompt, len(ids)):
        batch = single_sequence_batch(ids[pos:pos + 1], pos, table, BLOCK_SIZE, "all")
        pieces.append(ours.forward(batch, cache))
    return torch.cat(pieces)


def relative_error(logits: torch.Tensor, reference: torch.Tensor) -> float:
    """max |dlogit| / the reference's logit range."""
    return float((logits - reference).abs().max() / (reference.max() - reference.min()))


@pytest.fixture(scope="session")
def converter(tmp_path_factory) -> Path:
    """llama.cpp's convert_hf_to_gguf.py with its conversion package and gguf-py, from the sdist."""
    if not SDIST.is_file():
        pytest.fail(f"{SDIST} is missing: run `make testdata` (tests/fetch_testdata.py) first")
    return extract_converter(tmp_path_factory.mktemp("llamacpp"))


def extract_converter(dest: Path) -> Path:
    """Unpack convert_hf_to_gguf.py and what it imports from the sdist into ``dest``."""
    prefix = "llama_cpp_python-0.3.36/vendor/llama.cpp/"
    with tarfile.open(SDIST, "r:gz") as tar:
        members = [m for m in tar.getmembers() if m.isfile() and m.name.startswith(prefix)
                   and m.name[len(prefix):].startswith(CONVERTER_MEMBERS)]
        for member in members:
            member.name = member.name[len(prefix):]
        tar.extractall(dest, members=members, filter="data")
    return dest / "convert_hf_to_gguf.py"


def convert_to_gguf(converter: Path, directory: Path, outfile: Path, outtype: str = "f32") -> Path:
    """Run llama.cpp's converter offline (float32 tensors, or --outtype q8_0 ...)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)  # the converter's own gguf-py, not the tree's
    command = [sys.executable, str(converter), str(directory), "--outtype", outtype, "--outfile", str(outfile)]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    if result.returncode != 0:
        raise AssertionError(f"convert_hf_to_gguf.py failed:\n{result.stderr[-3000:]}")
    return outfile


def write_gemma2_gguf(model, outfile: Path) -> Path:
    """Gemma 2 as llama.cpp's converter writes it (its Gemma2Model needs a SentencePiece
    tokenizer.model, which the test tokenizer is not): the metadata of its set_gguf_parameters,
    the tensors named by gguf-py's own TensorNameMap, norms + 1, no lm_head (tied)."""
    import gguf

    cfg = model.config
    writer = gguf.GGUFWriter(str(outfile), "gemma2")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
    writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    writer.add_sliding_window(cfg.sliding_window)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA2, cfg.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":
            continue
        data = tensor.float()
        if name.endswith("norm.weight"):
            data = data + 1
        target = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert target is not None, name
        writer.add_tensor(target, data.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return outfile
