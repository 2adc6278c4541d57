"""cli.py: what the process writes on stderr is log lines, also what the interpreter would
print itself."""

import subprocess
import sys

from tests.conftest import REPO
from tests.test_logs import parse_logfmt

LEAKY = """
from exporter.cli import log_to_stderr
log_to_stderr("logfmt", "info")
class Leaky:
    def __del__(self):
        raise ValueError("raised in __del__")
Leaky()
"""


def test_an_exception_python_cannot_raise_is_one_log_line():
    # Python prints "Exception ignored in: ..." and a traceback, several lines not logfmt.
    result = subprocess.run([sys.executable, "-c", LEAKY], cwd=REPO, capture_output=True, text=True, timeout=30)
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    record = parse_logfmt(lines[0])
    assert record["level"] == "error" and "Leaky" in record["msg"], record
    assert "ValueError: raised in __del__" in record["err"], record
