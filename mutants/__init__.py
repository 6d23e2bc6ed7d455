"""Deliberately wrong block managers: the proof that the harness finds real bugs.

Each mutant is the reference model with exactly one plausible bug, the kind a
vLLM contributor could write in a review-sized change: a wrong free end, a
forgotten `del`, an off-by-one cap. The harness must kill every one
(`kvspec mutants`, and tests/mutants/test_mutants.py), and each has a named
scenario (tests/mutants/test_scenarios.py) that shows in a few explicit steps
that it is really wrong, so a kill is never a false alarm.

Mutants are grouped by theme, one module each, and every module defines
`MUTANTS: list[Mutant]`. The registry below discovers every module of this
package, so a new group (a `gpu_*.py` with mutants of the torch pool, say) is
picked up without editing a shared file. Private `_*` modules (the unmutated
bases) are skipped.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field

from kvspec.conformance.tools.mutants import Mutant

__all__ = ["REQUIRED_KINDS", "Discovery", "Mutant", "all_mutants", "discover"]

# The kinds of bug the harness must be shown to catch, worded as the issue that
# asked for the mutant set words them; every kind has at least one mutant.
REQUIRED_KINDS: tuple[str, ...] = (
    "wrong free end",
    "no tail-first order",
    "a freed block not reversed",
    "touch that leaves the block in the queue",
    "eviction that keeps the hash entry",
    "a stale hash after eviction",
    "hit cap off by one",
    "a partial block hashed",
    "a hash chain that ignores its parent",
    "cache_salt missing or on every block",
    "LoRA ignored",
    "a failed allocation that leaves touched blocks",
    "a double free accepted",
    "the null block freed or queued",
    "a duplicate queue entry",
    "a ref_cnt underflow",
    "reset accepted while blocks are held",
    "a miscounted num_free",
    "a cached block re-registered",
    "a preemption that drops a shared block",
    "ties broken the other way",
    "an access that does not refresh what its policy reads",
    "first fit taking the highest id",
    "an eviction that publishes no BlockRemoved",
    "a BlockStored with the wrong parent",
    "a stored event for a block already cached",
    "a reset without AllBlocksCleared",
    "a hit counted for a preempted request",
    "an external hit counted as local",
)

# Optional dependencies a mutant module may need (the torch pool's mutants need
# torch, which is the `gpu` extra); such a module is reported as skipped, not fatal.
_OPTIONAL_DEPENDENCIES = frozenset({"torch"})


@dataclass(frozen=True)
class Discovery:
    """What the registry found: the mutants, and the modules it could not load for lack of an extra."""

    mutants: list[Mutant]  # every mutant, in module order then list order
    skipped: list[str] = field(default_factory=list)  # "module: reason" for each module left out


def discover() -> Discovery:
    """Import every mutant module of this package and collect its `MUTANTS`.

    Returns:
        The mutants found and the modules skipped because an optional dependency is missing.

    Raises:
        ValueError: two mutants share a name, or a module has no `MUTANTS` list.
    """
    mutants: list[Mutant] = []
    skipped: list[str] = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        try:
            module = importlib.import_module(f"{__name__}.{info.name}")
        except ModuleNotFoundError as e:
            if e.name in _OPTIONAL_DEPENDENCIES:
                skipped.append(f"{info.name}: needs {e.name}, which is not installed")
                continue
            raise
        found = getattr(module, "MUTANTS", None)
        if not isinstance(found, list) or not all(isinstance(m, Mutant) for m in found):
            raise ValueError(f"mutant module {module.__name__} must define MUTANTS: list[Mutant]; got {found!r}")
        mutants.extend(found)
    seen: dict[str, Mutant] = {}
    for m in mutants:
        if m.name in seen:
            raise ValueError(f"two mutants are named {m.name!r}: {seen[m.name].description!r} and {m.description!r}")
        seen[m.name] = m
    return Discovery(mutants, skipped)


def all_mutants() -> list[Mutant]:
    """Every mutant of every loadable module, in a stable order."""
    return discover().mutants
