"""Adapters that misbehave in one way each, to test the harness's own reporting.

These are not the mutant set (mutants/, which measures the harness's
strength); they are the cases the harness must *report* in a particular way:
a divergence, a named invariant, a state changed by a rejected call, a hash
that is renamed between steps, a Python exception, a segfault, a hang, a
factory that cannot build, an adapter with a missing method. Each factory is
importable as `tests.conformance.adapters:<name>` (pytest imports the checkout's
tests/ package), as a user's would be.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
from collections.abc import Sequence

from kvspec.conformance.core.adapter import AdapterConfig, LevelNotProvided
from kvspec.conformance.targets.builtin import ReferenceManagerAdapter, ReferencePoolAdapter
from kvspec.mutants._base import ListFreeKVCacheBlockQueue, ListQueuePool
from kvspec.reference.free_queue import KVCacheBlock
from kvspec.spec.manager import Request
from kvspec.spec.state import BlockHash, BlockId, Snapshot


class FreeHeadFirst(ReferencePoolAdapter):
    """Frees the given blocks in reverse, so a request's head block is evicted before its tail."""

    def free_blocks(self, ordered_block_ids: Sequence[BlockId]) -> None:
        super().free_blocks(list(ordered_block_ids)[::-1])


class TakenBlocksStayQueued(ReferencePoolAdapter):
    """Hands out blocks but leaves them in the free queue as well (they would be handed out twice)."""

    def get_new_blocks(self, num_blocks: int) -> list[BlockId]:
        taken = super().get_new_blocks(num_blocks)
        self.free_block_queue.append_n(self.blocks[b] for b in taken)
        return taken


class AcceptsDoubleFree(ReferencePoolAdapter):
    """Skips blocks that no request holds instead of refusing the free."""

    def free_blocks(self, ordered_block_ids: Sequence[BlockId]) -> None:
        super().free_blocks([b for b in ordered_block_ids if not self._is_free(b)])

    def _is_free(self, b: object) -> bool:
        return type(b) is int and 0 < b < self.num_gpu_blocks and self.blocks[b].ref_cnt == 0


class TakesBeforeRefusing(ReferencePoolAdapter):
    """Asked for more blocks than are free, takes what there is and only then raises PoolExhausted."""

    def get_new_blocks(self, num_blocks: int) -> list[BlockId]:
        if isinstance(num_blocks, int) and num_blocks > self.get_num_free_blocks():
            super().get_new_blocks(self.get_num_free_blocks())
        return super().get_new_blocks(num_blocks)


class HitPastCap(ReferenceManagerAdapter):
    """Lets a prompt hit all its full blocks, even the one holding its last token."""

    def get_computed_blocks(self, request: Request) -> tuple[list[BlockId], int]:
        blocks, num_tokens = super().get_computed_blocks(request)
        full = self._block_hashes(request)
        if len(blocks) == (len(request.token_ids) - 1) // self.block_size and len(blocks) < len(full):
            extra = self.block_pool.get_cached_block(full[len(blocks)])
            if extra is not None:
                blocks = [*blocks, extra]
        return blocks, len(blocks) * self.block_size


class NoChunkedGroups(ReferenceManagerAdapter):
    """Builds full-attention and sliding-window groups, and says it has no chunked local attention
    (as vLLM 0.9.2 does: no ChunkedLocalAttentionSpec)."""

    def __init__(self, config: AdapterConfig) -> None:
        if "chunked" in config.groups:
            raise LevelNotProvided(f"no chunked local attention; groups={config.groups!r} is not provided")
        super().__init__(config)


class ExitsOnChunkedGroups(ReferenceManagerAdapter):
    """Ends the process when asked to build chunked local attention: the probe of `--groups auto` builds that
    layout too, and the exit is the implementation's fault, told with a story, not kvspec failing."""

    def __init__(self, config: AdapterConfig) -> None:
        if "chunked" in config.groups:
            sys.exit(0)
        super().__init__(config)


class OtherHashFunction(ReferenceManagerAdapter):
    """Correct, but hashes with pickle-sha256 whatever the config says: conforms (hashes are names)."""

    uses_kvspec_hash_chain = False  # its own hash function: hash values can only be compared as names

    def __init__(self, config: AdapterConfig) -> None:
        other = "sha256" if config.hash_fn != "sha256" else "sha256_cbor"
        super().__init__(
            AdapterConfig(
                config.level,
                config.num_gpu_blocks,
                config.enable_caching,
                config.profile,
                config.block_size,
                other,
                config.seed,
            )
        )


class DriftingHashes(ReferencePoolAdapter):
    """Reports each snapshot's hashes under fresh names: consistent within a snapshot, not across steps."""

    def __init__(self, config: AdapterConfig) -> None:
        super().__init__(config)
        self.num_snapshots = 0

    def snapshot(self, block_tables: tuple[tuple[str, tuple[BlockId, ...]], ...] | None = None) -> Snapshot:
        self.num_snapshots += 1
        s = super().snapshot(block_tables)
        salt = b"%d:" % self.num_snapshots

        def rename(h: BlockHash | None) -> BlockHash | None:
            return None if h is None else BlockHash(salt + h)

        return Snapshot(
            s.num_gpu_blocks,
            s.enable_caching,
            s.ref_cnt,
            tuple(rename(h) for h in s.block_hash),
            s.free_queue,
            tuple((BlockHash(salt + h), b) for h, b in s.hash_to_blocks),
            s.block_tables,
            s.quarantined,
        )


class CrashOnLongFree(ReferencePoolAdapter):
    """Raises KeyError when asked to free three blocks or more."""

    def free_blocks(self, ordered_block_ids: Sequence[BlockId]) -> None:
        if len(ordered_block_ids) >= 3:
            raise KeyError("free list overflow")
        super().free_blocks(ordered_block_ids)


class SegfaultOnTouch(ReferencePoolAdapter):
    """Dereferences a null pointer when two blocks are touched at once: the process dies."""

    def touch(self, block_ids: Sequence[BlockId]) -> None:
        if len(block_ids) >= 2:
            ctypes.string_at(0)
        super().touch(block_ids)


class HangOnReset(ReferencePoolAdapter):
    """Spins forever when asked to reset while blocks are held."""

    def reset_prefix_cache(self) -> bool:
        while self.free_block_queue.num_free_blocks < self.num_gpu_blocks - 1:
            pass
        return super().reset_prefix_cache()


class HangInC(ReferencePoolAdapter):
    """Sleeps with the alarm signal blocked when asked to reset while blocks are held (a hang in C)."""

    def reset_prefix_cache(self) -> bool:
        if self.free_block_queue.num_free_blocks < self.num_gpu_blocks - 1:
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
            time.sleep(3600)
        return super().reset_prefix_cache()


class ExitsOnTouch(ReferencePoolAdapter):
    """Calls sys.exit(0) when a block is touched: the implementation tries to end the process."""

    def touch(self, block_ids: Sequence[BlockId]) -> None:
        sys.exit(0)


class OsExitOnTouch(ReferencePoolAdapter):
    """Calls os._exit(3) when a block is touched: the process ends at once, no handler runs."""

    def touch(self, block_ids: Sequence[BlockId]) -> None:
        os._exit(3)


class KillsItselfOnTouch(ReferencePoolAdapter):
    """Sends itself SIGKILL when a block is touched."""

    def touch(self, block_ids: Sequence[BlockId]) -> None:
        os.kill(os.getpid(), signal.SIGKILL)


def make_never_returns(config: AdapterConfig) -> object:
    """A factory that never returns (a build that waits forever, say on a lock or a device)."""
    while True:
        time.sleep(0.05)


def make_slow_import(config: AdapterConfig) -> object:
    """A factory whose first build takes 1.5 s (a slow import, as vLLM's on a loaded machine), then is quick."""
    global _imported
    if not _imported:
        time.sleep(1.5)
        _imported = True
    return ReferencePoolAdapter(config)


_imported = False
make_never_returns.levels = make_slow_import.levels = ("pool",)  # type: ignore[attr-defined]


class _RightEndQueue(ListFreeKVCacheBlockQueue):
    """A free queue whose blocks are handed out from the wrong end: the right (most recently freed) first."""

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        taken = self._blocks[len(self._blocks) - n :][::-1]
        del self._blocks[len(self._blocks) - n :]
        return taken


class TakesFromTheRightEnd(ListQueuePool):
    """The reference pool, but get_new_blocks takes blocks from the right end of the free queue."""

    def __init__(self, config: AdapterConfig) -> None:
        super().__init__(config)
        self.free_block_queue = _RightEndQueue(self.free_block_queue)  # type: ignore[assignment]


class NoFreeBlocks:
    """A pool adapter that forgot free_blocks."""

    def __init__(self, config: AdapterConfig) -> None:
        self.pool = ReferencePoolAdapter(config)

    def get_new_blocks(self, num_blocks: int) -> list[BlockId]:
        return self.pool.get_new_blocks(num_blocks)

    def touch(self, block_ids: Sequence[BlockId]) -> None:
        self.pool.touch(block_ids)

    def get_cached_block(self, block_hash: BlockHash) -> BlockId | None:
        return self.pool.get_cached_block(block_hash)

    def cache_full_blocks(self, block_ids: Sequence[BlockId], block_hashes: Sequence[BlockHash]) -> None:
        self.pool.cache_full_blocks(block_ids, block_hashes)

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def snapshot(self) -> Snapshot:
        return self.pool.snapshot()


def broken_factory(config: AdapterConfig) -> object:
    """A factory whose construction fails (a missing device, a bad config, ...)."""
    raise RuntimeError(f"no device for num_gpu_blocks={config.num_gpu_blocks}")


def pool_only(cls: type[ReferencePoolAdapter]) -> object:
    """A factory for `cls` at the pool level and the reference at the request level."""

    def factory(config: AdapterConfig) -> object:
        return cls(config) if config.level == "pool" else ReferenceManagerAdapter(config)

    factory.__name__ = f"make_{cls.__name__}"
    return factory


def manager_only(cls: type[ReferenceManagerAdapter]) -> object:
    """A factory for `cls` at the request level and the reference pool at the pool level."""

    def factory(config: AdapterConfig) -> object:
        return cls(config) if config.level == "manager" else ReferencePoolAdapter(config)

    factory.__name__ = f"make_{cls.__name__}"
    return factory


make_free_head_first = pool_only(FreeHeadFirst)
make_taken_blocks_stay_queued = pool_only(TakenBlocksStayQueued)
make_accepts_double_free = pool_only(AcceptsDoubleFree)
make_takes_before_refusing = pool_only(TakesBeforeRefusing)
make_drifting_hashes = pool_only(DriftingHashes)
make_crash_on_long_free = pool_only(CrashOnLongFree)
make_segfault_on_touch = pool_only(SegfaultOnTouch)
make_hang_on_reset = pool_only(HangOnReset)
make_hang_in_c = pool_only(HangInC)
make_takes_from_the_right_end = pool_only(TakesFromTheRightEnd)
make_exits_on_touch = pool_only(ExitsOnTouch)
make_os_exit_on_touch = pool_only(OsExitOnTouch)
make_kills_itself_on_touch = pool_only(KillsItselfOnTouch)
make_hit_past_cap = manager_only(HitPastCap)
make_other_hash_function = manager_only(OtherHashFunction)
make_exits_on_chunked_groups = manager_only(ExitsOnChunkedGroups)


def make_no_free_blocks(config: AdapterConfig) -> object:
    """The adapter without free_blocks."""
    return NoFreeBlocks(config)


NOT_CALLABLE = 42  # for load_factory's "not callable" error


def make_pool_only(config: AdapterConfig) -> object:
    """A pool implementation's factory that ignores the level it is asked for (it has no request level)."""
    return ReferencePoolAdapter(config)


class AssertsOnOverallocation(ReferencePoolAdapter):
    """Refuses a too-large allocation with an AssertionError where the spec raises PoolExhausted."""

    def get_new_blocks(self, num_blocks: int) -> list[BlockId]:
        assert num_blocks <= self.get_num_free_blocks(), "not enough free blocks"
        return super().get_new_blocks(num_blocks)


def make_asserts_on_overallocation(config: AdapterConfig) -> object:
    return AssertsOnOverallocation(config) if config.level == "pool" else ReferenceManagerAdapter(config)


class NoEvictBlocks(ReferencePoolAdapter):
    """The reference pool without the optional evict_blocks (as vLLM before 0.13.0)."""

    evict_blocks = None  # type: ignore[assignment]


make_no_evict_blocks = pool_only(NoEvictBlocks)
