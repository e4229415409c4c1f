"""The chaos suite: a real small run with kill -9s of every service kind, a nats-server restart and
an S3 outage; the checks are the delivery guarantees (see services/pipeline/chaos.py).

It starts its own embedded stack (the faults would hurt the session's shared one)."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.pipeline.chaos import FAULTS, ChaosSettings, run_chaos

pytestmark = pytest.mark.stack  # its own stack and services


def test_chaos_run_loses_and_duplicates_nothing(tmp_path: Path) -> None:
    report = run_chaos(ChaosSettings(prompts=32, generators=2, max_faults=7, fault_every_s=7.0, train_steps=20,
                                     timeout_s=1500), tmp_path)
    text = report.format()
    print(text)
    (tmp_path / "chaos-report.txt").write_text(text)
    assert report.ok, text
    kinds = {kind for _, kind, _ in report.faults}
    assert set(FAULTS) <= kinds, text  # every kind of fault really happened
    assert report.figures["prompts completed (unique)"] == report.figures["prompts accepted"] > 0
    assert report.figures["trainer resumes"] >= 1
