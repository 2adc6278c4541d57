"""A SysV segment whose creator lives, hidden from /proc by hidepid=2 (root's process, read by
UID 65534 with no capabilities), when shmwatch cannot tell how its /proc hides pids: its
--path.procfs is a tree of links into that procfs, not the mount itself (no procfs mounted at
the path in its mountinfo), or has no self/mountinfo to read at all. The segment is no orphan
and `check` advises no ipcrm until the creator exits; then it is both. Real processes, in a
mount and an IPC namespace of the test's own (nothing left mounted, no host segment seen)."""

import subprocess
import sys
from typing import List

import pytest

from tests.conftest import REPO, needs_root
from tests.system.test_collectors_fixtures import SHM_CREATOR

pytestmark = needs_root
# check's SysV advice (exporter/check/kernel.py's IPCRM): prose, not a line to paste
IPCRM = "remove orphans (list them with ipcs -m, remove each with ipcrm -m ID)"

READ_AS_EXPORTER = r"""
import sys
from exporter.collectors.sysv import SysvCollector
from exporter.host.paths import Paths
[shm] = SysvCollector(Paths(procfs=sys.argv[1])).collect()
print(shm.orphans)
"""

# Runs as root in the namespaces of its own: mounts the hidepid procfs, links a tree into
# it, starts the creator, and reads as the exporter's user while it lives and once it exited.
SCENARIO = f"""
import os, subprocess, sys, tempfile
keep_self, exporter = sys.argv[1] == "self", sys.argv[2:]
hidden = tempfile.mkdtemp(prefix="shmwatch-hidepid-")
tree = tempfile.mkdtemp(prefix="shmwatch-links-")
os.chmod(hidden, 0o755)
os.chmod(tree, 0o755)
subprocess.run(["mount", "-t", "proc", "-o", "hidepid=2", "proc", hidden], check=True)
try:
    creator = subprocess.Popen([sys.executable, "-c", {SHM_CREATOR!r}], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    creator.stdout.readline()
    for name in os.listdir(hidden):  # root lists every pid; the exporter's user may not
        if keep_self or name not in ("self", "thread-self"):
            os.symlink(os.path.join(hidden, name), os.path.join(tree, name))

    def read():
        run = lambda *argv: subprocess.run([*exporter, *argv], capture_output=True, text=True,
                                           timeout=60)
        collected = run("-c", {READ_AS_EXPORTER!r}, tree)
        assert collected.returncode == 0, collected.stderr
        check = run("-m", "exporter", "check", "--no-collector.gpu", "--no-collector.cgroup",
                    "--shm.mount=/dev/shm", "--path.procfs=" + tree)
        return collected.stdout.strip() + " " + str({IPCRM!r} in check.stdout)

    alive = read()
    creator.stdin.close()
    creator.wait()
    print(alive, "|", read())
finally:
    subprocess.run(["umount", hidden], check=True)
"""


@pytest.mark.parametrize("links", ["self", "no-self"])
def test_a_live_creator_hidden_by_hidepid_is_not_gone_when_hidepid_is_unknown(
    nonroot_python: List[str], links: str
) -> None:
    """The bug: with mountinfo unread, or no procfs mounted at the path, hidepid read "off",
    so the creator missing from /proc was taken for exited: orphan, and ipcrm advised."""
    done = subprocess.run(
        [
            "unshare",
            "--mount",
            "--ipc",
            sys.executable,
            "-c",
            SCENARIO,
            links,
            *nonroot_python,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr
    alive, gone = (part.strip() for part in done.stdout.split("|"))
    assert alive == "0 False", done.stdout  # EPERM from kill(pid, 0): alive
    assert gone == "1 True", done.stdout  # ESRCH: gone, an orphan, ipcrm advised
