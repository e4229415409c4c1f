"""`dfpipe replay tokenize`: re-tokenize every completion shard from the SHARDS log.

Nothing is regenerated: the log holds every ShardWritten ever published, and the completion
shards are still in S3. Output goes under the fingerprint of the template and policy given now
(`--template` swaps the chat template), so the old output stays untouched; shards already
present under that fingerprint are not recomputed. The same code path as the service handles
each shard, the quality gate included.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from shared.bus import Bus, ProgressLoop
from shared.config import Config
from shared.failures import Poison, Retry
from shared.messages import ShardWritten
from shared.store import Store
from shared.topology import Streams, Subjects

from .gate import STAGE
from .service import GateTripped, TokenizerService

log = logging.getLogger("dflash.tokenizer.replay")


@dataclass
class ReplaySummary:
    fingerprint: str
    shards: int = 0
    written: int = 0
    already_present: int = 0
    failed: list[tuple[int, str, str]] = field(default_factory=list)  # (stream seq, shard key, error)
    gate: str = ""  # the gate's reason when it stopped the replay
    last_seq: int = 0


async def replay_tokenize(cfg: Config, bus: Bus, store: Store, tokenizer: Any, *, from_seq: int = 1,
                          worker: str = "replay", progress_every_s: float = 5.0,
                          retries: int = 3) -> ReplaySummary:
    service = TokenizerService(cfg, bus, store, tokenizer, worker=worker)
    service.stop = asyncio.Event()
    summary = ReplaySummary(service.fingerprint)
    subject = Subjects.progress(cfg.run, STAGE, worker)
    async with ProgressLoop(bus, subject, service.snapshot, every_s=progress_every_s):
        await service.prepare()
        service.state = "replaying"
        async for seq, ev in bus.read_log(Streams.SHARDS, Subjects.shards(cfg.run), from_seq, ShardWritten):
            summary.shards += 1
            summary.last_seq = seq
            before = service.counts.skipped_shards
            for attempt in range(1, retries + 1):
                try:
                    await service.process(ev)
                except Poison as e:
                    summary.failed.append((seq, ev.key, str(e)))
                    log.error("seq %d %s: %s", seq, ev.key, e)
                except Retry as e:
                    if attempt < retries:
                        await asyncio.sleep(2.0 * attempt)
                        continue
                    summary.failed.append((seq, ev.key, f"gave up after {retries} tries: {e}"))
                except GateTripped as e:
                    summary.gate = str(e)
                    service.state = "gate_tripped"
                    return summary
                else:
                    if service.counts.skipped_shards > before:
                        summary.already_present += 1
                    else:
                        summary.written += 1
                break
        service.state = "stopped"
    return summary
