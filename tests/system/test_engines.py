"""The engines' shared memory, made for real by tests/peers/engines.py: SGLang's segments
(leaked by a process that exits, and live), vLLM's unlinked offload file, and a memfd region
passed over a Unix socket and mapped by two processes in a real memory cgroup (v1 here)."""
import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from exporter.collectors.segments import SegmentsCollector
from exporter.host.paths import Paths
from exporter.inventory.owners import MAX_MEMFDS
from exporter.model.summary import memfd_summary
from exporter.model.types import Inventory, MemfdTotals
from tests.conftest import (EVERY_FAMILY, ENGINES, HOST_EXCUSED_RE, REPO, Exporter, Peer, mounted_tmpfs, needs_root,
                            prerequisite_missing, remove_cgroup, select, value)
from tests.helpers import Runs

MiB = 1 << 20
V1_ROOT = "/sys/fs/cgroup/memory"
CHILD_COMM = "memfd-child"  # the name tests/peers/engines.py's memfd child gives itself

pytestmark = needs_root


def inventory(tmpfs):
    return Runs(SegmentsCollector(Paths(), ignore_unreadable=HOST_EXCUSED_RE), [tmpfs]).full()


def segment(inv, name):
    found = [s for s in inv.mounts[0].rows() if s.name == name]
    assert len(found) == 1, [(s.name, s.state) for s in inv.mounts[0].rows()]
    return found[0]


def check_json(tmpfs):
    result = subprocess.run([sys.executable, "-m", "exporter", "check", "--no-collector.gpu",
                             f"--shm.mount={tmpfs}", "--output", "json"],
                            cwd=REPO, capture_output=True, text=True, timeout=60)
    return json.loads(result.stdout)["findings"]


def test_a_leaked_sglang_segment_is_an_orphan_to_remove_and_a_live_one_linked(tmpfs):
    with Peer(tmpfs, "sglang-leak", str(MiB), script=ENGINES) as leaker:
        leaker.proc.wait(10)
    leaked = leaker.info
    assert leaked.startswith(f"sgl_shm_mm_{leaker.pid}_")
    with Peer(tmpfs, "sglang", str(2 * MiB), script=ENGINES) as live:
        inv = inventory(tmpfs)
        seg = segment(inv, leaked)
        assert (seg.cls, seg.state, seg.allocated_bytes, seg.holders) == ("sglang", "orphan", MiB, ())
        seg = segment(inv, live.info)
        assert (seg.cls, seg.state, seg.holders) == ("sglang", "linked", (live.pid,))
        findings = check_json(tmpfs)
        remedies = " ".join(f["remedy"] for f in findings)
        assert f"rm -- {os.path.join(tmpfs, leaked)}" in remedies, findings
        assert live.info not in remedies


def test_vllm_offload_unlinked_once_mapped_is_hidden(tmpfs):
    with Peer(tmpfs, "vllm-offload", str(4 * MiB), script=ENGINES) as peer:
        seg = segment(inventory(tmpfs), peer.info)
        assert (seg.cls, seg.state, seg.allocated_bytes, seg.holders) == ("vllm_offload", "hidden", 4 * MiB,
                                                                          (peer.pid,))
        assert not os.path.exists(os.path.join(tmpfs, peer.info))


def memory_cgroup(limit):
    if not os.path.exists(os.path.join(V1_ROOT, "memory.usage_in_bytes")):
        prerequisite_missing("no cgroup v1 memory controller at /sys/fs/cgroup/memory")
    directory = os.path.join(V1_ROOT, f"shmwatch-test-{uuid.uuid4().hex[:8]}")
    os.mkdir(directory)
    with open(os.path.join(directory, "memory.limit_in_bytes"), "w") as f:
        f.write(str(limit))
    return directory


@pytest.mark.parametrize("below", [False, True], ids=["in-the-cgroup", "in-a-child-cgroup"])
def test_a_memfd_region_shows_both_holders_and_explains_the_cgroup_shmem(below):
    """The holders in the watched cgroup, or in a cgroup below it (a pod's container under
    the pod's cgroup): v1's total_shmem counts the child's pages, and so does the estimate."""
    directory = memory_cgroup(512 * MiB)
    cgroup = "/" + os.path.basename(directory)
    child_dir = os.path.join(directory, "container")
    if below:
        os.mkdir(child_dir)
    try:
        # An empty tmpfs and no SysV: whatever shmem the cgroup has, only memfd can explain it.
        with mounted_tmpfs("16m") as shm, Exporter(f"--shm.mount={shm}", f"--cgroup.path={cgroup}",
                                                   "--no-collector.gpu", "--no-collector.sysv",
                                                   EVERY_FAMILY) as exporter:
            name = "shmwatch_cgroup_memory_shmem_unexplained_bytes"
            before = exporter.wait_for(lambda s: value(s, name, cgroup=cgroup) is not None)
            shmem0 = value(before, "shmwatch_cgroup_memory_shmem_bytes", cgroup=cgroup)
            assert value(before, name, cgroup=cgroup) == shmem0  # nothing in the cgroup holds any
            holders_in = child_dir if below else directory
            with Peer(shm, "memfd", str(32 * MiB), holders_in, script=ENGINES) as parent:
                # Each holder by its process name (the child named itself), never by its pid.
                def seen(s):
                    held = {labels["comm"]: v for labels, v in select(s, "shmwatch_process_memfd_bytes")}
                    return held.get(parent.comm) == held.get(CHILD_COMM) == 32 * MiB

                s = exporter.wait_for(seen, timeout=30)
                by_class = {labels["class"]: v for labels, v in select(s, "shmwatch_memfd_bytes")}
                assert by_class.get("other", 0) >= 32 * MiB
                shmem = value(s, "shmwatch_cgroup_memory_shmem_bytes", cgroup=cgroup)
                unexplained = value(s, name, cgroup=cgroup)
                # Without the memfd series the estimate would be shmem minus the (empty) mount:
                # the 32 MiB region is what it drops by.
                assert shmem - shmem0 >= 32 * MiB
                assert shmem - unexplained == 32 * MiB
                print(f"\ncgroup shmem {shmem / MiB:.1f} MiB, unexplained {unexplained / MiB:.1f} MiB "
                      f"(before the region: {shmem0 / MiB:.1f} MiB)")
    finally:
        if below:
            remove_cgroup(child_dir)
        remove_cgroup(directory)


def test_check_names_the_memfd_holders(tmpfs):
    with Peer(tmpfs, "memfd", str(8 * MiB), script=ENGINES) as parent:
        child = int(parent.info)
        memfd = [f for f in check_json(tmpfs) if f["subject"] == "memfd"]
        assert len(memfd) == 1 and memfd[0]["area"] == "memory"
        assert f"[{parent.pid}] 8.0 MiB" in memfd[0]["message"]
        assert f"[{child}] 8.0 MiB" in memfd[0]["message"]


# A tenant's file at /memfd:<dir>/f on the root disk: opened, mapped, then unlinked, so its fd
# and its mapping read '/memfd:<dir>/f (deleted)' as a memfd's do.
NOT_A_MEMFD = r"""
import mmap, os, sys
path = os.path.join(sys.argv[1], "f")
with open(path, "wb") as f:
    f.write(b"\1" * (1 << 20))
fd = os.open(path, os.O_RDWR)
region = mmap.mmap(fd, 1 << 20)
os.unlink(path)
print("ready", flush=True)
sys.stdin.read()
"""


def test_a_file_at_memfd_on_a_mount_is_no_memfd_region(tmpfs):
    """A memfd is on the kernel's internal shm mount, which no mountinfo lists: a path alone
    would let a tenant's FUSE mount at /memfd:x be stat'ed (and hang the scan) and its files
    count as memfd regions (shrinking the unexplained shmem)."""
    directory = f"/memfd:shmwatch-test-{uuid.uuid4().hex[:8]}"
    os.mkdir(directory)
    try:
        proc = subprocess.Popen([sys.executable, "-c", NOT_A_MEMFD, directory], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE)
        try:
            assert proc.stdout.readline().strip() == b"ready"
            inv = inventory(tmpfs)
            assert [s.name for s in inv.memfd if proc.pid in s.holders] == []
            assert proc.pid not in inv.memfd_rest
        finally:
            proc.kill()
            proc.wait()
    finally:
        os.rmdir(directory)


# COUNT memfds of 4 KiB held open, and 8 of 1 MiB only mapped; then a fork inherits them all.
MEMFD_FLOOD = r"""
import mmap, os, resource, sys
hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
fds = []
for i in range(int(sys.argv[1])):
    fds.append(os.memfd_create(f"flood{i}"))
    os.write(fds[-1], b"\1" * 4096)
maps = []
for i in range(8):
    fd = os.memfd_create(f"big{i}")
    os.ftruncate(fd, 1 << 20)
    maps.append(mmap.mmap(fd, 1 << 20))
    maps[-1][:] = b"\1" * (1 << 20)
    os.close(fd)
child = os.fork()
if child:
    print("ready", child, flush=True)
sys.stdin.read()
"""


def test_thousands_of_memfds_are_kept_bounded_and_counted_exactly(tmpfs):
    """A process may hold any number of memfds: past the largest MAX_MEMFDS each counts by
    class only, so the inventory stays bounded while the class totals stay exact; a region
    its fork inherited counts once."""
    count = 5000
    proc = subprocess.Popen([sys.executable, "-c", MEMFD_FLOOD, str(count)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, start_new_session=True)
    try:
        line = proc.stdout.readline().split()
        assert line[0] == b"ready", line
        pids = {proc.pid, int(line[1])}
        started = time.monotonic()
        inv = inventory(tmpfs)
        took = time.monotonic() - started
        ours = [s for s in inv.memfd if pids & set(s.holders)]
        # The largest kept one by one (both processes hold the same ones), the rest by class.
        assert len(ours) <= MAX_MEMFDS
        assert {s.name for s in ours} >= {f"big{i}" for i in range(8)}
        mine = Inventory([], {}, 0, 0, memfd=ours, memfd_rest={p: r for p, r in inv.memfd_rest.items() if p in pids})
        by_class = memfd_summary(mine, 2).by_class
        assert by_class == {"other": MemfdTotals(count=count + 8, allocated_bytes=count * 4096 + 8 * MiB)}
        print(f"\n{count + 8} memfds held by two processes: {len(ours)} kept one by one, collect {took:.2f} s")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


# A process that has NCCL loaded: it maps a library named as NCCL's is.
NCCL_USER = r"""
import mmap, os, sys
path = os.path.join(sys.argv[1], "libnccl.so.2")
with open(path, "wb") as f:
    f.write(b"\0" * 4096)
with open(path, "rb") as f:
    lib = mmap.mmap(f.fileno(), 4096, prot=mmap.PROT_READ)
print("ready", flush=True)
sys.stdin.read()
"""


def test_check_says_why_nccl_files_may_be_absent(tmpfs, tmp_path):
    def nccl_notes(env):
        proc = subprocess.Popen([sys.executable, "-c", NCCL_USER, str(tmp_path)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, env={**os.environ, **env})
        try:
            assert proc.stdout.readline().strip() == b"ready"
            return [f for f in check_json(tmpfs) if f["subject"] == "nccl" and str(proc.pid) in f["message"]]
        finally:
            proc.stdin.close()
            proc.wait(10)

    notes = nccl_notes({})
    assert len(notes) == 1 and "cuMem host memory" in notes[0]["message"]
    assert "NCCL_CUMEM_HOST_ENABLE=0" in notes[0]["remedy"]
    assert nccl_notes({"NCCL_CUMEM_HOST_ENABLE": "0"}) == []
