"""Training checkpoints in S3: the drafter in its public layout plus `state.pt` (optimizer, scheduler, step,
schedule, data cursor, counters, torch RNG: everything an exact resume needs), under
`Keys.checkpoint(run, step)`, and a `latest.json` pointer written last, so a reader never follows it to a
half-written checkpoint."""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from shared.store import Store
from shared.topology import Keys

from .drafters import arch_name, load_drafter
from .model import DFlashDrafter

log = logging.getLogger("dflash.trainer")


def save_checkpoint(store: Store, run: str, step: int, drafter: DFlashDrafter, state: dict[str, Any]) -> str:
    """Upload the drafter and `state` under the step's prefix, then move the pointer; returns the prefix."""
    prefix = Keys.checkpoint(run, step)
    tmp = Path(tempfile.mkdtemp(prefix="dflash-ckpt-"))
    try:
        drafter.save(tmp / "drafter")
        torch.save(state, tmp / "state.pt")
        for path in sorted(tmp.rglob("*")):
            if path.is_file():
                store.put_file(prefix + str(path.relative_to(tmp)), path)
        # the pointer names the run's recorded settings too (shared/runconfig.py), so a reader of the
        # checkpoint finds what it was trained with
        pointer = {"step": step, "key": prefix, "run_config": Keys.run_config(run)}
        store.put_bytes(Keys.checkpoint_latest(run), json.dumps(pointer).encode(), "application/json")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("checkpoint %s", prefix)
    return prefix


def load_latest_checkpoint(store: Store, run: str, drafter: DFlashDrafter, arch: str) -> tuple[str, dict[str, Any]] | None:
    """Load the latest checkpoint's weights into `drafter` and return (prefix, state), or None when the run
    has none. A checkpoint of another architecture (`arch`: the config's trainer.arch) or another drafter
    shape is refused by name before any weight is copied."""
    if not store.exists(Keys.checkpoint_latest(run)):
        return None
    prefix = json.loads(store.get_bytes(Keys.checkpoint_latest(run)))["key"]
    tmp = Path(tempfile.mkdtemp(prefix="dflash-ckpt-"))
    try:
        for key in store.list(prefix):
            dest = tmp / key[len(prefix):]
            dest.parent.mkdir(parents=True, exist_ok=True)
            store.get_file(key, dest)
        loaded = load_drafter(tmp / "drafter", f"run {run}: checkpoint {prefix}")
        if arch_name(loaded) != arch_name(drafter):
            raise ValueError(f"run {run}: the checkpoint {prefix} is a {arch_name(loaded)}, the config "
                             f"(trainer.arch = {arch}) a {arch_name(drafter)}; resume with "
                             "the checkpoint's arch, or train it under a new --run")
        changed = loaded.config.shape_differences(drafter.config)
        if changed:
            raise ValueError(f"run {run}: the checkpoint {prefix} is of another drafter than the config "
                             f"describes ({'; '.join(changed)}, checkpoint → config); resume with the "
                             "checkpoint's settings, or train it under a new --run")
        if loaded.draft_vocab is not None:
            drafter.set_draft_vocab(loaded.draft_vocab)
        # what the weights were trained with, even where today's rules would pick another (a resume across an
        # upgrade must not swap the mask token under them)
        drafter.config.mask_token_id = loaded.config.mask_token_id
        drafter.config.torch_dtype = loaded.config.torch_dtype
        drafter.load_state_dict(loaded.state_dict())
        state = torch.load(tmp / "state.pt", weights_only=False)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return prefix, state


def record_target(store: Store, run: str, target: str) -> None:
    """Write the identity of the target this run trains against (`Keys.target`), once: `dfpipe export`'s card
    names it. A later start under other weights is logged, not hidden: the record keeps the first one."""
    from shared.model import target_identity

    identity = target_identity(target)
    key = Keys.target(run)
    if store.exists(key):
        first = json.loads(store.get_bytes(key))
        if first.get("weights_sha256") != identity["weights_sha256"]:
            log.warning("run %s: target %s (weights %s) is not the one the run first trained against (%s, %s)",
                        run, target, identity["weights_sha256"][:12], first.get("target"),
                        str(first.get("weights_sha256"))[:12])
        return
    store.put_bytes(key, json.dumps(identity, indent=2, sort_keys=True).encode(), "application/json")
