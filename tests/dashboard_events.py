"""A small, real event stream for the dashboard tests: the message types services publish, on their subjects.

`expected` holds the numbers the page must show for it, computed here from the same events.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from shared.bus import Bus
from shared.messages import (
    Alert,
    EvalReport,
    FeederProgress,
    GeneratorProgress,
    Message,
    ShardWritten,
    TokenizedShard,
    TokenizerProgress,
    TrainerProgress,
)
from shared.topology import Subjects

SILENT_WORKER = "gpu1"


@dataclass
class RunEvents:
    run: str
    prompts: int = 100
    counted: int = 0  # sum of the generator workers' latest `completions` (counts a redelivered prompt twice)
    generated: int = 0  # unique prompts in the run's completion shards
    shards: int = 0
    tokenized_shards: int = 0
    tokenized: int = 0  # the tokenizer's `samples_in`
    kept: int = 0  # samples in the latest tokenized shard of each completion shard
    kept_counted: int = 0  # the tokenizer's `samples_kept`
    trained: int = 0  # the trainer's samples_seen
    step: int = 0
    total_steps: int = 0
    checkpoint_key: str = ""


def initial_events(run: str, now: float | None = None) -> tuple[list[tuple[str, Message]], RunEvents]:
    now = time.time() if now is None else now
    ev = RunEvents(run)
    out: list[tuple[str, Message]] = [
        (Subjects.progress(run, "feed", "feeder"),
         FeederProgress(run=run, worker="feeder", read=103, accepted=100, duplicates=2, rejected=1, published=100,
                        done=True, ts=now - 120)),
        # gpu0 reports twice (the rate comes from the difference), gpu1 went quiet 15 minutes ago.
        (Subjects.progress(run, "generate", "gpu0"),
         GeneratorProgress(run=run, worker="gpu0", completions=20, prompt_tokens=2000, completion_tokens=4000,
                           prompt_tokens_per_s=90.0, completion_tokens_per_s=180.0, in_flight=8, shards=1,
                           finish_reasons={"stop": 19, "length": 1}, ts=now - 60)),
        (Subjects.progress(run, "generate", "gpu0"),
         GeneratorProgress(run=run, worker="gpu0", completions=40, prompt_tokens=4000, completion_tokens=8000,
                           prompt_tokens_per_s=100.0, completion_tokens_per_s=200.0, completions_per_s=0.35,
                           in_flight=8, errors=1, shards=2, finish_reasons={"stop": 36, "length": 4},
                           engine="http://gpu0:30000", engine_running=24, engine_queued=3, engine_max_running=32,
                           engine_tokens_per_s=1800.0, concurrency=27, ts=now - 2)),
        (Subjects.progress(run, "generate", SILENT_WORKER),
         GeneratorProgress(run=run, worker=SILENT_WORKER, completions=25, prompt_tokens=2500,
                           completion_tokens=5000, prompt_tokens_per_s=80.0, completion_tokens_per_s=150.0,
                           in_flight=4, shards=1, finish_reasons={"stop": 25}, ts=now - 900)),
        (Subjects.progress(run, "tokenize", "tok0"),
         TokenizerProgress(run=run, worker="tok0", fingerprint="fp1", shards=2, samples_in=50, samples_kept=44,
                           tokens=30000, supervised_tokens=12000, dropped={"truncated": 4, "too_few_supervised": 2},
                           retokenization_drift=3, supervised_histogram={"0": 6, "64": 20, "256": 24},
                           gate_tripped=True, ts=now - 5)),
        (Subjects.alert(run, "tokenize"),
         Alert(run=run, stage="tokenize", kind="quality_gate", worker="tok0",
               message="38% of the last 50 samples have fewer than 32 supervised tokens",
               examples=["<|im_start|>assistant\nOK.<|im_end|>"], ts=now - 5)),
        (Subjects.progress(run, "train", "trainer"),
         TrainerProgress(run=run, worker="trainer", state="waiting for data", ts=now - 60)),  # the placeholder
        (Subjects.progress(run, "train", "trainer"),
         TrainerProgress(run=run, worker="trainer", step=10, total_steps=100, loss=5.5, estimated_tau=1.4,
                         tokens_per_s=900.0, samples_seen=12, ts=now - 30)),
        (Subjects.progress(run, "train", "trainer"),
         TrainerProgress(run=run, worker="trainer", step=20, total_steps=100, loss=4.25, estimated_tau=1.9,
                         tokens_per_s=950.0, samples_seen=30, steps_per_s=0.5, eta_s=160.0, checkpoint_key=f"runs/{run}/checkpoints/step-00000020/", ts=now - 3)),
        (Subjects.progress(run, "eval", "eval"),
         EvalReport(run=run, checkpoint_key=f"runs/{run}/checkpoints/step-00000020/", prompts=8, tau=2.1,
                    speedup=1.3, lossless=True, ts=now - 1)),
    ]
    ev.counted, ev.tokenized, ev.kept_counted, ev.trained, ev.step, ev.total_steps = 40 + 25, 50, 44, 30, 20, 100
    out += shard_events(run, now)
    ev.generated, ev.shards, ev.tokenized_shards, ev.kept = 58, 3, 2, 24 + 18
    ev.checkpoint_key = f"runs/{run}/checkpoints/step-00000020/"
    return out, ev


def shard_events(run: str, now: float) -> list[tuple[str, Message]]:
    """Three completion shards, the third holding 5 prompts already in the second (redelivered after a
    crash), the second announced twice; two of them tokenized, the first twice (a new template)."""

    def written(key: str, first: int, n: int, ts: float) -> ShardWritten:
        return ShardWritten(run=run, key=f"runs/{run}/completions/{key}.parquet", worker=key.split("/")[0], seq=0,
                            num_records=n, prompt_ids=[f"p{i}" for i in range(first, first + n)], sha256="0" * 64,
                            size_bytes=1000, ts=ts)

    def tokenized(source: ShardWritten, fingerprint: str, samples: int, ts: float, dropped: dict[str, int],
                  drift: int) -> TokenizedShard:
        assert samples + sum(dropped.values()) == source.num_records
        hist = {"64": samples - 1, "4": 1 + dropped.get("below_min_supervised", 0)}
        return TokenizedShard(run=run, key=f"runs/{run}/tokenized/{fingerprint}/{source.seq}.parquet",
                              source_key=source.key, fingerprint=fingerprint, num_samples=samples, num_tokens=100,
                              num_supervised=50, sha256="0" * 64, dropped=dropped, retokenization_drift=drift,
                              supervised_histogram=hist, ts=ts)

    a, b, c = written("w0/0", 0, 30, now - 100), written("w0/1", 30, 20, now - 50), written("w1/0", 45, 13, now - 10)
    return [(Subjects.shards(run), e) for e in (a, b, b, c)] + [
        (Subjects.tokenized(run), tokenized(a, "fp1", 25, now - 90, {"below_min_supervised": 5}, 2)),
        (Subjects.tokenized(run), tokenized(b, "fp1", 18, now - 40, {"below_min_supervised": 1, "duplicate": 1}, 1)),
        (Subjects.tokenized(run), tokenized(a, "fp2", 24, now - 8, {"below_min_supervised": 4, "template_error": 2}, 0)),
    ]


# The data quality the shard events above give (the latest tokenized shard of w0/0 and of w0/1).
SHARD_QUALITY = {"samples_in": 30 + 20, "samples_kept": 24 + 18, "supervised_tokens": 100, "drift": 1,
                 "dropped": {"below_min_supervised": 5, "template_error": 2, "duplicate": 1},
                 "histogram": [(4, 5 + 2), (64, 23 + 17)]}


async def publish(bus: Bus, events: list[tuple[str, Message]]) -> None:
    for subject, msg in events:
        await bus.publish(subject, msg)
