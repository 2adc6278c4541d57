"""A SysV segment whose creator /proc hides (hidepid=2, another UID) is not an orphan: `check`
would advise ipcrm for it. The exporter's user reads a hidepid procfs, as a non-root sidecar
does, in an IPC namespace of the test's own with a real root creator."""

import subprocess
import sys
import tempfile

from tests.conftest import REPO, needs_root
from tests.system.test_collectors_fixtures import SHM_CREATOR

READ_AS_EXPORTER = r"""
import sys
from exporter.collectors.sysv import SysvCollector
from exporter.host.paths import Paths
[shm] = SysvCollector(Paths(procfs=sys.argv[1])).collect()
print(shm.orphans, [s.shmid for s in shm.segments if s.orphan])
"""

SCENARIO = f"""
import os, subprocess, sys
proc, exporter = sys.argv[1], sys.argv[2:]
creator = subprocess.Popen([sys.executable, "-c", {SHM_CREATOR!r}], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True)
shmid = creator.stdout.readline().strip()
read = lambda: subprocess.run([*exporter, "-c", {READ_AS_EXPORTER!r}, proc], capture_output=True,
                              text=True, check=True).stdout.strip()
alive = read()
creator.stdin.close()
creator.wait()
print(shmid, "|", alive, "|", read())
"""


@needs_root
def test_a_creator_hidden_by_hidepid_is_alive_not_gone(nonroot_python):
    proc = tempfile.mkdtemp(prefix="shmwatch-proc-")
    subprocess.run(["chmod", "755", proc], check=True)
    subprocess.run(["mount", "-t", "proc", "-o", "hidepid=2", "proc", proc], check=True)
    try:
        done = subprocess.run(
            ["unshare", "--ipc", sys.executable, "-c", SCENARIO, proc, *nonroot_python],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        subprocess.run(["umount", "-l", proc], check=False)
        subprocess.run(["rmdir", proc], check=False)
    assert done.returncode == 0, done.stderr
    shmid, alive, gone = (part.strip() for part in done.stdout.split("|"))
    assert alive == "0 []"  # the creator lives: /proc hides it, kill(pid, 0) says EPERM
    assert (
        gone == f"1 [{shmid}]"
    )  # it exited: ESRCH proves it, and the segment is an orphan
