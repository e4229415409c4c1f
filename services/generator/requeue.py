"""A completions shard's prompts queued again as a new generation (`dfpipe replay generate --shard KEY`).

From the shard's own records when it reads back as its ShardWritten event says it was written. When it does not
(the object deleted or lost with a volume, a truncated or altered object: the tokenizer dead-letters it), the
event's prompt ids are found again in the run's prompt sources: a prompt's id is the hash of its normalized
messages, so the same files give the same ids. The sources are the run's manifest's unless others are named;
they are streamed, holding only the shard's ids (at most `generator.shard_records`), whatever their size.

The requeued prompts are generation 1 + the shard's (1 when its records are lost): every reader keeps the
newest generation of a prompt, so the new completions replace whatever else of them exists. Their message ids
name the shard and the generation, so running the same replay twice queues nothing twice.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import msgspec

from services.feeder.normalize import prompt_id
from services.feeder.sources import accepted_prompts
from shared.bus import Bus
from shared.config import Config
from shared.messages import PromptTask, ShardWritten
from shared.records import read_completions
from shared.store import KeyNotFound, Store, sha256_bytes
from shared.topology import Keys, Streams, Subjects


class NotAShard(ValueError):
    """KEY is not a completions shard this run announced."""


@dataclass
class Requeue:
    key: str
    tasks: list[PromptTask]
    generation: int
    lost: str = ""  # why the shard's records could not be used ("" when they were)
    sources: list[str] = field(default_factory=list)  # where the prompts were found again (when lost)
    missing: list[str] = field(default_factory=list)  # prompt ids of the shard that no source holds

    def msg_id(self, task: PromptTask) -> str:
        return f"regen:{self.key}:{self.generation}:{task.prompt_id}"


async def shard_event(bus: Bus, run: str, key: str) -> ShardWritten:
    """The ShardWritten event that announced `key` (the run's shard log, read once: a one-shot command)."""
    async for _, ev in bus.read_log(Streams.SHARDS, Subjects.shards(run), 1, ShardWritten):
        if ev.key == key:
            return ev
    raise NotAShard(f"run {run} announced no completions shard {key!r} (keys look like "
                    f"{Keys.completions(run, 'WORKER', 3)})")


def _records_or_why_not(store: Store, ev: ShardWritten) -> tuple[list, str]:
    try:
        data = store.get_bytes(ev.key)
    except KeyNotFound:
        return [], f"no object {ev.key} in bucket {store.bucket!r}"
    if ev.sha256 and sha256_bytes(data) != ev.sha256:
        return [], f"{ev.key} is not what was written (sha256 differs from its ShardWritten event)"
    try:
        return read_completions(data), ""
    except Exception as e:  # a truncated or altered object: pyarrow's many errors
        return [], f"{ev.key} does not read as a completions shard: {type(e).__name__}: {e}"


def run_sources(store: Store, run: str) -> list[str]:
    """The prompt sources the run was fed from (its manifest)."""
    key = Keys.manifest(run)
    if not store.exists(key):
        return []
    return list(msgspec.json.decode(store.get_bytes(key)).get("sources", {}))


def find_prompts(cfg: Config, sources: list[str], wanted: set[str], generation: int) -> tuple[list[PromptTask], list[str]]:
    """The prompts of `wanted` found in `sources` (each once, as the feeder made them, as `generation`) and the
    ids none holds."""
    found: dict[str, PromptTask] = {}
    for source, line, messages in accepted_prompts(sources, cfg):
        pid = prompt_id(messages)
        if pid in wanted and pid not in found:
            found[pid] = PromptTask(run=cfg.run, prompt_id=pid, messages=messages, source=source, line=line,
                                    generation=generation)
            if len(found) == len(wanted):
                break
    return list(found.values()), sorted(wanted - found.keys())


async def requeue_shard(cfg: Config, bus: Bus, store: Store, key: str, sources: list[str] | None = None) -> Requeue:
    """What re-queuing `key` publishes; raises NotAShard for a key the run never announced, ValueError when the
    shard is lost and there is no source to find its prompts in."""
    ev = await shard_event(bus, cfg.run, key)
    records, lost = await asyncio.to_thread(_records_or_why_not, store, ev)
    if not lost:
        generation = 1 + max((r.generation for r in records), default=0)
        tasks = [PromptTask(run=cfg.run, prompt_id=r.prompt_id, messages=r.messages, source=key, generation=generation)
                 for r in records]
        return Requeue(key, tasks, generation)
    sources = sources or await asyncio.to_thread(run_sources, store, cfg.run)
    if not sources:
        raise ValueError(f"{lost}; run {cfg.run} records no prompt sources: name them with --prompts")
    tasks, missing = await asyncio.to_thread(find_prompts, cfg, sources, set(ev.prompt_ids), 1)
    return Requeue(key, tasks, 1, lost=lost, sources=sources, missing=missing)
