"""collectors/sysv.py: SysV shm per IPC namespace."""

import os
import subprocess
import time
from typing import Iterator, List

import pytest

from exporter.collectors.sysv import SysvCollector
from exporter.host.paths import Paths
from exporter.host.proctable import ProcessTable
from tests.conftest import needs_root


class CountingTable(ProcessTable):
    """The process table, counting how often it parses mountinfo for hidepid."""

    hidepid_reads = 0

    def hidepid(self) -> str:
        self.hidepid_reads += 1
        return super().hidepid()


@pytest.fixture
def ipc_namespaces() -> Iterator[List[str]]:
    """Three processes, each in an IPC namespace of its own: their namespaces."""
    sleepers = [subprocess.Popen(["unshare", "--ipc", "sleep", "60"]) for _ in range(3)]
    try:
        ours = os.readlink("/proc/self/ns/ipc")
        namespaces = []
        for sleeper in sleepers:
            deadline = time.monotonic() + 10
            while os.readlink(f"/proc/{sleeper.pid}/ns/ipc") == ours and time.monotonic() < deadline:
                time.sleep(0.01)  # unshare has not moved yet
            namespaces.append(os.readlink(f"/proc/{sleeper.pid}/ns/ipc"))
        assert ours not in namespaces
        yield namespaces
    finally:
        for sleeper in sleepers:
            sleeper.kill()
            sleeper.wait()


@needs_root
def test_node_mode_reads_how_proc_hides_pids_once_a_run_not_once_per_namespace(ipc_namespaces: List[str]) -> None:
    # The bug: read() asked the process table for hidepid, which parses all of mountinfo (a
    # node's runs to 2,000 lines), in every IPC namespace it joined: 200 pods, 200 parses.
    table = CountingTable(Paths())
    found = SysvCollector(Paths(), node_mode=True, table=table).collect()
    read = {shm.namespace for shm in found if shm.readable}
    assert set(ipc_namespaces) <= read
    # One for the process walk (ProcessTable.walk), one for the SysV run.
    assert table.hidepid_reads == 2, table.hidepid_reads
