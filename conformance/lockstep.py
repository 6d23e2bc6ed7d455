"""The lock-step core: the spec and an implementation stepped together, checked after every call.

`LockStep` runs one example: every call goes to the spec (`kvspec.spec.ops` /
`kvspec.spec.manager`) and to the implementation with the same arguments, and
after every call it checks, in this order, naming what failed:

1. the implementation did not crash or hang;
2. hit rules (`check_hit`) on every prefix hit it returns;
3. the same result (block ids in order) or the same spec error type;
4. after an error, its state is exactly what it was before the call;
5. every state invariant of its snapshot (`check_all`) and every step rule
   between its snapshots before and after (`check_step`);
6. its whole snapshot equals the spec's, hash values renamed consistently
   (`Snapshot.with_canonical_hashes`), and the renaming stays the same from one
   step to the next (a hash is a name, but the same name throughout).

Design choice: the spec itself, contracts included, is the oracle, rather than
the reference model: an implementation that agrees with the reference but not
with the spec would hide a bug shared by both. The rejected alternative
(checking only the invariants, without an oracle) would accept any order of
the free queue that keeps the invariants, and the order is the eviction
policy, the thing most worth checking.

`Observer` collects what a whole campaign reached and carries its mechanics
(the step time limit, the heartbeat, the stream of steps). The Hypothesis
machines that drive `LockStep` are in `kvspec.conformance.machine`; `kvspec
replay` drives it from a trace.
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
from typing import Any, cast

from kvspec.conformance.adapter import OPTIONAL_POOL_OPS, AdapterConfig, KVContentAdapter, capabilities
from kvspec.conformance.coverage import manager_events, pool_events
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
    "Factory",
    "LockStep",
    "Observer",
    "PrefixKVSource",
    "SpecFailure",
    "StepTimeout",
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
            events = pool_events(p.op, p.args, p.spec_before, spec_snap, p.spec)
        else:
            events = manager_events(p.op, p.spec_before, spec_snap, p.spec)
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
