"""The `kvspec` command's entry point, and `python -m kvspec`'s.

kvspec's modules take a second or so to load; a Ctrl-C meanwhile ends the command as one during its work
does (one line, exit 130), not with the traceback of whatever module was loading.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

# kvspec.conformance.core.results.EXIT_INTERRUPTED, which cannot be imported before the modules load
# (tests/conformance/test_ctrl_c.py holds the two equal).
EXIT_INTERRUPTED = 130


def main(argv: Sequence[str] | None = None) -> int:
    """Load the command line and run it on `argv` (None: the process's arguments); its exit code."""
    try:
        from kvspec.conformance.tools.cli import main as run_command
    except KeyboardInterrupt:
        print("kvspec: interrupted (Ctrl-C): no verdict", file=sys.stderr)
        return EXIT_INTERRUPTED
    return run_command(argv)
