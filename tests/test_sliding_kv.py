"""Sliding-window layers keep only their window's K/V (engine.core.block_manager, the scheduler's
window release, PagedKVCache.drop_window_blocks): the block bookkeeping against a plain model of
it, the engine's greedy output on a random Gemma 3 checkpoint against the exact model's argmax
with every dropped slot poisoned (an unmasked read of one would show), through chunked prefill,
prefix-cache hits and speculative rows, and the resident pages of the cache after a long context:
the full layer's context plus the sliding layers' window, not every layer's context."""
from __future__ import annotations

import ctypes
import mmap
import random

import pytest
import torch
from family_fixtures import randomize, save_checkpoint

import engine
from engine.batch import single_sequence_batch
from engine.core.block_manager import BlockManager

WINDOW = 64
BLOCK = 16
POISON = 1.0e4


def test_a_block_is_dropped_once_when_its_last_window_reference_goes():
    bm = BlockManager(8, BLOCK, sliding_window=WINDOW)
    a = bm.allocate(4)
    bm.take(a[:2])  # a second sequence shares the first two blocks
    bm.release_window(a[0])
    assert bm.drain_dropped() == [] and not bm.is_window_dropped[a[0]]
    bm.release_window(a[0])
    assert bm.drain_dropped() == [a[0]] and bm.is_window_dropped[a[0]]
    bm.free(a[:2], num_window_released=1)  # the second sequence ends, past block 0 only
    assert bm.drain_dropped() == []  # block 1 is still in the first sequence's window
    bm.free(a, num_window_released=1)
    bm.check_invariants()
    # ending a sequence drops the windows no prefix match can find (these blocks have no hash)
    assert sorted(bm.drain_dropped()) == a[1:]
    with pytest.raises(RuntimeError, match="window released more often"):
        bm.release_window(a[3])
    [again] = bm.allocate(1)  # a reused block starts with its K/V wanted again
    assert not bm.is_window_dropped[again] and bm.window_refs[again] == 1


def test_finished_windows_kept_for_matches_are_bounded_least_recent_dropped_first():
    """Many short sequences (each within the window, so none releases anything while running)
    leave their hashed blocks' sliding K/V for prefix matches: at most max_kept_windows of them,
    the least recently kept dropped first; the newest sequence's prefix still matches whole."""
    bm = BlockManager(64, BLOCK, sliding_window=WINDOW, max_kept_windows=6)
    sequences = []
    for n in range(5):
        ids = bm.allocate(3)
        hashes = [1000 * n + j for j in range(3)]
        for block_id, h in zip(ids, hashes):
            bm.register(block_id, h)
        bm.free(ids)
        bm.check_invariants()
        sequences.append((ids, hashes))
    dropped = bm.drain_dropped()
    assert len(bm.kept_windows) == 6 and len(dropped) == 15 - 6
    assert set(dropped) == {b for ids, _ in sequences[:3] for b in ids}  # the oldest three sequences
    ids, hashes = sequences[-1]
    assert bm.match_prefix(hashes) == ids
    assert bm.match_prefix(sequences[0][1]) == []  # its window is gone: no usable match
    bm.take(ids)  # a match re-references them: no longer kept-and-unreferenced
    assert not set(ids) & set(bm.kept_windows)
    bm.free(ids)
    bm.check_invariants()
    assert bm.reset_prefix_cache() > 0 and not bm.kept_windows  # forgotten prefixes drop their windows
    assert len(set(bm.drain_dropped())) == 6


def test_a_prefix_match_ends_where_its_window_is_whole():
    bm = BlockManager(16, BLOCK, sliding_window=WINDOW)
    ids = bm.allocate(10)
    hashes = list(range(100, 110))
    for block_id, h in zip(ids, hashes):
        bm.register(block_id, h)
    assert bm.match_prefix(hashes) == ids
    for block_id in ids[:3]:  # the sequence moved past its first three blocks
        bm.release_window(block_id)
    bm.free(ids, num_window_released=3)
    # A query at 10 * 16 = 160 reads keys 97..160: blocks 6..9, all whole.
    assert bm.match_prefix(hashes) == ids
    # At 6 * 16 = 96 it reads 33..96: block 2 is dropped, so 6 blocks do not do; 7 blocks (keys
    # from 49, block 3 on) do, and so does every longer match.
    assert bm.match_prefix(hashes[:6]) == []
    assert bm.match_prefix(hashes[:7]) == ids[:7]
    # Up to 4 blocks the window reaches back to block 0, which was dropped: no usable match.
    assert bm.match_prefix(hashes[:4]) == []


def test_match_agrees_with_a_plain_model_of_the_window():
    rng = random.Random(0)
    for _ in range(200):
        num = rng.randrange(1, 12)
        bm = BlockManager(16, BLOCK, sliding_window=rng.choice([16, 40, 64, 100]))
        ids = bm.allocate(num)
        for block_id, h in zip(ids, range(num)):
            bm.register(block_id, h)
        dropped = {b for b in ids if rng.random() < 0.3}
        for block_id in dropped:
            bm.release_window(block_id)
        got = bm.match_prefix(list(range(num)))
        expected = []
        for n in range(num, 0, -1):  # the longest n whose query at n * 16 sees no dropped key
            needed = range(max(0, n * BLOCK - bm.sliding_window + 1), n * BLOCK)
            if not any(ids[p // BLOCK] in dropped for p in needed):
                expected = ids[:n]
                break
        assert got == expected, (num, bm.sliding_window, sorted(dropped), got)


def _gemma3(head_dim: int):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    # five sliding layers and one full (Gemma 3's pattern), SmolLM2's tokenizer
    return Gemma3ForCausalLM(Gemma3TextConfig(
        vocab_size=49153, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
        head_dim=head_dim, max_position_embeddings=4096, rms_norm_eps=1e-6, num_hidden_layers=6,
        sliding_window=WINDOW, query_pre_attn_scalar=16,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}))


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory):
    torch.manual_seed(0)
    return save_checkpoint(randomize(_gemma3(head_dim=128), seed=1), tmp_path_factory.mktemp("gemma3_sliding"))


def _exact_argmax_margin(model, ids: list[int], num_prompt: int) -> torch.Tensor:
    """max logit - logit of the emitted token at each generated position, one exact forward."""
    num_blocks = -(-len(ids) // BLOCK)
    logits = model.forward(single_sequence_batch(ids, 0, list(range(num_blocks)), BLOCK, "all"),
                           model.make_kv_cache(num_blocks, BLOCK))[num_prompt - 1:-1]  # [N, V]
    emitted = torch.tensor(ids[num_prompt:])
    return logits.max(dim=-1).values - logits.gather(1, emitted[:, None])[:, 0]


@pytest.mark.parametrize("options", [
    {},
    {"max_num_batched_tokens": 48, "max_num_seqs": 4},  # prompts prefilled in chunks that cross the window
    {"speculative": "ngram", "num_speculative_tokens": 4},
], ids=["whole", "chunked", "ngram"])
def test_engine_output_is_the_exact_argmax_with_dropped_slots_poisoned(gemma3_dir, options):
    rng = random.Random(3)
    prefix = [rng.randrange(100, 40000) for _ in range(150)]
    prompts = [prefix + [rng.randrange(100, 40000) for _ in range(n)] for n in (10, 70)] + [prefix[:100]]
    params = engine.SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)
    with engine.Engine.from_pretrained(str(gemma3_dir), quantization="float32", **options) as eng:
        eng.kv_cache.poison = POISON
        first = eng.generate(prompts, params)
        again = eng.generate(prompts, params)  # prefix-cache hits on blocks some of whose windows were dropped
        assert eng.kv_cache.num_dropped_blocks > 0
        model = eng.model
    for done, repeat, prompt in zip(first, again, prompts):
        assert repeat.token_ids == done.token_ids
        margin = _exact_argmax_margin(model, prompt + done.token_ids, len(prompt))
        assert float(margin.max()) <= 1e-3, margin


def _resident_kb(tensor: torch.Tensor) -> int:
    """Resident kB of the tensor's pages, as the kernel reports them (mincore(2))."""
    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    start = tensor.data_ptr()
    assert start % page == 0, "the KV cache is not a memory map of its own"
    length = tensor.numel() * tensor.element_size()
    vec = (ctypes.c_ubyte * (-(-length // page)))()
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return sum(b & 1 for b in vec) * page // 1024


def test_a_long_context_keeps_the_full_layers_context_and_the_sliding_layers_window(gemma3_dir):
    num_prompt, num_new = 1500, 300
    prompt = [random.Random(5).randrange(100, 40000) for _ in range(num_prompt)]
    params = engine.SamplingParams(max_tokens=num_new, temperature=0, ignore_eos=True)
    with engine.Engine.from_pretrained(str(gemma3_dir), quantization="float32", kv_cache_tokens=4096,
                                       max_num_batched_tokens=256) as eng:
        [done] = eng.generate([prompt], params)
        cache = eng.kv_cache
        assert len(done.token_ids) == num_new and cache.sliding_layers == (0, 1, 2, 3, 4)
        token_kb = cache.block_bytes / BLOCK / 1024  # one token of K in one layer
        resident_kb = _resident_kb(cache.k)
    context = num_prompt + num_new
    every_layer_kb = 6 * context * token_kb
    # the full layer's whole context, and per sliding layer its window, a block either side and
    # the last prefill chunk (its rows were written before the window moved past them)
    budget_kb = (context + 5 * (WINDOW + 2 * BLOCK)) * token_kb + 64
    print(f"K resident {resident_kb} kB for {context} tokens; every layer's context {every_layer_kb:.0f} kB, "
          f"budget {budget_kb:.0f} kB")
    assert resident_kb <= budget_kb < every_layer_kb / 3


def test_many_short_requests_keep_the_sliding_layers_within_their_bound(gemma3_dir):
    """Requests shorter than the window never release one while they run; before the bound on
    kept windows their sliding K/V stayed resident for good, so a pool filled by short requests
    cost every layer's memory. Now the sliding layers hold at most the running windows and
    max_num_seqs finished ones (what kv_cache_bytes counts), while the full layer holds them all."""
    from engine.batch import window_blocks
    from engine.models.llama import kv_cache_bytes

    rng = random.Random(7)
    prompts = [[rng.randrange(100, 40000) for _ in range(40)] for _ in range(24)]  # 40 + 8 < WINDOW
    params = engine.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    with engine.Engine.from_pretrained(str(gemma3_dir), quantization="float32", kv_cache_tokens=2048,
                                       max_num_seqs=2, max_num_batched_tokens=64) as eng:
        for k in range(0, len(prompts), 2):
            eng.generate(prompts[k:k + 2], params)
        cache, config, model = eng.kv_cache, eng.config, eng.model
        token_kb = cache.block_bytes / BLOCK / 1024
        full_kb = _resident_kb(cache.k[5])  # the full-attention layer
        sliding_kb = max(_resident_kb(cache.k[i]) for i in cache.sliding_layers)
        bound = kv_cache_bytes(model.config, config.kv_cache_tokens, model.kv_cache_dtype, config)
        every = kv_cache_bytes(model.config, config.kv_cache_tokens, model.kv_cache_dtype)
    kept_blocks = config.max_num_seqs * window_blocks(WINDOW, BLOCK)
    print(f"K resident: full layer {full_kb} kB, a sliding layer {sliding_kb} kB (kept bound {kept_blocks} blocks)")
    assert full_kb >= 24 * 48 * token_kb  # every request's K stayed in the full layer (prefix cache)
    running_blocks = kept_blocks + 64 // BLOCK  # the running windows and a tick's prefill rows
    assert sliding_kb <= (kept_blocks + running_blocks) * BLOCK * token_kb + 64  # not 24 requests'
    assert bound < every


def test_the_memory_check_counts_sliding_layers_by_their_bound():
    """A Gemma-3-shaped config: 5 of 6 layers slide over 512 tokens; with 256k slots and 4
    sequences the bound counts the full layer's slots and the sliding layers' windows."""
    from engine.config import EngineConfig
    from engine.models.config import ModelConfig
    from engine.models.llama import kv_cache_bytes

    model = ModelConfig(architecture="gemma3", vocab_size=1000, hidden_size=64, intermediate_size=128,
                        num_layers=6, num_heads=4, num_kv_heads=1, head_dim=256,
                        max_position_embeddings=131072, sliding_window=512,
                        layer_types=("sliding",) * 5 + ("full",))
    config = EngineConfig(max_num_seqs=4, kv_cache_tokens=262144).resolve(131072)
    every = kv_cache_bytes(model, 262144, torch.float16)
    bound = kv_cache_bytes(model, 262144, torch.float16, config)
    token = 2 * 256 * 2  # K and V of one token in one layer
    assert every == 6 * 262144 * token
    per_seq = 512 // 16 + 1 + 1  # the window's blocks, one where it starts mid-block, the speculative slack
    assert bound == 262144 * token + 5 * (2 * 4 * per_seq + 256 // 16) * 16 * token
    assert bound < every / 5
