"""Fetch pinned test data into a cache directory (placeholder; filled by the tokenizer work)."""
import sys
from pathlib import Path

Path(sys.argv[1]).mkdir(parents=True, exist_ok=True)
