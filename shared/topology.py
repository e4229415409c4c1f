"""Where everything lives: the NATS subjects, the JetStream streams that capture them, and the S3 keys.

This is the only module that formats a subject or an object key, so a rename happens here once and
`tests/test_topology.py` checks the whole table: every subject `Subjects` produces is captured by
exactly one stream, and every key of a run lies under `runs/<run>/`.

Subjects: `dflash.<run>.<stage>.<event>[.<worker or prompt>]`. Stage is one of feed, generate,
tokenize, train, eval (and run, for the pipeline's own alerts). Progress subjects end with the worker
so that a LAST_PER_SUBJECT consumer yields every worker's latest state.

Pass `ANY` ("*") for a token to get the filter that matches every value of it (e.g. every worker's
progress of every stage of a run: `Subjects.progress(run, ANY, ANY)`); any other run, stage or worker name is checked by `check_name`, so a name with a dot or
a slash can never change a subject's or a key's shape.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

PREFIX = "dflash"
ANY = "*"  # one subject token, any value: for filters and the stream table, never for a publish

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")


def check_name(kind: str, value: str) -> str:
    """Run and worker names become subject tokens and S3 path parts: no dots, wildcards or slashes."""
    if not _NAME.match(value):
        raise ValueError(
            f"invalid {kind} name {value!r}: use 1-64 letters, digits, '_' or '-', starting with a letter or digit"
        )
    return value


def _token(kind: str, value: str) -> str:
    return value if value == ANY else check_name(kind, value)


def _subject(run: str, stage: str, *rest: str) -> str:
    return ".".join((PREFIX, _token("run", run), _token("stage", stage), *rest))


# --- subjects ----------------------------------------------------------------------------------


class Subjects:
    """The one subject naming scheme (see the module doc)."""

    PREFIX = PREFIX

    @staticmethod
    def prompts(run: str) -> str:
        return _subject(run, "generate", "task")

    @staticmethod
    def shards(run: str) -> str:
        return _subject(run, "generate", "shard")

    @staticmethod
    def tokenized(run: str) -> str:
        return _subject(run, "tokenize", "shard")

    @staticmethod
    def progress(run: str, stage: str, worker: str) -> str:
        return _subject(run, stage, "progress", _token("worker", worker))

    @staticmethod
    def alert(run: str, stage: str) -> str:
        return _subject(run, stage, "alert")

    @staticmethod
    def deadletter(run: str, stage: str) -> str:
        return _subject(run, stage, "deadletter")

    @staticmethod
    def registry(run: str, prompt_id: str) -> str:
        """One subject per prompt in the task registry: survives server restarts, unlike the dedupe window."""
        return _subject(run, "feed", "registry", _token("prompt_id", prompt_id))

    @staticmethod
    def whole_run(run: str) -> str:
        """Every subject of one run (or of every run, with ANY), in any stream (a filter)."""
        return f"{PREFIX}.{_token('run', run)}.>"


STAGES = ("feed", "generate", "tokenize", "train", "eval")


# --- streams -----------------------------------------------------------------------------------


class Streams:
    """The JetStream stream names: the table below and every reader spell them from here."""

    PROMPTS = "PROMPTS"
    REGISTRY = "REGISTRY"
    SHARDS = "SHARDS"
    TOKENIZED = "TOKENIZED"
    PROGRESS = "PROGRESS"
    DEADLETTER = "DEADLETTER"


def durable(stage: str, run: str) -> str:
    """The durable consumer of one stage's work in one run (see `stage_input`)."""
    return f"{_token('stage', stage)}-{_token('run', run)}"


@dataclass(frozen=True)
class StreamSpec:
    name: str
    subjects: tuple[str, ...]
    description: str
    work_queue: bool = False
    max_age_s: float = 0.0  # 0: keep forever
    max_msgs_per_subject: int = -1
    discard_new_per_subject: bool = False
    duplicate_window_s: float | None = None  # None: the bus config's


def streams(progress_max_age_s: float) -> list[StreamSpec]:
    """The stream table: which stream captures which subjects, and how long it keeps them (progress for
    `bus.progress_max_age_s`)."""
    return [
        StreamSpec(Streams.PROMPTS, (Subjects.prompts(ANY),), "prompt work queue: one PromptTask per prompt",
                   work_queue=True),
        StreamSpec(
            Streams.REGISTRY, (Subjects.registry(ANY, ANY),),
            "one message per fed prompt: dedupe that survives server restarts",
            max_msgs_per_subject=1, discard_new_per_subject=True, duplicate_window_s=120.0,
        ),
        StreamSpec(Streams.SHARDS, (Subjects.shards(ANY),), "ShardWritten log (replayable)"),
        StreamSpec(Streams.TOKENIZED, (Subjects.tokenized(ANY),), "TokenizedShard log (replayable)"),
        StreamSpec(
            Streams.PROGRESS, (Subjects.progress(ANY, ANY, ANY), Subjects.alert(ANY, ANY)),
            "progress heartbeats and alerts, kept for max_age so a late dashboard sees history",
            max_age_s=progress_max_age_s, duplicate_window_s=60.0,
        ),
        StreamSpec(Streams.DEADLETTER, (Subjects.deadletter(ANY, ANY),), "messages the pipeline gave up on, with the error"),
    ]


# --- leases (a NATS KV bucket) ---------------------------------------------------------------------

LEASES_BUCKET = "DFLASH_LEASES"  # one entry per held lease; each entry expires by its own TTL unless renewed


def lease_key(run: str, role: str) -> str:
    """The KV key of a run's lease for one role (e.g. the run's one trainer): `<role>.<run>`."""
    return f"{check_name('role', role)}.{check_name('run', run)}"


def stage_input(stage: str, run: str) -> tuple[str, str]:
    """(stream, filter subject) of the work a stage consumes: one durable consumer per stage and run."""
    table = {
        "generate": (Streams.PROMPTS, Subjects.prompts(run)),
        "tokenize": (Streams.SHARDS, Subjects.shards(run)),
        "train": (Streams.TOKENIZED, Subjects.tokenized(run)),
    }
    return table[stage]


# --- object keys -------------------------------------------------------------------------------


def _folder(run: str, *parts: str | None) -> str:
    """`runs/<run>/` and the parts that are given, each a folder."""
    return f"runs/{check_name('run', run)}/" + "".join(f"{p}/" for p in parts if p)


class Keys:
    """Deterministic object keys: every artifact of a run lives under `runs/<run>/`."""

    @staticmethod
    def run(run: str) -> str:
        """The prefix of everything a run stores."""
        return _folder(run)

    @staticmethod
    def manifest(run: str) -> str:
        """The feeder's per-source counts and totals (JSON)."""
        return Keys.run(run) + "manifest.json"

    @staticmethod
    def run_config(run: str) -> str:
        """The run's resolved settings (JSON), written once at its start; checkpoints name it (shared/runconfig.py)."""
        return Keys.run(run) + "config.json"

    @staticmethod
    def calibration(run: str) -> str:
        """What `dfpipe calibrate` measured of the run's engines (JSON, shared/calibration.py)."""
        return Keys.run(run) + "calibration.json"

    @staticmethod
    def target(run: str) -> str:
        """The identity of the target the run trained against (JSON: shared.model.target_identity)."""
        return Keys.run(run) + "target.json"

    @staticmethod
    def rejects(run: str) -> str:
        """The records the feeder refused, with reasons (JSON lines; one source's lines replaced per feed)."""
        return Keys.run(run) + "rejects.jsonl"

    @staticmethod
    def completions_prefix(run: str, worker: str | None = None) -> str:
        """Every completions shard of a run, or of one worker."""
        return _folder(run, "completions", check_name("worker", worker) if worker else None)

    @staticmethod
    def completions(run: str, worker: str, seq: int) -> str:
        return Keys.completions_prefix(run, worker) + f"{seq:08d}.parquet"

    @staticmethod
    def completions_seq(prefix: str, key: str) -> int | None:
        """The shard number of a key under `completions_prefix(run, worker)`; None for anything else there."""
        name = key[len(prefix):] if key.startswith(prefix) else ""
        stem, dot, ext = name.partition(".")
        return int(stem) if dot and ext == "parquet" and stem.isdigit() else None

    @staticmethod
    def tokenized_prefix(run: str, fingerprint: str | None = None) -> str:
        """Every tokenized shard of a run, or of one template fingerprint."""
        return _folder(run, "tokenized", fingerprint)

    @staticmethod
    def tokenized(run: str, fingerprint: str, shard_name: str) -> str:
        return Keys.tokenized_prefix(run, fingerprint) + f"{shard_name}.parquet"

    @staticmethod
    def tokenized_drops(run: str, fingerprint: str, shard_name: str) -> str:
        """The records a tokenized shard's build dropped, with reasons (JSON lines; only when there are any)."""
        return Keys.tokenized_prefix(run, fingerprint) + f"drops/{shard_name}.jsonl"

    @staticmethod
    def tokenizer_gate(run: str, fingerprint: str) -> str:
        """The tripped quality gate of a run's tokenizing under one template fingerprint (JSON Alert)."""
        return Keys.tokenized_prefix(run, fingerprint) + "gate.json"

    @staticmethod
    def ledger(run: str) -> str:
        """The run ledger's snapshot (shared.ledger): a fold of the run's logs up to per-stream sequences."""
        return Keys.run(run) + "ledger/snapshot.bin"

    @staticmethod
    def checkpoints_prefix(run: str) -> str:
        return _folder(run, "checkpoints")

    @staticmethod
    def checkpoint(run: str, step: int) -> str:
        """One checkpoint's folder: everything a resume needs."""
        return Keys.checkpoints_prefix(run) + f"step-{step:08d}/"

    @staticmethod
    def checkpoint_latest(run: str) -> str:
        """The pointer to the newest complete checkpoint, written after the checkpoint itself."""
        return Keys.checkpoints_prefix(run) + "latest.json"

    @staticmethod
    def eval_report(run: str) -> str:
        """`dfpipe eval`'s report (JSON EvalReport)."""
        return Keys.run(run) + "eval/report.json"
