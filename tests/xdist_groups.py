"""Which pytest-xdist runner runs which tests: every test of a group on one runner.

A group is a test module (its module fixtures are set up once), or, for a test that uses a session
fixture that starts processes (``PROCESS_FIXTURES``: a mesh, a second gateway, a trace receiver),
the folder defining that fixture, so the fixture starts once per run rather than once per runner.

xdist's own ``--dist loadgroup`` reads groups from a suffix its runners add to each test id, which
pytest 9.2 no longer lets a plugin change; so each runner writes the groups of the tests it collected
to a file the controller names (``pytest_configure_node``), and the controller's scheduler (xdist's
load-scope scheduler, whole groups at a time) reads them.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

PROCESS_FIXTURES = frozenset({"mesh", "guarded", "otlp", "client_mesh"})
_GROUPS_KEY = "kvmesh_groups_file"


def group_of(item: pytest.Item) -> str:
    info = getattr(item, "_fixtureinfo", None)
    shared = sorted(
        defs[-1].baseid or "session"
        for name, defs in (info.name2fixturedefs.items() if info else ())
        if name in PROCESS_FIXTURES and defs and defs[-1].scope == "session"
    )
    return shared[0] if shared else item.nodeid.split("::")[0]


def pytest_configure(config: pytest.Config) -> None:
    if config.pluginmanager.hasplugin("xdist") and not hasattr(config, "workerinput"):
        config.pluginmanager.register(_Controller(), "kvmesh-xdist-groups")


class _Controller:
    def __init__(self) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="kvmesh-xdist-groups-"))

    def pytest_configure_node(self, node) -> None:
        node.workerinput[_GROUPS_KEY] = str(self.folder / f"{node.gateway.id}.json")

    def pytest_xdist_make_scheduler(self, config: pytest.Config, log):
        if config.getoption("dist") != "loadgroup":
            return None
        from xdist.scheduler import LoadScopeScheduling

        folder = self.folder

        class ByGroup(LoadScopeScheduling):
            _groups: dict[str, str] | None = None

            def _split_scope(self, nodeid: str) -> str:
                if self._groups is None:
                    self._groups = {}
                    for f in folder.glob("*.json"):
                        self._groups.update(json.loads(f.read_text()))
                return self._groups.get(nodeid, nodeid.split("::")[0])

        return ByGroup(config, log)

    def pytest_unconfigure(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    path = getattr(config, "workerinput", {}).get(_GROUPS_KEY)
    if path:
        groups = {item.nodeid: group_of(item) for item in items}
        tmp = f"{path}.{os.getpid()}.tmp"
        Path(tmp).write_text(json.dumps(groups))
        os.replace(tmp, path)  # whole, before this runner reports its collection
