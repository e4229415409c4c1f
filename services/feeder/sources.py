"""Stream records out of a prompt file (local or `s3://bucket/key`) in constant memory.

Formats, auto-detected by extension then by content: JSONL (one object per line), JSON (a
top-level array, parsed incrementally), Parquet (row batches). Each record comes with its
1-based number in the source (the line for JSONL), so a reject names exactly what to fix.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec

from shared.config import Config

CHUNK = 1 << 20
_decoder = msgspec.json.Decoder()


class SourceError(ValueError):
    """The source as a whole is unusable (missing, unknown format, not an array)."""


class Raw(msgspec.Struct):
    line: int
    value: Any = None
    error: str = ""  # set when this one record could not be parsed


def detect_format(path: Path) -> str:
    name = path.name.lower()
    for ext, fmt in ((".jsonl", "jsonl"), (".ndjson", "jsonl"), (".json", "json"), (".parquet", "parquet")):
        if name.endswith(ext):
            return fmt
    with open(path, "rb") as f:
        head = f.read(4096)
    if head.startswith(b"PAR1"):
        return "parquet"
    stripped = head.lstrip(b"\xef\xbb\xbf \t\r\n")
    if stripped.startswith(b"["):
        return "json"
    if stripped.startswith(b"{"):
        return "jsonl"
    raise SourceError(f"{path}: cannot tell the format (not JSONL, a JSON array or Parquet)")


def _jsonl(path: Path) -> Iterator[Raw]:
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield Raw(n, _decoder.decode(line))
            except msgspec.DecodeError as e:
                yield Raw(n, error=f"invalid JSON: {e}")


def _json_array(path: Path) -> Iterator[Raw]:
    """Objects of a top-level JSON array, decoded one at a time from a sliding buffer."""
    dec = json.JSONDecoder()
    with open(path, encoding="utf-8-sig") as f:
        buf = f.read(CHUNK).lstrip()
        if not buf.startswith("["):
            raise SourceError(f"{path}: a JSON source must be an array of records")
        pos, n, eof = 1, 0, False
        while True:
            while True:  # skip whitespace and one comma
                while pos < len(buf) and buf[pos] in " \t\r\n":
                    pos += 1
                if pos < len(buf) or eof:
                    break
                more = f.read(CHUNK)
                eof = not more
                buf, pos = buf[pos:] + more, 0
            if pos >= len(buf):
                raise SourceError(f"{path}: JSON array is not closed (after record {n})")
            if buf[pos] == "]":
                return
            if buf[pos] == "," and n:
                pos += 1
                continue
            try:
                value, end = dec.raw_decode(buf, pos)
            except json.JSONDecodeError as e:
                if not eof:
                    more = f.read(CHUNK)
                    eof = not more
                    buf, pos = buf[pos:] + more, 0
                    continue
                raise SourceError(f"{path}: invalid JSON in record {n + 1}: {e.msg}; cannot resync an array") from None
            n += 1
            yield Raw(n, value)
            pos = end
            if pos > CHUNK:
                buf, pos = buf[pos:], 0


def _parquet(path: Path) -> Iterator[Raw]:
    import pyarrow.parquet as pq

    n = 0
    pf = pq.ParquetFile(path)
    for batch in pf.iter_batches(batch_size=4096):
        for row in batch.to_pylist():
            n += 1
            yield Raw(n, row)


READERS = {"jsonl": _jsonl, "json": _json_array, "parquet": _parquet}


@contextlib.contextmanager
def local_copy(source: str, cfg: Config) -> Iterator[Path]:
    """A local path for `source`; an `s3://bucket/key` source is downloaded to a temp file first."""
    if not source.startswith("s3://"):
        path = Path(source)
        if not path.is_file():
            raise SourceError(f"{source}: no such file")
        yield path
        return
    from shared.store import KeyNotFound, Store, resolve_credentials

    bucket, _, key = source[len("s3://"):].partition("/")
    if not bucket or not key:
        raise SourceError(f"{source}: expected s3://bucket/key")
    store_cfg = msgspec.structs.replace(cfg.store, bucket=bucket, create_bucket=False)
    store = Store(store_cfg, *resolve_credentials(cfg))
    suffix = "".join(Path(key).suffixes[-1:])
    fd, tmp = tempfile.mkstemp(prefix="dflash-feed-", suffix=suffix)
    os.close(fd)
    try:
        try:
            store.get_file(key, tmp, verify=False)  # a user's file carries no dflash checksum
        except KeyNotFound:
            raise SourceError(f"{source}: no such object") from None
        yield Path(tmp)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def read_records(path: Path, fmt: str | None = None) -> Iterator[Raw]:
    return READERS[fmt or detect_format(path)](path)
