"""`dfpipe run`: one command from a prompt file to a trained drafter, on the embedded stack or a configured one.

Phases, each judged from the bus and S3 alone (so a re-run resumes where the last one stopped):
feed (one-shot, idempotent) → generate (N supervised workers; done when every accepted prompt
is completed or dead-lettered) → tokenize (done when every completion shard has a tokenized
shard or a dead letter) → train (runs to its configured steps; resumes from its checkpoint)
→ eval (one-shot) → a report of where every artifact is. A crash-looping service or a tripped
quality gate stops the run with the reason, never silently.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from shared.bus import Bus
from shared.config import Config, data_dir
from shared.exits import Exit
from shared.ledger import RunLedger, generation_done, tokenization_done
from shared.messages import Alert
from shared.status import RunOverview, RunStatus, run_overview, run_status
from shared.store import Store
from shared.topology import Keys, Subjects

from .supervisor import ServiceSpec, ServiceState, Supervisor

log = logging.getLogger("dflash.run")

BUNDLED_PROMPTS = Path(__file__).parent / "data" / "prompts.jsonl"
DEMO_CONFIG = Path(__file__).parent / "data" / "demo.toml"


@dataclass
class RunRequest:
    """What a user asks of `dfpipe run`: the prompts, the generators to start, and which extras to run."""

    prompts: list[str]
    generators: list[int | None]  # one entry per generator: its GPU, or None on CPU
    backend: str | None = None
    train: bool = True
    dashboard: bool = True
    extra_env: dict[str, str] = field(default_factory=dict)


def cli_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "shared.cli", *args]


def service_specs(cfg: Config, request: RunRequest) -> list[ServiceSpec]:
    run = cfg.run
    specs = [ServiceSpec("feeder", cli_argv("feed", *request.prompts, "--run", run), one_shot=True)]
    for i, gpu in enumerate(request.generators):
        argv = cli_argv("generate", "--run", run, "--worker", f"gen{i}")
        if gpu is not None:
            argv += ["--gpu", str(gpu)]
        if request.backend:
            argv += ["--backend", request.backend]
        specs.append(ServiceSpec(f"generator-{i}", argv))
    specs.append(ServiceSpec("tokenizer", cli_argv("tokenize", "--run", run)))
    if request.train:
        # Started once tokenization is done: the step count is planned from the whole dataset. (A
        # trainer started by hand or in compose may start early: later shards join its next pass, and its
        # passes count as epochs once generation and tokenization are done.)
        specs.append(ServiceSpec("trainer", cli_argv("train", "--run", run), one_shot=True, deferred=True))
    if request.dashboard:
        specs.append(ServiceSpec("dashboard", cli_argv("dashboard", "--run", run)))
    for s in specs:
        s.env.update(request.extra_env)
    return specs


class Display:
    """A live terminal view (rich): one bar per stage with counts, rate and ETA."""

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
        self.max_steps = cfg.trainer.max_steps

    def __enter__(self) -> Display:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.__exit__(*exc)

    def update(self, p: RunOverview, services: dict[str, str]) -> None:
        st, stages = p.status, p.stages
        eta = f"ETA {int(st.eta_s // 60)}m{int(st.eta_s % 60):02d}s" if st.eta_s else ""
        self.progress.update(self.tasks["fed"], total=st.total or None, completed=st.total,
                             note=f"{st.rejects} rejected" + ("" if stages.fed else " (feeding)"))
        self.progress.update(self.tasks["generated"], total=st.total or None, completed=st.completed,
                             note=f"{st.completion_tokens_per_s:.0f} tok/s {eta} dead {st.dead_lettered.get('generate', 0)}")
        self.progress.update(self.tasks["tokenized"], total=stages.shards or None, completed=stages.tokenized_shards,
                             note=f"{p.tokenized_samples} samples")
        t = p.trainer
        self.progress.update(self.tasks["trained"], total=(t.total_steps if t else 0) or self.max_steps or None,
                             completed=t.step if t else 0,
                             note=f"loss {t.loss:.3f} τ≈{t.estimated_tau:.2f}" if t else "waiting for data")
        if not self.enabled and time.monotonic() - self.last_line > 10:  # a log line when not on a terminal
            self.last_line = time.monotonic()
            print(f"[{time_of_day()}] fed {st.total} generated {st.completed}/{st.total} tokenized "
                  f"{stages.tokenized_shards}/{stages.shards} shards trained {t.step if t else 0} steps | "
                  + " ".join(f"{k}={v}" for k, v in services.items()), flush=True)


def time_of_day() -> str:
    """HH:MM:SS, for the run's display lines."""
    return time.strftime("%H:%M:%S")


async def _crash_loop_alert(bus: Bus, run: str, st: ServiceState) -> None:
    alert = Alert(run=run, stage="run", kind="crash_loop", worker=st.spec.name,
                  message=f"{st.spec.name} crash-looped ({len(st.crashes)} exits, last code {st.last_exit}); "
                          "not restarted", examples=[])
    await bus.publish(Subjects.alert(run, "run"), alert)


async def run_pipeline(cfg: Config, request: RunRequest, *, env: dict[str, str], show: bool = True,
                       poll_s: float = 2.0) -> int:
    store = await asyncio.to_thread(Store.open, cfg)
    logs = data_dir(cfg) / "runs" / cfg.run / "logs"
    async with await Bus.connect(cfg.bus, "dflash-run", deadline_s=30) as bus:
        await bus.ensure_streams()

        async def on_crash(st: ServiceState) -> None:
            await _crash_loop_alert(bus, cfg.run, st)

        request.extra_env.update(env)
        sup = Supervisor(service_specs(cfg, request), logs, on_crash_loop=on_crash, grace_s=cfg.generator.drain_s + 15)
        sup.start()
        if request.dashboard:
            print(f"dashboard: http://{cfg.dashboard.host}:{cfg.dashboard.port}/  (logs in {logs})", flush=True)
        generators = [n for n in sup.services if n.startswith("generator-")]
        phase = "generate"
        outcome = Exit.OK
        ledger = RunLedger(cfg, bus, store)  # each poll folds only the events since the last
        try:
            with Display(cfg, show) as display:
                while True:
                    p = await run_overview(cfg, bus, store, ledger)
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
                        sup.launch("trainer")
                        state = sup.state()["trainer"]
                        if state == "done":
                            break
                    await asyncio.sleep(poll_s)
        finally:
            if outcome or not request.dashboard:
                await sup.stop()
        if outcome:
            return outcome
        report = None
        if request.train:
            proc = await asyncio.create_subprocess_exec(*cli_argv("eval", "--run", cfg.run), env={**os.environ, **env})
            if await proc.wait() != 0:
                print("eval failed (see above)")
                outcome = Exit.EVAL_FAILED
            else:
                key = Keys.eval_report(cfg.run)
                if await asyncio.to_thread(store.exists, key):
                    report = msgspec.json.decode(await asyncio.to_thread(store.get_bytes, key))
        print_artifacts(cfg, store, report, await run_status(cfg, bus, store, ledger),
                        on_cpu=all(g is None for g in request.generators))
        await sup.stop()
        return outcome


def print_artifacts(cfg: Config, store: Store, report: dict | None, st: RunStatus, on_cpu: bool = False) -> None:
    run = cfg.run
    dead = sum(st.dead_lettered.values())
    print(f"\nrun {run}: {st.completed} of {st.total} prompts completed ({st.rejects} rejected at feed, {dead} dead "
          f"letters); {st.tokenized_samples} training samples kept of {st.tokenized_records} records")
    dropped = {r: n for r, n in st.dropped.items() if r != "duplicate"}
    if dropped:
        print("  dropped: " + ", ".join(f"{r} {n}" for r, n in dropped.items()) + f"  (listed by `dfpipe drops --run {run}`)")
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


# What the first eval a newcomer sees means (the demo: a 135M target on a 2-core CPU, a short training), from
# measurements on such a machine (bench/results/train_quality.json; README, "Status of this build").
EXPECTED_ON_A_SMALL_CPU = (
    "  what to expect on this CPU: τ (tokens per cycle, bonus included) is the drafter's quality. The demo\n"
    "  (350 prompts, 4 epochs of a two-layer DFlash 2 drafter) ends near τ 1.9 (measured alone on 2 cores:\n"
    "  τ 1.905 on 16 held-out prompts, speedup 0.90x, 19 minutes in all); 1,500 prompts and 30 minutes of\n"
    "  training reach τ 2.0 (bench/train_quality.py). The speedup stays below 1x (0.95x at τ 2.0): a 135M\n"
    "  target on a CPU is compute-bound, so a drafter pass plus a block-wide verify cost about what the\n"
    "  tokens they save would. Speculative decoding pays where the target is large and memory-bound (an 8B+\n"
    "  target on a GPU: the paper reports τ 6.49 and 4.86x for Qwen3-8B). τ carries over; the speedup is\n"
    "  this machine's.")
