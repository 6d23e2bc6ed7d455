"""`kvspec demo`: seed 000's six-block walkthrough, one state per step."""

from __future__ import annotations

import argparse
from typing import Any

from kvspec.conformance.builtin import make_reference, make_spec
from kvspec.conformance.commands._arguments import output_file
from kvspec.conformance.walkthrough import load_golden, render_step, run_walkthrough


def register(subparsers: Any) -> None:
    """Add the `demo` subcommand."""
    p = subparsers.add_parser("demo", help="play seed 000's six-block walkthrough step by step")
    p.add_argument("--impl", choices=("reference", "spec"), default="reference", help="which model plays it")
    p.add_argument(
        "--html", type=output_file, metavar="PATH", help="also write the walkthrough as a step-through browser page"
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Print every step; exit 1 if a state differs from the seed's."""
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
        from kvspec.conformance.view import walkthrough_to_page_data, write_page

        print(f"page: {write_page(args.html, walkthrough_to_page_data(steps, args.impl))}")
    return 0 if ok else 1
