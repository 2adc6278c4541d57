"""Node mode: an event lists the new segment at once (its creator's until read); the next
inventory run reads the pods whose mounts moved, and what other pods' processes hold carries
over from the last full scan (never turned orphan)."""

import os
import uuid

import pytest

from exporter.collectors.segments import SegmentsCollector
from exporter.collectors.source import RunInput
from exporter.host.kube import pod_uid_of_mount
from exporter.host.paths import Paths
from exporter.host.proctable import ProcessTable
from tests.conftest import HOST_EXCUSED_RE, mounted_tmpfs, needs_root, prerequisite_missing
from tests.helpers import V1_MEMORY, WRITE_IN_PLACE, Clock, MiB, Runs, into_pod, orphan_attached_later, segment

ATTACH_LATER = """
import mmap, os, sys
sys.stdin.readline()  # attach when told: a process already running, already read
fd = os.open(sys.argv[1], os.O_RDWR)
view = mmap.mmap(fd, 4 << 20)
view[:1 << 20] = b"w" * (1 << 20)  # pages through the mapping: no inotify event
print("attached", flush=True)
sys.stdin.readline()
"""


# Run as a refresh only (the full scan every 600 s), or with a quick run before it.
QUICK_RUN_FIRST = pytest.mark.parametrize("quick_run_first", [False, True], ids=["refresh", "quick-run-then-refresh"])


@needs_root
@QUICK_RUN_FIRST
def test_a_running_process_that_attaches_to_an_orphan_and_writes_is_seen_by_the_next_refresh(two_pods,
                                                                                             quick_run_first):
    """Open and mmap raise no inotify event, but pages written move statvfs: the refresh walks
    the mount and reads its pod's processes again, so the orphan turns linked before the
    next full scan. Also when a quick run (a create) listed the mount just before the attach."""
    (a, _), (cg_a, _) = two_pods
    with orphan_attached_later(a, ATTACH_LATER, allocated=False, cgroup=cg_a) as orphan:
        if quick_run_first:
            open(os.path.join(a, "psm_other"), "wb").close()
            orphan.runs.changed(a, "psm_other")
            orphan.runs.quick()  # a create in the pod: the listing patched
        orphan.attach()
        assert orphan.refresh() == ("linked", (orphan.pid,))


@needs_root
def test_a_create_beside_an_orphan_reads_no_pod_again_pages_written_to_the_orphan_do(two_pods):
    """A create or a write to another file moves the mount's statvfs but cannot attach anyone
    to the file called leaked: no pod is read again for it. Pages written through a mapping
    to the orphan itself (no event) are: its pod is read again by the next refresh."""
    (a, _), (cg_a, _) = two_pods
    with orphan_attached_later(a, ATTACH_LATER, allocated=False, cgroup=cg_a) as orphan:
        real, asked = orphan.collector.owner_scan.refresh, []

        def refresh(devs, previous, also=frozenset()):
            asked.append(set(also))
            return real(devs, previous, also=also)

        orphan.collector.owner_scan.refresh = refresh
        with open(os.path.join(a, "psm_other"), "wb") as f:
            f.write(b"x" * MiB)
        orphan.runs.changed(a, "psm_other")
        orphan.runs.quick()
        assert orphan.refresh() == ("orphan", ())
        assert asked == [set()]  # a refresh that read no pod again
        orphan.attach()
        assert orphan.refresh() == ("linked", (orphan.pid,))
        assert asked[-1] == {pod_uid_of_mount(a)}


@needs_root
def test_pages_written_to_an_orphan_by_a_process_outside_its_pod_make_it_unverified_until_a_full_scan(two_pods):
    """Written through a mapping (no event) by a process in no pod's cgroup (a node agent, a
    hostPath debug pod): reading the mount's pod finds nobody, yet someone maps the file; it
    is never called leaked again before a full scan reads every process."""
    (a, _), _ = two_pods
    with orphan_attached_later(a, ATTACH_LATER, allocated=False) as orphan:
        orphan.attach()
        assert orphan.refresh() == ("unverified", ())
        assert orphan.refresh() == ("unverified", ())  # the pod read again proves nothing
        orphan.collector.pace.monotonic.now += 600  # the full scan
        assert segment(orphan.runs.full(), a, "psm_known") == ("linked", (orphan.pid,))


WRITE_LATER = """
import os, sys
sys.stdin.readline()
fd = os.open(sys.argv[1], os.O_RDWR)
os.pwrite(fd, b"w" * 4096, 0)  # a page already allocated: an event, no allocation moved
print("attached", flush=True)
sys.stdin.readline()
"""


@needs_root
def test_an_orphan_written_by_a_process_outside_its_pod_stays_unverified_and_its_pod_is_read_once(two_pods):
    """An event on an orphan whose writer (an fd kept open) is in no pod: reading the mount's
    pod finds nobody, which proves nothing; 'unverified' until the full scan, and the pod is
    not read again for it at every refresh meanwhile."""
    (a, _), _ = two_pods
    with orphan_attached_later(a, WRITE_LATER, allocated=True) as orphan:
        real, asked = orphan.collector.owner_scan.refresh, []

        def refresh(devs, previous, also=frozenset()):
            asked.append(set(also))
            return real(devs, previous, also=also)

        orphan.collector.owner_scan.refresh = refresh
        orphan.attach()
        orphan.runs.changed(a, "psm_known")  # what the watcher records for the write
        assert [orphan.refresh() for _ in range(3)] == [("unverified", ())] * 3
        assert asked == [{pod_uid_of_mount(a)}, set(), set()]
        orphan.collector.pace.monotonic.now += 600  # the full scan
        assert segment(orphan.runs.full(), a, "psm_known") == ("linked", (orphan.pid,))


@needs_root
def test_pages_written_to_an_orphan_in_no_pods_mount_bring_the_full_scan_forward(tmp_path):
    """A sandbox's or the host's shm: no pod to read again, so the next run reads everyone."""
    with mounted_tmpfs("16m", path=f"{tmp_path}/sandbox/shm") as mount:
        assert pod_uid_of_mount(mount) == ""
        with orphan_attached_later(mount, ATTACH_LATER, allocated=False) as orphan:
            orphan.attach()
            assert orphan.refresh() == ("linked", (orphan.pid,))


@needs_root
def test_the_segments_runner_does_not_stretch_while_a_segment_is_called_leaked(two_pods):
    """Refreshes alone see a write through a mapping to an orphan: their interval holds."""
    (a, _), _ = two_pods
    with orphan_attached_later(a, ATTACH_LATER, allocated=False) as orphan:
        watched = RunInput(mounts=(a,), all_watched=True)
        assert not orphan.collector.stretches(watched)
        orphan.attach()
        orphan.collector.pace.monotonic.now += 600  # a full scan: linked, nothing called leaked
        assert segment(orphan.runs.full(), a, "psm_known") == ("linked", (orphan.pid,))
        assert orphan.collector.stretches(watched)


HOLD_LATER = """
import mmap, os, sys
sys.stdin.readline()
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
os.ftruncate(fd, 1 << 20)
view = mmap.mmap(fd, 1 << 20)
view[:4096] = b"w" * 4096
print("held", os.fstat(fd).st_dev, os.fstat(fd).st_ino, flush=True)
sys.stdin.readline()
"""


@needs_root
def test_a_deleted_pods_device_number_handed_to_a_new_pod_proves_nothing(tmp_path):
    """The kernel hands a freed device number out again and tmpfs numbers inodes from 1 per
    instance: the new pod's first file has the deleted pod's first file's (device, inode).
    Known from the last full scan only on the same mount and device, or it is new: its
    creator's until a full scan, never 'orphan' from a refresh."""
    import subprocess
    import sys

    from tests.conftest import remove_cgroup
    if not os.path.exists(os.path.join(V1_MEMORY, "cgroup.procs")):
        prerequisite_missing(f"needs the cgroup v1 memory controller at {V1_MEMORY} to put processes in pod cgroups")
    old_uid, new_uid = str(uuid.uuid4()), str(uuid.uuid4())
    old_pod = f"{tmp_path}/var/lib/kubelet/pods/{old_uid}/volumes/kubernetes.io~empty-dir/dshm"
    new_pod = f"{tmp_path}/var/lib/kubelet/pods/{new_uid}/volumes/kubernetes.io~empty-dir/dshm"
    cgroup = os.path.join(V1_MEMORY, "kubepods", "burstable", f"pod{new_uid}")
    os.makedirs(cgroup)
    mounts = [old_pod]
    child = None
    try:
        with mounted_tmpfs("16m", path=old_pod) as old:
            with open(os.path.join(old, "psm_old"), "wb") as f:
                f.write(b"x" * 4096)
            before = os.stat(os.path.join(old, "psm_old"))
            os.makedirs(new_pod)
            child = subprocess.Popen([sys.executable, "-c", HOLD_LATER, os.path.join(new_pod, "psm_new")],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            into_pod(cgroup, child.pid)  # read by the full scan, holding nothing yet
            clock = Clock()
            collector = SegmentsCollector(Paths(), ProcessTable(Paths()), pod_of_pid=True,
                                          full_scan_interval=600.0, monotonic=clock,
                                          ignore_unreadable=HOST_EXCUSED_RE)
            runs = Runs(collector, lambda: list(mounts))
            assert segment(runs.full(), old, "psm_old") == ("orphan", ())
        with mounted_tmpfs("16m", path=new_pod) as new:
            mounts[:] = [new]
            child.stdin.write("go\n")
            child.stdin.flush()
            dev, ino = map(int, child.stdout.readline().split()[1:])
            reused = (dev, ino) == (before.st_dev, before.st_ino)
            clock.now += 15
            state, holders = segment(runs.full(), new, "psm_new")  # a refresh: nothing read the child
            assert state == "linked" and holders == ()
            print(f"device number reused: {reused}")
    finally:
        if child:
            child.kill()
            child.wait()
        remove_cgroup(cgroup)


@needs_root
def test_a_new_segment_nobody_holds_is_its_creators_until_the_full_scan_calls_it_leaked(two_pods):
    (a, _), _ = two_pods
    clock = Clock()
    collector = SegmentsCollector(Paths(), ProcessTable(Paths()), pod_of_pid=True,
                                  full_scan_interval=600.0, monotonic=clock, ignore_unreadable=HOST_EXCUSED_RE)
    runs = Runs(collector, [a])
    runs.full()
    open(os.path.join(a, "psm_made_and_closed"), "wb").close()
    runs.changed(a, "psm_made_and_closed")
    assert segment(runs.quick(), a, "psm_made_and_closed") == ("linked", ())
    clock.now += 15
    assert segment(runs.full(), a, "psm_made_and_closed") == ("linked", ())  # a refresh
    clock.now += 600
    assert segment(runs.full(), a, "psm_made_and_closed") == ("orphan", ())  # the full scan


@needs_root
@QUICK_RUN_FIRST
def test_a_write_in_place_to_an_orphan_is_never_called_leaked_again_before_its_pod_is_read(two_pods,
                                                                                           quick_run_first):
    """Its pages were all allocated: the write moves no statvfs figure, only an event says it.
    The quick run that handles the event no longer calls anything in the mount leaked, and the
    refresh reads the pod: linked to the writer."""
    (a, _), (cg_a, _) = two_pods
    with orphan_attached_later(a, WRITE_IN_PLACE, allocated=True, cgroup=cg_a) as orphan:
        orphan.attach()
        orphan.runs.changed(a, "psm_known")  # what the watcher records for the IN_MODIFY
        if quick_run_first:
            assert segment(orphan.runs.quick(), a, "psm_known") == ("unverified", ())
        assert orphan.refresh() == ("linked", (orphan.pid,))


@needs_root
def test_a_write_to_an_orphan_in_no_pods_mount_brings_the_full_scan_forward(tmp_path):
    """A sandbox's shm has no pod to read again: the change to its orphan is settled by a full
    scan, which finds the live writer."""
    shm = f"{tmp_path}/run/containerd/io.containerd.grpc.v1.cri/sandboxes/{'ab' * 32}/shm"
    with mounted_tmpfs("16m", path=shm) as m, orphan_attached_later(m, WRITE_IN_PLACE, allocated=True) as orphan:
        orphan.attach()
        orphan.runs.changed(m, "psm_known")
        assert segment(orphan.runs.quick(), m, "psm_known") == ("unverified", ())
        assert orphan.refresh() == ("linked", (orphan.pid,))


@needs_root
def test_a_staged_refresh_reads_the_pod_of_an_orphan_written_before_it_began(two_pods):
    """A write to an orphan still in the change log when a refresh starts: its pod is read."""
    (a, _), (cg_a, _) = two_pods
    with orphan_attached_later(a, WRITE_IN_PLACE, allocated=True, cgroup=cg_a) as orphan:
        orphan.attach()
        orphan.runs.changed(a, "psm_known")  # the watcher's IN_MODIFY, not yet drained
        orphan.collector.pace.monotonic.now += 15  # a refresh is due, not a full scan
        inv = orphan.runs.staged()
        assert segment(inv, a, "psm_known") == ("linked", (orphan.pid,))
