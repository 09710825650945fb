"""The package's shape, as a newcomer meets it: no import circle among spds's modules, and an
import of spds's own code inside a function only where a comment on that line says why (a
deferred import otherwise hides a circle, or a start-up cost, from the reader)."""

from __future__ import annotations

import ast

from conftest import REPO

PACKAGE = REPO / "spds"


def module_name(path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def spds_imports(path):
    """(imported spds module, line, at module level) for every import of spds's own code in `path`."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    top = {id(node) for node in tree.body}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [module] if node.module else [f"{module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            continue
        for target in targets:
            if target == "spds" or target.startswith("spds."):
                yield target, node.lineno, id(node) in top


def modules() -> dict:
    found = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}
    assert "spds.train" in found and "spds.model" in found  # the walk sees the package
    return found


def known(target: str, names) -> str | None:
    """The module an import names (`from . import __version__` names the package)."""
    while target and target not in names:
        target = target.rpartition(".")[0]
    return target or None


def test_no_import_circle_among_spds_modules():
    names = modules()
    graph = {
        name: {known(t, names) for t, _, _ in spds_imports(path)} - {None, name, "spds"} for name, path in names.items()
    }
    circles, state = [], {}

    def visit(node, trail):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                circles.append(" -> ".join(trail[trail.index(nxt) :] + [nxt]))
            elif nxt not in state:
                visit(nxt, trail + [nxt])
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not circles, "import circles (function-level imports included):\n  " + "\n  ".join(circles)


def test_a_deferred_import_of_spds_code_says_why():
    unexplained = []
    for name, path in modules().items():
        lines = path.read_text().splitlines()
        for target, line, at_top in spds_imports(path):
            if not at_top and "#" not in lines[line - 1]:
                unexplained.append(f"{path.relative_to(REPO)}:{line}: {lines[line - 1].strip()}")
    assert not unexplained, (
        "imports of spds code inside a function, with no comment on the line saying why "
        "(move them to the module's top, or say why they wait):\n  " + "\n  ".join(unexplained)
    )
