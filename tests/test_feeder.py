"""prompt-feeder on the real bus and S3: record shapes, rejects with line and reason, idempotent re-feed."""

from __future__ import annotations

import json
import re
from pathlib import Path

import msgspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from services.feeder.feed import Feeder
from services.feeder.normalize import RejectedRecord, normalize, prompt_id
from services.feeder.sources import SourceError, read_records
from shared.messages import PromptTask
from shared.topology import Keys, Subjects
from tests.conftest import make_config, new_run

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
    return [t async for _, t in bus.read_log("PROMPTS", Subjects.prompts(run), 1, PromptTask)]


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
    (tmp_path / "y.json").write_text('[{"prompt": "a"}, {"prompt": ')  # cut short: what is there is kept
    got = list(read_records(tmp_path / "y.json"))
    assert [r.value for r in got[:1]] == [{"prompt": "a"}] and "cannot resync" in got[1].error and len(got) == 2
    (tmp_path / "z.bin").write_bytes(b"\x00\x01binary")
    with pytest.raises(SourceError, match="cannot tell the format"):
        list(read_records(tmp_path / "z.bin"))


def test_large_json_array_streams_across_chunks(tmp_path):
    recs = [{"prompt": f"question {i} " + "x" * 300} for i in range(5000)]  # > several 1 MiB chunks
    (tmp_path / "big.json").write_text(json.dumps(recs))
    got = [r.value["prompt"] for r in read_records(tmp_path / "big.json")]
    assert got == [r["prompt"] for r in recs]
    assert all(type(p) is str for p in got)  # plain strings, not wrappers of the reader's
    assert msgspec.json.decode(msgspec.json.encode(got[:1])) == [recs[0]["prompt"]]


# --- messy files: no record stops a feed ---------------------------------------------------------


def rejects_of(store, run: str) -> list[dict]:
    return [json.loads(line) for line in store.get_bytes(Keys.rejects(run)).decode().splitlines()]


async def test_invalid_utf8_bom_crlf_and_blank_lines_never_stop_a_feed(stack, bus, store, tmp_path):
    cfg = make_config(stack)
    src = tmp_path / "messy.jsonl"
    src.write_bytes(b"\xef\xbb\xbf" + b'{"prompt": "first, after a BOM"}\r\n'  # Windows export: BOM and CRLF
                    + b'{"prompt": "caf\xe9 latin-1 bytes"}\r\n'  # not UTF-8
                    + b"\r\n   \n"
                    + b'{"prompt": "second"}\r\n'
                    + b'{"prompt": "no newline at the end"}')
    s = await Feeder(cfg, bus, store).feed([str(src)])
    assert (s.read, s.accepted, s.rejected, s.blank, s.duplicates) == (6, 3, 1, 2, 0)
    assert s.read == s.accepted + s.rejected + s.blank + s.duplicates
    assert {t.messages[0].content for t in await tasks_on_bus(bus, cfg.run)} == {
        "first, after a BOM", "second", "no newline at the end"}
    (reject,) = rejects_of(store, cfg.run)
    assert reject["line"] == 2 and reject["reason"] == "invalid UTF-8 at byte 15" and reject["code"] == "invalid_utf8"
    assert reject["raw"] == '{"prompt": "caf\\xe9 latin-1 bytes"}'  # the bytes, escaped
    manifest = json.loads(store.get_bytes(Keys.manifest(cfg.run)))
    entry = manifest["sources"][str(src)]
    assert (entry["read"], entry["accepted"], entry["rejected"], entry["blank"]) == (6, 3, 1, 2)


def test_json_array_resyncs_after_a_bad_element_and_counts_what_it_cannot(tmp_path):
    src = tmp_path / "a.json"
    src.write_bytes(b'\xef\xbb\xbf[\r\n {"prompt": "one"},\r\n {"prompt": tru},\r\n {"prompt": "three"},\r\n'
                    b' {"prompt": "cut sh\r\n {"prompt": "five"},\r\n {"prompt": "six"}\r\n]\r\n')
    got = list(read_records(src))
    assert [r.line for r in got] == [1, 2, 3, 4, 5, 6]
    assert [r.value for r in got if not r.error] == [{"prompt": p} for p in ("one", "three", "five", "six")]
    assert "invalid JSON" in got[1].error and got[1].raw == b'{"prompt": tru}'
    assert "resynced" in got[3].error and got[3].raw.startswith(b'{"prompt": "cut sh')
    # Parquet converted from a Windows CSV: a BOM on the first column's name, CRLF inside the text
    pq.write_table(pa.Table.from_pylist([{"\ufeffprompt": "line one\r\nline two", "id": 1}]), tmp_path / "p.parquet")
    (row,) = list(read_records(tmp_path / "p.parquet"))
    assert normalize(row.value)[0].content == "line one\nline two"
    # a break nothing after which parses: one reject for the rest, saying how much it was
    src.write_text('[{"prompt": "one"}, {"prompt": "two\\", ' + ", ".join(['{"prompt": "x\\"}'] * 5))
    got = list(read_records(src))
    assert got[0].value == {"prompt": "one"} and len(got) == 2
    assert "cannot resync" in got[1].error and "about 6 elements" in got[1].error


def test_a_huge_line_is_rejected_unread_in_bounded_memory(tmp_path):
    import tracemalloc

    src = tmp_path / "huge.jsonl"
    with open(src, "wb") as f:
        f.write(b'{"prompt": "before"}\n{"prompt": "')
        for _ in range(100):
            f.write(b"x" * (1 << 20))  # a 100 MiB line
        f.write(b'"}\n{"prompt": "after"}\n')
    tracemalloc.start()
    try:
        got = list(read_records(src, max_record_bytes=16 << 20))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert [r.value for r in got if not r.error] == [{"prompt": "before"}, {"prompt": "after"}]
    assert got[1].line == 2 and "over max_record_bytes" in got[1].error and got[1].size == (100 << 20) + 14
    assert peak < 1 << 20, peak  # the line is never copied


async def test_far_too_long_prompt_is_rejected_by_its_bytes_without_tokenizing(stack, bus, store, tmp_path):
    from services.feeder.feed import TokenCounter

    cfg = make_config(stack, feeder={"max_prompt_tokens": 200})
    counter = TokenCounter(cfg)
    assert 4 <= counter.max_token_bytes <= 256
    src = tmp_path / "long.jsonl"
    write_jsonl(src, [{"prompt": "word " * 2_000_000}, {"prompt": "word " * 300}, {"prompt": "short"}])
    s = await Feeder(cfg, bus, store).feed([str(src)])
    assert (s.accepted, s.rejected) == (1, 2)
    by_line = {r["line"]: r for r in rejects_of(store, cfg.run)}
    # 10 MB: refused by its byte length (a lower bound on its tokens), never tokenized; its echo is a prefix
    assert "by its length in bytes" in by_line[1]["reason"] and by_line[1]["record"] is None
    assert len(by_line[1]["raw"]) < 300
    assert "~" in by_line[2]["reason"] and by_line[2]["record"]  # near the limit: counted exactly


async def test_a_foreign_file_is_refused_once_with_the_keys_found(stack, bus, store, tmp_path):
    cfg = make_config(stack)
    foreign = tmp_path / "wiki.jsonl"
    write_jsonl(foreign, [{"id": i, "text": f"article {i}", "title": "t"} for i in range(1000)])
    columns = tmp_path / "table.parquet"
    pq.write_table(pa.Table.from_pylist([{"question": "q?", "answer": "a"}] * 10), columns)
    obj = tmp_path / "wrapped.json"
    obj.write_text(json.dumps({"data": GOOD, "version": 2}))
    good = tmp_path / "good.jsonl"
    write_jsonl(good, GOOD)
    s = await Feeder(cfg, bus, store).feed([str(foreign), str(columns), str(obj), str(good)])
    assert s.accepted == 5 and s.rejected == 0 and s.read == 5  # the refused files count nothing
    assert "keys found: id, text, title" in s.refused[str(foreign)] and "expected messages" in s.refused[str(foreign)]
    assert "columns question, answer" in s.refused[str(columns)]
    assert "one object with keys data, version" in s.refused[str(obj)]
    assert store.get_bytes(Keys.rejects(cfg.run)) == b""  # not 1000 identical rejects
    manifest = json.loads(store.get_bytes(Keys.manifest(cfg.run)))
    assert set(manifest["refused"]) == {str(foreign), str(columns), str(obj)}
    assert manifest["sources"][str(good)]["accepted"] == 5


def test_feed_cli_the_bad_input_of_issue_32_is_rejects_by_code_and_a_utf16_file_said_once(stack, stack_env, store,
                                                                                        tmp_path):
    """`dfpipe feed` on the 100,000-deep line (it crashed with RecursionError, exit 1) in JSONL and in a JSON array,
    invalid UTF-8 at two offsets (counted under one code, not "invalid UTF- at byte"), and a UTF-16 file."""
    import subprocess
    import sys

    from shared.exits import Exit

    deep = b"[" * 100_000 + b"]" * 100_000
    lines = tmp_path / "deep.jsonl"
    lines.write_bytes(b'{"prompt": "one"}\n' + deep + b'\n{"prompt": "caf\xe9"}\n{"prompt": "na\xefve caf\xe9"}\n'
                      + b'{"prompt": "two", "meta": ' + b"[" * 300 + b"]" * 300 + b"}\n")
    array = tmp_path / "deep.json"
    array.write_bytes(b'[{"prompt": "three"},\n' + deep + b',\n{"prompt": "four"}]')
    utf16 = tmp_path / "windows.jsonl"
    utf16.write_bytes('{"prompt": "five"}\n{"prompt": "six"}\n'.encode("utf-16"))
    run = new_run()
    r = subprocess.run([sys.executable, "-m", "shared.cli", "--log-level", "WARNING", "feed", str(lines), str(array),
                        str(utf16), "--run", run], env=stack_env, capture_output=True, text=True, timeout=120)
    assert r.returncode == Exit.USAGE, r.stdout + r.stderr  # the UTF-16 file refused; the others fed
    assert "Traceback" not in r.stderr and "accepted 3" in r.stdout and "rejected 5" in r.stdout, r.stdout
    assert f"refused {utf16}: {utf16}: file is UTF-16 (byte-order mark FF FE); must be UTF-8" in r.stderr
    assert re.search(r"reject\s+3\s+too_deep", r.stdout) and re.search(r"reject\s+2\s+invalid_utf8", r.stdout)
    rejects = rejects_of(store, run)
    assert {(x["source"], x["line"], x["code"]) for x in rejects} == {
        (str(lines), 2, "too_deep"), (str(lines), 3, "invalid_utf8"), (str(lines), 4, "invalid_utf8"),
        (str(lines), 5, "too_deep"), (str(array), 2, "too_deep")}  # none of the UTF-16 file's lines
    assert {x["reason"] for x in rejects if x["code"] == "invalid_utf8"} == {"invalid UTF-8 at byte 15",
                                                                            "invalid UTF-8 at byte 14"}
    manifest = json.loads(store.get_bytes(Keys.manifest(run)))
    assert manifest["sources"][str(lines)]["reject_reasons"] == {"too_deep": 2, "invalid_utf8": 2}
    assert manifest["sources"][str(lines)]["reject_examples"]["invalid_utf8"] == f"{lines}:3: invalid UTF-8 at byte 15"
    assert "file is UTF-16" in manifest["refused"][str(utf16)]
