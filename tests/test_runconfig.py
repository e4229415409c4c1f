"""A run's resolved config is recorded once at its start (shared/runconfig.py) against a real SeaweedFS S3: the
first start writes it, a later start with the same settings changes nothing, one with other settings is told
which keys differ and the record keeps the start's; the deployment sections are not part of it."""

from __future__ import annotations

import json
import logging

import msgspec

from shared.runconfig import differences, read_run_config, record_run_config, run_settings
from shared.topology import Keys


def test_the_first_start_records_the_settings_and_a_later_one_is_told_what_differs(store, cfg, caplog) -> None:
    assert read_run_config(store, cfg.run) is None  # a run started before records were written
    assert record_run_config(store, cfg) == []
    recorded = json.loads(store.get_bytes(Keys.run_config(cfg.run)))
    assert recorded == run_settings(cfg) and recorded["run"] == cfg.run
    assert not {"bus", "store", "stack", "dashboard"} & recorded.keys()  # addresses, not settings
    etag = store.client.stat_object(store.bucket, Keys.run_config(cfg.run)).etag

    moved = msgspec.structs.replace(cfg, store=msgspec.structs.replace(cfg.store, endpoint="elsewhere:9000"))
    assert record_run_config(store, moved) == []  # another host, the same settings: nothing written
    assert store.client.stat_object(store.bucket, Keys.run_config(cfg.run)).etag == etag

    changed = msgspec.structs.replace(cfg, trainer=msgspec.structs.replace(cfg.trainer, lr=1e-3, epochs=2))
    with caplog.at_level(logging.WARNING, logger="dflash.runconfig"):
        assert record_run_config(store, changed) == ["trainer.epochs", "trainer.lr"]
    assert "trainer.epochs, trainer.lr" in caplog.text
    back = read_run_config(store, cfg.run)
    assert back is not None and back.trainer == cfg.trainer and back.sampling == cfg.sampling  # the start's


def test_differences_name_every_changed_key() -> None:
    assert differences({"a": {"b": 1, "c": 2}, "d": 3}, {"a": {"b": 1, "c": 5}, "e": 4}) == ["a.c", "d", "e"]
    assert differences({"a": [1, 2]}, {"a": [1, 2]}) == []
