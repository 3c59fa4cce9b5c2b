"""Invariants 2-4 (docs/architecture.md) as properties, through the public Engine and real vocabularies.

ScriptedModel makes greedy decoding emit a drawn script of token ids; the tokenizers are
real: SmolLM2's GGUF vocabulary (byte-level BPE), Qwen's (qwen.tiktoken, byte-level BPE)
and llama.cpp's llama-spm (SentencePiece with <0xNN> byte fallback). Scripts are slices of
real multilingual text and random ids with byte tokens, partial characters and special
tokens over-represented. The reference for every property is the tokenizer's own
``decode`` of the emitted ids, cut by a plain re-implementation of the stop rules.

One Engine per vocabulary serves every example: its model delegates to a ScriptedModel
that `Harness.use_script` replaces between requests (the engine is idle then).
"""
from __future__ import annotations

import functools
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import engine
from engine.params import SamplingParams
from engine.testing import ScriptedModel
from tests import vocabs
from tests.tokenizer_fixtures import bytes_to_unicode

VOCABS = {"smollm2": vocabs.smollm2, "qwen": vocabs.qwen, "llama_spm": vocabs.llama_spm}
BYTE_LEVEL_VOCABS = {"smollm2", "qwen"}

TEXTS = [
    "안녕하세요, 세계! 한국어 문장은 음절 블록으로 이루어져 있습니다.",
    "你好，世界。日本語の文章も混ぜます：東京は晴れです。中文和日本語。",
    "Family 👨‍👩‍👧‍👦, 👩🏽‍💻 flags 🇰🇷🇯🇵🇺🇸, 🏳️‍🌈 ❤️‍🔥 thumbs 👍🏽.",
    "Combining: e\u0301 a\u0308 n\u0303 \u1100\u1161\u11a8, Zalgo z\u0357\u0350\u034ca\u0352.",
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # 🐍\n",
    vocabs.MIXED_TEXT,
]
ABSENT_STOPS = ["\x00never\x00", "zqzqzq", "🦄🦄🦄", "한국어텍스트없음"]
MAX_SCRIPT_IDS = 60

SETTINGS = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ------------------------------------------------------------------ one engine per vocabulary


class SwappableScript:
    """The engine's model interface over a ScriptedModel that a test replaces between requests."""

    max_model_len = None

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.scripted = ScriptedModel([0], vocab_size)

    def make_kv_cache(self, num_blocks: int, block_size: int):
        return self.scripted.make_kv_cache(num_blocks, block_size)

    def forward(self, batch, kv_cache):
        return self.scripted.forward(batch, kv_cache)


class Harness:
    def __init__(self, name: str, output_loop: str = "inline"):
        self.name = name
        self.tok = engine.load_tokenizer(VOCABS[name]())
        self.model = SwappableScript(self.tok.vocab_size)
        self.eng = engine.Engine(self.model, self.tok, max_model_len=1024, kv_cache_tokens=4096, max_num_seqs=8)
        if output_loop == "deferred":  # every steady tick's output on the engine's output worker
            self.eng._core.defer_min_forward_s, self.eng._core.defer_min_rows = 0.0, 1
        self.last_prompt_logprobs = None
        self.added = {i: t.content for i, t in self.tok.backend.get_added_tokens_decoder().items()}

    def decode(self, ids, skip_special_tokens: bool) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def use_script(self, script: list[int]) -> None:
        """Make the model emit `script` from now on (call only while no request runs)."""
        self.model.scripted = ScriptedModel(script, self.tok.vocab_size)

    def run(self, script: list[int], params: SamplingParams, prompt):
        """Stream the request, then run it twice more batched through generate (once with a
        different prompt): returns (events, [completion, completion])."""
        self.use_script(script)
        stream = self.eng.stream(prompt, params)
        events = list(stream)
        self.last_prompt_logprobs = stream.prompt_logprobs
        other_prompt = list(prompt) + [prompt[-1]] if isinstance(prompt, list) else prompt + " more"
        completions = self.eng.generate([prompt, other_prompt], [params, params])
        return events, completions

    @functools.cached_property
    def pools(self):
        """Ids to over-represent: byte tokens / partial characters, specials, real text, spelled characters."""
        num_ids = self.tok.vocab_size
        fragments = [i for i in range(num_ids) if not _is_valid_utf8(raw_bytes(self, i))]
        specials = sorted(set(self.tok.special_token_ids) | set(self.tok.eos_token_ids))
        text_ids = [self.tok.encode(text, add_special_tokens=False) for text in TEXTS]
        return fragments, specials, text_ids, _char_byte_runs(self.tok)


@pytest.fixture(scope="module", params=[(name, loop) for name in VOCABS for loop in ("inline", "deferred")],
                ids=lambda p: "-".join(p))
def harness(request):
    """Per vocabulary, with the steady ticks' output loop on the engine thread and on its output
    worker beside the next forward (a stop string found there ends the row a tick late)."""
    h = Harness(*request.param)
    yield h
    num_deferred = h.eng._core._output.num_handed_off
    h.eng.close()
    assert (num_deferred > 0) == (request.param[1] == "deferred")


# ------------------------------------------------------------------ reference rules


_BYTE_DECODER = {char: byte for byte, char in bytes_to_unicode().items()}
_SPM_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def raw_bytes(h: Harness, token_id: int) -> bytes:
    """A token's raw bytes, read off the vocabulary without engine code."""
    if token_id in h.added:
        return h.added[token_id].encode("utf-8")
    piece = h.tok.backend.id_to_token(token_id)
    if h.name in BYTE_LEVEL_VOCABS:
        return bytes(_BYTE_DECODER[c] for c in piece)
    match = _SPM_BYTE.fullmatch(piece)
    if match:
        return bytes([int(match.group(1), 16)])
    return piece.replace("\u2581", " ").encode("utf-8")


def _is_valid_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def _char_byte_runs(tok) -> list[list[int]]:
    """Characters spelled one byte token each (<0xNN> or a byte-level single byte)."""
    runs = []
    for char in "aé你한😀🇰\u200d\u0301":
        for spell in (lambda b: f"<0x{b:02X}>", lambda b: vocabs.byte_level_str(bytes([b]))):
            ids = [tok.token_to_id(spell(b)) for b in char.encode()]
            if None not in ids:
                runs.append(ids)
                break
    return runs


def emitted_ids(script: list[int], max_tokens: int) -> list[int]:
    """What greedy decoding over ScriptedModel emits before any stop: the script, then its last id."""
    return (script + [script[-1]] * max_tokens)[:max_tokens]


def expected_output(h: Harness, script: list[int], params: SamplingParams) -> tuple[list[int], str, str]:
    """(generated ids, text, finish_reason) by the contract's rules, from decode of prefixes.

    A stop token id (stop_token_ids, or EOS unless ignore_eos) ends generation and adds no
    text. Otherwise generation ends at the first token k whose prefix decode contains a stop
    string; the text is that decode cut before the earliest occurrence (the shorter stop on
    a tie), the stop kept if include_stop_str_in_output.
    """
    stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(h.tok.eos_token_ids))
    skip = params.skip_special_tokens
    ids = emitted_ids(script, params.max_tokens)
    for k in range(1, len(ids) + 1):
        if ids[k - 1] in stop_ids:
            return ids[:k], h.decode(ids[: k - 1], skip), "stop"
        if params.stop:
            text = h.decode(ids[:k], skip)
            hits = [(text.find(s), len(s)) for s in params.stop if s in text]
            if hits:
                pos, length = min(hits)
                return ids[:k], text[: pos + length if params.include_stop_str_in_output else pos], "stop"
    return ids, h.decode(ids, skip), "length"


# ------------------------------------------------------------------ strategies


@st.composite
def scripts(draw, h: Harness) -> list[int]:
    fragments, specials, text_ids, runs = h.pools
    ids: list[int] = []
    for _ in range(draw(st.integers(1, 8))):
        choice = draw(st.integers(0, 11))
        if choice < 2:
            ids.append(draw(st.integers(0, h.tok.vocab_size - 1)))
        elif choice < 4:  # a run of byte tokens / partial characters
            ids.extend(draw(st.lists(st.sampled_from(fragments), min_size=1, max_size=6)))
        elif choice < 6:  # whole characters spelled in byte tokens, maybe cut short
            run = [i for r in draw(st.lists(st.sampled_from(runs), min_size=1, max_size=3)) for i in r]
            ids.extend(run[: draw(st.integers(1, len(run)))])
        elif choice < 7:
            ids.append(draw(st.sampled_from(specials)))
        else:  # a slice of real text: Korean, CJK, emoji (ZWJ, flags), combining marks, code
            encoded = draw(st.sampled_from(text_ids))
            start = draw(st.integers(0, len(encoded) - 1))
            ids.extend(encoded[start : start + draw(st.integers(1, 16))])
    return ids[:MAX_SCRIPT_IDS]


@st.composite
def prompts(draw, h: Harness):
    if draw(st.booleans()):  # the last is long enough to fill cached prefix blocks
        return draw(st.sampled_from(["q", "Hello!", "안녕 你好 👋", "A longer prompt, " * 6]))
    return draw(st.lists(st.integers(0, h.tok.vocab_size - 1), min_size=1, max_size=4))


@st.composite
def max_tokens_for(draw, script: list[int]) -> int:
    choice = draw(st.integers(0, 5))
    if choice == 0:  # cut short
        return draw(st.integers(1, len(script)))
    if choice == 1:  # past the end: the last id repeats
        return len(script) + draw(st.integers(1, 4))
    return len(script)


@st.composite
def stop_strings(draw, text: str) -> list[str]:
    """Substrings of `text`: at its start, around non-ASCII characters (cutting a grapheme's
    neighbours: a combining mark, a ZWJ, half a flag), overlapping pairs; and absent ones."""
    stops: list[str] = []
    non_ascii = [i for i, c in enumerate(text) if ord(c) > 127]
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.integers(0, 5)) if text else 5
        length = draw(st.integers(1, 5))
        if kind == 0:
            start = 0
        elif kind in (1, 2) and non_ascii:
            start = max(0, draw(st.sampled_from(non_ascii)) + draw(st.integers(-1, 1)))
        elif kind < 5:
            start = draw(st.integers(0, len(text) - 1))
        else:
            stops.append(draw(st.sampled_from(ABSENT_STOPS)))
            continue
        stops.append(text[start : start + length])
        if kind in (2, 3):  # an overlapping one: shifted by one, or longer from the same start
            shift = draw(st.integers(0, 1))
            stops.append(text[start + shift : start + length + 1 - shift])
    return [s for s in stops if s]


# ------------------------------------------------------------------ checks shared by the properties


def check_events(h: Harness, events, completions, expected_ids: list[int], expected_text: str, reason: str, params):
    streamed = "".join(e.text for e in events)
    ids = [t for e in events for t in e.token_ids]
    assert ids == expected_ids
    assert streamed == expected_text
    assert events and events[-1].finish_reason == reason
    assert all(e.finish_reason is None for e in events[:-1])
    for done in completions:  # invariant 2: one-shot (batched) == streamed
        assert done.text == streamed
        assert done.token_ids == ids
        assert done.finish_reason == reason
        assert done.usage.completion_tokens == len(ids)
    # Never retracted, never past a stop cut: every streamed prefix is a prefix of the final
    # text and of the decode of the ids generated so far.
    sofar, ids_sofar = "", []
    for e in events[:-1]:
        sofar += e.text
        ids_sofar += e.token_ids
        assert expected_text.startswith(sofar)
        assert h.decode(ids_sofar, params.skip_special_tokens).startswith(sofar)


# ------------------------------------------------------------------ invariant 2


@SETTINGS
@given(data=st.data())
def test_stream_equals_one_shot_equals_decode(harness, data):
    h = harness
    script = data.draw(scripts(h), label="script")
    params = SamplingParams(
        max_tokens=data.draw(max_tokens_for(script)),
        temperature=0,
        ignore_eos=data.draw(st.booleans()),
        skip_special_tokens=data.draw(st.booleans()),
    )
    prompt = data.draw(prompts(h))
    events, completions = h.run(script, params, prompt)
    expected_ids, expected_text, reason = expected_output(h, script, params)
    if params.ignore_eos or not set(script) & set(h.tok.eos_token_ids):
        assert reason == "length"
        assert expected_text == h.decode(emitted_ids(script, params.max_tokens), params.skip_special_tokens)
    check_events(h, events, completions, expected_ids, expected_text, reason, params)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_seeded_sampling_stream_equals_one_shot(harness, data):
    """Sampled (not greedy) requests with a seed: the stream, the same request batched with a
    different one, and decode of the ids all agree; logprobs stay one per token."""
    h = harness
    script = data.draw(scripts(h), label="script")[:12]  # a sampled token costs a full-vocabulary draw
    params = SamplingParams(
        max_tokens=data.draw(max_tokens_for(script)),
        temperature=data.draw(st.sampled_from([0.7, 1.5, 4.0])),
        top_k=data.draw(st.sampled_from([0, 5, 1000])),
        top_p=data.draw(st.sampled_from([1.0, 0.95])),
        seed=data.draw(st.integers(0, 2**32)),
        ignore_eos=True,
        skip_special_tokens=data.draw(st.booleans()),
        logprobs=data.draw(st.booleans()),
    )
    other = SamplingParams(max_tokens=params.max_tokens, temperature=2.0, seed=params.seed + 1, ignore_eos=True)
    h.use_script(script)
    events = list(h.eng.stream("q", params))
    done, done_other = h.eng.generate(["q", "q"], [params, other])
    ids = [t for e in events for t in e.token_ids]
    assert len(ids) == params.max_tokens
    check_events(h, events, [done], ids, h.decode(ids, params.skip_special_tokens), "length", params)
    assert done_other.text == h.decode(done_other.token_ids, True)
    if params.logprobs:
        assert [lp.token_id for e in events for lp in e.logprobs] == ids == [lp.token_id for lp in done.logprobs]


# ------------------------------------------------------------------ invariant 3


@SETTINGS
@given(data=st.data())
def test_stop_strings_cut_at_earliest_occurrence(harness, data):
    h = harness
    script = data.draw(scripts(h), label="script")
    skip = data.draw(st.booleans())
    max_tokens = data.draw(max_tokens_for(script))
    full = h.decode(emitted_ids(script, max_tokens), skip)
    if data.draw(st.booleans()):  # also from a prefix's decode: a held character renders as U+FFFD there
        source = h.decode(script[: data.draw(st.integers(1, len(script)))], skip)
    else:
        source = full
    stops = data.draw(stop_strings(source), label="stops")
    if not stops:
        stops = [ABSENT_STOPS[0]]
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=0,
        ignore_eos=True,
        skip_special_tokens=skip,
        stop=stops,
        include_stop_str_in_output=data.draw(st.booleans()),
    )
    events, completions = h.run(script, params, data.draw(prompts(h)))
    expected_ids, expected_text, reason = expected_output(h, script, params)
    check_events(h, events, completions, expected_ids, expected_text, reason, params)
    if reason == "length":
        assert not any(s in full for s in stops)


# ------------------------------------------------------------------ invariant 4


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_logprobs_one_per_token_streamed_and_one_shot(harness, data):
    h = harness
    script = data.draw(scripts(h), label="script")
    top_k = data.draw(st.sampled_from([0, 1, 2, 5, 20]))
    prompt_k = data.draw(st.sampled_from([None, 0, 3]))
    full = h.decode(script, True)
    params = SamplingParams(
        max_tokens=data.draw(max_tokens_for(script)),
        temperature=0,
        ignore_eos=True,
        logprobs=True,
        top_logprobs=top_k,
        prompt_logprobs=prompt_k,
        stop=data.draw(st.one_of(st.just([]), stop_strings(full))),
    )
    events, completions = h.run(script, params, data.draw(prompts(h)))
    # prompt_logprobs: aligned with the prompt ids, entry 0 None, streamed and one-shot alike.
    for done, prompt_lps in [(completions[0], h.last_prompt_logprobs)] + [(c, c.prompt_logprobs) for c in completions]:
        if prompt_k is None:
            assert prompt_lps is None
            continue
        assert len(prompt_lps) == len(done.prompt_token_ids) and prompt_lps[0] is None
        for token_id, lp in zip(done.prompt_token_ids[1:], prompt_lps[1:]):
            assert lp.token_id == token_id and len(lp.top) == prompt_k
            assert bytes(lp.bytes) == raw_bytes(h, token_id)
    expected_ids, expected_text, reason = expected_output(h, script, params)
    check_events(h, events, completions, expected_ids, expected_text, reason, params)
    streamed = []
    for e in events:
        assert e.logprobs is not None and len(e.logprobs) == len(e.token_ids)
        assert [lp.token_id for lp in e.logprobs] == e.token_ids
        streamed.extend(e.logprobs)
    for done in completions:
        assert [lp.token_id for lp in done.logprobs] == expected_ids
        for a, b in zip(streamed, done.logprobs):
            assert a.token == b.token and a.bytes == b.bytes
            assert a.logprob == pytest.approx(b.logprob)
            assert [t[:3] for t in a.top] == [t[:3] for t in b.top]
            assert [t[3] for t in a.top] == pytest.approx([t[3] for t in b.top])
    for lp in streamed:
        assert bytes(lp.bytes) == raw_bytes(h, lp.token_id)
        assert lp.token == bytes(lp.bytes).decode("utf-8", errors="replace")
        assert lp.logprob <= 0.0
        assert len(lp.top) == top_k
        if top_k:
            assert lp.top[0][0] == lp.token_id  # ScriptedModel peaks on the scripted id
            assert lp.top[0][3] == pytest.approx(lp.logprob)
        values = [t[3] for t in lp.top]
        assert values == sorted(values, reverse=True)
        for token_id, token, data_bytes, _ in lp.top:
            assert bytes(data_bytes) == raw_bytes(h, token_id)
            assert token == bytes(data_bytes).decode("utf-8", errors="replace")
    joined = b"".join(bytes(lp.bytes) for lp in streamed)
    assert joined == b"".join(raw_bytes(h, i) for i in expected_ids)
    if h.name in BYTE_LEVEL_VOCABS and reason == "length":
        # Byte-level BPE: the output is exactly the joined bytes rendered with errors="replace".
        assert joined.decode("utf-8", errors="replace") == h.decode(expected_ids, False)


# ------------------------------------------------------------------ stop token ids and EOS


@SETTINGS
@given(data=st.data())
def test_stop_token_ids_and_eos_end_generation(harness, data):
    h = harness
    script = data.draw(scripts(h), label="script")
    position = data.draw(st.integers(0, len(script)))
    if data.draw(st.booleans()):
        stop_id, stop_token_ids = h.tok.eos_token_ids[0], ()
    else:
        stop_id = data.draw(st.integers(0, h.tok.vocab_size - 1))
        stop_token_ids = (stop_id,)
    script = script[:position] + [stop_id] + script[position:]
    skip = data.draw(st.booleans())
    with_stops = data.draw(st.booleans())  # stop strings too: whichever comes first ends it
    params = SamplingParams(
        max_tokens=len(script) + 2,
        temperature=0,
        stop_token_ids=stop_token_ids,
        skip_special_tokens=skip,
        logprobs=data.draw(st.booleans()),
        stop=data.draw(stop_strings(h.decode(script, skip))) if with_stops else (),
    )
    events, completions = h.run(script, params, data.draw(prompts(h)))
    expected_ids, expected_text, reason = expected_output(h, script, params)
    assert reason == "stop"
    if not with_stops:
        stop_ids = set(stop_token_ids) | set(h.tok.eos_token_ids)
        first = next(i for i, t in enumerate(script) if t in stop_ids)
        assert expected_ids == script[: first + 1]
        assert expected_text == h.decode(script[:first], skip)
    check_events(h, events, completions, expected_ids, expected_text, reason, params)
    if params.logprobs:
        assert [lp.token_id for e in events for lp in e.logprobs] == expected_ids


# ------------------------------------------------------------------ a stop that ends in held text


@pytest.mark.parametrize("name", sorted(BYTE_LEVEL_VOCABS))
@pytest.mark.parametrize("include", [False, True])
def test_stop_cut_is_earliest_even_when_it_ends_in_held_text(name, include):
    """Token " \\xe6" releases " " and holds the lead byte \\xe6 (decode shows U+FFFD). After "a",
    decode of the ids is "a \\ufffd": the stop "a \\ufffd" starts at 0, the stop " " at 1. The
    cut is before the earliest, whatever else the same token completes; adding a stop string
    that occurs later must never make the output longer."""
    tok = engine.load_tokenizer(VOCABS[name]())
    script = [tok.token_to_id("a"), tok.token_to_id(vocabs.byte_level_str(b" \xe6")), tok.token_to_id("b")]
    assert tok.decode(script[:2]) == "a \ufffd" and tok.decode(script) == "a \ufffdb"
    expected = "a \ufffd" if include else ""
    with engine.Engine(ScriptedModel(script, tok.vocab_size), tok, max_model_len=64) as eng:
        for stops in (["a \ufffd"], ["a \ufffd", " "], [" ", "a \ufffd"]):
            params = SamplingParams(max_tokens=3, temperature=0, stop=stops, include_stop_str_in_output=include)
            events = list(eng.stream("q", params))
            assert (("".join(e.text for e in events), [t for e in events for t in e.token_ids])
                    == (expected, script[:2])), stops
            assert events[-1].finish_reason == "stop"
