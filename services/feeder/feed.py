"""The feed: source records → normalized, deduplicated PromptTasks on the bus, rejects and manifest in S3.

Idempotence: every task is published with `Nats-Msg-Id = <run>:<prompt_id>` (the server drops a
repeat inside its duplicate window), and then recorded in the REGISTRY stream (one subject per
prompt, a second publish refused), which survives server restarts. A feed of a run that already
has registry entries checks the registry before publishing. The order task → registry means a
crash in between costs at most one duplicate generation (deduped on read), never a lost prompt.
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import TextIO

import msgspec

from shared.bus import Bus, ProgressLoop
from shared.config import Config, fingerprint
from shared.messages import ChatMessage, FeederProgress, PromptTask
from shared.records import jsonl_line
from shared.runconfig import record_run_config
from shared.store import Store
from shared.topology import ANY, Keys, Streams, Subjects

from .normalize import RejectedRecord, UnknownShape, normalize, prompt_id
from .reasons import Reason
from .sources import SHAPES, Raw, SourceError, escaped, local_copy, read_records

log = logging.getLogger("dflash.feeder")

BATCH = 1000
PENDING_BYTES = 32 << 20  # content bytes held for one token-count-and-publish batch
RECORD_ECHO_BYTES = 4096  # a parsed reject up to this size is echoed whole in rejects.jsonl, a larger one as a prefix


class ForeignSource(SourceError):
    """Every record read so far has none of the four record shapes: the wrong file, refused once."""


class FeedSummary(msgspec.Struct, kw_only=True):
    """Counts that add up: read = accepted + duplicates + rejected + blank, for every source read."""

    run: str
    sources: list[str]
    read: int = 0  # lines (JSONL), elements (JSON array) or rows (Parquet)
    blank: int = 0  # empty lines
    accepted: int = 0
    duplicates: int = 0  # repeats inside this feed
    rejected: int = 0
    published: int = 0  # new on the bus
    already_fed: int = 0  # accepted but queued by an earlier feed of this run
    reject_reasons: dict[str, int] = {}  # Reason code -> rejects
    reject_examples: dict[str, str] = {}  # Reason code -> its first reject: "source:line: detailed reason"
    refused: dict[str, str] = {}  # source -> why it was not read (or not read to the end)
    seconds: float = 0.0


COUNTS = ("read", "blank", "accepted", "duplicates", "rejected", "published", "already_fed")
FOREIGN_SAMPLE = 100  # a source whose first records all have none of the four shapes is refused once


class TokenCounter:
    """Prompt length in target tokens (contents plus a per-turn allowance for the template)."""

    PER_TURN = 4

    def __init__(self, cfg: Config) -> None:
        from tokenizers import Tokenizer

        from shared.model import resolve_target

        self.tok = Tokenizer.from_file(str(resolve_target(cfg.model.target) / "tokenizer.json"))
        # No token covers more bytes than the longest vocabulary entry (added tokens included), so a prompt
        # of B bytes has at least B / max_token_bytes tokens: far-too-long prompts are refused untokenized.
        self.max_token_bytes = max(len(t.encode()) for t in self.tok.get_vocab(with_added_tokens=True))

    def lower_bound(self, conv: list[ChatMessage]) -> int:
        return sum(len(m.content.encode()) for m in conv) // self.max_token_bytes + self.PER_TURN * len(conv)

    def upper_bound(self, conv: list[ChatMessage]) -> int:
        """Byte-level BPE and byte-fallback tokenizers never emit more tokens than bytes (+1 for a prefix)."""
        return sum(len(m.content.encode()) + 1 for m in conv) + self.PER_TURN * len(conv)

    def count(self, convs: list[list[ChatMessage]], limit: int) -> list[int]:
        """Token counts, exact where the bound could exceed `limit` (the rest get their upper bound)."""
        bounds = [self.upper_bound(c) for c in convs]
        todo = [i for i, b in enumerate(bounds) if b > limit]
        if not todo:
            return bounds
        exact = self._exact([convs[i] for i in todo])
        for i, n in zip(todo, exact, strict=True):
            bounds[i] = n
        return bounds

    def _exact(self, convs: list[list[ChatMessage]]) -> list[int]:
        flat = [m.content for conv in convs for m in conv]
        lens = [len(e.ids) for e in self.tok.encode_batch(flat, add_special_tokens=False)]
        out, i = [], 0
        for conv in convs:
            out.append(sum(lens[i:i + len(conv)]) + self.PER_TURN * len(conv))
            i += len(conv)
        return out


class _SourceBatch:
    """Accepted records of one source waiting for their token count and publish, and its pending rejects.

    Bounded: at most BATCH prompts or PENDING_BYTES of content are held; a prompt whose byte length alone
    puts it over max_prompt_tokens is rejected at once, without being held or tokenized."""

    def __init__(self, feeder: Feeder, source: str, rejects_file: TextIO) -> None:
        self.feeder, self.source, self.rejects_file = feeder, source, rejects_file
        self.pending: list[tuple[Raw, list[ChatMessage], str]] = []
        self.pending_bytes = 0
        self.rejects: list[str] = []

    async def add(self, raw: Raw, msgs: list[ChatMessage], pid: str) -> None:
        f = self.feeder
        limit = f.cfg.feeder.max_prompt_tokens
        if f.counter and (low := f.counter.lower_bound(msgs)) > limit:
            f._reject(self.rejects, self.source, raw, Reason.PROMPT_TOO_LONG,
                      f"prompt too long: at least {low} tokens by its length in bytes > max_prompt_tokens {limit}")
            return
        self.pending.append((raw, msgs, pid))
        self.pending_bytes += sum(len(m.content) for m in msgs)
        if len(self.pending) >= BATCH or self.pending_bytes >= PENDING_BYTES:
            await self.flush()

    async def flush(self) -> None:
        if not self.pending:
            return
        f, limit = self.feeder, self.feeder.cfg.feeder.max_prompt_tokens
        lens = f.counter.count([m for _, m, _ in self.pending], limit) if f.counter else [0] * len(self.pending)
        tasks = []
        for (raw, msgs, pid), n in zip(self.pending, lens, strict=True):
            if f.counter and n > limit:
                f._reject(self.rejects, self.source, raw, Reason.PROMPT_TOO_LONG,
                          f"prompt too long: ~{n} tokens > max_prompt_tokens {limit}")
                continue
            tasks.append(PromptTask(run=f.run, prompt_id=pid, messages=msgs, source=self.source, line=raw.line))
        f.summary.accepted += len(tasks)
        self.pending.clear()
        self.pending_bytes = 0
        await f._publish(tasks)

    def write_rejects(self) -> None:
        self.rejects_file.writelines(self.rejects)
        self.rejects.clear()


class Feeder:
    def __init__(self, cfg: Config, bus: Bus, store: Store, worker: str = "feeder") -> None:
        self.cfg, self.bus, self.store, self.worker = cfg, bus, store, worker
        self.run = cfg.run
        self.counter = TokenCounter(cfg) if cfg.feeder.max_prompt_tokens > 0 else None
        self.summary = FeedSummary(run=self.run, sources=[])
        self.reasons: Counter[str] = Counter()  # Reason code -> rejects
        self.examples: dict[str, str] = {}  # Reason code -> its first reject, "source:line: reason"
        self.source_examples: dict[str, str] = {}  # the same for the source being read
        self._seen: set[bytes] = set()
        self._resume = False
        self.per_source: dict[str, dict] = {}

    def progress(self) -> FeederProgress:
        s = self.summary
        return FeederProgress(run=self.run, worker=self.worker, read=s.read, accepted=s.accepted,
                              duplicates=s.duplicates, rejected=s.rejected, published=s.published)

    async def _registered(self, ids: list[str]) -> list[bool]:
        async def one(pid: str) -> bool:
            return await self.bus.last_msg(Streams.REGISTRY, Subjects.registry(self.run, pid), direct=True) is not None

        return list(await asyncio.gather(*(one(pid) for pid in ids)))

    async def _has_registry(self) -> bool:
        return await self.bus.last_msg(Streams.REGISTRY, Subjects.registry(self.run, ANY)) is not None

    async def _publish(self, batch: list[PromptTask]) -> None:
        if self._resume:
            known = await self._registered([t.prompt_id for t in batch])
            self.summary.already_fed += sum(known)
            batch = [t for t, k in zip(batch, known, strict=True) if not k]
        if not batch:
            return
        window = self.cfg.feeder.publish_window
        acks = await self.bus.publish_many(
            [(Subjects.prompts(self.run), t, f"{self.run}:{t.prompt_id}") for t in batch], window=window
        )
        fresh = sum(not a.duplicate for a in acks)
        self.summary.published += fresh
        self.summary.already_fed += len(acks) - fresh
        # The registry entry is written with a plain publish (JetStream stores it; no ack awaited): a lost
        # entry costs at most one duplicate generation after a server restart, never a lost prompt, and a
        # refusal (already registered) is exactly what we want.
        for t in batch:
            await self.bus.publish_core(Subjects.registry(self.run, t.prompt_id), b"")

    def _reject(self, out: list[str], source: str, raw: Raw, code: str, reason: str) -> None:
        """One line of rejects.jsonl: where, why (its code and the detail), and what was there (the record,
        or its first bytes escaped)."""
        self.summary.rejected += 1
        self.reasons[code] += 1
        self.examples.setdefault(code, f"{source}:{raw.line}: {reason}")
        self.source_examples.setdefault(code, f"{source}:{raw.line}: {reason}")
        entry: dict = {"source": source, "line": raw.line, "code": str(code), "reason": reason, "record": None}
        if raw.error:
            entry["raw"] = escaped(raw.raw, raw.size)
        else:
            try:
                encoded = msgspec.json.encode(raw.value)
            except (TypeError, ValueError, OverflowError, RecursionError):  # a Parquet value JSON has no form for
                encoded = repr(raw.value).encode()
                entry["raw"] = escaped(encoded, len(encoded))
            else:
                if len(encoded) <= RECORD_ECHO_BYTES:
                    entry["record"] = raw.value
                else:
                    entry["raw"] = escaped(encoded, len(encoded))
        out.append(jsonl_line(entry))

    async def feed_source(self, source: str, rejects_file: TextIO) -> None:
        """Every record of `source` ends as accepted, duplicate, rejected or blank. Rejects are held back
        until FOREIGN_SAMPLE records have been read, so a foreign file is refused without a reject per line."""
        with local_copy(source, self.cfg) as path:
            batch = _SourceBatch(self, source, rejects_file)
            try:
                await self._read(batch, path)
            except ForeignSource:
                raise
            except SourceError:  # unreadable from some record on: the records before it are kept and counted
                await batch.flush()
                batch.write_rejects()
                raise

    async def _read(self, batch: _SourceBatch, path: Path) -> None:
        s = self.summary
        foreign_keys: set[str] = set()  # keys of the sample's foreign records; "" once one record is not foreign
        read = 0
        for raw in read_records(path, max_record_bytes=self.cfg.feeder.max_record_bytes):
            read += 1
            s.read += 1
            if read == FOREIGN_SAMPLE + 1:  # the sample is complete: decide before the next record
                self._check_not_foreign(batch.source, foreign_keys, FOREIGN_SAMPLE)
            if read > FOREIGN_SAMPLE and len(batch.rejects) >= BATCH:
                batch.write_rejects()
            if raw.blank:
                s.blank += 1
                continue
            if raw.error:
                foreign_keys.add("")
                self._reject(batch.rejects, batch.source, raw, raw.code or Reason.INVALID_JSON, raw.error)
                continue
            try:
                msgs = normalize(raw.value)
            except RejectedRecord as e:
                if read <= FOREIGN_SAMPLE:
                    foreign_keys.update((e.keys or [""]) if isinstance(e, UnknownShape) else [""])
                self._reject(batch.rejects, batch.source, raw, e.code, str(e))
                continue
            foreign_keys.add("")
            pid = prompt_id(msgs)
            digest = bytes.fromhex(pid)
            if digest in self._seen:
                s.duplicates += 1
                continue
            self._seen.add(digest)
            await batch.add(raw, msgs, pid)
        await batch.flush()
        if read <= FOREIGN_SAMPLE:
            self._check_not_foreign(batch.source, foreign_keys, read)
        batch.write_rejects()

    @staticmethod
    def _check_not_foreign(source: str, keys: set[str], records: int) -> None:
        """Refuse a source whose records so far are all objects with none of the four shapes."""
        if keys and "" not in keys:
            shown = ", ".join(sorted(keys)[:20])
            raise ForeignSource(f"{source}: none of its first {records} records has a prompt; keys found: {shown}; "
                                f"expected {SHAPES}")

    async def feed(self, sources: list[str]) -> FeedSummary:
        started = time.monotonic()
        await asyncio.to_thread(record_run_config, self.store, self.cfg)  # a run fed without `dfpipe run`
        self._resume = await self._has_registry()
        fd, tmp = tempfile.mkstemp(prefix="dflash-rejects-", suffix=".jsonl")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as rejects:
                async with ProgressLoop(self.bus, Subjects.progress(self.run, "feed", self.worker), self.progress, 2.0):
                    for source in sources:
                        self.summary.sources.append(source)
                        before = msgspec.structs.asdict(self.summary)
                        reasons_before, examples_before = Counter(self.reasons), dict(self.examples)
                        self.source_examples = {}
                        refused = ""
                        try:
                            await self.feed_source(source, rejects)
                        except ForeignSource as e:  # nothing of it was accepted: as if it was never read
                            refused = str(e)
                            for k in COUNTS:
                                setattr(self.summary, k, before[k])
                            self.reasons, self.examples = reasons_before, examples_before
                        except SourceError as e:  # unreadable (from some record on): what was read counts
                            refused = str(e)
                        after = msgspec.structs.asdict(self.summary)
                        entry: dict = {k: after[k] - before[k] for k in COUNTS}
                        entry["reject_reasons"] = dict((self.reasons - reasons_before).most_common())
                        entry["reject_examples"] = {c: self.source_examples[c] for c in entry["reject_reasons"]}
                        entry["ts"] = time.time()
                        if refused:
                            entry["refused"] = refused
                            self.summary.refused[source] = refused
                            log.error("source refused: %s", refused)
                        self.per_source[source] = entry
            await self.bus.flush()  # the registry entries are on the server before the manifest says done
            self.summary.reject_reasons = dict(self.reasons.most_common())
            self.summary.reject_examples = {code: self.examples[code] for code in self.summary.reject_reasons}
            self.summary.seconds = round(time.monotonic() - started, 3)
            await asyncio.to_thread(self._write_rejects, Path(tmp), sources)
            await asyncio.to_thread(self._write_manifest)
        finally:
            os.unlink(tmp)
        done = msgspec.structs.replace(self.progress(), done=True)
        await self.bus.publish(Subjects.progress(self.run, "feed", self.worker), done)
        return self.summary

    def _write_rejects(self, new: Path, sources: list[str]) -> None:
        """rejects.jsonl keeps earlier feeds' lines for other sources; this feed's sources are rewritten."""
        key = Keys.rejects(self.run)
        kept = b""
        if self.store.exists(key):
            dec = msgspec.json.Decoder()
            old = self.store.get_bytes(key)
            kept = b"".join(line + b"\n" for line in old.splitlines()
                            if line.strip() and dec.decode(line).get("source") not in sources)
        # Written on every feed, empty when nothing was rejected: the manifest's rejects_key always exists.
        self.store.put_bytes(key, kept + new.read_bytes(), "application/x-ndjson")

    def _write_manifest(self) -> None:
        """Per-source counts (a re-feed of a source replaces its entry), totals over all sources."""
        key = Keys.manifest(self.run)
        manifest = msgspec.json.decode(self.store.get_bytes(key)) if self.store.exists(key) else {}
        feeds = manifest.get("sources", {})
        feeds.update(self.per_source)
        manifest.update({
            "run": self.run,
            "sources": feeds,
            "total_read": sum(f.get("read", 0) for f in feeds.values()),
            "total_blank": sum(f.get("blank", 0) for f in feeds.values()),
            "total_accepted": sum(f["accepted"] for f in feeds.values()),
            "total_rejected": sum(f["rejected"] for f in feeds.values()),
            "total_duplicates": sum(f["duplicates"] for f in feeds.values()),
            "refused": {src: f["refused"] for src, f in feeds.items() if f.get("refused")},
            "config_fingerprint": fingerprint(msgspec.structs.replace(self.cfg, bus=None, store=None, stack=None)),
            "model": self.cfg.model.target,
            "sampling": msgspec.to_builtins(self.cfg.sampling),
            "rejects_key": Keys.rejects(self.run),
            "updated": time.time(),
        })
        self.store.put_bytes(key, msgspec.json.encode(manifest), "application/json")
