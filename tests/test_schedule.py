"""Property tests of the trainer's schedule (services/trainer/schedule.py): pure arithmetic, no server.

Each property is a rule a fix to the trainer established (git log -- services/trainer/): one packing
rule for the loop and the pass-step count; a schedule that never ends inside a pass over part of the
data; epochs counted over the whole data only; steps per epoch over every rank's micro-batches; a warmup
that never restarts when the schedule stretches; a stop at a pass boundary that resumes at it.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from services.trainer.schedule import Cursor, Packing, StepSchedule, lr_lambda, warmup_steps

FAST = settings(max_examples=200, deadline=None)

lengths_st = st.lists(st.integers(1, 600), min_size=1, max_size=80).map(lambda xs: np.array(xs, dtype=np.int64))
packing_st = st.builds(Packing, token_budget=st.integers(1, 1500), max_length=st.integers(1, 700),
                       micro_per_step=st.integers(1, 8))


def microbatches(p: Packing, lengths: np.ndarray) -> list[tuple[int, int]]:
    """The pass's micro-batches as the loop takes them: [start, end) ranges from `microbatch_end`."""
    out, position = [], 0
    while position < len(lengths):
        end = p.microbatch_end(lengths, position)
        out.append((position, end))
        position = end
    return out


@FAST
@given(p=packing_st, raw=lengths_st)
def test_packing_partitions_the_pass_into_greedy_budgeted_microbatches(p: Packing, raw: np.ndarray) -> None:
    lengths = p.lengths(raw, np.arange(len(raw)))
    assert lengths.max() <= p.max_length
    mbs = microbatches(p, lengths)
    assert mbs[0][0] == 0 and mbs[-1][1] == len(lengths)
    for (s, e), nxt in zip(mbs, [*mbs[1:], None], strict=True):
        assert e > s  # every micro-batch holds at least one sequence: the loop always advances
        tokens = int(lengths[s:e].sum())
        assert e - s == 1 or tokens <= p.token_budget  # over budget only as a lone long sequence
        if nxt is not None:
            assert nxt[0] == e  # contiguous, nothing skipped or taken twice
            assert tokens + int(lengths[e]) > p.token_budget  # greedy: the next sequence did not fit


@FAST
@given(p=packing_st, raw=lengths_st)
def test_pass_steps_agree_with_the_steps_the_loop_takes(p: Packing, raw: np.ndarray) -> None:
    """The loop's step takes up to `micro_per_step` micro-batches until the pass is over; the pass-step
    count (which the schedule adds for a pass over part of the data) must be exactly that many."""
    lengths = p.lengths(raw, np.random.default_rng(len(raw)).permutation(len(raw)))
    steps, position = 0, 0
    while position < len(lengths):
        for _ in range(p.micro_per_step):
            end = p.microbatch_end(lengths, position)
            if end == position:
                break
            position = end
        steps += 1
    assert p.pass_steps(lengths) == steps
    assert steps == math.ceil(len(microbatches(p, lengths)) / p.micro_per_step)


@FAST
@given(n=st.integers(1, 300), length=st.integers(1, 600), budget=st.integers(1, 3000), grad_accum=st.integers(1, 4),
       world=st.integers(1, 8))
def test_steps_per_epoch_count_every_ranks_microbatches(n: int, length: int, budget: int, grad_accum: int,
                                                        world: int) -> None:
    """With equal lengths the epoch estimate is exact, for any number of ranks (before the fix, W ranks
    made a schedule W times too long)."""
    p = Packing(token_budget=budget, max_length=4096, micro_per_step=grad_accum * world)
    lengths = np.full(n, length, dtype=np.int64)
    assert p.steps_per_epoch(lengths) == p.pass_steps(lengths)
    one = Packing(token_budget=budget, max_length=4096, micro_per_step=grad_accum)
    assert p.steps_per_epoch(lengths) == math.ceil(len(microbatches(one, lengths)) / (grad_accum * world))


# --- a run whose data grows: the loop's schedule decisions, step by step ------------------------------


@dataclass
class Pass:
    start: int  # first step
    end: int  # step after its last
    complete: bool


@dataclass
class Run:
    passes: list[Pass] = field(default_factory=list)
    warmups: set[int] = field(default_factory=set)
    cursor: Cursor = field(default_factory=Cursor)
    schedule: StepSchedule | None = None
    step: int = 0
    inside: bool = False  # ended with a pass under way
    by_epochs: bool = False  # ended because every epoch was made (else: the schedule's last step)
    first_total: int = 0  # the schedule's length when it was first made


def simulate(first: list[int], growth: list[list[int]], p: Packing, epochs: int, warmup_ratio: float,
             max_steps: int = 0) -> Run:
    """The schedule decisions of `Trainer.run_until` (services/trainer/loop.py) with the same calls, on data
    that starts as `first` and grows by each of `growth` at the next pass boundaries; the data is complete
    once it has stopped growing (as when the generators finish, or `wait_for_data_s` runs out)."""
    r = Run()
    data = np.array(first, dtype=np.int64)
    arrivals = list(growth)
    complete = not arrivals
    r.cursor = Cursor(keys=[str(len(data))], complete=complete)
    lengths = p.lengths(data, np.arange(len(data)))
    r.schedule = StepSchedule.first(max_steps=max_steps, epochs=epochs, per_epoch=p.steps_per_epoch(data),
                                    uncounted=0 if max_steps or complete else p.pass_steps(lengths),
                                    warmup_ratio=warmup_ratio)
    r.first_total = r.schedule.total
    start = 0
    while r.step < r.schedule.total:
        if r.cursor.position >= len(lengths):
            r.passes.append(Pass(start, r.step, r.cursor.complete))
            uncounted = r.cursor.end_pass()
            if not max_steps and r.cursor.epochs_done >= epochs:
                r.by_epochs = True
                break
            if not r.cursor.complete and arrivals:
                data = np.concatenate([data, np.array(arrivals.pop(0), dtype=np.int64)])
            complete = r.cursor.complete or not arrivals
            keys = [str(len(data))]
            grown = keys != r.cursor.keys
            r.cursor.begin_pass(keys, complete)
            lengths = p.lengths(data, np.random.default_rng(r.cursor.epoch).permutation(len(data)))
            if (grown or uncounted or not complete) and not max_steps:
                r.schedule.stretch(step=r.step, epochs_left=epochs - r.cursor.epochs_done,
                                   per_epoch=p.steps_per_epoch(data),
                                   uncounted=0 if complete else p.pass_steps(lengths))
            start = r.step
        for _ in range(p.micro_per_step):
            end = p.microbatch_end(lengths, r.cursor.position)
            if end == r.cursor.position:
                break
            r.cursor.position = end
        r.step += 1
        r.warmups.add(r.schedule.warmup)
    r.inside = r.cursor.position < len(lengths)
    return r


@dataclass
class Growth:
    """A run's data as it arrives: the first shards' lengths, then each later arrival's."""

    p: Packing
    first: list[int]
    later: list[list[int]]
    epochs: int
    warmup_ratio: float

    def run(self, max_steps: int = 0) -> Run:
        return simulate(self.first, self.later, self.p, self.epochs, self.warmup_ratio, max_steps)


growth_st = st.builds(Growth, p=packing_st, first=st.lists(st.integers(1, 600), min_size=1, max_size=40),
                      later=st.lists(st.lists(st.integers(1, 600), min_size=1, max_size=30), max_size=4),
                      epochs=st.integers(1, 4), warmup_ratio=st.floats(0.0, 0.5))


@FAST
@given(g=growth_st)
def test_a_schedule_never_ends_inside_a_pass_over_part_of_the_data(g: Growth) -> None:
    r = g.run()
    assert not (r.inside and not r.cursor.complete)  # a partial pass is scheduled exactly, on top
    for ps in r.passes:
        if not ps.complete:
            assert ps.end <= r.schedule.total
    # epochs are passes over the whole data; the passes over part of it are all made and none counts
    assert r.cursor.epochs_done == sum(ps.complete for ps in r.passes) <= g.epochs
    assert r.cursor.partial == sum(not ps.complete for ps in r.passes) == len(g.later)
    if r.by_epochs:
        assert r.cursor.epochs_done == g.epochs


@FAST
@given(g=growth_st)
def test_the_warmup_never_restarts_when_the_schedule_stretches(g: Growth) -> None:
    r = g.run()
    assert r.warmups == {warmup_steps(r.first_total, g.warmup_ratio)}  # the first schedule's, at every step
    f = r.schedule.lr_lambda()
    warm = r.schedule.warmup
    assert [f(s) for s in range(warm)] == [(s + 1) / warm for s in range(warm)]
    after = [f(s) for s in range(warm, r.schedule.total + 1)]
    assert all(a >= b for a, b in itertools.pairwise(after))  # past the warmup the lr only decays


@FAST
@given(g=growth_st, max_steps=st.integers(1, 50))
def test_max_steps_is_kept_whatever_data_joins(g: Growth, max_steps: int) -> None:
    r = g.run(max_steps)
    assert r.schedule.total == max_steps and r.step == max_steps


@FAST
@given(step=st.integers(0, 10_000), epochs_left=st.integers(0, 10), per_epoch=st.integers(1, 500),
       uncounted=st.integers(0, 500), total=st.integers(1, 10_000), warm=st.integers(1, 500))
def test_a_stretch_always_leaves_a_step_and_keeps_the_warmup(step: int, epochs_left: int, per_epoch: int,
                                                              uncounted: int, total: int, warm: int) -> None:
    s = StepSchedule(total=total, warmup=warm)
    s.stretch(step=step, epochs_left=epochs_left, per_epoch=per_epoch, uncounted=uncounted)
    assert s.total >= step + 1 and s.total >= step + uncounted and s.warmup == warm


@FAST
@given(complete=st.lists(st.booleans(), min_size=1, max_size=20))
def test_a_stop_at_a_pass_boundary_resumes_at_it(complete: list[bool]) -> None:
    """Ending a pass and undoing it (a stop before the next pass began) leaves the cursor as it was, so a
    resume ends the same pass again, and counts it the same way."""
    c = Cursor()
    for done in complete:
        c.begin_pass(["k"], done)
        before = (c.epoch, c.partial, c.epochs_done)
        uncounted = c.end_pass()
        assert uncounted == (not done) and c.epochs_done == before[2] + done
        c.undo_end_pass(uncounted)
        assert (c.epoch, c.partial, c.epochs_done) == before
        c.end_pass()
    assert c.epochs_done == sum(complete) and c.partial == len(complete) - sum(complete)


@FAST
@given(total=st.integers(1, 5000), ratio=st.floats(0.0, 0.5), train_s=st.floats(0, 1000), budget=st.floats(1, 1000))
def test_lr_follows_whichever_of_steps_and_time_is_further(total: int, ratio: float, train_s: float,
                                                           budget: float) -> None:
    s = StepSchedule(total=total, warmup=warmup_steps(total, ratio))
    f = lr_lambda(total, s.warmup)
    assert all(0.0 <= f(k) <= 1.0 for k in (0, s.warmup - 1, s.warmup, total // 2, total))
    if total > s.warmup:
        assert f(total) == 0.0
    for step in (0, total // 3, total):
        frac = max(step / total, train_s / budget)
        assert s.lr_factor_with_time(step, train_s, budget) == f(min(total, round(frac * total)))
