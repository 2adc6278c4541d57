"""The package layout shows the design, and stays that way.

- Layering: a package under exporter/ imports only the packages LAYERS allows it (plus
  itself, `exporter` for __version__ and `exporter.config`); the top-level modules app,
  cli, config and __main__ may import anything. The README's "How it works" names the same
  packages in the same order.
- No import cycles between modules; no private name (`_x`) of one module used in another.
- No private attribute of another package (`obj._x` of a library) in exporter/exposition.
There is no line budget: clarity is held by types and complexity (tests/project/test_lint.py), not
by a count of lines, which density can always meet.

Imports are read from the source (ast), wherever they are: at the top, in a function, or
under `if TYPE_CHECKING:` (a type is a dependency too).
"""

from __future__ import annotations

import ast
import os
import re
from typing import Dict, Iterator, List, Optional, Set, Tuple

import pytest

from tests.conftest import REPO

PACKAGE = os.path.join(REPO, "exporter")

# Each package and what it may import besides itself, in the README's order (top first).
LAYERS: Dict[str, Set[str]] = {
    "host": set(),
    "model": {"host"},
    "inventory": {"host", "model"},
    "collectors": {"host", "model", "inventory"},
    "runtime": {"host", "model", "inventory", "collectors"},
    "exposition": {"host", "model"},
    "check": {"host", "model", "exposition"},
}
SHARED = {"exporter", "exporter.config"}  # every package may import these
TOP_LEVEL = {"exporter", "exporter.__main__", "exporter.app", "exporter.cli", "exporter.config"}



def _module_name(path: str) -> str:
    parts = os.path.relpath(path, REPO)[: -len(".py")].split(os.sep)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> Dict[str, str]:
    """exporter's module name -> path, e.g. exporter.host.paths, exporter.host (its __init__)."""
    found = {}
    for directory, subdirs, files in os.walk(PACKAGE):
        subdirs[:] = sorted(d for d in subdirs if d != "__pycache__")
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                found[_module_name(path)] = path
    return found


MODULES = _modules()
TREES = {}
for _name, _path in MODULES.items():
    with open(_path, encoding="utf-8") as _f:
        TREES[_name] = ast.parse(_f.read(), _path)


def _is_package(module: str) -> bool:
    return MODULES.get(module, "").endswith("__init__.py")


def _resolve(module: str, node: ast.ImportFrom) -> str:
    """The absolute module a `from … import` names (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    base = module.split(".") if _is_package(module) else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(module: str) -> Iterator[Tuple[str, Optional[str], int]]:
    """(imported exporter module, the name taken from it or None, line) for every import
    of one of ours in `module`; `from pkg import sub` yields the submodule pkg.sub."""
    for node in ast.walk(TREES[module]):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "exporter":
                    yield alias.name, None, node.lineno
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(module, node)
            if source.split(".")[0] != "exporter":
                continue
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                if submodule in MODULES:
                    yield submodule, None, node.lineno
                else:
                    yield source, alias.name, node.lineno


def _where(module: str) -> str:
    return os.path.relpath(MODULES[module], REPO)


def _owner(module: str) -> Optional[str]:
    """The layer a module belongs to: its package under exporter/, or None at the top level."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else None


def test_every_module_has_a_place_in_the_layering():
    homeless = [m for m in MODULES if m not in TOP_LEVEL and _owner(m) is None]
    assert not homeless, f"modules outside the packages of LAYERS (add the package to LAYERS and the README): {homeless}"


def test_packages_import_only_what_their_layer_allows():
    wrong = []
    for module in MODULES:
        layer = _owner(module)
        if layer is None:
            continue  # app, cli, config, __main__, exporter/__init__ may import anything
        allowed = LAYERS[layer] | {layer}
        for target, _name, line in imports(module):
            if target in SHARED or _owner(target) in allowed:
                continue
            wrong.append(f"{_where(module)}:{line}: {layer} imports {target}")
    assert not wrong, "imports against the layering:\n" + "\n".join(sorted(set(wrong)))


def _cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components with more than one module (Tarjan), or a self-import."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph[node]):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph[node]:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _one_cycle(graph: Dict[str, Set[str]], component: List[str]) -> List[str]:
    """A path that comes back to its start within `component`, to name in the failure."""
    start, members = component[0], set(component)
    path, seen = [start], {start}
    while True:
        step = next((m for m in sorted(graph[path[-1]]) if m in members and (m == start or m not in seen)), None)
        if step is None or step == start:
            return path + [start]
        path.append(step)
        seen.add(step)


def test_no_import_cycles_between_modules():
    # A package's __init__ that imports its own submodules while they import it (a registry
    # filled on import) is a cycle too: keep what they share in a module of its own.
    graph = {m: {target for target, _name, _line in imports(m) if target in MODULES} for m in MODULES}
    cycles = _cycles(graph)
    assert not cycles, "import cycles (modules that import each other, e.g. " + \
        "; ".join(" -> ".join(_one_cycle(graph, c)) for c in cycles) + "):\n" + \
        "\n".join(" <-> ".join(c) for c in cycles)


def _private(name: Optional[str]) -> bool:
    return bool(name) and name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _dotted(node: ast.expr) -> Optional[str]:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


def test_no_private_names_across_modules():
    wrong = []
    for module, tree in TREES.items():
        aliases: Dict[str, str] = {}  # local name -> an exporter module it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "exporter":
                        aliases[alias.asname or alias.name] = alias.name
                        aliases.setdefault("exporter", "exporter")
            elif isinstance(node, ast.ImportFrom):
                source = _resolve(module, node)
                if source.split(".")[0] != "exporter":
                    continue
                for alias in node.names:
                    if _private(alias.name):
                        wrong.append(f"{_where(module)}:{node.lineno}: from {source} import {alias.name}")
                    if f"{source}.{alias.name}" in MODULES:
                        aliases[alias.asname or alias.name] = f"{source}.{alias.name}"
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr):
                base = _dotted(node.value)
                if base is None:
                    continue
                head, _, rest = base.partition(".")
                target = aliases.get(head)
                if target and (f"{target}.{rest}" if rest else target) in MODULES:
                    wrong.append(f"{_where(module)}:{node.lineno}: {base}.{node.attr}")
    assert not wrong, "private names used across modules:\n" + "\n".join(wrong)


def test_exposition_uses_no_private_attribute_of_another_package():
    # asyncio's _ssl_protocol, _transport and _read_ready_cb were; a new Python renames them.
    from tests.helpers import private_attributes_of_other_packages

    paths = [p for m, p in MODULES.items() if m.startswith("exporter.exposition")]
    wrong = [hit for path in paths for hit in private_attributes_of_other_packages(path)]
    assert not wrong, "private attributes of other packages:\n" + "\n".join(wrong)


def _readme_section(title: str) -> str:
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        text = f.read()
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    if not match:
        pytest.fail(f'README.md has no "## {title}" section')
    return match.group(1)


def test_the_readme_names_the_packages_and_what_each_imports():
    # Lines such as: 2. `model/` (imports: host) — what it holds
    section = _readme_section("How it works")
    listed = re.findall(r"^\s*\d+\.\s+`(\w+)/`\s+\(imports:\s*([^)]*)\)", section, re.M)
    named = [package for package, _ in listed]
    existing = sorted(m.split(".")[1] for m in MODULES if m.count(".") == 1 and _is_package(m))
    assert named == list(LAYERS), f'README "How it works" lists {named}; the layering is {list(LAYERS)}'
    assert sorted(named) == existing, f"packages under exporter/: {existing}; README: {named}"
    for package, allowed in listed:
        said = set() if allowed.strip() == "nothing" else {a.strip() for a in allowed.split(",")}
        assert said == LAYERS[package], f"README: {package} imports {sorted(said)}; LAYERS: {sorted(LAYERS[package])}"


def mutated(decorators) -> bool:
    """mutmut 3 mutates a function with no decorator, or with staticmethod or classmethod alone."""
    return not decorators or len(decorators) == 1 and getattr(decorators[0], "id", "") in ("staticmethod",
                                                                                            "classmethod")


def test_mutation_testing_names_modules_and_functions_that_exist():
    # pyproject.toml's [tool.mutmut] only_mutate and [tool.shmwatch.mutation] pure follow moves.
    import tomllib

    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        tool = tomllib.load(f)["tool"]
    missing = [p for p in tool["mutmut"]["only_mutate"] if not os.path.exists(os.path.join(REPO, p))]
    for qualified in tool["shmwatch"]["mutation"]["pure"]:
        # module.function, or module.Class.method; a decorated one gets no mutants either
        # (mutmut leaves decorated functions whole: kube.pod_uid_of_mount's lru_cache), but
        # for a staticmethod or classmethod alone.
        parts = qualified.split(".")
        for split in (1, 2):
            body = getattr(TREES.get(".".join(parts[:-split])), "body", [])
            if split == 2:
                body = [b for n in body if isinstance(n, ast.ClassDef) and n.name == parts[-2] for b in n.body]
            if any(isinstance(n, ast.FunctionDef) and n.name == parts[-1] and mutated(n.decorator_list) for n in body):
                break
        else:
            missing.append(qualified)
    assert not missing, f"pyproject.toml's mutation testing names what is gone or decorated: {missing}"


# ---- tests findable by module (issue 43) ----
# Tests are found by module: a module of exporter/ of 80+ lines has its unit test file,
# tests/unit/<package>/test_<module>.py (tests/unit/test_<module>.py for the top-level ones);
# behaviour, system, project and VM tests live in their folders; no test file is over 600
# lines. The modules below have no unit test file yet: the list only shrinks (a module that
# gets one must leave it).
UNIT_TEST_NOT_YET: Set[str] = set()
TEST_FILE_MAX_LINES = 600


def _unit_test_file(module: str) -> str:
    """exporter.host.mountinfo -> tests/unit/host/test_mountinfo.py"""
    parts = module.split(".")[1:]
    return os.path.join(REPO, "tests", "unit", *parts[:-1], f"test_{parts[-1]}.py")


def _long_modules() -> List[str]:
    found = []
    for module, path in MODULES.items():
        if path.endswith("__init__.py") or module == "exporter.__main__":
            continue
        with open(path, encoding="utf-8") as f:
            if len(f.read().splitlines()) >= 80:
                found.append(module)
    return sorted(found)


def test_every_long_module_has_its_unit_test_file() -> None:
    missing = [m for m in _long_modules() if not os.path.exists(_unit_test_file(m))]
    new = sorted(set(missing) - UNIT_TEST_NOT_YET)
    assert not new, "write tests/unit/<package>/test_<module>.py for: " + ", ".join(new)
    done = sorted(UNIT_TEST_NOT_YET - set(missing))
    assert not done, f"they have a unit test file now: strike them off UNIT_TEST_NOT_YET: {done}"


def _test_files() -> Iterator[str]:
    for directory, subdirs, files in os.walk(os.path.join(REPO, "tests")):
        subdirs[:] = sorted(d for d in subdirs if d != "__pycache__")
        for name in sorted(files):
            if name.startswith("test_") and name.endswith(".py"):
                yield os.path.join(directory, name)


def test_no_test_file_is_over_the_limit() -> None:
    long = []
    for path in _test_files():
        with open(path, encoding="utf-8") as f:
            lines = len(f.read().splitlines())
        if lines > TEST_FILE_MAX_LINES:
            long.append(f"{os.path.relpath(path, REPO)}: {lines}")
    assert not long, f"over {TEST_FILE_MAX_LINES} lines, split by topic: " + ", ".join(long)


def test_no_test_file_directly_under_tests() -> None:
    top = sorted(n for n in os.listdir(os.path.join(REPO, "tests")) if n.startswith("test_") and n.endswith(".py"))
    assert not top, "a test goes in tests/unit/<package>/, tests/behaviour/ or tests/system/: " + ", ".join(top)
