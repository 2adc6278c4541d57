"""The Pythons the README says shmwatch supports are tested: this machine's (3.11) runs the
whole suite, and each other one (tests/behaviour/pythons.py: 3.13, Debian trixie's) runs the
fast tier in a Debian root made with mmdebstrap, built once and kept under /var/tmp. Under
CI=true a missing mmdebstrap fails; inside the root the tier runs as CI runs the suite (a
missing prerequisite fails, a skip fails here) with DeprecationWarning an error."""

import re
import shutil
import subprocess

import pytest

from tests.behaviour.pythons import OTHERS, Python, ensure, run_fast_tier
from tests.conftest import IS_ROOT, prerequisite_missing

pytestmark = pytest.mark.timeout(
    1800
)  # a root's first build (about a minute), then the tier


def _failures(output: str) -> str:
    """The inner run's short summary (which tests failed and why), else its last lines."""
    summary = output.rsplit("short test summary info", 1)
    return summary[1] if len(summary) == 2 else output[-6000:]


@pytest.mark.parametrize("python", OTHERS, ids=lambda p: f"python{p.version}-{p.suite}")
def test_the_fast_tier_passes_under_each_other_supported_python(python: Python) -> None:
    if not shutil.which("mmdebstrap") or not shutil.which("unshare"):
        prerequisite_missing(
            "needs mmdebstrap and unshare (Debian packages; .ci/run installs them)"
        )
    if not IS_ROOT:
        prerequisite_missing(
            "needs root: mmdebstrap into a directory, chroot and mounts"
        )
    root = ensure(python)
    version = subprocess.run(
        [
            "chroot",
            root,
            "python3",
            "-c",
            "import sys; print(*sys.version_info[:2], sep='.')",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert version == python.version, f"{root}: python3 is {version}"
    done = run_fast_tier(root)
    closing = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    print(f"\nPython {python.version} ({python.suite}): {closing}")
    assert done.returncode == 0, (
        f"the fast tier under Python {python.version} failed:\n{_failures(done.stdout)}"
    )
    assert re.search(r"\b\d+ passed\b", closing) and "skipped" not in closing, (
        done.stdout[-6000:]
    )
