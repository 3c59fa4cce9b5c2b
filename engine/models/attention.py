"""Paged attention over a flat KV cache, planned once per forward and reused by every layer.

The cache of one layer is K and V tensors ``[num_slots, num_kv_heads, head_dim]`` with
``num_slots = num_blocks * block_size``; slot = block_id * block_size + offset.

Decode rows (the first ``num_decode_seqs`` sequences, one row each) take one of two paths:
the fused C kernel (``engine.models.fused.decode_attention``) walks each block table in
place; the torch reference gathers the keys into a padded ``[B, KH, L, D]`` with a length
mask for one SDPA call. Prefill rows likewise: on the fused path one C call for all of them
(``engine.models.fused.prefill_attention``: a blocked flash attention over the block tables,
no gathered copy of the earlier context, no mask tensor), on the reference path one SDPA
call per sequence (a ``[T, C]`` mask and the context gathered, or viewed when its blocks are
consecutive, and widened to the compute dtype).
"""
from __future__ import annotations

import math
import mmap
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.batch import ForwardBatch
from engine.models import fused


def _zeroed(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, mmap.mmap | None]:
    """A zero tensor over a private anonymous memory map: the OS hands out zero pages and
    makes them resident only when first written, so the cache costs memory as it fills, not
    at start-up (masked padding slots are still read, hence zeros, never NaN garbage).
    -> (tensor, its map; None for a small tensor, which is not worth a mapping)."""
    num_bytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if num_bytes < 1 << 20:  # small (tests): not worth a mapping
        return torch.zeros(shape, dtype=dtype), None
    try:
        region = mmap.mmap(-1, num_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError as exc:  # only past the start-up memory check with allow_overcommit
        raise MemoryError(f"kv_cache_tokens: the OS refused to map {num_bytes} bytes for the KV cache "
                          f"({exc.strerror}); lower kv_cache_tokens or max_model_len") from None
    return torch.frombuffer(region, dtype=dtype).view(shape), region  # the tensor keeps the map alive


class PagedKVCache:
    """K and V for every layer: ``k[layer]`` / ``v[layer]`` are ``[num_slots, KH, D]``.

    ``sliding_layers``: the layers with a sliding window. ``drop_window_blocks`` gives the
    pages of some blocks in those layers back to the OS (the scheduler calls it for blocks no
    query can see any more through a window, engine.core.block_manager); they read as zeros
    until written again. ``poison`` (tests): fill the dropped slots with this value instead,
    so that any read of them that is not masked out shows in the outputs."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, sliding_layers: tuple[int, ...] = ()):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks: must be > 0, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size: must be > 0, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.sliding_layers = tuple(sliding_layers)
        self.poison: float | None = None
        self.num_dropped_blocks = 0  # blocks dropped in the sliding layers so far (a counter)
        shape = (num_layers, num_blocks * block_size, num_kv_heads, head_dim)
        self.k, self._k_map = _zeroed(shape, dtype)  # [L, S, KH, D]
        self.v, self._v_map = _zeroed(shape, dtype)  # [L, S, KH, D]
        self.block_bytes = block_size * num_kv_heads * head_dim * self.k.element_size()

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    def drop_window_blocks(self, block_ids: list[int]) -> None:
        """Give back the sliding layers' K/V pages of these blocks (runs of consecutive ids in one
        madvise call per layer; a page shared with a block still in use is kept)."""
        if not self.sliding_layers or not block_ids:
            return
        self.num_dropped_blocks += len(block_ids)
        runs = _consecutive_runs(sorted(block_ids))
        if self.poison is not None:
            for first, end in runs:
                span = slice(first * self.block_size, end * self.block_size)
                for layer in self.sliding_layers:
                    self.k[layer, span] = self.poison
                    self.v[layer, span] = self.poison
            return
        if self._k_map is None:  # a small cache (no map): nothing worth giving back
            return
        layer_bytes = self.num_slots * self.block_bytes // self.block_size
        page = mmap.PAGESIZE
        for region in (self._k_map, self._v_map):
            for layer in self.sliding_layers:
                for first, end in runs:
                    start = layer * layer_bytes + first * self.block_bytes
                    stop = layer * layer_bytes + end * self.block_bytes
                    start = -(-start // page) * page  # whole pages inside the run only
                    stop = stop // page * page
                    if stop > start:
                        region.madvise(mmap.MADV_DONTNEED, start, stop - start)


def _consecutive_runs(ids: list[int]) -> list[tuple[int, int]]:
    """Sorted ids -> [(first, end)] half-open runs of consecutive ids."""
    runs = []
    for block_id in ids:
        if runs and runs[-1][1] == block_id:
            runs[-1] = (runs[-1][0], block_id + 1)
        else:
            runs.append((block_id, block_id + 1))
    return runs


@dataclass(slots=True)
class PrefillSeq:
    row_start: int
    row_end: int
    kv_slots: torch.Tensor | None  # [C] slots of the whole context, None: attend the new rows only (causal)
    kv_first_slot: int | None  # the context's first slot when its blocks are consecutive (a view, no gather)
    mask: torch.Tensor | None  # [T, C] additive (0 or -inf); None with kv_slots None: is_causal


@dataclass(slots=True)
class AttentionPlan:
    slot_mapping: torch.Tensor  # [T]
    num_decode_seqs: int
    decode_slots: torch.Tensor | None  # [B, L] slots to gather for the decode rows
    decode_mask: torch.Tensor | None  # [B, 1, 1, L] additive (0 or -inf) in the model dtype
    prefills: list[PrefillSeq] = field(default_factory=list)
    # The fused decode kernel's inputs (decode_slots and decode_mask are then None):
    is_fused: bool = False
    block_tables: torch.Tensor | None = None  # [B, max_blocks] int64, rows contiguous
    context_lens: torch.Tensor | None = None  # [B] int64
    block_size: int = 0
    sliding_window: int | None = None
    # The fused prefill kernel's inputs (prefills is then empty): the sequences after the
    # decode rows, rows given by absolute query starts.
    num_prefill_seqs: int = 0
    prefill_query_starts: torch.Tensor | None = None  # [P + 1] int64
    prefill_block_tables: torch.Tensor | None = None  # [P, max_blocks] int64, rows contiguous
    prefill_context_lens: torch.Tensor | None = None  # [P] int64
    positions: torch.Tensor | None = None  # [T] int64
    tiles: bool = False  # the prefill kernel's products may run on AMX tiles (fused.prefill_attention)

    @property
    def has_prefill(self) -> bool:
        return bool(self.prefills) or self.num_prefill_seqs > 0


def _context_slots(block_table: torch.Tensor, num_tokens: int, block_size: int,
                   offsets: torch.Tensor) -> torch.Tensor:
    """block_table [..., max_blocks] -> slots [..., num_tokens] of positions 0..num_tokens-1."""
    num_blocks = -(-num_tokens // block_size)
    table = block_table[..., :num_blocks].clamp(min=0)  # -1 padding -> block 0 (masked out)
    slots = table.unsqueeze(-1) * block_size + offsets  # [..., nb, bs]
    return slots.flatten(-2)[..., :num_tokens]


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool mask (True = attend) -> 0 / -inf in dtype, built once per forward instead of per layer."""
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))


def plan_attention(batch: ForwardBatch, sliding_window: int | None = None,
                   dtype: torch.dtype = torch.float32, is_fused: bool = False, tiles: bool = False) -> AttentionPlan:
    """is_fused: decode rows go to the C kernel (no gather, no mask); tiles: the prefill kernel's
    products may run on AMX tiles (16 significant bits of each operand: models whose own products
    are the quantized kernels')."""
    bs = batch.block_size
    offsets = torch.arange(bs, dtype=torch.int64)
    context_lens = batch.context_lens_list
    starts = batch.query_starts_list
    num_decode = batch.num_decode_seqs
    decode_slots = decode_mask = None
    if num_decode and not is_fused:
        max_len = max(context_lens[:num_decode])
        decode_slots = _context_slots(batch.block_tables[:num_decode], max_len, bs, offsets)  # [B, L]
        key_pos = torch.arange(max_len, dtype=torch.int64)  # [L]
        lens = batch.context_lens[:num_decode, None]  # [B, 1]
        decode_mask = key_pos < lens  # [B, L]
        if sliding_window is not None and max_len > sliding_window:
            decode_mask &= key_pos >= lens - sliding_window
        decode_mask = _additive(decode_mask[:, None, None, :], dtype)  # [B, 1, 1, L]
    prefills = []
    # The fused kernel takes the prefill rows as they are (below), whole prompts too: it measured
    # as fast as torch's causal SDPA on a whole 4k-token prompt (docs/performance.md). The
    # reference path gets each sequence's slots and mask.
    for b in range(num_decode, num_decode if is_fused else batch.num_seqs):
        row_start, row_end = starts[b], starts[b + 1]
        num_rows, num_ctx = row_end - row_start, context_lens[b]
        if num_rows == 0:
            continue
        if num_ctx == num_rows and (sliding_window is None or num_rows <= sliding_window):
            prefills.append(PrefillSeq(row_start, row_end, None, None, None))
            continue
        kv_slots = _context_slots(batch.block_tables[b], num_ctx, bs, offsets)  # [C]
        # Consecutive blocks (the common case for a long prompt) are read as a slice of the cache.
        first_slot = int(kv_slots[0])
        is_consecutive = int(kv_slots[-1]) - first_slot == num_ctx - 1 and bool(
            (kv_slots[1:] - kv_slots[:-1] == 1).all()
        )
        key_pos = torch.arange(num_ctx, dtype=torch.int64)  # [C]
        query_pos = batch.positions[row_start:row_end, None]  # [T, 1]
        mask = key_pos <= query_pos  # [T, C]
        if sliding_window is not None:
            mask &= key_pos > query_pos - sliding_window
        prefills.append(PrefillSeq(
            row_start, row_end, kv_slots=kv_slots, kv_first_slot=first_slot if is_consecutive else None,
            mask=_additive(mask, dtype),
        ))
    plan = AttentionPlan(batch.slot_mapping, num_decode, decode_slots, decode_mask, prefills)
    if is_fused:
        plan.is_fused = True
        plan.block_tables = _int64_rows(batch.block_tables)
        plan.context_lens = _int64_rows(batch.context_lens)
        plan.slot_mapping = _int64_rows(batch.slot_mapping)
        plan.block_size = bs
        plan.sliding_window = sliding_window
        plan.tiles = tiles
        if batch.num_seqs > num_decode and batch.num_tokens > num_decode:
            plan.num_prefill_seqs = batch.num_seqs - num_decode
            plan.prefill_query_starts = _int64_rows(batch.query_starts[num_decode:])
            plan.prefill_block_tables = _int64_rows(batch.block_tables[num_decode:])
            plan.prefill_context_lens = _int64_rows(batch.context_lens[num_decode:])
            plan.positions = _int64_rows(batch.positions)
    return plan


def _int64_rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int64 and t.is_contiguous() else t.to(torch.int64).contiguous()


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, is_causal: bool,
            scale: float | None, softcap: float | None) -> torch.Tensor:
    """q [B, H, T, D], k/v [B, KH, C, D] -> [B, H, T, D]: SDPA, or with scores soft-capped
    (Gemma 2: cap * tanh(s / cap) before the mask and softmax) the same steps written out."""
    groups = q.shape[1] // k.shape[1]
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                              enable_gqa=groups > 1)
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # [B, H, C, D]
    scores = torch.matmul(q, k.transpose(-1, -2)) * (scale or q.shape[-1] ** -0.5)  # [B, H, T, C]
    scores = torch.tanh(scores / softcap) * softcap
    if is_causal:
        num_rows, num_ctx = scores.shape[-2:]
        causal = torch.ones(num_rows, num_ctx, dtype=torch.bool).tril_(num_ctx - num_rows)  # [T, C]
        mask = _additive(causal, scores.dtype)
    if mask is not None:
        scores = scores + mask
    return torch.matmul(scores.softmax(dim=-1), v)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, plan: AttentionPlan, scale: float | None = None,
                    softcap: float | None = None) -> torch.Tensor:
    """q [T, H, D], k/v [T, KH, D] (already written to the cache) -> [T, H * D].
    scale: the softmax scale (None: 1/sqrt(D)); softcap: Gemma 2's score cap (torch path only)."""
    num_rows, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    groups = num_heads // num_kv_heads
    nd = plan.num_decode_seqs
    if plan.is_fused and plan.num_prefill_seqs:  # the fused plan exists only for models without a softcap
        out = torch.empty((num_rows, num_heads * head_dim), dtype=q.dtype)  # [T, H * D]
        if nd:
            fused.decode_attention(q[:nd], k_cache, v_cache, plan.block_tables, plan.context_lens,
                                   plan.block_size, plan.sliding_window, out=out[:nd], scale=scale)
        return fused.prefill_attention(q, k_cache, v_cache, plan.prefill_block_tables,
                                       plan.prefill_query_starts, plan.prefill_context_lens, plan.positions,
                                       plan.block_size, plan.sliding_window, out=out, scale=scale,
                                       tiles=plan.tiles)
    pieces = []
    if nd and plan.is_fused:
        if softcap is not None:
            raise ValueError("softcap: the fused decode kernel has none (plan the torch path)")
        pieces.append(fused.decode_attention(q[:nd], k_cache, v_cache, plan.block_tables, plan.context_lens,
                                             plan.block_size, plan.sliding_window, scale=scale))  # [B, H * D]
    elif nd:
        qd = q[:nd].view(nd, num_kv_heads, groups, head_dim)  # [B, KH, G, D]
        kd = k_cache[plan.decode_slots].transpose(1, 2).to(q.dtype)  # [B, KH, L, D]
        vd = v_cache[plan.decode_slots].transpose(1, 2).to(q.dtype)  # [B, KH, L, D]
        out = _attend(qd.reshape(nd, num_heads, 1, head_dim), kd, vd, plan.decode_mask, False, scale,
                      softcap).view(nd, num_kv_heads, groups, head_dim)  # [B, KH, G, D]
        pieces.append(out.reshape(nd, num_heads * head_dim))
    for seq in plan.prefills:
        # 4-D inputs with enable_gqa take torch's fused CPU (flash) kernel; 3-D ones fall back to
        # the math path, which materialises [H, T, C] scores (minutes for an 8k-token prompt).
        qs = q[seq.row_start:seq.row_end].transpose(0, 1).unsqueeze(0)  # [1, H, T, D]
        if seq.kv_slots is None:
            # The new rows' K and V as the cache holds them (a float16 cache rounds them once on
            # write, as the fused kernel reads them and as a later chunk would).
            ks = k[seq.row_start:seq.row_end].to(k_cache.dtype).to(q.dtype).transpose(0, 1).unsqueeze(0)
            vs = v[seq.row_start:seq.row_end].to(v_cache.dtype).to(q.dtype).transpose(0, 1).unsqueeze(0)
            out = _attend(qs, ks, vs, None, True, scale, softcap)
        else:
            if seq.kv_first_slot is not None:
                span = slice(seq.kv_first_slot, seq.kv_first_slot + seq.kv_slots.shape[0])
                ks, vs = k_cache[span], v_cache[span]  # [C, KH, D] views
            else:
                ks, vs = k_cache[seq.kv_slots], v_cache[seq.kv_slots]  # [C, KH, D] gathered
            ks = ks.transpose(0, 1).unsqueeze(0).to(q.dtype)  # [1, KH, C, D] (a float16 cache: widened)
            vs = vs.transpose(0, 1).unsqueeze(0).to(q.dtype)  # [1, KH, C, D]
            out = _attend(qs, ks, vs, seq.mask, False, scale, softcap)
        pieces.append(out[0].transpose(0, 1).reshape(seq.row_end - seq.row_start, num_heads * head_dim))  # [T, H*D]
    if len(pieces) == 1:
        return pieces[0]
    return torch.cat(pieces, dim=0)
