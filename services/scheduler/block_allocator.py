"""Paged KV blocks: which of the replica's blocks are free. The shard holds the tensors."""

from __future__ import annotations

from collections import deque

from libs.runtime.settings import BLOCK_SIZE


def blocks_for(tokens: int) -> int:
    return -(-tokens // BLOCK_SIZE)


class BlockAllocator:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"{n} KV blocks wanted, {len(self._free)} free")
        return [self._free.popleft() for _ in range(n)]

    def release(self, blocks: list[int]) -> None:
        self._free.extend(blocks)
