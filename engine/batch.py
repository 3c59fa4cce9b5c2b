"""The model interface: one flat batch of mixed prefill and decode rows per tick.

A tick packs the query tokens of B sequences back to back into T rows. Sequence b owns
rows ``query_starts[b]:query_starts[b+1]``; its KV length after this tick is
``context_lens[b]`` (its cached tokens plus its new rows). Every new row writes its K/V
to the flat cache slot ``slot_mapping[t]`` (= block_id * block_size + offset), and
attends to the first ``positions[t] + 1`` tokens of its sequence, read through
``block_tables[b]`` (block ids, padded with -1).

A model object implements:

    vocab_size: int
    def make_kv_cache(self, num_blocks: int, block_size: int) -> object
    def forward(self, batch: ForwardBatch, kv_cache: object) -> torch.Tensor
        # -> logits [len(batch.logit_rows), vocab_size] float32, in logit_rows order

``engine.testing.ScriptedModel`` is the same interface with no compute.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, position of each row within its sequence
    slot_mapping: torch.Tensor  # [T] int64, flat KV slot each row writes
    query_starts: torch.Tensor  # [B+1] int64, row offsets (cu_seqlens)
    context_lens: torch.Tensor  # [B] int64, KV length of each sequence after this tick
    block_tables: torch.Tensor  # [B, max_blocks] int64, block ids, -1 padded
    logit_rows: torch.Tensor  # [S] int64, rows whose logits forward() returns
    prompt_lens: torch.Tensor  # [B] int64, original prompt length of each sequence
    # Host-side copies for Python loops (no tensor.item() on the hot path).
    query_starts_list: list[int]
    context_lens_list: list[int]
    num_decode_seqs: int = 0  # sequences 0..num_decode_seqs-1 have exactly one row each
    block_size: int = 16

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens_list)

    @property
    def num_tokens(self) -> int:
        return self.query_starts_list[-1]


def single_sequence_batch(
    token_ids: list[int], start_pos: int, block_table: list[int], block_size: int, logit_rows: str = "last"
) -> ForwardBatch:
    """A batch for one sequence whose tokens occupy consecutive positions from start_pos.

    Used by the raw model loop (benchmarks/decode.py) and tests; the engine builds
    batches in the scheduler tick instead.
    """
    n = len(token_ids)
    positions = torch.arange(start_pos, start_pos + n, dtype=torch.int64)
    table = torch.tensor(block_table, dtype=torch.int64)
    slots = table[positions // block_size] * block_size + positions % block_size
    rows = torch.arange(n, dtype=torch.int64) if logit_rows == "all" else torch.tensor([n - 1], dtype=torch.int64)
    return ForwardBatch(
        input_ids=torch.tensor(token_ids, dtype=torch.int64),
        positions=positions,
        slot_mapping=slots,
        query_starts=torch.tensor([0, n], dtype=torch.int64),
        context_lens=torch.tensor([start_pos + n], dtype=torch.int64),
        block_tables=table.unsqueeze(0),
        logit_rows=rows,
        prompt_lens=torch.tensor([start_pos + n], dtype=torch.int64),
        query_starts_list=[0, n],
        context_lens_list=[start_pos + n],
        num_decode_seqs=1 if n == 1 else 0,
        block_size=block_size,
    )
