"""Every request field the server knows, declared once: its JSON Schema, its endpoints and its fate.

A field is one of
  SAMPLING  becomes the SamplingParams field of the same name (``target`` if spelt otherwise)
  REQUEST   read by the parser itself (messages, prompt, stream, echo, ...)
  IGNORED   cannot change the answer (user, metadata, store, ...)
  HARMLESS  not implemented: accepted only with the values that change nothing (``schema``
            says which), otherwise a 400 naming the field (functions, audio, beam search, ...)
The parsers (webapp.protocol) validate every present field against its schema with
``check`` (one pass over the value: linear time), and ``json_schema(endpoint)`` renders
the table as the JSON Schema served at ``GET /v1/schema``. Fields the table does not know
are ignored, as vLLM does; on /v1/responses (``RESPONSES_FIELDS``) they are a 400 naming them.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from engine.params import MAX_LOGIT_BIAS, MAX_N, MAX_TOP_LOGPROBS

from .errors import bad_request

MAX_TOKENS_LIMIT = (1 << 31) - 1  # beyond this a request is malformed, not merely too long
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # /v1/completions without max_tokens (OpenAI documents 16; vLLM too)
CHAT, COMPLETIONS, RESPONSES = "chat", "completions", "responses"
BOTH = frozenset({CHAT, COMPLETIONS})


class Fate(enum.Enum):
    SAMPLING = "sampling"
    REQUEST = "request"
    IGNORED = "ignored"
    HARMLESS = "harmless"


@dataclass(frozen=True, slots=True)
class Field:
    name: str
    schema: dict
    fate: Fate
    doc: str
    endpoints: frozenset = BOTH
    target: str | None = None  # the SamplingParams field, when it is spelt differently


def _nullable(schema: dict) -> dict:
    return {"anyOf": [schema, {"type": "null"}]}


INT = {"type": "integer"}
NUM = {"type": "number"}
BOOL = {"type": "boolean"}
STR = {"type": "string"}
TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}}
FALSE = {"const": False}
TEXT_PART = {"type": "object", "properties": {"type": {"const": "text"}, "text": STR}, "required": ["type", "text"]}
MESSAGE = {"type": "object", "required": ["role"], "properties": {
    "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
    "content": {"anyOf": [STR, {"type": "array", "items": TEXT_PART}, {"type": "null"}]}}}
STRINGS = {"type": "array", "items": STR, "minItems": 1}
RESPONSE_FORMAT = {"anyOf": [
    {"type": "object", "properties": {"type": {"const": "text"}}, "required": ["type"]},
    {"type": "object", "properties": {"type": {"const": "json_object"}}, "required": ["type"]},
    {"type": "object", "required": ["type", "json_schema"], "properties": {
        "type": {"const": "json_schema"},
        "json_schema": {"type": "object", "required": ["name"], "properties": {
            "name": STR, "description": STR, "schema": {"type": "object"},
            "strict": {"anyOf": [BOOL, {"type": "null"}]}}}}},
]}
STRUCTURED_OUTPUTS = {"type": "object", "properties": {
    "json": {"anyOf": [{"type": "object"}, STR]}, "regex": STR, "choice": STRINGS, "grammar": STR, "json_object": BOOL}}
CONSTRAINT_FIELDS = frozenset({"response_format", "structured_outputs", "guided_json", "guided_regex",
                               "guided_choice", "guided_grammar"})  # checked by webapp.constraints

_S, _R, _I, _H = Fate.SAMPLING, Fate.REQUEST, Fate.IGNORED, Fate.HARMLESS
_C, _P = frozenset({CHAT}), frozenset({COMPLETIONS})

FIELDS: tuple[Field, ...] = (
    Field("model", _nullable(STR), _R, "any name: this server serves one model"),
    Field("messages", {"type": "array", "items": MESSAGE, "minItems": 1}, _R, "the conversation", _C),
    Field("prompt", {"anyOf": [STR, {"type": "array", "items": STR, "minItems": 1},
                               {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
                               {"type": "array", "items": TOKEN_IDS, "minItems": 1}]}, _R,
          "a string, token ids, or a batch of either (choices of prompt i have indices i*n .. i*n+n-1)", _P),
    Field("max_tokens", _nullable({"type": "integer", "minimum": 1, "maximum": MAX_TOKENS_LIMIT}), _S,
          "absent or null: the rest of the context", _C),
    Field("max_tokens", _nullable({"type": "integer", "minimum": 1, "maximum": MAX_TOKENS_LIMIT}), _S,
          f"absent: {COMPLETIONS_DEFAULT_MAX_TOKENS} (OpenAI's default, as vLLM); null: the rest of the "
          "context", _P),
    Field("max_completion_tokens", _nullable({"type": "integer", "minimum": 1, "maximum": MAX_TOKENS_LIMIT}), _S,
          "the newer name of max_tokens (wins over it)", _C, "max_tokens"),
    Field("temperature", _nullable({"type": "number", "minimum": 0}), _S, "0: greedy"),
    Field("top_p", _nullable({"type": "number", "exclusiveMinimum": 0, "maximum": 1}), _S, "nucleus mass"),
    Field("top_k", _nullable({"type": "integer", "minimum": -1}), _S, "0 or -1: disabled"),
    Field("min_p", _nullable({"type": "number", "minimum": 0, "maximum": 1}), _S, "drop p < min_p * p_max"),
    Field("seed", _nullable({"type": "integer", "minimum": -(1 << 63), "maximum": (1 << 64) - 1}), _S,
          "choice i of n draws with seed + i"),
    Field("n", _nullable({"type": "integer", "minimum": 1, "maximum": MAX_N}), _S, "choices per prompt"),
    Field("stop", {"anyOf": [STR, {"type": "array", "items": STR}, {"type": "null"}]}, _S, "stop strings"),
    Field("stop_token_ids", _nullable(TOKEN_IDS), _S, "stop token ids (vLLM)"),
    Field("ignore_eos", _nullable(BOOL), _S, "keep going past EOS (vLLM)"),
    Field("min_tokens", _nullable({"type": "integer", "minimum": 0}), _S, "EOS and stop ids masked until then"),
    Field("presence_penalty", _nullable({"type": "number", "minimum": -2, "maximum": 2}), _S,
          "l[i] -= p if i was generated"),
    Field("frequency_penalty", _nullable({"type": "number", "minimum": -2, "maximum": 2}), _S,
          "l[i] -= f * count of i in the output"),
    Field("repetition_penalty", _nullable({"type": "number", "exclusiveMinimum": 0, "maximum": 100}), _S,
          "prompt + output ids: l /= r if l > 0 else l *= r (vLLM)"),
    Field("logit_bias", _nullable({"type": "object", "propertyNames": {"pattern": "^[0-9]+$"},
                                   "additionalProperties": {"type": "number", "minimum": -MAX_LOGIT_BIAS,
                                                            "maximum": MAX_LOGIT_BIAS}}), _S,
          "token id -> bias added to its logit"),
    Field("allowed_token_ids", _nullable({"type": "array", "items": {"type": "integer", "minimum": 0},
                                          "minItems": 1}), _S, "only these ids may be generated (vLLM)"),
    Field("skip_special_tokens", _nullable(BOOL), _S, "drop special tokens from the text (vLLM)"),
    Field("include_stop_str_in_output", _nullable(BOOL), _S, "keep the matched stop string (vLLM)"),
    Field("prompt_logprobs", _nullable({"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS}), _S,
          "logprobs of the prompt tokens with the top k of each (vLLM; streamed: in the first chunk)"),
    Field("logprobs", _nullable(BOOL), _S, "logprobs of the output tokens", _C),
    Field("top_logprobs", _nullable({"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS}), _S,
          "alternatives per output token", _C),
    Field("logprobs", _nullable({"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS}), _S,
          "legacy: logprobs with this many alternatives", _P, "top_logprobs"),
    Field("stream", _nullable(BOOL), _R, "server-sent events"),
    Field("stream_options", _nullable({"type": "object", "properties": {
        "include_usage": _nullable(BOOL), "continuous_usage_stats": _nullable(FALSE)}}), _R,
          "include_usage adds a final usage chunk"),
    Field("echo", _nullable(BOOL), _R, "prepend the prompt to the text (and its logprobs)", _P),
    Field("add_special_tokens", _nullable(BOOL), _R, "add BOS etc. when encoding the prompt (vLLM)", _P),
    # --- cannot change the answer ---
    *(Field(name, {}, _I, "ignored: cannot change the answer") for name in (
        "user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key", "request_id",
        "priority", "prediction", "cache_salt", "kv_transfer_params")),
    # --- structured output (webapp.constraints reads these; at most one per request) ---
    Field("response_format", {"anyOf": [*RESPONSE_FORMAT["anyOf"], {"type": "null"}]}, _R,
          "text, json_object (any JSON object) or json_schema (OpenAI)"),
    Field("structured_outputs", _nullable(STRUCTURED_OUTPUTS), _R, "one of json, regex, choice, grammar (vLLM)"),
    Field("guided_json", _nullable({"anyOf": [{"type": "object"}, STR]}), _R, "a JSON Schema (vLLM)"),
    Field("guided_regex", _nullable(STR), _R, "a regex the whole output matches (vLLM)"),
    Field("guided_choice", _nullable(STRINGS), _R, "the output is one of these strings (vLLM)"),
    Field("guided_grammar", _nullable(STR), _R, "a Lark or GBNF grammar (vLLM)"),
    Field("guided_decoding_backend", _nullable(STR), _H, "any value: the one backend is llguidance"),
    # --- tools (engine.tools checks the definitions and the choice) ---
    Field("tools", _nullable({"type": "array", "items": {"type": "object"}}), _R,
          "function tools (engine/tools checks each definition)", _C),
    Field("tool_choice", {"anyOf": [{"enum": ["none", "auto", "required"]}, {"type": "object"}, {"type": "null"}]},
          _R, "none | auto | required | {type: function, function: {name}} (required and named: constrained)", _C),
    Field("parallel_tool_calls", _nullable(BOOL), _R, "false: tool_choice required makes exactly one call", _C),
    # --- not implemented: only the values that change nothing are accepted ---
    Field("functions", _nullable({"type": "array", "maxItems": 0}), _H, "legacy tools: not supported", _C),
    Field("function_call", _nullable({"enum": ["none", "auto"]}), _H, "legacy tools: not supported", _C),
    Field("modalities", _nullable({"type": "array", "items": {"const": "text"}}), _H, "text only", _C),
    Field("audio", {"type": "null"}, _H, "text only", _C),
    Field("reasoning_effort", {"type": "null"}, _H, "no reasoning models", _C),
    Field("verbosity", {"type": "null"}, _H, "not supported", _C),
    Field("web_search_options", {"type": "null"}, _H, "not supported", _C),
    Field("add_generation_prompt", _nullable({"const": True}), _H, "the template always adds it", _C),
    Field("continue_final_message", _nullable(FALSE), _H, "not supported", _C),
    Field("chat_template", {"type": "null"}, _H, "the model's own template only", _C),
    Field("chat_template_kwargs", _nullable({"type": "object"}), _R,
          "more variables of the chat template, e.g. {\"enable_thinking\": false}; each one the template reads", _C),
    Field("documents", {"type": "null"}, _H, "not supported", _C),
    Field("echo", _nullable(FALSE), _H, "vLLM's chat echo: not supported", _C),
    Field("add_special_tokens", _nullable(FALSE), _H, "the chat template adds what it needs", _C),
    Field("suffix", _nullable(STR), _R, "fill-in-the-middle: the text after the insertion (models with FIM "
          "tokens; others: a 400 unless empty)", _P),
    Field("best_of", _nullable({"type": "integer", "minimum": 1}), _H, "no reranking: must equal n"),
    Field("use_beam_search", _nullable(FALSE), _H, "no beam search"),
    Field("length_penalty", _nullable({"const": 1}), _H, "beam search only"),
    Field("bad_words", _nullable({"type": "array", "items": STR}), _S,
          "words never generated (vLLM: encoded as is and with a leading space)"),
    Field("truncate_prompt_tokens", {"type": "null"}, _H, "not supported"),
    Field("spaces_between_special_tokens", _nullable({"const": True}), _H, "always true"),
    Field("guided_whitespace_pattern", {"type": "null"}, _H, "not supported: JSON output is compact"),
    Field("logits_processors", {"type": "null"}, _H, "not supported"),
    Field("return_tokens_as_token_ids", _nullable(FALSE), _H, "not supported"),
    Field("mm_processor_kwargs", {"type": "null"}, _H, "text only"),
)

_RS = frozenset({RESPONSES})
TEXT_FORMAT = {"anyOf": [
    {"type": "object", "properties": {"type": {"enum": ["text", "json_object"]}}, "required": ["type"]},
    {"type": "object", "required": ["type"], "properties": {
        "type": {"const": "json_schema"}, "name": STR, "description": STR, "schema": {"type": "object"},
        "strict": _nullable(BOOL)}}]}

# POST /v1/responses (webapp.responses): a field not declared here is a 400 naming it.
RESPONSES_FIELDS: tuple[Field, ...] = (
    Field("model", _nullable(STR), _R, "any name: this server serves one model", _RS),
    Field("input", {"anyOf": [STR, {"type": "array", "minItems": 1}]}, _R,  # items: webapp.responses
          "a user message, or items: messages, function_call, function_call_output", _RS),
    Field("instructions", _nullable(STR), _R, "a system message first (not carried by previous_response_id)",
          _RS),
    Field("previous_response_id", _nullable(STR), _R, "continue a stored response's conversation", _RS),
    Field("store", _nullable(BOOL), _R, "keep the response for GET and previous_response_id (default true)",
          _RS),
    Field("max_output_tokens", _nullable({"type": "integer", "minimum": 1, "maximum": MAX_TOKENS_LIMIT}), _S,
          "absent or null: the rest of the context", _RS, "max_tokens"),
    Field("temperature", _nullable({"type": "number", "minimum": 0, "maximum": 2}), _S, "0: greedy", _RS),
    Field("top_p", _nullable({"type": "number", "exclusiveMinimum": 0, "maximum": 1}), _S, "nucleus mass",
          _RS),
    Field("tools", _nullable({"type": "array", "items": {"type": "object"}}), _R,
          "function tools {type: function, name, description, parameters, strict}", _RS),
    Field("tool_choice", {"anyOf": [{"enum": ["none", "auto", "required"]}, {"type": "object"},
                                    {"type": "null"}]}, _R, "none | auto | required | {type: function, name}",
          _RS),
    Field("parallel_tool_calls", _nullable(BOOL), _R, "false: tool_choice required makes exactly one call",
          _RS),
    Field("text", _nullable({"type": "object", "properties": {"format": TEXT_FORMAT,
                                                              "verbosity": _nullable({"const": "medium"})}}),
          _R, "format: text, json_object or json_schema {name, schema, strict} (structured output)", _RS),
    Field("stream", _nullable(BOOL), _R, "server-sent events, OpenAI's typed response.* events", _RS),
    Field("stream_options", _nullable({"type": "object", "properties": {
        "include_obfuscation": _nullable(BOOL)}}), _R, "include_obfuscation: no padding is ever added", _RS),
    Field("metadata", _nullable({"type": "object", "maxProperties": 16,
                                 "additionalProperties": STR}), _R, "echoed in the response", _RS),
    *(Field(name, {}, _I, "ignored: cannot change the answer", _RS) for name in (
        "user", "safety_identifier", "prompt_cache_key", "service_tier", "prompt_cache_retention")),
    Field("truncation", _nullable({"const": "disabled"}), _H, "a prompt past the context is a 400", _RS),
    Field("include", _nullable({"type": "array", "maxItems": 0}), _H, "no extra output data", _RS),
    Field("top_logprobs", _nullable({"const": 0}), _H, "no logprobs on this route", _RS),
    Field("reasoning", _nullable({"type": "object", "additionalProperties": {"type": "null"}}), _H,
          "effort and summary are not supported (a template's <think> block is a reasoning item)", _RS),
    Field("background", _nullable(FALSE), _H, "no background responses", _RS),
    Field("max_tool_calls", {"type": "null"}, _H, "not supported", _RS),
    Field("conversation", {"type": "null"}, _H, "conversations: use previous_response_id", _RS),
    Field("prompt", {"type": "null"}, _H, "prompt templates: not supported", _RS),
)

FIELDS_BY_ENDPOINT: dict[str, dict[str, Field]] = {
    endpoint: {f.name: f for f in (*FIELDS, *RESPONSES_FIELDS) if endpoint in f.endpoints}
    for endpoint in (CHAT, COMPLETIONS, RESPONSES)
}
REQUIRED_FIELD = {CHAT: "messages", COMPLETIONS: "prompt", RESPONSES: "input"}
ENDPOINTS = tuple(REQUIRED_FIELD)  # the endpoints GET /v1/schema describes


def json_schema(endpoint: str) -> dict:
    """The JSON Schema (draft 2020-12) of the request bodies ``endpoint`` accepts."""
    fields = FIELDS_BY_ENDPOINT[endpoint]
    properties = {}
    for name, f in fields.items():
        properties[name] = {**f.schema, "description": f"{f.doc} [{f.fate.value}]"}
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object",
            "required": [REQUIRED_FIELD[endpoint]], "properties": properties,
            "additionalProperties": endpoint != RESPONSES}


# ---- the validator: the subset of JSON Schema the table uses ----

_TYPE_NAMES = {"integer": "an integer", "number": "a number", "boolean": "a boolean", "string": "a string",
               "array": "an array", "object": "an object", "null": "null"}


def _is_type(value, name: str) -> bool:
    if name == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if name == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if name == "boolean":
        return isinstance(value, bool)
    if name == "string":
        return isinstance(value, str)
    if name == "array":
        return isinstance(value, list)
    if name == "object":
        return isinstance(value, dict)
    return value is None


def describe(schema: dict) -> str:
    """A schema in words, for error messages."""
    if "anyOf" in schema:
        return " or ".join(describe(s) for s in schema["anyOf"])
    if "const" in schema:
        return repr(schema["const"]) if not isinstance(schema["const"], bool) else str(schema["const"]).lower()
    if "enum" in schema:
        return "one of " + ", ".join(repr(v) for v in schema["enum"])
    if schema.get("maxItems") == 0 or schema.get("maxProperties") == 0:
        return "empty"
    text = _TYPE_NAMES.get(schema.get("type"), "any value")
    bounds = []
    if "minimum" in schema:
        bounds.append(f">= {schema['minimum']}")
    if "exclusiveMinimum" in schema:
        bounds.append(f"> {schema['exclusiveMinimum']}")
    if "maximum" in schema:
        bounds.append(f"<= {schema['maximum']}")
    if bounds:
        text += " " + " and ".join(bounds)
    if "items" in schema:
        item = describe(schema["items"]).removeprefix("an ").removeprefix("a ")
        words = item.split(" ", 1)
        text += f" of {words[0]}s" + (f" {words[1]}" if len(words) > 1 else "")
    if schema.get("minItems"):
        text = "a non-empty " + text.removeprefix("an ").removeprefix("a ")
    return text


def compile_schema(schema: dict):
    """A predicate ``value -> bool`` for ``schema`` (the subset above), built once per field:
    each call is a few closures deep, one pass over the value (linear time)."""
    if "anyOf" in schema:
        options = tuple(compile_schema(s) for s in schema["anyOf"])
        if len(options) == 2:
            first, second = options
            return lambda v: first(v) or second(v)
        return lambda v: any(o(v) for o in options)
    if "const" in schema:
        const = schema["const"]
        if isinstance(const, bool):
            return lambda v: v is const
        return lambda v: _is_type(v, "number") and v == const if _is_type(const, "number") else v == const
    if "enum" in schema:
        allowed = frozenset(schema["enum"])
        return lambda v: isinstance(v, str) and v in allowed
    kind = schema.get("type")
    if kind == "null":
        return lambda v: v is None
    if kind == "boolean":
        return lambda v: v is True or v is False
    if kind == "string":
        return lambda v: isinstance(v, str)
    if kind in ("integer", "number"):
        low = schema.get("minimum", float("-inf"))
        low_exclusive = schema.get("exclusiveMinimum")
        high = schema.get("maximum", float("inf"))
        types = int if kind == "integer" else (int, float)

        def number(v) -> bool:
            if not isinstance(v, types) or v is True or v is False or v != v:  # NaN fails v == v
                return False
            return low <= v <= high and (low_exclusive is None or v > low_exclusive)
        return number
    if kind == "array":
        min_items, max_items = schema.get("minItems", 0), schema.get("maxItems")
        item = compile_schema(schema["items"]) if "items" in schema else None

        def array(v) -> bool:
            if not isinstance(v, list) or len(v) < min_items or (max_items is not None and len(v) > max_items):
                return False
            return item is None or all(item(x) for x in v)
        return array
    if kind == "object":
        properties = {name: compile_schema(s) for name, s in schema.get("properties", {}).items()}
        required = tuple(schema.get("required", ()))
        max_properties = schema.get("maxProperties")
        extra = compile_schema(schema["additionalProperties"]) if isinstance(
            schema.get("additionalProperties"), dict) else None

        def obj(v) -> bool:
            if not isinstance(v, dict) or (max_properties is not None and len(v) > max_properties):
                return False
            if any(name not in v for name in required):
                return False
            if any(name in v and not p(v[name]) for name, p in properties.items()):
                return False
            return extra is None or all(extra(x) for k, x in v.items() if k not in properties)
        return obj
    return lambda v: True


def matches(value, schema: dict) -> bool:
    """True when ``value`` is valid under ``schema`` (compiles it: for tests and one-off checks)."""
    return compile_schema(schema)(value)


_CHECKS = {id(f): compile_schema(f.schema) for f in (*FIELDS, *RESPONSES_FIELDS)}


def check(value, f: Field):
    """``value`` if the field's schema accepts it, else a 400 naming the field."""
    if not _CHECKS[id(f)](value):
        if f.fate is Fate.HARMLESS:
            raise bad_request(f"{f.name} is not supported ({f.doc}): it must be {describe(f.schema)}, "
                              f"got {_short(value)}", f.name)
        raise bad_request(f"{f.name} must be {describe(f.schema)}, got {_short(value)}", f.name)
    return value


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
