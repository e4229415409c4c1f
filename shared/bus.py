"""NATS JetStream: the only module that imports `nats` (tests/test_imports.py checks it).

It owns the consumers (the stream table is shared.topology's), publishing with `Nats-Msg-Id`, and the
worker loop (fetch → handle → ack / nak with backoff / dead letter), so that a service only writes a
handler. The loop's rules, in one place:

* A handler returning normally means "the result is durable and its event is published":
  the message is acked (write-then-ack). Long handlers are kept alive with `in_progress()`
  every ack_wait/3, so ack_wait stays short (about a minute) and a dead worker's messages
  come back quickly.
* A handler's exception is classified once, by the failure policy (shared.failures.classify):
  - transient (`Retry`, S3 or NATS unavailable) or unexplained: nak with exponential backoff, until the
    delivery count reaches `max_deliver`; then a DeadLetter with the last error goes to the DEADLETTER
    stream and the message is terminated (which deletes it from a work queue).
  - poison (`Poison`): dead-lettered at once (malformed payloads too).
  - fatal (`Halt`, S3 refusing the worker's credentials, its bucket gone): the fault is the worker's,
    not the message's. The message is nak'ed for another worker, nothing is dead-lettered, the loop
    stops taking work, a critical Alert says why, and `work` raises `Halt`: a worker that cannot
    write must not burn its queue's deliveries into the dead letters.
* Every read of run state (stream and consumer state, logs, last messages), and the set-up calls (streams,
  consumers), is a method here that runs under the failure policy with `BusConfig.read_deadline_s`: a leader election or a node's restart is retried
  through, a longer outage raises `GaveUp` (transient), which a reader reports in one line. A missing stream
  or consumer is an answer (None), not an error.
* The server-side consumer has no max_deliver (-1). A message whose worker died on its last
  allowed delivery is dead-lettered by the next worker that sees it, instead of lingering in
  the work queue forever (what a server-side max_deliver does to work-queue messages).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import time
import traceback
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

import msgspec
import nats
import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js import api

from shared.config import BusConfig
from shared.failures import (
    Failure,
    GaveUp,
    Halt,
    Retry,
    backoff_s,
    classify,
    declare_transient,
    describe,
    redact,
    retry_async,
)
from shared.messages import Alert, DeadLetter, Message, MessageError, decode, encode
from shared.topology import LEASES_BUCKET, Streams, Subjects, durable, stage_input, streams

log = logging.getLogger("dflash.bus")

MSG_ID = "Nats-Msg-Id"
PUBLISH_ACK_WAIT_S = 10.0  # an async publish's ack later than this is taken as lost (JetStream acks in ms)
T = TypeVar("T")

# The server is down, restarting or electing: nats' errors for "not now" (shared.failures). Its timeouts are
# TimeoutErrors already.
declare_transient(
    nats.errors.NoServersError, nats.errors.ConnectionClosedError, nats.errors.ConnectionReconnectingError,
    nats.errors.StaleConnectionError, nats.errors.OutboundBufferLimitError, nats.errors.NoRespondersError,
    nats.js.errors.ServiceUnavailableError, nats.js.errors.NoStreamResponseError,
)


# --- consumers (the stream table is shared.topology's) -------------------------------------------


@dataclass(frozen=True)
class ConsumerSpec:
    stream: str
    durable: str
    filter_subject: str
    ack_wait_s: float = 60.0
    max_ack_pending: int = 256
    max_deliver: int = 5  # enforced by the worker loop (see module doc)
    stage: str = ""


def consumer_for(stage: str, run: str, *, ack_wait_s: float = 60.0, max_ack_pending: int = 256,
                 max_deliver: int = 5) -> ConsumerSpec:
    """The durable consumer each stage shares between all its workers, one per run."""
    stream, subject = stage_input(stage, run)
    return ConsumerSpec(stream, durable(stage, run), subject, ack_wait_s, max_ack_pending, max_deliver, stage)


# --- what readers get back (no nats type leaves this module) -------------------------------------


@dataclass(frozen=True)
class StreamState:
    first_seq: int
    last_seq: int
    created: str  # ISO time the stream was created: a recreated stream has another
    subjects: dict[str, int]  # messages per subject, when asked for with a filter
    work_queue: bool = False  # a work queue (PROMPTS) takes no second consumer: its log is read message by message


@dataclass(frozen=True)
class ConsumerState:
    name: str
    pending: int  # in the stream, not yet delivered to this consumer
    ack_pending: int  # delivered, not yet acked
    redelivered: int


def _transient_api_errors(fn: Callable[[], Awaitable[Any]]) -> Callable[[], Awaitable[Any]]:
    """A JetStream API answer of 5xx (a cluster without a leader for a moment) as the transient failure it is."""

    async def call() -> Any:
        try:
            return await fn()
        except nats.js.errors.ServerError as e:
            raise Retry(f"JetStream answered {e.code} {e.description}") from None

    return call


# --- handler outcomes --------------------------------------------------------------------------


@dataclass
class Delivery:
    msg: Msg
    data: Any
    num_delivered: int
    stream_seq: int

    async def in_progress(self) -> None:
        await self.msg.in_progress()


@dataclass
class WorkStats:
    acked: int = 0
    retried: int = 0
    dead_lettered: int = 0
    requeued_on_shutdown: int = 0
    last_error: str = ""
    errors: int = 0
    in_flight: int = 0
    halted: str = ""  # why the loop stopped on a fault of the worker's own (see Halt)


# --- the bus -----------------------------------------------------------------------------------


class Bus:
    def __init__(self, nc: nats.NATS, cfg: BusConfig, name: str = "dflash") -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.cfg = cfg
        self.name = name  # the connection's name: the worker, in alerts this module raises

    @classmethod
    async def connect(cls, cfg: BusConfig, name: str = "dflash", *, deadline_s: float | None = None) -> Bus:
        """Connect, retrying the first connection with backoff; afterwards reconnect forever.

        `deadline_s=None` waits for the server forever (services under a supervisor); a CLI
        passes a deadline so that a wrong URL is reported instead of hanging.
        """
        opts: dict[str, Any] = dict(
            servers=[s.strip() for s in cfg.url.split(",")],
            name=name,
            connect_timeout=cfg.connect_timeout_s,
            reconnect_time_wait=cfg.reconnect_wait_s,
            max_reconnect_attempts=-1,
            allow_reconnect=True,
        )
        if os.environ.get("DFLASH_NATS_TOKEN"):
            opts["token"] = os.environ["DFLASH_NATS_TOKEN"]
        if os.environ.get("DFLASH_NATS_USER"):
            opts["user"] = os.environ["DFLASH_NATS_USER"]
            opts["password"] = os.environ.get("DFLASH_NATS_PASSWORD", "")
        if cfg.creds_file:
            opts["user_credentials"] = cfg.creds_file

        async def _disconnected() -> None:
            log.info("disconnected from NATS (reconnecting unless closing)")

        async def _reconnected() -> None:
            log.info("reconnected to NATS")

        async def _error(e: Exception) -> None:
            log.debug("NATS client error: %s", e)

        opts.update(disconnected_cb=_disconnected, reconnected_cb=_reconnected, error_cb=_error)

        async def attempt() -> nats.NATS:
            # nats' first connect goes round the servers by itself, forever when reconnects are (max -1): the
            # deadline bounds it from outside, and a client given up on is closed, not left connecting
            nc = nats.NATS()
            try:
                if deadline_s is None:
                    await nc.connect(**opts)
                else:
                    try:
                        await asyncio.wait_for(nc.connect(**opts), timeout=deadline_s)
                    except TimeoutError:
                        raise ConnectionError(f"no server of {len(opts['servers'])} accepted a connection") from None
            except BaseException:
                with contextlib.suppress(Exception):
                    await nc.close()
                raise
            return nc

        try:
            nc = await retry_async(f"connect to NATS at {cfg.url}", attempt, deadline_s=deadline_s)
        except GaveUp as e:
            raise ConnectionError(redact(f"NATS at {cfg.url} unreachable for {deadline_s:.0f}s: {describe(e.last)}")) from None
        return cls(nc, cfg, name)

    async def close(self) -> None:
        if not self.nc.is_closed:
            with contextlib.suppress(Exception):
                await self.nc.drain()

    async def __aenter__(self) -> Bus:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- streams and consumers ------------------------------------------------------------------

    async def ensure_streams(self) -> None:
        """Create or update every stream in the table; safe on every start."""
        for spec in streams(self.cfg.progress_max_age_s):
            dup = self.cfg.duplicate_window_s if spec.duplicate_window_s is None else spec.duplicate_window_s
            if spec.max_age_s:
                dup = min(dup, spec.max_age_s)
            config = api.StreamConfig(
                name=spec.name,
                description=spec.description,
                subjects=list(spec.subjects),
                retention=api.RetentionPolicy.WORK_QUEUE if spec.work_queue else api.RetentionPolicy.LIMITS,
                storage=api.StorageType.FILE,
                num_replicas=self.cfg.replicas,
                max_age=spec.max_age_s or None,
                max_msgs_per_subject=spec.max_msgs_per_subject,
                discard=api.DiscardPolicy.NEW if spec.discard_new_per_subject else api.DiscardPolicy.OLD,
                discard_new_per_subject=spec.discard_new_per_subject,
                duplicate_window=dup,
                allow_direct=True,
            )
            await self._call(f"create or update stream {spec.name}", partial(self._put_stream, config))

    async def _put_stream(self, config: api.StreamConfig) -> None:
        try:
            await self.js.stream_info(config.name)
        except nats.js.errors.NotFoundError:
            await self.js.add_stream(config)
        else:
            await self.js.update_stream(config)

    async def ensure_consumer(self, spec: ConsumerSpec) -> api.ConsumerInfo:
        """Create or update a durable pull consumer (pull_subscribe would ignore a changed config)."""
        config = api.ConsumerConfig(
            durable_name=spec.durable,
            filter_subject=spec.filter_subject,
            ack_policy=api.AckPolicy.EXPLICIT,
            deliver_policy=api.DeliverPolicy.ALL,
            ack_wait=spec.ack_wait_s,
            max_ack_pending=spec.max_ack_pending,
            max_deliver=-1,
            max_waiting=512,
        )
        return await self._call(f"create consumer {spec.durable}", lambda: self.js.add_consumer(spec.stream, config))

    async def delete_consumer(self, stream: str, durable: str) -> bool:
        """Delete a durable consumer; False if there was none."""
        try:
            await self.js.delete_consumer(stream, durable)
        except nats.js.errors.NotFoundError:
            return False
        return True

    # --- publishing -----------------------------------------------------------------------------

    async def publish(self, subject: str, msg: Message, msg_id: str | None = None) -> api.PubAck:
        headers = {MSG_ID: msg_id} if msg_id else None
        return await self.js.publish(subject, encode(msg), headers=headers)

    async def publish_many(
        self, items: list[tuple[str, Message, str | None]], *, window: int = 2000
    ) -> list[api.PubAck]:
        """Async publishes with at most `window` unacknowledged; returns every PubAck in order.

        nats' async acks never time out by themselves: an ack lost with a server that died or is between
        leaders would hang the caller. An item with no ack after PUBLISH_ACK_WAIT_S, or refused, is published
        again with its message id under the failure policy; the server's duplicate window makes a second
        publish of a stored message a duplicate, never a second copy (its ack then says `duplicate`). An
        item without a message id is not published twice: its failure is raised."""
        acks: list[api.PubAck] = []
        for start in range(0, len(items), window):
            chunk = items[start:start + window]
            futures: list[asyncio.Future[api.PubAck] | None] = []
            for subject, msg, msg_id in chunk:
                try:
                    futures.append(await self.js.publish_async(
                        subject, encode(msg), headers={MSG_ID: msg_id} if msg_id else None))
                except Exception as e:
                    if classify(e) is not Failure.TRANSIENT:
                        raise
                    futures.append(None)  # not sent: published again below
            waiting = [f for f in futures if f is not None]
            if waiting:
                _, late = await asyncio.wait(waiting, timeout=PUBLISH_ACK_WAIT_S)
                for f in late:
                    f.cancel()  # frees nats' slot for it
            for (subject, msg, msg_id), f in zip(chunk, futures, strict=True):
                if f is not None and not f.cancelled() and f.exception() is None:
                    acks.append(f.result())
                    continue
                error = f.exception() if f is not None and not f.cancelled() else None
                if msg_id is None:
                    raise error or TimeoutError(f"no ack for a publish to {subject}")
                acks.append(await self._call(f"publish {msg_id}", partial(self.publish, subject, msg, msg_id)))
        return acks

    async def publish_raw(self, subject: str, payload: bytes, msg_id: str | None = None) -> api.PubAck:
        headers = {MSG_ID: msg_id} if msg_id else None
        return await self.js.publish(subject, payload, headers=headers)

    # --- reading run state (under the failure policy) ------------------------------------------------

    async def _call(self, what: str, fn: Callable[[], Awaitable[T]]) -> T:
        """`fn()` retried through a failover (BusConfig.read_deadline_s); then GaveUp."""
        return await retry_async(what, _transient_api_errors(fn), deadline_s=self.cfg.read_deadline_s)

    async def stream_state(self, stream: str, subjects_filter: str | None = None) -> StreamState | None:
        """The stream's sequences (and per-subject counts under `subjects_filter`); None if it does not exist."""

        async def info() -> StreamState | None:
            try:
                i = await self.js.stream_info(stream, subjects_filter=subjects_filter)
            except nats.js.errors.NotFoundError:
                return None
            created = getattr(i, "created", None)
            return StreamState(i.state.first_seq, i.state.last_seq, created.isoformat() if created is not None else "",
                               dict(i.state.subjects or {}), i.config.retention == api.RetentionPolicy.WORK_QUEUE)

        return await self._call(f"stream info {stream}", info)

    async def consumer_state(self, stream: str, durable: str) -> ConsumerState | None:
        """A durable consumer's queue; None if it (or its stream) does not exist."""

        async def info() -> ConsumerState | None:
            try:
                return _consumer_state(await self.js.consumer_info(stream, durable))
            except nats.js.errors.NotFoundError:
                return None

        return await self._call(f"consumer info {stream}/{durable}", info)

    async def consumer_states(self, stream: str) -> list[ConsumerState]:
        """Every consumer of `stream` (none if the stream does not exist)."""

        async def infos() -> list[ConsumerState]:
            try:
                return [_consumer_state(i) for i in await self.js.consumers_info(stream)]
            except nats.js.errors.NotFoundError:
                return []

        return await self._call(f"consumers of {stream}", infos)

    async def last_msg(self, stream: str, subject: str, *, direct: bool = False) -> bytes | None:
        """The payload of the last message on `subject`; None if there is none."""

        async def get() -> bytes | None:
            try:
                return (await self.js.get_last_msg(stream, subject, direct=direct)).data or b""
            except nats.js.errors.NotFoundError:
                return None

        return await self._call(f"last message {stream} {subject}", get)

    async def last_seq(self, stream: str) -> int:
        state = await self.stream_state(stream)
        return state.last_seq if state is not None else 0

    async def read_log(
        self, stream: str, subject: str, from_seq: int = 1, type: Any = None, *, batch: int = 1000
    ) -> AsyncIterator[tuple[int, Any]]:
        """Every message on `subject` from `from_seq` up to the stream's end when the read began, in order:
        the one log reader (a tail, a whole log, dead letters).

        Read in batches through a throwaway pull consumer (a tail of thousands costs a few round trips); a
        work queue, which admits no such consumer, by gets the stream's leader answers (one request per
        message). A consumer reads one replica, which may be behind: a read that ends before the log does is
        checked by one get from the leader, so a reader never takes a lagging replica's prefix for the whole
        log (tests/test_cluster.py). Each batch is one call under the failure policy: a failover mid-read (the
        consumer's server gone) re-reads that batch from where the read stands. A message this build cannot
        decode (a newer schema, garbage) is skipped with a warning naming it: a reader that raised on it
        would fail the same way at every restart.
        """
        state = await self.stream_state(stream)
        if state is None or state.last_seq < from_seq:
            return
        end = state.last_seq  # later messages are the next read's
        seq = max(1, from_seq)
        read_batch = self._log_batch_direct if state.work_queue else self._log_batch
        while seq <= end:
            got, more = await self._call(f"read {stream} {subject} from {seq}",
                                         partial(read_batch, stream, subject, seq, min(batch, end - seq + 1)))
            after = got[-1][0] + 1 if got else seq
            if not more and not state.work_queue and after <= end:
                # A read consumer lives on one replica, and a replica still catching up after its node came
                # back holds only a prefix of the log and says nothing more matches. The stream's leader
                # settles it with one get: a message it has up to `end` is read on from there.
                leader, _ = await self._call(f"check {stream} {subject} from {after}",
                                             partial(self._log_batch_direct, stream, subject, after, 1))
                if leader and leader[0][0] <= end:
                    log.debug("%s %s: the read's replica was behind at %d; reading on", stream, subject, after)
                    got, more = [*got, *leader], 1
            for at, data in got:
                if at > end:
                    return
                seq = at + 1
                try:
                    msg = decode(data, type) if type is not None else decode(data)
                except MessageError as e:  # one bad message must not stop every reader of the log
                    log.warning("%s seq %d skipped: %s", stream, at, e)
                    continue
                yield at, msg
            if not got or not more:
                return

    async def _log_batch(self, stream: str, subject: str, start: int, limit: int) -> tuple[list[tuple[int, bytes]], int]:
        """Up to `limit` (sequence, payload) on `subject` from `start`, and how many more matched then."""
        name = f"read-{secrets.token_hex(8)}"
        try:
            info = await self.js.add_consumer(stream, api.ConsumerConfig(
                name=name, filter_subject=subject, deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE,
                opt_start_seq=start, ack_policy=api.AckPolicy.NONE, inactive_threshold=60.0,
                mem_storage=True, num_replicas=1,
            ))
        except nats.js.errors.NotFoundError:  # the stream went away mid-read
            return [], 0
        try:
            matching = info.num_pending or 0
            want = min(limit, matching)
            out: list[tuple[int, bytes]] = []
            if want:
                sub = await self.js.pull_subscribe_bind(consumer=name, stream=stream)
                try:
                    while len(out) < want:
                        out.extend((m.metadata.sequence.stream, m.data) for m in await sub.fetch(want - len(out), timeout=10.0))
                finally:
                    with contextlib.suppress(Exception):
                        await sub.unsubscribe()
            return out, matching - len(out)
        finally:
            with contextlib.suppress(Exception):
                await self.js.delete_consumer(stream, name)

    async def _log_batch_direct(self, stream: str, subject: str, start: int,
                                limit: int) -> tuple[list[tuple[int, bytes]], int]:
        """As `_log_batch`, one get per message, answered by the stream's leader (so never behind; "more": 1
        while the last get found one)."""
        out: list[tuple[int, bytes]] = []
        seq = start
        while len(out) < limit:
            try:
                raw = await self.js.get_msg(stream, seq=seq, subject=subject, next=True)
            except nats.js.errors.NotFoundError:
                return out, 0
            if raw.seq is None:
                return out, 0
            out.append((raw.seq, raw.data or b""))
            seq = raw.seq + 1
        return out, 1

    async def follow(self, stream: str, subject: str, from_seq: int, type: Any = None, *,
                     idle_s: float = 1.0) -> AsyncGenerator[tuple[int, Any, int] | None, None]:
        """Every message on `subject` from `from_seq`, then each new one as it comes (a live reader: the dashboard).

        Yields (sequence, message, messages still pending), or None after `idle_s` with nothing new. An
        undecodable message is skipped with a warning. A failure (the server gone) ends the iteration by
        raising; the caller follows again from the last sequence it saw.
        """
        config = api.ConsumerConfig(deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=max(1, from_seq))
        sub = await self._call(f"follow {stream} {subject}", lambda: self.js.subscribe(
            subject, stream=stream, ordered_consumer=True, config=config))
        try:
            while True:
                try:
                    m = await sub.next_msg(timeout=idle_s)
                except TimeoutError:  # nats' too
                    yield None
                    continue
                md = m.metadata
                try:
                    msg = decode(m.data, type) if type is not None else decode(m.data)
                except MessageError as e:
                    log.warning("%s seq %d skipped: %s", stream, md.sequence.stream, e)
                    continue
                yield md.sequence.stream, msg, md.num_pending
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def latest_per_subject(self, stream: str, subject: str, *, timeout_s: float = 2.0) -> list[tuple[int, Any]]:
        """The last message of every subject matching `subject` (a wildcard), e.g. each worker's progress."""
        return await self._call(f"latest per subject {stream} {subject}",
                                partial(self._latest_per_subject, stream, subject, timeout_s))

    async def _latest_per_subject(self, stream: str, subject: str, timeout_s: float) -> list[tuple[int, Any]]:
        out: list[tuple[int, Any]] = []
        sub = await self.js.subscribe(
            subject, stream=stream, ordered_consumer=True,
            config=api.ConsumerConfig(deliver_policy=api.DeliverPolicy.LAST_PER_SUBJECT),
        )
        try:
            info = await self.js.stream_info(stream, subjects_filter=subject)
            expected = len(info.state.subjects or {})
            while len(out) < expected:
                try:
                    m = await sub.next_msg(timeout=timeout_s)
                except nats.errors.TimeoutError:
                    break
                with contextlib.suppress(MessageError):
                    out.append((m.metadata.sequence.stream, decode(m.data)))
                if m.metadata.num_pending == 0:
                    break
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        return out

    async def run_missing(self, run: str) -> str:
        """"" when `run` has left anything on the bus; else one line saying why not, for read-only commands
        (status, eval, drops, replay, dashboard) to print instead of a NotFoundError from deep inside."""
        if await self.stream_state(Streams.PROGRESS) is None:
            return (f"no run {run!r}: this stack has no dflash-pipeline streams yet (nothing was fed or started "
                    f"on NATS at {self.cfg.url})")
        for spec in streams(self.cfg.progress_max_age_s):  # one direct lookup per stream: cost independent of the run's size
            if await self.last_msg(spec.name, Subjects.whole_run(run)) is not None:
                return ""
        return f"no run {run!r} on this stack: nothing was fed to it and no service reported for it (check the name)"

    # --- core NATS (no JetStream ack) ---------------------------------------------------------------

    async def publish_core(self, subject: str, payload: bytes) -> None:
        """A plain publish: a stream bound to `subject` stores it, nothing is awaited (see the feeder's registry)."""
        await self.nc.publish(subject, payload)

    async def flush(self) -> None:
        """Every plain publish so far is on the server."""
        await self.nc.flush()

    @property
    def connected(self) -> bool:
        return self.nc.is_connected

    @property
    def closed(self) -> bool:
        return self.nc.is_closed

    # --- dead letters ---------------------------------------------------------------------------

    async def dead_letter(self, spec: ConsumerSpec, run: str, msg: Msg, error: str) -> None:
        md = msg.metadata
        letter = DeadLetter(
            run=run, stage=spec.stage, stream=md.stream, subject=msg.subject, consumer=spec.durable,
            stream_seq=md.sequence.stream, num_delivered=md.num_delivered, error=error[-4000:],
            payload=bytes(msg.data),
        )
        # Idempotent: a second worker dead-lettering the same stream message publishes nothing new.
        await self.publish(
            Subjects.deadletter(run, spec.stage), letter, msg_id=f"dl:{md.stream}:{md.sequence.stream}"
        )
        await msg.term()
        log.error("dead-lettered %s seq %d after %d deliveries: %s", md.stream, md.sequence.stream,
                  md.num_delivered, error.splitlines()[-1] if error else "")

    async def dead_letters(self, run: str, stage: str = "*") -> list[tuple[int, DeadLetter]]:
        return [item async for item in self.read_log(Streams.DEADLETTER, Subjects.deadletter(run, stage), 1, DeadLetter)]

    async def replay_dead_letters(self, run: str, stage: str = "*", *, only: Callable[[DeadLetter], bool] | None = None) -> int:
        """Put dead-lettered messages back where they came from; each is then removed from DEADLETTER.

        The republish uses a msg id derived from the dead letter's own sequence, so a crash between
        publish and delete (or two replays at once) publishes it once.
        """
        count = 0
        for seq, letter in await self.dead_letters(run, stage):
            if only is not None and not only(letter):
                continue
            await self.publish_raw(letter.subject, letter.payload, msg_id=f"replay:{letter.stream}:{letter.stream_seq}:{seq}")
            with contextlib.suppress(nats.js.errors.NotFoundError):
                await self.js.delete_msg(Streams.DEADLETTER, seq)
            count += 1
        return count

    # --- the worker loop ------------------------------------------------------------------------

    async def work(
        self,
        spec: ConsumerSpec,
        handle: Callable[[Delivery], Awaitable[None]],
        *,
        run: str,
        stop: asyncio.Event,
        message_type: Any,
        max_inflight: int | Callable[[], int] = 16,
        fetch_batch: int = 64,
        grace_s: float = 30.0,
        stats: WorkStats | None = None,
    ) -> WorkStats:
        """Run `handle` on every message of `spec` until `stop` is set; then finish or requeue in-flight work.

        At most `max_inflight` handlers run at once (with the consumer's max_ack_pending this is the
        backpressure). On stop: no more fetches, in-flight handlers get `grace_s` to finish, the
        rest are cancelled and nak'ed so another worker takes them at once.
        """
        stats = stats or WorkStats()
        await self.ensure_consumer(spec)
        sub = await self.js.pull_subscribe_bind(durable=spec.durable, stream=spec.stream)
        tasks: set[asyncio.Task[None]] = set()

        def finished(task: asyncio.Task[None]) -> None:
            tasks.discard(task)
            stats.in_flight = len(tasks)  # now, not at the next fetch that returns messages (a burst waits on it)

        stop_wait = asyncio.create_task(stop.wait())
        try:
            while not stop.is_set() and not stats.halted:
                free = (max_inflight() if callable(max_inflight) else max_inflight) - len(tasks)
                if free <= 0:  # a moving limit is looked at again every quarter second
                    await asyncio.wait([*tasks, stop_wait], return_when=asyncio.FIRST_COMPLETED,
                                       timeout=0.25 if callable(max_inflight) else None)
                    continue
                try:
                    msgs = await retry_async(f"fetch from {spec.durable}",
                                             partial(self._fetch_or_recreate, spec, sub, min(free, fetch_batch)),
                                             deadline_s=None, stop_event=stop)
                except Exception as e:
                    if classify(e) is Failure.TRANSIENT and stop.is_set():
                        continue  # stopping while the server is away: the loop ends
                    raise
                for m in msgs:
                    if stop.is_set() or stats.halted:
                        await m.nak()
                        continue
                    task = asyncio.create_task(self._handle_one(spec, handle, m, run, message_type, stats))
                    tasks.add(task)
                    task.add_done_callback(finished)
                stats.in_flight = len(tasks)
            if tasks:
                log.info("stopping: waiting up to %.0fs for %d in-flight messages", grace_s, len(tasks))
                _, pending = await asyncio.wait(tasks, timeout=grace_s)
                for task in pending:
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
        finally:
            stop_wait.cancel()
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        stats.in_flight = 0
        if stats.halted:
            await self.publish(Subjects.alert(run, spec.stage), Alert(
                run=run, stage=spec.stage, kind="worker_halted", worker=self.name, examples=[],
                message=f"{self.name} stopped taking {spec.stage} work: {stats.halted}"))
            raise Halt(stats.halted)
        return stats

    async def _fetch_or_recreate(self, spec: ConsumerSpec, sub: Any, n: int) -> list[Msg]:
        """One fetch. A fetch from a consumer that no longer exists meets "no responders", which also means a
        server between leaders: only the server's own "not found" tells them apart, and then the consumer is
        put back (someone deleted it under a running worker: an operator resetting a stage, a bench
        forgetting a run's training) so the worker goes on instead of retrying forever. Creating an existing
        consumer with its own config changes nothing, so a wrong "not found" costs nothing."""
        try:
            return await _fetch(sub, n)
        except nats.js.errors.ServiceUnavailableError:
            try:
                await self.js.consumer_info(spec.stream, spec.durable)
            except nats.js.errors.NotFoundError:
                log.warning("consumer %s on %s is gone (deleted under this worker): recreating it", spec.durable,
                            spec.stream)
                await self.ensure_consumer(spec)
                return []
            except Exception:  # the server is away: the fetch's own failure is the one to retry
                pass
            raise

    async def _handle_one(
        self, spec: ConsumerSpec, handle: Callable[[Delivery], Awaitable[None]], msg: Msg, run: str,
        message_type: Any, stats: WorkStats,
    ) -> None:
        md = msg.metadata
        try:
            data = decode(msg.data, message_type)
        except MessageError as e:
            await self.dead_letter(spec, run, msg, f"malformed payload: {e}")
            stats.dead_lettered += 1
            return
        if md.num_delivered > spec.max_deliver:
            await self.dead_letter(
                spec, run, msg,
                f"gave up after {md.num_delivered - 1} deliveries without an outcome "
                "(the worker died or overran ack_wait each time)",
            )
            stats.dead_lettered += 1
            return
        heartbeat = asyncio.create_task(_heartbeat(msg, spec.ack_wait_s / 3))
        try:
            await handle(Delivery(msg, data, md.num_delivered, md.sequence.stream))
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await msg.nak()
            stats.requeued_on_shutdown += 1
            raise
        except Exception as e:
            failure = classify(e)
            if failure is Failure.POISON:
                stats.errors += 1
                stats.last_error = str(e)
                await self.dead_letter(spec, run, msg, f"poison: {e}")
                stats.dead_lettered += 1
                return
            if failure is not Failure.FATAL:
                await self._failed(spec, run, msg, e, stats)
                return
            stats.errors += 1
            stats.last_error = stats.halted = stats.halted or f"{type(e).__name__}: {e}"
            log.error("%s seq %d put back, and no more work taken: %s", md.stream, md.sequence.stream, stats.last_error)
            with contextlib.suppress(Exception):
                await msg.nak()
        else:
            await msg.ack()
            stats.acked += 1
        finally:
            heartbeat.cancel()

    async def _failed(self, spec: ConsumerSpec, run: str, msg: Msg, e: Exception, stats: WorkStats) -> None:
        """A handler's failure: redelivered with backoff, dead-lettered on its last allowed delivery."""
        md = msg.metadata
        stats.errors += 1
        error = f"{type(e).__name__}: {e}" if isinstance(e, Retry) else "".join(traceback.format_exception(e, limit=8))
        stats.last_error = error.strip().splitlines()[-1]
        if md.num_delivered >= spec.max_deliver:
            await self.dead_letter(spec, run, msg, error)
            stats.dead_lettered += 1
        else:
            delay = e.delay_s if isinstance(e, Retry) and e.delay_s is not None else backoff_s(md.num_delivered, 1.0, 60.0)
            log.warning("delivery %d of %s seq %d failed, retry in %.1fs: %s", md.num_delivered, md.stream,
                        md.sequence.stream, delay, stats.last_error)
            await msg.nak(delay=delay)
            stats.retried += 1


def _consumer_state(info: api.ConsumerInfo) -> ConsumerState:
    return ConsumerState(info.name, info.num_pending or 0, info.num_ack_pending or 0, info.num_redelivered or 0)


async def _fetch(sub: Any, n: int) -> list[Msg]:
    """One fetch; an empty one (the fetch's timeout) is normal, not a failure."""
    try:
        return await sub.fetch(n, timeout=1.0)
    except TimeoutError:  # nats.errors.TimeoutError, or asyncio's from a fetch deadline
        return []


async def _heartbeat(msg: Msg, every_s: float) -> None:
    with contextlib.suppress(asyncio.CancelledError):
        while True:
            await asyncio.sleep(every_s)
            with contextlib.suppress(Exception):
                await msg.in_progress()


@dataclass
class ProgressLoop:
    """Publishes a service's progress snapshot every `every_s` seconds (and once more at the end)."""

    bus: Bus
    subject: str
    snapshot: Callable[[], Message]
    every_s: float = 5.0
    _task: asyncio.Task[None] | None = field(default=None, init=False)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.every_s)
            await self.publish_now()

    async def publish_now(self) -> None:
        try:
            await self.bus.publish(self.subject, self.snapshot())
        except Exception as e:  # progress must never take a service down
            log.debug("progress publish failed: %s", e)

    async def __aenter__(self) -> ProgressLoop:
        await self.publish_now()
        self._task = asyncio.create_task(self._loop())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.publish_now()


# --- leases: one holder at a time, across processes and hosts ------------------------------------


class LeaseHolder(msgspec.Struct, frozen=True):
    """Who holds a lease (the KV entry's value), so that a refused process can name it."""

    owner: str
    host: str
    pid: int
    since: float  # unix time the holder acquired it

    def dead_here(self) -> bool:
        """A holder on this host whose process no longer exists (another host's, or a live one: False)."""
        import psutil

        return self.host == socket.gethostname() and self.pid != os.getpid() and not psutil.pid_exists(self.pid)

    def describe(self) -> str:
        return (f"{self.owner} (host {self.host}, pid {self.pid}, since "
                f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(self.since))})")


class LeaseHeld(Exception):
    """Another process holds the lease."""

    def __init__(self, key: str, holder: LeaseHolder | None) -> None:
        self.key, self.holder = key, holder
        super().__init__(f"lease {key} is held by {holder.describe() if holder else 'another process'}")

    def __reduce__(self) -> tuple[type, tuple[str, LeaseHolder | None]]:  # sent from rank 0 to the other ranks
        return (LeaseHeld, (self.key, self.holder))


class Lease:
    """A lease on `key` in the LEASES KV bucket: created only if absent (or lapsed), renewed every ttl/3 with the
    revision it last wrote (a renewal that finds another writer's revision has lost the lease: `lost` is set),
    deleted on release. Each entry carries a per-message TTL, so a holder that dies without releasing it
    (SIGKILL, power loss, a partition) blocks others for at most `ttl_s`."""

    def __init__(self, bus: Bus, key: str, ttl_s: float, holder: LeaseHolder, revision: int) -> None:
        self.bus, self.key, self.ttl_s, self.holder, self.revision = bus, key, ttl_s, holder, revision
        self.lost = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._watch: asyncio.Task[None] | None = None

    @staticmethod
    async def _bucket(bus: Bus) -> Any:
        try:
            return await bus.js.key_value(LEASES_BUCKET)
        except nats.js.errors.BucketNotFoundError:
            return await bus.js.create_key_value(api.KeyValueConfig(
                bucket=LEASES_BUCKET, history=1, storage=api.StorageType.FILE, replicas=bus.cfg.replicas,
                description="dfpipe leases: one holder per key; entries expire by their own TTL"))

    @classmethod
    async def acquire(cls, bus: Bus, key: str, ttl_s: float, owner: str) -> Lease:
        """Take the lease or raise LeaseHeld naming its holder. Renewal starts at once. The server's calls are
        under the failure policy (a trainer starting while its cluster elects a leader waits, it does not crash);
        a create whose ack was lost and that is tried again finds its own entry, and takes it."""
        ttl = max(1, round(ttl_s))  # the server's message TTLs are whole seconds
        kv = await bus._call("open the leases bucket", lambda: cls._bucket(bus))
        me = LeaseHolder(owner=owner, host=socket.gethostname(), pid=os.getpid(), since=time.time())

        async def read() -> tuple[Any, LeaseHolder | None]:
            with contextlib.suppress(nats.js.errors.KeyNotFoundError, msgspec.DecodeError):  # lapsed meanwhile
                entry = await kv.get(key)
                return entry, msgspec.json.decode(entry.value or b"", type=LeaseHolder)
            return None, None

        try:
            revision = await bus._call(f"take lease {key}", lambda: kv.create(key, msgspec.json.encode(me), msg_ttl=ttl))
        except nats.js.errors.KeyWrongLastSequenceError:
            entry, holder = await bus._call(f"read lease {key}", read)
            if entry is not None and holder == me:  # our own create, stored before its ack was lost
                revision = entry.revision
            elif entry is None or holder is None or not holder.dead_here():
                raise LeaseHeld(key, holder) from None
            else:
                revision = await cls._take_from_dead(bus, key, me, ttl, entry, holder)
        lease = cls(bus, key, ttl, me, revision)
        lease._task = asyncio.create_task(lease._renew())
        log.info("lease %s acquired (ttl %ds)", key, ttl)
        return lease

    @staticmethod
    async def _take_from_dead(bus: Bus, key: str, me: LeaseHolder, ttl: int, entry: Any, holder: LeaseHolder) -> int:
        """Its holder was this host's process and is gone (a kill -9 restarted at once): no need to wait out the
        TTL. Taken only if the entry is still the dead holder's revision."""
        try:
            ack = await bus.js.publish(f"$KV.{LEASES_BUCKET}.{key}", msgspec.json.encode(me), msg_ttl=ttl,
                                       headers={"Nats-Expected-Last-Subject-Sequence": str(entry.revision)})
        except nats.js.errors.APIError:
            raise LeaseHeld(key, holder) from None
        log.warning("lease %s: its holder %s is gone; taken over", key, holder.describe())
        return ack.seq

    async def _renew(self) -> None:
        subject = f"$KV.{LEASES_BUCKET}.{self.key}"
        payload = msgspec.json.encode(self.holder)
        while True:
            await asyncio.sleep(self.ttl_s / 3)
            try:
                ack = await self.bus.js.publish(subject, payload, msg_ttl=self.ttl_s,
                                                headers={"Nats-Expected-Last-Subject-Sequence": str(self.revision)})
                self.revision = ack.seq
            except nats.js.errors.APIError as e:
                if e.err_code not in (10071, 10164):
                    log.warning("lease %s: renewal failed (%s); retrying", self.key, describe(e))
                elif not await self._recover():
                    log.error("lease %s lost: it lapsed and another process took it", self.key)
                    self.lost.set()
                    return
            except Exception as e:  # the server is away: try again next time, within the TTL
                log.warning("lease %s: renewal failed (%s); retrying", self.key, describe(e))

    async def _recover(self) -> bool:
        """A renewal found another revision than ours: still ours (a renewal whose ack was lost), or lapsed with no
        one else holding it (this process was too slow to renew: a starved loop), then take it again. False: another
        process holds it."""
        kv = await self._bucket(self.bus)
        try:
            entry = await kv.get(self.key)
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
            try:
                self.revision = await kv.create(self.key, msgspec.json.encode(self.holder), msg_ttl=self.ttl_s)
            except nats.js.errors.KeyWrongLastSequenceError:
                return False  # taken in between
            log.warning("lease %s lapsed (renewed too late) and was taken again; nobody else held it", self.key)
            return True
        if entry.value == msgspec.json.encode(self.holder):
            self.revision = entry.revision
            return True
        return False

    def lost_stops(self, stop: asyncio.Event) -> None:
        """Set `stop` if the lease is lost (a holder must not go on working beside the new one)."""
        async def watch() -> None:
            await self.lost.wait()
            stop.set()

        self._watch = asyncio.create_task(watch())

    async def release(self) -> None:
        """Stop renewing and delete the entry if it is still ours (a lost lease is left to its new holder)."""
        for task in (self._task, self._watch):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self.lost.is_set():
            return
        try:
            kv = await self._bucket(self.bus)
            await kv.delete(self.key, last=self.revision)
            log.info("lease %s released", self.key)
        except Exception as e:  # it lapses by its TTL anyway
            log.warning("lease %s: release failed (%s); it lapses within %ds", self.key, describe(e), self.ttl_s)


def install_stop_signals(stop: asyncio.Event, *, report_after_s: float = 45.0) -> None:
    """SIGTERM and SIGINT set `stop`: services stop fetching, finish in-flight work, drain, exit 0.

    A shutdown still running `report_after_s` later logs what every task waits on (and faulthandler
    dumps the threads', which also fires when the event loop itself is blocked), so a process that
    will not stop says where. A second signal exits at once: nothing is lost, since every message is
    acked only after its output was written; the unacked ones come back after their ack_wait.
    """
    import faulthandler
    import signal

    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:
        if stop.is_set():
            log.warning("second %s: exiting without draining (unacked messages are redelivered)", sig.name)
            os._exit(128 + sig.value)
        stop.set()
        loop.call_later(report_after_s, _report_stuck_shutdown, report_after_s)
        faulthandler.dump_traceback_later(report_after_s + 5, exit=False)

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)


def _report_stuck_shutdown(after_s: float) -> None:
    waiting = [t for t in asyncio.all_tasks() if not t.done()]
    stacks = "\n".join(f"  {t.get_name()}: " + " → ".join(_await_chain(t.get_coro())) for t in waiting)
    log.warning("still shutting down %gs after the stop signal; %d tasks waiting:\n%s", after_s, len(waiting), stacks)


def _await_chain(coro: Any) -> list[str]:
    """A task's whole await chain, outermost first (Task.get_stack shows only its own coroutine)."""
    out = []
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None) or getattr(coro, "ag_frame", None)
        if frame is not None:
            out.append(f"{frame.f_code.co_name} ({os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno})")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None) or getattr(coro, "ag_await", None)
    return out
