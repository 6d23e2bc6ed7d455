"""KV cache groups and their attention types: which token positions a group still reads.

A model's layers fall into KV cache groups (vLLM's `KVCacheConfig.kv_cache_groups`),
all allocating from one pool. A group's attention type decides which earlier
tokens the next token attends to, and so which blocks the group still needs
(vLLM's `single_type_kv_cache_manager.py`):

- `full`: every earlier token. Nothing is ever skipped.
- `sliding:W`: the last W tokens, the next one included. Once `c` tokens are
  computed, the next token (position c) reads positions c - W + 1 .. c, so the
  first `max(0, c - W + 1)` tokens are skipped (`SlidingWindowManager.get_num_skipped_tokens`).
- `chunked:C`: the tokens of its own chunk of C (chunked local attention):
  the first `c // C * C` tokens are skipped (`ChunkedLocalAttentionManager`).

A skipped block (every one of its tokens skipped) is freed and replaced in the
group's block table by the null block. Skipped tokens are computed once and
never read again, because the window only moves right as the request advances
(lemma 9, `kvspec prove`).

The arithmetic is written twice on purpose: as plain integer functions the
spec and the implementations' tests call, and as division rules
(`*_rule`, backend-generic as `spec.ordering`'s) that z3 reads with unknown
sizes, where `//` of two unknowns is nonlinear; a doctest and
tests/spec/test_attention.py tie the two together.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Literal, TypeVar, cast

from kvspec.spec.errors import InvalidRequest
from kvspec.spec.ordering import PY, Backend  # noqa: F401 (PY is the doctests' backend)

__all__ = [
    "FULL",
    "AttentionKind",
    "KVGroup",
    "chunk_start_rule",
    "format_groups",
    "num_skipped_blocks",
    "num_skipped_tokens",
    "parse_groups",
    "window_hit_blocks",
    "window_hit_blocks_rule",
    "window_skip_rule",
    "window_start_rule",
]

T = TypeVar("T")  # a boolean of the backend
N = TypeVar("N")  # an integer of the backend

AttentionKind = Literal["full", "sliding", "chunked"]
_KINDS: tuple[AttentionKind, ...] = ("full", "sliding", "chunked")


@dataclass(frozen=True, slots=True, order=True)
class KVGroup:
    """One KV cache group's attention type: `full`, `sliding:W` (a window of W tokens) or `chunked:C`."""

    kind: AttentionKind
    size: int = 0  # the window W or the chunk C in tokens; 0 for full attention

    def __str__(self) -> str:
        return self.kind if self.kind == "full" else f"{self.kind}:{self.size}"

    @property
    def skips(self) -> bool:
        """Whether this attention type ever stops reading a token (everything but full attention)."""
        return self.kind != "full"


FULL = KVGroup("full")


@lru_cache(maxsize=256)
def parse_groups(text: str) -> tuple[KVGroup, ...]:
    """The groups named by `full,sliding:8,chunked:16` (one to three groups, in order).

    >>> [str(g) for g in parse_groups("full,sliding:8")]
    ['full', 'sliding:8']

    Raises:
        InvalidRequest: a name is not `full`, `sliding:W` (W >= 2) or `chunked:C` (C >= 1),
            or there are no groups or more than three.
    """
    names = [part.strip() for part in str(text).split(",")]
    groups = tuple(_parse_group(name) for name in names)
    if not 1 <= len(groups) <= 3:
        raise InvalidRequest(f"groups={text!r}: one to three KV cache groups, comma-separated")
    return groups


def _parse_group(name: str) -> KVGroup:
    kind, _, size = name.partition(":")
    if kind == "full" and not size:
        return FULL
    if kind in ("sliding", "chunked") and size.isdigit():
        # NOTE: a window of 1 token reads only the token itself; vLLM then caches no
        # block of the group (its reachable-block mask is empty), a corner not modelled.
        least = 2 if kind == "sliding" else 1
        if int(size) >= least:
            return KVGroup(cast(AttentionKind, kind), int(size))
    raise InvalidRequest(
        f"KV cache group {name!r}: expected 'full', 'sliding:W' (a window of W >= 2 tokens) "
        "or 'chunked:C' (chunks of C >= 1 tokens)"
    )


def format_groups(groups: tuple[KVGroup, ...]) -> str:
    """The inverse of `parse_groups`.

    >>> format_groups(parse_groups("full, chunked:16"))
    'full,chunked:16'
    """
    return ",".join(str(g) for g in groups)


def num_skipped_tokens(group: KVGroup, num_computed_tokens: int) -> int:
    """How many leading tokens the group no longer reads once `num_computed_tokens` are computed.

    >>> [num_skipped_tokens(KVGroup("sliding", 4), c) for c in (3, 4, 7)], num_skipped_tokens(KVGroup("chunked", 8), 13)
    ([0, 1, 4], 8)
    """
    if group.kind == "sliding":
        return max(0, num_computed_tokens - group.size + 1)
    if group.kind == "chunked":
        return num_computed_tokens // group.size * group.size
    return 0


def num_skipped_blocks(group: KVGroup, num_computed_tokens: int, block_size: int) -> int:
    """How many leading blocks hold only skipped tokens: the blocks the group frees.

    >>> num_skipped_blocks(KVGroup("sliding", 8), 16, 4), num_skipped_blocks(KVGroup("sliding", 8), 12, 4)
    (2, 1)
    """
    return num_skipped_tokens(group, num_computed_tokens) // block_size


def window_hit_blocks(window: int, block_size: int) -> int:
    """How many contiguous cached blocks a sliding-window hit needs: those holding the W - 1 tokens before the next.

    vLLM's `SlidingWindowManager._contiguous_blocks_for_hit` (no EAGLE), `cdiv(W - 1, B)`.

    >>> window_hit_blocks(8, 4), window_hit_blocks(6, 4), window_hit_blocks(4, 4)
    (2, 2, 1)
    """
    return -(-(window - 1) // block_size)


# --- the same arithmetic as division rules, for z3 --------------------------------------------


def window_start_rule(num_computed: N, window: N, start: N, logic: Backend[T]) -> T:
    """Whether `start == max(0, num_computed - window + 1)`: the first position the next token reads.

    It is also how many tokens a `sliding:W` group skips (`num_skipped_tokens`).

    >>> [s for s in range(0, 20) if window_start_rule(16, 8, s, PY)], num_skipped_tokens(KVGroup("sliding", 8), 16)
    ([9], 9)
    >>> [s for s in range(0, 20) if window_start_rule(5, 8, s, PY)], num_skipped_tokens(KVGroup("sliding", 8), 5)
    ([0], 0)
    """
    c, w, s = (cast(int, v) for v in (num_computed, window, start))
    first = c - w + 1  # the oldest of the W tokens the next one (position c) reads, before clamping at 0
    return logic.or_(
        logic.and_(cast(T, first <= 0), cast(T, s == 0)),
        logic.and_(cast(T, first > 0), cast(T, s == first)),
    )


def window_skip_rule(num_computed: N, window: N, block_size: N, skipped_blocks: N, logic: Backend[T]) -> T:
    """Whether `skipped_blocks == max(0, num_computed - window + 1) // block_size`, by the division rule.

    >>> [q for q in range(0, 5) if window_skip_rule(16, 8, 4, q, PY)], num_skipped_blocks(KVGroup("sliding", 8), 16, 4)
    ([2], 2)
    """
    c, w, b, q = (cast(int, v) for v in (num_computed, window, block_size, skipped_blocks))
    s = c - w + 1
    return logic.or_(
        logic.and_(cast(T, s <= 0), cast(T, q == 0)),
        logic.and_(cast(T, s > 0), cast(T, b * q <= s), cast(T, s < b * (q + 1))),
    )


def window_hit_blocks_rule(window: N, block_size: N, need: N, logic: Backend[T]) -> T:
    """Whether `need == cdiv(window - 1, block_size)`: the fewest blocks whose tokens reach W - 1.

    >>> [k for k in range(0, 5) if window_hit_blocks_rule(6, 4, k, PY)], window_hit_blocks(6, 4)
    ([2], 2)
    """
    w, b, k = (cast(int, v) for v in (window, block_size, need))
    return logic.and_(cast(T, b * k >= w - 1), cast(T, b * (k - 1) < w - 1))


def chunk_start_rule(num_tokens: N, chunk: N, start: N, logic: Backend[T]) -> T:
    """Whether `start == num_tokens // chunk * chunk`: where the chunk holding position num_tokens begins.

    >>> [s for s in range(0, 20) if chunk_start_rule(13, 8, s, PY)]
    [8]
    """
    n, c, s = (cast(int, v) for v in (num_tokens, chunk, start))
    # s is a multiple of c: s = c * k for the k the rule pins, c * k <= n < c * (k + 1)
    return logic.and_(cast(T, s <= n), cast(T, n < s + c), cast(T, s % c == 0))
