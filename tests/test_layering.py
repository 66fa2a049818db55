"""Who may import whom (docs/architecture.md), read from the source with ``ast``.

- ``kernels`` imports nothing of the project; ``kvmesh`` (the library) nothing above it (``services``,
  ``bench``, ``train``).
- A service reaches another service only through that service's ``client.py`` (and the generated API,
  ``kvmesh.api``).
- No cycle between top-level packages, nor between the library's parts (``kvmesh.engine``,
  ``kvmesh.speculation``, ``kvmesh.blocks`` ...).
- A service's ``core.py`` never imports grpc; the gateway's process never imports torch.

Imports under ``if TYPE_CHECKING:`` are annotations, not dependencies: they count for no rule.
The checks run on the repository and, to show they can fail, on a tree with planted violations.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TOPS = ("kernels", "kvmesh", "services", "train", "bench")
# Each top-level package may import only those listed (besides itself).
MAY_IMPORT = {
    "kernels": set(),
    "kvmesh": {"kernels"},
    "services": {"kernels", "kvmesh"},
    "train": {"kernels", "kvmesh"},
    "bench": {"kernels", "kvmesh", "services", "train"},
}
Edges = dict[str, set[str]]


def module_name(root: Path, file: Path) -> str:
    parts = file.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(tree: ast.Module, module: str, known: set[str]) -> set[str]:
    """Every module ``module`` imports at run time, TYPE_CHECKING blocks aside: ``from a import b`` is
    ``a.b`` where that is one of the ``known`` modules, else ``a``; relative imports resolved."""
    found: set[str] = set()
    package = module.rsplit(".", 1)[0] if "." in module else module

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package.split(".")[: len(package.split(".")) - node.level + 1], base]).strip(".")
            for a in node.names:
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph(root: Path) -> Edges:
    """module -> the project's modules it imports (generated code under kvmesh/api left out)."""
    files = {module_name(root, f): f for top in TOPS for f in sorted((root / top).rglob("*.py"))}
    edges: Edges = {}
    for module, file in files.items():
        if module.startswith("kvmesh.api"):
            continue
        imported = imports_of(ast.parse(file.read_text(), str(file)), module, set(files))
        edges[module] = {m for m in imported if m.split(".")[0] in TOPS}
    return edges


def unit(module: str) -> str:
    """The part of the tree a module belongs to for the cycle rule: a top-level package, or the library's
    subpackage or top-level module (``kvmesh.engine``, ``kvmesh.blocks``)."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "kvmesh" and len(parts) > 1 else parts[0]


def layer_violations(edges: Edges) -> list[str]:
    out = []
    for module, targets in edges.items():
        top = module.split(".")[0]
        for target in sorted(targets):
            other = target.split(".")[0]
            if other != top and other not in MAY_IMPORT[top]:
                out.append(f"{module} imports {target}: {top} may import only {sorted(MAY_IMPORT[top])}")
    return out


def service_violations(edges: Edges) -> list[str]:
    """A service importing another service's modules other than its client."""
    out = []
    for module, targets in edges.items():
        if not module.startswith("services."):
            continue
        mine = module.split(".")[1]
        for target in sorted(targets):
            parts = target.split(".")
            if parts[0] == "services" and len(parts) > 1 and parts[1] != mine:
                if parts[2:3] != ["client"]:
                    out.append(f"{module} imports {target}: another service only through services.{parts[1]}.client")
    return out


def cycles(edges: Edges) -> list[list[str]]:
    """Cycles between units (``unit``), each as the path that closes it."""
    graph: dict[str, set[str]] = defaultdict(set)
    for module, targets in edges.items():
        for target in targets:
            if unit(module) != unit(target):
                graph[unit(module)].add(unit(target))
    found, state = [], {}

    def walk(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                found.append([*path[path.index(nxt) :], nxt])
            elif nxt not in state:
                walk(nxt, [*path, nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            walk(node, [node])
    return found


def test_the_tree_keeps_its_layers() -> None:
    edges = import_graph(REPO)
    assert len(edges) > 200  # the whole tree was read
    assert layer_violations(edges) == []
    assert service_violations(edges) == []
    assert cycles(edges) == []


def test_service_cores_do_not_import_grpc() -> None:
    """A service's core is its logic; the servicer (server.py) is what speaks gRPC."""
    for core in sorted(REPO.glob("services/*/core.py")):
        module = module_name(REPO, core)
        imported = imports_of(ast.parse(core.read_text()), module, set())
        assert not {m for m in imported if m.split(".")[0] == "grpc"}, f"{module} imports grpc"


def test_the_gateway_process_never_imports_torch() -> None:
    probe = "import sys, services.gateway.main; print(sorted(m for m in ('torch', 'xgrammar') if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]", result.stdout + result.stderr


def test_the_health_check_command_never_imports_torch() -> None:
    # `kvmesh health` is every container's HEALTHCHECK, run every 10 s: torch's import costs seconds of CPU.
    probe = (
        "import sys; from kvmesh.cli import build_parser; build_parser().parse_args(['health']); "
        "print('torch' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False", result.stdout + result.stderr


@pytest.fixture
def planted(tmp_path: Path) -> Path:
    """A tree with one violation of each kind."""
    files = {
        "kernels/ops.py": "import kvmesh.errors\n",
        "kvmesh/a/x.py": "from kvmesh.b import y\n",
        "kvmesh/b/y.py": "from kvmesh.a.x import thing\n",
        "kvmesh/errors.py": "",
        "kvmesh/api/gateway/v1/gateway_pb2.py": "import services.gateway.core\n",  # generated: not read
        "services/decode/core.py": "from services.speculator.eagle import Head\n",
        "services/decode/main.py": "from services.speculator import client\n",
        "services/decode/ok.py": "from services.speculator.client import SpeculatorProposer\n",
        "services/speculator/client.py": "",
        "services/speculator/eagle.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import bench.x\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


def test_each_rule_fails_on_a_planted_violation(planted: Path) -> None:
    edges = import_graph(planted)
    assert layer_violations(edges) == [
        "kernels.ops imports kvmesh.errors: kernels may import only []",
    ]
    assert service_violations(edges) == [
        "services.decode.core imports services.speculator.eagle: another service only through "
        "services.speculator.client",
    ]
    assert cycles(edges) == [["kvmesh.a", "kvmesh.b", "kvmesh.a"]]
