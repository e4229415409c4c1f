"""Build one shard's samples on several cores.

Rendering the chat template, placing the pieces and the per-sample checks are Python, so one
process tokenizes on one core however many the machine has. The pool cuts a shard's fresh records
(duplicates are decided before, by the caller) into consecutive parts: the calling thread builds
the first, worker processes the others, and the parts are joined in order, so the samples, drops
and drift are exactly those of building the whole shard in one process. Each worker builds its
own SampleBuilder from a copy of the caller's tokenizer and config, and refuses to start if it
arrives at another template fingerprint. A worker that dies (OOM killer) breaks the pool: the
shard is then built in the calling process, and so is every later one, with an error logged once.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from shared.config import Config
from shared.records import CompletionRecord

from .fingerprint import template_fingerprint
from .samples import SampleBuilder, ShardSamples

log = logging.getLogger("dflash.tokenizer.pool")

MIN_PER_PART = 32  # below this many records a part is not worth a round trip to another process
MAX_PROCESSES = 8

_builder: SampleBuilder | None = None  # in a worker process


def default_processes() -> int:
    """One per CPU this process may run on, at most MAX_PROCESSES."""
    return max(1, min(MAX_PROCESSES, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else
                      os.cpu_count() or 1))


def _start_worker(tokenizer: Any, cfg: Config, fingerprint: str) -> None:
    global _builder
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the service decides
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per process; the processes are the parallelism
    mine = template_fingerprint(tokenizer, cfg)
    if mine != fingerprint:
        raise RuntimeError(f"tokenizer worker has template fingerprint {mine}, the service {fingerprint}")
    _builder = SampleBuilder(tokenizer, cfg)


def _build_part(records: list[CompletionRecord]) -> ShardSamples:
    assert _builder is not None, "worker not started"
    return _builder.build_fresh(records)


class BuildPool:
    """`processes` builders in all: the calling thread and `processes - 1` worker processes (spawned)."""

    def __init__(self, tokenizer: Any, cfg: Config, processes: int, fingerprint: str) -> None:
        if processes < 2:
            raise ValueError("a build pool needs at least 2 processes (the caller and a worker)")
        self.processes = processes
        # Every builder on one core, this process's too: the fast tokenizer's own threads would compete with
        # the workers for the same cores (measured: 1.35 s vs 1.7 s a shard pass with them on).
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        self._executor: ProcessPoolExecutor | None = ProcessPoolExecutor(
            processes - 1, mp_context=multiprocessing.get_context("spawn"), initializer=_start_worker,
            initargs=(tokenizer, cfg, fingerprint),
        )

    def build(self, records: list[CompletionRecord], here: Callable[[list[CompletionRecord]], ShardSamples]
              ) -> list[ShardSamples]:
        """The parts of `records`, in order: the first built by `here`, the rest by the workers."""
        n = min(self.processes, len(records) // MIN_PER_PART) if self._executor is not None else 1
        if n < 2:
            return [here(records)]
        size = -(-len(records) // n)
        parts = [records[i:i + size] for i in range(0, len(records), size)]
        try:
            futures: list[Future[ShardSamples]] = [self._executor.submit(_build_part, p) for p in parts[1:]]
            first = here(parts[0])
            return [first, *(f.result() for f in futures)]
        except BrokenProcessPool as e:
            log.error("tokenizer build pool broke (%s): building in the service's own process from now on", e)
            self.close()
            return [here(records)]

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None
