"""EngineConfig: every engine option in one dataclass, validated once in ``__post_init__``.

``Engine(model, tokenizer, **options)``, ``Engine.from_pretrained(model, **options)``, the
command lines (``python -m engine``, ``python -m webapp``: ``add_engine_arguments``) and the
server all derive from these fields; nothing else lists or validates an engine option.

Options marked ``load`` (dtype, quantization, num_threads) choose how weights are loaded and
run, so only ``from_pretrained`` takes them. ``resolve(model_max_len)`` fills the options whose
default depends on the model (max_model_len, kv_cache_tokens).
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import math
from dataclasses import dataclass, field

from .core.tick_cost import DEFAULT_TARGET_TICK_SECONDS
from .errors import InvalidParameterError

log = logging.getLogger("engine")

# The vocabularies of the load options, declared here once (the loaders and the command lines
# read them from here). Activation dtypes:
DTYPES = ("float32", "bfloat16")
# Weight formats (engine.loader.resolve_options): "auto" keeps a GGUF file's quantized layers
# quantized (Q4 -> int4, Q5 -> int5, others int8), "int4" makes every projection int4,
# "bfloat16" / "float32" load everything dense in that dtype.
QUANTIZATIONS = ("auto", "int4", "bfloat16", "float32")
# The integer codes quantized products (weights packed in strips: AVX2 and up) round activations
# to: int16 (relative error < 2^-15, near float32) or int8 (llama.cpp's precision; with AVX-512 VNNI
# twice the multiply-adds per instruction: ~1.6x the products of several rows, prompts and
# verification; on AVX2 too for Q4 and Q5 strips, by vpmaddubsw).
ACTIVATIONS = ("int16", "int8")
POOLINGS = ("mean", "cls", "last", "max")  # embeddings (engine/embedding/pooling.py)
# With no max_model_len anywhere (a model that states none), cap the context here.
FALLBACK_MAX_MODEL_LEN = 32768
MIN_KV_CACHE_TOKENS = 16384
# Speculative decoding (engine/core/speculative.py): the contract's methods; "auto" is the draft
# model when one is given, else prompt lookup (EngineConfig.speculative_method).
SPECULATIVE = ("ngram", "draft", "auto")
MAX_NUM_SPECULATIVE_TOKENS = 16
DEFAULT_PREFIX_CACHE_DISK_BYTES = 8 << 30


def _option(default, help: str, *, load: bool = False, cli: bool = True):
    return field(default=default, metadata={"help": help, "load": load, "cli": cli})


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    # -- how the model is loaded (Engine.from_pretrained only) --
    dtype: str | None = _option(None, "compute dtype: float32 | bfloat16 (default: the quantization's)", load=True)
    quantization: str = _option("auto", "weights: auto (keep GGUF quantization) | int4 | bfloat16 | float32",
                                load=True)
    num_threads: int | None = _option(None, "compute threads (default: the engine's measured policy)", load=True)
    activations: str = _option("int16", "activation codes of quantized products: int16 (near float32) | int8 "
                               "(llama.cpp's precision; faster prompts and batches with AVX-512 VNNI)", load=True)
    # -- the scheduler and the KV cache --
    max_model_len: int | None = _option(None, "longest prompt + completion in tokens (default: the model's)")
    max_num_seqs: int = _option(64, "most sequences decoded in one tick")
    max_num_batched_tokens: int = _option(256, "token budget of one scheduler tick")
    kv_cache_tokens: int | None = _option(None, "KV cache size in tokens (default: max(2 x max_model_len, 16384))")
    block_size: int = _option(16, "tokens per KV cache block")
    enable_prefix_caching: bool = _option(True, "reuse the KV blocks of shared prompt prefixes", cli=False)
    allow_overcommit: bool = _option(
        False, "start even when the KV cache and the weights exceed the memory this process may use "
        "(cgroup limit, MemAvailable); without it such a start is refused")
    max_waiting: int = _option(1024, "most requests waiting for a slot; beyond it submit raises EngineOverloaded")
    pooling: str | None = _option(None, "embedding pooling: mean | cls | last | max (default: the model's "
                                  "sentence-transformers Pooling; last for a decoder)")
    target_tick_seconds: float | None = _option(
        DEFAULT_TARGET_TICK_SECONDS, "prefill paced so a tick takes about this long while streams decode "
        "(None: always fill max_num_batched_tokens)", cli=False)
    # -- the prefix cache's disk tier (engine/core/prefix_disk.py) --
    prefix_cache_dir: str | None = _option(
        None, "keep full KV blocks of prompts in this directory across restarts (command lines: the user "
        "cache dir's llm-engine/prefix unless LLM_ENGINE_PREFIX_CACHE_DIR says otherwise; 'off': none)")
    prefix_cache_disk_bytes: int = _option(DEFAULT_PREFIX_CACHE_DISK_BYTES,
                                           "most bytes the prefix cache directory holds (LRU eviction)")
    # -- speculative decoding --
    speculative: str | None = _option("auto", "speculative decoding: auto (the default: draft when "
                                      "--draft-model is given, else ngram), ngram (prompt lookup), draft (a "
                                      "draft model, --draft-model) or off (None in Python)")
    num_speculative_tokens: int = _option(4, f"most ids proposed per step (1-{MAX_NUM_SPECULATIVE_TOKENS})")
    draft_model: str | None = _option(None, "draft model path for speculative=draft (a .gguf file or HF "
                                      "directory with the model's tokenizer)")

    @property
    def speculative_method(self) -> str | None:
        """The proposer speculative decoding runs: None, "ngram" or "draft" ("auto" resolved)."""
        if self.speculative == "auto":
            return "draft" if self.draft_model is not None else "ngram"
        return self.speculative

    def __post_init__(self) -> None:
        if self.dtype is not None and self.dtype not in DTYPES:
            raise InvalidParameterError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}", "dtype")
        if self.quantization not in QUANTIZATIONS:
            raise InvalidParameterError(
                f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}", "quantization")
        if self.activations not in ACTIVATIONS:
            raise InvalidParameterError(
                f"activations must be one of {', '.join(ACTIVATIONS)}, got {self.activations!r}", "activations")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_waiting",
                     "prefix_cache_disk_bytes"):
            _check_positive_int(name, getattr(self, name))
        for name in ("num_threads", "max_model_len", "kv_cache_tokens"):
            if getattr(self, name) is not None:
                _check_positive_int(name, getattr(self, name))
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise InvalidParameterError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}) so every running decode fits in one tick", "max_num_batched_tokens")
        if not isinstance(self.allow_overcommit, bool):
            raise InvalidParameterError(
                f"allow_overcommit must be a boolean, got {self.allow_overcommit!r}", "allow_overcommit")
        if not isinstance(self.enable_prefix_caching, bool):
            raise InvalidParameterError(
                f"enable_prefix_caching must be a boolean, got {self.enable_prefix_caching!r}", "enable_prefix_caching")
        if self.prefix_cache_dir is not None and (not isinstance(self.prefix_cache_dir, str)
                                                  or not self.prefix_cache_dir):
            raise InvalidParameterError(
                f"prefix_cache_dir must be None or a directory path, got {self.prefix_cache_dir!r}",
                "prefix_cache_dir")
        if self.speculative is not None and self.speculative not in SPECULATIVE:
            raise InvalidParameterError(
                f"speculative must be None or one of {', '.join(SPECULATIVE)}, got {self.speculative!r}",
                "speculative")
        if self.speculative == "draft" and self.draft_model is None:
            raise InvalidParameterError("speculative='draft' needs draft_model (a model path)", "draft_model")
        if self.draft_model is not None and self.speculative not in ("draft", "auto"):
            raise InvalidParameterError(
                f"draft_model is used only with speculative='draft' or 'auto', got "
                f"speculative={self.speculative!r}", "draft_model")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_NUM_SPECULATIVE_TOKENS:
            raise InvalidParameterError(
                f"num_speculative_tokens must be an integer in [1, {MAX_NUM_SPECULATIVE_TOKENS}], got {k!r}",
                "num_speculative_tokens")
        if self.pooling is not None and self.pooling not in POOLINGS:
            raise InvalidParameterError(f"pooling must be one of {', '.join(POOLINGS)}, got {self.pooling!r}",
                                        "pooling")
        tick = self.target_tick_seconds
        if tick is not None and (isinstance(tick, bool) or not isinstance(tick, (int, float)) or not tick > 0):
            raise InvalidParameterError(f"target_tick_seconds must be None or a number > 0, got {tick!r}",
                                        "target_tick_seconds")

    # -- construction --
    @classmethod
    def from_options(cls, options: dict, *, allow_load: bool = True) -> EngineConfig:
        """From keyword options; unknown names (or load options where they do not apply) raise."""
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise InvalidParameterError(
                f"unknown engine option(s): {', '.join(unknown)}; known: {', '.join(known)}", unknown[0])
        if not allow_load:
            load = sorted(name for name in options if known[name].metadata["load"])
            if load:
                raise InvalidParameterError(
                    f"{', '.join(load)}: load options go to Engine.from_pretrained, not Engine(model, tokenizer)",
                    load[0])
        return cls(**options)

    @property
    def load_options(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.metadata["load"]}

    def resolve(self, model_max_len: int | None) -> EngineConfig:
        """The concrete config for a model: max_model_len and kv_cache_tokens filled in.

        A KV cache that cannot hold one max_model_len sequence lowers max_model_len to what it
        holds (logged), so no admitted request can run out of cache for lack of room."""
        max_model_len = self.max_model_len or model_max_len or FALLBACK_MAX_MODEL_LEN
        kv_tokens = self.kv_cache_tokens or max(2 * max_model_len, MIN_KV_CACHE_TOKENS)
        kv_tokens = math.ceil(kv_tokens / self.block_size) * self.block_size
        if kv_tokens < max_model_len:
            log.warning("kv_cache_tokens=%d holds less than max_model_len=%d: max_model_len lowered to %d",
                        kv_tokens, max_model_len, kv_tokens)
            max_model_len = kv_tokens
        return dataclasses.replace(self, max_model_len=max_model_len, kv_cache_tokens=kv_tokens)

    @property
    def num_blocks(self) -> int:
        if self.kv_cache_tokens is None:
            raise RuntimeError("EngineConfig.num_blocks needs a resolved config (resolve())")
        return self.kv_cache_tokens // self.block_size


def _check_positive_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InvalidParameterError(f"{name} must be a positive integer, got {value!r}", name)


# ---------------------------------------------------------------- command lines

def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """One ``--flag`` per EngineConfig field (``--max-num-seqs`` ...), default None (= the field's)."""
    group = parser.add_argument_group("engine options")
    for f in dataclasses.fields(EngineConfig):
        if not f.metadata["cli"]:
            continue
        flag = "--" + f.name.replace("_", "-")
        if f.type in (bool, "bool"):
            group.add_argument(flag, dest=f.name, action="store_true", default=None, help=f.metadata["help"])
            continue
        kind = str if f.name in ("dtype", "quantization", "activations", "speculative", "draft_model", "pooling",
                                 "prefix_cache_dir") else int
        choices = {"dtype": DTYPES, "quantization": QUANTIZATIONS, "activations": ACTIVATIONS,
                   "speculative": (*SPECULATIVE, "off"), "pooling": POOLINGS}.get(f.name)
        group.add_argument(flag, dest=f.name, type=kind, choices=choices, default=None, help=f.metadata["help"])


def engine_options_from_args(args: argparse.Namespace) -> dict:
    """The options given on the command line (flags left out keep the EngineConfig defaults, except
    ``prefix_cache_dir``: a command line keeps prompts on disk by default, default_prefix_cache_dir)."""
    from .core.prefix_disk import default_prefix_cache_dir

    options = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)
               if f.metadata["cli"] and getattr(args, f.name, None) is not None}
    if options.get("speculative") == "off":
        options["speculative"] = None
    cache_dir = options.pop("prefix_cache_dir", None)
    if cache_dir is None:
        cache_dir = default_prefix_cache_dir()
    elif cache_dir.strip().lower() in ("", "off", "none"):
        cache_dir = None
    if cache_dir is not None:
        options["prefix_cache_dir"] = cache_dir
    return options


__all__ = ["DTYPES", "QUANTIZATIONS", "EngineConfig", "add_engine_arguments", "engine_options_from_args"]
