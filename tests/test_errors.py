"""Typed errors: every engine exception maps to one HTTP status, code and param (webapp/errors.py)."""
import pytest

from engine.config import EngineConfig
from engine.errors import (
    ContextLengthError,
    EngineDead,
    EngineError,
    EngineOverloaded,
    InvalidParameterError,
)
from engine.params import SamplingParams
from webapp.errors import APIError, from_exception


@pytest.mark.parametrize("exc, status, code, param", [
    (ContextLengthError("too long", "max_tokens"), 400, "context_length_exceeded", "max_tokens"),
    (ContextLengthError("too long", "prompt"), 400, "context_length_exceeded", "prompt"),
    (InvalidParameterError("bad", "top_p"), 400, None, "top_p"),
    (ValueError("bad"), 400, None, None),
    (EngineOverloaded("full"), 429, "rate_limit_exceeded", None),
    (EngineDead("gone"), 503, "engine_dead", None),
    (EngineError("failed"), 500, "engine_error", None),
    (KeyError("x"), 500, "internal_error", None),
])
def test_each_exception_type_has_one_status(exc, status, code, param):
    err = from_exception(exc)
    assert (err.status, err.code, err.param) == (status, code, param)
    body = err.to_dict()["error"]
    assert body["param"] == param and body["code"] == code and body["message"]


def test_api_errors_pass_through_and_overload_says_when_to_retry():
    err = APIError(418, "teapot")
    assert from_exception(err) is err
    assert "Retry-After" in from_exception(EngineOverloaded("full")).headers


@pytest.mark.parametrize("field, value", [
    ("max_tokens", 0), ("temperature", -1), ("top_p", 0), ("top_k", -2), ("seed", 1 << 64), ("seed", "1"),
    ("stop", [1]), ("stop_token_ids", [-1]), ("logprobs", 1), ("top_logprobs", 21), ("prompt_logprobs", -1),
    ("min_tokens", -1),
])
def test_sampling_params_errors_carry_the_field(field, value):
    with pytest.raises(InvalidParameterError) as info:
        SamplingParams(**{field: value})
    assert info.value.param == field and isinstance(info.value, ValueError)


def test_sampling_params_is_not_mutated_by_the_engine_defaults():
    params = SamplingParams(max_tokens=None)
    assert params.max_tokens is None  # "the rest of the context", filled in per request by a copy


@pytest.mark.parametrize("options, param", [
    ({"max_num_seqs": 0}, "max_num_seqs"), ({"max_num_seqs": 8, "max_num_batched_tokens": 4}, "max_num_batched_tokens"),
    ({"block_size": True}, "block_size"), ({"kv_cache_tokens": -5}, "kv_cache_tokens"),
    ({"dtype": "float16"}, "dtype"), ({"quantization": "int3"}, "quantization"), ({"num_threads": 0}, "num_threads"),
    ({"target_tick_seconds": 0}, "target_tick_seconds"), ({"max_batch": 3}, "max_batch"),
])
def test_engine_config_is_validated_once_with_the_field(options, param):
    with pytest.raises(InvalidParameterError) as info:
        EngineConfig.from_options(options)
    assert info.value.param == param


def test_load_options_belong_to_from_pretrained():
    with pytest.raises(InvalidParameterError, match="from_pretrained"):
        EngineConfig.from_options({"dtype": "bfloat16"}, allow_load=False)


def test_resolve_fills_model_defaults_and_fits_the_context_in_the_cache():
    cfg = EngineConfig().resolve(4096)
    assert cfg.max_model_len == 4096 and cfg.kv_cache_tokens == 16384 and cfg.num_blocks == 16384 // 16
    small = EngineConfig(kv_cache_tokens=500).resolve(4096)
    # A cache smaller than one context lowers max_model_len to what it holds (whole blocks).
    assert small.kv_cache_tokens == 512 and small.max_model_len == 512
    assert EngineConfig(max_model_len=100).resolve(None).max_model_len == 100
