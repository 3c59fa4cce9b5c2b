"""Loaders: Hugging Face safetensors directories (single file and sharded) and GGUF files
(written here the way llama.cpp's convert_hf_to_gguf does) give transformers' logits;
the default GGUF re-saved as a safetensors directory gives the GGUF path's logits; bad
inputs raise errors that name the file and the problem."""
from __future__ import annotations

import json
import os

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from engine.batch import single_sequence_batch
from engine.loader import default_model_path, load_model, release_free_heap
from engine.loader.gguf_loader import load_gguf_state_dict
from engine.models import LlamaModel
from engine.models.config import ModelConfig

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rope_theta=10000.0, rms_norm_eps=1e-6)
IDS = [5, 17, 99, 3, 64, 12, 127, 0, 45, 45, 8, 77, 31, 2, 90, 60, 11, 4, 100, 23]


def hf_model(kind: str, seed: int = 0, rope_scaling: bool = True):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    if kind == "llama":
        rope = {"rope_type": "default", "rope_theta": 10000.0}
        if rope_scaling:
            rope.update(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                        original_max_position_embeddings=16)
        model = LlamaForCausalLM(LlamaConfig(**TINY, rope_parameters=rope))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**TINY, tie_word_embeddings=True))
    with torch.no_grad():  # random biases and norms, not the zeros/ones of the initializer
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval().float()


def hf_logits(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()  # [T, V]


def our_logits(model, ids=IDS) -> torch.Tensor:
    num_blocks = -(-len(ids) // 16)
    cache = model.make_kv_cache(num_blocks, 16)
    return model.forward(single_sequence_batch(ids, 0, list(range(num_blocks)), 16, "all"), cache)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("max_shard_size", [None, "60KB"])
def test_safetensors_dir_matches_transformers(tmp_path, kind, max_shard_size):
    model = hf_model(kind)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(tmp_path, safe_serialization=True, **kwargs)
    if max_shard_size:
        assert (tmp_path / "model.safetensors.index.json").is_file()
        assert len(list(tmp_path.glob("*.safetensors"))) > 1
    ours = load_model(tmp_path, quantization="float32")
    assert ours.config.architecture == kind and ours.config.attention_bias == (kind == "qwen2")
    torch.testing.assert_close(our_logits(ours), hf_logits(model), atol=1e-4, rtol=0)


def llamacpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.permute (q/k rows: halves -> interleaved pairs)."""
    return (w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def write_gguf(path, model, arch: str, qtype=gguf.GGMLQuantizationType.F32) -> None:
    """The tensors and metadata llama.cpp's converter writes for a Llama or Qwen2 checkpoint."""
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    layer_names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                   "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                   "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                   "mlp.down_proj": "ffn_down"}
    state = model.state_dict()
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    for name, tensor in state.items():
        w = tensor.float().numpy()
        if name.startswith("model.layers."):
            _, _, i, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            target = f"blk.{i}.{layer_names[module]}.{kind}"
            if arch == "llama" and module == "self_attn.q_proj":
                w = llamacpp_permute(w, cfg.num_attention_heads)
            elif arch == "llama" and module == "self_attn.k_proj":
                w = llamacpp_permute(w, cfg.num_key_value_heads)
        else:
            target = names[name]
        if w.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(target, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(target, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_gguf_file_matches_transformers(tmp_path, kind):
    model = hf_model(kind, seed=1, rope_scaling=False)  # the GGUF metadata written here has no scaling
    path = tmp_path / "tiny.gguf"
    write_gguf(path, model, kind)
    ours = load_model(path, quantization="float32")
    assert ours.config.architecture == kind
    assert ours.config.tie_word_embeddings == (kind == "qwen2")
    torch.testing.assert_close(our_logits(ours), hf_logits(model), atol=1e-4, rtol=0)


@pytest.mark.parametrize("qtype", ["F16", "BF16", "Q8_0", "Q4_1", "Q5_0"])
def test_gguf_quant_types_dequantize_like_gguf(tmp_path, qtype):
    model = hf_model("llama", seed=2, rope_scaling=False)
    qtype = gguf.GGMLQuantizationType[qtype]
    path = tmp_path / "tiny.gguf"
    write_gguf(path, model, "llama", qtype)
    _, state_dict, _ = load_gguf_state_dict(path)
    reader = gguf.GGUFReader(str(path))
    tensor = next(t for t in reader.tensors if t.name == "blk.1.ffn_down.weight")
    assert tensor.tensor_type == qtype
    expected = gguf.quants.dequantize(tensor.data, qtype).reshape(64, 96)
    np.testing.assert_array_equal(state_dict["model.layers.1.mlp.down_proj.weight"].numpy(), expected)
    assert load_model(path, dtype="bfloat16").dtype == torch.bfloat16


@pytest.mark.slow
def test_default_gguf_resaved_as_safetensors_gives_same_logits(tmp_path):
    config, state_dict, _ = load_gguf_state_dict(default_model_path())
    save_file({k: v.contiguous() for k, v in state_dict.items()}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(config.to_hf_dict()))
    from_dir = load_model(tmp_path, quantization="float32")
    assert from_dir.config == config
    ids = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407]
    from_gguf = LlamaModel(config, state_dict)  # what load_model does with a .gguf path
    torch.testing.assert_close(our_logits(from_dir, ids), our_logits(from_gguf, ids), atol=1e-5, rtol=0)


def test_default_model_path_is_the_embedded_gguf():
    path = default_model_path()
    assert path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"


def test_missing_path(tmp_path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        load_model(missing)


def test_text_file_named_gguf(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_text("hello, not a model")
    with pytest.raises(ValueError, match=r"x\.gguf.*not a GGUF file"):
        load_model(path)


def test_other_file_type(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match=r"weights\.bin.*not a GGUF file"):
        load_model(path)


def test_directory_without_config_json(tmp_path):
    with pytest.raises(ValueError, match=rf"{tmp_path.name}.*no config\.json"):
        load_model(tmp_path)


def test_directory_without_safetensors(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], **TINY}))
    with pytest.raises(ValueError, match=r"no \*\.safetensors"):
        load_model(tmp_path)


def test_unknown_hf_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(ValueError, match=r"config\.json.*GPT2LMHeadModel"):
        load_model(tmp_path)


def test_unknown_gguf_architecture(tmp_path):
    path = tmp_path / "phi.gguf"
    writer = gguf.GGUFWriter(str(path), "phi2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"phi\.gguf.*architecture.*'phi2'"):
        load_model(path)


def test_unsupported_gguf_quant_type(tmp_path):
    model = hf_model("llama", seed=3, rope_scaling=False)
    path = tmp_path / "int.gguf"
    write_gguf(path, model, "llama")
    # Rewrite one weight as I32, a ggml type gguf.quants cannot dequantize.
    reader = gguf.GGUFReader(str(path))
    writer = gguf.GGUFWriter(str(tmp_path / "bad.gguf"), "llama")
    for field in reader.fields.values():
        if field.name.startswith("llama."):
            writer.add_key_value(field.name, field.contents(), field.types[0])
    for t in reader.tensors:
        data = np.asarray(t.data).reshape([int(n) for n in reversed(t.shape)])
        if t.name == "blk.0.ffn_up.weight":
            data = data.astype(np.int32)
        writer.add_tensor(t.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"bad\.gguf.*blk\.0\.ffn_up\.weight.*I32"):
        load_model(tmp_path / "bad.gguf")


def test_invalid_dtype_is_rejected_before_loading(tmp_path):
    with pytest.raises(ValueError, match="dtype"):
        load_model(tmp_path / "missing.gguf", dtype="float16")


def test_config_from_gguf_metadata_errors():
    with pytest.raises(ValueError, match="general.architecture"):
        ModelConfig.from_gguf_metadata({"general.architecture": "falcon"})
    with pytest.raises(ValueError, match=r"GGUF metadata lacks llama\."):
        ModelConfig.from_gguf_metadata({"general.architecture": "llama", "llama.embedding_length": 64,
                                        "llama.attention.head_count": 4})


def _resident_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


@pytest.mark.skipif(not os.path.exists("/proc/self/status") or not release_free_heap(),
                    reason="needs glibc's malloc_trim and /proc (Linux)")
def test_release_free_heap_returns_freed_load_temporaries_to_the_os():
    # Blocks below glibc's mmap threshold stay in the heap when freed, as a load's repacking
    # temporaries do; one kept at the end stops the heap's top from shrinking by itself.
    blocks = [np.ones(16 * 1024, dtype=np.float32) for _ in range(3000)]  # 64 KiB each, ~190 MB
    keep = np.ones(16 * 1024, dtype=np.float32)
    del blocks
    before = _resident_mb()
    assert release_free_heap()
    assert before - _resident_mb() > 100
    assert keep.sum() == 16 * 1024
