"""Imports point downward: no circle among mindft's modules, and the flow reaches no shell.

The graph is read with ``ast`` (imports inside functions count too: a lazy import hides a
circle, it does not remove it). A package's ``__init__`` imported implicitly by its
submodules is not an edge; ``from mindft import flow`` is an edge to ``mindft.flow``. What a
module's ``if __name__ == "__main__":`` block imports is an edge too (``python -m
mindft.controller`` is :mod:`mindft.controller.__main__`, a module like any other).
"""
from __future__ import annotations

import ast
from pathlib import Path

import mindft

ROOT = Path(mindft.__file__).parent

# What the flow may stand on: the wire, the parsed configuration, the exit codes (each of which
# imports no other mindft module, see test_the_flow_stands_on_parsing_and_the_wire_only).
FLOW_GROUND = {"mindft.config", "mindft.exitcodes", "mindft.protocol"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module → the mindft modules it imports (anywhere in its body)."""
    modules = {_module_name(path): path for path in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges: set[str] = set()
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                edges.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    submodule = f"{node.module}.{alias.name}"
                    edges.add(submodule if submodule in modules else node.module)
        graph[name] = {edge for edge in edges if edge in modules and edge != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One circle of imports (its modules in order, the first repeated at the end), or []."""
    done: set[str] = set()
    path: list[str] = []
    on_path: set[str] = set()

    def visit(node: str) -> list[str]:
        path.append(node)
        on_path.add(node)
        for target in sorted(graph[node]):
            if target in on_path:
                return path[path.index(target):] + [target]
            if target not in done:
                cycle = visit(target)
                if cycle:
                    return cycle
        path.pop()
        on_path.discard(node)
        done.add(node)
        return []

    for start in sorted(graph):
        if start not in done:
            cycle = visit(start)
            if cycle:
                return cycle
    return []


def test_the_graph_sees_the_modules() -> None:
    graph = import_graph()
    assert {"mindft.config", "mindft.net.keys", "mindft.preflight", "mindft.flow.job", "mindft.controller.__main__"} <= set(graph)
    assert "mindft.config" in graph["mindft.preflight"] and "mindft.net.keys" in graph["mindft.preflight"]


def test_find_cycle_finds_one() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_among_mindft_modules() -> None:
    cycle = find_cycle(import_graph())
    assert not cycle, "import circle: " + " -> ".join(cycle)


def test_config_and_keys_import_one_way() -> None:
    graph = import_graph()
    assert "mindft.net.keys" not in graph["mindft.config"]
    assert graph["mindft.config"] == set(), "config parses only: it stands on no other mindft module"


def test_the_flow_stands_on_parsing_and_the_wire_only() -> None:
    graph = import_graph()
    for name, edges in graph.items():
        if name == "mindft.flow" or name.startswith("mindft.flow."):
            shells = {edge for edge in edges if not edge.startswith("mindft.flow") and edge not in FLOW_GROUND}
            assert not shells, f"{name} imports shells: {sorted(shells)}"
    for name in FLOW_GROUND:
        beyond = {edge for edge in graph[name] if not edge.startswith(f"{name}.")}  # a package's own modules
        assert beyond == set(), f"{name} imports {sorted(beyond)}: the flow would reach it"
        for part in graph[name] - beyond:
            assert graph[part] <= {f"{name}.{p}" for p in ("messages", "codec")}, f"{part} imports {graph[part]}"


# mindft's packages (and ground modules) from the ground up: a module imports its own package and
# lower layers only, so a helper lives in the lowest package that needs it.
LAYERS = (("config", "exitcodes"), ("protocol",), ("flow",), ("net",), ("preflight",), ("snapshot",),
          ("observe",), ("device",), ("replica",), ("rank",), ("controller",), ("agent",), ("mindio",),
          ("mindspore",), ("mindformers",), ("cli",), ("",))  # "": the package face, mindft/__init__
# Edges against the layers, each for a reason: the node agent starts MindIO's host (its controller and
# the step gate) on node 0 when the job runs on MindIO, imported only then: a backend the agent runs,
# not a helper to move down.
UPWARD = {("agent", "mindio")}


def _layer_of(module: str) -> tuple[str, int]:
    package = module.split(".")[1] if "." in module else ""
    return package, next(i for i, layer in enumerate(LAYERS) if package in layer)


def test_packages_import_downward() -> None:
    upward = set()
    for name, edges in import_graph().items():
        package, layer = _layer_of(name)
        for edge in edges:
            target, target_layer = _layer_of(edge)
            if target_layer > layer and (package, target) not in UPWARD:
                upward.add(f"{name} -> {edge}")
    assert not upward, "imports against the layers (move the helper down): " + ", ".join(sorted(upward))
