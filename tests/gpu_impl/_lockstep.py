"""Shared helpers of the gpu_impl tests: run two implementations side by side and compare.

`same_call` runs one operation on the reference and on gpu_impl and requires
the same result or the same error type; the state machines call it for every
step and then compare the whole snapshots. `group_layouts` draws the KV cache
groups a manager machine runs with.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hypothesis import strategies as st

from kvspec.spec.errors import BlockManagerError

__all__ = ["Outcome", "group_layouts", "same_call"]

Outcome = tuple[str, Any]  # ("ok", result) or ("error", exception type)


def _run(fn: Callable[..., Any], *args: Any) -> Outcome:
    try:
        return ("ok", fn(*args))
    except BlockManagerError as e:
        return ("error", type(e))


def same_call(reference: object, gpu: object, op: str, *args: Any) -> Outcome:
    """Run `op(*args)` on both; assert the same outcome (result, or error type); return it."""
    want = _run(getattr(reference, op), *args)
    got = _run(getattr(gpu, op), *args)
    assert got == want, f"{op}{args}: reference gave {want}, gpu_impl gave {got}"
    return want


def group_layouts(block_size: int, skipping: bool = False) -> st.SearchStrategy[str]:
    """One to three KV cache groups for `block_size`, as `"full,sliding:5"`; the single full group half the time.

    Sliding windows from 2 tokens to several blocks, multiples of the block
    size and not (a window of cdiv(W - 1, B) blocks is what a hit needs);
    chunks of one to three blocks (vLLM requires a multiple). Small windows
    and chunks let a short request slide past many blocks. `skipping`: only
    layouts with a sliding-window or chunked group, after full attention
    or not.
    """
    b = block_size
    skipper = st.one_of(
        st.integers(2, 3 * b + 1).map(lambda w: f"sliding:{w}"),
        st.integers(1, 3).map(lambda k: f"chunked:{k * b}"),
    )
    group = st.one_of(st.just("full"), skipper)
    if skipping:
        return st.tuples(st.lists(group, max_size=2), skipper, st.booleans()).map(
            lambda t: ",".join([t[1], *t[0]] if t[2] else [*t[0], t[1]])
        )
    return st.one_of(st.just("full"), st.lists(group, min_size=1, max_size=3).map(",".join))
