"""How long a CPU run should take on this machine, said when `dfpipe run` starts.

A newcomer's first run is the demo on whatever CPU they have, and its minutes scale with that CPU's matrix
units (3-4x between an AVX2 laptop core and an AMX server core). So the estimate is measured, not assumed: a
half-second probe times the target's own matrix shapes in fp32 here, and the stage times measured end to end on
the reference machine (a 2-core AVX2-only CPU, bench/results/demo.json) are scaled by the ratio. Generation and
the eval scale with the probe and with their token counts; training is its time budget when it has one
(`trainer.max_train_s`), else it is said to be unestimated; start-up and tokenization are taken as measured.
Only the in-process CPU backend is estimated: an engine's speed is `dfpipe calibrate`'s to measure.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from shared.config import Config


@dataclass(frozen=True)
class Reference:
    """The demo measured end to end on one machine, per unit of work (bench/results/demo.json)."""

    cpu: str
    probe_gflops: float  # probe_gflops() there
    startup_s: float  # stack start, feed, the generators' model load: before the first token
    gen_tokens_per_s: float  # the hf backend at demo.toml's batch size, all generators together
    tokenize_s: float  # from the last completion to the last tokenized shard
    train_startup_s: float  # the trainer's model load and first data, after generation
    eval_s_per_token: float  # per held-out prompt x eval_max_new_tokens: the drafter's decode and greedy's


# bench/results/demo.json: `dfpipe run --run demo` on a 2-core AMD EPYC restricted to AVX2
# (ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2), alone on the machine.
AVX2_2_CORES = Reference(cpu="2-core AMD EPYC restricted to AVX2", probe_gflops=190.0, startup_s=15.0,
                         gen_tokens_per_s=139.0, tokenize_s=5.0, train_startup_s=15.0, eval_s_per_token=0.125)


RUN_MARGIN_S = 30.0  # the trainer's start and last checkpoint, kept out of a run budget's training time


def probe_gflops(seconds: float = 0.5) -> float:
    """fp32 GFLOP/s of the target's MLP shape (576 x 1536, SmolLM2-135M) over 256 rows, on every core torch
    uses here, best of the repeats that fit in `seconds` (the first one warms the kernels)."""
    import torch

    a, b = torch.randn(256, 576), torch.randn(576, 1536)
    flops = 2 * 256 * 576 * 1536
    best = float("inf")
    torch.mm(a, b)
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        for _ in range(8):
            torch.mm(a, b)
        best = min(best, (time.perf_counter() - t0) / 8)
    return flops / best / 1e9


def count_prompts(paths: list[str], max_bytes: int = 64 << 20) -> int | None:
    """Lines with text in the local prompt files; None when one is remote or too large to count at start."""
    n = 0
    for p in paths:
        path = Path(p)
        if p.startswith("s3://") or not path.is_file() or path.stat().st_size > max_bytes:
            return None
        with path.open("rb") as f:
            n += sum(1 for line in f if line.strip())
    return n


@dataclass
class Expected:
    stages: list[tuple[str, float | None]]  # (stage, seconds); None: not estimated
    probe: float
    ref: Reference

    @property
    def total_s(self) -> float:
        return sum(s for _, s in self.stages if s is not None)

    def line(self) -> str:
        parts = ", ".join(f"{name} {'?' if s is None else f'~{s / 60:.0f}'}" for name, s in self.stages)
        unsure = " at least" if any(s is None for _, s in self.stages) else ""
        return (f"expected on this machine:{unsure} about {self.total_s / 60:.0f} minutes ({parts}; minutes). "
                f"Probe: {self.probe:.0f} GFLOP/s fp32 here, {self.ref.probe_gflops:.0f} on the {self.ref.cpu} "
                "the demo was timed on")


def expect(cfg: Config, prompts: int, *, train: bool, probe: float, ref: Reference = AVX2_2_CORES) -> Expected:
    """The run's stages in seconds on this machine: `ref`'s per-unit times, scaled by the probes' ratio."""
    slower = ref.probe_gflops / max(probe, 1e-6)  # >1: this machine is slower than the reference
    t = cfg.trainer
    stages: list[tuple[str, float | None]] = [
        ("start", ref.startup_s),
        ("generation", prompts * cfg.sampling.max_new_tokens / ref.gen_tokens_per_s * slower),
        ("tokenization", ref.tokenize_s),
    ]
    if train:
        eval_prompts = min(t.eval_prompts, prompts // max(t.holdout_mod, 1))
        eval_s = eval_prompts * t.eval_max_new_tokens * ref.eval_s_per_token * slower
        training: float | None = t.max_train_s if t.max_train_s > 0 else None
        if t.run_budget_s > 0:  # what the run's budget leaves it (as run.training_budget_s decides, with its margin)
            left = max(60.0, t.run_budget_s - sum(s for _, s in stages if s is not None) - eval_s - RUN_MARGIN_S)
            training = min(left, training) if training is not None else left
        stages.append(("training", None if training is None else ref.train_startup_s + training))
        stages.append(("eval", eval_s))
    return Expected(stages=stages, probe=probe, ref=ref)
