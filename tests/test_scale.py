"""The trainer's data plane against the reference dedupe rule on real S3, and bench/scale.py at a small size
(the same code path the 914K benchmark runs: synthetic generators, kill -9 of a generator and the tokenizer)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import make_config

from services.trainer.data import SampleIndex, ShardCache, held_out
from shared.records import TokenizedSample, dedupe_samples, samples_to_parquet
from shared.store import Store

ROOT = Path(__file__).resolve().parents[1]


def _shards(run: str, rng: random.Random, first: int, count: int) -> dict[str, list[TokenizedSample]]:
    out = {}
    for k in range(first, first + count):
        samples = []
        for _ in range(rng.randint(1, 9)):
            n = rng.randint(1, 12)
            mask = [rng.randint(0, 1) for _ in range(n)]
            samples.append(TokenizedSample(prompt_id=f"p{rng.randint(0, 15):03d}", input_ids=[rng.randint(0, 999)
                           for _ in range(n)], loss_mask=mask, num_tokens=n, num_supervised=sum(mask),
                           generation=rng.randint(0, 2)))
        out[f"runs/{run}/tokenized/fp/w{k:03d}.parquet"] = samples
    return out


def test_sample_index_keeps_dedupe_samples_rule_and_fetches_only_new_shards(stack, tmp_path: Path) -> None:
    cfg = make_config(stack)
    store = Store.open(cfg)
    rng = random.Random(7)
    shards = _shards(cfg.run, rng, 0, 6)
    for key, samples in shards.items():
        store.put_bytes(key, samples_to_parquet(samples))
    index = SampleIndex(store, ShardCache(tmp_path / "cache"))
    for mod in (0, 3):
        for train in (True, False):
            want = sorted((s for s in dedupe_samples(shards.items()).values()
                           if s.num_supervised >= 2 and held_out(s.prompt_id, mod) != train), key=lambda s: s.prompt_id)
            assert list(index.select(list(shards), holdout_mod=mod, train=train)) == want
    more = _shards(cfg.run, rng, 6, 3)  # the data grows: a regeneration or two among them
    for key, samples in more.items():
        store.put_bytes(key, samples_to_parquet(samples))
    assert index.add(list(shards) + list(more)) == 3  # only the new shards are fetched
    everything = {**shards, **more}
    got = index.select(list(everything), holdout_mod=0, train=True)
    assert list(got) == sorted((s for s in dedupe_samples(everything.items()).values() if s.num_supervised >= 2),
                               key=lambda s: s.prompt_id)
    # no per-token state in memory: the set's size does not depend on the samples' lengths
    assert got.memory_bytes() < 100 * len(got)


def test_a_shard_written_again_under_its_key_is_not_served_from_the_disk_cache(stack, tmp_path: Path) -> None:
    """A run deleted and run again under its name writes new objects under the same keys: a trainer on the
    node that cached the old ones must read the new ones."""
    cfg = make_config(stack)
    store = Store.open(cfg)
    rng = random.Random(7)
    (key, old), = _shards(cfg.run, rng, 0, 1).items()
    store.put_bytes(key, samples_to_parquet(old))
    want = lambda samples: sorted((s for s in dedupe_samples([(key, samples)]).values()  # noqa: E731
                                   if s.num_supervised >= 2), key=lambda s: s.prompt_id)
    assert list(SampleIndex(store, ShardCache(tmp_path / "cache")).select([key], holdout_mod=0, train=True)) == want(old)
    store.delete(key)
    (_, new), = _shards(cfg.run, rng, 0, 1).items()
    assert want(new) != want(old)
    store.put_bytes(key, samples_to_parquet(new))
    again = SampleIndex(store, ShardCache(tmp_path / "cache"))  # a restarted trainer, same node, same cache
    assert list(again.select([key], holdout_mod=0, train=True)) == want(new)


@pytest.mark.stack  # runs bench/scale.py's stack and services
def test_scale_bench_small_size_ends_exactly_once_after_kill9(tmp_path: Path) -> None:
    out = tmp_path / "scale.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "scale.py"), "--prompts", "2000", "--steps", "1",
                           "--results", str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())["sizes"]["2000"]
    once = r["exactly_once"]
    assert once["accepted"] == once["completed_unique"] == 2000 and once["dead_lettered"] == 0
    assert once["trainer_rows"] == once["trainer_unique_prompts"] == once["tokenized_kept"]
    assert once["one_sample_per_kept_prompt"] and once["status_calls_agree"]
    assert [k["service"] for k in r["faults"]] == ["generator-1", "tokenizer"]
    assert r["restarts"] == {"generator-1": 1, "tokenizer": 1}
    assert r["trainer"]["optimizer_steps"] == 1 and r["trainer"]["pass_steps"] > 0
