"""Model implementations behind the interface of ``engine.batch``."""
from engine.models.attention import PagedKVCache
from engine.models.llama import DTYPES, LlamaModel, resolve_dtype

__all__ = ["DTYPES", "LlamaModel", "PagedKVCache", "resolve_dtype"]
