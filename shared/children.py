"""Child processes that do not outlive the process that started them, even when it is killed -9.

A service `dfpipe run` supervises, or the SGLang server a generator launched, is started in a session of
its own (a terminal's Ctrl-C is the parent's to relay, not the child's to take). Then nothing stops it when
its parent dies without running its cleanup: a generator killed at the end of its grace left its engine
decoding on the GPU, and the restarted generator's own launch met the port still taken. On Linux the kernel
can send the child a signal when its parent dies (PR_SET_PDEATHSIG); that is set in the child before it runs.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
from collections.abc import Callable

PR_SET_PDEATHSIG = 1
_prctl = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True).prctl if sys.platform == "linux" else None


def dies_with_parent(sig: signal.Signals = signal.SIGTERM) -> Callable[[], None] | None:
    """A `preexec_fn` that has the kernel send `sig` to the child when the process starting it dies; None where
    the kernel cannot (not Linux). The kernel watches the thread that forks: start the child from the thread
    that lives as long as the process (the event loop's), never from a worker thread."""
    if _prctl is None:
        return None
    parent = os.getpid()

    def preexec() -> None:  # in the child, between fork and exec: no imports, no locks
        _prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the line above took effect
            os.kill(os.getpid(), sig)

    return preexec
