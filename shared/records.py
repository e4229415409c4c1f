"""The two artifacts stages hand each other through S3: completion shards and tokenized shards.

Both are Parquet, loadable with pandas and `datasets.load_dataset("parquet", ...)`.

Dedupe rule (at-least-once delivery means a prompt can be completed twice, e.g. after a
kill -9 between the shard write and the ack): readers keep **one record per prompt_id**,
the first by the key (-generation, truncated, shard_key, row): a deliberate regeneration
(`dfpipe replay generate --shard`, generation ≥ 1) beats what it replaces, then a complete
generation beats a truncated one, then the lexically smallest shard key, then the earliest row. The rule depends only on
what is in S3, never on the order shards are read, so every reader agrees.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterable
from typing import Any

import msgspec
import pyarrow as pa
import pyarrow.parquet as pq

from shared.messages import ChatMessage


class CompletionRecord(msgspec.Struct, kw_only=True):
    run: str
    prompt_id: str
    messages: list[ChatMessage]  # the conversation given to the target (everything before the regenerated turn)
    completion: str  # the regenerated assistant answer (without reasoning when the engine splits it)
    reasoning: str | None = None
    output_ids: list[int] | None = None  # what the engine really emitted, stop token included when it returns it
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str = "stop"  # stop | length | ...
    model: str = ""
    engine: str = ""
    sampling_fingerprint: str = ""
    worker: str = ""
    attempt: int = 1
    generation: int = 0  # 0: first generation; n: the n-th deliberate regeneration of a bad shard
    latency_s: float = 0.0
    ts: float = 0.0

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"


COMPLETION_SCHEMA = pa.schema([
    ("run", pa.string()),
    ("prompt_id", pa.string()),
    ("messages", pa.string()),  # JSON list of {role, content[, reasoning]}
    ("completion", pa.string()),
    ("reasoning", pa.string()),
    ("output_ids", pa.list_(pa.int32())),
    ("prompt_tokens", pa.int32()),
    ("completion_tokens", pa.int32()),
    ("finish_reason", pa.string()),
    ("truncated", pa.bool_()),
    ("model", pa.string()),
    ("engine", pa.string()),
    ("sampling_fingerprint", pa.string()),
    ("worker", pa.string()),
    ("attempt", pa.int32()),
    ("generation", pa.int32()),
    ("latency_s", pa.float64()),
    ("ts", pa.float64()),
])

_msgs_encoder = msgspec.json.Encoder()
_msgs_decoder = msgspec.json.Decoder(list[ChatMessage])


class RecordError(ValueError):
    pass


def _to_parquet(table: pa.Table) -> bytes:
    buf = io.BytesIO()
    # Fixed writer settings so the same records always give the same bytes (deterministic shard content).
    pq.write_table(table, buf, compression="snappy", write_statistics=False, store_schema=True)
    return buf.getvalue()


def _read_table(data: bytes, what: str) -> pa.Table:
    try:
        return pq.read_table(io.BytesIO(data))
    except (pa.ArrowInvalid, OSError) as e:
        raise RecordError(f"not a readable Parquet {what}: {e}") from None


def completions_to_parquet(records: list[CompletionRecord]) -> bytes:
    cols: dict[str, list[Any]] = {name: [] for name in COMPLETION_SCHEMA.names}
    for r in records:
        row = msgspec.structs.asdict(r)
        row["messages"] = _msgs_encoder.encode(r.messages).decode()
        row["truncated"] = r.truncated
        for name in COMPLETION_SCHEMA.names:
            cols[name].append(row[name])
    return _to_parquet(pa.Table.from_pydict(cols, schema=COMPLETION_SCHEMA))


def read_completions(data: bytes) -> list[CompletionRecord]:
    table = _read_table(data, "completions shard")
    missing = set(COMPLETION_SCHEMA.names) - {"truncated", "generation"} - set(table.column_names)
    if missing:
        raise RecordError(f"completions shard lacks columns {sorted(missing)}")
    out = []
    for row in table.to_pylist():
        row.pop("truncated", None)
        if row.get("generation") is None:
            row["generation"] = 0
        try:
            row["messages"] = _msgs_decoder.decode(row["messages"])
            out.append(msgspec.convert(row, CompletionRecord))
        except (msgspec.ValidationError, msgspec.DecodeError) as e:
            raise RecordError(f"bad completion record {row.get('prompt_id')!r}: {e}") from None
    return out


def dedupe_completions(shards: Iterable[tuple[str, list[CompletionRecord]]]) -> dict[str, CompletionRecord]:
    """One record per prompt_id by the module's rule; input order does not matter."""
    best: dict[str, tuple[tuple[int, bool, str, int], CompletionRecord]] = {}
    for key, records in shards:
        for row, rec in enumerate(records):
            rank = (-rec.generation, rec.truncated, key, row)
            cur = best.get(rec.prompt_id)
            if cur is None or rank < cur[0]:
                best[rec.prompt_id] = (rank, rec)
    return {pid: rec for pid, (_, rec) in best.items()}


# --- tokenized samples ---------------------------------------------------------------------------


class TokenizedSample(msgspec.Struct, kw_only=True):
    prompt_id: str
    input_ids: list[int]
    loss_mask: list[int]  # 1 on tokens the assistant generated (reasoning if trained on, answer, end-of-turn)
    num_tokens: int
    num_supervised: int
    truncated: bool = False  # cut to max_length by the tokenizer
    generation: int = 0  # the completion's (a deliberate regeneration's sample replaces the older one)

    def __post_init__(self) -> None:
        if len(self.input_ids) != len(self.loss_mask):
            raise ValueError(f"sample {self.prompt_id}: {len(self.input_ids)} ids but {len(self.loss_mask)} mask values")


SAMPLE_SCHEMA = pa.schema([
    ("prompt_id", pa.string()),
    ("input_ids", pa.list_(pa.int32())),
    ("loss_mask", pa.list_(pa.int8())),
    ("num_tokens", pa.int32()),
    ("num_supervised", pa.int32()),
    ("truncated", pa.bool_()),
    ("generation", pa.int32()),
])


SUMMARY_KEY = b"dflash.summary"


def samples_to_parquet(samples: list[TokenizedSample], summary: dict[str, Any] | None = None) -> bytes:
    """`summary` (JSON-able: what the shard's build dropped and why) rides in the file's schema metadata, so
    an event announcing the shard can be made again from the object alone, drops included."""
    cols: dict[str, list[Any]] = {name: [getattr(s, name) for s in samples] for name in SAMPLE_SCHEMA.names}
    table = pa.Table.from_pydict(cols, schema=SAMPLE_SCHEMA)
    if summary is not None:
        table = table.replace_schema_metadata({**(table.schema.metadata or {}), SUMMARY_KEY: msgspec.json.encode(summary)})
    return _to_parquet(table)


def read_samples_summary(data: bytes) -> dict[str, Any]:
    """The summary written with a tokenized shard ({} for shards written without one)."""
    try:
        meta = pq.read_schema(io.BytesIO(data)).metadata or {}
    except (pa.ArrowInvalid, OSError) as e:
        raise RecordError(f"not a readable Parquet tokenized shard: {e}") from None
    return msgspec.json.decode(meta[SUMMARY_KEY]) if SUMMARY_KEY in meta else {}


def read_samples(data: bytes) -> list[TokenizedSample]:
    table = _read_table(data, "tokenized shard")
    # shards written before the generation column have no such key in their rows: generation 0
    return [msgspec.convert(row, TokenizedSample) for row in table.to_pylist()]


def read_sample_generations(data: bytes) -> list[tuple[str, int]]:
    """(prompt_id, generation) of each row of a tokenized shard (cheap: the id lists are not decoded)."""
    try:
        pf = pq.ParquetFile(io.BytesIO(data))
        table = pf.read(columns=[c for c in ("prompt_id", "generation") if c in pf.schema_arrow.names])
    except (pa.ArrowInvalid, OSError, KeyError) as e:
        raise RecordError(f"not a readable Parquet tokenized shard: {e}") from None
    ids = table.column("prompt_id").to_pylist()
    gens = table.column("generation").to_pylist() if "generation" in table.column_names else [0] * len(ids)
    return [(pid, g or 0) for pid, g in zip(ids, gens, strict=True)]


def dedupe_samples(shards: Iterable[tuple[str, list[TokenizedSample]]]) -> dict[str, TokenizedSample]:
    """One tokenized sample per prompt_id, the first by (−generation, shard key, row) as for completions:
    a deliberate regeneration's sample replaces the older one; input order does not matter.

    The tokenizer skips a prompt_id it emitted before unless the record is a newer generation, so
    equal generations meet here only when two tokenizer workers raced on two shards of one prompt.
    """
    best: dict[str, tuple[tuple[int, str, int], TokenizedSample]] = {}
    for key, samples in shards:
        for row, s in enumerate(samples):
            rank = (-s.generation, key, row)
            cur = best.get(s.prompt_id)
            if cur is None or rank < cur[0]:
                best[s.prompt_id] = (rank, s)
    return {pid: s for pid, (_, s) in best.items()}


def jsonl_line(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, sort_keys=True) + "\n"
