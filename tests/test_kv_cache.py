"""KV block pool and prefix cache: exact block ids, eviction order, events, hash stability, the router's index."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from octoserve.services.core.kv_cache import KVCacheManager, PrefixIndex, hash_block, prefix_block_hashes
from octoserve.services.core.types import BlockRemoved, BlockStored

ROOT = pathlib.Path(__file__).resolve().parents[1]
A = tuple(range(10))  # 10 tokens: blocks of 4 -> two full blocks and a partial one


def make(num_blocks: int = 11, block_size: int = 4, **kwargs) -> KVCacheManager:
    return KVCacheManager(num_blocks=num_blocks, block_size=block_size, **kwargs)


def snapshot(kv: KVCacheManager) -> tuple:
    n = kv.num_total_blocks
    return (
        kv.free_block_ids(),
        tuple(kv.ref_count(b) for b in range(n)),
        tuple(kv.block_hash(b) for b in range(n)),
        kv.num_cached_blocks,
    )


def run_a_and_free(kv: KVCacheManager) -> list[int]:
    """Request A: 10 tokens allocated and computed, then freed. Returns the hashes of its two full blocks."""
    assert kv.allocate("A", A, 10) == (0, 1, 2)
    kv.cache_computed("A", A, 10)
    kv.free("A")
    return prefix_block_hashes(A, 4)


# ----- hashing -----


def test_hash_chain_matches_block_by_block_hashing():
    tokens = list(range(100, 137))
    h0 = hash_block(None, tuple(tokens[0:16]), "m")
    h1 = hash_block(h0, tuple(tokens[16:32]), "m")
    assert prefix_block_hashes(tokens, 16, "m") == [h0, h1]  # the 5-token tail is not a full block


def test_hash_depends_on_parent_tokens_and_extra_key():
    base = hash_block(None, (1, 2, 3, 4), "")
    assert hash_block(0, (1, 2, 3, 4), "") != base  # parent 0 is not "no parent"
    assert hash_block(None, (1, 2, 4, 3), "") != base
    assert hash_block(None, (1, 2, 3, 4), "llama-3-8b") != base
    assert prefix_block_hashes([1, 2, 3, 4], 4, "a") != prefix_block_hashes([1, 2, 3, 4], 4, "b")
    assert 0 <= base < 2**64


def test_hash_value_is_pinned():
    # Router and instances may run different builds; a changed hash would silently zero every prefix hit.
    assert hash_block(None, (1, 2, 3, 4), "") == 10246211980710244455


def test_hashes_are_identical_across_processes_with_different_hash_seeds():
    code = (
        "from octoserve.services.core.kv_cache import hash_block, prefix_block_hashes;"
        "print(prefix_block_hashes(list(range(40)), 16, 'llama-3-8b'), hash_block(7, (5, 6), 'adapter-x'))"
    )
    outputs = []
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        outputs.append(done.stdout)
    expected = f"{prefix_block_hashes(list(range(40)), 16, 'llama-3-8b')} {hash_block(7, (5, 6), 'adapter-x')}\n"
    assert outputs == [expected, expected]


# ----- allocation and the free list -----


def test_constructor_rejects_empty_pool():
    with pytest.raises(ValueError):
        make(num_blocks=0)
    with pytest.raises(ValueError):
        make(block_size=0)


def test_first_allocation_takes_lowest_ids_and_extends_by_new_ids_only():
    kv = make()
    assert kv.num_blocks_needed("A", 10) == 3
    assert kv.allocate("A", A, 10) == (0, 1, 2)
    assert kv.num_blocks_needed("A", 13) == 1
    assert kv.allocate("A", A, 12) == ()  # still covered by block 2
    assert kv.allocate("A", A, 13) == (3,)  # reserving beyond the known tokens
    assert kv.block_ids("A") == (0, 1, 2, 3)
    assert (kv.num_free_blocks, kv.num_total_blocks, kv.usage) == (7, 11, pytest.approx(4 / 11))
    assert kv.num_cached_tokens("A") == 0


def test_free_sends_cached_blocks_to_tail_reversed_and_empty_blocks_to_head():
    kv = make()
    run_a_and_free(kv)
    # Block 2 held no full block: reused first. Blocks 1, 0 are cached: evicted last, the longer prefix first.
    assert kv.free_block_ids() == (2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 0)
    assert (kv.num_free_blocks, kv.num_cached_blocks, kv.usage) == (11, 2, 0.0)


def test_eviction_pops_head_and_evicts_the_last_block_of_a_freed_prefix_first():
    kv = make()
    h0, h1 = run_a_and_free(kv)
    kv.drain_events()
    other = tuple(range(50, 86))  # 36 fresh tokens: 9 blocks
    assert kv.allocate("X", other, 36) == (2, 3, 4, 5, 6, 7, 8, 9, 10)
    assert kv.drain_events() == []  # nine empty blocks: nothing evicted yet
    assert kv.allocate("X", other, 37) == (1,)
    assert kv.drain_events() == [BlockRemoved((h1,))]
    assert kv.find_cached_prefix(A) == 4  # block 0 still serves the first four tokens
    assert kv.allocate("Y", (99, 98), 2) == (0,)
    assert kv.drain_events() == [BlockRemoved((h0,))]
    assert kv.find_cached_prefix(A) == 0
    assert kv.allocate("Z", (1,), 1) is None


def test_second_request_hits_free_listed_prefix_blocks():
    kv = make()
    run_a_and_free(kv)
    b_tokens = A[:8] + (100, 101, 102)
    assert kv.find_cached_prefix(b_tokens) == 8
    assert kv.allocate("B", b_tokens, 11) == (0, 1, 2)  # hits 0 and 1, then pops block 2 from the head
    assert kv.num_cached_tokens("B") == 8
    assert [kv.ref_count(b) for b in (0, 1, 2)] == [1, 1, 1]
    assert kv.free_block_ids() == (3, 4, 5, 6, 7, 8, 9, 10)  # hit blocks left the free list
    assert kv.num_blocks_needed("B", 12) == 0


def test_shared_prefix_blocks_count_their_holders():
    kv = make()
    assert kv.allocate("A", A, 10) == (0, 1, 2)
    kv.cache_computed("A", A, 10)
    assert kv.allocate("B", A[:8] + (7, 7), 10) == (0, 1, 3)
    assert [kv.ref_count(b) for b in range(4)] == [2, 2, 1, 1]
    kv.free("A")
    assert [kv.ref_count(b) for b in range(4)] == [1, 1, 0, 1]
    assert kv.free_block_ids() == (2, 4, 5, 6, 7, 8, 9, 10)  # 0 and 1 still held by B
    kv.free("B")
    # B frees 3 (empty -> head), then 1, 0 (cached -> tail, reversed).
    assert kv.free_block_ids() == (3, 2, 4, 5, 6, 7, 8, 9, 10, 1, 0)
    kv.free("B")  # freeing twice is harmless
    assert kv.num_free_blocks == 11


def test_lookups_of_prompts_sharing_a_prefix_match_fresh_lookups():
    """A lookup reuses the chain hashes of the previous one while that one's hashed tokens lead this prompt; prompts
    that share a first block, diverge, or are shorter than the chain held give what a fresh manager gives."""
    cached = tuple(range(100, 112))  # three blocks of 4, cached below
    kv = make(num_blocks=20)
    kv.allocate("c", cached + (7,), 13)
    kv.cache_computed("c", cached + (7,), 13)
    prompts = [cached + (1,), cached[:8] + (9, 9, 9, 9, 1), cached[:4] + (1,), cached + (2, 3, 4, 5, 6),
               (5,) + cached, cached[:6], cached + (1,)]
    expected = [12, 8, 4, 12, 0, 4, 12]
    assert [kv.find_cached_prefix(p) for p in prompts] == expected
    assert [kv.find_cached_prefix(list(p)) for p in reversed(prompts)] == expected[::-1]  # lists hash as tuples


def test_find_cached_prefix_never_reports_the_whole_prompt():
    kv = make()
    tokens = tuple(range(12))
    kv.allocate("A", tokens, 12)
    kv.cache_computed("A", tokens, 12)
    assert kv.find_cached_prefix(tokens[:8]) == 4  # the block holding the last token must be recomputed
    assert kv.find_cached_prefix(tokens[:9]) == 8
    assert kv.find_cached_prefix(tokens) == 8
    assert kv.find_cached_prefix(tokens + (5,)) == 12
    assert kv.find_cached_prefix(tokens[:1]) == 0
    assert kv.find_cached_prefix(()) == 0
    assert kv.find_cached_prefix((1,) + tokens) == 0  # a different first block breaks the chain
    assert kv.allocate("B", tokens[:8], 8) == (0, 3)
    assert kv.num_cached_tokens("B") == 4


def test_failed_allocation_counts_free_listed_hits_and_changes_nothing():
    kv = make(num_blocks=4)
    tokens = tuple(range(12))
    assert kv.allocate("A", tokens, 12) == (0, 1, 2)
    kv.cache_computed("A", tokens, 12)
    kv.free("A")
    kv.drain_events()
    assert kv.free_block_ids() == (3, 2, 1, 0)
    longer = tokens + (20, 21, 22, 23)
    before = snapshot(kv)
    # 5 blocks: 3 hits (all in the free list) + 2 fresh; 4 free blocks, but only 1 is not a hit.
    assert not kv.can_allocate("B", longer, 20)
    assert kv.allocate("B", longer, 20) is None
    assert snapshot(kv) == before
    assert (kv.has_request("B"), kv.block_ids("B"), kv.drain_events()) == (False, (), [])
    assert kv.can_allocate("B", longer, 16)
    assert kv.allocate("B", longer, 16) == (0, 1, 2, 3)
    assert kv.num_free_blocks == 0
    assert kv.allocate("B", longer, 17) is None  # extension fails too, and keeps what B holds
    assert kv.block_ids("B") == (0, 1, 2, 3)


# ----- caching and events -----


def test_cache_computed_emits_chained_stored_events_once():
    kv = make()
    h0, h1 = prefix_block_hashes(A, 4)
    kv.allocate("A", A, 10)
    kv.cache_computed("A", A, 3)
    assert kv.drain_events() == []
    kv.cache_computed("A", A, 4)
    assert kv.drain_events() == [BlockStored((h0,), None)]
    kv.cache_computed("A", A, 10)
    kv.cache_computed("A", A, 10)
    assert kv.drain_events() == [BlockStored((h1,), h0)]
    assert kv.drain_events() == []
    assert (kv.block_hash(0), kv.block_hash(1), kv.block_hash(2)) == (h0, h1, None)


def test_cache_computed_only_covers_allocated_blocks():
    kv = make()
    kv.allocate("A", A, 4)
    kv.cache_computed("A", A, 10)  # only block 0 is held, so only it can be cached
    assert kv.num_cached_blocks == 1
    kv.allocate("A", A, 10)
    kv.cache_computed("A", A, 10)
    assert kv.num_cached_blocks == 2


def test_cache_computed_of_unknown_request_raises():
    with pytest.raises(KeyError):
        make().cache_computed("nobody", A, 4)


def test_identical_block_computed_twice_keeps_the_first_mapping():
    kv = make()
    h0, h1 = prefix_block_hashes(A, 4)
    kv.allocate("A", A, 10)
    kv.allocate("B", A, 10)  # no hit: A has computed nothing yet
    assert kv.block_ids("B") == (3, 4, 5)
    kv.cache_computed("A", A, 10)
    kv.cache_computed("B", A, 10)
    assert kv.drain_events() == [BlockStored((h0, h1), None)]
    assert (kv.block_hash(3), kv.block_hash(4), kv.num_cached_blocks) == (None, None, 2)
    kv.free("B")
    assert kv.free_block_ids()[:3] == (3, 4, 5)  # B's anonymous copies are reused first
    assert kv.allocate("C", A[:8] + (1, 1), 10) == (0, 1, 3)


def test_stored_events_split_around_an_already_cached_block():
    kv = make(num_blocks=8)
    tokens = tuple(range(12))
    h0, h1, h2 = prefix_block_hashes(tokens, 4)
    kv.allocate("A", tokens, 12)
    kv.allocate("B", tokens, 12)
    kv.cache_computed("A", tokens, 12)
    kv.free("A")  # blocks 2, 1, 0 to the tail; head is 6, 7
    kv.allocate("X", (9,) * 12, 12)  # 6, 7, then evicts block 2 (h2)
    assert kv.block_ids("X") == (6, 7, 2)
    kv.drain_events()
    kv.cache_computed("B", tokens, 12)  # h0, h1 are still cached in blocks 0, 1; h2 is new
    assert kv.drain_events() == [BlockStored((h2,), h1)]
    assert kv.block_hash(5) == h2


def test_prefix_caching_disabled_never_hits_or_stores():
    kv = make(enable_prefix_caching=False)
    kv.allocate("A", A, 10)
    kv.cache_computed("A", A, 10)
    kv.free("A")
    assert (kv.num_cached_blocks, kv.drain_events(), kv.find_cached_prefix(A)) == (0, [], 0)
    assert kv.free_block_ids() == (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10)  # all empty: back to the head
    assert kv.allocate("B", A, 10) == (0, 1, 2)
    assert kv.num_cached_tokens("B") == 0


def test_extra_key_separates_models():
    kv = make(extra_key="llama-3-8b")
    kv.allocate("A", A, 10)
    kv.cache_computed("A", A, 10)
    assert kv.drain_events() == [BlockStored(tuple(prefix_block_hashes(A, 4, "llama-3-8b")), None)]


def test_reset_prefix_cache_only_when_nothing_is_held():
    kv = make()
    h0, h1 = prefix_block_hashes(A, 4)
    kv.allocate("A", A, 10)
    kv.cache_computed("A", A, 10)
    kv.drain_events()
    assert kv.reset_prefix_cache() is False
    assert kv.num_cached_blocks == 2
    kv.free("A")
    assert kv.reset_prefix_cache() is True
    assert kv.drain_events() == [BlockRemoved((h0, h1))]
    assert (kv.num_cached_blocks, kv.find_cached_prefix(A), kv.num_free_blocks) == (0, 0, 11)
    assert kv.reset_prefix_cache() is True
    assert kv.drain_events() == []


# ----- the router's prefix index -----


def test_prefix_index_counts_leading_hashes_per_instance():
    index = PrefixIndex()
    h = prefix_block_hashes(tuple(range(16)), 4)
    index.apply_all("i0", [BlockStored((h[0], h[1]), None), BlockStored((h[2],), h[1])])
    index.apply("i1", BlockStored((h[0],), None))
    index.apply("i2", BlockStored((h[1], h[2]), h[0]))  # holds later blocks but not the first
    assert index.overlap_blocks(h) == {"i0": 3, "i1": 1}
    assert index.overlap_blocks(h[1:]) == {"i0": 2, "i2": 2}
    assert index.overlap_blocks([]) == {}
    index.apply("i0", BlockRemoved((h[1],)))
    assert index.overlap_blocks(h) == {"i0": 1, "i1": 1}
    index.apply("i1", BlockRemoved((h[3],)))  # never stored: ignored
    index.remove_instance("i1")
    assert index.overlap_blocks(h) == {"i0": 1}
    assert (index.num_blocks("i0"), index.num_blocks("i1"), index.num_blocks("i2")) == (2, 0, 2)


def test_prefix_index_shared_hashes_duplicates_and_forgetting_one_instance():
    index = PrefixIndex()
    h = tuple(prefix_block_hashes(tuple(range(12)), 4))  # events carry tuples of hashes
    for iid in ("a", "b", "c"):
        index.apply(iid, BlockStored(h, None))
    index.apply("a", BlockStored(h[:2], None))  # stored again: counted once
    index.apply("b", BlockRemoved((h[2], h[2])))  # removed twice: counted once
    assert (index.num_blocks("a"), index.num_blocks("b"), index.num_blocks("c")) == (3, 2, 3)
    assert index.overlap_blocks(h) == {"a": 3, "b": 2, "c": 3}
    index.remove_instance("a")
    assert index.overlap_blocks(h) == {"b": 2, "c": 3}
    index.remove_instance("c")
    index.remove_instance("c")  # already forgotten: no change
    assert index.overlap_blocks(h) == {"b": 2} and index.num_blocks("c") == 0
    index.apply("a", BlockStored(h[:1], None))  # a restarted instance starts again from its new events
    assert index.overlap_blocks(h) == {"a": 1, "b": 2}
    index.apply_all("b", [BlockRemoved(h)])
    index.apply("a", BlockRemoved(h[:1]))
    assert index.overlap_blocks(h) == {} and index.num_hashes() == 0  # nothing left behind


def test_prefix_index_follows_a_manager_through_eviction():
    kv, index = make(num_blocks=3), PrefixIndex()
    hashes = prefix_block_hashes(A, 4)
    kv.allocate("A", A, 10)
    kv.cache_computed("A", A, 10)
    kv.free("A")
    index.apply_all("w", kv.drain_events())
    assert index.overlap_blocks(hashes) == {"w": 2}
    kv.allocate("X", (5,) * 8, 8)  # block 2 (empty), then block 1 (h1) is evicted
    index.apply_all("w", kv.drain_events())
    assert index.overlap_blocks(hashes) == {"w": 1}


# ----- property test: no sequence of operations over-allocates or corrupts the cache -----

BLOCK_SIZE = 2
# Prompts share prefixes often: a cut of one of a few base prompts, then a short random tail.
BASES = ((0, 1, 2, 0, 1, 2, 0, 1), (0, 1, 1, 1, 2, 2, 2, 2), (2,) * 8)
TOKENS = st.builds(
    lambda base, cut, tail: list(base[:cut]) + tail,
    st.sampled_from(BASES),
    st.integers(0, 8),
    st.lists(st.integers(0, 2), max_size=4),
).filter(bool)


class KVCacheMachine(RuleBasedStateMachine):
    """Drives a manager against a model that maps token prefixes to the block that caches them."""

    @initialize(num_blocks=st.integers(1, 12))
    def setup(self, num_blocks: int) -> None:
        self.kv = KVCacheManager(num_blocks, BLOCK_SIZE)
        self.index = PrefixIndex()
        self.next_id = 0
        self.tokens: dict[str, list[int]] = {}  # request -> its known tokens
        self.hashed: dict[str, int] = {}  # request -> full blocks already offered to the cache
        self.stored: dict[tuple[int, ...], int] = {}  # full-block token prefix -> the block caching it

    def _model_hits(self, tokens: list[int], cap: bool = True) -> list[int]:
        limit = (len(tokens) - 1) // BLOCK_SIZE if cap else len(tokens) // BLOCK_SIZE
        blocks = []
        for i in range(limit):
            block = self.stored.get(tuple(tokens[: (i + 1) * BLOCK_SIZE]))
            if block is None:
                break
            blocks.append(block)
        return blocks

    def _forget_evicted(self, fresh: tuple[int, ...]) -> None:
        self.stored = {k: b for k, b in self.stored.items() if b not in fresh}

    @rule(tokens=TOKENS, reserve=st.integers(0, 4), compute_all=st.booleans())
    def start(self, tokens: list[int], reserve: int, compute_all: bool) -> None:
        rid = f"r{self.next_id}"
        self.next_id += 1
        hits = self._model_hits(tokens)
        assert self.kv.find_cached_prefix(tokens) == len(hits) * BLOCK_SIZE
        num_tokens = len(tokens) + reserve
        need = -(-num_tokens // BLOCK_SIZE) - len(hits)
        hits_free = sum(1 for b in hits if self.kv.ref_count(b) == 0)
        fits = max(0, need) <= self.kv.num_free_blocks - hits_free
        before = snapshot(self.kv)
        got = self.kv.allocate(rid, tokens, num_tokens)
        if got is None:
            assert not fits and snapshot(self.kv) == before and not self.kv.has_request(rid)
            return
        assert fits
        assert got[: len(hits)] == tuple(hits) and len(got) == len(hits) + max(0, need)
        assert self.kv.num_cached_tokens(rid) == len(hits) * BLOCK_SIZE
        self._forget_evicted(got[len(hits) :])
        self.tokens[rid], self.hashed[rid] = list(tokens), len(hits)
        if compute_all:
            self._compute(rid, len(tokens))

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), new_tokens=st.lists(st.integers(0, 2), min_size=1, max_size=3))
    def grow(self, data, new_tokens: list[int]) -> None:
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        tokens = self.tokens[rid] + new_tokens
        before, held = snapshot(self.kv), self.kv.block_ids(rid)
        got = self.kv.allocate(rid, tokens, len(tokens))
        if got is None:
            assert snapshot(self.kv) == before and self.kv.block_ids(rid) == held
            return
        assert self.kv.block_ids(rid) == held + got
        self._forget_evicted(got)
        self.tokens[rid] = tokens

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), num_computed=st.integers(0, 16))
    def compute(self, data, num_computed: int) -> None:
        self._compute(data.draw(st.sampled_from(sorted(self.tokens))), num_computed)

    def _compute(self, rid: str, num_computed: int) -> None:
        tokens, held = self.tokens[rid], self.kv.block_ids(rid)
        self.kv.cache_computed(rid, tokens, num_computed)
        num_full = min(num_computed, len(tokens)) // BLOCK_SIZE
        for i in range(self.hashed[rid], min(num_full, len(held))):
            self.stored.setdefault(tuple(tokens[: (i + 1) * BLOCK_SIZE]), held[i])
        self.hashed[rid] = max(self.hashed[rid], min(num_full, len(held)))

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data) -> None:
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.kv.free(rid)
        del self.tokens[rid], self.hashed[rid]

    @rule(tokens=TOKENS)
    def lookup(self, tokens: list[int]) -> None:
        assert self.kv.find_cached_prefix(tokens) == len(self._model_hits(tokens)) * BLOCK_SIZE
        overlap = len(self._model_hits(tokens, cap=False))
        index_overlap = self.index.overlap_blocks(prefix_block_hashes(tokens, BLOCK_SIZE))
        assert index_overlap == ({"w": overlap} if overlap else {})

    @invariant()
    def blocks_are_accounted_for(self) -> None:
        holders = [0] * self.kv.num_total_blocks
        for rid in self.tokens:
            held = self.kv.block_ids(rid)
            assert len(set(held)) == len(held)
            for block in held:
                holders[block] += 1
        free = self.kv.free_block_ids()
        assert sorted(free) == [b for b, n in enumerate(holders) if n == 0]
        assert len(free) + sum(1 for n in holders if n) == self.kv.num_total_blocks
        for block, n in enumerate(holders):
            assert self.kv.ref_count(block) == n >= 0
            if n > 1:
                assert self.kv.block_hash(block) is not None  # only cached prefix blocks are shared

    @invariant()
    def cache_matches_model(self) -> None:
        assert self.kv.num_cached_blocks == len(self.stored)
        for prefix, block in self.stored.items():
            assert self.kv.block_hash(block) == prefix_block_hashes(prefix, BLOCK_SIZE)[-1]
        self.index.apply_all("w", self.kv.drain_events())
        assert self.index.num_blocks("w") == len(self.stored)


KVCacheMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestKVCacheMachine = KVCacheMachine.TestCase
