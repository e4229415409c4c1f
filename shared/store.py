"""S3-compatible object storage (MinIO, SeaweedFS, AWS S3) for every artifact of a run.

Every object written here carries its sha256 in metadata (`x-amz-meta-sha256`), and every
read verifies it: a corrupted or truncated object is an error, never silent. Transient faults
(connection refused, 5xx, SlowDown) are retried under the failure policy (shared.failures) until
`retry_deadline_s`; then `StoreUnavailable` says so. Refused credentials and a missing bucket are `StoreMisconfigured` at
once. Nothing is reported as written unless the PUT succeeded.

This module is synchronous (minio-py is); async services call it via `asyncio.to_thread`.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import stat as statmod
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import certifi
import msgspec
import urllib3
from minio import Minio
from minio.error import S3Error, ServerError

from shared.config import Config, StoreConfig, data_dir
from shared.failures import Failure, GaveUp, declare_transient, describe, retry_call

log = logging.getLogger("dflash.store")
T = TypeVar("T")

SHA_META = "sha256"
_SHA_HEADER = "x-amz-meta-sha256"
_TRANSIENT_CODES = {"InternalError", "SlowDown", "ServiceUnavailable", "RequestTimeout", "OperationAborted"}
_AUTH_CODES = {"AccessDenied", "SignatureDoesNotMatch", "InvalidAccessKeyId", "InvalidSecurity"}

# No connection, a reset, a read timeout: urllib3's errors for "S3 is not answering now" (shared.failures).
declare_transient(urllib3.exceptions.HTTPError)


class StoreError(RuntimeError):
    pass


class StoreUnavailable(StoreError):
    """S3 could not be reached (or kept failing) for the whole retry deadline. Still transient to a caller
    that can wait longer (a shard writer, a message's redelivery)."""

    failure = Failure.TRANSIENT


class S3Busy(StoreError):
    """One S3 answer that says "try again" (HTTP 5xx, SlowDown, ...): retried inside the store."""

    failure = Failure.TRANSIENT


class StoreMisconfigured(StoreError):
    """S3 refuses this store's settings (credentials, bucket): no retry helps until a person fixes them.
    A worker's handler that meets it stops the worker (`Failure.FATAL`, see shared.failures) instead of failing message
    after message into the dead letters."""

    failure = Failure.FATAL  # also what `dfpipe`'s exit code reads (shared.cli)


class StoreAuthError(StoreMisconfigured):
    pass


class KeyNotFound(StoreError, FileNotFoundError):
    failure = Failure.ERROR  # an OSError by its base, but no network error: not retried


class ChecksumMismatch(StoreError):
    pass


class _KeyExists(Exception):
    """A conditional put found the key taken."""


class ObjectConflict(StoreError):
    """A deterministic key already holds different content: refusing to overwrite."""


class ObjectInfo(msgspec.Struct, frozen=True):
    key: str
    size: int
    sha256: str


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | os.PathLike[str]) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_credentials_file(path: str | os.PathLike[str]) -> tuple[str, str]:
    """`KEY=VALUE` lines with AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY; the file must be 0600."""
    p = Path(path)
    mode = p.stat().st_mode
    if mode & (statmod.S_IRWXG | statmod.S_IRWXO):
        raise StoreAuthError(f"credentials file {p} is readable by others (mode {oct(mode & 0o777)}); chmod 600 it")
    values = dict(
        line.split("=", 1) for line in p.read_text().splitlines() if "=" in line and not line.startswith("#")
    )
    try:
        return values["AWS_ACCESS_KEY_ID"].strip(), values["AWS_SECRET_ACCESS_KEY"].strip()
    except KeyError:
        raise StoreAuthError(f"credentials file {p} lacks AWS_ACCESS_KEY_ID or AWS_SECRET_ACCESS_KEY") from None


def resolve_credentials(cfg: Config) -> tuple[str, str]:
    env_key, env_secret = os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("AWS_SECRET_ACCESS_KEY")
    if env_key and env_secret:
        return env_key, env_secret
    if cfg.store.credentials_file:
        return read_credentials_file(cfg.store.credentials_file)
    stack_file = data_dir(cfg) / "credentials"
    if stack_file.exists():
        return read_credentials_file(stack_file)
    raise StoreAuthError(
        "no S3 credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, set store.credentials_file, "
        f"or run `dfpipe stack up` (which keeps generated ones in {stack_file})"
    )


def _split_endpoint(endpoint: str, secure: bool) -> tuple[str, bool]:
    if endpoint.startswith("https://"):
        return endpoint.removeprefix("https://").rstrip("/"), True
    if endpoint.startswith("http://"):
        return endpoint.removeprefix("http://").rstrip("/"), False
    return endpoint.rstrip("/"), secure


class Store:
    """One bucket of one S3 endpoint."""

    def __init__(self, cfg: StoreConfig, access_key: str, secret_key: str) -> None:
        self.cfg = cfg
        self.bucket = cfg.bucket
        endpoint, secure = _split_endpoint(cfg.endpoint, cfg.secure)
        self.endpoint = endpoint
        # No retries inside urllib3: the deadline-bounded backoff in _call does them all.
        http = urllib3.PoolManager(
            timeout=urllib3.Timeout(connect=5, read=120),
            maxsize=16,
            cert_reqs="CERT_REQUIRED",
            ca_certs=os.environ.get("SSL_CERT_FILE") or certifi.where(),
            retries=False,
        )
        self.client = Minio(
            endpoint, access_key=access_key, secret_key=secret_key, secure=secure, region=cfg.region, http_client=http
        )

    @classmethod
    def open(cls, cfg: Config, *, ensure_bucket: bool | None = None) -> Store:
        key, secret = resolve_credentials(cfg)
        store = cls(cfg.store, key, secret)
        if cfg.store.create_bucket if ensure_bucket is None else ensure_bucket:
            store.ensure_bucket()
        return store

    # --- retry core ---------------------------------------------------------------------------

    def _call(self, what: str, fn: Callable[[], T], *, deadline_s: float | None = None) -> T:
        """`fn()` under the failure policy (shared.failures): S3's answers become this module's errors, the
        transient ones are retried until the deadline, then `StoreUnavailable`."""
        deadline = self.cfg.retry_deadline_s if deadline_s is None else deadline_s

        def attempt() -> T:
            try:
                return fn()
            except (S3Error, ServerError) as e:
                raise self._error(what, e) from None

        try:
            return retry_call(f"S3 {what}", attempt, deadline_s=deadline)
        except GaveUp as e:
            raise StoreUnavailable(
                f"S3 at {self.endpoint} unavailable: {what} failed {e.attempts} times over {deadline:.0f}s; "
                f"last error: {describe(e.last)}"
            ) from None

    def _error(self, what: str, e: S3Error | ServerError) -> Exception:
        """What an S3 answer means, as this module's error (its `failure` says whether to retry)."""
        if isinstance(e, ServerError):
            if e.status_code >= 500:
                return S3Busy(f"S3 {what}: HTTP {e.status_code}")
            return StoreError(f"S3 {what} failed: HTTP {e.status_code}")
        if e.code in _AUTH_CODES:
            return StoreAuthError(
                f"S3 at {self.endpoint} refused {what} in bucket {self.bucket!r}: {e.code} "
                "(check AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY)"
            )
        if e.code == "NoSuchBucket":
            return StoreMisconfigured(
                f"bucket {self.bucket!r} does not exist at {self.endpoint} (create it, or set store.create_bucket)"
            )
        if e.code in ("NoSuchKey", "NoSuchObject"):
            return KeyNotFound(f"s3://{self.bucket}/{e.object_name or ''} does not exist")
        if e.code in _TRANSIENT_CODES:
            return S3Busy(f"S3 {what}: {e.code}: {e.message}")
        return StoreError(f"S3 {what} failed: {e.code}: {e.message}")

    # --- bucket -------------------------------------------------------------------------------

    def ensure_bucket(self) -> None:
        if not self._call("bucket_exists", lambda: self.client.bucket_exists(self.bucket)):
            try:
                self._call("make_bucket", lambda: self.client.make_bucket(self.bucket))
            except StoreError as e:  # another process created it first
                if "BucketAlreadyOwnedByYou" not in str(e) and "BucketAlreadyExists" not in str(e):
                    raise

    def ping(self, deadline_s: float = 3.0) -> None:
        """Raise unless the endpoint answers an authenticated request within `deadline_s`."""
        if not self._call("bucket_exists", lambda: self.client.bucket_exists(self.bucket), deadline_s=deadline_s):
            raise StoreError(
                f"bucket {self.bucket!r} does not exist at {self.endpoint} (create it, or set store.create_bucket)"
            )

    # --- write --------------------------------------------------------------------------------

    def put_bytes(self, key: str, data: bytes, content_type: str = "application/octet-stream") -> ObjectInfo:
        digest = sha256_bytes(data)

        def put() -> None:
            self.client.put_object(
                self.bucket, key, io.BytesIO(data), len(data), content_type=content_type, metadata={SHA_META: digest}
            )

        self._call(f"put {key}", put)
        return ObjectInfo(key, len(data), digest)

    def put_file(self, key: str, path: str | os.PathLike[str], content_type: str = "application/octet-stream") -> ObjectInfo:
        digest = sha256_file(path)
        size = os.path.getsize(path)
        self._call(
            f"put {key}",
            lambda: self.client.fput_object(
                self.bucket, key, str(path), content_type=content_type, metadata={SHA_META: digest},
                part_size=64 * 1024 * 1024,
            ),
        )
        return ObjectInfo(key, size, digest)

    def put_new(self, key: str, data: bytes, content_type: str = "application/octet-stream") -> tuple[ObjectInfo, bool]:
        """Write a deterministic key once: same content again is a no-op, different content is refused.

        Returns (info, written). Two writers of the same key are expected to produce the same bytes
        (that is what deterministic keys mean); this check turns a violation into an error.
        """
        digest = sha256_bytes(data)
        existing = self.stat(key)
        if existing is None:
            try:
                return self._put_if_absent(key, data, digest, content_type), True
            except _KeyExists:  # another writer got there between the stat and the put
                existing = self.stat(key)
        if existing is not None and existing.sha256 == digest:
            return existing, False
        raise ObjectConflict(
            f"s3://{self.bucket}/{key} already holds different content "
            f"(sha256 {existing.sha256[:12] if existing else '?'} != {digest[:12]})"
        )

    def _put_if_absent(self, key: str, data: bytes, digest: str, content_type: str) -> ObjectInfo:
        """A put the server refuses when the key exists (`If-None-Match: *`: AWS S3, MinIO and SeaweedFS
        honour it), so of two writers racing on one key only one writes. minio < 8's public put_object
        takes no request headers, hence its `_put_object`."""
        headers = {"Content-Type": content_type, "If-None-Match": "*", _SHA_HEADER: digest}

        def put() -> None:
            try:
                self.client._put_object(self.bucket, key, data, headers)
            except S3Error as e:
                if e.code == "PreconditionFailed":
                    raise _KeyExists from None
                raise

        self._call(f"put {key}", put)
        return ObjectInfo(key, len(data), digest)

    # --- read ---------------------------------------------------------------------------------

    def stat(self, key: str) -> ObjectInfo | None:
        try:
            obj = self._call(f"stat {key}", lambda: self.client.stat_object(self.bucket, key))
        except KeyNotFound:
            return None
        meta = {k.lower(): v for k, v in (obj.metadata or {}).items()}
        return ObjectInfo(key, obj.size or 0, meta.get(_SHA_HEADER, ""))

    def exists(self, key: str) -> bool:
        return self.stat(key) is not None

    def get_bytes(self, key: str, *, verify: bool = True) -> bytes:
        def get() -> tuple[bytes, str]:
            resp = self.client.get_object(self.bucket, key)
            try:
                return resp.read(), resp.headers.get(_SHA_HEADER, "")
            finally:
                resp.close()
                resp.release_conn()

        data, expected = self._call(f"get {key}", get)
        if verify:
            if not expected:
                raise ChecksumMismatch(f"s3://{self.bucket}/{key} has no sha256 metadata: not written by dflash-pipeline, refusing")
            actual = sha256_bytes(data)
            if actual != expected:
                raise ChecksumMismatch(
                    f"s3://{self.bucket}/{key} is corrupt: sha256 {actual[:12]} != recorded {expected[:12]} ({len(data)} bytes)"
                )
        return data

    def get_file(self, key: str, path: str | os.PathLike[str], *, verify: bool = True) -> ObjectInfo:
        info = self.stat(key)
        if info is None:
            raise KeyNotFound(f"s3://{self.bucket}/{key} does not exist")
        self._call(f"get {key}", lambda: self.client.fget_object(self.bucket, key, str(path)))
        if verify:
            actual = sha256_file(path)
            if actual != info.sha256:
                os.unlink(path)
                raise ChecksumMismatch(f"s3://{self.bucket}/{key} is corrupt: sha256 {actual[:12]} != {info.sha256[:12]}")
        return info

    def list(self, prefix: str = "") -> Iterator[str]:
        """Keys under `prefix`, recursively, in lexical order."""
        objs = self._call(f"list {prefix}", lambda: list(self.client.list_objects(self.bucket, prefix, recursive=True)))
        for obj in objs:
            if not obj.is_dir:
                yield obj.object_name

    def delete(self, key: str) -> None:
        self._call(f"delete {key}", lambda: self.client.remove_object(self.bucket, key))

    def uri(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"
