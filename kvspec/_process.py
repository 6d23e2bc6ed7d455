"""What kvspec's own processes share about their parents, for the entry point and the runner alike.

Light on purpose (the standard library only): the entry point imports it before kvspec's modules load.
"""

from __future__ import annotations

import os
import signal
import sys

__all__ = ["end_with_parent"]

PR_SET_PDEATHSIG = 1  # prctl's option: the signal this process gets when its parent ends (<linux/prctl.h>)


def end_with_parent(parent: int, status: int) -> None:
    """In a forked child: be killed when `parent` is (Linux), so a parent killed by a signal (a runner's
    timeout, a `kill`) leaves none of kvspec's work running on, for ever and holding the caller's output open.
    Where the parent has already gone, end now with `status`. Elsewhere, or without prctl, nothing is done:
    the child outlives a killed parent, as any process does."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes  # only here: its import costs milliseconds no other platform need pay

    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # no prctl to call
        return
    if os.getppid() != parent:  # the parent was killed before prctl took effect
        os._exit(status)
