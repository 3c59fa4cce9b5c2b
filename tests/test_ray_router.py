"""The prefix-affine router's own parts (webapp.ray_router), without a Ray cluster: prefix keys and the table."""
from __future__ import annotations

from engine.params import SamplingParams
from webapp.protocol import ParsedRequest
from webapp.ray_router import BLOCK_CHARS, BLOCK_IDS, PrefixTable, prefix_keys, prompt_text


def test_keys_chain_whole_blocks_so_a_shared_prefix_shares_its_keys():
    system = "s" * (3 * BLOCK_CHARS)
    a = prefix_keys(system + "question one" + "x" * BLOCK_CHARS)
    b = prefix_keys(system + "question two" + "y" * BLOCK_CHARS)
    assert len(a) == len(b) == 4
    assert a[:3] == b[:3] and a[3] != b[3]
    assert prefix_keys("z" + system)[:3] != a[:3]  # key i names the whole prefix, not block i alone
    assert prefix_keys("s" * (BLOCK_CHARS - 1)) == []  # a partial block is never cached by the engine either


def test_token_id_prompts_use_blocks_of_ids():
    ids = list(range(2 * BLOCK_IDS + 3))
    keys = prefix_keys(ids)
    assert len(keys) == 2 and keys == prefix_keys(ids[:2 * BLOCK_IDS])


def test_prompt_text_renders_roles_so_moving_text_between_messages_changes_the_prefix():
    params = SamplingParams()
    chat = ParsedRequest(True, params, messages=[{"role": "system", "content": "ab"}, {"role": "user", "content": "c"}])
    moved = ParsedRequest(True, params,
                          messages=[{"role": "system", "content": "a"}, {"role": "user", "content": "bc"}])
    assert prompt_text(chat) != prompt_text(moved)
    batch = ParsedRequest(False, params, prompts=["first", "second"])
    assert prompt_text(batch) == "first"


def test_longest_match_prefers_the_deepest_live_owner():
    table = PrefixTable()
    shared = prefix_keys("p" * (4 * BLOCK_CHARS))
    table.record(shared[:2], "A")
    table.record(shared, "B")  # B served the longer prefix last
    assert table.longest_match(shared, {"A", "B"}) == ("B", 4)
    assert table.longest_match(shared, {"A"}) == (None, 0)  # B overwrote the first blocks; A holds none now
    table.record(shared[:2], "A")
    assert table.longest_match(shared, {"A"}) == ("A", 2)
    assert table.longest_match(prefix_keys("q" * BLOCK_CHARS), {"A", "B"}) == (None, 0)


def test_table_is_bounded_least_recently_used_first_and_forgets_dead_replicas():
    table = PrefixTable(max_keys=8)
    old = prefix_keys("o" * (4 * BLOCK_CHARS))
    new = prefix_keys("n" * (6 * BLOCK_CHARS))
    table.record(old, "A")
    table.record(new, "B")
    assert len(table) == 8
    assert table.longest_match(old, {"A"}) == ("A", 2)  # eviction took the deepest blocks of the oldest prefix
    assert table.longest_match(new, {"B"}) == ("B", 6)
    table.forget("B")
    assert len(table) == 2 and table.longest_match(new, {"B"}) == (None, 0)
