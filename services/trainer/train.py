"""Training loop: frozen target forward (online features) → drafter on all blocks of a sequence at once.

One optimizer step = `grad_accum` micro-batches of whole sequences up to `token_budget` tokens.
The loss is Σ w·CE / Σ w over the whole step: the weights do not depend on the model, so the
step's weight sum is known before any forward and every micro-batch backpropagates its share.
Anchors are drawn from a generator seeded by (seed, step, sequence), so a resumed run draws
exactly what an uninterrupted one would; the data cursor and optimizer/scheduler states are in
every checkpoint, which makes resume exact.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import torch

from shared.bus import Bus, ProgressLoop
from shared.config import Config
from shared.ledger import RunLedger
from shared.messages import Subjects, TrainerProgress
from shared.records import TokenizedSample
from shared.status import data_complete, picture
from shared.store import Keys, Store

from .blocks import Blocks, estimated_tau, label_states, make_blocks, sample_anchors
from .data import SampleIndex, SampleSet, ShardCache, ShardFeed, epoch_order, load_samples
from .dist import Dist
from .drafters import arch_name, load_drafter, new_drafter
from .features import Target
from .loss import head_cross_entropy, head_cross_entropy_top_k
from .model import DFlashDrafter, dtype_name, feature_layer_ids, resolve_mask_token_id
from .model_dflash2 import DFlash2Drafter

log = logging.getLogger("dflash.trainer")


def latest_key(run: str) -> str:
    return f"runs/{run}/checkpoints/latest.json"


@dataclass
class Cursor:
    epoch: int = 0
    position: int = 0  # index into the epoch's order
    keys: list[str] = field(default_factory=list)  # the epoch's shard list
    shards: dict[str, tuple[str, int]] = field(default_factory=dict)  # every announcement taken: key → (fingerprint, seq)
    complete: bool = True  # this pass's shards were the run's whole data (generation and tokenization done)
    partial: int = 0  # passes made over part of the data, while it still grew: not counted as epochs

    @property
    def epochs_done(self) -> int:
        """Completed passes over the whole data (the pass in progress not included)."""
        return self.epoch - self.partial


def warmup_steps(total: int, warmup_ratio: float) -> int:
    return max(1, round(total * warmup_ratio))


def lr_lambda(total: int, warm: int):
    """Linear warmup over `warm` steps (fixed when the run is first planned: a plan stretched by data that
    joins later must not send the lr back into warmup), then cosine to 0 at `total`."""
    warm = max(1, warm)

    def f(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        progress = min(1.0, (step - warm) / max(1, total - warm))
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return f


def build(cfg: Config, device: str) -> tuple[Target, DFlashDrafter, Any]:
    from transformers import AutoConfig

    from shared.model import load_causal_lm, load_tokenizer, resolve_target

    t = cfg.trainer
    tok = load_tokenizer(cfg.model.target)
    lm = load_causal_lm(cfg.model.target, device=device)
    n = lm.config.num_hidden_layers
    if not 0 <= t.draft_vocab < lm.config.vocab_size:
        raise ValueError(f"trainer.draft_vocab = {t.draft_vocab}: 0 (off) or fewer than the target's "
                         f"{lm.config.vocab_size} ids")
    ids = list(t.target_layer_ids) or feature_layer_ids(n, t.num_feature_layers)
    on_disk = AutoConfig.from_pretrained(resolve_target(cfg.model.target), local_files_only=True)
    drafter = new_drafter(t, lm.config, num_layers=t.num_layers, block_size=t.block_size, layer_ids=ids,
                          mask_token_id=resolve_mask_token_id(tok, lm.config.vocab_size), serve_dtype=dtype_name(on_disk))
    if t.init == "target":
        drafter.init_from_target(lm.get_decoder().layers)
    drafter = drafter.to(device)
    return Target(lm, ids), drafter, tok


def autocast_dtype(setting: str, device: torch.device) -> torch.dtype | None:
    """bf16 autocast (the drafter's, or the target's training forward): "auto" on GPU, and on CPU where
    matmuls have bf16 units (AMX / AVX512-BF16, ~3× fp32 there; AVX2-only CPUs emulate bf16, ~7×
    slower than fp32); "off" keeps fp32, "bf16" forces it."""
    if setting == "off":
        return None
    if setting == "bf16" or device.type == "cuda":
        return torch.bfloat16
    return torch.bfloat16 if device.type == "cpu" and torch.ops.mkldnn._is_mkldnn_bf16_supported() else None


def draft_vocab_ids(samples: SampleSet | list[TokenizedSample], size: int, vocab_size: int) -> torch.Tensor:
    """The `size` ids most frequent among the supervised tokens (ties to the lower id), sorted."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for s in samples:
        ids = torch.tensor(s.input_ids, dtype=torch.long)[torch.tensor(s.loss_mask, dtype=torch.bool)]
        counts.index_add_(0, ids, torch.ones_like(ids))
    order = torch.sort(-counts, stable=True).indices
    return torch.sort(order[:size]).values


def sequence_blocks(sample: TokenizedSample, anchors_n: int, seed: int, step: int, index: int, max_length: int,
                    block_size: int, mask_token_id: int) -> Blocks | None:
    """One sequence's blocks for this step (None: no anchor). The anchors are drawn from (seed, step,
    index), so every rank, and a resumed run, draws the same ones."""
    ids = torch.tensor(sample.input_ids[:max_length], dtype=torch.long)
    mask = torch.tensor(sample.loss_mask[:max_length], dtype=torch.long)
    g = torch.Generator().manual_seed((seed * 1_000_003 + step) * 65_537 + index)
    anchors = sample_anchors(mask, anchors_n, g)
    return make_blocks(ids, mask, anchors, block_size, mask_token_id) if len(anchors) else None


def sequence_loss(target: Target, drafter: DFlashDrafter, b: Blocks, chunk: int, scale: float, stats: dict,
                  amp: torch.dtype | None, feats: torch.Tensor, final: torch.Tensor | None = None,
                  selector_weight: float = 1.0) -> None:
    """Drafter forward + backward of one sequence's blocks; adds to stats (loss numerator, per-slot hits).
    `feats` [S, k·D] come from the caller's batched target forward (in the target's dtype, fp32 on
    CPU); `amp` autocasts the drafter, and the head runs in that dtype. With the target's final hidden
    states `final` [S, D], each label is the target's distribution at the position before it. A DFlash 2
    drafter adds `selector_weight` × its selector loss over the head's top-K (CandidateSelector.loss),
    and its hits are the selector's (what its walk would draft)."""
    c = drafter.config
    device = next(drafter.parameters()).device
    S, q_pos = feats.shape[0], b.q_pos.to(device)
    with torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None):
        emb = target.embed(b.block_ids.to(device))
        hidden = drafter(emb, feats, q_pos, torch.arange(S, device=device), b.mask.to(device))
    head = drafter.head_rows(target.head_weight(amp or hidden.dtype))
    w = b.weights.to(device)
    keep = torch.nonzero(w > 0).flatten()
    rows = drafter.vocab_rows(b.labels.to(device)[keep])
    teacher = None if final is None else label_states(final, q_pos[keep])
    if isinstance(drafter, DFlash2Drafter):
        selector = drafter.candidate_selector
        total, _, top_values, top_ids = head_cross_entropy_top_k(hidden[keep].to(head.dtype), head, rows, w[keep],
                                                                 selector.top_k, chunk, teacher)
        labels = b.labels.to(device)  # slot k−1's label is slot k's predecessor (slot 0's: the anchor itself)
        picked, hits, _ = selector.loss(hidden[keep], labels[keep - 1], top_values, top_ids, labels[keep], w[keep])
        total = total + selector_weight * picked
    elif drafter.draft_vocab is None:
        total, hits = head_cross_entropy(hidden[keep].to(head.dtype), head, rows, w[keep], chunk, teacher)
    else:  # labels outside the draft vocabulary cannot be proposed: out of the loss, counted as misses
        inside = rows >= 0
        total, hits_in = head_cross_entropy(hidden[keep[inside]].to(head.dtype), head, rows[inside],
                                            w[keep[inside]], chunk, None if teacher is None else teacher[inside])
        hits = torch.zeros(len(keep), dtype=torch.bool, device=device).masked_scatter_(inside, hits_in)
    slot = (keep % c.block_size).cpu()
    stats["hits"].index_add_(0, slot, hits.float().cpu())
    stats["counts"].index_add_(0, slot, torch.ones(len(slot)))
    (total * scale).backward()
    stats["loss_sum"] += float(total.detach())
    stats["tokens"] += S


class Trainer:
    def __init__(self, cfg: Config, bus: Bus, store: Store, *, worker: str = "trainer", device: str | None = None,
                 dist: Dist | None = None):
        self.cfg, self.bus, self.store, self.worker = cfg, bus, store, worker
        self.run = cfg.run
        self.dist = dist or Dist()
        dev = self.dist.device(device or cfg.model.device)
        self.device = dev
        self.target, self.drafter, self.tok = build(cfg, dev)
        t = cfg.trainer
        self.amp = autocast_dtype(t.autocast, torch.device(dev))
        self.target_amp = autocast_dtype(t.target_autocast, torch.device(dev))
        self.opt = torch.optim.AdamW(self.drafter.parameters(), lr=t.lr, weight_decay=t.weight_decay)
        self.step = 0
        self.total_steps = 0
        self.warmup = 1  # steps, set with the first plan
        self.cursor = Cursor()
        self.sched: Any = None
        self.last = TrainerProgress(run=self.run, worker=worker, state="starting")
        self.resumed_from: int | None = None
        self.samples_seen = 0
        self.train_s = 0.0  # time spent in training steps, over all processes of this run
        self.feed: ShardFeed | None = None  # rank 0's durable consumer of the TOKENIZED log
        self.ledger = RunLedger(cfg, bus, store)  # rank 0's view of the run: each check folds only what is new
        # every shard indexed so far (per-sample numbers; tokens in the node's disk cache): only new shards are fetched
        self.index = SampleIndex(store, ShardCache.for_config(cfg))
        self._packing: tuple[np.ndarray | None, np.ndarray] = (None, np.zeros(0, dtype=np.int64))

    # --- data --------------------------------------------------------------------------------

    async def _shard_keys(self) -> list[str]:
        """The shard list, as rank 0's feed has it (ranks must agree on the data)."""
        keys = self.feed.keys() if self.feed else None
        return await asyncio.to_thread(self.dist.from_main, keys)

    async def _wait_for_keys(self) -> list[str]:
        """The first plan: once there is data and the backlog of announcements has been taken."""
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
        """Rank 0's answer on every rank: is the run's data all there? When it is, the feed has taken every
        announcement before the answer (so the keys read next are the whole data)."""
        complete = None
        if self.feed is not None:
            complete = data_complete(await picture(self.cfg, self.bus, self.store, self.ledger))
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

    def _plan_total(self, samples: SampleSet) -> int:
        t = self.cfg.trainer
        return t.max_steps or max(1, t.epochs * self._steps_per_epoch(samples))

    def _steps_per_epoch(self, samples: SampleSet) -> int:
        t = self.cfg.trainer
        avg = int(np.minimum(samples.num_tokens, t.max_length).sum()) / max(1, len(samples))
        per_step = t.grad_accum * self.dist.world * max(1, int(t.token_budget // max(1.0, avg)))  # every rank's
        return math.ceil(len(samples) / per_step)

    def _pass_steps(self, samples: SampleSet, order: np.ndarray) -> int:
        """The optimizer steps of one pass in this order, packed as the training loop packs them."""
        t = self.cfg.trainer
        lengths = self._lengths(samples, order).tolist()  # plain ints: the packing loop runs once per sample
        micro, position = 0, 0
        while position < len(lengths):
            position = self._microbatch_end(lengths, position)
            micro += 1
        return math.ceil(micro / (t.grad_accum * self.dist.world))

    def _uncounted_steps(self, samples: SampleSet, order: np.ndarray) -> int:
        """A pass over part of the data comes on top of the epochs: the plan must not end inside it."""
        return 0 if self.cursor.complete else self._pass_steps(samples, order)

    def _replan(self, samples: SampleSet, order: np.ndarray) -> None:
        """At a pass boundary: the steps left become the remaining epochs over all the data there is (more
        data, or a pass over part of it that did not count, which is planned on top), and the cosine
        schedule stretches to the new total (a fixed max_steps is kept)."""
        t = self.cfg.trainer
        if t.max_steps:
            return
        epochs = (t.epochs - self.cursor.epochs_done) * self._steps_per_epoch(samples)
        total = max(self.step + 1, self.step + self._uncounted_steps(samples, order) + epochs)
        if total != self.total_steps:
            log.info("%d samples from epoch %d: total steps %d → %d", len(samples), self.cursor.epoch,
                     self.total_steps, total)
            self.total_steps = total
            self.sched.lr_lambdas = [lr_lambda(total, self.warmup)]  # a resume rebuilds it from total_steps

    # --- checkpoints -------------------------------------------------------------------------

    def save_checkpoint(self) -> str:
        prefix = Keys.checkpoint(self.run, self.step)
        if not self.dist.main:
            return prefix
        tmp = Path(tempfile.mkdtemp(prefix="dflash-ckpt-"))
        try:
            self.drafter.save(tmp / "drafter")
            torch.save({"optimizer": self.opt.state_dict(), "scheduler": self.sched.state_dict(), "step": self.step,
                        "total_steps": self.total_steps, "warmup_steps": self.warmup, "cursor": self.cursor.__dict__,
                        "samples_seen": self.samples_seen, "train_s": self.train_s,
                        "progress": msgspec.to_builtins(self.last),
                        "torch_rng": torch.get_rng_state()}, tmp / "state.pt")
            for path in sorted(tmp.rglob("*")):
                if path.is_file():
                    self.store.put_file(prefix + str(path.relative_to(tmp)), path)
            self.store.put_bytes(latest_key(self.run), json.dumps({"step": self.step, "key": prefix}).encode(),
                                 "application/json")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        log.info("checkpoint %s", prefix)
        return prefix

    def load_latest(self) -> bool:
        if not self.store.exists(latest_key(self.run)):
            return False
        prefix = json.loads(self.store.get_bytes(latest_key(self.run)))["key"]
        tmp = Path(tempfile.mkdtemp(prefix="dflash-ckpt-"))
        try:
            for key in self.store.list(prefix):
                dest = tmp / key[len(prefix):]
                dest.parent.mkdir(parents=True, exist_ok=True)
                self.store.get_file(key, dest)
            loaded = load_drafter(tmp / "drafter", f"run {self.run}: checkpoint {prefix}")
            if arch_name(loaded) != arch_name(self.drafter):
                raise ValueError(f"run {self.run}: the checkpoint {prefix} is a {arch_name(loaded)}, the config "
                                 f"(trainer.arch = {self.cfg.trainer.arch}) a {arch_name(self.drafter)}; resume with "
                                 "the checkpoint's arch, or train it under a new --run")
            changed = loaded.config.shape_differences(self.drafter.config)
            if changed:
                raise ValueError(f"run {self.run}: the checkpoint {prefix} is of another drafter than the config "
                                 f"describes ({'; '.join(changed)}, checkpoint → config); resume with the "
                                 "checkpoint's settings, or train it under a new --run")
            if loaded.draft_vocab is not None:
                self.drafter.set_draft_vocab(loaded.draft_vocab)
            # what the weights were trained with, even where today's rules would pick another (a resume across an
            # upgrade must not swap the mask token under them)
            self.drafter.config.mask_token_id = loaded.config.mask_token_id
            self.drafter.config.torch_dtype = loaded.config.torch_dtype
            self.drafter.load_state_dict(loaded.state_dict())
            state = torch.load(tmp / "state.pt", weights_only=False)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        self.step, self.total_steps = state["step"], state["total_steps"]
        self.warmup = state.get("warmup_steps") or warmup_steps(self.total_steps, self.cfg.trainer.warmup_ratio)
        # The scheduler first (its constructor rewrites the groups' lr), then the optimizer's saved
        # state (the lr the next step must use), then the scheduler's position.
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_lambda(self.total_steps, self.warmup))
        self.opt.load_state_dict(state["optimizer"])
        self.sched.load_state_dict(state["scheduler"])
        self.cursor = Cursor(**state["cursor"])
        self.samples_seen = state.get("samples_seen", 0)
        self.train_s = state.get("train_s", 0.0)
        torch.set_rng_state(state["torch_rng"])
        if "progress" in state:  # what the run had reached, not a blank "starting" (step 0, loss 0)
            self.last = msgspec.structs.replace(msgspec.convert(state["progress"], TrainerProgress), worker=self.worker,
                                                checkpoint_key=prefix, state="resumed", ts=time.time())
        self.resumed_from = self.step
        log.info("resumed from %s (step %d of %d)", prefix, self.step, self.total_steps)
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

    def _lengths(self, samples: SampleSet, order: np.ndarray) -> np.ndarray:
        """Each position's trained length in this pass's order (made once per order, from the index alone)."""
        if self._packing[0] is not order:
            self._packing = (order, np.minimum(samples.num_tokens[order], self.cfg.trainer.max_length))
        return self._packing[1]

    def _microbatch_end(self, lengths: Any, start: int) -> int:
        """Where the micro-batch starting at position `start` ends (`lengths`: each position's trained length):
        whole sequences up to `token_budget` tokens (at least one)."""
        t = self.cfg.trainer
        end, tokens = start, 0
        while end < len(lengths):
            n = int(lengths[end])
            if end > start and tokens + n > t.token_budget:
                break
            tokens += n
            end += 1
        return end

    def _next_microbatch(self, samples: SampleSet, order: np.ndarray) -> list[tuple[int, TokenizedSample]]:
        start = self.cursor.position
        self.cursor.position = self._microbatch_end(self._lengths(samples, order), start)
        return [(pos, samples[int(order[pos])]) for pos in range(start, self.cursor.position)]

    def _trained_weights(self, b: Blocks) -> torch.Tensor:
        if self.drafter.draft_vocab is None:
            return b.weights
        return b.weights * (self.drafter.vocab_rows(b.labels) >= 0)

    def train_step(self, samples: SampleSet, order: np.ndarray) -> dict | None:
        t, c = self.cfg.trainer, self.drafter.config
        micro = []
        for _ in range(t.grad_accum * self.dist.world):  # rank r takes micro-batches r, r+world, ...
            mb = self._next_microbatch(samples, order)
            if not mb:
                break
            micro.append(mb)
        if not micro:
            return None
        # every rank builds every micro-batch's blocks: loss = Σ w·CE / Σ w over the whole optimizer step
        blocks = [[sequence_blocks(s, t.anchors_per_sequence, t.seed, self.step, pos, t.max_length, c.block_size,
                                   c.mask_token_id) for pos, s in mb] for mb in micro]
        # labels outside a draft vocabulary are out of the loss, so out of its normaliser too
        weight_sum = sum(float(self._trained_weights(b).sum()) for bs in blocks for b in bs if b is not None)
        stats = {"loss_sum": 0.0, "tokens": 0, "target_s": 0.0, "hits": torch.zeros(c.block_size),
                 "counts": torch.zeros(c.block_size)}
        t0 = time.perf_counter()
        self.drafter.train()
        self.opt.zero_grad(set_to_none=True)
        if weight_sum > 0:
            for mb, bs in list(zip(micro, blocks, strict=True))[self.dist.rank::self.dist.world]:
                t1 = time.perf_counter()  # the micro-batch's target forward, batched
                with torch.autocast(torch.device(self.device).type, dtype=self.target_amp or torch.float32,
                                    enabled=self.target_amp is not None):
                    seqs = [torch.tensor(s.input_ids[: t.max_length], device=self.device) for _, s in mb]
                    feats = self.target.features_and_final_many(seqs) if t.soft_labels else \
                        [(f, None) for f in self.target.features_many(seqs)]
                stats["target_s"] += time.perf_counter() - t1
                for b, (f, final) in zip(bs, feats, strict=True):
                    if b is not None:
                        sequence_loss(self.target, self.drafter, b, t.logits_chunk, 1.0 / weight_sum, stats, self.amp,
                                      f, final, t.selector_loss_weight)
            self.dist.sum_grads(list(self.drafter.parameters()))
            torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), t.grad_clip)
            self.opt.step()
        self.sched.step()
        self.step += 1
        elapsed = time.perf_counter() - t0
        self.train_s += self.dist.from_main(elapsed)  # rank 0's clock, so every rank agrees on the budget
        if t.max_train_s > 0:  # the schedule runs on whichever of steps and time is further along
            frac = max(self.step / self.total_steps, self.train_s / t.max_train_s)
            factor = lr_lambda(self.total_steps, self.warmup)(min(self.total_steps, round(frac * self.total_steps)))
            for group in self.opt.param_groups:
                group["lr"] = t.lr * factor
        totals = self.dist.sum(torch.tensor([stats["loss_sum"], stats["tokens"], stats["target_s"], elapsed],
                                            dtype=torch.float64))
        hits, counts = self.dist.sum(stats["hits"]), self.dist.sum(stats["counts"])
        loss_sum, tokens, target_s, elapsed_sum = totals.tolist()
        acc = (hits[1:] / counts[1:].clamp(min=1)).tolist()
        return {"loss": loss_sum / weight_sum if weight_sum else 0.0, "acc": acc,
                "tokens_per_s": tokens / elapsed, "target_share": target_s / max(elapsed_sum, 1e-9),
                "samples": sum(len(mb) for mb in micro)}

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
                self.total_steps = self._plan_total(samples)
                if not t.max_steps:
                    self.total_steps += self._uncounted_steps(samples, epoch_order(len(samples), t.seed, 0))
                self.warmup = warmup_steps(self.total_steps, t.warmup_ratio)
                if t.draft_vocab:  # from the data at the start, the same on every rank; kept in checkpoints
                    self.drafter.set_draft_vocab(draft_vocab_ids(samples, t.draft_vocab, self.drafter.config.vocab_size))
                    log.info("draft vocabulary: %d ids", t.draft_vocab)
                self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_lambda(self.total_steps, self.warmup))
            order = epoch_order(len(samples), t.seed, self.cursor.epoch)
            while self.step < self.total_steps and not self.out_of_time() and \
                    not await asyncio.to_thread(self.dist.any, stop.is_set()):
                if self.cursor.position >= len(order):
                    uncounted = not self.cursor.complete  # the pass just made was over part of the data
                    self.cursor.epoch += 1
                    self.cursor.partial += uncounted
                    if not t.max_steps and self.cursor.epochs_done >= t.epochs:
                        break
                    keys, complete = await self._next_pass(stop)  # shards tokenized since join this pass
                    if await asyncio.to_thread(self.dist.any, stop.is_set()):
                        self.cursor.epoch -= 1  # nothing of the next pass was made: resume at this boundary
                        self.cursor.partial -= uncounted
                        break
                    grown = keys != self.cursor.keys
                    if grown:
                        samples = await asyncio.to_thread(self._samples, keys)
                    if not complete:
                        log.info("pass %d over %d samples: the run's data is still growing, not counted as an epoch",
                                 self.cursor.epoch, len(samples))
                    self.cursor.keys, self.cursor.position, self.cursor.complete = keys, 0, complete
                    order = epoch_order(len(samples), t.seed, self.cursor.epoch)
                    if grown or uncounted or not complete:
                        self._replan(samples, order)
                out = await asyncio.to_thread(self.train_step, samples, order)
                if out is None:
                    continue
                self.samples_seen += out["samples"]
                self.last = TrainerProgress(
                    run=self.run, worker=self.worker, step=self.step, total_steps=self.total_steps,
                    epoch=self.cursor.epoch, loss=out["loss"],
                    lr=self.opt.param_groups[0]["lr"], position_accuracy=[round(a, 4) for a in out["acc"]],
                    estimated_tau=round(estimated_tau(out["acc"]), 4), tokens_per_s=round(out["tokens_per_s"], 1),
                    target_forward_share=round(out["target_share"], 4), samples_seen=self.samples_seen,
                    checkpoint_key=checkpoint_key, state="running",
                )
                if self.step % t.checkpoint_every == 0 or self.step >= self.total_steps:
                    checkpoint_key = await self.checkpoint()  # holds this step's progress, for a resume's display
                    self.last = msgspec.structs.replace(self.last, checkpoint_key=checkpoint_key)
                if self.step % t.progress_every == 0 and self.dist.main:
                    await self.bus.publish(subject, self.last)
            if self.step and (checkpoint_key is None or not checkpoint_key.endswith(f"{self.step:08d}/")):
                checkpoint_key = await self.checkpoint()
            done = self.step >= self.total_steps or (not t.max_steps and self.cursor.epochs_done >= t.epochs) \
                or self.out_of_time()
            self.last = msgspec.structs.replace(self.last, checkpoint_key=checkpoint_key,
                                                state="done" if done else "stopped", ts=time.time())
        return self.last


async def run_trainer(cfg: Config, *, stop: asyncio.Event | None = None) -> TrainerProgress:
    from shared.bus import install_stop_signals

    if stop is None:
        stop = asyncio.Event()
        install_stop_signals(stop)
    torch.manual_seed(cfg.trainer.seed)  # the same initial drafter on every rank
    ranks = Dist.from_env(cfg.model.device)
    store = await asyncio.to_thread(Store.open, cfg)
    try:
        async with await Bus.connect(cfg.bus, f"trainer-{ranks.rank}", deadline_s=60) as bus:
            await bus.ensure_streams()
            trainer = await asyncio.to_thread(Trainer, cfg, bus, store, dist=ranks)
            return await trainer.run_until(stop)
    finally:
        ranks.close()
