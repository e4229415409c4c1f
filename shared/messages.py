"""Every message that crosses the bus.

Wire format: msgpack of a tagged msgspec Struct (`"type"` field). Decoding always goes
through the typed decoders below, so a payload from elsewhere fails with a clear
`MessageError` instead of a KeyError three functions later.

Evolution rules (msgspec's schema-evolution doc):
1. A new field always gets a default, so old payloads still decode.
2. Never change an existing field's type; add a new field instead.
3. Never reuse or rename a tag; tags are explicit, lowercase and stable.
4. Wire structs do not forbid unknown fields, so old readers skip new fields.
`v` is the schema version; a decoder refuses a payload from a newer major version.

Subjects (which subject each message travels on) live in shared.topology.
"""

from __future__ import annotations

import time
from typing import Any, Literal

import msgspec

SCHEMA_VERSION = 1


class Message(msgspec.Struct, tag_field="type", kw_only=True):
    v: int = SCHEMA_VERSION
    ts: float = msgspec.field(default_factory=time.time)


class ChatMessage(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: Literal["system", "user", "assistant", "tool"]
    content: str
    reasoning: str | None = None  # an assistant turn's thinking, when the source or engine splits it


# --- work --------------------------------------------------------------------------------------


class PromptTask(Message, tag="prompt_task"):
    """One conversation to complete: the target regenerates the last assistant turn."""

    run: str
    prompt_id: str  # sha256 of the normalized conversation (feeder), stable across re-feeds
    messages: list[ChatMessage]
    source: str = ""  # where it came from: path or s3:// URI
    line: int = 0  # 1-based record number in the source
    generation: int = 0  # >0: a deliberate regeneration (`dfpipe replay generate --shard`); wins on dedupe

    def __post_init__(self) -> None:
        if not self.messages:
            raise ValueError("a PromptTask needs at least one message")


class ShardWritten(Message, tag="shard_written"):
    """A completions shard is durably in S3 at `key`; its prompts may now be acked."""

    run: str
    key: str
    worker: str
    seq: int
    num_records: int
    prompt_ids: list[str]
    sha256: str
    size_bytes: int
    completion_tokens: int = 0
    truncated: int = 0  # records with finish_reason=length


class TokenizedShard(Message, tag="tokenized_shard"):
    """A tokenized shard (training samples) is durably in S3 at `key`."""

    run: str
    key: str
    source_key: str  # the completions shard it was made from
    fingerprint: str  # template/tokenizer fingerprint: part of the key, so re-tokenizing never overwrites
    num_samples: int
    num_tokens: int
    num_supervised: int
    sha256: str
    dropped: dict[str, int] = {}  # reason -> records of the source shard not kept (duplicates included)
    retokenization_drift: int = 0
    supervised_histogram: dict[str, int] = {}  # supervised tokens per sample, power-of-two bucket -> samples


# --- progress ----------------------------------------------------------------------------------


class FeederProgress(Message, tag="feeder_progress"):
    run: str
    worker: str
    read: int = 0
    accepted: int = 0
    duplicates: int = 0
    rejected: int = 0
    published: int = 0  # new on the bus (not refused as a duplicate)
    done: bool = False


class GeneratorProgress(Message, tag="generator_progress"):
    run: str
    worker: str
    completions: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_tokens_per_s: float = 0.0
    completion_tokens_per_s: float = 0.0
    completions_per_s: float = 0.0
    in_flight: int = 0
    errors: int = 0
    shards: int = 0
    finish_reasons: dict[str, int] = {}
    spec_accept_length: float | None = None
    state: str = "running"  # running | draining | stopped
    # The engine this generator feeds (sglang/openai backends; empty for in-process ones) and how full it is kept.
    # None: the engine did not say (no /metrics, no /get_server_info field).
    engine: str = ""  # its URL
    engine_running: int | None = None  # requests decoding in the engine now
    engine_queued: int | None = None  # requests waiting in the engine's queue
    engine_max_running: int | None = None  # the engine's batch limit (SGLang max_running_requests)
    engine_tokens_per_s: float | None = None  # the engine's own generation throughput, when it reports one
    concurrency: int = 0  # requests this generator keeps in flight now (its adaptive level)


class TokenizerProgress(Message, tag="tokenizer_progress"):
    run: str
    worker: str
    fingerprint: str = ""
    shards: int = 0
    samples_in: int = 0
    samples_kept: int = 0
    tokens: int = 0
    supervised_tokens: int = 0
    dropped: dict[str, int] = {}
    retokenization_drift: int = 0
    supervised_histogram: dict[str, int] = {}  # bucket lower bound (as str) -> count
    gate_tripped: bool = False
    state: str = "running"


class TrainerProgress(Message, tag="trainer_progress"):
    run: str
    worker: str
    step: int = 0
    total_steps: int = 0  # the step schedule's length now (data that joins later stretches it); under a
    # time budget that ends first, the step it will end at at the current pace
    epoch: int = 0
    loss: float = 0.0
    lr: float = 0.0
    position_accuracy: list[float] = []  # block slot 1..B-1
    estimated_tau: float = 0.0
    tokens_per_s: float = 0.0
    target_forward_share: float = 0.0
    samples_seen: int = 0
    checkpoint_key: str | None = None
    state: str = "running"
    resumes: int = 0  # times this run's training went on from a checkpoint (kept in the checkpoints)
    steps_per_s: float = 0.0  # optimizer steps per second over the recent steps
    eta_s: float | None = None  # seconds to total_steps at that rate; None while unknown
    ended_by: str = ""  # what ended a done training: "steps" (max_steps), "epochs" or "time" (max_train_s)


class EvalReport(Message, tag="eval_report"):
    run: str
    worker: str = "eval"
    checkpoint_key: str = ""
    prompts: int = 0
    tau: float = 0.0
    acceptance_histogram: list[int] = []  # index = tokens accepted in a cycle (bonus included)
    speedup: float = 0.0
    # greedy: every output equal to plain greedy decoding, token for token; None for a sampled run (lossless by
    # the rejection rule, not comparable token by token)
    lossless: bool | None = None
    mismatches: int = 0
    temperature: float = 0.0  # > 0: sampled (lossless speculative sampling, not compared token by token)
    top_p: float = 1.0
    top_k: int = 0
    seeds: int = 1
    tau_per_seed: list[float] = []
    tau_std: float = 0.0  # sample standard deviation of tau over seeds
    max_new_tokens: int = 0  # per prompt (trainer.eval_max_new_tokens); 0 in reports written before it was kept
    machine: str = ""  # where τ and the speedup were measured (shared.machine); "" in reports written before


class Alert(Message, tag="alert"):
    """Something a person must look at: quality gate, crash loop, silent worker."""

    run: str
    stage: str
    kind: str  # quality_gate | crash_loop | silent_worker | ...
    message: str
    severity: Literal["warning", "critical"] = "critical"
    worker: str = ""
    examples: list[str] = []


# --- failures ----------------------------------------------------------------------------------


class DeadLetter(Message, tag="dead_letter"):
    """A message the pipeline gave up on, with everything needed to put it back."""

    run: str
    stage: str
    stream: str
    subject: str  # where the original was published; replay publishes there again
    consumer: str
    stream_seq: int
    num_delivered: int
    error: str
    payload: bytes  # the original message, byte for byte


AnyMessage = (
    PromptTask
    | ShardWritten
    | TokenizedShard
    | FeederProgress
    | GeneratorProgress
    | TokenizerProgress
    | TrainerProgress
    | EvalReport
    | Alert
    | DeadLetter
)
ProgressMessage = FeederProgress | GeneratorProgress | TokenizerProgress | TrainerProgress | EvalReport | Alert


class MessageError(ValueError):
    """A payload that is not a valid dflash-pipeline message of the expected type."""


class NewerSchema(MessageError):
    """A message from a newer build (`v` above SCHEMA_VERSION): skipped by log readers, dead-lettered by workers."""

    def __init__(self, version: int) -> None:
        self.version = version
        super().__init__(f"message schema v{version} is newer than this build's v{SCHEMA_VERSION}: upgrade dflash-pipeline")


_encoder = msgspec.msgpack.Encoder()
_decoders: dict[Any, msgspec.msgpack.Decoder] = {}


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes, type: Any = AnyMessage) -> Any:
    """Decode a payload as `type` (a Message subclass or a union), or raise MessageError saying why."""
    decoder = _decoders.get(type)
    if decoder is None:
        decoder = _decoders[type] = msgspec.msgpack.Decoder(type)
    try:
        msg = decoder.decode(data)
    except msgspec.ValidationError as e:
        raw = _peek(data)
        if isinstance(raw, dict) and isinstance(raw.get("v"), int) and raw["v"] > SCHEMA_VERSION:
            raise NewerSchema(raw["v"]) from None
        if isinstance(raw, dict) and "type" in raw:
            raise MessageError(f"invalid {raw['type']!r} message: {e}") from None
        raise MessageError(f"not a dflash-pipeline message ({e})") from None
    except msgspec.DecodeError as e:
        raise MessageError(f"not a dflash-pipeline message: payload of {len(data)} bytes is not msgpack ({e})") from None
    if msg.v > SCHEMA_VERSION:
        raise NewerSchema(msg.v)
    return msg


def _peek(data: bytes) -> Any:
    try:
        return msgspec.msgpack.decode(data)
    except msgspec.DecodeError:
        return None
