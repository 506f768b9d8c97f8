"""The shared pytest plugin keeps `make test-unit` process-free: tests that start processes must say so.

Runs a small suite in a pytest subprocess with the plugin loaded (its patches of subprocess and os are
process-wide, so not in this process's own session).
"""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]
pytestmark = pytest.mark.integration  # a pytest subprocess, whose tests start processes

SUITE = """
import subprocess

import pytest


@pytest.fixture(scope="session")
def started_once():
    return subprocess.run(["true"], check=True).returncode


def test_unmarked_process():
    subprocess.run(["true"], check=True)


@pytest.mark.integration
def test_marked_process():
    subprocess.run(["true"], check=True)


def test_first_user_of_a_process_fixture(started_once):
    assert started_once == 0


def test_second_user_of_a_process_fixture(started_once):
    assert started_once == 0  # cached: no process now, but it depends on one


def test_redis(redis_url):
    assert redis_url.startswith("redis://")


def test_no_process():
    assert True
"""

INI = """
[pytest]
markers =
    integration: starts processes
    e2e: several services
    slow: slow
"""


@pytest.fixture
def suite(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeini(INI)
    pytester.makepyfile(test_suite=SUITE)
    return pytester


def test_a_test_that_starts_a_process_unmarked_fails_naming_it(suite: pytest.Pytester) -> None:
    result = suite.runpytest_subprocess("-p", "miles.common.testing.pytest_plugin", "-p", "no:cacheprovider", "-rf")
    result.assert_outcomes(passed=3, failed=3)
    result.stdout.fnmatch_lines(["*starts processes but is not marked integration, e2e or slow*"])
    failed = {line.split("::")[-1].split(" ")[0] for line in result.outlines if line.startswith("FAILED")}
    assert failed == {
        "test_unmarked_process",
        "test_first_user_of_a_process_fixture",
        "test_second_user_of_a_process_fixture",
    }
    result.stdout.fnmatch_lines(["*true (fixture started_once)*"])


def test_unit_selection_runs_only_process_free_tests(suite: pytest.Pytester) -> None:
    result = suite.runpytest_subprocess(
        "-p", "miles.common.testing.pytest_plugin", "-p", "no:cacheprovider", "-m", "not integration", "-rf"
    )
    # test_redis is marked integration by its fixture, so deselected with test_marked_process.
    result.assert_outcomes(passed=1, failed=3, deselected=2)
