"""The reference BlockPool against vLLM's own BlockPool on one operation trace.

Both pools replay the same trace of whole requests: look up the request's
prefix (``get_cached_block`` per block hash until a miss), ``touch`` the hit
blocks, ``get_new_blocks`` for the rest, ``cache_full_blocks`` for the new full
blocks, and later ``free_blocks`` tail first; requests come from families of
shared prefixes and stay running until half the pool is held, so allocation
evicts cached blocks. vLLM is driven directly (its block objects, its hash-key
type, a request carrying ``block_hashes``), not through the adapter, so the
numbers are vLLM's own. Construction time is measured too.

Two more lines put the numbers in context. vLLM's ``touch`` takes block
objects and checks nothing; the reference's takes ids and checks each one
(type, range, null block, hash, named twice) before the free queue changes, so
a ``touch, no checks`` row times the reference's own touch loop without those
checks on the same trace. And the conformance harness runs the same pool-level
campaign against the reference and against vLLM: steps per second for both.

Run: ``kvspec oracle --bench`` or ``python -m kvspec.benchmarks.vllm_bench [VERSION]``.
"""

from __future__ import annotations

import hashlib
import random
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvspec.reference import BlockPool

OPS = ("construct", "get_cached_block", "touch", "get_new_blocks", "cache_full_blocks", "free_blocks")
POOL_SIZES = (10_000, 100_000, 1_000_000)


@dataclass(frozen=True)
class Req:
    hashes: tuple[bytes, ...]  # the request's full-block hash chain


def make_trace(num_requests: int, seed: int = 0) -> list[Req]:
    """Requests from 32 prefix families: a shared prefix of 0 to 8 blocks, then 1 to 16 blocks of their own."""
    rng = random.Random(seed)
    families = [[hashlib.sha256(b"%d/%d" % (f, i)).digest() for i in range(8)] for f in range(32)]
    trace = []
    for r in range(num_requests):
        fam = families[rng.randrange(32)]
        shared = fam[: rng.randint(0, 8)]
        own = [hashlib.sha256(b"r%d/%d" % (r, i)).digest() for i in range(rng.randint(1, 16))]
        trace.append(Req(tuple(shared + own)))
    return trace


class _VllmRequest:
    def __init__(self, block_hashes: list[Any]) -> None:
        self.request_id = "bench"
        self.block_hashes = block_hashes


def _run(pool_ops: dict[str, Callable[..., Any]], trace: list[Req], num_blocks: int) -> dict[str, float]:
    """Replay the trace; seconds spent per operation."""
    spent: dict[str, float] = defaultdict(float)
    clock = time.perf_counter
    running: list[list[Any]] = []
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
        while running and (held + len(req.hashes) > num_blocks // 2):
            blocks = running.pop(0)
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
    from kvspec.conformance.vllm.adapter import light_release

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
    from kvspec.conformance.runner import run_check

    rates = []
    for factory in ("reference", f"vllm@{version}"):
        result = run_check(factory, max_examples=max_examples, isolate=False, seed=0)
        if result.verdict != "conforms":
            raise RuntimeError(f"harness against {factory}: {result.verdict} ({result.message})")
        rates.append(result.steps_per_second)
    return rates[0], rates[1]


def main(version: str = "0.33.0", num_requests: int = 20_000) -> int:
    """Print seconds per operation and the reference/vLLM ratio, per pool size."""
    import logging

    logging.disable(logging.WARNING)
    trace = make_trace(num_requests)
    print(f"reference BlockPool vs vllm=={version} BlockPool (light mode), {num_requests} requests")
    print(f"{'blocks':>9} {'op':<18} {'reference s':>12} {'vllm s':>10} {'ratio':>7}")
    worst = 0.0
    for n in POOL_SIZES:
        ref = bench_reference(n, trace)
        vl = bench_vllm(version, n, trace)
        for op in OPS:
            ratio = ref[op] / vl[op] if vl[op] > 0 else float("inf")
            worst = max(worst, ratio)
            print(f"{n:>9} {op:<18} {ref[op]:>12.4f} {vl[op]:>10.4f} {ratio:>6.2f}x")
        # vLLM's touch checks nothing; the reference's checks every id (type, range,
        # null block, hash, duplicates). This row shows what is left without them.
        bare = bench_reference(n, trace, checked_touch=False)["touch"]
        print(f"{n:>9} {'touch, no checks':<18} {bare:>12.4f} {vl['touch']:>10.4f} {bare / vl['touch']:>6.2f}x")
    print(f"worst ratio (reference / vLLM): {worst:.2f}x (target: at most 1.5x)")
    examples = 100
    ref_rate, vllm_rate = harness_speed(version, examples)
    print(
        f"harness, pool level, {examples} examples: {ref_rate:.0f} steps/s against the reference, "
        f"{vllm_rate:.0f} against vllm=={version} ({vllm_rate / ref_rate:.2f}x)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "0.33.0"))
