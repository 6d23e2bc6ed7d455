"""The conformance state machines: the spec and an implementation in lock-step.

Two Hypothesis `RuleBasedStateMachine`s, one per adapter level. Each rule
drives one or two adapter methods (and is named after the one it drives);
every call goes to the spec (`kvspec.spec.ops` / `kvspec.spec.manager`) and to
the implementation with the same arguments, and after every call `LockStep`
checks, in this order, naming what failed:

1. the implementation did not crash or hang;
2. hit rules (`check_hit`) on every prefix hit it returns;
3. the same result (block ids in order) or the same spec error type;
4. after an error, its state is exactly what it was before the call;
5. every state invariant of its snapshot (`check_all`) and every step rule
   between its snapshots before and after (`check_step`);
6. its whole snapshot equals the spec's, hash values renamed consistently
   (`Snapshot.with_canonical_hashes`), and the renaming stays the same from one
   step to the next (a hash is a name, but the same name throughout).

Design choice: the machine runs the spec itself, contracts included, as the
oracle, rather than the reference model: an implementation that agrees with
the reference but not with the spec would hide a bug shared by both. The
rejected alternative (checking only the invariants, without an oracle) would
accept any order of the free queue that keeps the invariants, and the order
is the eviction policy, the thing most worth checking.

Rules use preconditions (never `assume`) and bundles: the pool level keeps
groups of held blocks (one per simulated request) that `free_blocks`
consumes; the request level keeps prompts (families of shared prefixes, chats
that grow turn by turn), running requests and preempted ones. Each rule makes
a valid call about three times in four and otherwise one mistake the spec
rejects for that operation (double frees have their own rule), placed anywhere
in the argument list, so an implementation that validates half-way and then
changes its state is caught.

Rules are few and each does what a scheduler does in one go (allocate and
register the full blocks; look a hash chain up and touch the hits; finish
every request and reset), because Hypothesis turns a random subset of rules
off in each example (swarm testing): with many small rules, an example rarely
had all the ones a deep state needs. `target()` records how many cached blocks
an example evicted or hit again; long campaigns (1,000 examples or more)
hill-climb on it, short ones skip that phase, where it spent the budget on one
example's neighbours.
"""

from __future__ import annotations

import json
import operator
import os
import signal
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any, ClassVar, Literal, cast

from hypothesis import strategies as st
from hypothesis import target
from hypothesis.control import current_build_context
from hypothesis.errors import InvalidArgument
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
)

from kvspec.conformance import strategies as strat
from kvspec.conformance.adapter import OPTIONAL_POOL_OPS, AdapterConfig, KVContentAdapter, capabilities
from kvspec.conformance.report import render_story
from kvspec.conformance.trace import OP_PARAMS, Outcome, Trace, TraceStep, encode_value, header_line
from kvspec.spec import errors as spec_errors
from kvspec.spec import manager as spec_manager
from kvspec.spec import ops as spec_ops
from kvspec.spec.hashing import block_extra_keys
from kvspec.spec.invariants import INVARIANTS, STEP_RULES, check_all, check_hit, check_step, hit_content_intact
from kvspec.spec.manager import ManagerState, Request
from kvspec.spec.state import BlockHash, BlockId, PoolState, Snapshot

__all__ = [
    "NOT_EXERCISED_WHY",
    "ConformanceFailure",
    "LockStep",
    "ManagerMachine",
    "Observer",
    "PoolMachine",
    "PrefixKVSource",
    "SpecFailure",
    "StepTimeout",
    "conformance_machine",
    "expected_branches",
    "run_spec",
]

Factory = Callable[[AdapterConfig], object]


class ConformanceFailure(AssertionError):
    """The implementation broke the spec at one step; raised inside the machine, shrunk by Hypothesis."""

    def __init__(self, kind: str, step_index: int, op: str, message: str, invariant: str | None = None) -> None:
        super().__init__(f"{kind} at step {step_index} ({op}): {message}")
        self.kind = kind  # "diverges", "invariant" or "crashed"
        self.step_index = step_index  # 1-based; 0 is building the adapter
        self.op = op
        self.message = message
        self.invariant = invariant  # the rule's name, for kind "invariant"


class SpecFailure(AssertionError):
    """The spec itself failed (a contract or an unexpected exception): a bug in kvspec, not in the implementation."""


class StepTimeout(BaseException):
    """One implementation call ran past the step time limit.

    A BaseException on purpose: Hypothesis lets it through at once instead of
    shrinking it, since every shrink attempt of a hang would cost a full time
    limit.
    """


# --- results in normal form ---------------------------------------------------------------


class _BadResult(Exception):
    pass


def _as_id(v: Any) -> int:
    if isinstance(v, bool):
        raise _BadResult(f"{v!r} is a bool, not a block id")
    try:
        return operator.index(v)
    except TypeError:
        raise _BadResult(f"{v!r} is not an integer block id") from None


def _as_ids(v: Any) -> list[int]:
    if isinstance(v, (str, bytes)) or not isinstance(v, Sequence):
        try:
            v = list(v)
        except TypeError:
            raise _BadResult(f"{v!r} is not a list of block ids") from None
    return [_as_id(b) for b in v]


def _as_bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    raise _BadResult(f"{v!r} is not a bool")


def _norm_get_computed(v: Any) -> list[Any]:
    if not isinstance(v, (tuple, list)) or len(v) != 2:
        raise _BadResult(f"{v!r} is not (hit blocks, num_hit_tokens)")
    return [_as_ids(v[0]), _as_id(v[1])]


def _norm_float(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _BadResult(f"{v!r} is not a number")
    return float(v)


# How each operation's return value is put in normal (JSON) form; None: not compared.
_NORMALIZE: dict[str, Callable[[Any], Any] | None] = {
    "get_new_blocks": _as_ids,
    "touch": None,
    "free_blocks": None,
    "cache_full_blocks": None,
    "get_cached_block": lambda v: None if v is None else _as_id(v),
    "evict_blocks": None,
    "reset_prefix_cache": _as_bool,
    "is_block_writable": _as_bool,
    "get_num_free_blocks": _as_id,
    "get_usage": _norm_float,
    "get_computed_blocks": _norm_get_computed,
    "allocate_slots": lambda v: None if v is None else _as_ids(v),
    "free": None,
}


def _results_equal(op: str, spec: Any, impl: Any) -> bool:
    if op == "get_usage":
        return bool(abs(spec - impl) <= 1e-9)
    return bool(spec == impl)


# --- the spec side ------------------------------------------------------------------------


def _pool_op(op: str) -> Callable[..., tuple[PoolState, Any]]:
    def run(state: PoolState, *args: Any) -> tuple[PoolState, Any]:
        if op == "get_new_blocks":
            new, taken = spec_ops.get_new_blocks(state, *args)
            return new, list(taken)
        if op == "reset_prefix_cache":
            return cast(tuple[PoolState, Any], spec_ops.reset_prefix_cache(state))
        if op in ("touch", "free_blocks", "cache_full_blocks", "evict_blocks"):
            return getattr(spec_ops, op)(state, *args), None
        return state, getattr(spec_ops, op)(state, *args)

    return run


def _manager_op(op: str) -> Callable[..., tuple[ManagerState, Any]]:
    def run(state: ManagerState, *args: Any) -> tuple[ManagerState, Any]:
        if op == "get_computed_blocks":
            blocks, num_tokens = spec_manager.get_computed_blocks(state, *args)
            return state, [list(blocks), num_tokens]
        if op == "allocate_slots":
            new, allocated = spec_manager.allocate_slots(state, *args)
            return new, None if allocated is None else list(allocated)
        return spec_manager.free(state, *args), None

    return run


_POOL_OPS = {op: _pool_op(op) for op in list(_NORMALIZE)[:10]}
_MANAGER_OPS = {op: _manager_op(op) for op in list(_NORMALIZE)[10:]}


def _spec_error_name(e: BaseException) -> str | None:
    """The most specific spec error class `e` is an instance of (a subclass counts as its base)."""
    for cls in type(e).__mro__:
        if (
            issubclass(cls, spec_errors.BlockManagerError)
            and cls is not spec_errors.BlockManagerError
            and getattr(spec_errors, cls.__name__, None) is cls
        ):
            return str(cls.__name__)
    return None


def _crash_message(e: BaseException) -> str:
    frames = traceback.extract_tb(e.__traceback__)
    where = f" (at {frames[-1].filename.rsplit('/', 1)[-1]}:{frames[-1].lineno} in {frames[-1].name})" if frames else ""
    return f"{type(e).__name__}: {e}{where}"


# --- coverage -----------------------------------------------------------------------------

_POOL_BRANCHES = (
    "get_new_blocks: taken",
    "get_new_blocks: evicted a cached block",
    "get_new_blocks: PoolExhausted",
    "get_new_blocks: InvalidRequest",
    "touch: hit a free block",
    "touch: hit a held block",
    "touch: InvalidBlock",
    "touch: InvalidRequest",
    "free_blocks: to the left end",
    "free_blocks: to the right end",
    "free_blocks: still held by another",
    "free_blocks: DoubleFree",
    "free_blocks: InvalidBlock",
    "free_blocks: InvalidRequest",
    "cache_full_blocks: registered",
    "cache_full_blocks: duplicate hash kept",
    "cache_full_blocks: AlreadyCached",
    "cache_full_blocks: InvalidBlock",
    "cache_full_blocks: InvalidRequest",
    "get_cached_block: hit",
    "get_cached_block: hit a free block",
    "get_cached_block: miss",
    "get_cached_block: InvalidRequest",
    "evict_blocks: dropped a held block's hash",
    "evict_blocks: dropped a free block's hash",
    "evict_blocks: nothing cached",
    "evict_blocks: InvalidBlock",
    "evict_blocks: InvalidRequest",
    "reset_prefix_cache: accepted",
    "reset_prefix_cache: accepted, hashes dropped",
    "reset_prefix_cache: refused, blocks held",
    "is_block_writable: yes",
    "is_block_writable: no",
    "is_block_writable: InvalidBlock",
    "get_num_free_blocks",
    "get_usage",
)
_MANAGER_BRANCHES = (
    "get_computed_blocks: miss",
    "get_computed_blocks: hit",
    "get_computed_blocks: hit a free block",
    "get_computed_blocks: hit capped at len - 1",
    "get_computed_blocks: InvalidRequest",
    "allocate_slots: admitted",
    "allocate_slots: admitted with a prefix hit",
    "allocate_slots: external tokens",
    "allocate_slots: chunked prefill",
    "allocate_slots: decode",
    "allocate_slots: registered full blocks",
    "allocate_slots: duplicate hash kept",
    "allocate_slots: evicted a cached block",
    "allocate_slots: too few free blocks",
    "allocate_slots: InvalidRequest",
    "allocate_slots: InvalidBlock",
    "free: request finished",
    "free: request preempted",
    "free: shared blocks kept",
    "free: InvalidRequest",
    "readmitted after preemption",
)
# Branches only prefix caching can reach.
_CACHING_ONLY = frozenset(
    {
        "get_new_blocks: evicted a cached block",
        "touch: hit a free block",
        "touch: hit a held block",
        "touch: InvalidRequest",
        "free_blocks: still held by another",  # only a touch shares a block
        "cache_full_blocks: registered",
        "cache_full_blocks: duplicate hash kept",
        "cache_full_blocks: AlreadyCached",
        "cache_full_blocks: InvalidBlock",
        "get_cached_block: hit",
        "get_cached_block: hit a free block",
        "evict_blocks: dropped a held block's hash",
        "evict_blocks: dropped a free block's hash",
        "reset_prefix_cache: accepted, hashes dropped",
        "get_computed_blocks: hit",
        "get_computed_blocks: hit a free block",
        "get_computed_blocks: hit capped at len - 1",
        "allocate_slots: admitted with a prefix hit",
        "allocate_slots: registered full blocks",
        "allocate_slots: duplicate hash kept",
        "allocate_slots: evicted a cached block",
        "allocate_slots: InvalidBlock",
        "free: shared blocks kept",
    }
)


def expected_branches(level: str, enable_caching: bool, profile: str) -> tuple[str, ...]:
    """The spec branches and events a campaign at this configuration should reach.

    >>> "get_cached_block: hit" in expected_branches("pool", False, "vllm-v1")
    False
    """
    names: tuple[str, ...] = _POOL_BRANCHES if level == "pool" else _MANAGER_BRANCHES
    if not enable_caching:
        names = tuple(n for n in names if n not in _CACHING_ONLY)
        # Without hashes every freed block goes to the same end.
        end = "free_blocks: to the right end" if profile == "vllm-v1" else "free_blocks: to the left end"
        names = tuple(n for n in names if n != end)
    elif profile != "vllm-v1":
        names = tuple(n for n in names if n != "free_blocks: to the left end")
    return names


def _pool_events(op: str, args: Sequence[Any], before: Snapshot, after: Snapshot, out: Outcome) -> list[str]:
    if out.error is not None:
        return [f"{op}: {out.error}"]
    ev: list[str] = []
    if op == "get_new_blocks":
        ev.append("get_new_blocks: taken")
        if any(before.block_hash[b] is not None for b in out.result):
            ev.append("get_new_blocks: evicted a cached block")
    elif op == "touch":
        free = set(before.free_queue)
        ev += ["touch: hit a free block" if b in free else "touch: hit a held block" for b in args[0]]
    elif op == "free_blocks":
        ev += _freed_events(before, after, args[0])
    elif op == "cache_full_blocks":
        ev.append("cache_full_blocks: registered")
        if any(len(blocks) > 1 for _, blocks in after.hash_to_blocks):
            ev.append("cache_full_blocks: duplicate hash kept")
    elif op == "get_cached_block":
        if out.result is None:
            ev.append("get_cached_block: miss")
        else:
            ev.append("get_cached_block: hit")
            if out.result in before.free_queue:
                ev.append("get_cached_block: hit a free block")
    elif op == "evict_blocks":
        dropped = [b for b in args[0] if before.block_hash[b] is not None]
        ev += [
            "evict_blocks: dropped a held block's hash"
            if before.ref_cnt[b]
            else "evict_blocks: dropped a free block's hash"
            for b in dropped
        ]
        if not dropped:
            ev.append("evict_blocks: nothing cached")
    elif op == "reset_prefix_cache":
        if not out.result:
            ev.append("reset_prefix_cache: refused, blocks held")
        else:
            ev.append("reset_prefix_cache: accepted")
            if before.hash_to_blocks:
                ev.append("reset_prefix_cache: accepted, hashes dropped")
    elif op == "is_block_writable":
        ev.append("is_block_writable: yes" if out.result else "is_block_writable: no")
    else:
        ev.append(op)
    return ev


def _freed_events(before: Snapshot, after: Snapshot, freed: Sequence[Any]) -> list[str]:
    ev: list[str] = []
    old = set(before.free_queue)
    first_old = next((i for i, b in enumerate(after.free_queue) if b in old), len(after.free_queue))
    for i, b in enumerate(after.free_queue):
        if b not in old:
            ev.append("free_blocks: to the left end" if i < first_old else "free_blocks: to the right end")
    if any(after.ref_cnt[b] > 0 for b in freed):
        ev.append("free_blocks: still held by another")
    return ev


def _manager_events(op: str, before: Snapshot, after: Snapshot, out: Outcome) -> list[str]:
    if out.error is not None:
        return [f"{op}: {out.error}"]
    ev: list[str] = []
    if op == "get_computed_blocks":
        hit = out.result[0]
        ev.append("get_computed_blocks: hit" if hit else "get_computed_blocks: miss")
        if any(b in before.free_queue for b in hit):
            ev.append("get_computed_blocks: hit a free block")
    elif op == "allocate_slots":
        if out.result is None:
            ev.append("allocate_slots: too few free blocks")
            return ev
        pairs = list(zip(before.block_hash, after.block_hash))
        if any(h0 is not None and h1 != h0 for h0, h1 in pairs):
            ev.append("allocate_slots: evicted a cached block")
        if any(h1 is not None and h1 != h0 for h0, h1 in pairs):
            ev.append("allocate_slots: registered full blocks")
        if any(len(b) > 1 for _, b in after.hash_to_blocks):
            ev.append("allocate_slots: duplicate hash kept")
    elif op == "free" and any(after.ref_cnt[b] > 0 for b in _freed_blocks(before, after)):
        ev.append("free: shared blocks kept")
    return ev


def _freed_blocks(before: Snapshot, after: Snapshot) -> list[int]:
    return [b for b in range(before.num_gpu_blocks) if after.ref_cnt[b] < before.ref_cnt[b]]


# --- the observer: what a whole campaign collects ----------------------------------------


@dataclass
class Observer:
    """Collects, across every example of a campaign, what the summary and the runner need.

    It also carries the campaign's mechanics: the per-step time limit (an
    alarm signal, where one can be used), the heartbeat a parent process
    watches, and the stream of steps written before each implementation call
    so that a process that dies still leaves its trace.
    """

    step_timeout_s: float | None = None  # per implementation call; None: no limit
    stream_fd: int | None = None  # where each step is written before it runs (a crash leaves it)
    heartbeat: Any = None  # a shared double: when the running implementation call started, 0 when none
    keep_deepest: bool = False  # keep the records of the example that reached the most events
    impl_name: str | None = None  # written into trace headers
    device: str | None = None  # AdapterConfig.device for every adapter the machine builds
    coverage: Counter[str] = field(default_factory=Counter)
    states: set[int] = field(default_factory=set)  # hashes of the distinct spec states reached
    not_exercised: set[str] = field(default_factory=set)  # "<op>: <mistake>" the adapter declares it does not reject
    absent_ops: set[str] = field(default_factory=set)  # optional operations the adapter lacks or declares deviant
    examples: int = 0
    steps: int = 0
    invariants_checked: int = 0
    current: LockStep | None = None  # the example running now
    failure: tuple[ConformanceFailure | SpecFailure, LockStep] | None = None  # the latest failing example
    deepest: tuple[tuple[int, int], LockStep] | None = None  # ((events, steps), example)
    _alarm_ready: bool = False

    def start_example(self, lock: LockStep) -> None:
        """A new example begins: count it, and start its stream afresh."""
        self.examples += 1
        self.current = lock
        if self.stream_fd is not None:
            os.ftruncate(self.stream_fd, 0)
            os.lseek(self.stream_fd, 0, os.SEEK_SET)
            os.write(self.stream_fd, (header_line(lock.config, self.impl_name) + "\n").encode())

    def stream_step(self, index: int, op: str, args: Sequence[Any]) -> None:
        """Write the step about to run, so a crash or hang of the process still shows it."""
        if self.stream_fd is not None:
            line = json.dumps({"step": index, "op": op, "args": encode_value(list(args))})
            os.write(self.stream_fd, (line + "\n").encode())

    def install_alarm(self) -> Callable[[], None]:
        """Arm the per-step time limit with SIGALRM, if this thread can; returns the undo."""
        if self.step_timeout_s is None or not hasattr(signal, "setitimer"):
            return lambda: None
        if threading.current_thread() is not threading.main_thread():
            return lambda: None

        def on_alarm(signum: int, frame: object) -> None:
            raise StepTimeout()

        old = signal.signal(signal.SIGALRM, on_alarm)
        self._alarm_ready = True

        def undo() -> None:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
            self._alarm_ready = False

        return undo

    def impl_started(self) -> None:
        """An implementation call begins: start its clock."""
        if self._alarm_ready and self.step_timeout_s is not None:
            signal.setitimer(signal.ITIMER_REAL, self.step_timeout_s)
        if self.heartbeat is not None:
            self.heartbeat.value = time.monotonic()

    def impl_finished(self) -> None:
        """The implementation call returned (or raised): stop its clock."""
        if self._alarm_ready:
            signal.setitimer(signal.ITIMER_REAL, 0)
        if self.heartbeat is not None:
            self.heartbeat.value = 0.0

    def end_example(self, lock: LockStep) -> None:
        """An example finished (passed or failed): keep it if it is the deepest so far."""
        if self.keep_deepest and lock.failure is None:
            score = (len(lock.events), len(lock.records))
            if self.deepest is None or score > self.deepest[0]:
                self.deepest = (score, lock)


# --- the KV the harness has the implementation write ---------------------------------------


class PrefixKVSource:
    """The harness's model of a layer's KV: token position p's value names the request's prefix up to p.

    A `KVSource` for adapters with KV memory (`KVContentAdapter`). Value p is
    the number the source gave, on first sight, to the pair (value p - 1,
    token p, and at each block's first position the block's extra keys:
    LoRA, multimodal inputs, and the cache_salt on block 0). By induction it
    names the whole prefix (tokens and the extra keys of every block it
    touches), so two different prefixes never get the same value, equal
    prefixes always do, and every value is a small positive int64 (0 is
    never given: a slot nobody wrote reads as no prefix's value). The
    rejected alternative, a digest of the prefix, fits int64 only by
    truncation and then "never" holds only up to collisions.

    One source serves one example: the numbering depends on the order
    prefixes are first seen, so a replay numbers them the same way.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size  # tokens per block: where each block's extra keys join the chain
        self._ids: dict[tuple[Any, ...], int] = {}  # (previous value, token, block keys) -> value

    def __call__(self, request: Request, start: int, end: int) -> list[int]:
        """The values of token positions [start, end) of `request` (its tokens and extra keys). Cost: O(end).

        >>> src = PrefixKVSource(2)
        >>> src(Request("a", (5, 6, 7)), 0, 3), src(Request("b", (5, 6, 8)), 1, 3)
        ([1, 2, 3], [2, 4])
        >>> src(Request("c", (5, 6), cache_salt="t"), 0, 2)
        [5, 6]
        """
        bs, values, previous = self.block_size, [], 0
        for p in range(end):
            keys = (
                block_extra_keys(p, p + bs, request.lora_name, request.mm_inputs, request.cache_salt)
                if p % bs == 0
                else None
            )
            previous = self._ids.setdefault((previous, request.token_ids[p], keys), len(self._ids) + 1)
            if p >= start:
                values.append(previous)
        return values


# Why a caller mistake is not exercised against an adapter (the summary prints it).
NOT_EXERCISED_WHY = (
    "the adapter declares validates_bad_input = False and does not list these in rejected_mistakes, "
    "so it is not expected to raise the spec's error for them; operations 'not compared' are its "
    "declared known_deviations, features 'not applicable' its declared not_applicable"
)


# --- lock-step execution ------------------------------------------------------------------


@dataclass
class _Pending:
    index: int
    op: str
    args: tuple[Any, ...]
    spec: Outcome
    impl: Outcome
    spec_before: Snapshot
    hit_hashes: tuple[BlockHash, ...] | None = None  # the request's spec chain, for get_computed_blocks
    hit_content: list[Any] | None = None  # what read_kv returned for the implementation's hit blocks


# check_hit evaluates hit_within_cap and hit_prefix_closed; hit_content_intact is
# checked on adapters with KV memory; salt isolation follows from prefix closure.
_NUM_HIT_RULES_CHECKED = 2


class LockStep:
    """One example: the spec state and the adapter, stepped together and checked after each call.

    Usable without Hypothesis: `kvspec replay` feeds it a trace's steps.
    """

    def __init__(self, factory: Factory, config: AdapterConfig, observer: Observer | None = None) -> None:
        """Build the spec state and the adapter; the initial states are checked by the first `check()`.

        Raises:
            StepTimeout: building the adapter ran past the step time limit.
        """
        self.config = config
        self.level = config.level
        self.observer = observer if observer is not None else Observer()
        self.records: list[TraceStep] = []
        self.events: Counter[str] = Counter()
        self.failure: ConformanceFailure | SpecFailure | None = None
        self._s2i: dict[BlockHash, BlockHash] = {}  # spec hash -> implementation hash, fixed once seen
        self._i2s: dict[BlockHash, BlockHash] = {}
        self._tags: list[str] = []
        self.impl_snapshot: Snapshot | None = None
        self.spec_state: PoolState | ManagerState
        self._ops: dict[str, Callable[..., tuple[Any, Any]]]
        if config.level == "pool":
            self.spec_state = spec_ops.new_pool(config.num_gpu_blocks, config.enable_caching, config.profile)
            self._ops = _POOL_OPS
        else:
            self.spec_state = spec_manager.new_manager(
                config.num_gpu_blocks,
                config.block_size,
                config.enable_caching,
                config.profile,
                config.hash_fn,
                config.seed,
            )
            self._ops = _MANAGER_OPS
        self.spec_snapshot = self.spec_state.snapshot()
        self.observer.start_example(self)
        self.adapter: Any = None
        impl = Outcome()
        # The implementation call running now (index, op, args, spec outcome): what a hang reports.
        self._inflight: tuple[int, str, tuple[Any, ...], Outcome] | None = (0, "init", (), Outcome())
        self.observer.impl_started()
        try:
            self.adapter = factory(config)
        except Exception as e:
            impl = Outcome(crashed=True, message=f"building the adapter failed: {_crash_message(e)}")
        finally:
            self.observer.impl_finished()
        self._inflight = None
        adapter = self.adapter
        # An adapter may name operations whose results knowingly differ from the
        # spec's (a vLLM release's documented formula): they are not called, and
        # the summary says so, so that the rest of its behaviour is still judged.
        deviations: dict[str, str] = dict(getattr(adapter, "known_deviations", None) or {})
        self.capabilities = (capabilities(adapter) if adapter is not None else frozenset()) - set(deviations)
        if adapter is not None:
            self.observer.absent_ops.update(set(OPTIONAL_POOL_OPS) - self.capabilities)
        for op, why in deviations.items():
            self.observer.not_exercised.add(f"{op}: not compared, {why}")
        # What the implementation does not have (adapter.py): not exercised, and listed.
        self.not_applicable: dict[str, str] = dict(getattr(adapter, "not_applicable", None) or {})
        for feature, why in self.not_applicable.items():
            self.observer.not_exercised.add(f"{feature}: not applicable, {why}")
        # What the adapter declares (adapter.py): which caller mistakes it rejects,
        # whether its hashes are kvspec's own chain, whether it holds KV memory.
        self.validates_bad_input = bool(getattr(adapter, "validates_bad_input", True))
        self.rejected_mistakes = frozenset(getattr(adapter, "rejected_mistakes", None) or ())
        self.uses_kvspec_hash_chain = bool(getattr(adapter, "uses_kvspec_hash_chain", False))
        self.kv_source: PrefixKVSource | None = None
        if config.level == "manager" and adapter is not None and isinstance(adapter, KVContentAdapter):
            self.kv_source = PrefixKVSource(config.block_size)
            self._inflight = (0, "init", (), Outcome())
            self.observer.impl_started()
            try:
                adapter.set_kv_source(self.kv_source)
            except Exception as e:
                impl = Outcome(crashed=True, message=f"set_kv_source() failed: {_crash_message(e)}")
            finally:
                self.observer.impl_finished()
            self._inflight = None
        self._pending: _Pending | None = _Pending(0, "init", (), Outcome(), impl, self.spec_snapshot)

    def exercises(self, mistake: str) -> bool:
        """Whether the machine may make this caller mistake ("<op>: <mistake>") against the adapter.

        Every mistake, unless the adapter declares `validates_bad_input = False`;
        then only those it lists in `rejected_mistakes`. A mistake left out is
        recorded for the summary.
        """
        if self.validates_bad_input or mistake in self.rejected_mistakes:
            return True
        self.observer.not_exercised.add(mistake)
        return False

    # --- driving ---------------------------------------------------------------------------

    def tag(self, event: str) -> None:
        """Count a workload event (chunked prefill, preemption, ...) for the current step."""
        self._tags.append(event)

    def call(self, op: str, *args: Any) -> Outcome:
        """Run `op` on the spec and on the implementation; returns the spec's outcome.

        The check is left pending; `check()` runs it (the machine's invariant
        does, after each rule, and rules that call twice check in between).

        Raises:
            SpecFailure: the spec raised something that is not a spec error.
            StepTimeout: the implementation ran past the step time limit.
        """
        assert self._pending is None, f"call({op}) before the previous step ({self._pending.op}) was checked"
        # Every argument, defaults included: a trace records them all, and a replay reads them back.
        assert len(args) == len(OP_PARAMS[op]), f"{op} takes {OP_PARAMS[op]}; the machine passed {len(args)}"
        index = len(self.records) + 1
        before = self.spec_snapshot
        new_state: PoolState | ManagerState
        try:
            new_state, result = self._ops[op](self.spec_state, *args)
            spec = Outcome(result=result)
        except spec_errors.BlockManagerError as e:
            new_state, spec = self.spec_state, Outcome(error=_spec_error_name(e), message=str(e))
        except Exception as e:
            self.failure = SpecFailure(f"the spec failed at step {index} ({op}): {_crash_message(e)}")
            self.records.append(TraceStep(index, op, tuple(args), Outcome(crashed=True, message=str(e))))
            self.observer.failure = (self.failure, self)
            raise self.failure from e
        hit_hashes = None
        if op == "get_computed_blocks" and isinstance(self.spec_state, ManagerState) and spec.error is None:
            hit_hashes = spec_manager.request_block_hashes(self.spec_state, args[0])
        self.observer.stream_step(index, op, args)
        self._inflight = (index, op, tuple(args), spec)
        impl = self._impl_call(op, args)
        hit_content = None
        if hit_hashes is not None and self.kv_source is not None:
            impl, hit_content = self._read_hit(impl)
        self._inflight = None
        self.spec_state = new_state
        self.spec_snapshot = new_state.snapshot()
        self._pending = _Pending(index, op, tuple(args), spec, impl, before, hit_hashes, hit_content)
        return spec

    def _read_hit(self, impl: Outcome) -> tuple[Outcome, list[Any] | None]:
        """Read the implementation's hit blocks back from its KV memory (content-integrity).

        Only a well-formed hit of blocks of this pool is read; anything else is
        named by the checks that follow.
        """
        if impl.error is not None or impl.crashed or not isinstance(impl.result, list) or not impl.result[0]:
            return impl, None
        blocks = impl.result[0]
        if not all(0 <= b < self.config.num_gpu_blocks for b in blocks):
            return impl, None
        self.observer.impl_started()
        try:
            content = self.adapter.read_kv(list(blocks))
            return impl, [list(row) for row in content]
        except Exception as e:
            return Outcome(crashed=True, message=f"read_kv({blocks}) failed: {_crash_message(e)}"), None
        finally:
            self.observer.impl_finished()

    def _impl_call(self, op: str, args: Sequence[Any]) -> Outcome:
        fn = getattr(self.adapter, op, None)
        if not callable(fn):
            return Outcome(crashed=True, message=f"the adapter has no method {op}()")
        # Each side gets its own lists: an implementation that keeps or mutates its
        # argument must not change what the spec saw.
        impl_args = [list(a) if isinstance(a, (list, tuple)) else a for a in args]
        self.observer.impl_started()
        try:
            value = fn(*impl_args)
        except spec_errors.BlockManagerError as e:
            name = _spec_error_name(e)
            if name is None:
                return Outcome(
                    crashed=True, message=f"raised {type(e).__name__}, a BlockManagerError of no spec type: {e}"
                )
            return Outcome(error=name, message=str(e))
        except Exception as e:
            return Outcome(crashed=True, message=_crash_message(e))
        finally:
            self.observer.impl_finished()
        norm = _NORMALIZE[op]
        if norm is None:
            return Outcome(result=None)
        try:
            return Outcome(result=norm(value))
        except _BadResult as e:
            return Outcome(result={"malformed": f"{type(value).__name__}: {e}"})

    # --- checking --------------------------------------------------------------------------

    def check(self) -> None:
        """Check the pending step; does nothing if there is none.

        Raises:
            ConformanceFailure: the first thing that differs or breaks, named.
        """
        p = self._pending
        if p is None:
            return
        self._pending = None
        spec_snap = self.spec_snapshot
        if p.impl.crashed:
            self._fail("crashed", p, p.impl.message, None)
        impl_snap = self._take_snapshot(p)
        prev = self.impl_snapshot
        record = TraceStep(p.index, p.op, p.args, p.spec, p.impl, spec_snap, impl_snap)
        failure = self._first_problem(p, spec_snap, impl_snap, prev)
        if p.index > 0:
            self.records.append(record)
        if failure is not None:
            self._raise(failure)
        self.impl_snapshot = impl_snap
        self._count(p, spec_snap)

    def _take_snapshot(self, p: _Pending) -> Snapshot:
        self._inflight = (p.index, p.op, p.args, p.spec)
        self.observer.impl_started()
        try:
            snap = self.adapter.snapshot()
        except Exception as e:
            self.observer.impl_finished()
            self._fail("crashed", p, f"snapshot() failed: {_crash_message(e)}", None)
        self.observer.impl_finished()
        self._inflight = None
        if not isinstance(snap, Snapshot):
            self._fail("diverges", p, f"snapshot() returned {type(snap).__name__}, not a kvspec Snapshot", None)
        return _normal_snapshot(snap)

    def _first_problem(
        self, p: _Pending, spec_snap: Snapshot, impl_snap: Snapshot, prev: Snapshot | None
    ) -> ConformanceFailure | None:
        def fail(kind: str, message: str, invariant: str | None = None) -> ConformanceFailure:
            return ConformanceFailure(kind, p.index, p.op, message, invariant)

        spec, impl = p.spec, p.impl
        if isinstance(impl.result, dict) and "malformed" in impl.result:
            return fail(
                "diverges",
                f"returned a malformed value ({impl.result['malformed']}); the spec returned {spec.describe()}",
            )
        # Hit rules first: a hit past the cap is named as such, not as "a different list".
        if p.op == "get_computed_blocks" and impl.error is None and spec.error is None and p.hit_hashes is not None:
            blocks, num_tokens = impl.result
            request = p.args[0]
            if not all(0 <= b < p.spec_before.num_gpu_blocks for b in blocks):
                return fail("diverges", f"returned hit blocks {blocks}, not all blocks of this pool")
            try:
                check_hit(
                    p.spec_before,
                    len(request.token_ids),
                    self.config.block_size,
                    p.hit_hashes,
                    [BlockId(b) for b in blocks],
                    num_tokens,
                )
            except spec_errors.InvariantViolation as e:
                return fail("invariant", f"{e.rule} (got hit blocks {blocks}, {num_tokens} tokens)", e.name)
            if p.hit_content is not None:
                problem = self._content_problem(request, blocks, p.hit_content)
                if problem is not None:
                    return fail("invariant", problem, "hit_content_intact")
        if spec.error != impl.error:
            if spec.error is None:
                return fail(
                    "diverges",
                    f"the implementation raised {impl.error} ({impl.message}); the spec returned {spec.describe()}",
                )
            if impl.error is None:
                return fail(
                    "diverges",
                    f"the spec raised {spec.error} ({spec.message}); the implementation returned {impl.describe()}",
                )
            return fail(
                "diverges",
                f"the spec raised {spec.error} ({spec.message}); "
                f"the implementation raised {impl.error} ({impl.message})",
            )
        if spec.error is None and not _results_equal(p.op, spec.result, impl.result):
            return fail("diverges", f"returned {impl.describe()}; the spec returned {spec.describe()}")
        if spec.error is not None and prev is not None and impl_snap != prev:
            return fail(
                "diverges",
                f"after raising {impl.error} the state changed ({_diff(prev, impl_snap, 'before', 'after')}); "
                "a rejected call must change nothing",
            )
        try:
            check_all(impl_snap)
            if prev is not None:
                check_step(prev, impl_snap, p.op)
        except spec_errors.InvariantViolation as e:
            return fail("invariant", e.rule, e.name)
        spec_c, impl_c = spec_snap.with_canonical_hashes(), impl_snap.with_canonical_hashes()
        if spec_c != impl_c:
            return fail(
                "diverges", f"the state differs from the spec's: {_diff(spec_c, impl_c, 'spec', 'implementation')}"
            )
        if self.uses_kvspec_hash_chain and spec_snap.block_hash != impl_snap.block_hash:
            b = next(i for i, (hs, hi) in enumerate(zip(spec_snap.block_hash, impl_snap.block_hash)) if hs != hi)
            return fail(
                "diverges",
                f"block {b}'s hash is {_show(impl_snap.block_hash[b])}, but kvspec's chain "
                f"(hash_fn={self.config.hash_fn!r}, seed={self.config.seed!r}) gives {_show(spec_snap.block_hash[b])} "
                "for the same prefix (the adapter declares uses_kvspec_hash_chain, so values are compared exactly)",
            )
        self.observer.states.add(hash(spec_c))
        for b, (hs, hi) in enumerate(zip(spec_snap.block_hash, impl_snap.block_hash)):
            if hs is None or hi is None:
                continue
            if self._s2i.setdefault(hs, hi) != hi or self._i2s.setdefault(hi, hs) != hs:
                return fail(
                    "diverges",
                    f"block {b}'s hash is not the one the implementation used for the same prefix earlier "
                    "(hash values are compared as names: the same spec hash must keep the same name)",
                )
        return None

    def _content_problem(self, request: Request, blocks: Sequence[int], content: list[Any]) -> str | None:
        """What is wrong with the KV read back from a hit's blocks, or None (hit_content_intact)."""
        assert self.kv_source is not None, "content read without a KV source"
        bs = self.config.block_size
        if len(content) != len(blocks):
            return f"read_kv({list(blocks)}) returned {len(content)} blocks, not {len(blocks)}"
        for i, (b, actual) in enumerate(zip(blocks, content)):
            expected = self.kv_source(request, i * bs, (i + 1) * bs)
            if not hit_content_intact(expected, actual):
                slot = next(
                    (j for j, (e, a) in enumerate(zip(expected, actual)) if e != a), min(len(expected), len(actual))
                )
                return (
                    f"hit block {b} (the request's block {i}) does not hold its prefix's KV: slot {slot} reads "
                    f"{actual[slot] if slot < len(actual) else 'nothing'}, the value written for token position "
                    f"{i * bs + slot} of this prefix is {expected[slot] if slot < len(expected) else 'nothing'} "
                    f"(block reads {actual}, expected {expected})"
                )
        return None

    def _count(self, p: _Pending, spec_snap: Snapshot) -> None:
        obs = self.observer
        if p.index == 0:
            return
        obs.steps += 1
        obs.invariants_checked += (
            len(INVARIANTS)
            + len(STEP_RULES)
            + (_NUM_HIT_RULES_CHECKED if p.hit_hashes is not None else 0)
            + (1 if p.hit_content is not None else 0)
        )
        if self.level == "pool":
            events = _pool_events(p.op, p.args, p.spec_before, spec_snap, p.spec)
        else:
            events = _manager_events(p.op, p.spec_before, spec_snap, p.spec)
            if p.hit_hashes is not None:
                events += self._cap_event(p)
        events += self._tags
        self._tags = []
        self.events.update(events)
        obs.coverage.update(events)

    def _cap_event(self, p: _Pending) -> list[str]:
        request: Request = p.args[0]
        block_size = self.config.block_size
        num_full = len(request.token_ids) // block_size
        hit = p.spec.result[0]
        if (
            num_full > 0
            and len(hit) == (len(request.token_ids) - 1) // block_size
            and len(hit) < num_full
            and p.hit_hashes is not None
            and any(h == p.hit_hashes[len(hit)] for h, _ in p.spec_before.hash_to_blocks)
        ):
            return ["get_computed_blocks: hit capped at len - 1"]
        return []

    def _fail(self, kind: str, p: _Pending, message: str, invariant: str | None) -> Any:
        if p.index > 0:
            self.records.append(TraceStep(p.index, p.op, p.args, p.spec, p.impl, self.spec_snapshot, None))
        self._raise(ConformanceFailure(kind, p.index, p.op, message, invariant))

    def _raise(self, failure: ConformanceFailure) -> Any:
        self.failure = failure
        self.observer.failure = (failure, self)
        raise failure

    def trace(self, impl: str | None = None) -> Trace:
        """This example so far as a trace, with its verdict and failure if it failed."""
        f = self.failure
        if f is None:
            return Trace(config=self.config, steps=tuple(self.records), impl=impl)
        if isinstance(f, SpecFailure):
            failure = {"kind": "spec", "step": len(self.records), "op": "?", "message": str(f), "invariant": None}
            return Trace(self.config, tuple(self.records), impl, "could-not-run", failure)
        failure = {"kind": f.kind, "step": f.step_index, "op": f.op, "message": f.message, "invariant": f.invariant}
        verdict = {"invariant": "diverges"}.get(f.kind, f.kind)
        return Trace(self.config, tuple(self.records), impl, verdict, failure)

    def hung(self) -> ConformanceFailure:
        """Record that the implementation call in flight did not return in time; returns the failure."""
        limit = self.observer.step_timeout_s
        message = f"no answer within the step time limit of {limit:g} s" if limit else "no answer"
        index, op, args, spec = (
            self._inflight if self._inflight is not None else (len(self.records) + 1, "?", (), Outcome())
        )
        self._pending = self._inflight = None
        if index > 0:
            self.records.append(
                TraceStep(index, op, args, spec, Outcome(hung=True, message=message), self.spec_snapshot, None)
            )
        self.failure = ConformanceFailure("hung", index, op, message)
        return self.failure


def run_spec(config: AdapterConfig, steps: Sequence[tuple[str, Sequence[Any]]]) -> list[tuple[Outcome, Snapshot]]:
    """The spec's outcome and state after each step, the spec alone (no implementation).

    Used to rebuild the story of a process that died: up to its last step the
    implementation matched the spec, so the spec's side is the whole story.
    """
    state: PoolState | ManagerState
    table: dict[str, Callable[..., tuple[Any, Any]]]
    if config.level == "pool":
        state, table = spec_ops.new_pool(config.num_gpu_blocks, config.enable_caching, config.profile), _POOL_OPS
    else:
        state = spec_manager.new_manager(
            config.num_gpu_blocks, config.block_size, config.enable_caching, config.profile, config.hash_fn, config.seed
        )
        table = _MANAGER_OPS
    out: list[tuple[Outcome, Snapshot]] = []
    for op, args in steps:
        try:
            state, result = table[op](state, *args)
            outcome = Outcome(result=result)
        except spec_errors.BlockManagerError as e:
            outcome = Outcome(error=_spec_error_name(e), message=str(e))
        except Exception as e:
            outcome = Outcome(crashed=True, message=f"the spec failed: {_crash_message(e)}")
        out.append((outcome, state.snapshot()))
    return out


def _normal_snapshot(s: Snapshot) -> Snapshot:
    """The snapshot with every field a tuple of plain ints (implementations may hand back lists or numpy ints)."""
    if (
        type(s.ref_cnt) is tuple
        and type(s.free_queue) is tuple
        and type(s.block_hash) is tuple
        and type(s.hash_to_blocks) is tuple
        and type(s.quarantined) is tuple
    ):
        return s
    return replace(
        s,
        ref_cnt=tuple(int(r) for r in s.ref_cnt),
        block_hash=tuple(None if h is None else BlockHash(bytes(h)) for h in s.block_hash),
        free_queue=tuple(BlockId(int(b)) for b in s.free_queue),
        hash_to_blocks=tuple((BlockHash(bytes(h)), tuple(BlockId(int(b)) for b in bl)) for h, bl in s.hash_to_blocks),
        block_tables=None
        if s.block_tables is None
        else tuple((rid, tuple(BlockId(int(b)) for b in bl)) for rid, bl in s.block_tables),
        quarantined=tuple(BlockId(int(b)) for b in s.quarantined),
    )


_FIELDS = (
    "num_gpu_blocks",
    "enable_caching",
    "ref_cnt",
    "free_queue",
    "block_hash",
    "hash_to_blocks",
    "block_tables",
    "quarantined",
)


def _show(value: Any) -> str:
    if isinstance(value, tuple):
        return "(" + ", ".join(_show(v) for v in value) + ("," if len(value) == 1 else "") + ")"
    if isinstance(value, bytes):
        return value.decode("ascii", "replace") if value.startswith(b"h") and len(value) < 8 else value.hex()[:8]
    return repr(value)


def _diff(a: Snapshot, b: Snapshot, a_name: str, b_name: str) -> str:
    parts = [
        f"{name}: {a_name} {_show(getattr(a, name))} vs {b_name} {_show(getattr(b, name))}"
        for name in _FIELDS
        if getattr(a, name) != getattr(b, name)
    ]
    return "; ".join(parts)


# --- the machines ---------------------------------------------------------------------------


class _LockStepMachine(RuleBasedStateMachine):
    """What both levels share: one `LockStep` per example, checked after every rule."""

    factory: ClassVar[Factory]
    enable_caching: ClassVar[bool] = True
    profile: ClassVar[str] = "vllm-v1"
    observer: ClassVar[Observer]

    def __init__(self) -> None:
        super().__init__()
        self.lock: LockStep | None = None

    def _start(self, config: AdapterConfig) -> None:
        self.lock = LockStep(type(self).factory, config, type(self).observer)

    @property
    def _lock(self) -> LockStep:
        assert self.lock is not None, "a rule ran before the machine was initialized"
        return self.lock

    def _call(self, op: str, *args: Any) -> Outcome:
        return self._lock.call(op, *args)

    def _has(self, op: str) -> bool:
        return self.lock is not None and op in self.lock.capabilities

    def _mistakes(self, op: str, *mistakes: str) -> tuple[str, ...]:
        """The caller mistakes of `op` this adapter is checked on (see `LockStep.exercises`)."""
        return tuple(m for m in mistakes if self._lock.exercises(f"{op}: {m}"))

    def _config(self, level: Literal["pool", "manager"], num_gpu_blocks: int, block_size: int = 4) -> AdapterConfig:
        cls = type(self)
        # A factory may name the smallest pool it can build (a vLLM release
        # without a null block cannot build a pool of the null block alone).
        num_gpu_blocks = max(num_gpu_blocks, getattr(cls.factory, "min_num_gpu_blocks", 1))
        return AdapterConfig(
            level, num_gpu_blocks, cls.enable_caching, cls.profile, block_size, device=cls.observer.device
        )

    @invariant()
    def conforms(self) -> None:
        """The last adapter call agreed with the spec and broke no invariant (LockStep.check)."""
        if self.lock is not None:
            self.lock.check()

    def teardown(self) -> None:
        if self.lock is None:
            return
        lock = self.lock
        type(self).observer.end_example(lock)
        if lock.failure is not None and _is_final_run():
            # Run in-process (a test suite, HypoFuzz): the report carries the story too.
            lock.failure.add_note(render_story(lock.trace()))
        # Steer toward deep states: a cached block evicted or hit again needs
        # allocation, registration and freeing first. One label only: each
        # label gets its own hill-climb, and those runs come out of the budget.
        reuse = sum(n for e, n in lock.events.items() if "evicted" in e or ": hit" in e)
        target(float(reuse), label="cached blocks evicted or hit")


def _sampled(items: Sequence[Any]) -> st.SearchStrategy[Any]:
    """`st.sampled_from` over a tuple: Hypothesis caches strategies built from hashable
    arguments, and rebuilding (and re-validating) one per draw dominated a step's cost."""
    return _sampled_tuple(tuple(items))


@lru_cache(maxsize=1024)
def _sampled_tuple(items: tuple[Any, ...]) -> st.SearchStrategy[Any]:
    return st.sampled_from(items)


@lru_cache(maxsize=1024)
def _one_of(*strategies: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """`st.one_of`, cached for the same reason as `_sampled`."""
    return st.one_of(*strategies)


def _chunk(num_tokens: int) -> st.SearchStrategy[int]:
    """How many of `num_tokens` pending tokens a step schedules: all (shrinks to this), or a chunk."""
    return _one_of(st.just(num_tokens), st.integers(1, num_tokens))


def _is_final_run() -> bool:
    """Whether Hypothesis is replaying the minimal failing example to report it."""
    try:
        return bool(current_build_context().is_final)
    except InvalidArgument:  # not inside a Hypothesis test
        return False


def _insert(data: st.DataObject, items: list[Any], extra: Any) -> list[Any]:
    """`items` with `extra` at a drawn position (a mistake anywhere in the list, not only first)."""
    at = data.draw(st.integers(0, len(items)), label="position of the mistake")
    return items[:at] + [extra] + items[at:]


# Rules draw what kind of call to make from a list that starts with "valid",
# repeated so that about three calls in four are valid whatever the number of
# mistake kinds; Hypothesis shrinks toward the first entry, so a shrunk trace
# keeps a mistake only where the failure needs one.
VALID = "valid"


def _kinds(*mistakes: str) -> tuple[str, ...]:
    return (VALID,) * (3 * max(len(mistakes), 1)) + mistakes


class PoolMachine(_LockStepMachine):
    """The BlockPool level: vLLM's pool operations on a tiny pool, as a scheduler would call them.

    Each rule drives the adapter method it is named after, with a valid call
    or with one caller mistake of the kinds the spec rejects for it.
    """

    groups = Bundle("groups")  # blocks held together (one simulated request's block table)

    def __init__(self) -> None:
        super().__init__()
        self.live: list[tuple[int, ...]] = []  # the groups in the bundle, for rules that free them all

    def _hold(self, group: tuple[int, ...]) -> tuple[int, ...]:
        self.live.append(group)
        return group

    @initialize(num_gpu_blocks=strat.pool_sizes())
    def new_pool(self, num_gpu_blocks: int) -> None:
        self._start(self._config("pool", num_gpu_blocks))

    @property
    def _state(self) -> PoolState:
        return cast(PoolState, self._lock.spec_state)

    def _hashed(self) -> list[int]:
        s = self._state
        return [b for b in range(1, s.num_gpu_blocks) if s.block_hash[b] is not None]

    def _held(self, hashed: bool | None = None) -> list[int]:
        s = self._state
        return [
            b
            for b in range(1, s.num_gpu_blocks)
            if s.ref_cnt[b] > 0 and (hashed is None or (s.block_hash[b] is not None) == hashed)
        ]

    def _bad_id(self, data: st.DataObject) -> Any:
        return data.draw(strat.bad_block_ids(self._state.num_gpu_blocks), label="bad block id")

    # A full pool only refuses (the "more than free" mistake covers that); while
    # it is full, the rules that free or hit blocks get the turns.
    @precondition(lambda self: self.lock is not None and bool(self._state.free_queue))
    @rule(target=groups, data=st.data())
    def get_new_blocks(self, data: st.DataObject) -> Any:
        """A request's new blocks; then, as vLLM's scheduler does, the ones already full are registered."""
        num_free = len(self._state.free_queue)
        mistakes = self._mistakes("get_new_blocks", "none", "more than free", "bad count")
        kind = data.draw(_sampled(_kinds(*mistakes)), label="call")
        if kind == VALID:
            # Often more than a tiny pool has, where asking for too many is a mistake the adapter rejects.
            most = 4 if "more than free" in mistakes else min(num_free, 4)
            num_blocks: Any = data.draw(st.integers(1, most), label="num_blocks")
        elif kind == "none":
            num_blocks = 0
        elif kind == "more than free":
            num_blocks = num_free + data.draw(st.integers(1, 3), label="over by")
        else:
            num_blocks = data.draw(strat.bad_counts(), label="num_blocks")
        out = self._call("get_new_blocks", num_blocks)
        if out.error or not out.result:
            return multiple()
        blocks = list(out.result)
        if self.enable_caching:
            num_full = data.draw(st.integers(0, len(blocks)), label="num_full_blocks")
            if num_full:
                self._lock.check()
                hashes = data.draw(
                    st.lists(strat.hash_values(), min_size=num_full, max_size=num_full), label="block_hashes"
                )
                self._call("cache_full_blocks", blocks[:num_full], hashes)
        return self._hold(tuple(blocks))

    @rule(group=consumes(groups), order=_sampled(("tail first", "as allocated")))
    def free_blocks(self, group: tuple[int, ...], order: str) -> None:
        # vLLM frees a request's blocks tail first; any order is legal for the pool.
        self.live.remove(group)
        self._call("free_blocks", list(reversed(group)) if order == "tail first" else list(group))

    @precondition(lambda self: self.lock is not None and bool(self._free_mistakes()))
    @rule(data=st.data())
    def free_blocks_mistake(self, data: st.DataObject) -> None:
        """Double frees and other bad frees; the error types must match and nothing may change."""
        held, free = self._held(), self._state.free_queue
        allowed = self._free_mistakes()
        ok = (
            data.draw(st.lists(_sampled(held), max_size=3, unique=True), label="valid ids")
            if held and ("bad id" in allowed or "double free" in allowed or "named twice" in allowed)
            else []
        )
        kinds = [k for k in allowed if k != "named twice" or ok]
        if not kinds:
            return
        kind = data.draw(_sampled(kinds), label="mistake")
        if kind == "double free":
            bad: Any = data.draw(_sampled(free), label="free block")
        elif kind == "bad id":
            bad = self._bad_id(data)
        else:
            bad = data.draw(_sampled(ok), label="named twice")
        self._call("free_blocks", _insert(data, ok, bad))

    def _free_mistakes(self) -> tuple[str, ...]:
        return self._mistakes(
            "free_blocks", *(["double free"] if self._state.free_queue else []), "bad id", "named twice"
        )

    @rule(target=groups, data=st.data())
    def touch(self, data: st.DataObject) -> Any:
        """A prefix hit as vLLM's scheduler takes it: look up a hash chain until a miss, then touch the hits."""
        hashed, n = self._hashed(), self._state.num_gpu_blocks
        unhashed = [b for b in range(1, n) if b not in hashed]
        mistakes = (["named twice"] if hashed else []) + ["bad id"] + (["no hash"] if unhashed else [])
        mistakes = [*self._mistakes("touch", *mistakes), *self._mistakes("get_cached_block", "hash not bytes")]
        kind = data.draw(_sampled(_kinds(*mistakes)), label="call")
        if kind == "hash not bytes":
            self._call("get_cached_block", data.draw(strat.bad_hashes(), label="block_hash"))
            return multiple()
        if kind == VALID:
            # Mostly hashes that are registered now (a real prefix), sometimes any.
            registered = [h for h, _ in self._state.hash_to_blocks]
            one = _one_of(_sampled(registered), strat.hash_values()) if registered else strat.hash_values()
            chain = data.draw(st.lists(one, min_size=1, max_size=4), label="hash chain")
            hits: list[int] = []
            for h in chain:
                out = self._call("get_cached_block", h)
                self._lock.check()
                if out.result is None or out.result in hits:
                    break
                hits.append(out.result)
            if not hits:
                return multiple()
            out = self._call("touch", hits)
            return multiple() if out.error else self._hold(tuple(hits))
        ok = data.draw(st.lists(_sampled(hashed), max_size=2, unique=True), label="valid ids") if hashed else []
        if kind == "named twice":
            bad: Any = data.draw(_sampled(ok or hashed), label="named twice")
            ok = ok or [bad]
        elif kind == "bad id":
            bad = self._bad_id(data)
        else:
            bad = data.draw(_sampled(unhashed), label="block without hash")
        self._call("touch", _insert(data, ok, bad))
        return multiple()

    @precondition(lambda self: self.lock is not None and (not self.enable_caching or bool(self._held())))
    @rule(data=st.data())
    def cache_full_blocks(self, data: st.DataObject) -> None:
        """Blocks that filled later (decode) get registered; or one mistake the spec rejects."""
        s, n = self._state, self._state.num_gpu_blocks
        if not self.enable_caching:
            # Without prefix caching every call is a mistake, even a well-formed one.
            if not self._mistakes("cache_full_blocks", "caching off"):
                return
            ids = (
                data.draw(st.lists(st.integers(1, n - 1), max_size=2, unique=True), label="block_ids") if n > 1 else []
            )
            self._call("cache_full_blocks", ids, [strat.HASH_UNIVERSE[0]] * len(ids))
            return
        unhashed, hashed_held = self._held(hashed=False), self._held(hashed=True)
        free = [b for b in s.free_queue if s.block_hash[b] is None]
        mistakes = ["bad id", "length mismatch"] + (["named twice", "hash not bytes"] if unhashed else [])
        mistakes += (["already cached"] if hashed_held else []) + (["not held"] if free else [])
        allowed = self._mistakes("cache_full_blocks", *mistakes)
        if not unhashed and not allowed:
            return
        kind = data.draw(_sampled(_kinds(*allowed) if unhashed else allowed), label="call")
        size = (1, 3) if kind == VALID else (0, 2)
        ok = (
            data.draw(st.lists(_sampled(unhashed), min_size=size[0], max_size=size[1], unique=True), label="block_ids")
            if unhashed
            else []
        )
        hashes: list[Any] = data.draw(
            st.lists(strat.hash_values(), min_size=len(ok), max_size=len(ok)), label="block_hashes"
        )
        if kind == VALID:
            self._call("cache_full_blocks", ok, hashes)
            return
        if kind == "length mismatch":
            self._call("cache_full_blocks", ok, hashes + [strat.HASH_UNIVERSE[1]])
            return
        if kind == "hash not bytes":
            ok = ok or [unhashed[0]]
            hashes = hashes or [strat.HASH_UNIVERSE[0]]
            hashes[data.draw(st.integers(0, len(ok) - 1), label="which hash")] = data.draw(
                strat.bad_hashes(), label="bad hash"
            )
            self._call("cache_full_blocks", ok, hashes)
            return
        if kind == "bad id":
            bad: Any = self._bad_id(data)
        elif kind == "already cached":
            bad = data.draw(_sampled(hashed_held), label="cached block")
        elif kind == "not held":
            bad = data.draw(_sampled(free), label="free block")
        else:
            bad = data.draw(_sampled(ok or unhashed), label="named twice")
            if not ok:
                ok, hashes = [bad], [strat.HASH_UNIVERSE[0]]
        at = data.draw(st.integers(0, len(ok)), label="position of the mistake")
        self._call("cache_full_blocks", ok[:at] + [bad] + ok[at:], hashes[:at] + [strat.HASH_UNIVERSE[2]] + hashes[at:])

    @precondition(lambda self: self._has("evict_blocks"))
    @rule(data=st.data())
    def evict_blocks(self, data: st.DataObject) -> None:
        n = self._state.num_gpu_blocks
        mistakes = self._mistakes("evict_blocks", "bad id", *(["named twice"] if n > 1 else []))
        kind = data.draw(_sampled(_kinds(*mistakes)), label="call")
        hashed = self._hashed()
        any_id = st.integers(1, n - 1) if n > 1 else st.nothing()
        ids_strategy = _one_of(_sampled(hashed), any_id) if hashed else any_id
        ids = data.draw(st.lists(ids_strategy, max_size=3, unique=True), label="block_ids") if n > 1 else []
        if kind == VALID:
            self._call("evict_blocks", ids)
            return
        if kind == "named twice":
            ids = ids or [1]
            bad: Any = data.draw(_sampled(ids), label="named twice")
        else:
            bad = self._bad_id(data)
        self._call("evict_blocks", _insert(data, ids, bad))

    # A reset of an empty cache changes nothing whatever the answer; skipping it
    # keeps resets from crowding out the rules that build state. Without caching
    # the answer (refused while blocks are held) is all there is to check.
    @precondition(lambda self: self.lock is not None and (not self.enable_caching or bool(self._state.hash_to_blocks)))
    @rule()
    def reset_prefix_cache(self) -> None:
        self._call("reset_prefix_cache")

    @precondition(lambda self: self.lock is not None and bool(self.live))
    @rule(data=st.data())
    def reset_prefix_cache_when_idle(self, data: st.DataObject) -> None:
        """Every request finishes, in any order, then the cache is reset (as before a weight update)."""
        for group in data.draw(st.permutations(self.live), label="finishing order"):
            self._call("free_blocks", list(reversed(group)))
            self._lock.check()
        self.live.clear()
        self.bundle("groups").clear()  # all freed: nothing in the bundle is held any more
        self._call("reset_prefix_cache")

    @precondition(lambda self: self._has("is_block_writable"))
    @rule(data=st.data())
    def is_block_writable(self, data: st.DataObject) -> None:
        n = self._state.num_gpu_blocks
        held = self._held()
        valid = _one_of(_sampled(held), st.integers(0, n - 1)) if held else st.integers(0, n - 1)
        bad = _sampled(tuple(b for b in strat.bad_block_id_values(n) if b != 0))
        either = _one_of(valid, bad) if self._mistakes("is_block_writable", "bad id") else valid
        self._call("is_block_writable", data.draw(either, label="block_id"))

    @precondition(lambda self: self._has("get_num_free_blocks") or self._has("get_usage"))
    @rule()
    def get_num_free_blocks(self) -> None:
        """The scheduler's two questions about free space (a miscounted queue shows here first)."""
        if self._has("get_num_free_blocks"):
            self._call("get_num_free_blocks")
        if self._has("get_usage"):
            self._lock.check()
            self._call("get_usage")


@dataclass
class _Running:
    request: Request  # its tokens so far (prompt, then every output token)
    num_computed_tokens: int  # tokens with slots allocated


class ManagerMachine(_LockStepMachine):
    """The KVCacheManager level: requests sharing prefixes, chunked prefill, decode, preemption."""

    prompts = Bundle("prompts")  # request templates: system-prompt families and growing chats
    running = Bundle("running")  # ids of running requests
    preempted = Bundle("preempted")  # ids of preempted requests waiting to be re-admitted

    def __init__(self) -> None:
        super().__init__()
        self.block_size = 1
        self.shared: tuple[tuple[int, ...], ...] = ()
        self.requests: dict[str, _Running] = {}
        self.waiting: dict[str, Request] = {}
        self.finished: list[str] = []
        self.num_ids = 0

    @initialize(num_gpu_blocks=strat.manager_pool_sizes(), block_size=strat.block_sizes(), data=st.data())
    def new_manager(self, num_gpu_blocks: int, block_size: int, data: st.DataObject) -> None:
        self.block_size = block_size
        self.shared = data.draw(strat.system_prompts(block_size), label="system prompts")
        self._start(self._config("manager", num_gpu_blocks, block_size))

    def _new_id(self) -> str:
        self.num_ids += 1
        return f"r{self.num_ids}"

    @property
    def _state(self) -> ManagerState:
        return cast(ManagerState, self._lock.spec_state)

    # --- workload --------------------------------------------------------------------------

    def _sendable(self, request: Request) -> Request:
        """`request` without its cache_salt when the adapter declares it has none (`not_applicable`)."""
        if request.cache_salt is not None and "cache_salt" in self._lock.not_applicable:
            return replace(request, cache_salt=None)
        return request

    @rule(target=prompts, data=st.data())
    def new_prompt(self, data: st.DataObject) -> Request:
        return self._sendable(data.draw(strat.prompts(self.block_size, self.shared), label="prompt"))

    @rule(target=prompts, prompt=prompts, data=st.data())
    def continue_chat(self, prompt: Request, data: st.DataObject) -> Request:
        return strat.continue_chat(prompt, data.draw(strat.chat_turns(self.block_size), label="turn"))

    @rule(target=prompts, prompt=prompts, data=st.data())
    def long_continuation(self, prompt: Request, data: st.DataObject) -> Request:
        """An earlier prompt followed by more tokens than the whole pool holds (a long document).

        Its admission hits the cached prefix and then runs out of blocks: the
        failed allocation that must leave no block touched and none taken.
        Independent prompts are short, so without this that case is rare.
        """
        extra = self._state.pool.num_gpu_blocks * self.block_size
        tail = data.draw(strat.token_ids(extra, extra + self.block_size), label="long continuation")
        return replace(prompt, token_ids=prompt.token_ids + tail)

    @rule(target=prompts, prompt=prompts, data=st.data())
    def new_prompt_other_keys(self, prompt: Request, data: st.DataObject) -> Request:
        """An earlier prompt's tokens again, under another cache_salt, LoRA adapter or image.

        Isolation bugs (a chain that leaves out a key) show only when the same
        tokens arrive under different keys; independent prompts almost never
        repeat a whole prefix with only a key changed.
        """
        return self._sendable(data.draw(strat.other_keys(prompt, self.block_size), label="same tokens, other keys"))

    # --- adapter calls ---------------------------------------------------------------------

    @rule(prompt=prompts, data=st.data())
    def get_computed_blocks(self, prompt: Request, data: st.DataObject) -> None:
        kind = data.draw(
            _sampled(
                _kinds(
                    *self._mistakes(
                        "get_computed_blocks",
                        "no tokens",
                        "no id",
                        "misplaced images",
                        *(["already running"] if self.requests else []),
                    )
                )
            ),
            label="call",
        )
        if kind == "already running":
            request = self.requests[data.draw(_sampled(sorted(self.requests)), label="running request")].request
        elif kind == "no id":
            request = replace(prompt, request_id="")
        elif kind == "no tokens":
            request = replace(prompt, request_id=self._new_id(), token_ids=(), mm_inputs=())
        elif kind == "misplaced images":
            images = data.draw(strat.bad_mm_inputs(len(prompt.token_ids)), label="misplaced images")
            request = replace(prompt, request_id=self._new_id(), mm_inputs=images)
        else:
            request = replace(prompt, request_id=self._new_id())
        self._call("get_computed_blocks", request)

    def _admit(self, request: Request, data: st.DataObject) -> Any:
        """The scheduler's admission: look up the prefix hit, then allocate the first chunk."""
        hit = self._call("get_computed_blocks", request)
        self._lock.check()
        if hit.error is not None:
            return multiple()
        blocks, num_hit = hit.result
        remaining = len(request.token_ids) - num_hit
        ext = data.draw(strat.external_tokens(remaining - 1), label="num_external_computed_tokens")
        left = remaining - ext
        chunk = data.draw(_chunk(left), label="num_new_tokens")
        out = self._call("allocate_slots", request, chunk, num_hit, blocks, ext)
        if out.error is not None or out.result is None:
            return multiple()
        self._lock.tag("allocate_slots: admitted")
        if blocks:
            self._lock.tag("allocate_slots: admitted with a prefix hit")
        if ext:
            self._lock.tag("allocate_slots: external tokens")
        if num_hit + ext + chunk < len(request.token_ids):
            self._lock.tag("allocate_slots: chunked prefill")
        self.requests[request.request_id] = _Running(request, num_hit + ext + chunk)
        return request.request_id

    @rule(target=running, prompt=prompts, data=st.data())
    def allocate_slots_admit(self, prompt: Request, data: st.DataObject) -> Any:
        mistakes = ["no tokens scheduled", "bad count", "more tokens than the request has", "hit count mismatch"]
        mistakes += ["hit on a running request"] if self.requests else []
        mistakes += ["wrong hit block"] if self.enable_caching else ["hit without caching"]
        kind = data.draw(_sampled(_kinds(*self._mistakes("allocate_slots", *mistakes))), label="call")
        request = replace(prompt, request_id=self._new_id())
        if kind == VALID:
            return self._admit(request, data)
        self._allocate_slots_mistake(kind, request, data)
        return multiple()

    def _allocate_slots_mistake(self, kind: str, fresh: Request, data: st.DataObject) -> None:
        bs, n = self.block_size, self._lock.config.num_gpu_blocks
        if kind == "no tokens scheduled":
            self._call("allocate_slots", fresh, 0, 0, [], 0)
        elif kind == "bad count":
            args: list[Any] = [fresh, 1, 0, [], 0]
            args[data.draw(_sampled((1, 2, 4)), label="which count")] = data.draw(strat.bad_counts(), label="bad count")
            self._call("allocate_slots", *args)
        elif kind == "more tokens than the request has":
            on_running = data.draw(st.booleans(), label="running request") if self.requests else False
            if on_running:
                run = self.requests[data.draw(_sampled(sorted(self.requests)), label="running request")]
                self._call(
                    "allocate_slots", run.request, len(run.request.token_ids) - run.num_computed_tokens + 1, 0, [], 0
                )
            else:
                self._call("allocate_slots", fresh, len(fresh.token_ids) + 1, 0, [], 0)
        elif kind == "hit count mismatch":
            self._call("allocate_slots", fresh, 1, bs, [], 0)
        elif kind == "hit on a running request":
            rid = data.draw(_sampled(sorted(self.requests)), label="running request")
            block = data.draw(st.integers(1, max(n - 1, 1)), label="hit block")
            self._call("allocate_slots", self.requests[rid].request, 1, bs, [block], 0)
        else:
            # One full block and a token after it, so that only the hit block is wrong.
            request = replace(fresh, token_ids=fresh.token_ids + (0,) * max(bs + 1 - len(fresh.token_ids), 0))
            if kind == "hit without caching":
                block = data.draw(st.integers(1, max(n - 1, 1)), label="hit block")
            else:
                chain = spec_manager.request_block_hashes(self._state, request)
                pool = self._state.pool
                wrong = [b for b in range(-1, n + 1) if not (0 <= b < n and pool.block_hash[b] == chain[0])]
                block = data.draw(_sampled(wrong), label="hit block")
            self._call("allocate_slots", request, 1, bs, [block], 0)

    @rule(request_id=running, data=st.data())
    def allocate_slots_step(self, request_id: str, data: st.DataObject) -> None:
        run = self.requests[request_id]
        remaining = len(run.request.token_ids) - run.num_computed_tokens
        if remaining == 0:
            # Decode: the sampled tokens join the request, then get their slots
            # (more than one when speculative tokens are verified in one step).
            new = data.draw(strat.token_ids(1, 3), label="output tokens")
            run.request = strat.continue_chat(run.request, new)
            num = len(new)
            self._lock.tag("allocate_slots: decode")
        else:
            num = data.draw(_chunk(remaining), label="num_new_tokens")
            if num < remaining:
                self._lock.tag("allocate_slots: chunked prefill")
        out = self._call("allocate_slots", run.request, num, 0, [], 0)
        if out.error is None and out.result is not None:
            run.num_computed_tokens += num

    @rule(request_id=consumes(running))
    def free_finished(self, request_id: str) -> None:
        self._call("free", request_id)
        self._lock.tag("free: request finished")
        del self.requests[request_id]
        self.finished.append(request_id)

    @rule(target=preempted, request_id=consumes(running))
    def free_preempted(self, request_id: str) -> str:
        # Preemption drops every reference; the tokens (output included) stay
        # with the request, which is re-admitted later with its grown prompt.
        self._call("free", request_id)
        self._lock.tag("free: request preempted")
        self.waiting[request_id] = self.requests.pop(request_id).request
        return request_id

    @rule(target=running, request_id=consumes(preempted), data=st.data())
    def allocate_slots_readmit(self, request_id: str, data: st.DataObject) -> Any:
        result = self._admit(self.waiting.pop(request_id), data)
        if isinstance(result, str):
            self._lock.tag("readmitted after preemption")
        return result

    # NOTE: only once a request has finished. A rule that is enabled from the
    # first step and changes nothing is what the shrinker leaves in place of
    # steps it cannot delete (those that hold Hypothesis's first draws about
    # which rules are enabled): with this rule enabled at the start, shrunk
    # traces began with a dozen no-op frees; now those steps become prompt
    # draws, which call nothing and leave no step in the trace.
    @precondition(lambda self: bool(self.finished) and bool(self._mistakes("free", "not running")))
    @rule(data=st.data())
    def free_mistake(self, data: st.DataObject) -> None:
        """Freeing a request that is not running (never admitted, or already finished)."""
        ids = ["r0"] + [r for r in self.finished if r not in self.requests][-3:]
        self._call("free", data.draw(_sampled(ids), label="request_id"))


def conformance_machine(
    factory: Factory,
    level: str = "pool",
    enable_caching: bool = True,
    profile: str = "vllm-v1",
    observer: Observer | None = None,
    device: str | None = None,
) -> type[_LockStepMachine]:
    """A state machine class that checks `factory`'s adapters against the spec.

    Its `.TestCase` is an ordinary Hypothesis stateful test, usable directly
    in a test suite or under a fuzzing engine (HypoFuzz). `device` becomes
    every `AdapterConfig.device` (None: the observer's, else the adapter picks).

    Raises:
        ValueError: level is not "pool" or "manager".
    """
    if level not in ("pool", "manager"):
        raise ValueError(f"level must be 'pool' or 'manager'; got level={level!r}")
    if observer is not None and device is not None:
        observer.device = device
    base: type[_LockStepMachine] = PoolMachine if level == "pool" else ManagerMachine
    name = f"{base.__name__}_{'caching' if enable_caching else 'no_caching'}"
    attrs = {
        "factory": staticmethod(factory),
        "enable_caching": enable_caching,
        "profile": profile,
        "observer": observer if observer is not None else Observer(device=device),
        "__module__": __name__,
    }
    return type(name, (base,), attrs)
