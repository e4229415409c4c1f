"""A two-group run against two simulated engines (issue 31 §3), trained on all of the run's ranks through `dfpipe
run` itself (§5): `--gpus 0-1,2-3` starts one generator per group, each on its own engine; with the model on the
CPU, `--train-ranks 2` trains under torchrun with 2 gloo ranks (the path `--gpus` takes with NCCL on GPUs), and
the training matches one process step for step."""

from __future__ import annotations

import asyncio
import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from services.pipeline.run import BUNDLED_PROMPTS
from shared.bus import Bus
from shared.messages import TokenizedShard
from shared.store import Store
from shared.topology import Keys, Subjects
from tests.conftest import make_config, new_run
from tests.test_trainer import progress_history

CONFIG = """
[sampling]
max_new_tokens = 64
[generator]
shard_records = 8
# an upper bound on each generator's level: with the automatic one (up to 1024 + two shards held), the first
# generator to start would take all 36 prompts, and the check that both groups' engines served needs both
max_inflight = 8
[tokenizer]
min_supervised_tokens = 4
truncated_policy = "keep"
[trainer]
num_layers = 1
block_size = 8
anchors_per_sequence = 12
max_steps = 0
epochs = 1
checkpoint_every = 4
token_budget = 200
max_length = 128
holdout_mod = 6
lr = 0.003
autocast = "off"
wait_for_data_s = 5
eval_prompts = 2
eval_max_new_tokens = 8
"""


def _tokenized_events(stack, run: str) -> list[TokenizedShard]:
    cfg = make_config(stack, run)

    async def read() -> list[TokenizedShard]:
        async with await Bus.connect(cfg.bus, "pytest", deadline_s=10) as bus:
            return [e async for _, e in bus.read_log("TOKENIZED", Subjects.tokenized(run), 1)
                    if isinstance(e, TokenizedShard)]

    return asyncio.run(read())


def _announce(stack, run: str, events: list[TokenizedShard]) -> None:
    cfg = make_config(stack, run)

    async def publish() -> None:
        async with await Bus.connect(cfg.bus, "pytest", deadline_s=10) as bus:
            await bus.ensure_streams()
            for e in events:
                e.run = run
                await bus.publish(Subjects.tokenized(run), e, msg_id=f"{run}:{e.key}")

    asyncio.run(publish())


@pytest.mark.stack
def test_two_groups_on_two_simulated_engines_then_two_gloo_ranks_matching_one_process(stack, stack_env,
                                                                                     tmp_path: Path) -> None:
    from bench.engine_sim import PROFILES, EngineSim

    config, prompts = tmp_path / "run.toml", tmp_path / "prompts.jsonl"
    config.write_text(CONFIG)
    prompts.write_text("".join(BUNDLED_PROMPTS.read_text().splitlines(keepends=True)[:36]))
    run_two, run_one = new_run(), new_run()
    env = {**stack_env, "DFLASH_MODEL__DEVICE": "cpu", "DFLASH_TRAINER__GRAD_ACCUM": "1"}
    profile = dataclasses.replace(PROFILES["test-batch"], name="groups", mean_tokens=24, max_new_tokens=64)
    with EngineSim(profile) as a, EngineSim(profile) as b:
        two = subprocess.run(
            [sys.executable, "-m", "shared.cli", "--config", str(config), "run", "--prompts", str(prompts), "--run",
             run_two, "--gpus", "0-1,2-3", "--backend", "sglang", "--engine-urls", f"{a.url},{b.url}",
             "--train-ranks", "2", "--no-dashboard", "--plain"], env=env, capture_output=True, text=True, timeout=600)
        served = (a.stats().requests_finished, b.stats().requests_finished)
    logs = Path(stack.root) / "runs" / run_two / "logs"
    trainer_log = logs / "trainer.log"
    assert two.returncode == 0, (two.stdout + two.stderr)[-3000:] + (
        trainer_log.read_text()[-3000:] if trainer_log.exists() else "")
    done = re.search(r"(\d+) of (\d+) prompts completed", two.stdout)
    assert done and done.group(1) == done.group(2) and int(done.group(2)) >= 30, two.stdout[-2000:]
    assert "eval: τ =" in two.stdout
    assert all(n > 0 for n in served) and sum(served) >= 36, served  # both engines served; retries may add some
    store = Store.open(make_config(stack, run_two))
    workers = {k.split("/")[3] for k in store.list(Keys.completions_prefix(run_two)) if k.endswith(".parquet")}
    assert workers <= {"gen0-gpu0-1", "gen1-gpu2-3"} and workers, workers
    # the same tokenized shards, in the same order, trained by one process taking both ranks' micro-batches
    events = _tokenized_events(stack, run_two)
    assert events
    _announce(stack, run_one, events)
    log = tmp_path / "one.log"
    with open(log, "wb") as out:
        one = subprocess.Popen([sys.executable, "-m", "shared.cli", "--config", str(config), "train", "--run", run_one],
                               env={**env, "DFLASH_TRAINER__GRAD_ACCUM": "2"}, stdout=out, stderr=subprocess.STDOUT,
                               start_new_session=True)
    try:
        assert one.wait(timeout=300) == 0, log.read_text()[-3000:]
    except subprocess.TimeoutExpired:
        one.kill()
        raise AssertionError(log.read_text()[-5000:]) from None
    h1, h2 = progress_history(stack, run_one), progress_history(stack, run_two)
    assert sorted(h1) == sorted(h2) == list(range(1, len(h1) + 1)) and len(h1) >= 3, (sorted(h1), sorted(h2))
    for step in h1:
        assert h2[step].total_steps == h1[step].total_steps == len(h1), step
        assert h2[step].loss == pytest.approx(h1[step].loss, rel=1e-4), step
        assert h2[step].samples_seen == h1[step].samples_seen, step
    # (1 process with grad_accum 1 would have taken twice the steps: the equal schedules are the 2 ranks at work)
    assert h2[len(h2)].checkpoint_key == Keys.checkpoint(run_two, len(h2))  # written once, by rank 0


@pytest.mark.stack  # starts a simulated engine
def test_training_waits_for_launched_engines_to_be_gone() -> None:
    from bench.engine_sim import EngineSim
    from services.pipeline.layout import engines_still_up

    sim = EngineSim("test-small").start()
    url = sim.url
    assert asyncio.run(engines_still_up([url], deadline_s=0.3, poll_s=0.1)) == [url]  # still serving: said
    sim.stop()
    assert asyncio.run(engines_still_up([url], deadline_s=5.0, poll_s=0.1)) == []  # gone: training may start
