"""The run ledger on the real stack: the same numbers as a full replay of the logs, from a fresh fold, a warm
one, a snapshot plus its tail, and a snapshot that cannot be used; and the work per refresh is the new events."""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import logging
import os
import random
import subprocess
import sys
from collections import Counter
from typing import Any

import msgspec
import nats.errors as nats_errors
import pytest

import shared.ledger as ledger_mod
from shared.bus import Bus
from shared.config import Config
from shared.exits import Exit
from shared.ledger import SCHEMA, Ledger, PromptSet, RunLedger, prompt_hash, prompt_hashes
from shared.messages import Alert, DeadLetter, Message, ShardWritten, TokenizedShard
from shared.status import run_overview, run_status
from shared.store import Store
from shared.topology import ANY, Keys, Subjects

# --- the reference: the replay every status call made before the ledger, with plain Python sets --------


async def replay_from_start(cfg: Config, bus: Bus, store: Store) -> dict[str, Any]:
    """Every number status and the run overview take from the logs, replayed from sequence 1 the way
    `run_status` did before the ledger (prompt ids kept as strings: no hashing)."""
    run = cfg.run
    manifest = None
    if store.exists(Keys.manifest(run)):
        manifest = msgspec.json.decode(store.get_bytes(Keys.manifest(run)))
    prompts: set[str] = set()
    shard_keys: set[str] = set()
    records = 0
    workers: dict[str, list[int]] = {}  # worker -> [records, completion tokens, shards]
    tokenized: dict[str, TokenizedShard] = {}
    async for _, e in bus.read_log("SHARDS", Subjects.shards(run), 1, ShardWritten):
        if e.key not in shard_keys:
            shard_keys.add(e.key)
            records += e.num_records
            mine = workers.setdefault(e.worker, [0, 0, 0])
            mine[0], mine[1], mine[2] = mine[0] + e.num_records, mine[1] + e.completion_tokens, mine[2] + 1
            prompts.update(e.prompt_ids)
    async for _, e in bus.read_log("TOKENIZED", Subjects.tokenized(run), 1, TokenizedShard):
        if e.source_key not in tokenized or tokenized[e.source_key].key != e.key:
            tokenized[e.source_key] = e
    dropped: Counter[str] = Counter()
    hist: Counter[str] = Counter()
    for t in tokenized.values():
        dropped.update(t.dropped)
        hist.update(t.supervised_histogram)
    dead: dict[str, int] = {}
    for _, letter in await bus.dead_letters(run):
        dead[letter.stage] = dead.get(letter.stage, 0) + 1
    latest: dict[tuple[str, str, str], Alert] = {}
    async for _, a in bus.read_log("PROGRESS", Subjects.alert(run, ANY), 1, Alert):
        latest[(a.stage, a.kind, a.worker)] = a
    kept = sum(t.num_samples for t in tokenized.values())
    return {
        "total": int(manifest["total_accepted"]) if manifest else 0,
        "rejects": int(manifest["total_rejected"]) if manifest else 0,
        "completed": len(prompts), "completion_records": records, "shards": len(shard_keys), "workers": workers,
        "tokenized_samples": kept, "tokenized_shards": len(tokenized),
        "tokenized_records": kept + sum(dropped.values()),
        "dropped": dict(+dropped), "dead_lettered": dead, "alerts": [msgspec.to_builtins(a) for a in latest.values()],
        "histogram": dict(+hist), "drift": sum(t.retokenization_drift for t in tokenized.values()),
        "supervised_tokens": sum(t.num_supervised for t in tokenized.values()),
        "overview": {"fed": manifest is not None, "shards": len(shard_keys),
                    "tokenized_shards": len(tokenized.keys() & shard_keys),
                    "tokenized_samples": sum(t.num_samples for k, t in tokenized.items() if k in shard_keys),
                    "tokenize_dead": dead.get("tokenize", 0)},
    }


async def ledger_numbers(cfg: Config, bus: Bus, store: Store, ledger: RunLedger) -> dict[str, Any]:
    p = await run_overview(cfg, bus, store, ledger)
    st = p.status
    assert ledger.ledger is not None
    c = ledger.ledger.counts()
    return {
        "total": st.total, "rejects": st.rejects, "completed": st.completed,
        "completion_records": st.completion_records, "shards": st.shards,
        "workers": {w: [t.records, t.completion_tokens, t.shards] for w, t in ledger.ledger.workers.items()},
        "tokenized_samples": st.tokenized_samples,
        "tokenized_shards": st.tokenized_shards, "tokenized_records": st.tokenized_records, "dropped": st.dropped,
        "dead_lettered": st.dead_lettered, "alerts": [msgspec.to_builtins(a) for a in st.alerts],
        "histogram": c.histogram, "drift": c.drift, "supervised_tokens": c.supervised_tokens,
        "overview": {"fed": p.stages.fed, "shards": p.stages.shards, "tokenized_shards": p.stages.tokenized_shards,
                     "tokenized_samples": p.tokenized_samples, "tokenize_dead": p.stages.tokenize_dead},
    }


# --- a run's logs, with everything that makes counting hard --------------------------------------------


def run_events(run: str, shards: int, seed: int, first: int = 0) -> list[tuple[str, Message]]:
    """Shards `first`..`first+shards-1`: prompts completed twice across shards (redeliveries), shards announced
    twice, tokenized shards announced twice, re-tokenized under a new key, and some before their shard's event."""
    rng = random.Random(seed)
    pool = [f"{rng.getrandbits(256):064x}" for _ in range(shards * 8)]
    out: list[tuple[str, Message]] = []
    for i in range(first, first + shards):
        key = Keys.completions(run, f"w{i % 3}", i)
        ids = rng.sample(pool, rng.randint(3, 12))
        written = ShardWritten(run=run, key=key, worker=f"w{i % 3}", seq=i, num_records=len(ids) + i % 2,
                               prompt_ids=ids, completion_tokens=17 * len(ids) + i, sha256="0" * 64, size_bytes=100,
                               ts=1000.0 + i)
        tokenized = TokenizedShard(
            run=run, key=Keys.tokenized(run, "fp1", f"s{i}"), source_key=key, fingerprint="fp1",
            num_samples=len(ids) - i % 3, num_tokens=100 * len(ids), num_supervised=40 * len(ids), sha256="1" * 64,
            dropped={"duplicate": i % 2, "below_min_supervised": i % 3} if i % 4 else {},
            retokenization_drift=int(i % 5 == 0), supervised_histogram={"64": len(ids) - i % 3}, ts=1000.5 + i)
        if i % 7 == 3:  # tokenized shard's event first
            out.append((Subjects.tokenized(run), tokenized))
        out.append((Subjects.shards(run), written))
        if i % 5 == 1:
            out.append((Subjects.shards(run), written))  # announced again
        if i % 7 != 3 and i % 6 != 5:  # some shards never tokenized
            out.append((Subjects.tokenized(run), tokenized))
        if i % 9 == 2:
            out.append((Subjects.tokenized(run), msgspec.structs.replace(tokenized, dropped={}, ts=1001.0 + i)))
        if i % 8 == 4:  # a re-tokenization (another fingerprint) replaces it
            out.append((Subjects.tokenized(run), msgspec.structs.replace(
                tokenized, key=Keys.tokenized(run, "fp2", f"s{i}"), fingerprint="fp2", num_samples=1,
                dropped={"template_error": 2}, supervised_histogram={"0": 1}, ts=1002.0 + i)))
        if i % 10 == 6:
            stage = "tokenize" if i % 20 == 6 else "generate"
            out.append((Subjects.deadletter(run, stage), DeadLetter(
                run=run, stage=stage, stream="SHARDS", subject=Subjects.shards(run), consumer=f"{stage}-{run}",
                stream_seq=i, num_delivered=5, error="boom", payload=b"x")))
        if i % 11 == 7:
            out.append((Subjects.alert(run, "tokenize"), Alert(
                run=run, stage="tokenize", kind="quality_gate", worker=f"tok{i % 2}", message=f"gate at shard {i}")))
    return out


async def publish(bus: Bus, events: list[tuple[str, Message]]) -> None:
    await bus.publish_many([(subject, msg, None) for subject, msg in events])


def put_manifest(store: Store, run: str, accepted: int) -> None:
    store.put_bytes(Keys.manifest(run), json.dumps({"total_accepted": accepted, "total_rejected": 3}).encode())


# --- tests --------------------------------------------------------------------------------------------------


@pytest.mark.stack  # hashes in fresh processes
def test_prompt_hashes_are_stable_across_processes_and_keep_structured_ids_apart() -> None:
    ids = [f"{i:064x}" for i in range(50_000)] + [hashlib.sha256(b"x").hexdigest(), "p1", "g" * 64]
    hashes = prompt_hashes(ids)
    assert hashes == [prompt_hash(p) for p in ids] and len(set(hashes)) == len(ids)  # padded counters too
    assert prompt_hashes(["p1", ids[0]]) == [prompt_hash("p1"), prompt_hash(ids[0])]  # a mixed shard
    code = "import sys; from shared.ledger import prompt_hash; print(prompt_hash(sys.argv[1]), prompt_hash(sys.argv[2]))"
    for seed in ("1", "2"):  # str hashing is salted per process; these must not be
        out = subprocess.run([sys.executable, "-c", code, ids[7], "p1"], capture_output=True, text=True, check=True,
                             env={**os.environ, "PYTHONHASHSEED": seed})
        assert out.stdout.split() == [str(prompt_hash(ids[7])), str(prompt_hash("p1"))]


def test_prompt_set_from_a_snapshot_counts_like_a_set() -> None:
    rng = random.Random(0)
    values = [rng.getrandbits(64) for _ in range(20_000)]
    first = PromptSet()
    first.update(values[:10_000] + values[:100])
    loaded, reference = PromptSet(first.sorted_array()), set(values[:10_000])
    for i in range(10_000, 20_000, 50):
        chunk = values[i:i + 50] + rng.sample(values[:i], 5)  # new ones, and some already counted
        loaded.update(chunk)
        reference.update(chunk)
        assert len(loaded) == len(reference)
    assert loaded.sorted_array().tolist() == sorted(reference)


async def test_ledger_matches_a_full_replay_fresh_warm_and_from_snapshot_plus_tail(cfg, bus, store) -> None:
    run = cfg.run
    await publish(bus, run_events(run, 60, seed=1))
    put_manifest(store, run, 500)
    expected = await replay_from_start(cfg, bus, store)
    assert expected["completed"] < sum(len(e.prompt_ids) for _, e in run_events(run, 60, 1) if isinstance(e, ShardWritten))
    assert expected["dead_lettered"].keys() == {"generate", "tokenize"} and len(expected["alerts"]) == 2
    assert expected["dropped"] and expected["histogram"] and expected["overview"]["tokenized_shards"] < expected["shards"]

    fresh = RunLedger(cfg, bus, store)
    assert await ledger_numbers(cfg, bus, store, fresh) == expected
    assert fresh.source == "logs"
    await fresh.save()

    # More events: the warm ledger folds only them; a fresh one folds the snapshot's tail only.
    more = run_events(run, 25, seed=2, first=60)
    await publish(bus, more)
    put_manifest(store, run, 520)
    expected = await replay_from_start(cfg, bus, store)
    before = fresh.folded
    assert await ledger_numbers(cfg, bus, store, fresh) == expected
    folded = [e for _, e in more if isinstance(e, ShardWritten | TokenizedShard | Alert)]
    assert fresh.folded - before == len(folded)
    cold = RunLedger(cfg, bus, store)
    assert await ledger_numbers(cfg, bus, store, cold) == expected
    assert cold.source == "snapshot" and cold.folded == len(folded)
    again = await cold.refresh()
    assert cold.folded == len(folded) and again.completed == expected["completed"]  # nothing new: nothing folded
    rebuilt = RunLedger(cfg, bus, store)
    await rebuilt.rebuild()
    assert await ledger_numbers(cfg, bus, store, rebuilt) == expected


async def test_status_cli_in_a_fresh_process_reads_snapshot_plus_tail(cfg, bus, store, stack_env) -> None:
    run = cfg.run
    await publish(bus, run_events(run, 30, seed=3))
    put_manifest(store, run, 200)
    first = RunLedger(cfg, bus, store)
    await first.refresh()
    await first.save()
    await publish(bus, run_events(run, 10, seed=4, first=30))
    expected = await replay_from_start(cfg, bus, store)
    out = subprocess.run([sys.executable, "-m", "shared.cli", "status", "--run", run, "--json"], env=stack_env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode in (Exit.OK, Exit.ALERT), out.stderr  # ALERT: a critical alert (the quality gate) is among them
    st = msgspec.json.decode(out.stdout)
    for k in ("total", "completed", "completion_records", "shards", "tokenized_samples", "tokenized_shards",
              "tokenized_records", "dropped", "dead_lettered"):
        assert st[k] == expected[k], k
    assert st["alerts"] == json.loads(json.dumps(expected["alerts"]))


def _snapshot_with_schema(data: bytes, schema: int) -> bytes:
    head = len(ledger_mod.MAGIC)
    return data[:head] + schema.to_bytes(4, "little") + data[head + 4:]


@pytest.mark.parametrize("fault", ["garbage", "older_schema", "checksum", "other_run", "ahead_of_logs", "truncated"])
async def test_an_unusable_snapshot_is_rebuilt_from_the_logs_with_a_warning(cfg, bus, store, fault, caplog) -> None:
    run = cfg.run
    await publish(bus, run_events(run, 20, seed=5))
    put_manifest(store, run, 90)
    expected = await replay_from_start(cfg, bus, store)
    good = RunLedger(cfg, bus, store)
    await good.refresh()
    data = good.ledger.encode()
    key = Keys.ledger(run)
    if fault == "garbage":
        store.put_bytes(key, b"\x00not a snapshot" * 10)
    elif fault == "older_schema":
        store.put_bytes(key, _snapshot_with_schema(data, SCHEMA - 1))
    elif fault == "checksum":  # the bytes changed after they were written: the store's sha256 check refuses them
        bad = bytearray(data)
        bad[-5] ^= 0xFF
        store.client.put_object(store.bucket, key, io.BytesIO(bytes(bad)), len(bad),
                                metadata={"sha256": hashlib.sha256(data).hexdigest()})
    elif fault == "other_run":
        other = Ledger("someone-else")
        other.prompts.update([1, 2, 3])
        store.put_bytes(key, other.encode())
    elif fault == "ahead_of_logs":  # a snapshot from before the streams were recreated: its sequences run ahead
        ahead = Ledger.decode(data, run)
        ahead.cursor = {s: n + 10_000 for s, n in ahead.cursor.items()}
        ahead.prompts.add(7)  # a number that would be wrong
        store.put_bytes(key, ahead.encode())
    else:
        store.put_bytes(key, data[: len(data) // 2])
    caplog.set_level(logging.WARNING, logger="dflash.ledger")
    cold = RunLedger(cfg, bus, store)
    assert await ledger_numbers(cfg, bus, store, cold) == expected
    assert cold.source.startswith("rebuilt"), cold.source
    assert any(r.name == "dflash.ledger" and r.levelno == logging.WARNING for r in caplog.records)  # said so
    # The unusable snapshot is replaced by a good one at the rebuilding reader's next chance.
    await cold.flush()
    assert Ledger.decode(store.get_bytes(key), run).completed == expected["completed"]


async def test_a_reader_writes_a_snapshot_once_it_has_folded_enough(cfg, bus, store, monkeypatch) -> None:
    monkeypatch.setattr(ledger_mod, "SNAPSHOT_AFTER_EVENTS", 20)
    monkeypatch.setattr(ledger_mod, "SNAPSHOT_EVERY_S", 0.0)
    run = cfg.run
    reader = RunLedger(cfg, bus, store)
    await publish(bus, run_events(run, 5, seed=6))
    await reader.refresh()
    await reader.flush()
    assert not store.exists(Keys.ledger(run))  # under 20 events folded
    await publish(bus, run_events(run, 20, seed=7, first=5))
    fold = await reader.refresh()
    await reader.flush()
    snap = Ledger.decode(store.get_bytes(Keys.ledger(run)), run)
    assert snap.cursor == fold.cursor and snap.counts() == fold.counts()
    st = await run_status(cfg, bus, store)  # a fresh reader from that snapshot
    assert st.completed == fold.completed and st.shards == len(fold.shard_keys)


@pytest.mark.stack  # starts and restarts its own stack
async def test_the_ledger_survives_restarts_of_nats_and_s3(tmp_path) -> None:
    """Its own stack: both servers stopped and started again on their data. A long-lived ledger goes on from
    its sequences (the streams keep them and their creation time), a fresh one from the snapshot in S3."""
    from shared.stack import EmbeddedStack, Ports
    from tests.conftest import make_config

    s = EmbeddedStack(tmp_path, Ports.free())
    s.start()
    try:
        cfg = make_config(s)
        store = Store.open(cfg)
        async with await Bus.connect(cfg.bus, "pytest-restart", deadline_s=10) as bus:
            await bus.ensure_streams()
            await publish(bus, run_events(cfg.run, 20, seed=8))
            put_manifest(store, cfg.run, 150)
            warm = RunLedger(cfg, bus, store)
            await warm.refresh()
            await warm.save()
            for name in ("nats", "s3"):
                s.stop_component(name)
            s.start_nats()
            s.start_s3()
            s.wait_healthy(60)
            for _ in range(60):  # the client reconnects on its own
                try:
                    await asyncio.wait_for(bus.js.stream_info("SHARDS"), 2)
                    break
                except (TimeoutError, ConnectionError, nats_errors.Error):
                    await asyncio.sleep(0.5)
            more = run_events(cfg.run, 10, seed=9, first=20)
            for subject, msg in more:  # one by one: publish_many's async acks hung once right after the restart
                await bus.publish(subject, msg)
            expected = await replay_from_start(cfg, bus, store)
            before = warm.folded
            assert await ledger_numbers(cfg, bus, store, warm) == expected
            assert warm.folded - before == sum(isinstance(e, ShardWritten | TokenizedShard | Alert) for _, e in more)
            cold = RunLedger(cfg, bus, store)
            assert await ledger_numbers(cfg, bus, store, cold) == expected and cold.source == "snapshot"
    finally:
        s.stop()
