"""Where `dfpipe run` puts its services: one generator (and engine) per GPU group, training on the run's GPUs.

Generation: generator i runs the engine of group i (`dfpipe generate --gpus <group>`: a launched SGLang
gets `CUDA_VISIBLE_DEVICES=<group>` and `--tp-size <group size>`), talking to engine URL i: the one given
per group (`layout.engine_urls`, `--engine-urls`), or, when the generators launch their servers, the
configured URL with its port advanced by i so the servers of one host do not collide.

Training: once generation is done `dfpipe run` has stopped the generators, and with them the engines they
launched (an in-process hf engine, or an SGLang server a generator started), so the trainer takes every GPU
of the run under torchrun (one rank per GPU, NCCL). Engines the user runs outside `dfpipe run` are not the
pipeline's to stop: then training takes the GPUs the user names (`--train-gpus`), else the run's `--gpus`.
On CPU (no `--gpus`, or `model.device = "cpu"`), `layout.cpu_train_ranks` > 1 runs the same torchrun path with
gloo ranks.

Out of scope: a target too large to sit whole on one training GPU (each rank holds the whole frozen
target); `fit_problem` says so before the run starts instead of after days of generation.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from urllib.parse import urlparse, urlunparse

from shared.config import Config
from shared.gpus import GpuGroup, LayoutError, all_gpus

from .supervisor import ServiceSpec

DEFAULT_ENGINE_URL = "http://127.0.0.1:30000"


def engines_launched(cfg: Config, backend: str | None) -> bool:
    """Whether the run's engines are its own (started, and so stopped, by its generators)."""
    kind = backend or cfg.generator.backend
    return kind == "hf" or (kind == "sglang" and cfg.generator.launch)


def with_port(url: str, offset: int) -> str:
    """`url` with its port advanced by `offset`: the i-th launched server of a host."""
    parts = urlparse(url)
    port = (parts.port or 30000) + offset
    return urlunparse(parts._replace(netloc=f"{parts.hostname}:{port}"))


def engine_urls(cfg: Config, groups: list[GpuGroup | None], backend: str | None) -> list[str | None]:
    """Engine URL per generator (None: the configured one), checked against the number of groups."""
    given = cfg.layout.engine_urls
    if given:
        if len(given) != len(groups):
            raise LayoutError(f"{len(given)} engine URL(s) (layout.engine_urls / --engine-urls) for {len(groups)} "
                              "generator(s): give one per GPU group, in order")
        return list(given)
    if len(groups) > 1 and (backend or cfg.generator.backend) == "sglang" and cfg.generator.launch:
        base = cfg.generator.engine_url or DEFAULT_ENGINE_URL
        return [with_port(base, i) for i in range(len(groups))]
    return [None] * len(groups)


def generator_argv(run: str, index: int, group: GpuGroup | None, url: str | None, backend: str | None,
                   launch: bool = False) -> list[str]:
    """`dfpipe generate` for generator `index`: its worker name (unique per group), its group and engine."""
    worker = f"gen{index}" if group is None else f"gen{index}-gpu{group.label}"
    argv = ["generate", "--run", run, "--worker", worker]
    if group is not None:
        argv += ["--gpus", group.arg, "--tp", str(group.tp)]
    if url:
        argv += ["--engine-url", url]
    if backend:
        argv += ["--backend", backend]
    if launch:
        argv.append("--launch")
    return argv


def launched_engine_urls(cfg: Config, groups: list[GpuGroup | None], backend: str | None) -> list[str]:
    """The URLs of the SGLang servers this run's generators launch (none for hf: its engine is the process)."""
    if (backend or cfg.generator.backend) != "sglang" or not cfg.generator.launch:
        return []
    return [u or cfg.generator.engine_url or DEFAULT_ENGINE_URL for u in engine_urls(cfg, groups, backend)]


async def engines_still_up(urls: list[str], deadline_s: float, poll_s: float = 1.0) -> list[str]:
    """Wait until none of `urls` answers (their servers are gone, their GPUs free); those still answering at the
    deadline. A generator closes the server it launched; one killed at the end of its grace period cannot."""
    import asyncio

    import httpx

    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s
    async with httpx.AsyncClient(timeout=2.0) as http:
        while True:
            up = []
            for url in urls:
                try:
                    await http.get(url.rstrip("/") + "/health")
                    up.append(url)
                except httpx.TransportError:  # refused, reset, timed out: nobody serving there
                    pass
            if not up or loop.time() >= end:
                return up
            await asyncio.sleep(poll_s)


def training_gpus(cfg: Config, groups: list[GpuGroup | None]) -> list[int]:
    """The GPUs the trainer gets: `layout.train_gpus` when set, else every GPU of the run's groups; none when the
    model is pinned to the CPU (`model.device = "cpu"`: then `cpu_train_ranks` gloo ranks)."""
    if cfg.model.device == "cpu":
        return []
    if cfg.layout.train_gpus:
        return list(cfg.layout.train_gpus)
    return all_gpus([g for g in groups if g is not None])


def trainer_spec(cfg: Config, groups: list[GpuGroup | None], *, grace_s: float | None = None) -> ServiceSpec:
    """The trainer: one process, or torchrun with one rank per training GPU (NCCL) or `cpu_train_ranks` (gloo)."""
    gpus = training_gpus(cfg, groups)
    ranks = len(gpus) if gpus else cfg.layout.cpu_train_ranks
    if ranks < 1:
        raise LayoutError(f"layout.cpu_train_ranks = {cfg.layout.cpu_train_ranks}: at least 1")
    if ranks == 1:
        argv = [sys.executable, "-m", "shared.cli", "train", "--run", cfg.run]
    else:  # the run comes from DFLASH_RUN: torchrun's parser would claim `--run` (an abbreviation of --run-path)
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
                "-m", "shared.cli", "train"]
    env = {"DFLASH_RUN": cfg.run}
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
    elif ranks > 1:
        env["DFLASH_MODEL__DEVICE"] = "cpu"  # gloo ranks, even where a GPU is visible
    # Started once tokenization is done: the step count is planned from the whole dataset. (A trainer started by
    # hand or in compose may start early: later shards join its next pass, and its passes count as epochs once
    # generation and tokenization are done.)
    return ServiceSpec("trainer", argv, env=env, one_shot=True, deferred=True, grace_s=grace_s)


def target_bytes_bf16(target_dir: Path) -> int:
    """The target's weights as the GPU trainer holds them (bf16), from its files and config's dtype."""
    files = [*target_dir.glob("*.safetensors"), *target_dir.glob("*.bin")]
    size = sum(f.stat().st_size for f in files)
    try:
        dtype = json.loads((target_dir / "config.json").read_text()).get("torch_dtype", "bfloat16")
    except (OSError, ValueError):
        dtype = "bfloat16"
    per_param = {"float32": 4, "float16": 2, "bfloat16": 2}.get(str(dtype), 2)
    return size * 2 // per_param


# Room one training rank needs beside the frozen target: the drafter, its optimizer state, activations of a
# 16K-token micro-batch and CUDA's own (a rule of thumb, stated: a target that leaves less than this is refused).
TRAINING_HEADROOM = 0.25


def fit_problem(target_bytes: int, gpu_bytes: int, groups: list[GpuGroup | None]) -> str | None:
    """Why training on these GPUs is out of scope (the target does not sit whole on one), or None."""
    if gpu_bytes <= 0 or target_bytes <= gpu_bytes * (1 - TRAINING_HEADROOM):
        return None
    tp = max((g.tp for g in groups if g is not None), default=1)
    return (f"the target's weights ({target_bytes / 2**30:.1f} GiB in bf16) do not leave "
            f"{TRAINING_HEADROOM:.0%} of one GPU's {gpu_bytes / 2**30:.1f} GiB free, and training holds the whole "
            f"target on every GPU (one rank each{'; groups of ' + str(tp) + ' serve it with tensor parallelism, training does not' if tp > 1 else ''}): "
            "training such a target is out of scope here. Run with --no-train (generation and tokenization), "
            "or train on larger GPUs (--train-gpus)")


def gpu_memory_bytes(gpus: list[int]) -> int:
    """The smallest memory of `gpus` (0 where torch sees no CUDA device)."""
    import torch

    if not gpus or not torch.cuda.is_available():
        return 0
    return min(torch.cuda.get_device_properties(g).total_memory for g in gpus)
