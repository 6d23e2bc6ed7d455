"""The lock-step core: the spec and an implementation stepped together, checked after every call.

`LockStep` runs one example: every call goes to the spec (the operation's
entry in kvspec.conformance.core.operations says which spec function) and to the
implementation with the same arguments, and after every call it checks, in
this order, naming what failed:

1. the implementation did not crash or hang;
2. hit rules (`check_hit`) on every prefix hit it returns;
3. the same result (block ids in order) or the same spec error type;
4. after an error, its state is exactly what it was before the call;
5. every state invariant of its snapshot (`check_all`) and every step rule
   between its snapshots before and after (`check_step`);
6. its whole snapshot equals the spec's, hash values compared as names
   (`HashNames`: the same renaming from the first step to the last);
7. with `config.events`: the events it published obey every event rule
   (`check_events`, against the mirror its earlier events built), equal the
   spec's (kvspec.conformance.core.kv_events says what is compared), and at the
   request level its hit statistics equal the spec's.

Design choice: the spec itself, contracts included, is the oracle, rather than
the reference model: an implementation that agrees with the reference but not
with the spec would hide a bug shared by both. The rejected alternative
(checking only the invariants, without an oracle) would accept any order of
the free queue that keeps the invariants, and the order is the eviction
policy, the thing most worth checking.

`Observer` adds up what a whole campaign reached; `StepWatch`
(kvspec.conformance.core.watch) times the implementation's calls. The Hypothesis
machines that drive `LockStep` are in `kvspec.conformance.core.machine`; `kvspec
replay` drives it from a trace.
"""

from __future__ import annotations

import inspect
import operator
import traceback
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from itertools import chain
from typing import Any, NoReturn, cast

from kvspec.conformance.core.adapter import (
    NO_CONNECTOR_STATS,
    NO_RESET_COUNT,
    AdapterConfig,
    HarnessLimit,
    KVContentAdapter,
    capabilities,
    misdeclared,
)
from kvspec.conformance.core.coverage import step_branches
from kvspec.conformance.core.hash_names import HashNames
from kvspec.conformance.core.kv_events import (
    EVENT_FIELDS,
    MalformedEvents,
    comparable,
    describe_events,
    same_events,
    take_events_result,
)
from kvspec.conformance.core.kv_source import PrefixKVSource
from kvspec.conformance.core.operations import (
    ID_BOUND,
    OPERATIONS,
    BadResult,
    Operation,
    all_args,
    level_operations,
    optional_operations,
)
from kvspec.conformance.core.reactions import (
    NotExpressible,
    Reaction,
    ReactionDeclarationError,
    declared_reactions,
    observed_reaction,
    reaction_problem,
)
from kvspec.conformance.core.results import HARNESS_LIMIT, Failure, FailureKind, Outcome
from kvspec.conformance.core.trace import Trace, TraceStep
from kvspec.conformance.core.watch import IMPLEMENTATION_FAULTS, StepTimeout, StepWatch, raise_if_ctrl_c, said
from kvspec.spec import errors as spec_errors
from kvspec.spec import manager as spec_manager
from kvspec.spec import ops as spec_ops
from kvspec.spec.events import BlockStored, EventMirror, KVCacheEvent, naive_misreads, orphaned_stores
from kvspec.spec.invariants import (
    EVENT_RULES,
    INVARIANTS,
    STEP_RULES,
    check_all,
    check_events,
    check_hit,
    check_step,
    hit_content_intact,
)
from kvspec.spec.manager import ManagerState, Request
from kvspec.spec.state import NULL_BLOCK_ID, BlockHash, BlockId, PoolState, Snapshot
from kvspec.spec.stats import CacheCounters, PrefixCacheStats

__all__ = [
    "NOT_EXERCISED_WHY",
    "ConformanceFailure",
    "Factory",
    "LockStep",
    "Observer",
    "PrefixKVSource",
    "SpecFailure",
    "StepTimeout",
    "StepWatch",
    "run_spec",
    "spec_initial_state",
]


Factory = Callable[[AdapterConfig], object]


class ConformanceFailure(AssertionError):
    """The implementation broke the spec at one step; raised inside the machine, shrunk by Hypothesis."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(f"{failure.kind} at step {failure.step} ({failure.op}): {failure.message}")
        self.failure = failure


class SpecFailure(AssertionError):
    """The spec itself failed (a contract or an unexpected exception): a bug in kvspec, not in the implementation.

    Also kvspec's limit met inside the implementation's call (``limit``, a
    `HarnessLimit`; its failure's kind is LIMIT): no bug, but as little a verdict on the implementation.
    """

    def __init__(self, message: str, step: int, op: str = "?", *, limit: bool = False) -> None:
        super().__init__(message)
        self.failure = Failure(FailureKind.LIMIT if limit else FailureKind.SPEC, step, op, message)


def spec_initial_state(config: AdapterConfig) -> PoolState | ManagerState:
    """The spec's state before the first step of an example built with `config`."""
    if config.level == "pool":
        return spec_ops.new_pool(config.num_gpu_blocks, config.enable_caching, config.profile)
    return spec_manager.new_manager(
        config.num_gpu_blocks,
        config.block_size,
        config.enable_caching,
        config.profile,
        config.hash_fn,
        config.seed,
        config.groups,
    )


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


def _type_names(e: BaseException) -> tuple[str, ...]:
    """The names of `e`'s class and its bases, most specific first (what a declared `raises` may name)."""
    return tuple(c.__name__ for c in type(e).__mro__ if c not in (object, BaseException, Exception))


def _crash_message(e: BaseException) -> str:
    frames = traceback.extract_tb(e.__traceback__)
    where = f" (at {frames[-1].filename.rsplit('/', 1)[-1]}:{frames[-1].lineno} in {frames[-1].name})" if frames else ""
    if isinstance(e, SystemExit):  # sys.exit(0) says nothing by its message alone
        return f"SystemExit({e.code!r}): the implementation tried to end the process (sys.exit){where}"
    if isinstance(e, KeyboardInterrupt):  # only one no Ctrl-C raised gets here (watch.raise_if_ctrl_c)
        return f"KeyboardInterrupt: raised by the implementation itself, not by a Ctrl-C{where}"
    return f"{type(e).__name__}: {said(e)}{where}"


def _spec_step(operation: Operation, state: Any, args: Sequence[Any]) -> tuple[Any, Outcome]:
    """Run one operation on the spec: the new state and the outcome in normal form.

    Raises:
        Exception: anything that is not a spec error (a bug in kvspec).
    """
    try:
        step = operation.spec(state, *args)
    except spec_errors.BlockManagerError as e:
        return state, Outcome(error=_spec_error_name(e), message=str(e))
    result = None if operation.normalize is None else operation.normalize(step.result)
    return step.state, Outcome(result=result, events=step.events)


# --- the observer: what a whole campaign reached ------------------------------------------


@dataclass
class Observer:
    """Adds up, across every example of a campaign, what the summary reports."""

    keep_deepest: bool = False  # keep the example that reached the most branches
    coverage: Counter[str] = field(default_factory=Counter)  # branch -> times reached
    states: set[int] = field(default_factory=set)  # hashes of the distinct spec states reached
    not_exercised: set[str] = field(default_factory=set)  # what the adapter's declarations left out
    absent_ops: set[str] = field(default_factory=set)  # optional operations the adapter lacks or declares deviant
    examples: int = 0
    steps: int = 0
    invariants_checked: int = 0
    deepest: tuple[tuple[int, int], LockStep] | None = None  # ((branches, steps), example)
    mistakes_sent: Counter[str] = field(default_factory=Counter)  # mistake -> times its declared reaction was checked
    not_expressed: Counter[str] = field(default_factory=Counter)  # mistake -> calls its API cannot take
    reactions: dict[str, str] = field(default_factory=dict)  # mistake -> declared reaction, where not the spec's error
    # Set (to an empty dict) to survey instead of check: every mistake goes to a
    # replica and what the implementation did is counted, mistake -> reaction -> times.
    survey: dict[str, Counter[str]] | None = None

    def end_example(self, lock: LockStep) -> None:
        """An example finished (passed or failed): keep it if it is the deepest so far."""
        if self.keep_deepest and lock.failure is None:
            score = (len(lock.reached), len(lock.records))
            if self.deepest is None or score > self.deepest[0]:
                self.deepest = (score, lock)


# Why a caller mistake is not exercised against an adapter (the summary prints it).
NOT_EXERCISED_WHY = (
    "the adapter declares validates_bad_input = False and declares no reaction for these "
    "(mistake_reactions), or declares them not expressible in its API; operations 'not compared' are its "
    "declared known_deviations, features 'not applicable' its declared not_applicable"
)


# --- lock-step execution ------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class _Call:
    """The call a step made: its number, the operation, every argument, and the caller mistake it makes."""

    index: int  # the step's number (0: building the adapter)
    op: str  # the operations table's name
    args: tuple[Any, ...]  # every argument, defaults included
    mistake: str | None = None  # the caller mistake the call makes ("<op>: <mistake>")
    without: tuple[Any, ...] | None = None  # the mistaken call's good part


@dataclass(frozen=True, slots=True, kw_only=True)
class _Expected:
    """What the implementation is checked against besides the spec's outcome: the spec before the step,
    and the events the implementation must have published."""

    before: Snapshot  # the spec's state before the step
    stats_before: PrefixCacheStats | None = None  # the spec's hit statistics before the step (request level)
    # The spec's events, or, for a mistake the implementation ignores, its good part's; none where the
    # adapter itself was not called (a refused call publishes nothing).
    events: tuple[KVCacheEvent, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class _Hit:
    """A prefix hit the step returned (an operation whose entry `returns_hit`): what the hit rules need."""

    hashes: tuple[BlockHash, ...]  # the request's chain on the spec's side
    cut: bool = False  # the spec's agreed hit is shorter than some group's own (the coordinator cut it)
    content: list[Any] | None = None  # what read_kv returned for the implementation's hit blocks


@dataclass(frozen=True, slots=True, kw_only=True)
class _Sent:
    """How a call reached the implementation: the declared reaction its mistake is checked against, and,
    for a mistake sent to a replica, the replica's state before and after and whether its counts changed."""

    reaction: Reaction | None = None
    replica: tuple[Snapshot, Snapshot, bool] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class _Pending:
    """One step called but not yet checked (`LockStep.check` checks it)."""

    call: _Call
    spec: Outcome  # the spec's outcome in normal form
    impl: Outcome  # the implementation's
    expected: _Expected
    hit: _Hit | None = None
    sent: _Sent = _Sent()


# check_hit evaluates hit_within_cap, hit_same_length, hit_prefix_closed and
# hit_window_shape; hit_content_intact is checked on adapters with KV memory;
# salt isolation follows from prefix closure.
_NUM_HIT_RULES_CHECKED = 4


class LockStep:
    """One example: the spec state and the adapter, stepped together and checked after each call.

    Usable without Hypothesis: `kvspec replay` feeds it a trace's steps.
    """

    def __init__(
        self, factory: Factory, config: AdapterConfig, observer: Observer | None = None, watch: StepWatch | None = None
    ) -> None:
        """Build the spec state and the adapter; the initial states are checked by the first `check()`.

        Raises:
            StepTimeout: building the adapter ran past the step time limit.
        """
        self.config = config
        self.level = config.level
        self.observer = observer if observer is not None else Observer()
        self.watch = watch if watch is not None else StepWatch()
        self.records: list[TraceStep] = []
        self.reached: Counter[str] = Counter()  # the branches this example reached
        self.failure: ConformanceFailure | SpecFailure | None = None
        self.hash_names = HashNames()
        self._tags: list[str] = []
        self.impl_snapshot: Snapshot | None = None
        self.spec_state: PoolState | ManagerState = spec_initial_state(config)
        self.spec_snapshot = self.spec_state.snapshot()
        self.observer.examples += 1
        self.watch.start_example(self, config)
        self._factory = factory
        self._sent: list[tuple[Operation, tuple[Any, ...]]] = []  # the calls the adapter got, for a replica
        self.kv_source: PrefixKVSource | None = None
        # The implementation call running now (index, op, args, spec outcome): what a hang reports.
        self._inflight: tuple[int, str, tuple[Any, ...], Outcome, str | None] | None = (0, "init", (), Outcome(), None)
        self.adapter, impl = self._build_adapter()
        self._inflight = None
        impl = self._read_declarations() or impl
        self._pending: _Pending | None = _Pending(
            call=_Call(index=0, op="init", args=()),
            spec=Outcome(),
            impl=impl or Outcome(),
            expected=_Expected(before=self.spec_snapshot),
        )

    def _build_adapter(self) -> tuple[Any, Outcome | None]:
        """A new adapter from the factory (with its KV source, for KV memory); and the crash, if it crashed."""
        built: list[Any] = [None]
        build = lambda: built.__setitem__(0, self._factory(self.config))  # noqa: E731
        impl = self._impl_run(build, "building the adapter failed: ", building=True)
        adapter = built[0]
        if impl is None and self.config.level == "manager" and isinstance(adapter, KVContentAdapter):
            if self.kv_source is None:
                self.kv_source = PrefixKVSource(self.config.block_size)
            source = self.kv_source
            impl = self._impl_run(lambda: adapter.set_kv_source(source), "set_kv_source() failed: ")
        return adapter, impl

    def _impl_run(self, fn: Callable[[], object], what: str, building: bool = False) -> Outcome | None:
        """Run one implementation call under the watch (`building`: under the build time limit); None, or the
        crash it ended in."""
        self.watch.impl_started(building)
        try:
            fn()
            return None
        except HarnessLimit as e:
            raise self._harness_limit("building the adapter" if building else what.removesuffix(" failed: "), e) from e
        except IMPLEMENTATION_FAULTS as e:
            raise_if_ctrl_c(e)
            return Outcome(crashed=True, message=what + _crash_message(e))
        finally:
            self.watch.impl_finished()

    def _harness_limit(self, what: str, e: HarnessLimit, args: Sequence[Any] | None = None) -> SpecFailure:
        """The failure that ends the example where kvspec itself cannot run a call: no verdict on the implementation.

        ``args``: the operation's arguments, where ``what`` is an operation. The call in flight ends the
        trace (as a hang's does), so a replay reaches it and meets the same limit: its implementation side
        says it was not run to an answer, never that it crashed.
        """
        index = len(self.records) + 1
        message = f"{HARNESS_LIMIT} {index} ({what}) on the implementation: {said(e)}"
        self.failure = SpecFailure(message, index, what if args is not None else "?", limit=True)
        if args is not None and self._inflight is not None:
            index, op, call_args, spec, mistake = self._inflight
            impl = Outcome(not_sent=f"kvspec cannot run it: {said(e)}")
            # The spec's state after it is left out: the page recomputes it, as for a process that died.
            self.records.append(TraceStep(index, op, call_args, spec, impl, None, None, mistake))
        self._pending = self._inflight = None
        self.watch.failed = self
        return self.failure

    def _read_declarations(self) -> Outcome | None:
        """What the adapter declares about itself (adapter.py), and what the summary must say it left out.

        Returns a crash outcome when a declaration is malformed (the adapter is wrong, not the implementation).
        """
        adapter, obs = self.adapter, self.observer
        # An adapter may name operations whose results knowingly differ from the
        # spec's (a vLLM release's documented formula): they are not called, and
        # the summary says so, so that the rest of its behaviour is still judged.
        deviations: dict[str, str] = dict(getattr(adapter, "known_deviations", None) or {})
        self.not_applicable: dict[str, str] = dict(getattr(adapter, "not_applicable", None) or {})
        wrong = misdeclared(list(deviations), list(self.not_applicable))
        if wrong is not None:  # the summary would say something is left out that is not
            deviations, self.not_applicable = {}, {}
        self.capabilities = (capabilities(adapter) if adapter is not None else frozenset()) - set(deviations)
        if adapter is not None:
            obs.absent_ops.update(set(optional_operations(self.level)) - self.capabilities)
        for op, why in deviations.items():
            obs.not_exercised.add(f"{op}: not compared, {why}")
        # What the implementation does not have: not exercised, and listed.
        for feature, why in self.not_applicable.items():
            obs.not_exercised.add(f"{feature}: not applicable, {why}")
        self._read_event_declarations(adapter)
        # Whether its hashes are kvspec's own chain, and what it does with each caller mistake.
        self.uses_kvspec_hash_chain = bool(getattr(adapter, "uses_kvspec_hash_chain", False))
        self.reactions: dict[str, Reaction] = {}
        if adapter is None:
            return None
        try:
            self.reactions = declared_reactions(adapter)
            self.observer.reactions.update(
                (m, r.describe()) for m, r in self.reactions.items() if r.kind not in ("spec error", "not expressible")
            )
        except ReactionDeclarationError as e:
            return Outcome(crashed=True, message=f"the adapter's declarations are wrong: {e}")
        if wrong is not None:
            return Outcome(crashed=True, message=f"the adapter's declarations are wrong: {wrong}")
        return None

    def _read_event_declarations(self, adapter: Any) -> None:
        """What of the pool's events and statistics is checked (config.events), and what the summary says is not."""
        obs, events_on = self.observer, self.config.events and adapter is not None
        self.checks_events = events_on and callable(getattr(adapter, "take_events", None))
        self.checks_stats = (
            events_on and self.level == "manager" and callable(getattr(adapter, "prefix_cache_stats", None))
        )
        if events_on and not self.checks_events:
            obs.absent_ops.add("take_events")
        if events_on and self.level == "manager" and not self.checks_stats:
            obs.absent_ops.add("prefix_cache_stats")
        self.fields_not_reported = {f for f in EVENT_FIELDS if f"BlockStored.{f}" in self.not_applicable}
        self.impl_mirror = EventMirror()  # what a router holds from the implementation's stream
        self.spec_mirror = EventMirror()  # and from the spec's
        # The trailing parameters (the table's features, e.g. an external connector's cap on the hit) the
        # adapter's methods take.
        self._params_taken = frozenset(
            f.param for op in level_operations(self.level) for f in op.features if self._takes(op.name, f.param, f.name)
        )

    def takes(self, param: str) -> bool:
        """Whether the adapter takes a feature's parameter (one an operation's entry lists in `features`)."""
        return param in self._params_taken

    def _takes(self, op: str, param: str, feature: str) -> bool:
        """Whether the adapter's method (of either level) takes a parameter; if not, the summary says so."""
        if self.adapter is None:
            return False
        method = getattr(self.adapter, op, None)
        if callable(method) and _takes(method, param):
            return True
        self.observer.not_exercised.add(f"{feature}: not applicable, the adapter's {op} takes no {param}")
        return False

    def exercises(self, mistake: str) -> bool:
        """Whether the machine may make this caller mistake ("<op>: <mistake>") against the adapter.

        Every mistake the adapter declares a reaction for (kvspec.conformance.
        reactions), but not one its API cannot express; when surveying, every
        mistake. A mistake left out is recorded for the summary.
        """
        op, _, name = mistake.partition(": ")
        assert name in OPERATIONS[op].mistakes, f"{mistake!r} is not a mistake the operations table lists for {op}"
        reaction = self.reactions.get(mistake)
        if self.observer.survey is not None or (reaction is not None and reaction.kind != "not expressible"):
            return True
        self.observer.not_exercised.add(mistake if reaction is None else f"{mistake}: {reaction.describe()}")
        return False

    # --- driving ---------------------------------------------------------------------------

    def tag(self, event: str) -> None:
        """Count a workload event (chunked prefill, preemption, ...) for the current step."""
        self._tags.append(event)

    def call(self, op: str, *args: Any, mistake: str | None = None, without: Sequence[Any] | None = None) -> Outcome:
        """Run `op` on the spec and on the implementation; returns the spec's outcome.

        `mistake`: the caller mistake the call makes (a name the operations
        table lists for `op`), checked against the adapter's declared reaction;
        `without`: the same call's arguments with the mistake taken out (its
        good part), which an implementation that ignores the mistake applies
        (None: the call has no good part).
        The check is left pending; `check()` runs it (the machine's invariant
        does, after each rule, and rules that call twice check in between).

        Raises:
            SpecFailure: the spec raised something that is not a spec error.
            StepTimeout: the implementation ran past the step time limit.
        """
        assert self._pending is None, f"call({op}) before the previous step ({self._pending.call.op}) was checked"
        operation = OPERATIONS[op]
        step = _Call(
            index=len(self.records) + 1,
            op=op,
            args=all_args(operation, args),
            without=None if without is None else all_args(operation, without),  # as a trace reads it back
        )
        stats_before = self.spec_state.stats if isinstance(self.spec_state, ManagerState) else None
        expected = _Expected(before=self.spec_snapshot, stats_before=stats_before)
        self.hash_names.name_values(step.args)
        new_state, spec = self._spec_call(operation, step)
        if mistake is not None:
            step = replace(step, mistake=self._spec_rejected(step.index, op, step.args, spec, mistake))
        good_state, events = self._expected_after(operation, step, spec)
        hit = self._expected_hit(operation, step.args, spec)
        impl, sent = self._send(operation, step, spec)
        if step.mistake is not None:
            self.watch.stream_answer(impl)
        if good_state is not None and impl.not_sent is None:
            new_state = good_state  # the implementation ignores the mistake: its good part applies
        if impl.not_sent is not None or impl.replica:
            events = ()  # the adapter itself was not called
        if hit is not None and self.kv_source is not None:
            impl, content = self._read_hit(impl)
            hit = replace(hit, content=content)
        self._inflight = None
        self.spec_state = new_state
        self.spec_snapshot = new_state.snapshot()
        expected = replace(expected, events=events)
        self._pending = _Pending(call=step, spec=spec, impl=impl, expected=expected, hit=hit, sent=sent)
        return spec

    def _spec_call(self, operation: Operation, step: _Call) -> tuple[PoolState | ManagerState, Outcome]:
        """The spec's state and outcome after the call.

        Raises:
            SpecFailure: the spec raised something that is not a spec error (recorded as the trace's last step).
        """
        try:
            return _spec_step(operation, self.spec_state, step.args)
        except Exception as e:
            index, op = step.index, step.op
            self.failure = SpecFailure(f"the spec failed at step {index} ({op}): {_crash_message(e)}", index)
            self.records.append(TraceStep(index, op, step.args, Outcome(crashed=True, message=str(e))))
            self.watch.failed = self
            raise self.failure from e

    def _expected_after(
        self, operation: Operation, step: _Call, spec: Outcome
    ) -> tuple[PoolState | ManagerState | None, tuple[KVCacheEvent, ...]]:
        """The state the implementation must be in instead of the spec's (None: the spec's), and the events it
        must publish: for a mistake its adapter declares it ignores, what the call's good part alone does."""
        reaction = self._reaction(step.mistake)
        if reaction is not None and reaction.kind == "ignores":
            return self._good_part(operation, step.without)
        return None, spec.events

    def _expected_hit(self, operation: Operation, args: Sequence[Any], spec: Outcome) -> _Hit | None:
        """For an operation that returns a prefix hit (its entry's `hit_reached`), and returned one on the spec:
        the request's chain, and whether the coordinator cut the hit."""
        state = self.spec_state
        if operation.hit_reached is None or not isinstance(state, ManagerState) or spec.error is not None:
            return None
        hashes = spec_manager.request_block_hashes(state, args[0])
        return _Hit(hashes=hashes, cut=self._hit_cut(state, args[0], hashes, spec))

    def _send(self, operation: Operation, step: _Call, spec: Outcome) -> tuple[Outcome, _Sent]:
        """Call the implementation (a mistake with no declared reaction: not at all; one that changes the
        state, or any when surveying: a replica); its outcome, and how it was sent."""
        self.watch.stream_step(step.index, step.op, step.args, step.mistake, step.without)
        self._inflight = (step.index, step.op, step.args, spec, step.mistake)
        reaction = self._reaction(step.mistake)
        if step.mistake is not None and reaction is None:
            return Outcome(not_sent="the adapter declares no reaction to this mistake"), _Sent()
        if reaction is not None and (reaction.changes_state or self.observer.survey is not None):
            impl, replica = self._replica_call(operation, step.args, step.without)
            return impl, _Sent(reaction=reaction, replica=replica)
        return self._impl_call(operation, step.args, step.mistake is None), _Sent(reaction=reaction)

    @staticmethod
    def _hit_cut(state: ManagerState, request: Request, hashes: tuple[BlockHash, ...], spec: Outcome) -> bool:
        """Whether some group alone would hit more than the length every group agreed on (several groups)."""
        if len(state.config.groups) == 1 or not state.pool.config.enable_caching:
            return False
        alone = spec_manager.hit_lengths_alone(state, hashes, len(request.token_ids) - 1)
        return bool(max(alone) > spec.result[1])

    def _good_part(
        self, operation: Operation, without: Sequence[Any] | None
    ) -> tuple[PoolState | ManagerState, tuple[KVCacheEvent, ...]]:
        """The spec's state and events after a mistaken call's good part alone (what ignoring the mistake leaves)."""
        if without is None:
            return self.spec_state, ()
        state, outcome = _spec_step(operation, self.spec_state, without)
        assert outcome.error is None, f"the good part of a mistaken {operation.name} call is itself rejected"
        return state, outcome.events

    def _reaction(self, mistake: str | None) -> Reaction | None:
        """The reaction to check for `mistake` (when surveying: a placeholder, nothing is checked)."""
        if mistake is None:
            return None
        if self.observer.survey is not None:
            return Reaction("accepts", then="surveyed")
        reaction = self.reactions.get(mistake)
        return None if reaction is None or reaction.kind == "not expressible" else reaction

    def _spec_rejected(self, index: int, op: str, args: Sequence[Any], spec: Outcome, mistake: str) -> str:
        """The mistake's full name ("<op>: <mistake>"); the spec must have rejected it (else kvspec is wrong)."""
        if spec.error is None:
            self.failure = SpecFailure(
                f"step {index} ({op}) makes the mistake {mistake!r}, but the spec accepted it "
                f"(returned {spec.describe()}): the machine or the operations table is wrong",
                index,
            )
            self.watch.failed = self
            raise self.failure
        return mistake if mistake.startswith(f"{op}: ") else f"{op}: {mistake}"

    def _replica_call(
        self, operation: Operation, args: Sequence[Any], without: Sequence[Any] | None
    ) -> tuple[Outcome, tuple[Snapshot, Snapshot, bool] | None]:
        """Send a state-changing mistake to a replica: a new adapter given this example's calls so far.

        The example then goes on from the state before the mistake. A replica
        that does not reach the implementation's state shows that the
        implementation is not deterministic; that is reported as a crash.
        Returns the outcome and (the state to compare with, the state after,
        whether the counts differ): when surveying a call with a good part that
        returned normally, the state to compare with is a second replica's after
        the good part alone, so that a mistake whose bad part changes nothing
        shows as ignored.
        """
        outcome, states = self._replica_run(operation, args)
        if states is None:
            return outcome, None
        before, after, counts_before, counts_after = states
        returned = outcome.error is None and not outcome.crashed and outcome.not_sent is None
        if returned and without is not None and self.observer.survey is not None:
            _, good = self._replica_run(operation, without)
            if good is not None:
                before, counts_before = good[1], good[3]
        return outcome, (before, after, counts_before != counts_after)

    def _replica_run(
        self, operation: Operation, args: Sequence[Any]
    ) -> tuple[Outcome, tuple[Snapshot, Snapshot, tuple[Any, ...], tuple[Any, ...]] | None]:
        """One call on a new replica: its outcome, and its state and counts before and after."""
        replica, built = self._build_adapter()
        if built is not None:
            return replace(built, message="building a replica " + built.message), None
        for op, sent in self._sent:
            self._impl_call(op, sent, False, replica)
        before = self._replica_snapshot(replica)
        if isinstance(before, Outcome):
            return before, None
        if self.impl_snapshot is not None and before != self.impl_snapshot:
            differs = _diff(before, self.impl_snapshot, "replica", "implementation")
            return Outcome(crashed=True, message=(
                f"a replica given this example's calls again is not in the implementation's state ({differs}); "
                "the implementation is not deterministic, so a mistake that changes its state cannot be checked"
            )), None  # fmt: skip
        counters = self._counters(replica)
        impl = replace(self._impl_call(operation, args, False, replica), replica=True)
        after = self._replica_snapshot(replica)
        if isinstance(after, Outcome):
            return after, None
        return impl, (before, after, counters, self._counters(replica))

    def _counters(self, replica: Any) -> tuple[Any, ...]:
        """A replica's answers to the state questions it has (a count kept beside the queue can go wrong alone)."""
        answers: list[Any] = []
        for operation in OPERATIONS.values():
            if operation.is_count and operation.name in self.capabilities:
                outcome = self._impl_call(operation, (), False, replica)
                answers.append(outcome.result if outcome.error is None and not outcome.crashed else outcome.message)
        return tuple(answers)

    def _replica_snapshot(self, replica: Any) -> Snapshot | Outcome:
        self.watch.impl_started()
        try:
            snap = replica.snapshot()
        except IMPLEMENTATION_FAULTS as e:
            raise_if_ctrl_c(e)
            return Outcome(crashed=True, message=f"a replica's snapshot() failed: {_crash_message(e)}")
        finally:
            self.watch.impl_finished()
        if not isinstance(snap, Snapshot):
            why = f"returned {type(snap).__name__}, not a kvspec Snapshot"
            return Outcome(crashed=True, message=f"a replica's snapshot() {why}")
        checked = self._read_snapshot(snap)
        if isinstance(checked, str):
            return Outcome(crashed=True, message=f"a replica's snapshot() returned a malformed Snapshot: {checked}")
        return checked

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
        self.watch.impl_started()
        try:
            content = self.adapter.read_kv(list(blocks))
            return impl, [list(row) for row in content]
        except IMPLEMENTATION_FAULTS as e:
            raise_if_ctrl_c(e)
            return Outcome(crashed=True, message=f"read_kv({blocks}) failed: {_crash_message(e)}"), None
        finally:
            self.watch.impl_finished()

    def _impl_call(self, operation: Operation, args: Sequence[Any], valid: bool, adapter: Any = None) -> Outcome:
        """Call the adapter (or a replica); the outcome in normal form (`valid`: the call makes no caller mistake).

        A call to the adapter itself that reaches the implementation is kept for replicas.
        """
        if adapter is None:
            adapter = self.adapter
            self._sent.append((operation, tuple(args)))
        fn = getattr(adapter, operation.name, None)
        if not callable(fn):
            return Outcome(crashed=True, message=f"the adapter has no method {operation.name}()")
        # Each side gets its own lists: an implementation that keeps or mutates its
        # argument must not change what the spec saw.
        impl_args = [list(a) if isinstance(a, (list, tuple)) else a for a in _without_defaults(operation, args)]
        self.watch.impl_started()
        try:
            value = fn(*impl_args)
        except spec_errors.BlockManagerError as e:
            name = _spec_error_name(e)
            if name is None:
                return Outcome(
                    crashed=True, message=f"raised {type(e).__name__}, a BlockManagerError of no spec type: {said(e)}"
                )
            return self._with_events(Outcome(error=name, message=said(e), raised_types=_type_names(e)), adapter)
        except HarnessLimit as e:
            raise self._harness_limit(operation.name, e, args) from e
        except NotExpressible as e:
            if adapter is self.adapter:
                self._sent.pop()
            if valid:
                return Outcome(crashed=True, message=f"the adapter says a valid call is not expressible: {said(e)}")
            return Outcome(not_sent=f"not expressible in the implementation's API: {said(e)}")
        except IMPLEMENTATION_FAULTS as e:  # sys.exit() in an implementation is its crash, not the harness's
            raise_if_ctrl_c(e)
            return Outcome(crashed=True, message=_crash_message(e), raised_types=_type_names(e))
        finally:
            self.watch.impl_finished()
        if operation.normalize is None:
            return self._with_events(Outcome(result=None), adapter)
        normal = self._normal_result(operation, value)
        return normal if normal.crashed or isinstance(normal.result, dict) else self._with_events(normal, adapter)

    def _normal_result(self, operation: Operation, value: Any) -> Outcome:
        """A call's result in normal form, its reading watched as a call: reading it runs the implementation's
        code (a generator's body, an `__iter__` or `__index__`), whose faults and hangs are the implementation's."""
        assert operation.normalize is not None
        self.watch.impl_started()
        try:
            return Outcome(result=operation.normalize(value))
        except BadResult as e:
            return Outcome(result={"malformed": f"{type(value).__name__}: {e}"})
        except IMPLEMENTATION_FAULTS as e:
            raise_if_ctrl_c(e)
            message = f"reading its result ({type(value).__name__}) failed: {_crash_message(e)}"
            return Outcome(crashed=True, message=message, raised_types=_type_names(e))
        finally:
            self.watch.impl_finished()

    def _with_events(self, outcome: Outcome, adapter: Any) -> Outcome:
        """The outcome with the events the call published (drained from the adapter; a replica's are dropped)."""
        if not self.checks_events:
            return outcome
        self.watch.impl_started()
        try:
            events = take_events_result(adapter.take_events())
        except MalformedEvents as e:
            return Outcome(crashed=True, message=str(e))
        except IMPLEMENTATION_FAULTS as e:
            raise_if_ctrl_c(e)
            return Outcome(crashed=True, message=f"take_events() failed: {_crash_message(e)}")
        finally:
            self.watch.impl_finished()
        return replace(outcome, events=events) if adapter is self.adapter else outcome

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
        if p.impl.crashed and not self._crash_is_a_reaction(p):
            self._fail(FailureKind.CRASHED, p, p.impl.message)
        impl_snap = self._take_snapshot(p)
        prev = self.impl_snapshot
        # A mistake sent to a replica: the story shows the state it left the replica in.
        shown = p.sent.replica[1] if p.sent.replica is not None else impl_snap
        record = _record(p, spec_snap, shown)
        failure = self._first_problem(p, spec_snap, impl_snap, prev)
        if p.call.index > 0:
            self.records.append(record)
        if failure is not None:
            self._raise(Failure(failure[0], p.call.index, p.call.op, failure[1], failure[2]))
        self.impl_snapshot = impl_snap
        self._count(p, spec_snap)

    def _take_snapshot(self, p: _Pending) -> Snapshot:
        self._inflight = (p.call.index, p.call.op, p.call.args, p.spec, p.call.mistake)
        self.watch.impl_started()
        try:
            snap = self.adapter.snapshot()
        except IMPLEMENTATION_FAULTS as e:
            self.watch.impl_finished()
            raise_if_ctrl_c(e)
            self._fail(FailureKind.CRASHED, p, f"snapshot() failed: {_crash_message(e)}")
        self.watch.impl_finished()
        self._inflight = None
        if not isinstance(snap, Snapshot):
            self._fail(FailureKind.DIVERGES, p, f"snapshot() returned {type(snap).__name__}, not a kvspec Snapshot")
        checked = self._read_snapshot(snap)  # the invariants and the comparison read ints, bytes and tuples only
        if isinstance(checked, str):
            self._fail(FailureKind.DIVERGES, p, f"snapshot() returned a malformed Snapshot: {checked}")
        return checked

    def _read_snapshot(self, snap: Snapshot) -> Snapshot | str:
        """`_checked_snapshot`, watched as a call: reading the fields runs the implementation's code where they
        hold its own types (an `__iter__`, `__index__` or `__repr__`), whose faults and hangs are its own."""
        self.watch.impl_started()
        try:
            return _checked_snapshot(snap)
        except IMPLEMENTATION_FAULTS as e:
            raise_if_ctrl_c(e)
            return f"reading it raised {_crash_message(e)}"
        finally:
            self.watch.impl_finished()

    def _first_problem(
        self, p: _Pending, spec_snap: Snapshot, impl_snap: Snapshot, prev: Snapshot | None
    ) -> tuple[FailureKind, str, str | None] | None:
        """The first check of the step that fails, as (kind, message, rule name), or None."""
        pairs = self.hash_names.local_pairs(spec_snap, impl_snap)
        return (
            (self._mistake_problem(p, impl_snap, prev) if p.call.mistake is not None else self._result_problem(p))
            # Before the step rules: they compare the implementation's own snapshots, which only
            # means something while a prefix keeps its hash's name from one step to the next.
            or self._renaming_problem(spec_snap, pairs)
            or _state_problem(p, spec_snap, impl_snap, prev)
            or self._snapshot_problem(spec_snap, impl_snap, pairs)
            or self._events_problem(p, impl_snap)
            or self._stats_problem(p)
        )

    def _crash_is_a_reaction(self, p: _Pending) -> bool:
        """Whether an exception on a mistake step is what is checked (a declared `raises`, or a survey);
        any other exception is a crash, as on a valid call."""
        if p.call.mistake is None or not p.impl.raised_types:
            return False
        return self.observer.survey is not None or (p.sent.reaction is not None and p.sent.reaction.kind == "raises")

    def _mistake_problem(
        self, p: _Pending, impl_snap: Snapshot, prev: Snapshot | None
    ) -> tuple[FailureKind, str, str | None] | None:
        """What the implementation did with a caller mistake, against the reaction its adapter declares."""
        mistake, obs = p.call.mistake, self.observer
        assert mistake is not None, "a mistake check on a step that made no mistake"
        if p.impl.not_sent is not None:
            obs.not_expressed[mistake] += 1
            return None
        before, after, counted = p.sent.replica if p.sent.replica is not None else (prev, impl_snap, False)
        changed = counted or (before is not None and after != before)
        if obs.survey is not None:
            seen = observed_reaction(p.spec, p.impl, changed)
            obs.survey.setdefault(mistake, Counter())[seen.describe() if seen else p.impl.describe()] += 1
            return None
        assert p.sent.reaction is not None, f"{mistake!r} was sent with no reaction to check"
        obs.mistakes_sent[mistake] += 1
        if p.sent.reaction.kind == "spec error":
            return self._result_problem(p)
        problem = reaction_problem(p.sent.reaction, p.spec, p.impl, changed)
        return None if problem is None else (FailureKind.DIVERGES, f"the caller mistake {mistake!r}: {problem}", None)

    def _result_problem(self, p: _Pending) -> tuple[FailureKind, str, str | None] | None:
        """A malformed result, a broken hit rule, or a different result or error type."""
        spec, impl = p.spec, p.impl
        if isinstance(impl.result, dict) and "malformed" in impl.result:
            message = f"returned a malformed value ({impl.result['malformed']}); the spec returned {spec.describe()}"
            return FailureKind.DIVERGES, message, None
        # Hit rules first: a hit past the cap is named as such, not as "a different list".
        if p.hit is not None and impl.error is None and spec.error is None:
            problem = self._hit_problem(p)
            if problem is not None:
                return problem
        if spec.error != impl.error:
            spec_side = (
                f"the spec raised {spec.error} ({spec.message})"
                if spec.error
                else f"the spec returned {spec.describe()}"
            )
            impl_side = (
                f"the implementation raised {impl.error} ({impl.message})"
                if impl.error
                else f"the implementation returned {impl.describe()}"
            )
            first, second = (impl_side, spec_side) if spec.error is None else (spec_side, impl_side)
            return FailureKind.DIVERGES, f"{first}; {second}", None
        same_result = OPERATIONS[p.call.op].same_result if p.call.index > 0 else operator.eq
        if spec.error is None and not same_result(spec.result, impl.result):
            return FailureKind.DIVERGES, f"returned {impl.describe()}; the spec returned {spec.describe()}", None
        return None

    def _hit_problem(self, p: _Pending) -> tuple[FailureKind, str, str | None] | None:
        """The hit rules and, with KV memory, the content of every hit block."""
        assert p.hit is not None, "hit rules checked without the request's chain"
        blocks, num_tokens = p.impl.result
        request = p.call.args[0]
        if not all(0 <= b < p.expected.before.num_gpu_blocks for b in blocks):
            return FailureKind.DIVERGES, f"returned hit blocks {blocks}, not all blocks of this pool", None
        try:
            check_hit(
                p.expected.before,
                len(request.token_ids),
                self.config.block_size,
                p.hit.hashes,
                [BlockId(b) for b in blocks],
                num_tokens,
            )
        except spec_errors.InvariantViolation as e:
            return FailureKind.INVARIANT, f"{e.rule} (got hit blocks {blocks}, {num_tokens} tokens)", e.name
        if p.hit.content is not None:
            problem = self._content_problem(request, blocks, p.hit.content)
            if problem is not None:
                return FailureKind.INVARIANT, problem, "hit_content_intact"
        return None

    def _renaming_problem(
        self, spec_snap: Snapshot, pairs: dict[BlockHash, BlockHash] | None
    ) -> tuple[FailureKind, str, None] | None:
        """A hash the implementation named differently at an earlier step for the same prefix, or None."""
        clash = None if pairs is None else self.hash_names.conflict(spec_snap, pairs)
        if clash is None:
            return None  # a step whose hashes do not pair one to one is the state comparison's to report
        return (
            FailureKind.DIVERGES,
            (
                f"block {clash}'s hash is not the one the implementation used for the same prefix earlier "
                "(hash values are compared as names: the same spec hash must keep the same name)"
            ),
            None,
        )

    def _snapshot_problem(
        self, spec_snap: Snapshot, impl_snap: Snapshot, pairs: dict[BlockHash, BlockHash] | None
    ) -> tuple[FailureKind, str, None] | None:
        """The whole state against the spec's, hash values as names fixed across the example
        (`pairs`: this step's spec-to-implementation hash pairs, None where not one to one)."""
        names = self.hash_names
        if pairs is None or names.as_spec(impl_snap, pairs) != spec_snap:
            spec_n, impl_n = names.named(spec_snap, impl_snap)
            return (
                FailureKind.DIVERGES,
                f"the state differs from the spec's: {_diff(spec_n, impl_n, 'spec', 'implementation')}",
                None,
            )
        if self.uses_kvspec_hash_chain and spec_snap.block_hash != impl_snap.block_hash:
            b = next(i for i, (hs, hi) in enumerate(zip(spec_snap.block_hash, impl_snap.block_hash)) if hs != hi)
            # The pool level computes no chain: its hash values are the ones the harness handed over.
            expected = (
                f"the harness handed it {_show(spec_snap.block_hash[b])}" if self.level == "pool" else
                f"kvspec's chain (hash_fn={self.config.hash_fn!r}, seed={self.config.seed!r}) "
                f"gives {_show(spec_snap.block_hash[b])} for the same prefix"
            )  # fmt: skip
            return (
                FailureKind.DIVERGES,
                (
                    f"block {b}'s hash is {_show(impl_snap.block_hash[b])}, but {expected} "
                    "(the adapter declares uses_kvspec_hash_chain, so values are compared exactly)"
                ),
                None,
            )
        self.observer.states.add(hash(spec_snap.with_canonical_hashes()))
        names.learn(pairs)
        return None

    def _events_problem(self, p: _Pending, impl_snap: Snapshot) -> tuple[FailureKind, str, str | None] | None:
        """The event rules on the implementation's stream, then its events against the spec's (kv_events)."""
        if not self.checks_events:
            return None
        impl_events = p.impl.events
        try:
            check_events(self.impl_mirror, impl_events, impl_snap)
        except spec_errors.InvariantViolation as e:
            shown = describe_events(impl_events, self.hash_names.impl_name)
            return FailureKind.INVARIANT, f"{e.rule} (the implementation published: {shown})", e.name
        renamed = self.hash_names.events_as_spec(p.expected.events, impl_events)
        level, dropped = self.level, self.fields_not_reported
        spec_side = tuple(comparable(e, level, dropped) for e in p.expected.events)
        if p.sent.reaction is not None and p.sent.reaction.kind == "ignores":
            # An ignored mistake may still publish a BlockStored of no keys over the positions it named (vLLM
            # 0.14 on, for a call naming only the null block, which it skips): it changes no router's mirror.
            # One over no position (a call of no blocks: an event every decode step) is still compared.
            renamed = tuple(
                e for e in renamed if not (isinstance(e, BlockStored) and not e.block_hashes and e.token_ids)
            )
        impl_side = tuple(comparable(e, level, dropped) for e in renamed)
        if not same_events(spec_side, impl_side):
            return (
                FailureKind.DIVERGES,
                (
                    f"published {describe_events(impl_events, self.hash_names.impl_name)}; the spec published "
                    f"{describe_events(p.expected.events, self.hash_names.name)}"
                ),
                None,
            )
        return None

    def _stats_problem(self, p: _Pending) -> tuple[FailureKind, str, str | None] | None:
        """The implementation's hit statistics against the spec's (request level, with events)."""
        if not self.checks_stats or p.impl.replica or p.impl.not_sent is not None:
            return None
        self.watch.impl_started()
        try:
            impl = self.adapter.prefix_cache_stats()
        except IMPLEMENTATION_FAULTS as e:
            raise_if_ctrl_c(e)
            return FailureKind.CRASHED, f"prefix_cache_stats() failed: {_crash_message(e)}", None
        finally:
            self.watch.impl_finished()
        if not isinstance(impl, PrefixCacheStats):
            what = f"prefix_cache_stats() returned {type(impl).__name__}, not PrefixCacheStats"
            return FailureKind.DIVERGES, what, None
        spec = cast(ManagerState, self.spec_state).stats
        if NO_CONNECTOR_STATS in self.not_applicable:
            impl, spec = replace(impl, connector=CacheCounters()), replace(spec, connector=CacheCounters())
        if NO_RESET_COUNT in self.not_applicable:
            impl, spec = replace(impl, num_resets=0), replace(spec, num_resets=0)
        if impl != spec:
            return FailureKind.DIVERGES, f"the hit statistics differ from the spec's: {_stats_diff(spec, impl)}", None
        return None

    def _content_problem(self, request: Request, blocks: Sequence[int], content: list[Any]) -> str | None:
        """What is wrong with the KV read back from a hit's blocks, or None (hit_content_intact)."""
        assert self.kv_source is not None, "content read without a KV source"
        bs = self.config.block_size
        if len(content) != len(blocks):
            return f"read_kv({list(blocks)}) returned {len(content)} blocks, not {len(blocks)}"
        # The hit is group by group, as many positions each; a null position holds nothing to read.
        n = len(blocks) // max(len(self.spec_snapshot.kv_groups), 1)
        for j, (b, actual) in enumerate(zip(blocks, content)):
            if b == NULL_BLOCK_ID:
                continue
            i = j % n
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
        if p.call.index == 0:
            return
        obs.steps += 1
        obs.invariants_checked += (
            len(INVARIANTS)
            + len(STEP_RULES)
            + (len(EVENT_RULES) if self.checks_events else 0)
            + (_NUM_HIT_RULES_CHECKED if p.hit is not None else 0)
            + (1 if p.hit is not None and p.hit.content is not None else 0)
        )
        reached = step_branches(p.call.op, p.call.args, p.expected.before, spec_snap, p.spec)
        hit_reached = OPERATIONS[p.call.op].hit_reached if p.call.index > 0 else None
        if p.hit is not None and hit_reached is not None:
            reached += hit_reached(p.call.args[0], self.config.block_size, p.expected.before, p.spec.result,
                                   p.hit.hashes, p.hit.cut)  # fmt: skip
        reached += self._tags
        self._tags = []
        if self.config.events:
            reached += self._event_branches(p)
        self.reached.update(reached)
        obs.coverage.update(reached)
        self.watch.progress(obs.examples, obs.steps)

    def _event_branches(self, p: _Pending) -> list[str]:
        """What the step's events reached (the spec's), and the mirrors moved past them."""
        events = p.expected.events
        reached = sorted({f"events: {type(e).__name__}" for e in events})
        if naive_misreads(self.spec_mirror, events):
            reached.append("events: a key removed while another block still holds it")
        if orphaned_stores(self.spec_mirror, events):
            reached.append("events: a stored block's parent not held")
        self.spec_mirror = self.spec_mirror.apply(events)
        self.impl_mirror = self.impl_mirror.apply(p.impl.events)
        if p.expected.stats_before is not None:
            reached += _stats_branches(p.expected.stats_before, cast(ManagerState, self.spec_state).stats)
        return reached

    def _fail(self, kind: FailureKind, p: _Pending, message: str) -> NoReturn:
        if p.call.index > 0:
            self.records.append(_record(p, self.spec_snapshot, None))
        self._raise(Failure(kind, p.call.index, p.call.op, message))

    def _raise(self, failure: Failure) -> NoReturn:
        self.failure = ConformanceFailure(failure)
        self.watch.failed = self
        raise self.failure

    def trace(self, impl: str | None = None) -> Trace:
        """This example so far as a trace, with its verdict and failure if it failed."""
        if self.failure is None:
            return Trace(config=self.config, steps=tuple(self.records), impl=impl)
        failure = self.failure.failure
        if isinstance(self.failure, SpecFailure):
            failure = replace(failure, step=len(self.records))
        return Trace(self.config, tuple(self.records), impl, failure.kind.verdict, failure)

    def hung(self) -> ConformanceFailure:
        """Record that the implementation call in flight did not return in time; returns the failure."""
        message = self.watch.limit_met()
        index, op, args, spec, mistake = (
            self._inflight if self._inflight is not None else (len(self.records) + 1, "?", (), Outcome(), None)
        )
        self._pending = self._inflight = None
        if index > 0:
            self.records.append(
                TraceStep(index, op, args, spec, Outcome(hung=True, message=message), self.spec_snapshot, None, mistake)
            )
        self.failure = ConformanceFailure(Failure(FailureKind.HUNG, index, op, message))
        return self.failure


def _state_problem(
    p: _Pending, spec_snap: Snapshot, impl_snap: Snapshot, prev: Snapshot | None
) -> tuple[FailureKind, str, str | None] | None:
    """A rejected call that changed the state, or a broken invariant or step rule."""
    # An ignored mistake: then the good part's state is the spec's.
    ignored = p.sent.reaction is not None and p.sent.reaction.kind == "ignores"
    if p.spec.error is not None and prev is not None and impl_snap != prev and not ignored:
        what = f"the caller mistake {p.call.mistake!r}" if p.call.mistake else "the call"
        reaction = f"; its adapter declares it {p.sent.reaction.describe()}" if p.sent.reaction is not None else ""
        return (
            FailureKind.DIVERGES,
            (
                f"{what} changed the state ({_diff(prev, impl_snap, 'before', 'after')}) although the "
                f"implementation {p.impl.describe()}{reaction}; a rejected call must change nothing"
            ),
            None,
        )
    try:
        # Every spec operation's postconditions check every invariant on the state it returns (and a
        # rejected call returns the state its preconditions checked): a state equal to the spec's holds
        # them too, and an implementation that conforms is in the spec's state at every step.
        if impl_snap != spec_snap:
            check_all(impl_snap)
        if prev is not None:
            check_step(prev, impl_snap, p.call.op)
    except spec_errors.InvariantViolation as e:
        return FailureKind.INVARIANT, e.rule, e.name
    return None


def _record(p: _Pending, spec_snap: Snapshot, impl_snap: Snapshot | None) -> TraceStep:
    """The trace's record of a checked step."""
    c = p.call
    return TraceStep(c.index, c.op, c.args, p.spec, p.impl, spec_snap, impl_snap, c.mistake, c.without)


def _takes(method: Callable[..., Any], param: str) -> bool:
    """Whether a method takes a parameter of this name (or any keyword)."""
    try:
        params = inspect.signature(method).parameters
    except (TypeError, ValueError):
        return False
    return param in params or any(q.kind is inspect.Parameter.VAR_KEYWORD for q in params.values())


def _without_defaults(operation: Operation, args: Sequence[Any]) -> Sequence[Any]:
    """The arguments an adapter is called with: trailing ones at their default left out (an adapter written
    before the parameter existed keeps working; the machine sends another value only where it is taken)."""
    n = len(args)
    for value in reversed(operation.defaults):
        if n == 0 or not (type(args[n - 1]) is type(value) and args[n - 1] == value):  # 0 is not False
            break
        n -= 1
    return args[:n]


def _stats_branches(before: PrefixCacheStats, after: PrefixCacheStats) -> list[str]:
    """What a request-level step recorded in the spec's hit statistics, as coverage names it."""
    grew = [
        (after.local.hits > before.local.hits, "stats: local hit counted"),
        (  # in the local counters, or (a request whose lookup did not run) only in the connector's
            after.local.preempted_requests > before.local.preempted_requests
            or after.connector.preempted_requests > before.connector.preempted_requests,
            "stats: preempted request counted apart",
        ),
        (after.connector.hits > before.connector.hits, "stats: external tokens counted apart"),
        (after.num_resets > before.num_resets, "stats: reset recorded"),
    ]
    return [name for changed, name in grew if changed]


def _stats_diff(spec: PrefixCacheStats, impl: PrefixCacheStats) -> str:
    parts = []
    for side in ("local", "connector"):
        a, b = getattr(spec, side), getattr(impl, side)
        for f in ("requests", "queries", "hits", "preempted_requests", "preempted_queries", "preempted_hits"):
            if getattr(a, f) != getattr(b, f):
                parts.append(f"{side}.{f}: spec {getattr(a, f)} vs implementation {getattr(b, f)}")
    if spec.num_resets != impl.num_resets:
        parts.append(f"num_resets: spec {spec.num_resets} vs implementation {impl.num_resets}")
    return "; ".join(parts)


def run_spec(
    config: AdapterConfig,
    steps: Sequence[tuple[str, Sequence[Any]]],
    good_parts: Mapping[int, Sequence[Any] | None] | None = None,
) -> list[tuple[Outcome, Snapshot]]:
    """The spec's outcome and state after each step, the spec alone (no implementation).

    Used to rebuild the story of a process that died: up to its last step the
    implementation matched the spec, so the spec's side is the whole story.
    `good_parts` (position in `steps` -> a mistaken call's good part, None when
    it has none): the caller mistakes the implementation ignores; after each,
    the state is the spec's after its good part alone, as `LockStep` expects
    it (`_good_part`), while the outcome stays the spec's on the whole call.
    """
    state = spec_initial_state(config)
    out: list[tuple[Outcome, Snapshot]] = []
    for i, (op, args) in enumerate(steps):
        try:
            after, outcome = _spec_step(OPERATIONS[op], state, args)
            if good_parts is not None and i in good_parts:
                good = good_parts[i]
                after = state if good is None else _spec_step(OPERATIONS[op], state, good)[0]
            state = after
        except Exception as e:
            outcome = Outcome(crashed=True, message=f"the spec failed: {_crash_message(e)}")
        out.append((outcome, state.snapshot()))
    return out


def _checked_snapshot(s: Snapshot) -> Snapshot | str:
    """An implementation's snapshot with every field a tuple of plain ints, bytes and strings, or what in it is
    of the wrong type. Most are plain already: one type check, and the snapshot as it is."""
    if type(s) is not Snapshot:  # a subclass's own __eq__ or __repr__ would run wherever the checks compare or print
        s = Snapshot(**{f.name: getattr(s, f.name) for f in fields(Snapshot)})
    if _malformed(s) is None:
        return s
    try:
        normal = _normal_snapshot(s)
    except (TypeError, ValueError) as e:  # a field that is no sequence, or an id that is no integer
        return _malformed(s) or str(e)
    return _malformed(normal) or normal


def _normal_snapshot(s: Snapshot) -> Snapshot:
    """The snapshot with every field a tuple of plain ints (implementations may hand back lists or numpy ints).

    Raises:
        TypeError, ValueError: a field is no sequence, or an id or count is no integer (a float, a string).
    """
    index = operator.index  # an integer of any kind (numpy's too), never a float or a string
    return replace(
        s,
        ref_cnt=tuple(index(r) for r in s.ref_cnt),
        block_hash=tuple(None if h is None else BlockHash(bytes(h)) for h in s.block_hash),
        free_queue=tuple(BlockId(index(b)) for b in s.free_queue),
        hash_to_blocks=tuple((BlockHash(bytes(h)), tuple(BlockId(index(b)) for b in bl)) for h, bl in s.hash_to_blocks),
        block_tables=None
        if s.block_tables is None
        else tuple((rid, tuple(BlockId(index(b)) for b in bl)) for rid, bl in s.block_tables),
        quarantined=tuple(BlockId(index(b)) for b in s.quarantined),
        kv_groups=tuple(s.kv_groups),
    )


def _malformed(s: Snapshot) -> str | None:
    """Which field of a snapshot holds a value of other than its plain type, or None: ids and counts are ints,
    hashes bytes, request ids and group names strings, every sequence a tuple.

    Every step reads it, so each field is checked by the set of its values' types, in C loops (13 us on a
    49-block manager's snapshot, against 23 for a Python test a value).
    """

    def of(values: object, types: frozenset[type]) -> bool:
        if type(values) is not tuple or not set(map(type, values)) <= types:
            return False
        # An int past any pool's ids and counts could not even be printed in the story (past 4,300 digits).
        return int not in types or not values or (min(values) > -ID_BOUND and max(values) < ID_BOUND)

    def pairs(entries: object, key_types: frozenset[type]) -> bool:  # (key, ids) pairs: hashes or request ids
        if type(entries) is not tuple or not set(map(len, entries)) <= {2}:
            return False
        keys, lists = zip(*entries) if entries else ((), ())
        return of(keys, key_types) and of(lists, _TUPLE) and of(tuple(chain.from_iterable(lists)), _INT)

    checks: tuple[tuple[str, Callable[[], bool]], ...] = (
        ("num_gpu_blocks", lambda: type(s.num_gpu_blocks) is int),
        ("enable_caching", lambda: type(s.enable_caching) is bool),
        ("ref_cnt", lambda: of(s.ref_cnt, _INT)),
        ("block_hash", lambda: of(s.block_hash, _HASH_OR_NONE)),
        ("free_queue", lambda: of(s.free_queue, _INT)),
        ("hash_to_blocks", lambda: pairs(s.hash_to_blocks, _BYTES)),
        ("block_tables", lambda: s.block_tables is None or pairs(s.block_tables, _STR)),
        ("quarantined", lambda: of(s.quarantined, _INT)),
        ("kv_groups", lambda: of(s.kv_groups, _STR)),
    )
    for name, holds in checks:
        try:
            ok = holds()
        except (TypeError, ValueError):  # not iterable, or entries that are not pairs
            ok = False
        if not ok:
            try:
                return f"its {name} is {getattr(s, name)!r:.200}"
            except ValueError:  # an int too long to print
                return f"its {name} holds an integer past any block id or count"
    return None


_INT: frozenset[type] = frozenset({int})
_STR: frozenset[type] = frozenset({str})
_BYTES: frozenset[type] = frozenset({bytes})
_TUPLE: frozenset[type] = frozenset({tuple})
_HASH_OR_NONE: frozenset[type] = frozenset({bytes, type(None)})


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
        is_name = value[:1] in (b"h", b"x") and len(value) < 8 and value[1:].isdigit()
        return value.decode("ascii", "replace") if is_name else value.hex()[:8]
    return repr(value)


def _diff(a: Snapshot, b: Snapshot, a_name: str, b_name: str) -> str:
    parts = [
        f"{name}: {a_name} {_show(getattr(a, name))} vs {b_name} {_show(getattr(b, name))}"
        for name in _FIELDS
        if getattr(a, name) != getattr(b, name)
    ]
    return "; ".join(parts)
