"""Lint: what keeps the code clear rather than short (CONTRIBUTING.md, "Layout and style").

- ruff: pyflakes-class errors (unused imports and variables, undefined names) and code not in
  `ruff format`'s shape.
- Types: `mypy --strict exporter` with no project configuration (nothing can weaken --strict);
  the untyped tests and benchmarks checked for calls the code no longer accepts.
- Cognitive complexity (complexipy): at most 15 a function, but for at most five named
  exceptions of at most 25, each with the reason it cannot be split.
- No library internals: no private attribute (`obj._x`) of another package, no `SimpleNamespace`
  for a record, no taking apart a library's callable as a `functools.partial`.

Each gate holds the code that already passes it: a list below names what does not yet, and
may only shrink. A listed entry that has come to pass fails the test until it is struck off,
so each list stays the truth about the code.
"""

import ast
import glob
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from typing import Dict, Iterator, List, Set, Tuple

import pytest

from tests.conftest import REPO


def _ruff() -> str:
    return shutil.which("ruff") or pytest.fail("ruff is not installed (pip install -e '.[test]')")


def test_ruff_finds_nothing() -> None:
    result = subprocess.run([_ruff(), "check", "--select", "F,E9", "--line-length", "120", "--output-format", "concise",
                             "exporter", "tests", "bench", "grafana", "deploy", "docs"], cwd=REPO, capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_exporter_is_ruff_formatted() -> None:
    # Default settings: run `ruff format exporter` to fix.
    result = subprocess.run([_ruff(), "format", "--check", "--isolated", "exporter"], cwd=REPO, capture_output=True,
                            text=True)
    assert result.returncode == 0, "run: ruff format exporter\n" + result.stdout + result.stderr


def _modules() -> List[str]:
    return sorted(os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "exporter", "**", "*.py"),
                                                             recursive=True))


# --- types ------------------------------------------------------------------------------------

# Modules with `mypy --strict` errors today. Only shrinks: a module leaves this list when it is
# clean, and may not come back.
MYPY_NOT_YET_CLEAN: Set[str] = {
}


def mypy_errors() -> Dict[str, List[str]]:
    """Module -> its `mypy --strict` errors, with no configuration file and no cache left behind."""
    try:
        import mypy  # noqa: F401
    except ImportError:
        pytest.fail("mypy is not installed (pip install -e '.[test]')")
    result = subprocess.run([sys.executable, "-m", "mypy", "--strict", "--config-file=", "--cache-dir=/dev/null",
                             "--no-error-summary", "exporter"], cwd=REPO, capture_output=True, text=True)
    if result.returncode not in (0, 1) or result.stderr.strip():
        pytest.fail(f"mypy did not run (exit {result.returncode}):\n{result.stdout}{result.stderr}")
    errors: Dict[str, List[str]] = {}
    for line in result.stdout.splitlines():
        if match := re.match(r"(exporter/\S+?\.py):\d+: error: ", line):
            errors.setdefault(match[1], []).append(line)
    return errors


def test_mypy_strict_holds_the_clean_modules() -> None:
    errors = mypy_errors()
    new = {m: e for m, e in errors.items() if m not in MYPY_NOT_YET_CLEAN}
    assert not new, "mypy --strict errors in modules that were clean:\n" + "\n".join(
        line for lines in new.values() for line in lines)
    clean = sorted(m for m in MYPY_NOT_YET_CLEAN if m not in errors)
    assert not clean, f"now mypy --strict clean: strike them off MYPY_NOT_YET_CLEAN in tests/project/test_lint.py: {clean}"


# Errors in the untyped tests and benchmarks that mean a call into code that has changed under
# them: arguments it no longer takes, names or attributes that are gone. A branch a run seldom
# takes (a retry) would otherwise find out only on the day it runs, as a TypeError in CI. A
# deliberate bad call (under pytest.raises) says so with `# type: ignore[call-arg]`.
STALE_CALL_CODES = ("[call-arg]", "[name-defined]", "[attr-defined]")


def test_tests_and_benchmarks_call_the_code_as_it_is() -> None:
    result = subprocess.run([sys.executable, "-m", "mypy", "--check-untyped-defs", "--ignore-missing-imports",
                             "--config-file=", "--cache-dir=/dev/null", "--no-error-summary", "tests", "bench"],
                            cwd=REPO, capture_output=True, text=True)
    if result.returncode not in (0, 1) or result.stderr.strip():
        pytest.fail(f"mypy did not run (exit {result.returncode}):\n{result.stdout}{result.stderr}")
    stale = [line for line in result.stdout.splitlines() if line.endswith(STALE_CALL_CODES)]
    assert not stale, "calls into code that has changed:\n" + "\n".join(stale)


# --- cognitive complexity -----------------------------------------------------------------------

MAX_COMPLEXITY = 15
# At most five functions may reach EXCEPTION_MAX, each with why it cannot be split.
EXCEPTION_MAX, MAX_EXCEPTIONS = 25, 5
EXCEPTIONS: Dict[str, str] = {
    # "exporter/<path>.py::Class::method": "why it cannot be split",
}
# Functions over MAX_COMPLEXITY today, with their complexity: only shrinks. A listed function
# may not grow past its figure; one at MAX_COMPLEXITY or below (or renamed, or gone) is struck
# off. The figures are complexipy's (file_complexity), "path::Class::function".
NOT_YET_SIMPLE: Dict[str, int] = {
}


def complexities() -> Dict[str, int]:
    """"path::Class::function" -> its cognitive complexity, for every function in exporter/."""
    try:
        from complexipy import file_complexity
    except ImportError:
        pytest.fail("complexipy is not installed (pip install -e '.[test]')")
    found: Dict[str, int] = {}
    for module in _modules():
        for function in file_complexity(os.path.join(REPO, module)).functions:
            found[f"{module}::{function.name}"] = function.complexity
    return found


def test_the_complexity_lists_are_well_formed() -> None:
    assert len(EXCEPTIONS) <= MAX_EXCEPTIONS, f"at most {MAX_EXCEPTIONS} named exceptions"
    assert all(why.strip() for why in EXCEPTIONS.values()), "each exception says why it cannot be split"
    assert not EXCEPTIONS.keys() & NOT_YET_SIMPLE.keys()


def test_cognitive_complexity_holds_the_simple_functions() -> None:
    found = complexities()
    over = {f"{name}: {n}" for name, n in found.items()
            if n > (EXCEPTION_MAX if name in EXCEPTIONS else NOT_YET_SIMPLE.get(name, MAX_COMPLEXITY))}
    assert not over, (f"cognitive complexity over {MAX_COMPLEXITY} (complexipy; split by meaning, or over "
                      f"its figure in NOT_YET_SIMPLE):\n" + "\n".join(sorted(over)))
    done = sorted(name for name in NOT_YET_SIMPLE if found.get(name, 0) <= MAX_COMPLEXITY)
    assert not done, f"at {MAX_COMPLEXITY} or below, renamed or gone: strike them off NOT_YET_SIMPLE: {done}"
    unused = sorted(name for name in EXCEPTIONS if found.get(name, 0) <= MAX_COMPLEXITY)
    assert not unused, f"exceptions no longer needed (or renamed): strike them off EXCEPTIONS: {unused}"


# --- no library internals -----------------------------------------------------------------------

# (module, what) used today: only shrinks. `what` is a private attribute name, "SimpleNamespace",
# or "functools.partial" (a library's callable taken apart by its partial's fields).
INTERNALS_NOT_YET_GONE: Set[Tuple[str, str]] = {
}
# Where a library's bug forces the use of its internals: (module, name) -> the one function
# that wraps them and the test that pins the behaviour relied on, naming the library version.
PINNED_INTERNALS: Dict[Tuple[str, str], str] = {
    # watchdog 7.1 keeps the inotify fd of a reader stopped before its thread first read.
    ("exporter/runtime/watcher.py", "_closed"): "close_inotify; tests/unit/runtime/test_watcher_close.py",
    ("exporter/runtime/watcher.py", "_is_reading"): "close_inotify; tests/unit/runtime/test_watcher_close.py",
    ("exporter/runtime/watcher.py", "_close_resources"): "close_inotify; tests/unit/runtime/test_watcher_close.py",
}
# Names with a leading underscore that are public API (namedtuple's).
PUBLIC_UNDERSCORED = {"_replace", "_asdict", "_fields", "_make", "_field_defaults"}
PARTIAL_FIELDS = {"func", "keywords"}  # functools.partial's, read off a callable we were handed


def _private(name: str) -> bool:
    return name.startswith("_") and not name.endswith("__") and name not in PUBLIC_UNDERSCORED


def _trees() -> Dict[str, ast.Module]:
    trees = {}
    for module in _modules():
        with open(os.path.join(REPO, module), encoding="utf-8") as f:
            trees[module] = ast.parse(f.read(), module)
    return trees


def _defined_here(trees: Dict[str, ast.Module]) -> Set[str]:
    """Every private name exporter/ defines: a module's names, a class's body, `self._x = ...`
    (or cls's) and import aliases. An `obj._x` of no such name is another package's."""
    names: Set[str] = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.alias):
                names.add(node.asname or node.name.split(".")[-1])
            elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                  and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                names.add(node.attr)
    return {name for name in names if name.startswith("_")}


def _string_attribute(node: ast.Call) -> str:
    """The attribute a getattr/hasattr/setattr/delattr call names by a constant, else ''."""
    reflective = isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr", "setattr", "delattr")
    if reflective and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant):
        return str(node.args[1].value)
    return ""


def library_internals(trees: Dict[str, ast.Module]) -> Iterator[Tuple[str, str, int]]:
    """(module, what, line) of each use of another package's internals in `trees`."""
    ours = _defined_here(trees)
    for module, tree in trees.items():
        for node in ast.walk(tree):
            line = getattr(node, "lineno", 0)
            attribute = ""
            if isinstance(node, ast.Attribute):
                attribute = node.attr
            elif isinstance(node, ast.Call):
                attribute = _string_attribute(node)
            if _private(attribute) and attribute not in ours:
                yield module, attribute, line
            elif attribute in PARTIAL_FIELDS:
                yield module, "functools.partial", line
            if isinstance(node, ast.Name) and node.id == "SimpleNamespace" or \
                    isinstance(node, ast.alias) and node.name == "SimpleNamespace":
                yield module, "SimpleNamespace", line


def test_no_library_internals() -> None:
    found: Dict[Tuple[str, str], List[int]] = {}
    for module, what, line in library_internals(_trees()):
        found.setdefault((module, what), []).append(line)
    new = {k: v for k, v in found.items() if k not in INTERNALS_NOT_YET_GONE and k not in PINNED_INTERNALS}
    assert not new, "another package's internals (a private attribute, SimpleNamespace, a partial taken apart):\n" + \
        "\n".join(f"{m}:{lines[0]}: {what}" for (m, what), lines in sorted(new.items()))
    gone = sorted(k for k in INTERNALS_NOT_YET_GONE if k not in found)
    assert not gone, f"no longer used: strike them off INTERNALS_NOT_YET_GONE in tests/project/test_lint.py: {gone}"


def test_the_internals_check_finds_what_it_should() -> None:
    # A check that can fail: a library's private attribute, read directly and by getattr, a
    # SimpleNamespace and a partial taken apart; not our own private names nor _replace.
    code = ("from types import SimpleNamespace\nclass A:\n    def __init__(self):\n        self._ours = 1\n"
            "    def f(self, lib, encoder):\n        getattr(encoder, 'keywords', None)\n"
            "        return lib._theirs, getattr(lib, '_hidden'), self._ours, lib._replace()\n")
    found = Counter(what for _, what, _ in library_internals({"x.py": ast.parse(code)}))
    assert found == Counter({"_theirs": 1, "_hidden": 1, "SimpleNamespace": 1, "functools.partial": 1})
