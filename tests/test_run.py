"""`dfpipe run` end to end on the live test stack: prompts → completions → samples → drafter → eval,
then the same command again, which resumes the finished run and redoes nothing."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import msgspec

from shared.messages import EvalReport
from shared.store import Store
from shared.topology import Keys
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


def _dflash_run_on_a_terminal(stack_env: dict, run: str, prompts: Path, config: Path) -> tuple[int, str]:
    """`dfpipe run` with its stdout on a pseudo-terminal, so the live (rich) display is what runs."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "shared.cli", "--config", str(config), "run", "--prompts", str(prompts), "--run", run,
         "--no-dashboard"],
        env={**stack_env, "DFLASH_MODEL__DEVICE": "cpu", "COLUMNS": "140", "TERM": "xterm-256color"},
        stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, close_fds=True)
    os.close(slave)
    chunks, deadline = [], time.monotonic() + 900
    try:
        while time.monotonic() < deadline:
            if select.select([master], [], [], 1.0)[0]:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: the child closed its side
                    break
                if not data:
                    break
                chunks.append(data)
            elif proc.poll() is not None:
                break
        rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
    return rc, b"".join(chunks).decode(errors="replace")


def read_samples_of(store: Store, run: str):
    from shared.records import read_samples

    for key in store.list(f"runs/{run}/tokenized/"):
        if key.endswith(".parquet"):
            yield from read_samples(store.get_bytes(key))


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
    tokenized = sorted(store.list(f"runs/{run}/tokenized/"))  # shards, and the lists of what they dropped
    assert completions and len([k for k in tokenized if k.endswith(".parquet")]) == len(completions)
    assert store.exists(Keys.checkpoint(run, 6) + "drafter/model.safetensors")
    report = msgspec.json.decode(store.get_bytes(Keys.eval_report(run)), type=EvalReport)
    assert report.lossless and report.prompts >= 1 and report.tau >= 1.0
    assert "eval: τ =" in out and f"runs/{run}/checkpoints/" in out  # the report and where artifacts are
    assert "what to expect on this CPU" in out  # generators on CPU: how to read a 135M target's τ and speedup
    samples = sum(1 for _ in read_samples_of(store, run))
    assert f"run {run}: 12 of 12 prompts completed (1 rejected at feed, 0 dead letters); {samples} training samples " \
           "kept of 12 records" in out, out[-3000:]
    checkpoints = sorted(store.list(f"runs/{run}/checkpoints/"))

    # the same command again, this time on a terminal: the live display, and nothing redone
    rc, raw = _dflash_run_on_a_terminal(stack_env, run, prompts, config)
    out2 = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", raw)
    assert rc == 0, out2[-4000:]
    assert "\x1b[" in raw and "━" in out2  # rich drew bars with cursor control, not the plain log lines
    assert not re.search(r"^\[\d\d:\d\d:\d\d\] fed", out2, re.M)
    bars = {line.split()[0]: line for line in out2.splitlines() if "━" in line and line.split()[0] in
            ("fed", "generated", "tokenized", "trained")}
    assert " 12/12 " in bars["generated"] and " 6/6 " in bars["trained"], bars  # per-stage counts
    assert "1 rejected" in bars["fed"] and "samples" in bars["tokenized"], bars
    assert sorted(store.list(f"runs/{run}/completions/")) == completions  # nothing regenerated
    assert sorted(store.list(f"runs/{run}/tokenized/")) == tokenized
    assert sorted(store.list(f"runs/{run}/checkpoints/")) == checkpoints  # not trained again
    assert "eval: τ =" in out2
