"""Lint: pyflakes-class errors (unused imports and variables, undefined names) and code not
in `ruff format`'s shape fail the suite. A module's size is then its formatted size, which
is what tests/test_layout.py counts."""
import shutil
import subprocess

import pytest

from tests.conftest import REPO


def _ruff() -> str:
    return shutil.which("ruff") or pytest.fail("ruff is not installed (pip install -e '.[test]')")


def test_ruff_finds_nothing():
    result = subprocess.run([_ruff(), "check", "--select", "F,E9", "--line-length", "120", "--output-format", "concise",
                             "exporter", "tests", "bench", "grafana", "deploy", "docs"], cwd=REPO, capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_exporter_is_ruff_formatted():
    # Default settings, as the line budgets are counted: run `ruff format exporter` to fix.
    result = subprocess.run([_ruff(), "format", "--check", "--isolated", "exporter"], cwd=REPO, capture_output=True,
                            text=True)
    assert result.returncode == 0, "run: ruff format exporter\n" + result.stdout + result.stderr
