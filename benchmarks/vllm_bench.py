"""The reference BlockPool against vLLM's own BlockPool on one operation trace.

Both pools replay the same trace of whole requests, the way a scheduler drives
a pool: look up the request's prefix (``get_cached_block`` per block hash until
a miss), ``touch`` the hit blocks, ``get_new_blocks`` for the rest,
``cache_full_blocks`` for the new full blocks, and ``free_blocks`` (tail
first) when the request finishes. At most 256 requests run at once (vLLM's
default ``max_num_seqs``) and at most half the pool is held, so the oldest
running request finishes first when either limit is reached. Half the
requests start a conversation on one of 32 shared system prompts; the other
half are a user's next turn of an earlier conversation whose last turn has
finished: its blocks are free but still cached unless allocation has evicted
them, so ``touch`` takes cached blocks out of the free queue as well as adding
holders to running ones, and allocation evicts cached blocks in the small
pool. vLLM is driven directly (its block objects, its hash-key type, a request
carrying ``block_hashes``), not through the adapter, so the numbers are vLLM's
own. Construction time is measured too.

Four more lines put the numbers in context. The two APIs split a prefix hit
differently: vLLM's ``get_cached_block`` returns block objects and its
``touch`` takes them and checks nothing; the reference's lookup returns ids
and its ``touch`` finds each block by id and checks it (type, range, null
block, hash, named twice) before the free queue changes. So the ``prefix hit``
row adds the two operations up (a scheduler's work per hit), and the ``touch,
no checks`` row times the reference's own touch loop without its checks on the
same trace; the ``whole trace`` row sums every operation of the trace
(construction aside), the figure a scheduler feels. And the conformance harness runs the same pool-level campaign
against the reference and against vLLM: steps per second for both.

Run: ``kvspec oracle --bench`` or ``python -m kvspec.benchmarks.vllm_bench [VERSION]``.
"""

from __future__ import annotations

import gc
import hashlib
import inspect
import logging
import random
import sys
import time
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from kvspec.conformance.core.results import Verdict
from kvspec.conformance.runner.run import run_check
from kvspec.conformance.targets.vllm.adapter import light_release
from kvspec.conformance.targets.vllm.lightmode import LightModeError
from kvspec.reference import BlockPool

OPS = ("construct", "get_cached_block", "touch", "get_new_blocks", "cache_full_blocks", "free_blocks")
POOL_SIZES = (10_000, 100_000, 1_000_000)
MAX_RUNNING = 256  # requests running at once: vLLM's default max_num_seqs
RETURN_AFTER = 2 * MAX_RUNNING  # a user's next turn comes once the last one has finished (FIFO, <= 256 later)
LEAVE_AFTER = 16 * MAX_RUNNING  # a conversation idle this many requests is not continued
MAX_CONVERSATION_BLOCKS = 64


@dataclass(frozen=True)
class Req:
    hashes: tuple[bytes, ...]  # the request's full-block hash chain


def make_trace(num_requests: int, seed: int = 0) -> list[Req]:
    """Whole requests: half start a conversation, half continue one whose last turn has finished.

    A new conversation is 0 to 8 blocks of one of 32 system prompts, then 1 to
    16 of its own; a next turn is the conversation so far plus 1 to 8 blocks.
    """
    rng = random.Random(seed)
    prompts = [[hashlib.sha256(b"%d/%d" % (f, i)).digest() for i in range(8)] for f in range(32)]
    turns: list[tuple[int, tuple[bytes, ...]]] = []  # (request index, chain) of every turn that can go on
    returnable: list[tuple[int, tuple[bytes, ...]]] = []  # those a user may come back to now
    next_turn = 0  # turns[:next_turn] have been made returnable
    trace = []
    for r in range(num_requests):
        while next_turn < len(turns) and turns[next_turn][0] <= r - RETURN_AFTER:
            returnable.append(turns[next_turn])
            next_turn += 1
        if r % MAX_RUNNING == 0:  # users who left
            returnable = [t for t in returnable if t[0] > r - LEAVE_AFTER]
        if returnable and rng.random() < 0.5:
            chain = returnable.pop(rng.randrange(len(returnable)))[1]
            num_own = rng.randint(1, 8)
        else:
            chain = tuple(prompts[rng.randrange(32)][: rng.randint(0, 8)])
            num_own = rng.randint(1, 16)
        hashes = chain + tuple(hashlib.sha256(b"r%d/%d" % (r, i)).digest() for i in range(num_own))
        trace.append(Req(hashes))
        if len(hashes) <= MAX_CONVERSATION_BLOCKS - 8:
            turns.append((r, hashes))
    return trace


class _VllmRequest:
    def __init__(self, block_hashes: list[Any]) -> None:
        self.request_id = "bench"
        self.block_hashes = block_hashes


def _run(pool_ops: dict[str, Callable[..., Any]], trace: list[Req], num_blocks: int) -> dict[str, float]:
    """Replay the trace; seconds spent per operation."""
    spent: dict[str, float] = defaultdict(float)
    clock = time.perf_counter
    running: deque[list[Any]] = deque()
    held = 0
    lookup, touch, alloc, cache, free = (pool_ops[k] for k in OPS[1:])
    for req in trace:
        t = clock()
        hits = []
        for h in req.hashes[:-1]:  # the last block is always computed
            b = lookup(h)
            if b is None:
                break
            hits.append(b)
        t2 = clock()
        spent["get_cached_block"] += t2 - t
        need = len(req.hashes) - len(hits)
        while running and (len(running) >= MAX_RUNNING or held + len(req.hashes) > num_blocks // 2):
            blocks = running.popleft()  # the oldest request finishes
            t = clock()
            free(blocks[::-1])
            spent["free_blocks"] += clock() - t
            held -= len(blocks)
        t = clock()
        touch(hits)
        t2 = clock()
        new = alloc(need)
        t3 = clock()
        cache(new, list(req.hashes[len(hits) :]))
        t4 = clock()
        spent["touch"] += t2 - t
        spent["get_new_blocks"] += t3 - t2
        spent["cache_full_blocks"] += t4 - t3
        running.append(hits + new)
        held += len(req.hashes)
    for blocks in running:
        t = clock()
        free(blocks[::-1])
        spent["free_blocks"] += clock() - t
    return dict(spent)


def reference_ops(pool: BlockPool, checked_touch: bool = True) -> dict[str, Callable[..., Any]]:
    """The reference pool's operations as the trace calls them (touch without its checks on request)."""
    return {
        "get_cached_block": pool.get_cached_block,
        "touch": pool.touch if checked_touch else _touch_without_checks(pool),
        "get_new_blocks": pool.get_new_blocks,
        "cache_full_blocks": pool.cache_full_blocks,
        "free_blocks": pool.free_blocks,
    }


def bench_reference(num_blocks: int, trace: list[Req], checked_touch: bool = True) -> dict[str, float]:
    """The reference model on the trace; `checked_touch=False` times `_touch_without_checks` instead."""
    t = time.perf_counter()
    pool = BlockPool(num_blocks, True)
    construct = time.perf_counter() - t
    out = _run(reference_ops(pool, checked_touch), trace, num_blocks)
    out["construct"] = construct
    return out


def bench_vllm(version: str, num_blocks: int, trace: list[Req]) -> dict[str, float]:
    """vLLM's BlockPool of ``version`` (light mode: the release's own modules) on the trace."""

    release = light_release(version)
    ku, bp = release.kv_cache_utils, release.block_pool
    t = time.perf_counter()
    pool = bp.BlockPool(num_blocks, True, hash_block_size=16)
    construct = time.perf_counter() - t
    make_key = ku.make_block_hash_with_group_id

    def lookup(h: bytes) -> Any:
        found = pool.get_cached_block(h, [0])
        return None if found is None else found[0]

    def cache(blocks: list[Any], hashes: list[bytes]) -> None:
        pool.cache_full_blocks(_VllmRequest(hashes), blocks, 0, len(blocks), 16, 0)

    del make_key
    ops = {
        "get_cached_block": lookup,
        "touch": pool.touch,
        "get_new_blocks": pool.get_new_blocks,
        "cache_full_blocks": cache,
        "free_blocks": pool.free_blocks,
    }
    out = _run(ops, trace, num_blocks)
    out["construct"] = construct
    return out


def _touch_without_checks(pool: BlockPool) -> Callable[[list[Any]], None]:
    """The reference's touch with its argument checks taken out: what the checks cost, measured.

    Benchmark-only; kept to the reference's own data-structure work (a lookup,
    the free-queue removal, the reference count) so the difference is the checks.
    """
    all_blocks, remove = pool.blocks, pool.free_block_queue.remove

    def touch(block_ids: list[Any]) -> None:
        for b in block_ids:
            block = all_blocks[b]
            if block.ref_cnt == 0:
                remove(block)
            block.ref_cnt += 1

    return touch


def harness_speed(version: str, max_examples: int = 100) -> tuple[float, float]:
    """Pool-level harness steps per second against the reference and against vLLM ``version``, same campaign."""

    rates = []
    for factory in ("reference", f"vllm@{version}"):
        result = run_check(factory, max_examples=max_examples, isolate=False, seed=0)
        if result.verdict is not Verdict.CONFORMS:
            raise RuntimeError(f"harness against {factory}: {result.verdict} ({result.message})")
        rates.append(result.steps_per_second)
    return rates[0], rates[1]


def _best_of(runs: int, bench: Callable[[], dict[str, float]]) -> dict[str, float]:
    """The least time per operation over `runs` replays, with the garbage collector off (as timeit does)."""
    results = []
    for _ in range(runs):
        gc.collect()
        gc.disable()  # a collection pause lands on whichever operation is running: noise, not cost
        try:
            results.append(bench())
        finally:
            gc.enable()
    return {op: min(r[op] for r in results) for op in results[0]}


def whole_trace(spent: dict[str, float]) -> float:
    """Seconds for every operation of the trace together (construction aside): what a scheduler feels.

    >>> whole_trace({"construct": 9.0, "touch": 1.0, "free_blocks": 0.5})
    1.5
    """
    return sum(seconds for op, seconds in spent.items() if op != "construct")


def main(version: str = "0.33.0", num_requests: int = 20_000, runs: int = 3) -> int:
    """Print seconds per operation and the reference/vLLM ratio, per pool size (best of `runs` replays)."""

    logging.disable(logging.WARNING)
    try:  # the release first: a name that loads no vLLM, or a pool built otherwise, is refused before any timing
        release = light_release(version)
    except LightModeError as e:
        print(f"kvspec oracle --bench: {e}", file=sys.stderr)
        return 2
    if "hash_block_size" not in inspect.signature(release.block_pool.BlockPool).parameters:
        print(
            f"kvspec oracle --bench: vllm=={version}'s BlockPool takes no hash_block_size; the benchmark builds "
            "the pool as vLLM does from 0.12.0 on",
            file=sys.stderr,
        )
        return 2
    trace = make_trace(num_requests)
    print(f"reference BlockPool vs vllm=={version} BlockPool (light mode), {num_requests} requests, best of {runs}")
    print(f"{'blocks':>9} {'op':<18} {'reference s':>12} {'vllm s':>10} {'ratio':>7}")
    worst = 0.0
    for n in POOL_SIZES:
        ref = _best_of(runs, partial(bench_reference, n, trace))
        vl = _best_of(runs, partial(bench_vllm, version, n, trace))
        for op in OPS:
            ratio = ref[op] / vl[op] if vl[op] > 0 else float("inf")
            worst = max(worst, ratio)
            print(f"{n:>9} {op:<18} {ref[op]:>12.4f} {vl[op]:>10.4f} {ratio:>6.2f}x")
        # The lookup returns ids in the reference and block objects in vLLM, so
        # finding the blocks is touch's work in one and the lookup's in the other.
        ref_hit, vllm_hit = ref["get_cached_block"] + ref["touch"], vl["get_cached_block"] + vl["touch"]
        print(f"{n:>9} {'prefix hit':<18} {ref_hit:>12.4f} {vllm_hit:>10.4f} {ref_hit / vllm_hit:>6.2f}x")
        # vLLM's touch checks nothing; the reference's checks every id (type, range,
        # null block, hash, duplicates). This row shows what is left without them.
        bare = _best_of(runs, partial(bench_reference, n, trace, checked_touch=False))["touch"]
        print(f"{n:>9} {'touch, no checks':<18} {bare:>12.4f} {vl['touch']:>10.4f} {bare / vl['touch']:>6.2f}x")
        ref_all, vllm_all = whole_trace(ref), whole_trace(vl)
        print(f"{n:>9} {'whole trace':<18} {ref_all:>12.4f} {vllm_all:>10.4f} {ref_all / vllm_all:>6.2f}x")
    print(f"worst ratio (reference / vLLM), per operation: {worst:.2f}x (target: at most 1.5x)")
    examples = 100
    ref_rate, vllm_rate = harness_speed(version, examples)
    print(
        f"harness, pool level, {examples} examples: {ref_rate:.0f} steps/s against the reference, "
        f"{vllm_rate:.0f} against vllm=={version} ({vllm_rate / ref_rate:.2f}x)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "0.33.0"))
