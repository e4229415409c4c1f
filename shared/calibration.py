"""What `dfpipe calibrate` measured, as stored under the run's prefix (`Keys.calibration`), and the arithmetic
every reader shares: the planner's ETA and the generator's starting concurrency.

One engine's calibration is a sweep of fixed concurrencies over a sample of the run's own prompts: tokens/s
at each level (completion tokens, in wall time, over the steady part of the level: after the first
`concurrency` finishes, before the last `concurrency`, so neither the ramp nor the drain counts), the peak,
the knee (the lowest concurrency within 5% of the peak), latency per request, the completion-length
distribution and the share cut at `max_new_tokens`.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from shared.topology import Keys

KNEE_SHARE = 0.95  # the knee: the lowest concurrency whose tokens/s is within 5% of the peak


class Level(msgspec.Struct, kw_only=True):
    concurrency: int
    requests: int
    tokens_per_s: float  # completion tokens per wall-clock second, steady part
    latency_mean_s: float
    latency_p50_s: float
    latency_p90_s: float


class Lengths(msgspec.Struct, kw_only=True):
    """Completion tokens per request."""

    mean: float
    p10: float
    p50: float
    p90: float
    max: int


class EngineCalibration(msgspec.Struct, kw_only=True):
    engine: str  # its URL, or `hf:<device>`
    levels: list[Level]
    peak_tokens_per_s: float
    best_concurrency: int  # the level that gave the peak
    knee: int  # the lowest level within KNEE_SHARE of the peak
    latency_s: Level  # the knee's level: what a request waits there
    completion_tokens: Lengths
    truncation_rate: float  # finish_reason "length" at max_new_tokens
    requests: int
    errors: int = 0


class LayoutCalibration(msgspec.Struct, kw_only=True):
    """One layout of the same GPUs (`--launch --layouts`): its engines, measured one after the other."""

    name: str  # e.g. tp2+mtp
    tp: int
    mtp: bool
    gpus: list[int]
    engines: list[EngineCalibration]

    @property
    def tokens_per_s(self) -> float:
        """The layout's whole throughput: every engine at its own peak."""
        return sum(e.peak_tokens_per_s for e in self.engines)


class Calibration(msgspec.Struct, kw_only=True):
    run: str
    ts: float = msgspec.field(default_factory=time.time)
    backend: str
    max_new_tokens: int
    prompts_sampled: int
    engines: list[EngineCalibration]  # the engines to run (the recommended layout's, with --launch)
    layouts: list[LayoutCalibration] = []
    recommended: str = ""  # the layout to run, with --launch

    @property
    def tokens_per_s_per_engine(self) -> float:
        return sum(e.peak_tokens_per_s for e in self.engines) / len(self.engines) if self.engines else 0.0

    @property
    def mean_completion_tokens(self) -> float:
        n = sum(e.requests for e in self.engines)
        return sum(e.completion_tokens.mean * e.requests for e in self.engines) / n if n else 0.0

    def eta_s(self, prompts: int, engines: int | None = None) -> float:
        """The whole job's generation time: prompts × measured mean completion tokens ÷ (measured tokens/s per
        engine × engines)."""
        count = engines if engines is not None else len(self.engines)
        rate = self.tokens_per_s_per_engine * count
        return prompts * self.mean_completion_tokens / rate if rate > 0 else float("inf")

    def engine(self, url: str) -> EngineCalibration | None:
        """What was measured of the engine at `url` (its generator starts at its best concurrency), or None."""
        return next((e for e in self.engines if e.engine.rstrip("/") == url.rstrip("/")), None)


def knee_of(levels: list[Level]) -> tuple[float, int, int]:
    """(peak tokens/s, its concurrency, the knee) of a sweep."""
    best = max(levels, key=lambda lv: lv.tokens_per_s)
    knee = min(lv.concurrency for lv in levels if lv.tokens_per_s >= KNEE_SHARE * best.tokens_per_s)
    return best.tokens_per_s, best.concurrency, knee


def encode(c: Calibration) -> bytes:
    return msgspec.json.encode(c)


def decode(data: bytes, where: str) -> Calibration:
    try:
        return msgspec.json.decode(data, type=Calibration)
    except msgspec.DecodeError as e:
        raise ValueError(f"{where}: not a calibration this build reads ({e})") from None


def load_calibration(store: Any, run: str) -> Calibration | None:
    """The run's stored calibration, or None when `dfpipe calibrate` was not run for it."""
    key = Keys.calibration(run)
    if not store.exists(key):
        return None
    return decode(store.get_bytes(key), store.uri(key))
