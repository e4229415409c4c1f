"""The bf16 decision is taken by timing, not by a CPU flag: with every kernel library restricted to AVX2 (bf16
emulated), `autocast = "auto"` keeps fp32 even on a CPU whose flags say bf16."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from services.trainer.build import autocast_dtype, bf16_is_faster

AVX2_ONLY = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def test_the_settings_off_and_bf16_are_obeyed_and_auto_follows_the_probe() -> None:
    cpu = torch.device("cpu")
    assert autocast_dtype("off", cpu) is None and autocast_dtype("bf16", cpu) is torch.bfloat16
    probe = bf16_is_faster()
    assert probe.fp32_s > 0 and probe.bf16_s > 0
    assert autocast_dtype("auto", cpu) == (torch.bfloat16 if probe.faster else None)
    assert bf16_is_faster() is probe  # timed once per process


@pytest.mark.stack  # a subprocess: the kernel restriction is read when torch loads
def test_kernels_restricted_to_avx2_keep_fp32() -> None:
    code = ("import torch; from services.trainer.build import autocast_dtype, bf16_is_faster; "
            "p = bf16_is_faster(); print(p.fp32_s, p.bf16_s, autocast_dtype('auto', torch.device('cpu')))")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **AVX2_ONLY}, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    fp32_s, bf16_s, chosen = out.stdout.split()
    assert chosen == "None", out.stdout  # fp32: emulated bf16 is not picked
    assert float(bf16_s) > float(fp32_s), out.stdout  # because it measured slower, not because a flag said so
