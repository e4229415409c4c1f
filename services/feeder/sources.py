"""Stream records out of a prompt file (local or `s3://bucket/key`) in bounded memory.

Formats, auto-detected by extension then by content: JSONL (one object per line), JSON (a
top-level array, split into elements incrementally), Parquet (row batches). Each record comes
with its 1-based number in the source (the line for JSONL, the element for a JSON array, the
row for Parquet), so a reject names exactly what to fix.

No record stops a source: any bytes on a line (or in an array element) become a `Raw` with a
value, or with an error and a bounded prefix of the raw bytes. Text files are memory-mapped, so
the reader holds at most one record of `max_record_bytes` at a time; a longer record is counted
and rejected without being copied or parsed. A UTF-8 byte-order mark and CRLF line ends are
accepted in every format. Only a source that is unusable as a whole raises `SourceError` (a UTF-16 or
UTF-32 text file is one: said once, not per line).

Decoder limits are rejects, never a crash: a record nested deeper than MAX_NESTING arrays/objects
(found by a scan that runs only when the record holds more brackets than that), a number out of
range, and, in Parquet, a value Python cannot hold (the row is converted column by column to name it).
Parquet's own schema depth limit (pyarrow refuses a schema nested ~50 lists deep) refuses the file once:
every row has that column.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec

from shared.config import Config
from shared.messages import ChatMessage

from .reasons import Reason

BOM = b"\xef\xbb\xbf"
JSON_WS = b" \t\r\n"  # RFC 8259's whitespace (bytes.strip() would also take \x0b and \x0c)
RAW_PREFIX = 200  # bytes of a rejected record kept in rejects.jsonl (escaped)
RESYNC_TRIES = 1000  # candidate element starts tried after a broken JSON array element
SHAPES = "messages (OpenAI), conversations (ShareGPT), prompt (plain) or instruction (Alpaca)"
# Arrays/objects inside each other in one record. The decoders recurse on the interpreter's stack (msgspec
# and Python's json fail near 1000 levels minus the caller's depth): a fixed limit far below that makes the
# outcome the same in every call stack; real prompt records nest < 10 levels.
MAX_NESTING = 256
_decoder = msgspec.json.Decoder()


class SourceError(ValueError):
    """The source as a whole is unusable (missing, unknown format, not an array, foreign)."""


class Raw(msgspec.Struct):
    line: int
    value: Any = None
    error: str = ""  # set when this one record could not be parsed
    code: str = ""  # the error's Reason
    raw: bytes = b""  # the first RAW_PREFIX bytes of the record, for its reject
    size: int = 0  # the record's length in bytes in the source
    blank: bool = False  # an empty or whitespace-only line (JSONL): counted, nothing else


def escaped(raw: bytes, size: int | None = None) -> str:
    """Bytes as text a person can read in a JSON file: invalid UTF-8 as \\xNN, a cut marked with its size."""
    text = raw[:RAW_PREFIX].decode("utf-8", "backslashreplace")
    size = len(raw) if size is None else size
    return text + (f"… ({size} bytes)" if size > RAW_PREFIX else "")


def parse_record(data: bytes, line: int) -> Raw:
    """One record's bytes → its JSON value, or the reason it has none. Strict: RFC 8259 JSON in UTF-8,
    nested at most MAX_NESTING deep."""

    def rejected(code: Reason, error: str) -> Raw:
        return Raw(line, error=error, code=code, raw=data[:RAW_PREFIX], size=len(data))

    if (at := too_deep(data)) is not None:
        return rejected(Reason.TOO_DEEP, f"nested deeper than {MAX_NESTING} arrays/objects (at byte {at})")
    try:
        return Raw(line, _decoder.decode(data), size=len(data))
    except UnicodeDecodeError:
        return rejected(Reason.INVALID_UTF8, f"invalid UTF-8 at byte {_bad_utf8_at(data)}")
    except msgspec.ValidationError as e:  # a float beyond double range, an integer over 4300 characters
        return rejected(Reason.NUMBER_OUT_OF_RANGE, f"invalid JSON: {e}")
    except msgspec.DecodeError as e:
        return rejected(Reason.INVALID_JSON, f"invalid JSON: {e}")
    except RecursionError:  # only where the caller's own stack is already near the interpreter's limit
        return rejected(Reason.TOO_DEEP, "nested deeper than the JSON decoder can follow here")


_NESTING = re.compile(rb'[\[\]{}"]')


def too_deep(data: bytes, limit: int = MAX_NESTING) -> int | None:
    """The offset of the first bracket nested deeper than `limit` (strings skipped), or None. Free for a record
    with at most `limit` brackets in all (two C scans); otherwise one step per bracket or string."""
    if data.count(b"[") + data.count(b"{") <= limit:
        return None
    depth, pos = 0, 0
    while (m := _NESTING.search(data, pos)) is not None:
        c, pos = m.group(), m.end()
        if c == b'"':
            s = _STRING_REST.match(data, pos)
            if s is None:
                return None  # an unterminated string: the decoder names it
            pos = s.end()
        elif c in b"[{":
            depth += 1
            if depth > limit:
                return m.start()
        else:
            depth = max(0, depth - 1)
    return None


def _bad_utf8_at(data: bytes) -> int:
    """The offset in the record (msgspec gives it inside the string it was decoding)."""
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        return e.start
    return 0


def _too_big(line: int, head: bytes, size: int, limit: int) -> Raw:
    return Raw(line, error=f"record of {size} bytes is over max_record_bytes {limit}: not read",
               code=Reason.TOO_BIG, raw=head[:RAW_PREFIX], size=size)


_OTHER_ENCODINGS = (  # longest first: UTF-32 LE starts with UTF-16 LE's mark
    (b"\x00\x00\xfe\xff", "UTF-32"), (b"\xff\xfe\x00\x00", "UTF-32"), (b"\xfe\xff", "UTF-16"), (b"\xff\xfe", "UTF-16"))


def check_encoding(path: Path) -> None:
    """SourceError, once for the whole file, when a text file is UTF-16 or UTF-32 instead of UTF-8 (read as UTF-8,
    every line would be a reject): by its byte-order mark, or, without one, by its first 64 bytes being JSON
    text with a NUL byte at every other position (ASCII in UTF-16). A stray NUL in a UTF-8 line is that line's
    reject, not the file's."""
    with open(path, "rb") as f:
        head = f.read(64)
    for mark, name in _OTHER_ENCODINGS:
        if head.startswith(mark):
            raise SourceError(f"{path}: file is {name} (byte-order mark {mark.hex(' ').upper()}); must be UTF-8 "
                              f"(convert it, e.g. iconv -f {name} -t UTF-8)")
    if (order := _utf16_without_mark(head)) is not None:
        raise SourceError(f"{path}: file is UTF-16 (no byte-order mark; a NUL byte between the characters); "
                          f"must be UTF-8 (convert it, e.g. iconv -f UTF-16{order} -t UTF-8)")


def _utf16_without_mark(head: bytes) -> str | None:
    """"LE" or "BE" when `head` reads as ASCII JSON text in UTF-16, else None."""
    if len(head) < 16:
        return None
    even, odd = head[0::2], head[1::2]
    for order, text, zeros in (("LE", even, odd), ("BE", odd, even)):
        if zeros.count(0) == len(zeros) and not text.count(0) and text.lstrip(b" \t\r\n")[:1] in (b"{", b"["):
            return order
    return None


def detect_format(path: Path) -> str:
    name = path.name.lower()
    for ext, fmt in ((".jsonl", "jsonl"), (".ndjson", "jsonl"), (".json", "json"), (".parquet", "parquet")):
        if name.endswith(ext):
            return fmt
    with open(path, "rb") as f:
        head = f.read(4096)
    if head.startswith(b"PAR1"):
        return "parquet"
    stripped = head.removeprefix(BOM).lstrip(b" \t\r\n")
    if stripped.startswith(b"["):
        return "json"
    if stripped.startswith(b"{"):
        return "jsonl"
    raise SourceError(f"{path}: cannot tell the format (not JSONL, a JSON array or Parquet)")


@contextlib.contextmanager
def _mapped(path: Path) -> Iterator[bytes | mmap.mmap]:
    """The file's bytes without reading them into memory (an empty file cannot be mapped)."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            yield b""
            return
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            yield mm
        finally:
            mm.close()


def _jsonl(path: Path, max_record_bytes: int) -> Iterator[Raw]:
    with _mapped(path) as mm:
        pos = len(BOM) if mm[:len(BOM)] == BOM else 0
        n, end_of_file = 0, len(mm)
        while pos < end_of_file:
            n += 1
            nl = mm.find(b"\n", pos)
            end = end_of_file if nl < 0 else nl
            size = end - pos
            if size > max_record_bytes:
                yield _too_big(n, mm[pos:pos + RAW_PREFIX], size, max_record_bytes)
            else:
                line = mm[pos:end].rstrip(b"\r")
                yield Raw(n, blank=True) if not line.strip(JSON_WS) else parse_record(line, n)
            pos = end + 1


# --- JSON arrays: split into elements by structure, each element parsed on its own ----------------

_WS = re.compile(rb"[ \t\r\n]*")
_STRUCT = re.compile(rb'[\[\]{},"]')
_STRING_REST = re.compile(rb'(?:[^"\\]|\\.)*"', re.S)  # after an opening quote: up to its closing quote
_ELEMENT_START = re.compile(rb"[,\n][ \t\r\n]*(?=[\[{])")  # after a comma, or at a line start


_CLOSE = re.compile(rb"[}\]][ \t\r\n]*[,\]]")  # a closing bracket, then the next separator
FAST_TRIES = 4


def _fast_element(mm: Any, start: int, max_record_bytes: int) -> tuple[int, Any] | None:
    """The element at `start` as (index of its ',' or final ']', value) when it is valid JSON closing at one
    of the next few closing brackets; None sends the caller to the structural scan. A piece that decodes
    is exactly one JSON value, so it ends where the structural scan would end it: this only saves the scan."""
    pos = start
    for _ in range(FAST_TRIES):
        m = _CLOSE.search(mm, pos)
        if m is None or m.start() + 1 - start > max_record_bytes:
            return None
        pos, sep = m.start() + 1, m.end() - 1
        if mm[sep:sep + 1] == b"]" and _WS.match(mm, sep + 1).end() != len(mm):
            continue  # a ']' that does not end the file closes a nested list
        piece = mm[start:pos]
        if too_deep(piece) is not None:
            return None  # the structural scan finds its end; parse_record names the reason
        try:
            return sep, _decoder.decode(piece)
        except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
            continue
    return None


def _element_end(mm: Any, pos: int, limit: int | None = None) -> tuple[int, str]:
    """Where the array element starting at `pos` ends: (index of its terminating ',' or ']', "")
    or (-1, why) when its structure does not close (an unterminated string or bracket), or not within `limit` bytes."""
    depth = 0
    stop = len(mm) if limit is None else min(len(mm), pos + limit)
    while True:
        m = _STRUCT.search(mm, pos, stop)
        if m is None and stop < len(mm):
            return -1, f"no element end within {limit} bytes"
        if m is None:
            return -1, "the array is not closed" if depth == 0 else "an unclosed bracket"
        c, pos = m.group(), m.end()
        if c == b'"':
            s = _STRING_REST.match(mm, pos, stop)
            if s is None:
                return -1, "an unterminated string"
            pos = s.end()
        elif c in b"[{":
            depth += 1
        elif depth == 0 and (c == b"," or (c == b"]" and _WS.match(mm, pos).end() == len(mm))):
            return m.start(), ""  # a ']' ends the array only when nothing but whitespace follows it
        elif c in b"]}":
            depth -= 1
            if depth < 0:  # a stray closing bracket: the element is broken, its end is still findable
                depth = 0


def _indent(mm: Any, pos: int) -> int | None:
    """The column of `pos` when only whitespace precedes it on its line, else None."""
    window = max(0, pos - 4096)  # a minified file is one long line: never search back over all of it
    newline = mm.rfind(b"\n", window, pos)
    if newline < 0 and window > 0:
        return None
    line_start = newline + 1
    return pos - line_start if _WS.match(mm, line_start, pos).end() >= pos else None


def _resync(mm: Any, start: int, stop: int | None, limit: int) -> tuple[int, int] | None:
    """The first later element start whose element closes and parses: (its start, its end).

    Inside a broken element whose end was found (`stop`), only a line start indented no deeper than
    the broken element counts (a pretty-printed array's next element; never one of its own nested
    objects). Past a break that never closes, a start after any comma counts too."""
    indent = _indent(mm, start)
    for tries, m in enumerate(_ELEMENT_START.finditer(mm, start + 1, len(mm) if stop is None else stop)):
        if tries >= RESYNC_TRIES:
            return None
        candidate = m.end()
        column = _indent(mm, candidate)
        if column is None and stop is not None:
            continue
        if column is not None and indent is not None and column > indent:
            continue
        end, _ = _element_end(mm, candidate, limit)  # bounded: at most RESYNC_TRIES x limit bytes scanned
        if end >= 0 and not parse_record(bytes(mm[candidate:end]), 0).error:
            return candidate, end
    return None


def _json_array(path: Path, max_record_bytes: int) -> Iterator[Raw]:
    """Elements of a top-level JSON array. A broken element is one reject; the reader resynchronizes at
    the next element that parses, or, when none does, rejects the rest once, with its size and element count."""
    with _mapped(path) as mm:
        pos = _WS.match(mm, len(BOM) if mm[:len(BOM)] == BOM else 0).end()
        if mm[pos:pos + 1] != b"[":
            raise SourceError(f"{path}: a JSON source must be an array of records; {_describe_top(mm, pos)}")
        pos += 1
        n = 0
        while True:
            pos = _WS.match(mm, pos).end()
            if pos >= len(mm):
                if n == 0:
                    raise SourceError(f"{path}: the JSON array is not closed")
                return  # a missing final ']' loses nothing
            if mm[pos:pos + 1] == b"]" and _WS.match(mm, pos + 1).end() == len(mm):
                return
            if n and mm[pos:pos + 1] == b",":
                pos += 1
                continue
            start = pos
            n += 1
            if (fast := _fast_element(mm, start, max_record_bytes)) is not None:
                pos, value = fast
                yield Raw(n, value, size=pos - start)
                continue
            end, why = _element_end(mm, start)
            if end >= 0:
                size = end - start
                if size > max_record_bytes:
                    yield _too_big(n, bytes(mm[start:start + RAW_PREFIX]), size, max_record_bytes)
                    pos = end
                    continue
                raw = parse_record(bytes(mm[start:end]).rstrip(), n)
                if not raw.error:
                    yield raw
                    pos = end
                    continue
                why = raw.error
            found = _resync(mm, start, None if end < 0 else end, max_record_bytes)
            code = raw.code if end >= 0 else Reason.INVALID_JSON
            if found is None and end >= 0:
                yield Raw(n, error=why, code=code, raw=bytes(mm[start:min(end, start + RAW_PREFIX)]).rstrip(), size=end - start)
                pos = end
                continue
            if found is None:  # nothing after it parses: the rest of the file is this one reject
                rest = len(mm) - start
                starts = 1 + sum(1 for _ in _ELEMENT_START.finditer(mm, start))
                yield Raw(n, error=f"invalid JSON ({why}); cannot resync the array: skipped the remaining {rest} "
                          f"bytes (about {starts} elements)", code=Reason.INVALID_JSON, raw=bytes(mm[start:start + RAW_PREFIX]), size=rest)
                return
            resume, _ = found
            yield Raw(n, error=f"invalid JSON ({why}); resynced {resume - start} bytes later", code=code,
                      raw=bytes(mm[start:min(resume, start + RAW_PREFIX)]), size=resume - start)
            pos = resume


def _describe_top(mm: Any, pos: int) -> str:
    """What the file is instead of an array: an object's keys tell a person which file they picked."""
    if mm[pos:pos + 1] == b"{":
        end, _ = _element_end(mm, pos)
        value = parse_record(bytes(mm[pos:end if end >= 0 else len(mm)]), 0).value
        if isinstance(value, dict):
            return f"this is one object with keys {_keys(value)} (expected records with {SHAPES})"
    return f"it starts with {escaped(bytes(mm[pos:pos + 40]))!r}"


def _keys(value: dict) -> str:
    keys = sorted(map(str, value))
    return ", ".join(keys[:12]) + (f" (+{len(keys) - 12} more)" if len(keys) > 12 else "") if keys else "none"


# --- Parquet --------------------------------------------------------------------------------------


def _parquet(path: Path, max_record_bytes: int) -> Iterator[Raw]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise SourceError(f"{path}: not a readable Parquet file: {e}") from None
    # A column name with a BOM (a CSV export converted to Parquet) is the name without it.
    columns = [name.removeprefix("\ufeff") for name in pf.schema_arrow.names]
    renamed = dict(zip(pf.schema_arrow.names, columns, strict=True)) if columns != pf.schema_arrow.names else None
    if not {"messages", "conversations", "prompt", "instruction"} & set(columns):
        raise SourceError(f"{path}: no record in this Parquet file can be a prompt: columns {', '.join(columns) or 'none'}; "
                          f"expected a column {SHAPES}")
    n = 0
    batches = pf.iter_batches(batch_size=1024)
    while True:
        try:
            batch = next(batches, None)
        except (pa.ArrowException, OSError) as e:
            raise SourceError(f"{path}: Parquet file unreadable after row {n}: {e}") from None
        if batch is None:
            return
        try:
            rows: list[dict | None] = batch.to_pylist()
        except _VALUE_ERRORS:  # some value has no Python form: find the rows, keep the others
            rows = [_parquet_row(batch, i) for i in range(batch.num_rows)]
        for i, row in enumerate(rows):
            n += 1
            if row is None:
                yield _unreadable_row(batch, i, n)
            else:
                yield Raw(n, {renamed[k]: v for k, v in row.items()} if renamed else row)


# What converting a Parquet value to Python raises when Python cannot hold it (OverflowError for a
# timestamp past year 9999 or a duration over C int range; ArrowNotImplementedError for a type with no
# Python form).
_VALUE_ERRORS = (ArithmeticError, ValueError, TypeError, NotImplementedError, RecursionError)


def _parquet_row(batch: Any, i: int) -> dict | None:
    try:
        return batch.slice(i, 1).to_pylist()[0]
    except _VALUE_ERRORS:
        return None


def _unreadable_row(batch: Any, i: int, n: int) -> Raw:
    """The reject of a row with a value Python cannot hold, naming the column and the converter's message."""
    for name, column in zip(batch.schema.names, batch.columns, strict=True):
        try:
            column[i].as_py()
        except _VALUE_ERRORS as e:
            return Raw(n, error=f"column {name.removeprefix(chr(0xFEFF))!r}: value has no Python form "
                       f"({type(e).__name__}: {e})", code=Reason.UNREADABLE_VALUE, raw=_scalar_text(column, i))
    return Raw(n, error="row has no Python form", code=Reason.UNREADABLE_VALUE)


def _scalar_text(column: Any, i: int) -> bytes:
    """Arrow's own text of the value (Arrow formats what Python cannot hold), bounded."""
    try:
        return column.slice(i, 1).to_string(window=1)[:RAW_PREFIX].encode()
    except Exception:  # text for a reject only: the type says enough then
        return str(column.type).encode()


READERS = {"jsonl": _jsonl, "json": _json_array, "parquet": _parquet}
DEFAULT_MAX_RECORD_BYTES = 16 << 20


def _s3_source(source: str, cfg: Config) -> tuple[Any, str]:
    """(a Store on the source's bucket, the key), or SourceError for a malformed URI."""
    from shared.store import Store, StoreError, resolve_credentials

    bucket, _, key = source[len("s3://"):].partition("/")
    if not bucket or not key:
        raise SourceError(f"{source}: expected s3://bucket/key")
    try:
        return Store(msgspec.structs.replace(cfg.store, bucket=bucket, create_bucket=False), *resolve_credentials(cfg)), key
    except StoreError as e:
        raise SourceError(f"{source}: {e}") from None


def check_source(source: str, cfg: Config) -> None:
    """Raise SourceError unless `source` exists and can be read (an S3 object is stat'ed, not downloaded):
    `dfpipe run` checks its prompt sources with this before it starts any service."""
    if not source.startswith("s3://"):
        if not Path(source).is_file():
            raise SourceError(f"{source}: no such file")
        check_encoding(Path(source))  # a Parquet file starts with PAR1: never taken for UTF-16
        return
    from shared.store import StoreError

    store, key = _s3_source(source, cfg)
    try:
        found = store.stat(key)
    except StoreError as e:
        raise SourceError(f"{source}: {e}") from None  # the store's errors name the bucket
    if found is None:
        _check_bucket(store, source)  # a missing bucket reads as a missing object (a HEAD has no error code)
        raise SourceError(f"{source}: no such object in bucket {store.bucket!r}")


@contextlib.contextmanager
def local_copy(source: str, cfg: Config) -> Iterator[Path]:
    """A local path for `source`; an `s3://bucket/key` source is downloaded to a temp file first."""
    check_source(source, cfg)
    if not source.startswith("s3://"):
        yield Path(source)
        return
    from shared.store import StoreError

    store, key = _s3_source(source, cfg)
    fd, tmp = tempfile.mkstemp(prefix="dflash-feed-", suffix="".join(Path(key).suffixes[-1:]))
    os.close(fd)
    try:
        try:
            store.get_file(key, tmp, verify=False)  # a user's file carries no dflash checksum
        except StoreError as e:
            raise SourceError(f"{source}: {e}") from None
        yield Path(tmp)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def _check_bucket(store: Any, source: str) -> None:
    from shared.store import StoreError

    try:
        store.ping()
    except StoreError as e:
        raise SourceError(f"{source}: {e}") from None


def read_records(path: Path, fmt: str | None = None, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> Iterator[Raw]:
    """The records of `path`, each with its number; SourceError when the file as a whole is unusable."""
    if fmt != "parquet":
        check_encoding(path)  # before format detection: a UTF-16 file has no recognisable first byte
    return READERS[fmt or detect_format(path)](path, max_record_bytes)


def accepted_prompts(sources: list[str], cfg: Config) -> Iterator[tuple[str, int, list[ChatMessage]]]:
    """(source, line, normalized messages) of every record of `sources` the feeder would accept, one at a time;
    blank lines and rejects are skipped (reporting them is the feeder's). For readers that need the prompts
    again without feeding them: calibration's sample, a lost shard's prompts found again."""
    from .normalize import RejectedRecord, normalize

    for source in sources:
        with local_copy(source, cfg) as path:
            for raw in read_records(path, max_record_bytes=cfg.feeder.max_record_bytes):
                if raw.error or raw.blank:
                    continue
                try:
                    yield source, raw.line, normalize(raw.value)
                except RejectedRecord:
                    continue
