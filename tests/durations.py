"""Where the suite's time goes: ``--durations-json PATH`` writes every test's setup, call and teardown
seconds and every fixture's setup seconds, as the run measured them.

pytest's own ``--durations`` charges a shared fixture's setup to whichever test happened to need it first;
this report names the fixture. Under pytest-xdist each runner times its own fixtures and sends them to
the controller with the test's report (``user_properties``), which writes the one file.
``scripts/test_durations.py`` turns the file into ``docs/test-durations.md`` (``make durations``).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

_FIXTURE = "fixture-setup:"  # user_properties key prefix: fixture-setup:<scope>:<name> -> seconds


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--durations-json", metavar="PATH", help="write each test's and fixture's seconds as JSON")


class _FixtureTimer:
    """Times each fixture's setup; the test being set up carries it to the controller."""

    @pytest.hookimpl(wrapper=True)
    def pytest_fixture_setup(self, fixturedef: pytest.FixtureDef, request: pytest.FixtureRequest):
        start = time.perf_counter()
        try:
            return (yield)
        finally:
            seconds = time.perf_counter() - start
            if seconds >= 0.01:
                item = getattr(request, "_pyfuncitem", None)
                if item is not None:
                    where = fixturedef.baseid or "(plugin)"
                    item.user_properties.append(
                        (f"{_FIXTURE}{fixturedef.scope}:{where}::{fixturedef.argname}", seconds)
                    )


class _Recorder(_FixtureTimer):
    """On the controller (or a run without xdist): collects the reports and writes the file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.started = time.monotonic()
        self.tests: dict[str, dict] = {}
        self.fixtures: list[dict] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        test = self.tests.setdefault(
            report.nodeid, {"nodeid": report.nodeid, "file": report.nodeid.split("::")[0], "outcome": "passed"}
        )
        test[report.when] = round(report.duration, 3)
        worker = getattr(getattr(report, "node", None), "gateway", None)
        if worker is not None:
            test["worker"] = worker.id
        if report.outcome != "passed" and (report.when == "call" or report.outcome == "failed"):
            test["outcome"] = report.outcome
        if report.when == "setup":
            for key, seconds in report.user_properties:
                if isinstance(key, str) and key.startswith(_FIXTURE):
                    scope, _, name = key[len(_FIXTURE) :].partition(":")
                    self.fixtures.append(
                        {"fixture": name, "scope": scope, "seconds": round(seconds, 3), "test": report.nodeid}
                    )

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        report = {
            "wall_seconds": round(time.monotonic() - self.started, 1),
            "workers": len(getattr(session.config.option, "tx", None) or ()) or 1,  # xdist's runners
            "tests": sorted(self.tests.values(), key=lambda t: t["nodeid"]),
            "fixtures": self.fixtures,
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(report, indent=1) + "\n")


def pytest_configure(config: pytest.Config) -> None:
    path = config.getoption("--durations-json")
    if not path:
        return
    if hasattr(config, "workerinput"):
        config.pluginmanager.register(_FixtureTimer(), "kvmesh-durations")
    else:
        config.pluginmanager.register(_Recorder(Path(path)), "kvmesh-durations")
