"""`dflash run` end to end on the live test stack: prompts → completions → samples → drafter → eval,
then the same command again, which resumes the finished run and redoes nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import msgspec

from shared.messages import EvalReport
from shared.store import Keys, Store
from tests.conftest import make_config, new_run

TINY = """
[sampling]
max_new_tokens = 24
temperature = 0.0
[generator]
batch_size = 4
shard_records = 4
shard_seconds = 2
[tokenizer]
truncated_policy = "keep"
min_supervised_tokens = 4
[trainer]
num_layers = 1
block_size = 8
anchors_per_sequence = 8
max_steps = 6
checkpoint_every = 3
token_budget = 300
max_length = 128
holdout_mod = 4
eval_prompts = 2
eval_max_new_tokens = 16
"""


def _dflash_run(stack_env: dict, run: str, prompts: Path, config: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "shared.cli", "--config", str(config), "run", "--prompts", str(prompts), "--run", run,
         "--no-dashboard", "--plain"],
        env={**stack_env, "DFLASH_MODEL__DEVICE": "cpu"}, capture_output=True, text=True, timeout=900)


def test_dflash_run_end_to_end_then_resume(stack, stack_env, tmp_path: Path) -> None:
    bundled = Path(__file__).parents[1] / "services/pipeline/data/prompts.jsonl"
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(bundled.read_text().splitlines()[:12]) + "\n" + "{not json\n")
    config = tmp_path / "tiny.toml"
    config.write_text(TINY)
    run = new_run()

    first = _dflash_run(stack_env, run, prompts, config)
    out = first.stdout + first.stderr
    assert first.returncode == 0, out[-4000:]
    store = Store.open(make_config(stack, run))
    manifest = json.loads(store.get_bytes(Keys.manifest(run)))
    assert manifest["total_accepted"] == 12 and manifest["total_rejected"] == 1
    completions = sorted(store.list(f"runs/{run}/completions/"))
    tokenized = sorted(store.list(f"runs/{run}/tokenized/"))
    assert completions and len(tokenized) == len(completions)
    assert store.exists(Keys.checkpoint(run, 6) + "drafter/model.safetensors")
    report = msgspec.json.decode(store.get_bytes(Keys.eval_report(run)), type=EvalReport)
    assert report.lossless and report.prompts >= 1 and report.tau >= 1.0
    assert "eval: τ =" in out and f"runs/{run}/checkpoints/" in out  # the report and where artifacts are
    checkpoints = sorted(store.list(f"runs/{run}/checkpoints/"))

    second = _dflash_run(stack_env, run, prompts, config)
    out2 = second.stdout + second.stderr
    assert second.returncode == 0, out2[-4000:]
    assert sorted(store.list(f"runs/{run}/completions/")) == completions  # nothing regenerated
    assert sorted(store.list(f"runs/{run}/tokenized/")) == tokenized
    assert sorted(store.list(f"runs/{run}/checkpoints/")) == checkpoints  # not trained again
    assert "eval: τ =" in out2
