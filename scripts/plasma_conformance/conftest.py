"""pytest plugin for Plasma's own test file run against vovp.plasma (see run.py).

It does three things and nothing else (the test file itself is only sed-rewritten):
- skips the tests that need what vovp deliberately does not ship, each with its reason;
- removes the ``xfail`` marker of the huge-page test, so that where it runs its result counts;
- runs the tests that fail on a known daemon limitation (DAEMON_LIMITS) as strict xfails;
- checks the outcome: every other collected test must pass, and the set of skipped tests must
  be exactly the expected one (an unexpected skip or a stale expectation fails the run).
"""

import os

import pytest

# test node name -> why vovp does not support what it tests. Keep README.md ("Moving from
# Plasma") in step with this table.
NOT_SUPPORTED = {
    "TestPlasmaClient::test_put_and_get_serialization_context":
        "needs Arrow's deprecated serialization contexts (pa.SerializationContext); "
        "vovp.plasma.put pickles with protocol 5",
    "TestPlasmaClient::test_put_and_get_raw_buffer":
        "decodes put()'s output with pa.deserialize (Arrow's deprecated serialization); "
        "vovp.plasma.put pickles with protocol 5",
    "test_plasma_deprecated":
        "checks Plasma's DeprecationWarnings; vovp.plasma is not deprecated",
}

# test node name -> the daemon limitation that makes it fail today. Run as strict xfail: the
# run fails if one of them starts passing, so this table cannot outlive the fix.
DAEMON_LIMITS: dict = {}

HUGE_PAGE_TEST = "test_use_huge_pages"
HUGE_PAGE_DIR = "/mnt/hugepages"


def _short(nodeid):
    return nodeid.split("::", 1)[1] if "::" in nodeid else nodeid


def expected_skips():
    skips = set(NOT_SUPPORTED)
    if not os.path.exists(HUGE_PAGE_DIR):
        skips.add(HUGE_PAGE_TEST)  # the test's own skipif: "requires hugepage support"
    return skips


_outcomes = {}


def pytest_configure(config):
    config.addinivalue_line("markers", "plasma: Plasma tests (all of this file)")
    config.addinivalue_line("markers", "pandas: needs pandas")


def pytest_collection_modifyitems(session, config, items):
    names = {_short(item.nodeid) for item in items}
    stale = (set(NOT_SUPPORTED) | set(DAEMON_LIMITS) | {HUGE_PAGE_TEST}) - names
    if stale:
        raise pytest.UsageError(f"expected tests not found in test_plasma.py: {sorted(stale)}")
    for item in items:
        name = _short(item.nodeid)
        if name in NOT_SUPPORTED:
            item.add_marker(pytest.mark.skip(reason="vovp: " + NOT_SUPPORTED[name]))
        if name in DAEMON_LIMITS:
            item.add_marker(pytest.mark.xfail(reason="vovp daemon: " + DAEMON_LIMITS[name],
                                              strict=True))
        if name == HUGE_PAGE_TEST:
            # xfail(reason="often fails on travis") would hide a real failure here.
            item.own_markers = [m for m in item.own_markers if m.name != "xfail"]


def pytest_runtest_logreport(report):
    name = _short(report.nodeid)
    if report.when == "call" or report.outcome != "passed":
        # A failure or skip in setup/teardown is the test's outcome; a passing setup is not.
        previous = _outcomes.get(name)
        if previous in (None, "passed"):
            _outcomes[name] = "xfailed" if hasattr(report, "wasxfail") else report.outcome


def pytest_sessionfinish(session, exitstatus):
    skipped = {n for n, o in _outcomes.items() if o == "skipped"}
    expected = expected_skips() & set(_outcomes)  # (-k/--deselect runs check what ran)
    problems = []
    if skipped != expected:
        if skipped - expected:
            problems.append(f"unexpected skips: {sorted(skipped - expected)}")
        if expected - skipped:
            problems.append(f"expected to be skipped but ran: {sorted(expected - skipped)}")
    odd = {n: o for n, o in _outcomes.items()
           if o not in ("passed", "skipped", "failed")
           and not (n in DAEMON_LIMITS and o == "xfailed")}
    if odd:
        problems.append(f"xfail/xpass outcomes are not allowed here: {odd}")
    limits = {n for n in DAEMON_LIMITS if n in _outcomes}
    passed = sum(1 for o in _outcomes.values() if o == "passed")
    print(f"\nplasma conformance: {passed} passed, {len(skipped)} skipped, "
          f"{len(limits)} failing on a known daemon limit ({len(_outcomes)} tests)")
    if problems:
        print("plasma conformance FAILED: " + "; ".join(problems))
        session.exitstatus = 1
