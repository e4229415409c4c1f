"""The store against a real SeaweedFS S3."""

import io
import os
import time

import pytest

from shared.config import StoreConfig
from shared.stack import EmbeddedStack, Ports
from shared.store import (
    ChecksumMismatch,
    ObjectConflict,
    Store,
    StoreAuthError,
    StoreError,
    StoreUnavailable,
    sha256_bytes,
)


def test_round_trip_bytes_files_list(store, cfg, tmp_path):
    prefix = f"runs/{cfg.run}/"
    info = store.put_bytes(prefix + "a.bin", b"hello")
    assert info.sha256 == sha256_bytes(b"hello") and store.get_bytes(prefix + "a.bin") == b"hello"
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(3 * 1024 * 1024))
    store.put_file(prefix + "b/big.bin", big)
    store.get_file(prefix + "b/big.bin", tmp_path / "back.bin")
    assert (tmp_path / "back.bin").read_bytes() == big.read_bytes()
    assert list(store.list(prefix)) == [prefix + "a.bin", prefix + "b/big.bin"]
    assert store.exists(prefix + "a.bin") and not store.exists(prefix + "nope")
    assert store.stat(prefix + "b/big.bin").size == 3 * 1024 * 1024


def test_put_new_is_idempotent_and_refuses_different_content(store, cfg):
    key = f"runs/{cfg.run}/shard.parquet"
    _, written = store.put_new(key, b"v1")
    _, again = store.put_new(key, b"v1")
    assert written and not again
    with pytest.raises(ObjectConflict, match="already holds different content"):
        store.put_new(key, b"v2")
    assert store.get_bytes(key) == b"v1"


def test_put_new_between_another_writers_stat_and_put_cannot_overwrite(store, cfg, monkeypatch):
    """The race stat-then-put leaves open: the other writer's object lands after our stat saw nothing.
    The put itself is conditional (If-None-Match: *), so the real S3 server refuses it."""
    real_stat = store.stat

    def race(their_bytes: bytes):
        calls = []

        def stat(k):  # our check sees nothing; then the other writer's put lands before ours
            calls.append(k)
            if len(calls) == 1:
                store.put_bytes(k, their_bytes)
                return None
            return real_stat(k)
        return stat

    key = f"runs/{cfg.run}/raced.parquet"
    monkeypatch.setattr(store, "stat", race(b"theirs"))
    with pytest.raises(ObjectConflict, match="already holds different content"):
        store.put_new(key, b"ours")
    assert store.get_bytes(key) == b"theirs"

    monkeypatch.setattr(store, "stat", race(b"same"))
    info, written = store.put_new(key + ".same", b"same")  # lost the race to identical bytes: fine
    assert not written and info.sha256 == real_stat(key + ".same").sha256

    monkeypatch.setattr(store, "stat", real_stat)
    _, written = store.put_new(f"runs/{cfg.run}/fresh.parquet", b"new")
    assert written and store.get_bytes(f"runs/{cfg.run}/fresh.parquet") == b"new"  # verified: the sha is stored


def test_checksum_mismatch_is_detected(store, cfg):
    key = f"runs/{cfg.run}/corrupt"
    data = b"the real bytes"
    # written around the Store (as a corrupting writer would): metadata says one thing, bytes another
    store.client.put_object(store.bucket, key, io.BytesIO(data), len(data), metadata={"sha256": sha256_bytes(b"other")})
    with pytest.raises(ChecksumMismatch, match="is corrupt"):
        store.get_bytes(key)


def test_bad_credentials_and_missing_bucket_are_clear(cfg):
    bad = Store(cfg.store, os.environ["AWS_ACCESS_KEY_ID"], "wrong-secret")
    with pytest.raises(StoreAuthError, match="check AWS_ACCESS_KEY_ID"):
        bad.put_bytes("x", b"1")
    import msgspec

    missing = Store(msgspec.structs.replace(cfg.store, bucket="no-such-bucket-x"),
                    os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"])
    with pytest.raises(StoreError, match="bucket 'no-such-bucket-x' does not exist"):
        missing.ping()


@pytest.mark.stack  # starts and stops its own stack
def test_s3_down_mid_run_retries_then_clear_error_then_recovers(tmp_path):
    s = EmbeddedStack(tmp_path, Ports.free())
    s.start()
    try:
        key, secret = os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"]
        store = Store(StoreConfig(endpoint=s.s3_endpoint, bucket=s.bucket, retry_deadline_s=3), key, secret)
        store.put_bytes("before", b"1")
        s.stop_component("s3")
        t0 = time.monotonic()
        with pytest.raises(StoreUnavailable, match=r"unavailable: put during failed \d+ times"):
            store.put_bytes("during", b"2")
        assert time.monotonic() - t0 >= 2.5  # it retried for the deadline, not once
        s.start_s3()
        s.wait_healthy(60)
        assert not store.exists("during")  # nothing reported as written that was not
        store.put_bytes("during", b"2")
        assert store.get_bytes("during") == b"2" and store.get_bytes("before") == b"1"
    finally:
        s.stop()
