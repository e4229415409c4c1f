"""`dfpipe export --run R [--step N] DIR`: a run's drafter as a folder an engine serves or a hub takes as is.

Config and weights of one checkpoint (default: the one the eval measured, else the latest), the target's
tokenizer files, a model card (README.md) that names the target by its recorded identity and states every key
the engines' DFlash / DFlash 2 parsers read, `export.json` (the same facts as JSON) and a sha256 manifest.
Refused, one line each, before anything is written: a run with no checkpoint, a step it does not have, a
destination that is not empty, and, without `--step`, a run whose trainer is still training (its latest
checkpoint would be stale within minutes: `--step` exports one it has written, with a warning).
"""

from __future__ import annotations

import asyncio
import json
import re
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec

from shared.bus import Bus
from shared.config import Config
from shared.exits import Exit
from shared.messages import EvalReport, TokenizedShard, TrainerProgress
from shared.store import Store
from shared.topology import ANY, Keys, Streams, Subjects

from .card import model_card
from .destination import open_destination
from .serving import served_config

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "added_tokens.json", "chat_template.jinja", "generation_config.json")
# trainer states that mean it is not training now (services/trainer/loop.py)
_IDLE = ("done", "stopped")


class ExportRefused(Exception):
    """Why an export did not start, as one line, and the exit code that says so."""

    def __init__(self, line: str, code: Exit) -> None:
        super().__init__(line)
        self.code = code


def _json(store: Store, key: str) -> Any:
    return json.loads(store.get_bytes(key)) if store.exists(key) else None


def checkpoint_steps(store: Store, run: str) -> list[int]:
    """The steps of the run's complete checkpoints (those with a drafter config)."""
    steps = set()
    for key in store.list(Keys.checkpoints_prefix(run)):
        if m := re.search(r"/step-(\d+)/drafter/config\.json$", key):
            steps.add(int(m.group(1)))
    return sorted(steps)


async def trainer_activity(cfg: Config, bus: Bus) -> TrainerProgress | None:
    """The trainer's latest progress if it is training now (not done or stopped, heard from recently)."""
    latest = await bus.latest_per_subject(Streams.PROGRESS, Subjects.progress(cfg.run, "train", ANY))
    recent = [p for _, p in latest if isinstance(p, TrainerProgress) and p.state not in _IDLE
              and time.time() - p.ts < cfg.view.silent_after_s]
    return max(recent, key=lambda p: p.ts) if recent else None


async def _last_progress(cfg: Config, bus: Bus) -> TrainerProgress | None:
    latest = await bus.latest_per_subject(Streams.PROGRESS, Subjects.progress(cfg.run, "train", ANY))
    progress = [p for _, p in latest if isinstance(p, TrainerProgress)]
    return max(progress, key=lambda p: p.ts) if progress else None


async def training_data(cfg: Config, bus: Bus) -> dict[str, Any]:
    """Counts of what the drafter was trained on: the newest template fingerprint's tokenized shards (from the
    TOKENIZED log: one small event per shard, no shard is read) and the feeder's manifest."""
    by_fp: dict[str, dict[str, int]] = {}
    first: dict[str, int] = {}
    async for seq, e in bus.read_log(Streams.TOKENIZED, Subjects.tokenized(cfg.run), 1, TokenizedShard):
        first.setdefault(e.fingerprint, seq)
        agg = by_fp.setdefault(e.fingerprint, {"shards": 0, "samples": 0, "tokens": 0, "supervised": 0, "_keys": 0})
        agg["shards"] += 1
        agg["samples"] += e.num_samples
        agg["tokens"] += e.num_tokens
        agg["supervised"] += e.num_supervised
    out: dict[str, Any] = {}
    if first:
        fp = max(first, key=first.__getitem__)  # the newest template wins (services/trainer/data.py newest_keys)
        out = {k: v for k, v in by_fp[fp].items() if not k.startswith("_")} | {"fingerprint": fp}
    return out


def _target_identity(cfg: Config, store: Store) -> tuple[dict[str, Any] | None, str]:
    recorded = _json(store, Keys.target(cfg.run))
    if recorded:
        return recorded, ""
    from shared.model import ModelNotFound, target_identity

    try:
        return target_identity(cfg.model.target), ("the run did not record its target (trained before runs did); "
                                                   f"this is model.target `{cfg.model.target}` as configured now")
    except ModelNotFound:
        return None, "the run did not record its target and model.target is not on this machine"


def _tokenizer_dir(cfg: Config, identity: dict[str, Any] | None) -> Path | None:
    from shared.model import ModelNotFound, resolve_target

    for candidate in ([identity["path"]] if identity and identity.get("path") else []) + [cfg.model.target]:
        try:
            return resolve_target(candidate)
        except ModelNotFound:
            continue
    return None


def _training_settings(cfg: Config, store: Store) -> dict[str, Any]:
    resolved = _json(store, Keys.run_config(cfg.run))
    if resolved and isinstance(resolved.get("trainer"), dict):
        return {"settings": resolved["trainer"]}
    return {"settings": msgspec.to_builtins(cfg.trainer),
            "note": "the run did not record its resolved config; these are the trainer settings configured now"}


def choose_checkpoint(cfg: Config, store: Store, step: int | None) -> tuple[str, int, EvalReport | None, str]:
    """(checkpoint prefix, step, the eval report if it measured this checkpoint, why not otherwise)."""
    run = cfg.run
    report = None
    if store.exists(Keys.eval_report(run)):
        report = msgspec.json.decode(store.get_bytes(Keys.eval_report(run)), type=EvalReport)
    steps = checkpoint_steps(store, run)
    if not steps:
        raise ExportRefused(f"dfpipe export: run {run} has no checkpoint yet (train it first: dfpipe train --run {run})",
                            Exit.USAGE)
    if step is not None:
        if step not in steps:
            raise ExportRefused(f"dfpipe export: run {run} has no checkpoint at step {step} (it has steps "
                                f"{', '.join(map(str, steps))})", Exit.USAGE)
        prefix = Keys.checkpoint(run, step)
    elif report is not None and report.checkpoint_key and store.exists(report.checkpoint_key + "drafter/config.json"):
        prefix = report.checkpoint_key
        step = int(re.search(r"step-(\d+)/$", prefix).group(1))  # type: ignore[union-attr]
    else:
        latest = _json(store, Keys.checkpoint_latest(run))
        prefix = latest["key"] if latest else Keys.checkpoint(run, steps[-1])
        step = int(latest["step"]) if latest else steps[-1]
    if report is None:
        return prefix, step, None, f"run {run} has no eval report (dfpipe eval --run {run})"
    if report.checkpoint_key != prefix:
        return prefix, step, None, (f"the run's eval measured {report.checkpoint_key}, not this checkpoint "
                                    f"(dfpipe eval --run {run} evaluates the latest)")
    return prefix, step, report, ""


async def export_drafter(cfg: Config, store: Store, bus: Bus, where: str, step: int | None = None,
                         *, warn: Any = print) -> dict[str, Any]:
    """Write the export to `where` (a folder or s3://); returns the facts the card was made from."""
    run = cfg.run
    if missing := await bus.run_missing(run):
        raise ExportRefused(f"dfpipe export: {missing}", Exit.USAGE)
    busy = await trainer_activity(cfg, bus)
    if busy is not None and step is None:
        raise ExportRefused(
            f"dfpipe export: run {run}'s trainer is still training (step {busy.step} of {busy.total_steps}, "
            f"{time.time() - busy.ts:.0f}s ago): wait until it is done, or pass --step N to export a checkpoint "
            "it has written", Exit.BUSY)
    progress = await _last_progress(cfg, bus)
    data = await training_data(cfg, bus)
    return await asyncio.to_thread(_write_export, cfg, store, where, step, busy, progress, data, warn)


def _write_export(cfg: Config, store: Store, where: str, step: int | None, busy: TrainerProgress | None,
                  progress: TrainerProgress | None, data: dict[str, Any], warn: Any) -> dict[str, Any]:
    run = cfg.run
    prefix, step, report, eval_note = choose_checkpoint(cfg, store, step)
    if busy is not None:
        warn(f"warning: run {run}'s trainer is still training (step {busy.step}); exporting step {step} as asked")
    dest = open_destination(cfg, where)  # refuses a destination that is not empty, before anything is written
    try:
        config = served_config(json.loads(store.get_bytes(prefix + "drafter/config.json")))
        identity, identity_note = _target_identity(cfg, store)
        data["prompts"] = (_json(store, Keys.manifest(run)) or {}).get("total_accepted", "?")
        facts: dict[str, Any] = {
            "run": run, "step": step, "checkpoint": prefix, "config": config,
            "identity": identity, "identity_note": identity_note,
            "eval": msgspec.to_builtins(report) if report else None, "eval_note": eval_note,
            "data": data, "training": _training_settings(cfg, store),
            "progress": msgspec.to_builtins(progress) if progress else None,
            "target_for_serving": (identity or {}).get("path", cfg.model.target),
            "drafter_dir": dest.describe(),
        }
        with tempfile.TemporaryDirectory(prefix="dflash-export-") as tmp:
            weights = Path(tmp) / "model.safetensors"
            store.get_file(prefix + "drafter/model.safetensors", weights)
            dest.put_file("model.safetensors", weights)
        dest.put_bytes("config.json", (json.dumps(config, indent=2) + "\n").encode())
        tok_dir = _tokenizer_dir(cfg, identity)
        facts["tokenizer_files"] = sorted(n for n in TOKENIZER_FILES if tok_dir and (tok_dir / n).is_file())
        for name in facts["tokenizer_files"]:
            dest.put_file(name, tok_dir / name)  # type: ignore[operator]
        if not facts["tokenizer_files"]:
            warn(f"warning: the target's tokenizer files were not found on this machine ({cfg.model.target}); "
                 "the export has none")
        dest.put_bytes("export.json", (json.dumps(facts, indent=2, sort_keys=True, default=str) + "\n").encode())
        dest.put_bytes("README.md", model_card(facts).encode())
        dest.finish()
    except BaseException:
        dest.abort()
        raise
    return facts


async def run_card_facts(cfg: Config, bus: Bus, store: Store) -> tuple[str | None, dict[str, Any]]:
    """For `export-data`: the newest template fingerprint (None before any tokenizing) and the card's facts
    about the target and the sampling."""
    data = await training_data(cfg, bus)

    def read() -> dict[str, Any]:
        identity, note = _target_identity(cfg, store)
        resolved = _json(store, Keys.run_config(cfg.run))
        if resolved and isinstance(resolved.get("sampling"), dict):
            sampling = resolved["sampling"]
        else:
            sampling = {**msgspec.to_builtins(cfg.sampling),
                        "note": "the run did not record its resolved config: the sampling configured now"}
        return {"identity": identity, "identity_note": note, "sampling": sampling}

    return data.get("fingerprint"), await asyncio.to_thread(read)
