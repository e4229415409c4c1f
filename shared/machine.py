"""One line that says which machine measured a number (an eval's τ and speedup, a bench): a speedup is the
machine's as much as the drafter's, so a report that carries one names where it was taken."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags(wanted: tuple[str, ...] = ("amx_bf16", "avx512_bf16", "avx512f", "avx2")) -> list[str]:
    """Which of `wanted` this CPU has, in that order (default: the matmul units that decide its speed here)."""
    try:
        flags = next((line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("flags")), [])
    except OSError:
        return []
    return [f for f in wanted if f in flags]


def describe_machine(device: str = "cpu") -> str:
    """E.g. "NVIDIA H100 80GB HBM3 (cuda:0)" or "CPU: AMD EPYC 7B13, 2 cores (avx2)"."""
    if device.startswith("cuda"):
        import torch

        if torch.cuda.is_available():
            index = int(device.split(":", 1)[1]) if ":" in device else 0
            return f"{torch.cuda.get_device_name(index)} ({device})"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    features = cpu_flags()
    return f"CPU: {cpu_model()}, {cores} cores" + (f" ({', '.join(features)})" if features else "")
