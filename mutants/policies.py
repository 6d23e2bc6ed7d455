"""Mutants of seed 002's keyed policies: a key read the wrong way, a stamp forgotten, first fit backwards.

Each claims the keyed profile it breaks and is the reference with one change
to its keyed free blocks (kvspec.reference.keyed_free): every block, hash and
ref_cnt stays right, only the order the pool evicts in is wrong, which the
harness sees when a later allocation takes the wrong block.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from kvspec.conformance.core.adapter import AdapterConfig
from kvspec.conformance.targets.builtin import ReferencePoolAdapter
from kvspec.conformance.tools.mutants import Mutant
from kvspec.reference.free_queue import KVCacheBlock
from kvspec.reference.keyed_free import Key, KeyedFreeBlocks
from kvspec.spec.ordering import profile_rule

__all__ = ["MUTANTS"]


class _KeyedMutant(ReferencePoolAdapter):
    """The reference pool with its keyed free blocks replaced by a mutated `structure`."""

    structure: type[KeyedFreeBlocks] = KeyedFreeBlocks

    def __init__(self, config: AdapterConfig) -> None:
        super().__init__(config)
        if self._keyed is not None:  # under a queue profile the mutation has nothing to change
            keyed = self.structure(self.blocks, profile_rule(self.profile))
            KeyedFreeBlocks.popleft_n(keyed, 1)  # the null block, as the pool's constructor takes it
            self._keyed = keyed
            self.free_block_queue = keyed


class _TiesNewestFirst(KeyedFreeBlocks):
    def _key(self, b: int) -> Key:
        return (self.num_accesses[b], -self.last_access[b], b)  # MUTANT: `last_access`, not its negation


class LfuTiesNewestFirst(_KeyedMutant):
    """LFU's key breaks a tie on the access count by the most recent access first.

    Among blocks used equally often the one just used goes first: the
    recency half of the tie-break reads the wrong way round.
    """

    structure = _TiesNewestFirst


class _HitNotCounted(KeyedFreeBlocks):
    def hit(self, block_ids: Sequence[int]) -> None:
        clock, last = self.clock, self.last_access
        for i, b in enumerate(block_ids):
            last[b] = clock + i  # MUTANT: no `num_accesses[b] += 1`
        self.clock = clock + len(block_ids)


class HitNotCounted(_KeyedMutant):
    """A prefix hit refreshes the block's last access but does not count it.

    LFU then orders by allocations only: a block hit many times is evicted as
    soon as one that was never hit.
    """

    structure = _HitNotCounted


class _FreeKeepsTimestamp(KeyedFreeBlocks):
    def freed(self, named: Sequence[int], newly_free: Sequence[KVCacheBlock], evict_first: bool) -> None:
        for b in named:  # their tier, as the reference gives it
            self.is_evict_first[b] = evict_first
        for block in newly_free:  # MUTANT: the blocks named are not stamped first
            self._add(block)


class FreeKeepsTimestamp(_KeyedMutant):
    """`free_blocks` does not stamp the blocks it is given: each keeps its allocation's stamp.

    A request's blocks were allocated head first, so the head block now looks
    oldest and goes first, before the deeper blocks that depend on it.
    """

    structure = _FreeKeepsTimestamp


class _FirstFitHighest(KeyedFreeBlocks):
    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        taken: list[KVCacheBlock] = []
        while len(taken) < n and self._first_fit:
            b = max(self._first_fit)  # MUTANT: the highest id, not heappop's lowest
            self._first_fit.remove(b)
            taken.append(self._blocks[b])
        heapq.heapify(self._first_fit)
        self.num_free_blocks -= len(taken)
        return taken + (super().popleft_n(n - len(taken)) if len(taken) < n else [])


class FirstFitHighest(_KeyedMutant):
    """First fit takes the free block with the highest id instead of the lowest."""

    structure = _FirstFitHighest


MUTANTS: list[Mutant] = [
    Mutant(
        name="lfu_ties_newest_first",
        description="lfu breaks a tie on the access count by the most recent access first",
        level="pool",
        factory=LfuTiesNewestFirst,
        kind="ties broken the other way",
        profile="lfu",
    ),
    Mutant(
        name="hit_not_counted",
        description="a prefix hit refreshes the last access but does not count an access (lfu)",
        level="pool",
        factory=HitNotCounted,
        kind="an access that does not refresh what its policy reads",
        profile="lfu",
    ),
    Mutant(
        name="free_keeps_timestamp",
        description=(
            "free_blocks does not stamp the blocks it frees, so a request's head block looks oldest (lru-timestamp)"
        ),
        level="pool",
        factory=FreeKeepsTimestamp,
        kind="an access that does not refresh what its policy reads",
        profile="lru-timestamp",
    ),
    Mutant(
        name="first_fit_highest_id",
        description="first fit hands out the free block with the highest id, not the lowest (lru-timestamp)",
        level="pool",
        factory=FirstFitHighest,
        kind="first fit taking the highest id",
        profile="lru-timestamp",
    ),
]
