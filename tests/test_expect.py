"""`dfpipe run`'s expected duration (services/pipeline/expect.py): the probe, and the estimate's arithmetic on the
bundled demo. The reference figures themselves are measured (bench/results/demo.json), not tested here."""

from __future__ import annotations

from pathlib import Path

import msgspec

from services.pipeline.expect import AVX2_2_CORES, count_prompts, expect, probe_gflops
from services.pipeline.run import BUNDLED_PROMPTS, DEMO_CONFIG
from shared.config import load_config


def test_the_probe_measures_this_machine() -> None:
    a, b = probe_gflops(0.2), probe_gflops(0.2)
    assert 1 < a < 20_000 and 1 < b < 20_000  # a GFLOP/s figure, not a constant
    assert 0.25 < a / b < 4  # two probes a moment apart agree to within the noise of a shared machine


def test_prompts_are_counted_locally_only(tmp_path: Path) -> None:
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a"}\n\n{"prompt": "b"}\n')
    assert count_prompts([str(f), str(f)]) == 4  # blank lines are not prompts
    assert count_prompts([str(f), "s3://bucket/p.jsonl"]) is None  # remote: not read at start
    assert count_prompts([str(BUNDLED_PROMPTS)]) == 350


def test_the_demo_is_expected_within_20_minutes_on_the_reference_cpu_and_on_one_half_as_fast() -> None:
    cfg = load_config(DEMO_CONFIG, env={})
    assert cfg.trainer.run_budget_s <= 19 * 60
    on_ref = expect(cfg, 350, train=True, probe=AVX2_2_CORES.probe_gflops)
    half = expect(cfg, 350, train=True, probe=AVX2_2_CORES.probe_gflops / 2)
    for e in (on_ref, half):  # the run's budget holds: training gets what generation and the eval leave
        assert 0 < e.total_s <= 20 * 60, e.line()
    s, h = dict(on_ref.stages), dict(half.stages)
    # half as fast: generation and eval take twice as long, and training gives up what they took
    assert abs(h["generation"] - 2 * s["generation"]) < 1e-6 and abs(h["eval"] - 2 * s["eval"]) < 1e-6
    assert h["training"] < s["training"] <= AVX2_2_CORES.train_startup_s + cfg.trainer.max_train_s
    line = on_ref.line()
    assert line.startswith("expected on this machine: about ") and "generation ~" in line and "eval ~" in line


def test_a_run_budget_leaves_the_eval_its_time() -> None:
    from services.pipeline.run import RunRequest, training_budget_s

    cfg = load_config(DEMO_CONFIG, env={})
    t = cfg.trainer
    request = RunRequest(prompts=[], generators=[None], started_at=1000.0, expected_eval_s=200.0)
    # generation took 4 minutes: training gets the rest of the budget less the eval and the margin
    assert training_budget_s(cfg, request, now=1240.0) == min(t.max_train_s, t.run_budget_s - 240 - 200 - 30)
    assert training_budget_s(cfg, request, now=1000.0 + t.run_budget_s) == 60  # already late: still a minute
    early = training_budget_s(cfg, request, now=1001.0)
    assert early == t.max_train_s  # at most max_train_s
    assert training_budget_s(cfg, RunRequest(prompts=[], generators=[None]), now=1240.0) is None  # no estimate


def test_training_without_a_budget_is_said_to_be_unestimated() -> None:
    cfg = load_config(DEMO_CONFIG, env={})
    cfg = msgspec.structs.replace(cfg, trainer=msgspec.structs.replace(cfg.trainer, max_train_s=0.0))
    cfg = msgspec.structs.replace(cfg, trainer=msgspec.structs.replace(cfg.trainer, run_budget_s=0.0))
    e = expect(cfg, 350, train=True, probe=100.0)
    assert dict(e.stages)["training"] is None
    assert "at least" in e.line() and "training ?" in e.line()
    assert "training" not in dict(expect(cfg, 350, train=False, probe=100.0).stages)
