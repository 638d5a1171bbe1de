"""Child processes that never outlive the process that started them.

The supervisor (`up`, the demo, the tests) starts the broker and every stage as child processes.
If the supervisor itself is SIGKILLed it gets no chance to stop them, and they would keep their
ports and consumer-group memberships with parent PID 1. Linux's parent-death signal closes that
gap: the kernel sends the child SIGKILL when its parent exits, however it exits.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable

PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def die_with_parent() -> Callable[[], None] | None:
    """A Popen ``preexec_fn`` that makes the child get SIGKILL when this process exits.

    The signal follows the *thread* that forked the child: start children from a thread that
    lives as long as they should (the main thread, as `up` does). None off Linux.
    """
    if not sys.platform.startswith("linux"):
        return None
    parent = os.getpid()
    libc = ctypes.CDLL(None, use_errno=True)

    def preexec() -> None:  # runs in the child between fork and exec
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            os._exit(126)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return preexec
