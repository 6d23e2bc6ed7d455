"""How fast the harness checks the request level: lock-step steps per second against the reference, per layout.

One run, every layout side by side (the same seed, the same examples per
layout, in this process, no child): one full-attention group, the layout the
founding harness checked, then KV cache groups (a sliding window, chunked
local attention, three groups). A step is one operation run on the spec and
the reference and checked (result, invariants, hit rules, the whole state);
the rate is what a CI gate of allocator changes waits for.
"""

from __future__ import annotations

import platform
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from kvspec.conformance.commands._arguments import OneLineParser, group_layout, positive_int
from kvspec.conformance.results import Verdict
from kvspec.conformance.runner import run_check

__all__ = ["DEFAULT_LAYOUTS", "TARGET_STEPS_PER_S", "LayoutSpeed", "main", "measure"]

DEFAULT_LAYOUTS = ("full", "full,sliding:8", "full,chunked:16", "sliding:4", "full,sliding:6,chunked:8")
TARGET_STEPS_PER_S = 1000.0  # the request level on 2 cores, against the reference


@dataclass(frozen=True)
class LayoutSpeed:
    """One layout's campaign: what it checked and how fast."""

    groups: str
    verdict: str
    examples: int
    steps: int
    seconds: float

    @property
    def steps_per_second(self) -> float:
        """Checked steps per second of the campaign."""
        return self.steps / self.seconds if self.seconds > 0 else 0.0


def measure(layouts: Sequence[str] = DEFAULT_LAYOUTS, max_examples: int = 100, seed: int = 0) -> list[LayoutSpeed]:
    """One manager-level campaign against the reference per layout, caching on, in this process."""
    out = []
    for groups in layouts:
        r = run_check("reference", level="manager", max_examples=max_examples, seed=seed, isolate=False,
                      groups=groups, shrink=False)  # fmt: skip
        out.append(LayoutSpeed(groups, str(r.verdict), r.examples_run, r.steps_run, r.seconds))
    return out


def render(results: Sequence[LayoutSpeed]) -> str:
    """A row per layout, with its rate against the first layout's and against the target."""
    base = results[0].steps_per_second or 1.0
    width = max(len(r.groups) for r in results)
    lines = [f"{'KV cache groups':<{width}}  {'verdict':<9}{'examples':>9}{'steps':>8}{'steps/s':>9}  vs first"]
    for r in results:
        lines.append(
            f"{r.groups:<{width}}  {r.verdict:<9}{r.examples:>9}{r.steps:>8}{r.steps_per_second:>9.0f}  "
            f"{r.steps_per_second / base:>7.2f}x"
        )
    slowest = min(r.steps_per_second for r in results)
    lines.append(f"slowest layout: {slowest:.0f} steps/s (target: at least {TARGET_STEPS_PER_S:.0f})")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the campaigns and print the table; 0, or 1 if a campaign did not conform, 2 on bad arguments."""
    parser = OneLineParser(prog="kvspec bench harness", description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--groups", type=group_layout, nargs="+", default=list(DEFAULT_LAYOUTS), metavar="LAYOUT",
                        help="the layouts to time (default: %(default)s)")  # fmt: skip
    parser.add_argument("--max-examples", type=positive_int, default=100, help="examples per layout (default 100)")
    parser.add_argument("--seed", type=int, default=0, help="the campaigns' seed (default 0)")
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    print(f"harness, manager level, reference, caching on, {args.max_examples} examples per layout, seed {args.seed}")
    print(f"python {platform.python_version()} on {platform.machine()}, one process\n")
    results = measure(args.groups, args.max_examples, args.seed)
    print(render(results))
    return 0 if all(r.verdict == str(Verdict.CONFORMS) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
