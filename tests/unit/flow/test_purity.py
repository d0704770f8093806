"""The flow does no I/O: nothing in mindft/flow imports sockets, threads, clocks or frameworks."""
from __future__ import annotations

import ast
from pathlib import Path

import mindft.flow

FORBIDDEN = {"zmq", "threading", "socket", "time", "asyncio", "subprocess", "select", "mindspore", "os"}
FLOW = Path(mindft.flow.__file__).parent


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_flow_modules_import_nothing_that_does_io() -> None:
    files = sorted(FLOW.glob("*.py"))
    assert len(files) >= 5
    for path in files:
        roots = {name.split(".")[0] for name in imported_modules(path)}
        assert not roots & FORBIDDEN, f"{path.name} imports {sorted(roots & FORBIDDEN)}"


def test_flow_imports_point_downward() -> None:
    allowed = {"mindft.flow", "mindft.protocol", "mindft.config", "mindft.exitcodes"}
    for path in sorted(FLOW.glob("*.py")):
        own = {m for m in imported_modules(path) if m.startswith("mindft")}
        assert all(any(m == a or m.startswith(a + ".") for a in allowed) for m in own), (path.name, own)
