"""prompt-feeder on the real bus and S3: record shapes, rejects with line and reason, idempotent re-feed."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from services.feeder.feed import Feeder
from services.feeder.normalize import RejectedRecord, normalize, prompt_id
from services.feeder.sources import SourceError, read_records
from shared.messages import PromptTask, Subjects
from shared.store import Keys
from tests.conftest import make_config

GOOD = [
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a prime."}]},
    {"conversations": [{"from": "human", "value": "Hi there"}, {"from": "gpt", "value": "Hello!"},
                       {"from": "human", "value": "Tell me a joke."}, {"from": "gpt", "value": "old answer"}]},
    {"prompt": "What is 2+2?"},
    {"instruction": "Translate to French.", "input": "Good morning"},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "Parts "}, {"type": "text", "text": "work"}]}]},
]
BAD = [
    ('{"messages": [{"role": "user", "content": ', "invalid JSON"),
    ({"messages": [{"role": "user", "content": "   "}]}, "empty content"),
    ({"messages": [{"role": "wizard", "content": "abracadabra"}]}, "unknown role"),
    ({"conversations": [{"from": "human"}]}, "missing content"),
    ({"title": "no prompt here"}, "no messages, conversations, prompt or instruction"),
    ({"prompt": "word " * 400}, "prompt too long"),
]


def write_jsonl(path: Path, records: list) -> None:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))


async def tasks_on_bus(bus, run: str) -> list[PromptTask]:
    return [t async for _, t in bus.replay("PROMPTS", Subjects.prompts(run), 1, PromptTask)]


def test_shapes_normalize_to_one_conversation() -> None:
    msgs = normalize(GOOD[1])
    assert [m.role for m in msgs] == ["user", "assistant", "user"]  # the last assistant turn is the regenerated one
    assert msgs[-1].content == "Tell me a joke."
    assert normalize(GOOD[3])[0].content == "Translate to French.\n\nGood morning"
    assert normalize(GOOD[4])[0].content == "Parts work"
    # the id depends on the normalized conversation only
    assert prompt_id(normalize({"prompt": "  What is 2+2?\r\n"})) == prompt_id(normalize(GOOD[2]))
    with pytest.raises(RejectedRecord, match="must end with a user turn"):
        normalize({"messages": [{"role": "system", "content": "x"}, {"role": "assistant", "content": "y"},
                                {"role": "assistant", "content": "z"}]})


async def test_feed_counts_rejects_with_line_and_reason_and_refeed_publishes_nothing(stack, bus, store, tmp_path):
    cfg = make_config(stack, feeder={"max_prompt_tokens": 200})
    src = tmp_path / "prompts.jsonl"
    records = [*GOOD, GOOD[0], *(r for r, _ in BAD)]  # GOOD[0] twice: one duplicate
    write_jsonl(src, records)

    s = await Feeder(cfg, bus, store).feed([str(src)])
    assert (s.read, s.accepted, s.duplicates, s.rejected, s.published) == (12, 5, 1, 6, 5)
    tasks = await tasks_on_bus(bus, cfg.run)
    assert sorted(t.prompt_id for t in tasks) == sorted(prompt_id(normalize(r)) for r in GOOD)
    assert {t.line for t in tasks} == {1, 2, 3, 4, 5}

    rejects = [json.loads(line) for line in store.get_bytes(Keys.rejects(cfg.run)).decode().splitlines()]
    assert [r["line"] for r in rejects] == list(range(7, 13))
    for r, (_, reason) in zip(rejects, BAD, strict=True):
        assert reason in r["reason"], r
    manifest = json.loads(store.get_bytes(Keys.manifest(cfg.run)))
    assert manifest["total_accepted"] == 5 and manifest["total_rejected"] == 6
    assert manifest["sources"][str(src)]["reject_reasons"]

    again = await Feeder(cfg, bus, store).feed([str(src)])
    assert (again.accepted, again.published, again.already_fed) == (5, 0, 5)
    assert len(await tasks_on_bus(bus, cfg.run)) == 5


async def test_json_parquet_and_s3_sources_give_the_same_ids(stack, bus, store, tmp_path):
    expected = sorted(prompt_id(normalize(r)) for r in GOOD)
    (tmp_path / "p.json").write_text(json.dumps(GOOD, indent=2))
    rows = [{"prompt": normalize(r)[-1].content} for r in GOOD]  # plain prompts via Parquet
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet")
    noext = tmp_path / "prompts-data"
    write_jsonl(noext, GOOD)
    raw = (tmp_path / "p.json").read_bytes()
    store.put_bytes("inputs/p.json", raw)

    for source in (str(tmp_path / "p.json"), str(noext), f"s3://{stack.bucket}/inputs/p.json"):
        cfg = make_config(stack)
        s = await Feeder(cfg, bus, store).feed([source])
        assert s.accepted == 5 and s.rejected == 0, source
        assert sorted(t.prompt_id for t in await tasks_on_bus(bus, cfg.run)) == expected, source
    cfg = make_config(stack)
    await Feeder(cfg, bus, store).feed([str(tmp_path / "p.parquet")])
    assert len(await tasks_on_bus(bus, cfg.run)) == 5


def test_source_errors_are_clear(tmp_path):
    (tmp_path / "x.json").write_text('{"prompt": "an object, not an array"}')
    with pytest.raises(SourceError, match="must be an array"):
        list(read_records(tmp_path / "x.json"))
    (tmp_path / "y.json").write_text('[{"prompt": "a"}, {"prompt": ')
    with pytest.raises(SourceError, match="record 2"):
        list(read_records(tmp_path / "y.json"))
    (tmp_path / "z.bin").write_bytes(b"\x00\x01binary")
    with pytest.raises(SourceError, match="cannot tell the format"):
        list(read_records(tmp_path / "z.bin"))


def test_large_json_array_streams_across_chunks(tmp_path):
    recs = [{"prompt": f"question {i} " + "x" * 300} for i in range(5000)]  # > several 1 MiB chunks
    (tmp_path / "big.json").write_text(json.dumps(recs))
    got = [r.value["prompt"] for r in read_records(tmp_path / "big.json")]
    assert got == [r["prompt"] for r in recs]
    assert msgspec.json.decode(msgspec.json.encode(got[:1]))  # plain strings back
