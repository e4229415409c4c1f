"""Where an export goes: a local folder or an `s3://bucket/prefix`, never half-written.

A local export is written into a hidden sibling folder and renamed into place at the end, so the folder a user
named either does not exist or holds the whole export. S3 has no rename: files go under the prefix and the
sha256 manifest (`SHA256SUMS`, the format `sha256sum -c` reads) is written last, so an export is complete
exactly when its manifest exists; a failed export deletes what it wrote. Either way a destination that already
holds something is refused before anything is written.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
from pathlib import Path

from shared.config import Config

MANIFEST = "SHA256SUMS"


class DestinationNotEmpty(ValueError):
    pass


class Destination:
    """Files written by relative name; `finish()` writes the manifest and makes the export visible."""

    def __init__(self) -> None:
        self.files: dict[str, str] = {}  # relative name -> sha256

    def describe(self) -> str:
        raise NotImplementedError

    def _write(self, rel: str, path: Path | None, data: bytes | None) -> None:
        raise NotImplementedError

    def put_bytes(self, rel: str, data: bytes) -> None:
        self._write(rel, None, data)
        self.files[rel] = hashlib.sha256(data).hexdigest()

    def put_file(self, rel: str, path: Path) -> None:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
        self._write(rel, path, None)
        self.files[rel] = h.hexdigest()

    def manifest(self) -> bytes:
        return "".join(f"{sha}  {rel}\n" for rel, sha in sorted(self.files.items())).encode()

    def finish(self) -> None:
        self._write(MANIFEST, None, self.manifest())
        self._commit()

    def _commit(self) -> None:
        pass

    def abort(self) -> None:
        raise NotImplementedError


class LocalDestination(Destination):
    def __init__(self, folder: Path) -> None:
        super().__init__()
        self.folder = folder.expanduser().absolute()
        if self.folder.exists() and (not self.folder.is_dir() or any(self.folder.iterdir())):
            raise DestinationNotEmpty(f"{self.folder} is not an empty folder: choose a new one (nothing was written)")
        self.folder.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = self.folder.parent / f".{self.folder.name}.partial-{os.getpid()}"
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir()

    def describe(self) -> str:
        return str(self.folder)

    def path(self, rel: str) -> Path:
        """Where `rel` is being written (for writers that stream into a file)."""
        p = self.tmp / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        return p

    def _write(self, rel: str, path: Path | None, data: bytes | None) -> None:
        dest = self.path(rel)
        if data is not None:
            dest.write_bytes(data)
        elif path is not None and path.resolve() != dest.resolve():
            shutil.copyfile(path, dest)

    def _commit(self) -> None:
        if self.folder.exists():
            self.folder.rmdir()  # empty (checked at the start); a file put there since makes this fail loudly
        os.rename(self.tmp, self.folder)

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


class S3Destination(Destination):
    def __init__(self, cfg: Config, uri: str) -> None:
        import msgspec

        from shared.store import Store, resolve_credentials

        super().__init__()
        bucket, _, prefix = uri.removeprefix("s3://").partition("/")
        if not bucket:
            raise ValueError(f"{uri}: an S3 destination is s3://BUCKET/PREFIX")
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.store = Store(msgspec.structs.replace(cfg.store, bucket=bucket), *resolve_credentials(cfg))
        self.uri = f"s3://{bucket}/{self.prefix}"
        if next(iter(self.store.list(self.prefix)), None) is not None:
            raise DestinationNotEmpty(f"{self.uri} already holds objects: choose a new prefix (nothing was written)")

    def describe(self) -> str:
        return self.uri

    def _write(self, rel: str, path: Path | None, data: bytes | None) -> None:
        if data is not None:
            self.store.put_bytes(self.prefix + rel, data)
        elif path is not None:
            self.store.put_file(self.prefix + rel, path)

    def abort(self) -> None:
        for rel in [*self.files, MANIFEST]:
            with contextlib.suppress(Exception):  # best effort: the missing manifest already marks it incomplete
                self.store.delete(self.prefix + rel)


def open_destination(cfg: Config, where: str) -> Destination:
    return S3Destination(cfg, where) if where.startswith("s3://") else LocalDestination(Path(where))
