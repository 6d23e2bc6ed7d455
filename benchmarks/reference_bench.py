"""Per-operation cost of the reference model as the pool grows: flat is the claim.

The reference's docstrings claim O(1) work per block for every pool operation
(a linked free queue, hash maps). This benchmark checks that claim the only way
it can be checked: it runs the same operations on pools of 1e3 to 1e6 blocks,
side by side in one process, and prints each size's time per call beside its
ratio to the smallest pool's. A flat row (ratios near 1x) supports the claim;
a row that grows with the pool refutes it. Absolute numbers depend on the
machine; only the ratios are the result.

Every pool is measured in the state where eviction costs the most: full of
cached blocks (every block but the null block registered and free, in a
shuffled order), so each `get_new_blocks` evicts a hash and each `touch`
unlinks a block from the middle of the queue. Each call is timed on its own
(with the garbage collector off, as `timeit` does) and the median is reported.
The last row, `snapshot` (which walks every block), shows what a cost that
grows with the pool looks like: about 1000x from 1e3 to 1e6 blocks.

Expect some growth even in an O(1) row: a larger pool spreads its blocks and
hash-map entries over more memory, so the same few pointer hops miss the CPU
caches more often. That is a constant factor bounded by the memory hierarchy
(a few x over a 1000x larger pool), not work that grows with the pool.

This is a benchmark, not a test: run it with `kvspec bench reference`.
"""

from __future__ import annotations

import dataclasses
import gc
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvspec.conformance.targets.vllm.lightmode import LightModeError
from kvspec.conformance.targets.vllm.v0 import load_lru_evictor
from kvspec.conformance.tools.commands._arguments import (
    OneLineParser,
    integer,
    json_output,
    release_number,
    text_for_people,
)
from kvspec.conformance.tools.commands._check_output import write_json
from kvspec.conformance.tools.simulate import available_memory
from kvspec.gpu_impl.sizing import format_size  # plain arithmetic: no torch
from kvspec.reference import BlockPool, KVCacheManager
from kvspec.reference.free_queue import KVCacheBlock
from kvspec.reference.keyed_free import KeyedFreeBlocks
from kvspec.spec.manager import Request
from kvspec.spec.ordering import profile_rule
from kvspec.spec.state import BlockHash, BlockId

__all__ = [
    "DEFAULT_SIZES",
    "OPERATIONS",
    "EvictorMeasurement",
    "Measurement",
    "main",
    "measure",
    "measure_v0_evictor",
    "render",
    "render_v0_evictor",
]

DEFAULT_SIZES = (1_000, 10_000, 100_000, 1_000_000)
BATCH = 16  # blocks per call: a request's worth (vLLM frees and allocates a request's blocks at once)
BLOCK_SIZE = 16  # tokens per block for the request cycle
PROMPT_BLOCKS = 8  # a request of 8 blocks: 4 shared with every other request (a system prompt), 4 its own
SHARED_BLOCKS = 4

OPERATIONS = (
    f"get_new_blocks({BATCH})",
    f"cache_full_blocks({BATCH})",
    f"free_blocks({BATCH})",
    f"touch({BATCH})",
    "get_cached_block",
    "request cycle",
    "snapshot (O(n), for scale)",
)
# The memory one pool takes, measured with the peak resident set at 1e6 blocks: about 710 bytes a block
# (a pool full of cached blocks, their hashes and the hash map); rounded up.
BYTES_PER_POOL_BLOCK = 1_000
SCALE_CALLS = 3  # the O(n) row is timed this many times per size: it only shows what growth looks like


@dataclass(frozen=True)
class Measurement:
    """The median time of one call of `operation` on a pool of `num_gpu_blocks`."""

    operation: str
    num_gpu_blocks: int
    seconds: float  # median over the calls timed
    num_calls: int


class _Hashes:
    """Fresh, distinct block hashes (their values do not matter to the pool, only their identity)."""

    def __init__(self) -> None:
        self._next = 0

    def take(self, n: int) -> list[BlockHash]:
        start, self._next = self._next, self._next + n
        return [BlockHash(i.to_bytes(8, "little")) for i in range(start, start + n)]


def _fill_with_cached_blocks(pool: BlockPool, hashes: _Hashes, rng: random.Random) -> None:
    """Register every block and free them all in a shuffled order: a full prefix cache."""
    taken = pool.get_new_blocks(pool.get_num_free_blocks())
    pool.cache_full_blocks(taken, hashes.take(len(taken)))
    rng.shuffle(taken)
    for start in range(0, len(taken), BATCH):
        pool.free_blocks(taken[start : start + BATCH])


def _timed(call: Callable[[], object]) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


class _PoolUnderTest:
    """One pool size: a manager over a full prefix cache, and one round of every operation."""

    def __init__(self, num_gpu_blocks: int, seed: int) -> None:
        self.num_gpu_blocks = num_gpu_blocks
        self.rng = random.Random(seed)  # the same seed for every size: the same sequence of choices
        self.manager = KVCacheManager(num_gpu_blocks, BLOCK_SIZE)
        self.pool = self.manager.block_pool  # the pool operations run on the manager's own pool
        self.hashes = _Hashes()
        _fill_with_cached_blocks(self.pool, self.hashes, self.rng)
        self.times: dict[str, list[float]] = {op: [] for op in OPERATIONS}
        self.num_requests = 0

    def round(self) -> None:
        """Time one call of each operation."""
        pool, rng, times, batch = self.pool, self.rng, self.times, min(BATCH, self.num_gpu_blocks - 1)
        get_new, cache, free, touch, lookup, cycle, _ = OPERATIONS
        # A request's life at the pool level: new blocks (each evicts a cached
        # hash), registered, freed tail first (to the right end).
        ids: list[BlockId] = []
        times[get_new].append(_timed(lambda: ids.extend(pool.get_new_blocks(batch))))
        new_hashes = self.hashes.take(batch)
        times[cache].append(_timed(lambda: pool.cache_full_blocks(ids, new_hashes)))
        times[free].append(_timed(lambda: pool.free_blocks(ids[::-1])))
        # A hit on cached blocks scattered through the queue: each is unlinked from the middle.
        hit = [BlockId(b) for b in rng.sample(range(1, self.num_gpu_blocks), batch)]
        times[touch].append(_timed(lambda: pool.touch(hit)))
        pool.free_blocks(hit[::-1])
        block_hash = pool.blocks[rng.randrange(1, self.num_gpu_blocks)].block_hash
        assert block_hash is not None, "every block is cached"
        times[lookup].append(_timed(lambda: pool.get_cached_block(block_hash)))
        # A whole request: look up its prefix (a shared system prompt, then its
        # own tokens), allocate (touch the hit, take and register new blocks), free.
        own = tuple(rng.randrange(100_000) for _ in range((PROMPT_BLOCKS - SHARED_BLOCKS) * BLOCK_SIZE))
        request = Request(request_id=f"r{self.num_requests}", token_ids=_SHARED_PREFIX + own + (0,))
        self.num_requests += 1
        times[cycle].append(_timed(lambda: self._request_cycle(request)))

    def _request_cycle(self, request: Request) -> None:
        hit, num_hit_tokens = self.manager.get_computed_blocks(request)
        num_new = len(request.token_ids) - num_hit_tokens
        assert self.manager.allocate_slots(request, num_new, num_hit_tokens, hit) is not None
        self.manager.free(request.request_id)


_SHARED_PREFIX = tuple(range(SHARED_BLOCKS * BLOCK_SIZE))


def measure(sizes: Sequence[int] = DEFAULT_SIZES, repeat: int = 2000, seed: int = 0) -> list[Measurement]:
    """Time every operation on a pool of each size, the sizes side by side.

    The sizes take turns call by call (round-robin), so a change in the
    machine's load during the run touches every size alike and the ratios
    stay meaningful; it also means no pool runs with a cache left hot by itself.

    Args:
        sizes: pool sizes (num_gpu_blocks, the null block included), each > BATCH.
        repeat: calls timed per operation and size.
        seed: seeds the block and token choices (the same for every size).

    Returns:
        One measurement per operation and size.
    """
    pools = [_PoolUnderTest(size, seed) for size in sizes]
    gc.collect()
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(repeat):
            for p in pools:
                p.round()
        for p in pools:
            p.times[OPERATIONS[-1]] = [_timed(p.manager.snapshot) for _ in range(SCALE_CALLS)]
    finally:
        if gc_was_enabled:
            gc.enable()
    for p in pools:
        p.manager.check_invariants()
    return [
        Measurement(op, p.num_gpu_blocks, statistics.median(p.times[op]), len(p.times[op]))
        for p in pools
        for op in OPERATIONS
    ]


# --- the keyed free blocks against vLLM v0's own LRUEvictor ---------------------------------

V0_EVICTOR_ROW = "keyed free vs v0 LRUEvictor"


@dataclass(frozen=True, slots=True)
class EvictorMeasurement:
    """One size: the same add/remove/evict trace replayed on the reference's keyed free blocks and on v0's evictor."""

    num_blocks: int  # blocks in the trace (every one hashed and free at the start)
    num_operations: int  # operations in the trace
    reference_seconds: float  # best whole-trace replay time of KeyedFreeBlocks (lru-timestamp)
    v0_seconds: float  # best whole-trace replay time of v0's LRUEvictor


def _evictor_trace(num_blocks: int, rounds: int, seed: int) -> list[tuple[str, int]]:
    """The trace, in block ids: per round evict the LRU block and free it again, take a random free block out by a
    hit and free it again; the evicted ids are what LRU gives (both replays are checked against them)."""
    rng = random.Random(seed)
    order = list(range(num_blocks))  # the LRU order: stamps are given in this order, oldest first
    trace: list[tuple[str, int]] = []
    for _ in range(rounds):
        victim = order.pop(0)
        trace += [("evict", victim), ("add", victim)]
        order.append(victim)
        hit = order.pop(rng.randrange(len(order)))
        trace += [("remove", hit), ("add", hit)]
        order.append(hit)
    return trace


def _replay_keyed(num_blocks: int, trace: Sequence[tuple[str, int]]) -> float:

    blocks = [KVCacheBlock(b) for b in range(num_blocks)]
    free = KeyedFreeBlocks(blocks, profile_rule("lru-timestamp"))
    for block in free.popleft_n(num_blocks):
        block.block_hash = BlockHash(block.block_id.to_bytes(8, "big"))
    free.freed(range(num_blocks), blocks, False)  # stamped 0..n-1: the trace's LRU order
    start = time.perf_counter()
    for op, b in trace:
        if op == "evict":
            got = free.popleft().block_id
            assert got == b, f"keyed free blocks evicted block {got}, LRU says {b}"
        elif op == "remove":
            free.remove(blocks[b])
        else:
            free.freed((b,), (blocks[b],), False)
    return time.perf_counter() - start


def _replay_v0(evictor_cls: type, num_blocks: int, trace: Sequence[tuple[str, int]]) -> float:
    evictor = evictor_cls()
    for b in range(num_blocks):
        evictor.add(b, b, 1, float(b))
    clock = float(num_blocks)
    start = time.perf_counter()
    for op, b in trace:
        if op == "evict":
            got = evictor.evict()[0]
            assert got == b, f"v0's LRUEvictor evicted block {got}, LRU says {b}"
        elif op == "remove":
            evictor.remove(b)
        else:
            evictor.add(b, b, 1, clock)
            clock += 1.0
    return time.perf_counter() - start


def measure_v0_evictor(
    evictor_cls: type, sizes: Sequence[int] = DEFAULT_SIZES, rounds: int = 20_000, seed: int = 0, repeat: int = 3
) -> list[EvictorMeasurement]:
    """Replay one add/remove/evict trace per size on both, best of ``repeat``, the sizes in one run.

    Args:
        evictor_cls: v0's ``LRUEvictor`` (``kvspec.conformance.targets.vllm.v0.load_lru_evictor``).
        sizes: blocks per trace.
        rounds: rounds of (evict, add, remove, add) per trace.
        seed: seeds which free block each round's hit takes.
        repeat: replays per implementation and size; the fastest is kept.

    Returns:
        One measurement per size.
    """
    results = []
    for n in sizes:
        trace = _evictor_trace(n, rounds, seed)
        ref = min(_replay_keyed(n, trace) for _ in range(repeat))
        v0 = min(_replay_v0(evictor_cls, n, trace) for _ in range(repeat))
        results.append(EvictorMeasurement(n, len(trace), ref, v0))
    return results


def render_v0_evictor(results: Sequence[EvictorMeasurement], version: str) -> str:
    """One row: per size, the reference's and v0's time per operation and their ratio."""
    cells = []
    for m in results:
        ref, v0 = m.reference_seconds / m.num_operations, m.v0_seconds / m.num_operations
        cells.append(f"{m.num_blocks:,} blocks: {ref * 1e6:.2f} us vs {v0 * 1e6:.2f} us ({ref / v0:.2f}x)")
    return f"{V0_EVICTOR_ROW} (vllm=={version}, per operation, reference / v0):\n  " + "\n  ".join(cells)


def render(results: Sequence[Measurement]) -> str:
    """A table: one row per operation, one column per size, each cell the time and its ratio to the first size."""
    sizes = sorted({m.num_gpu_blocks for m in results})
    by_key = {(m.operation, m.num_gpu_blocks): m.seconds for m in results}
    ops = [op for op in OPERATIONS if any((op, s) in by_key for s in sizes)]
    width = max(len(op) for op in ops)
    header = f"{'operation':<{width}}  " + "  ".join(f"{f'{s:,} blocks':>20}" for s in sizes)
    lines = [header, "-" * len(header)]
    for op in ops:
        base = by_key[(op, sizes[0])]
        cells = []
        for s in sizes:
            t = by_key[(op, s)]
            cells.append(f"{t * 1e6:>9.2f} us ({t / base:>5.2f}x)")
        lines.append(f"{op:<{width}}  " + "  ".join(f"{c:>20}" for c in cells))
    return "\n".join(lines)


# Calls timed per operation and size at the most: a median needs no more, and 1e6 take minutes already.
MAX_REPEAT = 1_000_000


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark and print the table; returns the exit code (0, or 2 on bad arguments)."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    if any(s <= BATCH for s in args.sizes) or not 1 <= args.repeat <= MAX_REPEAT:
        print(
            f"kvspec bench reference: sizes must exceed {BATCH} blocks and repeat must be from 1 to {MAX_REPEAT:,}; "
            f"got sizes={args.sizes} repeat={args.repeat}",
            file=sys.stderr,
        )
        return 2
    need, free = BYTES_PER_POOL_BLOCK * max(args.sizes), available_memory()
    if free is not None and need > free:
        print(
            f"kvspec bench reference: a pool of {max(args.sizes):,} blocks needs about {format_size(need)}; "
            f"{format_size(free)} is free",
            file=sys.stderr,
        )
        return 2
    evictor_cls = None
    if args.v0_evictor is not None:  # loaded before any timing: a release that does not load is refused at once
        try:
            evictor_cls = load_lru_evictor(args.v0_evictor)
        except LightModeError as e:
            print(f"kvspec bench reference: {e}", file=sys.stderr)
            return 2
    with text_for_people(args.json):
        print(
            f"reference model, per-call median of {args.repeat} calls; {BATCH} blocks per call; "
            f"request cycle = {PROMPT_BLOCKS} full blocks of {BLOCK_SIZE} tokens plus one token, "
            f"{SHARED_BLOCKS} blocks a shared prefix"
        )
        print(f"python {platform.python_version()} on {platform.machine()}; every pool full of cached free blocks\n")
        results = measure(args.sizes, args.repeat, args.seed)
        print(render(results))
        print("\n(ratio = time / time at the smallest pool; flat ~1x means the cost does not grow with the pool)")
        if evictor_cls is not None:
            v0 = measure_v0_evictor(evictor_cls, args.sizes, seed=args.seed)
            print("\n" + render_v0_evictor(v0, args.v0_evictor))
    if args.json:
        document = {"kvspec": "bench reference", "repeat": args.repeat, "batch": BATCH,
                    "measurements": [dataclasses.asdict(m) for m in results]}  # fmt: skip
        return write_json(document, args.json, prog="kvspec bench reference")
    return 0


def _parser() -> OneLineParser:
    """The command line of `kvspec bench reference`."""
    parser = OneLineParser(
        prog="kvspec bench reference",
        description=__doc__.splitlines()[0],
        epilog="exit codes: 0 the table printed; 2 a bad argument, a pool that does not fit in memory, a "
        "--v0-evictor release that does not load, or a --json that cannot be written",
    )
    parser.add_argument(
        "--sizes",
        type=integer,
        nargs="+",
        default=list(DEFAULT_SIZES),
        help="pool sizes in blocks (default: 1e3 1e4 1e5 1e6)",
    )
    parser.add_argument("--repeat", type=integer, default=2000, help="calls timed per operation and size")
    parser.add_argument("--seed", type=integer, default=0, help="seeds the block and token choices")
    parser.add_argument(
        "--json", type=json_output, metavar="PATH", help="also write the measurements as JSON (- for stdout)"
    )
    parser.add_argument(
        "--v0-evictor",
        type=release_number,
        metavar="VERSION",
        default=None,
        help="also time the keyed free blocks against this vLLM v0 release's LRUEvictor (e.g. 0.7.3)",
    )
    return parser


if __name__ == "__main__":
    sys.exit(main())
