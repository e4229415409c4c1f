"""The training loop: wait for tokenized data over the bus, schedule the run, take optimizer steps,
publish progress, checkpoint on step and at the end, stop on request.

The parts it ties: `schedule` (packing, passes and epochs, the step schedule and the lr: pure), `step`
(one optimizer step, plain torch), `checkpoint` (S3, exact resume), `data` (the shard feed and the sample
index), `build` (the models). Whether the run's data is complete, so a pass counts as an epoch, is the
ledger's `data_complete`, asked by rank 0 and broadcast.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import msgspec
import numpy as np
import torch

from shared.bus import Bus, Lease, LeaseHeld, ProgressLoop
from shared.config import Config
from shared.failures import Failure, classify, describe
from shared.ledger import RunLedger, data_complete
from shared.messages import TrainerProgress
from shared.runconfig import record_run_config, settings_fingerprint
from shared.store import Store
from shared.topology import Keys, Subjects, lease_key

from .blocks import estimated_tau
from .build import autocast_dtype, build, draft_vocab_ids
from .checkpoint import load_latest_checkpoint, record_target, save_checkpoint
from .data import SampleIndex, SampleSet, ShardCache, ShardFeed, epoch_order, load_samples
from .dist import Dist
from .pace import Pace
from .schedule import Cursor, Packing, StepSchedule, warmup_steps
from .step import DrafterStep, Microbatch, StepResult

log = logging.getLogger("dflash.trainer")


class Trainer:
    """One rank of a run's training: rank 0 reads the bus and S3 and broadcasts what every rank must agree on
    (shard list, completeness, stop, clock); every rank takes the same steps on its share of the micro-batches."""

    def __init__(self, cfg: Config, bus: Bus, store: Store, *, worker: str = "trainer", device: str | None = None,
                 dist: Dist | None = None):
        self.cfg, self.bus, self.store, self.worker = cfg, bus, store, worker
        self.run = cfg.run
        self.dist = dist or Dist()
        dev = self.dist.device(device or cfg.model.device)
        self.device = dev
        self.target, self.drafter, self.tok = build(cfg, dev)
        t = cfg.trainer
        self.opt = torch.optim.AdamW(self.drafter.parameters(), lr=t.lr, weight_decay=t.weight_decay)
        self.drafter_step = DrafterStep(t, self.target, self.drafter, self.opt, dev, self.dist,
                                        autocast_dtype(t.autocast, torch.device(dev)),
                                        autocast_dtype(t.target_autocast, torch.device(dev)))
        self.packing = Packing(token_budget=t.token_budget, max_length=t.max_length,
                               micro_per_step=t.grad_accum * self.dist.world)  # every rank's micro-batches
        self.steps_done = 0  # optimizer steps taken in this run (a resume goes on from the checkpoint's)
        self.schedule = StepSchedule(total=0, warmup=1)  # made when the data is first there, or from a checkpoint
        self.cursor = Cursor()
        self.lr_scheduler: Any = None  # torch LambdaLR over `schedule`
        self.last = TrainerProgress(run=self.run, worker=worker, state="starting")
        self.resumes = 0  # times this run's training went on from a checkpoint, this start included
        self.samples_seen = 0
        self.train_s = 0.0  # time spent in training steps, over all processes of this run
        self.pace = Pace(cfg.view)  # steps/s and ETA for the progress reports, and the log's progress line
        self.feed: ShardFeed | None = None  # rank 0's durable consumer of the TOKENIZED log
        self.ledger = RunLedger(cfg, bus, store)  # rank 0's view of the run: each check folds only what is new
        # every shard indexed so far (per-sample numbers; tokens in the node's disk cache): only new shards are fetched
        self.index = SampleIndex(store, ShardCache.for_config(cfg))
        if self.dist.main:
            record_target(store, self.run, cfg.model.target)  # the target an exported drafter's card names
        self._lengths_of: tuple[np.ndarray | None, np.ndarray] = (None, np.zeros(0, dtype=np.int64))

    # --- data --------------------------------------------------------------------------------

    async def _shard_keys(self) -> list[str]:
        """The shard list, as rank 0's feed has it (ranks must agree on the data)."""
        keys = self.feed.keys() if self.feed else None
        return await asyncio.to_thread(self.dist.from_main, keys)

    async def _wait_for_keys(self) -> list[str]:
        """The first schedule's data: once there is data and the backlog of announcements has been taken."""
        end = time.monotonic() + self.cfg.trainer.wait_for_data_s
        while True:
            ready = bool(self.feed and self.feed.keys() and await self.feed.caught_up())
            if await asyncio.to_thread(self.dist.from_main, ready):
                return await self._shard_keys()
            if await asyncio.to_thread(self.dist.any, time.monotonic() > end):
                return await self._shard_keys()
            self.last = msgspec.structs.replace(self.last, state="waiting for data", ts=time.time())
            await asyncio.sleep(1)

    async def _complete(self) -> bool:
        """Rank 0's answer on every rank: is the run's data all there (the ledger's `data_complete`)? When it
        is, the feed has taken every announcement before the answer (so the keys read next are the whole data)."""
        complete = None
        if self.feed is not None:
            try:
                await self.ledger.refresh()  # retried through a failover (shared.bus reads)
                complete = data_complete(self.ledger.stages())
            except Exception as e:  # the stack unreadable for longer: not known complete yet, asked again next pass
                if classify(e) is not Failure.TRANSIENT:
                    raise
                log.warning("run state unreadable (%s): the data counts as not complete until it is read", describe(e))
                complete = False
            while complete and not await self.feed.caught_up():
                await asyncio.sleep(0.2)
        return await asyncio.to_thread(self.dist.from_main, complete)

    async def _next_pass(self, stop: asyncio.Event) -> tuple[list[str], bool]:
        """The next pass's shards, and whether they are the whole data. While generation or tokenization
        still runs, a pass is made only over new data (one with no new shard waits for one), and it is
        not counted as an epoch: the epochs are over all of the data. A run whose data stops growing for
        `wait_for_data_s` without being complete (its generators gone) is trained on as it is."""
        t = self.cfg.trainer
        since = time.monotonic()
        while True:
            complete = self.cursor.complete or await self._complete()  # once complete, it stays so
            keys = await self._shard_keys()
            if complete or t.max_steps or keys != self.cursor.keys:
                return keys, complete
            if await asyncio.to_thread(self.dist.any, time.monotonic() - since > t.wait_for_data_s):
                log.warning("no new shard for %.0fs and the run's data is not complete: the remaining %d epochs "
                            "are over the %d shards there are", t.wait_for_data_s, t.epochs - self.cursor.epochs_done,
                            len(keys))
                return keys, True
            if await asyncio.to_thread(self.dist.any, stop.is_set()):
                return keys, False
            if self.last.state != "waiting for data":
                log.info("the run's data is not complete and no shard is new since pass %d: waiting for one",
                         self.cursor.epoch - 1)
            self.last = msgspec.structs.replace(self.last, state="waiting for data", ts=time.time())
            await asyncio.sleep(2)

    def _samples(self, keys: list[str]) -> SampleSet:
        return load_samples(self.store, keys, holdout_mod=self.cfg.trainer.holdout_mod, train=True, index=self.index)

    def _lengths(self, samples: SampleSet, order: np.ndarray) -> np.ndarray:
        """Each position's trained length in this pass's order (made once per order, from the index alone)."""
        if self._lengths_of[0] is not order:
            self._lengths_of = (order, self.packing.lengths(samples.num_tokens, order))
        return self._lengths_of[1]

    def _next_microbatch(self, samples: SampleSet, order: np.ndarray) -> Microbatch:
        start = self.cursor.position
        self.cursor.position = self.packing.microbatch_end(self._lengths(samples, order), start)
        return [(pos, samples[int(order[pos])]) for pos in range(start, self.cursor.position)]

    # --- the step schedule -------------------------------------------------------------------

    def _uncounted_steps(self, samples: SampleSet, order: np.ndarray) -> int:
        """A pass over part of the data comes on top of the epochs: the schedule must not end inside it."""
        return 0 if self.cursor.complete else self.packing.pass_steps(self._lengths(samples, order))

    def _schedule(self, samples: SampleSet, order: np.ndarray) -> None:
        """The first schedule (its warmup is fixed from now on) and the lr scheduler."""
        t = self.cfg.trainer
        self.schedule = StepSchedule.first(
            max_steps=t.max_steps, epochs=t.epochs, per_epoch=self.packing.steps_per_epoch(samples.num_tokens),
            uncounted=0 if t.max_steps else self._uncounted_steps(samples, order), warmup_ratio=t.warmup_ratio)
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(self.opt, self.schedule.lr_lambda())

    def _stretch_schedule(self, samples: SampleSet, order: np.ndarray) -> None:
        """At a pass boundary: the steps left become the remaining epochs over all the data there is (more
        data, or a pass over part of it that did not count, which is scheduled on top), and the cosine
        stretches to the new total (a fixed max_steps is kept)."""
        t = self.cfg.trainer
        if t.max_steps:
            return
        before = self.schedule.total
        if self.schedule.stretch(step=self.steps_done, epochs_left=t.epochs - self.cursor.epochs_done,
                                 per_epoch=self.packing.steps_per_epoch(samples.num_tokens),
                                 uncounted=self._uncounted_steps(samples, order)):
            log.info("%d samples from epoch %d: total steps %d → %d", len(samples), self.cursor.epoch,
                     before, self.schedule.total)
            self.lr_scheduler.lr_lambdas = [self.schedule.lr_lambda()]  # a resume rebuilds it from the saved schedule

    # --- checkpoints -------------------------------------------------------------------------

    def _write_checkpoint(self) -> str:
        if not self.dist.main:
            return Keys.checkpoint(self.run, self.steps_done)
        state = {"optimizer": self.opt.state_dict(), "scheduler": self.lr_scheduler.state_dict(), "step": self.steps_done,
                 "total_steps": self.schedule.total, "warmup_steps": self.schedule.warmup, "cursor": self.cursor.__dict__,
                 "samples_seen": self.samples_seen, "train_s": self.train_s,
                 "progress": msgspec.to_builtins(self.last), "torch_rng": torch.get_rng_state(),
                 "run_config": Keys.run_config(self.run), "run_settings": settings_fingerprint(self.cfg)}
        return save_checkpoint(self.store, self.run, self.steps_done, self.drafter, state)

    def load_latest(self) -> bool:
        found = load_latest_checkpoint(self.store, self.run, self.drafter, self.cfg.trainer.arch)
        if found is None:
            return False
        prefix, state = found
        self.steps_done, total = state["step"], state["total_steps"]
        self.schedule = StepSchedule(total=total, warmup=state.get("warmup_steps")
                                     or warmup_steps(total, self.cfg.trainer.warmup_ratio))
        # The scheduler first (its constructor rewrites the groups' lr), then the optimizer's saved
        # state (the lr the next step must use), then the scheduler's position.
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(self.opt, self.schedule.lr_lambda())
        self.opt.load_state_dict(state["optimizer"])
        self.lr_scheduler.load_state_dict(state["scheduler"])
        self.cursor = Cursor(**state["cursor"])
        self.samples_seen = state.get("samples_seen", 0)
        self.train_s = state.get("train_s", 0.0)
        torch.set_rng_state(state["torch_rng"])
        saved = msgspec.convert(state.get("progress", {"run": self.run, "worker": self.worker}), TrainerProgress)
        self.resumes = saved.resumes + 1
        # what the run had reached, not a blank "starting" (step 0, loss 0); the heartbeat publishes it at once
        self.last = msgspec.structs.replace(saved, worker=self.worker, step=self.steps_done, total_steps=self.schedule.total,
                                            checkpoint_key=prefix, state="resumed", resumes=self.resumes, ts=time.time())
        log.info("resumed from %s (step %d of %d)", prefix, self.steps_done, self.schedule.total)
        return True

    async def checkpoint(self) -> str:
        """Save, then ack the announcements the saved shard table covers (write-then-ack)."""
        snap, waiting = self.feed.snapshot() if self.feed else (self.cursor.shards, [])
        self.cursor.shards = snap
        key = await asyncio.to_thread(self._write_checkpoint)
        ShardFeed.checkpointed(waiting)
        return key

    # --- the loop ----------------------------------------------------------------------------

    def out_of_time(self) -> bool:
        budget = self.cfg.trainer.max_train_s
        return budget > 0 and self.train_s >= budget

    def take_step(self, samples: SampleSet, order: np.ndarray) -> StepResult | None:
        """One optimizer step over the next micro-batches of this pass (None: the pass is over)."""
        t = self.cfg.trainer
        micro = []
        for _ in range(self.packing.micro_per_step):  # rank r takes micro-batches r, r+world, ...
            mb = self._next_microbatch(samples, order)
            if not mb:
                break
            micro.append(mb)
        if not micro:
            return None
        out = self.drafter_step(micro, self.steps_done)
        self.lr_scheduler.step()
        self.steps_done += 1
        self.train_s += self.dist.from_main(out.elapsed_s)  # rank 0's clock, so every rank agrees on the budget
        if t.max_train_s > 0:  # the schedule runs on whichever of steps and time is further along
            factor = self.schedule.lr_factor_with_time(self.steps_done, self.train_s, t.max_train_s)
            for group in self.opt.param_groups:
                group["lr"] = t.lr * factor
        return out

    # --- the loop, as named steps ------------------------------------------------------------

    async def _stopping(self, stop: asyncio.Event) -> bool:
        """A stop asked on any rank stops every rank at the same step."""
        return await asyncio.to_thread(self.dist.any, stop.is_set())

    async def _first_data(self) -> SampleSet:
        """A fresh run: wait for the first tokenized shards, then make the schedule (and the draft vocabulary)
        from them."""
        t = self.cfg.trainer
        keys = await self._wait_for_keys()
        complete = await self._complete()
        if complete:  # the announcements that completed the data since the keys were taken
            keys = await self._shard_keys()
        if not keys:
            raise RuntimeError(f"no tokenized shards for run {self.run} after {t.wait_for_data_s:.0f}s")
        samples = await asyncio.to_thread(self._samples, keys)
        if not samples:
            raise RuntimeError(f"run {self.run}: tokenized shards hold no trainable sample")
        self.cursor = Cursor(epoch=0, position=0, keys=keys, shards=self.cursor.shards, complete=complete)
        if not complete:
            log.info("the run's data is still growing: passes over it count as epochs once it is complete")
        self._schedule(samples, epoch_order(len(samples), t.seed, 0))
        if t.draft_vocab:  # from the data at the start, the same on every rank; kept in checkpoints
            self.drafter.set_draft_vocab(draft_vocab_ids(samples, t.draft_vocab, self.drafter.config.vocab_size))
            log.info("draft vocabulary: %d ids", t.draft_vocab)
        return samples

    async def _resumed_data(self) -> SampleSet:
        """A resume: the samples of the pass the checkpoint was in (its cursor holds the pass's shards)."""
        return await asyncio.to_thread(self._samples, self.cursor.keys)

    def _epochs_done(self) -> bool:
        t = self.cfg.trainer
        return not t.max_steps and self.cursor.epochs_done >= t.epochs

    async def _pass_boundary(self, stop: asyncio.Event, samples: SampleSet) -> tuple[SampleSet, np.ndarray] | None:
        """The pass is over: end it, take the shards tokenized since, begin the next pass (stretching the
        schedule over what is new). None: no next pass (the epochs are done, or a stop came while waiting)."""
        t = self.cfg.trainer
        uncounted = self.cursor.end_pass()  # True: the pass just made was over part of the data
        if self._epochs_done():
            return None
        keys, complete = await self._next_pass(stop)  # shards tokenized since join this pass
        if await self._stopping(stop):
            self.cursor.undo_end_pass(uncounted)  # nothing of the next pass was made
            return None
        grown = keys != self.cursor.keys
        if grown:
            samples = await asyncio.to_thread(self._samples, keys)
        if not complete:
            log.info("pass %d over %d samples: the run's data is still growing, not counted as an epoch",
                     self.cursor.epoch, len(samples))
        self.cursor.begin_pass(keys, complete)
        order = epoch_order(len(samples), t.seed, self.cursor.epoch)
        if grown or uncounted or not complete:
            self._stretch_schedule(samples, order)
        return samples, order

    def _progress(self, out: StepResult, checkpoint_key: str | None) -> TrainerProgress:
        """The progress message after a step (and, every `view.log_every_s`, the log's progress line)."""
        t = self.cfg.trainer
        budget_left_s = t.max_train_s - self.train_s if t.max_train_s > 0 else None
        steps_per_s, eta_s = self.pace.observe(self.steps_done, self.schedule.total, budget_left_s)
        total = self.schedule.total
        if budget_left_s is not None and steps_per_s > 0:  # the time budget binds: the steps it will end at
            total = min(total, self.steps_done + round(steps_per_s * max(0.0, budget_left_s)))
        progress = TrainerProgress(
            run=self.run, worker=self.worker, step=self.steps_done, total_steps=total,
            epoch=self.cursor.epoch, loss=out.loss,
            lr=self.opt.param_groups[0]["lr"], position_accuracy=[round(a, 4) for a in out.acc],
            estimated_tau=round(estimated_tau(out.acc), 4), tokens_per_s=round(out.tokens_per_s, 1),
            target_forward_share=round(out.target_share, 4), samples_seen=self.samples_seen,
            checkpoint_key=checkpoint_key, state="running", resumes=self.resumes,
            steps_per_s=round(steps_per_s, 4), eta_s=None if eta_s is None else round(eta_s, 1),
        )
        if self.dist.main:
            self.pace.maybe_log(progress)
        return progress

    async def _checkpoint_if_due(self, checkpoint_key: str | None) -> str | None:
        """Every `checkpoint_every` steps and at the last one; returns the newest checkpoint's key."""
        if self.steps_done % self.cfg.trainer.checkpoint_every == 0 or self.steps_done >= self.schedule.total:
            checkpoint_key = await self.checkpoint()  # holds this step's progress, for a resume's display
            self.last = msgspec.structs.replace(self.last, checkpoint_key=checkpoint_key)
        return checkpoint_key

    async def _final_checkpoint(self, checkpoint_key: str | None) -> str | None:
        """On the way out: a checkpoint of the last step taken, unless there is one already."""
        if self.steps_done and (checkpoint_key is None or not checkpoint_key.endswith(f"{self.steps_done:08d}/")):
            checkpoint_key = await self.checkpoint()
        return checkpoint_key

    def _finished(self) -> bool:
        return bool(self._ended_by())

    def _ended_by(self) -> str:
        """Which budget ended the training ("": none yet): the report says it, so a τ is read with it."""
        if self.out_of_time():
            return "time"
        if self._epochs_done():
            return "epochs"
        return "steps" if self.steps_done >= self.schedule.total else ""

    async def run_until(self, stop: asyncio.Event) -> TrainerProgress:
        """First data (or a resume), then until the schedule, the epochs or the time budget end, or a stop:
        pass boundary, step, progress, checkpoint; then a final checkpoint."""
        t = self.cfg.trainer
        if self.dist.main:  # a run trained without `dfpipe run` or a feed records its settings here
            await asyncio.to_thread(record_run_config, self.store, self.cfg)
        resumed = await asyncio.to_thread(self.load_latest)
        subject = Subjects.progress(self.run, "train", self.worker)
        # a resume starts at a saved checkpoint: one that is already at the last step saves nothing again
        checkpoint_key: str | None = Keys.checkpoint(self.run, self.steps_done) if resumed else None
        heartbeat = ProgressLoop(self.bus, subject, lambda: self.last, 10.0) if self.dist.main else contextlib.nullcontext()
        self.feed = ShardFeed(self.bus, self.run, self.cursor.shards, self.index) if self.dist.main else None
        async with heartbeat, self.feed or contextlib.nullcontext():
            samples = await (self._resumed_data() if resumed else self._first_data())
            order = epoch_order(len(samples), t.seed, self.cursor.epoch)
            while self.steps_done < self.schedule.total and not self.out_of_time() and not await self._stopping(stop):
                if self.cursor.position >= len(order):
                    next_pass = await self._pass_boundary(stop, samples)
                    if next_pass is None:
                        break
                    samples, order = next_pass
                out = await asyncio.to_thread(self.take_step, samples, order)
                if out is None:
                    continue
                self.samples_seen += out.samples
                self.last = self._progress(out, checkpoint_key)
                checkpoint_key = await self._checkpoint_if_due(checkpoint_key)
                if self.steps_done % t.progress_every == 0 and self.dist.main:
                    await self.bus.publish(subject, self.last)
            checkpoint_key = await self._final_checkpoint(checkpoint_key)
            self.last = msgspec.structs.replace(self.last, checkpoint_key=checkpoint_key,
                                                state="done" if self._finished() else "stopped",
                                                ended_by=self._ended_by(), ts=time.time())
        return self.last


async def run_trainer(cfg: Config, *, stop: asyncio.Event | None = None) -> TrainerProgress:
    """The trainer until done or SIGTERM/SIGINT (or `stop`), through the service skeleton with a main loop of its
    own: building the target and the drafter is its startup (a stop signal cancels it); the ranks close last."""
    from shared.service import Context, Service, serve, startup_thread

    torch.manual_seed(cfg.trainer.seed)  # the same initial drafter on every rank
    ranks = Dist.from_env(cfg.model.device)

    lease: list[Lease] = []  # rank 0's hold on the run's training, from before the model load to the end

    async def on_startup(ctx: Context) -> Trainer:
        holder = None
        if ranks.main:
            try:
                lease.append(await Lease.acquire(ctx.bus, lease_key(cfg.run, "trainer"), cfg.trainer.lease_ttl_s,
                                                 f"trainer of run {cfg.run}"))
            except LeaseHeld as e:
                holder = e
        if held := await asyncio.to_thread(ranks.from_main, holder):  # every rank refuses together
            raise held
        if lease:  # a lease that lapsed and was taken: stop at once, as on a signal (the other trainer goes on)
            lease[0].lost_stops(ctx.stop)
        return await startup_thread(lambda: Trainer(cfg, ctx.bus, ctx.store, dist=ranks))

    async def release(_: Trainer | None = None) -> None:  # while the bus is open (on_stop); else it lapses by TTL
        while lease:
            await lease.pop().release()

    async def on_shutdown(_: Trainer | None) -> None:
        await release()
        ranks.close()

    trainer = await serve(Service(name=f"trainer-{ranks.rank}", on_startup=on_startup, main=Trainer.run_until,
                                  on_stop=release, on_shutdown=on_shutdown, connect_deadline_s=60), cfg, stop=stop)
    return trainer.last if trainer is not None else TrainerProgress(run=cfg.run, worker="trainer", state="stopped")
