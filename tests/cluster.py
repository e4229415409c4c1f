"""The cluster fixtures, beside conftest's single-node ones: a 3-node NATS JetStream cluster (localhost routes,
own ports and store dirs) and a multi-process SeaweedFS (master, three volume servers with replication 001,
filer, S3 gateway), from shared.cluster. The services are the same; only configuration differs
(`DFLASH_BUS__REPLICAS=3`, the three URLs). A test module that uses them imports the fixtures from here and
marks itself `stack` (it starts servers)."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from typing import Any

import pytest

from shared.cluster import ClusterStack
from shared.config import Config
from tests.conftest import make_config


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterStack]:
    """One cluster per test module: its faults must not reach the session's single-node stack."""
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "test" + secrets.token_hex(4))
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", secrets.token_urlsafe(24))
    c = ClusterStack(tmp_path_factory.mktemp("cluster"))
    c.start()
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture
def cluster_env(cluster: ClusterStack) -> dict[str, str]:
    """Environment for a service or `dfpipe` subprocess on the cluster (R3 streams)."""
    return {**os.environ, **cluster.env(), "DFLASH_DATA_DIR": str(cluster.root)}


def cluster_config(cluster: ClusterStack, run: str | None = None, **sections: dict[str, Any]) -> Config:
    """A config for the cluster: all three NATS members, R3 streams, the S3 gateway."""
    bus = {"replicas": 3, "reconnect_wait_s": 0.5, **sections.pop("bus", {})}
    return make_config(cluster, run, bus=bus, **sections)  # type: ignore[arg-type]  (the same attributes)
