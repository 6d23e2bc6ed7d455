"""What the player and the stories say of a call: the words each entry of the operations table gives.

Each operation's entry (kvspec.conformance.core.operations) carries a
`Wording`: what a call asks, in a sentence (the player writes it under the
call), what a returned value means (the player's result line), and which
trailing arguments say nothing when left at their usual values (the player
and the stories leave them out of the call they print). A tool hands the
entry's functions a `CallText`: the call's arguments by parameter name, with
the tool's own way of showing a value (a hash by its short name, a request by
its id), so the words are written once whatever form the arguments are in
(trace JSON in the player, Python values in the stories).

Design choice: small functions over the arguments rather than format
templates with a mini-language of their own; a sentence with a condition in
it (allocate_slots' hit and external tokens) is plain Python, and every
wording is checked by mypy and the player's tests like any other code.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["CallText", "Wording", "blocks", "ids", "plural"]


def ids(values: Sequence[Any]) -> str:
    """Values comma-separated, or "none".

    >>> ids([3, 1]), ids([])
    ('3, 1', 'none')
    """
    return ", ".join(str(v) for v in values) if values else "none"


def blocks(values: Sequence[Any]) -> str:
    """Block ids in words: "block 3", or "blocks 3, 1".

    >>> blocks([3]), blocks([3, 1])
    ('block 3', 'blocks 3, 1')
    """
    return f"block {values[0]}" if len(values) == 1 else f"blocks {ids(values)}"


def plural(n: int, word: str) -> str:
    """A count and its noun.

    >>> plural(1, "token"), plural(2, "token")
    ('1 token', '2 tokens')
    """
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


class CallText:
    """One call's arguments as a tool shows them: by parameter name, values in the tool's own form.

    `show` puts one argument value in words (a hash by its short name),
    `request_id` names the request an argument holds; the player passes
    functions that read trace JSON, the stories ones that read Python values.
    """

    def __init__(
        self,
        params: Sequence[str],
        args: Sequence[Any],
        show: Callable[[Any], str],
        request_id: Callable[[Any], str],
    ) -> None:
        self._args = dict(zip(params, args))
        self._show = show
        self._request_id = request_id

    def __getitem__(self, param: str) -> Any:
        """The argument as passed."""
        return self._args[param]

    def count(self, param: str, noun: str) -> str:
        """An integer argument as a count of `noun` ("2 blocks"); any other value as it is."""
        value = self._args[param]
        return plural(value, noun) if isinstance(value, int) else str(value)

    def blocks(self, param: str) -> str:
        """A list of block ids: "block 3", "blocks 3, 1"."""
        return blocks(self._args[param])

    def value(self, param: str) -> str:
        """One argument in the tool's words (a hash by its name)."""
        return self._show(self._args[param])

    def values(self, param: str) -> str:
        """A list argument, each value in the tool's words, comma-separated."""
        return ids([self._show(v) for v in self._args[param]])

    def request_id(self, param: str) -> str:
        """The id of the request an argument holds."""
        return self._request_id(self._args[param])


def _no_words(result: Any) -> str | None:
    return None


@dataclass(frozen=True, slots=True)
class Wording:
    """What the player and the stories say of one operation."""

    asks: Callable[[CallText], str]  # what a call asks, in a sentence
    # What a returned value (normal form) means; None where the value is not of the expected shape (a
    # malformed or unexpected one), which a tool then shows as it is ("done" for None).
    answer: Callable[[Any], str | None] = _no_words
    # Usual values of the trailing parameters: a call whose trailing arguments are all at these (a running
    # request's step) is printed without them, since they say nothing there.
    quiet_tail: tuple[Any, ...] = ()

    def shown_args(self, args: Sequence[Any]) -> int:
        """How many leading arguments a printed call shows (all but a quiet tail)."""
        n = len(self.quiet_tail)
        if n and len(args) > n and list(args[-n:]) == list(self.quiet_tail):
            return len(args) - n
        return len(args)
