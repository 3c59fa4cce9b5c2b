"""Hostile model files (issue 27): hypothesis edits one header field, tensor-table entry or
safetensors header entry of a small real model, truncates it or overwrites header bytes, and every
case must load and generate, or raise ModelFileError naming the file in one line.

The model: two Llama layers (Q4_1 projections, a Q8_0 embedding, as the default model's) over the
first 1024 tokens of the default model's own vocabulary and merges, written with the gguf package,
and the same weights as a Hugging Face directory. Each case runs in a child forked from a worker
process that imported the engine once, so a crash or a hang fails that case, not the suite.
MODEL_FILES_FUZZ_EXAMPLES sets the examples per test (make test: 12, make fuzz: 2000).
"""

from __future__ import annotations

import json
import os
import select
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

NUM_EXAMPLES = int(os.environ.get("MODEL_FILES_FUZZ_EXAMPLES", "12"))
CASE_TIMEOUT = 120  # seconds a case may take before it counts as a hang
NUM_TOKENS = 1024
SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
FUZZ = settings(
    max_examples=NUM_EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# ---------------------------------------------------------------- the model


def _vocabulary():
    """The default model's first NUM_TOKENS tokens, and the merges among them."""
    from engine.gguf_file import read_gguf_metadata
    from engine.loader import default_model_path

    metadata = read_gguf_metadata(default_model_path())
    tokens = metadata["tokenizer.ggml.tokens"][:NUM_TOKENS]
    kept = set(tokens)
    merges = [
        m
        for m in metadata["tokenizer.ggml.merges"]
        if (parts := m.split(" ", 1))
        and len(parts) == 2
        and {parts[0], parts[1], parts[0] + parts[1]} <= kept
    ]
    return metadata, tokens, metadata["tokenizer.ggml.token_type"][:NUM_TOKENS], merges


CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    vocab_size=NUM_TOKENS,
)


def _weights(rng) -> dict[str, np.ndarray]:
    """Hugging Face name -> float32 weights, numpy order."""
    E, I, V = CONFIG["hidden_size"], CONFIG["intermediate_size"], NUM_TOKENS
    H, KH = CONFIG["num_attention_heads"], CONFIG["num_key_value_heads"]
    D = E // H
    shapes = {"model.embed_tokens.weight": (V, E), "model.norm.weight": (E,)}
    for i in range(CONFIG["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (E,),
                p + "post_attention_layernorm.weight": (E,),
                p + "self_attn.q_proj.weight": (H * D, E),
                p + "self_attn.k_proj.weight": (KH * D, E),
                p + "self_attn.v_proj.weight": (KH * D, E),
                p + "self_attn.o_proj.weight": (E, H * D),
                p + "mlp.gate_proj.weight": (I, E),
                p + "mlp.up_proj.weight": (I, E),
                p + "mlp.down_proj.weight": (E, I),
            }
        )
    return {
        name: (rng.standard_normal(shape) * (0.1 if len(shape) == 2 else 1) + (len(shape) == 1)).astype(
            np.float32
        )
        for name, shape in shapes.items()
    }


def write_tiny_gguf(path: Path) -> None:
    import gguf

    from engine.loader.gguf_loader import gguf_name

    metadata, tokens, types, merges = _vocabulary()
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(CONFIG["num_hidden_layers"])
    writer.add_context_length(CONFIG["max_position_embeddings"])
    writer.add_embedding_length(CONFIG["hidden_size"])
    writer.add_feed_forward_length(CONFIG["intermediate_size"])
    writer.add_head_count(CONFIG["num_attention_heads"])
    writer.add_head_count_kv(CONFIG["num_key_value_heads"])
    writer.add_rope_dimension_count(CONFIG["hidden_size"] // CONFIG["num_attention_heads"])
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(NUM_TOKENS)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(metadata["tokenizer.ggml.pre"])
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(metadata["tokenizer.chat_template"])
    for name, w in _weights(np.random.default_rng(0)).items():
        qtype = (
            (gguf.GGMLQuantizationType.Q8_0 if "embed" in name else gguf.GGMLQuantizationType.Q4_1)
            if w.ndim == 2
            else None
        )
        if qtype is None:
            writer.add_tensor(gguf_name(name), w)
        else:
            writer.add_tensor(gguf_name(name), gguf.quants.quantize(w, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_tiny_hf(directory: Path, gguf_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    from engine.tokenizer import load_tokenizer

    directory.mkdir()
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
        **CONFIG,
    }
    (directory / "config.json").write_text(json.dumps(config))
    save_file(
        {k: torch.from_numpy(v) for k, v in _weights(np.random.default_rng(0)).items()},
        str(directory / "model.safetensors"),
    )
    tokenizer = load_tokenizer(gguf_path)
    (directory / "tokenizer.json").write_text(tokenizer.backend.to_str())
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "chat_template": tokenizer.chat_template})
    )


# ---------------------------------------------------------------- where each field is


def gguf_fields(data: bytes) -> tuple[list[tuple[str, int, str, int | float]], int]:
    """-> ([(what, byte offset, struct format, value)] for every header scalar, count, length,
    type id and tensor-table field), header end."""
    fields = [("version", 4, "I", 0), ("num_tensors", 8, "Q", 0), ("num_kv", 16, "Q", 0)]
    pos = 24
    (num_tensors, num_kv) = struct.unpack_from("<QQ", data, 8)

    def string(what):
        nonlocal pos
        (n,) = struct.unpack_from("<Q", data, pos)
        fields.append((f"{what}.length", pos, "Q", n))
        pos += 8 + n
        return data[pos - n : pos].decode()

    for _ in range(num_kv):
        key = string("key")
        (type_id,) = struct.unpack_from("<I", data, pos)
        fields.append((f"{key}.type", pos, "I", type_id))
        pos += 4
        if type_id == 8:
            string(key)
        elif type_id == 9:
            item_type, count = struct.unpack_from("<IQ", data, pos)
            fields += [(f"{key}.item_type", pos, "I", item_type), (f"{key}.count", pos + 4, "Q", count)]
            pos += 12
            if item_type == 8:
                for _ in range(count):
                    (n,) = struct.unpack_from("<Q", data, pos)
                    pos += 8 + n
            else:
                pos += count * struct.calcsize(SCALAR_FORMATS[item_type])
        else:
            fmt = SCALAR_FORMATS[type_id]
            fields.append((key, pos, fmt, struct.unpack_from("<" + fmt, data, pos)[0]))
            pos += struct.calcsize(fmt)
    for _ in range(num_tensors):
        name = string("tensor")
        (num_dims,) = struct.unpack_from("<I", data, pos)
        fields.append((f"{name}.num_dims", pos, "I", num_dims))
        pos += 4
        for i in range(num_dims):
            fields.append((f"{name}.dims[{i}]", pos, "Q", struct.unpack_from("<Q", data, pos)[0]))
            pos += 8
        type_id, offset = struct.unpack_from("<IQ", data, pos)
        fields += [(f"{name}.type", pos, "I", type_id), (f"{name}.offset", pos + 4, "Q", offset)]
        pos += 12
    return fields, pos


def _range(fmt: str) -> tuple[int, int]:
    bits = 8 * struct.calcsize(fmt)
    return (0, (1 << bits) - 1) if fmt.isupper() else (-(1 << (bits - 1)), (1 << (bits - 1)) - 1)


@st.composite
def field_value(draw, field):
    """A replacement for one field: the attacker's favourites (0, 1, +-1, x2, /2, 2^31-1, 10^9, the
    type's extremes) or any value of the field's type."""
    _, _, fmt, value = field
    if fmt in "fd":
        return draw(
            st.one_of(
                st.sampled_from([0.0, -1.0, float("nan"), float("inf"), -float("inf"), 1e30]),
                st.floats(width=32 if fmt == "f" else 64),
            )
        )
    if fmt == "?":
        return draw(st.booleans())
    low, high = _range(fmt)
    favourites = [
        0,
        1,
        value + 1,
        value - 1,
        value * 2,
        value // 2,
        2**31 - 1,
        10**9,
        2**32 - 1,
        2**63 - 1,
        high,
        low,
        value + 32,
    ]
    return draw(
        st.one_of(st.sampled_from([v for v in favourites if low <= v <= high]), st.integers(low, high))
    )


# ---------------------------------------------------------------- the worker


def _child(path: str) -> tuple[int, str]:
    """Load and generate 2 tokens: 0 ok, 3 a clean ModelFileError, 1 anything else."""
    import traceback

    import engine
    from engine.errors import ModelFileError

    try:
        with engine.Engine.from_pretrained(path, kv_cache_tokens=4096) as eng:
            eng.generate(["Hi"], engine.SamplingParams(max_tokens=2, temperature=0))
        return 0, "generated"
    except ModelFileError as exc:
        message = str(exc)
        if "\n" in message or not message.startswith(exc.path):
            return 1, f"ModelFileError not one line naming its file: {message!r}"
        return 3, message
    except BaseException:
        return 1, traceback.format_exc()


def worker() -> None:
    """Reads a path per line; forks a child per case; answers {"kind", "detail"} per line."""
    import engine  # noqa: F401  imported once, before the forks
    import engine.api  # noqa: F401
    import engine.loader  # noqa: F401
    import engine.tokenizer  # noqa: F401

    for line in sys.stdin:
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read_fd)
            code, detail = _child(line.strip())
            os.write(write_fd, detail.encode(errors="replace")[:4000])
            os._exit(code)
        os.close(write_fd)
        out, deadline, status = b"", time.monotonic() + CASE_TIMEOUT, None
        while status is None:
            ready, _, _ = select.select([read_fd], [], [], max(0.0, min(1.0, deadline - time.monotonic())))
            if ready and (chunk := os.read(read_fd, 65536)):
                out += chunk
            elif ready:
                status = os.waitpid(pid, 0)[1]
            elif time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                break
        os.close(read_fd)
        detail = out.decode(errors="replace")
        if status is None:
            kind = "hang"
        elif os.WIFSIGNALED(status):
            kind = f"crash (signal {os.WTERMSIG(status)})"
        else:
            kind = {0: "ok", 3: "clean"}.get(os.WEXITSTATUS(status), "wrong kind")
        print(json.dumps({"kind": kind, "detail": detail}), flush=True)


class Worker:
    def __init__(self):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
        self.proc = subprocess.Popen(
            [sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )

    def run(self, path: Path) -> dict:
        self.proc.stdin.write(f"{path}\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"the fuzz worker died (exit status {self.proc.wait()})"
        return json.loads(line)

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(30)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    gguf_path = root / "tiny.gguf"
    write_tiny_gguf(gguf_path)
    write_tiny_hf(root / "tiny-hf", gguf_path)
    worker = Worker()
    yield root, gguf_path, worker
    worker.close()


def check(worker: Worker, path: Path, what: str) -> None:
    result = worker.run(path)
    assert result["kind"] in ("ok", "clean"), f"{what}: {result['kind']}\n{result['detail']}"


def test_the_unedited_files_load_and_generate(files):
    root, gguf_path, worker = files
    for path in (gguf_path, root / "tiny-hf"):
        assert worker.run(path)["kind"] == "ok", worker.run(path)["detail"]


def test_a_corrupt_file_is_reported_as_wrong_kind_not_hidden(files, tmp_path):
    root, _, worker = files  # the harness itself: a file the loader cannot make sense of is "clean"
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"GGUF" + b"\xff" * 64)
    assert worker.run(path)["kind"] == "clean"


# ---------------------------------------------------------------- GGUF


def _edited(tmp_path: Path, data: bytes, edits: list[tuple[int, bytes]], cut: int | None = None) -> Path:
    buf = bytearray(data if cut is None else data[:cut])
    for at, raw in edits:
        buf[at : at + len(raw)] = raw[: max(0, len(buf) - at)]
    path = tmp_path / f"case-{os.getpid()}-{time.monotonic_ns()}.gguf"
    path.write_bytes(bytes(buf))
    return path


@FUZZ
@given(data=st.data())
def test_gguf_header_and_tensor_table_edits(files, tmp_path_factory, data):
    _, gguf_path, worker = files
    raw = gguf_path.read_bytes()
    fields, _ = gguf_fields(raw)
    field = data.draw(st.sampled_from(fields), label="field")
    value = data.draw(field_value(field), label="value")
    path = _edited(tmp_path_factory.mktemp("case"), raw, [(field[1], struct.pack("<" + field[2], value))])
    check(worker, path, f"{field[0]} = {value!r}")
    path.unlink()


@FUZZ
@given(data=st.data())
def test_gguf_truncations_and_random_header_bytes(files, tmp_path_factory, data):
    _, gguf_path, worker = files
    raw = gguf_path.read_bytes()
    _, header_end = gguf_fields(raw)
    if data.draw(st.booleans(), label="truncate"):
        cut = data.draw(st.integers(0, len(raw) - 1), label="cut")
        path, what = _edited(tmp_path_factory.mktemp("case"), raw, [], cut), f"cut at {cut}"
    else:
        at = data.draw(st.integers(0, header_end - 1), label="at")
        junk = data.draw(st.binary(min_size=1, max_size=16), label="bytes")
        path, what = _edited(tmp_path_factory.mktemp("case"), raw, [(at, junk)]), f"{junk!r} at {at}"
    check(worker, path, what)
    path.unlink()


# ---------------------------------------------------------------- Hugging Face directories


def _hf_copy(root: Path, tmp_path: Path) -> Path:
    target = tmp_path / "model"
    target.mkdir()
    for f in (root / "tiny-hf").iterdir():
        (target / f.name).write_bytes(f.read_bytes())
    return target


def _safetensors_parts(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack_from("<Q", raw)
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _write_safetensors(path: Path, header: dict | bytes, body: bytes, length: int | None = None) -> None:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text) if length is None else length) + text + body)


ODD_VALUES = st.one_of(
    st.sampled_from([0, 1, -1, 2**31 - 1, 2**63, 10**9, None, "x", 1.5, [], {}]), st.integers(-(2**64), 2**64)
)


@FUZZ
@given(data=st.data())
def test_safetensors_header_edits(files, tmp_path_factory, data):
    root, _, worker = files
    model = _hf_copy(root, tmp_path_factory.mktemp("case"))
    file = model / "model.safetensors"
    header, body = _safetensors_parts(file)
    names = sorted(k for k in header if k != "__metadata__")
    how = data.draw(
        st.sampled_from(["shape", "dtype", "data_offsets", "entry", "length", "cut", "bytes"]), label="how"
    )
    name = data.draw(st.sampled_from(names), label="tensor")
    length = None
    if how == "shape":
        shape = header[name]["shape"]
        header[name]["shape"] = data.draw(
            st.one_of(
                st.lists(st.integers(0, 2**40), max_size=4),
                st.sampled_from(
                    [[d + 1 for d in shape], [d // 2 for d in shape], shape[::-1], shape + [1], [-1] + shape]
                ),
            )
        )
    elif how == "dtype":
        header[name]["dtype"] = data.draw(st.sampled_from(["F16", "BF16", "I32", "U8", "F64", "Q4", "", 7]))
    elif how == "data_offsets":
        begin, end = header[name]["data_offsets"]
        header[name]["data_offsets"] = data.draw(
            st.one_of(
                st.lists(st.integers(-1, 2**63), min_size=0, max_size=3),
                st.sampled_from(
                    [[end, begin], [begin, end + 4], [begin + 4, end], [0, len(body) + 1], [begin, 2**62]]
                ),
            )
        )
    elif how == "entry":
        header[name] = data.draw(ODD_VALUES)
    elif how == "length":
        length = data.draw(st.one_of(st.integers(0, 2**64 - 1), st.sampled_from([0, 1, 2**31 - 1, 2**63])))
    text = json.dumps(header).encode()
    if how == "bytes":
        at = data.draw(st.integers(0, len(text) - 1), label="at")
        junk = data.draw(st.binary(min_size=1, max_size=8), label="junk")
        text = text[:at] + junk + text[at + len(junk) :]
    _write_safetensors(file, text, body, length if how != "bytes" else len(text))
    if how == "cut":
        raw = file.read_bytes()
        file.write_bytes(raw[: data.draw(st.integers(0, len(raw) - 1), label="cut")])
    check(worker, model, f"{how} of {name}")


@FUZZ
@given(data=st.data())
def test_config_json_edits(files, tmp_path_factory, data):
    root, _, worker = files
    model = _hf_copy(root, tmp_path_factory.mktemp("case"))
    config = json.loads((model / "config.json").read_text())
    key = data.draw(st.sampled_from(sorted(config)), label="key")
    value = data.draw(
        st.one_of(
            ODD_VALUES,
            st.sampled_from(
                [v * 2 for v in [config[key]] if isinstance(v, int)]
                + ["LlamaForCausalLM", ["Nope"], 1e-30, float("nan")]
            ),
        )
    )
    config[key] = value
    (model / "config.json").write_text(json.dumps(config))
    check(worker, model, f"config.json {key} = {value!r}")


if __name__ == "__main__":
    worker()
