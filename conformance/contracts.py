"""CrossHair over the spec's contracts: each function searched for a counterexample, in a budget.

CrossHair runs a function on symbolic arguments and looks for a path where a
precondition holds but a postcondition fails, or where it raises an error its
docstring does not declare (`raises:`; a declared error is a caller mistake
rejected on purpose). Finding none within the time budget is reported as
exactly that, "no counterexample found within budget": a search, not a proof.

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

import importlib
import inspect
import random
import time
import types
import typing
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvspec.spec import manager as spec_manager
from kvspec.spec import ops as spec_ops
from kvspec.spec.errors import BlockManagerError
from kvspec.spec.ordering import PROFILES
from kvspec.spec.state import BlockHash, BlockId, PoolState

__all__ = [
    "DEFAULT_MODULES",
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


# --- the state corpora ----------------------------------------------------------------------------


def _random_pool_call(rng: random.Random, st: PoolState) -> PoolState:
    n = st.num_gpu_blocks
    op = rng.choice(("get_new_blocks", "touch", "free_blocks", "cache_full_blocks", "evict_blocks", "reset"))
    ids = [BlockId(b) for b in rng.sample(range(1, max(n, 2)), min(rng.randint(0, 3), max(n - 1, 0)))]
    try:
        if op == "get_new_blocks":
            return spec_ops.get_new_blocks(st, rng.randint(0, len(st.free_queue)))[0]
        if op == "touch":
            return spec_ops.touch(st, ids)
        if op == "free_blocks":
            return spec_ops.free_blocks(st, ids)
        if op == "evict_blocks":
            return spec_ops.evict_blocks(st, ids)
        if op == "cache_full_blocks":
            return spec_ops.cache_full_blocks(st, ids, [BlockHash(b"h%d" % rng.randint(1, 2)) for _ in ids])
        return spec_ops.reset_prefix_cache(st)[0]
    except BlockManagerError:
        return st  # a rejected call changes nothing


def pool_state_corpus(size: int = 48, max_blocks: int = 5, seed: int = 0) -> tuple[PoolState, ...]:
    """Distinct reachable pool states of at most `max_blocks` blocks, fresh pools first."""
    rng = random.Random(seed)
    states: dict[object, PoolState] = {}
    for n in range(1, max_blocks + 1):
        for profile in PROFILES:
            fresh = spec_ops.new_pool(n, True, profile)
            states.setdefault(fresh.snapshot(), fresh)
    while len(states) < size:
        st = spec_ops.new_pool(rng.randint(1, max_blocks), rng.random() < 0.85, rng.choice(list(PROFILES)))
        for _ in range(rng.randint(1, 10)):
            st = _random_pool_call(rng, st)
        states.setdefault(st.snapshot(), st)
    return tuple(states.values())


def manager_state_corpus(size: int = 24, seed: int = 0) -> tuple[spec_manager.ManagerState, ...]:
    """Distinct reachable manager states: requests sharing prefixes, running, finished, preempted."""
    rng = random.Random(seed)
    states: dict[object, spec_manager.ManagerState] = {}
    prompts = [(1, 2, 3, 4, 5), (1, 2, 3, 4, 9, 9), (7, 7), (1, 2)]
    attempts = 0
    while len(states) < size and attempts < 50 * size:
        attempts += 1
        state = spec_manager.new_manager(
            rng.randint(2, 8), rng.randint(1, 3), rng.random() < 0.85, rng.choice(list(PROFILES))
        )
        running: list[str] = []
        for step in range(rng.randint(0, 4)):
            if running and rng.random() < 0.35:
                state = spec_manager.free(state, running.pop(rng.randrange(len(running))))
                continue
            request = spec_manager.Request(f"r{step}", rng.choice(prompts))
            hit, num_hit = spec_manager.get_computed_blocks(state, request)
            num_new = len(request.token_ids) - num_hit
            state, blocks = spec_manager.allocate_slots(state, request, num_new, num_hit, hit)
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
    import cbor2
    from crosshair.core import SymbolicFactory, register_patch, register_type, with_realized_args
    from crosshair.tracers import ResumedTracing
    from crosshair.util import IgnoreAttempt

    register_patch(cbor2.dumps, with_realized_args(cbor2.dumps, deep=True))

    pools = pool_state_corpus()
    managers = manager_state_corpus()

    def from_corpus(corpus: Sequence[T], name: str) -> Callable[[SymbolicFactory], T]:
        def create(p: SymbolicFactory) -> T:
            with ResumedTracing():
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
        return typing.Union[erased]
    try:
        return annotation.copy_with(erased)
    except AttributeError:
        return origin[erased]


def _function_info(fn: Callable[..., object]) -> Any:
    """CrossHair's FunctionInfo for `fn`, with NewTypes erased from its signature."""
    from crosshair.fnutil import FunctionInfo

    class RuntimeTypedFunction(FunctionInfo):  # type: ignore[misc]
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
    """One postcondition (or an undeclared error) of one function."""

    condition: str  # the condition's source text ("" for the function body)
    status: str  # "no counterexample found within budget", or CrossHair's failure kind
    exhausted: bool  # every path of the generated inputs was explored
    message: str  # the counterexample, as CrossHair prints it ("" when none)
    line: int  # where CrossHair points


@dataclass(frozen=True)
class FunctionReport:
    """What CrossHair found for one function."""

    name: str  # module.function
    num_conditions: int  # postconditions searched
    seconds: float  # wall time
    failures: tuple[ConditionResult, ...]  # counterexamples; empty when none was found
    exhausted: bool  # every condition's search ran out of paths before the budget

    @property
    def ok(self) -> bool:
        """Whether no counterexample was found."""
        return not self.failures

    @property
    def summary(self) -> str:
        """One line: the finding, never "verified"."""
        if self.failures:
            first = self.failures[0]
            return f"counterexample ({first.status}): {first.message}"
        return NO_COUNTEREXAMPLE + (" (every generated path explored)" if self.exhausted else "")


@dataclass(frozen=True)
class ContractsReport:
    """Every function CrossHair searched."""

    functions: tuple[FunctionReport, ...]
    per_condition_timeout: float
    seconds: float
    crosshair_version: str = field(default="")

    @property
    def ok(self) -> bool:
        """Whether no function had a counterexample."""
        return all(f.ok for f in self.functions)


def contract_functions(module_names: Sequence[str] = DEFAULT_MODULES) -> list[Callable[..., object]]:
    """The functions defined in these modules that carry icontract conditions, in source order."""
    found: list[tuple[str, int, Callable[..., object]]] = []
    for module_name in module_names:
        module = importlib.import_module(module_name)
        for name, member in vars(module).items():
            if not inspect.isfunction(member) or member.__module__ != module.__name__:
                continue
            if getattr(member, "__postconditions__", None) or getattr(member, "__preconditions__", None):
                line = inspect.getsourcelines(inspect.unwrap(member))[1]
                found.append((module_name, line, member))
    order = {m: i for i, m in enumerate(module_names)}
    return [fn for module_name, line, fn in sorted(found, key=lambda t: (order[t[0]], t[1]))]


def _failure_kinds() -> set[Any]:
    from crosshair.statespace import MessageType

    return {MessageType.PRE_UNSAT, MessageType.POST_ERR, MessageType.EXEC_ERR, MessageType.POST_FAIL,
            MessageType.SYNTAX_ERR, MessageType.IMPORT_ERR}


def check_function(
    fn: Callable[..., object], per_condition_timeout: float = 4.0, per_path_timeout: float = 2.0
) -> FunctionReport:
    """Search every postcondition of `fn` with CrossHair for at most `per_condition_timeout` seconds each."""
    from crosshair.core_and_libs import analyze_function, run_checkables
    from crosshair.options import AnalysisKind, AnalysisOptionSet
    from crosshair.statespace import MessageType

    _register_inputs()
    options = AnalysisOptionSet(
        analysis_kind=[AnalysisKind.icontract],
        per_condition_timeout=per_condition_timeout,
        per_path_timeout=per_path_timeout,
        report_all=True,
    )
    start = time.perf_counter()
    checkables = analyze_function(_function_info(fn), options)
    messages = run_checkables(checkables)
    failures = tuple(
        ConditionResult(
            condition="",
            status=m.state.name.lower(),
            exhausted=False,
            message=m.message,
            line=m.line,
        )
        for m in messages
        if m.state in _failure_kinds()
    )
    exhausted = bool(checkables) and all(m.state == MessageType.CONFIRMED for m in messages)
    name = f"{fn.__module__}.{fn.__name__}"
    return FunctionReport(name, len(checkables), time.perf_counter() - start, failures, exhausted and not failures)


def check_modules(
    module_names: Sequence[str] = DEFAULT_MODULES,
    per_condition_timeout: float = 4.0,
    per_path_timeout: float = 2.0,
    only: Sequence[str] = (),
) -> ContractsReport:
    """CrossHair over every contract-carrying function of `module_names` (or those named in `only`)."""
    import crosshair

    start = time.perf_counter()
    reports = []
    for fn in _selected(contract_functions(module_names), only):
        reports.append(check_function(fn, per_condition_timeout, per_path_timeout))
    return ContractsReport(
        tuple(reports), per_condition_timeout, time.perf_counter() - start, getattr(crosshair, "__version__", "")
    )


def _selected(functions: Sequence[Callable[..., object]], only: Sequence[str]) -> Iterator[Callable[..., object]]:
    for fn in functions:
        if not only or fn.__name__ in only or f"{fn.__module__}.{fn.__name__}" in only:
            yield fn
