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
import re
import tempfile
import time
from collections import Counter
from pathlib import Path

import msgspec
import nats.js.errors

from shared.bus import Bus, ProgressLoop
from shared.config import Config, fingerprint
from shared.messages import ChatMessage, FeederProgress, PromptTask, Subjects
from shared.records import jsonl_line
from shared.store import Keys, Store

from .normalize import RejectedRecord, normalize, prompt_id
from .sources import Raw, local_copy, read_records

log = logging.getLogger("dflash.feeder")

BATCH = 1000


def reason_kind(reason: str) -> str:
    """A reject reason without its specifics, for counting: "messages[2]: unknown role 'bot'" → "unknown role"."""
    if reason.startswith("invalid JSON"):
        return "invalid JSON"
    text = re.sub(r"^[\w\[\]\d.]+: ", "", reason)
    text = re.sub(r"\(.*?\)|'[^']*'|~?\d+", "", text)
    return re.sub(r"\s+", " ", text).strip(" :>")[:60]


class FeedSummary(msgspec.Struct, kw_only=True):
    run: str
    sources: list[str]
    read: int = 0
    accepted: int = 0
    duplicates: int = 0  # repeats inside this feed
    rejected: int = 0
    published: int = 0  # new on the bus
    already_fed: int = 0  # accepted but queued by an earlier feed of this run
    reject_reasons: dict[str, int] = {}
    seconds: float = 0.0


class TokenCounter:
    """Prompt length in target tokens (contents plus a per-turn allowance for the template)."""

    PER_TURN = 4

    def __init__(self, cfg: Config) -> None:
        from tokenizers import Tokenizer

        from shared.model import resolve_target

        self.tok = Tokenizer.from_file(str(resolve_target(cfg.model.target) / "tokenizer.json"))

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


class Feeder:
    def __init__(self, cfg: Config, bus: Bus, store: Store, worker: str = "feeder") -> None:
        self.cfg, self.bus, self.store, self.worker = cfg, bus, store, worker
        self.run = cfg.run
        self.counter = TokenCounter(cfg) if cfg.feeder.max_prompt_tokens > 0 else None
        self.summary = FeedSummary(run=self.run, sources=[])
        self.reasons: Counter[str] = Counter()
        self._seen: set[bytes] = set()
        self._resume = False
        self.per_source: dict[str, dict] = {}

    def progress(self) -> FeederProgress:
        s = self.summary
        return FeederProgress(run=self.run, worker=self.worker, read=s.read, accepted=s.accepted,
                              duplicates=s.duplicates, rejected=s.rejected, published=s.published)

    async def _registered(self, ids: list[str]) -> list[bool]:
        async def one(pid: str) -> bool:
            try:
                await self.bus.js.get_last_msg("REGISTRY", Subjects.registry(self.run, pid), direct=True)
                return True
            except nats.js.errors.NotFoundError:
                return False

        return list(await asyncio.gather(*(one(pid) for pid in ids)))

    async def _has_registry(self) -> bool:
        try:
            await self.bus.js.get_last_msg("REGISTRY", f"dflash.{self.run}.feed.registry.*")
            return True
        except nats.js.errors.NotFoundError:
            return False

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
            await self.bus.nc.publish(Subjects.registry(self.run, t.prompt_id), b"")

    def _reject(self, out, source: str, raw: Raw, reason: str) -> None:
        self.summary.rejected += 1
        self.reasons[reason_kind(reason)] += 1
        record = raw.value if raw.error == "" else None
        out.write(jsonl_line({"source": source, "line": raw.line, "reason": reason, "record": record}))

    async def feed_source(self, source: str, rejects) -> None:
        s = self.summary
        max_tokens = self.cfg.feeder.max_prompt_tokens
        with local_copy(source, self.cfg) as path:
            pending: list[tuple[Raw, list[ChatMessage], str]] = []

            async def flush() -> None:
                lens = (self.counter.count([m for _, m, _ in pending], max_tokens) if self.counter
                        else [0] * len(pending))
                tasks = []
                for (raw, msgs, pid), n in zip(pending, lens, strict=True):
                    if self.counter and n > max_tokens:
                        self._reject(rejects, source, raw, f"prompt too long: ~{n} tokens > max_prompt_tokens {max_tokens}")
                        continue
                    tasks.append(PromptTask(run=self.run, prompt_id=pid, messages=msgs, source=source, line=raw.line))
                s.accepted += len(tasks)
                await self._publish(tasks)
                pending.clear()

            for raw in read_records(path):
                s.read += 1
                if raw.error:
                    self._reject(rejects, source, raw, raw.error)
                    continue
                try:
                    msgs = normalize(raw.value)
                except RejectedRecord as e:
                    self._reject(rejects, source, raw, str(e))
                    continue
                pid = prompt_id(msgs)
                digest = bytes.fromhex(pid)
                if digest in self._seen:
                    s.duplicates += 1
                    continue
                self._seen.add(digest)
                pending.append((raw, msgs, pid))
                if len(pending) >= BATCH:
                    await flush()
            if pending:
                await flush()

    async def feed(self, sources: list[str]) -> FeedSummary:
        started = time.monotonic()
        self._resume = await self._has_registry()
        fd, tmp = tempfile.mkstemp(prefix="dflash-rejects-", suffix=".jsonl")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as rejects:
                async with ProgressLoop(self.bus, Subjects.progress(self.run, "feed", self.worker), self.progress, 2.0):
                    for source in sources:
                        self.summary.sources.append(source)
                        before = msgspec.structs.asdict(self.summary)
                        reasons_before = Counter(self.reasons)
                        await self.feed_source(source, rejects)
                        after = msgspec.structs.asdict(self.summary)
                        entry = {k: after[k] - before[k] for k in ("read", "accepted", "duplicates", "rejected",
                                                                     "published", "already_fed")}
                        entry["reject_reasons"] = dict((self.reasons - reasons_before).most_common())
                        entry["ts"] = time.time()
                        self.per_source[source] = entry
            await self.bus.nc.flush()  # the registry entries are on the server before the manifest says done
            self.summary.reject_reasons = dict(self.reasons.most_common())
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
        data = kept + new.read_bytes()
        if data or self.store.exists(key):
            self.store.put_bytes(key, data, "application/x-ndjson")

    def _write_manifest(self) -> None:
        """Per-source counts (a re-feed of a source replaces its entry), totals over all sources."""
        key = Keys.manifest(self.run)
        manifest = msgspec.json.decode(self.store.get_bytes(key)) if self.store.exists(key) else {}
        feeds = manifest.get("sources", {})
        feeds.update(self.per_source)
        manifest.update({
            "run": self.run,
            "sources": feeds,
            "total_accepted": sum(f["accepted"] for f in feeds.values()),
            "total_rejected": sum(f["rejected"] for f in feeds.values()),
            "total_duplicates": sum(f["duplicates"] for f in feeds.values()),
            "config_fingerprint": fingerprint(msgspec.structs.replace(self.cfg, bus=None, store=None, stack=None)),
            "model": self.cfg.model.target,
            "sampling": msgspec.to_builtins(self.cfg.sampling),
            "rejects_key": Keys.rejects(self.run),
            "updated": time.time(),
        })
        self.store.put_bytes(key, msgspec.json.encode(manifest), "application/json")
