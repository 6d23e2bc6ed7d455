"""Mutants of KV cache groups: the window arithmetic, the freeing of skipped blocks, the hit, the keys.

Each is the reference manager with one group manager (vLLM's
`SingleTypeKVCacheManager`) that makes one plausible mistake, run with the
layout where it shows: full attention and a sliding window of 8 tokens.
"""

from __future__ import annotations

from kvspec.conformance.targets.builtin import ReferenceManagerAdapter
from kvspec.conformance.tools.mutants import Mutant
from kvspec.reference.kv_cache_manager import _GroupManager
from kvspec.spec.state import NULL_BLOCK_ID, BlockHash, BlockId

__all__ = ["MUTANTS"]

LAYOUT = "full,sliding:8"


class _KeepsSkipped(_GroupManager):
    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        return  # MUTANT: the blocks outside the window are never freed


class SkippedBlockNotFreed(ReferenceManagerAdapter):
    """`remove_skipped_blocks` is never called: a sliding window holds every block it ever took.

    Nothing breaks at once, but the pool fills with blocks no token reads,
    so allocations fail (and requests are preempted) that vLLM would serve.
    """

    group_manager_cls = _KeepsSkipped


class _FreesHeadFirst(_GroupManager):
    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        blocks = self.req_to_blocks.get(request_id)
        skipped = self.skipped_blocks(num_computed_tokens)
        if not blocks or not skipped:
            return
        freed: list[BlockId] = []
        for i in range(min(skipped, len(blocks))):  # MUTANT: from the first block up, not from the last down
            if blocks[i] != NULL_BLOCK_ID:
                freed.append(blocks[i])
                blocks[i] = NULL_BLOCK_ID
        if freed:
            self.pool.free_blocks(freed)


class SkippedFreedHeadFirst(ReferenceManagerAdapter):
    """The blocks a window leaves are freed first block first, where vLLM walks back from the last one.

    The free queue then holds them in the other order: the earlier block,
    the one more requests share, is evicted before the later one.
    """

    group_manager_cls = _FreesHeadFirst


class _WindowOneBlockShort(_GroupManager):
    def skipped_tokens(self, num_computed_tokens: int) -> int:
        skipped = super().skipped_tokens(num_computed_tokens)
        if self.group.kind == "sliding" and skipped:
            return skipped + self.block_size  # MUTANT: the window is taken one block shorter
        return skipped


class WindowOffByOneBlock(ReferenceManagerAdapter):
    """A sliding window skips one block more than it may: a block the next token still reads is freed.

    Its KV is gone while the window still covers it: the next token
    attends to the null block's zeros where there were real keys and values.
    """

    group_manager_cls = _WindowOneBlockShort


class _WindowHitOneShort(_GroupManager):
    def blocks_for_window_hit(self) -> int:
        return super().blocks_for_window_hit() - 1  # MUTANT: one block fewer than the window reads


class HitLongerThanWindowAllows(ReferenceManagerAdapter):
    """The sliding-window hit is satisfied by one cached block fewer than the window needs.

    The search stops at a run of cdiv(W - 1, B) - 1 cached blocks, so the hit
    reaches further than the cached blocks support: the first token to
    compute reads a position of its window that holds the null block.
    """

    group_manager_cls = _WindowHitOneShort


class _KeyWithoutGroup(_GroupManager):
    def key(self, block_hash: BlockHash) -> BlockHash:
        return block_hash  # MUTANT: the group id is left out of the key


class KeyWithoutGroupId(ReferenceManagerAdapter):
    """Every group registers its blocks under the bare block hash, without its group id.

    Two groups' blocks for the same tokens then share one hash-table key,
    and a group's hit can return another group's block: KV computed by
    other layers.
    """

    group_manager_cls = _KeyWithoutGroup


MUTANTS: list[Mutant] = [
    Mutant(
        name="skipped_block_not_freed",
        description="a sliding-window group never frees the blocks its window has left",
        level="manager",
        factory=SkippedBlockNotFreed,
        kind="a skipped block not freed",
        groups=LAYOUT,
    ),
    Mutant(
        name="skipped_freed_head_first",
        description="the blocks a window leaves are freed first block first, not last block first",
        level="manager",
        factory=SkippedFreedHeadFirst,
        kind="skipped blocks freed head first",
        groups=LAYOUT,
    ),
    Mutant(
        name="window_off_by_one_block",
        description="a sliding window skips one block more than it may, freeing a block the next token reads",
        level="manager",
        factory=WindowOffByOneBlock,
        kind="a window off by one block",
        groups=LAYOUT,
    ),
    Mutant(
        name="hit_longer_than_window_allows",
        description="the sliding-window hit needs one cached block fewer than the window reads",
        level="manager",
        factory=HitLongerThanWindowAllows,
        kind="a hit longer than the window allows",
        groups=LAYOUT,
    ),
    Mutant(
        name="key_without_group_id",
        description="every group registers its blocks under the bare hash, without its group id",
        level="manager",
        factory=KeyWithoutGroupId,
        kind="a key without its group id",
        groups=LAYOUT,
    ),
]
