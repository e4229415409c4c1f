"""The dashboard's one connection to the stack: a daemon thread with its own asyncio loop.

Streamlit reruns the page script in short-lived threads, so an event-loop-bound client cannot
be cached; this object is (via `st.cache_resource`), and the page only reads `snapshot()`.
On start it replays the PROGRESS stream from its first message (a page opened on day three
shows days one and two), then follows it live with an ordered consumer. The counts workers cannot give
exactly (unique prompts in S3, shards tokenized, data quality) come from each run's ledger
(`shared.ledger.RunLedger`: its S3 snapshot, then the new events at every poll). Dead letters, stream
lag per consumer, S3 reachability and run manifests are polled every few seconds. Every read is a bus
method under the failure policy (a failover is retried through); a longer outage is recorded as stack
health for the page (what failed, and since when) and tried again at the next poll; nothing raises into the
page.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import threading
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

import msgspec

from dashboard.state import RunState, apply
from shared.bus import Bus
from shared.config import Config
from shared.failures import describe
from shared.ledger import DurableCounts, RunLedger
from shared.messages import DeadLetter, ProgressMessage
from shared.store import Store, StoreError
from shared.topology import ANY, Keys, Streams, Subjects
from shared.view import LedgerFacts, ledger_facts

log = logging.getLogger("dflash.dashboard")

POLL_S = 3.0


@dataclass
class ConsumerLag:
    stream: str
    consumer: str
    pending: int  # in the stream, not yet delivered to this consumer
    ack_pending: int  # delivered, not yet acked
    redelivered: int


@dataclass
class Health:
    nats_ok: bool = False
    nats_error: str = "connecting…"
    s3_ok: bool = False
    s3_error: str = "connecting…"
    stream_missing: bool = False
    replaying: bool = True
    replay_pending: int = 0
    checked_at: float = 0.0
    nats_down_since: float = 0.0  # wall time NATS became unreachable (or its reads failed); 0 while it answers


@dataclass
class Snapshot:
    """A deep copy of the listener's state at one moment: the page may read it freely."""

    runs: dict[str, RunState] = field(default_factory=dict)
    health: Health = field(default_factory=Health)
    dead_letters: list[tuple[int, DeadLetter]] = field(default_factory=list)
    lag: list[ConsumerLag] = field(default_factory=list)
    manifests: dict[str, dict[str, Any]] = field(default_factory=dict)
    last_seq: int = 0
    durable: dict[str, DurableCounts] = field(default_factory=dict)  # per run: unique prompts and shards in S3
    facts: dict[str, LedgerFacts] = field(default_factory=dict)  # per run: its ledger's facts, for its view


class Listener:
    """Follows `dflash.<run>.>` on PROGRESS (all runs when `run` is None) for the life of the server."""

    def __init__(self, cfg: Config, run: str | None = None) -> None:
        self.cfg = cfg
        self.run = run
        self._lock = threading.Lock()
        self._state = Snapshot()
        self._ledgers: dict[str, RunLedger] = {}  # per run, refreshed on the listener's loop at every poll
        self._seq: dict[str, int] = {}  # last stream sequence folded, per stream
        self._stop = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._bus: Bus | None = None
        self._store: Store | None = None
        self._thread = threading.Thread(target=self._main, name="dflash-dashboard-listener", daemon=True)
        self._thread.start()

    # --- page side --------------------------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        with self._lock:
            s = self._state
            return Snapshot(
                runs={run: rs.copy() for run, rs in s.runs.items()}, health=copy.copy(s.health),
                dead_letters=list(s.dead_letters), lag=list(s.lag), manifests=dict(s.manifests), last_seq=s.last_seq,
                durable=dict(s.durable), facts=dict(s.facts),
            )

    def replay_dead_letters(self, run: str, stage: str = "*", timeout_s: float = 60.0) -> int:
        """The same path as `dfpipe replay`: Bus.replay_dead_letters, run on the listener's loop."""
        if self._bus is None or not self._bus.connected:
            raise ConnectionError("not connected to NATS")
        count = self._submit(self._bus.replay_dead_letters(run, stage)).result(timeout_s)
        self._submit(self._refresh_dead_letters()).result(timeout_s)
        return count

    def close(self) -> None:
        """Called by st.cache_resource's on_release: stop the thread and drain the connection."""
        self._stop.set()
        if self._loop.is_running():
            with contextlib.suppress(Exception):
                self._submit(self._close_bus()).result(5)
        self._thread.join(timeout=5)

    def _submit(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    # --- listener thread --------------------------------------------------------------------------

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._supervise())
        finally:
            self._loop.close()

    async def _supervise(self) -> None:
        await asyncio.gather(self._follow_forever(Streams.PROGRESS, Subjects.whole_run(self.run or ANY)), self._poll_forever())

    async def _close_bus(self) -> None:
        if self._bus is not None:
            await self._bus.close()

    def _health(self, **changes: Any) -> None:
        with self._lock:
            health = self._state.health
            for k, v in changes.items():
                setattr(health, k, v)
            health.checked_at = time.time()
            if "nats_ok" in changes or "nats_error" in changes:
                down = not health.nats_ok or bool(health.nats_error)
                health.nats_down_since = (health.nats_down_since or health.checked_at) if down else 0.0

    async def _connect(self) -> Bus:
        while True:
            if self._bus is not None and not self._bus.closed:
                return self._bus
            try:
                self._bus = await Bus.connect(self.cfg.bus, "dflash-dashboard", deadline_s=2.0)
                self._health(nats_ok=True, nats_error="")
                return self._bus
            except ConnectionError as e:
                self._health(nats_ok=False, nats_error=str(e))
                await asyncio.sleep(POLL_S)

    async def _follow_forever(self, stream: str, subject: str) -> None:
        while not self._stop.is_set():
            bus = await self._connect()
            try:
                await self._follow(bus, stream, subject)
            except Exception as e:  # the server gone past the read deadline, a failover mid-follow: follow again
                self._health(nats_error=f"following progress failed: {describe(e)}")
                await asyncio.sleep(POLL_S)

    async def _follow(self, bus: Bus, stream: str, subject: str) -> None:
        """Replay `stream` from where we are (the start, first time), then follow it live."""
        if await bus.stream_state(stream) is None:  # no service has created the streams yet
            self._health(stream_missing=True)
            await asyncio.sleep(POLL_S)
            return
        self._health(stream_missing=False)
        followed = bus.follow(stream, subject, self._seq.get(stream, 0) + 1, ProgressMessage)
        try:
            async for item in followed:
                if self._stop.is_set():
                    return
                if item is None:
                    self._health(replaying=False, replay_pending=0)
                    continue
                seq, event, pending = item
                with self._lock:
                    self._seq[stream] = seq
                    apply(self._state.runs, event)
                    self._state.last_seq = seq
                    self._state.health.replaying = pending > 0
                    self._state.health.replay_pending = pending
        finally:
            await followed.aclose()

    # --- polling: health, lag, dead letters, manifests -----------------------------------------------

    async def _poll_forever(self) -> None:
        while not self._stop.is_set():
            await asyncio.gather(self._poll_nats(), asyncio.to_thread(self._poll_s3), return_exceptions=True)
            await asyncio.sleep(POLL_S)

    async def _poll_nats(self) -> None:
        bus = self._bus
        if bus is None:
            return
        if not bus.connected:
            self._health(nats_ok=False, nats_error=f"NATS at {self.cfg.bus.url} unreachable (reconnecting)")
            return
        try:
            lag = await self._lag(bus)
            await self._refresh_dead_letters()
        except Exception as e:  # reads retried through a failover and still failing: stack health, not a crash
            self._health(nats_error=f"NATS query failed: {describe(e)}")
            return
        with self._lock:
            self._state.lag = lag
        self._health(nats_ok=True, nats_error="")
        try:
            await self._refresh_ledgers(bus)
        except Exception as e:  # NATS or S3 failing mid-read: the counts stay as they were until the next poll
            log.warning("run ledger not refreshed: %s", e)

    async def _lag(self, bus: Bus) -> list[ConsumerLag]:
        out = []
        for stream in (Streams.PROMPTS, Streams.SHARDS, Streams.TOKENIZED):
            for info in await bus.consumer_states(stream):
                out.append(ConsumerLag(stream, info.name, info.pending, info.ack_pending, info.redelivered))
        return out

    async def _refresh_ledgers(self, bus: Bus) -> None:
        """Fold each run's new shard events; the counts are taken here, on the loop that folds, so the page's
        snapshot only copies them."""
        with self._lock:
            runs = [self.run] if self.run else list(self._state.runs)
            s3_unknown = self._store is None and self._state.health.s3_error == "connecting…"
        if s3_unknown:  # the first poll: wait for S3 (the snapshot) rather than fold the logs from the start
            return
        for run in runs:
            ledger = self._ledgers.get(run)
            if ledger is None:
                ledger = self._ledgers[run] = RunLedger(msgspec.structs.replace(self.cfg, run=run), bus, self._store)
            ledger.bus, ledger.store = bus, ledger.store or self._store  # S3 may have come up since
            await ledger.refresh()
            facts = ledger_facts(ledger)
            with self._lock:
                self._state.durable[run] = facts.counts
                self._state.facts[run] = facts

    async def _refresh_dead_letters(self) -> None:
        bus = self._bus
        if bus is None:
            return
        letters = await bus.dead_letters(self.run or "*")  # none while the stream does not exist
        with self._lock:
            self._state.dead_letters = letters

    def _poll_s3(self) -> None:
        try:
            if self._store is None:
                cfg = msgspec.structs.replace(self.cfg.store, retry_deadline_s=2.0)
                self._store = Store.open(msgspec.structs.replace(self.cfg, store=cfg), ensure_bucket=False)
            self._store.ping(deadline_s=2.0)
        except Exception as e:  # StoreError, bad credentials, DNS: all shown on the page as text
            self._health(s3_ok=False, s3_error=str(e).splitlines()[0][:300])
            return
        with self._lock:
            runs = list(self._state.runs)
        manifests = {}
        for run in runs:
            with contextlib.suppress(StoreError, msgspec.DecodeError):
                manifests[run] = msgspec.json.decode(self._store.get_bytes(Keys.manifest(run), verify=False))
        with self._lock:
            self._state.manifests = manifests
        self._health(s3_ok=True, s3_error="")
