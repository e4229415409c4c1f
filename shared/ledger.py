"""A run's ledger: its durable facts folded once, incrementally, from the logs, with a snapshot in S3.

What it folds: ShardWritten (SHARDS), TokenizedShard (TOKENIZED) and alerts (PROGRESS), each from the
last stream sequence it has seen; per poll it also reads the feed manifest (re-read only when its sha256
changes), the dead-letter counts per stage (the server's per-subject counts: `dfpipe replay` deletes
dead letters, so they are counted as they are now, not folded) and the generate consumer's queue. Status,
`dfpipe run`, the trainer and the dashboard read it, so the work per poll is the events since the last poll.

Whether generation and tokenization are over, and so whether the run's training data is complete (the
trainer counts a pass as an epoch only then), is decided once, here: `data_complete` and the two stage
rules over `RunLedger.stages()`.

The snapshot (`Keys.ledger(run)`, one S3 object) is a fold up to its per-stream sequences, so a fresh
reader loads it and folds the tail. Any snapshot is a self-consistent prefix of the logs: with several
writers the last PUT wins, and an older snapshot overwriting a newer one costs its readers only a longer
tail. S3 and the JetStream file store both survive restarts. A snapshot that is corrupt, from another
schema or run, or ahead of the logs (a stream recreated) is dropped with a warning and the ledger is
rebuilt from sequence 1 of the logs: never a wrong number, never a crash.

Size and memory: unique prompts are stable 64-bit hashes (`prompt_hash`: a chance of one collision below
1e-7 at a million prompts): in the snapshot a sorted uint64 array (8 bytes per prompt, 7.3 MB at 914K), kept
as it is by the reader that loads it; the prompts folded since are a Python set (~70 bytes per prompt: one
lookup per id keeps the fold fast); per completion shard its key, per tokenized shard its numbers (~150
bytes each); per generator worker three totals (a restarted generator counts on from them); alerts within
PROGRESS's retention; 512 rate points per stage (the history a fresh `dfpipe status` takes its rates over the
view's window from: `shared.view`). All of it grows linearly with the run and none of it per
token; bench/ledger.py measures it at 914K prompts.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from shared.bus import Bus, StreamState
from shared.config import Config
from shared.messages import Alert, ShardWritten, TokenizedShard
from shared.store import KeyNotFound, Store, StoreError
from shared.topology import ANY, Keys, Streams, Subjects, durable

log = logging.getLogger("dflash.ledger")

SCHEMA = 3  # the snapshot's layout; a snapshot of any other is rebuilt from the logs (3: points carry a second total)
MAGIC = b"dflash-ledger\n"
POINTS = 512  # (ts, count, amount) points kept per stage for rates: minutes of history at any shard rate
SNAPSHOT_AFTER_EVENTS = 2000  # a reader that folded this many events since the last snapshot writes one...
SNAPSHOT_EVERY_S = 30.0  # ...at most this often


def prompt_hash(prompt_id: str) -> int:
    """A prompt id as a 64-bit hash that is the same in every process (`hash(str)` is salted per process).

    A feeder's id is a sha256 in hex: its last 16 digits (uniform, and distinct for a zero-padded counter
    too). Any other id: its blake2b (~1.4 us, several times slower)."""
    if len(prompt_id) == 64:
        try:
            return int(prompt_id[48:], 16)
        except ValueError:
            pass
    return int.from_bytes(hashlib.blake2b(prompt_id.encode(), digest_size=8).digest(), "little")


def prompt_hashes(prompt_ids: list[str]) -> list[int]:
    """`prompt_hash` of each id; one hex parse for a shard of feeder ids."""
    if all(len(p) == 64 for p in prompt_ids):
        try:
            return np.frombuffer(bytes.fromhex("".join([p[48:] for p in prompt_ids])), ">u8").tolist()
        except ValueError:
            pass
    return [prompt_hash(p) for p in prompt_ids]


class PromptSet:
    """Unique prompt hashes: the snapshot's sorted uint64 array as loaded (no per-prompt object, so a fresh
    reader starts in milliseconds) plus a Python set of those folded since (one lookup per id)."""

    def __init__(self, loaded: np.ndarray | None = None) -> None:
        self._loaded = np.zeros(0, np.uint64) if loaded is None else loaded
        self._added: set[int] = set()

    def __len__(self) -> int:
        return len(self._loaded) + len(self._added)

    def update(self, hashes: list[int]) -> None:
        if len(self._loaded):
            new = np.array(hashes, np.uint64)
            at = np.minimum(np.searchsorted(self._loaded, new), len(self._loaded) - 1)
            hashes = new[self._loaded[at] != new].tolist()
        self._added.update(hashes)

    def add(self, h: int) -> None:
        self.update([h])

    def sorted_array(self) -> np.ndarray:
        added = np.sort(np.fromiter(self._added, np.uint64, len(self._added)))
        return np.insert(self._loaded, np.searchsorted(self._loaded, added), added)  # disjoint: no unique pass


class TokenizedEntry(msgspec.Struct, array_like=True):
    """What the ledger keeps of a completion shard's latest tokenized shard."""

    key: str
    num_samples: int
    num_tokens: int
    num_supervised: int
    drift: int = 0
    dropped: dict[str, int] = {}
    histogram: dict[str, int] = {}

    @classmethod
    def of(cls, e: TokenizedShard) -> TokenizedEntry:
        return cls(e.key, e.num_samples, e.num_tokens, e.num_supervised, e.retokenization_drift, e.dropped,
                   e.supervised_histogram)


class WorkerTotals(msgspec.Struct, array_like=True):
    """One generator's durable output, summed over its shards: what its restarted process counts on from."""

    records: int = 0
    completion_tokens: int = 0
    shards: int = 0


@dataclass(frozen=True)
class DurableCounts:
    """A copy of a ledger's numbers (no id sets), cheap enough to take on every page refresh."""

    completed: int  # unique prompt_ids in completion shards
    records: int  # completion records, including prompts written twice after a redelivery
    shards: int  # completion shards
    tokenized_shards: int  # completion shards with a tokenized shard
    kept: int  # training samples in the latest tokenized shard of each completion shard
    # (event ts, completed, completion tokens) per completion shard, the latest POINTS
    completed_points: tuple[tuple[float, int, int], ...]
    tokenized_points: tuple[tuple[float, int, int], ...]  # (event ts, tokenized_shards, samples kept)
    # Data quality over the same latest tokenized shards: records in, supervised tokens kept, drops by reason,
    # supervised tokens per sample (bucket -> samples), token-exact records whose text re-tokenizes otherwise.
    samples_in: int = 0
    supervised_tokens: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    histogram: dict[str, int] = field(default_factory=dict)
    drift: int = 0


@dataclass
class _QualityTotals:
    kept: int = 0
    samples_in: int = 0
    supervised_tokens: int = 0
    drift: int = 0
    dropped: Counter[str] = field(default_factory=Counter)
    histogram: Counter[str] = field(default_factory=Counter)

    def add(self, e: TokenizedEntry, sign: int) -> None:
        self.kept += sign * e.num_samples
        self.samples_in += sign * (e.num_samples + sum(e.dropped.values()))
        self.supervised_tokens += sign * e.num_supervised
        self.drift += sign * e.drift
        for counter, items in ((self.dropped, e.dropped), (self.histogram, e.histogram)):
            for k, n in items.items():
                counter[k] += sign * n


class SnapshotError(ValueError):
    """A ledger snapshot that cannot be used (corrupt, another schema, another run): rebuild from the logs."""


class _Snapshot(msgspec.Struct, kw_only=True):
    run: str
    cursor: dict[str, int]  # stream -> last sequence folded
    created: dict[str, str]  # stream -> its creation time: a recreated stream makes the snapshot void
    records: int
    prompts: bytes  # sorted little-endian uint64 prompt hashes
    shard_keys: list[str]
    workers: dict[str, WorkerTotals]
    tokenized: list[tuple[str, TokenizedEntry]]  # completion shard key -> its latest tokenized shard
    completed_points: list[tuple[float, int, int]]
    tokenized_points: list[tuple[float, int, int]]
    alerts: list[tuple[int, Alert]]  # (PROGRESS sequence, alert), in stream order


_snapshot_encoder = msgspec.msgpack.Encoder()
_snapshot_decoder = msgspec.msgpack.Decoder(_Snapshot)


class Ledger:
    """The fold itself, with no I/O: what a run has durably produced, event by event.

    The events are the record (each says an object is in S3), so these counts survive what worker
    counters do not: a restarted worker starts its counters at zero, and a prompt redelivered after a
    crash is completed twice.
    """

    def __init__(self, run: str) -> None:
        self.run = run
        self.cursor: dict[str, int] = {}  # stream -> last sequence folded
        self.created: dict[str, str] = {}
        self.prompts = PromptSet()  # prompt_hash of every completed prompt
        self.shard_keys: set[str] = set()
        self.records = 0
        self.workers: dict[str, WorkerTotals] = {}  # generator worker -> its shards' totals
        self.tokenized: dict[str, TokenizedEntry] = {}  # completion shard key -> its latest tokenized shard
        self.tokenized_in_shards = 0  # of self.tokenized, those whose completion shard is in shard_keys
        self.tokenized_samples_in_shards = 0
        self._quality = _QualityTotals()  # summed over self.tokenized, kept current event by event
        self.completion_tokens = 0  # summed over the completion shards
        self.completed_points: deque[tuple[float, int, int]] = deque(maxlen=POINTS)
        self.tokenized_points: deque[tuple[float, int, int]] = deque(maxlen=POINTS)
        self.alerts: deque[tuple[int, Alert]] = deque()  # (PROGRESS seq, alert) still in the stream

    @property
    def completed(self) -> int:
        return len(self.prompts)

    def add(self, event: ShardWritten | TokenizedShard | Alert, seq: int = 0) -> None:
        """Fold one event; `seq` is its stream sequence (alerts need it, to expire with the stream)."""
        if isinstance(event, ShardWritten):
            if event.key in self.shard_keys:  # the same shard announced again (a republish): nothing new
                return
            self.shard_keys.add(event.key)
            self.records += event.num_records
            mine = self.workers.setdefault(event.worker, WorkerTotals())
            mine.records += event.num_records
            mine.completion_tokens += event.completion_tokens
            mine.shards += 1
            self.prompts.update(prompt_hashes(event.prompt_ids))
            self.completion_tokens += event.completion_tokens
            self.completed_points.append((event.ts, self.completed, self.completion_tokens))
            tokenized = self.tokenized.get(event.key)
            if tokenized is not None:  # its tokenized shard came first (the streams are read one by one)
                self.tokenized_in_shards += 1
                self.tokenized_samples_in_shards += tokenized.num_samples
        elif isinstance(event, TokenizedShard):
            previous = self.tokenized.get(event.source_key)
            if previous is not None and previous.key == event.key:
                return  # the same tokenized shard announced again (from S3, maybe without the numbers): nothing new
            entry = TokenizedEntry.of(event)
            in_shards = event.source_key in self.shard_keys
            if previous is not None:
                self._quality.add(previous, -1)
                if in_shards:
                    self.tokenized_samples_in_shards -= previous.num_samples
            elif in_shards:
                self.tokenized_in_shards += 1
            self.tokenized[event.source_key] = entry
            self._quality.add(entry, 1)
            if in_shards:
                self.tokenized_samples_in_shards += entry.num_samples
            if previous is None:
                self.tokenized_points.append((event.ts, len(self.tokenized), self._quality.kept))
        elif isinstance(event, Alert):
            self.alerts.append((seq, event))

    def expire_alerts(self, first_seq: int) -> None:
        """Forget alerts the stream no longer has (PROGRESS keeps them for max_age)."""
        while self.alerts and self.alerts[0][0] < first_seq:
            self.alerts.popleft()

    def latest_alerts(self) -> list[Alert]:
        """The latest alert per (stage, kind, worker), in the order each first appears in the stream."""
        latest: dict[tuple[str, str, str], Alert] = {}
        for _, a in self.alerts:
            latest[(a.stage, a.kind, a.worker)] = a
        return list(latest.values())

    def counts(self) -> DurableCounts:
        q = self._quality
        return DurableCounts(
            self.completed, self.records, len(self.shard_keys), len(self.tokenized), q.kept, tuple(self.completed_points),
            tuple(self.tokenized_points), samples_in=q.samples_in, supervised_tokens=q.supervised_tokens,
            dropped=dict(+q.dropped), histogram=dict(+q.histogram), drift=q.drift,
        )

    # --- snapshot ----------------------------------------------------------------------------------

    def encode(self) -> bytes:
        snap = _Snapshot(
            run=self.run, cursor=dict(self.cursor), created=dict(self.created), records=self.records,
            prompts=self.prompts.sorted_array().astype("<u8").tobytes(), shard_keys=sorted(self.shard_keys),
            workers=dict(self.workers), tokenized=list(self.tokenized.items()),
            completed_points=list(self.completed_points),
            tokenized_points=list(self.tokenized_points), alerts=list(self.alerts),
        )
        return MAGIC + SCHEMA.to_bytes(4, "little") + _snapshot_encoder.encode(snap)

    @classmethod
    def decode(cls, data: bytes, run: str) -> Ledger:
        """A ledger from a snapshot, or SnapshotError saying why it cannot be used."""
        if not data.startswith(MAGIC) or len(data) < len(MAGIC) + 4:
            raise SnapshotError("not a ledger snapshot")
        schema = int.from_bytes(data[len(MAGIC):len(MAGIC) + 4], "little")
        if schema != SCHEMA:
            raise SnapshotError(f"snapshot schema {schema}, this build reads {SCHEMA}")
        try:
            snap = _snapshot_decoder.decode(data[len(MAGIC) + 4:])
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise SnapshotError(f"undecodable snapshot: {e}") from None
        if snap.run != run:
            raise SnapshotError(f"snapshot of run {snap.run!r}, not {run!r}")
        if len(snap.prompts) % 8:
            raise SnapshotError("prompt hashes are not whole uint64s")
        prompts = np.frombuffer(snap.prompts, "<u8").astype(np.uint64)
        if len(prompts) > 1 and not bool(np.all(prompts[1:] > prompts[:-1])):
            raise SnapshotError("prompt hashes are not sorted and unique")
        ledger = cls(run)
        ledger.cursor, ledger.created, ledger.records = dict(snap.cursor), dict(snap.created), snap.records
        ledger.prompts = PromptSet(prompts)
        ledger.shard_keys = set(snap.shard_keys)
        ledger.workers = dict(snap.workers)
        ledger.completion_tokens = sum(w.completion_tokens for w in ledger.workers.values())
        ledger.tokenized = dict(snap.tokenized)
        for source, entry in ledger.tokenized.items():
            ledger._quality.add(entry, 1)
            if source in ledger.shard_keys:
                ledger.tokenized_in_shards += 1
                ledger.tokenized_samples_in_shards += entry.num_samples
        ledger.completed_points.extend(map(tuple, snap.completed_points))
        ledger.tokenized_points.extend(map(tuple, snap.tokenized_points))
        ledger.alerts.extend(snap.alerts)
        return ledger


def _logs(run: str) -> list[tuple[str, str, Any]]:
    """(stream, subject, type) of each log the ledger folds."""
    return [(Streams.SHARDS, Subjects.shards(run), ShardWritten), (Streams.TOKENIZED, Subjects.tokenized(run), TokenizedShard),
            (Streams.PROGRESS, Subjects.alert(run, ANY), Alert)]


class RunLedger:
    """A run's ledger kept current from the bus: `refresh()` folds what is new since the last call.

    A long-lived reader (`dfpipe run`, the trainer, the dashboard) keeps one and refreshes it each poll; a
    fresh process starts from the S3 snapshot and folds the tail. A reader that folded
    SNAPSHOT_AFTER_EVENTS since the last snapshot writes a new one (at most every SNAPSHOT_EVERY_S).

    Every read goes through the bus's read methods and the store, both under the failure policy: a failover
    is retried through; a longer outage raises GaveUp out of `refresh()` with the fold as far as it got (a
    consistent prefix: the next refresh goes on from there).
    """

    def __init__(self, cfg: Config, bus: Bus, store: Store | None, *, use_snapshot: bool = True) -> None:
        self.run = cfg.run
        self.bus = bus
        self.store = store
        self.use_snapshot = use_snapshot
        self.ledger: Ledger | None = None
        self.manifest: dict[str, Any] | None = None  # the feed manifest, once written
        self._manifest_sha = ""
        self.dead_lettered: dict[str, int] = {}  # stage -> dead letters in the stream now
        self.in_flight = 0  # prompts delivered to a generator and not acked, now
        self.queued = 0  # prompts not yet delivered, now
        self.source = ""  # how the fold began: "snapshot", "logs" (no snapshot) or "rebuilt: <why>"
        self.folded = 0  # events folded by this reader
        self._since_snapshot = 0
        self._snapshot_at = 0.0
        self._saving: asyncio.Task[None] | None = None

    async def refresh(self) -> Ledger:
        """Fold every event since the last refresh (the first one loads the snapshot); read the manifest and
        dead-letter counts."""
        if self.ledger is None:
            self.ledger = await self._load()
        infos = {stream: await self.bus.stream_state(stream) for stream, _, _ in _logs(self.run)}  # None: no stream yet
        if why := self._out_of_step(infos):
            log.warning("ledger of run %s: %s; rebuilding from the logs", self.run, why)
            self.ledger, self.source = Ledger(self.run), f"rebuilt: {why}"
            self._since_snapshot, self._snapshot_at = SNAPSHOT_AFTER_EVENTS, 0.0  # replace the snapshot now
        ledger = self.ledger
        for stream, subject, type_ in _logs(self.run):
            info = infos[stream]
            if info is None:
                continue
            ledger.created[stream] = info.created
            start = ledger.cursor.get(stream, 0) + 1
            if info.last_seq >= start:
                async for seq, event in self.bus.read_log(stream, subject, start, type_):
                    ledger.add(event, seq)
                    self.folded += 1
                    self._since_snapshot += 1
                    ledger.cursor[stream] = seq
                # The read covered the log up to at least last_seq: what it skipped (other runs' events,
                # progress, an undecodable message) is not read again.
                ledger.cursor[stream] = max(ledger.cursor.get(stream, 0), info.last_seq)
            if stream == Streams.PROGRESS:
                ledger.expire_alerts(info.first_seq)
        await asyncio.gather(self._read_manifest(), self._read_dead_letters(), self._read_prompt_queue())
        self._maybe_snapshot()
        return ledger

    def _out_of_step(self, infos: dict[str, StreamState | None]) -> str:
        """Why the fold cannot continue from these streams ("" when it can): a stream was recreated."""
        ledger = self.ledger
        assert ledger is not None
        for stream, info in infos.items():
            seen = ledger.cursor.get(stream, 0)
            if info is None:
                if seen:
                    return f"stream {stream} is gone (the fold had read it to {seen})"
                continue
            if seen > info.last_seq:
                return f"stream {stream} ends at {info.last_seq}, before the fold's sequence {seen}"
            if ledger.created.get(stream, info.created) != info.created:
                return f"stream {stream} was recreated"
        return ""

    async def rebuild(self) -> Ledger:
        """Drop the fold and fold the logs from sequence 1 (the path a bad snapshot takes, and the check)."""
        self.ledger, self.source = Ledger(self.run), "rebuilt: on request"
        return await self.refresh()

    # --- snapshot --------------------------------------------------------------------------------

    async def _load(self) -> Ledger:
        if self.store is None or not self.use_snapshot:
            self.source = "logs"
            return Ledger(self.run)
        try:
            data = await asyncio.to_thread(self.store.get_bytes, Keys.ledger(self.run))
            ledger = Ledger.decode(data, self.run)
        except KeyNotFound:
            self.source = "logs"
            return Ledger(self.run)
        except (StoreError, SnapshotError) as e:  # corrupt (checksum), unreadable, another schema or run
            log.warning("ledger snapshot of run %s unusable (%s); rebuilding from the logs", self.run, e)
            self.source = f"rebuilt: {e}"
            self._since_snapshot = SNAPSHOT_AFTER_EVENTS  # replace it at the first chance
            return Ledger(self.run)
        self.source = "snapshot"
        self._snapshot_at = time.monotonic()
        return ledger

    def _maybe_snapshot(self) -> None:
        due = self._since_snapshot >= SNAPSHOT_AFTER_EVENTS and time.monotonic() - self._snapshot_at >= SNAPSHOT_EVERY_S
        if due and self.store is not None and self.ledger is not None and (self._saving is None or self._saving.done()):
            data = self.ledger.encode()  # now, on the loop: a consistent fold; the upload runs beside the next poll
            self._since_snapshot, self._snapshot_at = 0, time.monotonic()
            self._saving = asyncio.create_task(self._put(data))

    async def _put(self, data: bytes) -> None:
        assert self.store is not None
        try:
            await asyncio.to_thread(self.store.put_bytes, Keys.ledger(self.run), data)
        except StoreError as e:  # a reader must not fail for want of a snapshot: the next one tries again
            log.warning("ledger snapshot of run %s not written: %s", self.run, e)
            self._since_snapshot = SNAPSHOT_AFTER_EVENTS

    async def save(self) -> None:
        """Write the snapshot now (and wait for any upload under way)."""
        await self.flush()
        if self.store is not None and self.ledger is not None:
            self._since_snapshot, self._snapshot_at = 0, time.monotonic()
            await self._put(self.ledger.encode())

    async def flush(self) -> None:
        """Wait for a snapshot upload under way (a one-shot process calls this before it exits)."""
        if self._saving is not None:
            await self._saving

    # --- per poll: what is not a log --------------------------------------------------------------

    async def _read_manifest(self) -> None:
        if self.store is None:
            return
        key = Keys.manifest(self.run)
        info = await asyncio.to_thread(self.store.stat, key)
        if info is None:
            self.manifest, self._manifest_sha = None, ""
        elif info.sha256 != self._manifest_sha:
            self.manifest = msgspec.json.decode(await asyncio.to_thread(self.store.get_bytes, key))
            self._manifest_sha = info.sha256

    async def _read_dead_letters(self) -> None:
        """Dead letters per stage as the stream has them now (one request: the server counts per subject)."""
        info = await self.bus.stream_state(Streams.DEADLETTER, subjects_filter=Subjects.deadletter(self.run, ANY))
        counts: dict[str, int] = {}
        for subject, n in (info.subjects if info is not None else {}).items():
            stage = subject.split(".")[2]
            counts[stage] = counts.get(stage, 0) + n
        self.dead_lettered = counts

    async def _read_prompt_queue(self) -> None:
        """The generate consumer's in-flight and queued prompts (before any generator has started: every
        prompt fed is queued)."""
        info = await self.bus.consumer_state(Streams.PROMPTS, durable("generate", self.run))
        if info is not None:
            self.in_flight, self.queued = info.ack_pending, info.pending
            return
        self.in_flight = 0
        sinfo = await self.bus.stream_state(Streams.PROMPTS, subjects_filter=Subjects.prompts(self.run))
        self.queued = sum(sinfo.subjects.values()) if sinfo is not None else 0

    def stages(self) -> StageCounts:
        """The numbers each stage's end is decided by, as of the last refresh."""
        assert self.ledger is not None, "refresh() first"
        manifest = self.manifest
        return StageCounts(
            fed=manifest is not None, accepted=int(manifest.get("total_accepted", 0)) if manifest else 0,
            completed=self.ledger.completed, generate_dead=self.dead_lettered.get("generate", 0),
            in_flight=self.in_flight, queued=self.queued, shards=len(self.ledger.shard_keys),
            tokenized_shards=self.ledger.tokenized_in_shards, tokenize_dead=self.dead_lettered.get("tokenize", 0),
        )


@dataclass(frozen=True)
class StageCounts:
    """A run's numbers that say whether generation and tokenization are over (`RunLedger.stages()`)."""

    fed: bool  # the feed manifest is written: the feeder is done
    accepted: int  # prompts the feeder accepted
    completed: int  # unique prompts in completion shards
    generate_dead: int  # prompts dead-lettered by generation
    in_flight: int  # prompts delivered to a generator, not acked
    queued: int  # prompts not yet delivered
    shards: int  # completion shards
    tokenized_shards: int  # of those, the ones with a tokenized shard
    tokenize_dead: int  # completion shards dead-lettered by tokenization


def generation_done(c: StageCounts) -> bool:
    """Every accepted prompt is completed or dead-lettered, and none is in flight."""
    return c.fed and c.accepted > 0 and c.completed + c.generate_dead >= c.accepted and c.in_flight == 0


def tokenization_done(c: StageCounts) -> bool:
    """Every completion shard is tokenized or dead-lettered."""
    return c.shards > 0 and c.tokenized_shards + c.tokenize_dead >= c.shards


def data_complete(c: StageCounts) -> bool:
    """The run's training data is all there, so a pass over it counts as an epoch: generation and
    tokenization are done, or nothing was ever fed or generated (then the tokenized shards announced by
    hand are the whole of it)."""
    nothing_fed = not c.fed and c.accepted == 0 and c.queued == 0 and c.in_flight == 0 and c.shards == 0
    return nothing_fed or (generation_done(c) and tokenization_done(c))
