"""The trainer's schedule, as pure arithmetic (numpy only: no torch, no bus, no S3): which samples form a
micro-batch, how many optimizer steps a pass and an epoch take, how long the run's step schedule is when
it starts and when data joins later, and the learning rate at each step.

The rules the trainer's history fixed, each a property in tests/test_schedule.py:
- one packing rule (`Packing.microbatch_end`), used by the loop and by the pass-step count alike;
- epochs are passes over the run's whole data; a pass made while the data still grows does not count,
  and it is scheduled on top of the epochs, exactly, so the schedule never ends inside it;
- the steps per epoch count every rank's micro-batches (W ranks do not make a schedule W times longer);
- the warmup length is fixed when the schedule is first made: a schedule stretched by data that joins
  later never sends the lr back into warmup;
- with a time budget the lr follows whichever of steps and time is further along.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Cursor:
    """Where the run is in its data; saved in every checkpoint (its fields are the checkpoint's layout)."""

    epoch: int = 0  # passes begun (the one in progress included), counted or not
    position: int = 0  # index into the pass's order
    keys: list[str] = field(default_factory=list)  # the pass's shard list
    shards: dict[str, tuple[str, int]] = field(default_factory=dict)  # every announcement taken: key → (fingerprint, seq)
    complete: bool = True  # this pass's shards were the run's whole data (generation and tokenization done)
    partial: int = 0  # passes made over part of the data, while it still grew: not counted as epochs

    @property
    def epochs_done(self) -> int:
        """Completed passes over the whole data (the pass in progress not included)."""
        return self.epoch - self.partial

    def end_pass(self) -> bool:
        """The pass at the cursor is over; returns whether it was over part of the data (not an epoch)."""
        uncounted = not self.complete
        self.epoch += 1
        self.partial += uncounted
        return uncounted

    def undo_end_pass(self, uncounted: bool) -> None:
        """Nothing of the next pass was made (a stop): back to the boundary, so a resume ends the pass again."""
        self.epoch -= 1
        self.partial -= uncounted

    def begin_pass(self, keys: list[str], complete: bool) -> None:
        self.keys, self.position, self.complete = keys, 0, complete


@dataclass(frozen=True)
class Packing:
    """The packing rule: a micro-batch is whole sequences, in the pass's order, up to `token_budget` tokens
    (at least one sequence); a sequence counts its first `max_length` tokens. An optimizer step takes
    `micro_per_step` micro-batches (grad_accum × ranks)."""

    token_budget: int
    max_length: int
    micro_per_step: int

    def lengths(self, num_tokens: np.ndarray, order: np.ndarray) -> np.ndarray:
        """Each position's trained length in this pass's order."""
        return np.minimum(num_tokens[order], self.max_length)

    def microbatch_end(self, lengths: list[int] | np.ndarray, start: int) -> int:
        """Where the micro-batch starting at position `start` ends."""
        end, tokens = start, 0
        while end < len(lengths):
            n = int(lengths[end])
            if end > start and tokens + n > self.token_budget:
                break
            tokens += n
            end += 1
        return end

    def pass_steps(self, lengths: np.ndarray) -> int:
        """The optimizer steps of one pass over these lengths, packed as the loop packs them."""
        plain = lengths.tolist()  # plain ints: the packing loop runs once per sample
        micro, position = 0, 0
        while position < len(plain):
            position = self.microbatch_end(plain, position)
            micro += 1
        return math.ceil(micro / self.micro_per_step)

    def steps_per_epoch(self, num_tokens: np.ndarray) -> int:
        """An epoch's steps as the schedule counts them: from the mean trained length (no pass order needed)."""
        n = len(num_tokens)
        avg = int(np.minimum(num_tokens, self.max_length).sum()) / max(1, n)
        per_step = self.micro_per_step * max(1, int(self.token_budget // max(1.0, avg)))
        return math.ceil(n / per_step)


@dataclass
class StepSchedule:
    """The run's step schedule: its length and its warmup (both in every checkpoint)."""

    total: int  # optimizer steps
    warmup: int  # steps; fixed when the schedule is first made

    @classmethod
    def first(cls, *, max_steps: int, epochs: int, per_epoch: int, uncounted: int,
              warmup_ratio: float) -> StepSchedule:
        """The schedule when training starts: `max_steps` when set, else the epochs plus `uncounted`, the
        steps of a first pass over part of the data (0 when the data is complete)."""
        total = max_steps or max(1, epochs * per_epoch) + uncounted
        return cls(total=total, warmup=warmup_steps(total, warmup_ratio))

    def stretch(self, *, step: int, epochs_left: int, per_epoch: int, uncounted: int) -> bool:
        """At a pass boundary (step `step`): the steps left become the remaining epochs over all the data
        there is, plus `uncounted` for a pass that begins over part of it; at least one more step. The
        warmup stays as it was. Returns whether the length changed."""
        total = max(step + 1, step + uncounted + epochs_left * per_epoch)
        changed, self.total = total != self.total, total
        return changed

    def lr_lambda(self):
        """The lr factor per step (torch's LambdaLR takes it)."""
        return lr_lambda(self.total, self.warmup)

    def lr_factor_with_time(self, step: int, train_s: float, max_train_s: float) -> float:
        """The lr factor under a time budget: the schedule at whichever of steps and time is further along."""
        frac = max(step / self.total, train_s / max_train_s)
        return self.lr_lambda()(min(self.total, round(frac * self.total)))


def warmup_steps(total: int, warmup_ratio: float) -> int:
    return max(1, round(total * warmup_ratio))


def lr_lambda(total: int, warm: int):
    """Linear warmup over `warm` steps (fixed when the run is first scheduled: a schedule stretched by data
    that joins later must not send the lr back into warmup), then cosine to 0 at `total`."""
    warm = max(1, warm)

    def f(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        progress = min(1.0, (step - warm) / max(1, total - warm))
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return f
