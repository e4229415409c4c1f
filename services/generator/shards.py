"""Write-then-ack: completions are buffered into shards; a prompt is acked only once its shard is in S3
and its ShardWritten event is on the bus.

Each worker numbers its shards 0, 1, 2, … under `runs/<run>/completions/<worker>/`, continuing
after the highest number already in S3, so a key is fixed before it is written and never
reused. `put_new` refuses to overwrite a key with different content (two live workers given the
same name): the writer then moves to the next number, loudly. S3 or NATS down: the shard is
kept and retried under the failure policy (shared.failures), its prompts stay unacked (heartbeats keep them), nothing is lost.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from functools import partial

from shared.bus import Bus
from shared.failures import Poison, retry_async
from shared.messages import ShardWritten
from shared.records import CompletionRecord, completions_to_parquet, read_completions
from shared.store import ObjectConflict, Store
from shared.topology import Keys, Subjects

log = logging.getLogger("dflash.generator.shards")


def shard_event(run: str, key: str, worker: str, seq: int, records: list[CompletionRecord], sha: str,
                size: int) -> ShardWritten:
    return ShardWritten(
        run=run, key=key, worker=worker, seq=seq, num_records=len(records),
        prompt_ids=[r.prompt_id for r in records], sha256=sha, size_bytes=size,
        completion_tokens=sum(r.completion_tokens for r in records), truncated=sum(r.truncated for r in records),
    )


class ShardWriter:
    """A shard is written when it holds `max_records`, when its oldest record is `max_age_s` old, or
    when the engine has had nothing to do for `idle_s` (`idle_for()` says how long; None: busy): the queue ran
    dry, so nothing is coming to fill it and waiting out `max_age_s` would only delay the run's tail."""

    def __init__(self, bus: Bus, store: Store, run: str, worker: str, *, max_records: int, max_age_s: float,
                 idle_for: Callable[[], float | None] = lambda: None, idle_s: float = 1.0) -> None:
        self.bus, self.store, self.run, self.worker = bus, store, run, worker
        self.max_records, self.max_age_s = max_records, max_age_s
        self.idle_for, self.idle_s = idle_for, idle_s
        self.seq = 0
        self.shards_written = 0
        self.write_errors = 0
        self._records: list[CompletionRecord] = []
        self._waiters: list[asyncio.Future[None]] = []
        self._oldest = 0.0
        self._lock = asyncio.Lock()
        self._timer: asyncio.Task[None] | None = None
        self._flushes: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        prefix = Keys.completions_prefix(self.run, self.worker)
        keys = await asyncio.to_thread(lambda: list(self.store.list(prefix)))
        seqs = [seq for k in keys if (seq := Keys.completions_seq(prefix, k)) is not None]
        if seqs:
            self.seq = max(seqs) + 1
            await self._announce_last(max(seqs))
        self._timer = asyncio.create_task(self._age_flusher())

    async def _announce_last(self, seq: int) -> None:
        """A crash between the S3 write and the publish leaves the last shard unannounced: announce it
        again (the msg id is the key, so an already-announced shard is not published twice)."""
        key = Keys.completions(self.run, self.worker, seq)
        data = await asyncio.to_thread(self.store.get_bytes, key)
        records = read_completions(data)
        info = await asyncio.to_thread(self.store.stat, key)
        event = shard_event(self.run, key, self.worker, seq, records, info.sha256 if info else "", len(data))
        await self.bus.publish(Subjects.shards(self.run), event, msg_id=key)

    @property
    def buffered(self) -> int:
        return len(self._records)

    async def add(self, record: CompletionRecord) -> None:
        """Returns once the record is durably in S3 and announced: then its prompt may be acked."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if not self._records:
            self._oldest = time.monotonic()
        self._records.append(record)
        self._waiters.append(fut)
        if len(self._records) >= self.max_records:
            task = asyncio.create_task(self.flush())
            self._flushes.add(task)
            task.add_done_callback(self._flushes.discard)
        try:
            await asyncio.shield(fut)  # a cancelled handler (shutdown) must not cancel the shared write
        except asyncio.CancelledError:
            if fut in self._waiters:  # not taken by a flush yet: its prompt is nak'ed, so drop the record too
                i = self._waiters.index(fut)
                del self._waiters[i], self._records[i]
            raise

    async def _age_flusher(self) -> None:
        while True:
            await asyncio.sleep(min(0.25, self.max_age_s / 4))
            idle = self.idle_for()
            if self._records and (time.monotonic() - self._oldest >= self.max_age_s
                                  or (idle is not None and idle >= self.idle_s)):
                try:
                    await self.flush()
                except Exception:  # never let the timer die: later shards would wait for max_records only
                    log.exception("shard flush failed")

    async def flush(self) -> None:
        async with self._lock:
            if not self._records:
                return
            records, waiters = self._records, self._waiters
            self._records, self._waiters = [], []
            records, waiters, data = await self._storable(records, waiters)
            if not records:
                return
            while True:
                key = Keys.completions(self.run, self.worker, self.seq)
                try:
                    # S3 or NATS unreachable (transient): keep the shard, keep trying; its prompts stay unacked.
                    await retry_async(f"shard {key} ({len(records)} records)",
                                      partial(self._write, key, self.seq, records, data), deadline_s=None,
                                      on_failure=self._count_error)
                    break
                except ObjectConflict as e:
                    log.error("%s; is another worker named %r running? writing the next shard number", e, self.worker)
                    self.seq += 1
                except Exception as e:
                    # No retry helps (S3 refuses this worker's settings: fatal; or an error nothing explains). The
                    # handlers fail with the error: a fatal one puts their prompts back for a worker that can write
                    # and stops this one, any other is redelivered up to max_deliver (shared.bus).
                    self.write_errors += 1
                    log.error("shard %s (%d records) cannot be written: %s", key, len(records), e)
                    for fut in waiters:
                        if not fut.done():
                            fut.set_exception(e)
                    return
            self.seq += 1
            self.shards_written += 1
            log.info("shard %s: %d records", key, len(records))
            for fut in waiters:
                if not fut.done():
                    fut.set_result(None)

    async def _write(self, key: str, seq: int, records: list[CompletionRecord], data: bytes) -> None:
        """The shard to S3 (once: `put_new`), then its event (once: the key is the msg id)."""
        info, _ = await asyncio.to_thread(self.store.put_new, key, data, "application/vnd.apache.parquet")
        event = shard_event(self.run, key, self.worker, seq, records, info.sha256, len(data))
        await self.bus.publish(Subjects.shards(self.run), event, msg_id=key)

    def _count_error(self, _: BaseException) -> None:
        self.write_errors += 1

    async def _storable(self, records: list[CompletionRecord], waiters: list[asyncio.Future[None]]
                        ) -> tuple[list[CompletionRecord], list[asyncio.Future[None]], bytes]:
        """The shard's Parquet bytes (built off the event loop). A record that cannot be stored (text Arrow
        refuses, such as a lone surrogate from an engine's JSON) fails alone, as Poison: its prompt becomes a
        dead letter with the reason, the others are written; it must not leave the whole shard unacked."""
        try:
            return records, waiters, await asyncio.to_thread(completions_to_parquet, records)
        except Exception:
            pass
        keep: list[tuple[CompletionRecord, asyncio.Future[None]]] = []
        for record, fut in zip(records, waiters, strict=True):
            try:
                await asyncio.to_thread(completions_to_parquet, [record])
                keep.append((record, fut))
            except Exception as e:
                log.error("completion of %s cannot be stored: %s", record.prompt_id, e)
                if not fut.done():
                    fut.set_exception(Poison(f"completion cannot be stored in a shard: {type(e).__name__}: {e}"))
        records, waiters = [r for r, _ in keep], [f for _, f in keep]
        return records, waiters, (await asyncio.to_thread(completions_to_parquet, records) if records else b"")

    async def close(self, timeout_s: float | None = None) -> None:
        """Write what is left. With `timeout_s`, give up after it (S3 or NATS still down at shutdown): the
        prompts of what is not written were nak'ed when their handlers were cancelled, so nothing is lost."""
        try:
            async with asyncio.timeout(timeout_s):
                await asyncio.gather(*self._flushes, return_exceptions=True)
                await self.flush()
        except TimeoutError:
            unwritten = self.buffered + sum(1 for t in self._flushes if not t.done())
            log.warning("shutdown: shard writes still failing after %.0fs; giving up on them (%d buffered records; "
                        "their prompts go back to the queue)", timeout_s, unwritten)
            for task in list(self._flushes):
                task.cancel()
        finally:
            if self._timer:
                self._timer.cancel()
                await asyncio.gather(self._timer, return_exceptions=True)
