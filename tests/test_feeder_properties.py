"""Property tests of the feeder's input boundary: any bytes in, every record accounted for once.

The reader and `normalize` are checked against a strict reference parser written here with
Python's own `json` (RFC 8259: UTF-8, no NaN/Infinity, finite numbers, no lone surrogates), over
random byte lines, random JSON values and random mixes of the four record shapes with random
damage, in JSONL, JSON arrays and Parquet, and over JSON at the decoders' limits (nesting depth
around MAX_NESTING and 100,000 deep, brackets inside strings, integers around 4300 characters,
floats at the edge of double range) and Parquet values Python cannot hold. These run on local files only (well under a minute);
one test feeds random files through the real bus and S3 and checks that nothing is published twice.
"""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from services.feeder.feed import Feeder
from services.feeder.normalize import RejectedRecord, normalize, prompt_id
from services.feeder.reasons import Reason
from services.feeder.sources import MAX_NESTING, SourceError, read_records
from shared.bus import Bus
from shared.messages import PromptTask
from shared.store import Store
from shared.topology import Keys, Subjects
from tests.conftest import make_config

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                          HealthCheck.too_slow])

# --- the strict reference -------------------------------------------------------------------------


class Invalid(ValueError):
    pass


def _no_constant(name: str):
    raise Invalid(f"non-JSON constant {name}")


def _finite(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise Invalid("number out of range")
    return value


MAX_INT_CHARS = 4300  # the feeder's integer limit: its text, sign included (Python's int() allows 4300 digits)


def _int(text: str) -> int:
    if len(text) > MAX_INT_CHARS:
        raise Invalid("integer out of range")
    return int(text)


def _depth(text: str) -> int:
    """How deep arrays/objects nest in a JSON text, strings skipped: a char-by-char reading of RFC 8259."""
    depth = deepest = 0
    in_string = escape = False
    for c in text:
        if in_string:
            if escape:
                escape = False
            elif c == "\\":
                escape = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif c in "]}":
            depth -= 1
    return deepest


def _check_text(value) -> None:
    if isinstance(value, str):
        value.encode("utf-8")  # a lone surrogate escape raises
    elif isinstance(value, list):
        for v in value:
            _check_text(v)
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_text(k)
            _check_text(v)


def reference_value(data: bytes):
    """The record's value, or Invalid. Strict: what RFC 8259 calls JSON text, in UTF-8, with the feeder's stated
    limits (nesting at most MAX_NESTING, integers of at most 4300 characters, floats within double range)."""
    try:
        text = data.decode("utf-8")
        if _depth(text) > MAX_NESTING:
            raise Invalid("nested too deep")
        value = json.loads(text, parse_constant=_no_constant, parse_float=_finite, parse_int=_int)
        _check_text(value)
        return value
    except (UnicodeError, ValueError, RecursionError) as e:
        raise Invalid(str(e)) from None


def reference_outcome(value) -> str | None:
    """The prompt id the record must be accepted as, or None for a reject."""
    try:
        return prompt_id(normalize(value))
    except RejectedRecord:
        return None


def outcomes(path: Path) -> dict[int, str | bool | None]:
    """record number -> prompt id (accepted), None (rejected) or False (blank line), by the real reader."""
    out: dict[int, str | bool | None] = {}
    for raw in read_records(path):
        assert raw.line not in out, f"record {raw.line} read twice"
        if raw.blank:
            out[raw.line] = False
        elif raw.error:
            assert raw.size >= 0 and len(raw.raw) <= 200
            assert raw.code in set(Reason), raw  # every reject is counted under a reason code
            out[raw.line] = None
        else:
            out[raw.line] = reference_outcome(raw.value)
    return out


# --- strategies -----------------------------------------------------------------------------------

text = st.text(max_size=30)
roles = st.sampled_from(["user", "system", "assistant", "human", "gpt", "tool", "wizard", "", "USER"])
turn = st.fixed_dictionaries({"role": roles, "content": st.one_of(text, st.none(), st.integers())})
sharegpt_turn = st.fixed_dictionaries({"from": roles, "value": text})
shaped = st.one_of(
    st.fixed_dictionaries({"messages": st.lists(turn, max_size=4)}),
    st.fixed_dictionaries({"conversations": st.lists(sharegpt_turn, max_size=4)}),
    st.fixed_dictionaries({"prompt": text}, optional={"system": text}),
    st.fixed_dictionaries({"instruction": text}, optional={"input": text, "system": text}),
)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
    max_leaves=8,
)
records = st.one_of(shaped, shaped, json_values)


def _nest(depth: int, inner: bytes, kind: str) -> bytes:
    """`inner` inside `depth` arrays, objects or both alternating (bytes: json.dumps itself recurses)."""
    if kind == "[":
        return b"[" * depth + inner + b"]" * depth
    if kind == "{":
        return b'{"k":' * depth + inner + b"}" * depth
    pairs, odd = divmod(depth, 2)
    return b'[{"k":' * pairs + b"[" * odd + inner + b"]" * odd + b"}]" * pairs


@st.composite
def at_limits(draw, deepest: int = 100_000) -> bytes:
    """JSON text at the decoders' limits, valid or not: nesting around MAX_NESTING, past the decoders' own
    recursion limit (~1000) and, by default, the 100,000-deep line of issue 32 (whole record, or one field of a
    good prompt), brackets and escapes inside strings (the depth scan must skip them), integers around 4300
    characters, floats at the edge of double range. (`deepest` is smaller for JSON arrays: their structural
    scan steps through every bracket in Python; the CLI test feeds the 100,000-deep element.)"""
    prompt = json.dumps(draw(text)).encode()
    kind = draw(st.sampled_from(["deep", "deep_field", "bracket_text", "int", "float"]))
    if kind in ("deep", "deep_field"):
        depth = draw(st.sampled_from([MAX_NESTING - 1, MAX_NESTING, MAX_NESTING + 1, deepest]) | st.integers(0, 1200))
        deep = _nest(depth, draw(st.sampled_from([b"1", b"[]", b"{}", b'"x"', prompt])), draw(st.sampled_from("[{m")))
        return deep if kind == "deep" else b'{"prompt": ' + prompt + b', "meta": ' + deep + b"}"
    if kind == "bracket_text":
        content = draw(st.text(alphabet='[]{}"\\ab', max_size=700))
        return json.dumps({"prompt": "[{" * draw(st.integers(0, 700)) + content}).encode()
    if kind == "int":
        digits = draw(st.sampled_from([4299, 4300, 4301]) | st.integers(1, 5000))
        number = draw(st.sampled_from([b"", b"-"])) + b"9" * digits
        return number if draw(st.booleans()) else b'{"prompt": ' + prompt + b', "n": ' + number + b"}"
    number = draw(st.sampled_from([b"1e308", b"1.7976931348623157e308", b"1.7976931348623159e308", b"1e309",
                                   b"-1e400", b"1e-400", b"0." + b"1" * 5000, b"1" + b"0" * 400 + b".5"]))
    return b'{"prompt": ' + prompt + b', "x": ' + number + b"}"


@st.composite
def damaged(draw, alphabet: bytes | None = None) -> bytes:
    """A record's JSON with random damage: cut short, bytes flipped, inserted or deleted.

    With `alphabet`, inserted bytes come from it only (damage that keeps an array's element boundaries)."""
    data = bytearray(json.dumps(draw(records), ensure_ascii=draw(st.booleans())).encode())
    for _ in range(draw(st.integers(0, 2))):
        kind = draw(st.sampled_from(["cut", "insert", "delete", "flip"] if alphabet is None else ["insert"]))
        at = draw(st.integers(0, len(data)))
        if kind == "cut":
            del data[at:]
        elif kind == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=3)) if alphabet is None else bytes(
                draw(st.lists(st.sampled_from(list(alphabet)), min_size=1, max_size=3)))
        elif kind == "delete":
            del data[at:at + 1]
        elif data:
            i = min(at, len(data) - 1)
            data[i] ^= draw(st.integers(1, 255))
    return bytes(data)


line_bytes = st.one_of(damaged(), st.binary(max_size=40), st.just(b""), st.just(b"  \t"), at_limits())
element_bytes = st.one_of(damaged(), st.binary(max_size=40), st.just(b""), st.just(b"  \t"), at_limits(2000))


def lines_only(data: bytes) -> bytes:
    return data.replace(b"\n", b" ")


# --- JSONL ----------------------------------------------------------------------------------------


@FAST
@given(lines=st.lists(line_bytes.map(lines_only), max_size=12), bom=st.booleans(), crlf=st.booleans(),
       final_newline=st.booleans())
def test_jsonl_any_bytes_every_line_once_and_the_accepted_set_is_the_references(
        tmp_path_factory, lines, bom, crlf, final_newline) -> None:
    eol = b"\r\n" if crlf else b"\n"
    body = eol.join(lines) + (eol if final_newline and lines else b"")
    path = tmp_path_factory.mktemp("jsonl") / "p.jsonl"
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + body)
    got = outcomes(path)
    if not bom:  # a first line starting with the mark starts with a BOM: the reader's rule (one mark, not two:
        body = body.removeprefix(b"\xef\xbb\xbf")  # after a file's BOM, a line that starts with one holds U+FEFF)
    pieces = body.split(b"\n")
    if pieces[-1] == b"":
        pieces.pop()  # the newline ends the last line; nothing follows it
    assert sorted(got) == list(range(1, len(pieces) + 1))
    for n, piece in enumerate(pieces, 1):
        line = piece.rstrip(b"\r")
        if not line.strip(b" \t\r\n"):
            assert got[n] is False, n
            continue
        try:
            want = reference_outcome(reference_value(line))
        except Invalid:
            want = None
        assert got[n] == want, (n, line)


# --- JSON arrays ----------------------------------------------------------------------------------

STRUCTURE_SAFE = bytes(b for b in range(256) if b not in b'[]{},"\\\n')


@FAST
@given(elements=st.lists(st.one_of(records.map(lambda r: json.dumps(r).encode()), damaged(STRUCTURE_SAFE),
                                   at_limits(2000)), max_size=10),
       pretty=st.booleans(), bom=st.booleans())
def test_json_array_with_damaged_elements_matches_the_reference_element_by_element(
        tmp_path_factory, elements, pretty, bom) -> None:
    assume(all(e.strip(b" \t\r") for e in elements))
    sep = b",\r\n  " if pretty else b","
    path = tmp_path_factory.mktemp("json") / "p.json"
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + b"[" + sep.join(elements) + b"]")
    got = outcomes(path)
    assert sorted(got) == list(range(1, len(elements) + 1))
    for n, element in enumerate(elements, 1):
        try:
            want = reference_outcome(reference_value(element))
        except Invalid:
            want = None
        assert got[n] == want, (n, element)


@FAST
@given(data=st.lists(element_bytes, max_size=8).map(lambda parts: b"[" + b",\n".join(parts) + b"]"))
def test_json_array_of_any_bytes_always_completes_and_numbers_records_once(tmp_path_factory, data) -> None:
    path = tmp_path_factory.mktemp("json") / "p.json"
    path.write_bytes(data)
    try:
        got = outcomes(path)
    except SourceError:
        return  # the whole file refused with a reason (not an array): allowed, never a crash
    assert sorted(got) == list(range(1, len(got) + 1))


# --- Parquet --------------------------------------------------------------------------------------

PARQUET_SCHEMA = pa.schema([
    ("messages", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
    ("prompt", pa.string()),
    ("instruction", pa.string()),
    ("input", pa.string()),
    ("system", pa.string()),
    ("when", pa.timestamp("us")),  # past year 9999 Python's datetime cannot hold it: that row is one reject
])
parquet_rows = st.fixed_dictionaries({}, optional={
    "messages": st.none() | st.lists(st.fixed_dictionaries({"role": roles | st.none(), "content": text | st.none()}),
                                     max_size=3),
    "prompt": text | st.none(),
    "instruction": text | st.none(),
    "input": text | st.none(),
    "system": text | st.none(),
    "when": st.none() | st.integers(-(2**63) + 1, 2**63 - 1) | st.integers(0, 2**40),
})


@FAST
@given(rows=st.lists(parquet_rows, min_size=1, max_size=10))
def test_parquet_rows_match_the_reference(tmp_path_factory, rows) -> None:
    path = tmp_path_factory.mktemp("pq") / "p.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=PARQUET_SCHEMA), path)
    table = pq.read_table(path)  # the strict reference: pyarrow's own values, a row with one Python cannot hold rejected
    got = outcomes(path)
    assert sorted(got) == list(range(1, len(rows) + 1))
    for n in range(1, len(rows) + 1):
        try:
            row = {name: table.column(name)[n - 1].as_py() for name in table.column_names}
        except (OverflowError, ValueError):
            assert got[n] is None, n
            continue
        assert got[n] == reference_outcome(row), (n, row)


def test_a_parquet_schema_nested_past_pyarrows_limit_is_refused_once(tmp_path) -> None:
    deep_type, deep_value = pa.string(), "x"
    for _ in range(60):
        deep_type, deep_value = pa.list_(deep_type), [deep_value]
    schema = pa.schema([("prompt", pa.string()), ("meta", deep_type)])
    pq.write_table(pa.Table.from_pylist([{"prompt": "hi", "meta": deep_value}], schema=schema), tmp_path / "d.parquet")
    with pytest.raises(SourceError, match=r"not a readable Parquet file: .*too deeply nested"):
        list(read_records(tmp_path / "d.parquet"))


# --- encodings other than UTF-8: the file is refused once, never a reject per line --------------------


@FAST
@given(recs=st.lists(shaped, min_size=1, max_size=5), encoding=st.sampled_from(["utf-16", "utf-16-le", "utf-16-be",
                                                                                 "utf-32"]),
       fmt=st.sampled_from(["p.jsonl", "p.json", "prompts"]))
def test_a_utf16_or_utf32_file_is_refused_once_naming_its_encoding(tmp_path_factory, recs, encoding, fmt) -> None:
    body = json.dumps(recs) if fmt == "p.json" else "".join(json.dumps(r) + "\n" for r in recs)
    path = tmp_path_factory.mktemp("enc") / fmt
    path.write_bytes(body.encode(encoding))
    with pytest.raises(SourceError, match=f"file is {encoding[:6].upper()} .*must be UTF-8"):
        list(read_records(path))


# --- the real stack: accounted once, published once -----------------------------------------------


def feed_file(stack, path: Path):
    async def go():
        cfg = make_config(stack, feeder={"max_prompt_tokens": 0})
        bus = await Bus.connect(cfg.bus, "pytest", deadline_s=10)
        try:
            await bus.ensure_streams()
            store = Store.open(cfg)
            summary = await Feeder(cfg, bus, store).feed([str(path)])
            again = await Feeder(cfg, bus, store).feed([str(path)])
            tasks = [t async for _, t in bus.read_log("PROMPTS", Subjects.prompts(cfg.run), 1, PromptTask)]
            rejects = [json.loads(x) for x in store.get_bytes(Keys.rejects(cfg.run)).splitlines()]  # always written
            manifest = json.loads(store.get_bytes(Keys.manifest(cfg.run)))
            entry = manifest["sources"][str(path)]
            assert entry["read"] == entry["accepted"] + entry["duplicates"] + entry["rejected"] + entry["blank"]
            assert entry["read"] == (0 if summary.refused else summary.read)
            return summary, again, tasks, rejects
        finally:
            await bus.close()

    return asyncio.run(go())


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=st.lists(st.one_of(shaped.map(lambda r: json.dumps(r).encode()), line_bytes.map(lines_only)),
                      min_size=1, max_size=15))
def test_real_feed_accounts_every_line_once_and_publishes_nothing_twice(stack, tmp_path_factory, lines) -> None:
    lines = lines + lines[: len(lines) // 2]  # repeats: duplicates in the same feed
    path = tmp_path_factory.mktemp("feed") / "p.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    summary, again, tasks, rejects = feed_file(stack, path)
    if summary.refused:  # a file of only foreign objects: refused whole, nothing counted or published
        assert not tasks and summary.read == 0 and "keys found" in summary.refused[str(path)]
        return
    assert summary.read == len(lines) == summary.accepted + summary.duplicates + summary.rejected + summary.blank
    want: dict[str, int] = {}
    blank, rejected = set(), set()
    expected = [lines[0].removeprefix(b"\xef\xbb\xbf"), *lines[1:]]  # the file's first bytes: a BOM if they are one
    for n, line in enumerate(expected, 1):
        if not line.strip(b" \t\r\n"):
            blank.add(n)
            continue
        try:
            pid = reference_outcome(reference_value(line.rstrip(b"\r")))
        except Invalid:
            pid = None
        if pid is None:
            rejected.add(n)
        else:
            want.setdefault(pid, n)
    ids = [t.prompt_id for t in tasks]
    assert len(ids) == len(set(ids)) == summary.published == summary.accepted  # nothing published twice
    assert {t.prompt_id: t.line for t in tasks} == want  # the first line of each prompt, as the reference says
    assert {r["line"] for r in rejects} == rejected and len(rejects) == len(rejected)
    assert summary.blank == len(blank)
    assert (again.published, again.already_fed) == (0, summary.accepted)  # a re-feed publishes nothing


@pytest.mark.parametrize("fmt", ["jsonl", "json"])
def test_random_documents_of_other_shapes_are_refused_not_rejected_per_line(stack, tmp_path, fmt) -> None:
    rows = [{"id": i, "text": f"doc {i}", "url": "u"} for i in range(300)]
    path = tmp_path / f"docs.{fmt}"
    path.write_text(json.dumps(rows) if fmt == "json" else "".join(json.dumps(r) + "\n" for r in rows))
    summary, _, tasks, rejects = feed_file(stack, path)
    assert not tasks and not rejects and summary.read == 0
    assert "none of its first 100 records has a prompt; keys found: id, text, url" in summary.refused[str(path)]
