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

A batch may carry ``logits_out``, a ``LogitsBuffer`` the model may write the logits into
(the engine's, reused tick after tick); a model is free to ignore it.

``engine.testing.ScriptedModel`` is the same interface with no compute.
"""
from __future__ import annotations

import mmap

import numpy as np
import torch

from engine.heap import release_free_heap

_ARRAYS = ("input_ids", "positions", "slot_mapping", "query_starts", "context_lens", "block_tables",
           "logit_rows", "prompt_lens")


def _tensor_field(name: str, doc: str) -> property:
    key = "_" + name

    def get(self) -> torch.Tensor:
        value = getattr(self, key)
        if isinstance(value, np.ndarray):  # the scheduler's arrays: a tensor only when a model reads it
            value = torch.from_numpy(value)
            setattr(self, key, value)
        return value

    def set(self, value) -> None:
        setattr(self, key, value)

    return property(get, set, doc=doc)


class ForwardBatch:
    """The int64 arrays are torch tensors, or numpy arrays made tensors (no copy) when first read,
    so a tick pays only for the tensors its model uses; ``array(name)`` reads one as numpy."""

    __slots__ = tuple("_" + name for name in _ARRAYS) + (
        "query_starts_list", "context_lens_list", "num_decode_seqs", "block_size", "gen_rows", "gen_seqs",
        "generation_end", "logits_out")

    input_ids = _tensor_field("input_ids", "[T] int64")
    positions = _tensor_field("positions", "[T] int64, position of each row within its sequence")
    slot_mapping = _tensor_field("slot_mapping", "[T] int64, flat KV slot each row writes")
    query_starts = _tensor_field("query_starts", "[B+1] int64, row offsets (cu_seqlens)")
    context_lens = _tensor_field("context_lens", "[B] int64, KV length of each sequence after this tick")
    block_tables = _tensor_field("block_tables", "[B, max_blocks] int64, block ids, -1 padded")
    logit_rows = _tensor_field("logit_rows", "[S] int64, rows whose logits forward() returns")
    prompt_lens = _tensor_field("prompt_lens", "[B] int64, original prompt length of each sequence")

    def __init__(self, input_ids, positions, slot_mapping, query_starts, context_lens, block_tables,
                 logit_rows, prompt_lens, query_starts_list: list[int], context_lens_list: list[int],
                 num_decode_seqs: int = 0, block_size: int = 16, gen_rows: int | None = None,
                 gen_seqs: int | None = None, generation_end: int | None = None):
        self._input_ids = input_ids
        self._positions = positions
        self._slot_mapping = slot_mapping
        self._query_starts = query_starts
        self._context_lens = context_lens
        self._block_tables = block_tables
        self._logit_rows = logit_rows
        self._prompt_lens = prompt_lens
        # Host-side copies for Python loops (no tensor.item() on the hot path).
        self.query_starts_list = query_starts_list
        self.context_lens_list = context_lens_list
        self.num_decode_seqs = num_decode_seqs  # sequences 0..num_decode_seqs-1 have exactly one row each
        self.block_size = block_size
        # Rows 0..gen_rows-1 belong to the gen_seqs sequences that decode in this tick (one row
        # each, or 1 + k rows verifying a speculative proposal); then the generation requests'
        # prompt rows up to generation_end (None: every other row); then embedding texts' rows.
        # The products' route per class of rows: route_spans.
        self.gen_rows = num_decode_seqs if gen_rows is None else gen_rows
        self.gen_seqs = num_decode_seqs if gen_seqs is None else gen_seqs
        self.generation_end = generation_end
        self.logits_out: LogitsBuffer | None = None  # where the logits may go (the engine's tick sets it)

    def route_spans(self) -> tuple[tuple[int, int], ...]:
        """(rows, route_rows) per class of rows, for engine.models.linear.row_routes: the decode
        and verification rows take the route of plain decoding's batch (gen_seqs rows); the rows
        after the generation requests' (embedding texts) that of their count. Decode rows beside
        prompt rows take the prompt's route with them: on a route of their own a 256-row chunk's
        tick beside 4 SmolLM2 streams took 1.14x (a second pass over the weights), so a stream's
        numbers may move when a prompt shares its tick (a greedy token only at a near tie)."""
        end = self.num_tokens if self.generation_end is None else self.generation_end
        if end > self.gen_rows:  # prompt rows (with any decode rows)
            return ((end, end),)
        return ((self.gen_rows, self.gen_seqs),) if self.gen_rows else ()

    def array(self, name: str) -> np.ndarray:
        """One of the int64 arrays as numpy (a view, no copy)."""
        value = getattr(self, "_" + name)
        return value if isinstance(value, np.ndarray) else value.numpy()

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens_list)

    @property
    def num_tokens(self) -> int:
        return self.query_starts_list[-1]

    def __repr__(self) -> str:
        return (f"ForwardBatch(num_seqs={self.num_seqs}, num_tokens={self.num_tokens}, "
                f"num_decode_seqs={self.num_decode_seqs}, block_size={self.block_size})")


class LogitsBuffer:
    """The logits of one engine's ticks, in one anonymous memory map reused while the tick's row
    count stays within [capacity / SHRINK_RATIO, capacity].

    A decode tick's logits are a large block (16 rows of Gemma 3's 262,144 ids: 16.8 MB) freed
    as soon as the tick is sampled. Through malloc, glibc placed each tick's block anew while the
    tick's small allocations filled the hole the last one left, so the engine thread's heap grew
    ~23 MB over 64 ticks at a live size that did not move (Gemma 3 270M, 16 streams). Mapped
    apart from the heap, the block is written in place every tick and given back to the OS
    whole when the ticks shrink (a prompt chunk's single row), so a prefill's activations never
    sit beside a decode batch's logits. Blocks under MIN_BYTES come from torch as before.

    The tensor ``take`` returns is valid until the next ``take``: the engine samples a tick's
    logits before it runs the next forward, and nothing keeps them past that.
    """

    MIN_BYTES = 1 << 20
    SHRINK_RATIO = 4

    __slots__ = ("_tensor", "_map", "num_maps")

    def __init__(self):
        self._tensor: torch.Tensor | None = None  # [capacity, V] float32 over _map
        self._map: mmap.mmap | None = None
        self.num_maps = 0  # maps made so far (tests: a steady batch maps once)

    @property
    def capacity(self) -> int:
        """Rows the current map holds (0: none)."""
        return 0 if self._tensor is None else self._tensor.shape[0]

    def take(self, num_rows: int, num_cols: int) -> torch.Tensor | None:
        """A float32 [num_rows, num_cols] view to write this tick's logits into, or None when the
        block is small (the caller allocates it as usual)."""
        if num_rows * num_cols * 4 < self.MIN_BYTES:
            self.release()
            return None
        tensor = self._tensor
        if (tensor is None or tensor.shape[1] != num_cols or num_rows > tensor.shape[0]
                or num_rows * self.SHRINK_RATIO <= tensor.shape[0]):
            self.release()
            # The forward's activations are freed by now (the head is its last product): their
            # heap pages go back before the new map's come in, or both are resident at once
            # (Gemma 3 270M, a prefill tick of 16 prompts: a trim of ~12 MB there).
            release_free_heap()
            region = mmap.mmap(-1, num_rows * num_cols * 4, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            tensor = torch.frombuffer(region, dtype=torch.float32).view(num_rows, num_cols)
            self._tensor, self._map = tensor, region
            self.num_maps += 1
        return tensor[:num_rows]

    def release(self) -> None:
        """Drop the map (unmapped once no tensor over it is left)."""
        self._tensor = self._map = None


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


def verify_rows_as_decodes(batch: ForwardBatch) -> ForwardBatch:
    """The attention's view of a tick whose generation rows verify speculative proposals: each of
    the first ``gen_rows`` rows a one-row sequence of its own (its sequence's block table, the
    context up to its position), the sequences after them as they are. Plain decoding computes
    each of those rows as a decode row; the decode and prefill attention kernels sum in other
    orders (SmolLM2's logits moved by 0.008 between them), so verification attends as decoding
    does, at the price of reading a sequence's context once per verified row."""
    num_rows = batch.gen_rows
    starts = batch.query_starts_list
    num_seqs = next(b for b in range(batch.num_seqs + 1) if starts[b] >= num_rows)  # sequences in the rows
    seq_of_row = np.repeat(np.arange(num_seqs), np.diff(starts[: num_seqs + 1]))  # [G]
    positions = batch.array("positions")
    context_lens = np.concatenate([positions[:num_rows] + 1, batch.array("context_lens")[num_seqs:]])
    tables = batch.array("block_tables")
    query_starts = np.concatenate([np.arange(num_rows), np.asarray(starts[num_seqs:], dtype=np.int64)])
    prompt_lens = batch.array("prompt_lens")
    return ForwardBatch(
        input_ids=batch.input_ids, positions=batch.positions, slot_mapping=batch.slot_mapping,
        query_starts=query_starts, context_lens=context_lens,
        block_tables=np.concatenate([tables[seq_of_row], tables[num_seqs:]]),
        logit_rows=batch.logit_rows,
        prompt_lens=np.concatenate([prompt_lens[seq_of_row], prompt_lens[num_seqs:]]),
        query_starts_list=query_starts.tolist(), context_lens_list=context_lens.tolist(),
        num_decode_seqs=num_rows, block_size=batch.block_size, gen_rows=num_rows, gen_seqs=batch.gen_seqs,
    )


def window_blocks(sliding_window: int, block_size: int) -> int:
    """Blocks one sequence's sliding window can touch: the window's, one more where it starts
    mid-block (the scheduler's bound on kept windows, the KV memory check's on sliding layers)."""
    return -(-sliding_window // block_size) + 1
