"""No import circles: every import of every module under ``ardiff_server/``, ``policies/`` (``ardiff_policies``),
``kv/`` (``ardiff_kv``), ``client/`` (``ardiff_client``) and ``sim/`` (``ardiff_sim``) is walked, module-level, function-level (lazy) and ``if TYPE_CHECKING:`` alike, since a
lazy or type-only import back into a module is a circle all the same (it only moves where it bites), and the test
fails naming every circle it finds.

Read from the source with ``ast``, nothing imported: a circle cannot hide behind an import that happens to work.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# folder -> import name: the server, its two libraries, the client and the simulated task
PACKAGES = {"ardiff_server": "ardiff_server", "policies": "ardiff_policies", "kv": "ardiff_kv", "client": "ardiff_client", "sim": "ardiff_sim"}

# Circles allowed (each entry a set of modules; a circle passes only if all its modules are in one entry, so a new
# circle, or a known one that grew, fails). None: every circle the layout once had is gone.
KNOWN_CYCLES: tuple[frozenset[str], ...] = ()


def modules(repo: Path = REPO) -> dict[str, tuple[Path, bool]]:
    """Import name -> (path, whether it is a package's ``__init__``) of every module of the three packages."""
    found = {}
    for folder, name in PACKAGES.items():
        for path in sorted((repo / folder).rglob("*.py")):
            parts = (name, *path.relative_to(repo / folder).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


def imports(name: str, source: str, is_package: bool, known: Iterable[str]) -> set[str]:
    """The modules of ``known`` that the module ``name`` imports anywhere in ``source``: ``import a.b`` names ``a.b``,
    ``from a import b`` names ``a.b`` when that is a module, else ``a``; relative imports resolved."""
    known = set(known)
    package = name if is_package else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):  # every node: function bodies and TYPE_CHECKING blocks included
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                # the deepest known module of the dotted name (a name may end in a module's attribute)
                found.update(next(([".".join(parts[:i])] for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in known), []))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                if f"{base}.{alias.name}" in known:
                    found.add(f"{base}.{alias.name}")
                elif base in known:
                    found.add(base)
    found.discard(name)
    return found


def import_graph(repo: Path = REPO) -> dict[str, set[str]]:
    known = modules(repo)
    return {name: imports(name, path.read_text(), is_package, known) for name, (path, is_package) in known.items()}


def cycles(graph: Mapping[str, Iterable[str]]) -> list[set[str]]:
    """The circles of ``graph``: its strongly connected components of more than one module (Tarjan's algorithm,
    iterative: the graph has hundreds of modules), in the order of their first module."""
    graph = {node: sorted(set(targets)) for node, targets in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, targets = work[-1]
            target = next((t for t in targets if t in graph), None)
            if target is not None:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(graph[target])))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(component)
    return sorted(components, key=min)


def closed_path(graph: Mapping[str, Iterable[str]], component: set[str]) -> list[str]:
    """A shortest path from the component's first module back to itself, through the component (``[a, b, a]``)."""
    graph = {node: sorted(set(targets)) for node, targets in graph.items()}
    start = min(component)
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for target in graph[node]:
                if target == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [*reversed(path), start]
                if target in component and target not in previous:
                    previous[target] = node
                    following.append(target)
        frontier = following
    raise AssertionError(f"no closed path through {sorted(component)}")  # a component of >1 always has one


def unknown_cycles(graph: Mapping[str, Iterable[str]], allowed: Iterable[frozenset[str]] = KNOWN_CYCLES) -> list[str]:
    """One line per circle not in ``allowed``: a closed path through it, and every module of it when there are more."""
    allowed = list(allowed)
    lines = []
    for component in cycles(graph):
        if any(component <= known for known in allowed):
            continue
        path = closed_path(graph, component)
        others = sorted(component - set(path))
        lines.append(" -> ".join(path) + (f" (the same circle also holds {', '.join(others)})" if others else ""))
    return lines


def test_no_import_circle_in_the_server_the_policies_or_kv():
    graph = import_graph()
    assert len(graph) > 100 and graph["ardiff_server.frontend.service"], "the walk found the modules and their imports"
    circles = unknown_cycles(graph)
    assert circles == [], "import circles (a lazy or TYPE_CHECKING import counts too):\n" + "\n".join(circles)


def test_lazy_and_type_checking_imports_count_and_relative_ones_resolve():
    known = {"pkg", "pkg.a", "pkg.b", "pkg.c", "pkg.sub", "pkg.sub.d"}
    source = (
        "from typing import TYPE_CHECKING\n"
        "import os\n"
        "from pkg import b\n"
        "if TYPE_CHECKING:\n"
        "    from pkg.c import Thing\n"
        "def later():\n"
        "    import pkg.sub.d.attribute\n"
        "    from . import a\n"
        "    from .sub import d\n"
        "    from .. import outside\n"
    )
    assert imports("pkg.a", source, False, known) == {"pkg.b", "pkg.c", "pkg.sub.d"}  # pkg.a itself: no self-edge
    assert imports("pkg.sub", "from . import d\nfrom .. import c\n", True, known) == {"pkg.sub.d", "pkg.c"}
    assert imports("pkg.sub.d", "from pkg import name_in_init\n", False, known) == {"pkg"}


def test_a_circle_is_found_and_named_and_only_known_ones_pass():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"f"}, "f": {"e"}, "g": {"a"}}
    assert cycles(graph) == [{"a", "b", "c"}, {"e", "f"}]
    assert closed_path(graph, {"a", "b", "c"}) == ["a", "b", "c", "a"]
    assert unknown_cycles(graph, allowed=[frozenset("ef")]) == ["a -> b -> c -> a"]
    assert unknown_cycles(graph, allowed=[frozenset("abc"), frozenset("ef")]) == []
    assert unknown_cycles(graph, allowed=[frozenset("abcx"), frozenset("efx")]) == []  # part of a known one removed
    graph["d"] = {"b"}  # a known circle that grew is a new one
    assert unknown_cycles(graph, allowed=[frozenset("abc"), frozenset("ef")]) == ["a -> b -> c -> a (the same circle also holds d)"]
    assert cycles({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []
