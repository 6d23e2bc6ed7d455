"""`kvspec simulate`: seed 002's tuning advice (block size, pool size, eviction order) measured on a workload.

A workload is a list of requests: prompt tokens, the tokens the request then
generates, the step it arrives at, a LoRA name and a cache salt. It is
replayed through a request-level block manager (the reference, or any
request-level adapter, `KVCacheManagerAdapter`, such as vLLM's KVCacheManager
behind its adapter; the scheduler calls `get_computed_blocks`,
`allocate_slots` and `free`) by a scheduler that
is vLLM's in outline and nothing more:

- each step, the running requests decode one token each, oldest first; a
  decode that finds no free block preempts the newest running request (freed
  and put back first in the waiting queue, to be recomputed, as vLLM's
  recompute preemption does) and tries again;
- then, unless that preempted a request (vLLM's scheduler admits nothing in
  such a step), the waiting requests that have arrived are admitted first
  come, first served, while the whole of each one's prompt fits and fewer
  than 256 run (vLLM's default `max_num_seqs`): its prefix hit
  (`get_computed_blocks`, capped at len - 1 tokens), then `allocate_slots`
  for the rest; a request that cannot fit, or grow, even with nothing else
  running is rejected (counted) so the queue goes on. There is no token budget per
  step: a prompt is prefilled in one step, not in chunks;
- a request that has generated all its tokens is freed.

What is counted, per configuration: queries and hits as vLLM's prefix-cache
statistics count them (at each admission, the request's tokens and its hit
tokens; a request recomputed after preemption is looked up, and counted,
again, with its preemption count raised so the manager counts it apart),
read from the manager's own counters (`prefix_cache_stats`, spec.stats: the
first admissions and the re-admissions added up) where it keeps them, else
counted by this scheduler at each admission (`counted_by` says which); the
hit rate, evictions (cached blocks reallocated; the reference
counts them, other managers say None), preemptions, the peak of blocks held,
and the unfilled tails: the slots held by running requests past their last
token, as a share of every slot they hold (what a larger block size costs).
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvspec.conformance.core.adapter import KVCacheManagerAdapter
from kvspec.conformance.core.files import read_text_file
from kvspec.reference.kv_cache_manager import KVCacheManager
from kvspec.spec.manager import Request

__all__ = [
    "BYTES_PER_BLOCK",
    "MAX_POOL_BLOCKS",
    "MAX_STEPS",
    "SimRequest",
    "SimResult",
    "WorkloadError",
    "available_memory",
    "pool_size_refusal",
    "read_workload",
    "simulate",
]


MAX_RUNNING = 256  # requests running at once: vLLM's default max_num_seqs


class WorkloadError(ValueError):
    """A workload file or request that cannot be simulated (the message names the line)."""


# The reference manager's memory per pool block, measured with tracemalloc (a KVCacheBlock, its free-queue
# links, the manager's tables): about 120 bytes; 200 leaves room for the run's own bookkeeping.
BYTES_PER_BLOCK = 200
# The largest pool simulate builds: 10,000,000 blocks take about 2 GB and a minute and a half to build.
MAX_POOL_BLOCKS = 10_000_000
# The scheduler steps a simulation runs at most: a request decodes one token per step, so one that arrives
# or generates later than this never finishes, and a workload file is refused for it before anything runs.
MAX_STEPS = 1_000_000


def available_memory() -> int | None:
    """Bytes of memory the machine can still give (Linux's MemAvailable), or None where it does not say."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def pool_size_refusal(pools: Sequence[int], at_once: int) -> str | None:
    """Why pools of these sizes, ``at_once`` built at the same time, will not be built; None when they fit.

    >>> pool_size_refusal([2000], 1) is None
    True
    >>> pool_size_refusal([10**14], 1).split(";")[0]
    '--pool 100000000000000 is more than simulate builds (at most 10,000,000 blocks)'
    """
    largest = max(pools)
    if largest > MAX_POOL_BLOCKS:
        return f"--pool {largest} is more than simulate builds (at most {MAX_POOL_BLOCKS:,} blocks); " \
            "a pool's hit rate levels off long before"  # fmt: skip
    need = BYTES_PER_BLOCK * sum(sorted(pools)[-at_once:])
    free = available_memory()
    if free is not None and need > free:
        return f"pools of {', '.join(map(str, pools))} blocks, {at_once} at once, need about {need / 2**30:.1f} GiB; " \
            f"{free / 2**30:.1f} GiB is available (fewer --jobs, or smaller pools)"  # fmt: skip
    return None


@dataclass(frozen=True, slots=True)
class SimRequest:
    """One request of a workload."""

    prompt: tuple[int, ...]  # at least one token
    output: tuple[int, ...] = ()  # the tokens it generates, one per decode step
    arrival: int = 0  # the first scheduler step it may be admitted at
    lora_name: str | None = None
    cache_salt: str | None = None


@dataclass(frozen=True, slots=True)
class SimResult:
    """What one configuration of a simulation measured."""

    profile: str
    block_size: int
    num_gpu_blocks: int
    requests: int  # in the workload
    finished: int
    rejected: int  # could not fit in the pool even alone
    preemptions: int
    queries: int  # tokens looked up, as vLLM's prefix-cache stats count them
    hits: int  # of those, tokens found cached
    evictions: int | None  # cached blocks reallocated (None: the manager does not count them)
    peak_blocks_held: int
    tail_share: float  # unfilled tail slots / slots held by running requests, averaged over steps
    steps: int
    counted_by: str = "scheduler"  # where queries and hits come from: "manager" (its prefix_cache_stats) or this

    @property
    def hit_rate(self) -> float:
        """hits / queries (0 with no query)."""
        return self.hits / self.queries if self.queries else 0.0

    def as_json(self) -> dict[str, Any]:
        """The result, with the hit rate, as plain JSON values."""
        return {**asdict(self), "hit_rate": self.hit_rate}


@dataclass(slots=True)
class _Running:
    computed: int  # tokens with slots: the prompt, then one per decode step
    blocks: list[Any] = field(default_factory=list)  # its block table


def _request(index: int, req: SimRequest, num_tokens: int, num_preemptions: int = 0) -> Request:
    tokens = (req.prompt + req.output)[:num_tokens]
    return Request(
        f"r{index}", tokens, lora_name=req.lora_name, cache_salt=req.cache_salt, num_preemptions=num_preemptions
    )


class _Scheduler:
    """One simulation: the queues, the counters, and the steps."""

    def __init__(self, workload: Sequence[SimRequest], manager: KVCacheManagerAdapter, block_size: int) -> None:
        self.workload, self.manager, self.block_size = workload, manager, block_size
        self.arrivals = deque(sorted(range(len(workload)), key=lambda i: (workload[i].arrival, i)))
        self.waiting: deque[tuple[int, int]] = deque()  # (index, tokens generated before a preemption)
        self.running: dict[int, _Running] = {}  # in admission order
        self.finished = self.rejected = self.preemptions = self.queries = self.hits = 0
        self.num_preemptions: dict[int, int] = {}  # request index -> times it was preempted
        self.peak = 0
        self.tail_shares: list[float] = []

    def run(self, max_steps: int) -> int:
        step = 0
        while (self.arrivals or self.waiting or self.running) and step < max_steps:
            while self.arrivals and self.workload[self.arrivals[0]].arrival <= step:
                self.waiting.append((self.arrivals.popleft(), 0))
            if not self._decode():
                self._admit()
            self._measure()
            step += 1
        if self.arrivals or self.waiting or self.running:
            raise WorkloadError(f"the workload did not finish within {max_steps} steps")
        return step

    def _decode(self) -> bool:
        """One decode step for every running request; whether it preempted one."""
        preempted = False
        for index in list(self.running):
            run = self.running.get(index)
            if run is None:  # preempted earlier in this step
                continue
            req = self.workload[index]
            if run.computed >= len(req.prompt) + len(req.output):
                self._release(index)
                self.finished += 1
                continue
            while True:
                got = self.manager.allocate_slots(_request(index, req, run.computed + 1), 1)
                if got is not None:
                    run.blocks += got
                    run.computed += 1
                    break
                victim = next(reversed(self.running))
                generated = self._release(victim)
                if victim == index and not self.running:
                    self.rejected += 1  # it cannot grow even alone: recomputing it would loop forever
                    break
                self.waiting.appendleft((victim, generated))
                self.preemptions += 1
                self.num_preemptions[victim] = self.num_preemptions.get(victim, 0) + 1
                preempted = True
                if victim == index:
                    break
        return preempted

    def _release(self, index: int) -> int:
        """Free a running request; returns how many tokens it had generated."""
        run = self.running.pop(index)
        self.manager.free(f"r{index}")
        return run.computed - len(self.workload[index].prompt)

    def _admit(self) -> None:
        while self.waiting and len(self.running) < MAX_RUNNING:
            index, generated = self.waiting[0]
            req = self.workload[index]
            request = _request(index, req, len(req.prompt) + max(generated, 0), self.num_preemptions.get(index, 0))
            blocks, num_hit = self.manager.get_computed_blocks(request)
            got = self.manager.allocate_slots(request, len(request.token_ids) - num_hit, num_hit, blocks)
            if got is None:
                if self.running:
                    return  # first come, first served: the head waits for blocks to free up
                self.waiting.popleft()
                self.rejected += 1
                continue
            self.waiting.popleft()
            self.queries += len(request.token_ids)
            self.hits += num_hit
            self.running[index] = _Running(len(request.token_ids), [*blocks, *got])

    def _measure(self) -> None:
        held = {b for run in self.running.values() for b in run.blocks}
        self.peak = max(self.peak, len(held))
        slots = sum(len(run.blocks) for run in self.running.values()) * self.block_size
        if slots:
            unused = sum(len(run.blocks) * self.block_size - run.computed for run in self.running.values())
            self.tail_shares.append(unused / slots)


def simulate(
    workload: Sequence[SimRequest],
    *,
    block_size: int,
    num_gpu_blocks: int,
    profile: str = "vllm-v1",
    enable_caching: bool = True,
    manager: Callable[[], KVCacheManagerAdapter] | None = None,
    max_steps: int = MAX_STEPS,
) -> SimResult:
    """Replay `workload` through a block manager; one configuration.

    Args:
        workload: the requests.
        block_size, num_gpu_blocks, profile, enable_caching: the reference manager's configuration.
        manager: builds the manager to drive instead of the reference (its configuration is the
            caller's; the arguments above then only label the result).
        max_steps: a bound on scheduler steps (a workload that does not finish is an error).

    Raises:
        WorkloadError: the workload is empty or did not finish within `max_steps`.
        kvspec.spec.errors.InvalidRequest: a configuration value the reference refuses.
    """
    if not workload:
        raise WorkloadError("the workload has no request")
    built: KVCacheManagerAdapter = (
        manager() if manager is not None else KVCacheManager(num_gpu_blocks, block_size, enable_caching, profile)
    )
    sched = _Scheduler(workload, built, block_size)
    steps = sched.run(max_steps)
    pool = getattr(built, "block_pool", None)
    evictions = getattr(pool, "num_evictions", None) if isinstance(built, KVCacheManager) else None
    shares = sched.tail_shares
    queries, hits, counted_by = sched.queries, sched.hits, "scheduler"
    counters = getattr(built, "prefix_cache_stats", None)
    if callable(counters):  # the manager's own counters: what an operator's dashboard reads
        local = counters().local
        queries, hits = local.queries + local.preempted_queries, local.hits + local.preempted_hits
        counted_by = "manager"
    return SimResult(
        profile, block_size, num_gpu_blocks, len(workload), sched.finished, sched.rejected, sched.preemptions,
        queries, hits, evictions, sched.peak, sum(shares) / len(shares) if shares else 0.0, steps, counted_by,
    )  # fmt: skip


# --- workload files --------------------------------------------------------------------------------


def _token_list(value: object, what: str, where: str, allow_empty: bool) -> tuple[int, ...]:
    if not isinstance(value, list) or (not value and not allow_empty):
        raise WorkloadError(f"{where}: {what} must be a {'' if allow_empty else 'non-empty '}list of token ids")
    for t in value:
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise WorkloadError(f"{where}: {what} holds {t!r}, not a non-negative integer token id")
    return tuple(value)


def _optional_str(entry: dict[str, Any], key: str, where: str) -> str | None:
    value = entry.get(key)
    if value is not None and (not isinstance(value, str) or not value):
        raise WorkloadError(f"{where}: {key} must be a non-empty string; got {value!r}")
    return value


_KEYS = {"prompt", "output", "arrival", "lora", "cache_salt"}


def parse_request(entry: object, where: str) -> SimRequest:
    """One workload line's request: {"prompt": [...], "output": [...], "arrival": n, "lora": s, "cache_salt": s}.

    Raises:
        WorkloadError: a missing or malformed field, or an unknown one; the message starts with `where`.
    """
    if not isinstance(entry, dict):
        raise WorkloadError(f"{where}: a request is a JSON object; got {type(entry).__name__}")
    unknown = sorted(set(entry) - _KEYS)
    if unknown:
        raise WorkloadError(f"{where}: unknown field(s) {', '.join(unknown)}; a request has {', '.join(sorted(_KEYS))}")
    if "prompt" not in entry:
        raise WorkloadError(f"{where}: no prompt")
    arrival = entry.get("arrival", 0)
    if isinstance(arrival, bool) or not isinstance(arrival, int) or arrival < 0:
        raise WorkloadError(f"{where}: arrival must be a non-negative integer step; got {arrival!r}")
    prompt = _token_list(entry["prompt"], "prompt", where, allow_empty=False)
    output = _token_list(entry.get("output", []), "output", where, allow_empty=True)
    # Admitted at its arrival, then one token per step, then freed: the step it ends at is known now.
    if arrival + len(output) + 1 >= MAX_STEPS:
        raise WorkloadError(f"{where}: arrival {arrival} with {len(output)} output tokens ends past the "
                            f"{MAX_STEPS:,} steps a simulation runs (one token per step)")  # fmt: skip
    lora, salt = _optional_str(entry, "lora", where), _optional_str(entry, "cache_salt", where)
    return SimRequest(prompt, output, arrival, lora, salt)


def read_workload(path: str | Path) -> list[SimRequest]:
    """The requests of a JSON-lines file, one per non-blank line.

    Raises:
        WorkloadError: the file cannot be read, a line is not JSON or not a request (named by its number),
            or it holds no request.
    """
    try:
        lines: Iterable[str] = read_text_file(path).splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise WorkloadError(f"{path}: cannot read the workload: {e}") from None
    requests = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as e:
            raise WorkloadError(f"{where}: not JSON ({e.msg})") from None
        except RecursionError:  # json's parser recurses once per level of nesting
            raise WorkloadError(f"{where}: nested deeper than any request") from None
        requests.append(parse_request(entry, where))
    if not requests:
        raise WorkloadError(f"{path}: no request in the file")
    return requests
