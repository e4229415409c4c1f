"""One view of a run: the numbers `dfpipe status`, `dfpipe run`'s display and the dashboard all show.

`build_view` is the one place a run's counts, rates, ETAs, silent workers, alerts and engine figures are
computed; the three render its `RunView` and compute nothing of their own, so they cannot disagree.
Its inputs: the run's ledger (`LedgerFacts`, a copy of `shared.ledger.RunLedger`'s numbers: durable counts
with their (ts, count, amount) rate points, the manifest, dead letters, the prompt queue, alerts), each
worker's latest progress report, the time, and the `[view]` config (`rate_window_s`, `silent_after_s`).

Rates are over ONE window (`rate_window_s`) ending now: generation and tokenization from the ledger's
rate points (kept in its snapshot, so a fresh `dfpipe status` has them); before a stage has two points,
from its live workers' own reported rates. Training's rate is the trainer's steps/s (`TrainerProgress`,
measured over the same window by `services.trainer.pace`). A worker that has not reported for
`silent_after_s` and did not say it stopped is silent: listed, not counted in any rate.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import msgspec

from shared.bus import Bus
from shared.config import Config, ViewConfig
from shared.ledger import DurableCounts, RunLedger, StageCounts, generation_done
from shared.messages import (
    Alert,
    EvalReport,
    FeederProgress,
    GeneratorProgress,
    Message,
    TokenizerProgress,
    TrainerProgress,
)
from shared.topology import ANY, Streams, Subjects

SCHEMA = 1  # the view's JSON layout (`dfpipe status --json`): bumped when a field changes meaning or goes
FINISHED_STATES = frozenset({"stopped", "done", "finished"})  # a worker in one of these is not silent, just over
STAGE_OF: dict[type, str] = {FeederProgress: "feed", GeneratorProgress: "generate", TokenizerProgress: "tokenize",
                             TrainerProgress: "train"}


@dataclass(frozen=True)
class LedgerFacts:
    """What the view takes from a run's ledger, copied so that another thread may read it (the dashboard)."""

    counts: DurableCounts
    stages: StageCounts
    manifest_accepted: int | None  # None: no manifest yet (the feeder is not done)
    manifest_rejected: int
    dead_lettered: dict[str, int]
    alerts: tuple[Alert, ...]


def empty_facts() -> LedgerFacts:
    """The facts of a run whose ledger was not read yet (the dashboard before S3 answers)."""
    return LedgerFacts(counts=DurableCounts(0, 0, 0, 0, 0, (), ()), stages=StageCounts(False, 0, 0, 0, 0, 0, 0, 0, 0),
                       manifest_accepted=None, manifest_rejected=0, dead_lettered={}, alerts=())


def ledger_facts(ledger: RunLedger) -> LedgerFacts:
    """The facts of a refreshed ledger."""
    assert ledger.ledger is not None, "refresh() first"
    m = ledger.manifest
    return LedgerFacts(counts=ledger.ledger.counts(), stages=ledger.stages(),
                       manifest_accepted=int(m.get("total_accepted", 0)) if m is not None else None,
                       manifest_rejected=int(m.get("total_rejected", 0)) if m is not None else 0,
                       dead_lettered=dict(ledger.dead_lettered), alerts=tuple(ledger.ledger.latest_alerts()))


class StageView(msgspec.Struct, kw_only=True):
    """One stage as every view shows it: done of total, its rate over the window, and when it ends."""

    stage: str  # feed | generate | tokenize | train
    label: str
    unit: str  # what `done` counts
    done: int
    total: int | None  # None: not known yet
    rate_per_s: float  # `unit`s per second over the window
    eta_s: float | None  # None: unknown (no rate yet, stalled, or waiting for the stage before)
    source: str  # where `done` and the rate come from


class WorkerView(msgspec.Struct, kw_only=True):
    stage: str
    worker: str
    state: str  # as reported, or "silent"
    silent: bool
    age_s: float  # since its latest report
    done: int  # completions (generate), shards (tokenize), steps (train), accepted (feed)
    # generators: their own figures, and the engine they feed (None where the engine did not say)
    tokens_per_s: float = 0.0  # completion tokens/s
    prompt_tokens_per_s: float = 0.0
    completions: int = 0
    in_flight: int = 0
    errors: int = 0
    shards: int = 0
    spec_accept_length: float | None = None
    engine: str = ""
    engine_running: int | None = None
    engine_queued: int | None = None
    engine_max_running: int | None = None
    engine_tokens_per_s: float | None = None
    concurrency: int = 0
    fill: float | None = None  # engine_running / engine_max_running


class EngineView(msgspec.Struct, kw_only=True):
    """An inference engine as its live generators report it (several generators may share one)."""

    engine: str
    generators: list[str]
    running: int | None
    queued: int | None
    max_running: int | None
    tokens_per_s: float | None
    concurrency: int  # summed over its generators
    fill: float | None  # running / max_running


class TrainingView(msgspec.Struct, kw_only=True):
    worker: str
    state: str
    silent: bool
    step: int
    total_steps: int
    epoch: int
    loss: float | None  # None before the first step (the 'waiting' report's 0 is no loss)
    estimated_tau: float | None
    steps_per_s: float
    eta_s: float | None
    tokens_per_s: float
    samples_seen: int
    checkpoint_key: str | None
    ended_by: str = ""  # a done training's end: "steps", "epochs" or "time" (its max_train_s)


class RunView(msgspec.Struct, kw_only=True):
    """A run at one moment. The flat fields up to `trainer_step` are `dfpipe status --json`'s since before the view."""

    schema: int = SCHEMA
    run: str
    at: float = 0.0  # the time the view was taken (unix seconds)
    rate_window_s: float = 0.0
    silent_after_s: float = 0.0
    total: int = 0  # accepted by the feeder (manifest)
    rejects: int = 0
    completed: int = 0  # unique prompt_ids in completion shards
    completion_records: int = 0  # including duplicates from redeliveries
    shards: int = 0
    in_flight: int = 0  # delivered, not acked
    queued: int = 0  # not yet delivered
    failed: int = 0  # engine/S3 errors reported by generators (each retried)
    dead_lettered: dict[str, int] = {}
    completion_tokens_per_s: float = 0.0  # generation, over the window
    completions_per_s: float = 0.0
    eta_s: float | None = None  # generation's
    tokenized_samples: int = 0  # in the latest tokenized shard of each completion shard
    tokenized_shards: int = 0
    tokenized_records: int = 0  # completion records those shards were built from
    dropped: dict[str, int] = {}  # records not kept, by reason (duplicates included)
    trainer_step: int | None = None
    stages: list[StageView] = []  # feed, generate, tokenize, train
    training: TrainingView | None = None
    workers: list[WorkerView] = []
    engines: list[EngineView] = []
    silent: list[str] = []  # "stage/worker"
    alerts: list[Alert] = []

    def stage(self, name: str) -> StageView:
        return next(s for s in self.stages if s.stage == name)


# --- rates ---------------------------------------------------------------------------------------


def window_rates(points: Sequence[tuple[float, int, int]], now: float, window_s: float) -> tuple[float, float] | None:
    """(count/s, amount/s) of cumulative (ts, count, amount) points over the window ending `now`; None when the
    points cannot say (fewer than two, or all of them stamped after `now` by a clock ahead of this one).

    The value at the window's start is the last point before it (the counters move in steps); with no point
    before, the first point in it (its own increase happened at an unknown time before). No point in the
    window: (0, 0), the stage is stalled."""
    if len(points) < 2:
        return None
    start = now - window_s
    i = len(points)
    while i > 0 and points[i - 1][0] >= start:  # from the end: the work is the window's points, not the history
        i -= 1
    if i == len(points):
        return 0.0, 0.0
    base = points[i - 1] if i > 0 else points[i]
    t0 = max(base[0], start)
    last = points[-1]
    if now <= t0:
        return None
    return max(0.0, (last[1] - base[1]) / (now - t0)), max(0.0, (last[2] - base[2]) / (now - t0))


def _eta(done: int, total: int | None, rate: float) -> float | None:
    if total is not None and total > 0 and done >= total:
        return 0.0
    return (total - done) / rate if total is not None and rate > 0 else None


# --- the view ------------------------------------------------------------------------------------


def is_silent(msg: Message, now: float, silent_after_s: float) -> bool:
    """No report for `silent_after_s` from a worker that did not say it was finished."""
    if isinstance(msg, EvalReport) or (isinstance(msg, FeederProgress) and msg.done):
        return False
    return getattr(msg, "state", "running") not in FINISHED_STATES and now - msg.ts > silent_after_s


def _worker(msg: Message, now: float, silent: bool) -> WorkerView:
    stage = STAGE_OF[type(msg)]
    state = "silent" if silent else getattr(msg, "state", "done" if getattr(msg, "done", False) else "running")
    w = WorkerView(stage=stage, worker=msg.worker, state=state, silent=silent, age_s=round(max(0.0, now - msg.ts), 1),
                   done=0)
    if isinstance(msg, GeneratorProgress):
        fill = (msg.engine_running / msg.engine_max_running
                if msg.engine_running is not None and msg.engine_max_running else None)
        w = msgspec.structs.replace(
            w, done=msg.completions, completions=msg.completions, tokens_per_s=msg.completion_tokens_per_s,
            prompt_tokens_per_s=msg.prompt_tokens_per_s, in_flight=msg.in_flight, errors=msg.errors, shards=msg.shards,
            spec_accept_length=msg.spec_accept_length, engine=msg.engine, engine_running=msg.engine_running,
            engine_queued=msg.engine_queued, engine_max_running=msg.engine_max_running,
            engine_tokens_per_s=msg.engine_tokens_per_s, concurrency=msg.concurrency, fill=fill)
    elif isinstance(msg, TokenizerProgress):
        w.done = msg.shards
    elif isinstance(msg, TrainerProgress):
        w.done = msg.step
    elif isinstance(msg, FeederProgress):
        w.done = msg.accepted
    return w


def _engines(generators: list[tuple[GeneratorProgress, WorkerView]]) -> list[EngineView]:
    """Live generators grouped by the engine they feed; the engine's own figures from the latest report."""
    by_engine: dict[str, list[tuple[GeneratorProgress, WorkerView]]] = {}
    for msg, w in generators:
        if msg.engine and not w.silent and w.state not in FINISHED_STATES:
            by_engine.setdefault(msg.engine, []).append((msg, w))
    out = []
    for engine, members in sorted(by_engine.items()):
        latest = max(members, key=lambda mw: mw[0].ts)[0]
        out.append(EngineView(engine=engine, generators=sorted(w.worker for _, w in members),
                              running=latest.engine_running, queued=latest.engine_queued,
                              max_running=latest.engine_max_running, tokens_per_s=latest.engine_tokens_per_s,
                              concurrency=sum(m.concurrency for m, _ in members),
                              fill=(latest.engine_running / latest.engine_max_running
                                    if latest.engine_running is not None and latest.engine_max_running else None)))
    return out


def _training(msgs: list[TrainerProgress], now: float, silent_after_s: float) -> TrainingView | None:
    """The trainer furthest along (several ranks or a restarted one report under one or more names)."""
    if not msgs:
        return None
    t = max(msgs, key=lambda m: (m.step, m.ts))
    silent = is_silent(t, now, silent_after_s)
    stepped = t.step > 0
    live = not silent and t.state not in FINISHED_STATES
    done = t.state == "done" or (t.total_steps > 0 and t.step >= t.total_steps)
    return TrainingView(worker=t.worker, state="silent" if silent else t.state, silent=silent, step=t.step,
                        total_steps=t.total_steps, epoch=t.epoch, loss=t.loss if stepped else None,
                        estimated_tau=t.estimated_tau if stepped else None,
                        steps_per_s=t.steps_per_s if live else 0.0,
                        eta_s=0.0 if done else (t.eta_s if live else None), tokens_per_s=t.tokens_per_s if live else 0.0,
                        samples_seen=t.samples_seen, checkpoint_key=t.checkpoint_key, ended_by=t.ended_by)


def build_view(run: str, facts: LedgerFacts, latest: Iterable[Message], now: float, cfg: ViewConfig) -> RunView:
    """The run's view from its ledger's facts and each worker's latest progress report (any order)."""
    c, window = facts.counts, cfg.rate_window_s
    v = RunView(run=run, at=now, rate_window_s=window, silent_after_s=cfg.silent_after_s)
    v.total, v.rejects = facts.manifest_accepted or 0, facts.manifest_rejected
    v.completed, v.shards, v.completion_records = c.completed, c.shards, c.records
    v.tokenized_samples, v.tokenized_shards, v.tokenized_records = c.kept, c.tokenized_shards, c.samples_in
    v.dropped = dict(sorted(c.dropped.items(), key=lambda kv: -kv[1]))
    v.in_flight, v.queued, v.dead_lettered = facts.stages.in_flight, facts.stages.queued, dict(facts.dead_lettered)
    v.alerts = list(facts.alerts)

    generators: list[tuple[GeneratorProgress, WorkerView]] = []
    trainers: list[TrainerProgress] = []
    feeders: list[FeederProgress] = []
    tokenizers: list[tuple[TokenizerProgress, WorkerView]] = []
    for msg in latest:
        if type(msg) not in STAGE_OF or getattr(msg, "run", run) != run:
            continue
        w = _worker(msg, now, is_silent(msg, now, cfg.silent_after_s))
        v.workers.append(w)
        if w.silent:
            v.silent.append(f"{w.stage}/{w.worker}")
        if isinstance(msg, GeneratorProgress):
            generators.append((msg, w))
            v.failed += msg.errors
        elif isinstance(msg, TrainerProgress):
            trainers.append(msg)
        elif isinstance(msg, FeederProgress):
            feeders.append(msg)
        elif isinstance(msg, TokenizerProgress):
            tokenizers.append((msg, w))
    order = {s: i for i, s in enumerate(("feed", "generate", "tokenize", "train"))}
    v.workers.sort(key=lambda w: (order[w.stage], w.worker))
    v.engines = _engines(generators)
    live_generators = [m for m, w in generators if not w.silent and w.state not in FINISHED_STATES]

    # feed: the manifest, once written (the feeder's own counter before)
    fed = v.total if facts.manifest_accepted is not None else sum(m.accepted for m in feeders)
    prompts = facts.manifest_accepted if facts.manifest_accepted is not None else (fed or None)
    fed_all = facts.manifest_accepted is not None or (bool(feeders) and all(m.done for m in feeders))
    feed = StageView(stage="feed", label="fed", unit="prompts", done=fed, total=prompts, rate_per_s=0.0,
                     eta_s=0.0 if fed_all else None,
                     source="the feed manifest" if facts.manifest_accepted is not None else "the feeder's counter")

    # generate: unique prompts in the run's shards; before the first shard, the generators' counters
    rates = window_rates(c.completed_points, now, window)
    if rates is None:
        rates = (sum(m.completions_per_s for m in live_generators), sum(m.completion_tokens_per_s for m in live_generators))
        rate_source = "the live generators' own rates"
    else:
        rate_source = f"the shard events over the last {window:.0f}s"
    v.completions_per_s, v.completion_tokens_per_s = rates
    exact = c.shards > 0
    generated = c.completed if exact else sum(m.completions for m, _ in generators)
    generation_over = generation_done(facts.stages)
    dead = facts.stages.generate_dead  # a dead-lettered prompt is over too (`dfpipe replay` may bring it back)
    v.eta_s = 0.0 if generation_over else _eta(generated + dead, prompts, v.completions_per_s)
    gen = StageView(stage="generate", label="generated", unit="prompts", done=generated, total=prompts,
                    rate_per_s=v.completions_per_s, eta_s=v.eta_s,
                    source=("unique prompts in the run's shard events" if exact else
                            "the generators' counters until the first shard is written (a restart resets them)")
                    + f"; rate from {rate_source}")

    # tokenize: completion shards tokenized of those written; it cannot end before generation does
    tok_rates = window_rates(c.tokenized_points, now, window)
    tok_rate = tok_rates[0] if tok_rates is not None else 0.0
    tokenized = c.tokenized_shards if exact else sum(m.shards for m, _ in tokenizers)
    shards = c.shards if exact else (sum(m.shards for m, _ in generators) or None)
    tok_eta = _eta(tokenized, shards, tok_rate)
    if not generation_over and tok_eta is not None:
        tok_eta = None if v.eta_s is None else max(tok_eta, v.eta_s)
    tok = StageView(stage="tokenize", label="tokenized shards", unit="shards", done=tokenized, total=shards or None,
                    rate_per_s=tok_rate, eta_s=tok_eta,
                    source="completion shards tokenized of those written, from the run's shard events" if exact else
                    "the tokenizers' and generators' counters until the first shard is written")

    # train: steps of the schedule, at the trainer's own steps/s
    v.training = _training(trainers, now, cfg.silent_after_s)
    t = v.training
    v.trainer_step = t.step if t is not None else None
    train = StageView(stage="train", label="trained (steps)", unit="steps", done=t.step if t else 0,
                      total=(t.total_steps or None) if t else None, rate_per_s=t.steps_per_s if t else 0.0,
                      eta_s=t.eta_s if t else None,
                      source="the trainer's steps of its schedule (the schedule grows while data still arrives)")
    v.stages = [feed, gen, tok, train]
    return v


# --- its words: how every renderer says a duration, a rate, training's state -------------------------


def duration(s: float | None, unknown: str = "unknown") -> str:
    """A duration as the views print it: 1h05m, 4m07s, 12s."""
    if s is None:
        return unknown
    h, rem = divmod(int(s), 3600)
    if h:
        return f"{h}h{rem // 60:02d}m"
    return f"{rem // 60}m{rem % 60:02d}s" if rem >= 60 else f"{rem}s"


def rate_text(rate_per_s: float, unit: str) -> str:
    """A rate as every view words it: per second, or per minute under 0.1 a second (19 steps/min, not 0.32/s)."""
    if rate_per_s >= 0.1 or rate_per_s == 0:
        return f"{rate_per_s:.2f} {unit}/s"
    return f"{60 * rate_per_s:.1f} {unit}/min"


def training_text(v: RunView) -> str:
    """Training as every view words it: step of total, loss, τ, steps/s, ETA (or what it waits for)."""
    t = v.training
    if t is None:
        return "waiting for data"
    if t.loss is None:
        return t.state
    of = f" of {t.total_steps}" if t.total_steps else ""
    return (f"step {t.step}{of}, loss {t.loss:.3f}, τ≈{t.estimated_tau:.2f}, {rate_text(t.steps_per_s, 'steps')}, "
            f"ETA {duration(t.eta_s)}" + ("" if t.state in ("running", "done") else f" ({t.state})"))


# --- reading it ----------------------------------------------------------------------------------


async def latest_progress(bus: Bus, run: str) -> list[Message]:
    """Each worker's latest progress report of `run` (one per subject: the work is the number of workers)."""
    return [m for _, m in await bus.latest_per_subject(Streams.PROGRESS, Subjects.progress(run, ANY, ANY))]


async def read_view(cfg: Config, bus: Bus, ledger: RunLedger, now: float | None = None) -> RunView:
    """Refresh `ledger` (only what is new since its last refresh), read the workers' latest reports, build."""
    await ledger.refresh()
    latest = await latest_progress(bus, cfg.run)
    return build_view(cfg.run, ledger_facts(ledger), latest, time.time() if now is None else now, cfg.view)
