"""Paged KV blocks: which of the replica's blocks are free, shared or cached. The shard holds the tensors.

A block is in one of three states:
- in use: held by one or more running sequences (a reference count; a prefix-cache hit shares blocks);
- cached: no longer held, but it holds the KV of a known full block of tokens (its chain hash is indexed), so
  a later prompt with that prefix can take it back instead of recomputing it; kept in LRU order;
- free: holds nothing worth keeping.
Allocation takes free blocks first, then evicts cached ones, least recently used first. `free` counts both
(what an allocation can get).
"""

from __future__ import annotations

from collections import OrderedDict, deque

from libs.runtime.settings import BLOCK_SIZE


def blocks_for(tokens: int, block_size: int = BLOCK_SIZE) -> int:
    return -(-tokens // block_size)


class BlockAllocator:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, bytes] = {}  # block → chain hash of the tokens it holds (indexed blocks)
        self._by_hash: dict[bytes, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached blocks nobody holds, oldest first

    @property
    def free(self) -> int:
        """Blocks an allocation can take now (free + cached but unheld)."""
        return len(self._free) + len(self._lru)

    @property
    def cached(self) -> int:
        """Blocks whose KV is indexed by a chain hash (held or not)."""
        return len(self._hash_of)

    def allocate(self, n: int) -> list[int]:
        if n > self.free:
            raise MemoryError(f"{n} KV blocks wanted, {self.free} free")
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.popleft()
            else:  # evict the least recently used cached block
                b, _ = self._lru.popitem(last=False)
                del self._by_hash[self._hash_of.pop(b)]
            self._refs[b] = 1
            out.append(b)
        return out

    def release(self, blocks: list[int]) -> None:
        for b in blocks:
            self._refs[b] -= 1
            if self._refs[b] == 0:
                if b in self._hash_of:
                    self._lru[b] = None  # most recently used end
                else:
                    self._free.append(b)

    # ---- prefix cache ---------------------------------------------------------------------------
    def forget_cache(self) -> None:
        """The KV behind the index is gone (the shard restarted): unheld cached blocks become plain free blocks
        and no hash names a block any more. Call it only when nothing is held."""
        self._free.extend(self._lru)
        self._lru.clear()
        self._hash_of.clear()
        self._by_hash.clear()

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """The blocks of the longest cached prefix of a chain of block hashes (not yet held)."""
        out = []
        for h in hashes:
            b = self._by_hash.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def unheld(self, blocks: list[int]) -> int:
        """How many of `blocks` are cached but unheld (taking them lowers `free`)."""
        return sum(1 for b in blocks if self._refs[b] == 0)

    def acquire(self, blocks: list[int]) -> None:
        """Hold cached blocks (a prefix hit); they leave the LRU until released."""
        for b in blocks:
            if self._refs[b] == 0:
                del self._lru[b]
            self._refs[b] += 1

    def register(self, block: int, chain_hash: bytes) -> None:
        """A held block now holds the full block of tokens `chain_hash` names. A hash that is already indexed
        (computed twice, concurrently) keeps its first block; this one stays private and is freed normally."""
        if chain_hash in self._by_hash or block in self._hash_of:
            return
        self._by_hash[chain_hash] = block
        self._hash_of[block] = chain_hash
