"""`dfpipe run`: one command from a prompt file to a trained drafter, on the embedded stack or a configured one.

Phases, each judged from the bus and S3 alone (so a re-run resumes where the last one stopped):
feed (one-shot, idempotent) → generate (N supervised workers; done when every accepted prompt
is completed or dead-lettered) → tokenize (done when every completion shard has a tokenized
shard or a dead letter) → train (runs to its configured steps; resumes from its checkpoint)
→ eval (one-shot) → a report of where every artifact is. A crash-looping service or a tripped
quality gate stops the run with the reason, never silently. A stack that cannot be read does not: the
services keep running (they ride through outages themselves), the display says for how long the stack has
been unreachable, and the run goes on when it answers again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import msgspec

from shared.bus import Bus
from shared.children import dies_with_parent
from shared.config import Config, data_dir
from shared.exits import Exit
from shared.failures import Failure, classify, describe, retry_async
from shared.gpus import GpuGroup
from shared.ledger import RunLedger, StageCounts, generation_done, tokenization_done
from shared.messages import Alert
from shared.runconfig import record_run_config
from shared.status import RunOverview, RunStatus, duration, rate_text, run_overview, run_status, training_text
from shared.store import Store
from shared.topology import Keys, Subjects
from shared.view import RunView, TrainingView

from .expect import RUN_MARGIN_S
from .layout import engine_urls, engines_still_up, generator_argv, launched_engine_urls, trainer_spec
from .supervisor import ServiceSpec, ServiceState, Supervisor, kill_group

log = logging.getLogger("dflash.run")
T = TypeVar("T")

# A stopped trainer finishes its step and saves a checkpoint before it exits: on a busy CPU or with a large
# drafter that takes minutes, and a SIGKILL before it ends loses every step since the last checkpoint.
TRAINER_GRACE_S = 300.0
BUNDLED_PROMPTS = Path(__file__).parent / "data" / "prompts.jsonl"
DEMO_CONFIG = Path(__file__).parent / "data" / "demo.toml"


@dataclass
class RunRequest:
    """What a user asks of `dfpipe run`: the prompts, the generators to start, and which extras to run."""

    prompts: list[str]
    generators: list[GpuGroup | None]  # one entry per generator: its engine's GPU group, or None on CPU
    backend: str | None = None
    train: bool = True
    dashboard: bool = True
    extra_env: dict[str, str] = field(default_factory=dict)
    started_at: float = field(default_factory=time.monotonic)  # when the command began (trainer.run_budget_s)
    expected_eval_s: float | None = None  # the eval's expected time on this machine, when it was estimated


def training_budget_s(cfg: Config, request: RunRequest, now: float, margin_s: float = RUN_MARGIN_S) -> float | None:
    """The training's time budget when it starts under `trainer.run_budget_s`: what is left of the run's
    budget, less the eval's expected time and `margin_s` (the trainer's start and last checkpoint), at most
    `max_train_s` when set, at least a minute (a run already late still trains). None: no run budget."""
    t = cfg.trainer
    if t.run_budget_s <= 0 or request.expected_eval_s is None:
        return None
    left = t.run_budget_s - (now - request.started_at) - request.expected_eval_s - margin_s
    if t.max_train_s > 0:
        left = min(left, t.max_train_s)
    return round(max(60.0, left))


def cli_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "shared.cli", *args]


def service_specs(cfg: Config, request: RunRequest) -> list[ServiceSpec]:
    """The run's services; a layout that cannot run raises LayoutError (shared/gpus.py) before any starts."""
    run = cfg.run
    specs = [ServiceSpec("feeder", cli_argv("feed", *request.prompts, "--run", run), one_shot=True)]
    urls = engine_urls(cfg, request.generators, request.backend)
    for i, (group, url) in enumerate(zip(request.generators, urls, strict=True)):
        specs.append(ServiceSpec(f"generator-{i}", cli_argv(*generator_argv(run, i, group, url, request.backend,
                                                                             cfg.generator.launch))))
    specs.append(ServiceSpec("tokenizer", cli_argv("tokenize", "--run", run)))
    if request.train:
        specs.append(trainer_spec(cfg, request.generators, grace_s=TRAINER_GRACE_S))
    if request.dashboard:
        specs.append(ServiceSpec("dashboard", cli_argv("dashboard", "--run", run)))
    for s in specs:
        s.env = {**request.extra_env, **s.env}  # a spec's own placement (CUDA_VISIBLE_DEVICES) wins
    return specs


class Display:
    """A live terminal view (rich): one bar per stage with counts, rate and ETA, rendered from the run's view
    (`shared.view`: the numbers `dfpipe status` and the dashboard show); a log line instead when not on a terminal."""

    def __init__(self, cfg: Config, enabled: bool) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.console = Console(stderr=False)
        self.enabled = enabled and self.console.is_terminal
        self.progress = Progress(
            TextColumn("[bold]{task.description:<10}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[note]}"), TimeElapsedColumn(), console=self.console,
            disable=not self.enabled, refresh_per_second=2,
        )
        self.tasks = {name: self.progress.add_task(name, total=None, note="") for name in
                      ("fed", "generated", "tokenized", "trained")}
        self.last_line = 0.0

    def __enter__(self) -> Display:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.__exit__(*exc)

    def update(self, p: RunOverview, services: dict[str, str]) -> None:
        self.show(p.view, p.stages, services)

    def show(self, v: RunView, stages: StageCounts, services: dict[str, str]) -> None:
        for task, line in zip(("fed", "generated", "tokenized", "trained"), stage_lines(v, stages), strict=True):
            self.progress.update(self.tasks[task], total=line.total, completed=line.done, note=line.note)
        if not self.enabled and time.monotonic() - self.last_line > 10:  # a log line when not on a terminal
            self.last_line = time.monotonic()
            print(f"[{time_of_day()}] " + " | ".join(f"{line.name} {line.done}/{line.total or '?'} {line.note}"
                                                      for line in stage_lines(v, stages))
                  + " | " + " ".join(f"{k}={n}" for k, n in services.items()), flush=True)


@dataclass(frozen=True)
class StageLine:
    """One stage as `dfpipe run` shows it: a bar of done of total, and a note with its rate and ETA."""

    name: str
    done: int
    total: int | None
    note: str


def stage_lines(v: RunView, stages: StageCounts) -> list[StageLine]:
    """The display's four lines, every number from the view."""
    feed, gen, tok, train = (v.stage(s) for s in ("feed", "generate", "tokenize", "train"))
    return [
        StageLine("fed", feed.done, feed.total, f"{v.rejects} rejected" + ("" if stages.fed else " (feeding)")),
        StageLine("generated", gen.done, gen.total,
                  f"{v.completion_tokens_per_s:.0f} tok/s, {rate_text(gen.rate_per_s, gen.unit)}, ETA {duration(gen.eta_s)}, "
                  f"dead {v.dead_lettered.get('generate', 0)}"),
        StageLine("tokenized", tok.done, tok.total,
                  f"{v.tokenized_samples} samples, {rate_text(tok.rate_per_s, tok.unit)}, ETA {duration(tok.eta_s)}"),
        StageLine("trained", train.done, train.total, training_text(v)),
    ]


def time_of_day() -> str:
    """HH:MM:SS, for the run's display lines."""
    return time.strftime("%H:%M:%S")


async def _crash_loop_alert(bus: Bus, run: str, st: ServiceState) -> None:
    alert = Alert(run=run, stage="run", kind="crash_loop", worker=st.spec.name,
                  message=f"{st.spec.name} crash-looped ({len(st.crashes)} exits, last code {st.last_exit}); "
                          "not restarted", examples=[])
    try:
        await retry_async("crash-loop alert", lambda: bus.publish(Subjects.alert(run, "run"), alert),
                          deadline_s=bus.cfg.read_deadline_s)
    except Exception as e:  # the run stops and says why on the terminal either way
        log.warning("crash-loop alert not published: %s", describe(e))


class Unreachable:
    """How long the stack has not answered `dfpipe run`'s poll: one line every `every_s` while it lasts, one when
    it is back. The services are not stopped for it."""

    def __init__(self, every_s: float = 10.0) -> None:
        self.since: float | None = None
        self.every_s = every_s
        self._said = 0.0

    def failed(self, error: BaseException, say: Callable[[str], None]) -> None:
        now = time.monotonic()
        if self.since is None:
            self.since = now
        if now - self._said >= self.every_s:
            self._said = now
            say(f"[{time_of_day()}] stack unreachable for {now - self.since:.0f}s ({describe(error)}); "
                "services kept running, waiting for it")

    def answered(self, say: Callable[[str], None]) -> None:
        if self.since is not None:
            say(f"[{time_of_day()}] stack reachable again after {time.monotonic() - self.since:.0f}s")
        self.since, self._said = None, 0.0


class StopSignals:
    """SIGTERM, SIGINT and SIGHUP (a scheduler, `docker stop`, Ctrl-C, a closed terminal) ask `dfpipe run` to stop:
    the first sets `requested` (the run drains and stops every service it started, then exits Exit.STOPPED); a
    second ends every service's process group at once and exits Exit.STOPPED too (nothing is lost: work is acked
    only once its output is written, so the unacked work is redone by the next run)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

    def __init__(self, kill_now: Callable[[], None]) -> None:
        self.requested = asyncio.Event()
        self.name = ""
        self.kill_now = kill_now

    def __enter__(self) -> StopSignals:
        loop = asyncio.get_running_loop()
        for sig in self.SIGNALS:
            loop.add_signal_handler(sig, self._on_signal, sig)
        return self

    def __exit__(self, *exc: object) -> None:
        loop = asyncio.get_running_loop()
        for sig in self.SIGNALS:
            loop.remove_signal_handler(sig)

    def _on_signal(self, sig: signal.Signals) -> None:
        if self.requested.is_set():
            self.kill_now()
            with contextlib.suppress(OSError):  # the terminal may be gone (SIGHUP)
                print(f"\nsecond {sig.name}: every service killed; nothing is lost, the same command resumes",
                      flush=True)
            os._exit(Exit.STOPPED)
        self.name = sig.name
        self.requested.set()
        with contextlib.suppress(OSError):
            print(f"\n{sig.name}: draining and stopping every service of this run (a second signal kills them "
                  "at once)", flush=True)


async def run_pipeline(cfg: Config, request: RunRequest, *, env: dict[str, str], show: bool = True,
                       poll_s: float = 2.0) -> int:
    children: list[Callable[[], None]] = []  # kill_all of what is running now: the supervisor, the eval
    with StopSignals(lambda: [kill() for kill in children]) as signals:
        return await _run_pipeline(cfg, request, env=env, show=show, poll_s=poll_s, signals=signals,
                                   children=children)


async def _run_pipeline(cfg: Config, request: RunRequest, *, env: dict[str, str], show: bool, poll_s: float,
                        signals: StopSignals, children: list[Callable[[], None]]) -> int:
    store = await asyncio.to_thread(Store.open, cfg)
    started_with = msgspec.structs.replace(
        cfg, generator=msgspec.structs.replace(cfg.generator, backend=request.backend)) if request.backend else cfg
    await asyncio.to_thread(record_run_config, store, started_with)  # the run's settings, once, at its start
    logs = data_dir(cfg) / "runs" / cfg.run / "logs"
    async with await Bus.connect(cfg.bus, "dflash-run", deadline_s=30) as bus:
        await bus.ensure_streams()

        async def on_crash(st: ServiceState) -> None:
            await _crash_loop_alert(bus, cfg.run, st)

        request.extra_env.update(env)
        sup = Supervisor(service_specs(cfg, request), logs, on_crash_loop=on_crash, grace_s=cfg.generator.drain_s + 15)
        children.append(sup.kill_all)
        sup.start()
        if request.dashboard:
            print(f"dashboard: http://{cfg.dashboard.host}:{cfg.dashboard.port}/  (logs in {logs})", flush=True)
        generators = [n for n in sup.services if n.startswith("generator-")]
        phase = "generate"
        outcome = Exit.OK
        keep_dashboard = False  # only a run that finished its phases keeps the page up while the eval runs
        ledger = RunLedger(cfg, bus, store)  # each poll folds only the events since the last
        unreachable = Unreachable()
        try:
            with Display(cfg, show) as display:
                def say(line: str) -> None:
                    display.console.print(line, markup=False, highlight=False)

                while not signals.requested.is_set():
                    try:
                        p = await run_overview(cfg, bus, store, ledger)
                    except Exception as e:  # each read was retried through a failover already
                        if classify(e) is not Failure.TRANSIENT:
                            raise
                        unreachable.failed(e, say)
                        await asyncio.sleep(poll_s)
                        continue
                    unreachable.answered(say)
                    display.update(p, sup.state())
                    looping = [n for n, s in sup.state().items() if s == "crash_loop"]
                    if looping:
                        print(f"stopping: {', '.join(looping)} crash-looped (logs in {logs})")
                        outcome = Exit.CRASH_LOOP
                        break
                    gate = [a for a in p.alerts if a.kind == "quality_gate" and a.severity == "critical"]
                    if gate and not cfg.tokenizer.gate_override:
                        print(f"stopping: quality gate tripped: {gate[-1].message}")
                        for ex in gate[-1].examples[:3]:
                            print(f"  e.g. {ex[:200]!r}")
                        outcome = Exit.QUALITY_GATE
                        break
                    if phase == "generate" and generation_done(p.stages):
                        await asyncio.gather(*(sup.stop_service(n) for n in generators))
                        phase = "tokenize"
                    if phase == "tokenize" and tokenization_done(p.stages):
                        phase = "train"
                        await sup.stop_service("tokenizer")
                    if phase == "train":
                        if not request.train:
                            break
                        if sup.state()["trainer"] == "pending" and (up := await engines_still_up(
                                launched_engine_urls(cfg, request.generators, request.backend), 120.0)):
                            print(f"engines this run launched still answer at {', '.join(up)}: training starts "
                                  "beside them (stop them to free their GPUs)")
                        if sup.state()["trainer"] == "pending" and (budget := training_budget_s(
                                cfg, request, time.monotonic())) is not None:
                            sup.services["trainer"].spec.env["DFLASH_TRAINER__MAX_TRAIN_S"] = str(budget)
                            cfg = msgspec.structs.replace(cfg, trainer=msgspec.structs.replace(cfg.trainer, max_train_s=budget))
                            print(f"training for {budget / 60:.1f} minutes: what is left of the run's "
                                  f"{cfg.trainer.run_budget_s / 60:.0f} (trainer.run_budget_s) after the eval's expected "
                                  f"{request.expected_eval_s / 60:.1f}", flush=True)
                        sup.launch("trainer")
                        state = sup.state()["trainer"]
                        if state == "done":
                            break
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(signals.requested.wait(), timeout=poll_s)
                keep_dashboard = not signals.requested.is_set() and not outcome and request.dashboard
        finally:
            if not keep_dashboard:
                await sup.stop()
        if signals.requested.is_set():
            return stopped_by(signals.name, sup)
        if outcome:
            return outcome
        report = None
        if request.train:
            # its own session: a terminal's Ctrl-C is ours to relay; it dies with us, even by kill -9
            proc = await asyncio.create_subprocess_exec(*cli_argv("eval", "--run", cfg.run), env={**os.environ, **env},
                                                        start_new_session=True, preexec_fn=dies_with_parent())
            children.append(lambda: kill_group(proc.pid))
            if await until_signal(proc.wait(), signals.requested) is None:  # an eval is redone whole: nothing to drain
                kill_group(proc.pid)
                await proc.wait()
                await sup.stop()
                return stopped_by(signals.name, sup)
            if proc.returncode != Exit.OK:
                print("eval failed (see above)")
                outcome = Exit.EVAL_FAILED
            else:
                key = Keys.eval_report(cfg.run)
                if await asyncio.to_thread(store.exists, key):
                    report = msgspec.json.decode(await asyncio.to_thread(store.get_bytes, key))
        final = await retry_async("the run's final status", lambda: run_status(cfg, bus, store, ledger), deadline_s=None)
        print_artifacts(cfg, store, report, final, on_cpu=all(g is None for g in request.generators))
        await sup.stop()
        return outcome


async def until_signal(step: Awaitable[T], requested: asyncio.Event) -> T | None:
    """`step`'s result, or None (and `step` cancelled) once a stop is requested."""
    task = asyncio.ensure_future(step)
    stop = asyncio.create_task(requested.wait())
    await asyncio.wait([task, stop], return_when=asyncio.FIRST_COMPLETED)
    stop.cancel()
    if task.done():
        return task.result()
    task.cancel()
    return None


def stopped_by(signal_name: str, sup: Supervisor) -> int:
    """The closing line of a run stopped by a signal: every service stopped, and how to go on."""
    left = [n for n, st in sup.services.items() if st.proc is not None and st.proc.returncode is None]
    print(f"run stopped by {signal_name}: " + (f"still running: {', '.join(left)}" if left else
          "every service it started has stopped") + "; nothing is lost, the same command resumes (the embedded "
          "stack keeps running: `dfpipe stack down` stops it)", flush=True)
    return Exit.STOPPED


def print_artifacts(cfg: Config, store: Store, report: dict | None, st: RunStatus, on_cpu: bool = False) -> None:
    run = cfg.run
    dead = sum(st.dead_lettered.values())
    print(f"\nrun {run}: {st.completed} of {st.total} prompts completed ({st.rejects} rejected at feed, {dead} dead "
          f"letters); {st.tokenized_samples} training samples kept of {st.tokenized_records} records")
    dropped = {r: n for r, n in st.dropped.items() if r != "duplicate"}
    if dropped:
        print("  dropped: " + ", ".join(f"{r} {n}" for r, n in dropped.items()) + f"  (listed by `dfpipe drops --run {run}`)")
    if st.training and st.training.ended_by:
        print("  " + training_end(cfg, st.training))
    print(f"run {run} finished. Artifacts:")
    print(f"  manifest      {store.uri(Keys.manifest(run))}")
    print(f"  rejects       {store.uri(Keys.rejects(run))}")
    print(f"  completions   {store.uri(Keys.completions_prefix(run))}")
    print(f"  tokenized     {store.uri(Keys.tokenized_prefix(run))}")
    print(f"  checkpoints   {store.uri(Keys.checkpoints_prefix(run))}")
    if report:
        print(f"  eval report   {store.uri(Keys.eval_report(run))}")
        print(f"eval: τ = {report.get('tau', 0):.3f} on {report.get('prompts', 0)} held-out prompts, speedup "
              f"{report.get('speedup', 0):.2f}x, lossless={report.get('lossless')}")
        if on_cpu:  # the numbers of a CPU run need reading; a GPU run's speak for themselves
            print(EXPECTED_ON_A_SMALL_CPU)
    print("next (docs/export.md):")
    if report:
        print(f"  dfpipe export --run {run} ./{run}-drafter      # the evaluated drafter: config, weights, tokenizer, "
              "model card with the SGLang/vLLM commands")
    print(f"  dfpipe export-data --run {run} --format parquet,sharegpt ./{run}-data      # the regenerated "
          "completions as a dataset")


def training_end(cfg: Config, t: TrainingView) -> str:
    """Which budget ended the training: a τ reads differently after 7 minutes than after 4 epochs."""
    budget = (f"what was left of the run's {cfg.trainer.run_budget_s / 60:.0f} minutes, trainer.run_budget_s"
              if cfg.trainer.run_budget_s > 0 else "trainer.max_train_s")
    why = {"time": f"its time budget ({cfg.trainer.max_train_s:.0f} s: {budget})",
           "epochs": f"its epochs (trainer.epochs = {cfg.trainer.epochs})",
           "steps": f"its steps (trainer.max_steps = {cfg.trainer.max_steps})"}.get(t.ended_by, t.ended_by)
    return f"training: {t.step} steps, ended by {why}"


# What the first eval a newcomer sees means (the demo: a 135M target on a 2-core CPU, a short training), from
# measurements on such a machine (bench/results/demo.json, train_quality.json; bench/README.md).
EXPECTED_ON_A_SMALL_CPU = (
    "  what to expect on this CPU: τ (tokens per cycle, bonus included) is the drafter's quality. The demo\n"
    "  (350 prompts, 80-token answers, a two-layer block-4 DFlash 2 drafter trained for what is left of a\n"
    "  19-minute run) ends near τ 1.5 on a 2-core AVX2 CPU (measured: τ 1.52 on 24 held-out prompts,\n"
    "  lossless, speedup 0.67x, 481 steps, 18.5 minutes in all; bench/results/demo.json). Longer training\n"
    "  reaches τ 1.9-2.1: 4 epochs of 192-token answers (about 20 minutes of training with bf16 units) τ 1.9;\n"
    "  1,500 prompts and 30 minutes τ 2.15 (DFlash 2; DFlash 1.86; bench/train_quality.py). The speedup\n"
    "  stays below 1x (0.89x at τ 2.15): a 135M target on a CPU is compute-bound, so a drafter pass plus a\n"
    "  block-wide verify cost about what the tokens they save would. Speculative decoding pays where the\n"
    "  target is large and memory-bound (an 8B+ target on a GPU: the paper reports τ 6.49 and 4.86x for\n"
    "  Qwen3-8B). τ carries over; the speedup is this machine's.")
