"""The training data: tokenized shards announced on the TOKENIZED log, deduped by prompt_id, in a
deterministic per-epoch order so a resumed run sees exactly the samples it would have seen.

The trainer takes the announcements through its durable consumer (`ShardFeed`) as they arrive,
so training can begin while generation and tokenization still run; the shard list is fixed per
epoch (later shards join the next one). Only the newest template fingerprint is used (a
re-tokenization supersedes the old output). Every `holdout_mod`-th prompt (by prompt_id hash) is
held out of training for `dfpipe eval`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib

import torch

from shared.bus import Bus, Delivery, consumer_for
from shared.messages import Subjects, TokenizedShard
from shared.records import TokenizedSample, dedupe_samples, read_samples
from shared.store import Store


def held_out(prompt_id: str, holdout_mod: int) -> bool:
    return holdout_mod > 0 and int(hashlib.sha256(prompt_id.encode()).hexdigest()[:8], 16) % holdout_mod == 0


def newest_keys(shards: dict[str, tuple[str, int]]) -> list[str]:
    """{key: (fingerprint, stream seq of its first announcement)} → the keys of the fingerprint that
    appeared last. By each fingerprint's first announcement, not its latest: an old template's shard
    announced again (a tokenizer still running it, a re-announcement after a restart) must not send
    training back to the superseded output."""
    if not shards:
        return []
    first: dict[str, int] = {}
    for fp, seq in shards.values():
        first[fp] = min(seq, first.get(fp, seq))
    newest = max(first, key=first.__getitem__)
    return sorted(k for k, (fp, _) in shards.items() if fp == newest)


class ShardFeed:
    """The trainer's durable consumer `train-<run>` on the TOKENIZED log (rank 0 only).

    Write-then-ack, like every stage: an announcement is acked only once a checkpoint holds it
    (`shards` is saved in the cursor), so after a kill the unacked ones come back and the acked
    ones are in the checkpoint the trainer resumes from. Until then the handler waits (the bus
    heartbeats it); if the trainer stops first, the waiting ones are nak'ed for the next trainer.
    """

    def __init__(self, bus: Bus, run: str, shards: dict[str, tuple[str, int]] | None = None) -> None:
        self.bus, self.run = bus, run
        # Announcements are tiny and wait for a checkpoint: a whole run's worth may be pending at once.
        # A crash-looping trainer gets them redelivered many times: that is not the message's fault.
        self.spec = consumer_for("train", run, max_ack_pending=100_000, max_deliver=1_000_000)
        self.shards: dict[str, tuple[str, int]] = {k: (v[0], int(v[1])) for k, v in (shards or {}).items()}
        self._waiting: list[asyncio.Future[None]] = []
        self._stop = asyncio.Event()
        self._task: asyncio.Task | None = None

    def keys(self) -> list[str]:
        return newest_keys(self.shards)

    async def _handle(self, d: Delivery) -> None:
        e: TokenizedShard = d.data
        if e.num_samples > 0:
            self.shards.setdefault(e.key, (e.fingerprint, d.stream_seq))  # a key's first announcement
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append(done)
        await done  # acked (by the bus) when this returns: after the next checkpoint

    async def caught_up(self) -> bool:
        """Every announcement made so far has been taken (so a plan made now sees all of them)."""
        if self._task is not None and self._task.done():  # its consumer loop ended: nothing would ever catch up
            error = None if self._task.cancelled() else self._task.exception()
            raise RuntimeError(f"the trainer's shard feed stopped: {error!r}")
        info = await self.bus.js.consumer_info(self.spec.stream, self.spec.durable)
        return info.num_pending == 0 and info.num_ack_pending <= len(self._waiting)

    def snapshot(self) -> tuple[dict[str, tuple[str, int]], list[asyncio.Future[None]]]:
        """The shard table for a checkpoint, and the announcements it will cover."""
        waiting, self._waiting = self._waiting, []
        return dict(self.shards), waiting

    @staticmethod
    def checkpointed(waiting: list[asyncio.Future[None]]) -> None:
        for f in waiting:
            if not f.done():
                f.set_result(None)

    async def __aenter__(self) -> ShardFeed:
        await self.bus.ensure_consumer(self.spec)
        self._task = asyncio.create_task(self.bus.work(
            self.spec, self._handle, run=self.run, stop=self._stop, message_type=TokenizedShard,
            max_inflight=self.spec.max_ack_pending, grace_s=0.0))
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        if self._task:
            with contextlib.suppress(Exception):
                await self._task


async def shard_keys(bus: Bus, run: str) -> list[str]:
    """The newest fingerprint's shard keys, read from the whole log (for `dfpipe eval` and readers)."""
    shards: dict[str, tuple[str, int]] = {}
    async for seq, e in bus.replay("TOKENIZED", Subjects.tokenized(run), 1, TokenizedShard):
        if e.num_samples > 0:
            shards.setdefault(e.key, (e.fingerprint, seq))  # a key's first announcement
    return newest_keys(shards)


def load_samples(store: Store, keys: list[str], *, holdout_mod: int, train: bool) -> list[TokenizedSample]:
    """One sample per prompt_id (by `dedupe_samples`: a regeneration replaces the older sample), the
    held-out ones or the others."""
    unique = dedupe_samples((key, read_samples(store.get_bytes(key))) for key in keys)
    return sorted((s for s in unique.values() if s.num_supervised >= 2 and held_out(s.prompt_id, holdout_mod) != train),
                  key=lambda s: s.prompt_id)


def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g).tolist()
