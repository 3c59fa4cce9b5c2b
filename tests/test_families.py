"""Each model family against transformers (pinned, requirements-test.txt) on a small random
checkpoint with the family's real structure, saved as safetensors with a real tokenizer and
converted to GGUF by llama.cpp's own convert_hf_to_gguf.py: our logits over the whole prompt
and one decode step at a time (64 steps, past the sliding windows) stay within 1e-3 of the
logit range in float32. A negative control per family: leaving out one piece of its
structure (a norm, a scale, a window) moves the logits far past that bound."""
from __future__ import annotations

import contextlib
from dataclasses import replace

import pytest
import torch
from family_fixtures import (  # noqa: F401
    NUM_DECODE,
    TOLERANCE,
    convert_to_gguf,
    converter,
    decode_logits,
    prompt_ids,
    prompt_logits,
    randomize,
    reference_logits,
    relative_error,
    save_checkpoint,
    write_gemma2_gguf,
)

from engine.loader import load_model
from engine.loader.hf_loader import family_state_dict, load_hf_state_dict, quantize_int4
from engine.models import LlamaModel

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


def qwen3moe(norm_topk_prob: bool = True, mlp_only_layers: tuple[int, ...] = ()):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    # 8 experts, top 2 (renormalised, as Qwen3-30B-A3B)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**SMALL, num_hidden_layers=3, num_experts=8, num_experts_per_tok=2,
                                              moe_intermediate_size=32, norm_topk_prob=norm_topk_prob,
                                              mlp_only_layers=list(mlp_only_layers)))


def mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(MixtralConfig(**SMALL, num_hidden_layers=2, num_local_experts=4,
                                            num_experts_per_tok=2, rope_theta=10000.0))


FAMILIES = {"qwen3": qwen3, "qwen3moe": qwen3moe, "mixtral": mixtral,
            # a dense layer 1 and no renormalisation: llama.cpp's qwen3moe has neither (no GGUF)
            "qwen3moe_mixed": lambda: qwen3moe(norm_topk_prob=False, mlp_only_layers=(1,)),
            "gemma3": gemma3, "gemma2": gemma2, "granite": granite, "olmo2": olmo2, "phi3": phi3,
            "gemma3_scalar": lambda: gemma3(query_pre_attn_scalar=24)}  # llama.cpp derives it: no GGUF
ARCHITECTURE = {"gemma3_scalar": "gemma3", "qwen3moe_mixed": "qwen3moe"}
GGUF_FAMILIES = ["gemma3", "granite", "mixtral", "olmo2", "phi3", "qwen3", "qwen3moe"]
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
    "qwen3moe": [({"norm_topk_prob": False}, "top-k renormalisation"), ({"num_experts_per_tok": 1}, "top 2"),
                 ({"qk_norm": None}, "q/k norms")],
    "qwen3moe_mixed": [({"norm_topk_prob": True}, "no renormalisation")],
    "mixtral": [({"num_experts_per_tok": 1}, "top 2")],
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


ROUTER_NEAR_TIE = 1e-4  # k-th vs (k+1)-th router probability: a rounding may pick either expert


def _routing_near_ties(model, ids: list[int], monkeypatch) -> torch.Tensor:
    """[T] bool: positions where some layer's k-th and (k+1)-th router probabilities are within
    ROUTER_NEAR_TIE in one forward of the model (no MoE layers: none)."""
    from engine.models.moe import MixtureOfExperts

    near = torch.zeros(len(ids), dtype=torch.bool)
    route = MixtureOfExperts.route

    def spy(self, h):
        probs = torch.nn.functional.linear(h.float(), self.router).softmax(dim=-1).sort(dim=-1, descending=True)[0]
        near.logical_or_(probs[:, self.top_k - 1] - probs[:, self.top_k] < ROUTER_NEAR_TIE)
        return route(self, h)

    with monkeypatch.context() as patch:
        patch.setattr(MixtureOfExperts, "route", spy)
        prompt_logits(model, ids)
    return near


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_int4_is_the_exact_product_of_its_dequantized_weights(checkpoints, family, monkeypatch):
    """quantization="int4" is off transformers by int4's own rounding, not by its kernels: on these
    Gaussian random weights group-32 min/max codes err by ~7.7% rms per weight, 0.13-0.25 of the
    logit range after a few layers (measured, qwen3 / olmo2 / gemma3), while the int4 model's
    logits equal a float32 model of its dequantized weights (float16 KV cache, as int4 keeps it)
    within the family bound, whole prompt and decode steps (the int16 activation codes). Positions
    where a router's k-th and (k+1)-th experts nearly tie are left out of both checks: there
    the activation codes' 2^-15 may pick the other expert (Mixtral's position 52: 6e-6 apart), and so
    are the decode steps after the first such tie, which read its K/V (Qwen3-MoE's position 70:
    1.8e-5 apart, then 0.007 of the logit range at position 75)."""
    _, directory, ids, _ = checkpoints(family)
    config, state_dict = load_hf_state_dict(directory)
    dequantized = {name: w.dequantize().float() if hasattr(w, "dequantize") else w
                   for name, w in quantize_int4(family_state_dict(config, state_dict)).items()}
    plain = LlamaModel(config, dequantized, dtype="float32", kv_cache_dtype="float16")
    reference = prompt_logits(plain, ids)
    decisive = ~_routing_near_ties(plain, ids, monkeypatch)
    ours = load_model(directory, quantization="int4")
    with _expert_choices(monkeypatch) as prompt_chosen:
        prompt = prompt_logits(ours, ids)
    with _expert_choices(monkeypatch) as chosen:
        decoded = decode_logits(ours, ids, NUM_PROMPT)
    with _expert_choices(monkeypatch) as planned:
        prompt_logits(plain, ids)
    # A row that took the other expert of a near tie wrote its K/V from that expert's output,
    # and every later position reads it: each check stops at its first such position (the
    # prompt's too: its products take the integer routes' codes where they measure fastest).
    in_prompt = torch.ones(len(ids), dtype=torch.bool)
    flipped = [p for p in range(len(ids))
               if _experts_at(prompt_chosen, p, len(ids)) != _experts_at(planned, p, len(ids))]
    assert all(not decisive[p] for p in flipped)  # only a near tie may flip
    in_prompt[min(flipped, default=len(ids)):] = False
    prompt_error = relative_error(prompt[in_prompt], reference[in_prompt])
    flipped = [p for p in range(len(ids)) if _experts_at(chosen, p, NUM_PROMPT) != _experts_at(planned, p, len(ids))]
    decisive[min(flipped, default=len(ids)):] = False
    assert all(not decisive[p] for p in flipped)  # only a near tie may flip
    decode_error = relative_error(decoded[decisive], reference[decisive])
    print(family, "int4", prompt_error, decode_error, f"{int((~decisive).sum())} positions left out")
    assert prompt_error <= TOLERANCE and decode_error <= TOLERANCE, (prompt_error, decode_error)
    assert int(decisive.sum()) >= len(ids) // 2 and int(in_prompt.sum()) >= len(ids) // 2


@contextlib.contextmanager
def _expert_choices(monkeypatch):
    """-> the list of expert ids [T, k] (sorted per row) of every router call, in call order."""
    from engine.models.moe import MixtureOfExperts

    calls = []
    route = MixtureOfExperts.route

    def spy(self, h):
        weights, ids = route(self, h)
        calls.append(ids.sort(dim=-1)[0])
        return weights, ids

    with monkeypatch.context() as patch:
        patch.setattr(MixtureOfExperts, "route", spy)
        yield calls


def _experts_at(calls: list, position: int, num_first_rows: int) -> list:
    """The experts every MoE layer chose for ``position``: ``calls`` are one forward of
    num_first_rows rows (one call per layer), then forwards of one row each."""
    if not calls:
        return []
    num_layers = next((i for i, c in enumerate(calls) if c.shape[0] != num_first_rows), len(calls))
    if position < num_first_rows:
        return [c[position].tolist() for c in calls[:num_layers]]
    step = position - num_first_rows + 1
    return [c[0].tolist() for c in calls[step * num_layers:(step + 1) * num_layers]]


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


class ExpertCalls:
    """Records which experts run, and over how many rows, in each MoE layer."""

    def __init__(self, model):
        self.calls: list[tuple[int, int, int]] = []  # (layer, expert, rows)
        for i, layer in enumerate(model.layers):
            if layer.moe is not None:
                layer.moe.experts = [(self._wrap(gate_up, i, j), down) for j, (gate_up, down) in
                                     enumerate(layer.moe.experts)]

    def _wrap(self, linear, layer: int, expert: int):
        def call(x):
            self.calls.append((layer, expert, x.shape[0]))
            return linear(x)
        return call


@pytest.mark.parametrize("family", ["mixtral", "qwen3moe_mixed"])
def test_experts_run_once_per_forward_and_decode_reads_only_the_selected(checkpoints, family):
    _, directory, ids, _ = checkpoints(family)
    ours = load_model(directory, quantization="float32")
    calls = ExpertCalls(ours)
    prompt_logits(ours, ids)  # 80 rows: each expert's product once, over all the rows routed to it
    per_layer: dict[int, list[tuple[int, int]]] = {}
    for layer, expert, rows in calls.calls:
        per_layer.setdefault(layer, []).append((expert, rows))
    top_k = ours.config.num_experts_per_tok
    for layer, runs in per_layer.items():
        experts = [e for e, _ in runs]
        assert len(experts) == len(set(experts)), f"layer {layer}: an expert ran twice in one forward"
        assert sum(rows for _, rows in runs) == top_k * len(ids)
    calls.calls.clear()
    decode_logits(ours, ids[:NUM_PROMPT + 3], NUM_PROMPT)  # the last 3 forwards are single decode rows
    decode_runs = [c for c in calls.calls if c[2] == 1][-3 * len(per_layer) * top_k:]
    assert len(decode_runs) == 3 * len(per_layer) * top_k  # k experts per MoE layer per step, no more
    layer = ours.layers[next(iter(per_layer))]
    x = torch.randn(1, ours.config.hidden_size)
    _, selected = layer.moe.route(x)
    assert selected.shape == (1, top_k)


@pytest.mark.parametrize("family", ["mixtral", "qwen3moe"])
def test_quantized_experts_run_in_the_kernels(checkpoints, converter, tmp_path, family):  # noqa: F811
    """A Q8_0 file (llama.cpp's converter --outtype q8_0): the experts load as the file's int8
    codes and run in the quantized kernels, with the logits of exact float32 products of the same
    weights (the file dequantized), prompt and decode."""
    _, directory, ids, _ = checkpoints(family)
    path = convert_to_gguf(converter, directory, tmp_path / f"{family}-q8_0.gguf", outtype="q8_0")
    ours = load_model(path)  # quantization "auto"
    moe = next(layer.moe for layer in ours.layers if layer.moe is not None)
    assert {gate_up.format for gate_up, _ in moe.experts} == {"int8"}
    exact = prompt_logits(load_model(path, quantization="float32"), ids)
    errors = (relative_error(prompt_logits(ours, ids), exact),
              relative_error(decode_logits(ours, ids, NUM_PROMPT), exact))
    print(family, "q8_0 kernels vs exact", errors)
    assert max(errors) <= TOLERANCE, errors


def test_unsupported_architectures_name_the_supported_ones(tmp_path):
    import json

    import gguf

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*Gemma3ForCausalLM.*Qwen3MoeForCausalLM") as info:
        load_model(tmp_path)
    assert "\n" not in str(info.value)
    path = tmp_path / "falcon.gguf"
    writer = gguf.GGUFWriter(str(path), "falcon")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", torch.zeros(8, 4).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"'falcon'.*'gemma2'.*'phi3'.*'qwen3moe'") as info:
        load_model(path)
    assert "\n" not in str(info.value)
