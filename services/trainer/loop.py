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

from shared.bus import Bus, ProgressLoop
from shared.config import Config
from shared.ledger import RunLedger, data_complete
from shared.messages import TrainerProgress
from shared.store import Store
from shared.topology import Keys, Subjects

from .blocks import estimated_tau
from .build import autocast_dtype, build, draft_vocab_ids
from .checkpoint import load_latest_checkpoint, record_target, save_checkpoint
from .data import SampleIndex, SampleSet, ShardCache, ShardFeed, epoch_order, load_samples
from .dist import Dist
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
        self.optimizer_step = DrafterStep(t, self.target, self.drafter, self.opt, dev, self.dist,
                                          autocast_dtype(t.autocast, torch.device(dev)),
                                          autocast_dtype(t.target_autocast, torch.device(dev)))
        self.packing = Packing(token_budget=t.token_budget, max_length=t.max_length,
                               micro_per_step=t.grad_accum * self.dist.world)  # every rank's micro-batches
        self.step = 0
        self.schedule = StepSchedule(total=0, warmup=1)  # made when the data is first there, or from a checkpoint
        self.cursor = Cursor()
        self.sched: Any = None
        self.last = TrainerProgress(run=self.run, worker=worker, state="starting")
        self.resumes = 0  # times this run's training went on from a checkpoint, this start included
        self.samples_seen = 0
        self.train_s = 0.0  # time spent in training steps, over all processes of this run
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
            await self.ledger.refresh()
            complete = data_complete(self.ledger.stages())
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
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, self.schedule.lr_lambda())

    def _stretch_schedule(self, samples: SampleSet, order: np.ndarray) -> None:
        """At a pass boundary: the steps left become the remaining epochs over all the data there is (more
        data, or a pass over part of it that did not count, which is scheduled on top), and the cosine
        stretches to the new total (a fixed max_steps is kept)."""
        t = self.cfg.trainer
        if t.max_steps:
            return
        before = self.schedule.total
        if self.schedule.stretch(step=self.step, epochs_left=t.epochs - self.cursor.epochs_done,
                                 per_epoch=self.packing.steps_per_epoch(samples.num_tokens),
                                 uncounted=self._uncounted_steps(samples, order)):
            log.info("%d samples from epoch %d: total steps %d → %d", len(samples), self.cursor.epoch,
                     before, self.schedule.total)
            self.sched.lr_lambdas = [self.schedule.lr_lambda()]  # a resume rebuilds it from the saved schedule

    # --- checkpoints -------------------------------------------------------------------------

    def save_checkpoint(self) -> str:
        if not self.dist.main:
            return Keys.checkpoint(self.run, self.step)
        state = {"optimizer": self.opt.state_dict(), "scheduler": self.sched.state_dict(), "step": self.step,
                 "total_steps": self.schedule.total, "warmup_steps": self.schedule.warmup, "cursor": self.cursor.__dict__,
                 "samples_seen": self.samples_seen, "train_s": self.train_s,
                 "progress": msgspec.to_builtins(self.last), "torch_rng": torch.get_rng_state()}
        return save_checkpoint(self.store, self.run, self.step, self.drafter, state)

    def load_latest(self) -> bool:
        found = load_latest_checkpoint(self.store, self.run, self.drafter, self.cfg.trainer.arch)
        if found is None:
            return False
        prefix, state = found
        self.step, total = state["step"], state["total_steps"]
        self.schedule = StepSchedule(total=total, warmup=state.get("warmup_steps")
                                     or warmup_steps(total, self.cfg.trainer.warmup_ratio))
        # The scheduler first (its constructor rewrites the groups' lr), then the optimizer's saved
        # state (the lr the next step must use), then the scheduler's position.
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, self.schedule.lr_lambda())
        self.opt.load_state_dict(state["optimizer"])
        self.sched.load_state_dict(state["scheduler"])
        self.cursor = Cursor(**state["cursor"])
        self.samples_seen = state.get("samples_seen", 0)
        self.train_s = state.get("train_s", 0.0)
        torch.set_rng_state(state["torch_rng"])
        saved = msgspec.convert(state.get("progress", {"run": self.run, "worker": self.worker}), TrainerProgress)
        self.resumes = saved.resumes + 1
        # what the run had reached, not a blank "starting" (step 0, loss 0); the heartbeat publishes it at once
        self.last = msgspec.structs.replace(saved, worker=self.worker, step=self.step, total_steps=self.schedule.total,
                                            checkpoint_key=prefix, state="resumed", resumes=self.resumes, ts=time.time())
        log.info("resumed from %s (step %d of %d)", prefix, self.step, self.schedule.total)
        return True

    async def checkpoint(self) -> str:
        """Save, then ack the announcements the saved shard table covers (write-then-ack)."""
        snap, waiting = self.feed.snapshot() if self.feed else (self.cursor.shards, [])
        self.cursor.shards = snap
        key = await asyncio.to_thread(self.save_checkpoint)
        ShardFeed.checkpointed(waiting)
        return key

    # --- the loop ----------------------------------------------------------------------------

    def out_of_time(self) -> bool:
        budget = self.cfg.trainer.max_train_s
        return budget > 0 and self.train_s >= budget

    def train_step(self, samples: SampleSet, order: np.ndarray) -> StepResult | None:
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
        out = self.optimizer_step(micro, self.step)
        self.sched.step()
        self.step += 1
        self.train_s += self.dist.from_main(out.elapsed_s)  # rank 0's clock, so every rank agrees on the budget
        if t.max_train_s > 0:  # the schedule runs on whichever of steps and time is further along
            factor = self.schedule.lr_factor_with_time(self.step, self.train_s, t.max_train_s)
            for group in self.opt.param_groups:
                group["lr"] = t.lr * factor
        return out

    async def run_until(self, stop: asyncio.Event) -> TrainerProgress:
        t = self.cfg.trainer
        resumed = await asyncio.to_thread(self.load_latest)
        subject = Subjects.progress(self.run, "train", self.worker)
        samples: SampleSet | None = None
        # a resume starts at a saved checkpoint: one that is already at the last step saves nothing again
        checkpoint_key: str | None = Keys.checkpoint(self.run, self.step) if resumed else None
        heartbeat = ProgressLoop(self.bus, subject, lambda: self.last, 10.0) if self.dist.main else contextlib.nullcontext()
        self.feed = ShardFeed(self.bus, self.run, self.cursor.shards, self.index) if self.dist.main else None
        async with heartbeat, self.feed or contextlib.nullcontext():
            if resumed:
                samples = await asyncio.to_thread(self._samples, self.cursor.keys)
            else:
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
            order = epoch_order(len(samples), t.seed, self.cursor.epoch)
            while self.step < self.schedule.total and not self.out_of_time() and \
                    not await asyncio.to_thread(self.dist.any, stop.is_set()):
                if self.cursor.position >= len(order):
                    uncounted = self.cursor.end_pass()  # True: the pass just made was over part of the data
                    if not t.max_steps and self.cursor.epochs_done >= t.epochs:
                        break
                    keys, complete = await self._next_pass(stop)  # shards tokenized since join this pass
                    if await asyncio.to_thread(self.dist.any, stop.is_set()):
                        self.cursor.undo_end_pass(uncounted)  # nothing of the next pass was made
                        break
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
                out = await asyncio.to_thread(self.train_step, samples, order)
                if out is None:
                    continue
                self.samples_seen += out.samples
                self.last = TrainerProgress(
                    run=self.run, worker=self.worker, step=self.step, total_steps=self.schedule.total,
                    epoch=self.cursor.epoch, loss=out.loss,
                    lr=self.opt.param_groups[0]["lr"], position_accuracy=[round(a, 4) for a in out.acc],
                    estimated_tau=round(estimated_tau(out.acc), 4), tokens_per_s=round(out.tokens_per_s, 1),
                    target_forward_share=round(out.target_share, 4), samples_seen=self.samples_seen,
                    checkpoint_key=checkpoint_key, state="running", resumes=self.resumes,
                )
                if self.step % t.checkpoint_every == 0 or self.step >= self.schedule.total:
                    checkpoint_key = await self.checkpoint()  # holds this step's progress, for a resume's display
                    self.last = msgspec.structs.replace(self.last, checkpoint_key=checkpoint_key)
                if self.step % t.progress_every == 0 and self.dist.main:
                    await self.bus.publish(subject, self.last)
            if self.step and (checkpoint_key is None or not checkpoint_key.endswith(f"{self.step:08d}/")):
                checkpoint_key = await self.checkpoint()
            done = self.step >= self.schedule.total or (not t.max_steps and self.cursor.epochs_done >= t.epochs) \
                or self.out_of_time()
            self.last = msgspec.structs.replace(self.last, checkpoint_key=checkpoint_key,
                                                state="done" if done else "stopped", ts=time.time())
        return self.last


async def run_trainer(cfg: Config, *, stop: asyncio.Event | None = None) -> TrainerProgress:
    """The trainer until done or SIGTERM/SIGINT (or `stop`), through the service skeleton with a main loop of its
    own: building the target and the drafter is its startup (a stop signal cancels it); the ranks close last."""
    from shared.service import Context, Service, serve, startup_thread

    torch.manual_seed(cfg.trainer.seed)  # the same initial drafter on every rank
    ranks = Dist.from_env(cfg.model.device)

    async def on_startup(ctx: Context) -> Trainer:
        return await startup_thread(lambda: Trainer(cfg, ctx.bus, ctx.store, dist=ranks))

    async def on_shutdown(_: Trainer | None) -> None:
        ranks.close()

    trainer = await serve(Service(name=f"trainer-{ranks.rank}", on_startup=on_startup, main=Trainer.run_until,
                                  on_shutdown=on_shutdown, connect_deadline_s=60), cfg, stop=stop)
    return trainer.last if trainer is not None else TrainerProgress(run=cfg.run, worker="trainer", state="stopped")
