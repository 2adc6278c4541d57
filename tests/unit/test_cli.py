"""cli.py: what the process writes on stderr is log lines, also what the interpreter would
print itself."""

import subprocess
import sys

from tests.conftest import REPO
from tests.system.test_logs import parse_logfmt

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


SERVING = ("exporter.app", "exporter.exposition.http", "exporter.exposition.webconfig", "exporter.runtime.scheduler")
LOADED = """
import sys
from exporter.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
print(" ".join(m for m in {serving!r} if m in sys.modules))
"""


def test_version_help_and_usage_errors_load_nothing_of_serving():
    # What only serving needs (the app's wiring, the HTTP front, the web config) is imported
    # where it serves: --version, --help and a bad flag answer without it.
    for argv in (["--version"], ["--help"], ["--poll-interval=abc"], ["check", "--help"]):
        code = LOADED.format(serving=SERVING)
        result = subprocess.run([sys.executable, "-c", code, *argv], cwd=REPO, capture_output=True, text=True,
                                timeout=30)
        assert result.stdout.splitlines()[-1:] in ([], [""]), (argv, result.stdout[-300:])


def test_version_is_pyprojects():
    import tomllib

    with open(f"{REPO}/pyproject.toml", "rb") as f:
        version = tomllib.load(f)["project"]["version"]
    result = subprocess.run([sys.executable, "-m", "exporter", "--version"], cwd=REPO, capture_output=True, text=True,
                            timeout=30)
    assert (result.returncode, result.stdout) == (0, f"shmwatch {version}\n"), result.stderr
