"""Each model family against transformers (pinned, requirements-test.txt) on a small random
checkpoint with the family's real structure, saved as safetensors with a real tokenizer and
converted to GGUF by llama.cpp's own convert_hf_to_gguf.py: our logits over the whole prompt
and one decode step at a time (64 steps, past the sliding windows) stay within 1e-3 of the
logit range in float32. A negative control per family: leaving out one piece of its
structure (a norm, a scale, a window) moves the logits far past that bound."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine.loader import load_model
from engine.loader.hf_loader import family_state_dict, load_hf_state_dict
from engine.models import LlamaModel
from family_fixtures import (NUM_DECODE, TOLERANCE, convert_to_gguf, converter, decode_logits,  # noqa: F401
                             prompt_ids, prompt_logits, randomize, reference_logits, relative_error, save_checkpoint,
                             write_gemma2_gguf)

VOCAB = 49153  # SmolLM2's tokenizer as our GGUF reader builds it (one id past the file's for raw bytes)
NUM_PROMPT = 16
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6)


def qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(**SMALL, num_hidden_layers=2, rope_parameters={
        "rope_type": "default", "rope_theta": 5000.0}))


WINDOW = 8  # sliding windows well inside the 80-token contexts


def gemma3(query_pre_attn_scalar: int = 16):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    # six layers: llama.cpp's pattern (five sliding, one full), each kind with its own RoPE base
    return Gemma3ForCausalLM(Gemma3TextConfig(
        **SMALL, num_hidden_layers=6, sliding_window=WINDOW, query_pre_attn_scalar=query_pre_attn_scalar,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}))


def gemma2():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    # alternating sliding (even) and full layers; soft-caps low enough to bite on random weights
    return Gemma2ForCausalLM(Gemma2Config(**SMALL, num_hidden_layers=4, sliding_window=WINDOW,
                                          query_pre_attn_scalar=16, attn_logit_softcapping=0.5,
                                          final_logit_softcapping=3.0))


def granite():
    from transformers import GraniteConfig, GraniteForCausalLM

    return GraniteForCausalLM(GraniteConfig(**SMALL, num_hidden_layers=2, tie_word_embeddings=True,
                                            embedding_multiplier=12.0, residual_multiplier=0.22,
                                            attention_multiplier=4.0, logits_scaling=8.0))


def olmo2():
    from transformers import Olmo2Config, Olmo2ForCausalLM

    return Olmo2ForCausalLM(Olmo2Config(**SMALL, num_hidden_layers=2))


def phi3():
    from transformers import Phi3Config, Phi3ForCausalLM

    # Phi-4-mini's shape: partial rotary (here 8 of 16 dims), LongRoPE past an original context of
    # 32 positions (the 80-token contexts use the long factors, in transformers and here)
    g = torch.Generator().manual_seed(7)
    short, long = (1 + torch.rand(4, generator=g)).tolist(), (1 + 4 * torch.rand(4, generator=g)).tolist()
    return Phi3ForCausalLM(Phi3Config(
        **SMALL, num_hidden_layers=2, original_max_position_embeddings=32, pad_token_id=0,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                         "short_factor": short, "long_factor": long, "original_max_position_embeddings": 32}))


FAMILIES = {"qwen3": qwen3, "gemma3": gemma3, "gemma2": gemma2, "granite": granite, "olmo2": olmo2, "phi3": phi3,
            "gemma3_scalar": lambda: gemma3(query_pre_attn_scalar=24)}  # llama.cpp derives it: no GGUF
ARCHITECTURE = {"gemma3_scalar": "gemma3"}
GGUF_FAMILIES = ["gemma3", "granite", "olmo2", "phi3", "qwen3"]
# What each family must not lose: (ModelConfig changes, what they leave out).
CONTROLS = {
    "qwen3": [({"qk_norm": None}, "q/k norms")],
    "gemma3": [({"post_norms": False}, "post-norms"), ({"qk_norm": None}, "q/k norms"),
               ({"embedding_scale": 1.0}, "sqrt(hidden) embedding scale"), ({"hidden_act": "silu"}, "GeGLU"),
               ({"rope_local_theta": None}, "the sliding layers' RoPE base"),
               ({"layer_types": None, "sliding_window": None}, "sliding windows")],
    "gemma2": [({"post_norms": False}, "post-norms"), ({"attn_logit_softcap": None}, "attention soft-cap"),
               ({"final_logit_softcap": None}, "final soft-cap"),
               ({"layer_types": None, "sliding_window": None}, "sliding windows")],
    "granite": [({"embedding_scale": 1.0}, "embedding multiplier"), ({"residual_scale": 1.0}, "residual multiplier"),
                ({"attention_scale": None}, "attention multiplier"), ({"logit_scale": 1.0}, "logits scaling")],
    "olmo2": [({"post_norms": False}, "post-norms"), ({"qk_norm": None}, "q/k norms")],
    "phi3": [(lambda c: {"rotary_dim": None, "rope_scaling": _padded_factors(c.rope_scaling)}, "partial rotary"),
             ({"rope_scaling": None}, "LongRoPE")],
    "gemma3_scalar": [({"attention_scale": 16 ** -0.5}, "query_pre_attn_scalar")],
}


def _padded_factors(scaling: dict) -> dict:
    """LongRoPE factors for every dim pair (the extra pairs' factors 1)."""
    pad = [1.0] * len(scaling["short_factor"])
    return {**scaling, "short_factor": scaling["short_factor"] + pad, "long_factor": scaling["long_factor"] + pad}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family -> (transformers model, safetensors directory, token ids), built once."""
    built = {}

    def get(family: str):
        if family not in built:
            torch.manual_seed(0)
            model = randomize(FAMILIES[family](), seed=1)
            directory = save_checkpoint(model, tmp_path_factory.mktemp(family))
            ids = prompt_ids(directory, NUM_PROMPT + NUM_DECODE)
            built[family] = (model, directory, ids, reference_logits(model, ids))
        return built[family]
    return get


def check_against_reference(ours, ids, reference) -> tuple[float, float]:
    prompt_error = relative_error(prompt_logits(ours, ids), reference)
    decode_error = relative_error(decode_logits(ours, ids, NUM_PROMPT), reference)
    assert prompt_error <= TOLERANCE and decode_error <= TOLERANCE, (prompt_error, decode_error)
    return prompt_error, decode_error


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_safetensors_matches_transformers(checkpoints, family):
    _, directory, ids, reference = checkpoints(family)
    ours = load_model(directory, quantization="float32")
    assert ours.config.architecture == ARCHITECTURE.get(family, family)
    print(family, "safetensors", check_against_reference(ours, ids, reference))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_torch_path_matches_transformers(checkpoints, family):
    _, directory, ids, reference = checkpoints(family)
    ours = load_model(directory, quantization="float32")
    ours.use_fused = False
    check_against_reference(ours, ids, reference)


@pytest.mark.parametrize("family", GGUF_FAMILIES)
def test_gguf_from_llamacpp_converter_matches_transformers(checkpoints, converter, tmp_path, family):  # noqa: F811
    _, directory, ids, reference = checkpoints(family)
    path = convert_to_gguf(converter, directory, tmp_path / f"{family}.gguf")
    ours = load_model(path, quantization="float32")
    assert ours.config.architecture == family
    print(family, "gguf", check_against_reference(ours, ids, reference))


def test_gemma2_gguf_matches_transformers(checkpoints, tmp_path):
    """Written with gguf-py as llama.cpp's converter writes it (family_fixtures.write_gemma2_gguf)."""
    model, _, ids, reference = checkpoints("gemma2")
    ours = load_model(write_gemma2_gguf(model, tmp_path / "gemma2.gguf"), quantization="float32")
    assert ours.config.architecture == "gemma2" and ours.config.layer_types == ("sliding", "full") * 2
    print("gemma2 gguf", check_against_reference(ours, ids, reference))


@pytest.mark.parametrize("family, change, what", [(f, c, w) for f in sorted(CONTROLS) for c, w in CONTROLS[f]])
def test_leaving_out_structure_breaks_parity(checkpoints, family, change, what):
    _, directory, ids, reference = checkpoints(family)
    config, state_dict = load_hf_state_dict(directory)
    change = change(config) if callable(change) else change
    ours = LlamaModel(replace(config, **change), family_state_dict(config, state_dict))
    error = relative_error(prompt_logits(ours, ids), reference)
    assert error > 10 * TOLERANCE, f"{family} without {what}: error {error}"
