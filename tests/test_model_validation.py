"""Model files checked against their own shapes, and memory checked before it is taken (issue 27).

Each hostile edit is one field of a small real model (tests/test_model_files_fuzz.py writes it);
the error must be a ModelFileError naming the file and what is wrong, before any tensor is used."""

import json
import os
import struct
import subprocess
import sys

import pytest

from engine.errors import MemoryLimitError, ModelFileError
from engine.loader import load_model
from engine.loader.validate import read_safetensors_header
from engine.startup import check_memory, check_model_path, memory_available
from engine.tokenizer import load_tokenizer
from tests.test_model_files_fuzz import gguf_fields, write_tiny_gguf, write_tiny_hf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    write_tiny_gguf(root / "tiny.gguf")
    write_tiny_hf(root / "hf", root / "tiny.gguf")
    return root


def patched(tiny, tmp_path, field_name: str, value) -> str:
    raw = bytearray((tiny / "tiny.gguf").read_bytes())
    fields, _ = gguf_fields(bytes(raw))
    [(_, at, fmt, _)] = [f for f in fields if f[0] == field_name]
    raw[at : at + struct.calcsize(fmt)] = struct.pack("<" + fmt, value)
    path = tmp_path / "patched.gguf"
    path.write_bytes(bytes(raw))
    return str(path)


def test_the_tiny_model_loads(tiny):
    check_model_path(tiny / "tiny.gguf")
    check_model_path(tiny / "hf")
    assert load_model(tiny / "tiny.gguf").config.num_layers == 2


@pytest.mark.parametrize(
    "field,value,says",
    [
        (
            "blk.0.attn_q.weight.dims[1]",
            63,
            r"tensor 'blk\.0\.attn_q\.weight' has shape \[63, 64\], but the metadata implies "
            r"\[64, 64\] \(llama\.attention\.head_count = 4 x .*llama\.embedding_length = 64\)",
        ),
        (
            "blk.1.attn_k.weight.dims[1]",
            1,
            r"'blk\.1\.attn_k\.weight' has shape \[1, 64\].*\[32, 64\].*head_count_kv = 2",
        ),
        ("llama.feed_forward_length", 127, r"'blk\.0\.ffn_gate\.weight' has shape \[128, 64\].*\[127, 64\]"),
        ("llama.block_count", 3, r"tensor 'blk\.2\.attn_norm\.weight' is missing"),
        (
            "llama.context_length",
            2**31 - 1,
            r"max_position_embeddings: 2147483647 is outside the plausible range "
            r"\[32, 16777216\] \(GGUF key llama\.context_length\)",
        ),
        ("llama.attention.head_count", 0, r"num_heads: must be a positive int.*llama\.attention\.head_count"),
        (
            "blk.0.ffn_up.weight.type",
            9,
            r"'blk\.0\.ffn_up\.weight' has ggml type Q8_1 \(9\), which the loader cannot",
        ),
        ("output_norm.weight.dims[0]", 0, r"'output_norm\.weight' has a zero dim"),
    ],
)
def test_a_tensor_or_key_at_odds_with_the_metadata_names_both(tiny, tmp_path, field, value, says):
    path = patched(tiny, tmp_path, field, value)
    for attempt in (check_model_path, load_model):
        with pytest.raises(ModelFileError, match=says) as info:
            attempt(path)
        assert str(info.value).startswith(path) and info.value.path == path


def test_a_float_that_is_not_finite_is_refused(tiny, tmp_path):
    for value in (float("nan"), float("inf"), 0.0, -1.0):
        path = patched(tiny, tmp_path, "llama.rope.freq_base", value)
        with pytest.raises(
            ModelFileError, match="rope_theta: must be a finite number > 0.*llama.rope.freq_base"
        ):
            check_model_path(path)


def test_special_ids_outside_the_vocabulary_are_refused(tiny, tmp_path):
    path = patched(tiny, tmp_path, "tokenizer.ggml.eos_token_id", 10**9)
    with pytest.raises(
        ModelFileError,
        match=r"tokenizer\.ggml\.eos_token_id = 1000000000 is not a token id of this "
        r"vocabulary \(1024 tokens\)",
    ):
        load_tokenizer(path)


def test_a_merge_the_tokenizer_library_refuses_is_named(tiny, tmp_path):
    raw = (tiny / "tiny.gguf").read_bytes()
    merges = load_tokenizer(tiny / "tiny.gguf")  # sanity: the file's own merges load
    assert merges.vocab_size == 1024
    from engine.gguf_file import read_gguf_metadata

    first = read_gguf_metadata(tiny / "tiny.gguf")["tokenizer.ggml.merges"][0].encode()
    at = raw.index(struct.pack("<Q", len(first)) + first) + 8
    path = tmp_path / "merges.gguf"
    junk = bytes(b if b == 0x20 else 0x7E for b in first)  # "~~ ~": no such tokens
    path.write_bytes(raw[:at] + junk + raw[at + len(first) :])
    with pytest.raises(
        ModelFileError,
        match=r"tokenizer\.ggml\.merges\[0\] = .* is not in tokenizer\.ggml\.tokens; "
        r"the tokenizers library refuses the vocabulary",
    ) as info:
        load_tokenizer(path)
    assert "\n" not in str(info.value) and str(info.value).startswith(str(path))


def test_a_chat_template_that_does_not_compile_is_refused_at_load(tiny, tmp_path):
    (tmp_path / "hf").mkdir()
    for f in (tiny / "hf").iterdir():
        (tmp_path / "hf" / f.name).write_bytes(f.read_bytes())
    (tmp_path / "hf" / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": "{% for m in messages %}"})
    )
    with pytest.raises(
        ModelFileError,
        match=r"chat_template \(tokenizer_config\.json or chat_template\.jinja\): "
        r"chat template is not valid jinja2",
    ):
        load_tokenizer(tmp_path / "hf")


def _copy_hf(tiny, tmp_path):
    target = tmp_path / "hf"
    target.mkdir()
    for f in (tiny / "hf").iterdir():
        (target / f.name).write_bytes(f.read_bytes())
    return target


def _rewrite_header(file, edit):
    raw = file.read_bytes()
    (n,) = struct.unpack_from("<Q", raw)
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    text = json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :])


def test_safetensors_offsets_that_overrun_the_file_are_refused(tiny, tmp_path):
    model = _copy_hf(tiny, tmp_path)
    file = model / "model.safetensors"
    _rewrite_header(file, lambda h: h["model.norm.weight"].update(data_offsets=[0, 1 << 40]))
    with pytest.raises(
        ModelFileError, match=r"'model\.norm\.weight': data_offsets \[0, 1099511627776\] overrun"
    ):
        read_safetensors_header(file)
    with pytest.raises(ModelFileError, match="overrun"):
        load_model(model)


def test_config_json_is_checked_against_the_safetensors_headers(tiny, tmp_path):
    model = _copy_hf(tiny, tmp_path)
    config = json.loads((model / "config.json").read_text())
    config["intermediate_size"] = 96
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ModelFileError,
        match=r"config\.json: tensor 'model\.layers\.0\.mlp\.gate_proj\.weight' "
        r"\(in .*model\.safetensors\) has shape \[128, 64\], but the metadata "
        r"implies \[96, 64\]",
    ):
        check_model_path(model)


def test_a_header_length_beyond_the_file_is_refused(tiny, tmp_path):
    model = _copy_hf(tiny, tmp_path)
    file = model / "model.safetensors"
    raw = file.read_bytes()
    file.write_bytes(struct.pack("<Q", len(raw)) + raw[8:])
    with pytest.raises(ModelFileError, match="its header claims"):
        check_model_path(model)


# ---------------------------------------------------------------- memory


def fake_system(tmp_path, mem_available_kb: int, v1=None, v2=None):
    """A /proc and /sys/fs/cgroup of plain files: meminfo, the process's cgroup lines and limits."""
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(f"MemTotal: 99999999 kB\nMemAvailable: {mem_available_kb} kB\n")
    lines = []
    if v1 is not None:
        d = root / "memory" / "job"
        d.mkdir(parents=True)
        (d / "memory.limit_in_bytes").write_text(f"{v1[0]}\n")
        (d / "memory.usage_in_bytes").write_text(f"{v1[1]}\n")
        lines.append("4:memory:/job")
    if v2 is not None:
        d = root / "outer" / "inner"
        d.mkdir(parents=True)
        (root / "outer" / "memory.max").write_text(f"{v2[0]}\n")
        (root / "outer" / "memory.current").write_text(f"{v2[1]}\n")
        (d / "memory.max").write_text("max\n")
        (d / "memory.current").write_text("1\n")
        lines.append("0::/outer/inner")
    (proc / "self" / "cgroup").write_text("\n".join(lines) + "\n")
    return root, proc


def test_memory_available_is_the_least_of_meminfo_and_each_cgroup_limit(tmp_path):
    root, proc = fake_system(tmp_path / "a", 8 << 20)
    assert memory_available(root, proc) == (8 << 30, "MemAvailable")
    root, proc = fake_system(tmp_path / "b", 8 << 20, v1=(2 << 30, 1 << 30))
    assert memory_available(root, proc) == (1 << 30, f"cgroup memory.limit_in_bytes of {root}/memory/job")
    root, proc = fake_system(tmp_path / "c", 8 << 20, v2=(3 << 30, 1 << 30))  # the ancestor's limit applies
    assert memory_available(root, proc) == (2 << 30, f"cgroup memory.max of {root}/outer")
    root, proc = fake_system(tmp_path / "d", 8 << 20, v1=(1 << 63, 5))  # v1's "no limit"
    assert memory_available(root, proc)[1] == "MemAvailable"


def test_a_kv_cache_beyond_the_memory_is_refused_naming_the_option_and_both_sizes():
    from engine.config import EngineConfig

    config = EngineConfig(kv_cache_tokens=100_000_000).resolve(8192)
    with pytest.raises(
        MemoryLimitError,
        match=r"kv_cache_tokens=100000000 needs 2\.1 TiB \(a KV cache of 2\.1 TiB "
        r".*more than the 1\.0 GiB this process may use \(test\)",
    ) as info:
        check_memory(config, 2_304_000_000_000, 0, "kv_cache_tokens", available=(1 << 30, "test"))
    assert info.value.param == "kv_cache_tokens" and info.value.num_bytes_available == 1 << 30
    check_memory(config, 1 << 20, 0, available=(1 << 30, "test"))  # fits
    check_memory(
        EngineConfig(kv_cache_tokens=100_000_000, allow_overcommit=True).resolve(8192),
        1 << 50,
        available=(1 << 30, "test"),
    )  # the user's opt-in


@pytest.mark.parametrize(
    "args,param",
    [
        (["--kv-cache-tokens", "100000000"], "kv_cache_tokens"),
        (["--max-model-len", "1000000000"], "max_model_len"),
    ],
)
def test_start_up_refuses_an_impossible_kv_cache_in_one_line(args, param):
    env = dict(os.environ, PYTHONPATH=ROOT)
    done = subprocess.run(
        [sys.executable, "-m", "engine", "complete", "Hi", "--max-tokens", "1", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr
    [line] = [ln for ln in done.stderr.splitlines() if "error" in ln]
    assert line.startswith(f"python -m engine: error: {param}=") and "this process may use" in line
    assert "Traceback" not in done.stderr and "Errno" not in done.stderr
