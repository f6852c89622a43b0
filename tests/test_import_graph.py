"""The package's modules import each other without a circle (issue 37: capture's utilities made a
circle of four files in pipeline/, generation.py spanned two floors, pte_component tied the
ExecuTorch lowering and runner together).

Every import counts, at module level or inside a function (a circle hidden in a function is still a
circle: each side needs the other to work); an import under ``if TYPE_CHECKING:`` is for the type
checker only and does not."""

import ast
from pathlib import Path

import networkx as nx

import hfexport

PACKAGE = Path(hfexport.__file__).parent


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(tree: ast.Module) -> set[str]:
    """The dotted names ``tree`` imports (``from a import b`` gives ``a`` and ``a.b``), outside
    ``if TYPE_CHECKING:`` blocks."""
    typing_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for inner in ast.walk(node)
    }
    names: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def import_graph() -> nx.DiGraph:
    modules = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for name, path in modules.items():
        graph.add_edges_from((name, other) for other in _imported(ast.parse(path.read_text())) if other in modules)
    graph.remove_edges_from([(a, b) for a, b in graph.edges if a == b])
    return graph


def circles(graph: nx.DiGraph) -> list[list[str]]:
    """The import circles of ``graph``, one per group of modules that import each other, each shown
    as its shortest circle."""
    found = []
    for group in nx.strongly_connected_components(graph):
        if len(group) > 1:
            shortest = min(nx.simple_cycles(graph.subgraph(group)), key=len)
            found.append([*shortest, shortest[0]])
    return sorted(found)


def test_no_module_imports_one_that_imports_it_back():
    graph = import_graph()
    found = circles(graph)
    assert found == [], "\n".join(" -> ".join(circle) for circle in found)


def test_the_graph_sees_function_level_imports_and_skips_type_checking_ones():
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from a import typed\n"
        "def f():\n    from b.c import d\n    import e\n"
    )
    assert _imported(tree) == {"typing", "typing.TYPE_CHECKING", "b.c", "b.c.d", "e"}
