"""The eviction order: a policy orders the free (ref_cnt 0) blocks, and the key encoding of the queue.

The free queue is the eviction order: `get_new_blocks` takes its left end.
A profile names the policy that orders it, of one of two kinds.

Queue policies (vLLM v1, seed 000): there are no timestamps; a block's
position in the queue is its key. A block whose ref_cnt drops to 0 goes to the
*left* end when it has no hash (nobody can hit it, so reuse it first) and to
the *right* end when it has one (keep it as long as possible: LRU).
`vllm-v1` is seed 000's rule; `vllm-v1-tail` sends every freed block to the
right end, as earlier vLLM v1 releases did. A free called with `evict_first`
(vLLM 0.34.0 on: the blocks' content lives in another tier too) sends every
block it frees to the left end under either, hashed or not: it is evicted
before every other cached block.

Keyed policies (seed 002; `lru-timestamp` orders cached blocks as vLLM v0's
`LRUEvictor` does): every block carries metadata stamped by a logical clock,
never the wall clock (`spec.state.BlockStamps`), and the queue is derived
from it: the free blocks without a hash first, lowest id first (seed 002's
first fit: no cached content is lost while such a block exists; v0 itself
reuses them last freed first, as the v0 oracle measures), then the
free blocks with a hash in ascending `eviction_key` order. The clock advances
by one per block stamped, in the order a call names the blocks, so every
stamp is unique: an allocation and a hit (`touch`) stamp `last_access` and
count an access; a `free_blocks` stamps `last_access` too (the freeing
request's last step read every block it held; blocks named tail first, so a
request's deeper block gets the older stamp and goes first, what v0's
"more hashed tokens first" tie-break buys); `cache_full_blocks` stamps
`registered_at`. The keys:

| profile | key (smallest evicted first) |
|---|---|
| `lru-timestamp` | last access |
| `block-age` | registration time: the oldest content goes, the newest is kept |
| `lfu` | number of accesses (allocation and hits), ties by last access |
| `lru-lfu:W` | `last_access + W * accesses`, ties by last access |

In `lru-lfu:W` an access is worth W ticks of recency: W = 0 is
`lru-timestamp`, and as W grows the order tends to `lfu`'s. Every key opens
with a tier, `is_evict_first`, stamped by each free on the blocks it names:
a block last freed with `evict_first` sorts before every hashed block freed
without it (and after the first-fit blocks, which hold no cached content),
its own key ordering it among its peers.

The predicates take a logic backend so that one body runs concretely (`PY`) and
symbolically (`Z3`, built in `spec.lemmas`): inside them there is no Python
`and`/`or`/`if` on values and no tuple comparison, only the backend's
`and_`, `or_`, `not_`, `implies`, `ite` and `lex_lt`.

The key encoding (lemma 6, used by gpu_impl): every free block carries an
integer key and the queue is the blocks in ascending key order. The pool keeps
two counters, `lo` (at most the smallest key ever given) and `hi` (at least
the largest). A batch of k blocks sent left gets keys `lo - k + i` (i = 0..k-1,
so it keeps its order and sits below everything); a batch sent right gets
`hi + 1 + i`. Taking n blocks is selecting the n smallest keys. A fresh pool
gives block b the key `initial_free_key(b)`, with `lo = 1` and `hi = n - 1`.

The hit cap is arithmetic written the same way: `max_hit_blocks_rule` states
`max_hit_blocks == (num_tokens - 1) // block_size` by the division rule
(`block_size * q <= num_tokens - 1 < block_size * (q + 1)`), which z3 reasons
about where it cannot reason about `//` on two unknowns; `num_hit_tokens` is
what a request reuses, and `hit_tokens_within_cap` the rule it must obey.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Generic, TypeVar, cast

import icontract

from kvspec.spec.state import BlockHash, BlockId

__all__ = [
    "DEFAULT_PROFILE",
    "PROFILES",
    "PY",
    "QUEUE_PROFILES",
    "Backend",
    "ProfileRule",
    "eviction_key",
    "is_profile",
    "known_profiles",
    "keyed_free_order",
    "keyed_rank",
    "freed_goes_left",
    "freed_in_place",
    "hit_tokens_within_cap",
    "in_keyed_order",
    "initial_free_key",
    "initial_key_counters",
    "left_batch_key",
    "max_hit_blocks_rule",
    "num_hit_tokens",
    "place_freed",
    "profile_rule",
    "right_batch_key",
]

T = TypeVar("T")  # a boolean of the backend: bool, or a z3 BoolRef
N = TypeVar("N")  # an integer of the backend: int, or a z3 ArithRef


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
    """One eviction policy: the queue's own order (vLLM v1), or a key per block (seed 002)."""

    name: str  # the profile's name, as implementations declare it
    unhashed_to_left: bool  # queue policies: True sends freed blocks without a hash to the left end
    summary: str  # one sentence for reports
    key: str = "position"  # "position" (the queue's order), or the keyed policy: see KEYS
    weight: Fraction = Fraction(0)  # lru-lfu's W: the ticks of recency one access is worth

    @property
    def keyed(self) -> bool:
        """Whether the free blocks are ordered by a key per block (first fit, then the key)."""
        return self.key != "position"


KEYS = ("last-access", "registered", "accesses", "recency-frequency")
LRU_LFU = "lru-lfu"  # the prefix of the weighted profiles, `lru-lfu:W`

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
    "lru-timestamp": ProfileRule(
        "lru-timestamp",
        unhashed_to_left=True,
        summary="first fit, then the oldest last access is evicted first (seed 002; vLLM v0's LRUEvictor)",
        key="last-access",
    ),
    "block-age": ProfileRule(
        "block-age",
        unhashed_to_left=True,
        summary="first fit, then the oldest registered content is evicted first, the newest kept (seed 002)",
        key="registered",
    ),
    "lfu": ProfileRule(
        "lfu",
        unhashed_to_left=True,
        summary="first fit, then the fewest accesses is evicted first, ties by last access (seed 002)",
        key="accesses",
    ),
}
DEFAULT_PROFILE = "vllm-v1"
QUEUE_PROFILES = tuple(name for name, rule in PROFILES.items() if not rule.keyed)  # vLLM v1's


def _lru_lfu(name: str) -> ProfileRule:
    """The rule of `lru-lfu:W`, W a non-negative number written in decimal (`0.5`, `64`)."""
    text = name[len(LRU_LFU) + 1 :]
    whole, _, frac = text.partition(".")
    # Parsed by hand, not by Fraction(str): ASCII digits only (str.isdigit() takes other
    # scripts' digits), and no regular expression, which CrossHair cannot follow symbolically.
    if not whole + frac or not all(c in "0123456789" for c in whole + frac):
        raise ValueError(
            f"unknown profile={name!r}: {LRU_LFU}:W takes a non-negative decimal weight W, e.g. {LRU_LFU}:0.5"
        )
    scale = 10 ** len(frac)
    weight = Fraction(int(whole or "0") * scale + int(frac or "0"), scale)
    return ProfileRule(
        name,
        unhashed_to_left=True,
        summary=f"first fit, then the smallest last_access + {text} x accesses is evicted first (seed 002's hybrid)",
        key="recency-frequency",
        weight=weight,
    )


def known_profiles() -> str:
    """Every profile name, for messages: the fixed ones sorted, then the weighted form.

    >>> known_profiles()
    'block-age, lfu, lru-timestamp, vllm-v1, vllm-v1-tail, lru-lfu:W'
    """
    return ", ".join([*sorted(PROFILES), f"{LRU_LFU}:W"])


def profile_rule(name: str) -> ProfileRule:
    """The rule of the profile called `name` (one of PROFILES, or `lru-lfu:W`).

    Raises:
        ValueError: `name` is not a known profile.

    >>> profile_rule("vllm-v1").unhashed_to_left, profile_rule("lru-lfu:0.5").weight
    (True, Fraction(1, 2))
    """
    if isinstance(name, str) and name.startswith(LRU_LFU + ":"):
        return _lru_lfu(name)
    try:
        return PROFILES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown profile={name!r}; known profiles: {known_profiles()}") from None


def is_profile(name: object) -> bool:
    """Whether `name` names a profile.

    >>> is_profile("lfu"), is_profile("lru-lfu:2"), is_profile("lru-lfu:-1"), is_profile("mru")
    (True, True, False, False)
    """
    try:
        profile_rule(name)  # type: ignore[arg-type]
    except ValueError:
        return False
    return True


def eviction_key(
    rule: ProfileRule,
    block_id: N,
    last_access: N,
    num_accesses: N,
    registered_at: N,
    is_evict_first: T,
    logic: Backend[T],
) -> tuple[object, ...]:
    """A free, hashed block's key under a keyed policy: the smallest is evicted first.

    It opens with the block's tier: 0 when the free that released it asked to
    evict it first (`free_blocks(..., evict_first=True)`: its content lives in
    another tier too), else 1, so such a block goes before every other cached
    block, as vLLM v1 sends it to the left end; within a tier the policy's own
    key orders. Stamps are unique, so a key never ties; the block id ends it
    only so that the order is total by construction. `lru-lfu:W`'s score
    `last_access + W * accesses` is kept scaled by W's denominator q, `q *
    last_access + p * accesses` for W = p / q: an integer, in the same order,
    which z3 compares exactly. Written with the backend's `ite`, never a
    branch on values, so z3 terms evaluate it too.

    >>> rule = profile_rule("lfu")
    >>> eviction_key(rule, 3, 10, 2, 5, False, PY) < eviction_key(rule, 4, 7, 3, 1, False, PY)  # fewer accesses first
    True
    >>> eviction_key(rule, 3, 10, 2, 5, False, PY) > eviction_key(rule, 4, 7, 3, 1, True, PY)  # evict_first first
    True
    >>> eviction_key(profile_rule("lru-lfu:0.5"), 3, 10, 2, 5, False, PY)  # 10 + 0.5 x 2, scaled by 2
    (1, 22, 10, 3)
    """
    tier = logic.ite(is_evict_first, 0, 1)
    if rule.key == "last-access":
        return (tier, last_access, block_id)
    if rule.key == "registered":
        return (tier, registered_at, block_id)
    if rule.key == "accesses":
        return (tier, num_accesses, last_access, block_id)
    if rule.key == "recency-frequency":
        p, q = rule.weight.numerator, rule.weight.denominator
        score = cast("N", q * last_access + p * num_accesses)  # type: ignore[operator]
        return (tier, score, last_access, block_id)
    raise ValueError(f"profile {rule.name!r} orders by queue position, not by a key")


_KEY_LENGTH = 4  # the longest eviction_key; keyed_rank pads the others to it


def keyed_rank(
    rule: ProfileRule,
    block_id: N,
    hashed: T,
    last_access: N,
    num_accesses: N,
    registered_at: N,
    is_evict_first: T,
    logic: Backend[T],
) -> tuple[object, ...]:
    """Where a free block stands in a keyed policy's order: five terms, compared with `logic.lex_lt`.

    A block without a hash ranks `(0, id, 0, 0, 0)` (first fit), one with a
    hash `(1, *key)`, its `eviction_key` padded to four terms with its id.

    >>> lfu = profile_rule("lfu")
    >>> keyed_rank(lfu, 4, False, 9, 1, 2, False, PY), keyed_rank(lfu, 4, True, 9, 1, 2, False, PY)
    ((0, 4, 0, 0, 0), (1, 1, 1, 9, 4))
    """
    key = eviction_key(rule, block_id, last_access, num_accesses, registered_at, is_evict_first, logic)
    padded = (*key, *(block_id,) * (_KEY_LENGTH - len(key)))
    unhashed = (block_id, *(0,) * (_KEY_LENGTH - 1))
    return (logic.ite(hashed, 1, 0), *(logic.ite(hashed, k, u) for k, u in zip(padded, unhashed)))


def keyed_free_order(
    rule: ProfileRule,
    free_blocks: Sequence[BlockId],
    block_hash: Sequence[BlockHash | None],
    last_access: Sequence[int],
    num_accesses: Sequence[int],
    registered_at: Sequence[int],
    is_evict_first: Sequence[bool],
) -> tuple[BlockId, ...]:
    """The free queue of a keyed policy: blocks without a hash by id (first fit), then hashed ones by key.

    >>> rule, h, no = profile_rule("lru-timestamp"), [None, b"a", b"b", None, None, None], [False] * 6
    >>> keyed_free_order(rule, [5, 2, 4, 1], h, [0, 9, 3, 0, 0, 0], [0] * 6, [0] * 6, no)
    (4, 5, 2, 1)
    >>> keyed_free_order(rule, [5, 2, 4, 1], h, [0, 9, 3, 0, 0, 0], [0] * 6, [0] * 6, [False, True, *no[2:]])
    (4, 5, 1, 2)
    """
    stamps = (block_hash, last_access, num_accesses, registered_at, is_evict_first)
    return tuple(sorted(free_blocks, key=lambda b: _keyed_rank(rule, b, *stamps)))


def _keyed_rank(
    rule: ProfileRule,
    b: BlockId,
    block_hash: Sequence[BlockHash | None],
    last_access: Sequence[int],
    num_accesses: Sequence[int],
    registered_at: Sequence[int],
    is_evict_first: Sequence[bool],
) -> tuple[object, ...]:
    """`keyed_rank` of block b, read from the state's sequences."""
    hashed = block_hash[b] is not None
    return keyed_rank(rule, b, hashed, last_access[b], num_accesses[b], registered_at[b], is_evict_first[b], PY)


def in_keyed_order(
    rule: ProfileRule,
    free_queue: Sequence[BlockId],
    block_hash: Sequence[BlockHash | None],
    last_access: Sequence[int],
    num_accesses: Sequence[int],
    registered_at: Sequence[int],
    is_evict_first: Sequence[bool],
) -> bool:
    """Whether `free_queue` is in a keyed policy's order: unhashed by ascending id, then hashed by ascending key.

    >>> rule, h = profile_rule("block-age"), [None, b"a", b"b", None]
    >>> stamps = ([0] * 4, [0] * 4, [0, 8, 5, 0], [False] * 4)  # last access, accesses, registration, evict first
    >>> in_keyed_order(rule, (3, 2, 1), h, *stamps), in_keyed_order(rule, (3, 1, 2), h, *stamps)
    (True, False)
    """
    stamps = (block_hash, last_access, num_accesses, registered_at, is_evict_first)
    ranks = [_keyed_rank(rule, b, *stamps) for b in free_queue]
    return all(PY.lex_lt(a, b) for a, b in zip(ranks, ranks[1:]))


def freed_goes_left(unhashed_to_left: T, has_hash: T, evict_first: T, logic: Backend[T]) -> T:
    """Whether a block whose ref_cnt just dropped to 0 goes to the left end.

    A free called with `evict_first` (vLLM 0.34.0 on: its content lives in
    another tier too) sends every block it frees left, hashed or not, so that
    it is evicted before every other cached block.

    >>> freed_goes_left(True, False, False, PY), freed_goes_left(True, True, False, PY)
    (True, False)
    >>> freed_goes_left(False, False, False, PY), freed_goes_left(True, True, True, PY)
    (False, True)
    """
    return logic.or_(evict_first, logic.and_(unhashed_to_left, logic.not_(has_hash)))


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


def initial_free_key(block_id: N) -> N:
    """The key of a free block in a fresh pool: its id, so the queue starts in id order.

    >>> [initial_free_key(b) for b in (1, 2, 3)]
    [1, 2, 3]
    """
    return block_id


def initial_key_counters(num_gpu_blocks: N) -> tuple[int, N]:
    """`(lo, hi)` of a fresh pool: the smallest and largest initial key (block 0 is never free).

    >>> initial_key_counters(4)
    (1, 3)
    """
    return 1, cast(N, cast(int, num_gpu_blocks) - 1)


def max_hit_blocks_rule(num_tokens: N, block_size: N, max_hit_blocks: N, logic: Backend[T]) -> T:
    """Whether `max_hit_blocks == (num_tokens - 1) // block_size`, stated by the division rule.

    For `block_size >= 1` exactly one integer satisfies it: the quotient. The
    cap leaves the last prompt token uncached, because its logits sample the
    first output token.

    >>> [q for q in range(-2, 5) if max_hit_blocks_rule(9, 4, q, PY)], (9 - 1) // 4
    ([2], 2)
    """
    b, q, last = cast(int, block_size), cast(int, max_hit_blocks), cast(int, num_tokens) - 1
    return logic.and_(b * q <= last, last < b * (q + 1))


def num_hit_tokens(block_size: N, num_cached_blocks: N, max_hit_blocks: N, logic: Backend[T]) -> N:
    """The tokens a request reuses: whole blocks, `min(num_cached_blocks, max_hit_blocks)` of them.

    `num_cached_blocks` is how many leading blocks of the request's hash chain
    are cached; the manager stops at the first miss and at the cap.

    >>> num_hit_tokens(4, 5, 2, PY), num_hit_tokens(4, 1, 2, PY)
    (8, 4)
    """
    # Comparisons of backend integers are backend booleans: casts only tell mypy so.
    fewer_cached = cast(T, cast(int, num_cached_blocks) < cast(int, max_hit_blocks))
    capped = logic.ite(fewer_cached, num_cached_blocks, max_hit_blocks)
    return cast(N, cast(int, block_size) * cast(int, capped))


def hit_tokens_within_cap(num_tokens: N, num_hit: N, logic: Backend[T]) -> T:
    """Whether a hit of `num_hit` tokens leaves the last of `num_tokens` prompt tokens to compute.

    >>> hit_tokens_within_cap(9, 8, PY), hit_tokens_within_cap(8, 8, PY), hit_tokens_within_cap(8, -4, PY)
    (True, False, False)
    """
    return logic.and_(cast(int, num_hit) >= 0, cast(int, num_hit) <= cast(int, num_tokens) - 1)


def _distinct_known_blocks(
    free_queue: Sequence[BlockId], newly_free: Sequence[BlockId], block_hash: Sequence[BlockHash | None]
) -> bool:
    """Every block named once, and each newly freed one has a block_hash entry."""
    every = [*free_queue, *newly_free]
    return len(set(every)) == len(every) and all(0 <= b < len(block_hash) for b in newly_free)


def _sent_left(
    newly_free: Sequence[BlockId], block_hash: Sequence[BlockHash | None], rule: ProfileRule, evict_first: bool
) -> tuple[BlockId, ...]:
    """The newly free blocks that go to the left end, in the order they were freed."""
    return tuple(
        b for b in newly_free if freed_goes_left(rule.unhashed_to_left, block_hash[b] is not None, evict_first, PY)
    )


def _in_order_of(items: Sequence[BlockId], within: Sequence[BlockId]) -> bool:
    """`items` appear in `within`, in the same order."""
    kept = set(items)
    return tuple(b for b in within if b in kept) == tuple(items)


def _all_before(first: Sequence[BlockId], then: Sequence[BlockId], within: Sequence[BlockId]) -> bool:
    """Every block of `first` sits before every block of `then` in `within` (all of them are in it)."""
    if not first or not then:
        return True
    where = {b: i for i, b in enumerate(within)}
    return max(where[a] for a in first) < min(where[b] for b in then)


def freed_in_place(
    free_queue: Sequence[BlockId],
    newly_free: Sequence[BlockId],
    block_hash: Sequence[BlockHash | None],
    rule: ProfileRule,
    result: Sequence[BlockId],
    evict_first: bool = False,
) -> bool:
    """Whether `result` is `free_queue` with `newly_free` placed as `rule` (and `evict_first`) say.

    Nothing lost or repeated; the blocks already free keep their order; those
    sent left keep their given order before all of them, the others keep
    theirs after all of them.

    >>> h, rule = [None, b"x", None], PROFILES["vllm-v1"]
    >>> freed_in_place((2,), [1], h, rule, (2, 1)), freed_in_place((1,), [2], h, rule, (1, 2))
    (True, False)
    >>> freed_in_place((2,), [1], h, rule, (1, 2), evict_first=True)
    True
    """
    left = _sent_left(newly_free, block_hash, rule, evict_first)
    sent_left = set(left)
    right = [b for b in newly_free if b not in sent_left]
    return (
        sorted(result) == sorted([*free_queue, *newly_free])
        and _in_order_of(free_queue, result)
        and _in_order_of(left, result)
        and _in_order_of(right, result)
        and _all_before(left, free_queue, result)
        and _all_before(free_queue, right, result)
    )


@icontract.require(
    lambda free_queue, newly_free, block_hash: _distinct_known_blocks(free_queue, newly_free, block_hash)
)
@icontract.ensure(
    lambda free_queue, newly_free, block_hash, rule, evict_first, result: freed_in_place(
        free_queue, newly_free, block_hash, rule, result, evict_first
    )
)
def place_freed(
    free_queue: tuple[BlockId, ...],
    newly_free: Sequence[BlockId],
    block_hash: Sequence[BlockHash | None],
    rule: ProfileRule,
    evict_first: bool = False,
) -> tuple[BlockId, ...]:
    """The free queue after `newly_free` (in the order they were freed) join it.

    Blocks sent left (`freed_goes_left`) keep their given order and sit before
    every block already free, as one batch: vLLM's `prepend_n`, which links
    the batch in its given order ahead of the old head. Blocks sent right keep
    their order and sit after every block (`append_n`). With `evict_first`
    every newly free block goes left, in the same single batch.

    >>> h = [None, b"x", None, None]
    >>> place_freed((BlockId(9),), [BlockId(3), BlockId(1), BlockId(2)], h, PROFILES["vllm-v1"])
    (3, 2, 9, 1)
    >>> place_freed((BlockId(9),), [BlockId(3), BlockId(1), BlockId(2)], h, PROFILES["vllm-v1"], evict_first=True)
    (3, 1, 2, 9)
    """
    left = _sent_left(newly_free, block_hash, rule, evict_first)
    right = tuple(b for b in newly_free if b not in left)
    return left + free_queue + right
