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
    assert "spds.training.train" in found and "spds.model.soft_prompt" in found  # the walk sees the package
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


# The pipeline, in order: a module imports from its own folder and from folders before it (and the
# primitives). A verb at the top may import anything. Where a folder needs a later one's vocabulary
# the exception is named here, with why.
FLOORS = ["kernels", "contract", "data", "model", "generation", "training", "trained"]
PRIMITIVES = {"spds", "spds.errors", "spds.fsio", "spds.stop"}
VERBS = {"spds.cli", "spds.starter"}
LATER_ALLOWED: set = set()  # none: every folder reads only its own and the earlier ones


def floor(module: str) -> int | None:
    """The folder's place in the pipeline; None for a primitive or a verb."""
    parts = module.split(".")
    return FLOORS.index(parts[1]) if len(parts) > 1 and parts[1] in FLOORS else None


def test_the_top_of_the_package_holds_only_the_verbs_and_the_primitives():
    tops = {name for name in modules() if name.count(".") == 1 and floor(name) is None}
    assert tops == VERBS | (PRIMITIVES - {"spds"}), (
        "a module at the top of spds/ that is neither a verb nor a primitive: put it in the folder "
        f"of its concern (docs/design.md, Architecture): {sorted(tops - VERBS - PRIMITIVES)}"
    )


def test_no_folder_imports_a_later_one_in_the_pipeline():
    names = modules()
    later = []
    for name, path in names.items():
        here = floor(name)
        if here is None:
            continue
        for target, line, _ in spds_imports(path):
            imported = known(target, names)
            there = floor(imported) if imported else None
            if imported in VERBS or (there is not None and there > here):
                if (name, imported) not in LATER_ALLOWED:
                    later.append(f"{path.relative_to(REPO)}:{line} imports {imported}")
    assert not later, (
        f"a folder imports one later in the pipeline ({' < '.join(FLOORS)} < the verbs):\n  " + "\n  ".join(later)
    )


def test_each_folder_lists_its_modules_in_its_init():
    for folder in FLOORS:
        listed = (PACKAGE / folder / "__init__.py").read_text()
        for path in sorted((PACKAGE / folder).glob("*.py")):
            if path.name != "__init__.py":
                assert f" {path.stem} " in listed.replace("\n", " ").replace(",", " "), (
                    f"spds/{folder}/__init__.py does not list {path.stem}: each folder's docstring names its modules"
                )


BENCH_LINES = 3000  # bench/ is a handful of maintained tools (one per capability measured) and one table


def tracked(folder: str) -> list[str]:
    import subprocess

    listed = subprocess.run(["git", "-C", str(REPO), "ls-files", folder], capture_output=True, text=True)
    if listed.returncode != 0:  # not a git checkout (an unpacked sdist): read the folder itself
        return [str(p.relative_to(REPO)) for p in (REPO / folder).rglob("*") if p.is_file()]
    return listed.stdout.split()


def test_bench_holds_tools_and_one_table_not_raw_results():
    files = tracked("bench")
    strays = [f for f in files if not (f.endswith(".py") or f == "bench/RESULTS.md")]
    assert not strays, f"raw results or other files in bench/ (a bench tool writes them outside the checkout): {strays}"
    assert not (REPO / "bench" / "results").exists(), "bench/results/: raw output goes outside the checkout"
    lines = sum(len((REPO / f).read_text().splitlines()) for f in files)
    assert lines < BENCH_LINES, f"bench/ has {lines} lines; keep it a handful of tools under {BENCH_LINES}"


def test_every_bench_tool_says_how_to_run_it():
    """A newcomer runs a tool from its --help alone: every tool parses its arguments, help first;
    a case of bench/check.py (bench/checks/) says what it checks and takes the arguments it parses
    for it (`bench/check.py CASE --help`)."""
    tools = [f for f in tracked("bench") if f.endswith(".py") and not f.endswith("common.py")]
    for tool in tools:
        tree = ast.parse((REPO / tool).read_text())
        docstring = ast.get_docstring(tree)
        assert docstring and len(docstring.splitlines()) >= 2, f"{tool}: no docstring saying what it measures"
        if tool.startswith("bench/checks/"):
            mains = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main"]
            assert mains and len(mains[0].args.args) == 1, f"{tool}: a case of bench/check.py has main(args)"
            continue
        calls = [n for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "ArgumentParser"]
        assert calls, f"{tool}: no argparse parser, so no --help"
