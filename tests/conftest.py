"""pytest's set-up for the Python suites (tests/integration/, tests/cluster/): each starts real clusters of the
build's programs and drives them as users do.

- `--bin DIR`: the build's bin folder (build/bin by default), handed to the suites as TANDEM_BIN.
- The checks: a suite's check() prints one PASS or FAIL line and goes on (one cluster answers many checks); a
  test fails when any check in it failed, and names them (a check in a fixture fails the test that set it up or
  tore it down).
- The run closes with one line, "checks: N passed, N failed": the checks, plus one failure for each test that
  failed outside a check (an exception, a fixture that could not start its cluster). tests/run.sh reads it.

Run as `.venv/bin/python -m pytest -s tests/integration/test_http.py --bin build/bin` from the repository root
(`-s` streams the check lines; `-k` selects tests, `--junitxml` writes a JUnit report)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "integration"))
UNCHECKED = pytest.StashKey[list]()  # the tests (and the phase) that failed outside their checks
CHECKS_FAILED = pytest.StashKey[set]()  # the phases of a test that failed by a check


def pytest_addoption(parser):
    parser.addoption("--bin", default="build/bin", help="the build's bin folder (default build/bin)")
    parser.addoption("--compare", action="store_true",
                     help="test_scale: the workload shift on a fixed 1P+2D cluster too, its SLO attainment beside auto's")
    parser.addoption("--seed", type=int, help="test_cache_hits: the workload's seed (its default: the one CI runs)")
    parser.addoption("--fault-table", metavar="FILE", help="test_hosts: the fault table written to FILE too")


def pytest_configure(config):
    os.environ["TANDEM_BIN"] = os.path.abspath(config.getoption("--bin"))
    if config.getoption("--seed") is not None:
        os.environ["TANDEM_SEED"] = str(config.getoption("--seed"))
    config.stash[UNCHECKED] = []


def _checked(item, when):
    """Runs one phase (a fixture's set-up, the test, the tear-downs): any check that failed in it fails the phase."""
    __tracebackhide__ = True  # the failure is the checks' lines, not this frame
    import harness
    n0 = len(harness.failed)
    res = yield
    bad = harness.failed[n0:]
    if bad:
        item.stash.setdefault(CHECKS_FAILED, set()).add(when)
        raise AssertionError("%d check%s failed: %s" % (len(bad), "" if len(bad) == 1 else "s", "; ".join(bad)))
    return res


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    __tracebackhide__ = True
    return (yield from _checked(item, "setup"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    __tracebackhide__ = True
    return (yield from _checked(item, "call"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    __tracebackhide__ = True
    return (yield from _checked(item, "teardown"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    rep = yield
    if rep.failed and rep.when not in item.stash.get(CHECKS_FAILED, set()):
        item.config.stash[UNCHECKED].append("%s (%s)" % (item.nodeid, rep.when))
    return rep


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    harness = sys.modules.get("harness")
    results = harness.results if harness else []
    unchecked = config.stash[UNCHECKED]
    for u in unchecked:
        terminalreporter.write_line("FAIL %s: failed outside its checks" % u)
    terminalreporter.write_line("checks: %d passed, %d failed" % (sum(results), len(results) - sum(results) +
                                                                 len(unchecked)))
