"""Shared helpers of the gpu_impl tests: run two implementations side by side and compare.

`same_call` runs one operation on the reference and on gpu_impl and requires
the same result or the same error type; the state machines call it for every
step and then compare the whole snapshots.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvspec.spec.errors import BlockManagerError

__all__ = ["Outcome", "same_call"]

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
