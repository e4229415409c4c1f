"""The two test tiers: how a test is classified, what the fast tier refuses, and that CI runs the README's commands.

Pure: an in-process pytest run (pytester) over a few tiny test files, with this suite's conftest.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch  # before pytester snapshots sys.modules: a torch it removed could not be imported again

ROOT = Path(__file__).resolve().parents[1]

TESTS = '''
import socket
import subprocess

import pytest


def test_pure():
    assert sum(range(4)) == 6


def test_requests_a_stack_fixture(cfg):
    pass


def test_requests_it_through_another_fixture(through_bus):
    pass


@pytest.fixture
def through_bus(bus):
    return bus


@pytest.mark.stack
def test_marked_by_hand():
    subprocess.run(["true"], check=True)


def test_opens_a_socket_unmarked():
    socket.create_connection(("127.0.0.1", 9), timeout=1)


def test_starts_a_process_unmarked():
    subprocess.run(["true"], check=True)


def test_resolves_the_model_unmarked():
    from shared.model import resolve_target
    resolve_target("smollm2")
'''


@pytest.fixture
def suite(pytester: pytest.Pytester) -> Iterator[pytest.Pytester]:
    pytester.makeini("[pytest]\nasyncio_default_fixture_loop_scope = session\n")
    pytester.makeconftest((ROOT / "tests" / "conftest.py").read_text())
    pytester.makepyfile(test_tiny=TESTS)
    threads = torch.get_num_threads()
    yield pytester
    torch.set_num_threads(threads)  # the inner fast-tier run set one thread for this process


def test_stack_fixtures_and_the_hand_mark_leave_the_fast_tier(suite: pytest.Pytester) -> None:
    result = suite.inline_run("-m", "stack", "--collect-only")
    names = sorted(item.name for item in result.getcalls("pytest_collection_finish")[0].session.items)
    assert names == ["test_marked_by_hand", "test_requests_a_stack_fixture", "test_requests_it_through_another_fixture"]


def test_the_fast_tier_fails_a_test_that_reaches_for_a_socket_a_process_or_the_model(suite: pytest.Pytester) -> None:
    result = suite.inline_run("-m", "not stack", "-p", "no:cacheprovider")
    passed, _, failed = result.listoutcomes()
    assert [r.head_line for r in passed] == ["test_pure"]
    assert sorted({r.head_line for r in failed}) == ["test_opens_a_socket_unmarked", "test_resolves_the_model_unmarked",
                                                     "test_starts_a_process_unmarked"]
    assert all("a fast-tier test must not" in r.longreprtext for r in failed)


def test_ci_runs_the_readmes_test_commands_in_order() -> None:
    readme = [line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("python -m pytest")]
    ci = re.findall(r"^tier (.+)$", (ROOT / ".ci" / "run").read_text(), re.M)
    assert ci == readme and len(ci) == 2
    assert ci[0].endswith('-m "not stack" tests') and ci[1].endswith("-m stack tests")
