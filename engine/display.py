"""How an Engine and a Completion show themselves: plain text (IPython's pretty printer, repr)
and HTML (Jupyter's ``_repr_html_``). Reads public attributes only."""
from __future__ import annotations

import html
import os

MAX_SHORT_TEXT = 60


def short_text(text: str, limit: int = MAX_SHORT_TEXT) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def format_bytes(num_bytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if num_bytes < 1024 or unit == "GiB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    raise AssertionError("unreachable")


# ---------------------------------------------------------------- Completion

def _completion_rows(completion, show_ids: bool) -> list[tuple[str, str]]:
    usage = completion.usage
    rows = [
        ("finish_reason", str(completion.finish_reason)),
        ("usage", f"{usage.prompt_tokens} prompt + {usage.completion_tokens} completion tokens"),
        ("request_id", completion.request_id),
    ]
    calls = getattr(completion, "tool_calls", None) or ()
    rows[:0] = [("tool call", f"{call.name}({call.arguments})  id={call.id}") for call in calls]
    reasoning = getattr(completion, "reasoning_content", None)
    if reasoning is not None:
        rows.insert(0, ("reasoning_content", repr(reasoning)))
    if show_ids:
        rows.append(("prompt_token_ids", str(completion.prompt_token_ids)))
        rows.append(("token_ids", str(completion.token_ids)))
    return rows


def describe_completion(completion, show_ids: bool = False) -> str:
    lines = ["Completion", f"  text: {completion.text!r}"]
    lines += [f"  {name}: {value}" for name, value in _completion_rows(completion, show_ids)]
    return "\n".join(lines)


def completion_html(completion, show_ids: bool = False) -> str:
    rows = "".join(f"<tr><th style='text-align:left'>{html.escape(name)}</th>"
                   f"<td style='text-align:left'>{html.escape(value)}</td></tr>"
                   for name, value in _completion_rows(completion, show_ids))
    return (f"<div><pre style='white-space:pre-wrap'>{html.escape(completion.text)}</pre>"
            f"<table>{rows}</table></div>")


# ---------------------------------------------------------------- Engine

def _tensor_bytes(obj) -> int:
    """Bytes of the distinct tensor storages an object reaches (a torch module's parameters,
    buffers and tensor attributes, or an object's tensor attributes)."""
    import torch

    seen: set[int] = set()
    total = 0

    def add(tensor) -> None:
        nonlocal total
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()

    modules = list(obj.modules()) if isinstance(obj, torch.nn.Module) else [obj]
    for module in modules:
        for value in vars(module).values():
            if isinstance(value, torch.Tensor):
                add(value)
            elif isinstance(value, dict):  # nn.Module keeps parameters and buffers in dicts
                for item in value.values():
                    if isinstance(item, torch.Tensor):
                        add(item)
            elif not isinstance(value, torch.nn.Module) and hasattr(value, "__dict__"):
                for item in vars(value).values():  # a packed-weights holder
                    if isinstance(item, torch.Tensor):
                        add(item)
    return total


def engine_rows(eng) -> list[tuple[str, str]]:
    model = eng.model
    config = eng.config
    stats = eng.stats()
    dtype = getattr(model, "dtype", None)
    kv_cache = eng.kv_cache
    rows = [
        ("model", os.path.basename(os.path.normpath(eng.model_path)).removesuffix(".gguf")
         if eng.model_path else type(model).__name__),
        ("dtype", str(dtype).removeprefix("torch.") if dtype is not None else "-"),
        ("weights memory", format_bytes(_tensor_bytes(model))),
        ("KV cache", f"{config.kv_cache_tokens} tokens, {format_bytes(_tensor_bytes(kv_cache))}"
         if kv_cache is not None else f"{config.kv_cache_tokens} tokens"),
        ("KV usage", f"{100 * stats['kv_usage']:.1f}%"),
        ("requests", f"{stats['num_running']} running, {stats['num_waiting']} waiting"),
        ("max_model_len", str(config.max_model_len)),
        ("state", "running" if eng.is_alive() else "closed"),
    ]
    return rows


def describe_engine(eng) -> str:
    return "Engine\n" + "\n".join(f"  {name}: {value}" for name, value in engine_rows(eng))


def engine_html(eng) -> str:
    rows = "".join(f"<tr><th style='text-align:left'>{html.escape(name)}</th>"
                   f"<td style='text-align:left'>{html.escape(value)}</td></tr>" for name, value in engine_rows(eng))
    return f"<table><caption style='text-align:left'><b>Engine</b></caption>{rows}</table>"
