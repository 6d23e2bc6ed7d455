"""The errors a caller's mistake gets, shared by the spec and every implementation.

Each error inherits both `BlockManagerError` (catch every caller mistake at
once) and the builtin that matches its meaning (code that already catches
`ValueError` keeps working). The spec and every implementation raise the same
type for the same mistake, and leave the state unchanged when they do; the
conformance harness checks both.
"""

from __future__ import annotations

from typing import TypeGuard

__all__ = [
    "AlreadyCached",
    "BlockManagerError",
    "DoubleFree",
    "InvalidBlock",
    "InvalidRequest",
    "InvariantViolation",
    "NotWritable",
    "PoolExhausted",
    "is_count",
    "is_int",
]


def is_int(value: object) -> TypeGuard[int]:
    """Whether an argument is an integer: an int that is not a bool (True is an int to Python, but names no
    block and counts nothing). Every check of an id, a count or a size reads this.

    >>> is_int(3), is_int(True), is_int(3.0)
    (True, False, False)
    """
    return isinstance(value, int) and not isinstance(value, bool)


def is_count(value: object) -> TypeGuard[int]:
    """Whether an argument is a count: a non-negative `is_int` (tokens, blocks, preemptions).

    >>> is_count(0), is_count(-1), is_count(False)
    (True, False, False)
    """
    return is_int(value) and value >= 0


class BlockManagerError(Exception):
    """A caller asked for something the block manager cannot do."""


class InvalidRequest(BlockManagerError, ValueError):
    """An argument is malformed: a negative or non-integer count, an empty prompt."""


class InvalidBlock(BlockManagerError, ValueError):
    """A block id is out of range, is the null block, or is in the wrong state."""


class DoubleFree(BlockManagerError, ValueError):
    """A block was freed that no request holds."""


class AlreadyCached(BlockManagerError, ValueError):
    """A block that already has a hash was registered again."""


class NotWritable(BlockManagerError, PermissionError):
    """A write was aimed at a block that is shared, hashed, free, or the null block."""


class PoolExhausted(BlockManagerError, RuntimeError):
    """More blocks were asked for than the free queue holds."""


class InvariantViolation(AssertionError):
    """A state broke a named invariant: a bug in the implementation, not in the caller."""

    def __init__(self, name: str, rule: str, detail: str) -> None:
        super().__init__(f"invariant {name} violated: {rule}\n{detail}")
        self.name = name
        self.rule = rule
