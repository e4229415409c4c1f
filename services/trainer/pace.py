"""The trainer's pace: steps/s over the view's rate window, an ETA, and a progress line every few seconds.

A long training must never look stuck: its progress reports carry `steps_per_s` and `eta_s` (what `dfpipe
status`, `dfpipe run`'s display and the dashboard show, through `shared.view`), and its log says step of
total, loss, τ, steps/s and the ETA every `[view] log_every_s`. The rate is over `[view] rate_window_s`,
the window every view's rates are over. Memory: one (time, step) point per step within the window.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

from shared.config import ViewConfig
from shared.messages import TrainerProgress
from shared.view import duration, rate_text

log = logging.getLogger("dflash.trainer")


class Pace:
    """Fed each step (`observe`); says the rate, the ETA and when a log line is due."""

    def __init__(self, cfg: ViewConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = cfg.rate_window_s
        self.log_every_s = cfg.log_every_s
        self.clock = clock
        self.points: deque[tuple[float, int]] = deque()  # (clock, step) within the window, and one before it
        self.logged_at = self.clock()

    def observe(self, step: int, total_steps: int, budget_left_s: float | None = None) -> tuple[float, float | None]:
        """(steps/s over the window, seconds to `total_steps` at it, or to the time budget if that ends first).

        A first step (or a resume's) has no rate yet: (0.0, None)."""
        now = self.clock()
        self.points.append((now, step))
        while len(self.points) > 2 and self.points[1][0] <= now - self.window_s:
            self.points.popleft()
        (t0, s0), (t1, s1) = self.points[0], self.points[-1]
        if t1 <= t0 or s1 <= s0:
            return 0.0, None
        rate = (s1 - s0) / (t1 - t0)
        eta = max(0, total_steps - step) / rate
        if budget_left_s is not None:
            eta = min(eta, max(0.0, budget_left_s))
        return rate, eta

    def maybe_log(self, p: TrainerProgress) -> bool:
        """Log one progress line if `log_every_s` passed since the last; whether it did."""
        now = self.clock()
        if now - self.logged_at < self.log_every_s:
            return False
        self.logged_at = now
        log.info("%s", progress_line(p))
        return True


def progress_line(p: TrainerProgress) -> str:
    of = f" of {p.total_steps}" if p.total_steps else ""
    return (f"step {p.step}{of} (epoch {p.epoch}): loss {p.loss:.4f}, estimated τ {p.estimated_tau:.2f}, "
            f"{rate_text(p.steps_per_s, 'steps')}, ETA {duration(p.eta_s)}")
