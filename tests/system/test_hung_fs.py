"""A process holding a file on a FUSE filesystem whose server has stopped answering (model
weights on gcsfuse or an s3 mount) must not block the inventory: stat() on that fd would
never return, so the owner scan must not call it."""
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from exporter.collectors.segments import SegmentsCollector
from exporter.host.paths import Paths
from tests.conftest import Peer, mounted_tmpfs, needs_root, prerequisite_missing
from tests.helpers import Runs

SERVER = r'''
import errno, stat, sys, time
from fuse import FUSE, FuseOSError, Operations

DATA = b"w" * 4096


class Weights(Operations):
    def getattr(self, path, fh=None):
        now = time.time()
        if path == "/":
            return dict(st_mode=stat.S_IFDIR | 0o755, st_nlink=2, st_ctime=now, st_mtime=now, st_atime=now)
        if path == "/weights.bin":
            return dict(st_mode=stat.S_IFREG | 0o444, st_nlink=1, st_size=len(DATA), st_ctime=now,
                        st_mtime=now, st_atime=now)
        raise FuseOSError(errno.ENOENT)

    def readdir(self, path, fh):
        return [".", "..", "weights.bin"]

    def read(self, path, size, offset, fh):
        return DATA[offset:offset + size]


# No attribute or entry caching: every stat() asks the server.
FUSE(Weights(), sys.argv[1], foreground=True, ro=True, attr_timeout=0, entry_timeout=0)
'''

HOLDER = "import os, sys; fd = os.open(sys.argv[1], os.O_RDONLY); print(fd, flush=True); sys.stdin.read()"


def wait_stopped(pid, timeout=5.0):
    """SIGSTOP lands asynchronously: until every thread is stopped, one may still answer."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = []
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
        if all(state in ("T", "t") for state in states):
            return
        time.sleep(0.01)
    raise AssertionError(f"the FUSE server {pid} did not stop")


class HungFuse:
    """SERVER serving `mnt` (made here) for the `with`; `stop()` stops it (SIGSTOP): every
    stat() and read() below then blocks. `resume()` before a file below is closed (close()
    flushes to the server); leaving resumes, unmounts and ends it."""

    def __init__(self, tmp_path, mnt):
        try:
            import fuse  # noqa: F401 - fusepy, which needs libfuse2
        except (ImportError, OSError, EnvironmentError) as err:
            prerequisite_missing(f"fusepy (pip, test extras) and libfuse2 (apt, .ci/run) are needed: {err}")
        if not os.path.exists("/dev/fuse"):
            prerequisite_missing("/dev/fuse is missing: no FUSE in this kernel or container")
        self.mnt, self.stopped = mnt, False
        mnt.mkdir()
        script = tmp_path / "fuse_server.py"
        script.write_text(SERVER)
        self.server = subprocess.Popen([sys.executable, str(script), str(mnt)], stderr=subprocess.PIPE)

    def __enter__(self):
        try:
            deadline = time.monotonic() + 10
            while not os.path.ismount(self.mnt):
                assert self.server.poll() is None, self.server.stderr.read().decode()[-2000:]
                assert time.monotonic() < deadline, "the FUSE server did not mount"
                time.sleep(0.05)
        except BaseException:
            self.__exit__()
            raise
        return self

    def stop(self):
        os.kill(self.server.pid, signal.SIGSTOP)  # the server stops answering
        self.stopped = True
        wait_stopped(self.server.pid)

    def resume(self):
        if self.stopped:
            os.kill(self.server.pid, signal.SIGCONT)
            self.stopped = False

    def __exit__(self, *exc):
        self.resume()
        subprocess.run(["umount", "-l", str(self.mnt)], check=False)
        try:
            self.server.wait(10)
        except subprocess.TimeoutExpired:
            self.server.kill()
            self.server.wait()


@needs_root
@pytest.mark.parametrize("at_memfd", [False, True], ids=["below-tmp", "at-/memfd:x"])
def test_an_fd_on_a_hung_fuse_mount_does_not_block_the_inventory(tmp_path, at_memfd):
    """Also mounted at /memfd:x, where its file's path reads as a memfd's: a memfd is told by
    its mount (none that mountinfo lists), not by its path."""
    mnt = Path(f"/memfd:shmwatch-test-{uuid.uuid4().hex[:8]}") if at_memfd else tmp_path / "weights"
    holder = probe = None
    try:
        with HungFuse(tmp_path, mnt) as fuse:
            try:
                holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(mnt / "weights.bin")],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE)
                fd = int(holder.stdout.readline())
                fuse.stop()
                # The hang is real: a stat() of the held file does not come back.
                probe = threading.Thread(target=lambda: os.stat(f"/proc/{holder.pid}/fd/{fd}"), daemon=True)
                probe.start()
                probe.join(1.0)
                assert probe.is_alive(), "stat() on the hung FUSE file returned: the test proves nothing"
                with mounted_tmpfs("16m") as shm, Peer(shm, "mapped", "nccl-beside", str(1 << 20)) as peer:
                    result = {}
                    inventory = threading.Thread(
                        target=lambda: result.update(inv=Runs(SegmentsCollector(Paths()), [shm]).full()), daemon=True)
                    started = time.monotonic()
                    inventory.start()
                    inventory.join(10.0)
                    assert not inventory.is_alive(), "the inventory blocked on the hung FUSE fd"
                    assert time.monotonic() - started < 10.0
                    [m] = result["inv"].mounts
                    assert [(s.name, s.state, s.holders) for s in m.rows()] == [
                        ("nccl-beside", "linked", (peer.pid,))]
            finally:
                fuse.resume()  # before anything closes the fd: close() flushes to it
                if probe is not None:
                    probe.join(5.0)
                if holder is not None:
                    holder.stdin.close()
                    holder.wait(10)
    finally:
        shutil.rmtree(mnt, ignore_errors=True)
