"""Keep the engine's batch full: how many requests one generator keeps in flight, found by itself.

An engine decodes all its running requests in one step bound by reading the weights, so its tokens/s grow
almost linearly with the batch up to its own cap — `max_running_requests`, or fewer when its KV pool fills
first. A generator that holds fewer requests than that leaves the GPU idle in proportion. The rule here:

- **The engine says its load** (SGLang `/metrics` with `--enable-metrics`, or `/v1/loads`; vLLM's `/metrics`):
  keep a queue waiting in the engine. While the engine has fewer than `want_queue` requests queued and
  this generator's own level is what binds, raise the level (by a quarter); while more than three times that
  wait, lower it to what runs plus `want_queue` (idempotent: a queue the engine has not worked off yet by the
  next poll does not lower it again). A queue that never empties means the engine is at its own cap, whatever
  caps it (slots or KV pool), and stays so when completion lengths change mid-run. `want_queue` is a quarter
  of the engine's batch limit (at least 4): enough to refill the slots freed between two polls and while
  the generator is busy elsewhere (queued requests hold no KV cache in the engine; they cost latency only).
- **It says only its limit** (`/get_server_info`'s `effective_max_running_requests_per_dp` × DP ranks): the
  starting level is that limit plus the queue.
- **It says nothing** (no or broken metrics, e.g. `transformers serve`): start at the safe fixed
  `fallback` level and climb on measured throughput — doubling while completion tokens/s rise by ≥ 5% per
  window (a slow start: an engine's tokens/s grow about linearly with its batch up to its cap, so a short run
  gets there in a few windows), back to the best level when they stop, then a quarter more at a time,
  probing again later.

The level never exceeds `upper` (`generator.max_inflight` when set; otherwise 1024 — see `auto_upper`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

AUTO_UPPER = 1024  # no engine runs more: SGLang's max_running_requests is derived from the pool, typically 128-1024


@dataclass
class EngineLoad:
    """What the engine reports about itself; None: it did not say."""

    running: int | None = None
    queued: int | None = None
    max_running: int | None = None
    tokens_per_s: float | None = None


def parse_prometheus(text: str, names: set[str]) -> dict[str, float]:
    """Sum each wanted metric over its label sets (one engine may report several DP ranks)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        head, _, value = line.rpartition(" ")
        name = head.split("{", 1)[0].strip()
        if name in names:
            try:
                out[name] = out.get(name, 0.0) + float(value)
            except ValueError:
                continue
    return out


def auto_upper(max_ack_pending: int, shard_records: int) -> int:
    """The level's bound when none is set: AUTO_UPPER, or what a run-wide max_ack_pending leaves one worker.

    Memory: a request in flight holds its PromptTask (the prompt's messages, a few KB) and, once answered,
    its output ids until its shard is written (≤ max_new_tokens ints, ~36 bytes each as a Python list: 150 KB
    at 4,096 tokens) — so 1,024 in flight plus a 256-record shard stay under ~200 MB per generator."""
    if max_ack_pending > 0:
        return max(1, min(AUTO_UPPER, max_ack_pending - shard_records))
    return AUTO_UPPER


class FillController:
    """The number of requests this generator keeps in flight (`level`), adjusted from the engine's reports
    (`on_load`) or, when it has none, from measured throughput (`on_window`)."""

    def __init__(self, *, upper: int, fallback: int, fixed: bool = False) -> None:
        self.upper = max(1, upper)
        self.fallback = max(1, min(fallback, self.upper))
        self.fixed = fixed  # a hand-set level (hf/synthetic backends, or adaptive off): never changes
        self.level = self.upper if fixed else self.fallback
        self.max_running: int | None = None
        self.mode = "fixed" if fixed else "fallback"  # fixed | fallback | limit | queue | throughput
        self.seen_queue = False  # the engine has queued requests at least once (the slow start is over)
        # throughput mode
        self.best_rate = 0.0
        self.best_level = self.level
        self.hold_windows = 0
        self.slow_start = True

    def want_queue(self, running: int | None = None) -> int:
        basis = self.max_running or running or 8
        return max(4, math.ceil(0.25 * basis))

    def on_limit(self, max_running: int) -> None:
        """The engine's batch limit is known: start there, plus the queue."""
        if self.fixed or max_running <= 0:
            return
        self.max_running = max_running
        if self.mode in ("fallback", "throughput"):
            self.level = min(self.upper, max_running + self.want_queue())
            self.mode = "limit"

    def on_load(self, load: EngineLoad, in_flight: int) -> None:
        """One poll of the engine's running/queued counts."""
        if load.max_running:
            self.on_limit(load.max_running)
        if self.fixed or load.running is None or load.queued is None:
            return
        self.mode = "queue"
        want = self.want_queue(load.running)
        if load.queued < want:
            # our own level binds (within the few requests between a completion and the next send): double
            # until the engine has first queued some (a slow start), a quarter more after that
            if in_flight >= self.level - max(2, self.level // 8):
                step = self.level if not self.seen_queue else max(2, math.ceil(self.level / 4))
                self.level = min(self.upper, self.level + step)
            return
        self.seen_queue = True
        if load.queued > 3 * want:  # the engine's own cap binds: what runs plus the queue is enough
            self.level = max(1, min(self.level, load.running + want))

    def on_window(self, tokens_per_s: float) -> None:
        """One throughput window (engine reports nothing): hill-climb on completion tokens/s."""
        if self.fixed or self.mode in ("queue",):
            return
        self.mode = "throughput" if self.mode != "limit" else "limit"
        if self.hold_windows > 0:
            self.hold_windows -= 1
            if self.hold_windows == 0:  # probe again from the best level, re-measuring it first
                self.best_rate = 0.0
            return
        if tokens_per_s > self.best_rate * 1.05:
            self.best_rate, self.best_level = tokens_per_s, self.level
            # a slow start (double) until the first window that gains nothing, a quarter more after that
            self.level = min(self.upper, 2 * self.level if self.slow_start else math.ceil(self.level * 1.25) + 1)
        else:
            self.slow_start = False
            self.level = self.best_level
            self.hold_windows = 6


class ThroughputWindow:
    """Completion tokens/s over windows long enough to hold several completions."""

    def __init__(self, min_s: float = 5.0) -> None:
        self.min_s = min_s
        self.started = time.monotonic()
        self.tokens = 0
        self.latencies: list[float] = []

    def add(self, tokens: int, latency_s: float) -> None:
        self.tokens += tokens
        if len(self.latencies) < 1000:
            self.latencies.append(latency_s)

    def close(self) -> float | None:
        """The window's tokens/s once it spans min_s and twice the mean latency; None before that."""
        span = time.monotonic() - self.started
        mean_latency = sum(self.latencies) / len(self.latencies) if self.latencies else math.inf
        if span < max(self.min_s, 2 * mean_latency) or len(self.latencies) < 4:
            return None
        rate = self.tokens / span
        self.started, self.tokens, self.latencies = time.monotonic(), 0, []
        return rate


class RequestTimeout:
    """How long one request may take: the longest completion that can wait in a full engine's queue.

    A request this generator sends waits behind at most one batch (the level keeps the engine's queue a
    fraction of its batch), then decodes max_new_tokens steps: so ≤ 2 × max_new_tokens × the time one token
    takes a request. That per-token time is measured from completed requests (latency ÷ tokens, queueing
    included, the slowest of the last 256), and the timeout is 3 × max_new_tokens × it, between `floor_s` and
    `ceiling_s`. Only completions of at least `min_tokens` count: a 3-token answer that queued for a minute
    says how long the queue was, not how fast tokens come, and divided by 3 it made the timeout days long (a
    hung request then held its slot for that long). Until enough have completed, `initial_s` applies."""

    def __init__(self, max_new_tokens: int, *, initial_s: float = 1800.0, floor_s: float = 120.0,
                 ceiling_s: float = 6 * 3600.0) -> None:
        self.max_new_tokens = max_new_tokens
        self.initial_s, self.floor_s, self.ceiling_s = initial_s, floor_s, ceiling_s
        self.min_tokens = max(1, min(32, max_new_tokens // 4))
        self.per_token: list[float] = []

    def add(self, latency_s: float, tokens: int) -> None:
        if tokens < self.min_tokens:
            return
        self.per_token.append(latency_s / tokens)
        if len(self.per_token) > 256:
            del self.per_token[:128]

    @property
    def seconds(self) -> float:
        if len(self.per_token) < 8:
            return self.initial_s
        return min(self.ceiling_s, max(self.floor_s, 3 * self.max_new_tokens * max(self.per_token)))
