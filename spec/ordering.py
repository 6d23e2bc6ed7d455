"""The eviction order: where freed blocks go, and the key encoding of the queue.

Design choice: the free queue is the eviction order (vLLM v1). There are no
timestamps; a block's position says when it will be reused. A block whose
ref_cnt drops to 0 goes to the *left* end when it has no hash (nobody can hit
it, so reuse it first) and to the *right* end when it has one (keep it as long
as possible: LRU). The rejected alternative is seed 002's timestamp LRU (vLLM
v0's evictor), which needs a scan or a heap at eviction time; it survives here
only as a profile name.

Profiles name rule sets. `vllm-v1` is seed 000's rule; `vllm-v1-tail` sends
every freed block to the right end, as earlier vLLM v1 releases did.

The predicates take a logic backend so that one body runs concretely (`PY`) and
symbolically (`Z3`, built in `spec.lemmas`): inside them there is no Python
`and`/`or`/`if` on values and no tuple comparison, only the backend's
`and_`, `or_`, `not_`, `implies`, `ite` and `lex_lt`.

The key encoding (lemma 6, used by gpu_impl): every free block carries an
integer key and the queue is the blocks in ascending key order. The pool keeps
two counters, `lo` (at most the smallest key ever given) and `hi` (at least
the largest). A batch of k blocks sent left gets keys `lo - k + i` (i = 0..k-1,
so it keeps its order and sits below everything); a batch sent right gets
`hi + 1 + i`. Taking n blocks is selecting the n smallest keys.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from kvspec.spec.state import BlockHash, BlockId

__all__ = [
    "DEFAULT_PROFILE",
    "PROFILES",
    "PY",
    "Backend",
    "ProfileRule",
    "freed_goes_left",
    "left_batch_key",
    "place_freed",
    "profile_rule",
    "right_batch_key",
]

T = TypeVar("T")  # a boolean of the backend: bool, or a z3 BoolRef


@dataclass(frozen=True, slots=True)
class Backend(Generic[T]):
    """The few logical connectives the ordering predicates may use."""

    and_: Callable[..., T]  # conjunction of any number of booleans
    or_: Callable[..., T]  # disjunction of any number of booleans
    not_: Callable[[T], T]  # negation
    implies: Callable[[T, T], T]  # material implication
    ite: Callable[[T, object, object], object]  # if-then-else on values
    lex_lt: Callable[[Sequence[object], Sequence[object]], T]  # strict lexicographic <


def _py_lex_lt(a: Sequence[object], b: Sequence[object]) -> bool:
    for x, y in zip(a, b):
        if x != y:
            return x < y  # type: ignore[operator,no-any-return]
    return len(a) < len(b)


PY: Backend[bool] = Backend(
    and_=lambda *xs: all(xs),
    or_=lambda *xs: any(xs),
    not_=lambda x: not x,
    implies=lambda a, b: (not a) or b,
    ite=lambda c, a, b: a if c else b,
    lex_lt=_py_lex_lt,
)


@dataclass(frozen=True, slots=True)
class ProfileRule:
    """One ordering rule set: where a block goes when its ref_cnt drops to 0."""

    name: str  # the profile's name, as implementations declare it
    unhashed_to_left: bool  # True: blocks without a hash go to the left end
    summary: str  # one sentence for reports


PROFILES: Mapping[str, ProfileRule] = {
    "vllm-v1": ProfileRule(
        "vllm-v1",
        unhashed_to_left=True,
        summary="freed tail-first; blocks without a hash go to the left end, hashed ones right",
    ),
    "vllm-v1-tail": ProfileRule(
        "vllm-v1-tail",
        unhashed_to_left=False,
        summary="freed tail-first; every freed block goes to the right end",
    ),
}
DEFAULT_PROFILE = "vllm-v1"


def profile_rule(name: str) -> ProfileRule:
    """The rule of the profile called `name`.

    Raises:
        ValueError: `name` is not a known profile.

    >>> profile_rule("vllm-v1").unhashed_to_left
    True
    """
    try:
        return PROFILES[name]
    except KeyError:
        known = ", ".join(sorted(PROFILES))
        raise ValueError(f"unknown profile={name!r}; known profiles: {known}") from None


def freed_goes_left(unhashed_to_left: T, has_hash: T, logic: Backend[T]) -> T:
    """Whether a block whose ref_cnt just dropped to 0 goes to the left end.

    >>> freed_goes_left(True, False, PY), freed_goes_left(True, True, PY)
    (True, False)
    >>> freed_goes_left(False, False, PY)
    False
    """
    return logic.and_(unhashed_to_left, logic.not_(has_hash))


def left_batch_key(lo: int, batch_len: int, index: int) -> int:
    """The key of the index-th block of a batch of `batch_len` sent to the left end.

    >>> [left_batch_key(1, 3, i) for i in range(3)]
    [-2, -1, 0]
    """
    return lo - batch_len + index


def right_batch_key(hi: int, index: int) -> int:
    """The key of the index-th block of a batch sent to the right end.

    >>> [right_batch_key(6, i) for i in range(2)]
    [7, 8]
    """
    return hi + 1 + index


def place_freed(
    free_queue: tuple[BlockId, ...],
    newly_free: Sequence[BlockId],
    block_hash: Sequence[BlockHash | None],
    rule: ProfileRule,
) -> tuple[BlockId, ...]:
    """The free queue after `newly_free` (in the order they were freed) join it.

    Blocks sent left keep their given order and sit before every block already
    free; blocks sent right keep their order and sit after every block.

    >>> h = [None, b"x", None, None]
    >>> place_freed((BlockId(9),), [BlockId(3), BlockId(1), BlockId(2)], h, PROFILES["vllm-v1"])
    (3, 2, 9, 1)
    """
    left = tuple(
        b for b in newly_free if freed_goes_left(rule.unhashed_to_left, block_hash[b] is not None, PY)
    )
    right = tuple(b for b in newly_free if b not in left)
    return left + free_queue + right
