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

`--cluster` runs the same on a 3-node NATS cluster with R3 streams and a multi-process SeaweedFS
(shared.cluster): the faults are then also SIGKILLs of the stream leader of PROMPTS and of SHARDS and of the
meta leader (each node restarted `node_down_s` later), a node frozen (SIGSTOP) longer than a failover, and a
volume server killed while shards and checkpoints are written; at most one node is down at a time (what R3
survives). Each generator connects to a different cluster member, the tokenizer and the trainer to others.
The driver's poll is `dfpipe run`'s (the ledger, under the failure policy): the report counts the polls that
failed even after their retries, and the longest stretch the stack could not be read.
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
from functools import partial
from pathlib import Path
from typing import Any

import msgspec

from shared.bus import Bus
from shared.cluster import NATS_NODES, VOLUMES, ClusterStack
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
CLUSTER_FAULTS = ("kill_generator", "kill_tokenizer", "kill_trainer", "kill_prompts_leader", "kill_shards_leader",
                  "kill_meta_leader", "freeze_node", "kill_volume")
NODE_FAULTS = ("kill_prompts_leader", "kill_shards_leader", "kill_meta_leader", "freeze_node", "kill_volume")


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
    cluster: bool = False  # 3 NATS nodes (R3) and a multi-process SeaweedFS, with node faults
    backend: str = "hf"
    node_down_s: float = 5.0  # a killed node or volume server is restarted this long after
    freeze_s: float = 10.0  # SIGSTOP this long: longer than a failover, shorter than a reader's deadline

    @property
    def faults(self) -> tuple[str, ...]:
        return CLUSTER_FAULTS if self.cluster else FAULTS


@dataclass
class ChaosReport:
    run: str
    faults: list[tuple[float, str, str]] = field(default_factory=list)  # (t, kind, detail)
    restarts: dict[str, int] = field(default_factory=dict)
    figures: dict[str, Any] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    kinds: tuple[str, ...] = FAULTS

    @property
    def ok(self) -> bool:
        return not self.failures

    def format(self) -> str:
        lines = [f"chaos run {self.run}: {'PASSED' if self.ok else 'FAILED'}", "faults injected:"]
        lines += [f"  {t:6.1f}s  {kind:<15} {detail}" for t, kind, detail in self.faults]
        counts = Counter(kind for _, kind, _ in self.faults)
        lines.append("  totals: " + ", ".join(f"{k} {counts.get(k, 0)}" for k in self.kinds))
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
    if s.backend == "synthetic":  # it answers at once: paced so that generation outlasts the fault plan
        values["GENERATOR__SYNTHETIC_RATE"] = round(s.prompts / (s.generators * 1.2 * fault_plan_s(s)), 4)
    return {f"DFLASH_{k}": str(v) for k, v in values.items()}


def fault_plan_s(s: ChaosSettings) -> float:
    """About how long injecting every timed fault takes: each waits `fault_every_s` after the one before, and a
    node fault admits no other until its node is back (down or frozen, then a few seconds to rejoin)."""
    timed = [k for k in s.faults if k != "kill_trainer"][: s.max_faults]
    down = {k: (s.freeze_s if k == "freeze_node" else s.node_down_s) + 5.0 for k in NODE_FAULTS}
    return sum(max(s.fault_every_s, down.get(k, 0.0)) for k in timed) + s.fault_every_s


class Chaos:
    def __init__(self, root: Path, s: ChaosSettings) -> None:
        self.root, self.s = root, s
        self.rng = random.Random(s.seed)
        self.stack: EmbeddedStack | ClusterStack = (ClusterStack(root / "stack") if s.cluster
                                                    else EmbeddedStack(root / "stack", Ports.free()))
        self.run = f"chaos{int(time.time()) % 100000}"
        self.report = ChaosReport(run=self.run, kinds=s.faults)
        self.t0 = time.monotonic()
        self._node_fault: asyncio.Task[None] | None = None  # a node down or frozen now: one at a time
        self.polls = self.polls_failed = 0
        self._unreadable_since: float | None = None
        self.longest_unreadable_s = 0.0

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
        if kind in NODE_FAULTS:
            return await self._node(kind)
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

    async def _node(self, kind: str) -> bool:
        """A cluster fault, restored in the background (the driver keeps polling through it)."""
        stack = self.stack
        assert isinstance(stack, ClusterStack)
        if self._node_fault is not None and not self._node_fault.done():
            return False  # R3 survives one node down, not two
        if kind == "kill_volume":
            name = self.rng.choice(VOLUMES)
            detail = f"volume server {name} SIGKILLed for {self.s.node_down_s:.0f}s while shards/checkpoints are written"
        elif kind == "freeze_node":
            name = self.rng.choice(NATS_NODES)
            detail = f"NATS node {name} SIGSTOPped for {self.s.freeze_s:.0f}s, then SIGCONT"
        else:
            name = await asyncio.to_thread(stack.meta_leader if kind == "kill_meta_leader" else
                                           partial(stack.stream_leader, kind.split("_")[1].upper()))
            if not name:
                return False  # between elections: try again at the next fault
            what = "meta leader" if kind == "kill_meta_leader" else f"{kind.split('_')[1].upper()} stream leader"
            detail = f"NATS node {name} ({what}) SIGKILLed for {self.s.node_down_s:.0f}s"
        await asyncio.to_thread(stack.freeze if kind == "freeze_node" else stack.kill, name)
        self.note(kind, detail)

        async def restore() -> None:
            await asyncio.sleep(self.s.freeze_s if kind == "freeze_node" else self.s.node_down_s)
            if kind == "freeze_node":
                stack.thaw(name)
            else:
                await asyncio.to_thread(stack.restart, name, 90)
            self.say(f"{name} back")

        self._node_fault = asyncio.create_task(restore())
        return True

    def _polled(self, ok: bool) -> None:
        self.polls += 1
        now = time.monotonic()
        if ok:
            self._unreadable_since = None
            return
        self.polls_failed += 1
        self._unreadable_since = self._unreadable_since or now
        self.longest_unreadable_s = max(self.longest_unreadable_s, now - self._unreadable_since)

    def service_members(self, specs: list[Any]) -> None:
        """Each generator on its own cluster member, the tokenizer and trainer on others (clients discover
        the rest of the cluster from the member they reach)."""
        stack = self.stack
        if not isinstance(stack, ClusterStack):
            return
        for i, spec in enumerate(s for s in specs if s.name.startswith(("generator-", "tokenizer", "trainer"))):
            spec.env["DFLASH_NATS_URL"] = stack.member_url(NATS_NODES[i % len(NATS_NODES)])

    # --- the run -----------------------------------------------------------------------------

    async def execute(self) -> ChaosReport:
        self.stack.start()
        try:
            env = {**os.environ, **self.stack.env(), "DFLASH_DATA_DIR": str(self.stack.root), **service_env(self.s)}
            env.pop("DFLASH_CONFIG", None)
            cfg = self.config(env)
            request = RunRequest(prompts=[str(self.prompts_file())], generators=[None] * self.s.generators,
                                 backend=self.s.backend, dashboard=False, extra_env=env)
            specs = service_specs(cfg, request)
            self.service_members(specs)
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
                if self._node_fault is not None:
                    await self._node_fault
            if self.s.cluster:
                self.report.figures["state polls failed after retries"] = f"{self.polls_failed} of {self.polls}"
                self.report.figures["longest unreadable (s)"] = round(self.longest_unreadable_s, 1)
            if self.stack.nats_healthy() and self.stack.s3_healthy():
                await self.verify(cfg, store)
        finally:
            self.stack.stop()
        return self.report

    async def _drive(self, cfg: Config, sup: Supervisor, store: Store) -> None:
        pending = list(self.s.faults)
        self.rng.shuffle(pending)
        # a worker's kill needs its stage still running, a node's or S3's fault can come at any time: the
        # worker kills first (a fast generation ended before its kill once the node faults took their turns)
        pending.sort(key=lambda kind: kind not in ("kill_generator", "kill_tokenizer"))
        # The trainer's kill is due the moment a checkpoint exists: its window (first checkpoint to the last step)
        # lasts seconds on a fast machine, shorter than the time between timed faults and shorter than a status
        # poll riding through a node fault, so its own watcher looks every half second.
        trainer_killed = asyncio.create_task(self._kill_trainer_when_due(sup, store) if "kill_trainer" in pending
                                             else asyncio.sleep(0))
        try:
            await self._drive_loop(cfg, sup, store, pending, trainer_killed)
        finally:
            trainer_killed.cancel()

    async def _kill_trainer_when_due(self, sup: Supervisor, store: Store) -> None:
        while not await self.inject("kill_trainer", sup, store):
            await asyncio.sleep(0.5)

    async def _drive_loop(self, cfg: Config, sup: Supervisor, store: Store, pending: list[str],
                          trainer_killed: asyncio.Task) -> None:
        """Timed faults in `pending`'s order while the run's phases move on, until the trainer is done."""
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
                if trainer_killed.done() and "kill_trainer" in pending:
                    injected += 1
                    pending.remove("kill_trainer")
                if injected < self.s.max_faults and time.monotonic() >= next_fault:
                    kinds = [k for k in pending if k != "kill_trainer"] or list(self.s.faults)
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
                    self._polled(False)
                    print(f"[chaos] status unavailable: {type(e).__name__}: {e}", flush=True)
                    await asyncio.sleep(2)
                    continue
                self._polled(True)
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
            shards = [e async for _, e in bus.read_log(Streams.SHARDS, Subjects.shards(self.run), 1, ShardWritten)]
            tokenized = [e async for _, e in bus.read_log(Streams.TOKENIZED, Subjects.tokenized(self.run), 1, TokenizedShard)]
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

