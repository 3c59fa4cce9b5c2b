"""Structured-output request fields -> the one SamplingParams constraint.

The spellings the server accepts (each becomes exactly one of SamplingParams' ``json_schema``,
``regex``, ``choice``, ``grammar``; engine.structured compiles it):

    response_format  {"type": "text"}                                    no constraint (OpenAI)
                     {"type": "json_object"}                             any JSON object
                     {"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}
    guided_json      a JSON Schema (object, or its JSON text)             (vLLM, older)
    guided_regex     a regex the whole output matches
    guided_choice    a list of strings; the output is one of them
    guided_grammar   a Lark or GBNF grammar
    structured_outputs  {"json" | "regex" | "choice" | "grammar" | "json_object": true}   (vLLM, newer)

More than one constraint in a request is a 400 naming the second field. Errors found later
(the schema does not compile) name the field the client used (``ParsedRequest.constraint_param``).
"""
from __future__ import annotations

import json

from .errors import bad_request

ANY_JSON_OBJECT = {"type": "object"}
STRUCTURED_OUTPUTS_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                           "json_object": "json_schema"}
# vLLM options of structured_outputs we do not implement: accepted only when they change nothing.
STRUCTURED_OUTPUTS_INERT = {"disable_fallback": False, "disable_any_whitespace": False,
                            "disable_additional_properties": False, "whitespace_pattern": None,
                            "structural_tag": None}
GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}


def _schema(value, param: str) -> dict:
    """A JSON Schema given as an object or as its JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise bad_request(f"{param} is not valid JSON: {e}", param) from None
    if not isinstance(value, dict):
        raise bad_request(f"{param} must be a JSON Schema object, got {type(value).__name__}", param)
    return value


def _response_format(value) -> tuple[str, object] | None:
    if not isinstance(value, dict):
        raise bad_request(f"response_format must be an object like {{\"type\": \"json_object\"}}, got "
                          f"{type(value).__name__}", "response_format")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return "json_schema", ANY_JSON_OBJECT
    if kind != "json_schema":
        raise bad_request(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                          "response_format")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request("response_format.json_schema must be an object with name and schema",
                          "response_format.json_schema")
    name = spec.get("name")
    if name is not None and not isinstance(name, str):
        raise bad_request("response_format.json_schema.name must be a string", "response_format.json_schema.name")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad_request("response_format.json_schema.strict must be a boolean",
                          "response_format.json_schema.strict")
    schema = spec.get("schema")
    if schema is None:
        return "json_schema", ANY_JSON_OBJECT  # OpenAI: schema is optional
    return "json_schema", _schema(schema, "response_format.json_schema.schema")


def _structured_outputs(value) -> list[tuple[str, str, object]]:
    if not isinstance(value, dict):
        raise bad_request(f"structured_outputs must be an object like {{\"regex\": \"...\"}}, got "
                          f"{type(value).__name__}", "structured_outputs")
    found = []
    for key, item in value.items():
        param = f"structured_outputs.{key}"
        if key in STRUCTURED_OUTPUTS_INERT:
            if item is not None and item != STRUCTURED_OUTPUTS_INERT[key]:
                raise bad_request(f"{param} is not supported", param)
            continue
        if key not in STRUCTURED_OUTPUTS_KEYS:
            raise bad_request(f"{param} is not a structured_outputs option (json, regex, choice, grammar, "
                              "json_object)", param)
        if item is None or (key == "json_object" and item is False):
            continue
        if key == "json_object":
            if item is not True:
                raise bad_request(f"{param} must be a boolean", param)
            item = ANY_JSON_OBJECT
        elif key == "json":
            item = _schema(item, param)
        found.append((param, STRUCTURED_OUTPUTS_KEYS[key], item))
    return found


def constraint(values: dict) -> tuple[str, str, object] | None:
    """(the client's field, the SamplingParams field, its value) of the request's one constraint, or None.
    ``values``: the request's known, non-null fields (already type-checked by request_fields)."""
    found: list[tuple[str, str, object]] = []
    if "response_format" in values:
        got = _response_format(values["response_format"])
        if got is not None:
            found.append(("response_format", *got))
    for name, target in GUIDED.items():
        if name in values:
            value = values[name]
            found.append((name, target, _schema(value, name) if target == "json_schema" else value))
    if "structured_outputs" in values:
        found.extend(_structured_outputs(values["structured_outputs"]))
    if len(found) > 1:
        raise bad_request(f"only one structured-output constraint may be set, got {found[0][0]} and {found[1][0]}",
                          found[1][0])
    return found[0] if found else None


__all__ = ["constraint"]
