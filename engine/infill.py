"""Fill-in-the-middle: the prompt of a code completion between a prefix and a suffix.

    ids, params = prepare_infill(tokenizer, prefix, suffix, params, extra_files=None)

The model's FIM tokens (``Tokenizer.fim_token_ids``: the GGUF header's ``tokenizer.ggml.fim_*``
ids, else the texts llama.cpp recognises, e.g. Qwen2.5-Coder's ``<|fim_prefix|>``) frame the
prompt in prefix-suffix-middle order, as llama.cpp renders it:

    extra_files None (Engine.infill, /v1/completions' suffix; llama-cpp-python's Llama(suffix=)):
        [BOS] <PRE> prefix <SUF> suffix <MID>
    extra_files a list (llama.cpp's /infill, repo-level context, arXiv 2409.12186):
        <REP>myproject\\n  (<SEP>filename\\n text)...  <SEP>filename\\n  [BOS] <PRE> prefix <SUF> suffix <MID>
        (without a file separator token each file is "\\n\\n--- snippet ---\\n\\n" + text)

Unlike llama.cpp nothing is cut to fit a batch: a prompt past the context is a context-length
error, as any other. Generation stops at EOS and at the FIM pad, repo and file-separator tokens.
A model without prefix, suffix and middle tokens raises InvalidParameterError naming ``suffix``.
"""
from __future__ import annotations

import dataclasses

from .errors import InvalidParameterError
from .params import SamplingParams

REQUIRED_ROLES = ("pre", "suf", "mid")
END_ROLES = ("pad", "rep", "sep")
REPO_NAME = "myproject"  # llama.cpp's placeholder project and file names
CURRENT_FILE = "filename"
SNIPPET_SEPARATOR = "\n\n--- snippet ---\n\n"
MAX_EXTRA_FILES = 1024


def fim_tokens(tokenizer) -> dict[str, int]:
    """The tokenizer's FIM token ids by role; InvalidParameterError naming ``suffix`` if it has none."""
    found = getattr(tokenizer, "fim_token_ids", None) or {}
    missing = [role for role in REQUIRED_ROLES if role not in found]
    if missing:
        raise InvalidParameterError(
            "suffix (fill-in-the-middle) is not supported by this model: its vocabulary has no "
            f"{'/'.join(missing)} FIM token", "suffix")
    return found


def _encode(tokenizer, text, param: str) -> list[int]:
    if isinstance(text, str):
        return tokenizer.encode(text, add_special_tokens=False)
    if isinstance(text, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in text):
        return list(text)
    raise InvalidParameterError(f"{param} must be a string or a list of token ids", param)


def _extra_ids(tokenizer, fim: dict[str, int], extra_files) -> list[int]:
    """llama.cpp's repo-level context: the project, each file with its name, then the current file."""
    if not isinstance(extra_files, (list, tuple)):
        raise InvalidParameterError("extra_files must be a list of {filename, text} objects", "extra_files")
    if len(extra_files) > MAX_EXTRA_FILES:
        raise InvalidParameterError(f"extra_files holds {len(extra_files)} files; at most {MAX_EXTRA_FILES}",
                                    "extra_files")
    ids: list[int] = []
    if "rep" in fim:
        ids += [fim["rep"], *tokenizer.encode(REPO_NAME + "\n", add_special_tokens=False)]
    for i, item in enumerate(extra_files):
        where = f"extra_files[{i}]"
        if not isinstance(item, dict):
            raise InvalidParameterError(f"{where} must be an object with filename and text", where)
        text, filename = item.get("text", ""), item.get("filename", "tmp")
        for name, value in (("text", text), ("filename", filename)):
            if not isinstance(value, str):
                raise InvalidParameterError(f"{where}.{name} must be a string", f"{where}.{name}")
        if "sep" in fim:
            ids += [fim["sep"], *tokenizer.encode(filename + "\n", add_special_tokens=False)]
        else:
            ids += tokenizer.encode(SNIPPET_SEPARATOR, add_special_tokens=False)
        ids += tokenizer.encode(text, add_special_tokens=False)
    if "sep" in fim:
        ids += [fim["sep"], *tokenizer.encode(CURRENT_FILE + "\n", add_special_tokens=False)]
    return ids


def infill_prompt_ids(tokenizer, prefix, suffix, extra_files=None) -> list[int]:
    """The FIM prompt (see the module's docstring). ``prefix`` / ``suffix``: text or token ids."""
    fim = fim_tokens(tokenizer)
    bos = [tokenizer.bos_token_id] if tokenizer.add_bos else []
    extra = [] if extra_files is None else _extra_ids(tokenizer, fim, extra_files)
    return [*extra, *bos, fim["pre"], *_encode(tokenizer, prefix, "prompt"), fim["suf"],
            *_encode(tokenizer, suffix, "suffix"), fim["mid"]]


def infill_params(tokenizer, params: SamplingParams | None) -> SamplingParams:
    """``params`` that also stop at the FIM end tokens the tokenizer's EOS ids do not hold already."""
    params = params if params is not None else SamplingParams()
    fim = fim_tokens(tokenizer)
    ends = [fim[role] for role in END_ROLES if role in fim and fim[role] not in tokenizer.eos_token_ids]
    missing = [i for i in ends if i not in params.stop_token_ids]
    if not missing:
        return params
    return dataclasses.replace(params, stop_token_ids=(*params.stop_token_ids, *missing))


def prepare_infill(tokenizer, prefix, suffix, params: SamplingParams | None = None,
                   extra_files=None) -> tuple[list[int], SamplingParams]:
    """(prompt ids, params) of a fill-in-the-middle request: the one infill path."""
    return infill_prompt_ids(tokenizer, prefix, suffix, extra_files), infill_params(tokenizer, params)
