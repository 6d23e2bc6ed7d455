"""`kvspec diff A B`: what changed in vLLM's block pool between two vLLMs.

A and B are vLLM implementations as --impl names them: a release
(vllm@0.33.0, from its wheel in light mode, any release the package registry
has), a source tree (vllm@path/to/checkout, the folder that holds vllm/), or
the installed vLLM (vllm). Reported at the pool level: the BlockPool's API
(methods and parameters added, removed, changed), the facts kvspec reads or
declares (the null block, touch's shape, the hash key, the caller-mistake
reactions, each probe's verdict), and each behaviour change with a witness: a
trace that conforms on one side and not on the other, replayable on each with
kvspec replay (--html-dir: also a step-through page of it, A beside B).

Exit codes: 0 no change found (or only changes --accept lists), 1 a change
found (so a CI that pins "no change" fails on one), 2 no answer (a name that
loads no vLLM, a bad flag). --accept FILE lists the changes a pull request
means to make (kind and what, as --json writes them).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from kvspec.conformance.core.files import read_text_file
from kvspec.conformance.runner.registry import FactoryError
from kvspec.conformance.tools.commands._arguments import (
    DEFAULT_TRACE_DIR,
    json_output,
    output_dir,
    positive_int,
    text_for_people,
)
from kvspec.conformance.tools.commands._check_output import write_json
from kvspec.conformance.tools.vllm_diff import changes_json, diff_vllm, format_changes

__all__ = ["accepted_changes", "register", "run"]

MAX_EXAMPLES = 10_000  # per campaign; the default is enough to find a changed free order in a few steps


def register(subparsers: Any) -> None:
    """Add the `diff` subcommand."""
    p = subparsers.add_parser(
        "diff",
        help="what changed in vLLM's block pool between two vLLMs (exit 1 when something did)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("a", metavar="A", help="the vLLM before: vllm@<release>, vllm@<dir> or vllm")
    p.add_argument("b", metavar="B", help="the vLLM after, named the same ways")
    p.add_argument("--max-examples", type=positive_int, default=100, metavar="N",
                   help=f"examples per campaign, one campaign per side, profile and caching setting "
                   f"(default 100, at most {MAX_EXAMPLES})")  # fmt: skip
    p.add_argument("--trace-dir", type=output_dir, default=DEFAULT_TRACE_DIR, metavar="DIR",
                   help=f"where the witnesses are written (default ./{DEFAULT_TRACE_DIR})")  # fmt: skip
    p.add_argument("--html-dir", type=output_dir, metavar="DIR",
                   help="also write each witness as a step-through page here, A beside B")  # fmt: skip
    p.add_argument("--json", type=json_output, metavar="PATH", help="also write the changes as JSON (- for stdout)")
    p.add_argument("--accept", type=Path, metavar="FILE",
                   help="changes that are expected (a --json file, or a list of {kind, what}): "
                   "only others exit 1")  # fmt: skip
    p.set_defaults(run=run)


def accepted_changes(path: Path) -> set[tuple[str, str]]:
    """The (kind, what) of each change a --accept file lists (the --json form, or its list of changes).

    Raises:
        ValueError: the file cannot be read as such a list (the message says why).
    """
    try:
        data = json.loads(read_text_file(path))
        listed = data["changes"] if isinstance(data, dict) else data
        return {(str(c["kind"]), str(c["what"])) for c in listed}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"--accept: cannot read {path} as a list of changes ({type(e).__name__}: {e})") from None
    except RecursionError:  # json's parser recurses once per level of nesting
        raise ValueError(f"--accept: cannot read {path} as a list of changes (nested too deep)") from None


def run(args: argparse.Namespace) -> int:
    """Diff A and B; print the changes; exit 1 if there are any."""
    names = [args.a, args.b]
    not_vllm = [n for n in names if n != "vllm" and not n.startswith("vllm@")]
    if not_vllm:
        print(f"kvspec diff: {not_vllm[0]!r} is not a vLLM: name vllm@<release>, vllm@<dir> or vllm", file=sys.stderr)
        return 2
    if args.max_examples > MAX_EXAMPLES:
        print(f"kvspec diff: --max-examples: at most {MAX_EXAMPLES}; got {args.max_examples}", file=sys.stderr)
        return 2
    try:
        accepted = accepted_changes(args.accept) if args.accept else set()
    except ValueError as e:
        print(f"kvspec diff: {e}", file=sys.stderr)
        return 2
    logging.disable(logging.WARNING)  # vLLM logs every refused reset; the changes say it all
    try:
        changes = diff_vllm(args.a, args.b, max_examples=args.max_examples, trace_dir=args.trace_dir,
                            html_dir=args.html_dir,
                            log=lambda msg: print(f"  {msg}", file=sys.stderr, flush=True))  # fmt: skip
    except FactoryError as e:
        print(f"kvspec diff: {e}", file=sys.stderr)
        return 2
    unexpected = [c for c in changes if (c.kind, c.what) not in accepted]
    with text_for_people(args.json):
        print(format_changes(args.a, args.b, changes))
        if accepted:
            print(f"\n{len(changes) - len(unexpected)} change(s) accepted by {args.accept}, {len(unexpected)} not")
    if args.json is not None and write_json(changes_json(args.a, args.b, changes), args.json, prog="kvspec diff"):
        return 2
    return 1 if unexpected else 0
