"""The tokenizer service end to end on the real stack (nats-server + SeaweedFS) with the real SmolLM2 tokenizer.

Completion shards are written and announced the way the generator does it (Parquet from
`completions_to_parquet` at `Keys.completions`, `ShardWritten` from `services.generator.shards.shard_event`),
the service runs in burst mode, and its outputs are read back from S3 with pandas and `datasets`:
a normal run (dedupe, drop counts, token-exact ids, masks), the real incident (87% "OK.") tripping
the quality gate, token-exact vs re-tokenized on SmolLM2's own output, corrupt shards dead-lettered
while the others go on, and a replay under a fixed template that never overwrites the old output.
"""

from __future__ import annotations

import asyncio
import io
import random
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

from services.generator.shards import shard_event
from services.tokenizer.fingerprint import load_target_tokenizer
from services.tokenizer.replay import replay_tokenize
from services.tokenizer.samples import SampleBuilder
from services.tokenizer.service import TokenizerService, run_service, shard_name
from shared.bus import Bus
from shared.config import Config
from shared.exits import Exit
from shared.messages import Alert, ShardWritten, TokenizedShard, TokenizerProgress
from shared.records import (
    ChatMessage,
    CompletionRecord,
    completions_to_parquet,
    read_sample_generations,
    read_samples,
    read_samples_summary,
)
from shared.status import format_status, run_status
from shared.store import SHA_META, Store, sha256_bytes
from shared.topology import Keys, Streams, Subjects, durable
from tests.conftest import make_config

ROOT = Path(__file__).resolve().parents[1]

SYSTEM = "You are a helpful assistant. Answer clearly and in full sentences."
TOPICS = [
    ("photosynthesis", "Photosynthesis is the process by which green plants use sunlight, water and carbon dioxide "
                       "to make glucose and oxygen. It takes place mainly in the chloroplasts of leaf cells, where "
                       "chlorophyll absorbs the light."),
    ("tides", "Tides are the regular rise and fall of the sea, caused mostly by the Moon's gravity pulling on the "
              "oceans. Most coasts see two high tides and two low tides a day, about twelve hours and twenty-five "
              "minutes apart."),
    ("binary search", "Binary search finds an item in a sorted list by repeatedly halving the range: compare the "
                      "target with the middle element, then keep only the half that can still contain it. It needs "
                      "about log2(n) comparisons, so 1,000,000 items take at most 20 steps."),
    ("sourdough", "Sourdough bread rises thanks to a starter, a fermented mix of flour and water full of wild yeast "
                  "and lactic acid bacteria. The bacteria give the bread its tangy flavour, and the long "
                  "fermentation makes the crumb open and chewy."),
    ("volcanoes", "A volcano forms where molten rock, called magma, reaches the surface through a crack in the "
                  "Earth's crust. When pressure builds up, gases and lava escape in an eruption; over time the "
                  "layers of cooled lava and ash build a mountain."),
    ("compilers", "A compiler translates source code into machine code in several stages: it reads the text into "
                  "tokens, parses them into a syntax tree, checks types, optimizes an intermediate form and "
                  "finally emits instructions for the target processor."),
    ("jazz", "Jazz began in New Orleans in the early twentieth century, mixing blues, ragtime and brass band "
             "music. Its hallmarks are swing rhythms, blue notes and improvisation, where players invent melodies "
             "on the spot over a shared chord progression."),
    ("prime numbers", "A prime number is a whole number greater than 1 whose only divisors are 1 and itself, like 2, "
                      "3, 5, 7 and 11. Every whole number above 1 can be written as a product of primes in exactly "
                      "one way, which is why they matter so much in number theory."),
]


def record(run: str, pid: str, question: str, answer: str, *, system: bool = False, **kw) -> CompletionRecord:
    msgs = ([ChatMessage(role="system", content=SYSTEM)] if system else []) + [ChatMessage(role="user", content=question)]
    return CompletionRecord(run=run, prompt_id=pid, messages=msgs, completion=answer, engine="hf", model="smollm2",
                            completion_tokens=len(answer) // 4, **kw)


def topic_record(run: str, i: int, **kw) -> CompletionRecord:
    topic, answer = TOPICS[i % len(TOPICS)]
    return record(run, f"p{i:05d}", f"Explain {topic} in two or three sentences. (question {i})", answer,
                  system=i % 2 == 0, **kw)


def answer_of(pid: str) -> str:
    return TOPICS[int(pid[1:]) % len(TOPICS)][1]


async def write_shard(bus: Bus, store: Store, run: str, worker: str, seq: int, records: list[CompletionRecord],
                      *, event_sha: str | None = None) -> ShardWritten:
    """What the generator's ShardWriter does: Parquet into S3 at the deterministic key, then ShardWritten."""
    key = Keys.completions(run, worker, seq)
    data = completions_to_parquet(records)
    info, _ = await asyncio.to_thread(store.put_new, key, data)
    return await announce(bus, run, key, worker, seq, records, event_sha or info.sha256, len(data))


async def announce(bus: Bus, run: str, key: str, worker: str, seq: int, records: list[CompletionRecord], sha: str,
                   size: int) -> ShardWritten:
    event = shard_event(run, key, worker, seq, records, sha, size)
    await bus.publish(Subjects.shards(run), event, msg_id=key)
    return event


async def tokenized_events(bus: Bus, run: str) -> list[TokenizedShard]:
    return [e async for _, e in bus.read_log("TOKENIZED", Subjects.tokenized(run), 1, TokenizedShard)]


async def burst(cfg: Config, tok):
    """`dfpipe tokenize --run R --burst`, in process (own stop event: no signal handlers in pytest)."""
    return await asyncio.wait_for(
        run_service(cfg, burst=True, stop=asyncio.Event(), progress_every_s=0.5, tokenizer=tok), 120)


def masked_text(tok, ids, mask) -> str:
    return tok.decode([t for t, m in zip(ids, mask, strict=True) if m], skip_special_tokens=False,
                      clean_up_tokenization_spaces=False)


def parquet_keys(store: Store, run: str) -> list[str]:
    return sorted(k for k in store.list(f"runs/{run}/tokenized/") if k.endswith(".parquet"))


def cli(stack_env: dict, *args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shared.cli", *args], cwd=ROOT, env={**stack_env, **(env or {})},
                          capture_output=True, text=True, timeout=timeout)


# --- a normal run ----------------------------------------------------------------------------------
# One run of three completion shards, tokenized once per session (`normal_run`), then checked behaviour by
# behaviour: the shards and their loading, the events, the masks, the counts, the drops, a re-announcement.


@dataclass
class NormalRun:
    cfg: Config
    tok: Any
    exact_answer: str
    exact_ids: list[int]
    odd_ids: list[int]
    shards: list[ShardWritten]  # the three completion shards' events
    service: TokenizerService
    keys: list[str]  # the tokenized shards
    frames: list[Any]  # each tokenized shard as a pandas frame
    rows: dict[str, dict]  # prompt_id -> row, as `datasets` loads them
    progress: list[Any]  # the tokenizer's last progress after the burst

    @property
    def run(self) -> str:
        return self.cfg.run


_normal_run: list[NormalRun] = []


async def normal_run(stack, bus: Bus, store: Store, tmp_path_factory) -> NormalRun:
    """Three completion shards (duplicates, a too-short answer, a truncated one, exact and non-canonical engine
    ids), tokenized by one burst of the service; made once, on the first test that asks."""
    if _normal_run:
        return _normal_run[0]
    import datasets
    import pandas as pd

    cfg = make_config(stack)  # default policy: min_supervised_tokens = 2 x block size = 32
    run = cfg.run
    tok = await asyncio.to_thread(load_target_tokenizer, cfg)
    exact_answer = TOPICS[2][1]
    exact_ids = tok(exact_answer, add_special_tokens=False)["input_ids"]
    # An engine may emit a valid but non-canonical tokenization of its text: the first word letter by letter.
    first, rest = exact_answer.split(" ", 1)
    odd_ids = [tok.convert_tokens_to_ids(c) for c in first] + tok(" " + rest, add_special_tokens=False)["input_ids"]
    assert tok.decode(odd_ids) == exact_answer and odd_ids != exact_ids

    s0 = [topic_record(run, i) for i in range(4)]
    s0.append(record(run, "exact-with-stop", "How does binary search work?", exact_answer,
                     output_ids=[*exact_ids, tok.eos_token_id]))
    s1 = [topic_record(run, i) for i in range(4, 7)]
    s1.append(record(run, "exact-trimmed", "Describe binary search.", exact_answer, output_ids=exact_ids))
    s1.append(topic_record(run, 1))  # p00001 again: completed twice (a redelivery), kept once
    s1.append(record(run, "ok", "Is that clear?", "OK."))  # the incident's answer: too few supervised tokens
    s2 = [topic_record(run, i) for i in range(7, 10)]
    s2.append(record(run, "drifting", "Binary search, please.", exact_answer, output_ids=[*odd_ids, tok.eos_token_id]))
    s2.append(record(run, "cut", "Tell me about jazz.", TOPICS[6][1][:120], finish_reason="length"))
    shards = [await write_shard(bus, store, run, "gen-0", 0, s0), await write_shard(bus, store, run, "gen-0", 1, s1),
              await write_shard(bus, store, run, "gen-1", 0, s2)]

    service = await burst(cfg, tok)
    assert service.tripped is None and service.counts.shards == 3
    progress = [p for _, p in await bus.latest_per_subject(Streams.PROGRESS,
                                                           Subjects.progress(run, "tokenize", "tokenizer"))]
    keys = parquet_keys(store, run)
    tmp = tmp_path_factory.mktemp("normal-run")
    local = []
    for k in keys:
        path = tmp / k.rsplit("/", 1)[-1]
        path.write_bytes(store.get_bytes(k))
        local.append(str(path))
    ds = datasets.load_dataset("parquet", data_files=local, split="train", cache_dir=str(tmp / "hf"))
    assert ds.features["input_ids"].feature.dtype == "int32"
    _normal_run.append(NormalRun(cfg, tok, exact_answer, exact_ids, odd_ids, shards, service, keys,
                                 [pd.read_parquet(p) for p in local], {r["prompt_id"]: r for r in ds}, progress))
    return _normal_run[0]


async def normal_run_events(bus: Bus, n: NormalRun) -> list[TokenizedShard]:
    """The TokenizedShard event of each completion shard, in the shards' order."""
    events = {e.source_key: e for e in await tokenized_events(bus, n.run)}
    assert set(events) == {e.key for e in n.shards}
    return [events[s.key] for s in n.shards]


async def test_normal_run_writes_one_loadable_deduped_shard_per_completion_shard(stack, bus, store, tmp_path_factory):
    n = await normal_run(stack, bus, store, tmp_path_factory)
    fp, run = n.service.fingerprint, n.run
    assert n.keys == sorted(Keys.tokenized(run, fp, shard_name(e.key)) for e in n.shards)
    assert n.keys == [f"runs/{run}/tokenized/{fp}/gen-0.00000000.parquet",
                      f"runs/{run}/tokenized/{fp}/gen-0.00000001.parquet",
                      f"runs/{run}/tokenized/{fp}/gen-1.00000000.parquet"]
    # Loadable with pandas and datasets (from local copies), int32 ids, the documented columns.
    for df in n.frames:
        assert {"prompt_id", "input_ids", "loss_mask", "num_tokens", "num_supervised"} <= set(df.columns)
        assert all(np.asarray(ids).dtype == np.int32 for ids in df["input_ids"])
        assert (df["num_tokens"] == df["input_ids"].map(len)).all()
        assert (df["num_supervised"] == df["loss_mask"].map(lambda m: int(np.sum(m)))).all()
    ids_all = [pid for df in n.frames for pid in df["prompt_id"]]
    assert sorted(ids_all) == sorted(n.rows) and len(ids_all) == 5 + 4 + 4  # every kept prompt once
    assert ids_all.count("p00001") == 1  # the duplicate across shards appears once
    assert "ok" not in ids_all and "cut" not in ids_all


async def test_normal_run_announces_each_shard_with_its_drops_and_drift(stack, bus, store, tmp_path_factory):
    n = await normal_run(stack, bus, store, tmp_path_factory)
    e0, e1, e2 = await normal_run_events(bus, n)
    assert (e0.num_samples, e0.dropped, e0.retokenization_drift) == (5, {}, 0)
    assert (e1.num_samples, e1.dropped, e1.retokenization_drift) == (4, {"duplicate": 1, "below_min_supervised": 1}, 0)
    assert (e2.num_samples, e2.dropped, e2.retokenization_drift) == (4, {"truncated_generation": 1}, 1)
    for ev, df in zip((e0, e1, e2), n.frames, strict=True):
        assert ev.fingerprint == n.service.fingerprint and ev.key in n.keys
        assert ev.num_tokens == int(df["num_tokens"].sum()) and ev.num_supervised == int(df["num_supervised"].sum())
        assert ev.sha256 == store.stat(ev.key).sha256
        # the histogram counts the kept samples and those dropped after tokenizing ("ok"), not duplicates
        assert sum(ev.supervised_histogram.values()) == ev.num_samples + ev.dropped.get("below_min_supervised", 0)
    assert e1.supervised_histogram["2"] == 1  # "OK." + <|im_end|>: 3 supervised tokens


async def test_normal_run_masks_the_answer_and_keeps_the_engines_ids(stack, bus, store, tmp_path_factory):
    n = await normal_run(stack, bus, store, tmp_path_factory)
    tok = n.tok
    # Masks: decoding the masked tokens gives the assistant's answer plus the end-of-turn token, nothing else.
    for pid, row in n.rows.items():
        answer = n.exact_answer if pid.startswith(("exact", "drift")) else answer_of(pid)
        assert masked_text(tok, row["input_ids"], row["loss_mask"]) == answer + tok.eos_token, pid
        assert row["loss_mask"][-1] == 0 and tok.decode(row["input_ids"][-1:]) == "\n"  # template tail, unmasked
    # Token-exact: canonical engine ids (stop token kept, or trimmed by the engine) give the re-tokenized sample;
    # non-canonical ones are used as they are (and counted as drift).
    retok = SampleBuilder(tok, n.cfg).build([record(n.run, "x", "How does binary search work?",
                                                    n.exact_answer)]).samples[0]
    with_stop = n.rows["exact-with-stop"]
    assert (with_stop["input_ids"], with_stop["loss_mask"]) == (retok.input_ids, retok.loss_mask)
    trimmed = n.rows["exact-trimmed"]
    assert [t for t, m in zip(trimmed["input_ids"], trimmed["loss_mask"], strict=True) if m] == [*n.exact_ids, 2]
    drifting = n.rows["drifting"]
    assert [t for t, m in zip(drifting["input_ids"], drifting["loss_mask"], strict=True) if m] == [*n.odd_ids, 2]


async def test_normal_run_progress_and_status_count_the_same(stack, bus, store, tmp_path_factory):
    n = await normal_run(stack, bus, store, tmp_path_factory)
    # Progress says what happened (the last event, published when the service stopped).
    assert len(n.progress) == 1 and isinstance(n.progress[0], TokenizerProgress)
    p = n.progress[0]
    assert (p.shards, p.samples_in, p.samples_kept, p.retokenization_drift, p.state) == (3, 16, 13, 1, "stopped")
    assert p.dropped == {"duplicate": 1, "below_min_supervised": 1, "truncated_generation": 1}
    assert not p.gate_tripped
    # `dfpipe status` reads the same numbers from the shard events.
    st = await run_status(n.cfg, bus, store)
    assert (st.tokenized_samples, st.tokenized_records, st.tokenized_shards) == (13, 16, 3)
    assert st.dropped == {"duplicate": 1, "below_min_supervised": 1, "truncated_generation": 1}
    text = format_status(st)
    assert "13 samples kept of 16 records, 3/3 shards" in text and "below_min_supervised 1" in text, text


async def test_normal_run_drops_are_listed_beside_the_shards(stack, stack_env, bus, store, tmp_path_factory):
    n = await normal_run(stack, bus, store, tmp_path_factory)
    fp, run = n.service.fingerprint, n.run
    # `dfpipe drops` lists the dropped records (not the duplicate) from the per-shard lists beside the shards.
    assert [k.rsplit("/", 1)[1] for k in store.list(Keys.tokenized_prefix(run, fp) + "drops/")] == [
        "gen-0.00000001.jsonl", "gen-1.00000000.jsonl"]  # none for the shard that dropped nothing
    r = cli(stack_env, "drops", "--run", run)
    assert r.returncode == 0, r.stderr
    assert f"{fp}  ok  [below_min_supervised]  'OK.'" in r.stdout and f"{fp}  cut  [truncated_generation]" in r.stdout
    assert "p00001" not in r.stdout and f"{fp}  below_min_supervised: 1" in r.stdout, r.stdout
    r = cli(stack_env, "drops", "--run", run, "--reason", "template_error")
    assert "no dropped records with reason template_error" in r.stdout, r.stdout


async def test_normal_run_reannounces_stored_shards_after_a_restart(stack, bus, store, tmp_path_factory):
    n = await normal_run(stack, bus, store, tmp_path_factory)
    fp, run = n.service.fingerprint, n.run
    events = await normal_run_events(bus, n)
    # Each shard holds its build's summary, from which a re-announcement is made: a restarted tokenizer whose
    # rebuilds differ from the stored shards (every prompt is a duplicate now) announces the stored ones.
    for ev in events:
        summary = read_samples_summary(store.get_bytes(ev.key))
        drops = summary.pop("drops")
        assert summary == {"dropped": ev.dropped, "retokenization_drift": ev.retokenization_drift,
                           "supervised_histogram": ev.supervised_histogram}
        assert len(drops) == sum(k for r, k in ev.dropped.items() if r != "duplicate")
    # The drop lists lost (a crash between the shard and its list): the re-announcement writes them again.
    drops_prefix = Keys.tokenized_prefix(run, fp) + "drops/"
    lists = {k: store.get_bytes(k) for k in store.list(drops_prefix)}
    for k in lists:
        store.delete(k)
    await bus.js.delete_consumer(Streams.SHARDS, durable("tokenize", run))
    again = await burst(n.cfg, n.tok)
    assert again.counts.skipped_shards == 3 and again.counts.shards == 0
    assert {k: store.get_bytes(k) for k in store.list(drops_prefix)} == lists
    # What such a re-announcement publishes (here a duplicate message id, so not stored again): the original event.
    service = TokenizerService(n.cfg, bus, store, n.tok)
    await service.prepare()
    announced = await service.process(n.shards[1])
    assert msgspec.structs.replace(announced, ts=0.0) == msgspec.structs.replace(events[1], ts=0.0)


async def test_a_deliberate_regeneration_replaces_the_old_sample(stack, bus, store):
    """`dfpipe replay generate --shard` re-queues prompts as generation ≥ 1: the tokenizer must emit their new
    completions (not drop them as duplicates, even after a restart) and every reader must pick them."""
    from services.trainer.data import load_samples

    cfg = make_config(stack)
    run = cfg.run
    tok = await asyncio.to_thread(load_target_tokenizer, cfg)
    await write_shard(bus, store, run, "gen-0", 0, [topic_record(run, i) for i in range(4)])
    await burst(cfg, tok)
    new_answer = TOPICS[5][1]
    regen = topic_record(run, 1, generation=1)
    regen.completion = new_answer
    redelivered = topic_record(run, 2)  # the same generation again: still a duplicate
    shard = await write_shard(bus, store, run, "gen-0", 1, [regen, redelivered])
    service = await burst(cfg, tok)  # a fresh service: what it emitted before comes from S3
    assert service.seen == {"p00000": 0, "p00001": 1, "p00002": 0, "p00003": 0}

    event = next(e for e in await tokenized_events(bus, run) if e.source_key == shard.key)
    assert (event.num_samples, event.dropped) == (1, {"duplicate": 1})
    samples = load_samples(store, parquet_keys(store, run), holdout_mod=0, train=True)
    assert [s.prompt_id for s in samples] == ["p00000", "p00001", "p00002", "p00003"]  # one each
    newer = samples[1]
    assert newer.generation == 1 and masked_text(tok, newer.input_ids, newer.loss_mask) == new_answer + tok.eos_token

    # a third completion of generation 1 (the replay's message redelivered) is a duplicate again
    again = topic_record(run, 1, generation=1)
    shard = await write_shard(bus, store, run, "gen-1", 0, [again])
    await burst(cfg, tok)
    event = next(e for e in await tokenized_events(bus, run) if e.source_key == shard.key)
    assert (event.num_samples, event.dropped) == (0, {"duplicate": 1})


async def test_a_stored_shard_whose_announcement_failed_still_counts_for_dedupe(stack, bus, store):
    """The cluster chaos run's duplicate: a NATS leader died between a tokenized shard's write and its event; the
    next shard, holding a redelivered prompt of the first, emitted it again. Stored is emitted, announced or not."""
    cfg = make_config(stack, tokenizer={"processes": 1})
    run = cfg.run
    tok = await asyncio.to_thread(load_target_tokenizer, cfg)
    first = await write_shard(bus, store, run, "gen-0", 0, [topic_record(run, i) for i in range(3)])
    second = await write_shard(bus, store, run, "gen-1", 0, [topic_record(run, 2), topic_record(run, 3)])
    lost = await Bus.connect(cfg.bus, "pytest-lost", deadline_s=10)
    await lost.close()  # a real connection, gone: its publish fails as one to a dead leader does
    service = TokenizerService(cfg, lost, store, tok)
    await service.prepare()
    with pytest.raises(Exception):  # noqa: B017 - whichever error a closed connection raises
        await service.process(first)
    assert len(parquet_keys(store, run)) == 1  # written, not announced
    service.bus = bus
    event = await service.process(second)
    assert (event.num_samples, event.dropped) == (1, {"duplicate": 1})
    again = await service.process(first)  # the redelivery: announced from the stored shard, not rebuilt
    assert again.num_samples == 3 and service.counts.skipped_shards == 1
    rows = [r for k in parquet_keys(store, run) for r in read_sample_generations(store.get_bytes(k))]
    assert sorted(rows) == [(f"p{i:05d}", 0) for i in range(4)]


async def test_a_shard_stored_though_its_write_failed_still_counts_for_dedupe(stack, bus, store):
    """A put whose answer was lost (a volume server or the network gone after the bytes landed) raises, yet the
    shard is stored: before the next shard is built the tokenizer finds out, so the redelivered prompt is not
    emitted twice."""
    from shared.store import StoreUnavailable, resolve_credentials

    class AnswerLost(Store):  # the real S3 stores the shard; only its answer is lost
        def put_new(self, key: str, data: bytes, content_type: str = "application/octet-stream"):
            super().put_new(key, data, content_type)
            raise StoreUnavailable(f"put {key}: the answer was lost (injected)")

    cfg = make_config(stack, tokenizer={"processes": 1})
    run = cfg.run
    tok = await asyncio.to_thread(load_target_tokenizer, cfg)
    first = await write_shard(bus, store, run, "gen-0", 0, [topic_record(run, i) for i in range(3)])
    second = await write_shard(bus, store, run, "gen-1", 0, [topic_record(run, 2), topic_record(run, 3)])
    service = TokenizerService(cfg, bus, AnswerLost(cfg.store, *resolve_credentials(cfg)), tok)
    await service.prepare()
    with pytest.raises(StoreUnavailable):
        await service.process(first)
    service.store = store
    event = await service.process(second)
    assert (event.num_samples, event.dropped) == (1, {"duplicate": 1})
    rows = [r for k in parquet_keys(store, run) for r in read_sample_generations(store.get_bytes(k))]
    assert sorted(rows) == [(f"p{i:05d}", 0) for i in range(4)]


# --- the real incident -------------------------------------------------------------------------------


async def test_the_ok_incident_trips_the_gate_in_the_first_window_and_status_shows_it(stack, stack_env, bus, store):
    """87% of answers collapsed to "OK.": the gate trips within its first window, names the reason with examples,
    stops consuming (also after a restart), and `dfpipe status` shows it."""
    cfg = make_config(stack, tokenizer={"gate_window": 50})
    run = cfg.run
    tok = await asyncio.to_thread(load_target_tokenizer, cfg)
    rng = random.Random(87)
    flags = [rng.random() < 0.87 for _ in range(400)]
    recs = [record(run, f"p{i:05d}", f"Explain topic {i} to me.", "OK.") if ok else topic_record(run, i)
            for i, ok in enumerate(flags)]
    assert 0.83 < sum(flags) / len(flags) < 0.91
    shards = [await write_shard(bus, store, run, "gen-0", seq, recs[seq * 100:(seq + 1) * 100]) for seq in range(4)]

    service = await burst(cfg, tok)
    assert service.tripped is not None and service.state == "gate_tripped"
    alerts = [a async for _, a in bus.read_log("PROGRESS", Subjects.alert(run, "tokenize"), 1, Alert)]
    gate = [a for a in alerts if a.kind == "quality_gate"]
    assert len(gate) == 1, alerts
    alert = gate[0]
    assert alert.severity == "critical" and alert.stage == "tokenize" and alert.run == run
    assert "of the first" in alert.message and "below_min_supervised" in alert.message
    seen = int(alert.message.split(" of the first ")[1].split()[0])
    assert seen <= cfg.tokenizer.gate_window  # tripped within the first window
    assert service.fingerprint in alert.message and "gate_override" in alert.message
    assert alert.examples and all("[below_min_supervised]: 'OK.'" in ex for ex in alert.examples)

    # It stopped consuming: nothing tokenized, nothing acked, the trip recorded beside the output.
    assert await tokenized_events(bus, run) == [] and parquet_keys(store, run) == []
    assert service.counts.shards == 0
    assert store.exists(Keys.tokenizer_gate(run, service.fingerprint))
    info = await bus.js.consumer_info("SHARDS", f"tokenize-{run}")
    assert info.num_pending + info.num_ack_pending == len(shards)
    progress = [p for _, p in await bus.latest_per_subject("PROGRESS", Subjects.progress(run, "tokenize", "tokenizer"))]
    assert progress[0].gate_tripped and progress[0].state == "gate_tripped"
    # A restarted service does not quietly go on.
    again = await burst(cfg, tok)
    assert again.tripped is not None and again.counts.shards == 0 and parquet_keys(store, run) == []

    r = cli(stack_env, "status", "--run", run, timeout=60)
    assert r.returncode == Exit.ALERT, r.stdout + r.stderr  # a critical alert
    assert "ALERT [critical] tokenize/quality_gate" in r.stdout and "below_min_supervised" in r.stdout, r.stdout
    assert "OK." in r.stdout and alert.message[:60] in r.stdout


# --- token-exact vs re-tokenized on SmolLM2's own output ---------------------------------------------


def test_token_exact_and_retokenized_paths_agree_on_smollm2_output(target_dir: Path) -> None:
    import torch

    from shared.config import load_config
    from shared.model import load_causal_lm, load_tokenizer

    tok, lm = load_tokenizer(str(target_dir)), load_causal_lm(str(target_dir))
    recs = []
    for i, q in enumerate(["Name three colours.", "What is 2 + 2?", "Say hello in French."]):
        msgs = [{"role": "user", "content": q}]
        prompt = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        ids = tok(prompt, add_special_tokens=False, return_tensors="pt").input_ids
        with torch.no_grad():
            out = lm.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1]:].tolist()
        text = tok.decode(out, skip_special_tokens=True)
        recs.append(CompletionRecord(run="r", prompt_id=f"q{i}", messages=[ChatMessage(role="user", content=q)],
                                     completion=text, output_ids=out, completion_tokens=len(out),
                                     finish_reason="stop" if out[-1] == tok.eos_token_id else "length"))
    cfg = load_config(env={"DFLASH_TOKENIZER__TRUNCATED_POLICY": "keep", "DFLASH_TOKENIZER__MIN_SUPERVISED_TOKENS": "2"})
    builder = SampleBuilder(tok, cfg)
    exact = builder.build(recs)
    plain = builder.build([CompletionRecord(**{**{f: getattr(r, f) for f in r.__struct_fields__}, "output_ids": None})
                           for r in recs])
    assert len(exact.samples) == len(plain.samples) == 3
    assert exact.exact == 3 and plain.exact == 0
    differing = sum((a.input_ids, a.loss_mask) != (b.input_ids, b.loss_mask)
                    for a, b in zip(exact.samples, plain.samples, strict=True))
    assert exact.drift == differing  # the reported drift is the real count of differing samples
    assert differing == 0, "SmolLM2's greedy answers re-tokenize to its own output ids"
    for a, r in zip(exact.samples, recs, strict=True):  # and the masked ids are exactly what the engine emitted
        assert [t for t, m in zip(a.input_ids, a.loss_mask, strict=True) if m] == r.output_ids


# --- corrupt shards --------------------------------------------------------------------------------


async def test_corrupt_shards_are_dead_lettered_with_reasons_while_the_others_are_tokenized(stack, bus, store):
    cfg = make_config(stack)
    run = cfg.run
    tok = await asyncio.to_thread(load_target_tokenizer, cfg)
    good = [await write_shard(bus, store, run, "gen-0", 0, [topic_record(run, i) for i in range(3)])]
    recs = [topic_record(run, i) for i in range(10, 12)]
    # garbage bytes at the shard key (written with a correct checksum: unreadable as Parquet)
    garbage = b"\x00\x01 this is not a parquet file " * 8
    key = Keys.completions(run, "gen-0", 1)
    store.put_bytes(key, garbage)
    bad_parquet = await announce(bus, run, key, "gen-0", 1, recs, sha256_bytes(garbage), len(garbage))
    # bit rot in S3: the object's bytes no longer match the sha256 recorded when it was written
    data = completions_to_parquet(recs)
    key = Keys.completions(run, "gen-0", 2)
    rotten = bytearray(data)
    rotten[len(rotten) // 2] ^= 0xFF
    store.client.put_object(store.bucket, key, io.BytesIO(bytes(rotten)), len(rotten),
                            metadata={SHA_META: sha256_bytes(data)})
    bad_checksum = await announce(bus, run, key, "gen-0", 2, recs, sha256_bytes(data), len(data))
    # the object differs from what its ShardWritten event announced (overwritten after the announcement)
    other = [topic_record(run, i) for i in range(20, 22)]
    mismatch = await write_shard(bus, store, run, "gen-0", 3, other, event_sha=sha256_bytes(data))
    # announced but never written
    missing = await announce(bus, run, Keys.completions(run, "gen-0", 4), "gen-0", 4, recs, "0" * 64, 1)
    good.append(await write_shard(bus, store, run, "gen-1", 0, [topic_record(run, i) for i in range(3, 7)]))

    service = await burst(cfg, tok)
    assert service.counts.shards == 2 and service.tripped is None
    events = await tokenized_events(bus, run)
    assert sorted(e.source_key for e in events) == sorted(e.key for e in good)
    assert sum(e.num_samples for e in events) == 7
    letters = {letter.payload: letter for _, letter in await bus.dead_letters(run, "tokenize")}
    assert len(letters) == 4
    by_key = {}
    for letter in letters.values():
        assert letter.stage == "tokenize" and letter.stream == "SHARDS" and letter.error.startswith("poison: ")
        by_key[next(k for k in (bad_parquet.key, bad_checksum.key, mismatch.key, missing.key) if k in letter.error)] = letter
    assert "unreadable" in by_key[bad_parquet.key].error and "not a readable Parquet" in by_key[bad_parquet.key].error
    assert "is corrupt: sha256" in by_key[bad_checksum.key].error
    assert "differs from its ShardWritten event" in by_key[mismatch.key].error
    assert "does not exist" in by_key[missing.key].error
    for key, letter in by_key.items():  # each says how its prompts are generated again
        assert f"`dfpipe replay generate --run {run} --shard {key}`" in letter.error, letter.error
    info = await bus.js.consumer_info("SHARDS", f"tokenize-{run}")
    assert info.num_pending == info.num_ack_pending == 0  # every shard got an outcome


# --- replay under a fixed template ---------------------------------------------------------------


async def test_replay_with_a_fixed_template_writes_a_new_fingerprint_and_keeps_the_old(
        stack, stack_env, bus, store, tmp_path: Path) -> None:
    cfg = make_config(stack)
    run = cfg.run
    tok = await asyncio.to_thread(load_target_tokenizer, cfg)
    await write_shard(bus, store, run, "gen-0", 0, [topic_record(run, i) for i in range(1, 5)])
    await write_shard(bus, store, run, "gen-0", 1, [topic_record(run, i) for i in range(5, 8)])
    service = await burst(cfg, tok)
    old = {k: (store.get_bytes(k), store.stat(k).sha256) for k in store.list(f"runs/{run}/tokenized/")}
    assert len(old) == 2 and all(k.startswith(f"runs/{run}/tokenized/{service.fingerprint}/") for k in old)

    fixed = tmp_path / "template.jinja"
    fixed.write_text(tok.chat_template.replace("named SmolLM, trained by Hugging Face", "that answers briefly"))
    assert fixed.read_text() != tok.chat_template
    r = cli(stack_env, "replay", "tokenize", "--run", run, "--template", str(fixed))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "replayed 2 shards" in r.stdout and "2 written, 0 already present" in r.stdout, r.stdout
    now = set(store.list(f"runs/{run}/tokenized/"))
    assert len(now) == 4 and set(old) <= now
    for k, (data, sha) in old.items():
        assert store.get_bytes(k) == data and store.stat(k).sha256 == sha  # the old output is untouched
    events = await tokenized_events(bus, run)
    fps = {e.fingerprint for e in events}
    assert len(fps) == 2 and service.fingerprint in fps
    (new_fp,) = fps - {service.fingerprint}
    new = sorted(now - set(old))
    assert new == sorted(k.replace(service.fingerprint, new_fp) for k in old)  # same shard names, new folder
    for k in new:
        for s in read_samples(store.get_bytes(k)):
            text = tok.decode(s.input_ids)
            assert ("that answers briefly" in text) == (int(s.prompt_id[1:]) % 2 == 1)  # only where no own system
            assert masked_text(tok, s.input_ids, s.loss_mask) == answer_of(s.prompt_id) + tok.eos_token

    # Replaying with the original template again recomputes and overwrites nothing.
    summary = await replay_tokenize(cfg, bus, store, tok, progress_every_s=0.5)
    assert (summary.fingerprint, summary.shards, summary.written, summary.already_present) == (
        service.fingerprint, 2, 0, 2)
    assert set(store.list(f"runs/{run}/tokenized/")) == now
    for k, (data, _) in old.items():
        assert store.get_bytes(k) == data
