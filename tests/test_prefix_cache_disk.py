"""The prefix cache's disk tier (engine/core/prefix_disk.py) on the default model.

The engines here prefill in chunks of exactly one block (max_num_batched_tokens = block_size,
no tick-time target), so a cold prefill and a restart that reads the prompt's blocks from disk
compute the prompt's tail with the same rows over the same context: their outputs must then be
bitwise identical, greedy ids and logprobs alike. (With larger chunks a cold run computes the
tail inside a bigger product, whose rows may take another route and round differently; the
in-memory prefix cache has that same, documented, effect.)
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from engine import Engine, SamplingParams
from engine.errors import InvalidParameterError
from engine.testing import ScriptedModel

BLOCK = 16
ALIGNED = dict(block_size=BLOCK, max_num_batched_tokens=BLOCK, max_num_seqs=4, target_tick_seconds=None,
               kv_cache_tokens=4096, max_model_len=2048)
PARAMS = SamplingParams(max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
SYSTEM = ("You are the help desk of a small bicycle shop. Returns are accepted within thirty days with a "
          "receipt. Repairs are quoted before any work starts. Helmets cannot be returned once worn. ") * 3
QUESTION = "\nUser: Can I return a helmet I wore once?\nAssistant:"
REPO = Path(__file__).resolve().parents[1]


def run(eng: Engine, prompt: str):
    [done] = eng.generate([prompt], PARAMS)
    return done.token_ids, [(lp.token_id, lp.logprob, [t[3] for t in lp.top]) for lp in done.logprobs]


def kv_files(root) -> list[Path]:
    return sorted(Path(root).glob("*/*.kv"))


@pytest.fixture(scope="module")
def cold():
    """The output of a cold engine with no disk tier (and the prompt's length in tokens). The model
    is used once first, by another engine, as it is before every engine of the tests below (the
    first use of freshly loaded weights moved the fifth decimal of a logprob after a merge)."""
    with Engine.from_pretrained(**ALIGNED) as eng:
        run(eng, SYSTEM + QUESTION)
    with Engine.from_pretrained(**ALIGNED) as eng:
        return run(eng, SYSTEM + QUESTION), len(eng.tokenizer.encode(SYSTEM + QUESTION))


def test_restart_reads_the_prompt_from_disk_with_identical_output(tmp_path, cold):
    expected, num_prompt = cold
    num_blocks = num_prompt // BLOCK
    with Engine.from_pretrained(prefix_cache_dir=str(tmp_path), **ALIGNED) as eng:
        assert run(eng, SYSTEM + QUESTION) == expected
        assert eng._core.flush_disk()
        stats = eng.stats()
        assert stats["num_prefix_cache_disk_written_blocks"] == num_blocks
        assert stats["num_prefix_cache_disk_hit_tokens"] == 0
    assert len(kv_files(tmp_path)) == num_blocks
    with Engine.from_pretrained(prefix_cache_dir=str(tmp_path), **ALIGNED) as eng:
        assert run(eng, SYSTEM + QUESTION) == expected
        stats = eng.stats()
    num_hit = (num_prompt - 1) // BLOCK * BLOCK  # the last prompt token is always computed
    assert stats["num_prefix_cache_disk_hit_tokens"] == num_hit
    assert stats["num_prefix_cache_hit_tokens"] == num_hit
    assert stats["num_prefix_cache_disk_bad_files"] == 0
    assert stats["num_prefix_cache_disk_written_blocks"] == 0  # nothing new to write


def _corrupt(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "truncate":
        path.write_bytes(bytes(data[: len(data) // 2]))
    elif how == "flip-payload":
        data[len(data) - 100] ^= 0x40
        path.write_bytes(bytes(data))
    elif how == "flip-header":
        data[20] ^= 0x01
        path.write_bytes(bytes(data))
    elif how == "foreign-model":  # a sound file of another model: only its fingerprint differs
        import struct
        import zlib

        from engine.core.prefix_disk import HEADER

        fields = list(HEADER.unpack_from(data))
        fields[8] = bytes(16)  # the fingerprint
        header = HEADER.pack(*fields)
        path.write_bytes(header + struct.pack("<I", zlib.crc32(header)) + bytes(data[HEADER.size + 4:]))
    elif how == "empty":
        path.write_bytes(b"")


@pytest.mark.parametrize("how", ["truncate", "flip-payload", "flip-header", "foreign-model", "empty"])
def test_a_bad_file_falls_back_to_prefill_and_is_replaced(tmp_path, cold, how, caplog):
    expected, num_prompt = cold
    with Engine.from_pretrained(prefix_cache_dir=str(tmp_path), **ALIGNED) as eng:
        eng.cache_prompt(SYSTEM + QUESTION)
    files = kv_files(tmp_path)
    bad = next(p for p in files if p.name.startswith("000003-"))
    _corrupt(bad, how)
    with Engine.from_pretrained(prefix_cache_dir=str(tmp_path), **ALIGNED) as eng:
        assert run(eng, SYSTEM + QUESTION) == expected
        stats = eng.stats()
    assert stats["num_prefix_cache_disk_bad_files"] == 1
    assert stats["num_prefix_cache_disk_hit_tokens"] == 3 * BLOCK  # the blocks before the bad one
    assert any("removed, prefilling instead" in r.getMessage() for r in caplog.records)
    # The bad file was removed and the block written again from the prefill: a third engine reads it all.
    assert bad.stat().st_size == files[0].stat().st_size
    with Engine.from_pretrained(prefix_cache_dir=str(tmp_path), **ALIGNED) as eng:
        got = run(eng, SYSTEM + QUESTION)
        stats = eng.stats()
    # The K/V came from other processes, whose product routes were timed by themselves (a table
    # timed on a busy machine is timed again by a quiet load, engine.models.routes): the same
    # tokens, and logprobs up to that rounding, not bit for bit (a wrong block moves them by far more).
    assert got[0] == expected[0]
    for (token, logprob, top), (token_e, logprob_e, top_e) in zip(got[1], expected[1], strict=True):
        assert token == token_e and top == top_e and abs(logprob - logprob_e) <= 1e-4
    assert stats["num_prefix_cache_disk_bad_files"] == 0
    assert stats["num_prefix_cache_disk_hit_tokens"] == (num_prompt - 1) // BLOCK * BLOCK


def test_cache_prompt_warms_memory_and_disk(tmp_path, cold):
    expected, num_prompt = cold
    with Engine.from_pretrained(prefix_cache_dir=str(tmp_path), **ALIGNED) as eng:
        num_system = len(eng.tokenizer.encode(SYSTEM))
        num_cached = eng.cache_prompt(SYSTEM)
        assert num_cached == num_system // BLOCK * BLOCK > 0
        assert len(kv_files(tmp_path)) == num_cached // BLOCK  # on disk when cache_prompt returns
        assert eng.stats()["num_prefix_cache_disk_written_blocks"] == num_cached // BLOCK
    with Engine.from_pretrained(prefix_cache_dir=str(tmp_path), **ALIGNED) as eng:
        assert run(eng, SYSTEM + QUESTION) == expected
        stats = eng.stats()
        assert stats["num_prefix_cache_disk_hit_tokens"] == num_cached  # read from disk
        assert eng.cache_prompt(SYSTEM) == num_cached
        assert eng.stats()["num_prefix_cache_hit_tokens"] - stats["num_prefix_cache_hit_tokens"] == num_cached
        assert eng.stats()["num_prefix_cache_disk_read_blocks"] == stats["num_prefix_cache_disk_read_blocks"]


def test_the_byte_bound_evicts(tmp_path, cold):
    expected, num_prompt = cold
    with Engine.from_pretrained(prefix_cache_dir=str(tmp_path), **ALIGNED) as eng:
        file_bytes = eng._core.disk.file_bytes
    for p in kv_files(tmp_path):
        p.unlink()
    bound = 5 * file_bytes
    with Engine.from_pretrained(prefix_cache_dir=str(tmp_path), prefix_cache_disk_bytes=bound, **ALIGNED) as eng:
        eng.cache_prompt(SYSTEM + QUESTION)
        stats = eng.stats()
    files = kv_files(tmp_path)
    assert num_prompt // BLOCK > 5 and stats["num_prefix_cache_disk_evicted_files"] > 0
    assert 0 < sum(p.stat().st_size for p in files) <= bound
    with Engine.from_pretrained(prefix_cache_dir=str(tmp_path), prefix_cache_disk_bytes=bound, **ALIGNED) as eng:
        assert run(eng, SYSTEM + QUESTION) == expected  # whatever stayed, the output is the cold one
        stats = eng.stats()
    assert stats["num_prefix_cache_disk_bad_files"] == 0
    assert stats["num_prefix_cache_disk_hit_tokens"] <= len(files) * BLOCK


WRITER = textwrap.dedent("""
    import sys
    from engine import Engine, SamplingParams
    options = dict(block_size=16, max_num_batched_tokens=16, max_num_seqs=4, target_tick_seconds=None,
                   kv_cache_tokens=4096, max_model_len=2048)
    prompts = [sys.argv[2] + sys.argv[3], sys.argv[2] + sys.argv[4]]
    with Engine.from_pretrained(prefix_cache_dir=sys.argv[1], **options) as eng:
        eng.generate(prompts, SamplingParams(max_tokens=4, temperature=0))
    print("done")
""")


def test_two_processes_writing_one_directory_leave_it_readable(tmp_path, cold):
    expected, num_prompt = cold
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), SYSTEM, QUESTION, f" Case {i}."],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0 and "done" in out, err[-2000:]
    assert not list(Path(tmp_path).glob("*/*.tmp"))
    with Engine.from_pretrained(prefix_cache_dir=str(tmp_path), **ALIGNED) as eng:
        got = run(eng, SYSTEM + QUESTION)
        stats = eng.stats()
    # The K/V came from other processes, whose product routes were timed by themselves (a table
    # timed on a busy machine is timed again by a quiet load, engine.models.routes): the same
    # tokens, and logprobs up to that rounding, not bit for bit (a wrong block moves them by far more).
    assert got[0] == expected[0]
    for (token, logprob, top), (token_e, logprob_e, top_e) in zip(got[1], expected[1], strict=True):
        assert token == token_e and top == top_e and abs(logprob - logprob_e) <= 1e-4
    assert stats["num_prefix_cache_disk_bad_files"] == 0
    assert stats["num_prefix_cache_disk_hit_tokens"] == (num_prompt - 1) // BLOCK * BLOCK


def test_a_server_restart_reuses_the_directory(tmp_path):
    from webapp import create_app

    body = {"prompt": SYSTEM + QUESTION, "max_tokens": 6, "temperature": 0, "logprobs": 2}
    answers, metrics = [], []
    for _ in range(2):
        with Engine.from_pretrained(prefix_cache_dir=str(tmp_path), **ALIGNED) as eng:
            client = create_app(eng).test_client()
            response = client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.get_data(as_text=True)
            answers.append(response.get_json()["choices"])
            metrics.append(client.get("/metrics").get_data(as_text=True))
    assert answers[0] == answers[1]

    def disk_hits(text: str) -> float:
        [line] = [ln for ln in text.splitlines() if ln.startswith("llm:prefix_cache_disk_hits_total")]
        return float(line.split()[-1])

    assert disk_hits(metrics[0]) == 0 and disk_hits(metrics[1]) > 0


def test_prompt_logprobs_compute_every_row(tmp_path):
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    outputs = []
    for _ in range(2):
        with Engine.from_pretrained(prefix_cache_dir=str(tmp_path), **ALIGNED) as eng:
            [done] = eng.generate([SYSTEM], params)
            outputs.append([lp and lp.logprob for lp in done.prompt_logprobs])
            assert eng.stats()["num_prefix_cache_disk_hit_tokens"] == 0
    assert outputs[0] == outputs[1]


def test_options_are_checked(tmp_path):
    with pytest.raises(InvalidParameterError) as info:
        Engine.from_pretrained(prefix_cache_dir=str(tmp_path), prefix_cache_disk_bytes=0)
    assert info.value.param == "prefix_cache_disk_bytes"
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(InvalidParameterError) as info:
        Engine.from_pretrained(prefix_cache_dir=str(a_file), **ALIGNED)
    assert info.value.param == "prefix_cache_dir"
    with Engine.from_pretrained() as eng:
        tok = eng.tokenizer
    with pytest.raises(InvalidParameterError) as info:
        Engine(ScriptedModel([1], tok.vocab_size), tok, prefix_cache_dir=str(tmp_path))
    assert info.value.param == "prefix_cache_dir"


def test_the_server_refuses_a_directory_it_cannot_use_before_loading(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    proc = subprocess.run([sys.executable, "-m", "webapp", "--prefix-cache-dir", str(a_file / "sub"), "--port", "0"],
                          env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    [line] = proc.stderr.strip().splitlines()[-1:]
    assert "error: prefix_cache_dir" in line and str(a_file / "sub") in line


def test_command_line_defaults(tmp_path, monkeypatch):
    from engine.config import engine_options_from_args
    from engine.core.prefix_disk import default_prefix_cache_dir
    from webapp.__main__ import build_parser

    def options(*argv):
        return engine_options_from_args(build_parser().parse_args(list(argv)))

    monkeypatch.delenv("LLM_ENGINE_PREFIX_CACHE_DIR", raising=False)
    assert "prefix_cache_dir" not in options()  # under pytest: off unless asked
    assert options("--prefix-cache-dir", str(tmp_path), "--prefix-cache-disk-bytes", "1000") == {
        "prefix_cache_dir": str(tmp_path), "prefix_cache_disk_bytes": 1000}
    assert "prefix_cache_dir" not in options("--prefix-cache-dir", "off")
    monkeypatch.setenv("LLM_ENGINE_PREFIX_CACHE_DIR", str(tmp_path / "env"))
    assert options()["prefix_cache_dir"] == str(tmp_path / "env")
    monkeypatch.delenv("LLM_ENGINE_PREFIX_CACHE_DIR")
    monkeypatch.delenv("PYTEST_CURRENT_TEST")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_prefix_cache_dir() == str(tmp_path / "xdg" / "llm-engine" / "prefix")
    assert options()["prefix_cache_dir"] == str(tmp_path / "xdg" / "llm-engine" / "prefix")


def test_fingerprint_names_approximate_routes_not_the_timed_table():
    """Two processes time their route tables apart (a busy machine's table is timed again by a quiet
    one): exact tables that differ still meet each other's blocks; an approximate (bfloat16) route does not."""
    import torch

    from engine.core.prefix_disk import model_fingerprint

    class KV:
        k = torch.zeros(2, 32, 3, 64)

    one = {"q4_1 576x576": ["int16"] * 5 + ["float"] * 5}
    other = {"q4_1 576x576": ["int16"] * 4 + ["blas"] * 6}
    amx = {"q4_1 576x576": ["int16"] * 4 + ["amx"] * 6}
    fingerprint = model_fingerprint("m", KV, 16, one)
    assert fingerprint == model_fingerprint("m", KV, 16, other) == model_fingerprint("m", KV, 16, None)
    assert model_fingerprint("m", KV, 16, amx) != model_fingerprint("m", KV, 16, one)
    assert model_fingerprint("m", KV, 32, one) != model_fingerprint("m", KV, 16, one)
