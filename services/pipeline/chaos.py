"""`dfpipe chaos`: a real small run on its own embedded stack while faults are injected.

The run is the production one (feeder, N generators on the hf backend, tokenizer, trainer, each a
supervised process) on a tiny budget. While it runs, faults are injected in a shuffled order,
each kind at least once: kill -9 of a generator, of the tokenizer, of the trainer (after its
first checkpoint), a restart of nats-server, S3 stopped for a while. Afterwards the delivery
guarantees are checked from S3 and the bus alone:
- every accepted prompt has exactly one completion (or a dead letter), however often it was
  generated; every announced shard is in S3 and reads back with its checksum (no shard lost);
- the tokenized dataset holds each of those prompts exactly once (less the samples the
  tokenizer dropped with a reason), and every completion shard was tokenized;
- the trainer reached its last step, having resumed from a checkpoint after its kill.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from shared.bus import Bus
from shared.config import Config, load_config
from shared.ledger import RunLedger, generation_done, tokenization_done
from shared.messages import ShardWritten, TokenizedShard, TrainerProgress
from shared.records import dedupe_completions, read_completions, read_sample_generations
from shared.stack import EmbeddedStack, Ports
from shared.status import run_overview
from shared.store import Store
from shared.topology import ANY, Keys, Streams, Subjects

from .run import BUNDLED_PROMPTS, RunRequest, service_specs
from .supervisor import Supervisor

FAULTS = ("kill_generator", "kill_tokenizer", "kill_trainer", "restart_nats", "s3_down")


@dataclass
class ChaosSettings:
    prompts: int = 40
    generators: int = 2
    fault_every_s: float = 8.0
    max_faults: int = 8
    s3_down_s: float = 6.0
    train_steps: int = 24
    seed: int = 0
    timeout_s: float = 1200.0


@dataclass
class ChaosReport:
    run: str
    faults: list[tuple[float, str, str]] = field(default_factory=list)  # (t, kind, detail)
    restarts: dict[str, int] = field(default_factory=dict)
    figures: dict[str, Any] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    def format(self) -> str:
        lines = [f"chaos run {self.run}: {'PASSED' if self.ok else 'FAILED'}", "faults injected:"]
        lines += [f"  {t:6.1f}s  {kind:<15} {detail}" for t, kind, detail in self.faults]
        counts = Counter(kind for _, kind, _ in self.faults)
        lines.append("  totals: " + ", ".join(f"{k} {counts.get(k, 0)}" for k in FAULTS))
        lines.append("restarts: " + ", ".join(f"{k} {v}" for k, v in self.restarts.items()))
        lines.append("what survived:")
        lines += [f"  {k:<28} {v}" for k, v in self.figures.items()]
        lines += [f"FAILED: {f}" for f in self.failures]
        return "\n".join(lines)


def service_env(s: ChaosSettings) -> dict[str, str]:
    """A tiny budget for every stage; fast redelivery so a killed worker's prompts come back soon."""
    values = {
        "MODEL__DEVICE": "cpu",
        "BUS__RECONNECT_WAIT_S": 0.5,
        "STORE__RETRY_DEADLINE_S": 60,
        "SAMPLING__MAX_NEW_TOKENS": 24,
        "GENERATOR__BATCH_SIZE": 4, "GENERATOR__MAX_INFLIGHT": 4, "GENERATOR__SHARD_RECORDS": 4,
        "GENERATOR__SHARD_SECONDS": 3, "GENERATOR__ACK_WAIT_S": 20, "GENERATOR__DRAIN_S": 5,
        "GENERATOR__PROGRESS_EVERY_S": 1,
        "TOKENIZER__TRUNCATED_POLICY": "keep", "TOKENIZER__MIN_SUPERVISED_TOKENS": 2,
        "TRAINER__NUM_LAYERS": 1, "TRAINER__BLOCK_SIZE": 8, "TRAINER__ANCHORS_PER_SEQUENCE": 12,
        "TRAINER__MAX_STEPS": s.train_steps, "TRAINER__CHECKPOINT_EVERY": 4, "TRAINER__TOKEN_BUDGET": 300,
        "TRAINER__MAX_LENGTH": 160, "TRAINER__HOLDOUT_MOD": 10, "TRAINER__WAIT_FOR_DATA_S": 600,
    }
    return {f"DFLASH_{k}": str(v) for k, v in values.items()}


class Chaos:
    def __init__(self, root: Path, s: ChaosSettings) -> None:
        self.root, self.s = root, s
        self.rng = random.Random(s.seed)
        self.stack = EmbeddedStack(root / "stack", Ports.free())
        self.run = f"chaos{int(time.time()) % 100000}"
        self.report = ChaosReport(run=self.run)
        self.t0 = time.monotonic()

    def config(self, env: dict[str, str]) -> Config:
        return load_config(env={**env, "DFLASH_RUN": self.run})

    def prompts_file(self) -> Path:
        lines = BUNDLED_PROMPTS.read_text().splitlines()[: self.s.prompts]
        path = self.root / "prompts.jsonl"
        path.write_text("\n".join(lines) + "\n")
        return path

    def note(self, kind: str, detail: str) -> None:
        self.report.faults.append((time.monotonic() - self.t0, kind, detail))
        self.say(f"{kind}: {detail}")

    def say(self, text: str) -> None:
        print(f"[chaos {time.monotonic() - self.t0:6.1f}s] {text}", flush=True)

    # --- faults ------------------------------------------------------------------------------

    def _kill(self, sup: Supervisor, name: str) -> bool:
        st = sup.services.get(name)
        if st is None or st.pid is None or st.state != "running":
            return False
        try:
            os.killpg(st.pid, signal.SIGKILL)
        except ProcessLookupError:
            return False
        self.note(f"kill_{name.split('-')[0]}", f"kill -9 {name} (pid {st.pid})")
        return True

    async def inject(self, kind: str, sup: Supervisor, store: Store) -> bool:
        if kind == "kill_generator":
            names = [n for n in sup.services if n.startswith("generator-")]
            self.rng.shuffle(names)
            return any(self._kill(sup, n) for n in names)
        if kind == "kill_tokenizer":
            return self._kill(sup, "tokenizer")
        if kind == "kill_trainer":
            step = await asyncio.to_thread(checkpoint_step, store, self.run)
            if step is None or step >= self.s.train_steps:
                return False  # only a kill after a checkpoint shows a resume
            return self._kill(sup, "trainer")
        if kind == "restart_nats":
            await asyncio.to_thread(self.stack.stop_component, "nats")
            self.note(kind, "nats-server stopped")
            await asyncio.sleep(2.0)
            await asyncio.to_thread(self.stack.start_nats)
            await asyncio.to_thread(self.stack.wait_healthy, 60, s3=False)
            self.say("nats-server back (same store dir)")
            return True
        if kind == "s3_down":
            await asyncio.to_thread(self.stack.stop_component, "s3")
            self.note(kind, f"S3 stopped for {self.s.s3_down_s:.0f}s")
            await asyncio.sleep(self.s.s3_down_s)
            await asyncio.to_thread(self.stack.start_s3)
            await asyncio.to_thread(self.stack.wait_healthy, 60, nats=False)
            self.say("S3 back")
            return True
        raise ValueError(kind)

    # --- the run -----------------------------------------------------------------------------

    async def execute(self) -> ChaosReport:
        self.stack.start()
        try:
            env = {**os.environ, **self.stack.env(), "DFLASH_DATA_DIR": str(self.stack.root), **service_env(self.s)}
            env.pop("DFLASH_CONFIG", None)
            cfg = self.config(env)
            request = RunRequest(prompts=[str(self.prompts_file())], generators=[None] * self.s.generators,
                                 backend="hf", dashboard=False, extra_env=env)
            specs = service_specs(cfg, request)
            for spec in specs:
                spec.deferred = False  # the trainer runs alongside generation here, so it can be killed mid-run
            sup = Supervisor(specs, self.root / "logs", crash_limit=50, backoff_base_s=0.5, backoff_cap_s=4.0, grace_s=20)
            store = await asyncio.to_thread(Store.open, cfg)
            sup.start()
            try:
                await self._drive(cfg, sup, store)
            finally:
                await sup.stop()
                self.report.restarts = {n: max(0, st.starts - 1) for n, st in sup.services.items()}
            if self.stack.nats_healthy() and self.stack.s3_healthy():
                await self.verify(cfg, store)
        finally:
            self.stack.stop()
        return self.report

    async def _drive(self, cfg: Config, sup: Supervisor, store: Store) -> None:
        pending = list(FAULTS)
        self.rng.shuffle(pending)
        injected = 0
        next_fault = time.monotonic() + self.s.fault_every_s
        phase = "generate"
        deadline = self.t0 + self.s.timeout_s
        async with await Bus.connect(cfg.bus, "chaos", deadline_s=30) as bus:
            await bus.ensure_streams()
            ledger = RunLedger(cfg, bus, store)
            while True:
                if time.monotonic() > deadline:
                    self.report.failures.append(f"did not finish within {self.s.timeout_s:.0f}s (phase {phase})")
                    return
                looping = [n for n, st in sup.state().items() if st == "crash_loop"]
                if looping:
                    self.report.failures.append(f"crash loop: {', '.join(looping)}")
                    return
                # the trainer's kill is due the moment a checkpoint exists: its window (first checkpoint to the
                # last step) lasts seconds on a fast machine, shorter than the time between timed faults
                if "kill_trainer" in pending and await self.inject("kill_trainer", sup, store):
                    injected += 1
                    pending.remove("kill_trainer")
                if injected < self.s.max_faults and time.monotonic() >= next_fault:
                    kinds = [k for k in pending if k != "kill_trainer"] or list(FAULTS)
                    for kind in list(kinds):
                        if await self.inject(kind, sup, store):
                            injected += 1
                            if kind in pending:
                                pending.remove(kind)
                            break
                    next_fault = time.monotonic() + self.s.fault_every_s
                try:
                    p = await run_overview(cfg, bus, store, ledger)
                except Exception as e:
                    print(f"[chaos] status unavailable: {type(e).__name__}: {e}", flush=True)
                    await asyncio.sleep(2)
                    continue
                if phase == "generate" and generation_done(p.stages):
                    await asyncio.gather(*(sup.stop_service(n) for n in sup.services if n.startswith("generator-")))
                    phase = "tokenize"
                if phase == "tokenize" and tokenization_done(p.stages):
                    await sup.stop_service("tokenizer")
                    phase = "train"
                if phase == "train" and sup.state()["trainer"] == "done":
                    missing = [k for k in pending if k != "kill_trainer"]
                    if missing:
                        self.report.failures.append(f"run ended before these faults could be injected: {missing}")
                    return
                await asyncio.sleep(1.0)

    # --- the checks --------------------------------------------------------------------------

    async def verify(self, cfg: Config, store: Store) -> None:
        from shared.status import run_status

        f, fail = self.report.figures, self.report.failures
        async with await Bus.connect(cfg.bus, "chaos-verify", deadline_s=30) as bus:
            st = await run_status(cfg, bus, store)
            shards = [e async for _, e in bus.replay(Streams.SHARDS, Subjects.shards(self.run), 1, ShardWritten)]
            tokenized = [e async for _, e in bus.replay(Streams.TOKENIZED, Subjects.tokenized(self.run), 1, TokenizedShard)]
            trainer = await bus.latest_per_subject(Streams.PROGRESS, Subjects.progress(self.run, "train", ANY))
        dead_gen, dead_tok = st.dead_lettered.get("generate", 0), st.dead_lettered.get("tokenize", 0)
        f["prompts accepted"] = st.total
        f["completion shards"] = len({e.key for e in shards})
        loaded: list[tuple[str, list]] = []
        for key in sorted({e.key for e in shards}):
            try:
                loaded.append((key, read_completions(await asyncio.to_thread(store.get_bytes, key))))
            except Exception as e:
                fail.append(f"shard {key} announced but unreadable: {e}")
        unique = dedupe_completions(loaded)
        records = sum(len(r) for _, r in loaded)
        f["completion records"] = records
        f["duplicates (redelivered)"] = records - len(unique)
        f["prompts completed (unique)"] = len(unique)
        f["generate dead letters"] = dead_gen
        if len(unique) + dead_gen != st.total:
            fail.append(f"{st.total} accepted but {len(unique)} completed + {dead_gen} dead-lettered")
        fp = tokenized[-1].fingerprint if tokenized else ""
        newest = {e.key: e for e in tokenized if e.fingerprint == fp}
        covered = {e.source_key for e in newest.values()}
        untokenized = {e.key for e in shards} - covered
        f["tokenized shards"] = len(newest)
        f["tokenize dead letters"] = dead_tok
        if len(untokenized) > dead_tok:
            fail.append(f"{len(untokenized)} completion shards never tokenized: {sorted(untokenized)[:3]}")
        rows: list[tuple[str, int]] = []  # (prompt_id, generation): a regeneration may add a newer one
        for key in sorted(newest):
            rows += read_sample_generations(await asyncio.to_thread(store.get_bytes, key))
        ids = [pid for pid, _ in rows]
        dropped = Counter()
        for e in newest.values():
            dropped.update({k: v for k, v in e.dropped.items() if k != "duplicate"})
        f["tokenized samples"] = len(ids)
        f["tokenizer drops (reasons)"] = dict(dropped) or "none"
        if len(rows) != len(set(rows)):
            fail.append(f"tokenized dataset holds {len(rows) - len(set(rows))} prompts more than once")
        if not set(ids) <= set(unique):
            fail.append("tokenized dataset holds prompts that have no completion")
        if dead_tok == 0 and len(set(ids)) + sum(dropped.values()) != len(unique):
            fail.append(f"{len(unique)} completed prompts but {len(set(ids))} tokenized + {sum(dropped.values())} dropped")
        step = await asyncio.to_thread(checkpoint_step, store, self.run)
        f["trainer final step"] = f"{step} of {self.s.train_steps}"
        if step != self.s.train_steps:
            fail.append(f"trainer ended at checkpoint step {step}, not {self.s.train_steps}")
        # the count the trainer keeps in its checkpoints and progress: one more at each start from a checkpoint
        resumes = max((p.resumes for _, p in trainer if isinstance(p, TrainerProgress)), default=0)
        f["trainer resumes"] = resumes
        if any(kind == "kill_trainer" for _, kind, _ in self.report.faults) and not resumes:
            fail.append("the trainer was killed after a checkpoint but never resumed from one")


def checkpoint_step(store: Store, run: str) -> int | None:

    key = Keys.checkpoint_latest(run)
    return json.loads(store.get_bytes(key))["step"] if store.exists(key) else None


def run_chaos(s: ChaosSettings, root: Path | None = None) -> ChaosReport:
    with tempfile.TemporaryDirectory(prefix="dflash-chaos-") as tmp:
        base = Path(root or tmp)
        base.mkdir(parents=True, exist_ok=True)
        report = asyncio.run(Chaos(base, s).execute())
    return report


def report_json(report: ChaosReport) -> bytes:
    return msgspec.json.encode({"run": report.run, "ok": report.ok, "faults": report.faults,
                                "restarts": report.restarts, "figures": report.figures, "failures": report.failures})

