"""Draft-model speculation (speculative="draft"): a model drafting for itself is accepted almost
always and changes nothing (SmolLM2-135M and Qwen2.5-Coder-0.5B, greedy token for token, seeded
sampling too), stops and max_tokens cut accepted runs, the draft's KV follows rollbacks and
preemption, and a draft whose tokenizer differs is refused in one line before its weights load."""
import subprocess
import sys
import time

import pytest
from model_fixtures import qwen_gguf  # noqa: F401 (fixture)

import engine
from engine.config import EngineConfig
from engine.errors import InvalidParameterError
from engine.loader import default_model_path
from engine.params import SamplingParams

PROMPTS = [
    "Repeat this sentence exactly: the quick brown fox jumps over the lazy dog, and the dog sleeps.",
    "Write a short poem about the sea.",
    "Count from one to twenty in words.",
    "Explain what a hash table is.",
]


def generate(eng, prompts, params):
    return eng.generate([eng.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in prompts], params)


@pytest.fixture(scope="module")
def engines():
    path = default_model_path()
    with engine.Engine.from_pretrained() as plain, \
            engine.Engine.from_pretrained(speculative="draft", draft_model=path, num_speculative_tokens=3) as fast:
        fast._core.spec.budgeted = False  # a model drafting for itself never pays (a draft id costs a step)
        yield plain, fast


def test_self_draft_greedy_equal_and_accepted(engines):
    plain, fast = engines
    params = SamplingParams(max_tokens=48, temperature=0)
    want = generate(plain, PROMPTS, params)
    got = generate(fast, PROMPTS, params)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    for prompt, expected in zip(PROMPTS[:2], want):
        [alone] = generate(fast, [prompt], params)
        assert alone.token_ids == expected.token_ids
    spec = fast._core.spec
    assert spec.num_model_draft_tokens > 30  # the draft model proposed where prompt lookup found nothing
    assert spec.num_draft_tokens > spec.num_model_draft_tokens  # and prompt lookup where it found something
    # the same model drafting: only rounding disagrees
    assert spec.num_model_accepted_tokens > 0.9 * spec.num_model_draft_tokens
    stats = fast.stats()
    assert stats["spec_decode_num_draft_tokens"] == spec.num_draft_tokens


def test_self_draft_stops_max_tokens_and_seeded_sampling(engines):
    plain, fast = engines
    [full] = generate(plain, PROMPTS[:1], SamplingParams(max_tokens=48, temperature=0, ignore_eos=True))
    stop = full.text[len(full.text) // 2 :][:5]
    cases = [SamplingParams(max_tokens=48, temperature=0, stop=[stop]),
             SamplingParams(max_tokens=21, temperature=0, ignore_eos=True),
             SamplingParams(max_tokens=40, temperature=0, logprobs=True, top_logprobs=2, repetition_penalty=1.2)]
    for params in cases:
        want = generate(plain, PROMPTS[:2], params)
        got = generate(fast, PROMPTS[:2], params)
        assert [(c.token_ids, c.text, c.finish_reason) for c in got] == \
            [(c.token_ids, c.text, c.finish_reason) for c in want], params
    # Seeded sampling on a real model: reproducible run to run. Equality with plain decoding's draws
    # is proven on exact logits (test_speculative_sampling.py); here a verification chunk's float32
    # rounding can move a draw that lands on a step of the distribution to its neighbour (README),
    # as a fresh-clone run once saw at temperature 0.5.
    seeded = SamplingParams(max_tokens=40, temperature=0.5, top_k=20, seed=4)
    first, again = (generate(fast, PROMPTS[:1], seeded) for _ in range(2))
    assert [c.token_ids for c in first] == [c.token_ids for c in again]
    assert fast.stats()["spec_decode_num_accepted_tokens"] > 0


class _SlowDraft:
    """A draft model whose every forward appears to take SKEW seconds more (the clock is moved)."""

    SKEW = 1000.0

    def __init__(self, model, skew: list):
        self._model, self._skew = model, skew

    def forward(self, batch, kv_cache):
        out = self._model.forward(batch, kv_cache)
        self._skew[0] += self.SKEW
        return out

    def __getattr__(self, name):
        return getattr(self._model, name)


def test_tick_times_leave_the_draft_models_forwards_out(engines, monkeypatch):
    """The verify budget prices a draft id by the draft's own forwards (DraftModel.step_seconds,
    row_seconds); the ticks' times it reads per row count must not count them again: a tick that
    caught a draft cache up would else price its row count for good."""
    _plain, fast = engines
    core = fast._core
    skew, real = [0.0], time.perf_counter
    draft = core.spec.draft
    for name in ("seconds", "step_seconds", "row_seconds"):  # the skewed prices go at teardown
        monkeypatch.setattr(draft, name, getattr(draft, name))
    monkeypatch.setattr(time, "perf_counter", lambda: real() + skew[0])
    monkeypatch.setattr(draft, "model", _SlowDraft(draft.model, skew))
    observed = []
    observe = core.spec.observe_step
    monkeypatch.setattr(core.spec, "observe_step", lambda rows, seconds, num_seqs=None: (
        observed.append(seconds), observe(rows, seconds, num_seqs)))
    generate(fast, PROMPTS[:2], SamplingParams(max_tokens=24, temperature=0))
    assert skew[0] > 0 and observed  # the draft ran, and ticks were timed
    assert max(observed) < _SlowDraft.SKEW
    assert draft.step_seconds > _SlowDraft.SKEW / 10  # the draft's own price has them (an average)


def test_self_draft_under_preemption_frees_everything():
    # A KV cache for about two sequences and four requests: preemption while drafting.
    path = default_model_path()
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    options = dict(max_model_len=256, kv_cache_tokens=320, max_num_seqs=4)
    with engine.Engine.from_pretrained(**options) as plain:
        want = generate(plain, PROMPTS, params)
    with engine.Engine.from_pretrained(speculative="draft", draft_model=path, **options) as fast:
        got = generate(fast, PROMPTS, params)
        stats = fast.stats()
        draft = fast._core.spec.draft
        generate(fast, PROMPTS[:1], SamplingParams(max_tokens=8, temperature=0))  # the last drafter frees the rest
        num_held = sum(len(t) for t in draft.tables)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert stats["num_preemptions"] > 0 and stats["spec_decode_num_accepted_tokens"] > 0
    assert stats["kv_usage"] == 0.0
    assert num_held <= 256 // 16 + 1  # only the last sequence's draft blocks, until the next proposal


def test_qwen_coder_drafting_for_itself(qwen_gguf):  # noqa: F811
    code = "def area(width, height):\n    result = width * height\n    return result\n"
    prompts = ["Rename result to product in this function. Answer with the code only.\n\n" + code,
               "Write a haiku about rain."]
    params = SamplingParams(max_tokens=48, temperature=0)
    with engine.Engine.from_pretrained(str(qwen_gguf)) as plain:
        want = generate(plain, prompts, params)
    with engine.Engine.from_pretrained(str(qwen_gguf), speculative="draft", draft_model=str(qwen_gguf)) as fast:
        fast._core.spec.budgeted = False
        got = generate(fast, prompts, params)
        spec = fast._core.spec
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert spec.num_model_draft_tokens > 0
    assert spec.num_model_accepted_tokens > 0.9 * spec.num_model_draft_tokens


def test_mismatched_tokenizer_is_refused_in_one_line(qwen_gguf):  # noqa: F811
    with pytest.raises(InvalidParameterError) as info:
        engine.Engine.from_pretrained(speculative="draft", draft_model=str(qwen_gguf))
    assert info.value.param == "draft_model"
    message = str(info.value)
    assert "draft_model does not match the model" in message and "\n" not in message


def test_draft_options_are_validated():
    with pytest.raises(InvalidParameterError, match="needs draft_model"):
        EngineConfig(speculative="draft")
    with pytest.raises(InvalidParameterError, match="only with speculative='draft' or 'auto'"):
        EngineConfig(speculative="ngram", draft_model="/tmp/x.gguf")
    assert EngineConfig(speculative="auto").speculative_method == "ngram"
    assert EngineConfig(speculative="auto", draft_model="/tmp/x.gguf").speculative_method == "draft"
    assert EngineConfig(speculative="draft", draft_model="/tmp/x.gguf").speculative_method == "draft"
    assert EngineConfig().speculative_method == "ngram"  # the default, auto, without a draft model
    assert EngineConfig(draft_model="/tmp/x.gguf").speculative_method == "draft"
    assert EngineConfig(speculative=None).speculative_method is None
    from engine.errors import ModelFileError
    with pytest.raises(ModelFileError, match="no such file"):
        engine.Engine.from_pretrained(speculative="draft", draft_model="/nonexistent/draft.gguf")


def test_server_refuses_a_mismatched_draft_in_one_line(qwen_gguf):  # noqa: F811
    proc = subprocess.run([sys.executable, "-m", "webapp", "--port", "0", "--speculative", "draft",
                           "--draft-model", str(qwen_gguf)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert "draft_model does not match the model" in lines[-1]
    assert not any("Traceback" in line for line in lines)
