"""The one failure policy: what an error means (`classify`), and the one way a call is retried (`retry_call`,
`retry_async`).

An error is classified once, by what it is, not by where it was caught:

* TRANSIENT: the world will change (a server down or restarting, a timeout, HTTP 5xx, S3 SlowDown). A call is
  retried with backoff until its deadline; a message whose handler failed so is redelivered with backoff.
* FATAL: the fault is the worker's own settings (S3 refusing its credentials, its bucket gone, `Halt`). No
  retry helps until a person fixes them: the worker puts its message back and stops, saying why.
* POISON: this message can never succeed (malformed, refused by the engine): dead-letter it now.
* ERROR: nothing says it will pass (a bug, an unexpected answer). A call is not retried (retrying would hide
  it); a message is redelivered up to its `max_deliver`, then dead-lettered with the traceback.

Our exceptions declare their class with a `failure` attribute. Errors of a library are declared transient by
the module that owns the library (`declare_transient`, at import: shared.bus for nats, shared.store for
urllib3, the HTTP backends for httpx), so no other module needs to know them. Built in: ConnectionError,
TimeoutError (asyncio's and nats' timeouts too) and the network errnos of OSError.

Backoff everywhere is `backoff_s`: exponential from `base_s`, capped at `cap_s`, ×[0.8, 1.2) jitter so that
workers restarted together do not retry together. The retry helpers use tenacity for the loop (attempt
state, the sync and the async variant from one policy); the policy itself (which errors, which delays, the
deadline, one warning per attempt) is this module's.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import errno
import logging
import random
import re
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import tenacity

log = logging.getLogger("dflash.retry")
T = TypeVar("T")


class Failure(enum.Enum):
    TRANSIENT = "transient"
    FATAL = "fatal"
    POISON = "poison"
    ERROR = "error"


# --- outcomes a handler raises ------------------------------------------------------------------


class Retry(Exception):
    """Transient failure: redeliver later (after `delay_s`, else the usual backoff)."""

    failure = Failure.TRANSIENT

    def __init__(self, reason: str, delay_s: float | None = None) -> None:
        super().__init__(reason)
        self.delay_s = delay_s


class Poison(Exception):
    """This message can never succeed: dead-letter it now."""

    failure = Failure.POISON


class Halt(Exception):
    """This worker can do no work as it is configured: put the message back and stop the worker."""

    failure = Failure.FATAL  # also what `dfpipe`'s exit code reads (shared.cli)


class GaveUp(Exception):
    """A transient failure outlasted its call's deadline. Still transient: a caller above may wait longer."""

    failure = Failure.TRANSIENT

    def __init__(self, name: str, attempts: int, elapsed_s: float, last: BaseException) -> None:
        super().__init__(redact(f"{name} failed {attempts} times over {elapsed_s:.0f}s; last error: {describe(last)}"))
        self.attempts, self.elapsed_s, self.last = attempts, elapsed_s, last


# --- classification -----------------------------------------------------------------------------

# socket.gaierror: a host name that does not resolve now (DNS) may resolve later.
_TRANSIENT: list[type[BaseException]] = [ConnectionError, TimeoutError, socket.gaierror]
_NETWORK_ERRNOS = {errno.ENETUNREACH, errno.EHOSTUNREACH, errno.ENETDOWN, errno.ENETRESET, errno.ECONNABORTED,
                   errno.ECONNREFUSED, errno.ECONNRESET, errno.ETIMEDOUT, errno.EPIPE, errno.EAGAIN}


def declare_transient(*types: type[BaseException]) -> None:
    """Declare a library's errors transient; called once by the module that owns the library."""
    _TRANSIENT.extend(t for t in types if t not in _TRANSIENT)


def classify(e: BaseException) -> Failure:
    """What `e` means: its declared `failure`, else transient if it is a declared or a network error, else ERROR."""
    declared = getattr(e, "failure", None)
    if isinstance(declared, Failure):
        return declared
    if isinstance(e, tuple(_TRANSIENT)):
        return Failure.TRANSIENT
    if isinstance(e, OSError) and e.errno in _NETWORK_ERRNOS:
        return Failure.TRANSIENT
    return Failure.ERROR


# --- backoff and logging ------------------------------------------------------------------------

CALL_BASE_S, CALL_CAP_S = 0.2, 5.0  # a call: first retry soon, then at most every 5 s


def backoff_s(attempt: int, base_s: float = CALL_BASE_S, cap_s: float = CALL_CAP_S) -> float:
    """The delay after failed attempt number `attempt` (1-based): base·2^(attempt−1), capped, jittered."""
    doublings = min(max(0, attempt - 1), 60)  # a retry-forever loop reaches attempt 1024: 2**1023 overflows a float
    return min(cap_s, base_s * 2.0 ** doublings) * (0.8 + 0.4 * random.random())


_URL_USERINFO = re.compile(r"(?<=://)[^/@\s]+@")


def redact(text: str) -> str:
    """`text` with the `user:password@` of any URL in it blanked: what goes into a log line or an error."""
    return _URL_USERINFO.sub("***@", text)


def describe(e: BaseException) -> str:
    """`Type: message`, one line, redacted."""
    text = f"{type(e).__name__}: {e}".strip().splitlines()
    return redact(text[-1] if text else type(e).__name__)


# --- the retry helpers --------------------------------------------------------------------------


def _policy(name: str, deadline_s: float | None, base_s: float, cap_s: float,
            on_failure: Callable[[BaseException], None] | None, stop_event: asyncio.Event | None) -> dict[str, Any]:
    """One tenacity configuration for both helpers: retry TRANSIENT only, backoff_s waits that never sleep
    past the deadline, give up once the deadline has passed (or `stop_event` is set), one warning per retry."""

    def wait(state: tenacity.RetryCallState) -> float:
        delay = backoff_s(state.attempt_number, base_s, cap_s)
        if deadline_s is not None:
            delay = min(delay, max(0.0, deadline_s - state.seconds_since_start))
        return delay

    def stop(state: tenacity.RetryCallState) -> bool:
        over = deadline_s is not None and (state.seconds_since_start or 0.0) >= deadline_s
        return over or (stop_event is not None and stop_event.is_set())

    def before_sleep(state: tenacity.RetryCallState) -> None:
        error = state.outcome.exception() if state.outcome else None
        if error is not None and on_failure is not None:
            on_failure(error)
        log.warning("%s failed (attempt %d), retrying in %.1fs: %s", redact(name), state.attempt_number,
                    state.upcoming_sleep, describe(error) if error else "?")

    def gave_up(state: tenacity.RetryCallState) -> Any:
        error = state.outcome.exception() if state.outcome else None
        assert error is not None  # only failed attempts are retried
        if on_failure is not None:
            on_failure(error)
        if stop_event is not None and stop_event.is_set():
            raise error
        raise GaveUp(name, state.attempt_number, state.seconds_since_start or 0.0, error) from None

    return dict(retry=tenacity.retry_if_exception(lambda e: classify(e) is Failure.TRANSIENT),
                wait=wait, stop=stop, before_sleep=before_sleep, retry_error_callback=gave_up)


def retry_call(name: str, fn: Callable[[], T], *, deadline_s: float | None, base_s: float = CALL_BASE_S,
               cap_s: float = CALL_CAP_S, on_failure: Callable[[BaseException], None] | None = None) -> T:
    """`fn()`, retried while it fails TRANSIENT, until `deadline_s` (None: forever); then `GaveUp`.

    Any other failure is raised at once, unchanged. `name` says what is attempted in the warnings (never a
    credential). `on_failure` sees every failed attempt that is retried or given up on (e.g. a counter).
    """
    policy = _policy(name, deadline_s, base_s, cap_s, on_failure, None)
    return tenacity.Retrying(sleep=time.sleep, **policy)(fn)


async def retry_async(name: str, fn: Callable[[], Awaitable[T]], *, deadline_s: float | None,
                      base_s: float = CALL_BASE_S, cap_s: float = CALL_CAP_S,
                      on_failure: Callable[[BaseException], None] | None = None,
                      stop_event: asyncio.Event | None = None) -> T:
    """`await fn()` under the same policy as `retry_call`. `stop_event` set: no more attempts (a shutdown);
    the last error is raised as it is, and a backoff wait under way ends at once."""

    async def sleep(seconds: float) -> None:
        if stop_event is None:
            await asyncio.sleep(seconds)
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop_event.wait(), timeout=seconds)

    async def attempt() -> T:  # tenacity awaits only coroutine functions; `fn` may be a lambda or a partial
        return await fn()

    policy = _policy(name, deadline_s, base_s, cap_s, on_failure, stop_event)
    return await tenacity.AsyncRetrying(sleep=sleep, **policy)(attempt)
