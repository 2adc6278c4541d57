"""Pyflakes-class errors (unused imports and variables, undefined names) fail the suite."""
import shutil
import subprocess

import pytest

from tests.conftest import REPO


def test_ruff_finds_nothing():
    ruff = shutil.which("ruff") or pytest.fail("ruff is not installed (pip install -e '.[test]')")
    result = subprocess.run([ruff, "check", "--select", "F,E9", "--line-length", "120", "--output-format", "concise",
                             "exporter", "tests", "bench", "grafana", "deploy"], cwd=REPO, capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stdout + result.stderr
