"""`kvspec demo`: seed 000's six-block walkthrough, one state per step; with `--groups`, a walkthrough of KV
cache groups, where the null block replaces the blocks a group no longer reads."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kvspec.conformance.targets.builtin import make_reference, make_spec
from kvspec.conformance.tools.commands._arguments import group_layout, output_file, write_output
from kvspec.conformance.tools.groups_demo import BLOCK_SIZE, BLOCKS_PER_GROUP, render_groups_step, run_groups_demo
from kvspec.conformance.tools.view import render_page, walkthrough_to_page_data
from kvspec.conformance.tools.walkthrough import load_golden, render_step, run_walkthrough


def register(subparsers: Any) -> None:
    """Add the `demo` subcommand."""
    p = subparsers.add_parser(
        "demo",
        help="play seed 000's six-block walkthrough step by step",
        epilog="exit codes: 0 every state equals the seed's (with --groups: holds every invariant and equals the "
        "spec's); 1 a state differs; 2 a bad flag or an --html page that cannot be written",
    )
    p.add_argument("--impl", choices=("reference", "spec"), default="reference", help="which model plays it")
    p.add_argument(
        "--html", type=output_file, metavar="PATH", help="also write the walkthrough as a step-through browser page"
    )
    p.add_argument(
        "--groups",
        type=group_layout,
        metavar="LAYOUT",
        help="instead, a request-level walkthrough with these KV cache groups (e.g. full,sliding:8): "
        "a request decodes, its groups free the blocks they no longer read, another hits what every group serves",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Print every step; exit 1 if a state differs from the seed's (or, with groups, from the spec's)."""
    if getattr(args, "groups", None):
        return _run_groups(args)
    steps = run_walkthrough(make_reference if args.impl == "reference" else make_spec)
    golden = {g["step"]: g for g in load_golden()["steps"]}
    print(f"Seed 000's walkthrough on the {args.impl} model: 6 blocks of 4 tokens (block 0 is the null block).")
    print("Legend: * changed in this step, # registered in the hash table (can be hit).\n")
    ok = True
    previous = None
    for step in steps:
        want = golden[step.step]
        # Step 7 branches from step 5, so it is compared with the state after step 5.
        base = next((s for s in steps if s.step == want["after"]), None) if want["after"] is not None else None
        print(render_step(step, base if step.step == 7 else previous))
        got = step.as_golden()
        matches = all(got[k] == want[k] for k in ("ref_cnt", "free_queue", "hash_table", "block_tables"))
        print(f"  matches the seed: {'yes' if matches else 'NO'}\n")
        ok = ok and matches
        previous = step
    if getattr(args, "html", None):
        if write_output("kvspec demo", args.html, render_page(walkthrough_to_page_data(steps, args.impl))):
            return 2
        print(f"page: {args.html}")
    return 0 if ok else 1


def _run_groups(args: argparse.Namespace) -> int:
    """The KV cache groups walkthrough; exit 1 if a state breaks an invariant or differs from the spec's."""

    if getattr(args, "html", None):
        print("kvspec demo: --html plays seed 000's walkthrough; it does not take --groups", file=sys.stderr)
        return 2
    steps = run_groups_demo(make_reference if args.impl == "reference" else make_spec, args.groups)
    print(
        f"KV cache groups {args.groups} on the {args.impl} model: blocks of {BLOCK_SIZE} tokens, "
        f"{BLOCKS_PER_GROUP} per group, one pool (block 0 is the null block)."
    )
    print("Legend: # registered in the hash table (can be hit); null: a position the group no longer reads.\n")
    for step in steps:
        print(render_groups_step(step, args.groups) + "\n")
    ok = all(not s.broken and s.agrees for s in steps)
    print("every state holds every invariant and equals the spec's" if ok else "a state is WRONG (see above)")
    return 0 if ok else 1
