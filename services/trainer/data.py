"""The training data: tokenized shards announced on the TOKENIZED log, deduped by prompt_id, in a
deterministic per-epoch order so a resumed run sees exactly the samples it would have seen.

The trainer takes the announcements through its durable consumer (`ShardFeed`) as they arrive,
so training can begin while generation and tokenization still run; the shard list is fixed per
epoch (later shards join the next one). Only the newest template fingerprint is used (a
re-tokenization supersedes the old output). Every `holdout_mod`-th prompt (by prompt_id hash) is
held out of training for `dfpipe eval`.

Memory does not grow with the tokens (DESIGN.md, Scale): each shard is fetched once into a local
disk cache as flat arrays (`ShardCache`: int32 ids + uint8 mask, and a small per-sample table), and
the trainer keeps only per-sample numbers (`SampleIndex`, `SampleSet`: ~70 bytes a sample, no
per-token Python object); a sample's tokens are read from the cache file when a micro-batch needs
them. The cache is shared by every rank of a node (files are written once, by rename).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import tempfile
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from shared.bus import Bus, Delivery, consumer_for
from shared.config import Config, data_dir
from shared.failures import Poison
from shared.messages import TokenizedShard
from shared.records import RecordError, TokenizedSample
from shared.store import ChecksumMismatch, KeyNotFound, Store
from shared.topology import Streams, Subjects


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

    def __init__(self, bus: Bus, run: str, shards: dict[str, tuple[str, int]] | None = None,
                 index: SampleIndex | None = None) -> None:
        self.bus, self.run = bus, run
        self.index = index  # when given, a shard is indexed before it is taken: an unreadable one is a dead letter
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
        if e.num_samples > 0 and e.key not in self.shards:
            if self.index is not None:
                try:  # a truncated, corrupt or foreign shard never reaches a plan: it would fail every pass
                    await asyncio.to_thread(self.index.add, [e.key])
                except (RecordError, ChecksumMismatch, KeyNotFound) as err:
                    raise Poison(f"tokenized shard {e.key}: {err}") from None
            self.shards[e.key] = (e.fingerprint, d.stream_seq)  # a key's first announcement
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append(done)
        await done  # acked (by the bus) when this returns: after the next checkpoint

    async def caught_up(self) -> bool:
        """Every announcement made so far has been taken (so a plan made now sees all of them)."""
        if self._task is not None and self._task.done():  # its consumer loop ended: nothing would ever catch up
            error = None if self._task.cancelled() else self._task.exception()
            raise RuntimeError(f"the trainer's shard feed stopped: {error!r}")
        info = await self.bus.consumer_state(self.spec.stream, self.spec.durable)
        return info is not None and info.pending == 0 and info.ack_pending <= len(self._waiting)

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


async def _announced(bus: Bus, run: str) -> dict[str, tuple[str, int]]:
    """{tokenized shard key: (fingerprint, stream seq of its first announcement)}, from the whole log."""
    shards: dict[str, tuple[str, int]] = {}
    async for seq, e in bus.read_log(Streams.TOKENIZED, Subjects.tokenized(run), 1, TokenizedShard):
        if e.num_samples > 0:
            shards.setdefault(e.key, (e.fingerprint, seq))  # a key's first announcement
    return shards


async def shard_keys(bus: Bus, run: str) -> list[str]:
    """The newest fingerprint's shard keys, read from the whole log (for `dfpipe eval` and readers)."""
    return newest_keys(await _announced(bus, run))


async def shard_keys_in_log_order(bus: Bus, run: str) -> list[str]:
    """The newest fingerprint's shard keys in the order the log first announced them: an order that only
    grows at its end while a run goes on (sorted keys do not: `w0-00000009` sorts before `w1-00000000`)."""
    shards = await _announced(bus, run)
    return sorted(newest_keys(shards), key=lambda k: shards[k][1])


def prompt_part(sample: TokenizedSample) -> list[int]:
    """A tokenized sample's prompt: everything before its first supervised token."""
    first = next((i for i, m in enumerate(sample.loss_mask) if m), len(sample.loss_mask))
    return list(sample.input_ids[:first])


async def held_out_prompts(cfg: Config, store: Store, bus: Bus, limit: int | None = None) -> list[list[int]]:
    """The prompts `dfpipe eval` decodes: the prompt parts of the first `limit` (default `trainer.eval_prompts`)
    held-out samples, shards taken in the order the log announced them and rows in shard order, one per
    prompt_id; any other decoder (the reference's loop in the quality bench) is given exactly the same ones.

    Shards are read only until that many are found: at the mission's size (tens of thousands of shards) an
    eval on a fresh machine fetches a handful of shards, not the whole tokenized dataset. (Until Dec 2026 the
    pick was the `limit` smallest held-out prompt_ids over every shard, which read them all.) A prompt's
    regenerations share its prompt part, so which generation a row is does not change the pick."""
    keys = await shard_keys_in_log_order(bus, cfg.run)
    return await asyncio.to_thread(pick_held_out, store, keys, holdout_mod=cfg.trainer.holdout_mod,
                                   want=limit or cfg.trainer.eval_prompts, cache=ShardCache.for_config(cfg))


def pick_held_out(store: Store, keys: list[str], *, holdout_mod: int, want: int,
                  cache: ShardCache | None = None) -> list[list[int]]:
    """The first `want` held-out prompt parts (at least 2 supervised tokens, one per prompt_id) of `keys` taken
    in order, fetching a shard only while fewer have been found."""
    if holdout_mod <= 0 or want <= 0:
        return []
    cache = cache or ShardCache.temporary()
    out: list[list[int]] = []
    seen: set[bytes] = set()
    for key in keys:
        meta = cache.meta(store, key)
        rows = np.flatnonzero((meta["holdout_hash"] % holdout_mod == 0) & (meta["num_supervised"] >= 2))
        if not len(rows):
            continue
        held = SampleSet(cache, [key], meta[rows], np.zeros(len(rows), dtype=np.int32),
                         np.array([int(meta["num_tokens"].sum())], dtype=np.int64))
        for i, row in enumerate(rows):
            pid = bytes(meta["prompt_id"][row])
            if pid in seen:
                continue
            seen.add(pid)
            out.append(prompt_part(held[i]))
            if len(out) == want:
                return out
    return out


def _holdout_hash(prompt_id: str) -> int:
    return int(hashlib.sha256(prompt_id.encode()).hexdigest()[:8], 16)


def held_out(prompt_id: str, holdout_mod: int) -> bool:
    return holdout_mod > 0 and _holdout_hash(prompt_id) % holdout_mod == 0


# One row per sample of a shard, in row order; `start` is the sample's first token in the shard's token file.
def _meta_dtype(id_width: int) -> np.dtype:
    return np.dtype([("prompt_id", f"S{max(1, id_width)}"), ("generation", "<i4"), ("num_tokens", "<i4"),
                     ("num_supervised", "<i4"), ("truncated", "?"), ("holdout_hash", "<u4"), ("start", "<i8")])


class ShardCache:
    """Tokenized shards on local disk: `<name>.tok` (int32 ids of every sample, then their uint8 masks) and
    `<name>.meta.npy` (the per-sample table), written once each through a rename, the table last (its
    presence means the shard is complete). `<name>` is the key and the object's sha256: a run's objects
    never change, but a run deleted and run again under its name writes other objects under the same keys,
    and those are fetched again, never served from the old ones (one HEAD per shard a process indexes).
    The folder is per S3 endpoint and bucket, so another stack's objects never meet these."""

    def __init__(self, root: Path, *, keep: object = None) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._keep = keep  # a temporary folder's owner: removed with the last reference to this cache
        self._names: dict[str, Path] = {}  # key -> its object's files, once `meta` has looked it up

    @classmethod
    def temporary(cls) -> ShardCache:
        """A private cache removed once nothing uses it (for one-off readers)."""
        tmp = tempfile.TemporaryDirectory(prefix="dflash-samples-")
        return cls(Path(tmp.name), keep=tmp)

    @classmethod
    def for_config(cls, cfg: Config) -> ShardCache:
        if cfg.trainer.data_cache_dir:
            base = Path(cfg.trainer.data_cache_dir).expanduser()
        else:
            base = data_dir(cfg) / "cache" / "tokenized"
        where = hashlib.sha256(f"{cfg.store.endpoint}/{cfg.store.bucket}".encode()).hexdigest()[:12]
        return cls(base / where)

    def tokens_path(self, key: str) -> Path:
        """The shard's token file (`meta` first: it names the file after the object it found)."""
        return self._names[key].with_suffix(".tok")

    def meta(self, store: Store, key: str) -> np.ndarray:
        """The shard's per-sample table, fetching and converting the shard first if this object is not cached."""
        info = store.stat(key)
        if info is None:
            raise KeyNotFound(f"{store.uri(key)} does not exist")
        name = self.root / hashlib.sha256(f"{key}\0{info.sha256}".encode()).hexdigest()[:32]
        meta_path = name.with_suffix(".meta.npy")
        if not meta_path.exists():
            self._fetch(store, key, name.with_suffix(".tok"), meta_path)
        self._names[key] = name
        return np.load(meta_path)

    def _fetch(self, store: Store, key: str, tok_path: Path, meta_path: Path) -> None:
        try:
            table = pq.read_table(pa.BufferReader(store.get_bytes(key)))
            ids = table.column("input_ids").combine_chunks()
            mask = table.column("loss_mask").combine_chunks()
            pids = table.column("prompt_id").to_numpy(zero_copy_only=False)
        except (pa.ArrowInvalid, OSError, KeyError) as e:
            raise RecordError(f"{key}: not a readable tokenized shard: {e}") from None
        offsets = ids.offsets.to_numpy().astype(np.int64)
        lengths = np.diff(offsets)
        if not np.array_equal(lengths, np.diff(mask.offsets.to_numpy())):
            raise RecordError(f"{key}: a sample's mask is not as long as its ids")
        encoded = [p.encode() for p in pids]  # one small object per sample while converting, none kept
        meta = np.zeros(len(pids), dtype=_meta_dtype(max((len(p) for p in encoded), default=1)))
        meta["prompt_id"] = encoded
        meta["generation"] = (table.column("generation").fill_null(0).to_numpy()
                              if "generation" in table.column_names else 0)
        meta["num_tokens"] = lengths
        meta["num_supervised"] = table.column("num_supervised").to_numpy()
        meta["truncated"] = table.column("truncated").to_numpy(zero_copy_only=False)
        meta["holdout_hash"] = [_holdout_hash(p) for p in pids]
        meta["start"] = offsets[:-1] - offsets[0]
        start, end = int(offsets[0]), int(offsets[-1])
        tmp = tok_path.with_name(f"{tok_path.name}.{os.getpid()}.{threading.get_ident()}.tmp")  # per writer thread
        with open(tmp, "wb") as f:
            f.write(ids.values.to_numpy()[start:end].astype("<i4", copy=False).tobytes())
            f.write(mask.values.to_numpy()[start:end].astype(np.uint8).tobytes())
        os.replace(tmp, tok_path)
        tmp = meta_path.with_name(f"{meta_path.name}.{os.getpid()}.{threading.get_ident()}.tmp.npy")
        np.save(tmp, meta)
        os.replace(tmp, meta_path)


class SampleSet:
    """The samples of one pass, sorted by prompt_id: per-sample numbers in arrays, tokens on disk.
    `set[i]` reads sample i from the cache (a TokenizedSample, as the training loop uses)."""

    def __init__(self, cache: ShardCache, keys: list[str], rows: np.ndarray, shard: np.ndarray,
                 shard_tokens: np.ndarray) -> None:
        self.cache = cache
        self._paths = [str(cache.tokens_path(k)) for k in keys]
        self._rows, self._shard, self._shard_tokens = rows, shard, shard_tokens  # the shard's ids end where its masks start
        self.num_tokens = rows["num_tokens"].astype(np.int64)

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, i: int) -> TokenizedSample:
        r = self._rows[i]
        shard = self._shard[i]
        path, n, total = self._paths[shard], int(r["num_tokens"]), int(self._shard_tokens[shard])
        ids = np.fromfile(path, dtype="<i4", count=n, offset=4 * int(r["start"]))
        mask = np.fromfile(path, dtype=np.uint8, count=n, offset=4 * total + int(r["start"]))
        return TokenizedSample(prompt_id=r["prompt_id"].decode(), input_ids=ids.tolist(), loss_mask=mask.tolist(),
                               num_tokens=n, num_supervised=int(r["num_supervised"]), truncated=bool(r["truncated"]),
                               generation=int(r["generation"]))

    def __iter__(self) -> Iterator[TokenizedSample]:
        return (self[i] for i in range(len(self)))

    def memory_bytes(self) -> int:
        return self._rows.nbytes + self._shard.nbytes + self._shard_tokens.nbytes + self.num_tokens.nbytes


class SampleIndex:
    """Every shard indexed so far (its per-sample table, in memory); `select` dedupes and filters them.
    Growing data costs the new shards' fetch and conversion; the dedupe is a vectorized sort."""

    def __init__(self, store: Store, cache: ShardCache) -> None:
        self.store, self.cache = store, cache
        self._meta: dict[str, np.ndarray] = {}

    def add(self, keys: list[str]) -> int:
        """Index the shards not indexed yet; how many were new. Many at once (a trainer's start: every shard of
        its checkpoint) are looked up and fetched 16 at a time, so a start costs S3 round trips / 16."""
        new = [k for k in keys if k not in self._meta]
        if len(new) > 1:
            with ThreadPoolExecutor(min(16, len(new)), thread_name_prefix="shard-index") as pool:
                metas = list(pool.map(lambda k: self.cache.meta(self.store, k), new))
        else:
            metas = [self.cache.meta(self.store, k) for k in new]
        self._meta.update(zip(new, metas, strict=True))
        return len(new)

    def select(self, keys: list[str], *, holdout_mod: int, train: bool) -> SampleSet:
        """One sample per prompt_id by `shared.records.dedupe_samples`' rule (the first by (−generation,
        shard key, row)), with at least 2 supervised tokens, held out or not, sorted by prompt_id."""
        self.add(keys)
        keys = sorted(keys)
        metas = [self._meta[k] for k in keys]
        width = max((m.dtype["prompt_id"].itemsize for m in metas), default=1)
        rows = np.zeros(sum(len(m) for m in metas), dtype=_meta_dtype(width))
        shard = np.repeat(np.arange(len(metas), dtype=np.int32), [len(m) for m in metas])
        row_no = np.zeros(len(rows), dtype=np.int64)
        at = 0
        for m in metas:
            for name in m.dtype.names:
                rows[name][at:at + len(m)] = m[name]
            row_no[at:at + len(m)] = np.arange(len(m))
            at += len(m)
        shard_tokens = np.array([int(m["num_tokens"].sum()) for m in metas], dtype=np.int64)
        # lexsort: the last key is the primary one
        order = np.lexsort((row_no, shard, -rows["generation"].astype(np.int64), rows["prompt_id"]))
        pids = rows["prompt_id"][order]
        first = np.ones(len(order), dtype=bool)
        first[1:] = pids[1:] != pids[:-1]
        order = order[first]
        keep = rows["num_supervised"][order] >= 2
        if holdout_mod > 0:
            keep &= (rows["holdout_hash"][order] % holdout_mod == 0) != train
        elif not train:
            keep[:] = False
        order = order[keep]
        return SampleSet(self.cache, keys, rows[order], shard[order], shard_tokens)


def load_samples(store: Store, keys: list[str], *, holdout_mod: int, train: bool,
                 cache: ShardCache | None = None, index: SampleIndex | None = None) -> SampleSet:
    """One sample per prompt_id (by `dedupe_samples`' rule: a regeneration replaces the older sample), the
    held-out ones or the others. Pass the trainer's `index` so only shards new to it are fetched; without
    `cache` the shards go to a temporary one, removed with the returned set."""
    if index is None:
        index = SampleIndex(store, cache or ShardCache.temporary())
    return index.select(keys, holdout_mod=holdout_mod, train=train)


def epoch_order(n: int, seed: int, epoch: int) -> np.ndarray:
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g).numpy()
