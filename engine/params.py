"""SamplingParams: what a request asks of generation, validated once at creation."""
from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import InvalidParameterError
from .text.stops import check_stop_caps

MAX_TOP_LOGPROBS = 20
MAX_N = 128  # choices per request
MAX_LOGIT_BIAS = 100.0  # |bias| bound, as OpenAI
MAX_BAD_WORDS = 256
MAX_LOGIT_BIAS_ENTRIES = 1024  # OpenAI's limit is 300; every entry costs a scatter per token
# Structured output (engine.structured): sizes bound the compile work done on the caller's thread.
MAX_GRAMMAR_CHARS = 65_536  # json_schema (serialized), grammar, and all of choice together
MAX_REGEX_CHARS = 8_192
MAX_CHOICES = 1_024
MAX_SCHEMA_DEPTH = 64  # nesting of objects/arrays in json_schema
CONSTRAINT_FIELDS = ("json_schema", "regex", "choice", "grammar")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    max_tokens: int | None = 256  # None: the rest of the context (max_model_len - prompt)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] | list[str] | str = ()
    stop_token_ids: tuple[int, ...] | list[int] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_p: float = 0.0
    allowed_token_ids: tuple[int, ...] | list[int] | None = None
    bad_words: tuple[str, ...] | list[str] = ()
    n: int = 1
    json_schema: dict | None = None  # the output is JSON valid under this schema
    regex: str | None = None  # the whole output matches this regex
    choice: tuple[str, ...] | list[str] | None = None  # the output is one of these strings
    grammar: str | None = None  # the output is a sentence of this Lark or GBNF grammar

    def __post_init__(self) -> None:
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise InvalidParameterError(
                f"max_tokens must be None or an integer >= 1, got {self.max_tokens!r}", "max_tokens")
        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidParameterError(
                f"temperature must be a finite number >= 0, got {self.temperature!r}", "temperature")
        if not _is_number(self.top_p) or not (0 < self.top_p <= 1):
            raise InvalidParameterError(f"top_p must be in (0, 1], got {self.top_p!r}", "top_p")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise InvalidParameterError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}", "top_k")
        if self.seed is not None and not (_is_int(self.seed) and -(1 << 63) <= self.seed < (1 << 64)):
            raise InvalidParameterError(f"seed must be None or a 64-bit integer, got {self.seed!r}", "seed")
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) for s in self.stop):
            raise InvalidParameterError(f"stop must be a string or a list of strings, got {self.stop!r}", "stop")
        if any(s == "" for s in self.stop):
            raise InvalidParameterError("stop must not contain an empty string", "stop")
        check_stop_caps(self.stop)
        self.stop = tuple(self.stop)
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
            _is_int(t) and t >= 0 for t in self.stop_token_ids
        ):
            raise InvalidParameterError(
                f"stop_token_ids must be a list of non-negative integers, got {self.stop_token_ids!r}",
                "stop_token_ids")
        self.stop_token_ids = tuple(self.stop_token_ids)
        for name in ("ignore_eos", "logprobs", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidParameterError(f"{name} must be a boolean, got {getattr(self, name)!r}", name)
        if not _is_int(self.top_logprobs) or not (0 <= self.top_logprobs <= MAX_TOP_LOGPROBS):
            raise InvalidParameterError(
                f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs!r}",
                "top_logprobs")
        if self.top_logprobs and not self.logprobs:
            self.logprobs = True
        if self.prompt_logprobs is not None and (
            not _is_int(self.prompt_logprobs) or not (0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS)
        ):
            raise InvalidParameterError(
                f"prompt_logprobs must be None or an integer in [0, {MAX_TOP_LOGPROBS}], got {self.prompt_logprobs!r}",
                "prompt_logprobs")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise InvalidParameterError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}", "min_tokens")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not (-2.0 <= value <= 2.0):
                raise InvalidParameterError(f"{name} must be a number in [-2, 2], got {value!r}", name)
        if not _is_number(self.repetition_penalty) or not (0 < self.repetition_penalty <= 100):
            raise InvalidParameterError(
                f"repetition_penalty must be a number in (0, 100] (1 disables it), got {self.repetition_penalty!r}",
                "repetition_penalty")
        if not _is_number(self.min_p) or not (0 <= self.min_p <= 1):
            raise InvalidParameterError(f"min_p must be a number in [0, 1], got {self.min_p!r}", "min_p")
        if not _is_int(self.n) or not (1 <= self.n <= MAX_N):
            raise InvalidParameterError(f"n must be an integer in [1, {MAX_N}], got {self.n!r}", "n")
        if self.logit_bias is not None:
            self.logit_bias = _check_logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, (list, tuple)) or not self.allowed_token_ids or not all(
                _is_int(t) and t >= 0 for t in self.allowed_token_ids
            ):
                raise InvalidParameterError(
                    f"allowed_token_ids must be None or a non-empty list of non-negative integers, "
                    f"got {self.allowed_token_ids!r}", "allowed_token_ids")
            self.allowed_token_ids = tuple(sorted(set(self.allowed_token_ids)))
        if not isinstance(self.bad_words, (list, tuple)) or len(self.bad_words) > MAX_BAD_WORDS or not all(
            isinstance(w, str) and w.strip() for w in self.bad_words
        ):
            raise InvalidParameterError(
                f"bad_words must be a list of at most {MAX_BAD_WORDS} non-blank strings, got {self.bad_words!r}",
                "bad_words")
        self.bad_words = tuple(self.bad_words)
        _check_constraint(self)

    @property
    def has_constraint(self) -> bool:
        """True when one of json_schema / regex / choice / grammar constrains the output."""
        return (self.json_schema is not None or self.regex is not None or self.choice is not None
                or self.grammar is not None)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def has_logits_processing(self) -> bool:
        """True when the sampler must change this request's logits before choosing (penalties,
        logit_bias, allowed_token_ids, bad_words, min_tokens); min_p is applied with temperature instead."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
            or self.logit_bias or self.allowed_token_ids is not None or self.min_tokens or self.bad_words
        )


def _check_constraint(params: SamplingParams) -> None:
    """At most one of json_schema / regex / choice / grammar, each of bounded size (linear time).
    Whether the schema or grammar compiles is checked by engine.structured when the request is made."""
    present = [name for name in CONSTRAINT_FIELDS if getattr(params, name) is not None]
    if len(present) > 1:
        raise InvalidParameterError(
            f"only one of json_schema, regex, choice, grammar may be set, got {' and '.join(present)}", present[1])
    if params.json_schema is not None:
        if not isinstance(params.json_schema, dict):
            raise InvalidParameterError(
                f"json_schema must be a JSON Schema object (dict), got {type(params.json_schema).__name__}",
                "json_schema")
        _check_schema_size(params.json_schema)
    for name, limit in (("regex", MAX_REGEX_CHARS), ("grammar", MAX_GRAMMAR_CHARS)):
        value = getattr(params, name)
        if value is not None and (not isinstance(value, str) or not value.strip() or len(value) > limit):
            raise InvalidParameterError(
                f"{name} must be a non-empty string of at most {limit} characters, got "
                f"{type(value).__name__ if not isinstance(value, str) else f'{len(value)} characters'}", name)
    if params.choice is not None:
        choice = params.choice
        if (not isinstance(choice, (list, tuple)) or not choice or len(choice) > MAX_CHOICES
                or not all(isinstance(c, str) and c for c in choice)):
            raise InvalidParameterError(
                f"choice must be a list of 1 to {MAX_CHOICES} non-empty strings, got {_short(choice)}", "choice")
        if sum(len(c) for c in choice) > MAX_GRAMMAR_CHARS:
            raise InvalidParameterError(f"choice strings exceed {MAX_GRAMMAR_CHARS} characters in total", "choice")
        params.choice = tuple(choice)


def _check_schema_size(schema: dict) -> None:
    """JSON values only, nesting <= MAX_SCHEMA_DEPTH, <= MAX_GRAMMAR_CHARS of keys and strings
    (one iterative pass, stops as soon as a bound is passed)."""
    stack = [(schema, 1)]
    num_chars = 0
    while stack:
        value, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise InvalidParameterError(f"json_schema nests deeper than {MAX_SCHEMA_DEPTH} levels", "json_schema")
        if isinstance(value, dict):
            for key, item in value.items():
                if not isinstance(key, str):
                    raise InvalidParameterError(f"json_schema keys must be strings, got {key!r}", "json_schema")
                num_chars += len(key) + 4
                stack.append((item, depth + 1))
        elif isinstance(value, (list, tuple)):
            num_chars += 2 + len(value)
            stack.extend((item, depth + 1) for item in value)
        elif isinstance(value, str):
            num_chars += len(value) + 2
        elif value is None or isinstance(value, (bool, int)) or (isinstance(value, float) and math.isfinite(value)):
            num_chars += 8
        else:
            raise InvalidParameterError(
                f"json_schema must hold JSON values only, got {type(value).__name__}", "json_schema")
        if num_chars > MAX_GRAMMAR_CHARS:
            raise InvalidParameterError(f"json_schema is larger than {MAX_GRAMMAR_CHARS} characters", "json_schema")


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _check_logit_bias(logit_bias) -> dict[int, float]:
    """{token id: bias}; keys may be ints or decimal strings (JSON object keys), biases in [-100, 100]."""
    if not isinstance(logit_bias, dict):
        raise InvalidParameterError(
            f"logit_bias must be an object mapping token ids to numbers, got {type(logit_bias).__name__}", "logit_bias")
    if len(logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidParameterError(
            f"logit_bias has {len(logit_bias)} entries; at most {MAX_LOGIT_BIAS_ENTRIES} are allowed", "logit_bias")
    out: dict[int, float] = {}
    for key, value in logit_bias.items():
        if _is_int(key):
            token_id = key
        elif isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 10:
            token_id = int(key)
        else:
            raise InvalidParameterError(f"logit_bias keys must be token ids (non-negative integers), got {key!r}",
                                        "logit_bias")
        if token_id < 0:
            raise InvalidParameterError(f"logit_bias keys must be non-negative token ids, got {key!r}", "logit_bias")
        if not _is_number(value) or not (-MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS):
            raise InvalidParameterError(
                f"logit_bias[{key!r}] must be a number in [-100, 100], got {value!r}", "logit_bias")
        out[token_id] = float(value)
    return out
