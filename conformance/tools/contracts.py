"""CrossHair over the spec's contracts: each function searched for a counterexample, in a budget.

CrossHair runs a function on symbolic arguments and looks for a path where a
precondition holds but a postcondition fails, or where it raises an error its
docstring does not declare (`raises:`; a declared error is a caller mistake
rejected on purpose). Finding none within the time budget is reported as
exactly that, "no counterexample found within budget": a search, not a proof.
A search in which no generated input got past the preconditions searched
nothing (CrossHair's `pre_unsat`): it is reported as that, never as a
condition that holds, and never as a counterexample either.

A budget is given in CPU seconds per condition, and may also be given in
paths (`max_paths`): CrossHair's path order is seeded, so a budget in paths
explores the same inputs on every machine, where one in seconds explores
fewer on a slower or busier one.

Design choice: the pool and manager states CrossHair feeds the operations are
drawn from a corpus of reachable states (built by the spec's own operations
from fresh pools, seeded), chosen by a symbolic index, while every other
argument stays fully symbolic. Left to build a `PoolState` from scratch,
CrossHair almost never satisfies the invariants a precondition demands (a free
queue that is exactly the ref-0 blocks, a hash table mirroring the hashes) and
a silent run would mean nothing; with the corpus it reaches every operation's
body on states of every kind (free cached blocks, shared blocks, prefix caching
off, both profiles) and finds the planted wrong operations in seconds.

NOTE: parameters typed with a `typing.NewType` (`Sequence[BlockId]`) are shown
to CrossHair as their runtime type (`Sequence[int]`): CrossHair 0.0.113 keeps
NewType elements as heap objects, which is slow, and its type unifier calls
`issubclass` on them and crashes while printing a counterexample. At run time a
NewType is its supertype, so nothing is lost.
"""

from __future__ import annotations

import collections
import importlib
import inspect
import random
import time
import types
import typing
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import cbor2

from kvspec.spec import manager as spec_manager
from kvspec.spec import ops as spec_ops
from kvspec.spec.errors import BlockManagerError
from kvspec.spec.ordering import PROFILES
from kvspec.spec.state import BlockHash, BlockId, PoolState

__all__ = [
    "ANALYSIS_ERROR",
    "DEFAULT_MODULES",
    "NO_COUNTEREXAMPLE",
    "SEARCHED_NOTHING",
    "ConditionResult",
    "ContractsReport",
    "FunctionReport",
    "check_function",
    "check_modules",
    "contract_functions",
    "manager_state_corpus",
    "pool_state_corpus",
]

DEFAULT_MODULES = ("kvspec.spec.ops", "kvspec.spec.manager", "kvspec.spec.ordering")
NO_COUNTEREXAMPLE = "no counterexample found within budget"
ANALYSIS_ERROR = "analysis_error"  # CrossHair could not analyse the function at all
SEARCHED_NOTHING = "pre_unsat"  # CrossHair's name: no generated input got past the preconditions
# CrossHair's kinds of counterexample: a postcondition false, or raising, or the body raising what it does not declare
COUNTEREXAMPLE_KINDS = ("post_fail", "post_err", "exec_err")


# --- the state corpora ----------------------------------------------------------------------------


def _some(rng: random.Random, blocks: list[BlockId]) -> list[BlockId]:
    return rng.sample(blocks, rng.randint(0, len(blocks)))


def _held(st: PoolState) -> list[BlockId]:
    return [BlockId(b) for b in range(1, st.num_gpu_blocks) if st.ref_cnt[b] > 0]


def _hashed(st: PoolState) -> list[BlockId]:
    return [BlockId(b) for b in range(1, st.num_gpu_blocks) if st.block_hash[b] is not None]


def _take(rng: random.Random, st: PoolState) -> PoolState:
    return spec_ops.get_new_blocks(st, rng.randint(0, len(st.free_queue))).state


def _free(rng: random.Random, st: PoolState) -> PoolState:
    return spec_ops.free_blocks(st, _some(rng, _held(st))).state


def _cache(rng: random.Random, st: PoolState) -> PoolState:
    blocks = _some(rng, [b for b in _held(st) if st.block_hash[b] is None])
    return spec_ops.cache_full_blocks(st, blocks, [BlockHash(b"h%d" % rng.randint(1, 3)) for _ in blocks]).state


def _touch(rng: random.Random, st: PoolState) -> PoolState:
    return spec_ops.touch(st, _some(rng, _hashed(st))).state


def _evict(rng: random.Random, st: PoolState) -> PoolState:
    return spec_ops.evict_blocks(st, _some(rng, _hashed(st))[:1]).state


def _reset(rng: random.Random, st: PoolState) -> PoolState:
    return spec_ops.reset_prefix_cache(st).state


# The calls a workload makes, weighted by repetition (taking and freeing blocks twice as often as the rest).
_POOL_CALLS: tuple[Callable[[random.Random, PoolState], PoolState], ...] = (
    _take,
    _take,
    _free,
    _free,
    _cache,
    _touch,
    _evict,
    _reset,
)


def _random_pool_call(rng: random.Random, st: PoolState) -> PoolState:
    """A call a real workload could make: its arguments drawn from the blocks in the right state."""
    call = rng.choice(_POOL_CALLS)
    try:
        return call(rng, st)
    except BlockManagerError:
        return st  # prefix caching off: nothing is cached


# Every named profile and one weighted hybrid: the keyed policies' stamps are state too.
CORPUS_PROFILES: tuple[str, ...] = (*PROFILES, "lru-lfu:0.5")


def _pool_features(st: PoolState) -> tuple[object, ...]:
    """What makes a state a different test case for an operation."""
    free = st.free_queue
    free_hashed = [b for b in free if st.block_hash[b] is not None]
    held = [b for b in range(1, st.num_gpu_blocks) if st.ref_cnt[b] > 0]
    # A block one free away from the free queue: where it lands beside the free blocks is what
    # free_blocks decides (left or right, by its hash and the profile).
    last_ref = [b for b in held if st.ref_cnt[b] == 1]
    hashes = [h for h in st.block_hash if h is not None]
    return (
        min(st.num_gpu_blocks, 4),
        st.config.enable_caching,
        st.config.profile,
        bool(free) and st.block_hash[free[0]] is not None,
        bool(free_hashed),
        len(free_hashed) < len(free),
        any(st.ref_cnt[b] > 1 for b in held),
        any(st.block_hash[b] is not None for b in held),
        any(st.block_hash[b] is None for b in held),
        len(hashes) != len(set(hashes)),
        bool(free) and any(st.block_hash[b] is not None for b in last_ref),
        bool(free) and any(st.block_hash[b] is None for b in last_ref),
    )


def _pairwise_cover(candidates: Sequence[T], features: Callable[[T], tuple[object, ...]]) -> list[T]:
    """A few candidates that together show every pair of feature values any candidate shows.

    Greedy: repeatedly take the candidate adding the most uncovered pairs.
    """

    def pairs(c: T) -> set[tuple[object, ...]]:
        f = features(c)
        return {(i, f[i], j, f[j]) for i in range(len(f)) for j in range(i + 1, len(f))}

    each = [pairs(c) for c in candidates]
    uncovered = set().union(*each) if each else set()
    chosen: list[T] = []
    while uncovered:
        best = max(range(len(candidates)), key=lambda k: len(each[k] & uncovered))
        chosen.append(candidates[best])
        uncovered -= each[best]
    return chosen


def pool_state_corpus(max_blocks: int = 5, seed: int = 0) -> tuple[PoolState, ...]:
    """Reachable pool states of at most `max_blocks` blocks, covering every pair of features.

    Features are what an operation's behaviour depends on (`_pool_features`):
    a free cached block at the left end, a shared block, prefix caching off,
    the profile, ... Fresh pools come first.
    """
    rng = random.Random(seed)
    seen: dict[object, PoolState] = {}
    profiles = CORPUS_PROFILES
    for _ in range(3000):
        st = spec_ops.new_pool(rng.randint(1, max_blocks), rng.random() < 0.85, rng.choice(profiles))
        for _ in range(rng.randint(1, 12)):
            st = _random_pool_call(rng, st)
        seen.setdefault(st.snapshot(), st)
    fresh = [spec_ops.new_pool(n, True, profile) for n in (1, 2, max_blocks) for profile in profiles]
    covering = [st for st in _pairwise_cover(list(seen.values()), _pool_features) if st not in fresh]
    return tuple(fresh + covering)


def manager_state_corpus(size: int = 24, seed: int = 0) -> tuple[spec_manager.ManagerState, ...]:
    """Distinct reachable manager states: requests sharing prefixes, running, finished, preempted."""
    rng = random.Random(seed)
    states: dict[object, spec_manager.ManagerState] = {}
    prompts = [(1, 2, 3, 4, 5), (1, 2, 3, 4, 9, 9), (7, 7), (1, 2)]
    attempts = 0
    while len(states) < size and attempts < 50 * size:
        attempts += 1
        state = spec_manager.new_manager(
            rng.randint(2, 8), rng.randint(1, 3), rng.random() < 0.85, rng.choice(CORPUS_PROFILES)
        )
        running: list[str] = []
        for step in range(rng.randint(0, 4)):
            if running and rng.random() < 0.35:
                state = spec_manager.free(state, running.pop(rng.randrange(len(running)))).state
                continue
            request = spec_manager.Request(f"r{step}", rng.choice(prompts))
            hit, num_hit = spec_manager.get_computed_blocks(state, request).result
            num_new = len(request.token_ids) - num_hit
            allocated = spec_manager.allocate_slots(state, request, num_new, num_hit, hit)
            state, blocks = allocated.state, allocated.result
            if blocks is not None:
                running.append(request.request_id)
        states.setdefault(state.snapshot(), state)
    return tuple(states.values())


T = typing.TypeVar("T")


def _pick(corpus: Sequence[T], index: Any) -> T:
    """corpus[index] for a symbolic index, by halving: CrossHair then spreads its paths evenly.

    (Realizing the index directly makes CrossHair pick the same value again and again.)
    """
    lo, hi = 0, len(corpus)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if index < mid:
            hi = mid
        else:
            lo = mid
    return corpus[lo]


_REGISTERED = False


def _register_inputs() -> None:
    """Tell CrossHair to draw PoolState and ManagerState arguments from the corpora.

    Also hand cbor2 (a C extension, which cannot read symbolic values) concrete
    ones, as CrossHair does itself for hashlib.
    """
    global _REGISTERED
    if _REGISTERED:
        return
    # optional dependency (the proofs extra): CrossHair is imported only when contracts are checked
    from crosshair.core import SymbolicFactory, register_patch, register_type, with_realized_args
    from crosshair.tracers import ResumedTracing
    from crosshair.util import IgnoreAttempt

    register_patch(cbor2.dumps, with_realized_args(cbor2.dumps, deep=True))

    pools = pool_state_corpus()
    managers = manager_state_corpus()

    def from_corpus(corpus: Sequence[T], name: str) -> Callable[[SymbolicFactory], T]:
        def create(p: SymbolicFactory) -> T:
            with ResumedTracing():  # type: ignore[no-untyped-call]
                index = p(int, name)
                if index < 0 or index >= len(corpus):
                    raise IgnoreAttempt
                return _pick(corpus, index)

        return create

    register_type(PoolState, from_corpus(pools, "_pool_state"))
    register_type(spec_manager.ManagerState, from_corpus(managers, "_manager_state"))
    _REGISTERED = True


# --- NewType-free signatures --------------------------------------------------------------------------


def _runtime_type(annotation: Any) -> Any:
    """The annotation with every NewType replaced by its supertype, recursively."""
    while hasattr(annotation, "__supertype__"):
        annotation = annotation.__supertype__
    args = typing.get_args(annotation)
    origin = typing.get_origin(annotation)
    if not args or origin is None:
        return annotation
    erased = tuple(... if a is ... else _runtime_type(a) for a in args)
    if origin is types.UnionType or origin is typing.Union:
        return typing.Union[erased]  # noqa: UP007 (the union is built from a tuple)
    try:
        return annotation.copy_with(erased)
    except AttributeError:
        return origin[erased]


def _function_info(fn: Callable[..., object]) -> Any:
    """CrossHair's FunctionInfo for `fn`, with NewTypes erased from its signature."""
    # optional dependency (the proofs extra): CrossHair is imported only when contracts are checked
    from crosshair.fnutil import FunctionInfo

    class RuntimeTypedFunction(FunctionInfo):
        def get_callable(self) -> Any:
            pair = super().get_callable()
            if pair is None:
                return None
            real_fn, sig = pair
            params = [p.replace(annotation=_runtime_type(p.annotation)) for p in sig.parameters.values()]
            return real_fn, sig.replace(parameters=params, return_annotation=_runtime_type(sig.return_annotation))

    module = inspect.getmodule(fn)
    return RuntimeTypedFunction(module, fn.__name__, fn)


# --- running CrossHair ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ConditionResult:
    """What CrossHair found for one postcondition of one function."""

    condition: str  # the postcondition's source text
    status: str  # NO_COUNTEREXAMPLE, one of COUNTEREXAMPLE_KINDS, SEARCHED_NOTHING, or why it could not be analysed
    exhausted: bool  # every path of the generated inputs was explored before the budget ran out
    message: str  # the counterexample as CrossHair prints it ("" when none)
    num_paths: int  # paths explored
    seconds: float  # wall time

    @property
    def ok(self) -> bool:
        """Whether inputs were searched and no counterexample was found."""
        return self.status == NO_COUNTEREXAMPLE

    @property
    def found(self) -> bool:
        """Whether the search found a counterexample."""
        return self.status in COUNTEREXAMPLE_KINDS


@dataclass(frozen=True)
class FunctionReport:
    """What CrossHair found for one function."""

    name: str  # module.function
    conditions: tuple[ConditionResult, ...]  # one per postcondition searched

    @property
    def ok(self) -> bool:
        """Whether every condition was searched and none had a counterexample."""
        return all(c.ok for c in self.conditions)

    @property
    def failures(self) -> tuple[ConditionResult, ...]:
        """The conditions with a counterexample."""
        return tuple(c for c in self.conditions if c.found)

    @property
    def not_searched(self) -> tuple[ConditionResult, ...]:
        """The conditions whose search never got past the preconditions, or could not be analysed."""
        return tuple(c for c in self.conditions if not c.ok and not c.found)

    @property
    def seconds(self) -> float:
        """Wall time over every condition."""
        return sum(c.seconds for c in self.conditions)

    @property
    def num_paths(self) -> int:
        """Paths explored over every condition."""
        return sum(c.num_paths for c in self.conditions)

    @property
    def summary(self) -> str:
        """One line: the finding, never "verified"."""
        if self.failures:
            first = self.failures[0]
            return f"counterexample ({first.status}): {first.message}"
        if self.not_searched:
            first = self.not_searched[0]
            if first.status != SEARCHED_NOTHING:
                return f"could not be analysed ({first.status}): {first.message}"
            return (
                f"searched nothing in {len(self.not_searched)} of {len(self.conditions)} conditions: "
                f"no generated input met the preconditions ({first.num_paths} "
                f"{'path' if first.num_paths == 1 else 'paths'} tried); give a larger budget"
            )
        exhausted = bool(self.conditions) and all(c.exhausted for c in self.conditions)
        return NO_COUNTEREXAMPLE + (" (every generated path explored)" if exhausted else "")


@dataclass(frozen=True)
class ContractsReport:
    """Every function CrossHair searched."""

    functions: tuple[FunctionReport, ...]  # in module and source order
    per_condition_timeout: float  # CrossHair's budget per postcondition (CPU seconds)
    seconds: float  # wall time of the run
    crosshair_version: str = field(default="")
    max_paths: int | None = None  # CrossHair's budget per postcondition in paths, if one was given

    @property
    def ok(self) -> bool:
        """Whether every condition was searched and none had a counterexample."""
        return all(f.ok for f in self.functions)

    @property
    def found(self) -> bool:
        """Whether some condition had a counterexample."""
        return any(f.failures for f in self.functions)

    @property
    def could_not_run(self) -> bool:
        """Whether some condition was not searched: CrossHair failed on it, or met no precondition."""
        return any(f.not_searched for f in self.functions)


def contract_functions(module_names: Sequence[str] = DEFAULT_MODULES) -> list[Callable[..., object]]:
    """The functions defined in these modules that carry icontract conditions, in source order."""
    found: list[tuple[str, int, Callable[..., object]]] = []
    for module_name in module_names:
        module = importlib.import_module(module_name)
        for member in vars(module).values():
            if not inspect.isfunction(member) or member.__module__ != module.__name__:
                continue
            if getattr(member, "__postconditions__", None) or getattr(member, "__preconditions__", None):
                line = inspect.getsourcelines(inspect.unwrap(member))[1]
                found.append((module_name, line, member))
    order = {m: i for i, m in enumerate(module_names)}
    return [fn for module_name, line, fn in sorted(found, key=lambda t: (order[t[0]], t[1]))]


def check_function(
    fn: Callable[..., object],
    per_condition_timeout: float = 3.0,
    per_path_timeout: float = 1.0,
    *,
    condition: str | None = None,
    stop_at_first: bool = False,
    max_paths: int | None = None,
) -> FunctionReport:
    """Search each postcondition of `fn` with CrossHair, `per_condition_timeout` CPU seconds each.

    Args:
        fn: an icontract-decorated function.
        per_condition_timeout: CrossHair's budget per postcondition.
        per_path_timeout: CrossHair's budget per path.
        condition: search only the postconditions whose source contains this text.
        stop_at_first: end the search at the first counterexample.
        max_paths: also end each postcondition's search after this many paths. A budget in
            paths is the same on every machine (CrossHair's path order is seeded); one in
            seconds is not, so a test that must find something gives both.

    Returns:
        One result per postcondition searched.
    """
    # optional dependency (the proofs extra): CrossHair is imported only when contracts are checked
    from crosshair.core import ConditionCheckable
    from crosshair.core_and_libs import analyze_function, run_checkables
    from crosshair.statespace import MessageType

    _register_inputs()
    results: list[ConditionResult] = []
    for checkable in analyze_function(_function_info(fn), _options(per_condition_timeout, per_path_timeout, max_paths)):
        assert isinstance(checkable, ConditionCheckable), f"{fn.__name__}: {checkable!r} is not a condition"
        source = " ".join(checkable.conditions.post[0].expr_source.split())
        if condition is not None and condition not in source:
            continue
        stats: collections.Counter[str] = collections.Counter()
        checkable.options.stats = stats
        start = time.perf_counter()
        messages = run_checkables([checkable])
        seconds = time.perf_counter() - start
        failed = [m for m in messages if m.state not in (MessageType.CONFIRMED, MessageType.CANNOT_CONFIRM)]
        results.append(
            ConditionResult(
                condition=source,
                status=failed[0].state.name.lower() if failed else NO_COUNTEREXAMPLE,
                exhausted=any(m.state == MessageType.CONFIRMED for m in messages),
                message=failed[0].message if failed else "",
                num_paths=stats["num_paths"],
                seconds=seconds,
            )
        )
        if failed and stop_at_first:
            break
    return FunctionReport(f"{fn.__module__}.{fn.__name__}", tuple(results))


def _options(per_condition_timeout: float, per_path_timeout: float, max_paths: int | None = None) -> Any:
    # optional dependency (the proofs extra): CrossHair is imported only when contracts are checked
    from crosshair.options import AnalysisKind, AnalysisOptionSet

    return AnalysisOptionSet(
        analysis_kind=[AnalysisKind.icontract],
        per_condition_timeout=per_condition_timeout,
        per_path_timeout=per_path_timeout,
        max_iterations=max_paths,
        report_all=True,
    )


def check_modules(
    module_names: Sequence[str] = DEFAULT_MODULES,
    per_condition_timeout: float = 3.0,
    per_path_timeout: float = 1.0,
    only: Sequence[str] = (),
    max_paths: int | None = None,
) -> ContractsReport:
    """CrossHair over every contract-carrying function of `module_names` (or those named in `only`).

    `max_paths` also ends each postcondition's search after that many paths (see check_function).
    """
    # optional dependency (the proofs extra): CrossHair is imported only when contracts are checked
    import crosshair

    start = time.perf_counter()
    reports = []
    for fn in _selected(contract_functions(module_names), only):
        began = time.perf_counter()
        try:
            reports.append(check_function(fn, per_condition_timeout, per_path_timeout, max_paths=max_paths))
        except Exception as e:  # CrossHair or icontract failing on this function: report it, go on
            error = f"{type(e).__name__}: {e}"
            failed = ConditionResult("", ANALYSIS_ERROR, False, error, 0, time.perf_counter() - began)
            reports.append(FunctionReport(f"{fn.__module__}.{fn.__name__}", (failed,)))
    return ContractsReport(
        tuple(reports),
        per_condition_timeout,
        time.perf_counter() - start,
        getattr(crosshair, "__version__", ""),
        max_paths,
    )


def _selected(functions: Sequence[Callable[..., object]], only: Sequence[str]) -> Iterator[Callable[..., object]]:
    for fn in functions:
        if not only or fn.__name__ in only or f"{fn.__module__}.{fn.__name__}" in only:
            yield fn
