"""`dfpipe tokenize`: ShardWritten events in, tokenized Parquet shards and TokenizedShard events out.

config -> connect -> loop. One handler per ShardWritten, write-then-ack:
read the completions shard (checksum verified) -> build samples (off the event loop) -> quality
gate -> write `runs/<run>/tokenized/<fingerprint>/<shard>.parquet` -> publish TokenizedShard
(msg id = key) -> ack. A corrupt or unreadable shard is Poison (dead letter with the reason);
the others go on. An output key that already exists is not recomputed (exists -> skip): its
event is published again from the stored shard.

Dedupe across shards: prompt_ids this run already has under this fingerprint (read from S3 at
start, then kept in memory, with the newest generation of each) are skipped as `duplicate`
unless the record is a newer generation (a deliberate regeneration, whose sample then replaces
the old one on read); readers apply `dedupe_samples` for that and for the rare race of two
workers. A sample's content depends only on its record, the template and the policy, never on
which worker made it.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from shared.bus import Bus, Delivery, WorkStats, consumer_for
from shared.config import Config
from shared.failures import Poison, Retry
from shared.messages import Alert, ShardWritten, TokenizedShard, TokenizerProgress
from shared.records import (
    CompletionRecord,
    RecordError,
    TokenizedSample,
    read_completions,
    read_sample_generations,
    read_samples,
    read_samples_summary,
    samples_to_parquet,
)
from shared.service import Consumer, Context, Progress, Service, serve, startup_thread
from shared.store import (
    ChecksumMismatch,
    KeyNotFound,
    ObjectConflict,
    Store,
    StoreUnavailable,
    sha256_bytes,
)
from shared.topology import Keys, Subjects

from . import checks
from . import gate as gatemod
from .fingerprint import load_target_tokenizer, template_fingerprint
from .pool import BuildPool, default_processes
from .samples import SampleBuilder, ShardSamples

log = logging.getLogger("dflash.tokenizer")
# What a dead letter of a lost or damaged completions shard tells its reader to do (services/generator/requeue.py).
_REGENERATE = "; `dfpipe replay generate --run {run} --shard {key}` generates its prompts again"


def shard_name(completions_key: str) -> str:
    """`runs/r/completions/gen-0/00000003.parquet` -> `gen-0.00000003`: flat, unique, deterministic."""
    rel = completions_key.split("/completions/", 1)[-1]
    return rel.removesuffix(".parquet").replace("/", ".")


def histogram_bucket(n: int) -> str:
    """Power-of-two lower bound: 0, 1, 2, 4, 8, ... (the "OK." incident is a spike in bucket 4)."""
    return "0" if n <= 0 else str(2 ** int(math.log2(n)))


def shard_summary(built: ShardSamples) -> dict[str, Any]:
    """What a shard's build dropped and why, and its histogram (kept samples and those dropped after
    tokenizing), stored in the shard's Parquet metadata: its TokenizedShard event carries the counts (so
    the data-quality numbers are rebuilt from the shard log, through tokenizer restarts), and `drops` lists
    the dropped records (duplicates aside: those are redeliveries) for `dfpipe drops`. Stored with the
    shard, so a shard announced again from S3 (another worker's, or after a crash) keeps all of it."""
    hist = Counter(histogram_bucket(s.num_supervised) for s in built.samples)
    hist.update(histogram_bucket(d.num_supervised) for d in built.drops if d.num_supervised is not None)
    drops = [{"prompt_id": d.prompt_id, "reason": d.reason, "example": d.example, "num_supervised": d.num_supervised}
             for d in built.drops if d.reason != checks.DUPLICATE]
    return {"dropped": built.dropped(), "retokenization_drift": built.drift, "supervised_histogram": dict(hist),
            "drops": drops}


class GateTripped(Exception):
    pass


@dataclass
class Counts:
    shards: int = 0
    skipped_shards: int = 0
    samples_in: int = 0
    samples_kept: int = 0
    tokens: int = 0
    supervised_tokens: int = 0
    drift: int = 0
    exact: int = 0
    dropped: Counter[str] = field(default_factory=Counter)
    histogram: Counter[str] = field(default_factory=Counter)
    poisoned: int = 0


class TokenizerService:
    """Tokenizes one run's completion shards under one template fingerprint."""

    def __init__(self, cfg: Config, bus: Bus, store: Store, tokenizer: Any, *, worker: str = "tokenizer") -> None:
        self.cfg = cfg
        self.run = cfg.run
        self.bus = bus
        self.store = store
        self.worker = worker
        self.builder = SampleBuilder(tokenizer, cfg)  # TemplateError here: the template cannot give exact masks
        self.processes = cfg.tokenizer.processes or default_processes()
        self.pool: BuildPool | None = None  # started with the first shard, closed at shutdown (close())
        self.fingerprint = template_fingerprint(tokenizer, cfg)
        t = cfg.tokenizer
        self.gate = gatemod.QualityGate(t.gate_window, t.gate_threshold, t.gate_identical_threshold)
        self.override = t.gate_override
        self.counts = Counts()
        self.seen: dict[str, int] = {}  # prompt_id → the newest generation emitted
        self._unsettled: set[str] = set()  # tokenized keys whose write failed: stored or not, unknown until _settle
        self.tripped: Alert | None = None
        self.state = "starting"
        self._lock = asyncio.Lock()
        # The previous delivery's turn: build -> gate -> write runs in delivery order even when a later
        # shard's download finishes first (which record of a duplicated prompt_id wins must not be timing).
        self._turn: asyncio.Future[None] | None = None
        self.stop: asyncio.Event | None = None
        self.stats = WorkStats()

    # --- start --------------------------------------------------------------------------------

    async def prepare(self) -> None:
        """Seed the dedupe set from this fingerprint's existing shards; pick up a gate tripped before."""
        prefix = Keys.tokenized_prefix(self.run, self.fingerprint)
        keys = [k for k in await asyncio.to_thread(lambda: list(self.store.list(prefix))) if k.endswith(".parquet")]
        for key in keys:
            data = await asyncio.to_thread(self.store.get_bytes, key)
            self._saw(read_sample_generations(data))
        marker = Keys.tokenizer_gate(self.run, self.fingerprint)
        if await asyncio.to_thread(self.store.exists, marker):
            alert = msgspec.json.decode(await asyncio.to_thread(self.store.get_bytes, marker), type=Alert)
            if self.override:
                await self._warn_override(f"a quality gate tripped earlier for this run: {alert.message}")
            else:
                self.tripped = alert
                log.error("quality gate tripped earlier for run %s (%s): not consuming. %s",
                          self.run, self.store.uri(marker), alert.message)
        elif self.override:
            await self._warn_override("tokenizer.gate_override is set: a tripped quality gate will not stop this run")
        log.info("tokenizer for run %s: fingerprint %s, %d prompt_ids already tokenized", self.run,
                 self.fingerprint, len(self.seen))

    def _build(self, records: list[CompletionRecord]) -> ShardSamples:
        """In a worker thread: the shard's samples, on `processes` cores."""
        if self.pool is None and self.processes > 1:
            self.pool = BuildPool(self.builder.tok, self.cfg, self.processes, self.fingerprint)
        return self.builder.build(records, seen=self.seen, pool=self.pool)

    def _saw(self, samples: Iterable[tuple[str, int]]) -> None:
        for prompt_id, generation in samples:
            if generation > self.seen.get(prompt_id, -1):
                self.seen[prompt_id] = generation

    async def _warn_override(self, message: str) -> None:
        log.warning("%s", message)
        await self.bus.publish(
            Subjects.alert(self.run, gatemod.STAGE),
            Alert(run=self.run, stage=gatemod.STAGE, kind=gatemod.KIND, severity="warning", worker=self.worker,
                  message=f"{message} [template {self.fingerprint}]"),
        )

    # --- one shard ----------------------------------------------------------------------------

    async def handle(self, d: Delivery) -> None:
        await self.process(d.data)

    async def process(self, ev: ShardWritten) -> TokenizedShard | None:
        """Tokenize one completions shard; None when the gate is tripped (the shard stays unconsumed)."""
        if self.tripped is not None:
            raise GateTripped(self.tripped.message)
        # Taken before the first await, so in the order the deliveries arrived; released whatever happens.
        previous, mine = self._turn, asyncio.get_running_loop().create_future()
        self._turn = mine
        try:
            return await self._process(ev, previous)
        finally:
            mine.set_result(None)

    async def _process(self, ev: ShardWritten, previous: asyncio.Future[None] | None) -> TokenizedShard | None:
        key = Keys.tokenized(self.run, self.fingerprint, shard_name(ev.key))
        if await asyncio.to_thread(self.store.exists, key):
            return await self._republish(ev, key)
        data = await self._read_source(ev)
        try:
            records = await asyncio.to_thread(read_completions, data)
        except RecordError as e:
            raise Poison(f"completions shard {ev.key} is unreadable: {e}{_REGENERATE.format(run=self.run, key=ev.key)}") from None
        if previous is not None:
            await asyncio.shield(previous)  # downloads overlap; the rest waits for the earlier delivery
        async with self._lock:  # one shard at a time through build -> gate -> write, in delivery order
            if self.tripped is not None:
                raise GateTripped(self.tripped.message)
            await self._settle()
            built = await asyncio.to_thread(self._build, records)
            trial = self.gate.copy()
            verdict = trial.observe(built.outcomes)
            if verdict is not None and self.gate.verdict is None:
                await self._on_trip(verdict)
                if not self.override:
                    raise GateTripped(verdict.reason)
            summary = shard_summary(built)
            payload = samples_to_parquet(built.samples, summary)
            try:
                info, _ = await asyncio.to_thread(self.store.put_new, key, payload)
            except ObjectConflict:  # another worker wrote this shard first (different dedupe history): theirs stands
                return await self._republish(ev, key)
            except BaseException:
                self._unsettled.add(key)  # it may have landed all the same: settled before the next build
                raise
            # Stored is in the dataset, announced or not: a failed announcement below (a NATS leader lost) is
            # redelivered and re-announced, and a shard built meanwhile must not emit these prompts again.
            self.gate = trial
            self._saw((s.prompt_id, s.generation) for s in built.samples)
            event = await self._announce(ev, key, built.samples, info.sha256, summary)
            c = self.counts
            c.shards += 1
            c.samples_in += len(records)
            c.samples_kept += len(built.samples)
            c.tokens += event.num_tokens
            c.supervised_tokens += event.num_supervised
            c.drift += built.drift
            c.exact += built.exact
            c.dropped.update(summary["dropped"])
            c.histogram.update(summary["supervised_histogram"])
            log.info("%s: %d/%d samples kept, %d tokens (%d supervised), drift %d, dropped %s", key,
                     len(built.samples), len(records), event.num_tokens, event.num_supervised, built.drift,
                     summary["dropped"] or "none")
            return event

    async def _settle(self) -> None:
        """A tokenized shard whose write failed may be stored all the same (the answer lost, not the put): its
        prompts count as emitted before another shard is built, or a redelivered prompt would be emitted twice."""
        for key in sorted(self._unsettled):
            try:
                self._saw(read_sample_generations(await asyncio.to_thread(self.store.get_bytes, key)))
            except KeyNotFound:
                pass  # not stored: its redelivery builds it
            except StoreUnavailable as e:
                raise Retry(f"cannot tell whether {key} was stored: {e}") from None
            except (ChecksumMismatch, RecordError) as e:  # its own redelivery dead-letters it, saying why
                log.warning("%s was stored but cannot be read: %s", key, e)
            self._unsettled.discard(key)

    async def _read_source(self, ev: ShardWritten) -> bytes:
        try:
            data = await asyncio.to_thread(self.store.get_bytes, ev.key)
        except (ChecksumMismatch, KeyNotFound) as e:
            raise Poison(f"completions shard {ev.key}: {e}{_REGENERATE.format(run=self.run, key=ev.key)}") from None
        except StoreUnavailable as e:
            raise Retry(str(e)) from None
        if ev.sha256 and sha256_bytes(data) != ev.sha256:
            raise Poison(f"completions shard {ev.key} differs from its ShardWritten event (sha256 mismatch)"
                         + _REGENERATE.format(run=self.run, key=ev.key))
        return data

    async def _republish(self, ev: ShardWritten, key: str) -> TokenizedShard:
        """The output exists: publish its event again from the stored shard (a duplicate msg id is a no-op)."""
        data = await asyncio.to_thread(self.store.get_bytes, key)
        samples = read_samples(data)
        self._saw((s.prompt_id, s.generation) for s in samples)
        event = await self._announce(ev, key, samples, sha256_bytes(data), read_samples_summary(data))
        self.counts.skipped_shards += 1
        return event

    async def _announce(self, ev: ShardWritten, key: str, samples: list[TokenizedSample], sha256: str,
                        summary: dict[str, Any]) -> TokenizedShard:
        """The stored shard's drop list beside it (written again from the same summary: idempotent), then its event."""
        counts = {k: v for k, v in summary.items() if k in TokenizedShard.__struct_fields__}  # a newer writer's extras
        if drops := summary.get("drops", []):
            lines = b"".join(msgspec.json.encode(d) + b"\n" for d in drops)
            await asyncio.to_thread(self.store.put_bytes, Keys.tokenized_drops(self.run, self.fingerprint,
                                    shard_name(ev.key)), lines, "application/x-ndjson")
        event = TokenizedShard(
            run=self.run, key=key, source_key=ev.key, fingerprint=self.fingerprint, num_samples=len(samples),
            num_tokens=sum(s.num_tokens for s in samples), num_supervised=sum(s.num_supervised for s in samples),
            sha256=sha256, **counts,
        )
        await self.bus.publish(Subjects.tokenized(self.run), event, msg_id=key)
        return event

    async def _on_trip(self, verdict: gatemod.GateVerdict) -> None:
        alert = gatemod.gate_alert(self.run, self.worker, self.fingerprint, verdict, overridden=self.override)
        if self.override:
            log.warning("%s", alert.message)
        else:
            log.error("%s", alert.message)
            self.tripped = alert
            marker = Keys.tokenizer_gate(self.run, self.fingerprint)
            await asyncio.to_thread(self.store.put_bytes, marker, msgspec.json.encode(alert), "application/json")
            if self.stop is not None:
                self.stop.set()
        await self.bus.publish(Subjects.alert(self.run, gatemod.STAGE), alert)

    # --- progress -----------------------------------------------------------------------------

    def snapshot(self) -> TokenizerProgress:
        c = self.counts
        return TokenizerProgress(
            run=self.run, worker=self.worker, fingerprint=self.fingerprint, shards=c.shards,
            samples_in=c.samples_in, samples_kept=c.samples_kept, tokens=c.tokens,
            supervised_tokens=c.supervised_tokens, dropped=dict(c.dropped), retokenization_drift=c.drift,
            supervised_histogram=dict(c.histogram), gate_tripped=self.tripped is not None or self.gate.verdict is not None,
            state=self.state,
        )

    # --- what the skeleton runs (shared/service.py) ------------------------------------------------

    def consumer(self) -> Consumer | None:
        """The run's ShardWritten consumer; none when a quality gate tripped earlier (nothing may be consumed)."""
        if self.tripped is not None:
            return None
        self.state = "running"
        t = self.cfg.tokenizer
        spec = consumer_for("tokenize", self.run, ack_wait_s=t.ack_wait_s, max_ack_pending=t.max_ack_pending)
        return Consumer(spec, self.run, self._handle_gate_aware, ShardWritten, max_inflight=t.max_inflight,
                        stats=self.stats)

    def published_progress(self, every_s: float) -> Progress:
        return Progress(Subjects.progress(self.run, gatemod.STAGE, self.worker), self.snapshot, every_s)

    async def after_consuming(self, *, stay_until: asyncio.Event | None) -> None:
        """A tripped gate ends consuming: the worker stays visible (progress says gate_tripped) until `stay_until`."""
        if self.tripped is None:
            self.state = "stopped"
            return
        self.state = "gate_tripped"
        log.error("tokenizing stopped by the quality gate: %s", self.tripped.message)
        if stay_until is not None:
            await stay_until.wait()

    async def close(self) -> None:
        if self.pool is not None:
            await asyncio.to_thread(self.pool.close)

    async def _handle_gate_aware(self, d: Delivery) -> None:
        try:
            await self.handle(d)
        except GateTripped as e:
            # Not a failure of this shard: put it back for after the fix (or an override) and stop consuming.
            raise Retry(f"quality gate tripped: {e}", delay_s=30.0) from None


def tokenizer_service(cfg: Config, *, worker: str = "tokenizer", burst: bool = False, progress_every_s: float = 5.0,
                      tokenizer: Any = None) -> Service[TokenizerService]:
    """The tokenizer, declared: the target's tokenizer loads, the run's tokenized shards seed the dedupe set, then
    ShardWritten events are consumed until SIGTERM/SIGINT (with `burst`: until none is left) or a gate trips."""

    async def on_startup(ctx: Context) -> TokenizerService:
        tok = tokenizer if tokenizer is not None else await startup_thread(load_target_tokenizer, cfg)
        service = TokenizerService(cfg, ctx.bus, ctx.store, tok, worker=worker)
        service.stop = ctx.stop  # a tripped gate sets it
        return service

    async def on_stop(service: TokenizerService) -> None:
        await service.after_consuming(stay_until=None if burst else service.stop)

    async def on_shutdown(service: TokenizerService | None) -> None:
        if service is not None:
            await service.close()

    return Service(
        name=f"tokenizer-{worker}", on_startup=on_startup, progress=lambda s: s.published_progress(progress_every_s),
        catch_up=TokenizerService.prepare, consumer=TokenizerService.consumer, on_stop=on_stop,
        on_shutdown=on_shutdown, burst=burst,
    )


async def run_service(cfg: Config, *, worker: str = "tokenizer", burst: bool = False,
                      stop: asyncio.Event | None = None, progress_every_s: float = 5.0,
                      tokenizer: Any = None) -> TokenizerService | None:
    """The tokenizer until SIGTERM/SIGINT (or `stop`, or burst's end), for the CLI and for tests; None if it was
    stopped during startup."""
    return await serve(tokenizer_service(cfg, worker=worker, burst=burst, progress_every_s=progress_every_s,
                                         tokenizer=tokenizer), cfg, stop=stop)
