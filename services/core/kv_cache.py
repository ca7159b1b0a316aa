"""Paged KV block pool with prefix caching, and the router's index of which instance caches which blocks.

The KV cache of one engine instance is `num_blocks` fixed-size blocks (ids 0..num_blocks-1) of `block_size`
tokens each. A request holds a list of blocks covering its tokens. A *full* computed block is keyed by a chained
hash of (parent block hash, the block's token ids, extra_key), so equal hashes mean equal prefixes, and a later
request with the same prefix reuses the blocks instead of recomputing them (the idea of vLLM v1's block pool).

Invariants:
- Every block is either held (ref count >= 1, by that many requests) or in the free list (ref count 0); so
  `num_free_blocks + held blocks == num_total_blocks`. A block is held twice only when it is a cached prefix block
  that two requests share; a request never holds the same block twice.
- A hash maps to at most one block (`_hash_to_block`), and that block's `_block_hashes` entry is the hash. If an
  identical block is computed again elsewhere, the existing mapping is kept and the copy stays anonymous.
- The free list is the LRU order, so the pool needs no clock: allocation pops from the head; a freed request's
  cached blocks go to the tail in reverse order (its last block is evicted first, since a longer prefix is less
  likely to be shared); its blocks without cached content go to the head, since evicting them costs nothing.
  A free block that still holds a hash can be hit by a prefix lookup, which takes it out of the free list; popping
  it for a new allocation evicts its hash (a `BlockRemoved` event).
- Running out of blocks is a return value (`allocate` -> None), and a failed allocation changes nothing.
- Hashes are 64-bit blake2b digests of bytes, identical in every process (PYTHONHASHSEED does not matter), so the
  router can compute them with `prefix_block_hashes` and match them against instances' `BlockStored` events.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache

from octoserve.services.core.types import BlockRemoved, BlockStored, KVEvent

_TOKEN_BYTES = 4  # token ids are hashed as unsigned 32-bit little-endian integers
_NO_PARENT = b"\x00"  # first block of a sequence; a real parent is b"\x01" + 8 bytes, so the two never collide
_PARENT_HEAD = struct.Struct("<BQ")  # b"\x01" + the parent hash as 8 little-endian bytes
# Every digest starts from a copy of this empty 8-byte hasher: cheaper than the constructor, which parses its keyword
# arguments at each call (a simulated run hashes ~340,000 blocks).
_EMPTY_HASHER = hashlib.blake2b(digest_size=8)


@lru_cache(maxsize=64)
def _extra_key_bytes(extra_key: str) -> bytes:
    # Length-prefixed so that the key's bytes can never run into the token bytes that follow.
    raw = extra_key.encode("utf-8")
    return len(raw).to_bytes(4, "little") + raw


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    packed = array("I", token_ids)  # OverflowError for ids outside 0..2**32-1: no vocabulary is that large
    if sys.byteorder == "big":
        packed.byteswap()  # the same hash on every machine, not only in every process
    return packed.tobytes()


def _digest(parent_hash: int | None, extra: bytes, block_bytes: bytes) -> int:
    head = _NO_PARENT if parent_hash is None else _PARENT_HEAD.pack(1, parent_hash)
    return _digest_of(head + extra + block_bytes)


def _digest_of(data: bytes) -> int:
    """The hash of one block from its whole input: parent head, extra key bytes, token bytes (see `_digest`)."""
    hasher = _EMPTY_HASHER.copy()
    hasher.update(data)
    return int.from_bytes(hasher.digest(), "little")


def hash_block(parent_hash: int | None, token_ids: Sequence[int], extra_key: str) -> int:
    """The 64-bit hash of one block: its parent's hash (None for the first block), its tokens, the model key."""
    return _digest(parent_hash, _extra_key_bytes(extra_key), _token_bytes(token_ids))


def _chain_hashes(
    parent_hash: int | None, token_ids: Sequence[int], first_block: int, end_block: int, block_size: int, extra: bytes
) -> list[int]:
    """Hashes of blocks first_block..end_block-1, chained from `parent_hash` (the hash of block first_block-1)."""
    data = _token_bytes(token_ids[first_block * block_size : end_block * block_size])
    step = block_size * _TOKEN_BYTES
    hashes: list[int] = []
    for offset in range(0, len(data), step):
        parent_hash = _digest(parent_hash, extra, data[offset : offset + step])
        hashes.append(parent_hash)
    return hashes


def prefix_block_hashes(token_ids: Sequence[int], block_size: int, extra_key: str = "") -> list[int]:
    """Chained hashes of every full block of `token_ids` (a trailing partial block has none)."""
    num_full = len(token_ids) // block_size
    return _chain_hashes(None, token_ids, 0, num_full, block_size, _extra_key_bytes(extra_key))


@dataclass(slots=True)
class _RequestBlocks:
    """Mutable per-request state, owned by the manager."""

    block_ids: list[int] = field(default_factory=list)  # in token order
    block_hashes: list[int] = field(default_factory=list)  # chain hash of each full computed block, in order
    num_cached_tokens: int = 0  # prefix hit taken at the first allocation


class KVCacheManager:
    """The block pool of one engine instance: allocation, reference counts, prefix cache, LRU eviction."""

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, extra_key: str = ""
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must both be >= 1")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.extra_key = extra_key
        self._extra = _extra_key_bytes(extra_key)
        self._block_struct = struct.Struct(f"<{block_size}I")  # one block's tokens as `_token_bytes` packs them
        # What a block's digest input (`_digest`) starts with, before its token bytes: the head and the extra key,
        # for a first block (head b"\x00") and, packed in one go, for a block with a parent (see `_PARENT_HEAD`).
        self._first_head = _NO_PARENT + self._extra
        self._next_head = struct.Struct(f"<BQ{len(self._extra)}s")
        self._ref_counts = [0] * num_blocks
        self._block_hashes: list[int | None] = [None] * num_blocks
        self._hash_to_block: dict[int, int] = {}
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # head = next to evict
        self._requests: dict[str, _RequestBlocks] = {}
        self._events: list[KVEvent] = []
        # The chain hashes of the blocks `_lookup` hashed last, and those blocks' tokens packed (`_token_bytes`).
        self._lookup_bytes = b""
        self._lookup_hashes: list[int] = []

    # ----- sizes -----

    @property
    def num_total_blocks(self) -> int:
        return len(self._ref_counts)

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds, cached-but-evictable ones included."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a prefix hash, held or free."""
        return len(self._hash_to_block)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / len(self._ref_counts)

    def num_blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """New blocks `request_id` needs to cover `num_tokens`, beyond those it holds (prefix hits not counted)."""
        req = self._requests.get(request_id)
        held = len(req.block_ids) if req is not None else 0
        return max(0, self._blocks_for(num_tokens) - held)

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ----- lookups (pure) -----

    def find_cached_prefix(self, token_ids: Sequence[int]) -> int:
        """Tokens of `token_ids` served from the cache: a multiple of block_size, never the whole prompt."""
        return len(self._lookup(token_ids)[0]) * self.block_size

    def _lookup(self, token_ids: Sequence[int]) -> tuple[list[int], list[int]]:
        """(hashes, block ids) of the longest cached prefix that leaves at least one token to compute."""
        if not self.enable_prefix_caching:
            return [], []
        # Only blocks that end strictly before the last token: the last token's logits must be computed.
        bs = self.block_size
        max_blocks = max(0, len(token_ids) - 1) // bs
        # Hashes depend on the tokens only, so a repeated lookup (the batcher looks a prompt up, then allocates it)
        # reuses the chain of the blocks hashed last time while its tokens are this prompt's first ones. Only the
        # blocks hashed are packed: a prompt's chain usually ends after a few blocks.
        chain = self._lookup_hashes
        if _token_bytes(token_ids[: len(chain) * bs]) != self._lookup_bytes:
            chain = self._lookup_hashes = []
            self._lookup_bytes = b""
        hashes: list[int] = []
        blocks: list[int] = []
        parent: int | None = None
        for index in range(max_blocks):
            if index == len(chain):
                block_bytes = _token_bytes(token_ids[index * bs : (index + 1) * bs])
                chain.append(_digest(parent, self._extra, block_bytes))
                self._lookup_bytes += block_bytes
            parent = chain[index]
            block = self._hash_to_block.get(parent)
            if block is None:
                break  # hash lazily: a miss ends the prefix, so later blocks are never hashed
            hashes.append(parent)
            blocks.append(block)
        return hashes, blocks

    def block_ids(self, request_id: str) -> tuple[int, ...]:
        req = self._requests.get(request_id)
        return tuple(req.block_ids) if req is not None else ()

    def num_cached_tokens(self, request_id: str) -> int:
        req = self._requests.get(request_id)
        return req.num_cached_tokens if req is not None else 0

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    def free_block_ids(self) -> tuple[int, ...]:
        """The free list in eviction order (head first)."""
        return tuple(self._free)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def block_hash(self, block_id: int) -> int | None:
        return self._block_hashes[block_id]

    # ----- allocation -----

    def can_allocate(self, request_id: str, token_ids: Sequence[int], num_tokens: int) -> bool:
        """Whether `allocate` with the same arguments would succeed now (prefix hits counted)."""
        return self._plan(request_id, token_ids, num_tokens) is not None

    def allocate(self, request_id: str, token_ids: Sequence[int], num_tokens: int) -> tuple[int, ...] | None:
        """Make `request_id` hold blocks covering its first `num_tokens` tokens.

        On the request's first call it first takes the longest cached prefix of `token_ids` (ref count +1).
        Returns the block ids newly taken by this call (prefix-hit blocks first, then fresh ones), so the
        concatenation of a request's results is `block_ids(request_id)`; None, changing nothing, when the pool
        cannot supply them.
        """
        plan = self._plan(request_id, token_ids, num_tokens)
        if plan is None:
            return None
        hit_hashes, hit_blocks, num_new = plan
        req = self._requests.get(request_id)
        if req is None:
            req = _RequestBlocks(block_hashes=hit_hashes, num_cached_tokens=len(hit_blocks) * self.block_size)
            self._requests[request_id] = req
        for block in hit_blocks:
            self._take_cached(block)
        taken = hit_blocks + self._pop_free(num_new)
        req.block_ids.extend(taken)
        return tuple(taken)

    def _plan(
        self, request_id: str, token_ids: Sequence[int], num_tokens: int
    ) -> tuple[list[int], list[int], int] | None:
        """(hit hashes, hit blocks, number of fresh blocks) for an allocation, or None when it cannot fit."""
        req = self._requests.get(request_id)
        if req is None:
            hit_hashes, hit_blocks = self._lookup(token_ids)
            held = 0
        else:
            hit_hashes, hit_blocks, held = [], [], len(req.block_ids)
        num_new = max(0, self._blocks_for(num_tokens) - held - len(hit_blocks))
        # A hit block sitting in the free list leaves it when taken, so it cannot also serve as a fresh block.
        num_hits_free = sum(1 for block in hit_blocks if self._ref_counts[block] == 0)
        if num_new > len(self._free) - num_hits_free:
            return None
        return hit_hashes, hit_blocks, num_new

    def _take_cached(self, block: int) -> None:
        if self._ref_counts[block] == 0:
            del self._free[block]
        self._ref_counts[block] += 1

    def _pop_free(self, count: int) -> list[int]:
        taken: list[int] = []
        evicted: list[int] = []
        free, block_hashes, ref_counts = self._free, self._block_hashes, self._ref_counts
        for _ in range(count):
            block, _ = free.popitem(last=False)
            block_hash = block_hashes[block]
            if block_hash is not None:
                block_hashes[block] = None
                del self._hash_to_block[block_hash]
                evicted.append(block_hash)
            ref_counts[block] = 1
            taken.append(block)
        if evicted:
            self._events.append(BlockRemoved(tuple(evicted)))
        return taken

    # ----- caching -----

    def cache_computed(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Enter the request's full blocks among its first `num_computed_tokens` tokens into the prefix cache.

        `token_ids` is the request's whole known sequence (prompt + output so far); calls must agree on it.
        Raises KeyError for a request that holds no allocation.
        """
        req = self._requests[request_id]
        if not self.enable_prefix_caching:
            return
        num_full = min(num_computed_tokens, len(token_ids)) // self.block_size
        num_full = min(num_full, len(req.block_ids))
        first = len(req.block_hashes)
        if num_full <= first:
            return  # the common decode step: no block became full
        parent = req.block_hashes[-1] if first else None
        hashes = _chain_hashes(parent, token_ids, first, num_full, self.block_size, self._extra)
        req.block_hashes.extend(hashes)
        self._register(parent, req.block_ids[first:num_full], hashes)

    def cache_next_block(self, request_id: str, num_full: int, block_token_ids: Sequence[int]) -> bool:
        """`cache_computed` for a request whose computed tokens just filled block `num_full - 1` when the blocks
        before it are cached already (a decode, block by block): `block_token_ids` are that block's tokens.
        Returns False, changing nothing, when that is not the case (call `cache_computed`)."""
        return self.cache_next_block_bytes(request_id, num_full, self._block_struct.pack(*block_token_ids))

    def cache_next_block_bytes(self, request_id: str, num_full: int, block_bytes: bytes) -> bool:
        """`cache_next_block` with the block's tokens already packed as `_token_bytes` packs them (the simulator
        slices them from its token formula's packed cycle, `sim_executor.sim_token_bytes`)."""
        req = self._requests[request_id]
        if not self.enable_prefix_caching:
            return True
        hashes = req.block_hashes
        first = len(hashes)
        if first != num_full - 1 or num_full > len(req.block_ids):
            return False
        parent: int | None = None
        if first:
            parent = hashes[-1]
            block_hash = _digest_of(self._next_head.pack(1, parent, self._extra) + block_bytes)
        else:
            block_hash = _digest_of(self._first_head + block_bytes)
        hashes.append(block_hash)
        hash_to_block = self._hash_to_block
        if block_hash in hash_to_block:
            return True  # cached in another block already: this copy stays anonymous (see `_register`)
        block = req.block_ids[first]
        hash_to_block[block_hash] = block
        self._block_hashes[block] = block_hash
        self._events.append(BlockStored((block_hash,), parent))
        return True

    def _register(self, parent: int | None, blocks: list[int], hashes: list[int]) -> None:
        """Map each new hash to its block; one BlockStored event per contiguous run of newly stored hashes."""
        run: list[int] = []
        run_parent = parent
        for block, block_hash in zip(blocks, hashes):
            if block_hash in self._hash_to_block:
                # Already cached in another block (computed concurrently): keep that mapping, this copy stays
                # anonymous and is reused like any uncached block once freed.
                self._flush_stored(run, run_parent)
                run = []
            else:
                if not run:
                    run_parent = parent
                self._hash_to_block[block_hash] = block
                self._block_hashes[block] = block_hash
                run.append(block_hash)
            parent = block_hash
        self._flush_stored(run, run_parent)

    def _flush_stored(self, run: list[int], parent: int | None) -> None:
        if run:
            self._events.append(BlockStored(tuple(run), parent))

    # ----- release -----

    def free(self, request_id: str) -> None:
        """Release the request's blocks. Freeing an unknown (or already freed) request does nothing."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return
        free, block_hashes, ref_counts = self._free, self._block_hashes, self._ref_counts
        for block in reversed(req.block_ids):
            ref_counts[block] -= 1
            if ref_counts[block] > 0:
                continue  # still shared with another request
            free[block] = None
            if block_hashes[block] is None:
                free.move_to_end(block, last=False)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Only when no request holds blocks (as vLLM): else returns False, no change."""
        if len(self._free) != len(self._ref_counts):
            return False
        evicted = [h for h in self._block_hashes if h is not None]
        self._block_hashes = [None] * len(self._ref_counts)
        self._hash_to_block.clear()
        if evicted:
            self._events.append(BlockRemoved(tuple(evicted)))
        return True

    def drain_events(self) -> list[KVEvent]:
        """KV events since the last drain, oldest first."""
        events, self._events = self._events, []
        return events


class PrefixIndex:
    """Router side: which instance caches which block hashes, learnt only from the instances' KV events.

    Exact (no sampling, no clock): an instance holds a hash from its BlockStored until its BlockRemoved. The
    hashes are only comparable when the router hashes prompts with the instance's block_size and extra_key.

    Memory: the index mirrors every cached block of every instance (up to the node's total KV blocks, ~145,000
    on the default placement), so an entry is one dict item, hash -> bitmask of the instances holding it (bit i:
    the i-th instance seen). A set of holders per hash cost ~4x as much and made the router's RSS climb by tens
    of MiB as the workers' caches filled.
    """

    def __init__(self) -> None:
        self._holders: dict[int, int] = {}  # block hash -> bitmask of the instances caching it
        self._bits: dict[str, int] = {}  # instance -> its bit
        self._names: list[str] = []  # bit index -> instance
        self._counts: dict[str, int] = {}  # instance -> block hashes it caches

    def _bit(self, instance_id: str) -> int:
        bit = self._bits.get(instance_id)
        if bit is None:
            bit = self._bits[instance_id] = 1 << len(self._names)
            self._names.append(instance_id)
        return bit

    def apply(self, instance_id: str, event: KVEvent) -> None:
        self.apply_all(instance_id, (event,))

    def apply_all(self, instance_id: str, events: Iterable[KVEvent]) -> None:
        """Apply an instance's events in order (a simulated step brings ~7 of them: one lookup of its bit)."""
        bit, holders = self._bit(instance_id), self._holders
        changed = 0
        for event in events:
            if isinstance(event, BlockStored):
                for block_hash in event.block_hashes:
                    mask = holders.get(block_hash, 0)
                    if not mask & bit:
                        holders[block_hash] = mask | bit
                        changed += 1
            else:
                for block_hash in event.block_hashes:
                    mask = holders.get(block_hash, 0)
                    if mask & bit:
                        changed -= 1
                        if mask == bit:
                            del holders[block_hash]
                        else:
                            holders[block_hash] = mask & ~bit
        if changed:
            self._counts[instance_id] = self._counts.get(instance_id, 0) + changed

    def remove_instance(self, instance_id: str) -> None:
        """Forget an instance (it restarted, reset its cache, or left); O(hashes indexed)."""
        bit = self._bits.get(instance_id)
        if bit is None or not self._counts.pop(instance_id, 0):
            return
        holders = self._holders
        for block_hash, mask in list(holders.items()):
            if mask & bit:
                if mask == bit:
                    del holders[block_hash]
                else:
                    holders[block_hash] = mask & ~bit

    def num_blocks(self, instance_id: str) -> int:
        return self._counts.get(instance_id, 0)

    def num_hashes(self) -> int:
        """Distinct block hashes held by any instance: the index's size."""
        return len(self._holders)

    def overlap_blocks(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """instance -> number of leading hashes of `block_hashes` it caches; instances with none are absent."""
        overlap: dict[str, int] = {}
        alive, depth = -1, 0
        for block_hash in block_hashes:
            still = alive & self._holders.get(block_hash, 0)
            if still != alive:
                self._record(overlap, alive & ~still, depth)  # those that stop here matched `depth` blocks
                if not still:
                    return overlap
                alive = still
            depth += 1
        self._record(overlap, alive, depth)
        return overlap

    def prompt_overlap_blocks(self, token_ids: Sequence[int], block_size: int, extra_key: str = "") -> dict[str, int]:
        """`overlap_blocks(prefix_block_hashes(token_ids, block_size, extra_key))`, hashing the prompt's blocks
        only as far as some instance still caches the chain (a chain hash that no instance holds ends every
        match, so the blocks after it cannot change the answer): the router asks this at every arrival."""
        holders = self._holders
        overlap: dict[str, int] = {}
        num_full = len(token_ids) // block_size
        if not holders or not num_full:
            return overlap
        extra = _extra_key_bytes(extra_key)
        alive, depth, parent_hash = -1, 0, None
        # Most chains end within a few blocks: the prompt's tokens are packed a few blocks at a time, doubling.
        done, batch = 0, 4
        while done < num_full:
            end = min(num_full, done + batch)
            data = _token_bytes(token_ids[done * block_size : end * block_size])
            for block in range(end - done):
                parent_hash = _digest(parent_hash, extra, data[block * block_size * _TOKEN_BYTES :
                                                               (block + 1) * block_size * _TOKEN_BYTES])
                still = alive & holders.get(parent_hash, 0)
                if still != alive:
                    self._record(overlap, alive & ~still, depth)
                    if not still:
                        return overlap
                    alive = still
                depth += 1
            done, batch = end, 2 * batch
        self._record(overlap, alive, depth)
        return overlap

    def _record(self, overlap: dict[str, int], mask: int, depth: int) -> None:
        if depth == 0:
            return
        while mask:
            low = mask & -mask
            overlap[self._names[low.bit_length() - 1]] = depth
            mask ^= low
