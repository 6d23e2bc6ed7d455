"""The conformance state machines: Hypothesis drives the spec and an implementation in lock-step.

Two Hypothesis `RuleBasedStateMachine`s, one per adapter level. Each rule
drives one or two adapter methods (and is named after the one it drives)
through a `LockStep` (kvspec.conformance.core.lockstep), which runs the spec beside
the implementation and checks every call.

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
had all the ones a deep state needs. For the same reason each machine may
start from a pool that has served requests (blocks cached in the free queue):
an example whose subset leaves allocation out still has a cache to act on.
`target()` records how many cached blocks an example evicted or hit again; long campaigns (1,000 examples or more)
hill-climb on it, short ones skip that phase, where it spent the budget on one
example's neighbours.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
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

from kvspec.conformance.core import strategies as strat
from kvspec.conformance.core.adapter import NO_CACHE_SALT, NO_IMAGES, AdapterConfig
from kvspec.conformance.core.lockstep import Factory, LockStep, Observer, StepWatch
from kvspec.conformance.core.operations import HIT_LIMIT, Level, Operation, level_operations
from kvspec.conformance.core.report import render_story
from kvspec.conformance.core.results import Outcome
from kvspec.conformance.core.run_config import AUTO, DRAWN, Configuration, RunConfig, adapter_config
from kvspec.spec import manager as spec_manager
from kvspec.spec.attention import num_skipped_blocks, parse_groups
from kvspec.spec.hashing import DEFAULT_HASH_FN, DEFAULT_SEED
from kvspec.spec.manager import ManagerState, Request
from kvspec.spec.state import NULL_BLOCK_ID, PoolState

__all__ = [
    "ManagerMachine",
    "PoolMachine",
    "conformance_machine",
    "machine_for",
    "table_rule",
]


# --- the machines ---------------------------------------------------------------------------


class _LockStepMachine(RuleBasedStateMachine):
    """What both levels share: one `LockStep` per example, checked after every rule."""

    factory: ClassVar[Factory]
    configuration: ClassVar[Configuration]  # what the campaign checks: the run's record, at one level and mode
    observer: ClassVar[Observer]  # what the campaign reached, across examples
    watch: ClassVar[StepWatch]  # the step time limit, the heartbeat and the step stream

    def __init__(self) -> None:
        super().__init__()
        self.lock: LockStep | None = None

    @property
    def enable_caching(self) -> bool:
        """Prefix caching on or off in this campaign (the configuration's)."""
        return type(self).configuration.enable_caching

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A rule for every operation of the machine's level whose entry says how to draw it and that has no
        hand-written rule of its name (`table_rule`); a machine class built later (`conformance_machine`) also
        gets the operations added to the table since."""
        super().__init_subclass__(**kwargs)
        level = getattr(cls, "table_level", None)
        for operation in level_operations(level) if level is not None else ():
            if operation.draw is not None and not hasattr(cls, operation.name):
                setattr(cls, operation.name, table_rule(operation))

    def _start(self, config: AdapterConfig) -> None:
        cls = type(self)
        self.lock = LockStep(cls.factory, config, cls.observer, cls.watch)

    @property
    def _lock(self) -> LockStep:
        assert self.lock is not None, "a rule ran before the machine was initialized"
        return self.lock

    def _call(self, op: str, *args: Any, mistake: str | None = None, without: Sequence[Any] | None = None) -> Outcome:
        """One adapter call; `mistake`: the caller mistake it makes (a kind the rule drew), None for a valid call;
        `without`: its arguments with the mistake taken out (see `LockStep.call`)."""
        if mistake == VALID:
            return self._lock.call(op, *args)
        return self._lock.call(op, *args, mistake=mistake, without=without)

    def _has(self, op: str) -> bool:
        return self.lock is not None and op in self.lock.capabilities

    def _mistakes(self, op: str, *mistakes: str) -> tuple[str, ...]:
        """The caller mistakes of `op` this adapter is checked on (see `LockStep.exercises`)."""
        return tuple(m for m in mistakes if self._lock.exercises(f"{op}: {m}"))

    def _config(
        self, level: Literal["pool", "manager"], num_gpu_blocks: int, block_size: int = 4, groups: str = "full"
    ) -> AdapterConfig:
        cls = type(self)
        assert level == cls.configuration.level, f"a {level} rule ran in a {cls.configuration.level}-level machine"
        # A factory may name the smallest pool it can build (a vLLM release
        # without a null block cannot build a pool of the null block alone).
        num_gpu_blocks = max(num_gpu_blocks, getattr(cls.factory, "min_num_gpu_blocks", 1))
        # It may name the hash function and seed its implementation hashes with (a vLLM release's own),
        # so that the spec's chain is the one it computes and hash values can be compared exactly.
        hashing = getattr(cls.factory, "spec_hashing", lambda: (DEFAULT_HASH_FN, DEFAULT_SEED))()
        return adapter_config(cls.configuration, num_gpu_blocks, block_size, groups, hashing)

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
        reuse = sum(n for e, n in lock.reached.items() if "evicted" in e or ": hit" in e)
        target(float(reuse), label="cached blocks evicted or hit")


_sampled = strat.sampled
_EVICT_FIRST = (False, True)  # a free's evict_first, where it may be sent one; shrinks to False
_one_of = strat.one_of


def _chunk(num_tokens: int) -> st.SearchStrategy[int]:
    """How many of `num_tokens` pending tokens a step schedules: all (shrinks to this), or a chunk."""
    return _one_of(st.just(num_tokens), st.integers(1, num_tokens))


def table_rule(operation: Operation) -> Any:
    """The machine's rule for an operation whose entry says how to draw it (`Draw`): named after it, run while
    the adapter has it and the entry's guard holds; it draws the kind of call, then the arguments, and calls.

    Raises:
        ValueError: the entry has no `draw`.
    """
    draw, name = operation.draw, operation.name
    if draw is None:
        raise ValueError(f"{name}: the operations table says nothing of how to draw it")

    def guard(self: _LockStepMachine) -> bool:
        return self._has(name) and draw.when(self._lock.spec_state, self.enable_caching)

    def call(self: _LockStepMachine) -> None:
        self._call(name)

    def call_drawn(self: _LockStepMachine, data: st.DataObject) -> None:
        assert draw.args is not None, "a rule with arguments generated for an operation that has none"
        state = self._lock.spec_state
        kind = data.draw(_sampled(_kinds(*self._mistakes(name, *draw.mistakes(state)))), label="call")
        self._call(name, *draw.args(state, kind, data), mistake=kind)

    body: Any = call if draw.args is None else call_drawn
    body.__name__ = body.__qualname__ = name  # Hypothesis orders and switches rules by name
    body.__doc__ = f"{name}, drawn as the operations table says (Draw)."
    decorated = rule()(body) if draw.args is None else rule(data=st.data())(body)
    return precondition(guard)(decorated)


def _is_final_run() -> bool:
    """Whether Hypothesis is replaying the minimal failing example to report it."""
    try:
        return bool(current_build_context().is_final)
    except InvalidArgument:  # not inside a Hypothesis test
        return False


def _with_bad_block(
    ok: list[Any], hashes: list[Any], bad: Any, at: int, kind: str
) -> tuple[list[Any], list[Any], tuple[list[Any], list[Any]]]:
    """cache_full_blocks' blocks and hashes with `bad` at `at`, and the call's good part
    (for "named twice": the first copy of each block, with its hash)."""
    ids, with_hashes = ok[:at] + [bad] + ok[at:], hashes[:at] + [strat.HASH_UNIVERSE[2]] + hashes[at:]
    if kind != "named twice":
        return ids, with_hashes, (ok, hashes)
    first: dict[Any, Any] = {}
    for b, h in zip(ids, with_hashes):
        first.setdefault(b, h)
    return ids, with_hashes, (list(first), list(first.values()))


def _good_part(ids: list[Any], ok: list[Any], kind: str) -> list[Any]:
    """A mistaken list of blocks without its mistake: the first copy of each block for "named twice", else `ok`."""
    return list(dict.fromkeys(ids)) if kind == "named twice" else ok


def _insert(data: st.DataObject, items: list[Any], extra: Any) -> list[Any]:
    """`items` with `extra` at a drawn position (a mistake anywhere in the list, not only first)."""
    at = data.draw(st.integers(0, len(items)), label="position of the mistake")
    return items[:at] + [extra] + items[at:]


VALID = strat.VALID  # the kind of call a rule draws (strategies.kinds)


NEW_PROMPT = "new prompt"
# What an admission sends (ManagerMachine._prompt): a new prompt (a system prompt, then the user's tokens;
# twice as likely, and what a prompt shrinks to), or an earlier prompt again or built on.
PROMPT_KINDS = (
    NEW_PROMPT,
    "the same prompt again",
    "next chat turn",
    NEW_PROMPT,
    "long continuation",
    "same tokens, other keys",
)


_kinds = strat.kinds


class PoolMachine(_LockStepMachine):
    """The BlockPool level: vLLM's pool operations on a tiny pool, as a scheduler would call them.

    Each rule drives the adapter method it is named after, with a valid call
    or with one caller mistake of the kinds the spec rejects for it. The rules
    of operations whose entry says how to draw them (is_block_writable,
    reset_prefix_cache) are generated from the operations table; the others
    are hand-written because they carry more than one call's arguments: they
    feed or consume the bundle of held blocks, chain calls as a scheduler does
    (a lookup then a touch, an allocation then a registration), or send a
    mistaken list with its good part for an implementation that ignores it.
    """

    table_level: ClassVar[Level] = "pool"  # the operations whose rules are generated (table_rule)

    groups = Bundle("groups")  # blocks held together (one simulated request's block table)

    def __init__(self) -> None:
        super().__init__()
        self.live: list[tuple[int, ...]] = []  # the groups in the bundle, for rules that free them all

    def _hold(self, group: tuple[int, ...]) -> tuple[int, ...]:
        self.live.append(group)
        return group

    @initialize(num_gpu_blocks=strat.pool_sizes(), data=st.data())
    def new_pool(self, num_gpu_blocks: int, data: st.DataObject) -> None:
        self._start(self._config("pool", num_gpu_blocks))
        if self.enable_caching:
            self._served_before(data)

    def _served_before(self, data: st.DataObject) -> None:
        """Start from a pool that has served requests: blocks taken, registered and freed, so cached blocks
        wait in the free queue from the first step (none is what this shrinks to).

        Why: Hypothesis turns a random subset of rules off in each example, and
        in an example without get_new_blocks no block is ever cached; touch,
        evict_blocks and the allocation that evicts then have nothing to act
        on, and a short campaign left those branches unreached.
        """
        n = data.draw(st.integers(0, len(self._state.free_queue)), label="blocks cached before the first step")
        if not n:
            return
        self._lock.check()
        blocks = list(self._call("get_new_blocks", n).result or ())
        self._lock.check()
        # Mostly every block registered; none is what this shrinks to, so a failing free needs no registration.
        full = data.draw(_one_of(st.integers(0, len(blocks)), st.just(len(blocks))), label="num_full_blocks")
        if full:
            hashes = data.draw(st.lists(strat.hash_values(), min_size=full, max_size=full), label="block_hashes")
            self._call("cache_full_blocks", blocks[:full], hashes)
            self._lock.check()
        self._call("free_blocks", list(reversed(blocks)))

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
        mistakes = self._mistakes("get_new_blocks", "more than free", "bad count")
        kind = data.draw(_sampled(_kinds(*mistakes)), label="call")
        if kind == VALID:
            # Often more than a tiny pool has, where asking for too many is a mistake the adapter rejects;
            # now and then none at all, a valid call that takes nothing (shrinks toward 1 block).
            most = 4 if "more than free" in mistakes else min(num_free, 4)
            num_blocks: Any = data.draw(_one_of(st.integers(1, most), st.just(0)), label="num_blocks")
        elif kind == "more than free":
            num_blocks = num_free + data.draw(st.integers(1, 3), label="over by")
        else:
            num_blocks = data.draw(strat.bad_counts(), label="num_blocks")
        if kind == VALID and num_blocks > num_free:
            kind = "more than free"
        out = self._call("get_new_blocks", num_blocks, mistake=kind)
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

    @rule(group=consumes(groups), order=_sampled(("tail first", "as allocated")), data=st.data())
    def free_blocks(self, group: tuple[int, ...], order: str, data: st.DataObject) -> None:
        # vLLM frees a request's blocks tail first; any order is legal for the pool.
        self.live.remove(group)
        group = self._still_held(group)
        evict_first = self._releases_cached(group) and data.draw(_sampled(_EVICT_FIRST), label="evict_first")
        self._call("free_blocks", list(reversed(group)) if order == "tail first" else list(group), evict_first)

    def _releases_cached(self, group: tuple[int, ...]) -> bool:
        """Whether a free of `group` may be sent evict_first: the adapter's free_blocks takes it (vLLM 0.34.0
        on), and the free releases a cached block, the blocks it is meant for (their content is in another tier)."""
        s = self._state
        releases = any(s.ref_cnt[b] == 1 and s.block_hash[b] is not None for b in group)
        return releases and self._lock.takes("evict_first")

    def _still_held(self, group: tuple[int, ...]) -> tuple[int, ...]:
        """The blocks of `group` the spec still counts as held: an adapter that ignores a bad
        free (vllm-ascend) frees the call's good part, which may have released a group's block."""
        return tuple(b for b in group if self._state.ref_cnt[b] > 0)

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
        ids = _insert(data, ok, bad)
        self._call("free_blocks", ids, mistake=kind, without=(_good_part(ids, ok, kind),))

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
            self._call("get_cached_block", data.draw(strat.bad_hashes(), label="block_hash"), mistake=kind)
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
        ids = _insert(data, ok, bad)
        self._call("touch", ids, mistake=kind, without=(_good_part(ids, ok, kind),))
        return multiple()

    @precondition(lambda self: self.lock is not None and self.enable_caching)
    @rule(data=st.data())
    def popular_block(self, data: st.DataObject) -> None:
        """A cached free block hit and freed two or three times (a prefix served to request after request), then
        another hit once.

        A keyed policy reads how often and how lately each block was used; one
        touch at a time rarely leaves two free cached blocks whose counts and
        ages disagree: here the popular block has more accesses but the older
        last access, which an LFU order and a recency order rank apart (and a
        hit that forgets to count shows).
        """
        s = self._state
        cached = [b for b in s.free_queue if s.block_hash[b] is not None]
        if not cached:
            return
        popular = data.draw(_sampled(cached), label="popular block")
        others = [b for b in cached if b != popular]
        other = data.draw(_sampled(others), label="hit once") if others else None
        for block in [popular] * data.draw(st.integers(2, 3), label="hits") + ([other] if other is not None else []):
            if self._call("touch", [block]).error is not None:
                return
            self._lock.check()
            if self._call("free_blocks", [block]).error is not None:
                return
            self._lock.check()

    @precondition(lambda self: self.lock is not None and (not self.enable_caching or bool(self._held())))
    @rule(data=st.data())
    def cache_full_blocks(self, data: st.DataObject) -> None:
        """Blocks that filled later (decode) get registered; or one mistake the spec rejects."""
        s = self._state
        if not self.enable_caching:
            self._cache_full_blocks_without_caching(data)
            return
        unhashed, hashed_held = self._held(hashed=False), self._held(hashed=True)
        # Free blocks without a hash: one with a hash is also "already cached", two mistakes in one.
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
            self._call("cache_full_blocks", ok, hashes + [strat.HASH_UNIVERSE[1]], mistake=kind, without=(ok, hashes))
            return
        if kind == "hash not bytes":
            ok = ok or [unhashed[0]]
            hashes = hashes or [strat.HASH_UNIVERSE[0]]
            hashes[data.draw(st.integers(0, len(ok) - 1), label="which hash")] = data.draw(
                strat.bad_hashes(), label="bad hash"
            )
            self._call("cache_full_blocks", ok, hashes, mistake=kind)
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
        ids, with_hashes, good = _with_bad_block(ok, hashes, bad, at, kind)
        self._call("cache_full_blocks", ids, with_hashes, mistake=kind, without=good)

    def _cache_full_blocks_without_caching(self, data: st.DataObject) -> None:
        """Without prefix caching every call is a mistake, even a well-formed one."""
        n = self._state.num_gpu_blocks
        if not self._mistakes("cache_full_blocks", "caching off"):
            return
        # At least one block: an empty call without caching changes nothing in any implementation.
        ids = (
            data.draw(st.lists(st.integers(1, n - 1), min_size=1, max_size=2, unique=True), label="block_ids")
            if n > 1
            else []
        )
        self._call("cache_full_blocks", ids, [strat.HASH_UNIVERSE[0]] * len(ids), mistake="caching off")

    @precondition(lambda self: self._has("evict_blocks"))
    @rule(data=st.data())
    def evict_blocks(self, data: st.DataObject) -> None:
        n = self._state.num_gpu_blocks
        # Plain ids: each class of bad id is a mistake of its own (strategies.PLAIN_ID_MISTAKES).
        mistakes = self._mistakes("evict_blocks", *strat.PLAIN_ID_MISTAKES, *(["named twice"] if n > 1 else []))
        kind = data.draw(_sampled(_kinds(*mistakes)), label="call")
        hashed = self._hashed()
        any_id = st.integers(1, n - 1) if n > 1 else st.nothing()
        ids_strategy = _one_of(_sampled(hashed), any_id) if hashed else any_id
        ids = data.draw(st.lists(ids_strategy, max_size=3, unique=True), label="block_ids") if n > 1 else []
        if kind == VALID:
            # Evicting nothing checks nothing, and a no-op step is what the shrinker leaves behind.
            if ids:
                self._call("evict_blocks", ids)
            return
        if kind == "named twice":
            ids = ids or [1]
            bad: Any = data.draw(_sampled(ids), label="named twice")
        else:
            bad = data.draw(strat.plain_bad_ids(n, kind), label="bad block id")
        with_bad = _insert(data, ids, bad)
        self._call("evict_blocks", with_bad, mistake=kind, without=(_good_part(with_bad, ids, kind),))

    @precondition(lambda self: self._has("reset_prefix_cache") and bool(self.live))
    @rule(data=st.data())
    def reset_prefix_cache_when_idle(self, data: st.DataObject) -> None:
        """Every request finishes, in any order, then the cache is reset (as before a weight update)."""
        for group in data.draw(st.permutations(self.live), label="finishing order"):
            self._call("free_blocks", list(reversed(self._still_held(group))))
            self._lock.check()
        self.live.clear()
        self.bundle("groups").clear()  # all freed: nothing in the bundle is held any more
        self._call("reset_prefix_cache")

    @precondition(lambda self: self._has("get_num_free_blocks") or self._has("get_usage"))
    @rule()
    def get_num_free_blocks(self) -> None:
        """The scheduler's two questions about free space (a miscounted queue shows here first).

        Hand-written, not drawn from the table: the scheduler asks both in one
        step, and as one rule neither is switched off alone by swarm testing
        (a count kept beside the queue is caught by comparing the two).
        """
        if self._has("get_num_free_blocks"):
            self._call("get_num_free_blocks")
        if self._has("get_usage"):
            self._lock.check()
            self._call("get_usage")


@dataclass
class _Running:
    request: Request  # its tokens so far (prompt, then every output token)
    num_computed_tokens: int  # tokens with slots allocated
    loading: bool = False  # an asynchronous external load not yet reported done (cache_blocks)


class ManagerMachine(_LockStepMachine):
    """The KVCacheManager level: requests sharing prefixes, chunked prefill, decode, preemption.

    Every rule is hand-written: each carries a scheduler's logic (a request's
    admission, its steps, its preemption) beyond drawing one call's arguments.
    """

    table_level: ClassVar[Level] = "manager"  # the operations whose rules are generated (table_rule)

    running = Bundle("running")  # ids of running requests
    preempted = Bundle("preempted")  # ids of preempted requests waiting to be re-admitted

    def __init__(self) -> None:
        super().__init__()
        self.block_size = 1
        self.num_groups = 1  # KV cache groups: a hit has this many blocks per position
        self.shared: tuple[tuple[int, ...], ...] = ()
        self.prompts: list[Request] = []  # every prompt sent: system-prompt families and growing chats
        self.requests: dict[str, _Running] = {}
        self.waiting: dict[str, Request] = {}
        self.finished: list[str] = []
        self.num_ids = 0

    @initialize(num_gpu_blocks=strat.manager_pool_sizes(), block_size=strat.block_sizes(), data=st.data())
    def new_manager(self, num_gpu_blocks: int, block_size: int, data: st.DataObject) -> None:
        groups = type(self).configuration.groups
        assert groups != AUTO, "groups 'auto' is resolved per implementation before a campaign runs"
        if groups == DRAWN:
            kinds = type(self).configuration.group_kinds
            groups = data.draw(strat.group_layouts(block_size, kinds), label="KV cache groups")
        elif any(g.kind == "chunked" and g.size % block_size for g in parse_groups(groups)):
            # A chunk must be a multiple of the block size: draw one that divides it.
            block_size = data.draw(strat.block_sizes_for(parse_groups(groups)), label="block_size")
        self.block_size = block_size
        self.num_groups = len(parse_groups(groups))
        self.shared = data.draw(strat.system_prompts(block_size), label="system prompts")
        # Every group takes its own blocks from the one pool: as many requests' worth per group.
        num_gpu_blocks = 1 + (num_gpu_blocks - 1) * self.num_groups
        self._start(self._config("manager", num_gpu_blocks, block_size, groups))
        if self.enable_caching:
            self._served_before(data)

    def _served_before(self, data: st.DataObject) -> None:
        """Start, now and then, from a manager that has served a request: one prompt admitted whole and
        finished, its blocks cached in the free queue, the prompt kept for later ones to repeat or build on
        (none is what this shrinks to).

        Why: a prefix hit needs an earlier request's blocks registered and the
        same prefix sent again; Hypothesis turns a random subset of rules off in
        each example, and a short campaign left the hit's branches (a hit, a
        hit on a free block, the len - 1 cap) unreached.
        """
        if not data.draw(st.booleans(), label="a request served before the first step"):
            return
        self._lock.check()
        request_id = self._admit(replace(self._prompt(data), request_id=self._new_id()), data, whole=True)
        if not isinstance(request_id, str):  # it did not fit: nothing was served
            return
        self._lock.check()
        self._call("free", request_id)
        self._lock.tag("free: request finished")
        del self.requests[request_id]
        self.finished.append(request_id)

    def _new_id(self) -> str:
        self.num_ids += 1
        return f"r{self.num_ids}"

    @property
    def _state(self) -> ManagerState:
        return cast(ManagerState, self._lock.spec_state)

    # --- workload --------------------------------------------------------------------------

    def _sendable(self, request: Request) -> Request:
        """`request` without what the adapter declares it does not have (`not_applicable`): its cache_salt,
        its multimodal inputs, its hit limit."""
        if request.cache_salt is not None and NO_CACHE_SALT in self._lock.not_applicable:
            request = replace(request, cache_salt=None)
        if request.mm_inputs and not self._images:
            request = replace(request, mm_inputs=())
        if request.prefix_cache_hit_limit is not None and not self._hit_limits:
            request = replace(request, prefix_cache_hit_limit=None)
        return request

    @property
    def _hit_limits(self) -> bool:
        """Whether requests may carry a prefix-cache hit limit (and so a bad one, as a mistake)."""
        return HIT_LIMIT.name not in self._lock.not_applicable

    def _request_mistakes(self, op: str) -> tuple[str, ...]:
        """The mistakes in a new request itself (`REQUEST_MISTAKES`) this adapter is checked on for `op`."""
        images = ["misplaced images"] if self._images else []
        limits = ["bad hit limit"] if self._hit_limits else []
        return self._mistakes(op, "no tokens", "no id", *images, *limits)

    def _mistaken(self, kind: str, request: Request, data: st.DataObject) -> Request:
        """A new request with the mistake `kind` made in it (`REQUEST_MISTAKES`), or as it is for another kind."""
        if kind == "no id":
            return replace(request, request_id="")
        if kind == "no tokens":
            return replace(request, token_ids=(), mm_inputs=())
        if kind == "misplaced images":
            images = data.draw(strat.bad_mm_inputs(len(request.token_ids)), label="misplaced images")
            return replace(request, mm_inputs=images)
        if kind == "bad hit limit":
            return replace(request, prefix_cache_hit_limit=data.draw(strat.bad_hit_limits(), label="hit limit"))
        return request

    @property
    def _images(self) -> bool:
        """Whether requests may carry multimodal inputs (and so misplaced ones, as a mistake)."""
        return NO_IMAGES not in self._lock.not_applicable

    def _prompt(self, data: st.DataObject) -> Request:
        """The prompt an admission sends: a new one, or one built on an earlier prompt (see `PROMPT_KINDS`).

        Every prompt is kept, so a chat grows turn by turn. Prompts are drawn
        inside the rules that send them, not made by rules of their own: such
        rules checked nothing, and they were almost half the rules a campaign ran.
        """
        kind = data.draw(_sampled(PROMPT_KINDS), label="prompt") if self.prompts else NEW_PROMPT
        if kind == NEW_PROMPT:
            prompt = self._sendable(data.draw(strat.prompts(self.block_size, self.shared), label="new prompt"))
            if self._hit_limits:  # the request's own bound on its hit (prompt scoring, or none: 0)
                limit = data.draw(strat.hit_limits(len(prompt.token_ids)), label="prefix_cache_hit_limit")
                prompt = replace(prompt, prefix_cache_hit_limit=limit)
        else:
            # The most recent prompt first: it shrinks toward the prompt just made.
            back = data.draw(st.integers(0, len(self.prompts) - 1), label="earlier prompt, counted back")
            earlier = self.prompts[-1 - back]
            if kind == "the same prompt again":
                return earlier
            prompt = self._built_on(kind, earlier, data)
        self.prompts.append(prompt)
        return prompt

    def _built_on(self, kind: str, earlier: Request, data: st.DataObject) -> Request:
        if kind == "next chat turn":
            return strat.continue_chat(earlier, data.draw(strat.chat_turns(self.block_size), label="turn"))
        if kind == "long continuation":
            # More tokens than the whole pool holds (a long document): its admission hits the cached prefix
            # and then runs out of blocks, the failed allocation that must leave no block touched and none
            # taken. Independent prompts are short, so without this that case is rare.
            extra = self._state.pool.num_gpu_blocks * self.block_size
            tail = data.draw(strat.long_tokens(extra, extra + self.block_size), label="long continuation")
            return replace(earlier, token_ids=earlier.token_ids + tail)
        # The same tokens under another cache_salt, LoRA adapter or image: isolation bugs (a chain that
        # leaves out a key) show only then, and independent prompts almost never repeat a whole prefix
        # with only a key changed.
        return self._sendable(data.draw(strat.other_keys(earlier, self.block_size), label="same tokens, other keys"))

    # --- adapter calls ---------------------------------------------------------------------

    @rule(data=st.data())
    def get_computed_blocks(self, data: st.DataObject) -> None:
        prompt = self._prompt(data)
        mistakes = self._request_mistakes("get_computed_blocks") + self._mistakes(
            "get_computed_blocks",
            *(["already running"] if self.requests else []),
            *(["bad hit cap"] if self._lock.takes("max_cache_hit_length") else []),
        )
        kind = data.draw(_sampled(_kinds(*mistakes)), label="call")
        if kind == "already running":
            request = self.requests[data.draw(_sampled(sorted(self.requests)), label="running request")].request
        else:
            request = self._mistaken(kind, replace(prompt, request_id=self._new_id()), data)
        # NOTE: drawn for the request sent, so that no cap is past its last token: vLLM 0.33 uses an explicit
        # cap as given (0.34 bounds it by len - 1), and its chunked-local search then reads past the hashes.
        cap: object = self._hit_cap(request, data)
        if kind == "bad hit cap":
            cap = data.draw(strat.bad_hit_caps(), label="max_cache_hit_length")
        self._call("get_computed_blocks", request, cap, mistake=kind)

    @precondition(lambda self: self._has("get_num_cached_tokens"))
    @rule(data=st.data())
    def get_num_cached_tokens(self, data: st.DataObject) -> None:
        """Probe how much of a request is cached: a new prompt, or a running request (the probe takes nothing)."""
        kind = data.draw(_sampled(_kinds(*self._request_mistakes("get_num_cached_tokens"))), label="call")
        if kind == VALID and self.requests and data.draw(st.booleans(), label="a running request"):
            request = self.requests[data.draw(_sampled(sorted(self.requests)), label="running request")].request
        else:
            request = self._mistaken(kind, replace(self._prompt(data), request_id=self._new_id()), data)
        self._call("get_num_cached_tokens", request, mistake=kind)

    def _hit_cap(self, request: Request, data: st.DataObject) -> int | None:
        """The scheduler's cap on the local hit (an external connector's), where the adapter takes one."""
        if not self._lock.takes("max_cache_hit_length"):
            return None
        return data.draw(strat.hit_caps(len(request.token_ids)), label="max_cache_hit_length")

    def _admit(self, request: Request, data: st.DataObject, whole: bool = False, capped: bool = True) -> Any:
        """The scheduler's admission: look up the prefix hit, then allocate the first chunk (`whole`: all of it;
        `capped`: a cap on the hit may be drawn)."""
        cap = self._hit_cap(request, data) if capped and not whole else None
        hit = self._call("get_computed_blocks", request, cap)
        self._lock.check()
        if hit.error is not None:
            return multiple()
        blocks, num_hit = hit.result
        remaining = len(request.token_ids) - num_hit
        # NOTE: a request with a hit limit reads nothing from an external connector (vLLM 0.34's scheduler:
        # `skip_reading_external_kv`, the connector's hits are not bounded by the limit), so none is drawn.
        limited = request.prefix_cache_hit_limit is not None
        ext = (
            0
            if whole or limited
            else data.draw(strat.external_tokens(remaining - 1), label="num_external_computed_tokens")
        )
        # An asynchronous load: blocks for the external tokens now, no token computed, registered when it is done.
        delayed = (
            ext > 0 and self._lock.takes("delay_cache_blocks") and data.draw(st.booleans(), label="load in background")
        )
        left = remaining - ext
        chunk = 0 if delayed else left if whole else data.draw(_chunk(left), label="num_new_tokens")
        out = self._call("allocate_slots", request, chunk, num_hit, blocks, ext, delayed)
        if out.error is not None or out.result is None:
            return multiple()
        self._lock.tag("allocate_slots: admitted")
        if blocks:
            self._lock.tag("allocate_slots: admitted with a prefix hit")
        if ext:
            self._lock.tag("allocate_slots: external tokens")
        if num_hit + ext + chunk < len(request.token_ids) and not delayed:
            self._lock.tag("allocate_slots: chunked prefill")
        self.requests[request.request_id] = _Running(request, num_hit + ext + chunk, loading=delayed)
        return request.request_id

    @rule(target=running, data=st.data())
    def allocate_slots_admit(self, data: st.DataObject) -> Any:
        prompt = self._prompt(data)
        images = ["misplaced images"] if self._images else []
        limits = ["bad hit limit"] if self._hit_limits else []
        mistakes = ["no id", "no tokens", *images, *limits, "no tokens scheduled", "bad count"]
        mistakes += ["more tokens than the request has", "hit count mismatch"]
        mistakes += ["hit on a running request"] if self.requests else []
        caching = ["wrong hit block", "hit longer than the request"]
        mistakes += caching if self.enable_caching else ["hit without caching"]
        mistakes += ["delay without an external load"] if self._lock.takes("delay_cache_blocks") else []
        kind = data.draw(_sampled(_kinds(*self._mistakes("allocate_slots", *mistakes))), label="call")
        request = replace(prompt, request_id=self._new_id())
        if kind == VALID:
            return self._admit(request, data)
        self._allocate_slots_mistake(kind, request, data)
        return multiple()

    @precondition(lambda self: self.enable_caching and self.lock is not None)
    @rule(target=running, data=st.data())
    def allocate_slots_admit_on_a_full_pool(self, data: st.DataObject) -> Any:
        """Admit a prompt whose prefix is cached in free blocks after a filler took the pool to the edge.

        The edge is where the prompt's new blocks fit but not together with
        the hit blocks that leave the free queue when touched: the capacity
        check must count those hits (vLLM's `num_evictable_computed_blocks`),
        and a random workload reaches that edge rarely.
        """
        prompt = self._prompt(data)
        request = replace(prompt, request_id=self._new_id())
        state = self._state
        hits, _ = spec_manager.get_computed_blocks(state, request).result
        held = [b for b in hits if b != NULL_BLOCK_ID]
        num_evictable = sum(1 for b in held if state.pool.ref_cnt[b] == 0)
        need = -(-len(request.token_ids) // self.block_size) * self.num_groups - len(hits)
        num_filler = len(state.pool.free_queue) - (need + num_evictable - 1)
        if num_evictable == 0 or num_filler < 1:
            return multiple()
        # Tokens nothing cached shares (outside the workload's vocabulary): the filler takes new blocks only.
        filler = Request(self._new_id(), tuple(1000 + i for i in range(num_filler * self.block_size)))
        if not isinstance(self._admit(filler, data, whole=True), str):
            return multiple()
        self._lock.check()
        admitted = self._admit(request, data, capped=False)  # the edge above is the uncapped hit's
        return multiple(filler.request_id, *([admitted] if isinstance(admitted, str) else []))

    def _allocate_slots_mistake(self, kind: str, fresh: Request, data: st.DataObject) -> None:
        bs, n = self.block_size, self._lock.config.num_gpu_blocks

        def call(*args: Any) -> None:
            self._call("allocate_slots", *args, mistake=kind)

        if kind in ("no id", "no tokens", "misplaced images", "bad hit limit"):
            call(self._mistaken(kind, fresh, data), 1, 0, [], 0)
        elif kind == "hit longer than the request":
            # One hit block more than the request has full blocks (any ids: the length is checked first).
            num_hits = len(fresh.token_ids) // bs + 1
            size = num_hits * self.num_groups  # every group's positions
            blocks = data.draw(
                st.lists(st.integers(1, max(n - 1, 1)), min_size=size, max_size=size), label="hit blocks"
            )
            call(fresh, 1, num_hits * bs, blocks, 0)
        elif kind == "no tokens scheduled":
            call(fresh, 0, 0, [], 0)
        elif kind == "delay without an external load":
            call(fresh, 1, 0, [], 0, True)
        elif kind == "bad count":
            args: list[Any] = [fresh, 1, 0, [], 0]
            args[data.draw(_sampled((1, 2, 4)), label="which count")] = data.draw(strat.bad_counts(), label="bad count")
            call(*args)
        elif kind == "more tokens than the request has":
            on_running = data.draw(st.booleans(), label="running request") if self.requests else False
            if on_running:
                run = self.requests[data.draw(_sampled(sorted(self.requests)), label="running request")]
                call(run.request, len(run.request.token_ids) - run.num_computed_tokens + 1, 0, [], 0)
            else:
                call(fresh, len(fresh.token_ids) + 1, 0, [], 0)
        elif kind == "hit count mismatch":
            call(fresh, 1, bs, [], 0)
        elif kind == "hit on a running request":
            rid = data.draw(_sampled(sorted(self.requests)), label="running request")
            block = data.draw(st.integers(1, max(n - 1, 1)), label="hit block")
            call(self.requests[rid].request, 1, bs, [block] * self.num_groups, 0)
        else:
            # One full block and a token after it, so that only the hit block is wrong.
            request = replace(fresh, token_ids=fresh.token_ids + (0,) * max(bs + 1 - len(fresh.token_ids), 0))
            if kind == "hit without caching":
                block = data.draw(st.integers(1, max(n - 1, 1)), label="hit block")
            else:
                chain = spec_manager.request_block_hashes(self._state, request)
                pool = self._state.pool
                # The null block is the right one where every group's window skips the hit's position (a chunk
                # of one block: the hit lies in a chunk the step no longer reads).
                skipped = all(num_skipped_blocks(g, bs, bs) > 0 for g in self._state.config.groups)
                wrong = [
                    b for b in range(-1, n + 1)
                    if not (0 <= b < n and pool.block_hash[b] == chain[0]) and not (skipped and b == NULL_BLOCK_ID)
                ]  # fmt: skip
                block = data.draw(_sampled(wrong), label="hit block")
            call(request, 1, bs, [block] * self.num_groups, 0)  # group 0's is checked first

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

    @precondition(lambda self: self.lock is not None and self._skips_blocks())
    @rule(target=running, data=st.data())
    def allocate_slots_rest_on_a_full_pool(self, data: st.DataObject) -> Any:
        """A new prompt's first chunk past a window, a filler that takes the pool to within a block of empty,
        then the rest of the prompt in one step.

        In a layout whose windows skip tokens (sliding, chunked), a step first
        frees the blocks its request no longer reads and then may still be
        refused for lack of blocks (vLLM's `remove_skipped_blocks` runs before
        the capacity check, and the freed blocks stay freed). That takes a step
        longer than what it frees, on a full pool: a random workload reaches it
        rarely, a chunked-only layout almost never.
        """
        bs = self.block_size
        span = max([bs] + [g.size for g in self._state.config.groups])  # the widest window or chunk
        first = span + data.draw(st.integers(0, bs), label="first chunk past the window")
        rest = span + bs * data.draw(st.integers(1, 3), label="blocks in the rest")
        # Tokens nothing cached shares (its first token is its own): no prefix hit, new blocks only.
        request = Request(self._new_id(), (5000 + self.num_ids,) + tuple(2000 + i for i in range(first + rest - 1)))
        if self._call("get_computed_blocks", request, None).error is not None:
            return multiple()
        self._lock.check()
        out = self._call("allocate_slots", request, first, 0, [], 0)
        if out.error is not None or out.result is None:
            return multiple()
        self._lock.check()
        self.requests[request.request_id] = run = _Running(request, first)
        per_group = (
            len(self._state.pool.free_queue) - data.draw(st.integers(0, 1), label="left free")
        ) // self.num_groups
        filler = None
        if per_group >= 1:
            # Tokens nothing cached shares (outside the workload's vocabulary): the filler takes new blocks only.
            filler = self._admit(
                Request(self._new_id(), tuple(1000 + i for i in range(per_group * bs))), data, whole=True
            )
            self._lock.check()
        out = self._call("allocate_slots", request, rest, 0, [], 0)
        if out.error is None and out.result is not None:
            run.num_computed_tokens += rest
        return multiple(request.request_id, *([filler] if isinstance(filler, str) else []))

    def _skips_blocks(self) -> bool:
        """Whether the manager's layout has a group whose window skips tokens (sliding window, chunked local)."""
        return any(g.kind != "full" for g in self._state.config.groups)

    @rule(target=running, data=st.data())
    def prefill_in_chunks(self, data: st.DataObject) -> Any:
        """A new request prefilled in two to four equal chunks, then one decode step.

        Each chunk moves a sliding window or a chunk boundary past several
        blocks at once, so the next step frees several in one call (their
        order is then the free order); one token at a time frees one.
        """
        prompt = self._prompt(data)
        request = replace(prompt, request_id=self._new_id())
        hit = self._call("get_computed_blocks", request, None)
        self._lock.check()
        if hit.error is not None:
            return multiple()
        blocks, num_hit = hit.result
        left = len(request.token_ids) - num_hit
        size = -(-left // data.draw(st.integers(2, 4), label="chunks"))
        out = self._call("allocate_slots", request, size, num_hit, blocks, 0)
        if out.error is not None or out.result is None:
            return multiple()
        self._lock.tag("allocate_slots: admitted")
        self.requests[request.request_id] = run = _Running(request, num_hit + size)
        while run.num_computed_tokens < len(request.token_ids):
            self._lock.check()
            num = min(size, len(request.token_ids) - run.num_computed_tokens)
            out = self._call("allocate_slots", request, num, 0, [], 0)
            if out.error is not None or out.result is None:
                return request.request_id
            self._lock.tag("allocate_slots: chunked prefill")
            run.num_computed_tokens += num
        self._lock.check()
        run.request = strat.continue_chat(request, (0,))
        if self._call("allocate_slots", run.request, 1, 0, [], 0).result is not None:
            self._lock.tag("allocate_slots: decode")
            run.num_computed_tokens += 1
        return request.request_id

    @rule(request_id=running, data=st.data())
    def decode_run(self, request_id: str, data: st.DataObject) -> None:
        """A running request finishes its prompt, then decodes token after token, each a step of its own.

        Long runs are where a sliding window or a chunk moves past block after
        block (each step frees the blocks the window left); independent decode
        rules rarely string enough steps together. Up to 4 x max(block_size, 8)
        + 2 steps, so a run moves past several blocks at any block size; one
        draw for the run's tokens: the output tokens follow from its first.
        """
        run = self.requests[request_id]
        num_steps = data.draw(st.integers(2, 4 * max(self.block_size, 8) + 2), label="decode steps")
        first = data.draw(st.integers(0, strat.VOCABULARY_SIZE - 1), label="first output token")
        for k in range(num_steps):
            if not self._advance(run, (first + k) % strat.VOCABULARY_SIZE):
                return

    @precondition(lambda self: bool(self.requests))
    @rule()
    def schedule_running(self) -> None:
        """One engine step: every running request advances, in admission order, by the rest of its
        prompt or one decoded token; the step ends at the first allocation that fails (where the
        scheduler would preempt).

        Serving engines advance all their requests each step, so the requests'
        blocks interleave in the pool and one request's window frees blocks
        between another's allocations; rules that move one request at a time
        rarely interleave them. Nothing is drawn (a decoded token follows from
        the request's length), so the campaign checks several steps per rule
        it draws. A request waiting for an external load is not scheduled.
        """
        for run in list(self.requests.values()):
            if not run.loading and not self._advance(run, len(run.request.token_ids) % strat.VOCABULARY_SIZE):
                return

    def _advance(self, run: _Running, token: int) -> bool:
        """One step of a running request: the rest of its prompt, or else `token` decoded; whether it fit."""
        remaining = len(run.request.token_ids) - run.num_computed_tokens
        decode = remaining == 0
        if decode:
            run.request, remaining = strat.continue_chat(run.request, (token,)), 1
        out = self._call("allocate_slots", run.request, remaining, 0, [], 0)
        if out.error is not None or out.result is None:
            return False
        if decode:
            self._lock.tag("allocate_slots: decode")
        run.num_computed_tokens += remaining
        self._lock.check()
        return True

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
        # The scheduler counts the preemption: the re-admission's hits are counted apart (spec.stats).
        request = self.requests.pop(request_id).request
        self.waiting[request_id] = replace(request, num_preemptions=request.num_preemptions + 1)
        return request_id

    @rule(target=running, request_id=consumes(preempted), data=st.data())
    def allocate_slots_readmit(self, request_id: str, data: st.DataObject) -> Any:
        result = self._admit(self.waiting.pop(request_id), data)
        if isinstance(result, str):
            self._lock.tag("readmitted after preemption")
        return result

    # Only while a request runs: the connector reports the blocks of a load it was doing for one. Enabled
    # whenever anything is cached, the rule evicted so often that prefix hits became rare.
    @precondition(
        lambda self: (
            self._has("evict_blocks")
            and bool(self.requests)
            and (not self.enable_caching or bool(self._state.pool.hash_to_blocks))
        )
    )
    @rule(data=st.data())
    def evict_blocks(self, data: st.DataObject) -> None:
        """The connector reports blocks whose external load failed: their hashes go, held or free.

        Mostly cached blocks of a running request's table, so its next
        registration names a parent that is gone and the next lookup meets a
        hole in the chain.
        """
        n = self._state.pool.num_gpu_blocks
        mistakes = self._mistakes("evict_blocks", *strat.PLAIN_ID_MISTAKES, "named twice")
        kind = data.draw(_sampled(_kinds(*mistakes)), label="call")
        held = {b for _, e in self._state.requests for t in e.tables for b in t if b != NULL_BLOCK_ID}
        hashed = [b for b, h in enumerate(self._state.pool.block_hash) if h is not None and b in held] or [
            b for b, h in enumerate(self._state.pool.block_hash) if h is not None
        ]
        any_id = st.integers(1, n - 1)
        ids_strategy = _one_of(_sampled(hashed), any_id) if hashed else any_id
        ids = data.draw(st.lists(ids_strategy, min_size=1, max_size=3, unique=True), label="block_ids")
        if kind == VALID:
            self._call("evict_blocks", ids)
            return
        bad: Any = (
            data.draw(_sampled(ids), label="named twice")
            if kind == "named twice"
            else data.draw(strat.plain_bad_ids(n, kind), label="bad block id")
        )
        with_bad = _insert(data, ids, bad)
        self._call("evict_blocks", with_bad, mistake=kind, without=(_good_part(with_bad, ids, kind),))

    @precondition(lambda self: self._has("cache_blocks") and any(r.loading for r in self.requests.values()))
    @rule(data=st.data())
    def cache_blocks(self, data: st.DataObject) -> None:
        """An asynchronous load is done: its blocks are registered; one that failed partway keeps fewer tokens."""
        rid = data.draw(_sampled(sorted(r for r, run in self.requests.items() if run.loading)), label="loaded request")
        mistakes = self._mistakes("cache_blocks", "not running", "tokens out of range")
        kind = data.draw(_sampled(_kinds(*mistakes)), label="call")
        run = self.requests[rid]
        registered = max(self._state.request(rid).num_cached_blocks, default=0) * self.block_size  # type: ignore[union-attr]
        if kind == "not running":
            self._call("cache_blocks", replace(run.request, request_id=self._new_id()), 0, mistake=kind)
            return
        if kind == "tokens out of range":
            self._call("cache_blocks", run.request, run.num_computed_tokens + 1, mistake=kind)
            return
        # Mostly the whole load; else it failed partway and the tokens after the valid prefix are computed again.
        valid = data.draw(_one_of(st.just(run.num_computed_tokens), st.integers(registered, run.num_computed_tokens)),
                          label="tokens loaded")  # fmt: skip
        out = self._call("cache_blocks", run.request, valid)
        if out.error is None:
            run.num_computed_tokens, run.loading = valid, False

    # A reset of an empty cache changes nothing whatever the answer; without caching, only the refusal
    # while requests run (or every one finishing first) is worth a step.
    @precondition(
        lambda self: (
            self._has("reset_prefix_cache")
            and (bool(self._state.pool.hash_to_blocks) if self.enable_caching else bool(self.requests))
        )
    )
    @rule(data=st.data())
    def reset_prefix_cache(self, data: st.DataObject) -> None:
        """A reset (as before a weight update): refused while requests run, unless every one finishes first."""
        finish = bool(self.requests) and data.draw(st.booleans(), label="finish every request first")
        if finish:
            for request_id in data.draw(st.permutations(sorted(self.requests)), label="finishing order"):
                self._call("free", request_id)
                self._lock.check()
                del self.requests[request_id]
                self.finished.append(request_id)
            self.bundle("running").clear()
        self._call("reset_prefix_cache")

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
        self._call("free", data.draw(_sampled(ids), label="request_id"), mistake="not running")


def conformance_machine(
    factory: Factory,
    level: str = "pool",
    enable_caching: bool = True,
    profile: str = "vllm-v1",
    observer: Observer | None = None,
    device: str | None = None,
    watch: StepWatch | None = None,
    groups: str = "full",
    events: bool = False,
) -> type[_LockStepMachine]:
    """A state machine class that checks `factory`'s adapters against the spec.

    Its `.TestCase` is an ordinary Hypothesis stateful test, usable directly
    in a test suite or under a fuzzing engine (HypoFuzz). The settings are the
    `RunConfig` fields of the same meaning: `device` becomes every
    `AdapterConfig.device` (None: the adapter picks); `groups` the KV cache
    groups of every manager built ("full,sliding:8"), or "drawn" for a layout
    drawn per example; `events` checks the KV cache events every call
    publishes and, at the request level, the hit statistics. `observer` adds
    up what the campaign reached, `watch` times the implementation's calls (a
    fresh one of each when not given).

    Raises:
        ValueError: a setting `RunConfig` refuses (a level other than "pool" or "manager", a groups text that
            names no layout): its `ConfigError`.
    """
    run = RunConfig(
        levels=(level,),  # type: ignore[arg-type]  # checked by RunConfig
        caching=(enable_caching,),
        profile=profile,
        device=device,
        groups=groups,
        events=events,
    )
    (configuration,) = run.configurations()
    return machine_for(factory, configuration, observer, watch)


def machine_for(
    factory: Factory, configuration: Configuration, observer: Observer | None = None, watch: StepWatch | None = None
) -> type[_LockStepMachine]:
    """The state machine class of one configuration (`conformance_machine`, from the run's record)."""
    base: type[_LockStepMachine] = PoolMachine if configuration.level == "pool" else ManagerMachine
    name = f"{base.__name__}_{'caching' if configuration.enable_caching else 'no_caching'}"
    attrs = {
        "factory": staticmethod(factory),
        "configuration": configuration,
        "observer": observer if observer is not None else Observer(),
        "watch": watch if watch is not None else StepWatch(),
        "__module__": __name__,
    }
    return type(name, (base,), attrs)
