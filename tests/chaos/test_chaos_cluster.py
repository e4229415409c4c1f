"""`dfpipe chaos --cluster`, CI-sized: the chaos suite on 3 NATS nodes (R3) and a multi-process SeaweedFS.

Faults, each at least once: SIGKILL of the PROMPTS stream leader, the SHARDS stream leader and the meta leader
(each node back 5 s later), a node SIGSTOPped for 10 s (longer than a failover) then SIGCONT, a volume server
SIGKILLed while shards and checkpoints are written, and kill -9 of a generator, the tokenizer and the trainer
(after its first checkpoint). Generators, tokenizer and trainer connect to different members. The synthetic
backend answers at once, so chaos paces it to outlast the fault plan (chaos.fault_plan_s: on a fast machine an
unpaced run ended before its last fault); the trainer is the real one. Checks (services/pipeline/chaos.py): unique
completions = accepted prompts, one sample per kept prompt, the trainer resumed from a checkpoint and ended at
its last step; and the driver's poll (`dfpipe run`'s ledger reads) never failed past its retries.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from services.pipeline.chaos import CLUSTER_FAULTS, ChaosSettings, run_chaos

pytestmark = pytest.mark.stack  # its own cluster and services


def test_chaos_on_a_cluster_loses_and_duplicates_nothing(tmp_path: Path) -> None:
    report = run_chaos(ChaosSettings(cluster=True, backend="synthetic", prompts=18, generators=3, max_faults=8,
                                     fault_every_s=4.0, train_steps=8, timeout_s=900), tmp_path)
    text = report.format()
    print(text)
    assert report.ok, text
    assert set(CLUSTER_FAULTS) <= {kind for _, kind, _ in report.faults}, text  # every kind really happened
    assert report.figures["prompts completed (unique)"] == report.figures["prompts accepted"] == 18
    assert report.figures["trainer resumes"] >= 1
    assert report.figures["state polls failed after retries"].startswith("0 of "), text
