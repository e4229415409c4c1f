"""The failure policy (shared.failures): how errors are classified, and the one retry helper.

Pure: no server. Sleeps are recorded instead of timed, so the assertions are about what the
helper did: which attempts it made, how long it chose to wait, when it gave up.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import time

import nats.errors
import pytest
import urllib3

import shared.bus  # noqa: F401 - declares nats' errors transient, as it does in every service
from services.generator.backends import EngineError, PromptRefused
from shared.failures import (  # the one module services import failure types from
    Failure,
    GaveUp,
    Halt,
    Poison,
    Retry,
    backoff_s,
    classify,
    describe,
    retry_async,
    retry_call,
)
from shared.store import (
    KeyNotFound,
    ObjectConflict,
    StoreAuthError,
    StoreError,
    StoreMisconfigured,
    StoreUnavailable,
)


@pytest.mark.parametrize("error, failure", [
    (Retry("engine busy"), Failure.TRANSIENT),
    (StoreUnavailable("S3 down for 120 s"), Failure.TRANSIENT),
    (EngineError("HTTP 503"), Failure.TRANSIENT),
    (ConnectionRefusedError(errno.ECONNREFUSED, "refused"), Failure.TRANSIENT),
    (TimeoutError(), Failure.TRANSIENT),
    (OSError(errno.EHOSTUNREACH, "no route to host"), Failure.TRANSIENT),
    (socket.gaierror(-3, "Temporary failure in name resolution"), Failure.TRANSIENT),
    (nats.errors.NoServersError(), Failure.TRANSIENT),
    (nats.errors.TimeoutError(), Failure.TRANSIENT),
    (urllib3.exceptions.NewConnectionError(None, "refused"), Failure.TRANSIENT),
    (Halt("no GPU"), Failure.FATAL),
    (StoreMisconfigured("bucket gone"), Failure.FATAL),
    (StoreAuthError("AccessDenied"), Failure.FATAL),
    (Poison("malformed"), Failure.POISON),
    (PromptRefused("HTTP 400: too long"), Failure.POISON),
    (KeyNotFound("s3://b/k does not exist"), Failure.ERROR),  # an OSError by its base, but not a network one
    (OSError(errno.ENOSPC, "no space left"), Failure.ERROR),
    (StoreError("S3 put failed: InvalidArgument"), Failure.ERROR),
    (ObjectConflict("different content"), Failure.ERROR),
    (ValueError("a bug"), Failure.ERROR),
])
def test_each_error_is_classified_once_by_what_it_is(error: BaseException, failure: Failure) -> None:
    assert classify(error) is failure


class Flaky:
    """Fails with `errors` in turn, then returns "ok"; counts calls."""

    def __init__(self, *errors: BaseException) -> None:
        self.errors, self.calls = list(errors), 0

    def __call__(self) -> str:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return "ok"


@pytest.fixture
def sleeps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The waits the sync helper chose (each slept for real: the deadlines below are short)."""
    chosen: list[float] = []
    real = time.sleep

    def fake(seconds: float) -> None:
        chosen.append(seconds)
        real(seconds)

    monkeypatch.setattr(time, "sleep", fake)
    return chosen


def test_transient_failures_are_retried_with_one_warning_each(sleeps: list[float], caplog) -> None:
    fn = Flaky(ConnectionResetError(errno.ECONNRESET, "reset"), StoreUnavailable("down"))
    with caplog.at_level(logging.WARNING, logger="dflash.retry"):
        assert retry_call("S3 put runs/r/x", fn, deadline_s=60, base_s=0.01) == "ok"
    assert fn.calls == 3 and len(sleeps) == 2
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2
    assert all("S3 put runs/r/x" in w for w in warnings)
    assert "attempt 1" in warnings[0] and "ConnectionResetError" in warnings[0]
    assert "attempt 2" in warnings[1] and "StoreUnavailable" in warnings[1]


@pytest.mark.parametrize("error", [ValueError("a bug"), Halt("no GPU"), Poison("bad"), StoreAuthError("denied")])
def test_what_is_not_transient_is_raised_at_once(error: BaseException, sleeps: list[float], caplog) -> None:
    fn = Flaky(error)
    with pytest.raises(type(error)) as raised:
        retry_call("op", fn, deadline_s=60)
    assert raised.value is error and fn.calls == 1 and sleeps == [] and not caplog.records


def test_the_deadline_is_honoured_and_no_wait_runs_past_it(sleeps: list[float]) -> None:
    seen: list[BaseException] = []
    always = Flaky(*[TimeoutError(f"t{i}") for i in range(10_000)])
    with pytest.raises(GaveUp) as raised:
        retry_call("connect", always, deadline_s=0.6, base_s=0.02, cap_s=0.1, on_failure=seen.append)
    gave_up = raised.value
    assert gave_up.elapsed_s >= 0.6  # it kept trying until the deadline...
    assert sum(sleeps) <= 0.6 + 1e-6  # ...and never chose to sleep beyond it
    assert max(sleeps) < 0.1 * 1.2  # each wait capped
    assert gave_up.attempts == always.calls == len(sleeps) + 1 == len(seen)
    assert isinstance(gave_up.last, TimeoutError) and str(gave_up.last) == f"t{always.calls - 1}"
    assert classify(gave_up) is Failure.TRANSIENT  # a caller above may wait longer
    assert f"failed {always.calls} times" in str(gave_up)


def test_backoff_doubles_from_its_base_and_is_capped_with_jitter() -> None:
    for attempt in range(1, 40):
        ideal = min(5.0, 0.2 * 2 ** (attempt - 1))
        for _ in range(20):
            assert 0.8 * ideal <= backoff_s(attempt, 0.2, 5.0) < 1.2 * ideal
    assert backoff_s(100_000, 0.2, 5.0) < 6.0  # a retry-forever loop's late attempts: capped, no overflow
    assert len({backoff_s(3) for _ in range(20)}) > 1  # jittered: workers restarted together spread out


def test_async_helper_retries_then_returns_and_stops_on_the_stop_event() -> None:
    async def scenario() -> None:
        flaky = Flaky(nats.errors.NoServersError(), nats.errors.NoServersError())

        async def call() -> str:
            return flaky()

        assert await retry_async("connect", call, deadline_s=None, base_s=0.01, cap_s=0.02) == "ok"
        assert flaky.calls == 3
        flaky.errors = [nats.errors.NoServersError()]
        assert await retry_async("connect", lambda: call(), deadline_s=None, base_s=0.01) == "ok"  # not a coroutine fn
        assert flaky.calls == 5

        stop = asyncio.Event()
        down = Flaky(*[nats.errors.NoServersError() for _ in range(10_000)])

        async def never() -> str:
            return down()

        asyncio.get_running_loop().call_later(0.05, stop.set)  # a shutdown while the server is away
        with pytest.raises(nats.errors.NoServersError):  # the last error, as it is
            # a 60 s wait that must end when stop is set (else wait_for's TimeoutError fails the test)
            await asyncio.wait_for(
                retry_async("fetch", never, deadline_s=None, base_s=60.0, cap_s=60.0, stop_event=stop), 20)
        assert down.calls == 2  # the attempt that was waiting, then none after the stop

    asyncio.run(scenario())


def test_logged_errors_carry_no_url_credentials() -> None:
    text = describe(ConnectionError("cannot reach nats://alice:s3cret@10.0.0.5:4222 (refused)"))
    assert "s3cret" not in text and "alice" not in text and "10.0.0.5:4222" in text
    gave_up = GaveUp("connect to NATS at nats://alice:s3cret@h:4222", 3, 10.0, TimeoutError())
    assert "s3cret" not in str(gave_up)
