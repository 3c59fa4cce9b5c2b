"""Structured output through the public Engine on the real default model (SmolLM2-135M-Instruct):
every constrained output parses and validates, streams end exactly when the grammar is complete,
bad constraints are ValueErrors naming the field."""
import functools
import json
import re

import jsonschema
import llguidance
import llguidance.numpy
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import engine
from engine.errors import InvalidParameterError
from engine.params import SamplingParams
from engine.structured import cache_info, compile_grammar, spec_of
from engine.structured.matcher import mask_logits

NUM_SCHEMAS = 50
MAX_TOKENS = 200  # every schema below fits well within this (strings, arrays and nesting are bounded)


@pytest.fixture(scope="module")
def eng():
    with engine.Engine.from_pretrained(max_model_len=1024, max_num_seqs=64, max_num_batched_tokens=512) as e:
        yield e


def chat_prompt(eng, text: str) -> str:
    return eng.tokenizer.apply_chat_template([{"role": "user", "content": text}])


# ---- a bounded strategy of JSON Schemas: objects, arrays, enums, nesting, patterns, bounded numbers ----
NAMES = st.sampled_from(["id", "name", "age", "city", "tags", "score", "kind", "items", "ok", "note"])


def leaf_schemas():
    integer = st.tuples(st.integers(-1000, 1000), st.integers(0, 1000)).map(
        lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]})
    # multipleOf bounds the digits: a bare "number" lets a small model write decimals forever.
    number = st.tuples(st.integers(-100, 100), st.integers(1, 100), st.booleans(), st.sampled_from([0.25, 0.5])).map(
        lambda t: {"type": "number", "minimum": t[0], "maximum": t[0] + t[1], "multipleOf": t[3]} if t[2]
        else {"type": "number", "exclusiveMinimum": t[0], "exclusiveMaximum": t[0] + t[1], "multipleOf": t[3]})
    string = st.integers(1, 10).map(lambda n: {"type": "string", "maxLength": n})
    pattern = st.sampled_from([r"^[a-z]{2,6}$", r"^[A-Z][a-z]{1,5}$", r"^[0-9]{3}-[0-9]{2}$", r"^(yes|no)$"]).map(
        lambda p: {"type": "string", "pattern": p})
    enum = st.one_of(
        st.lists(st.text("abcdefgh", min_size=1, max_size=6), min_size=1, max_size=4, unique=True),
        st.lists(st.integers(-5, 50), min_size=1, max_size=4, unique=True)).map(lambda v: {"enum": v})
    return st.one_of(integer, number, string, pattern, enum, st.just({"type": "boolean"}), st.just({"type": "null"}))


def array_schemas(children):
    return st.tuples(children, st.integers(0, 2), st.integers(0, 2)).map(
        lambda t: {"type": "array", "items": t[0], "minItems": t[1], "maxItems": t[1] + t[2]})


def object_schemas(children):
    return st.lists(st.tuples(NAMES, children, st.booleans()), min_size=1, max_size=3,
                    unique_by=lambda t: t[0]).map(lambda props: {
                        "type": "object", "properties": {n: s for n, s, _ in props},
                        "required": [n for n, _, is_req in props if is_req], "additionalProperties": False})


def container_schemas(children):
    return st.one_of(object_schemas(children), array_schemas(children))


SCHEMAS = st.recursive(leaf_schemas(), container_schemas, max_leaves=4)
TOP_OBJECTS = object_schemas(SCHEMAS)  # what response_format users send
TOP_OTHERS = st.one_of(array_schemas(SCHEMAS), leaf_schemas())


@functools.cache
def draw_schemas(count: int) -> list[dict]:
    """60% objects at the top level, the rest arrays and bare values."""
    num_objects = count * 3 // 5
    return draw(TOP_OBJECTS, num_objects) + draw(TOP_OTHERS, count - num_objects)


def draw(strategy, count: int) -> list[dict]:
    """``count`` distinct schemas: hypothesis draws a few lists of them (derandomized, so every run
    checks the same ones; its first list is the minimal one) and the most varied list wins. The
    engine then runs them all in one batch, which keeps 50 real generations within seconds."""
    lists: list[list[dict]] = []

    @settings(max_examples=4, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
    @given(st.lists(strategy, min_size=count, max_size=count, unique_by=lambda s: json.dumps(s, sort_keys=True)))
    def collect(schemas):
        lists.append(schemas)

    collect()
    return max(lists, key=lambda schemas: len(json.dumps(schemas)))


def test_schema_strategy_covers_the_features():
    text = json.dumps(draw_schemas(NUM_SCHEMAS))
    for feature in ('"type": "object"', '"type": "array"', '"enum"', '"pattern"', '"exclusiveMinimum"',
                    '"type": "number"', '"type": "integer"', '"maxLength"', '"required"'):
        assert feature in text, feature
    assert re.search(r'"properties": \{[^{}]*"type": "object"', text) or '"items": {"type": "object"' in text


def test_random_schemas_give_valid_json_greedy_and_seeded(eng):
    schemas = draw_schemas(NUM_SCHEMAS)
    prompt = chat_prompt(eng, "Reply with a JSON value.")
    params = [SamplingParams(max_tokens=MAX_TOKENS, json_schema=s, temperature=0 if i % 2 == 0 else 0.8,
                             seed=None if i % 2 == 0 else i) for i, s in enumerate(schemas)]
    completions = eng.generate([prompt] * len(schemas), params)
    for schema, c in zip(schemas, completions):
        assert c.finish_reason == "stop", (schema, c.text)
        value = json.loads(c.text)
        jsonschema.validate(value, schema)


def test_json_schema_in_chat_follows_property_order_and_validates(eng):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    c = eng.chat([{"role": "user", "content": "Give a person as JSON."}],
                 SamplingParams(max_tokens=60, temperature=0, json_schema=schema))
    value = json.loads(c.text)
    jsonschema.validate(value, schema)
    assert list(value) == ["name", "age"]  # properties in the schema's order
    assert c.finish_reason == "stop"


REGEXES = [r"[0-9]{3}-[0-9]{4}", r"(cat|dog|bird)s?", r"[A-Z][a-z]{2,8} [A-Z][a-z]{2,8}",
           r"-?[1-9][0-9]{0,3}\.[0-9]{2}", r"(yes|no), because [a-z ]{5,20}\."]


def test_regex_outputs_match_greedy_and_seeded(eng):
    prompt = chat_prompt(eng, "Answer briefly.")
    params = [SamplingParams(max_tokens=60, regex=r, temperature=t, seed=7) for r in REGEXES for t in (0, 1.0)]
    completions = eng.generate([prompt] * len(params), params)
    for p, c in zip(params, completions):
        assert re.fullmatch(p.regex, c.text), (p.regex, c.text)
        if c.finish_reason == "length":  # an unbounded tail ([a-z ]{5,20} is bounded: none here)
            pytest.fail(f"{p.regex!r} did not complete: {c.text!r}")


def test_choice_outputs_are_one_of_the_choices(eng):
    choices = ["Paris", "London", "Berlin", "a longer answer with spaces"]
    prompt = chat_prompt(eng, "What is the capital of France?")
    params = [SamplingParams(max_tokens=20, choice=choices, temperature=t, seed=s) for t, s in
              [(0, None), (1.0, 1), (1.0, 2), (1.5, 3)]]
    completions = eng.generate([prompt] * len(params), params)
    for c in completions:
        assert c.text in choices and c.finish_reason == "stop"


@pytest.mark.parametrize("grammar, pattern", [
    ('root ::= "The answer is " [0-9]+ "."', r"The answer is [0-9]+\."),  # GBNF (llama.cpp)
    ('start: "x=" NUM ("," NUM)*\nNUM: /[0-9]{1,3}/', r"x=[0-9]{1,3}(,[0-9]{1,3})*"),  # Lark
])
def test_grammar_dialects_gbnf_and_lark(eng, grammar, pattern):
    c = eng.generate([chat_prompt(eng, "Compute 6 times 7.")], SamplingParams(max_tokens=40, temperature=0,
                                                                              grammar=grammar))[0]
    assert re.fullmatch(pattern, c.text), c.text


def test_stream_ends_exactly_when_the_grammar_completes(eng):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 15},
                                               "ok": {"type": "boolean"}}, "required": ["city", "ok"],
              "additionalProperties": False}
    params = SamplingParams(max_tokens=100, temperature=0.7, seed=3, json_schema=schema)
    events = list(eng.stream(chat_prompt(eng, "A city as JSON."), params))
    assert [e.finish_reason for e in events[:-1]] == [None] * (len(events) - 1)
    assert events[-1].finish_reason == "stop"
    token_ids = [t for e in events for t in e.token_ids]
    text = "".join(e.text for e in events)
    jsonschema.validate(json.loads(text), schema)
    # Replay the ids through a fresh matcher: complete after the last id, not one id earlier.
    matcher = compile_grammar(spec_of(params), eng.tokenizer, eng.tokenizer.vocab_size).matcher()
    assert not set(token_ids) & set(eng.tokenizer.eos_token_ids)  # it stopped on the grammar, not on EOS
    for token_id in token_ids[:-1]:
        assert matcher.consume_token(token_id)
        assert not matcher.is_stopped()
    assert matcher.consume_token(token_ids[-1]) and matcher.is_stopped()


def test_logprobs_of_a_constrained_request_are_over_the_allowed_tokens(eng):
    """As vLLM: the mask comes before the logprobs, so the alternatives are tokens the grammar allows
    and their probabilities sum to at most 1 among themselves."""
    params = SamplingParams(max_tokens=5, temperature=0, regex="[0-9]{3}", logprobs=True, top_logprobs=5)
    c = eng.generate([chat_prompt(eng, "Pick a number.")], params)[0]
    assert re.fullmatch("[0-9]{3}", c.text) and len(c.logprobs) == len(c.token_ids)
    for entry in c.logprobs:
        finite = [(token, lp) for _, token, _, lp in entry.top if lp != float("-inf")]
        assert finite and all(re.fullmatch("[0-9]+", token) for token, _ in finite), entry.top
        assert entry.logprob == finite[0][1]  # greedy took the best allowed token
        assert sum(np.exp(lp) for _, lp in finite) <= 1.0 + 1e-4


def test_n_choices_each_follow_the_schema(eng):
    schema = {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3}
    completions = eng.generate([chat_prompt(eng, "Some colors.")],
                               SamplingParams(max_tokens=40, temperature=1.0, seed=5, n=3, json_schema=schema))
    assert len(completions) == 3
    for c in completions:
        jsonschema.validate(json.loads(c.text), schema)


def test_a_repeated_schema_is_compiled_once(eng):
    schema = {"type": "object", "properties": {"unique_for_cache_test": {"type": "integer"}}}
    params = SamplingParams(max_tokens=5, temperature=0, json_schema=schema)
    eng.generate(["hi"], params)
    before = cache_info()
    eng.generate(["hi", "ho"], params)
    after = cache_info()
    assert after["misses"] == before["misses"] and after["hits"] == before["hits"] + 2


@pytest.mark.parametrize("fields, param", [
    ({"json_schema": {"type": "object", "properties": {"a": {"type": "string", "format": "no-such-format"}}}},
     "json_schema"),
    ({"json_schema": {"type": "strange"}}, "json_schema"),
    ({"json_schema": {"$ref": "#/$defs/missing"}}, "json_schema"),
    ({"json_schema": "not a dict"}, "json_schema"),
    ({"json_schema": {"a": float("nan")}}, "json_schema"),
    ({"regex": "[a-z"}, "regex"),
    ({"regex": "(unclosed"}, "regex"),
    ({"regex": ""}, "regex"),
    ({"regex": "a" * 10_000}, "regex"),
    ({"choice": []}, "choice"),
    ({"choice": ["a", 3]}, "choice"),
    ({"choice": "abc"}, "choice"),
    ({"grammar": "start: undefined_rule"}, "grammar"),
    ({"grammar": "root ::= (\"a\""}, "grammar"),
    ({"json_schema": {"type": "object"}, "regex": "a+"}, "regex"),
    ({"choice": ["a"], "grammar": "start: \"a\""}, "grammar"),
])
def test_bad_constraints_are_value_errors_naming_the_field(eng, fields, param):
    with pytest.raises(ValueError) as info:
        eng.generate(["hi"], SamplingParams(max_tokens=5, **fields))
    assert isinstance(info.value, InvalidParameterError) and info.value.param == param


def test_deep_or_huge_schemas_are_refused_before_compiling():
    deep = {"type": "string"}
    for _ in range(100):
        deep = {"type": "array", "items": deep}
    with pytest.raises(InvalidParameterError, match="deeper") as info:
        SamplingParams(json_schema=deep)
    assert info.value.param == "json_schema"
    huge = {"enum": ["x" * 100] * 1000}
    with pytest.raises(InvalidParameterError, match="larger") as info:
        SamplingParams(json_schema=huge)
    assert info.value.param == "json_schema"


def test_gguf_vocabulary_bridge_accepts_our_own_encoding(qwen_vocab):
    """A Qwen2 GGUF vocabulary (byte-level BPE read by our GGUF loader): the JSON text our tokenizer
    encodes walks the grammar to completion; a wrong id is refused."""
    tok = engine.load_tokenizer(qwen_vocab)
    schema = {"type": "object", "properties": {"名前": {"type": "string"}, "n": {"type": "integer"}},
              "required": ["名前", "n"], "additionalProperties": False}
    compiled = compile_grammar(spec_of(SamplingParams(json_schema=schema)), tok, tok.vocab_size + 7)
    matcher = compiled.matcher()
    for token_id in tok.encode('{"名前": "ä ö ü 😀", "n": -12}', add_special_tokens=False):
        assert matcher.consume_token(token_id)
    assert matcher.is_stopped() and matcher.is_accepting()
    fresh = compiled.matcher()
    assert not fresh.consume_token(tok.encode("[", add_special_tokens=False)[0])
    assert isinstance(fresh, llguidance.LLMatcher)


@pytest.fixture(scope="module")
def qwen_vocab():
    from tokenizer_fixtures import TESTDATA
    path = TESTDATA / "ggml-vocab-qwen2.gguf"
    if not path.is_file():
        pytest.fail(f"{path} is missing: run `make testdata` first")
    return path


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 6), st.integers(1, 200), st.data())
def test_mask_logits_matches_llguidance_reference(num_rows, vocab_size, data):
    """Our unpack-and-mask against llguidance's own NumPy reference (apply_token_bitmask_inplace)."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    logits = rng.standard_normal((num_rows, vocab_size)).astype(np.float32)  # [S, V]
    row_ids = sorted(data.draw(st.sets(st.integers(0, num_rows - 1), min_size=1)))
    bitmask = rng.integers(-2**31, 2**31, size=(len(row_ids), (vocab_size + 31) // 32), dtype=np.int64).astype(
        np.int32)  # [R, W]
    expected = logits.copy()
    sub = expected[row_ids]
    llguidance.numpy.apply_token_bitmask_inplace(sub, bitmask)
    expected[row_ids] = sub
    got = logits.copy()
    mask_logits(got, row_ids, bitmask)
    np.testing.assert_array_equal(got, expected)
