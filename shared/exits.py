"""Every `dfpipe` command's exit status, one meaning each.

A scheduler, a shell script and a person read the same number: 0 is done, a code below 64 says what went
wrong, 75 says "stopped on request, nothing lost, run the same command again to go on". `docs/reference.md`
renders this table; `tests/test_exits.py` checks that no command returns a bare integer.
"""

from __future__ import annotations

from enum import IntEnum


class Exit(IntEnum):
    OK = 0  # done: the command did what it was asked
    FAILED = 1  # it ran and the outcome is a failure: items that failed (replay), an eval that was not lossless,
    #             a chaos check that failed, an unhealthy stack; also Python's own status for an uncaught error
    USAGE = 2  # bad arguments, config, input or run name: refused before any work (argparse uses 2 as well)
    HALTED = 3  # a worker stopped by a fault of its settings (shared.bus.Halt, a misconfigured store)
    QUALITY_GATE = 4  # the tokenizer's quality gate tripped: the data is not fit to train on
    CRASH_LOOP = 5  # `dfpipe run`: a service crash-looped and was not restarted; the run stopped
    EVAL_FAILED = 6  # `dfpipe run`: training finished but the eval did not
    ALERT = 7  # `dfpipe status`: the run has a critical alert open
    UNREACHABLE = 8  # NATS or S3 did not answer within the command's bound
    BUSY = 9  # another process holds the run's lease (a trainer is already training this run)
    STOPPED = 75  # stopped by a signal after draining: nothing lost, the same command resumes (EX_TEMPFAIL)
    INTERRUPTED = 130  # a one-shot command interrupted by Ctrl-C (128 + SIGINT)

    @property
    def meaning(self) -> str:
        return _MEANINGS[self]


_MEANINGS = {
    Exit.OK: "done",
    Exit.FAILED: "ran, and the outcome is a failure (failed items, eval not lossless, chaos check failed, "
                 "unhealthy stack, an unexpected error)",
    Exit.USAGE: "bad arguments, config, input or run name; nothing was started",
    Exit.HALTED: "a worker stopped by a fault of its settings (bad credentials, wrong bucket, ...)",
    Exit.QUALITY_GATE: "the tokenizer's quality gate tripped: the data is not fit to train on",
    Exit.CRASH_LOOP: "`dfpipe run`: a service crash-looped and was not restarted",
    Exit.EVAL_FAILED: "`dfpipe run`: training finished, the eval failed",
    Exit.ALERT: "`dfpipe status`: a critical alert is open",
    Exit.UNREACHABLE: "NATS or S3 did not answer within the command's bound",
    Exit.BUSY: "another process holds the run's lease (a second trainer on the same run)",
    Exit.STOPPED: "stopped by a signal after draining; nothing lost, run the same command again to resume",
    Exit.INTERRUPTED: "a one-shot command interrupted (Ctrl-C)",
}


def table() -> str:
    """The exit codes as a Markdown table (docs/reference.md)."""
    rows = ["| code | name | meaning |", "|---|---|---|"]
    rows += [f"| {e.value} | `{e.name}` | {e.meaning} |" for e in Exit]
    return "\n".join(rows)
