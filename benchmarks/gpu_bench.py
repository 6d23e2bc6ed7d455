"""`kvspec bench gpu`: gpu_impl against the reference, whole requests in batches of 1 to 1e5 blocks.

One run measures both implementations side by side and prints for each
operation the median time per call and the ratio reference / gpu_impl (above
1x: gpu_impl is faster). The operations are a request's whole batch at once,
as vLLM issues them: `get_new_blocks(k)`, `free_blocks` of k blocks tail
first, and `touch` of k cached blocks scattered through the free queue (a
prefix hit). The default grid is short: batches of 1, 16 and 1e3 blocks in
pools of 1e4 and 1e6 (`--quick`: the 1e4 pool only); `--full` runs batches of
1 to 1e5 in pools of 1e4 to 1e6.

Every pool starts full of cached blocks (every block registered and free, in
a shuffled order), so each allocation evicts hashes and each touch takes
blocks out of the middle of the queue: the expensive case for both. The two
implementations take turns call by call, so a change in the machine's load
touches both alike. Each call is timed on its own (on CUDA, up to a device
synchronisation, so asynchronous kernels are counted), with the garbage
collector off.

gpu_impl is measured twice: with Python lists in and out (vLLM's API, the
`ratio` column) and with block ids kept on the device as tensors (`tensor
ratio`: what a caller that keeps its block tables on the GPU pays). On the
CPU, torch gets one thread (`--threads`), as the reference has one core: on a
loaded machine torch's thread pool otherwise adds stalls of milliseconds.
`--python-path-max` overrides the longest batch gpu_impl runs as a Python
loop (0: every batch as tensor operations), which is how the crossover is
measured.

Beside each time, where it goes: `device face` is the time to bring
gpu_impl's device face up to date after the call (`sync_device`, timed
apart: on the CPU the faces share memory and it is nothing; with
`--two-memories`, or on CUDA, it is the copy the call left waiting), and
`calls` / `(tensors)` count the call's torch calls as host/device/waits
(kvspec.benchmarks.torch_calls), with lists and with device ids. With
batches of 1e3 blocks or more it also prints the floor a list pays before
any kernel: turning a list of that many ints into a tensor (and, with
`--events`, building that many events).
`--events` builds both pools with KV cache events on (vLLM's
`enable_kv_cache_events`): each take of cached blocks then publishes a
`BlockRemoved` per key and each registration a `BlockStored`, which the
timed calls pay; the queues are drained, and compared, between calls,
untimed. Without it, events are off, as in vLLM by default.

A second table times the hash-to-blocks map gpu_impl keeps on the host
against a device-side table (sorted 64-bit fingerprints, `searchsorted`):
one lookup, and a batched lookup of a 1e3-block chain.

A third table is the KV content check at size: a paged KV tensor shaped like
a model's (`--content-layers` x 8 KV heads x head dim 128 x 16 tokens, bf16,
per block) for `--content-blocks` blocks (1e3 by default, 1e5 with
`--full`), filled by requests of 1e3 blocks whose content is written
through their block tables and sealed with checksums, then every request
comes back as a prefix hit: its blocks are touched, their checksums
verified, and every hit block read back and compared with what was written.
It prints the cost of each step per hit block; a block that reads back
wrong makes the run fail (exit 1).

The targets are printed under the tables: on the CPU, no slower than 3x the
reference for single-request batches; on CUDA, batches of 1 and 16 within
1.5x of the reference's time and 1e5-block batches at least 10x faster with
lists, 50x with device ids. With `--two-memories` the CUDA targets are
stated against CUDA's path run on the CPU, said so: the host's share of
each call is CUDA's, and the device's share runs on the CPU. This is a
benchmark, not a test: the ratios are measured, never asserted.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from kvspec.benchmarks.torch_calls import Costs, calls_of, on_the_device
from kvspec.conformance.tools.commands._arguments import (
    OneLineParser,
    integer,
    json_output,
    positive_float,
    profile_name,
    text_for_people,
)
from kvspec.conformance.tools.commands._check_output import write_json
from kvspec.conformance.tools.simulate import available_memory
from kvspec.gpu_impl.block_pool import TensorBlockPool, ids_as_tensor
from kvspec.gpu_impl.device import pick_device
from kvspec.gpu_impl.kv_cache import PagedKVCache
from kvspec.gpu_impl.sizing import KVLayout, format_size
from kvspec.reference import BlockPool
from kvspec.spec.errors import BlockManagerError, InvalidRequest
from kvspec.spec.events import BlockRemoved
from kvspec.spec.ordering import profile_rule
from kvspec.spec.state import BlockHash, BlockId

__all__ = [
    "DEFAULT_BATCHES",
    "DEFAULT_POOLS",
    "FULL_BATCHES",
    "FULL_POOLS",
    "OPERATIONS",
    "ContentTiming",
    "HashMapTiming",
    "Measurement",
    "content_layers_that_fit",
    "main",
    "measure",
    "measure_content",
    "measure_hash_map",
    "render",
]

DEFAULT_POOLS = (10_000, 1_000_000)
DEFAULT_BATCHES = (1, 16, 1_000)
QUICK_POOLS = (10_000,)
QUICK_BATCHES = DEFAULT_BATCHES
FULL_POOLS = (10_000, 100_000, 1_000_000)
FULL_BATCHES = (1, 16, 100, 1_000, 10_000, 100_000)
DEFAULT_CONTENT_BLOCKS, FULL_CONTENT_BLOCKS = 1_000, 100_000
# torch threads at the most: more than any machine's cores only contend, and tens of thousands crash torch's
# thread pool (a segmentation fault, not an error)
MAX_THREADS = 256
CONTENT_REQUEST_BLOCKS = 1_000  # blocks per request in the content check: 16k tokens
OPERATIONS = ("get_new_blocks", "free_blocks", "touch")
SINGLE_REQUEST_MAX_BLOCKS = 1_000  # a request's blocks: up to 16k tokens at 16 tokens per block
CPU_TARGET = 1 / 3  # on the CPU: no slower than 3x the reference
# The memory one pool size takes, measured with the peak resident set at 1e6 blocks on the CPU: both pools
# full of cached blocks about 1,080 bytes a block, the hash-map comparison 400 more; rounded up.
BYTES_PER_POOL_BLOCK = 1_600
LIST_FLOOR_MIN = 1_000  # the floors are printed for a largest batch of at least this many blocks
# On CUDA (issue 29): batches of 1 and 16 within 1.5x of the reference's time; 1e5-block batches at least
# 10x faster with lists, 50x with device ids.
CUDA_SHORT_BATCHES, CUDA_SHORT_TARGET = (1, 16), 1 / 1.5
CUDA_TARGET_BATCH, CUDA_TARGET, CUDA_TENSOR_TARGET = 100_000, 10.0, 50.0


@dataclass(frozen=True)
class Measurement:
    """Median seconds per call of one operation, one batch size, one pool, for each implementation."""

    num_gpu_blocks: int
    batch: int
    operation: str
    reference: float  # the reference BlockPool, Python lists
    gpu: float  # gpu_impl, Python lists in and out
    gpu_tensor: float  # gpu_impl, ids kept as device tensors
    num_calls: int
    # gpu_impl, lists: bringing the device face up to date after the call (its writes copied; timed apart,
    # as device code reading the pool after every call would pay it; nothing to do in one memory)
    device_face: float = 0.0
    calls: Costs = Costs(0, 0, 0)  # gpu_impl's torch calls for one call with lists: host / device / waits
    tensor_calls: Costs = Costs(0, 0, 0)  # the same with the ids on the device

    @property
    def ratio(self) -> float:
        """reference / gpu_impl: above 1, gpu_impl is faster."""
        return self.reference / self.gpu

    @property
    def tensor_ratio(self) -> float:
        """reference / gpu_impl with device-resident ids."""
        return self.reference / self.gpu_tensor


@dataclass(frozen=True)
class Floors:
    """What Python itself costs a long call, whatever the pool does with it: the floor under its time."""

    length: int  # ids (and events) in the call
    # seconds: gpu_impl's ids_as_tensor (every id checked to be a plain int, then one copy into a tensor), for
    # a list of ints made in one go (`tolist` in a fresh heap: side by side in memory) and for one drawn as
    # the benchmark draws its hits (`random.sample`: each int made among other objects); reading the second's
    # ints misses the cache far more often, and so do those of any list a process makes once it has run a
    # while (the ids the pool hands out in the benchmark's later rounds too)
    to_tensor: float
    to_tensor_drawn: float
    to_list: float  # seconds: an int64 tensor back to a Python list (what get_new_blocks hands back)
    # seconds to build `length` BlockRemoved events (--events; None: not measured), from keys side by side in
    # memory, and from keys read as a pool holds them: through a list by block id, each key made at its own
    # time (a take publishes the keys of the blocks it evicts, in the free order, not the ids' order)
    events: float | None = None
    events_held: float | None = None


def measure_floors(length: int, events: bool = False, repeats: int = 5) -> Floors:
    """Time the list-to-tensor conversion gpu_impl makes for a long batch of ids in a list, the way back, and,
    with `events`, building the KV cache events a take of that many cached blocks publishes."""
    tensor = torch.randperm(2 * length, generator=torch.Generator().manual_seed(0))[:length].add_(1)
    in_order = tensor.tolist()
    drawn = random.Random(0).sample(range(1, 2 * length + 1), length)  # as _Pair.round draws its hits
    clock = _Clock(torch.device("cpu"))

    def best(call: Callable[[], object]) -> float:
        return min(clock.time(call) for _ in range(repeats))

    keys = [BlockHash(b.to_bytes(8, "little")) for b in in_order]
    held = [BlockHash(b.to_bytes(8, "little")) for b in range(2 * length + 1)]
    random.Random(1).shuffle(held)  # the key of a block is no neighbour of the next block's
    gc.collect()
    gc_was_enabled = gc.isenabled()
    gc.disable()  # as in the timed cells (_measure_cell)
    try:
        return Floors(
            length=length,
            to_tensor=best(lambda: ids_as_tensor(in_order)),
            to_tensor_drawn=best(lambda: ids_as_tensor(drawn)),
            to_list=best(tensor.tolist),
            events=best(lambda: [BlockRemoved((key,)) for key in keys]) if events else None,
            events_held=best(lambda: [BlockRemoved((held[b],)) for b in drawn]) if events else None,
        )
    finally:
        if gc_was_enabled:
            gc.enable()


@dataclass(frozen=True)
class HashMapTiming:
    """The hash map choice, measured: host dict against a device fingerprint table."""

    num_entries: int
    chain_length: int
    dict_lookup: float  # seconds per get_cached_block on the host dict
    table_lookup: float  # seconds per single lookup in the device table (copy in, searchsorted, read back)
    dict_chain: float  # seconds to look up a whole chain, one dict lookup per hash
    table_chain: float  # seconds to look up a whole chain in one batched searchsorted


@dataclass(frozen=True)
class ContentTiming:
    """The KV content check at size: seconds per block for each step, and whether every hit read back intact."""

    num_blocks: int
    layout: KVLayout
    device: str
    write: float  # per block: its KV written through the block table, registered and sealed
    touch: float  # per hit block: the pool's touch of the whole request
    verify: float  # per hit block: the checksum recomputed against the seal
    read_back: float  # per hit block: the page read back and compared with what was written
    num_requests: int
    is_intact: bool  # every hit block passed its checksum and read back what was written

    @property
    def per_hit_block(self) -> float:
        """Seconds per hit block for the whole hit: touch, verify, read back."""
        return self.touch + self.verify + self.read_back


class _Clock:
    """Times one call, waiting for the device when it runs asynchronously."""

    def __init__(self, device: torch.device) -> None:
        self._sync: Callable[[], None] = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        self.times: dict[tuple[str, str], list[float]] = {}  # (operation, implementation) -> seconds per call

    def time(self, call: Callable[[], object]) -> float:
        self._sync()
        start = time.perf_counter()
        call()
        self._sync()
        return time.perf_counter() - start

    def record(self, op: str, impl: str, call: Callable[[], object], pool: object = None) -> None:
        """Time one call of a round; after gpu_impl's calls with lists, its device face catching up, apart."""
        self.times.setdefault((op, impl), []).append(self.time(call))
        if impl == "gpu" and isinstance(pool, TensorBlockPool):
            self.times.setdefault((op, "device_face"), []).append(self.time(pool.sync_device))


class _Counter(_Clock):
    """Counts gpu_impl's torch calls in one round instead of timing it (kvspec.benchmarks.torch_calls)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.costs: dict[tuple[str, str], Costs] = {}

    def record(self, op: str, impl: str, call: Callable[[], object], pool: object = None) -> None:
        if isinstance(pool, TensorBlockPool):
            self.costs[(op, impl)] = calls_of(call, pool).costs()
            pool.sync_device()  # as in a timed round: the next call starts with nothing waiting
        else:
            call()


def _hashes(start: int, n: int) -> list[BlockHash]:
    return [BlockHash(i.to_bytes(8, "little")) for i in range(start, start + n)]


class _Pair:
    """The reference and gpu_impl pools of one size, in the same state, and the calls that drive them."""

    def __init__(
        self,
        num_gpu_blocks: int,
        device: torch.device,
        seed: int,
        python_path_max: int | None,
        profile: str,
        events: bool = False,
        two_memories: bool = False,
    ) -> None:
        self.num_gpu_blocks = num_gpu_blocks
        self.rng = random.Random(seed)
        self.events = events
        self.ref = BlockPool(num_gpu_blocks, True, profile, enable_kv_cache_events=events)
        self.gpu = TensorBlockPool(
            num_gpu_blocks,
            True,
            profile,
            device=device,
            python_path_max=python_path_max,
            share_host_memory=False if two_memories else None,
            enable_kv_cache_events=events,
        )
        self.device = device
        self.num_hashes = 0
        # A full prefix cache: every block registered, all freed in one shuffled order.
        everything = self.ref.get_new_blocks(num_gpu_blocks - 1)
        assert self.gpu.get_new_blocks(num_gpu_blocks - 1) == everything
        hashes = self._fresh_hashes(len(everything))
        self.ref.cache_full_blocks(everything, hashes)
        self.gpu.cache_full_blocks(everything, hashes)
        self.rng.shuffle(everything)
        self.ref.free_blocks(everything)
        self.gpu.free_blocks(everything)
        self.drain_events()

    def drain_events(self) -> None:
        """Take both pools' events (untimed), so no queue grows across rounds; they must be the same."""
        if self.events:
            assert self.gpu.take_events() == self.ref.take_events(), "the pools published different events"

    def _fresh_hashes(self, n: int) -> list[BlockHash]:
        self.num_hashes += n
        return _hashes(self.num_hashes - n, n)

    def round(self, batch: int, clock: _Clock) -> None:
        """One request's life on each implementation (lists), then on gpu_impl with device ids."""
        hit = [BlockId(b) for b in self.rng.sample(range(1, self.num_gpu_blocks), batch)]
        hashes = self._fresh_hashes(batch)
        self._list_round("reference", self.ref, batch, hit, hashes, clock)
        self._list_round("gpu", self.gpu, batch, hit, hashes, clock)
        # The same round with the ids on the device; the reference replays it
        # untimed, so the two pools stay in the same state.
        gpu = self.gpu
        hit_t = on_the_device(gpu, hit)
        hashes = self._fresh_hashes(batch)
        taken: list[torch.Tensor] = []
        clock.record("get_new_blocks", "gpu_tensor", lambda: taken.append(gpu.get_new_blocks_tensor(batch)), gpu)
        gpu.cache_full_blocks(taken[0], hashes)
        tail_first_t = on_the_device(gpu, taken[0].tolist()[::-1])
        clock.record("free_blocks", "gpu_tensor", lambda: gpu.free_blocks(tail_first_t), gpu)
        clock.record("touch", "gpu_tensor", lambda: gpu.touch(hit_t), gpu)
        gpu.free_blocks(hit[::-1])
        replay = self.ref.get_new_blocks(batch)
        self.ref.cache_full_blocks(replay, hashes)
        self.ref.free_blocks(replay[::-1])
        self.ref.touch(hit)
        self.ref.free_blocks(hit[::-1])
        self.drain_events()

    @staticmethod
    def _list_round(
        impl: str,
        pool: BlockPool | TensorBlockPool,
        batch: int,
        hit: list[BlockId],
        hashes: list[BlockHash],
        clock: _Clock,
    ) -> None:
        """Allocate, register, free tail first; then hit scattered cached blocks and free them."""
        ids: list[BlockId] = []
        clock.record("get_new_blocks", impl, lambda: ids.extend(pool.get_new_blocks(batch)), pool)
        pool.cache_full_blocks(ids, hashes)
        tail_first = ids[::-1]
        clock.record("free_blocks", impl, lambda: pool.free_blocks(tail_first), pool)
        clock.record("touch", impl, lambda: pool.touch(hit), pool)
        pool.free_blocks(hit[::-1])


def measure(
    pools: Sequence[int] = DEFAULT_POOLS,
    batches: Sequence[int] = DEFAULT_BATCHES,
    device: str | None = None,
    seconds_per_cell: float = 0.5,
    max_rounds: int = 200,
    seed: int = 0,
    verify: bool = True,
    python_path_max: int | None = None,
    profile: str = "vllm-v1",
    events: bool = False,
    two_memories: bool = False,
) -> list[Measurement]:
    """Time every operation for each pool size and each batch that fits it, both implementations side by side.

    Args:
        pools: pool sizes (num_gpu_blocks, the null block included).
        batches: blocks per call; a batch is skipped for pools with fewer free blocks.
        device: gpu_impl's device (None picks).
        seconds_per_cell: a batch size runs rounds until both implementations used about this long
            (at least 3 rounds, at most max_rounds).
        max_rounds: the most rounds per cell.
        seed: seeds the blocks hit.
        verify: compare the two pools' snapshots after each pool size (O(pool) each).
        python_path_max: gpu_impl's longest host-face batch (None: its default for the device).
        profile: the eviction policy both pools run (a keyed one times seed 002's stamps and heaps).
        events: both pools publish KV cache events (drained and compared between calls, untimed).
        two_memories: gpu_impl's two faces in two memories on the CPU too (the path CUDA takes).

    Returns:
        One measurement per pool, batch and operation.
    """
    dev = pick_device(device)
    results: list[Measurement] = []
    for num_gpu_blocks in pools:
        pair = _Pair(num_gpu_blocks, dev, seed, python_path_max, profile, events, two_memories)
        for batch in batches:
            if batch > num_gpu_blocks - 1:
                continue
            results += _measure_cell(pair, batch, seconds_per_cell, max_rounds)
        if verify:
            assert pair.gpu.snapshot() == pair.ref.snapshot(), f"the pools diverged at num_gpu_blocks={num_gpu_blocks}"
    return results


_IMPLS = ("reference", "gpu", "gpu_tensor")  # what a round times: the reference, gpu_impl with lists, with tensors


def _measure_cell(pair: _Pair, batch: int, seconds_per_cell: float, max_rounds: int) -> list[Measurement]:
    """One pool size and batch: a warm-up round, a counted one, then timed rounds; the median per operation
    and implementation, and gpu_impl's torch calls."""
    pair.round(batch, _Clock(pair.device))  # warm-up: first-call allocations, lazy CUDA init
    counter = _Counter(pair.device)
    pair.round(batch, counter)
    clock = _Clock(pair.device)
    rounds = _timed_rounds(pair, batch, clock, seconds_per_cell, max_rounds)
    results = []
    for op in OPERATIONS:
        median = {impl: statistics.median(clock.times[(op, impl)]) for impl in _IMPLS}
        results.append(
            Measurement(
                num_gpu_blocks=pair.num_gpu_blocks,
                batch=batch,
                operation=op,
                reference=median["reference"],
                gpu=median["gpu"],
                gpu_tensor=median["gpu_tensor"],
                num_calls=rounds,
                device_face=statistics.median(clock.times[(op, "device_face")]),
                calls=counter.costs[(op, "gpu")],
                tensor_calls=counter.costs[(op, "gpu_tensor")],
            )
        )
    return results


def _timed_rounds(
    pair: _Pair,
    batch: int,
    clock: _Clock,
    seconds_per_cell: float,
    max_rounds: int,
) -> int:
    """Run rounds with the garbage collector off (at least 3, then until the cell's time is spent); return how many.

    A collection's pause would land in whichever timed call happened to
    trigger it; so the garbage is collected once before the first round and
    the collector stays off until the last.
    """
    gc.collect()
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        rounds, spent = 0, 0.0
        while rounds < 3 or (spent < seconds_per_cell and rounds < max_rounds):
            start = time.perf_counter()
            pair.round(batch, clock)
            spent += time.perf_counter() - start
            rounds += 1
    finally:
        if gc_was_enabled:
            gc.enable()
    return rounds


def measure_hash_map(
    num_entries: int = 1_000_000, chain_length: int = 1_000, device: str | None = None, seed: int = 0
) -> HashMapTiming:
    """Time the host dict gpu_impl uses against a device table of 64-bit fingerprints.

    The device table is the cheapest one that answers a lookup: fingerprints
    sorted once, `searchsorted`, one comparison, one read back. (A real one
    would also verify the full hash on a fingerprint match and pay a re-sort
    or a probing kernel per insert and delete; none of that is timed.)

    Args:
        num_entries: registered hashes.
        chain_length: hashes in one batched chain lookup.
        device: the device table's device (None picks).
        seed: seeds the hash values.
    """
    dev = pick_device(device)
    clock = _Clock(dev)
    rng = random.Random(seed)
    hashes = [BlockHash(rng.randbytes(32)) for _ in range(num_entries)]
    table: dict[BlockHash, dict[int, None]] = {h: {b: None} for b, h in enumerate(hashes, start=1)}
    fingerprints = torch.tensor([int.from_bytes(h[:8], "little", signed=True) for h in hashes], dtype=torch.int64)
    order = torch.argsort(fingerprints)
    keys = fingerprints[order].to(dev)
    blocks = (order + 1).to(dev)
    probes = [hashes[rng.randrange(num_entries)] for _ in range(chain_length)]

    def dict_lookup(h: BlockHash) -> int | None:
        entry = table.get(h)
        return next(iter(entry)) if entry else None

    def table_lookup_many(chain: Sequence[BlockHash]) -> list[int]:
        q = torch.tensor([int.from_bytes(h[:8], "little", signed=True) for h in chain], dtype=torch.int64).to(dev)
        i = torch.searchsorted(keys, q).clamp(max=num_entries - 1)
        found = torch.where(keys[i] == q, blocks[i], torch.zeros_like(i))
        return list(found.tolist())

    def repeat(call: Callable[[], object], n: int) -> float:
        return statistics.median(clock.time(call) for _ in range(n))

    one = probes[0]
    assert dict_lookup(one) == table_lookup_many([one])[0], "the two maps disagree"
    n_single = 2_000
    dict_single = repeat(lambda: [dict_lookup(h) for h in probes[:100]], n_single // 100) / 100
    table_single = repeat(lambda: table_lookup_many([one]), n_single)
    dict_chain = repeat(lambda: [dict_lookup(h) for h in probes], 50)
    table_chain = repeat(lambda: table_lookup_many(probes), 50)
    return HashMapTiming(
        num_entries=num_entries,
        chain_length=chain_length,
        dict_lookup=dict_single,
        table_lookup=table_single,
        dict_chain=dict_chain,
        table_chain=table_chain,
    )


_STAMP_MULTIPLIER = 0x5851F42D4C957F2D  # odd: spreads consecutive block positions over 64 bits
# Pages written or compared per tensor operation, at most: on the CPU a chunk
# that stays in cache (5x faster than 64 MiB), on a device a large one.
_CONTENT_CHUNK_BYTES = {"cpu": 1 << 20}
_DEVICE_CONTENT_CHUNK_BYTES = 256 << 20


def measure_content(
    num_blocks: int = DEFAULT_CONTENT_BLOCKS,
    layout: KVLayout | None = None,
    device: str | None = None,
    request_blocks: int = CONTENT_REQUEST_BLOCKS,
    seed: int = 0,
) -> ContentTiming:
    """The KV content check at size: fill, hit every request again, read every hit block back.

    A pool of num_blocks blocks (and the null block) with a paged KV tensor of
    `layout`. Requests of `request_blocks` blocks take their blocks, write
    their KV through the block table (`PagedKVCache.write_tokens`, which
    checks writability), register the blocks and seal them, and finish. Then
    each request comes back as a prefix hit on all of its blocks: `touch`,
    the checksums checked against the seals (`intact`), and every page read
    back and compared with what was written; then it finishes again. A page
    is a fixed random pattern XOR a 64-bit stamp of the block's position in
    its request, so a page that lands in another block, or another request's
    page, reads back wrong.

    Args:
        num_blocks: blocks filled and hit (the pool has one more: the null block).
        layout: what a block holds (None: 1 layer x 8 KV heads x head dim 128 x 16 tokens, bf16).
        device: gpu_impl's device (None picks).
        request_blocks: blocks per request.
        seed: seeds the page pattern.

    Raises:
        InvalidRequest: a count is not positive, or a block's bytes are not a whole number of 8-byte words.
    """
    layout = layout or KVLayout(num_layers=1, num_kv_heads=8, head_dim=128, block_size=16)
    if num_blocks < 1 or request_blocks < 1:
        raise InvalidRequest(f"num_blocks and request_blocks must be >= 1; got {num_blocks} and {request_blocks}")
    if layout.block_bytes % 8:
        raise InvalidRequest(f"a block of {layout.block_bytes} bytes is not a whole number of 8-byte words")
    check = _ContentCheck(num_blocks, layout, pick_device(device), seed)
    requests = [  # (block table, stamps) of each request, in order
        check.write_request(first, min(request_blocks, num_blocks - first))
        for first in range(0, num_blocks, request_blocks)
    ]
    for table_ids, _ in requests:
        check.pool.free_blocks(table_ids.flip(0))
    for table_ids, stamps in requests:
        check.hit_request(table_ids, stamps)
    return ContentTiming(
        num_blocks=num_blocks,
        layout=layout,
        device=str(check.device),
        write=check.write / num_blocks,
        touch=check.touch / num_blocks,
        verify=check.verify / num_blocks,
        read_back=check.read_back / num_blocks,
        num_requests=len(requests),
        is_intact=check.is_intact,
    )


class _ContentCheck:
    """The content check's pool and paged KV tensor, its two steps per request, and the time each step took."""

    def __init__(self, num_blocks: int, layout: KVLayout, device: torch.device, seed: int) -> None:
        self.device = device
        self.clock = _Clock(device)
        self.pool = TensorBlockPool(num_blocks + 1, device=device)
        self.kv = PagedKVCache.for_layout(self.pool, layout)
        self.block_size = layout.block_size
        self.pages = self.kv.kv.view(num_blocks + 1, -1).view(torch.int64)  # each block's page as 64-bit words
        pattern = torch.randint(-(2**62), 2**62, (self.pages.shape[1],), generator=torch.Generator().manual_seed(seed))
        self.pattern = pattern.to(device)  # every page is this XOR its block's stamp
        chunk_bytes = _CONTENT_CHUNK_BYTES.get(device.type, _DEVICE_CONTENT_CHUNK_BYTES)
        self.per_chunk = max(1, chunk_bytes // layout.block_bytes)  # pages written or compared per tensor operation
        self.write = self.touch = self.verify = self.read_back = 0.0  # seconds spent in each step so far
        self.is_intact = True  # every hit block so far passed its checksum and read back what was written

    def write_request(self, first: int, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A request of the blocks at positions [first, first + num_blocks): take, write, register, seal (timed).

        Returns:
            Its block table and its blocks' stamps.
        """
        pool, kv, per_chunk = self.pool, self.kv, self.per_chunk
        positions = torch.arange(first, first + num_blocks, dtype=torch.int64, device=self.device)
        stamps = (positions + 1) * _STAMP_MULTIPLIER
        hashes = [BlockHash(stamp.to_bytes(8, "little", signed=True)) for stamp in stamps.tolist()]
        taken: list[torch.Tensor] = []

        def fill() -> None:
            table = pool.get_new_blocks_tensor(num_blocks)
            for i in range(0, num_blocks, per_chunk):
                words = self.pattern[None, :] ^ stamps[i : i + per_chunk, None]
                kv.write_tokens(table, i * self.block_size, words.view(kv.kv.dtype).reshape(-1, *kv.slot_shape))
            pool.cache_full_blocks(table, hashes)
            kv.seal(table)
            taken.append(table)

        self.write += self.clock.time(fill)
        return taken[0], stamps

    def hit_request(self, table_ids: torch.Tensor, stamps: torch.Tensor) -> None:
        """A written request back as a prefix hit: touch, checksums, read back (each timed); then it finishes."""

        def check() -> None:
            self.is_intact &= bool(self.kv.intact(table_ids).all())

        def read() -> None:
            per_chunk = self.per_chunk
            for i in range(0, table_ids.numel(), per_chunk):
                got = self.pages.index_select(0, table_ids[i : i + per_chunk]) ^ stamps[i : i + per_chunk, None]
                self.is_intact &= bool((got == self.pattern).all())

        self.touch += self.clock.time(lambda: self.pool.touch(table_ids))
        self.verify += self.clock.time(check)
        self.read_back += self.clock.time(read)
        self.pool.free_blocks(table_ids.flip(0))


def content_layers_that_fit(num_blocks: int, device: str | None = None, fraction: float = 0.4) -> int:
    """As many layers of KV per block (1 to 16) as fit num_blocks blocks in `fraction` of the free memory.

    The free memory is the CUDA device's, or on the CPU what the machine can still give (Linux's MemAvailable).
    """
    per_layer = num_blocks * KVLayout(num_layers=1, num_kv_heads=8, head_dim=128, block_size=16).block_bytes
    return max(1, min(16, int(_free_bytes(device) * fraction) // per_layer))


def _free_bytes(device: str | None) -> int:
    """The free memory of gpu_impl's device: the CUDA device's, or on the CPU what the machine can still give.

    Raises:
        BlockManagerError: the device is not one torch knows (pick_device).
    """
    # optional dependency (the gpu extra): torch is imported only when a device is asked for
    from kvspec.gpu_impl.sizing import device_free_memory

    dev = pick_device(device)
    if dev.type == "cuda":
        return device_free_memory(str(dev))[0]
    available = available_memory()
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") if available is None else available


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:,.1f} us" if seconds < 0.1 else f"{seconds * 1e3:,.1f} ms"


def render(
    results: Sequence[Measurement],
    device: str,
    hash_map: HashMapTiming | None = None,
    content: ContentTiming | None = None,
    profile: str = "vllm-v1",
    events: bool = False,
    floor: Floors | None = None,
    two_memories: bool = False,
) -> str:
    """The comparison table, the hash-map table, the content check, and where the targets are met or missed.

    With `two_memories` (CUDA's path on the CPU) the verdicts are CUDA's targets, marked as measured on the CPU.
    """
    lines = [
        f"gpu_impl on {device} against the reference, profile {profile}"
        f"{', KV cache events on' if events else ''}: median time per call; "
        "ratio = reference / gpu_impl (above 1x: gpu_impl faster)",
        "",
        f"{'pool':>10} {'batch':>8}  {'operation':<15}{'reference':>12}{'gpu_impl':>12}{'ratio':>9}"
        f"{'gpu (tensors)':>15}{'tensor ratio':>14}{'device face':>13}{'calls':>10}{'(tensors)':>11}",
    ]
    lines.append("-" * len(lines[-1]))
    for m in results:
        lines.append(
            f"{m.num_gpu_blocks:>10,} {m.batch:>8,}  {m.operation:<15}{_us(m.reference):>12}{_us(m.gpu):>12}"
            f"{m.ratio:>8.2f}x{_us(m.gpu_tensor):>15}{m.tensor_ratio:>13.2f}x{_us(m.device_face):>13}"
            f"{str(m.calls):>10}{str(m.tensor_calls):>11}"
        )
    if results:
        lines += [
            "device face: gpu_impl's writes of the call (lists) copied to the device face, timed apart; a "
            "scheduler pays it once a step (sync_device), for every call since",
            "calls: gpu_impl's torch calls for one call, on the host / on the device / waits for the device "
            "(kvspec.benchmarks.torch_calls)",
        ]
    if floor is not None:
        lines += _floor_lines(floor)
    if hash_map is not None:
        hm = hash_map
        lines += [
            "",
            f"hash-to-blocks map, {hm.num_entries:,} entries: host dict (gpu_impl) against a device table "
            f"(sorted fingerprints, searchsorted) on {device}",
            f"  one lookup            dict {_us(hm.dict_lookup):>10}   device table {_us(hm.table_lookup):>10}"
            f"   ({hm.table_lookup / hm.dict_lookup:,.0f}x)",
            f"  chain of {hm.chain_length:,} hashes  dict {_us(hm.dict_chain):>10}   device table "
            f"{_us(hm.table_chain):>10}   ({hm.table_chain / hm.dict_chain:,.1f}x)",
        ]
    if content is not None:
        lines += ["", *_render_content(content)]
    lines += ["", *_verdicts(results, device, two_memories, profile_rule(profile).keyed)]
    return "\n".join(lines)


def _render_content(c: ContentTiming) -> list[str]:
    lo = c.layout
    return [
        f"KV content check on {c.device}: {c.num_blocks:,} blocks of {lo.block_size} tokens x 2 (K, V) x "
        f"{lo.num_layers} layers x {lo.num_kv_heads} KV heads x head dim {lo.head_dim}, {lo.dtype} "
        f"({format_size(lo.block_bytes)} a block, {format_size(c.num_blocks * lo.block_bytes)} in all), "
        f"{c.num_requests:,} requests",
        f"  write through the block table, register, seal  {_us(c.write):>10} a block",
        f"  hit: touch                                     {_us(c.touch):>10} a hit block",
        f"  hit: checksums against the seals               {_us(c.verify):>10} a hit block",
        f"  hit: read back and compare                     {_us(c.read_back):>10} a hit block",
        f"  every hit block read back: {'intact' if c.is_intact else 'MISMATCH (a block read back other KV)'}; "
        f"a whole hit costs {_us(c.per_hit_block)} a block",
    ]


def _floor_lines(floor: Floors) -> list[str]:
    """What Python itself costs a long call, under the pool's own work."""
    lines = [
        f"the floor of a long call with lists, {floor.length:,} ids: to a tensor {_us(floor.to_tensor)} "
        f"(checked to be ints, copied) made side by side in memory, {_us(floor.to_tensor_drawn)} drawn as the "
        f"hits are (random.sample: ints scattered in memory, as a process that has run a while makes them), "
        f"a tensor back to a list {_us(floor.to_list)}; "
        "the rest of the call is the pool's work"
    ]
    if floor.events is not None and floor.events_held is not None:
        lines.append(
            f"the floor of events, {floor.length:,} BlockRemoved built: {_us(floor.events)} from keys side by "
            f"side in memory, {_us(floor.events_held)} from keys read as a pool holds them (by block id, "
            "scattered in memory), paid by a take of that many cached blocks with events on; the rest is the "
            "pool's work"
        )
    return lines


def _verdicts(
    results: Sequence[Measurement], device: str, two_memories: bool = False, keyed: bool = False
) -> list[str]:
    """The issue's targets, stated against what was measured: CUDA's on CUDA, and on the CPU with two memories
    (CUDA's path: its host work is CUDA's, its device work runs on the CPU too), the CPU's otherwise. A keyed
    policy's 1e5-block target is its own: take and free 10x, lists or device ids alike."""
    out: list[str] = []
    if device.startswith("cuda") or two_memories:
        out += (
            []
            if device.startswith("cuda")
            else [
                "CUDA's targets against CUDA's path on the CPU (two memories): the host's share as on CUDA, the "
                "device's share run by the CPU; indicative until a CUDA machine runs it"
            ]
        )
        for batch in sorted({m.batch for m in results if m.batch in CUDA_SHORT_BATCHES}):
            worst = min((m for m in results if m.batch == batch), key=lambda m: m.ratio)
            out.append(
                f"CUDA target, batch {batch:>5,}: within {1 / CUDA_SHORT_TARGET:g}x of the reference's time: "
                f"{'met' if worst.ratio >= CUDA_SHORT_TARGET else 'MISSED'} (worst {1 / worst.ratio:.2f}x, "
                f"{worst.operation}, pool {worst.num_gpu_blocks:,})"
            )
        big = [m for m in results if m.batch >= CUDA_TARGET_BATCH]
        if not big:
            return [*out, f"CUDA target, 1e5-block batches: not measured (no batch of {CUDA_TARGET_BATCH:,})"]
        if keyed:
            return [*out, _keyed_verdict(big)]
        worst = min(big, key=lambda m: m.ratio)
        out.append(
            f"CUDA target, 1e5-block batches >= {CUDA_TARGET:g}x faster with lists: "
            f"{'met' if worst.ratio >= CUDA_TARGET else 'MISSED'} (worst {worst.ratio:.1f}x: {worst.operation}, "
            f"pool {worst.num_gpu_blocks:,})"
        )
        worst = min(big, key=lambda m: m.tensor_ratio)
        out.append(
            f"CUDA target, 1e5-block batches >= {CUDA_TENSOR_TARGET:g}x faster with device ids: "
            f"{'met' if worst.tensor_ratio >= CUDA_TENSOR_TARGET else 'MISSED'} (worst {worst.tensor_ratio:.1f}x: "
            f"{worst.operation}, pool {worst.num_gpu_blocks:,})"
        )
        return out
    return _cpu_verdicts(results)


def _keyed_verdict(big: Sequence[Measurement]) -> str:
    """A keyed policy's 1e5-block target: its take and its free at least CUDA_TARGET times the reference's speed."""
    timed = [
        (ratio, m.operation, how, m.num_gpu_blocks)
        for m in big
        if m.operation in ("get_new_blocks", "free_blocks")
        for ratio, how in ((m.ratio, "lists"), (m.tensor_ratio, "device ids"))
    ]
    ratio, operation, how, pool = min(timed)
    return (
        f"CUDA target, keyed policy, 1e5-block take and free >= {CUDA_TARGET:g}x faster: "
        f"{'met' if ratio >= CUDA_TARGET else 'MISSED'} (worst {ratio:.1f}x: {operation} with {how}, pool {pool:,})"
    )


def _cpu_verdicts(results: Sequence[Measurement]) -> list[str]:
    """The CPU's target: single-request batches no slower than CPU_TARGET's inverse times the reference."""
    out: list[str] = []
    single = [m for m in results if m.batch <= SINGLE_REQUEST_MAX_BLOCKS]
    for batch in sorted({m.batch for m in single}):
        worst = min((m for m in single if m.batch == batch), key=lambda m: m.ratio)
        met = worst.ratio >= CPU_TARGET
        out.append(
            f"CPU target, batch {batch:>5,}: no slower than 3x the reference: {'met' if met else 'MISSED'} "
            f"(worst {1 / worst.ratio:.1f}x the reference's time, {worst.operation}, pool {worst.num_gpu_blocks:,})"
        )
    if any(m.ratio < CPU_TARGET for m in single):
        out.append(
            "  where it misses: a short call is Python over the pool's host face and makes no torch call "
            "(gpu_impl.block_pool's docstring counts them); check --python-path-max, and rerun on a quiet "
            "machine: the two implementations are timed call by call, but a loaded machine still skews one "
            "run's medians."
        )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """`kvspec bench gpu [--quick | --full] [--pools ...] [--batches ...] [--device D] ...`.

    Exit 0; 1 if a hit block of the content check read back wrong; 2 if it cannot run.
    """
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    pools = args.pools or (QUICK_POOLS if args.quick else FULL_POOLS if args.full else DEFAULT_POOLS)
    batches = args.batches or (QUICK_BATCHES if args.quick else FULL_BATCHES if args.full else DEFAULT_BATCHES)
    content_blocks = args.content_blocks
    if content_blocks is None:  # not `or`: --content-blocks 0 is refused below, not taken for the default
        content_blocks = FULL_CONTENT_BLOCKS if args.full else DEFAULT_CONTENT_BLOCKS
    try:
        content_layers = _content_layers(args.content_layers, content_blocks, args.device)
    except BlockManagerError as e:
        return _cannot_run(e)
    try:
        problem = _bad_arguments(args, pools, batches, content_blocks, content_layers)
    except BlockManagerError as e:
        return _cannot_run(e)
    if problem is not None:
        return _cannot_run(problem)
    try:
        device, results, hash_map, content = _measure_all(args, pools, batches, content_blocks, content_layers)
    except BlockManagerError as e:
        return _cannot_run(e)
    floor = measure_floors(max(batches), args.events) if max(batches) >= LIST_FLOOR_MIN else None
    with text_for_people(args.json):
        print(render(results, device, hash_map, content, args.profile, args.events, floor, args.two_memories))
    if args.json is not None:
        document = _document(
            results, device, hash_map, content, args.threads, args.profile, args.events, args.two_memories
        )
        floors = None if floor is None else asdict(floor)
        if write_json({**document, "floors": floors}, args.json, prog="kvspec bench gpu"):
            return 2
    return 1 if content is not None and not content.is_intact else 0


def _cannot_run(reason: object) -> int:
    """Say on stderr why the benchmark cannot run; exit status 2."""
    print(f"kvspec bench gpu: {reason}", file=sys.stderr)
    return 2


def _parser() -> OneLineParser:
    """The command line of `kvspec bench gpu`."""
    parser = OneLineParser(
        prog="kvspec bench gpu",
        description=(__doc__ or "").splitlines()[0],
        epilog="exit codes: 0 the tables printed; 1 a hit block of the content check read back wrong; "
        "2 it cannot run (a bad argument, a device, a grid or a memory it does not have, an unwritable --json)",
    )
    parser.add_argument("--pools", type=integer, nargs="+", default=None, help="pool sizes (default 1e4 1e6)")
    parser.add_argument("--batches", type=integer, nargs="+", default=None, help="blocks per call (default 1 16 1e3)")
    parser.add_argument(
        "--device", default=None, help="gpu_impl's device: cpu, cuda, cuda:1 (default: CUDA if present)"
    )
    parser.add_argument("--seconds", type=positive_float, default=0.5, help="time spent per batch size (default 0.5)")
    grid = parser.add_mutually_exclusive_group()
    grid.add_argument("--quick", action="store_true", help="a small grid: pool 1e4, batches 1, 16, 1e3")
    grid.add_argument(
        "--full",
        action="store_true",
        help="the whole grid: pools 1e4 1e5 1e6, batches 1 16 100 1e3 1e4 1e5, and the content check at 1e5 blocks",
    )
    parser.add_argument("--no-hash-map", action="store_true", help="skip the hash-map comparison")
    _content_options(parser)
    parser.add_argument(
        "--python-path-max",
        type=integer,
        default=None,
        help="gpu_impl's longest batch run as a Python loop (default: its own; 0: every batch as tensor operations)",
    )
    parser.add_argument(
        "--two-memories",
        action="store_true",
        help="on the CPU, gpu_impl's host and device faces in two memories: the path CUDA takes (its copies "
        "and the counts of its device calls) without a GPU",
    )
    parser.add_argument(
        "--threads",
        type=integer,
        default=1,
        help=f"torch threads on the CPU, 1 to {MAX_THREADS} (default 1: the reference runs on one core too)",
    )
    parser.add_argument("--seed", type=integer, default=0)
    parser.add_argument(
        "--profile",
        type=profile_name,
        default="vllm-v1",
        help="the eviction policy both pools run (default vllm-v1; a keyed one such as lru-timestamp or lfu "
        "times seed 002's policies: gpu_impl's selection per take against the reference's heaps)",
    )
    parser.add_argument(
        "--events",
        action="store_true",
        help="both pools publish KV cache events (enable_kv_cache_events), which the timed calls pay",
    )
    parser.add_argument(
        "--json", type=json_output, metavar="PATH", help="also write the measurements as JSON (- for stdout)"
    )
    return parser


def _content_options(parser: OneLineParser) -> None:
    """The KV content check's options of `kvspec bench gpu`."""
    parser.add_argument("--no-content", action="store_true", help="skip the KV content check")
    parser.add_argument(
        "--content-blocks",
        type=integer,
        default=None,
        help=f"blocks in the content check (default {DEFAULT_CONTENT_BLOCKS:,}; {FULL_CONTENT_BLOCKS:,} with --full)",
    )
    parser.add_argument(
        "--content-layers",
        default="1",
        help="layers of KV per block in the content check (8 KV heads x head dim 128 x 16 tokens each; default 1), "
        "or auto: as many (up to 16) as fit in 40%% of the free memory",
    )


def _content_layers(content_layers: str, content_blocks: int, device: str | None) -> int:
    """`--content-layers` as a count: auto asks the free memory; a value that is no integer is 0 (refused later).

    Raises:
        BlockManagerError: auto, and the memory cannot be read (content_layers_that_fit).
    """
    if content_layers == "auto" and content_blocks >= 1:  # no blocks fit no layers: refused with the blocks later
        return content_layers_that_fit(content_blocks, device)
    return int(content_layers) if content_layers.lstrip("-").isdigit() else 0


def _bad_arguments(
    args: argparse.Namespace, pools: Sequence[int], batches: Sequence[int], content_blocks: int, content_layers: int
) -> str | None:
    """What is wrong with the grid or the counts, the grid first, then the memory they need; None when nothing is.

    Raises:
        BlockManagerError: the device is not one torch knows (pick_device).
    """
    if min(pools) < 2 or min(batches) < 1:
        return f"pools must be >= 2 and batches >= 1; got pools={list(pools)} batches={list(batches)}"
    if not 1 <= args.threads <= MAX_THREADS or content_blocks < 1 or content_layers < 1:
        return (
            f"threads, content blocks and content layers must be >= 1 (layers: or auto), threads at most "
            f"{MAX_THREADS}; got threads={args.threads} content_blocks={content_blocks} "
            f"content_layers={args.content_layers}"
        )
    unfit = [batch for batch in batches if batch > max(pools) - 1]
    if unfit:
        return (
            f"batches {unfit} fit no pool: a batch takes at most a pool's free blocks (pool - 1, "
            f"{max(pools) - 1:,} here); give larger --pools or smaller --batches"
        )
    return _memory_refusal(args, pools, content_blocks, content_layers)


def _memory_refusal(
    args: argparse.Namespace, pools: Sequence[int], content_blocks: int, content_layers: int
) -> str | None:
    """Why the largest pool, or the content check's KV, would not fit in the memory free now; None when they do.

    Raises:
        BlockManagerError: the device is not one torch knows (pick_device).
    """
    need, free = BYTES_PER_POOL_BLOCK * max(pools), _free_bytes("cpu")  # the pools' bookkeeping is on the host
    if need > free:
        return (
            f"a pool of {max(pools):,} blocks needs about {format_size(need)} here (both pools and the hash map); "
            f"{format_size(free)} is free"
        )
    if not args.no_content:
        layout = KVLayout(num_layers=content_layers, num_kv_heads=8, head_dim=128, block_size=16)
        need, free = content_blocks * layout.block_bytes, _free_bytes(args.device)
        if need > free:
            return (
                f"the content check's KV, {content_blocks:,} blocks of {content_layers} layers, needs "
                f"{format_size(need)}; {format_size(free)} is free on {pick_device(args.device)} "
                "(fewer --content-blocks or --content-layers, or --no-content)"
            )
    return None


def _measure_all(
    args: argparse.Namespace, pools: Sequence[int], batches: Sequence[int], content_blocks: int, content_layers: int
) -> tuple[str, list[Measurement], HashMapTiming | None, ContentTiming | None]:
    """Run the three tables' measurements with torch on `--threads` threads (restored after).

    Returns:
        The device, the comparison's measurements, the hash map's timing and the content check's (None: skipped).

    Raises:
        BlockManagerError: a measurement cannot run (a bad device, a pool or layout refused).
    """
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        device = str(pick_device(args.device))
        results = measure(
            pools,
            batches,
            device,
            seconds_per_cell=args.seconds,
            seed=args.seed,
            python_path_max=args.python_path_max,
            profile=args.profile,
            events=args.events,
            two_memories=args.two_memories,
        )
        hash_map = (
            None
            if args.no_hash_map
            else measure_hash_map(
                num_entries=max(pools), chain_length=min(1_000, max(pools)), device=device, seed=args.seed
            )
        )
        layout = KVLayout(num_layers=content_layers, num_kv_heads=8, head_dim=128, block_size=16)
        content = None if args.no_content else measure_content(content_blocks, layout, device, seed=args.seed)
    finally:
        torch.set_num_threads(previous_threads)
    return device, results, hash_map, content


def _document(
    results: Sequence[Measurement],
    device: str,
    hash_map: HashMapTiming | None,
    content: ContentTiming | None,
    threads: int,
    profile: str = "vllm-v1",
    events: bool = False,
    two_memories: bool = False,
) -> dict[str, object]:
    """The measurements as JSON: seconds per call, with the ratios the table prints."""
    return {
        "kvspec": "bench gpu",
        "device": device,
        "two_memories": two_memories,
        "profile": profile,
        "events": events,
        "threads": threads,
        "measurements": [{**asdict(m), "ratio": m.ratio, "tensor_ratio": m.tensor_ratio} for m in results],
        "hash_map": None if hash_map is None else asdict(hash_map),
        "content": None if content is None else {**asdict(content), "per_hit_block": content.per_hit_block},
    }


if __name__ == "__main__":
    sys.exit(main())
