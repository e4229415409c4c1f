"""Data parallelism under torchrun: every rank runs the target and the drafter on its share of each
optimizer step's micro-batches, and the gradients are summed across ranks before the step.

The gradients are all-reduced explicitly (what DDP's hooks do) rather than through the DDP
wrapper: ranks run different numbers of backward passes per step (one per sequence), which DDP
cannot synchronise. The loss of each sequence is already scaled by the step's global weight sum,
so the summed gradient is exactly the single-process one. Rank 0 alone reads the shard list,
writes checkpoints and publishes progress; the others follow it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @classmethod
    def from_env(cls, device: str = "auto") -> Dist:
        """`device` is the configured model device: NCCL only when the ranks train on GPUs."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world > 1 and not dist.is_initialized():
            gpus = device != "cpu" and torch.cuda.is_available()
            dist.init_process_group("nccl" if gpus else "gloo")
        return cls(int(os.environ.get("RANK", "0")), world, int(os.environ.get("LOCAL_RANK", "0")))

    @property
    def comm_device(self) -> str:
        return f"cuda:{self.local_rank}" if self.world > 1 and dist.get_backend() == "nccl" else "cpu"

    @property
    def main(self) -> bool:
        return self.rank == 0

    def device(self, configured: str) -> str:
        if configured == "auto":
            configured = "cuda" if torch.cuda.is_available() else "cpu"
        return f"cuda:{self.local_rank}" if configured == "cuda" and self.world > 1 else configured

    def sum_grads(self, params: list[torch.nn.Parameter]) -> None:
        if self.world == 1:
            return
        grads = []
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        flat = torch._utils._flatten_dense_tensors(grads)
        dist.all_reduce(flat)
        for g, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads), strict=True):
            g.copy_(synced)

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            moved = values.to(self.comm_device, copy=True)
            dist.all_reduce(moved)
            values = moved.to(values.device)
        return values

    def any(self, flag: bool) -> bool:
        """True on every rank if it is true on any (a stop must be taken by all ranks at the same step)."""
        if self.world == 1:
            return flag
        t = torch.tensor([1.0 if flag else 0.0], device=self.comm_device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def from_main(self, obj: Any) -> Any:
        """Rank 0's value on every rank."""
        if self.world == 1:
            return obj
        box = [obj]
        # the device the objects travel through: NCCL would otherwise use the current CUDA device (0 on every
        # rank, and in the worker threads these calls run in), colliding across ranks
        dist.broadcast_object_list(box, src=0, device=torch.device(self.comm_device))
        return box[0]

    def close(self) -> None:
        if self.world > 1 and dist.is_initialized():
            dist.destroy_process_group()
