"""Starting engine services in-process for tests: flags parsed the way main.py parses them."""

from __future__ import annotations

import os
from collections.abc import Sequence
from contextlib import asynccontextmanager
from types import ModuleType

from kvmesh.runtime import common_flags, parse_flags, serve
from kvmesh.runtime.ports import free_port  # noqa: F401  (the tests import it from here)


@asynccontextmanager
async def serve_main(name: str, main: ModuleType, argv: Sequence[str]):
    """Run ``main.build`` in-process on a free port; yields the Runtime."""
    port = free_port()
    # Of the shell's variables only the suite's compile switch (tests/conftest.py) reaches the service, as it
    # reaches the processes the suite starts: no in-process decode worker compiles graphs unless a test asks.
    environ = {"KVMESH_COMPILE": os.environ.get("KVMESH_COMPILE", "")}
    args = parse_flags(name, [*common_flags(port, 0), *main.FLAGS], ["--port", str(port), *argv], environ=environ)
    async with serve(name, main.build, args, port=port, metrics_port=0, grace_seconds=1.0) as rt:
        yield rt
