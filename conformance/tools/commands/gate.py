"""`kvspec gate PR BASE --out DIR`: the gate of a vLLM pull request, in light mode.

PR and BASE are vLLM source trees (the folders that hold vllm/): the pull
request's checkout and its merge base's. Nothing is built or installed: each
tree's vllm/v1/core is loaded where it is. Two checks, their files in DIR:

1. the pull request against the spec (kvspec check --impl vllm@PR, pool
   level, caching on and off): kvspec.xml (JUnit), traces/, pages/;
2. what it changes against its merge base (kvspec diff vllm@BASE vllm@PR):
   changes.json, each behaviour change with its witness trace in traces/.

Exit 0: it conforms and changes nothing but what --accept lists; 1: it
diverges from the spec or changes something else (the traces and pages say
where); 2: no answer. A pull request that means to change behaviour commits
the changes it makes (changes.json's, or a list of {"kind", "what"}) and
names that file with --accept. The workflow that runs it:
examples/ci/vllm-pull-request.yml.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from kvspec.conformance.targets.vllm.lightmode import LightModeError, tree_package
from kvspec.conformance.tools.commands import check, diff
from kvspec.conformance.tools.commands._arguments import output_dir

__all__ = ["register", "run"]


def register(subparsers: Any) -> None:
    """Add the `gate` subcommand."""
    p = subparsers.add_parser(
        "gate",
        help="a vLLM pull request's gate: its checkout against the spec and against its merge base (light mode)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("pr", type=_vllm_tree, metavar="PR",
                   help="the pull request's vLLM checkout (the folder that holds vllm/)")  # fmt: skip
    p.add_argument("base", type=_vllm_tree, metavar="BASE", help="its merge base's checkout")
    p.add_argument("--out", type=output_dir, required=True, metavar="DIR",
                   help="where the reports, traces and pages go")  # fmt: skip
    p.add_argument("--accept", type=_readable_file, metavar="FILE",
                   help="the changes the pull request means to make")  # fmt: skip
    p.set_defaults(run=run)


def _vllm_tree(text: str) -> str:
    """A vLLM checkout: a folder that holds vllm/ (a release number is `kvspec diff`'s, not the gate's)."""
    path = Path(text)
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"no such folder {text}")
    if not (path / "vllm").is_dir():
        raise argparse.ArgumentTypeError(f"{text} holds no vllm/ folder: not a vLLM checkout")
    try:  # what both stages load: a tree without it would be refused twice, after the first stage ran
        tree_package(path, text)
    except LightModeError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _readable_file(text: str) -> Path:
    """A file that exists and can be read as the diff reads it, checked before either stage runs (a malformed
    one would otherwise be found only by the diff, after the check)."""
    path = Path(text)
    if not path.is_file() or not os.access(path, os.R_OK):
        raise argparse.ArgumentTypeError(f"no readable file {text}")
    try:
        diff.accepted_changes(path)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--accept: ")) from None
    return path


def _run(command: Any, argv: list[str]) -> int:
    """One subcommand's run, its arguments parsed by its own parser (as the command line would)."""
    parser = argparse.ArgumentParser(prog="kvspec")
    command.register(parser.add_subparsers(dest="command"))
    parsed = parser.parse_args(argv)
    code: int = parsed.run(parsed)
    return code


def run(args: argparse.Namespace) -> int:
    """Check, then diff; the worse of the two exit codes (2 before 1 before 0)."""
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    pr, base = f"vllm@{args.pr}", f"vllm@{args.base}"
    print(f"== {pr} against the spec", flush=True)
    checked = _run(check, [
        "check", "--impl", pr, "--level", "pool", "--junit", str(out / "kvspec.xml"),
        "--trace-dir", str(out / "traces"), "--html-dir", str(out / "pages"),
    ])  # fmt: skip
    print(f"\n== {pr} against {base}", flush=True)
    accept = ["--accept", str(args.accept)] if args.accept else []
    changed = _run(diff, ["diff", base, pr, "--json", str(out / "changes.json"),
                          "--trace-dir", str(out / "traces"), "--html-dir", str(out / "pages"), *accept])  # fmt: skip
    print(f"\nkvspec gate: check exit {checked}, diff exit {changed} (0 pass, 1 a finding, 2 no answer)")
    return 2 if 2 in (checked, changed) else max(checked, changed)
