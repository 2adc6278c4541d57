"""Real UCX (ucx_perftest from ucx-utils) and Open MPI (openmpi-bin) peers.

Each runs in a mount namespace with the test's tmpfs at /dev/shm, so its segments
land there under their real names, mapped by the real libraries.
"""
import os
import shutil
import subprocess
import time

import pytest

from exporter.collectors.segments import SegmentsCollector
from exporter.collectors.sysv import SysvCollector
from exporter.host.paths import Paths
from tests.conftest import HOST_EXCUSED_RE, REPO, free_port, in_shm_namespace, needs_root
from tests.helpers import Runs

pytestmark = needs_root


def require(tool):
    path = shutil.which(tool)
    if path is None:
        pytest.fail(f"{tool} is not installed (.ci/run installs it from Debian)")
    return path


def wait_listening(port, timeout=15.0):
    """Wait for a LISTEN socket on port, without connecting: ucx_perftest's server
    accepts exactly one connection, and a probe would take the client's place."""
    token = ":%04X " % port
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            try:
                with open(table) as f:
                    if any(token in line and line.split()[3] == "0A" for line in f.readlines()[1:]):
                        return
            except OSError:
                pass
        time.sleep(0.05)
    raise TimeoutError(f"nothing listens on {port}")


def wait_inventory(tmpfs, predicate, timeout=20.0):
    runs = Runs(SegmentsCollector(Paths(), ignore_unreadable=HOST_EXCUSED_RE), [tmpfs])
    deadline = time.monotonic() + timeout
    while True:
        inv = runs.full()
        if predicate(inv.mounts[0]) or time.monotonic() > deadline:
            return inv, inv.mounts[0]
        time.sleep(0.2)


class UcxPair:
    """ucx_perftest server + client doing tag_lat over the given transports."""

    def __init__(self, tmpfs, env):
        perftest = require("ucx_perftest")
        port = free_port()
        self.env = {**os.environ, **env}
        args = ["-t", "tag_lat", "-p", str(port), "-n", "1000000000"]
        self.server = subprocess.Popen(in_shm_namespace(tmpfs, [perftest, *args]), env=self.env,
                                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        wait_listening(port)
        self.client = subprocess.Popen(in_shm_namespace(tmpfs, [perftest, "127.0.0.1", *args]), env=self.env,
                                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.pids = {self.server.pid, self.client.pid}

    def close(self):
        for proc in (self.client, self.server):
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("proc_link,state", [("n", "linked"), ("y", "hidden")])
def test_ucx_posix_segments(tmpfs, proc_link, state):
    pair = UcxPair(tmpfs, {"UCX_TLS": "posix,self", "UCX_POSIX_USE_PROC_LINK": proc_link})
    try:
        def both_hold_their_fifos(m):
            # UCX creates and maps a segment before it writes its ~4 MiB receive FIFOs: under
            # load (CI) an inventory can fall in between and find 12 KiB allocated.
            ucx = [s for s in m.rows() if s.cls == "ucx"]
            # Both FIFOs written: what statvfs counts is then all accounted for.
            return ucx and pair.pids <= {pid for s in ucx for pid in s.holders} and \
                max(s.allocated_bytes for s in ucx) >= 1 << 20 and m.unattributed_bytes <= 16 * 4096

        inv, m = wait_inventory(tmpfs, both_hold_their_fifos)
        ucx = [s for s in m.rows() if s.cls == "ucx"]
        assert ucx, [(s.name, s.state) for s in m.rows()]
        assert all(s.name.startswith("ucx_shm_posix_") for s in ucx)
        assert {s.state for s in ucx} == {state}
        assert pair.pids <= {pid for s in ucx for pid in s.holders}
        assert {inv.comms[pid] for pid in pair.pids} == {"ucx_perftest"}
        # The big receive FIFOs are ~4 MiB each; all of it is accounted for.
        assert max(s.allocated_bytes for s in ucx) >= 1 << 20
        assert m.unattributed_bytes <= 16 * 4096
    finally:
        pair.close()


def test_ucx_sysv_segments(tmpfs):
    collector = SysvCollector(Paths())
    before = {s.shmid for s in collector.collect()[0].segments}
    pair = UcxPair(tmpfs, {"UCX_TLS": "sysv,self"})
    try:
        deadline = time.monotonic() + 20
        while True:
            mine = [s for s in collector.collect()[0].segments if s.shmid not in before and s.cpid in pair.pids]
            if {s.cpid for s in mine} == pair.pids or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert {s.cpid for s in mine} == pair.pids, mine
        assert all(s.nattch >= 1 and s.size_bytes > 0 for s in mine)
        # SysV segments never show in the tmpfs.
        assert not [s for s in wait_inventory(tmpfs, lambda m: True)[1].rows() if s.cls == "ucx"]
    finally:
        pair.close()


def test_open_mpi_vader_segments(tmpfs, tmp_path):
    mpicc, mpirun = require("mpicc"), require("mpirun")
    program = tmp_path / "mpi_hold"
    subprocess.run([mpicc, "-o", str(program), os.path.join(REPO, "tests", "peers", "mpi_hold.c")], check=True)
    release = tmp_path / "release"
    job = subprocess.Popen(in_shm_namespace(tmpfs, [
        mpirun, "--allow-run-as-root", "--oversubscribe", "-np", "2", "--mca", "btl", "self,vader",
        str(program), str(release)]), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        line = job.stdout.readline().decode().strip()
        assert line == "ready", job.stderr.read().decode()[-2000:]
        inv, m = wait_inventory(tmpfs, lambda m: len([s for s in m.rows() if s.cls == "mpi"]) >= 2)
        vader = [s for s in m.rows() if s.cls == "mpi"]
        assert len(vader) == 2 and all(s.name.startswith("vader_segment.") for s in vader)
        assert {s.state for s in vader} == {"linked"}
        ranks = {pid for s in vader for pid in s.holders}
        assert len(ranks) == 2 and {inv.comms[pid] for pid in ranks} == {"mpi_hold"}
        # vader ftruncates its 4 MiB segments: apparent size is the asked-for size,
        # allocated only what was touched.
        assert all(s.apparent_bytes >= 4 << 20 and 0 < s.allocated_bytes <= s.apparent_bytes for s in vader)
    finally:
        release.touch()
        try:
            job.wait(20)
        except subprocess.TimeoutExpired:
            job.kill()
            job.wait()
