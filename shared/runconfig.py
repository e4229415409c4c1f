"""A run's resolved config, written once when the run starts (`Keys.run_config`), so an eval, a resume or a
person reads the settings the run was made with. `dfpipe run`, the feeder and the trainer each record it at
their start: the first write wins, and a later start with other settings logs which keys differ (the run
goes on with the settings it was given; the record keeps the start's). Checkpoints name it.

The deployment sections (`bus`, `store`, `stack`, `dashboard`: addresses and ports that differ between hosts
and restarts, never credentials, which no config holds) are left out, as the feeder's manifest fingerprint
leaves them out.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import msgspec

from shared.config import Config, ConfigError, config_to_dict, fingerprint
from shared.store import ObjectConflict, Store
from shared.topology import Keys

DEPLOYMENT = ("bus", "store", "stack", "dashboard")

log = logging.getLogger("dflash.runconfig")


def run_settings(cfg: Config) -> dict[str, Any]:
    """The config as plain data, without the deployment sections."""
    return {k: v for k, v in config_to_dict(cfg).items() if k not in DEPLOYMENT}


def settings_fingerprint(cfg: Config) -> str:
    """A short hash of `run_settings(cfg)` (named by checkpoints beside the key)."""
    return fingerprint(run_settings(cfg))


def encode_run_config(cfg: Config) -> bytes:
    return json.dumps(run_settings(cfg), sort_keys=True, indent=1).encode()


def differences(recorded: Any, current: Any, path: str = "") -> list[str]:
    """The dotted keys whose values differ between two settings trees (a key only one has differs)."""
    if isinstance(recorded, dict) and isinstance(current, dict):
        return [d for k in sorted(recorded.keys() | current.keys())
                for d in differences(recorded.get(k), current.get(k), f"{path}.{k}" if path else k)]
    return [] if recorded == current else [path]


def record_run_config(store: Store, cfg: Config) -> list[str]:
    """Write the run's config unless the run has one; returns the keys where `cfg` differs from the one
    recorded ([] when this call wrote it, or they agree), and logs them."""
    try:
        store.put_new(Keys.run_config(cfg.run), encode_run_config(cfg), "application/json")
        return []
    except ObjectConflict:
        recorded = json.loads(store.get_bytes(Keys.run_config(cfg.run)))
    changed = differences(recorded, run_settings(cfg))
    if cfg.trainer.run_budget_s > 0:  # `dfpipe run` set the training's budget from the run's: not a change
        changed = [k for k in changed if k != "trainer.max_train_s"]
    if changed:
        log.warning("run %s was started with other settings (%s: %s); this process uses its own, the run's "
                    "record keeps the start's", cfg.run, Keys.run_config(cfg.run), ", ".join(changed))
    return changed


def read_run_config(store: Store, run: str) -> Config | None:
    """The settings run `run` was started with (deployment sections at their defaults), or None when it has
    no record (a run started before records were written)."""
    key = Keys.run_config(run)
    if not store.exists(key):
        return None
    try:
        return msgspec.convert(json.loads(store.get_bytes(key)), Config)
    except (ValueError, msgspec.ValidationError) as e:
        raise ConfigError(f"{key}: not a config this version reads: {e}") from None
